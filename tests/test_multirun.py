"""Seed lists and ``fl-train -m`` (Hydra multirun, pipeline/multirun.py) as a user runs them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_core.config import ConfigError
from pipeline.multirun import seed_override, split_seeds

ROOT = Path(__file__).resolve().parent.parent
TINY = ["partition=iid", "train.rounds=1", "partition.num_clients=4", "tracking.enabled=false", "engine.progress=false",
        "engine.checkpoint_every=0"]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the hydra_plugins namespace itself is missing
        return False


def _run(args, cwd):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=cwd, env=env, capture_output=True,
                          check=False, text=True, timeout=600)


def _metrics(tmp_path):
    return {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "results").glob("*/metrics.json")}


# --------------------------------------------------------------------------- seed lists (no training)


@pytest.mark.parametrize("args,rest,seeds", [
    (["seed=1,2,3", "train.rounds=1"], ["train.rounds=1"], [1, 2, 3]),
    (["seed=range(1,4)"], [], [1, 2, 3]),
    (["seed=5", "algorithm=fedprox"], ["seed=5", "algorithm=fedprox"], None),
    (["algorithm=fedavg"], ["algorithm=fedavg"], None),
])
def test_split_seeds(args, rest, seeds):
    assert split_seeds(args) == (rest, seeds)
    assert seed_override(seeds) == ([f"seed={','.join(map(str, seeds))}"] if seeds else [])


def test_split_seeds_keeps_other_sweeps_only_with_m():
    assert split_seeds(["algorithm=fedavg,fedprox", "seed=1,2"], sweep_ok=True) == (["algorithm=fedavg,fedprox"], [1, 2])
    with pytest.raises(ConfigError, match=r"^algorithm=fedavg,fedprox sweeps over several values: add -m"):
        split_seeds(["algorithm=fedavg,fedprox"])


@pytest.mark.parametrize("args,message", [
    (["seed=a,b"], "seed=a,b: seeds must be integers, got 'a'"),
    (["seed=1,1"], "seed=1,1: seed 1 is listed twice"),
    (["seed=1,2", "seed=3"], "seed=1,2: seed is given more than once"),
])
def test_split_seeds_refuses_bad_lists(args, message):
    with pytest.raises(ConfigError) as err:
        split_seeds(args)
    assert str(err.value) == message


# --------------------------------------------------------------------------- the command


def test_seed_list_without_m_is_one_experiment(tmp_path):
    proc = _run(["seed=1,2", "name=pair"] + TINY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    metrics = _metrics(tmp_path)
    assert list(metrics) == ["pair"] and metrics["pair"]["seeds"] == [1, 2]
    assert not (tmp_path / "outputs").exists()  # no Hydra run folder for a single run


@pytest.mark.slow  # ~12 s: four jobs (test_swept_values_name_the_jobs runs -m in the fast suite)
def test_multirun_runs_one_experiment_per_combination_with_all_seeds(tmp_path):
    proc = _run(["-m", "algorithm=fedavg,fedprox", "seed=1,2"] + TINY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    metrics = _metrics(tmp_path)
    assert sorted(metrics) == ["fedavg_iid_digits", "fedprox_iid_digits"]  # results/<derived name>/ as one run
    for m in metrics.values():
        assert m["seeds"] == [1, 2] and m["rounds"] == 1
    sweeps = list((tmp_path / "outputs" / "multirun").glob("*/*"))
    assert len(sweeps) == 1 and (sweeps[0] / "multirun.yaml").is_file()
    assert sorted(p.name for p in sweeps[0].iterdir() if p.is_dir()) == ["0", "1"]
    assert "job #1: algorithm=fedprox" in proc.stderr and "2 of 2 job(s) succeeded" in proc.stderr


def test_bad_value_in_a_swept_list_fails_before_any_job(tmp_path):
    proc = _run(["-m", "algorithm=fedavg,nope", "seed=1,2"] + TINY, tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: algorithm must be one of ") and "got 'nope'" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_swept_values_name_the_jobs(tmp_path):
    """Without name=, each job's results name is the derived name plus the swept values it does not show."""
    proc = _run(["-m", "train.lr=0.01,0.1"] + TINY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(_metrics(tmp_path)) == ["fedavg_iid_digits-lr0.01", "fedavg_iid_digits-lr0.1"]


def test_jobs_that_would_share_a_results_folder_are_refused(tmp_path):
    proc = _run(["-m", "train.lr=0.01,0.1", "name=same"] + TINY, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: jobs #0 (train.lr=0.01) and #1 (train.lr=0.1) would both write results/same/: "
        "give each job its own name, e.g. name='same-lr${train.lr}'")
    assert list(tmp_path.iterdir()) == []


def test_exit_status_is_the_worst_jobs(tmp_path):
    """tiny_cnn does not fit digits: that job ends with its one-line error (2); the other still trains."""
    proc = _run(["-m", "model=mlp,tiny_cnn", "name=w-${model.name}"] + TINY, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "error: model=tiny_cnn (tiny_cnn) does not fit dataset=digits" in proc.stderr
    assert "job #1 (model=tiny_cnn " in proc.stderr and "exited with status 2" in proc.stderr
    assert list(_metrics(tmp_path)) == ["w-mlp"]


@pytest.mark.skipif(not _installed("hydra_plugins.hydra_joblib_launcher"),
                    reason="hydra-joblib-launcher is not installed (pip install -e '.[parallel]')")
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path):
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "algorithm=fedavg,fedprox", "seed=1,2"]
    proc = _run(args + [a for a in TINY if a != "tracking.enabled=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "on JoblibLauncher" in proc.stderr
    metrics = _metrics(tmp_path)
    assert sorted(metrics) == ["fedavg_iid_digits", "fedprox_iid_digits"]
    assert all(m["seeds"] == [1, 2] for m in metrics.values())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    parents = {r.info.run_id: r.info.run_name for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(parents.values()) == ["fedavg_iid_digits", "fedprox_iid_digits"]
    children = [r.data.tags["mlflow.parentRunId"] for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert sorted(children) == sorted(list(parents) * 2)  # each parent: its 2 seeds
    assert all(r.info.status == "FINISHED" for r in runs)


# --------------------------------------------------------------------------- a grid as one population

GRID_POP = ["algorithm=fedprox", "engine.executor=vectorized", "train.rounds=2", "model=mlp", "partition.num_clients=6",
            "train.participation=0.5", "engine.progress=false", "engine.checkpoint_every=0", "tracking.log_model=false"]


@pytest.mark.slow  # fl-train -m and each job alone (about 20 s; the engine's populations: tests/test_population.py)
def test_a_grid_over_mu_trains_as_one_population_with_each_jobs_own_numbers(tmp_path, monkeypatch):
    """``-m algorithm.fedprox.mu=0,0.1 seed=1,2`` on the vectorised executor: the 2 jobs' 4 runs train in one pass per
    round; each job's files equal, byte for byte, those of the job run alone with its seeds apart (float32), and each
    job has its own MLflow parent with one FINISHED child per seed. (A grid over eta_l forms one population in
    test_a_job_of_a_grid_population_that_cannot_start_ends_alone; the engine's per-replica numbers over eta_l and mu
    are tests/test_population.py's.)"""
    from mlflow.tracking import MlflowClient

    from fl_core.engine import population
    from pipeline.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    passes = []
    lock_step = population._lock_step
    monkeypatch.setattr(population, "_lock_step", lambda sims, *a: passes.append(len(sims)) or lock_step(sims, *a))
    name = "name=g-lr${train.lr}-mu${algorithm.fedprox.mu}"
    assert main(["-m", "train.lr=0.05", "algorithm.fedprox.mu=0,0.1", "seed=1,2", name] + GRID_POP) == 0
    assert passes == [4]
    jobs = [("0.05", mu) for mu in ("0", "0.1")]
    passes.clear()
    for lr, mu in jobs:
        alone = ["tracking.enabled=false", "engine.population=false", f"name=alone-{lr}-{mu}"]
        assert main([f"train.lr={lr}", f"algorithm.fedprox.mu={mu}", "seed=1,2"] + GRID_POP[:-1] + alone) == 0
        for f in ("runs.csv", "rounds.csv", "metrics.json"):
            got = (tmp_path / "results" / f"g-lr{lr}-mu{float(mu)}" / f).read_text()
            assert got == (tmp_path / "results" / f"alone-{lr}-{mu}" / f).read_text(), (lr, mu, f)
    assert passes == []  # each alone: its seeds one after another
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    parents = {r.data.tags["fl.experiment"]: r for r in runs if r.data.tags.get("fl.role") == "parent"}
    assert sorted(parents) == sorted(f"g-lr{lr}-mu{float(mu)}" for lr, mu in jobs)
    for p in parents.values():
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]
        assert sorted(int(k.data.tags["fl.seed"]) for k in kids) == [1, 2]
        assert {k.info.status for k in kids} | {p.info.status} == {"FINISHED"}


def test_jobs_that_differ_in_more_than_a_replica_carries_are_not_one_population():
    """A population's jobs may differ in eta_l and in rule parameters marked replica=True only; another key (local
    epochs, a parameter of another rule), another executor or engine.population=false keeps them apart."""
    from pipeline.multirun import population_groups

    vec = ["algorithm=fedprox", "engine.executor=vectorized"]
    assert population_groups([vec + ["train.lr=0.1", "name=a"], vec + ["train.lr=0.2", "name=b"],
                              vec + ["algorithm.fedprox.mu=1", "name=c"]], [1, 2]) == [[0, 1, 2]]
    assert population_groups([vec + ["train.local_epochs=2"], vec + ["train.local_epochs=3"]], None) == [[0], [1]]
    assert population_groups([["algorithm=feddyn", "engine.executor=vectorized", f"algorithm.feddyn.adaptive_alpha={a}"]
                              for a in ("true", "false")], None) == [[0], [1]]
    # FedDyn's alpha, eta_g and the weight decay are carried by each replica (fl_core.config.replica_keys)
    assert population_groups([["algorithm=feddyn", "engine.executor=vectorized", f"algorithm.feddyn.alpha={a}",
                               f"train.weight_decay={a / 10}"] for a in (0.1, 0.2)], None) == [[0, 1]]
    assert population_groups([["train.lr=0.1"], ["train.lr=0.2"]], None) == [[0], [1]]  # the sequential executor
    assert population_groups([vec + ["engine.population=false", f"train.lr={lr}"] for lr in (0.1, 0.2)],
                             None) == [[0], [1]]


def test_a_job_of_a_grid_population_that_cannot_start_ends_alone(tmp_path, monkeypatch, capsys):
    """One job's results folder holds a file the project did not write: that job ends with its one-line error
    (status 2) and its folder untouched; the other two still train as one population."""
    from fl_core.engine import population
    from pipeline.train import main

    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "results" / "g-lr0.05" / "my-notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("not the project's")
    passes = []
    lock_step = population._lock_step
    monkeypatch.setattr(population, "_lock_step", lambda sims, *a: passes.append(len(sims)) or lock_step(sims, *a))
    over = [a for a in GRID_POP if a != "tracking.log_model=false"] + ["tracking.enabled=false"]
    assert main(["-m", "train.lr=0.02,0.05,0.1", "seed=1,2", "name=g-lr${train.lr}"] + over) == 2
    assert passes == [4]
    err = capsys.readouterr().err
    assert "error: " in err and "my-notes.txt" in err and "job #1 (train.lr=0.05 " in err
    assert sorted(p.name for p in (tmp_path / "results").iterdir() if not p.name.startswith(".")) == \
        ["g-lr0.02", "g-lr0.05", "g-lr0.1"]
    assert [p.name for p in mine.parent.iterdir()] == ["my-notes.txt"]
    assert all((tmp_path / "results" / n / "metrics.json").is_file() for n in ("g-lr0.02", "g-lr0.1"))
