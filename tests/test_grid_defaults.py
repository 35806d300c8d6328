"""A single run's defaults are the default grid's shared values, so a plain ``fl-train`` is a grid row; the grid
pins portable CPU kernels for its committed numbers (docs/reliability.md), so the row is exact with
``engine.kernels=portable``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_core.config import ConfigError, compose, to_container
from pipeline.grid import load_grid

ROOT = Path(__file__).resolve().parent.parent


def test_single_run_defaults_equal_the_grid_shared_values():
    grid = load_grid(ROOT / "params.yaml")
    assert to_container(compose(grid.shared)) == to_container(compose(["engine.kernels=portable"]))


def test_the_grid_fedavg_row_is_a_plain_single_run():
    grid = load_grid(ROOT / "params.yaml")
    row = to_container(compose(grid.overrides("fedavg", 1)))
    single = to_container(compose(["seed=1", "engine.kernels=portable"]))
    assert row.pop("name") == "fedavg" and single.pop("name") is None
    assert row == single


def test_a_shared_name_chooses_the_config_group(tmp_path):
    (tmp_path / "params.yaml").write_text(
        "partition: {name: dirichlet, alpha: 0.5}\nexperiments:\n  a: {algorithm: fedavg}\n  b: {partition: iid}\n")
    grid = load_grid(tmp_path / "params.yaml")
    assert grid.shared == ["partition=dirichlet", "partition.alpha=0.5"]
    a, b = (grid.compose_all(n)[0] for n in ("a", "b"))
    assert a.partition.name == "dirichlet" and a.partition.alpha == 0.5
    assert b.partition.name == "iid"  # the experiment's own group choice replaces the shared one
    # b does not use the shared alpha, a does: a grid setting, accepted; a run of b alone with it typed is refused
    with pytest.raises(ConfigError, match="partition.alpha has no effect with partition.name=iid"):
        compose(grid.overrides("b", 0))


def test_a_shared_key_no_experiment_uses_is_refused(tmp_path):
    (tmp_path / "params.yaml").write_text(
        "algorithm: {fedprox: {mu: 0.1}}\nexperiments:\n  a: {algorithm: fedavg}\n  b: {algorithm: scaffold}\n")
    grid = load_grid(tmp_path / "params.yaml")
    with pytest.raises(ConfigError) as err:
        grid.compose_all("a")
    assert str(err.value).startswith("algorithm.fedprox.mu: no experiment of the grid uses it (a: ")
    assert "algorithm=fedprox" in str(err.value)
    (tmp_path / "params.yaml").write_text(
        "algorithm: {fedprox: {mu: 0.1}}\nexperiments:\n  a: {algorithm: fedavg}\n  b: {algorithm: fedprox}\n")
    grid = load_grid(tmp_path / "params.yaml")
    assert grid.compose_all("b")[0].algorithm.fedprox.mu == 0.1
    assert grid.compose_all("a")[0].algorithm.name == "fedavg"  # the grid's FedProx setting, used by b


def test_an_experiments_own_key_it_does_not_use_is_refused(tmp_path):
    (tmp_path / "params.yaml").write_text(
        "experiments:\n  a: {algorithm: fedavg, algorithm.fedprox.mu: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^experiments\.a: algorithm\.fedprox\.mu is not used"):
        load_grid(tmp_path / "params.yaml").compose_all("a")


def test_an_unknown_shared_key_names_the_closest_known_one(tmp_path):
    (tmp_path / "params.yaml").write_text("train: {roudns: 3}\nexperiments:\n  a: {algorithm: fedavg}\n")
    with pytest.raises(ConfigError, match=r"unknown key train\.roudns \(did you mean train\.rounds\?\)"):
        load_grid(tmp_path / "params.yaml").compose_all("a")


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
