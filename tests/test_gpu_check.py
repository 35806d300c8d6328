"""benchmarks/gpu_check.py and its kit (benchmarks/gpu_kit.py, ``make gpu-kit``): the GPU check runs where a bare GPU
machine's image is all there is, with no package index, and every part reports.

The slow test stands a fresh virtual environment in for that image: it sees only torch and what the image holds
besides (torchvision, pillow, numpy, pyyaml, tqdm, packaging, filelock and their requirements), linked from this
environment, so hydra-core and omegaconf do not import there; pip's index is an address nothing answers. The check
must then install the kit's wheels itself and run every part on the CPU (``--device cpu --quick``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parent.parent
# what the GPU image holds that the engine uses (docs/benchmarks.md, GPU); their requirements come along
IMAGE = ("torch", "torchvision", "pillow", "numpy", "pyyaml", "tqdm", "packaging", "filelock")


def test_missing_kit_is_one_line_naming_make_gpu_kit(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "KIT_MODULES", ("no_such_module_for_the_kit_test",))
    with pytest.raises(SystemExit, match=r"^error: no_such_module_for_the_kit_test do not import and .*kit holds no "
                                         r"wheels: run `make gpu-kit` .*\(--kit\)$"):
        gpu_check.ensure_kit(tmp_path / "kit")


def test_kit_not_needed_where_the_modules_import(tmp_path):
    assert gpu_check.ensure_kit(tmp_path / "absent").startswith("kit: not needed")


def test_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--parts", "agreement,warp"])
    assert "unknown part(s) warp" in capsys.readouterr().err


def test_render_names_every_part_and_its_error():
    data = {"command": "python3 benchmarks/gpu_check.py --out x", "date": "today", "elapsed_s": 1.0, "kit": "kit: x",
            "machine": {"cpu": "a CPU", "cores": 2, "python": "3.12", "torch": "2.11", "cuda": None},
            "parts": [{"name": "agreement", "ok": True, "seconds": 1.0, "error": None},
                      {"name": "vit", "ok": False, "seconds": 0.5, "error": "RuntimeError: out of memory"}],
            "agreement": [{"stack": "FedAvg", "dtype": "float32", "kernels": "cpu", "rel_l2": 2e-8, "rtol": 1e-4,
                           "max_abs": 1e-8, "seq_vs_default_kernels": 3e-7, "train_loss": [2.3, 2.3], "within": True}],
            "speed": [], "population": [], "vit": []}
    md_text = gpu_check.render(data)
    assert "| vit | RuntimeError: out of memory | 0.5 |" in md_text
    assert ("| FedAvg | float32 | cpu | 2.0e-08 | 0.0001 | 1.0e-08 | 3.0e-07 | - | 2.300000 / 2.300000 | yes |"
            in md_text)


def _closure(names):
    """The installed distributions ``names`` and everything they require (markers evaluated, extras left out)."""
    seen, todo = {}, list(names)
    while todo:
        name = todo.pop()
        dist = md.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _image_stand_in(folder: Path) -> Path:
    """A folder of links to the files of :data:`IMAGE` and their requirements in this environment."""
    folder.mkdir()
    for dist in _closure(IMAGE):
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or []}:
            if top in ("..", "__pycache__") or top.endswith(".pth") or (folder / top).exists():
                continue
            os.symlink(base / top, folder / top)
    return folder


@pytest.mark.slow
def test_gpu_check_runs_in_a_bare_image_with_only_the_kit(tmp_path):
    kit = tmp_path / "kit"
    built = subprocess.run([sys.executable, "benchmarks/gpu_kit.py", "--out", str(kit)], cwd=ROOT,
                           check=False, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheels = sorted(w.name for w in kit.glob("*.whl"))
    assert len(wheels) == 3 and all(w.endswith("-none-any.whl") for w in wheels), wheels
    assert sum(w.stat().st_size for w in kit.glob("*.whl")) <= 40 * 2 ** 20

    env_dir = tmp_path / "image"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "image_stand_in.pth").write_text(str(_image_stand_in(tmp_path / "image_site")) + "\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "2",
           "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PYTHONUNBUFFERED": "1"}
    bare = subprocess.run([str(python), "-c", "import torch, numpy, yaml, tqdm\nimport hydra"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "No module named 'hydra'" in bare.stderr, bare.stderr  # the image's packages only

    out = tmp_path / "out"
    run = subprocess.run([str(python), "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--kit", str(kit),
                          "--out", str(out)], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["kit"].startswith("kit: 3 wheels from") and data["kit"].endswith("(no index)")
    assert [p["name"] for p in data["parts"]] == ["agreement", "speed", "population", "trials", "vit"]
    assert all(p["ok"] for p in data["parts"]), data["parts"]
    assert [r["stack"] for r in data["agreement"]] == [s[0] for s in gpu_check.AGREE_STACKS]
    assert all(r["within"] and r["rel_l2"] <= r["rtol"] for r in data["agreement"])
    assert [r["executor"].split(" ")[0] for r in data["speed"]] == ["naive", "sequential", "vectorized", "auto"]
    assert all(r["workload"] == "W1" and r["ms"] > 0 and r["peak_mib"] > 0 for r in data["speed"])
    pop = {r["row"]: r for r in data["population"]}
    assert set(pop) == {"population", "vectorized, one after another", "sequential, one after another"}
    assert pop["population"]["max_rel_l2"] <= 1e-5 and pop["vectorized, one after another"]["max_rel_l2"] <= 1e-4
    trials = {r["row"]: r for r in data["trials"]}  # a sweep's batch: 4 eta_l values (--quick) in one pass
    assert trials["population"]["max_rel_l2"] <= 1e-5 and trials["population"]["vs_sequential"] > 0
    vit = {r["executor"]: r for r in data["vit"]}
    assert vit["sequential"]["model"] == vit["vectorized"]["model"] == "vit_tiny"
    assert vit["vectorized"]["estimate_mib"] > 0 and vit["vectorized"]["clients_at_once"] >= 1
    md_text = (out / "gpu_check.md").read_text()
    assert "| agreement | ok |" in md_text and "Populations (W1" in md_text and "V0 (vit_tiny" in md_text
