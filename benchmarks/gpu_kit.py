#!/usr/bin/env python3
"""``make gpu-kit``: the wheels benchmarks/gpu_check.py needs on a bare GPU machine without a package index.

Such a machine has python3 with torch, torchvision, numpy, pyyaml, tqdm, packaging and filelock; the engine imports
hydra-core, omegaconf and the antlr4 runtime beyond them (:data:`benchmarks.gpu_check.KIT_MODULES`). This script puts
one pure-Python wheel of each, at the version installed here (so the GPU runs what the tests run), in ``--out``
(default ``gpu-kit/``, git-ignored), for Python 3.12 (``pip download --only-binary=:all: --python-version 3.12``);
a distribution published only as a source archive (antlr4-python3-runtime 4.9.3) is built into its pure-Python wheel
with ``pip wheel --no-deps``. Wheels of other versions or names already in the folder are removed first. MLflow stays
out (the check runs with tracking off).

Errors (exit 2, one line): a distribution not installed here, a download or build that fails, a wheel that is not
pure Python, or a folder over :data:`LIMIT_MIB`. Needs a package index (PyPI or a mirror), as ``make setup`` does.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = ("hydra-core", "omegaconf", "antlr4-python3-runtime")  # fl_core's run-time needs beyond the image
PYTHON = "3.12"  # the GPU image's python3
LIMIT_MIB = 40.0


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def _pip(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=False,
                          capture_output=True, text=True)


def fetch(dist: str, version: str, out: Path) -> Path:
    """One pure-Python wheel of ``dist==version`` in ``out``: downloaded as a wheel for Python :data:`PYTHON`, else
    built from its source archive. Raises SystemExit(2) with pip's last line when neither works."""
    spec = f"{dist}=={version}"
    with tempfile.TemporaryDirectory(prefix="gpu_kit_") as tmp:
        got = _pip(["download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON, "-d", tmp, spec])
        if got.returncode:
            got = _pip(["wheel", "--no-deps", "-w", tmp, spec])
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode or len(wheels) != 1:
            last = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SystemExit(f"error: gpu-kit: no wheel of {spec}: {last}")
        wheel = wheels[0]
        if not wheel.name.endswith("-none-any.whl"):
            raise SystemExit(f"error: gpu-kit: {wheel.name} is not pure Python (the kit must install on any "
                             "Python 3.12 machine)")
        target = out / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target


def build(out: Path, dists: Sequence[str] = DISTRIBUTIONS) -> List[Path]:
    """Fill ``out`` with the kit's wheels (module docstring) and return them."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for dist in dists:
        try:
            wanted[dist] = md.version(dist)
        except md.PackageNotFoundError:
            raise SystemExit(f"error: gpu-kit: {dist} is not installed in {sys.prefix} (run make setup first)") \
                from None
    prefixes = {f"{_norm(d)}-{v}-" for d, v in wanted.items()}
    for old in out.glob("*.whl"):
        if not any(old.name.lower().startswith(p) for p in prefixes):
            old.unlink()
    wheels = []
    for dist, version in wanted.items():
        have = [w for w in out.glob("*.whl") if w.name.lower().startswith(f"{_norm(dist)}-{version}-")]
        wheels.append(have[0] if have else fetch(dist, version, out))
    total = sum(w.stat().st_size for w in out.glob("*.whl")) / 2 ** 20
    if total > LIMIT_MIB:
        raise SystemExit(f"error: gpu-kit: {out} holds {total:.1f} MiB of wheels, over the {LIMIT_MIB:g} MiB limit")
    return wheels


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "gpu-kit", help="the kit's folder (default: gpu-kit/)")
    args = p.parse_args(argv)
    wheels = build(args.out)
    total = sum(w.stat().st_size for w in wheels) / 2 ** 20
    print(f"{args.out}: {len(wheels)} wheels, {total:.2f} MiB ({', '.join(w.name for w in wheels)}); run the check "
          f"with python3 benchmarks/gpu_check.py --out DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
