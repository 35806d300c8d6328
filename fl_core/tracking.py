"""MLflow tracking: one parent run per experiment, one child run per seed, metrics every round.

Store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db`` with artifacts
under ``<project root>/mlartifacts`` (absolute, so DVC stages, queued ``dvc exp`` runs and sweeps
share one store). Per-round metrics are buffered and written in one ``log_batch`` every
``tracking.log_every`` rounds and at checkpoints (about a millisecond per round on SQLite).

Resume: a resumed run reopens its MLflow run (its id is in the checkpoint) and skips the steps
already stored, so every metric keeps exactly one value per round.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from .paths import store_root

log = logging.getLogger(__name__)

_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000


def tracking_uri(root: Optional[Path] = None) -> str:
    """The tracking URI in force: ``MLFLOW_TRACKING_URI`` or the project's SQLite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(root or store_root()) / 'mlflow.db'}"


def artifact_root(uri: str) -> Optional[str]:
    """For a SQLite store, ``<folder of the .db>/mlartifacts`` (MLflow would otherwise use ``./mlruns``
    of whatever folder a run starts in); None (the server's default) for other stores."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    db = Path(uri[len(prefix):])
    if not db.is_absolute():
        db = Path.cwd() / db
    return (db.parent / "mlartifacts").as_uri()


def flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested mappings -> ``{"a.b.c": value}`` (lists kept as their string form)."""
    out: Dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten(v, key))
            else:
                out[key] = v
    return out


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quiet_mlflow() -> None:
    for name in ("mlflow", "alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Tracking:
    """A thin wrapper over :class:`mlflow.tracking.MlflowClient` for one MLflow experiment."""

    def __init__(self, experiment: str, root: Optional[Path] = None):
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient

        self.root = root or store_root()
        self.uri = tracking_uri(self.root)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(experiment,
                                                               artifact_location=artifact_root(self.uri))
        else:
            self.experiment_id = exp.experiment_id

    def start_parent(self, name: str, tags: Dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        return run.info.run_id

    def end_parent(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def child_logger(self, parent_id, name: str, tags: Dict[str, str], params: Dict[str, Any],
                     log_every: int = 10) -> "MlflowRunLogger":
        return MlflowRunLogger(self, parent_id, name, tags, params, log_every)

    def log_params(self, run_id: str, params: Dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        from mlflow.entities import Param

        for s in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[s:s + _MAX_PARAMS_PER_BATCH]])

    def log_artifacts(self, run_id: str, paths: Iterable[Path], artifact_path: Optional[str] = None) -> None:
        for p in paths:
            if Path(p).exists():
                self.client.log_artifact(run_id, str(p), artifact_path)


class MlflowRunLogger:
    """A child run that receives the per-round metrics of one seed (implements the RunLogger protocol)."""

    def __init__(self, tracking: Tracking, parent_id, name: str, tags: Dict[str, str],
                 params: Dict[str, Any], log_every: int):
        self.tracking = tracking
        # the parent run id, or a callable giving it (called only for a new run; a resumed run keeps
        # the parent recorded in its checkpoint)
        self._parent = parent_id
        self.parent_id: Optional[str] = parent_id if isinstance(parent_id, str) or parent_id is None else None
        self.name = name
        self.tags = dict(tags)
        self.params = params
        self.log_every = max(1, int(log_every))
        self.run_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._skip_until = 0  # steps <= this are already stored (resume)
        self._pending_steps = 0

    # -------------------------------------------------------------- RunLogger protocol
    def open(self, saved: Optional[dict]) -> None:
        client = self.tracking.client
        if saved and saved.get("run_id"):
            self.run_id = saved["run_id"]
            self.parent_id = saved.get("parent_id")
            client.update_run(self.run_id, status="RUNNING")
            hist = client.get_metric_history(self.run_id, "train_loss")
            self._skip_until = max((m.step for m in hist), default=0)
            return
        tags = dict(self.tags)
        if callable(self._parent):
            self.parent_id = self._parent()
        if self.parent_id:
            tags["mlflow.parentRunId"] = self.parent_id
        run = client.create_run(self.tracking.experiment_id, run_name=self.name, tags=tags)
        self.run_id = run.info.run_id
        self.tracking.log_params(self.run_id, self.params)

    def state(self) -> dict:
        return {"run_id": self.run_id, "parent_id": self.parent_id}

    def log_round(self, step: int, metrics: Dict[str, float]) -> None:
        if step <= self._skip_until:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), ts, int(step)) for k, v in metrics.items())
        self._pending_steps += 1
        if self._pending_steps >= self.log_every:
            self.flush()

    def flush(self) -> None:
        if not self._buffer or self.run_id is None:
            return
        for s in range(0, len(self._buffer), _MAX_METRICS_PER_BATCH):
            self.tracking.client.log_batch(self.run_id, metrics=self._buffer[s:s + _MAX_METRICS_PER_BATCH])
        self._buffer.clear()
        self._pending_steps = 0

    def close(self, status: str, reason: Optional[str] = None) -> None:
        if self.run_id is None:
            return
        self.flush()
        if reason:
            self.tracking.client.set_tag(self.run_id, "failure_reason", reason[:5000])
        self.tracking.client.set_terminated(self.run_id, status=status)

    # -------------------------------------------------------------- extras
    def log_artifacts(self, paths: Iterable[Path], artifact_path: Optional[str] = None) -> None:
        if self.run_id is not None:
            self.tracking.log_artifacts(self.run_id, paths, artifact_path)

    def log_summary(self, metrics: Dict[str, float]) -> None:
        """Summary values (no step), e.g. best accuracy."""
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.tracking.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()])
