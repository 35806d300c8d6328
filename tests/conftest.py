"""Shared fixtures: the digits data set (loaded once) and a tiny config/simulator builder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# Keep test runs away from the project's MLflow store.
os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + str(Path(os.environ.get("TMPDIR", "/tmp")) /
                                                             f"fl-tests-{os.getpid()}-mlflow.db"))

TINY = ["partition.num_clients=6", "train.rounds=3", "train.participation=0.5", "train.local_epochs=2",
        "train.batch_size=32", "train.lr=0.05", "engine.progress=false", "engine.checkpoint_every=0",
        "tracking.enabled=false"]


@pytest.fixture(scope="session")
def digits():
    from fl_core.config import compose
    from fl_core.data import load_source

    cfg = compose([])
    return load_source(cfg.dataset, ROOT / "data" / "raw")


def tiny_cfg(*overrides):
    """The tiny setting (a preset: its keys may go unread, e.g. local_epochs under a test's local_steps) + the
    test's overrides (each must change the run)."""
    from fl_core.config import compose

    return compose(TINY + list(overrides), user=list(overrides))


def run_sim(ds, *overrides, **kw):
    """Compose a tiny config, build its simulator on ``ds`` and run it; returns (sim, result)."""
    from fl_core.data import make_partition
    from fl_core.engine.factory import build_simulator

    cfg = tiny_cfg(*overrides)
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes)
    sim = build_simulator(cfg, ds, part, **kw)
    return sim, sim.run()


@pytest.fixture(autouse=True)
def _deterministic_threads():
    mkldnn = torch.backends.mkldnn.enabled  # engine.kernels=portable turns oneDNN off for its process
    torch.set_num_threads(1)
    yield
    torch.backends.mkldnn.enabled = mkldnn


def skip_unless_permissions_apply(tmp_path: Path) -> None:
    """Skip where a file with mode 000 can still be read (root, CAP_DAC_OVERRIDE)."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        probe.read_text()
    except PermissionError:
        return
    finally:
        probe.chmod(0o644)
        probe.unlink()
    pytest.skip("this user reads files without read permission (root)")


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its schema built once per test process (MLflow's migrations take seconds per
    store); a test copies it (``shutil.copy``) rather than building its own."""
    from fl_core.store.tracking import ensure_store

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    ensure_store(f"sqlite:///{db}")
    return db


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One SQLite MLflow store per test module (creating a store costs seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def sandbox(tmp_path, monkeypatch, mlflow_uri):
    """The module's MLflow store and a private working directory (relative outputs land here): the sweeps' tests."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.chdir(tmp_path)
    return tmp_path
