"""sweeps/tune.py: search spaces, fixed keys, storage errors, pruning, diverging / infeasible / failing
trials, resuming, stale trials, workers, MLflow, the outputs and the best YAML.

Studies run on digits with tiny settings (a fraction of a second per trial); storage and outputs
live under tmp_path and MLflow in one SQLite store per module (under a tmp folder: creating a store
costs seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import yaml

from sweeps import outputs, tune
from sweeps.settings import HOST, Settings
from sweeps.storage import STALE_REASON, StorageError, open_storage, setup_lock
from sweeps.trials import TrialRunner
from sweeps.spaces import (FIXED_KEYS, VALIDATION, check_space, load_space, merge_overrides, overrides_mapping,
                           space_names, space_path, SpaceError)

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=mlp", "partition.num_clients=4", "train.rounds=3", "train.local_epochs=1", "train.batch_size=16",
        "train.participation=1.0"]
LR_SPACE = """\
description: local learning rate on a tiny digits run (tests)
base: [model=mlp, partition=iid, partition.num_clients=4, train.rounds=3, train.local_epochs=1, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-6, high: 1.0e+6, log: true}
"""



def _study(storage: Path, name: str):
    return optuna.load_study(study_name=name, storage=open_storage(str(storage)))


def _runs(study_name: str, role: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("fl-pipeline-sweeps")
    runs = client.search_runs([exp.experiment_id], f"tags.optuna_study = '{study_name}' and tags.sweep_role = '{role}'")
    return client, runs


def _args(space, storage, name, out, *extra):
    return ["--space", str(space), "--storage", str(storage), "--study-name", name, "--out", str(out), "--quiet",
            *extra]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# --------------------------------------------------------------------------- CLI and spaces


def test_help_lists_the_options():
    res = subprocess.run([sys.executable, str(ROOT / "sweeps" / "tune.py"), "--help"], capture_output=True, check=False,
                         text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    for opt in ("--space", "--n-trials", "--timeout", "--workers", "--storage", "--study-name", "--sampler",
                "--pruner", "--seeds", "--objectives", "--fail-stale", "--no-fail-stale", "KEY=VALUE",
                "psycopg2-binary"):
        assert opt in res.stdout, opt
    assert all(name in res.stdout for name in ("fedbug", "fedbug_units", "cross"))  # the shipped spaces


@pytest.mark.parametrize("name", space_names())
def test_every_space_file_loads_and_composes(name):
    from omegaconf import OmegaConf

    space = load_space(name)
    cfg = check_space(space, [])
    assert space.description
    for key in space.keys():
        if "." in key:  # a value key: it exists in the config schema
            assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key


def test_shipped_spaces_search_the_issue_keys():
    keys = {name: set(load_space(name).keys()) for name in space_names()}
    assert set(keys) == {"fedbug", "fedbug_units", "fednlr", "fedbcgd", "lr", "cross"}
    assert {"algorithm.fedbug.gu_percentage", "algorithm.fedbug.schedule", "algorithm.name"} <= keys["fedbug"]
    assert keys["fedbug_units"] == {"model.units", "algorithm.fedbug.gu_percentage", "algorithm.name"}
    units = load_space("fedbug_units")
    assert "model=resnet18" in units.base and set(units.params["model.units"].choices) == {"module", "block"}
    assert {"algorithm.fednlr.mu0", "algorithm.fednlr.a1", "algorithm.fednlr.a2",
            "algorithm.fednlr.depth_term"} <= keys["fednlr"]
    assert {"algorithm.fedbcgd.lam", "algorithm.fedbcgd.blocks"} <= keys["fedbcgd"]
    assert keys["lr"] == {"train.lr"}
    cross = load_space("cross")
    assert set(cross.conditional["algorithm"]) >= {"fedbug", "fednlr", "fedbcgd"}
    lam = cross.conditional["algorithm"]["fedbcgd"].params["algorithm.fedbcgd.lam"]
    assert (lam.low, lam.high) == (0.4, 0.95)


BAD_SPACES = [
    ("params: {train.lr: {type: float, low: 0.5, high: 0.1}}", "params.train.lr: low must be < high"),
    ("params: {train.lr: {type: uniform, low: 0, high: 1}}", "params.train.lr.type must be one of"),
    ("params: {train.lr: {type: float, low: 0.0, high: 1.0, log: true}}", "params.train.lr: a log scale needs low > 0"),
    ("params: {train.lr: {type: float, low: 0.1, high: 1.0, scale: 2}}", "unknown field 'scale'"),
    ("parms: {train.lr: {type: float, low: 0.1, high: 1.0}}", "unknown top-level key 'parms'"),
    ("params: {}", "params is empty"),
    ("params: {train.lr: {type: float, low: 0.1, high: 1.0}}\nconditional: {train.lr: {0.1: {}}}",
     "conditional.train.lr: 'train.lr' must be a categorical"),
    ("params: {algorithm: {type: categorical, choices: [fedavg, fedbug]}}\n"
     "conditional: {algorithm: {fednlr: {params: {algorithm.fednlr.mu0: {type: float, low: 0.5, high: 2.0}}}}}",
     "conditional.algorithm.fednlr: 'fednlr' is not one of the choices"),
    ("base: [dataset.validation_fraction=0.0]\nparams: {train.lr: {type: float, low: 0.1, high: 1.0}}",
     "base: dataset.validation_fraction is fixed by the sweep"),
    ("params: {seed: {type: int, low: 1, high: 5}}", "params.seed: seed is fixed by the sweep"),
]


@pytest.mark.parametrize("text,message", BAD_SPACES, ids=[m for _, m in BAD_SPACES])
def test_bad_space_files_give_one_line_naming_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(SpaceError) as err:
        load_space(str(path))
    assert message in str(err.value)
    assert "bad.yaml" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text,message", [
    ("base: [algorithm=fedbcgd]\nparams: {algorithm.fedbcgd.lam: {type: float, low: 0.4, high: 1.0}}",
     "algorithm.fedbcgd.lam must be < 1"),  # the high end does not validate
    ("params: {train.lrr: {type: float, low: 0.1, high: 1.0}}", "train.lrr"),  # no such key
])
def test_space_values_are_checked_against_the_config(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    assert tune.main(["--space", str(path), "--n-trials", "1", "--storage", str(tmp_path / "s.log")]) == 2
    err = _one_line_error(capsys)
    assert "bad.yaml" in err and message in err
    assert not (tmp_path / "s.log").exists()  # nothing was started


@pytest.mark.parametrize("override", ["dataset.validation_fraction=0", "seed=3", "+seed=3", "tracking.enabled=true",
                                      "engine.checkpoint_every=5", "engine.progress=true"])
def test_keys_the_sweep_fixes_cannot_be_overridden(tmp_path, capsys, override):
    storage = tmp_path / "s.log"
    assert tune.main(["--space", "lr", "--n-trials", "1", "--storage", str(storage), override]) == 2
    key = override.split("=")[0].lstrip("+")
    assert key in FIXED_KEYS
    err = _one_line_error(capsys)
    assert f"{key} is fixed by the sweep" in err and repr(override) in err
    assert not storage.exists()


@pytest.mark.parametrize("url,message", [
    ("postgresql://sweeper@localhost/optuna", "driver is not installed (import of psycopg halted; None in "
                                              "sys.modules; pip install 'psycopg[binary]'"),  # psycopg hidden below
    ("postgresql+psycopg2://sweeper:pw@localhost/optuna", "pip install psycopg2-binary"),
    ("nosuchdialect://host/db", "cannot open the storage"),
    ("sqlite:////nonexistent-dir/x/optuna.db", "cannot open the storage"),
])
def test_storage_errors_are_one_line_naming_the_storage(tmp_path, capsys, monkeypatch, url, message):
    """(PostgreSQL servers that cannot be reached: tests/test_postgres.py.)"""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the dependency were missing: import raises
    tmp_space = tmp_path / "lr.yaml"
    tmp_space.write_text(LR_SPACE)
    assert tune.main(["--space", str(tmp_space), "--n-trials", "1", "--storage", url, "--no-mlflow"]) == 2
    err = _one_line_error(capsys)
    assert f"--storage {url.replace(':pw@', ':***@')}" in err and message in err
    assert not Path("/nonexistent-dir").exists()


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_the_setup_lock_of_a_file_storage_has_one_holder_at_a_time(tmp_path, kind):
    """Journal and SQLite files: a file lock beside the file (PostgreSQL's advisory lock: tests/test_postgres.py)."""
    db = tmp_path / "studies" / ("s.log" if kind == "journal" else "s.db")
    if kind == "sqlite":
        db.parent.mkdir()
    spec = str(db) if kind == "journal" else f"sqlite:///{db}"
    waits = []
    with setup_lock(spec) as how:
        assert how == "file" and (db.parent / f"{db.name}.setup.lock").exists()
        with pytest.raises(StorageError) as err:
            with setup_lock(spec, timeout_s=0.3, on_wait=waits.append):
                pytest.fail("a second holder got the lock")
        assert str(err.value) == (f"--storage {spec}: another process held the study-setup lock for 0.3 s "
                                  "(a sweep stuck while it starts?)")
        assert waits == [f"another process is setting up a study in {spec}: waiting for it (at most 0.3 s)"]
    with setup_lock(spec, timeout_s=0.3) as how:  # released at the end of the block
        assert how == "file"
    with setup_lock("sqlite://") as how:  # in memory: one process, nothing to lock
        assert how == "none"


def test_overrides_precedence_and_conditional_sampling():
    run = TrialRunner(Settings(space=str(space_path("cross")), overrides=["train.rounds=7"],
                               seeds=[1], objectives=["acc"], study_name="x", storage="unused"))
    trial = optuna.trial.FixedTrial({"algorithm": "fedbug", "train.lr": 0.125,
                                     "algorithm.fedbug.gu_percentage": 0.3})
    ovs = run.experiment_overrides(trial)
    assert "train.rounds=7" in ovs and "train.rounds=20" not in ovs  # the command line beats the space's base
    assert ovs[-4:] == ["algorithm=fedbug", "train.lr=0.125", "algorithm.fedbug.gu_percentage=0.3", *VALIDATION]
    assert not any(o.startswith("algorithm.fedprox") or o.startswith("algorithm.fednlr") for o in ovs)
    with pytest.raises(SpaceError, match="train.lr is searched"):
        check_space(load_space("cross"), ["train.lr=0.1"])


def test_best_yaml_entries_round_trip_through_the_grid(tmp_path):
    from pipeline.grid import load_grid

    ovs = ["algorithm=fedbug", "algorithm.wrappers=[fedbug]", "train.lr=1e-05", "train.grad_clip=null",
           "engine.progress=false", f"algorithm.fedbug.gu_percentage={0.1 + 0.2!r}", "+experiment=fedbug_cifar10"]
    doc = {"seeds": [1], "experiments": {"e": overrides_mapping(ovs)}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_grid(tmp_path / "p.yaml").experiments["e"] == ovs
    assert merge_overrides(["a=1", "b=2"], ["+a=3"]) == ["b=2", "+a=3"]


def test_commands_use_paths_from_the_project_root(tmp_path, monkeypatch):
    from fl_core.paths import project_root

    monkeypatch.chdir(tmp_path)
    inside = project_root() / "sweeps" / "results" / "s" / "best.yaml"
    assert outputs.command_path(inside) == "sweeps/results/s/best.yaml"
    assert outputs.command_path(Path("elsewhere/best.yaml")) == str(tmp_path / "elsewhere" / "best.yaml")


# --------------------------------------------------------------------------- acceptance: every shipped space


# fedbug_units trains ResNet-18 (about 20 s): with the slow tests
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "fedbug_units" else n
                                  for n in space_names()])
def test_every_shipped_space_runs_a_tiny_study(sandbox, name):
    """Default sampler (TPE) and pruner (median), 3 trials, 2 rounds of 2 local steps on 3 clients."""
    out = sandbox / "out"
    args = ["--space", name, "--storage", str(sandbox / "s.log"), "--out", str(out), "--n-trials", "3", "--quiet",
            "--no-test", "--no-mlflow", "--sampler-seed", "0", "train.rounds=2", "partition.num_clients=3",
            "train.local_steps=2", "train.batch_size=16"]
    assert tune.main(args) == 0
    study = _study(sandbox / "s.log", name)
    assert study.metric_names == ["val_acc"]
    trials = study.trials
    assert len(trials) == 3 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    for t in trials:
        if t.state.name == "PRUNED":  # default pruner: no pruning before 5 trials; only infeasible settings
            assert t.user_attrs["reason"].startswith("infeasible: "), t.user_attrs["reason"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == 3 and summary["status"] == "finished"
    assert (out / "trials.csv").exists() and (out / "summary.md").exists()
    assert summary["complete"] >= 1 and (out / "best.yaml").exists()  # fedbug_units: ResNet-18 on 8x8 digits


# --------------------------------------------------------------------------- studies


@pytest.mark.slow  # ~25 s: a whole sweep with pruning, a divergence, a resume and the best config rerun
def test_study_prunes_survives_divergence_resumes_and_its_best_yaml_reproduces(sandbox, capsys, request):
    from pipeline import train

    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    space, storage, out = sandbox / "lr.yaml", sandbox / "studies" / "t.log", sandbox / "out"
    space.write_text(LR_SPACE)
    study = optuna.create_study(study_name="t", storage=open_storage(str(storage)), direction="maximize")
    for lr in (1e-5, 1e6, 0.1):  # far too small (pruned), diverging (non-finite loss), good
        study.enqueue_trial({"train.lr": lr})
    # options after the overrides (parse_intermixed_args); the results of the pipeline runs below land in sandbox
    args = _args(space, storage, "t", out, f"results_dir={sandbox / 'results'}", "--pruner", "threshold:0.3",
                 "--sampler", "random", f"engine.checkpoint_dir={sandbox / 'ckpt'}", "--sampler-seed", "0")
    torch.set_num_threads(2)
    assert tune.main(args + ["--n-trials", "3"]) == 0
    assert torch.get_num_threads() == 2  # --threads 1 held only during main()

    trials = _study(storage, "t").trials
    assert [t.state.name for t in trials] == ["PRUNED", "PRUNED", "COMPLETE"]
    assert trials[0].user_attrs["reason"].startswith("pruned: val_acc")
    assert 1 in trials[0].intermediate_values and trials[0].intermediate_values[1] < 0.3
    assert trials[1].user_attrs["reason"].startswith("diverged: ") and "non-finite" in trials[1].user_attrs["reason"]
    assert sorted(trials[2].intermediate_values) == [1, 2, 3]  # one report per round

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["complete"], summary["pruned"], summary["failed"]) == (1, 2, 0)
    assert summary["pruned_by"] == {"pruned": 1, "diverged": 1, "infeasible": 0}
    assert summary["best"]["trial"] == 2 and summary["best"]["val_acc"] == pytest.approx(trials[2].value)
    assert 0.0 < summary["best_test_acc"] <= 1.0
    for png in ("history.png", "parallel_coordinate.png", "intermediate_values.png"):
        assert (out / png).stat().st_size > 1000
    assert any("importances" in n for n in summary["plot_notes"])  # one complete trial: skipped, said so
    assert "Best trial 2" in capsys.readouterr().out
    csv = (out / "trials.csv").read_text().splitlines()
    assert {"user_attrs_reason", "user_attrs_overrides", "user_attrs_algorithm"} <= set(csv[0].split(","))
    assert "diverged: " in csv[2]

    # MLflow: one parent, one nested run per trial with the Optuna state mapped to the run status
    client, parents = _runs("t", "study")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    assert parents[0].data.metrics["best_test_acc"] == pytest.approx(summary["best_test_acc"])
    _, children = _runs("t", "trial")
    by_trial = {int(r.data.tags["optuna_trial"]): r for r in children}
    assert {k: (r.info.status, r.data.tags["optuna_state"]) for k, r in by_trial.items()} == {
        0: ("KILLED", "PRUNED"), 1: ("KILLED", "PRUNED"), 2: ("FINISHED", "COMPLETE")}
    assert by_trial[1].data.tags["failure_reason"].startswith("diverged: ")
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in children)
    assert [m.step for m in client.get_metric_history(by_trial[2].info.run_id, "val/acc")] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(parent)}
    assert {"best.yaml", "summary.md", "trials.csv", "history.png"} <= artifacts

    # the same command resumes: more trials in the same study, still one parent run; with --no-test the
    # cached test accuracy of the unchanged best is still reported
    study = _study(storage, "t")
    for _ in range(2):
        study.enqueue_trial({"train.lr": 1e-5})
    assert tune.main(args + ["--n-trials", "2", "--no-test"]) == 0
    assert [t.number for t in _study(storage, "t").trials] == [0, 1, 2, 3, 4]
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["best"]["trial"] == 2 and resumed["best_test_acc"] == summary["best_test_acc"]
    _, parents = _runs("t", "study")
    assert [p.info.run_id for p in parents] == [parent]
    assert len(_runs("t", "trial")[1]) == 5

    # other settings on the same study are refused before any trial
    capsys.readouterr()
    assert tune.main(args + ["--n-trials", "1", "--seeds", "2"]) == 2
    assert "seeds" in _one_line_error(capsys)
    assert len(_study(storage, "t").trials) == 5

    # best.yaml: the command it prints, run from the project root, reproduces the tuned (validation) value
    best_yaml = out / "best.yaml"
    text = best_yaml.read_text()
    assert f"--params {best_yaml.resolve()}" in (out / "summary.md").read_text()  # outside the project: absolute
    assert "dvc exp run -S '++experiments.t_best=" in text
    command = next(line.lstrip("# ").split("  #")[0].strip() for line in text.splitlines() if "t_best_val " in line)
    # the trials ran with 1 torch thread (--threads); 2 threads change the losses by ~1e-7: the command pins it
    assert command == f"OMP_NUM_THREADS=1 python -m pipeline.train --grid t_best_val --params {best_yaml.resolve()}"
    res = subprocess.run([sys.executable] + command.split()[2:], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, check=False, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads((sandbox / "results" / "t_best_val" / "metrics.json").read_text())
    assert metrics["final_acc_mean"] == pytest.approx(summary["best"]["val_acc"], abs=1e-9)
    # ... and the test experiment the reported best_test_acc (in-process, threads as in the sweep)
    torch.set_num_threads(1)
    assert train.main(["--grid", "t_best", "--params", str(best_yaml)]) == 0
    metrics = json.loads((sandbox / "results" / "t_best" / "metrics.json").read_text())
    assert metrics["final_acc_mean"] == pytest.approx(summary["best_test_acc"], abs=1e-9)


def _patch_build(monkeypatch, on_round):
    """Add ``on_round(build_number, round)`` as a callback of every simulator built."""
    from fl_core.engine import factory

    builds = {"n": 0}
    real_build = factory.build_simulator

    def build(*args, callbacks=None, **kw):
        builds["n"] += 1
        n = builds["n"]
        return real_build(*args, callbacks=list(callbacks or []) + [lambda r, row: on_round(n, r)], **kw)

    monkeypatch.setattr(factory, "build_simulator", build)


def test_infeasible_settings_are_pruned_and_other_training_errors_fail_the_trial(sandbox, monkeypatch, capsys):
    def boom(build, r):
        if build == 2 and r == 2:
            raise ValueError("boom")  # a ValueError that is not InfeasibleSetting: a bug, not a setting

    _patch_build(monkeypatch, boom)
    space, storage = sandbox / "bug.yaml", sandbox / "i.log"
    space.write_text("base: [algorithm=fedbug, algorithm.fedbug.schedule=code, " + ", ".join(TINY) + "]\n"
                     "params: {algorithm.fedbug.gu_percentage: {type: float, low: 0.0, high: 1.0}}\n")
    study = optuna.create_study(study_name="i", storage=open_storage(str(storage)), direction="maximize")
    for p in (0.01, 1.0, 1.0):  # code schedule: P * K_i = 0.17 < M = 3 units of the MLP; then a valid P (twice)
        study.enqueue_trial({"algorithm.fedbug.gu_percentage": p})
    args = _args(space, storage, "i", sandbox / "out", "--n-trials", "3", "--pruner", "none", "--no-test",
                 "--no-mlflow", "--batch", "1")  # one trial at a time (a batch: tests/test_sweeps_batch.py)
    assert tune.main(args) == 0  # the study goes on after a failed trial
    trials = _study(storage, "i").trials
    assert [t.state.name for t in trials] == ["PRUNED", "FAIL", "COMPLETE"]
    assert trials[0].user_attrs["reason"].startswith("infeasible: algorithm.fedbug.schedule=code needs")
    assert trials[1].user_attrs["reason"] == "error: ValueError: boom"
    assert "trial 1: error: ValueError: boom (at " in capsys.readouterr().err  # with where it was raised
    summary = json.loads((sandbox / "out" / "summary.json").read_text())
    assert summary["pruned_by"] == {"pruned": 0, "diverged": 0, "infeasible": 1}
    assert summary["failed_by"] == {"error": 1, "interrupted": 0, "stale": 0}


def test_an_error_outside_the_trials_still_writes_the_outputs(sandbox, monkeypatch, capsys):
    calls = {"n": 0}
    real = TrialRunner.experiment_overrides

    def sample_then_crash(self, trial):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler exploded")
        return real(self, trial)

    monkeypatch.setattr(TrialRunner, "experiment_overrides", sample_then_crash)
    space, storage, out = sandbox / "lr.yaml", sandbox / "e.log", sandbox / "out"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-2").replace("1.0e+6", "0.2"))
    assert tune.main(_args(space, storage, "e", out, "--n-trials", "3", "--pruner", "none", "--batch", "1")) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err  # a bug keeps its traceback, then one line (once "error: error: RuntimeError: ...")
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        f"error: RuntimeError: sampler exploded (at {Path(__file__).resolve()}:"
        f"{sample_then_crash.__code__.co_firstlineno + 3} in sample_then_crash); writing the outputs of the trials "
        "done"]
    assert [t.state.name for t in _study(storage, "e").trials] == ["COMPLETE", "FAIL"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "RuntimeError: sampler exploded" in summary["error"]
    assert summary["complete"] == 1 and summary["best_test_acc"] is None  # no test run after an error
    assert (out / "best.yaml").exists() and (out / "history.png").exists()
    assert "Stopped by an error" in (out / "summary.md").read_text()
    assert _runs("e", "study")[1][0].info.status == "FAILED"


def test_ctrl_c_ends_the_running_trial_and_keeps_the_study(sandbox, monkeypatch):
    def interrupt(build, r):  # Ctrl-C in round 2 of the second trial
        if build == 2 and r == 2:
            raise KeyboardInterrupt

    _patch_build(monkeypatch, interrupt)
    space, storage, out = sandbox / "lr.yaml", sandbox / "c.log", sandbox / "out"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-2").replace("1.0e+6", "0.2"))
    args = _args(space, storage, "c", out, "--n-trials", "3", "--pruner", "none", "--sampler-seed", "0", "--batch", "1")
    assert tune.main(args) == tune.EXIT_INTERRUPTED
    trials = _study(storage, "c").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    assert "interrupted" in trials[1].user_attrs["reason"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["complete"] == 1 and summary["best_test_acc"] is None
    _, children = _runs("c", "trial")
    assert {int(r.data.tags["optuna_trial"]): r.info.status for r in children} == {0: "FINISHED", 1: "KILLED"}
    assert _runs("c", "study")[1][0].info.status == "KILLED"


def test_trials_left_running_by_a_dead_process_are_marked_stale(sandbox, capsys):
    space, storage = sandbox / "lr.yaml", sandbox / "st.log"
    space.write_text(LR_SPACE)
    study = optuna.create_study(study_name="st", storage=open_storage(str(storage)), direction="maximize")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owners = [(HOST, dead.pid), (HOST, os.getpid()), ("another-machine", dead.pid)]
    for host, pid in owners:  # killed here, still running here, running elsewhere
        t = study.ask()
        t.set_user_attr("host", host)
        t.set_user_attr("pid", pid)
    args = _args(space, storage, "st", sandbox / "out", "--n-trials", "0", "--no-mlflow")
    assert tune.main(args + ["--no-fail-stale"]) == 0
    assert [t.state.name for t in _study(storage, "st").trials] == ["RUNNING"] * 3
    assert tune.main(args) == 0  # default for a journal file: on
    trials = _study(storage, "st").trials
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "RUNNING"]
    assert trials[0].user_attrs["reason"] == STALE_REASON
    assert "trial(s) 0 were left RUNNING" in capsys.readouterr().err


@pytest.mark.slow  # ~18 s: two spawned workers (tests/test_postgres.py runs four machines, also slow)
def test_two_workers_share_one_storage_without_duplicate_trials(sandbox, capfd):
    space, storage = sandbox / "lr.yaml", sandbox / "w.log"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-3").replace("1.0e+6", "0.5"))
    args = ["--space", str(space), "--storage", str(storage), "--study-name", "w", "--out", str(sandbox / "out"),
            "--workers", "2", "--n-trials", "4", "--pruner", "none", "--sampler", "random", "--sampler-seed", "0",
            "--no-test", "--no-mlflow"]  # MLflow with workers: one SQLite store written by 3 processes, not here
    assert tune.main(args) == 0
    trials = _study(storage, "w").trials
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert {t.user_attrs["worker"] for t in trials} == {1, 2}
    assert all(t.state.name == "COMPLETE" for t in trials)
    captured = capfd.readouterr()
    assert "w1 trial" in captured.err and "w2 trial" in captured.err  # trial lines on stderr, as in-process
    assert "w1 trial" not in captured.out and "w2 trial" not in captured.out


def test_the_parent_run_stays_running_while_trials_of_other_machines_run(sandbox, capsys):
    """Several machines on one storage: a process that finishes while other processes' trials run leaves the
    MLflow parent run RUNNING; the one that finishes when none runs ends it."""
    space, storage = sandbox / "lr.yaml", sandbox / "m.log"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-3").replace("1.0e+6", "0.5"))
    study = optuna.create_study(study_name="m", storage=open_storage(str(storage)), direction="maximize")
    elsewhere = study.ask()  # a trial another machine runs (--fail-stale leaves it alone)
    elsewhere.set_user_attr("host", "another-machine")
    elsewhere.set_user_attr("pid", 1)
    args = _args(space, storage, "m", sandbox / "out", "--pruner", "none", "--no-test")
    assert tune.main(args + ["--n-trials", "1"]) == 0
    assert "note: 1 trial(s) of the study still RUNNING" in capsys.readouterr().err
    client, parents = _runs("m", "study")
    assert [p.info.status for p in parents] == ["RUNNING"]
    assert parents[0].data.metrics["trials_complete"] == 1  # its outputs are logged all the same
    study.tell(elsewhere, state=optuna.trial.TrialState.PRUNED)  # the other machine is done (no value: never best)
    assert tune.main(args + ["--n-trials", "1"]) == 0
    assert "still RUNNING" not in capsys.readouterr().err
    assert [p.info.status for p in _runs("m", "study")[1]] == ["FINISHED"]
    assert client.get_run(parents[0].info.run_id).data.metrics["trials_complete"] == 2


def test_multi_objective_study_has_a_pareto_front_and_no_pruning(sandbox):
    space, out = sandbox / "algos.yaml", sandbox / "out"
    space.write_text(f"base: [{', '.join(TINY)}]\n"  # FedBCGD uploads less than FedAvg: a front of 2 algorithms
                     "params: {algorithm: {type: categorical, choices: [fedavg, fedbcgd]}}\n"
                     "conditional: {algorithm: {fedbcgd: {base: [algorithm.fedbcgd.blocks=2], params: "
                     "{algorithm.fedbcgd.lam: {type: float, low: 0.4, high: 0.9}}}}}\n")
    args = _args(space, sandbox / "mo.log", "mo", out, "--objectives", "acc,uplink", "--n-trials", "4",
                 "--sampler", "random", "--sampler-seed", "2", "--no-test", "--no-mlflow")
    assert tune.main(args) == 0
    study = _study(sandbox / "mo.log", "mo")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert study.metric_names == ["val_acc", "uplink"]
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert complete and all(not t.intermediate_values for t in study.trials)
    summary = json.loads((out / "summary.json").read_text())
    front = summary["pareto_front"]
    assert front

    def dominates(a, b):  # maximise accuracy, minimise uplink
        return a[0] >= b[0] and a[1] <= b[1] and a != b

    for entry in front:
        assert not any(dominates(t.values, entry["values"]) for t in complete)
    for t in complete:  # the uplink objective is cumulative floats per client in units of d
        assert t.values[1] == pytest.approx(t.user_attrs["uplink_d"]) and 0 < t.values[1] <= 3 * 2 + 1e-9
    assert (out / "pareto_front.png").stat().st_size > 1000
