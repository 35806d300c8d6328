"""A tiny ``dvc repro`` of the real dvc.yaml in a temporary copy of the project."""

from __future__ import annotations

import csv
import io
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


def _columns(csv_text: str) -> list:
    return next(csv.reader(io.StringIO(csv_text)))


def _leaves(d) -> int:
    return sum(_leaves(v) for v in d.values()) if isinstance(d, dict) else 1


def _expected_columns(params_yaml: Path, dvc_yaml: Path) -> int:
    """Columns of `dvc exp show`: Experiment, Created, the report's metrics (acc and std per experiment,
    vs_fedavg for all but FedAvg), every params.yaml leaf (a list is one) and every distinct dependency."""
    params = yaml.safe_load(params_yaml.read_text())
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    deps = {d for st in stages.values() for d in (st.get("do", st).get("deps") or [])}
    n = len(params["experiments"])
    return 2 + (3 * n - 1) + _leaves(params) + len(deps)


def test_dvc_exp_show_of_the_default_grid_fits_about_40_columns():
    """The column count of `dvc exp show` on the project's own grid (the tiny repro below checks that the
    count formula is what DVC shows)."""
    assert _expected_columns(ROOT / "params.yaml", ROOT / "dvc.yaml") <= 42


@pytest.mark.slow
def test_tiny_dvc_repro_in_a_copy(tmp_path):
    """The project's dvc.yaml on a 2-experiment, 2-round grid: repro, the outputs git keeps, a second repro
    that does nothing, `dvc metrics show` / `dvc plots show` without load warnings, and a `dvc exp run`
    whose experiment row in `dvc exp show` holds numbers (no '!') in about 40 columns."""
    if not (BIN / "dvc").exists():
        pytest.skip("dvc is not installed next to this python")
    work = tmp_path / "proj"
    work.mkdir()
    for item in ("fl_core", "pipeline", "conf", "dvc.yaml", "params.yaml", "pyproject.toml", ".gitignore",
                 ".dvcignore"):
        src = ROOT / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item,
                                                            **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                               if src.is_dir() else {}))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["seeds"] = [1, 2]
    params["train"].update(rounds=2)
    params["partition"]["num_clients"] = 6
    params["experiments"] = {k: v for k, v in params["experiments"].items() if k in ("fedavg", "fedbug")}
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
    assert "train@fedbug" in out

    res = work / "results"
    for exp in ("fedavg", "fedbug"):
        m = json.loads((res / exp / "metrics.json").read_text())
        assert m["seeds"] == [1, 2] and m["rounds"] == 2
        assert all(isinstance(v, (int, float, list, type(None))) or k == "status" for k, v in m.items()), m  # numbers
        info = json.loads((res / exp / "experiment.json").read_text())
        assert set(info["per_seed"]) == {"1", "2"} and info["partition"].startswith("digits-shards")
    report = (work / "report" / "report.md").read_text()
    assert "FedAvg" in report and "FedBug P=0.2 (FedAvg)" in report and "±" in report
    assert "## Difference to FedAvg" in report
    assert (work / "report" / "curves.png").exists() and (work / "report" / "curves.pdf").exists()
    root = json.loads((work / "report" / "metrics.json").read_text())
    assert set(root) == {"fedavg", "fedbug"} and set(root["fedbug"]) == {"acc", "std", "vs_fedavg"}
    assert (work / "mlflow.db").exists()  # default store in the folder the stages run in

    # git keeps the small outputs, the DVC cache the large ones
    tracked = _sh(["git", "status", "--porcelain", "--untracked-files=all"], work, env)
    for f in ("results/fedavg/metrics.json", "results/fedavg/experiment.json", "results/fedavg/rounds.csv",
              "report/metrics.json", "report/test_acc.csv"):
        assert f in tracked, f
    for f in ("results/fedavg/models", "data/prepared", "results/.locks"):
        assert f not in tracked, f

    again = _sh(["dvc", "repro"], work, env)
    assert "Running stage" not in again  # a second repro does nothing

    metrics = _sh(["dvc", "metrics", "show"], work, env)
    assert "fedbug.vs_fedavg" in metrics and "failed" not in metrics.lower(), metrics
    plots = _sh(["dvc", "plots", "show"], work, env)
    assert "failed" not in plots.lower() and "warning" not in plots.lower(), plots
    html = (work / "dvc_plots" / "index.html").read_text()
    assert "curves.png" in html and "fedbug" in html

    # `dvc exp run -S train.rounds=N` edits the shared section and retrains; the experiment carries numbers
    _sh(["git", "add", "-A"], work, env)
    _sh(["git", "commit", "-qm", "tiny grid"], work, env)
    _sh(["dvc", "exp", "run", "-S", "train.rounds=1"], work, env)
    m = json.loads((res / "fedavg" / "metrics.json").read_text())
    assert m["rounds"] == 1
    table = _sh(["dvc", "exp", "show", "--csv"], work, env)
    cols = [c for c in _columns(table) if c not in ("rev", "typ", "parent")]  # --csv only: not on screen
    assert len(cols) == _expected_columns(work / "params.yaml", work / "dvc.yaml"), cols
    rows = list(csv.DictReader(io.StringIO(table)))
    exp_rows = [r for r in rows if r["typ"] == "branch_base"]
    assert exp_rows and all(r["fedavg.acc"] not in ("", "!") for r in exp_rows), rows
    assert not any(c.startswith(("per_seed", "studies")) for c in cols), cols
