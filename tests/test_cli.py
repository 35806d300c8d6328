"""``python -m pipeline.train`` as a user runs it: one-line errors, nothing written, real outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd, env_extra=None):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["partition.alpha=-1"], "error: partition.alpha must be > 0, got -1"),
    (["train.rounds=abc"], "error: Value 'abc' of type 'str' could not be converted to Integer (full_key: train.rounds)"),
    (["train.participation=1.5"], "error: train.participation must be <= 1, got 1.5"),
    (["train.nope=1"], "error: Key 'nope' not in 'TrainConfig' (full_key: train.nope)"),
    (["algorithm=nope"], "error: algorithm must be one of "
     + ", ".join(sorted(p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml"))) + ", got 'nope'"),
    (["algorithm.fedbug.gu_percentage=1.2"], "error: algorithm.fedbug.gu_percentage must be <= 1, got 1.2"),
    (["--bogus"], "error: unknown option --bogus (see --help)"),
])
def test_bad_config_gives_one_line_and_writes_nothing(tmp_path, args, message):
    proc = _run(args, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_dataset_names_the_root_and_writes_nothing(tmp_path):
    proc = _run(["dataset=cifar10", "dataset.root=nowhere"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dataset.root") and "nowhere" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_help_lists_the_keys(tmp_path):
    proc = _run(["--help"], tmp_path)
    assert proc.returncode == 0
    for key in ("partition.alpha", "train.rounds", "train.participation", "algorithm.fedbug.gu_percentage", "seed"):
        assert key in proc.stdout


def test_single_run_writes_results_and_mlflow(tmp_path):
    proc = _run(["partition=dirichlet", "partition.alpha=0.3", "algorithm=fedbug", "train.rounds=3",
                 "partition.num_clients=8", "seed=1", "name=smoke", "engine.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results" / "smoke"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["seeds"] == [1] and metrics["rounds"] == 3
    assert 0.1 < metrics["final_acc_mean"] <= 1.0
    assert metrics["algorithm"] == "fedbug[P=0.2](fedavg)"
    for f in ("rounds.csv", "runs.csv", "curves.png", "config.yaml", "models/seed_1.pt", "partition/stats.json",
              "partition/labels_per_client.png", "details/schedule.csv", "details/schedule.png",
              "details/seed_1.csv", "details/seed_1.png"):
        assert (out / f).exists(), f
    assert not any((tmp_path / "checkpoints").rglob("*.pt"))  # removed once the run finished

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fl-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 1
    child = children[0]
    assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert child.data.tags["algorithm"] == "fedbug[P=0.2](fedavg)"
    assert child.data.params["partition.alpha"] == "0.3"
    assert [m.step for m in client.get_metric_history(child.info.run_id, "test_acc")] == [1, 2, 3]
    arts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"config.yaml", "seed_1.pt", "seed_1.csv", "seed_1.png", "partition", "schedule.csv", "schedule.png"} <= arts
    assert [m.step for m in client.get_metric_history(child.info.run_id, "fedbug_trainable_share")] == [1, 2, 3]


def test_killed_grid_run_resumes_under_the_same_parent_run(tmp_path):
    """Interrupt a run (Ctrl-C) after its first checkpoint and run the same command again: still one
    parent run and one child run, with every round logged exactly once."""
    import signal
    import time

    # 30 rounds: long enough that the signal, sent once the round-2 checkpoint exists, always lands mid-run
    args = ["train.rounds=30", "engine.checkpoint_every=2", "partition.num_clients=6", "seed=1", "name=resume",
            "engine.progress=false", "tracking.log_every=1"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ck = tmp_path / "checkpoints" / "resume"
    deadline = time.time() + 120
    while time.time() < deadline and not any(ck.glob("*.pt")):
        time.sleep(0.05)
    assert any(ck.glob("*.pt")), "no checkpoint was written"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    again = _run(args, tmp_path)
    assert again.returncode == 0, again.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    if proc.returncode == 0:  # the run finished before the signal: nothing to resume, skip the check
        pytest.skip("the first run finished before it could be interrupted")
    assert len(parents) == 1 and len(children) == 1
    assert children[0].data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert sorted(m.step for m in client.get_metric_history(children[0].info.run_id, "test_acc")) == list(range(1, 31))
