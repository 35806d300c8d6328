"""A tiny ``dvc repro`` of the real dvc.yaml in a temporary copy of the project."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _sh(args, cwd, env):
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, check=False, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _columns(csv_text: str) -> list:
    return next(csv.reader(io.StringIO(csv_text)))


def _leaves(d) -> int:
    return sum(_leaves(v) for v in d.values()) if isinstance(d, dict) else 1


def _expected_columns(params_yaml: Path, dvc_yaml: Path, metrics_json: Path) -> int:
    """Columns of `dvc exp show`: Experiment, Created, one per number of report/metrics.json, every params.yaml
    leaf (a list is one) and every distinct dependency."""
    params = yaml.safe_load(params_yaml.read_text())
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    deps = {d for st in stages.values() for d in (st.get("do", st).get("deps") or [])}
    return 2 + _leaves(json.loads(metrics_json.read_text())) + _leaves(params) + len(deps)


def _exp_show_flags() -> list:
    """The flags of `make exp-show` (the Makefile's EXP_SHOW line, after `exp show`)."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("EXP_SHOW :="))
    return shlex.split(line.split(":=", 1)[1])


def test_the_committed_dvc_metrics_lead_with_every_experiments_final_accuracy():
    """report/metrics.json, the one file DVC tracks as metrics: the first group is `final` with every experiment
    of params.yaml in grid order (so the leftmost columns of `dvc exp show` are those), values are fractions, no
    group is empty, and `make exp-show` keeps `final.*` and drops the other groups."""
    root = json.loads((ROOT / "report" / "metrics.json").read_text())
    grid = list(yaml.safe_load((ROOT / "params.yaml").read_text())["experiments"])
    assert list(root)[0] == "final" and list(root["final"]) == grid
    assert all(root[g] for g in root)
    for group in ("final", "final_std", "best", "best_std", "worst10"):
        assert all(0.0 <= v <= 1.0 for v in root[group].values()), (group, root[group])
    flags = _exp_show_flags()
    keep, drop = flags[flags.index("--keep") + 1], flags[flags.index("--drop") + 1]
    assert re.match(keep, "final.fedavg") and not re.match(drop, "final.fedavg")
    for group in set(root) - {"final"}:
        assert re.match(drop, f"{group}.fedavg"), group
    assert not re.match(drop, "train.lr")


@pytest.mark.slow
def test_tiny_dvc_repro_in_a_copy(tmp_path):
    """The project's dvc.yaml on a 2-experiment, 2-round grid: repro, the outputs git keeps, a second repro
    that does nothing, `dvc metrics show` / `dvc plots show` without load warnings, and a `dvc exp run`
    whose experiment row in `dvc exp show` holds numbers (no '!') in about 40 columns."""
    if not (BIN / "dvc").exists():
        pytest.skip("dvc is not installed next to this python")
    work = tmp_path / "proj"
    work.mkdir()
    for item in ("fl_core", "pipeline", "conf", "scripts", "dvc.yaml", "params.yaml", "pyproject.toml", ".gitignore",
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
    (work / ".venv").symlink_to(BIN.parent, target_is_directory=True)  # as `make setup` leaves a clone
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "FL_PROJECT_ROOT": str(work),
           "PYTHONPATH": str(work), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    env.pop("MLFLOW_TRACKING_URI", None)
    _sh([sys.executable, "-m", "pipeline.grid", "sync-dvc"], work, env)
    _sh(["git", "init", "-q"], work, env)
    _sh(["dvc", "init", "-q"], work, env)
    _sh(["dvc", "config", "core.analytics", "false"], work, env)
    shutil.copy(ROOT / ".dvc" / "plots.html", work / ".dvc" / "plots.html")  # the offline page, as .dvc/config names it
    _sh(["dvc", "config", "plots.html_template", "plots.html"], work, env)
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
    assert list(root)[0] == "final" and list(root["final"]) == ["fedavg", "fedbug"]
    assert all(0.0 <= v <= 1.0 for v in root["final"].values())
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
    assert "final.fedbug" in metrics and "failed" not in metrics.lower(), metrics
    assert len([ln for ln in metrics.splitlines() if ln.strip()]) == 2, metrics  # a header and one file, no empty row
    plots = _sh(["dvc", "plots", "show"], work, env)
    assert "failed" not in plots.lower() and "warning" not in plots.lower(), plots
    html = (work / "dvc_plots" / "index.html").read_text()
    assert "curves.png" in html and "fedbug" in html
    assert not re.search(r"<script[^>]*\bsrc=", html)  # Vega inline: the charts open without internet

    # `dvc exp run -S train.rounds=N` edits the shared section and retrains; the experiment carries numbers
    _sh(["git", "add", "-A"], work, env)
    _sh(["git", "commit", "-qm", "tiny grid"], work, env)
    # as README prints it, from a plain shell: no venv on PATH, no `python` there with torch (scripts/python finds
    # the project's interpreter for every stage)
    plain = {**env, "PATH": "/usr/bin:/bin"}
    plain.pop("VIRTUAL_ENV", None)
    _sh([str(BIN / "dvc"), "exp", "run", "-S", "train.rounds=1"], work, plain)
    m = json.loads((res / "fedavg" / "metrics.json").read_text())
    assert m["rounds"] == 1
    # a stage that fails (a value the train stage refuses) loses no result: the outputs persist (dvc.yaml)
    kept = {p: p.read_bytes() for p in sorted(res.rglob("*")) if p.is_file()}
    failed = subprocess.run([str(BIN / "dvc"), "exp", "run", "-S", "train.rounds=abc"], cwd=work, env=plain,
                            capture_output=True, text=True, check=False)
    assert failed.returncode != 0 and "train.rounds" in failed.stdout + failed.stderr
    assert {p: p.read_bytes() for p in sorted(res.rglob("*")) if p.is_file()} == kept
    _sh(["git", "checkout", "params.yaml"], work, env)  # DVC leaves the -S edit it applied in the workspace
    table = _sh(["dvc", "exp", "show", "--csv"], work, env)
    cols = [c for c in _columns(table) if c not in ("rev", "typ", "parent")]  # --csv only: not on screen
    assert len(cols) == _expected_columns(work / "params.yaml", work / "dvc.yaml", work / "report/metrics.json"), cols
    rows = list(csv.DictReader(io.StringIO(table)))
    exp_rows = [r for r in rows if r["typ"] == "branch_base"]
    assert exp_rows and all(r["final.fedavg"] not in ("", "!") for r in exp_rows), rows
    # `make exp-show`, rendered as wide as it wants: within 160 columns, every final accuracy and the changed param
    wide = _sh(["dvc", *_exp_show_flags()], work, {**env, "COLUMNS": "1000"})
    lines = [ln for ln in wide.splitlines() if ln.strip()]
    assert max(len(ln) for ln in lines) <= 160 and "\u2026" not in wide, wide
    assert all(h in wide for h in ("final.fedavg", "final.fedbug", "train.rounds")), wide
    assert not any(c.startswith(("per_seed", "studies")) for c in cols), cols
