"""Nothing a user owns is deleted or overwritten, and no error leaves a run RUNNING or a staging folder behind.

A run writes, replaces or deletes only folders of its own (:mod:`fl_core.store.owned`): a folder at ``results/<name>``
that the project did not write (``results_dir=. name=docs``, a folder of notes, a results folder holding a file the
user added) is refused in one line, exit 2, before anything is created. And whatever error stops a run (one the
project does not expect: ``FL_FAULT=POINT:ERROR``), the one place that ends its runs (``_end_on_failure``) leaves no
MLflow run RUNNING and no staging folder; the same command then completes the runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fl_core.store import faults, owned
from fl_core.store.runstore import ATTEMPT_PATTERNS, OUTPUT_PATTERNS, ExperimentStore

RUN = ["partition.num_clients=4", "train.rounds=2", "train.participation=1.0", "train.local_epochs=1",
       "train.batch_size=64", "engine.progress=false"]


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes (what must stay untouched)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(tmp: Path, monkeypatch, *args: str, tracking: bool = False) -> int:
    """``fl-train`` in this process with its working directory in ``tmp``: the exit status."""
    from pipeline.train import main

    monkeypatch.chdir(tmp)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
    extra = [] if tracking else ["tracking.enabled=false"]
    try:
        return main([*RUN, *extra, *args])
    except SystemExit as stop:
        return int(stop.code)


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


def test_results_dir_dot_and_name_of_a_project_folder_is_refused_and_nothing_is_touched(tmp_path, monkeypatch,
                                                                                       capsys):
    docs = tmp_path / "docs"
    (docs / "img").mkdir(parents=True)
    (docs / "cli.md").write_text("the project's docs")
    (docs / "img" / "ui.png").write_bytes(b"\x89PNG")
    before = _snapshot(tmp_path)
    assert _train(tmp_path, monkeypatch, "results_dir=.", "name=docs") == 2
    line = _one_error_line(capsys)
    assert "results folder docs holds files this project did not write" in line and "nothing was changed" in line
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]  # no lock, staging or checkpoint folder either


@pytest.mark.parametrize("layout,named", [
    ({"notes.md": "my notes"}, "precious/notes.md"),  # a folder of the user's
    ({"experiment.json": "{}", "metrics.json": "{}", "notes.md": "my notes"}, "precious/notes.md"),  # a stray file
    ({"metrics.json": "{}"}, "has no experiment.json"),  # files named like outputs, no marker
    ({"models/seed_1.pt": "x", "experiment.json": "{}", "models/mine/a.txt": "x"}, "precious/models/mine"),
])
def test_a_results_folder_the_project_did_not_write_is_refused(tmp_path, monkeypatch, capsys, layout, named):
    out = tmp_path / "results" / "precious"
    for rel, text in layout.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    before = _snapshot(tmp_path)
    assert _train(tmp_path, monkeypatch, "name=precious", "--overwrite") == 2  # --overwrite replaces only ours
    line = _one_error_line(capsys)
    assert named in line and "nothing was changed" in line
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results" / ".locks").exists()


def test_every_file_a_run_writes_is_one_the_project_recognises_and_may_replace(tmp_path, monkeypatch):
    """A FedBug run (its schedule files too), then another config under the same name with --overwrite: the first
    run's folder holds only :data:`OUTPUT_PATTERNS` files, so the second replaces it whole."""
    assert _train(tmp_path, monkeypatch, "algorithm=fedbug", "name=run", "seed=1,2") == 0
    out = tmp_path / "results" / "run"
    assert (out / "details" / "schedule.csv").exists() and (out / "models" / "seed_2.pt").exists()
    assert owned.foreign_entries(out, OUTPUT_PATTERNS, limit=100) == []
    assert _train(tmp_path, monkeypatch, "algorithm=fedbug", "name=run", "train.lr=0.02", "--overwrite") == 0
    assert not (out / "models" / "seed_2.pt").exists()  # the earlier set was replaced whole
    assert json.loads((out / "experiment.json").read_text())["seeds_run"] == [0]


def test_an_empty_folder_is_the_runs_to_fill(tmp_path, monkeypatch):
    (tmp_path / "results" / "run").mkdir(parents=True)
    assert _train(tmp_path, monkeypatch, "name=run") == 0
    assert (tmp_path / "results" / "run" / "metrics.json").exists()


def test_foreign_entries_and_patterns():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "seed_1.pt.states").mkdir()
        (root / "seed_1.pt.states" / "h.bin").write_bytes(b"")
        (root / "seed_1.done.pt").write_bytes(b"")
        (root / "seed_1.pt.abc.tmp").write_bytes(b"")
        assert owned.foreign_entries(root, ATTEMPT_PATTERNS) == []
        (root / "keep").mkdir()
        (root / "mine.txt").write_text("x")
        assert owned.foreign_entries(root, ATTEMPT_PATTERNS, limit=5) == ["keep", "mine.txt"]
        os.symlink(root / "keep", root / "seed_2.pt.states")  # a link is never the project's to follow or delete
        assert "seed_2.pt.states" in owned.foreign_entries(root, ATTEMPT_PATTERNS, limit=5)
        # an interrupted atomic write's temporary file (pipeline.files.atomic_write) beside an output
        out = root / "out"
        (out / "details").mkdir(parents=True)
        (out / "details" / ".seed_1.csv.x1y2.csv").write_text("")
        assert owned.foreign_entries(out, OUTPUT_PATTERNS) == ["details/.seed_1.csv.x1y2.csv"]
        assert owned.foreign_entries(out, owned.with_temporaries(OUTPUT_PATTERNS)) == []


def test_recover_leaves_a_removed_folder_that_holds_foreign_files(tmp_path):
    store = ExperimentStore("exp", "0123456789abcdef", tmp_path / "results", tmp_path / "checkpoints")
    ours = tmp_path / "checkpoints" / "exp" / "0123456789abcdef.77.removed"
    theirs = tmp_path / "checkpoints" / "exp" / "photos.2024.removed"
    ours.mkdir(parents=True)
    (ours / "seed_1.pt").write_bytes(b"")
    theirs.mkdir()
    (theirs / "beach.jpg").write_bytes(b"")
    store.recover()
    assert not ours.exists() and (theirs / "beach.jpg").exists()


def test_a_foreign_attempt_folder_is_refused(tmp_path):
    store = ExperimentStore("exp", "0123456789abcdef", tmp_path / "results", tmp_path / "checkpoints")
    store.attempt.mkdir(parents=True)
    (store.attempt / "thesis.tex").write_text("x")
    with pytest.raises(owned.ForeignFolder, match=r"checkpoint folder .*thesis\.tex.*engine\.checkpoint_dir"):
        store.check_owned()


# ------------------------------------------------------------------ any error: nothing RUNNING, no staging


@pytest.mark.parametrize("point", ["before_first_checkpoint", pytest.param("after_record", marks=pytest.mark.slow),
                                   pytest.param("between_seeds", marks=pytest.mark.slow), "after_outputs"])
def test_an_error_anywhere_ends_the_runs_and_removes_staging_and_the_rerun_completes(tmp_path, monkeypatch, point,
                                                                                  empty_store):
    from mlflow.tracking import MlflowClient

    shutil.copy(empty_store, tmp_path / "mlflow.db")
    args = ("name=exp", "seed=1,2", "engine.checkpoint_every=1")
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv(faults.ENV, f"{point}:ERROR")
    with pytest.raises(faults.InjectedError):
        _train(tmp_path, monkeypatch, *args, tracking=True)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    assert runs and "RUNNING" not in {r.info.status for r in runs}
    ended = [r for r in runs if r.info.status == "FAILED"]
    assert ended and all(r.data.tags["fl.end_reason"].startswith("stopped by an error: InjectedError: ")
                         for r in ended)
    assert not list((tmp_path / "results").glob(".*.staging"))

    monkeypatch.delenv(faults.ENV)
    assert _train(tmp_path, monkeypatch, *args, tracking=True) == 0
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert len(runs) == 3  # the parent and one child per seed: the stopped runs were continued, not duplicated
    assert not list((tmp_path / "results").glob(".*.staging"))
    assert json.loads((tmp_path / "results" / "exp" / "metrics.json").read_text())["status"] == "ok"


def test_a_results_folder_missing_the_files_dvc_caches_is_trained_again(tmp_path, monkeypatch, capsys):
    """A clone of the project holds the files git tracks (metrics.json, ...) but not the models and details DVC keeps
    in its cache: the same config then trains again (DVC needs those outputs), instead of "nothing to do"."""
    assert _train(tmp_path, monkeypatch, "name=run") == 0
    out = tmp_path / "results" / "run"
    assert _train(tmp_path, monkeypatch, "name=run") == 0
    assert "nothing to do" in capsys.readouterr().err  # complete: not trained again
    shutil.rmtree(out / "models")
    shutil.rmtree(out / "details")
    assert _train(tmp_path, monkeypatch, "name=run") == 0
    assert "nothing to do" not in capsys.readouterr().err
    assert (out / "models" / "seed_0.pt").is_file() and (out / "details" / "seed_0.csv").is_file()


def test_a_published_model_is_the_same_bytes_on_every_run_and_times_stay_apart(tmp_path, monkeypatch):
    """The files DVC hashes (models, details) are the same bytes when the same run is repeated, so dvc.lock does not
    change; the wall-clock round times go to details/round_times.csv (left out of the hash by .dvcignore)."""
    import csv

    runs = []
    for name in ("a", "b"):
        assert _train(tmp_path, monkeypatch, f"name={name}") == 0
        runs.append(tmp_path / "results" / name)
    for rel in ("models/seed_0.pt", "details/seed_0.csv", "runs.csv"):
        assert (runs[0] / rel).read_bytes() == (runs[1] / rel).read_bytes(), rel
    assert "round_time_s" not in (runs[0] / "details" / "seed_0.csv").read_text()
    with open(runs[0] / "details" / "round_times.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows] == ["1", "2"] and all(float(r["round_time_s"]) > 0 for r in rows)
    assert "results/*/details/round_times.csv" in (Path(__file__).resolve().parent.parent / ".dvcignore").read_text()
