"""A study's grid rows as populations in DVC: ``python -m pipeline.grid sync-dvc`` writes one train stage per group of
rows that can share a pass (``--grid A,B``), and a grouped stage gives each row, byte for byte, the outputs it gets
trained alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from fl_core.config import ConfigError
from pipeline.grid import load_grid, sync_dvc, train_groups, train_stage_name

ROOT = Path(__file__).resolve().parent.parent
VEC = {"engine": {"executor": "vectorized", "progress": False, "checkpoint_every": 0}}


def _grid(tmp: Path, experiments: dict, **shared) -> Path:
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump({"seeds": [1, 2], **shared, "experiments": experiments}, sort_keys=False))
    return path


def test_rows_that_differ_only_in_keys_a_replica_carries_form_one_group(tmp_path):
    """eta_l and FedProx's mu are carried by each replica: those rows group; another local-step setting, another
    rule, a row with its own tracking diagnostics stay alone; the groups keep the grid's order."""
    grid = load_grid(_grid(tmp_path, {
        "a": {"algorithm": "fedprox"},
        "b": {"algorithm": "fedprox", "train.lr": 0.1},
        "c": {"algorithm": "fedprox", "train.local_epochs": 2},
        "d": {"algorithm": "fedprox", "algorithm.fedprox.mu": 0.5, "train.lr": 0.2},
        "e": {"algorithm": "scaffold"},
        "f": {"algorithm": "scaffold", "train.lr": 0.1},
        "g": {"algorithm": "fedprox", "tracking.layer_cosine": True},
    }, **VEC))
    assert train_groups(grid) == [["a", "b", "d"], ["c"], ["e", "f"], ["g"]]
    assert train_stage_name(["a", "b", "d"]) == "train-a-and-2-more" and train_stage_name(["c"]) == "train-c"


def test_the_sequential_executor_or_population_off_keeps_every_row_alone(tmp_path):
    rows = {"a": {"train.lr": 0.05}, "b": {"train.lr": 0.1}}
    assert train_groups(load_grid(_grid(tmp_path, rows, engine={"executor": "sequential"}))) == [["a"], ["b"]]
    off = {"engine": {"executor": "vectorized", "population": False}}
    assert train_groups(load_grid(_grid(tmp_path, rows, **off))) == [["a"], ["b"]]


def test_a_row_that_does_not_compose_is_named(tmp_path):
    grid = load_grid(_grid(tmp_path, {"a": {}, "bad": {"partition.alpha": 0.5}}, partition={"name": "iid"}))
    with pytest.raises(ConfigError, match=r"^experiments\.bad: partition\.alpha"):
        train_groups(grid)


TEMPLATE = """stages:
  prepare:
    cmd: echo prepare
  # BEGIN grid train: generated
  train-x:
    cmd: OMP_NUM_THREADS=1 sh ../../scripts/python -m pipeline.train --grid x --params params.yaml
    deps:
      - code/fl_core
    params:
      - seeds
      - train
      - experiments.x
    outs:
      - results/x/models:
          cache: false
    metrics:
      - results/x/metrics.json:
          cache: false
    plots:
      - results/x/rounds.csv:
          cache: false
          x: round
  # END grid train
  report:
    cmd: echo report
    deps:
      # BEGIN grid deps
      # END grid deps
"""


def test_sync_dvc_writes_one_stage_per_group_after_the_first_stages_shape(tmp_path):
    grid = load_grid(_grid(tmp_path, {"a": {}, "b": {"train.lr": 0.1}, "c": {"train.local_epochs": 2}}, **VEC))
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text(TEMPLATE)
    assert sync_dvc(dvc, grid) is True
    stages = yaml.safe_load(dvc.read_text())["stages"]
    assert list(stages) == ["prepare", "train-a-and-1-more", "train-c", "report"]
    ab = stages["train-a-and-1-more"]
    assert ab["cmd"] == "OMP_NUM_THREADS=1 sh ../../scripts/python -m pipeline.train --grid a,b --params params.yaml"
    assert ab["deps"] == ["code/fl_core"]
    assert ab["params"] == ["seeds", "train", "experiments.a", "experiments.b"]
    assert ab["outs"] == [{"results/a/models": {"cache": False}}, {"results/b/models": {"cache": False}}]
    assert ab["metrics"] == [{f"results/{r}/metrics.json": {"cache": False}} for r in "ab"]
    assert ab["plots"] == [{f"results/{r}/rounds.csv": {"cache": False, "x": "round"}} for r in "ab"]
    assert stages["train-c"]["params"] == ["seeds", "train", "experiments.c"]
    assert "results/c/experiment.json" in stages["report"]["deps"]
    assert sync_dvc(dvc, grid) is False  # the generated block is its own template: in sync


def test_a_train_block_whose_first_stage_names_no_rows_is_refused(tmp_path):
    grid = load_grid(_grid(tmp_path, {"a": {}}, **VEC))
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text(TEMPLATE.replace("--grid x ", ""))
    with pytest.raises(ConfigError, match=r"dvc\.yaml: stage train-x: its cmd must name the rows with --grid"):
        sync_dvc(dvc, grid)
    dvc.write_text("stages:\n  # BEGIN grid train\n  # END grid train\n")
    with pytest.raises(ConfigError, match=r"holds no stage to follow"):
        sync_dvc(dvc, grid)


STUDIES = sorted(p.parent.name for p in (ROOT / "studies").glob("*/dvc.yaml"))
HEAVY = ("fedbug", "mnist1d", "noniid", "noniid_cifar10", "synthetic", "fednlr")  # 5-9 s of composing each


@pytest.mark.parametrize("study", [pytest.param(s, marks=pytest.mark.slow) if s in HEAVY else s for s in STUDIES])
def test_every_studys_train_stages_are_in_sync_with_its_grid(study, tmp_path):
    folder = ROOT / "studies" / study
    copy = tmp_path / "dvc.yaml"
    copy.write_text((folder / "dvc.yaml").read_text())
    grid = load_grid(folder / "params.yaml")
    assert sync_dvc(copy, grid) is False, f"run `python -m pipeline.grid sync-dvc` in studies/{study}"


ROWS = {"slow": {"train.lr": 0.03}, "fast": {"train.lr": 0.08}}
TINY = {"partition": {"num_clients": 6}, "model": {"name": "mlp"},
        "train": {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 32},
        "engine": {"executor": "vectorized", "progress": False, "checkpoint_every": 1},
        "tracking": {"enabled": False}}  # the MLflow runs of a grouped stage: tests/test_faults.py
FILES = ("metrics.json", "experiment.json", "rounds.csv", "runs.csv", "config.yaml")


def _train(folder: Path, monkeypatch, *args) -> int:
    from pipeline.train import main

    monkeypatch.chdir(folder)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder / 'mlflow.db'}")
    try:
        return main(list(args))
    except SystemExit as err:  # a bad command line: fail() exits
        return err.code


def test_a_grouped_stage_gives_each_row_the_outputs_it_gets_alone(tmp_path, monkeypatch):
    """``--grid slow,fast`` (two rows that differ in eta_l, 2 seeds each) trains one population of 4 replicas; each
    row's result files equal, byte for byte, and its models bit for bit, those of ``--grid slow`` and ``--grid fast``
    run one after another in another folder."""
    from fl_core.engine import population

    passes = []
    lock_step = population._lock_step
    monkeypatch.setattr(population, "_lock_step", lambda sims, *a: passes.append(len(sims)) or lock_step(sims, *a))
    grouped, alone = tmp_path / "grouped", tmp_path / "alone"
    for folder in (grouped, alone):
        folder.mkdir()
        _grid(folder, ROWS, **TINY)
    assert _train(grouped, monkeypatch, "--grid", "slow,fast") == 0
    assert passes == [4]
    passes.clear()
    for row in ROWS:
        assert _train(alone, monkeypatch, "--grid", row) == 0
    assert passes == [2, 2]
    for row in ROWS:
        for f in FILES:
            assert (grouped / "results" / row / f).read_bytes() == (alone / "results" / row / f).read_bytes(), (row, f)
        for s in (1, 2):
            got = torch.load(grouped / "results" / row / "models" / f"seed_{s}.pt")
            ref = torch.load(alone / "results" / row / "models" / f"seed_{s}.pt")
            assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), (row, s)


def test_grid_names_are_checked_before_anything_is_trained(tmp_path, monkeypatch, capsys):
    _grid(tmp_path, ROWS, **TINY)
    assert _train(tmp_path, monkeypatch, "--grid", "slow,slow") == 2
    assert "--grid slow,slow: a comma-separated list of distinct experiment names" in capsys.readouterr().err
    assert _train(tmp_path, monkeypatch, "--grid", "slow,nope") == 2
    assert "no experiment named 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
