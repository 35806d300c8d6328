"""A tiny ``dvc repro`` of the real dvc.yaml in a temporary copy of the project."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _sh(args, cwd, env):
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_tiny_dvc_repro_in_a_copy(tmp_path):
    if not (BIN / "dvc").exists():
        pytest.skip("dvc is not installed next to this python")
    work = tmp_path / "proj"
    work.mkdir()
    for item in ("fl_core", "pipeline", "conf", "dvc.yaml", "params.yaml", "pyproject.toml"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["seeds"] = [1, 2]
    params["train"].update(rounds=2)
    params["partition"]["num_clients"] = 6
    params["experiments"] = {k: v for k, v in params["experiments"].items() if k in ("fedavg_iid", "fedbug20_dir")}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "FL_PROJECT_ROOT": str(work),
           "PYTHONPATH": str(work), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    env.pop("MLFLOW_TRACKING_URI", None)
    _sh([sys.executable, "-m", "pipeline.grid", "sync-dvc"], work, env)
    _sh(["git", "init", "-q"], work, env)
    _sh(["dvc", "init", "-q"], work, env)
    _sh(["dvc", "config", "core.analytics", "false"], work, env)
    out = _sh(["dvc", "repro"], work, env)
    assert "train@fedbug20_dir" in out

    res = work / "results"
    for exp in ("fedavg_iid", "fedbug20_dir"):
        m = json.loads((res / exp / "metrics.json").read_text())
        assert m["seeds"] == [1, 2] and m["rounds"] == 2
    report = (res / "report.md").read_text()
    assert "FedAvg" in report and "FedBug P=0.2 (FedAvg)" in report and "±" in report
    assert (res / "curves.png").exists()
    assert (work / "mlflow.db").exists()  # default store at the project root

    again = _sh(["dvc", "repro"], work, env)
    assert "Running stage" not in again  # a second repro does nothing

    metrics = _sh(["dvc", "metrics", "show", "--json"], work, env)
    assert "final_acc_mean" in metrics

    # `dvc exp run -S train.rounds=N` edits the shared section and retrains
    _sh(["git", "add", "-A"], work, env)
    _sh(["git", "commit", "-qm", "tiny grid"], work, env)
    _sh(["dvc", "exp", "run", "-S", "train.rounds=1"], work, env)
    m = json.loads((res / "fedavg_iid" / "metrics.json").read_text())
    assert m["rounds"] == 1
