"""sweeps/tune.py: search spaces, pruning, diverging trials, resuming, workers, MLflow and the best YAML.

Every study runs on digits with an MLP, 4 clients and 3 rounds (well under a second per trial);
storage, outputs and the MLflow store live under tmp_path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from sweeps import tune

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=mlp", "partition.num_clients=4", "train.rounds=3", "train.local_epochs=1", "train.batch_size=16",
        "train.participation=1.0"]
LR_SPACE = """\
description: local learning rate on a tiny digits run (tests)
base: [model=mlp, partition.num_clients=4, train.rounds=3, train.local_epochs=1, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-6, high: 1.0e+6, log: true}
"""


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A private MLflow store and working directory (relative outputs of pipeline.train land here)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _study(storage: Path, name: str):
    return optuna.load_study(study_name=name, storage=tune.open_storage(str(storage)))


def _runs(study_name: str, role: str):
    from mlflow.tracking import MlflowClient

    import os

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("fl-pipeline-sweeps")
    runs = client.search_runs([exp.experiment_id], f"tags.optuna_study = '{study_name}' and tags.sweep_role = '{role}'")
    return client, runs


def _args(space, storage, name, out, *extra):
    return ["--space", str(space), "--storage", str(storage), "--study-name", name, "--out", str(out), "--quiet",
            *extra]


# --------------------------------------------------------------------------- CLI and spaces


def test_help_lists_the_options():
    res = subprocess.run([sys.executable, str(ROOT / "sweeps" / "tune.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    for opt in ("--space", "--n-trials", "--timeout", "--workers", "--storage", "--study-name", "--sampler",
                "--pruner", "--seeds", "--objectives", "KEY=VALUE"):
        assert opt in res.stdout
    assert "fedbug" in res.stdout and "cross" in res.stdout  # the shipped spaces are named


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps" / "spaces").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_space_file_loads_and_composes(path):
    from omegaconf import OmegaConf

    space = tune.load_space(str(path))
    cfg = tune.check_space(space, [])
    assert cfg.dataset.validation_fraction == tune.VALIDATION_FRACTION
    assert space.description
    for key in space.keys():
        if "." in key:  # a value key: it exists in the config schema
            assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key


def test_shipped_spaces_search_the_issue_keys():
    keys = {p.stem: set(tune.load_space(p.stem).keys()) for p in (ROOT / "sweeps" / "spaces").glob("*.yaml")}
    assert {"algorithm.fedbug.gu_percentage", "algorithm.fedbug.schedule", "algorithm.name"} <= keys["fedbug"]
    assert {"algorithm.fednlr.mu0", "algorithm.fednlr.a1", "algorithm.fednlr.a2",
            "algorithm.fednlr.depth_term"} <= keys["fednlr"]
    assert {"algorithm.fedbcgd.lam", "algorithm.fedbcgd.blocks"} <= keys["fedbcgd"]
    assert keys["lr"] == {"train.lr"}
    cross = tune.load_space("cross")
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
]


@pytest.mark.parametrize("text,message", BAD_SPACES, ids=[m for _, m in BAD_SPACES])
def test_bad_space_files_give_one_line_naming_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(tune.SpaceError) as err:
        tune.load_space(str(path))
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
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.yaml" in err and message in err and "\n" not in err
    assert not (tmp_path / "s.log").exists()  # nothing was started


def test_overrides_precedence_and_conditional_sampling():
    runner = tune.TrialRunner(tune.Settings(space=str(tune.space_path("cross")), overrides=["train.rounds=7"],
                                            seeds=[1], objectives=["acc"], study_name="x", storage="unused"))
    trial = optuna.trial.FixedTrial({"algorithm": "fedbug", "train.lr": 0.125,
                                     "algorithm.fedbug.gu_percentage": 0.3})
    ovs = runner.experiment_overrides(trial)
    assert ovs[0] == f"dataset.validation_fraction={tune.VALIDATION_FRACTION}"
    assert "train.rounds=7" in ovs and "train.rounds=20" not in ovs  # the command line beats the space's base
    assert ovs[-3:] == ["algorithm=fedbug", "train.lr=0.125", "algorithm.fedbug.gu_percentage=0.3"]
    assert not any(o.startswith("algorithm.fedprox") or o.startswith("algorithm.fednlr") for o in ovs)
    with pytest.raises(tune.SpaceError, match="train.lr is searched"):
        tune.check_space(tune.load_space("cross"), ["train.lr=0.1"])


def test_best_yaml_entries_round_trip_through_the_grid(tmp_path):
    from pipeline.grid import load_grid

    ovs = ["algorithm=fedbug", "algorithm.wrappers=[fedbug]", "train.lr=1e-05", "train.grad_clip=null",
           "engine.progress=false", f"algorithm.fedbug.gu_percentage={0.1 + 0.2!r}", "+experiment=fedbug_cifar10"]
    doc = {"seeds": [1], "experiments": {"e": tune.overrides_mapping(ovs)}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_grid(tmp_path / "p.yaml").experiments["e"] == ovs
    assert tune.merge_overrides(["a=1", "b=2"], ["+a=3"]) == ["b=2", "+a=3"]


# --------------------------------------------------------------------------- studies


def test_study_prunes_survives_divergence_resumes_and_its_best_yaml_reproduces(sandbox, capsys):
    from pipeline import train

    space, storage, out = sandbox / "lr.yaml", sandbox / "studies" / "t.log", sandbox / "out"
    space.write_text(LR_SPACE)
    study = optuna.create_study(study_name="t", storage=tune.open_storage(str(storage)), direction="maximize")
    for lr in (1e-5, 1e6, 0.1):  # far too small (pruned), diverging (non-finite loss), good
        study.enqueue_trial({"train.lr": lr})
    args = _args(space, storage, "t", out, "--pruner", "threshold:0.3", "--sampler", "random", "--sampler-seed", "0")
    assert tune.main(args + ["--n-trials", "3"]) == 0

    trials = _study(storage, "t").trials
    assert [t.state.name for t in trials] == ["PRUNED", "PRUNED", "COMPLETE"]
    assert trials[0].user_attrs["reason"].startswith("pruned: val_acc")
    assert 1 in trials[0].intermediate_values and trials[0].intermediate_values[1] < 0.3
    assert "non-finite" in trials[1].user_attrs["reason"]
    assert sorted(trials[2].intermediate_values) == [1, 2, 3]  # one report per round

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["complete"], summary["pruned"], summary["failed"]) == (1, 2, 0)
    assert summary["best"]["trial"] == 2 and summary["best"]["val_acc"] == pytest.approx(trials[2].value)
    assert 0.0 < summary["best_test_acc"] <= 1.0
    for png in ("history.png", "parallel_coordinate.png", "intermediate_values.png"):
        assert (out / png).stat().st_size > 1000
    assert any("importances" in n for n in summary["plot_notes"])  # one complete trial: skipped, said so
    assert "Best trial 2" in capsys.readouterr().out

    # MLflow: one parent, one nested run per trial with the Optuna state mapped to the run status
    client, parents = _runs("t", "study")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    assert parents[0].data.metrics["best_test_acc"] == pytest.approx(summary["best_test_acc"])
    _, children = _runs("t", "trial")
    by_trial = {int(r.data.tags["optuna_trial"]): r for r in children}
    assert {k: (r.info.status, r.data.tags["optuna_state"]) for k, r in by_trial.items()} == {
        0: ("KILLED", "PRUNED"), 1: ("KILLED", "PRUNED"), 2: ("FINISHED", "COMPLETE")}
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in children)
    assert [m.step for m in client.get_metric_history(by_trial[2].info.run_id, "val_acc")] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(parent)}
    assert {"best.yaml", "summary.md", "history.png"} <= artifacts

    # the same command resumes: more trials in the same study, still one parent run
    assert tune.main(args + ["--n-trials", "2"]) == 0
    numbers = [t.number for t in _study(storage, "t").trials]
    assert numbers == [0, 1, 2, 3, 4]
    _, parents = _runs("t", "study")
    assert [p.info.run_id for p in parents] == [parent]
    assert len(_runs("t", "trial")[1]) == 5

    # other settings on the same study are refused before any trial
    assert tune.main(args + ["--n-trials", "1", "--seeds", "2"]) == 2
    assert "seeds" in capsys.readouterr().err
    assert len(_study(storage, "t").trials) == 5

    # the best YAML runs through the pipeline and reproduces the tuned (validation) and test values
    summary = json.loads((out / "summary.json").read_text())
    best_yaml = out / "best.yaml"
    assert "dvc exp run -S '++experiments.t_best=" in best_yaml.read_text()
    assert train.main(["--grid", "t_best_val", "--params", str(best_yaml)]) == 0
    metrics = json.loads((sandbox / "results" / "t_best_val" / "metrics.json").read_text())
    assert metrics["final_acc_mean"] == pytest.approx(summary["best"]["val_acc"], abs=1e-12)
    assert train.main(["--grid", "t_best", "--params", str(best_yaml)]) == 0
    metrics = json.loads((sandbox / "results" / "t_best" / "metrics.json").read_text())
    assert metrics["final_acc_mean"] == pytest.approx(summary["best_test_acc"], abs=1e-12)


def test_an_infeasible_combination_is_pruned_with_its_reason(sandbox):
    space, storage = sandbox / "bug.yaml", sandbox / "i.log"
    space.write_text("base: [algorithm=fedbug, algorithm.fedbug.schedule=code, " + ", ".join(TINY) + "]\n"
                     "params: {algorithm.fedbug.gu_percentage: {type: float, low: 0.0, high: 1.0}}\n")
    study = optuna.create_study(study_name="i", storage=tune.open_storage(str(storage)), direction="maximize")
    for p in (0.01, 1.0):  # code schedule: P * K_i = 0.17 < M = 3 units of the MLP; then a valid P
        study.enqueue_trial({"algorithm.fedbug.gu_percentage": p})
    args = _args(space, storage, "i", sandbox / "out", "--n-trials", "2", "--pruner", "none", "--no-test")
    assert tune.main(args) == 0
    trials = _study(storage, "i").trials
    assert [t.state.name for t in trials] == ["PRUNED", "COMPLETE"]
    assert trials[0].user_attrs["reason"].startswith("infeasible: algorithm.fedbug.schedule=code needs")
    summary = json.loads((sandbox / "out" / "summary.json").read_text())
    assert summary["pruned_by"] == {"pruned": 0, "diverged": 0, "infeasible": 1}
    _, children = _runs("i", "trial")
    reasons = {int(r.data.tags["optuna_trial"]): r.data.tags.get("failure_reason", "") for r in children}
    assert reasons[0].startswith("infeasible:") and reasons[1] == ""


def test_two_workers_share_one_storage_without_duplicate_trials(sandbox):
    space, storage = sandbox / "lr.yaml", sandbox / "w.log"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-3").replace("1.0e+6", "0.5"))
    args = _args(space, storage, "w", sandbox / "out", "--workers", "2", "--n-trials", "4", "--pruner", "none",
                 "--sampler", "random", "--sampler-seed", "0", "--no-test")
    assert tune.main(args) == 0
    trials = _study(storage, "w").trials
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert {t.user_attrs["worker"] for t in trials} == {1, 2}
    assert all(t.state.name == "COMPLETE" for t in trials)
    _, children = _runs("w", "trial")
    assert sorted(int(r.data.tags["optuna_trial"]) for r in children) == [0, 1, 2, 3]
    assert len(_runs("w", "study")[1]) == 1


def test_multi_objective_study_has_a_pareto_front_and_no_pruning(sandbox):
    out = sandbox / "out"
    args = _args("cross", sandbox / "mo.log", "mo", out, "--objectives", "acc,uplink", "--n-trials", "4",
                 "--sampler", "random", "--sampler-seed", "2", "--no-test", *TINY)
    assert tune.main(args) == 0
    study = _study(sandbox / "mo.log", "mo")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
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


def test_ctrl_c_ends_the_running_trial_and_keeps_the_study(sandbox, monkeypatch):
    from fl_core.engine import factory

    builds = {"n": 0}
    real_build = factory.build_simulator

    def build_then_interrupt(*args, callbacks=None, **kw):  # Ctrl-C in round 2 of the second trial
        builds["n"] += 1

        def interrupt(r, row):
            if builds["n"] == 2 and r == 2:
                raise KeyboardInterrupt

        return real_build(*args, callbacks=list(callbacks or []) + [interrupt], **kw)

    monkeypatch.setattr(factory, "build_simulator", build_then_interrupt)
    space, storage, out = sandbox / "lr.yaml", sandbox / "c.log", sandbox / "out"
    space.write_text(LR_SPACE.replace("1.0e-6", "1.0e-2").replace("1.0e+6", "0.2"))
    args = _args(space, storage, "c", out, "--n-trials", "3", "--pruner", "none", "--sampler-seed", "0")
    assert tune.main(args) == tune.EXIT_INTERRUPTED
    trials = _study(storage, "c").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    assert "interrupted" in trials[1].user_attrs["reason"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["complete"] == 1 and summary["best_test_acc"] is None
    _, children = _runs("c", "trial")
    assert {int(r.data.tags["optuna_trial"]): r.info.status for r in children} == {0: "FINISHED", 1: "KILLED"}
    assert _runs("c", "study")[1][0].info.status == "KILLED"
