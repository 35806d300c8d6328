"""A single run's defaults are the default grid's shared values, so a plain ``fl-train`` is a grid row."""

from __future__ import annotations

from pathlib import Path

from fl_core.config import compose, to_container
from pipeline.grid import load_grid

ROOT = Path(__file__).resolve().parent.parent


def test_single_run_defaults_equal_the_grid_shared_values():
    grid = load_grid(ROOT / "params.yaml")
    assert to_container(compose(grid.shared)) == to_container(compose([]))


def test_the_grid_fedavg_row_is_a_plain_single_run():
    grid = load_grid(ROOT / "params.yaml")
    row = to_container(compose(grid.overrides("fedavg", 1)))
    single = to_container(compose(["seed=1"]))
    assert row.pop("name") == "fedavg" and single.pop("name") is None
    assert row == single


def test_a_shared_name_chooses_the_config_group(tmp_path):
    (tmp_path / "params.yaml").write_text(
        "partition: {name: dirichlet, alpha: 0.5}\nexperiments:\n  a: {algorithm: fedavg}\n  b: {partition: iid}\n")
    grid = load_grid(tmp_path / "params.yaml")
    assert grid.shared == ["partition=dirichlet", "partition.alpha=0.5"]
    a, b = (compose(grid.overrides(n, 0)) for n in ("a", "b"))
    assert a.partition.name == "dirichlet" and a.partition.alpha == 0.5
    assert b.partition.name == "iid"  # the experiment's own group choice replaces the shared one


def test_a_sweeps_dvc_entry_pins_the_grids_group_choices_as_choices(tmp_path):
    """sweeps/outputs.py pins every shared key of params.yaml the tuned overrides do not set; a shared group
    choice (partition: {name: shards}) is pinned as a choice, not as the whole section."""
    from sweeps.outputs import _pinned_for_dvc

    (tmp_path / "params.yaml").write_text(
        "partition: {name: shards, num_clients: 10}\ntrain: {rounds: 30}\nexperiments:\n  a: {algorithm: fedavg}\n")
    pins = _pinned_for_dvc(["algorithm=fedprox"], tmp_path / "params.yaml")
    assert pins == ["algorithm=fedprox", "partition=shards", "partition.num_clients=10", "train.rounds=30"]
    pins = _pinned_for_dvc(["partition=dirichlet", "train.rounds=5"], tmp_path / "params.yaml")
    assert pins == ["partition=dirichlet", "train.rounds=5", "partition.num_clients=10"]
