"""A study's fingerprint (the first rounds of every row, committed with its report) and ``studies-status --verify``:
a rerun on the same code is current, a row whose numbers change is named, and a study that reads absent local data
files says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import fingerprint, studies_status

ROOT = Path(__file__).resolve().parent.parent
GRID = {"seeds": [1, 2], "partition": {"num_clients": 6}, "model": {"name": "mlp"},
        "train": {"rounds": 3, "participation": 0.5, "local_epochs": 1, "batch_size": 32},
        "engine": {"executor": "sequential", "progress": False, "checkpoint_every": 0},
        "tracking": {"enabled": False},
        "experiments": {"plain": {}, "fast": {"train.lr": 0.1}}}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A study folder whose two rows were trained (``pipeline.train --grid``) and fingerprinted."""
    from pipeline.train import main

    folder = tmp_path_factory.mktemp("study")
    (folder / "params.yaml").write_text(yaml.safe_dump(GRID, sort_keys=False))
    here = Path.cwd()
    import os

    os.chdir(folder)
    try:
        for row in GRID["experiments"]:
            assert main(["--grid", row]) == 0
    finally:
        os.chdir(here)
    assert fingerprint.main([str(folder)]) == 0
    return folder


def test_the_fingerprint_holds_the_first_seeds_first_rounds_of_every_row(study):
    fp = json.loads((study / "results" / fingerprint.FILE).read_text())
    assert (fp["rounds"], fp["seed"], sorted(fp["rows"])) == (fingerprint.ROUNDS, 1, ["fast", "plain"])
    for row, rounds in fp["rows"].items():
        assert [r["round"] for r in rounds] == list(range(1, fingerprint.ROUNDS + 1))
        runs = (study / "results" / row / "runs.csv").read_text().splitlines()
        first = dict(zip(runs[0].split(","), runs[1].split(",")))
        assert rounds[0]["train_loss"] == float(first["train_loss"])
        assert rounds[0]["test_acc"] == float(first["test_acc"]) and 0 <= rounds[0]["test_acc"] <= 1


def test_verify_on_the_same_code_is_current_in_every_row(study):
    checks = fingerprint.verify(study)
    assert [(c.row, c.status) for c in checks] == [("plain", "current"), ("fast", "current")]


def test_a_row_whose_numbers_change_is_named_with_its_first_difference(study, tmp_path):
    changed = tmp_path / "changed"
    (changed / "results").mkdir(parents=True)
    grid = {**GRID, "experiments": {"plain": {}, "fast": {"train.lr": 0.2}}}  # the code now trains "fast" otherwise
    (changed / "params.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    (changed / "results" / fingerprint.FILE).write_text((study / "results" / fingerprint.FILE).read_text())
    checks = {c.row: c for c in fingerprint.verify(changed)}
    assert checks["plain"].status == "current"
    assert checks["fast"].status == "changed" and checks["fast"].detail.startswith("round 1: train_loss")


def test_the_tolerance_takes_other_float_sums_not_other_numbers():
    want = {"round": 1, "train_loss": 2.0, "test_acc": 0.5}
    assert fingerprint.differs({"train_loss": 2.0 + 1e-6, "test_acc": 0.5 + 1 / 900}, want) is None
    assert fingerprint.differs({"train_loss": 2.01, "test_acc": 0.5}, want) == "round 1: train_loss 2.01, committed 2"
    assert fingerprint.differs({"train_loss": 2.0, "test_acc": 0.52}, want) == "round 1: test_acc 0.52, committed 0.5"
    assert fingerprint.differs({"test_acc": 0.5}, want) == "round 1: no train_loss"


def test_a_study_without_a_fingerprint_or_results_says_what_writes_one(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(GRID, sort_keys=False))
    with pytest.raises(FileNotFoundError, match="make study-refresh"):
        fingerprint.verify(tmp_path)
    assert fingerprint.main([str(tmp_path)]) == 2


def test_a_study_that_reads_absent_local_files_says_where_they_go(tmp_path, monkeypatch):
    grid = {**GRID, "dataset": {"name": "cifar10", "root": str(tmp_path / "nowhere")}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    why = studies_status.needs_data(tmp_path)
    assert why is not None and "nowhere" in why and "\n" not in why
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(GRID, sort_keys=False))  # the bundled digits
    assert studies_status.needs_data(tmp_path) is None


def test_rows_of_one_population_are_verified_as_their_stage_trains_them(tmp_path, monkeypatch):
    """Two rows that share a pass (eta_l differs; the vectorised executor): the refresh trained them as one population
    of 4 replicas, and so does the verify run (one pass of 4), which finds both current."""
    import os

    from fl_core.engine import population
    from pipeline.train import main

    grid = {**GRID, "engine": {**GRID["engine"], "executor": "vectorized"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    here = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert main(["--grid", "plain,fast"]) == 0
    finally:
        os.chdir(here)
    assert fingerprint.main([str(tmp_path)]) == 0
    passes = []
    lock_step = population._lock_step
    monkeypatch.setattr(population, "_lock_step", lambda sims, *a: passes.append(len(sims)) or lock_step(sims, *a))
    checks = fingerprint.verify(tmp_path)
    assert [(c.row, c.status) for c in checks] == [("plain", "current"), ("fast", "current")]
    assert passes == [4]
