"""sweeps/tune.py --batch K: trials asked K at a time and trained as one population (sweeps/batch.py).

Studies run on digits with tiny settings, as tests/test_sweeps.py (whose fixtures and helpers they share): the
option's one-line errors, the same finished trials as one at a time, a trial's value in a batch equal to its value
alone (float64), pruning that stops replicas and refills their slots, a diverged or infeasible replica ending its
trial alone, errors, Ctrl-C, workers, and a batch larger than the memory estimate allows.
"""

from __future__ import annotations

import json

import optuna
import pytest

from sweeps import tune
from sweeps.storage import open_storage
from sweeps.trials import DataCache, TrialRunner, train_seeds

from test_sweeps import LR_SPACE, TINY, _args, _one_line_error, _patch_build, _runs, _study

LR = LR_SPACE.replace("1.0e-6", "1.0e-2").replace("1.0e+6", "0.3")  # values that train


@pytest.fixture
def populations(monkeypatch):
    """Each call of pipeline.experiment.train_population from the batch runner: (trials at the start, whether it
    trained them as one population, the parts at the end: the trials it trained, refills included)."""
    from sweeps import batch

    calls = []
    real = batch.train_population

    def spy(parts, steer, replicas):
        start = len(parts)
        out = real(parts, steer, replicas)
        calls.append((start, out is not None, len(parts)))
        return out

    monkeypatch.setattr(batch, "train_population", spy)
    return calls


def _states(storage, name):
    return [t.state.name for t in _study(storage, name).trials]


# --------------------------------------------------------------------------- the option


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", ""])
def test_bad_batch_values_end_in_one_line(sandbox, capsys, value):
    space = sandbox / "lr.yaml"
    space.write_text(LR)
    assert tune.main(_args(space, sandbox / "s.log", "s", sandbox / "out", "--n-trials", "1", "--batch", value)) == 2
    assert _one_line_error(capsys) == f"error: --batch must be auto or an integer >= 1, got {value!r}"
    assert not (sandbox / "s.log").exists()  # nothing run


def test_a_batch_refuses_an_executor_that_trains_one_trial_at_a_time(sandbox, capsys):
    space = sandbox / "lr.yaml"
    space.write_text(LR)
    args = _args(space, sandbox / "s.log", "s", sandbox / "out", "--n-trials", "1", "--batch", "4",
                 "engine.executor=sequential")
    assert tune.main(args) == 2
    assert _one_line_error(capsys).startswith("error: --batch 4 trains trials together on the vectorised executor; "
                                              "engine.executor=sequential trains them one at a time")


def _needs(space, replicas):
    """The vectorised executor's memory estimate (bytes) for populations of ``replicas`` trials of ``space``'s base."""
    from fl_core.engine import diskstate
    from fl_core.engine.factory import DTYPES, vectorized_fit
    from pipeline.experiment import ExperimentRunner
    from sweeps.spaces import load_space
    from sweeps.trials import resolve_trial

    exp = resolve_trial(load_space(str(space)).experiment_overrides([], ["engine.executor=sequential"], []), [1])
    sim = ExperimentRunner(exp).simulator(exp.cfg0)
    state = diskstate.client_state_bytes(sim.algo, sim.spec.d, DTYPES[exp.cfg0.engine.dtype])
    return {r: vectorized_fit(exp.cfg0, sim.model, sim.algo, sim.executor.data, state,
                              held_bytes=sim.num_clients * state * r, replicas=r).need.total() for r in replicas}


def _available(monkeypatch, nbytes):
    from fl_core.engine import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: (int(nbytes / memory.FIT_FRACTION),
                                                                     "of RAM available (test)"))


def _timings(monkeypatch, vectorized_ms, sequential_ms_per_trial=100.0):
    """``factory.population_timing`` predicting ``vectorized_ms(R)`` for R replicas vectorised, R x the given ms
    sequential; returns the replica counts asked for."""
    from types import SimpleNamespace

    from fl_core.engine import factory

    asked = []

    def timing(cfg, sim, replicas):
        asked.append(replicas)
        return SimpleNamespace(round_s={"vectorized": vectorized_ms(replicas) / 1e3,
                                        "sequential": replicas * sequential_ms_per_trial / 1e3})

    monkeypatch.setattr(factory, "population_timing", timing)
    return asked


def _auto(space, n_trials=16):
    from sweeps import batch
    from sweeps.settings import Settings
    from sweeps.spaces import load_space

    settings = Settings(space=str(space), overrides=[], seeds=[1], objectives=["acc"], study_name="a", storage="x")
    return batch.auto_batch(load_space(str(space)), settings, DataCache(), n_trials)


def test_batch_auto_takes_the_fewest_trials_about_as_fast_as_any_within_the_memory(sandbox, monkeypatch):
    """auto: the smallest K of 1, 2, 4, 8, 16 whose predicted time a round per trial is within 10 % of the best of
    them, within what the memory allows (16 for this tiny digits base) and the trials to run; 1 when the vectorised
    pass is not faster than one after another."""
    space = sandbox / "lr.yaml"
    space.write_text(LR)
    asked = _timings(monkeypatch, lambda r: 10.0 * r ** 0.5)  # per trial 10 / sqrt(R): always pays
    k, why = _auto(space)
    assert (k, asked) == (16, [1, 2, 4, 8, 16]) and "at most 16, which memory allows" in why, why
    _timings(monkeypatch, lambda r: {1: 20.0, 2: 24.0, 4: 28.0, 8: 54.0, 16: 104.0}[r])  # per trial 20 .. 6.5
    k, why = _auto(space)
    assert k == 4 and why.startswith("auto: 4, the fewest trials within 10% of the best time a round per trial (20.0 "
                                     "ms at 1, 12.0 ms at 2, 7.0 ms at 4, 6.8 ms at 8, 6.5 ms at 16)"), why
    _timings(monkeypatch, lambda r: 150.0 * r)  # slower than 100 ms per trial sequentially
    k, why = _auto(space)
    assert k == 1 and "is not faster than their replicas one after another" in why, why
    asked = _timings(monkeypatch, lambda r: 10.0 * r ** 0.5)
    assert _auto(space, n_trials=3)[0] == 3 and asked == [1, 2, 3]  # no more than the trials to run
    assert _auto(space, n_trials=1) == (1, "auto: 1, 1 trial(s) to run")


def test_batch_auto_stays_within_the_memory_estimate(sandbox, monkeypatch):
    """With the available memory set between what 2 and 3 trials need at once, auto is 2 (a population that keeps
    paying otherwise)."""
    space = sandbox / "lr.yaml"
    space.write_text(LR)
    need = _needs(space, (2, 3))
    _available(monkeypatch, (need[2] + need[3]) / 2)
    asked = _timings(monkeypatch, lambda r: 10.0 * r ** 0.5)
    k, why = _auto(space)
    assert k == 2 and asked == [1, 2] and "memory allows 2 of at most 16" in why, why


# --------------------------------------------------------------------------- the same trials, fewer passes


def test_batch_4_and_batch_1_both_end_with_8_finished_trials_and_an_mlflow_run_each(sandbox, populations):
    space = sandbox / "lr.yaml"
    space.write_text(LR)
    for k in ("4", "1"):
        storage = sandbox / f"k{k}.log"
        args = _args(space, storage, f"k{k}", sandbox / f"out{k}", "--n-trials", "8", "--batch", k, "--no-test",
                     "--sampler-seed", "3")
        assert tune.main(args) == 0
        states = _states(storage, f"k{k}")
        assert len(states) == 8 and set(states) <= {"COMPLETE", "PRUNED"}, states
        _, runs = _runs(f"k{k}", "trial")
        assert sorted(int(r.data.tags["optuna_trial"]) for r in runs) == list(range(8))
        assert {r.info.status for r in runs} <= {"FINISHED", "KILLED"}
    # --batch 4: groups of 4 (two, or one refilled) offered to the population trainer, which trains them as one
    # population where engine.executor=auto's probe finds the vectorised pass faster, else one by one; --batch 1: none
    assert sum(end for _, _, end in populations) == 8 and populations[0][0] == 4, populations


def test_a_trial_in_a_batch_records_the_value_it_has_alone(sandbox, populations):
    """float64: each trial of a population of 3 (vectorised, eta_l apart) has the value and the intermediate values
    of the same overrides trained alone on the sequential executor, to 1e-9."""
    space, storage = sandbox / "lr.yaml", sandbox / "f.log"
    space.write_text(LR)
    args = _args(space, storage, "f", sandbox / "out", "--n-trials", "3", "--batch", "3", "--pruner", "none",
                 "--no-test", "--no-mlflow", "engine.dtype=float64", "engine.executor=vectorized")
    assert tune.main(args) == 0
    assert populations == [(3, True, 3)]
    cache = DataCache()
    for t in _study(storage, "f").trials:
        assert t.state.name == "COMPLETE"
        alone = [o for o in t.user_attrs["overrides"] if o != "engine.executor=vectorized"]
        seen: dict = {}
        res = train_seeds(alone, [1], cache, on_round=lambda i, r, row, seen=seen: seen.__setitem__(r, row["test_acc"]))
        assert abs(res.mean_acc - t.value) <= 1e-9, (t.number, res.mean_acc, t.value)
        assert t.intermediate_values.keys() == seen.keys()
        assert all(abs(t.intermediate_values[r] - seen[r]) <= 1e-9 for r in seen)


# --------------------------------------------------------------------------- how trials of a batch end


def test_pruning_stops_the_replicas_of_a_trial_and_refills_its_slot(sandbox, populations):
    """threshold:0.999 stops every trial at its first report after the warm-up (step 2 of 6 rounds): each of the 6
    trials ends PRUNED there, and the 3 asked after the first 3 were pruned join the same population."""
    space, storage = sandbox / "lr.yaml", sandbox / "p.log"
    space.write_text(LR.replace("train.rounds=3", "train.rounds=6"))
    args = _args(space, storage, "p", sandbox / "out", "--n-trials", "6", "--batch", "3", "--pruner",
                 "threshold:0.999", "--no-test", "--no-mlflow", "engine.executor=vectorized")
    assert tune.main(args) == 0
    trials = _study(storage, "p").trials
    assert [t.state.name for t in trials] == ["PRUNED"] * 6
    for t in trials:
        assert t.user_attrs["reason"].startswith("pruned: val_acc ") and t.user_attrs["reason"].endswith(
            " at seed 1 round 2 (step 2)"), t.user_attrs["reason"]
        assert max(t.intermediate_values) == 2  # stopped after the pass that reported step 2
    assert populations == [(3, True, 6)]  # one population, refilled


def test_a_diverged_or_infeasible_replica_ends_its_trial_alone(sandbox, populations):
    """FedBug's code schedule with P = 0.01 is infeasible for the MLP's 3 units once running, eta_l = 1e6 diverges;
    both trials end PRUNED with their reason while the two others of the population complete."""
    space, storage = sandbox / "bug.yaml", sandbox / "b.log"
    space.write_text("base: [algorithm=fedbug, algorithm.fedbug.schedule=code, " + ", ".join(TINY) + "]\n"
                     "params:\n  algorithm.fedbug.gu_percentage: {type: float, low: 0.0, high: 1.0}\n"
                     "  train.lr: {type: float, low: 1.0e-2, high: 1.0e+6, log: true}\n")
    study = optuna.create_study(study_name="b", storage=open_storage(str(storage)), direction="maximize")
    for p, lr in ((0.01, 0.05), (1.0, 0.05), (1.0, 1e6), (0.5, 0.1)):
        study.enqueue_trial({"algorithm.fedbug.gu_percentage": p, "train.lr": lr})
    args = _args(space, storage, "b", sandbox / "out", "--n-trials", "4", "--batch", "4", "--pruner", "none",
                 "--no-test", "--no-mlflow", "engine.executor=vectorized")
    assert tune.main(args) == 0
    trials = _study(storage, "b").trials
    assert [t.state.name for t in trials] == ["PRUNED", "COMPLETE", "PRUNED", "COMPLETE"]
    assert trials[0].user_attrs["reason"].startswith("infeasible: algorithm.fedbug.schedule=code needs P*K_i >= M")
    assert trials[2].user_attrs["reason"].startswith("diverged: non-finite")
    assert populations == [(4, True, 4)]


def test_an_error_in_a_populations_training_fails_its_trials_and_the_study_goes_on(sandbox, monkeypatch, capsys,
                                                                                  populations):
    def boom(build, r):
        if build == 2 and r == 2:
            raise ValueError("boom")  # not a property of a trial's setting: a bug

    _patch_build(monkeypatch, boom)
    space, storage = sandbox / "lr.yaml", sandbox / "e.log"
    space.write_text(LR)
    args = _args(space, storage, "e", sandbox / "out", "--n-trials", "4", "--batch", "2", "--pruner", "none",
                 "--no-test", "--no-mlflow", "engine.executor=vectorized")
    assert tune.main(args) == 0
    trials = _study(storage, "e").trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    assert {t.user_attrs["reason"] for t in trials[:2]} == {"error: ValueError: boom"}
    assert "trial 0: error: ValueError: boom (at " in capsys.readouterr().err


def test_a_storage_lost_in_one_trials_report_costs_that_trial_alone(sandbox, monkeypatch, capsys, populations):
    """The storage fails while trial 1 reports round 2 and answers again (a PostgreSQL restart: tests/test_env_faults.py
    runs the real one): trial 1 ends FAIL "storage lost" with its MLflow run FAILED, its replica stops, one note says
    so, and the two other trials of the population complete."""
    from fl_core.store import envfail
    from sweeps import batch
    from sweeps import storage as storage_module

    class Lost(Exception):
        pass

    failure = envfail.EnvironmentFailure("Optuna storage x", "lost its connection (terminating connection)",
                                         "check it", store="x")
    monkeypatch.setattr(batch, "storage_failure", lambda err, s: failure if isinstance(err, Lost) else None)
    monkeypatch.setattr(storage_module, "wait_for_storage", lambda s, f: 1.0)
    real = TrialRunner.report

    def report(self, st, i, r, row):
        if st.trial.number == 1 and r == 2:
            raise Lost("terminating connection")
        return real(self, st, i, r, row)

    monkeypatch.setattr(TrialRunner, "report", report)
    space, storage = sandbox / "lr.yaml", sandbox / "s.log"
    space.write_text(LR)
    args = _args(space, storage, "s", sandbox / "out", "--n-trials", "3", "--batch", "3", "--pruner", "none",
                 "--no-test", "engine.executor=vectorized")
    assert tune.main(args) == 0
    trials = _study(storage, "s").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert trials[1].user_attrs["reason"] == "storage lost: lost its connection (terminating connection)"
    assert sorted(trials[1].intermediate_values) == [1] and sorted(trials[0].intermediate_values) == [1, 2, 3]
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: trial")]
    assert notes == ["note: trial 1 ended FAIL: the Optuna storage lost its connection (terminating connection); it "
                     "answered again after 1 s and the sweep goes on"]
    _, children = _runs("s", "trial")
    status = {int(r.data.tags["optuna_trial"]): r.info.status for r in children}
    assert status == {0: "FINISHED", 1: "FAILED", 2: "FINISHED"}
    assert populations == [(3, True, 3)]


def test_ctrl_c_in_a_batch_fails_every_unfinished_trial(sandbox, monkeypatch):
    def interrupt(build, r):
        if build == 2 and r == 2:
            raise KeyboardInterrupt

    _patch_build(monkeypatch, interrupt)
    space, storage, out = sandbox / "lr.yaml", sandbox / "c.log", sandbox / "out"
    space.write_text(LR)
    args = _args(space, storage, "c", out, "--n-trials", "5", "--batch", "3", "--pruner", "none",
                 "engine.executor=vectorized")
    assert tune.main(args) == tune.EXIT_INTERRUPTED
    trials = _study(storage, "c").trials
    assert [t.state.name for t in trials] == ["FAIL"] * 3  # the three asked; none left RUNNING
    assert {t.user_attrs["reason"] for t in trials} == {"interrupted (Ctrl-C)"}
    _, children = _runs("c", "trial")
    assert sorted((int(r.data.tags["optuna_trial"]), r.info.status) for r in children) == [
        (0, "KILLED"), (1, "KILLED"), (2, "KILLED")]
    assert json.loads((out / "summary.json").read_text())["interrupted"]


@pytest.mark.slow  # ~30 s: two sweep processes
def test_a_worker_killed_between_two_passes_leaves_each_trial_once_after_the_rerun(sandbox):
    """SIGKILL at the named point between_passes (its second hit: after round 2 of 3 of a batch of 2): both trials
    stay RUNNING in the storage; the next invocation (--fail-stale: a dead process of this machine) fails them, ends
    their MLflow runs as orphans (KILLED) and trains two more: each trial exactly once, one MLflow run each, none
    RUNNING."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    space, storage = sandbox / "lr.yaml", sandbox / "k.log"
    space.write_text(LR)
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "sweeps" / "tune.py"),
           *_args(space, storage, "k", sandbox / "out", "--batch", "2", "--pruner", "none", "--no-test",
                  "engine.executor=vectorized")]
    killed = subprocess.run([*cmd, "--n-trials", "4"], env={**os.environ, "FL_FAULT": "between_passes@2"},
                            capture_output=True, text=True, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert _states(storage, "k") == ["RUNNING", "RUNNING"]
    rerun = subprocess.run([*cmd, "--n-trials", "2", "--fail-stale"], capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _states(storage, "k") == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    _, runs = _runs("k", "trial")
    assert sorted((int(r.data.tags["optuna_trial"]), r.info.status) for r in runs) == [
        (0, "KILLED"), (1, "KILLED"), (2, "FINISHED"), (3, "FINISHED")]


def test_an_error_outside_the_training_fails_every_trial_of_the_batch(sandbox, monkeypatch, capsys):
    calls = {"n": 0}
    real = TrialRunner.experiment_overrides

    def sample_then_crash(self, trial):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("sampler exploded")
        return real(self, trial)

    monkeypatch.setattr(TrialRunner, "experiment_overrides", sample_then_crash)
    space, storage, out = sandbox / "lr.yaml", sandbox / "o.log", sandbox / "out"
    space.write_text(LR)
    assert tune.main(_args(space, storage, "o", out, "--n-trials", "4", "--batch", "4", "--no-mlflow")) == 1
    trials = _study(storage, "o").trials
    assert [t.state.name for t in trials] == ["FAIL"] * 3  # two waiting, the third crashed while sampled
    assert {t.user_attrs["reason"] for t in trials} == {"error: RuntimeError: sampler exploded"}
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow  # two spawned workers (about 20 s; one at a time: tests/test_sweeps.py)
def test_two_workers_with_batches_share_the_storage_without_duplicate_trials(sandbox):
    space, storage = sandbox / "lr.yaml", sandbox / "w.log"
    space.write_text(LR)
    args = _args(space, storage, "w", sandbox / "out", "--n-trials", "6", "--workers", "2", "--batch", "3",
                 "--no-test", "--no-mlflow")
    assert tune.main(args) == 0
    trials = _study(storage, "w").trials
    assert len(trials) == 6 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    assert sorted(t.number for t in trials) == list(range(6))
    assert {t.user_attrs["worker"] for t in trials} == {1, 2}


def test_a_batch_larger_than_the_memory_allows_trains_in_chunks(sandbox, monkeypatch):
    """With the available memory set so that one trial's clients fit at once but not four trials', --batch 4 trains
    its population in chunks of clients (engine.max_parallel_clients unset), and every trial completes."""
    from fl_core.engine import population

    space, storage = sandbox / "lr.yaml", sandbox / "m.log"
    space.write_text(LR)
    need = _needs(space, (1, 4))
    _available(monkeypatch, (need[1] + need[4]) / 2)
    chunks = []
    real_run = population.run_together
    monkeypatch.setattr(population, "run_together",
                        lambda sims, chunk=0, *a, **kw: chunks.append(chunk) or real_run(sims, chunk, *a, **kw))
    args = _args(space, storage, "m", sandbox / "out", "--n-trials", "4", "--batch", "4", "--pruner", "none",
                 "--no-test", "--no-mlflow", "engine.executor=vectorized")
    assert tune.main(args) == 0
    assert _states(storage, "m") == ["COMPLETE"] * 4
    assert chunks and 0 < chunks[0] < 16, chunks  # 4 trials x 4 clients a round, in chunks
