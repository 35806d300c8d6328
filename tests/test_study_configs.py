"""The paper studies' grids compose: every experiment of every studies/<study>/params.yaml is a valid config for
its first seed (the seeds change only ``seed``), with the grid's shared keys each used by some experiment (the
checks ``pipeline.train --grid`` and ``pipeline.prepare`` make before training), and the study's
dvc.yaml lists every experiment's results in its report stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_core.config import ConfigError, compose
from pipeline.grid import load_grid, report_deps

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ["mnist1d", "natural", "synthetic", "theory"]


def _composed(grid, name, seed=1):
    """Experiment ``name`` of ``grid`` composed as ``pipeline.train --grid`` composes it (its own keys checked)."""
    return compose(grid.overrides(name, seed), user=grid.experiments[name])


# mnist1d and synthetic have the most experiments (9-14 s): with the slow tests
@pytest.mark.parametrize("study", [pytest.param(s, marks=pytest.mark.slow) if s in ("mnist1d", "synthetic") else s
                                   for s in STUDIES])
def test_every_experiment_of_the_study_composes(study):
    grid = load_grid(ROOT / "studies" / study / "params.yaml")
    seed = grid.seeds[0]
    for name, own in grid.experiments.items():
        try:
            cfg = compose(grid.overrides(name, seed), user=own)
        except ConfigError as err:
            pytest.fail(f"experiments.{name}: {err}")
        assert (cfg.seed, cfg.name) == (seed, name)
    first = next(iter(grid.experiments))
    grid.check_shared(first, _composed(grid, first, seed))


@pytest.mark.parametrize("study", STUDIES)
def test_the_report_stage_depends_on_every_experiment(study):
    grid = load_grid(ROOT / "studies" / study / "params.yaml")
    text = (ROOT / "studies" / study / "dvc.yaml").read_text()
    missing = [d for d in report_deps(grid) if f"- {d}\n" not in text]
    assert not missing, f"run `python -m pipeline.grid sync-dvc` in studies/{study}: {missing[:3]}"


def test_the_mnist1d_central_experiments_are_the_authors_recipe():
    grid = load_grid(ROOT / "studies" / "mnist1d" / "params.yaml")
    for name in ("central_logreg", "central_mlp", "central_cnn", "central_gru", "central_cnn_shuf"):
        c = _composed(grid, name)
        assert (c.partition.name, c.partition.num_clients, c.train.participation) == ("iid", 1, 1.0)
        assert (c.train.optimizer, c.train.lr, c.train.batch_size, c.train.weight_decay) == ("adam", 0.01, 100, 0.0)
        assert c.train.local_steps * c.train.rounds == 6000
    assert _composed(grid, "central_cnn_shuf").dataset.shuffle_positions is True


def test_the_synthetic_straggler_arms():
    grid = load_grid(ROOT / "studies" / "synthetic" / "params.yaml")
    drop = _composed(grid, "fedavg_s11_p90")
    keep = _composed(grid, "fedprox1_s11_p90")
    assert (drop.algorithm.name, drop.train.stragglers, drop.train.drop_stragglers) == ("fedavg", 0.9, True)
    assert (keep.algorithm.name, keep.algorithm.fedprox.mu, keep.train.drop_stragglers) == ("fedprox", 1.0, False)
    assert (keep.train.local_epochs, keep.train.batch_size, keep.train.lr) == (20, 10, 0.01)
    assert round(keep.train.participation * keep.partition.num_clients) == 10
