#!/usr/bin/env python
"""Portable CPU kernels: do they hold the numbers still where native kernels move, and what do they cost?

Two CPUs differ to PyTorch in the kernels it picks (fl_core/engine/kernels.py). One machine cannot be another CPU,
but it can stand in for one: each *machine stand-in* below changes, through the environment, one of the choices a
different processor would change: the instruction set ATen's loops use (``ATEN_CPU_CAPABILITY``; not settable
under ``portable``, which pins it), the instruction set oneDNN may use (``ONEDNN_MAX_CPU_ISA``), the one MKL may
use (``MKL_ENABLE_INSTRUCTIONS``), and the number of threads (``OMP_NUM_THREADS``: a CPU with another core count).
For each experiment (the default grid's setting, one seed) and each kernel mode the script trains once per
stand-in with ``python -m pipeline.train`` in a fresh process and prints the final accuracy, a hash of the final
model and the wall time. Under ``native`` the hashes differ between stand-ins; under ``portable`` they must all
be equal (the script exits 1 when they are not). The time ratio portable / native is measured on the baseline
stand-in, both modes in the same run.

Run from the project root (about 6 minutes on 2 cores)::

    PYTHONPATH=$PWD python benchmarks/portable_kernels.py
    PYTHONPATH=$PWD python benchmarks/portable_kernels.py --experiments fedavg --rounds 10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# name -> environment changes (a processor that differs in one kernel choice)
STAND_INS = {
    "baseline": {},
    "aten_avx512_off": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "one_core": {"OMP_NUM_THREADS": "1"},
}
# the settings the default grid's experiments add to the shared values (params.yaml)
EXPERIMENTS = {e: [f"algorithm={e}"] for e in ("fedavg", "fedprox", "scaffold", "feddyn", "fedbug")}
PORTABLE_PINS = ("ATEN_CPU_CAPABILITY",)  # variables portable sets itself: a stand-in cannot change them there


def train(experiment: str, mode: str, stand_in: str, rounds: int, seed: int, work: Path) -> dict:
    """One run in a fresh process; returns final accuracy, model hash and wall seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    changes = dict(STAND_INS[stand_in])
    if mode == "portable":
        changes = {k: v for k, v in changes.items() if k not in PORTABLE_PINS}
    env.update(changes)
    env["PYTHONPATH"] = str(ROOT)
    out = work / f"{experiment}-{mode}-{stand_in}"
    cmd = [sys.executable, "-m", "pipeline.train", *EXPERIMENTS[experiment], f"engine.kernels={mode}",
           f"train.rounds={rounds}", f"seed={seed}", "tracking.enabled=false", "engine.progress=false",
           "engine.checkpoint_every=0", f"results_dir={out}", f"data_dir={work / 'data'}", "name=run"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    model = torch.load(out / "run" / "models" / f"seed_{seed}.pt", map_location="cpu", weights_only=True)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for _, t in sorted(model.items()))).hexdigest()[:12]
    metrics = json.loads((out / "run" / "metrics.json").read_text())
    return {"acc": metrics["final_acc_mean"], "hash": digest, "wall": wall, "changes": changes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiments", default="fedavg,scaffold", help=f"comma list of {', '.join(EXPERIMENTS)}")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    names = [e for e in args.experiments.split(",") if e]
    ok = True
    print(f"{'experiment':10} {'kernels':9} {'stand-in':16} {'final acc':>9} {'model hash':12} {'wall s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for e in names:
            runs = {m: {s: train(e, m, s, args.rounds, args.seed, Path(tmp)) for s in STAND_INS}
                    for m in ("native", "portable")}
            for m, by in runs.items():
                for s, r in by.items():
                    print(f"{e:10} {m:9} {s:16} {100 * r['acc']:9.2f} {r['hash']:12} {r['wall']:7.1f}")
            hashes = {m: len({r["hash"] for r in by.values()}) for m, by in runs.items()}
            ratio = runs["portable"]["baseline"]["wall"] / runs["native"]["baseline"]["wall"]
            spread = max(r["acc"] for r in runs["native"].values()) - min(r["acc"] for r in runs["native"].values())
            print(f"{e}: distinct models native {hashes['native']} / portable {hashes['portable']} of "
                  f"{len(STAND_INS)} stand-ins; native accuracy spread {100 * spread:.2f} pp; wall portable / native "
                  f"{ratio:.2f}x")
            ok &= hashes["portable"] == 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
