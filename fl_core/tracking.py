"""MLflow tracking: one parent run per experiment, one child run per seed, metrics every round.

Store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db`` with artifacts
under ``<project root>/mlartifacts`` (absolute, so DVC stages, queued ``dvc exp`` runs and sweeps
share one store). Per-round metrics are buffered and written in one ``log_batch`` every
``tracking.log_every`` rounds and at checkpoints (about a millisecond per round on SQLite).

Run identity: an experiment's parent run carries the tags ``fl.experiment`` (its name),
``fl.fingerprint`` (hash of the config that determines its numbers, seeds excluded) and
``fl.role=parent``; a seed's child run carries ``fl.seed`` under it. Every start looks these runs
up by tags (:meth:`Tracking.parent_run`, :meth:`Tracking.child_run`), so a command run again after
a kill at any point continues in the same runs, and a reopened run skips every (metric, step) it
already holds: each metric keeps exactly one value per round. Every run also records the process
that runs it (:func:`fl_core.procs.identity`), so a later start can end the runs of a process that
is gone (:meth:`Tracking.end_orphans`: status KILLED, tag ``fl.end_reason``).

What the UI shows: a run's params are :func:`run_params` (the config without the sections of the rules
that are not in its stack); per-round metrics get MLflow names of the form ``<section>/<key>``
(:func:`mlflow_metric_name`) so that the chart view shows accuracy, loss, communication, per-round
bookkeeping and diagnostics in that order (the CSV files and histories keep the plain keys); every
experiment carries the tag ``mlflow.experimentKind`` = ``custom_model_development`` (a model-training
experiment, not a GenAI one).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, List, Optional

from . import procs
from .paths import store_root

log = logging.getLogger(__name__)

_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

TAG_EXPERIMENT, TAG_FINGERPRINT, TAG_ROLE, TAG_SEED = "fl.experiment", "fl.fingerprint", "fl.role", "fl.seed"
TAG_END_REASON = "fl.end_reason"
#: statuses of a run that an interrupted command left behind (a new attempt continues in it)
RESUMABLE = ("RUNNING", "KILLED", "SCHEDULED")
ORPHAN_REASON = "orphaned: the process that ran it is gone"

#: MLflow's experiment tag for the kind of work an experiment holds; ``custom_model_development`` is a
#: model-training experiment (the UI's "Machine learning" / "Model training" kind, vs ``genai_development``)
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

#: sections of the per-round metrics in MLflow, in the order the chart view shows them. The chart view
#: puts a metric ``a/b/c`` in section ``a/b`` and orders the sections by name (keys without ``/`` go to
#: "Model metrics", shown after every named section), hence the leading digits.
GROUP_ACCURACY, GROUP_LOSS, GROUP_COMM, GROUP_ROUND, GROUP_DIAGNOSTICS = (
    "1_accuracy", "2_loss", "3_communication", "4_round", "5_diagnostics")
METRIC_GROUPS = (GROUP_ACCURACY, GROUP_LOSS, GROUP_COMM, GROUP_ROUND, GROUP_DIAGNOSTICS)
#: per-round bookkeeping of the round loop
ROUND_KEYS = ("lr", "num_clients", "round_time_s", "local_steps_mean", "local_steps_min", "local_steps_max",
              "stragglers")


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


def mlflow_metric_name(key: str) -> str:
    """The MLflow name of the per-round metric ``key``: ``<section>/<key>``, the section (one of
    :data:`METRIC_GROUPS`) telling where the chart view shows it. Tokens are the ``_``-separated parts
    of ``key``; the first rule that applies wins:

    - a ``/`` in the key (``client_loss/3``): ``5_diagnostics/<key>`` (section ``5_diagnostics/client_loss``);
    - a token ``acc``: ``1_accuracy/<key>`` (``test_acc``, ``val_acc``, ``post_test_acc``), or
      ``1_accuracy/clients/<key>`` when the first token is ``client`` (``client_acc_mean`` / ``_std`` /
      ``_worst10``: their own section, right after the accuracies);
    - a token ``loss``: ``2_loss/<key>`` (``test_loss``, ``train_loss``, ``train_loss_clients_max``);
    - first token ``comm``: ``3_communication/<key>`` (``comm_up_floats``, ``comm_down_floats``);
    - one of :data:`ROUND_KEYS`: ``4_round/<key>`` (``lr``, ``num_clients``, ``round_time_s``);
    - anything else: ``5_diagnostics/<key>`` (``cos_*``, ``neuron_drift*``, the rules' diagnostics).

    A name already in a section (its first part one of :data:`METRIC_GROUPS`) and MLflow's ``system/``
    metrics are returned unchanged.
    """
    head = key.split("/", 1)[0]
    if head in METRIC_GROUPS or head == "system":
        return key
    if "/" in key:
        return f"{GROUP_DIAGNOSTICS}/{key}"
    tokens = key.split("_")
    if "acc" in tokens:
        return f"{GROUP_ACCURACY}/clients/{key}" if tokens[0] == "client" else f"{GROUP_ACCURACY}/{key}"
    if "loss" in tokens:
        return f"{GROUP_LOSS}/{key}"
    if tokens[0] == "comm":
        return f"{GROUP_COMM}/{key}"
    if key in ROUND_KEYS:
        return f"{GROUP_ROUND}/{key}"
    return f"{GROUP_DIAGNOSTICS}/{key}"


def rule_sections() -> Dict[str, FrozenSet[str]]:
    """Rule name -> the ``algorithm.<section>`` config sections it reads, from the rule registry
    (:mod:`fl_core.algorithms.registry`): ``fedbcgd_plus`` -> {fedbcgd}, ``topk`` / ``qsgd`` -> {compression},
    ``adam`` -> {adaptive}, ``momentum`` -> {fedavgm}, ``fedavg`` -> {}."""
    from .algorithms import registry

    return {r.name: frozenset(registry.stack_sections([r.name])) for r in registry.rules()}


def run_params(container: Dict[str, Any]) -> Dict[str, Any]:
    """MLflow params of a run: :func:`flatten` of the config ``container`` (e.g.
    :func:`fl_core.config.to_container`), where ``algorithm.*`` keeps its own values (``name``,
    ``wrappers``, ``aggregation``, ``eta_g``, ... everything that is not a section) and only the sections
    of the rules in the stack: ``algorithm.name``, ``algorithm.server_opt`` and every ``algorithm.wrappers`` entry
    (``registry.trim_sections``; a rule the registry does not know keeps the section of its own name).
    Everything outside ``algorithm`` is kept."""
    from .algorithms import registry

    algo = container.get("algorithm")
    if not isinstance(algo, dict):
        return flatten(container)
    return flatten({**container, "algorithm": registry.trim_sections(algo)})


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quiet_mlflow() -> None:
    for name in ("mlflow", "alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _filter(tags: Dict[str, str], status: Optional[str] = None) -> str:
    conds = [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    if status:
        conds.append(f"attributes.status = '{status}'")
    return " and ".join(conds)


def end_orphaned_runs(client, experiment_id: str, tags: Optional[Dict[str, str]] = None) -> List[str]:
    """End the runs of ``experiment_id`` (with the given tag values) left RUNNING by a process of this
    machine that is gone (:func:`fl_core.procs.gone` on the run's ``fl.host`` / ``fl.pid`` /
    ``fl.proc_start`` tags; without ``fl.proc_start`` the run's start bounds the process's). Each is set
    KILLED with ``fl.end_reason`` = :data:`ORPHAN_REASON`; runs of other machines, of live processes
    and without the tags are left alone.

    Returns:
        The ids of the runs ended.

    Raises:
        mlflow.exceptions.MlflowException: the store cannot be searched or written.
    """
    query = _filter({**(tags or {}), "fl.host": procs.HOST}, "RUNNING")
    runs, token = [], None
    while True:  # every page first: ending runs while paging would shift the pages
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    ended = []
    for run in runs:
        if procs.gone(run.data.tags, run.info.start_time / 1000):
            client.set_tag(run.info.run_id, TAG_END_REASON, ORPHAN_REASON)
            client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
    return ended


def ensure_store(uri: str) -> None:
    """Create a missing SQLite store whole: MLflow builds its schema in a temporary file beside the
    target, which is renamed into place only when complete (under a lock, so that concurrent first
    starts create it once). A kill during MLflow's schema creation would otherwise leave a store
    that no later start can open. Other stores (a server, PostgreSQL) are left to MLflow.
    Fault point ``store_init``."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return
    db = Path(uri[len(prefix):])
    if not db.is_absolute():
        db = Path.cwd() / db
    if db.exists():
        return
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    from . import durable, faults

    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db.with_name(f".{db.name}.lock"))):
        if db.exists():
            return
        for stale in db.parent.glob(f".{db.name}.*.init"):  # left by a killed creation
            stale.unlink()
        tmp = db.with_name(f".{db.name}.{os.getpid()}.init")
        MlflowClient(tracking_uri=f"{prefix}{tmp}").search_experiments(max_results=1)  # builds the schema
        faults.point("store_init")
        os.replace(tmp, db)
        durable.fsync_dir(db.parent)


class Tracking:
    """A thin wrapper over :class:`mlflow.tracking.MlflowClient` for one MLflow experiment."""

    def __init__(self, experiment: str, root: Optional[Path] = None):
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient

        self.root = root or store_root()
        self.uri = tracking_uri(self.root)
        ensure_store(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(experiment,
                                                               artifact_location=artifact_root(self.uri),
                                                               tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
        else:
            self.experiment_id = exp.experiment_id
            if TAG_EXPERIMENT_KIND not in exp.tags:  # an older experiment; a kind set in the UI stays
                self.client.set_experiment_tag(self.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)

    def find_runs(self, tags: Dict[str, str], status: Optional[str] = None) -> List[Any]:
        """Runs of this experiment whose tags have the given values (newest first)."""
        return self.client.search_runs([self.experiment_id], filter_string=_filter(tags, status),
                                       order_by=["attributes.start_time DESC"], max_results=1000)

    def reopen(self, run_id: str) -> None:
        """Mark a run RUNNING again, recorded as this process's (an earlier ``fl.end_reason`` dropped)."""
        if TAG_END_REASON in self.client.get_run(run_id).data.tags:
            self.client.delete_tag(run_id, TAG_END_REASON)
        self.client.update_run(run_id, status="RUNNING")
        for k, v in procs.identity().items():
            self.client.set_tag(run_id, k, v)

    def parent_run(self, name: str, fingerprint: str, tags: Dict[str, str], continuing: bool = False) -> str:
        """The parent run of experiment (``name``, ``fingerprint``), reopened, or a new one.

        With ``continuing`` (an unfinished attempt exists on disk) the newest parent is reused whatever
        its status (a kill may have come after it ended); otherwise only one an interrupted command left
        (:data:`RESUMABLE`): FINISHED and FAILED parents are complete attempts."""
        for run in self.find_runs({TAG_ROLE: "parent", TAG_EXPERIMENT: name, TAG_FINGERPRINT: fingerprint}):
            if continuing or run.info.status in RESUMABLE:
                self.reopen(run.info.run_id)
                return run.info.run_id
        return self.start_parent(name, {**tags, TAG_ROLE: "parent", TAG_EXPERIMENT: name,
                                        TAG_FINGERPRINT: fingerprint})

    def child_run(self, parent_id: str, seed: int) -> Optional[Any]:
        """The newest child run of ``seed`` under ``parent_id``, or None."""
        runs = self.find_runs({"mlflow.parentRunId": parent_id, TAG_SEED: str(seed)})
        return runs[0] if runs else None

    def start_parent(self, name: str, tags: Dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags={**tags, **procs.identity()})
        return run.info.run_id

    def end_parent(self, run_id: str, status: str = "FINISHED", reason: Optional[str] = None) -> None:
        self.end_run(run_id, status, reason)

    def end_run(self, run_id: str, status: str, reason: Optional[str] = None) -> None:
        """End a run with ``status``; ``reason`` goes to the tag ``fl.end_reason``."""
        if reason:
            self.client.set_tag(run_id, TAG_END_REASON, reason[:5000])
        self.client.set_terminated(run_id, status=status)

    def end_orphans(self, name: str) -> int:
        """End the RUNNING runs of experiment ``name`` whose process is gone (:func:`end_orphaned_runs`);
        returns how many were ended."""
        return len(end_orphaned_runs(self.client, self.experiment_id, {TAG_EXPERIMENT: name}))

    def child_logger(self, parent_id, name: str, tags: Dict[str, str], params: Dict[str, Any],
                     log_every: int = 10) -> "MlflowRunLogger":
        return MlflowRunLogger(self, parent_id, name, tags, params, log_every)

    def log_params(self, run_id: str, params: Dict[str, Any]) -> None:
        """Log params, skipping those the run already holds (params cannot change once logged)."""
        have = self.client.get_run(run_id).data.params
        items = [(k, str(v)[:6000]) for k, v in params.items() if k not in have]
        from mlflow.entities import Param

        for s in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[s:s + _MAX_PARAMS_PER_BATCH]])

    def log_metrics_once(self, run_id: str, metrics: Dict[str, float], step: int = 0) -> None:
        """Log step-``step`` values of the keys the run does not hold yet (summaries: once per run).

        Summary names are kept as given (no :func:`mlflow_metric_name` section): they are the runs
        table's sort columns (``final_acc_mean``, ``summary_best_acc``) and the chart view shows them
        under "Model metrics", after the per-round sections."""
        from mlflow.entities import Metric

        have = self.client.get_run(run_id).data.metrics
        ts = int(time.time() * 1000)
        todo = [Metric(k, float(v), ts, step) for k, v in metrics.items() if k not in have and v is not None]
        for s in range(0, len(todo), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=todo[s:s + _MAX_METRICS_PER_BATCH])

    def log_inputs(self, run_id: str, inputs: Iterable[Dict[str, str]]) -> None:
        """Log datasets as the run's MLflow inputs (shown in the UI's Datasets column), once per run.

        Args:
            inputs: dicts with ``name``, ``digest``, ``source`` (where the data comes from) and
                ``context`` (``training``, ``evaluation``, ...).
        """
        from mlflow.entities import Dataset, DatasetInput, InputTag

        have = {(d.dataset.name, d.dataset.digest) for d in self.client.get_run(run_id).inputs.dataset_inputs}
        todo = [DatasetInput(Dataset(i["name"], i["digest"], "local", i["source"]),
                             [InputTag("mlflow.data.context", i["context"])])
                for i in inputs if (i["name"], i["digest"]) not in have]
        if todo:
            self.client.log_inputs(run_id, datasets=todo)

    def log_artifacts(self, run_id: str, paths: Iterable[Path], artifact_path: Optional[str] = None) -> None:
        for p in paths:
            if Path(p).exists():
                self.client.log_artifact(run_id, str(p), artifact_path)


class MlflowRunLogger:
    """A child run that receives the per-round metrics of one seed (implements the RunLogger protocol).

    With a parent id and a ``fl.seed`` tag the run is looked up by tags when it opens
    (:meth:`Tracking.child_run`): an existing child of that seed is reopened and keeps its
    (metric, step) pairs; else, or without them, the run id saved in a checkpoint is reopened, or a
    new child is created.

    Per-round metrics go to MLflow under :func:`mlflow_metric_name`; a metric that a reopened run
    already holds under its plain name (a run begun before the names had sections) keeps that name,
    so that each series stays whole.
    """

    def __init__(self, tracking: Tracking, parent_id: Optional[str], name: str, tags: Dict[str, str],
                 params: Dict[str, Any], log_every: int):
        self.tracking = tracking
        self.parent_id = parent_id
        self.name = name
        self.tags = dict(tags)
        self.params = params
        self.log_every = max(1, int(log_every))
        self.run_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._logged: Dict[str, set] = {}  # MLflow name -> steps the (reopened) run already holds
        self._names: Dict[str, str] = {}  # per-round key -> its MLflow name in this run
        self._pending_steps = 0

    # -------------------------------------------------------------- RunLogger protocol
    def open(self, saved: Optional[dict]) -> None:
        client = self.tracking.client
        self._names.clear()
        run_id = None
        if self.parent_id and TAG_SEED in self.tags:
            found = self.tracking.child_run(self.parent_id, int(self.tags[TAG_SEED]))
            run_id = found.info.run_id if found is not None else None
        if run_id is None and saved and saved.get("run_id"):
            run_id = saved["run_id"]
            self.parent_id = self.parent_id or saved.get("parent_id")
        if run_id is not None:
            self.run_id = run_id
            self.tracking.reopen(run_id)
            for key in client.get_run(run_id).data.metrics:
                self._logged[key] = {m.step for m in client.get_metric_history(run_id, key)}
            self.tracking.log_params(run_id, self.params)
            return
        tags = {**self.tags, **procs.identity()}
        if self.parent_id:
            tags["mlflow.parentRunId"] = self.parent_id
        run = client.create_run(self.tracking.experiment_id, run_name=self.name, tags=tags)
        self.run_id = run.info.run_id
        self.tracking.log_params(self.run_id, self.params)

    def state(self) -> dict:
        return {"run_id": self.run_id, "parent_id": self.parent_id}

    def metric_name(self, key: str) -> str:
        """The MLflow name of the per-round metric ``key`` in this run: :func:`mlflow_metric_name`, or
        ``key`` itself where the reopened run holds ``key`` and not the sectioned name."""
        name = self._names.get(key)
        if name is None:
            name = mlflow_metric_name(key)
            if name != key and key in self._logged and name not in self._logged:
                name = key
            self._names[key] = name
        return name

    def log_round(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        step = int(step)
        named = ((self.metric_name(k), v) for k, v in metrics.items())
        self._buffer.extend(Metric(n, float(v), ts, step) for n, v in named
                            if step not in self._logged.get(n, ()))
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
        if reason and status == "FAILED":
            self.tracking.client.set_tag(self.run_id, "failure_reason", reason[:5000])
        self.tracking.end_run(self.run_id, status, reason)

    # -------------------------------------------------------------- extras
    def log_artifacts(self, paths: Iterable[Path], artifact_path: Optional[str] = None) -> None:
        if self.run_id is not None:
            self.tracking.log_artifacts(self.run_id, paths, artifact_path)

    def log_summary(self, metrics: Dict[str, float]) -> None:
        """Summary values (step 0), e.g. best accuracy; each key is logged once per run."""
        if self.run_id is not None:
            self.tracking.log_metrics_once(self.run_id, metrics)
