"""Exactly one clean run per experiment and seed, whatever is killed: fault injection at every named point.

Each case runs a two-seed SCAFFOLD grid experiment in a process (a fork of this one, or a new
interpreter) that ``FL_FAULT`` kills (SIGKILL) or interrupts (SIGINT) at a named point of
:mod:`fl_core.store.faults`, then runs the same command again
(in this process) and checks the end state against an uninterrupted run: the same final models,
one MLflow parent with one child per seed, every (metric, step) once (the parent's seed-mean curves
included), one complete MLflow model per child and the parent's best-child tags, every run FINISHED,
no temporary or staging files, no attempt folder left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fl_core.store import faults

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 4
SEEDS = [1, 2]
GRID = {
    "seeds": SEEDS,
    "partition": {"num_clients": 4},
    "train": {"rounds": ROUNDS, "participation": 1.0, "local_epochs": 1, "batch_size": 64, "lr": 0.05},
    "engine": {"checkpoint_every": 1, "progress": False},
    "tracking": {"log_every": 1},
    "experiments": {"exp": {"algorithm": "scaffold", "partition": "dirichlet"}},
}


def _project(tmp: Path, grid=GRID, store: Path | None = None) -> Path:
    """A project folder with ``params.yaml`` and, from ``store``, a copy of an empty MLflow store."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    if store is not None:
        shutil.copy(store, tmp / "mlflow.db")
    return tmp


def _env(tmp: Path, fault: str | None = None) -> dict:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           "PYTHONPATH": str(ROOT), "FL_PROJECT_ROOT": str(ROOT),
           "OMP_NUM_THREADS": "1"}  # as this process (tests/conftest.py): float sums depend on the thread count
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    return env


def _subprocess(tmp: Path, args, fault=None):
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=tmp, env=_env(tmp, fault),
                          capture_output=True, check=False, text=True, timeout=300)


def _fork(tmp: Path, args, env: dict, stderr: Path | None = None) -> int:
    """``pipeline.train``'s main(args) in a forked copy of this process (no interpreter start-up) with ``env`` in its
    environment (``FL_FAULT`` removed unless ``env`` names it); its pid (see :func:`_wait`). Its stderr goes to
    ``stderr``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.chdir(tmp)
            os.environ.update(env)
            if faults.ENV not in env:
                os.environ.pop(faults.ENV, None)
            torch.set_num_threads(1)  # as every run here: float sums depend on the thread count
            # Ctrl-C as at a terminal, even when pytest was started with SIGINT ignored (a shell's background job)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if stderr else devnull, 2)
            # not pytest's capture of this process; open until os._exit below
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            from pipeline.train import main

            code = main(args)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    """``-signal`` when a signal ended the forked command, else its exit status."""
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _forked(tmp: Path, args, fault: str | None = None, stderr: Path | None = None) -> int:
    """The command in a forked copy of this process, with ``FL_FAULT=fault``; returns ``-signal`` when a signal
    ended it, else its exit status. Its stderr goes to ``stderr``."""
    return _wait(_fork(tmp, args, _env(tmp, fault), stderr))


def _in_process(tmp: Path, args, monkeypatch) -> int:
    """The same command in this process (no interpreter start-up): a plain rerun."""
    from pipeline.train import main

    with monkeypatch.context() as m:
        m.chdir(tmp)
        for k, v in _env(tmp).items():
            if os.environ.get(k) != v:
                m.setenv(k, v)
        m.delenv(faults.ENV, raising=False)
        try:
            return main(args)
        except SystemExit as exit_:
            return int(exit_.code)


def _earlier_outputs(tmp: Path) -> None:
    """``results/exp/`` as an earlier run of another config left it: its experiment.json and a model of a seed
    this run does not train (the project's own files, so the run may replace them: fl_core.store.owned)."""
    out = tmp / "results" / "exp"
    (out / "models").mkdir(parents=True)
    (out / "experiment.json").write_text(json.dumps({"experiment": "exp", "fingerprint": "an earlier config"}))
    (out / "models" / "seed_9.pt").write_text("a model of an earlier run")


def _models(tmp: Path) -> dict:
    return {s: torch.load(tmp / "results" / "exp" / "models" / f"seed_{s}.pt") for s in SEEDS}


def _mlflow_state(tmp: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fl-pipeline")
    runs = client.search_runs([exp.experiment_id])
    return client, runs


def _assert_clean(tmp: Path, reference: dict) -> None:
    """The end state every kill must lead to after one rerun."""
    from mlflow.entities import LoggedModelStatus

    got = _models(tmp)
    for s in SEEDS:
        assert got[s].keys() == reference[s].keys()
        for k in got[s]:
            assert torch.equal(got[s][k], reference[s][k]), (s, k)
    metrics = json.loads((tmp / "results" / "exp" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["seeds"] == SEEDS
    assert not (tmp / "results" / "exp" / "models" / "seed_9.pt").exists()  # the earlier outputs were replaced whole

    client, runs = _mlflow_state(tmp)
    parents = [r for r in runs if r.data.tags.get("fl.role") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(runs) == 1 + len(SEEDS)
    assert sorted(int(c.data.tags["fl.seed"]) for c in children) == SEEDS
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert {r.info.status for r in runs} == {"FINISHED"}
    for c in children:
        for key in c.data.metrics:
            steps = [m.step for m in client.get_metric_history(c.info.run_id, key)]
            assert len(steps) == len(set(steps)), (key, steps)  # each (key, step) once
            if key.startswith("summary_"):
                assert steps == [0]
        assert sorted(m.step for m in client.get_metric_history(c.info.run_id, "test/acc")) == list(range(1, ROUNDS + 1))
        models = client.search_logged_models([c.info.experiment_id], filter_string=f"source_run_id = '{c.info.run_id}'")
        assert [(m.name, m.status) for m in models] == [("model", LoggedModelStatus.READY)]  # one, complete
    parent = parents[0]
    assert parent.data.metrics["final_acc_mean"] == pytest.approx(metrics["final_acc_mean"])
    for key in ("test/acc", "test/loss", "train/loss", "comm/up_floats"):  # the seed-mean curves, each step once
        assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, key)) == list(range(1, ROUNDS + 1))
    best = {c.data.tags["fl.seed"]: c.info.run_id for c in children}[parent.data.tags["fl.best_seed"]]
    assert parent.data.tags["fl.best_model_uri"] == f"runs:/{best}/model"

    leftovers = [p for p in tmp.rglob("*") if p.name.endswith((".tmp", ".prev", ".corrupt", ".staging", ".old",
                                                                 ".removed", ".holder", ".init"))]
    assert leftovers == []
    assert not (tmp / "checkpoints" / "exp").exists()  # the attempt folder is gone


@pytest.fixture(scope="module")
def reference(tmp_path_factory, empty_store):
    """Final models of an uninterrupted run."""
    tmp = _project(tmp_path_factory.mktemp("reference"), store=empty_store)
    assert _forked(tmp, ["--grid", "exp"]) == 0
    return _models(tmp)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(faults.POINTS))
def test_kill_at_every_point_leaves_one_clean_run(tmp_path, point, reference, monkeypatch, empty_store):
    tmp = _project(tmp_path, store=None if point == "store_init" else empty_store)
    _earlier_outputs(tmp)
    # the second hit of the checkpoint points, so that a previous checkpoint exists
    fault = f"{point}@2" if point in ("checkpoint_write", "checkpoint_swap") else point
    assert _forked(tmp, ["--grid", "exp"], fault) == -signal.SIGKILL, point
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _assert_clean(tmp, reference)


POPULATION = {**GRID, "engine": {**GRID["engine"], "executor": "vectorized"}}  # the seeds train as one population


@pytest.fixture(scope="module")
def population_reference(tmp_path_factory, empty_store):
    """Final models of an uninterrupted run whose two seeds train as one population."""
    tmp = _project(tmp_path_factory.mktemp("population"), POPULATION, store=empty_store)
    assert _forked(tmp, ["--grid", "exp"]) == 0
    return _models(tmp)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["checkpoint_write@4", "after_last_round", "after_record", "after_child_finished",
                                   "after_outputs"])
def test_a_kill_inside_a_population_leaves_one_clean_run(tmp_path, fault, population_reference, monkeypatch,
                                                         empty_store):
    """checkpoint_write@4: seed 1 holds round 2, seed 2 round 1 (the rerun catches seed 2 up); after_record: seed 1
    is recorded, seed 2 resumes alone."""
    tmp = _project(tmp_path, POPULATION, store=empty_store)
    _earlier_outputs(tmp)
    assert _forked(tmp, ["--grid", "exp"], fault) == -signal.SIGKILL, fault
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _assert_clean(tmp, population_reference)


# ``fl-train -m`` over eta_l on the vectorised executor: two experiments' seeds (4 runs) train as one population
LR_GRID = ["-m", "train.lr=0.05,0.1", "name=g${train.lr}", "seed=1,2", "algorithm=scaffold", "partition=dirichlet",
           "partition.num_clients=4", f"train.rounds={ROUNDS}", "train.participation=1.0", "train.local_epochs=1",
           "train.batch_size=64", "engine.checkpoint_every=1", "engine.progress=false", "tracking.log_every=1",
           "engine.executor=vectorized"]
LR_NAMES = ("g0.05", "g0.1")


def _grid_models(tmp: Path, names=LR_NAMES) -> dict:
    return {(n, s): torch.load(tmp / "results" / n / "models" / f"seed_{s}.pt") for n in names for s in SEEDS}


@pytest.fixture(scope="module")
def grid_reference(tmp_path_factory, empty_store):
    """Final models of an uninterrupted ``-m train.lr=...`` population."""
    tmp = _project(tmp_path_factory.mktemp("lr_grid"), store=empty_store)
    assert _forked(tmp, LR_GRID) == 0
    return _grid_models(tmp)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["checkpoint_write@6", "after_record", "after_record@3", "after_outputs"])
def test_a_kill_inside_a_grid_population_leaves_one_clean_run_per_experiment(tmp_path, fault, grid_reference,
                                                                             monkeypatch, empty_store):
    """checkpoint_write@6: the replicas hold rounds 2 and 1; after_record (@3): one (three) of the four runs is
    recorded, the rerun trains the others; after_outputs: one experiment is published, the other finishes on the
    rerun. Every experiment ends with the models of an uninterrupted run, one MLflow parent with one FINISHED child
    per seed, each round logged once, and nothing left behind."""
    tmp = _project(tmp_path, store=empty_store)
    assert _forked(tmp, LR_GRID, fault) == -signal.SIGKILL, fault
    assert _in_process(tmp, LR_GRID, monkeypatch) == 0
    _assert_clean_rows(tmp, grid_reference)


def _assert_clean_rows(tmp: Path, reference: dict, names=LR_NAMES) -> None:
    """Each experiment of ``names`` ends with the ``reference`` models, one MLflow parent with one FINISHED child
    per seed, each round logged once, and nothing left behind."""
    got = _grid_models(tmp, names)
    for key, ref in reference.items():
        assert got[key].keys() == ref.keys()
        assert all(torch.equal(got[key][k], ref[k]) for k in ref), key
    client, runs = _mlflow_state(tmp)
    parents = {r.data.tags["fl.experiment"]: r for r in runs if r.data.tags.get("fl.role") == "parent"}
    assert sorted(parents) == sorted(names) and len(runs) == len(names) * (1 + len(SEEDS))
    assert {r.info.status for r in runs} == {"FINISHED"}
    for parent in parents.values():
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(k.data.tags["fl.seed"]) for k in kids) == SEEDS
        for k in kids:
            steps = [m.step for m in client.get_metric_history(k.info.run_id, "test/acc")]
            assert sorted(steps) == list(range(1, ROUNDS + 1))
    for name in names:
        assert json.loads((tmp / "results" / name / "metrics.json").read_text())["status"] == "ok"
        assert not (tmp / "checkpoints" / name).exists()
    assert [p for p in tmp.rglob("*") if p.name.endswith((".tmp", ".prev", ".staging", ".old", ".removed"))] == []


# a study's grouped DVC stage (python -m pipeline.grid sync-dvc): two rows of params.yaml that differ in eta_l, trained
# by one `--grid lr005,lr01` as one population of 4 replicas
ROW_NAMES = ("lr005", "lr01")
ROWS_GRID = {**POPULATION, "experiments": {name: {"algorithm": "scaffold", "partition": "dirichlet", "train.lr": lr}
                                           for name, lr in zip(ROW_NAMES, (0.05, 0.1))}}
ROWS = ["--grid", ",".join(ROW_NAMES)]


@pytest.fixture(scope="module")
def rows_reference(tmp_path_factory, empty_store):
    """Final models of each row of ``ROWS_GRID`` trained alone (``--grid lr005``, then ``--grid lr01``)."""
    tmp = _project(tmp_path_factory.mktemp("rows_alone"), ROWS_GRID, store=empty_store)
    for name in ROW_NAMES:
        assert _forked(tmp, ["--grid", name]) == 0
    return _grid_models(tmp, ROW_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["checkpoint_write@6", "after_record@3", "after_outputs"])
def test_a_kill_inside_a_grouped_grid_stage_leaves_each_row_once(tmp_path, fault, rows_reference, monkeypatch,
                                                                  empty_store):
    """A kill inside ``--grid lr005,lr01`` (replicas at rounds 2 and 1; three of four runs recorded; one row
    published): the same command again ends every row with the models it gets trained alone, one MLflow parent with
    one FINISHED child per seed, each round once, nothing left behind."""
    tmp = _project(tmp_path, ROWS_GRID, store=empty_store)
    assert _forked(tmp, ROWS, fault) == -signal.SIGKILL, fault
    assert _in_process(tmp, ROWS, monkeypatch) == 0
    _assert_clean_rows(tmp, rows_reference, ROW_NAMES)
    assert _in_process(tmp, ROWS, monkeypatch) == 0  # complete: nothing trained again
    _assert_clean_rows(tmp, rows_reference, ROW_NAMES)


@pytest.mark.slow
def test_two_kills_in_a_row_and_a_completed_rerun_does_nothing(tmp_path, reference, monkeypatch, capsys,
                                                               empty_store):
    tmp = _project(tmp_path, store=empty_store)
    assert _forked(tmp, ["--grid", "exp"], "checkpoint_write@3") == -signal.SIGKILL
    assert _forked(tmp, ["--grid", "exp"], "after_child_finished") == -signal.SIGKILL
    _earlier_outputs(tmp)
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _assert_clean(tmp, reference)
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0  # complete: nothing is trained or logged again
    assert "nothing to do" in capsys.readouterr().err
    _assert_clean(tmp, reference)


def _truncate_current(attempt: Path) -> None:
    ck = attempt / "seed_1.pt"
    ck.write_bytes(ck.read_bytes()[:100])


def _garbage_both(attempt: Path) -> None:
    (attempt / "seed_1.pt").write_bytes(b"")
    (attempt / "seed_1.pt.prev").write_bytes(b"not a checkpoint at all")


@pytest.mark.slow
@pytest.mark.parametrize("spoil,moved,resumed", [
    (_truncate_current, ["seed_1.pt"], "exp seed 1: resumed from round 1"),  # the previous checkpoint is used
    (_garbage_both, ["seed_1.pt", "seed_1.pt.prev"], None),  # nothing readable: from scratch
])
def test_unreadable_checkpoints_are_moved_aside(tmp_path, reference, monkeypatch, capsys, spoil, moved, resumed,
                                               empty_store):
    tmp = _project(tmp_path, store=empty_store)
    # killed inside the third checkpoint write of seed 1: seed_1.pt holds round 2, seed_1.pt.prev round 1
    assert _forked(tmp, ["--grid", "exp"], "checkpoint_write@3") == -signal.SIGKILL
    attempt = next((tmp / "checkpoints" / "exp").iterdir())
    assert (attempt / "seed_1.pt").exists() and (attempt / "seed_1.pt.prev").exists()
    assert list(attempt.glob("*.tmp"))  # what the kill left: removed by the next start
    spoil(attempt)
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    err = capsys.readouterr().err
    for name in moved:
        rel = (attempt / name).relative_to(tmp)
        assert f"warning: {rel} is unreadable" in err and f"moved it to {name}.corrupt" in err
    assert err.count("is unreadable") == len(moved)
    if resumed:
        assert resumed in err
    else:
        assert "resumed" not in err
    _assert_clean(tmp, reference)


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_the_rerun_resumes(tmp_path, reference, monkeypatch, capsys, empty_store):
    tmp = _project(tmp_path, store=empty_store)
    log = tmp_path.parent / f"{tmp_path.name}.stderr"
    assert _forked(tmp, ["--grid", "exp"], "before_first_checkpoint@2:INT", stderr=log) == 130  # seed 2, round 1
    err = log.read_text()
    assert err.strip().splitlines()[-1] == "interrupted at round 1; run the same command again to resume"
    assert "Traceback" not in err
    _client, runs = _mlflow_state(tmp)
    assert {r.info.status for r in runs if r.data.tags.get("fl.seed") == "2"} == {"KILLED"}
    assert {r.info.status for r in runs if r.data.tags.get("fl.role") == "parent"} == {"KILLED"}
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _assert_clean(tmp, reference)


@pytest.mark.slow
def test_second_writer_of_the_same_experiment_exits_2_naming_the_holder(tmp_path):
    from fl_core.store.runstore import ExperimentStore

    tmp = _project(tmp_path)
    store = ExperimentStore("exp", "any", tmp / "results", tmp / "checkpoints")
    with store.lock():
        proc = _subprocess(tmp, ["--grid", "exp"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: experiment 'exp' is being written by another process")
    assert f"pid {os.getpid()}" in lines[0]
    assert not (tmp / "results" / "exp").exists() and not (tmp / "mlflow.db").exists()


@pytest.mark.slow
def test_orphaned_runs_are_ended_forked(tmp_path, monkeypatch, empty_store):
    """Runs of a process that is gone (here: a kill before the first checkpoint of a config that is then
    changed) are ended KILLED with a reason when the experiment next starts."""
    tmp = _project(tmp_path, store=empty_store)
    assert _forked(tmp, ["--grid", "exp"], "before_first_checkpoint") == -signal.SIGKILL
    changed = {**GRID, "train": {**GRID["train"], "lr": 0.02}}
    _project(tmp, changed)
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _client, runs = _mlflow_state(tmp)
    old = [r for r in runs if r.info.status != "FINISHED"]
    assert len(old) == 2 and {r.info.status for r in old} == {"KILLED"}  # the first attempt's parent and seed 1
    assert {r.data.tags["fl.end_reason"] for r in old} == {"orphaned: the process that ran it is gone"}
    assert len([r for r in runs if r.info.status == "FINISHED"]) == 1 + len(SEEDS)


@pytest.mark.slow
def test_diverging_experiment_completes_its_stage_and_the_report_names_it(tmp_path, monkeypatch, capsys,
                                                                          empty_store):
    """A grid entry that diverges (lr 100) ends its `--grid` stage with exit 0 and `status: failed`; the
    other experiments and the report still run; a single CLI run of it exits 1."""
    grid = {**GRID, "seeds": [1], "engine": {"checkpoint_every": 2, "progress": False},
            "experiments": {"good": {"algorithm": "fedavg", "partition": "iid"},
                            "bad": {"algorithm": "fedavg", "partition": "iid", "train.lr": 100}}}
    tmp = _project(tmp_path, grid, store=empty_store)
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "bad"], monkeypatch) == 0
    err = capsys.readouterr().err
    assert "error: bad seed 1 FAILED: non-finite" in err and "bad: FAILED (seed 1: non-finite" in err
    assert _in_process(tmp, ["--grid", "good"], monkeypatch) == 0
    m = json.loads((tmp / "results" / "bad" / "metrics.json").read_text())
    assert m["status"] == "failed" and m["failed_seeds"] == [1] and m["seeds"] == []
    assert json.loads((tmp / "results" / "bad" / "experiment.json").read_text())["failures"]["1"].startswith("non-finite")
    for out in ("runs.csv", "rounds.csv", "curves.png", "config.yaml", "models", "details/seed_1.csv"):
        assert (tmp / "results" / "bad" / out).exists(), out  # every output DVC expects
    _client, runs = _mlflow_state(tmp)
    bad = [r for r in runs if r.data.tags.get("fl.experiment") == "bad"]
    assert sorted(r.info.status for r in bad) == ["FAILED", "FAILED"]
    assert not (tmp / "checkpoints" / "bad").exists()

    from pipeline.report import main as report_main

    with monkeypatch.context() as m_:
        m_.chdir(tmp)
        assert report_main([]) == 0
    report = (tmp / "results" / "report.md").read_text()
    assert "## Failed" in report and "- `bad`: FAILED: seed 1: non-finite" in report
    assert json.loads((tmp / "results" / "good" / "metrics.json").read_text())["status"] == "ok"

    capsys.readouterr()
    assert _in_process(tmp, ["train.lr=100", "partition=iid", "seed=1", "name=single", "engine.progress=false",
                             "partition.num_clients=4", "train.rounds=4", "train.participation=1.0",
                             "train.local_epochs=1", "train.batch_size=64"], monkeypatch) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("single: FAILED (seed 1: non-finite")
