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
                          check=False, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["partition.alpha=-1"], "error: partition.alpha must be > 0, got -1"),
    (["train.rounds=abc"], "error: Value 'abc' of type 'str' could not be converted to Integer (full_key: train.rounds)"),
    (["train.participation=1.5"], "error: train.participation must be <= 1, got 1.5"),
    (["train.nope=1"], "error: unknown key train.nope (see fl-train --help for the keys)"),
    (["+train.roudns=3"], "error: unknown key train.roudns (did you mean train.rounds?)"),
    (["algorithm.fedprox.mu=0.1", "train.rounds=1"],
     "error: algorithm.fedprox.mu is not used by this run's rules (fedavg); to train FedProx use algorithm=fedprox "
     "(or algorithm.name=fedprox)"),
    (["train.lr=1e400"], "error: train.lr must be a finite number, got inf"),
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


# What a command executed, printed as its last line: the heavy libraries among sys.modules. torch is bound lazily by
# the rule files (fl_core/lazy.py), so "torch" itself may be listed without having run: its compiled core torch._C
# tells whether it was executed.
_LOADED = """
import json, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
heavy = ("mlflow", "matplotlib", "sklearn", "scipy", "torchvision", "optuna", "dvc", "pandas")
print(json.dumps([m for m in heavy if m in sys.modules] + (["torch"] if "torch._C" in sys.modules else [])))
"""


@pytest.mark.parametrize("module,args", [
    ("pipeline.train", ["--help"]),
    ("pipeline.train", ["--hydra-help"]),
    ("pipeline.train", ["--cfg", "algorithm=fedprox", "train.rounds=2"]),
    ("pipeline.train", ["--cfg", "all", "algorithm=fedbug"]),
    ("pipeline.train", ["--info", "dataset=mnist1d", "model=m1d_cnn"]),
    ("pipeline.prepare", ["--help"]),
    ("pipeline.partition", ["--help"]),
])
def test_help_cfg_and_info_load_no_torch_mlflow_or_matplotlib(tmp_path, module, args):
    """The commands that print and exit import none of the heavy libraries (a run imports them where it uses them):
    structural, so it holds on any machine however loaded."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, module, *args], cwd=tmp_path, capture_output=True,
                          check=False, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert list(tmp_path.iterdir()) == []


def test_the_command_trains_with_the_garbage_collector_on(tmp_path, monkeypatch):
    """``fl-train`` (main without argv) pauses the cyclic garbage collector while it starts (imports, data, model)
    and switches it on before the first round trains; main with an argv list leaves it alone."""
    import gc

    from pipeline import observer, train

    seen = {}
    preflight, progress = observer.ExperimentRun._preflight, observer._Progress.__call__
    monkeypatch.setattr(observer.ExperimentRun, "_preflight",
                        lambda self: seen.setdefault("start-up", gc.isenabled()) is None or preflight(self))
    monkeypatch.setattr(observer._Progress, "__call__",
                        lambda self, r, row: seen.setdefault("training", gc.isenabled()) is None or progress(self, r, row))
    args = ["train.rounds=1", "partition.num_clients=4", "train.local_epochs=1", "seed=1", "engine.progress=false",
            "tracking.enabled=false", f"results_dir={tmp_path / 'r'}", f"engine.checkpoint_dir={tmp_path / 'c'}",
            f"data_dir={tmp_path / 'd'}"]
    monkeypatch.setattr(sys, "argv", ["fl-train", *args])
    try:
        assert train.main() == 0
        assert seen == {"start-up": False, "training": True} and gc.isenabled()
        seen.clear()
        assert train.main(args + ["name=again"]) == 0
        assert seen == {"start-up": True, "training": True} and gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_single_run_writes_results_and_mlflow(tmp_path):
    proc = _run(["partition=dirichlet", "partition.alpha=0.3", "algorithm=fedbug", "train.rounds=3",
                 "partition.num_clients=8", "seed=1", "name=smoke", "engine.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results" / "smoke"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["seeds"] == [1] and metrics["rounds"] == 3
    assert 0.1 < metrics["final_acc_mean"] <= 1.0
    assert all(isinstance(v, (int, float, list, type(None))) for k, v in metrics.items() if k != "status"), metrics
    info = json.loads((out / "experiment.json").read_text())
    assert info["algorithm"] == "fedbug[P=0.2](fedavg)" and set(info["per_seed"]) == {"1"}
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
    assert [m.step for m in client.get_metric_history(child.info.run_id, "test/acc")] == [1, 2, 3]
    arts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"config.yaml", "seed_1.csv", "seed_1.png", "partition", "schedule.csv", "schedule.png"} <= arts
    assert "seed_1.pt" not in arts  # the model is the run's MLflow model (tests/test_tracking.py loads it)
    assert parents[0].data.tags["fl.best_model_uri"] == f"runs:/{child.info.run_id}/model"
    assert [m.step for m in client.get_metric_history(child.info.run_id, "diag/fedbug_trainable_share")] == [1, 2, 3]
    assert child.data.tags["mlflow.source.git.commit"] == child.data.tags["git_commit"]
    for run in (child, parents[0]):
        inputs = {d.dataset.name: d for d in client.get_run(run.info.run_id).inputs.dataset_inputs}
        assert set(inputs) == {"digits", "digits-dirichlet-per_client-a0.3-n8-sgm0-s0"}
        assert len(inputs["digits"].dataset.digest) == 16
    assert parents[0].data.metrics["final_acc_mean"] == pytest.approx(metrics["final_acc_mean"])


@pytest.mark.parametrize("args,start", [
    (["model=tiny_cnn"], "error: model=tiny_cnn (tiny_cnn) does not fit dataset=digits inputs of shape [1, 8, 8]: "),
    (["model=vgg11"], "error: model=vgg11 (vgg11) does not fit dataset=digits inputs of shape [1, 8, 8]: "),
])
def test_model_that_does_not_fit_the_data_fails_before_anything_is_written(tmp_path, args, start):
    proc = _run(args + ["name=smoke"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # nine fl-train subprocesses (about 20 s)
def test_bad_inputs_leave_an_earlier_good_run_untouched(tmp_path):
    """Bad configs, a model that does not fit, and a second writer change no file of a finished run."""
    good = ["train.rounds=2", "partition.num_clients=4", "train.local_epochs=1", "train.batch_size=64", "seed=1",
            "name=smoke", "engine.progress=false"]
    assert _run(good, tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for bad in (["model=tiny_cnn"], ["partition.alpha=-1"], ["dataset=cifar10", "dataset.root=nowhere"]):
        proc = _run(good + bad, tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_cfg_info_and_hydra_help_as_in_hydra(tmp_path, capsys, monkeypatch):
    """``--cfg job|hydra|all`` (bare: job), ``--info`` and ``--hydra-help`` print and exit 0 without running or
    writing anything; the overrides are checked as for a run."""
    import yaml

    from pipeline.train import main

    monkeypatch.chdir(tmp_path)

    def out(*args):
        assert main(list(args)) == 0
        return capsys.readouterr().out

    job = yaml.safe_load(out("--cfg", "job", "train.rounds=2"))
    assert job["train"]["rounds"] == 2 and "hydra" not in job
    assert yaml.safe_load(out("--cfg", "train.rounds=2")) == job  # bare --cfg is job
    hydra = yaml.safe_load(out("--cfg", "hydra", "algorithm=fedprox"))
    assert list(hydra) == ["hydra"] and "algorithm=fedprox" in hydra["hydra"]["overrides"]["task"]
    both = out("--cfg", "all", "algorithm=fedprox")
    assert both.startswith("hydra:") and "\nalgorithm:\n  name: fedprox" in both
    info = out("--info", "dataset=mnist1d", "model=m1d_cnn")
    assert "Config search path:" in info and "dataset=mnist1d" in info and "model=m1d_cnn" in info
    assert "key=value" in out("--hydra-help") and "group=option" in out("--hydra-help")
    assert list(tmp_path.iterdir()) == []  # nothing run, nothing written
    with pytest.raises(SystemExit) as err:
        main(["--cfg", "hydra", "train.roudns=3"])
    assert err.value.code == 2 and "did you mean train.rounds" in capsys.readouterr().err


@pytest.mark.slow  # ~16 s: four runs of the CLI
def test_a_name_holding_another_configs_results_is_refused_unless_overwrite(tmp_path):
    """Rerunning a name with another config exits 2 with one line (name=... or --overwrite) and changes no file;
    with --overwrite the new config's results replace the old ones; the same config again does nothing."""
    good = ["train.rounds=1", "partition.num_clients=4", "train.local_epochs=1", "seed=1", "name=mine",
            "engine.progress=false", "tracking.enabled=false"]
    assert _run(good, tmp_path).returncode == 0
    assert (tmp_path / "results" / "mine" / ".gitignore").read_text().splitlines()[-1] == "*"  # ad hoc: git-ignored
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = _run(good + ["train.lr=0.1"], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: results/mine/ holds the results of another config of experiment mine")
    assert "name=..." in lines[0] and "--overwrite" in lines[0]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    old = json.loads((tmp_path / "results" / "mine" / "experiment.json").read_text())["fingerprint"]
    assert _run(good + ["train.lr=0.1", "--overwrite"], tmp_path).returncode == 0
    new = json.loads((tmp_path / "results" / "mine" / "experiment.json").read_text())["fingerprint"]
    assert new != old
    again = _run(good + ["train.lr=0.1"], tmp_path)
    assert again.returncode == 0 and "already holds this experiment" in again.stderr
