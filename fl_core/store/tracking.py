"""MLflow tracking: one parent run per experiment, one child run per seed, metrics every round.

Store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db`` with artifacts under
``<project root>/mlartifacts`` (the store's path is absolute, so DVC stages, queued ``dvc exp`` runs and sweeps
share one store; the artifact locations inside it are not, see below). Per-round metrics are buffered and
written in one ``log_batch`` every ``tracking.log_every`` rounds by a writer thread while training goes on
(:meth:`Tracking.submit`); each checkpoint, failure and run end waits until they are in the store.

Run identity: an experiment's parent run carries the tags ``fl.experiment`` (its name),
``fl.fingerprint`` (hash of the config that determines its numbers, seeds excluded) and
``fl.role=parent``; a seed's child run carries ``fl.seed`` under it. Every start looks these runs
up by tags (:meth:`Tracking.parent_run`, :meth:`Tracking.child_run`), so a command run again after
a kill at any point continues in the same runs, and a reopened run skips every (metric, step) it
already holds: each metric keeps exactly one value per round. Every run also records the process
that runs it (:func:`fl_core.store.procs.identity`), so a later start can end the runs of a process that
is gone (:meth:`Tracking.end_orphans`: status KILLED, tag ``fl.end_reason``). A run ended FAILED because the
environment failed under it (``fl.end_reason`` ``environment failure: ...``) is continued by the next start as a
KILLED one is (:func:`resumable`).

Waiting on the store is bounded (:func:`bounded_uri`, :mod:`fl_core.store.storewait`: MLflow's HTTP retries, SQLite's
busy timeout, PostgreSQL's timeouts) and a store that fails is named in one line (:mod:`fl_core.store.storefail`: locked,
unreachable, a ``sqlite:///`` URI in a folder that does not exist).

What the UI shows: a run's params are :func:`run_params` (the config without the sections of the rules
that are not in its stack); per-round metrics get MLflow names ``<section>/<name>`` (:func:`mlflow_metric_name`:
``test/acc``, ``train/loss``, ``comm/up_floats``, ...; the UI's chart view makes one section of each part before
the ``/``; the CSV files and histories keep the plain keys); per-layer and per-client values stay in the
``seed_<s>.csv`` artifact unless ``tracking.detail_metrics`` (:func:`is_detail`); a parent run gets the seed-mean
curves (:meth:`Tracking.log_curves`), a child run its final model as an MLflow model named ``model``
(:meth:`Tracking.log_model`, ``mlflow.pytorch``), and the parent the tags :data:`TAG_BEST_CHILD`,
:data:`TAG_BEST_SEED` and :data:`TAG_BEST_MODEL_URI` (the child with the best final accuracy); every
experiment carries the tag ``mlflow.experimentKind`` = ``custom_model_development`` (a model-training
experiment, not a GenAI one). The metric names are listed in ``docs/tracking.md``.

Artifacts of a SQLite store live in ``mlartifacts/`` beside ``mlflow.db``, recorded in the store as
``mlflow-artifacts:/...`` (no folder in the database): a moved or copied project folder keeps its artifacts
(:mod:`fl_core.store.mlflow_artifacts`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, List, Optional

from . import envfail, mlflow_artifacts, procs, storefail, storewait
from ..paths import store_root

log = logging.getLogger(__name__)

_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

TAG_EXPERIMENT, TAG_FINGERPRINT, TAG_ROLE, TAG_SEED = "fl.experiment", "fl.fingerprint", "fl.role", "fl.seed"
TAG_END_REASON = "fl.end_reason"
#: the DVC experiment a run was made by (``dvc exp run`` exports its name to the stage as ``DVC_EXP_NAME``); the
#: run names carry it too, so a grid's experiments tell apart in the MLflow UI
TAG_DVC_EXPERIMENT = "dvc.exp_name"
#: statuses of a run that an interrupted command left behind (a new attempt continues in it); a FAILED run whose
#: ``fl.end_reason`` starts with :data:`ENV_FAILURE` is one too (:func:`resumable`)
RESUMABLE = ("RUNNING", "KILLED", "SCHEDULED")
ORPHAN_REASON = "orphaned: the process that ran it is gone"
#: how the ``fl.end_reason`` of a run ended FAILED by an environment failure begins (:mod:`fl_core.store.envfail`): the
#: environment failed, not the run, so the same command continues it
ENV_FAILURE = "environment failure: "
#: how the ``fl.end_reason`` of a run ended FAILED because the command stopped on an error of its own (bad input found
#: late, a defect) begins: not the run's numbers, so the same command continues it once the cause is fixed
STOPPED_BY_ERROR = "stopped by an error: "
#: what to do when the SQLite tracking store is locked (:func:`fl_core.store.storefail.name_store`)
SQLITE_LOCKED_ACTION = "retry, or set MLFLOW_TRACKING_URI to a tracking server"

#: MLflow's experiment tag for the kind of work an experiment holds; ``custom_model_development`` is a
#: model-training experiment (the UI's "Machine learning" / "Model training" kind, vs ``genai_development``)
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

#: the experiment's saved runs-table view (MLflow 3's UI: the Runs tab's "Saved views" menu, or the link of
#: :func:`headline_url`): the headline columns a user would otherwise pick by hand, each run's final accuracy first
TAG_SHARED_VIEW = "mlflow.sharedViewState."
HEADLINE_VIEW = "headline"
HEADLINE_COLUMNS = ("metrics.`final_acc_mean`", "metrics.`final_acc_std`", "metrics.`summary_final_acc`",
                    "tags.`algorithm`", "tags.`partition`", "tags.`dataset`", "tags.`seed`")
HEADLINE_STATE = {"selectedColumns": list(HEADLINE_COLUMNS), "orderByKey": "metrics.`final_acc_mean`",
                  "orderByAsc": False}
#: the experiment's description (shown above its runs), set when it has none
TAG_NOTE = "mlflow.note.content"
NOTE = ("Federated-learning runs of this project: one parent run per experiment (the summary over seeds, the seed-mean "
        "curves), one child run per seed (every round, the final model). The headline columns (final accuracy, "
        "algorithm, partition, dataset, seed): Runs tab > Saved views > headline, or add "
        "`?viewStateShareKey=headline` to the runs page's address.")

#: the name of a child run's MLflow model: ``mlflow.pytorch.load_model("runs:/<child run id>/model")``
MODEL_NAME = "model"
#: parent-run tags naming the child whose final accuracy is the highest: its run id, its seed, its model's URI
TAG_BEST_CHILD, TAG_BEST_SEED, TAG_BEST_MODEL_URI = "fl.best_child", "fl.best_seed", "fl.best_model_uri"
#: how a child's model was serialised (``pt2``: torch.export; ``pickle``: the fallback for a model torch.export
#: cannot trace)
TAG_MODEL_FORMAT = "fl.model_format"

#: The MLflow names of the per-round keys (docs/tracking.md lists them with units). The UI's chart view puts
#: ``<section>/<name>`` in section ``<section>`` (the run page: the part before the first ``/``; the experiment's
#: chart view: before the last one; every name here has one ``/``, so both agree) and titles the chart
#: ``<name>``. Sections: ``test`` (the global model on the evaluation split), ``val`` (a sweep's validation
#: split), ``post`` (after a post-training step such as CCVR), ``train``, ``comm``, ``round`` (per-round
#: bookkeeping), ``diag`` (rule and study diagnostics), ``drift`` (the drift measures, ``tracking.drift``), ``detail`` (per-layer and per-client values, only with
#: ``tracking.detail_metrics``).
METRIC_NAMES: Dict[str, str] = {
    "test_acc": "test/acc", "test_acc_std": "test/acc_std", "test_loss": "test/loss",
    "client_acc_mean": "test/client_acc_mean", "client_acc_std": "test/client_acc_std",
    "client_acc_worst10": "test/client_acc_worst10",
    "val_acc": "val/acc", "val_loss": "val/loss",
    "train_loss": "train/loss", "train_loss_clients_min": "train/loss_clients_min",
    "train_loss_clients_max": "train/loss_clients_max", "lr": "train/lr",
    "comm_up_floats": "comm/up_floats", "comm_down_floats": "comm/down_floats",
    "num_clients": "round/clients", "local_steps_mean": "round/local_steps_mean",
    "local_steps_min": "round/local_steps_min", "local_steps_max": "round/local_steps_max",
    "stragglers": "round/stragglers", "round_time_s": "round/time_s",
}
METRIC_SECTIONS = ("comm", "detail", "diag", "drift", "post", "round", "test", "train", "val")
#: the sections of the names before these (a run begun with them keeps them when it resumes)
LEGACY_SECTIONS = ("1_accuracy", "2_loss", "3_communication", "4_round", "5_diagnostics")
_PER_LAYER = re.compile(r"_l\d+$")


def resumable(run) -> bool:
    """Whether a command continues ``run`` (an ``mlflow.entities.Run``): it is :data:`RESUMABLE`, or FAILED because the
    environment failed under it or the command stopped on an error (``fl.end_reason`` starts with :data:`ENV_FAILURE`
    or :data:`STOPPED_BY_ERROR`). A run FAILED by its own numbers (a diverged seed) and a FINISHED one are complete."""
    status = run.info.status
    return status in RESUMABLE or (status == "FAILED" and
                                   run.data.tags.get(TAG_END_REASON, "").startswith((ENV_FAILURE, STOPPED_BY_ERROR)))


def dvc_experiment_tags() -> Dict[str, str]:
    """``{TAG_DVC_EXPERIMENT: name}`` when this process runs a stage of ``dvc exp run`` (``DVC_EXP_NAME`` set),
    else ``{}``."""
    name = os.environ.get("DVC_EXP_NAME", "").strip()
    return {TAG_DVC_EXPERIMENT: name} if name else {}


def run_name(name: str, tags: Dict[str, str]) -> str:
    """The MLflow run name of ``name``: ``name [<DVC experiment>]`` for a run a DVC experiment made (``tags`` holds
    :data:`TAG_DVC_EXPERIMENT`), else ``name``."""
    exp = tags.get(TAG_DVC_EXPERIMENT)
    return f"{name} [{exp}]" if exp else name


def tracking_uri(root: Optional[Path] = None) -> str:
    """The tracking URI in force: ``MLFLOW_TRACKING_URI`` or the project's SQLite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(root or store_root()) / 'mlflow.db'}"


def artifact_root(uri: str) -> Optional[str]:
    """The artifact location of a new experiment: for a SQLite store ``mlflow-artifacts:/``, which
    :mod:`fl_core.store.mlflow_artifacts` resolves to ``<folder of the .db>/mlartifacts`` and ``mlflow ui
    --artifacts-destination <that folder>`` serves (no absolute path in the store, so a moved project folder keeps
    its artifacts); None (the server's default) for other stores."""
    return mlflow_artifacts.LOCATION if mlflow_artifacts.local_destination(uri) is not None else None


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


def is_detail(key: str) -> bool:
    """Whether the per-round key ``key`` is a per-client or per-layer value: ``client_loss/<i>``
    (``tracking.client_loss_trace``), ``cos_<layer>`` (``tracking.layer_cosine``; their mean ``cos_mean`` is not),
    ``drift_cos_<layer>`` (``tracking.drift``; the whole model's ``drift_cosine`` is not),
    and every key ending in ``_l<digits>`` (``fednlr_mu_l<l>``, ``fednlr_T_l<l>``, ``neuron_drift_l<l>``). They
    go to MLflow only with ``tracking.detail_metrics``; the per-seed CSV (``details/seed_<s>.csv``, a child
    artifact) always holds them."""
    return ("/" in key or (key.startswith("cos_") and key != "cos_mean") or key.startswith("drift_cos_")
            or bool(_PER_LAYER.search(key)))


def mlflow_metric_name(key: str) -> str:
    """The MLflow name of the per-round key ``key`` (a column of the histories and CSV files).

    The first rule that applies:

    - a name already in a section (``test/acc``; its part before the first ``/`` one of :data:`METRIC_SECTIONS`), and
      MLflow's own ``system/...``: unchanged;
    - a key of :data:`METRIC_NAMES`: its name there (``test_acc`` -> ``test/acc``, ``comm_up_floats`` ->
      ``comm/up_floats``, ``num_clients`` -> ``round/clients``);
    - ``post_<k>`` (after a post-training step): ``post/<k>`` (``post_test_acc`` -> ``post/test_acc``);
    - a drift measure ``drift_<k>`` (``tracking.drift``) that is not per layer: ``drift/<k>`` (``drift_cosine`` ->
      ``drift/cosine``);
    - a per-client or per-layer key (:func:`is_detail`): ``detail/<key>`` with ``/`` as ``_``
      (``client_loss/3`` -> ``detail/client_loss_3``);
    - anything else: ``diag/<key>`` (``cos_mean``, ``neuron_drift``, ``fedbug_trainable_share``,
      ``server_update_norm``, ``objective_gap``, ...).
    """
    head = key.split("/", 1)[0]
    if "/" in key and (head in METRIC_SECTIONS or head == "system"):
        return key
    if key in METRIC_NAMES:
        return METRIC_NAMES[key]
    if key.startswith("post_"):
        return f"post/{key[len('post_'):]}"
    if key.startswith("drift_") and not is_detail(key):
        return f"drift/{key[len('drift_'):]}"
    if is_detail(key):
        return "detail/" + key.replace("/", "_")
    return f"diag/{key}"


def _legacy_key(name: str) -> Optional[str]:
    """The per-round key of a name an older run holds: a plain key itself, ``1_accuracy/clients/client_acc_mean``
    -> ``client_acc_mean``, ``5_diagnostics/client_loss/3`` -> ``client_loss/3``; None for a current name."""
    head, _, rest = name.partition("/")
    if not rest:
        return name
    if head not in LEGACY_SECTIONS:
        return None
    return rest[len("clients/"):] if rest.startswith("clients/") else rest


def rule_sections() -> Dict[str, FrozenSet[str]]:
    """Rule name -> the ``algorithm.<section>`` config sections it reads, from the rule registry
    (:mod:`fl_core.algorithms.registry`): ``fedbcgd_plus`` -> {fedbcgd}, ``topk`` / ``qsgd`` -> {compression},
    ``adam`` -> {adaptive}, ``momentum`` -> {fedavgm}, ``fedavg`` -> {}."""
    from ..algorithms import registry

    return {r.name: frozenset(registry.stack_sections([r.name])) for r in registry.rules()}


def run_params(container: Dict[str, Any]) -> Dict[str, Any]:
    """MLflow params of a run: :func:`flatten` of the config ``container`` (e.g.
    :func:`fl_core.config.to_container`), where ``algorithm.*`` keeps its own values (``name``,
    ``wrappers``, ``aggregation``, ``eta_g``, ... everything that is not a section) and only the sections
    of the rules in the stack: ``algorithm.name``, ``algorithm.server_opt`` and every ``algorithm.wrappers`` entry
    (``registry.trim_sections``; a rule the registry does not know keeps the section of its own name).
    Everything outside ``algorithm`` is kept."""
    from ..algorithms import registry

    algo = container.get("algorithm")
    if not isinstance(algo, dict):
        return flatten(container)
    return flatten({**container, "algorithm": registry.trim_sections(algo)})


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quiet_mlflow() -> None:
    """MLflow's and SQLAlchemy's loggers at WARNING; the ones that log a traceback for an error that is raised anyway
    (MLflow's database errors and engine retries, SQLAlchemy's pool resetting a dead connection) are silent unless
    ``--debug`` / ``FL_DEBUG=1``: the error ends the command with one line (:mod:`fl_core.store.storefail`)."""
    for name in ("mlflow", "alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not envfail.debug():
        for name in ("mlflow.store.db.utils", "sqlalchemy.pool"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _filter(tags: Dict[str, str], status: Optional[str] = None) -> str:
    conds = [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    if status:
        conds.append(f"attributes.status = '{status}'")
    return " and ".join(conds)


def end_orphaned_runs(client, experiment_id: str, tags: Optional[Dict[str, str]] = None) -> List[str]:
    """End the runs of ``experiment_id`` (with the given tag values) left RUNNING by a process of this
    machine that is gone (:func:`fl_core.store.procs.gone` on the run's ``fl.host`` / ``fl.pid`` /
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


def headline_view() -> str:
    """The experiment tag value of the saved view :data:`HEADLINE_VIEW`: MLflow 3's saved-view envelope (``name``,
    ``createdAt`` / ``updatedAt`` in ms, ``state``: the runs table's state as JSON, here :data:`HEADLINE_STATE`),
    which its UI lists under "Saved views" and opens with ``?viewStateShareKey=headline``. A column whose metric,
    param or tag no run holds stays absent from the table."""
    now = int(time.time() * 1000)
    return json.dumps({"name": HEADLINE_VIEW, "createdAt": now, "updatedAt": now,
                       "state": json.dumps(HEADLINE_STATE, sort_keys=True)})


def _is_headline_view(value: Optional[str]) -> bool:
    """Whether an experiment's tag value is :func:`headline_view`'s (whatever its times)."""
    try:
        env = json.loads(value or "")
        return env.get("name") == HEADLINE_VIEW and json.loads(env["state"]) == HEADLINE_STATE
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


def headline_url(experiment: str, root: Optional[Path] = None, base: str = "http://127.0.0.1:5000") -> Optional[str]:
    """The MLflow UI address of ``experiment``'s runs table in its headline view (``make ui`` prints it), or None when
    the store (the project's, or ``MLFLOW_TRACKING_URI``) has no such experiment yet. An experiment logged before the
    view existed gets it here (the tag :data:`TAG_SHARED_VIEW` + :data:`HEADLINE_VIEW`); nothing else is written."""
    from mlflow.tracking import MlflowClient

    _quiet_mlflow()
    uri = tracking_uri(root or store_root())
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return None
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    if not _is_headline_view(exp.tags.get(TAG_SHARED_VIEW + HEADLINE_VIEW)):
        client.set_experiment_tag(exp.experiment_id, TAG_SHARED_VIEW + HEADLINE_VIEW, headline_view())
    return f"{base}/#/experiments/{exp.experiment_id}/runs?viewStateShareKey={HEADLINE_VIEW}"


def check_store(uri: Optional[str] = None) -> None:
    """Check, before anything is written, that the tracking store ``uri`` (default :func:`tracking_uri`) can be
    opened where this can be known without opening it: a ``sqlite:///`` store's folder exists.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: ``tracking store sqlite:///.../mlflow.db is in a folder that does not
            exist (...); create the folder or set MLFLOW_TRACKING_URI to a store in an existing one, then run the
            same command again`` (nothing is created).
    """
    missing = storefail.missing_folder(uri or tracking_uri(), "tracking store",
                                       "set MLFLOW_TRACKING_URI to a store in an existing one")
    if missing is not None:
        raise missing


def ensure_store(uri: str) -> None:
    """Create a missing SQLite store whole: MLflow builds its schema in a temporary file beside the
    target, which is renamed into place only when complete (under a lock, so that concurrent first
    starts create it once). A kill during MLflow's schema creation would otherwise leave a store
    that no later start can open. MLflow's own ``Default`` experiment gets the artifact location
    ``mlflow-artifacts:/0`` (as every experiment of the project, :func:`artifact_root`), so the new store
    holds no absolute folder. Other stores (a server, PostgreSQL) are left to MLflow.
    Fault point ``store_init``.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: the store's folder does not exist (nothing is created: MLflow would
            create every missing folder of a mistyped path).
    """
    path = storefail.sqlite_path(uri)  # None: not a SQLite file
    if path is None:
        return
    check_store(uri)
    db = Path(path)
    if db.exists():
        return
    from filelock import FileLock
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from . import durable, faults

    with FileLock(str(db.with_name(f".{db.name}.lock"))):
        if db.exists():
            return
        for stale in db.parent.glob(f".{db.name}.*.init"):  # left by a killed creation
            stale.unlink()
        tmp = db.with_name(f".{db.name}.{os.getpid()}.init")
        SqlAlchemyStore(f"sqlite:///{tmp}", mlflow_artifacts.LOCATION).engine.dispose()  # builds the schema
        faults.point("store_init")
        os.replace(tmp, db)
        durable.fsync_dir(db.parent)


def bounded_uri(uri: str) -> str:
    """The tracking URI ``uri`` with bounded waits (:mod:`fl_core.store.storewait`): for a server, MLflow's HTTP retry
    settings where unset (:func:`fl_core.store.storewait.http_defaults`), and MLflow's "View run" lines off when the URI holds
    a password or token (they would print it); for PostgreSQL, libpq's connect timeout,
    keepalives and statement timeout in the URI where it does not set them; SQLite's busy timeout and the stall
    watch for every database (:func:`fl_core.store.storewait.install`). Returns the URI to open."""
    storewait.install()
    if uri.startswith(("http://", "https://")):
        storewait.http_defaults()
        if storefail.mask(uri) != uri:  # MLflow prints "View run ... at: <the URI>" on stdout as a run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return storewait.with_pg_params(uri)


class Tracking:
    """A thin wrapper over :class:`mlflow.tracking.MlflowClient` for one MLflow experiment.

    Raises (on construction, as every method may while it works):
        fl_core.store.envfail.EnvironmentFailure: a ``sqlite:///`` store in a folder that does not exist.
        mlflow.exceptions.MlflowException: the store failed; :func:`fl_core.store.envfail.classify` names a locked or
            unreachable store (:mod:`fl_core.store.storefail`).
    """

    def __init__(self, experiment: str, root: Optional[Path] = None):
        from mlflow.tracking import MlflowClient

        _quiet_mlflow()  # after MLflow's import, which sets its loggers' levels

        self._writer = None  # the writer thread of the run loggers' round batches (submit)
        self.root = root or store_root()
        self.uri = bounded_uri(tracking_uri(self.root))
        server = self.uri.startswith(("http://", "https://"))
        storefail.name_store(self.uri, "tracking server" if server else "tracking store",
                             SQLITE_LOCKED_ACTION if self.uri.startswith("sqlite:") else "")
        mlflow_artifacts.register()  # mlflow-artifacts:/ beside a SQLite store (also an entry point once installed)
        ensure_store(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=artifact_root(self.uri),
                tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND, TAG_SHARED_VIEW + HEADLINE_VIEW: headline_view(),
                      TAG_NOTE: NOTE})
        else:
            self.experiment_id = exp.experiment_id
            if TAG_EXPERIMENT_KIND not in exp.tags:  # an older experiment; a kind set in the UI stays
                self.client.set_experiment_tag(self.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
            if not _is_headline_view(exp.tags.get(TAG_SHARED_VIEW + HEADLINE_VIEW)):  # absent or another column set
                self.client.set_experiment_tag(self.experiment_id, TAG_SHARED_VIEW + HEADLINE_VIEW, headline_view())
            if TAG_NOTE not in exp.tags:  # a description written in the UI stays
                self.client.set_experiment_tag(self.experiment_id, TAG_NOTE, NOTE)

    def find_runs(self, tags: Dict[str, str], status: Optional[str] = None) -> List[Any]:
        """Runs of this experiment whose tags have the given values (newest first)."""
        return self.client.search_runs([self.experiment_id], filter_string=_filter(tags, status),
                                       order_by=["attributes.start_time DESC"], max_results=1000)

    def reopen(self, run_id: str) -> None:
        """Mark a run RUNNING again, recorded as this process's (an earlier ``fl.end_reason`` and ``failure_reason``
        dropped)."""
        tags = self.client.get_run(run_id).data.tags
        for tag in (TAG_END_REASON, "failure_reason"):
            if tag in tags:
                self.client.delete_tag(run_id, tag)
        self.client.update_run(run_id, status="RUNNING")
        for k, v in procs.identity().items():
            self.client.set_tag(run_id, k, v)

    def parent_run(self, name: str, fingerprint: str, tags: Dict[str, str], continuing: bool = False) -> str:
        """The parent run of experiment (``name``, ``fingerprint``), reopened, or a new one.

        With ``continuing`` (an unfinished attempt exists on disk) the newest parent is reused whatever
        its status (a kill may have come after it ended); otherwise only one an interrupted command left
        (:func:`resumable`): FINISHED parents and those FAILED by their seeds are complete attempts."""
        for run in self.find_runs({TAG_ROLE: "parent", TAG_EXPERIMENT: name, TAG_FINGERPRINT: fingerprint}):
            if continuing or resumable(run):
                self.reopen(run.info.run_id)
                return run.info.run_id
        return self.start_parent(name, {**tags, TAG_ROLE: "parent", TAG_EXPERIMENT: name,
                                        TAG_FINGERPRINT: fingerprint})

    def child_run(self, parent_id: str, seed: int) -> Optional[Any]:
        """The newest child run of ``seed`` under ``parent_id``, or None."""
        runs = self.find_runs({"mlflow.parentRunId": parent_id, TAG_SEED: str(seed)})
        return runs[0] if runs else None

    def start_parent(self, name: str, tags: Dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name(name, tags),
                                     tags={**tags, **procs.identity()})
        return run.info.run_id

    def end_parent(self, run_id: str, status: str = "FINISHED", reason: Optional[str] = None) -> None:
        self.end_run(run_id, status, reason)

    def end_run(self, run_id: str, status: str, reason: Optional[str] = None) -> None:
        """End a run with ``status``; ``reason`` goes to the tag ``fl.end_reason``."""
        if reason:
            self.client.set_tag(run_id, TAG_END_REASON, reason[:5000])
        self.client.set_terminated(run_id, status=status)

    def submit(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on this tracking's one writer thread (started on first use); its
        ``concurrent.futures.Future``. The run loggers hand their round batches here and wait for them at each
        checkpoint, failure and run's end (:meth:`MlflowRunLogger.flush`), so nothing is left queued when a run
        ends; a kill loses at most the rounds since the last checkpoint, which the resumed run logs again."""
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-writer")
        return self._writer.submit(fn, *args, **kwargs)

    def end_orphans(self, name: str) -> int:
        """End the RUNNING runs of experiment ``name`` whose process is gone (:func:`end_orphaned_runs`);
        returns how many were ended."""
        return len(end_orphaned_runs(self.client, self.experiment_id, {TAG_EXPERIMENT: name}))

    def child_logger(self, parent_id, name: str, tags: Dict[str, str], params: Dict[str, Any],
                     log_every: int = 10, detail: bool = False) -> "MlflowRunLogger":
        """The logger of a (new or reopened) child run; ``detail``: ``tracking.detail_metrics``."""
        return MlflowRunLogger(self, parent_id, name, tags, params, log_every, detail)

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

    def log_curves(self, run_id: str, rows: Iterable[Dict[str, Any]]) -> int:
        """Log per-round rows (each with ``round`` and metric keys, e.g. the seed-mean curve of ``rounds.csv``)
        as metrics with step = round under their :func:`mlflow_metric_name`, once: every (name, step) the run
        already holds is skipped (a parent ended by a kill while logging them gets the rest on the rerun).
        Per-client and per-layer keys (:func:`is_detail`) and None values are left out.

        Returns:
            How many values were logged.
        """
        from mlflow.entities import Metric

        rows = [r for r in rows if "round" in r]
        names = {k: mlflow_metric_name(k) for r in rows for k in r if k != "round" and not is_detail(k)}
        held = {n: {m.step for m in self.client.get_metric_history(run_id, n)} for n in set(names.values())}
        ts = int(time.time() * 1000)
        todo = [Metric(names[k], float(v), ts, int(r["round"])) for r in rows for k, v in r.items()
                if k in names and v is not None and int(r["round"]) not in held[names[k]]]
        for s in range(0, len(todo), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=todo[s:s + _MAX_METRICS_PER_BATCH])
        return len(todo)

    def logged_models(self, run_id: str, name: str = MODEL_NAME) -> List[Any]:
        """The MLflow logged models named ``name`` whose source is run ``run_id`` (``mlflow.entities.LoggedModel``)."""
        found, token = [], None
        while True:
            page = self.client.search_logged_models(experiment_ids=[self.experiment_id],
                                                    filter_string=f"name = '{name}' AND source_run_id = '{run_id}'",
                                                    page_token=token)
            found += [m for m in page if m.source_run_id == run_id]
            token = page.token
            if not token:
                return found

    def model_uri(self, run_id: str) -> Optional[str]:
        """``runs:/<run_id>/model`` when the run holds a complete (READY) model :data:`MODEL_NAME`, else None."""
        from mlflow.entities import LoggedModelStatus

        ready = [m for m in self.logged_models(run_id) if m.status == LoggedModelStatus.READY]
        return f"runs:/{run_id}/{MODEL_NAME}" if ready else None

    def log_model(self, run_id: str, model, example) -> str:
        """Log ``model`` as the MLflow model :data:`MODEL_NAME` of run ``run_id`` with ``mlflow.pytorch.log_model``,
        once: a run that already holds a complete one (a rerun after a kill) keeps it, an incomplete one is deleted
        first. The model is saved as MLflow 3's default ``pt2`` (``torch.export``: loading needs neither the
        project's classes nor pickle); a model that torch.export cannot trace is pickled instead, with a warning
        line (loading it needs ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true`` and ``fl_core`` importable). The tag
        :data:`TAG_MODEL_FORMAT` records which.

        Args:
            run_id: an open child run of this experiment.
            model: ``torch.nn.Module`` on the CPU in eval mode, holding the final weights.
            example: [n, ...] CPU tensor of model inputs (n >= 2, so that the batch dimension stays free in ``pt2``);
                its numpy form is the input example, and the signature is inferred from it and ``model(example)``
                (logits [n, classes]).

        Returns:
            ``runs:/<run_id>/model`` (``mlflow.pytorch.load_model`` takes it).

        Raises:
            mlflow.exceptions.MlflowException: the store cannot be written, or the model cannot be saved at all.
        """
        import sys

        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        uri = self.model_uri(run_id)
        if uri is not None:
            return uri
        for stale in self.logged_models(run_id):  # left by a kill while it was logged: load_model could pick it
            self.client.delete_logged_model(stale.model_id)
        with torch.no_grad():
            out = model(example)
        x = example.numpy()
        kwargs = dict(name=MODEL_NAME, signature=infer_signature(x, out.numpy()), input_example=x,
                      pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"])
        fmt = "pt2"
        with self._active_run(run_id):
            try:
                mlflow.pytorch.log_model(model, serialization_format=fmt, **kwargs)
            except Exception as err:  # noqa: BLE001  (whatever torch.export raises on a model it cannot trace)
                first = envfail.first_line(err)[:200]
                print(f"warning: torch.export cannot trace {type(model).__name__} ({first}); its MLflow model is "
                      "pickled instead", file=sys.stderr)
                for failed in self.logged_models(run_id):
                    self.client.delete_logged_model(failed.model_id)
                fmt = "pickle"
                mlflow.pytorch.log_model(model, serialization_format=fmt, **kwargs)
        self.client.set_tag(run_id, TAG_MODEL_FORMAT, fmt)
        return f"runs:/{run_id}/{MODEL_NAME}"

    @contextlib.contextmanager
    def _active_run(self, run_id: str):
        """Run ``run_id`` of this store as MLflow's active run (what ``mlflow.pytorch.log_model`` logs to), left
        RUNNING afterwards (its owner ends it); the tracking URI and active run of the process are restored."""
        import mlflow

        before = os.environ.get("MLFLOW_TRACKING_URI")  # what mlflow.set_tracking_uri mirrors
        started = False
        try:
            mlflow.set_tracking_uri(self.uri)
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None)
            started = True
            yield
        finally:
            if started:
                mlflow.end_run(status="RUNNING")
            mlflow.set_tracking_uri(before)  # None: unset again

    def set_best_child(self, parent_id: str, seed: int, child_id: str) -> None:
        """Tag the parent with its best child: :data:`TAG_BEST_CHILD` (run id), :data:`TAG_BEST_SEED` and, when the
        child holds a model, :data:`TAG_BEST_MODEL_URI` (``runs:/<child>/model``)."""
        self.client.set_tag(parent_id, TAG_BEST_CHILD, child_id)
        self.client.set_tag(parent_id, TAG_BEST_SEED, str(seed))
        uri = self.model_uri(child_id)
        if uri is not None:
            self.client.set_tag(parent_id, TAG_BEST_MODEL_URI, uri)

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

    Per-round metrics go to MLflow under :func:`mlflow_metric_name`; per-client and per-layer keys
    (:func:`is_detail`) only with ``detail`` (``tracking.detail_metrics``). A metric that a reopened run
    already holds under an older name (its plain key, or the ``1_accuracy/``-style sections of
    :data:`LEGACY_SECTIONS`) keeps that name, so that each series stays whole.
    """

    def __init__(self, tracking: Tracking, parent_id: Optional[str], name: str, tags: Dict[str, str],
                 params: Dict[str, Any], log_every: int, detail: bool = False):
        self.tracking = tracking
        self.parent_id = parent_id
        self.name = name
        self.tags = dict(tags)
        self.params = params
        self.log_every = max(1, int(log_every))
        self.detail = bool(detail)
        self.run_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._sent: List[Any] = []  # batches handed to the tracking's writer thread, not yet waited for
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
        run = client.create_run(self.tracking.experiment_id, run_name=run_name(self.name, tags), tags=tags)
        self.run_id = run.info.run_id
        self.tracking.log_params(self.run_id, self.params)

    def state(self) -> dict:
        return {"run_id": self.run_id, "parent_id": self.parent_id}

    def metric_name(self, key: str) -> Optional[str]:
        """The MLflow name of the per-round metric ``key`` in this run: :func:`mlflow_metric_name`, or the older
        name under which the reopened run holds ``key`` (and not the current one); None for a per-client or
        per-layer key without ``detail``."""
        if key not in self._names:
            name = mlflow_metric_name(key)
            if name not in self._logged:
                older = {_legacy_key(n): n for n in self._logged}
                name = older.get(key, name)
            self._names[key] = name if self.detail or not is_detail(key) else None
        return self._names[key]

    def log_round(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        step = int(step)
        named = ((self.metric_name(k), v) for k, v in metrics.items())
        self._buffer.extend(Metric(n, float(v), ts, step) for n, v in named
                            if n is not None and step not in self._logged.get(n, ()))
        self._pending_steps += 1
        if self._pending_steps >= self.log_every:
            self._send()

    def _send(self) -> None:
        """Hand the buffered rounds to the tracking's writer thread (:meth:`Tracking.submit`): training goes on
        while they are written. A batch that failed earlier raises here (its own exception)."""
        for done in [f for f in self._sent if f.done()]:
            self._sent.remove(done)
            done.result()
        if not self._buffer or self.run_id is None:
            return
        for s in range(0, len(self._buffer), _MAX_METRICS_PER_BATCH):
            self._sent.append(self.tracking.submit(self.tracking.client.log_batch, self.run_id,
                                                   metrics=self._buffer[s:s + _MAX_METRICS_PER_BATCH]))
        self._buffer = []
        self._pending_steps = 0

    def flush(self) -> None:
        """Every round logged so far is in the store when this returns (a checkpoint's, a failure's and the run's
        end wait here); a batch that failed raises its own exception."""
        self._send()
        sent, self._sent = self._sent, []
        for f in sent:
            f.result()

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
