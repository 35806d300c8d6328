"""The Optuna dashboard of the sweeps (sweeps/dashboard.py, make dashboard): what its HTTP API shows of a study
that sweeps/tune.py ran, the study's labels, and the one-line errors for a storage that does not exist yet.

The study: a tiny digits run (MLP, 4 clients, 3 rounds) with three enqueued learning rates, two that train
(COMPLETE) and one far too small that the threshold pruner stops (PRUNED), in a temporary journal file. The
dashboard's WSGI app (``optuna_dashboard.wsgi``) is served by wsgiref on a free port in a thread.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest

from sweeps import dashboard, tune
from sweeps.settings import Settings
from sweeps.spaces import load_space
from sweeps.storage import default_storage, open_storage
from sweeps.study import study_labels

pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (pip install -e '.[dashboard]')")

ROOT = Path(__file__).resolve().parent.parent
LR_SPACE = """\
description: local learning rate on a tiny digits run (tests)
base: [model=mlp, partition=iid, partition.num_clients=4, train.rounds=3, train.local_epochs=1, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-6, high: 1.0e+6, log: true}
"""
LRS = (0.1, 1e-5, 0.05)  # trains, far too small (val_acc < 0.3 at round 1: pruned), trains


def tune_args(space: Path, storage: Path, out: Path) -> list:
    return ["--space", str(space), "--storage", str(storage), "--study-name", "t", "--out", str(out), "--quiet",
            "--no-test", "--no-mlflow", "--sampler", "random", "--sampler-seed", "0"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(search space file, journal file): study ``t`` after 3 trials, numbers 0 and 2 COMPLETE, 1 PRUNED."""
    tmp = tmp_path_factory.mktemp("dashboard")
    space, storage = tmp / "lr.yaml", tmp / "studies" / "t.log"
    space.write_text(LR_SPACE)
    study = optuna.create_study(study_name="t", storage=open_storage(str(storage)), direction="maximize")
    for lr in LRS:
        study.enqueue_trial({"train.lr": lr})
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        assert tune.main(tune_args(space, storage, tmp / "out") + ["--pruner", "threshold:0.3", "--n-trials", "3"]) == 0
    return space, storage


@contextmanager
def serving(spec: str):
    """The dashboard of storage ``spec`` (opened as ``make dashboard`` opens it) on a free port: its base URL."""
    storage, _ = dashboard.open_dashboard_storage(spec)
    server = dashboard.make_server(dashboard.make_app(storage), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def get(url: str):
    with urllib.request.urlopen(url, timeout=60) as res:
        body = res.read()
        return res.status, res.headers.get_content_type(), body


def get_json(url: str):
    status, kind, body = get(url)
    assert status == 200 and kind == "application/json", (url, status, kind)
    return json.loads(body)


def attrs(entries):
    """The dashboard's ``[{"key": k, "value": v}, ...]`` as a dict."""
    return {e["key"]: e["value"] for e in entries}


# --------------------------------------------------------------------------- the dashboard's HTTP API


def test_the_dashboard_shows_the_study_its_objective_and_its_pruned_trial(sweep):
    _, storage = sweep
    with serving(str(storage)) as base:
        studies = get_json(f"{base}/api/studies")["study_summaries"]
        assert [(s["study_name"], s["directions"]) for s in studies] == [("t", ["maximize"])]
        labels = attrs(studies[0]["user_attrs"])
        assert labels["objective"].startswith("val_acc (maximize): validation accuracy")
        assert labels["search_space"] == "train.lr: float [1e-06, 1e+06] log"
        assert labels["pruning"].startswith("threshold: stops a trial as soon as val_acc < 0.3, from step 1 on")

        detail = get_json(f"{base}/api/studies/{studies[0]['study_id']}")
        assert detail["objective_names"] == ["val_acc"]
        trials = sorted(detail["trials"], key=lambda t: t["number"])
        assert [t["state"] for t in trials] == ["Complete", "Pruned", "Complete"]
        assert [float(t["params"][0]["param_external_value"]) for t in trials] == list(LRS)
        pruned = trials[1]
        assert attrs(pruned["user_attrs"])["reason"].startswith("pruned: val_acc ")
        assert [(v["step"], v["value"] < 0.3) for v in pruned["intermediate_values"]] == [(1, True)]
        for t in (trials[0], trials[2]):  # one value per evaluated round, steps 1..R
            assert [v["step"] for v in t["intermediate_values"]] == [1, 2, 3] and 0 < t["values"][0] <= 1
        best = max((trials[0], trials[2]), key=lambda t: t["values"][0])
        assert [t["number"] for t in detail["best_trials"]] == [best["number"]]
        assert detail["has_intermediate_values"] is True
        assert [p["name"] for p in detail["union_search_space"]] == ["train.lr"]

        importances = get_json(f"{base}/api/studies/{studies[0]['study_id']}/param_importances")
        assert [p["name"] for p in importances["param_importances"][0]] == ["train.lr"]
        status, kind, page = get(f"{base}/dashboard")
        assert status == 200 and kind == "text/html" and b"<html" in page.lower()


def test_every_invocation_relabels_the_study(sweep, tmp_path):
    space, journal = sweep
    storage = tmp_path / "t.log"  # a copy: the module's study keeps its labels
    shutil.copyfile(journal, storage)
    args = tune_args(space, storage, tmp_path / "out") + ["--pruner", "none", "--n-trials", "0"]
    assert tune.main(args) == 0  # no trial: only the outputs
    study = optuna.load_study(study_name="t", storage=open_storage(str(storage)))
    assert study.metric_names == ["val_acc"] and len(study.trials) == 3
    assert study.user_attrs["pruning"].startswith("none; step = seed_index * 3 + round")
    assert study.user_attrs["base"].split() == ["model=mlp", "partition=iid", "partition.num_clients=4",
                                                "train.rounds=3", "train.local_epochs=1", "train.batch_size=16",
                                                "train.participation=1.0", "dataset.validation_fraction=0.2"]


def test_labels_of_a_conditional_space_and_of_two_objectives():
    space = load_space("cross")
    settings = Settings(space=str(space.path), overrides=["train.rounds=30"], seeds=[1, 2, 3],
                        objectives=["acc", "uplink"], study_name="c", storage="x.log", rounds=30,
                        final_window=3)
    labels = study_labels(settings, space)
    assert labels["objective"] == (
        "val_acc (maximize): validation accuracy (fraction; 20% of the training set held out), mean of the last 3 "
        "evaluation(s), mean over seeds 1..3; uplink (minimize): cumulative uplink floats per client after the "
        "last round, in units of d (model size)")
    searched = labels["search_space"].split("; ")
    assert searched[:2] == ["algorithm: fedavg | fedprox | feddyn | fedbug | fednlr | fedbcgd",
                            "train.lr: float [0.01, 0.3] log"]
    assert ("if algorithm=fedbcgd: algorithm.fedbcgd.lam: float [0.4, 0.95], algorithm.fedbcgd.blocks: int [1, 3]"
            in searched)
    assert labels["pruning"].startswith("none: multi-objective studies cannot prune")
    assert labels["base"].split()[-2:] == ["train.rounds=30", "dataset.validation_fraction=0.2"]
    settings.objectives, settings.pruner = ["acc"], "median"
    assert study_labels(settings, space)["pruning"].startswith(
        "median: stops a trial whose best val_acc so far is below the median of the COMPLETE trials at the same "
        "step, from step 10 on once 5 trials are COMPLETE; step = seed_index * 30 + round")


# --------------------------------------------------------------------------- which storage; one-line errors


def test_a_storage_that_does_not_exist_yet_is_one_line_and_is_not_created(tmp_path, capsys):
    journal, db = tmp_path / "nope.log", tmp_path / "nope.db"
    for argv, shown in ((["--storage", str(journal)], str(journal)), (["--storage", f"sqlite:///{db}"], str(db))):
        assert dashboard.main(argv + ["--port", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: no sweep storage at ") and shown in err and "\n" not in err, err
        assert err.endswith("run a sweep first, e.g. python sweeps/tune.py --space cross --n-trials 20")
    assert list(tmp_path.iterdir()) == []  # neither the journal nor the SQLite file was created

    empty = tmp_path / "empty.db"  # a database without Optuna's tables
    import sqlite3

    sqlite3.connect(empty).execute("create table other (x)").connection.close()
    assert dashboard.main(["--storage", f"sqlite:///{empty}", "--port", "0"]) == 2
    assert "no sweep storage at sqlite:///" in capsys.readouterr().err
    assert dashboard.main(["--storage", "postgresql+psycopg2://u:secret@127.0.0.1:1/db"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --storage postgresql+psycopg2://u:***@127.0.0.1:1/db: ") and "secret" not in err


def test_the_default_storage_is_the_journal_tune_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FL_PROJECT_ROOT", str(tmp_path))
    studies = tmp_path / "sweeps" / "studies"
    with pytest.raises(dashboard.DashboardError, match="no sweep storage in .* yet: run a sweep first"):
        dashboard.resolve_storage()
    assert dashboard.resolve_storage(study="fedbug") == default_storage("fedbug") == str(studies /
                                                                                         "fedbug.log")
    assert dashboard.main(["--study", "lr"]) == 2
    assert capsys.readouterr().err.strip().endswith("python sweeps/tune.py --space lr --n-trials 20")
    studies.mkdir(parents=True)
    optuna.create_study(study_name="a", storage=open_storage(str(studies / "a.log")))
    assert dashboard.resolve_storage() == str(studies / "a.log")  # the only one
    (studies / "b.log").touch()
    with pytest.raises(dashboard.DashboardError, match=r"2 studies in .* \(a, b\): choose one with make dashboard "
                                                       "STUDY=NAME"):
        dashboard.resolve_storage()
    assert dashboard.main(["--study", "b"]) == 2  # an empty journal: no study yet
    assert "no study in " in capsys.readouterr().err


def test_a_port_in_use_is_one_line(sweep):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(dashboard.DashboardError, match=f"port {port} on 127.0.0.1 is in use: .* PORT={port + 1}"):
            dashboard.make_server(dashboard.make_app(open_storage(str(sweep[1]))), "127.0.0.1", port)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_dashboard_passes_storage_and_port(tmp_path):
    """``make dashboard`` with this interpreter (the set-up stamp not remade): STORAGE reaches the command."""
    missing = tmp_path / "nope.log"
    stamp = tmp_path / "stamp"
    res = subprocess.run(["make", "-s", "dashboard", f"PY={sys.executable}", f"STAMP={stamp}", "-o", str(stamp),
                          f"STORAGE={missing}", "PORT=0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode != 0
    assert res.stderr.splitlines()[0] == (f"error: no sweep storage at {missing} yet: run a sweep first, e.g. "
                                          "python sweeps/tune.py --space cross --n-trials 20")
    assert not missing.exists()
