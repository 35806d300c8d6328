"""Running the trials of a sweep: storage, sampler, pruner, one trial, the trial loop and workers.

A trial's value is the validation accuracy (see :mod:`sweeps.spaces` for the overrides a trial runs
with). Each evaluated round reports it with ``step = seed_index * rounds + round`` so that a pruner
compares trials at the same seed and round. How a trial ends (:class:`TrialRunner`):

- COMPLETE: every seed trained;
- PRUNED, reason "pruned: ...": the pruner stopped it;
- PRUNED, reason "diverged: ...": the loss became non-finite (``RunFailed``);
- PRUNED, reason "infeasible: ...": the sampled combination does not compose or build
  (``ConfigError`` / ``ValueError`` naming a key), or a rule rejects it while running
  (:class:`fl_core.algorithms.InfeasibleSetting`, e.g. FedBug's code schedule with P*K_i < M);
- FAIL, reason "error: <exception>": any other exception while training (the study continues);
- FAIL, reason "storage lost: ...": the storage went away during the trial and came back (:func:`optimize`);
- FAIL, reason "interrupted (Ctrl-C)"; FAIL, reason "stale: ..." (:func:`fail_stale_trials`: its process on this
  machine is gone; :func:`fail_silent_trials`: no Optuna heartbeat for :data:`GRACE_S` s, any machine).

An environment failure (:mod:`fl_core.store.envfail`: the storage gone for good or not answering, MLflow's store, the disk)
is not a property of the trial: the sweep stops with one line (:func:`optimize`, :func:`run_workers`).

Processes killed hard: spawned workers die with the process that started them
(:func:`die_with_parent`); every MLflow run of a sweep records its process (:func:`owner_tags`) and
the next invocation ends the runs whose process is gone (:func:`end_orphaned_runs`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from fl_core import progress
from fl_core.store import envfail, procs, storefail, storewait
from fl_core.config import ConfigError
from fl_core.schema import format_value
from fl_core.store.tracking import ORPHAN_REASON  # noqa: F401  (re-exported: MLflow tag fl.end_reason of ended orphans)
from fl_core.store.tracking import end_orphaned_runs as tracking_end_orphans

from .spaces import TRIAL_FIXED, VALIDATION_FRACTION, Space, load_space, make_override, merge_overrides

OBJECTIVES = {"acc": "maximize", "uplink": "minimize"}  # uplink: cumulative floats per client, in units of d
METRIC_NAMES = {"acc": "val_acc", "uplink": "uplink"}  # the objectives' names in Optuna (dashboard, plots)
SAMPLERS = ("tpe", "cmaes", "gp", "random", "nsga2")
EXIT_INTERRUPTED = 130
STALE_REASON = "stale: left RUNNING by an earlier process"
HOST = procs.HOST
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for this process when its parent exits
EXIT_PARENT_GONE = 1  # exit status of a worker whose parent is already gone when it starts


@dataclass
class Settings:
    """Everything a worker process needs to run trials (picklable: sent to spawned workers)."""

    space: str  # the space file
    overrides: List[str]  # command-line Hydra overrides
    seeds: List[int]
    objectives: List[str]
    study_name: str
    storage: str  # URL or journal file path
    rounds: int = 1  # train.rounds of the base configuration (pruner resources)
    final_window: int = 1  # train.final_window of the base configuration (the objective's last evaluations)
    sampler: str = "tpe"
    sampler_seed: Optional[int] = None
    pruner: str = "median"
    experiment: Optional[str] = None  # MLflow experiment; None: no MLflow
    parent_run_id: Optional[str] = None
    threads: int = 1
    timeout: Optional[float] = None
    quiet: bool = False

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1

    def directions(self) -> List[str]:
        return [OBJECTIVES[o] for o in self.objectives]


# =========================================================================== storage, sampler, pruner


class StorageError(RuntimeError):
    """The --storage value cannot be opened; the one-line message names it."""


# the module SQLAlchemy 2.1 imports for a URL -> how to install it
DRIVERS = {
    "psycopg": "pip install 'psycopg[binary]' (a dependency of the project) for postgresql:// and "
               "postgresql+psycopg://, or pip install psycopg2-binary and write postgresql+psycopg2://",
    "psycopg2": "pip install psycopg2-binary",
    "MySQLdb": "pip install mysqlclient for mysql://, or pip install pymysql and write mysql+pymysql://",
    "pymysql": "pip install pymysql",
}
SETUP_LOCK_TIMEOUT_S = 600.0  # the longest a process waits for another one's study setup (setup_lock)
SETUP_LOCK_NAME = "fl-pipeline sweeps: study setup"  # hashed into PostgreSQL's advisory lock key
#: Optuna's heartbeat of a RUNNING trial in an RDB storage: written every HEARTBEAT_S seconds by the process that runs
#: it; a trial without one for GRACE_S seconds is stale (its process or machine is gone) and any process of the
#: study marks it FAIL (:func:`fail_stale_trials`). 3 missed beats: a loaded machine delays a beat by seconds, not 20.
HEARTBEAT_S, GRACE_S = 10, 30
HEARTBEAT_REASON = f"stale: no heartbeat for over {GRACE_S} s (its process or machine is gone)"
STORAGE_ACTION = "check that the database server runs and answers"


def is_url(spec: str) -> bool:
    """True for an RDB URL (``postgresql://``, ``sqlite:///``, ...), False for a journal file path."""
    return "://" in spec


def default_storage(study_name: str) -> str:
    """The journal file that keeps a study by default: ``sweeps/studies/<study>.log`` (gitignored)."""
    from fl_core.paths import project_root

    return str(project_root() / "sweeps" / "studies" / f"{study_name}.log")


def shown_storage(spec: str) -> str:
    """How the storage ``spec`` is shown in messages, tags and summaries: :func:`fl_core.store.storefail.mask` (the
    password and secret query values of an RDB URL replaced by ``***``; a journal path unchanged)."""
    return storefail.mask(spec)


def storage_error(spec: str, err: BaseException) -> StorageError:
    """The one-line :class:`StorageError` naming ``spec`` for an error raised while opening it: a missing driver
    (``ImportError``, with how to install it), else "cannot open the storage (<type>: <first line>)"."""
    if isinstance(err, ImportError):  # Optuna re-raises SQLAlchemy's ModuleNotFoundError as ImportError
        cause = err.__cause__ or err.__context__ or err
        hint = DRIVERS.get(getattr(cause, "name", None) or "", "install the driver of the URL's dialect")
        return StorageError(f"--storage {shown_storage(spec)}: the database driver is not installed "
                            f"({storefail.redact(envfail.first_line(cause), spec)}; {hint})")
    return StorageError(f"--storage {shown_storage(spec)}: cannot open the storage "
                        f"({type(err).__name__}: {storefail.redact(envfail.first_line(err), spec)})")


def bounded_storage(spec: str) -> None:
    """Name the RDB storage ``spec`` ``Optuna storage`` in the messages of its failures (:mod:`fl_core.store.storefail`) and
    bound the waits on it (:func:`fl_core.store.storewait.install`: SQLite's busy timeout, the stall watch)."""
    storewait.install()
    storefail.name_store(spec, "Optuna storage", STORAGE_ACTION)


def open_storage(spec: str):
    """An Optuna storage: an RDB URL (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///``) through
    SQLAlchemy (the URL's driver must be installed; psycopg 3 for PostgreSQL is a dependency), else a journal
    file (parent folders created), safe for several processes on one machine.

    An RDB storage waits a bounded time (:mod:`fl_core.store.storewait`: PostgreSQL's connect and statement timeouts and
    keepalives as ``connect_args``, where the URL does not set them; SQLite's busy timeout) and keeps Optuna's
    heartbeat of running trials (every :data:`HEARTBEAT_S` s, stale after :data:`GRACE_S` s: :func:`heartbeat`,
    :func:`fail_stale_trials`).

    A new database gets Optuna's tables on first open; processes that may open a new database at the same
    time (several machines starting) hold :func:`setup_lock` around it.

    Raises:
        StorageError: a missing driver, an unreachable server, a bad URL or an unusable file (one line
            naming ``spec``).
    """
    import optuna

    try:
        if is_url(spec):
            bounded_storage(spec)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return optuna.storages.RDBStorage(spec, engine_kwargs=storewait.engine_kwargs(spec),
                                                  heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
        path = Path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    except Exception as err:  # SQLAlchemy: no driver, unreachable server, bad URL; OSError: the journal file
        raise storage_error(spec, err) from None


@contextmanager
def setup_lock(spec: str, timeout_s: float = SETUP_LOCK_TIMEOUT_S, poll_s: float = 0.2,
               on_wait: Optional[Callable[[str], None]] = None) -> Iterator[str]:
    """Hold the study-setup lock of storage ``spec`` while the ``with`` block runs: one process at a time, on
    any machine, opens the storage (Optuna creates its tables in a new database), creates or loads a study,
    records its signature and creates or reopens its MLflow parent run. Without it, processes started
    together on a new PostgreSQL database fail creating the same tables (``UniqueViolation`` on
    ``pg_type_typname_nsp_index``) and each creates its own parent run. Trials do not take it.

    - PostgreSQL (``postgresql[+driver]://``): a session-level advisory lock (``pg_try_advisory_lock`` on a
      key hashed from :data:`SETUP_LOCK_NAME`, tried every ``poll_s`` seconds) on a connection of its own;
      it is released when the block ends, and by the server if this process dies;
    - SQLite files and journal files (one machine): a file lock beside the file, ``<file>.setup.lock``
      (a journal file's folder is created, as :func:`open_storage` does);
    - other databases (MySQL, in-memory SQLite): no lock (processes must not start a new study together).

    ``on_wait`` receives one line once if the lock is held by another process at the first try.

    Yields:
        How the lock is held: ``"advisory"``, ``"file"`` or ``"none"``.

    Raises:
        StorageError: the storage cannot be reached (as :func:`open_storage`), or another process held the
            lock for ``timeout_s`` seconds (one line naming ``spec``).
    """
    if not is_url(spec):
        with _file_lock(spec, Path(spec + ".setup.lock"), timeout_s, on_wait, mkdir=True):
            yield "file"
        return
    try:
        from sqlalchemy.engine import make_url

        url = make_url(spec)
        backend = url.get_backend_name()
    except Exception as err:  # not a URL SQLAlchemy can parse
        raise storage_error(spec, err) from None
    if backend == "postgresql":
        with _advisory_lock(spec, timeout_s, poll_s, on_wait):
            yield "advisory"
    elif backend == "sqlite" and url.database not in (None, "", ":memory:"):
        with _file_lock(spec, Path(url.database + ".setup.lock"), timeout_s, on_wait, mkdir=False):
            yield "file"
    else:
        yield "none"


def _lock_timeout(spec: str, timeout_s: float) -> StorageError:
    return StorageError(f"--storage {shown_storage(spec)}: another process held the study-setup lock for "
                        f"{timeout_s:g} s (a sweep stuck while it starts?)")


@contextmanager
def _file_lock(spec: str, path: Path, timeout_s: float, on_wait: Optional[Callable[[str], None]],
               mkdir: bool) -> Iterator[None]:
    """:func:`setup_lock` for a file: ``filelock.FileLock`` on ``path``; its folder is created with ``mkdir``, else
    it must exist."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        if mkdir:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.parent.is_dir():  # FileLock would create it: SQLite itself does not
            raise FileNotFoundError(f"no such folder: {path.parent}")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait(f"another process is setting up a study in {shown_storage(spec)}: waiting for it "
                        f"(at most {timeout_s:g} s)")
            lock.acquire(timeout=timeout_s)
    except Timeout:
        raise _lock_timeout(spec, timeout_s) from None
    except OSError as err:  # the folder does not exist (SQLite) or cannot be written
        raise storage_error(spec, err) from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _advisory_lock(spec: str, timeout_s: float, poll_s: float,
                   on_wait: Optional[Callable[[str], None]]) -> Iterator[None]:
    """:func:`setup_lock` for PostgreSQL: a session advisory lock on a connection of its own (no pool)."""
    import hashlib

    import sqlalchemy

    key = int.from_bytes(hashlib.sha256(SETUP_LOCK_NAME.encode()).digest()[:8], "big", signed=True)
    try_lock = sqlalchemy.text("SELECT pg_try_advisory_lock(:key)")
    engine = conn = None
    try:
        engine = sqlalchemy.create_engine(spec, poolclass=sqlalchemy.pool.NullPool, **storewait.engine_kwargs(spec))
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        deadline = time.monotonic() + timeout_s
        held = bool(conn.execute(try_lock, {"key": key}).scalar())
        if not held and on_wait is not None:
            on_wait(f"another process is setting up a study in {shown_storage(spec)}: waiting for it "
                    f"(at most {timeout_s:g} s)")
        while not held and time.monotonic() < deadline:
            time.sleep(poll_s)
            held = bool(conn.execute(try_lock, {"key": key}).scalar())
    except Exception as err:  # no driver, unreachable server, bad URL
        _close(conn, engine)
        raise storage_error(spec, err) from None
    if not held:
        _close(conn, engine)
        raise _lock_timeout(spec, timeout_s)
    try:
        yield
    finally:
        try:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        except Exception:  # the connection is gone: the server released the lock with it
            pass
        _close(conn, engine)


def _close(conn, engine) -> None:
    """Close a connection and dispose of its engine, either of them None; errors are ignored."""
    for close in ((conn.close if conn is not None else None), (engine.dispose if engine is not None else None)):
        if close is not None:
            try:
                close()
            except Exception:
                pass


def make_sampler(name: str, seed: Optional[int], multi: bool, conditional: bool):
    """The Optuna sampler ``name`` (one of :data:`SAMPLERS`).

    TPE is multivariate with constant liar (parallel workers); ``group`` decomposition is switched
    on for spaces with conditional parameters.

    Raises:
        ValueError: CMA-ES with several objectives.
    """
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=conditional, constant_liar=True)
    if name == "cmaes":
        if multi:
            raise ValueError("--sampler cmaes handles one objective only (use tpe, nsga2, gp or random)")
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


def parse_pruner(spec: str) -> Tuple[str, Optional[float]]:
    """``median`` | ``hyperband`` | ``none`` | ``threshold:X`` (prune when val_acc < X) -> (kind, X).

    Raises:
        ValueError: anything else.
    """
    if spec in ("median", "hyperband", "none"):
        return spec, None
    if spec.startswith("threshold:"):
        try:
            x = float(spec.split(":", 1)[1])
        except ValueError:
            x = float("nan")
        if 0.0 <= x <= 1.0:
            return "threshold", x
    raise ValueError(f"--pruner must be median, hyperband, none or threshold:X (X in [0, 1]), got {spec!r}")


def make_pruner(spec: str, rounds: int, num_seeds: int, multi: bool):
    """The pruner for reports at steps 1 .. num_seeds * rounds (see the module docstring).

    Warm-up: Optuna prunes at steps >= ``rounds // 3`` only; steps count on over the seeds
    (``seed_index * rounds + round``), so the warm-up covers seed 1's rounds 1 .. rounds // 3 - 1
    and nothing of the later seeds (none at all for rounds < 6).
    median: no pruning before 5 trials are COMPLETE nor during the warm-up; the trial's best value
    so far (over all its steps) is compared with the median of the complete trials at the same step;
    hyperband: resources from rounds // 4 to num_seeds * rounds steps, reduction factor 3, no warm-up;
    threshold:X: prune as soon as an evaluated validation accuracy is below X (after the same
    warm-up as median). Multi-objective studies get no pruner.

    Raises:
        ValueError: see :func:`parse_pruner`.
    """
    import optuna

    kind, x = parse_pruner(spec)
    warmup = max(0, rounds // 3)
    if multi or kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=warmup)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, rounds // 4), max_resource=num_seeds * rounds,
                                              reduction_factor=3)
    return optuna.pruners.ThresholdPruner(lower=x, n_warmup_steps=warmup)


def _not_sqlalchemy_fallback(record) -> bool:
    """A logging filter: False for Optuna's warning that it retries a query of all trials another way after a
    SQLAlchemy error (the query repeats the IN list), which on a lost database precedes the error itself and on a
    large study only announces a slower query."""
    return not str(record.msg).startswith("Caught an error from sqlalchemy")


def quiet_optuna() -> None:
    """Optuna's log at WARNING, without its experimental warnings, the heartbeat warning of explicit ask and tell,
    and (unless ``--debug`` / ``FL_DEBUG=1``) the multi-line warning of its all-trials query's fallback."""
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not envfail.debug():
        rdb = logging.getLogger("optuna.storages._rdb.storage")
        if _not_sqlalchemy_fallback not in rdb.filters:
            rdb.addFilter(_not_sqlalchemy_fallback)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the sweep asks and tells its trials and beats their heartbeat itself (heartbeat)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def sampler_and_pruner(settings: Settings, space: Space, worker: int = 0) -> Dict[str, Any]:
    """``sampler`` (seeded ``sampler_seed + worker``) and ``pruner`` keyword arguments of
    ``optuna.create_study`` / ``load_study`` for this process.

    Raises:
        ValueError: see :func:`make_sampler`.
    """
    seed = None if settings.sampler_seed is None else settings.sampler_seed + worker
    return {"sampler": make_sampler(settings.sampler, seed, settings.multi, bool(space.conditional)),
            "pruner": make_pruner(settings.pruner, settings.rounds, len(settings.seeds), settings.multi)}


# =========================================================================== what a study shows


def _param_text(p) -> str:
    """``"float [0.005, 0.5] log"``, ``"int [1, 3]"``, ``"fedavg | fedprox"``: one parameter's distribution."""
    if p.kind == "categorical":
        return " | ".join(format_value(c) for c in p.choices)
    scale = " log" if p.log else (f" step {p.step:g}" if p.step is not None else "")
    return f"{p.kind} [{p.low:g}, {p.high:g}]{scale}"


def _pruning_text(settings: Settings) -> str:
    """What the pruner of ``settings`` does, in the words of docs/sweeps.md (How trials end, Pruning steps)."""
    kind, x = parse_pruner(settings.pruner)
    r, warmup = settings.rounds, max(0, settings.rounds // 3)
    when = f"from step {warmup} on" if warmup > 0 else "at every step"
    reasons = ("diverged (non-finite loss) or infeasible (a combination that does not build)")
    if settings.multi:
        return ("none: multi-objective studies cannot prune (no intermediate values); a PRUNED trial's user "
                "attribute reason starts with " + reasons)
    reasons = "a PRUNED trial's user attribute reason starts with pruned (the pruner), " + reasons
    if kind == "none":
        rule = "none; "
    elif kind == "median":
        rule = (f"median: stops a trial whose best val_acc so far is below the median of the COMPLETE trials at "
                f"the same step, {when} once 5 trials are COMPLETE; ")
    elif kind == "hyperband":
        rule = (f"hyperband: budgets from {max(1, r // 4)} to {len(settings.seeds) * r} steps, reduction factor 3; ")
    else:
        rule = f"threshold: stops a trial as soon as val_acc < {x:g}, {when}; "
    return (rule + f"step = seed_index * {r} + round (val_acc of every evaluated round: the intermediate values); "
            + reasons)


def study_labels(settings: Settings, space: Space) -> Dict[str, str]:
    """The study's user attributes that say what a sweep optimises (:func:`label_study`), as text.

    Keys: ``objective`` (each objective's name, direction and meaning), ``search_space`` (every searched
    override with its distribution, ``;`` between them; a conditional branch's as ``if algorithm=fedbug: ...``),
    ``base`` (the overrides of the base experiment: the space's base, the command line, the validation split),
    ``pruning`` (the pruner of the latest invocation, what a step is, how a PRUNED trial's reason reads) and
    ``space`` (the space's name and description).
    """
    seeds = settings.seeds
    over = f"seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    meaning = {"acc": (f"validation accuracy (fraction; {VALIDATION_FRACTION:.0%} of the training set held out), "
                       f"mean of the last {settings.final_window} evaluation(s), mean over {over}"),
               "uplink": "cumulative uplink floats per client after the last round, in units of d (model size)"}
    objective = "; ".join(f"{METRIC_NAMES[o]} ({OBJECTIVES[o]}): {meaning[o]}" for o in settings.objectives)
    searched = [f"{k}: {_param_text(p)}" for k, p in space.params.items()]
    for key, branches in space.conditional.items():
        for value, branch in branches.items():
            if branch.params:
                searched.append(f"if {make_override(key, value)}: " +
                                ", ".join(f"{k}: {_param_text(p)}" for k, p in branch.params.items()))
    return {"objective": objective, "search_space": "; ".join(searched),
            "base": " ".join(space.experiment_overrides([], settings.overrides, [])),
            "pruning": _pruning_text(settings),
            "space": f"{space.name}: {space.description}" if space.description else space.name}


def label_study(study, settings: Settings, space: Space) -> Dict[str, str]:
    """Name the study's objectives (``study.set_metric_names``: ``val_acc``, ``uplink``) and set the user
    attributes of :func:`study_labels`, so that optuna-dashboard's first screen says what was optimised, over
    which parameters and why trials were pruned (the names also label Optuna's plots and ``trials_dataframe``).
    Called by every invocation, under the storage's setup lock (a space's ranges or the pruner may change between
    invocations); an attribute already holding the value is not written again.

    Returns:
        The user attributes set (key -> text).
    """
    names = [METRIC_NAMES[o] for o in settings.objectives]
    if study.metric_names != names:
        study.set_metric_names(names)
    labels = study_labels(settings, space)
    current = study.user_attrs
    for key, text in labels.items():
        if current.get(key) != text:
            study.set_user_attr(key, text)
    return labels


# =========================================================================== stale trials


def _alive(pid: int, since: Optional[datetime]) -> bool:
    """Whether process ``pid`` of this machine runs and started before ``since`` (:func:`fl_core.store.procs.alive`)."""
    return procs.alive(pid, since.timestamp() if since is not None else None)


def fail_stale_trials(study) -> List[int]:
    """Mark the RUNNING trials that no process runs any more FAIL, with reason :data:`STALE_REASON`.

    A trial records its machine and process id (user attributes ``host``, ``pid``) when it starts;
    it is stale if it was started on this machine by a process that is gone, or if it records
    neither (a process killed right after ``ask``). Trials of other machines are left alone.

    Returns:
        The numbers of the trials marked FAIL.
    """
    from optuna.trial import TrialState

    stale = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        host, pid = t.user_attrs.get("host"), t.user_attrs.get("pid")
        if host is not None and host != HOST:
            continue
        if pid is not None and _alive(int(pid), t.datetime_start):
            continue
        study._storage.set_trial_user_attr(t._trial_id, "reason", STALE_REASON)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        stale.append(t.number)
    return stale


def fail_silent_trials(study) -> List[int]:
    """Mark FAIL, with reason :data:`HEARTBEAT_REASON`, the RUNNING trials whose Optuna heartbeat is older than
    :data:`GRACE_S` seconds (Optuna's own test of a stale trial, on any machine); nothing for a storage without
    heartbeats (a journal file). A trial marked FAIL this way while its process still runs (a database outage
    longer than the grace period) keeps FAIL: that process drops its result (:func:`optimize`).

    Returns:
        The numbers of the trials marked FAIL.
    """
    from optuna.trial import TrialState

    storage = study._storage
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is None:
        return []
    stale = set(storage._get_stale_trial_ids(study._study_id))  # Optuna's query (BaseHeartbeat)
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t._trial_id not in stale:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "reason", HEARTBEAT_REASON)
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except Exception as err:  # another process finished or failed it meanwhile
            if "UpdateFinishedTrialError" not in {c.__name__ for c in type(err).__mro__}:
                raise
            continue
        failed.append(t.number)
    return failed


@contextmanager
def heartbeat(study, trial, on_error: Optional[Callable[[BaseException], None]] = None) -> Iterator[None]:
    """Record Optuna's heartbeat of ``trial`` every :data:`HEARTBEAT_S` seconds (at once, then every second while
    the database fails) from a daemon thread while the block runs; nothing for a storage without heartbeats.
    ``study.optimize`` does this itself; the sweep asks and tells its trials explicitly. Errors are not raised here:
    the trial's own next use of the storage meets them; ``on_error(err)`` hears of each (:func:`optimize`: the
    storage's outage begins then, :func:`fl_core.store.storewait.outage_began`, even while the trial computes)."""
    storage = study._storage
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if interval is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial._trial_id)
                pause = interval
            except Exception as err:  # the database is away: try again soon
                pause = 1.0
                if on_error is not None:
                    try:
                        on_error(err)
                    except Exception:  # noqa: BLE001  (a note only: the trial's own call decides)
                        pass
            if stop.wait(pause):
                return

    thread = threading.Thread(target=beat, name=f"optuna-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


owner_tags = procs.identity  # MLflow tags naming the process that creates a run (fl.host, fl.pid, fl.proc_start)


def end_orphaned_runs(client, experiment_id: str) -> List[str]:
    """End the sweep's MLflow runs left RUNNING by a process of this machine that is gone (status KILLED,
    ``fl.end_reason`` = :data:`ORPHAN_REASON`; :func:`fl_core.store.tracking.end_orphaned_runs`).

    Returns:
        The ids of the runs ended.
    """
    return tracking_end_orphans(client, experiment_id)


# =========================================================================== training


class DataCache:
    """Dataset, partition and device tensors per (dataset, partition, device) config, kept for the
    last ``size`` combinations of this process (trials differ mostly in algorithm settings)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._items: "OrderedDict[str, Any]" = OrderedDict()

    def get(self, cfg):
        """The :class:`pipeline.experiment.Inputs` of ``cfg`` (dataset, partition, client data, device); raises
        what the data loaders raise."""
        from fl_core.config import to_container
        from pipeline.experiment import Inputs

        c = to_container(cfg)
        key = json.dumps([c["dataset"], c["partition"], c["data_dir"], c["engine"]["device"], c["engine"]["dtype"]],
                         sort_keys=True)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        item = Inputs.load(cfg)
        self._items[key] = item
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return item


class InfeasibleConfig(RuntimeError):
    """A sampled configuration is infeasible: it does not compose, the simulator cannot be built
    (``ConfigError``/``ValueError`` naming a key), or a rule rejects it once running
    (:class:`fl_core.algorithms.InfeasibleSetting`). The trial ends PRUNED with this reason."""


@dataclass
class SeedsResult:
    """Outcome of training one configuration for several seeds."""

    final_acc: List[float]  # per seed: mean of the last train.final_window evaluations (fraction)
    uplink_d: float  # cumulative uplink floats per client after the last round, in units of d (model size)
    algorithm: str  # the algorithm stack, e.g. fedbug[P=0.2](fedavg)

    @property
    def mean_acc(self) -> float:
        return sum(self.final_acc) / len(self.final_acc)


def train_seeds(overrides: Sequence[str], seeds: Sequence[int], cache: DataCache,
                on_round: Optional[Callable[[int, int, Dict[str, float]], None]] = None,
                on_config: Optional[Callable[[Dict[str, Any], str], None]] = None, threads: int = 1) -> SeedsResult:
    """Train ``overrides`` (experiment overrides, no seed) once per seed, through the one runner of an
    experiment's seeds (:class:`pipeline.experiment.ExperimentRunner`: one population where they share a pass).

    Args:
        overrides: Hydra overrides of the experiment; :data:`TRIAL_FIXED` and ``seed=s`` are appended.
        seeds: run seeds, e.g. [1, 2, 3].
        cache: the process's :class:`DataCache`.
        on_round: called as ``on_round(seed_index, round, row)`` after every round (``row`` as the
            simulator's history rows: ``test_acc``/``test_loss`` on evaluated rounds, ``train_loss``,
            ``comm_up_floats``, ...); it may raise ``optuna.TrialPruned``.
        on_config: called once, before training, with the first seed's composed config (plain dict)
            and the algorithm stack's description.
        threads: torch threads of the runs (``engine.threads``; ``tune.py --threads``).

    Raises:
        InfeasibleConfig: see :class:`InfeasibleConfig`.
        fl_core.engine.simulator.RunFailed: a run's loss became non-finite.
        Exception: anything else the run raises (a bug, not a property of the configuration).
    """
    from fl_core.algorithms import InfeasibleSetting
    from fl_core.config import compose, to_container
    from fl_core.experiment import resolve
    from fl_core.metrics import summarize_run
    from pipeline.experiment import ExperimentRunner, Observer

    try:
        # every key a trial can set was held to "changes the run" by spaces.check_space (the base alone, then
        # the command line, every branch and both ends of every range over it) before the first trial
        exp = resolve([compose(merge_overrides(overrides, TRIAL_FIXED, [make_override("engine.threads", threads),
                                                                       make_override("seed", seed)]), user=())
                       for seed in seeds])
    except (ConfigError, ValueError) as err:  # a combination the config validation rejects
        raise InfeasibleConfig(envfail.first_line(err)) from None
    index = {int(cfg.seed): i for i, cfg in enumerate(exp.configs)}
    seen: Dict[str, Any] = {"first": None, "training": False}

    class _Seeds(Observer):
        def built(self, run) -> None:
            if seen["first"] is None:  # the first seed's config and rule stack, before any seed trains
                seen["first"] = run.sim
                if on_config is not None:
                    on_config(to_container(run.cfg), run.sim.algo.describe())

        def started(self, seed: int, resumed_from: int) -> None:
            seen["training"] = True

        def round(self, seed: int, r: int, row: Dict[str, float]) -> None:
            if on_round is not None:
                on_round(index[seed], r, row)

        def finished(self, run) -> None:
            if run.failure is not None:  # the trial ends on its first diverging seed
                raise run.failure

    try:
        runs = ExperimentRunner(exp, cache.get(exp.cfg0)).train(exp.configs, [_Seeds()])
    except InfeasibleSetting as err:  # a rule's setting the data cannot run (before the generic ValueError)
        raise InfeasibleConfig(envfail.first_line(err)) from None
    except (ConfigError, ValueError) as err:  # a combination the config validation / the builders reject
        if seen["training"]:
            raise
        raise InfeasibleConfig(envfail.first_line(err)) from None
    accs = [float(summarize_run(run.history, run.cfg.train.target_acc, run.cfg.train.final_window)["final_acc"])
            for run in runs]
    uplink = float(runs[-1].history[-1]["comm_up_floats"]) / seen["first"].spec.d
    algo = seen["first"].algo.describe()
    return SeedsResult(accs, uplink, algo)


@dataclass
class Outcome:
    """How a trial ended: Optuna state name, objective values (COMPLETE only) and a reason."""

    state: str
    values: Optional[List[float]] = None
    reason: str = ""


def round_metrics(row: Dict[str, float], prefix: str) -> Dict[str, float]:
    """The MLflow metrics of one history row, ``test_*`` renamed ``<prefix>_*``."""
    out = {k: row[k] for k in ("train_loss", "comm_up_floats", "round_time_s") if k in row}
    if "test_acc" in row:
        out[f"{prefix}_acc"], out[f"{prefix}_loss"] = row["test_acc"], row["test_loss"]
    return out


def error_reason(err: BaseException) -> Tuple[str, str]:
    """(``"error: <the traceback's last line>"``, where it was raised as ``file:line in function``)."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    frames = traceback.extract_tb(err.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    return f"error: {last}", where


class TrialRunner:
    """Runs one Optuna trial: sample, train every seed (reporting for pruning), log to MLflow."""

    def __init__(self, settings: Settings, tracking=None, worker: int = 0, cache: Optional[DataCache] = None):
        self.settings = settings
        self.space = load_space(settings.space)
        self.tracking = tracking
        self.worker = worker
        self.cache = cache or DataCache()
        self._live = None  # the MLflow run of the trial in progress (ended FAILED if the process must end)
        storewait.on_stall(self._on_stall)

    def _on_stall(self, failure: BaseException) -> None:
        """A database stopped answering and the process ends (:func:`fl_core.store.storewait.on_stall`): the trial's MLflow
        run ends FAILED, unless it is MLflow's store that does not answer."""
        self._end_run(self._live, failure)

    def _end_run(self, logger, failure) -> None:
        """End the trial's MLflow run FAILED with ``fl.end_reason`` ``environment failure: <line>`` (best effort; not
        when MLflow's own store is the one that failed)."""
        from fl_core.store.tracking import ENV_FAILURE

        if logger is None or logger.run_id is None or _is_store_of(failure, self.tracking.uri):
            return
        try:
            self.tracking.client.set_tag(logger.run_id, "optuna_state", "FAIL")
            logger.close("FAILED", f"{ENV_FAILURE}{failure}")
        except Exception:  # noqa: BLE001  (the run is then ended as an orphan by the next invocation)
            pass

    def experiment_overrides(self, trial) -> List[str]:
        """Sample ``trial`` and return its experiment overrides (validation split on, no seed)."""
        extra, values = self.space.sample(trial)
        return self.space.experiment_overrides(extra, self.settings.overrides,
                                               [make_override(k, v) for k, v in values.items()])

    def _logger(self, trial, overrides: List[str]):
        if self.tracking is None:
            return None
        s = self.settings
        tags = {"sweep_role": "trial", "optuna_study": s.study_name, "optuna_trial": str(trial.number),
                "space": self.space.name, "worker": str(self.worker), **owner_tags()}
        params = {**{f"optuna.{k}": v for k, v in trial.params.items()}, "sweep.overrides": " ".join(overrides),
                  "sweep.seeds": ",".join(map(str, s.seeds))}
        logger = self.tracking.child_logger(s.parent_run_id, f"{s.study_name}/trial-{trial.number}", tags,
                                            params, log_every=1_000_000)  # buffered: written at close
        logger.open(None)
        return logger

    def __call__(self, trial) -> Outcome:
        """Run ``trial``; KeyboardInterrupt propagates after its MLflow run is closed as KILLED."""
        import optuna

        from fl_core.engine.simulator import RunFailed

        t0 = time.perf_counter()
        overrides = self._trial_overrides(trial)
        logger = self._live = self._logger(trial, overrides)
        on_config, on_round = self._callbacks(trial, logger)
        try:
            res = train_seeds(overrides, self.settings.seeds, self.cache, on_round=on_round, on_config=on_config,
                              threads=self.settings.threads)
        except optuna.TrialPruned as err:
            return self._finish(trial, logger, t0, Outcome("PRUNED", reason=f"pruned: {err}"), "KILLED")
        except RunFailed as err:
            return self._finish(trial, logger, t0, Outcome("PRUNED", reason=f"diverged: {err}"), "KILLED")
        except InfeasibleConfig as err:
            return self._finish(trial, logger, t0, Outcome("PRUNED", reason=f"infeasible: {err}"), "KILLED")
        except KeyboardInterrupt:
            self._finish(trial, logger, t0, Outcome("FAIL", reason="interrupted (Ctrl-C)"), "KILLED")
            raise
        except Exception as err:  # not a property of the configuration: FAIL, and the study goes on
            failure = envfail.classify(err)
            if failure is not None:  # the environment (the storage, MLflow, the disk): optimize decides
                self._end_run(logger, failure)
                raise
            reason, where = error_reason(err)
            reason = storefail.redact(reason, self.settings.storage, self.tracking.uri if self.tracking else None)
            print(f"{'w%d ' % self.worker if self.worker else ''}trial {trial.number}: {reason} (at {where})",
                  file=sys.stderr, flush=True)
            return self._finish(trial, logger, t0, Outcome("FAIL", reason=reason), "FAILED", f" (at {where})")
        return self._finish(trial, logger, t0, self._completed(trial, logger, res), "FINISHED")

    def _trial_overrides(self, trial) -> List[str]:
        """Tag ``trial`` with this process (host, pid, worker), then sample its experiment overrides
        (also stored as the user attribute ``overrides``)."""
        trial.set_user_attr("host", HOST)  # first: tells a stale trial from a running one (fail_stale_trials)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("worker", self.worker)
        overrides = self.experiment_overrides(trial)
        trial.set_user_attr("overrides", overrides)
        return overrides

    def _callbacks(self, trial, logger) -> Tuple[Callable[[Dict[str, Any], str], None],
                                                 Callable[[int, int, Dict[str, float]], None]]:
        """:func:`train_seeds`'s ``on_config`` (algorithm and run params to the trial and MLflow) and
        ``on_round`` (round metrics to MLflow; validation accuracy reported for pruning at
        ``step = seed_index * rounds + round``, raising ``optuna.TrialPruned`` when the pruner says so)."""
        import optuna

        from fl_core.store.tracking import run_params

        s = self.settings
        rounds = {"R": 1}

        def on_config(cfg: Dict[str, Any], algo: str) -> None:
            rounds["R"] = int(cfg["train"]["rounds"])
            trial.set_user_attr("algorithm", algo)
            if logger is not None:
                self.tracking.log_params(logger.run_id, {k: v for k, v in run_params(cfg).items() if k != "seed"})
                self.tracking.client.set_tag(logger.run_id, "algorithm", algo)

        def on_round(i: int, r: int, row: Dict[str, float]) -> None:
            step = i * rounds["R"] + r
            if logger is not None:
                logger.log_round(step, round_metrics(row, "val"))
            if "test_acc" in row and not s.multi:
                trial.report(float(row["test_acc"]), step)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"val_acc {row['test_acc']:.4f} at seed {s.seeds[i]} round {r} "
                                             f"(step {step})")

        return on_config, on_round

    def _completed(self, trial, logger, res: SeedsResult) -> Outcome:
        """The COMPLETE outcome of a trained trial (objective values in ``settings.objectives`` order);
        its per-seed accuracies and uplink go to the trial's user attributes and MLflow summary."""
        s = self.settings
        trial.set_user_attr("val_acc_per_seed", res.final_acc)
        trial.set_user_attr("uplink_d", res.uplink_d)
        values = [res.mean_acc if o == "acc" else res.uplink_d for o in s.objectives]
        if logger is not None:
            logger.log_summary({"objective_val_acc": res.mean_acc, "uplink_d": res.uplink_d,
                                **{f"val_acc_final_seed{sd}": a for sd, a in zip(s.seeds, res.final_acc)}})
        return Outcome("COMPLETE", values)

    def _finish(self, trial, logger, t0: float, outcome: Outcome, status: str, detail: str = "") -> Outcome:
        """Record how ``trial`` ended (``duration_s`` since ``t0``, ``reason``) and close its MLflow run
        with ``status`` (FINISHED | KILLED | FAILED; ``detail`` is appended to the reason there); returns
        ``outcome``. The storage failing here ends the MLflow run FAILED and raises."""
        try:
            trial.set_user_attr("duration_s", round(time.perf_counter() - t0, 3))
            if outcome.reason:
                trial.set_user_attr("reason", outcome.reason)
        except Exception as err:
            failure = envfail.classify(err)
            if failure is not None:
                self._end_run(logger, failure)
            raise
        self._live = None
        if logger is not None:
            self.tracking.client.set_tag(logger.run_id, "optuna_state", outcome.state)
            if outcome.reason:  # the documented tag of every non-COMPLETE trial, whatever close() tags
                self.tracking.client.set_tag(logger.run_id, "failure_reason", (outcome.reason + detail)[:5000])
            logger.close(status, (outcome.reason + detail) or None)
        return outcome


# =========================================================================== the trial loop and workers


def trial_line(number: int, outcome: Outcome, params: Dict[str, Any], duration: float, worker: int) -> str:
    """One progress line per finished trial (``w<k>`` prefix in spawned worker k)."""
    vals = "/".join(f"{v:.4f}" for v in outcome.values) if outcome.values else "-"
    shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                      for k, v in params.items())
    why = f"  [{outcome.reason}]" if outcome.reason and outcome.state != "COMPLETE" else ""
    who = f"w{worker} " if worker else ""
    return f"{who}trial {number:>3} {outcome.state:<8} {vals:>15}  {shown}  ({duration:.1f}s){why}"


def _is_store_of(failure, url: Optional[str]) -> bool:
    """Whether the environment failure ``failure`` is that of the store or database at ``url``."""
    store = getattr(failure, "store", None)
    return bool(store and url) and storefail.identity(store) == storefail.identity(url)


def storage_failure(err: BaseException, settings: Settings) -> Optional[envfail.EnvironmentFailure]:
    """The environment failure ``err`` stands for when it is the sweep's RDB storage that failed (lost, refused,
    timed out, locked: :mod:`fl_core.store.storefail`), else None."""
    if not is_url(settings.storage):
        return None
    failure = envfail.classify(err)
    return failure if _is_store_of(failure, settings.storage) else None


def note_outage(settings: Settings, err: BaseException) -> None:
    """``err`` (from any thread: the trial's heartbeat too) is the storage's failure: its outage begins now if it
    has not begun yet (:func:`fl_core.store.storewait.outage_began`), so :func:`wait_for_storage` counts from here."""
    if storage_failure(err, settings) is not None:
        storewait.outage_began(settings.storage)


def wait_for_storage(settings: Settings, failure: envfail.EnvironmentFailure) -> float:
    """After ``failure`` of the storage: wait until it answers again (:func:`fl_core.store.storewait.wait_until_back`),
    at most until ``FL_DB_RETRY_S`` (default 30 s) after the outage began: its first failure seen by this process
    (the trial's heartbeat included, :func:`note_outage`); the waits of one outage share that deadline. Returns the
    seconds since the outage began. A locked SQLite file is not waited for again (its busy timeout was the wait).

    Raises:
        fl_core.store.envfail.EnvironmentFailure: it does not answer within that time (one line: what failed first and
            how long it was waited for).
    """
    if settings.storage.startswith("sqlite"):
        raise failure
    back, waited = storewait.wait_until_back(settings.storage)
    if not back:
        cause = storefail.after_answering(failure.cause)  # only called after the storage had answered this sweep
        raise envfail.EnvironmentFailure(failure.resource, f"{cause}, and it did not answer again within "
                                         f"{storewait.retry_s():g} s ({storewait.RETRY_ENV})", failure.action,
                                         store=failure.store) from None
    return waited


def storage_call(settings: Settings, fn: Callable[[], Any]) -> Any:
    """``fn()``, once more after the storage answers again when it failed (:func:`wait_for_storage`): a database
    restart costs a pause, not the sweep. Only for calls that may be repeated (asking for a trial, telling one, user
    attributes)."""
    try:
        return fn()
    except Exception as err:
        failure = storage_failure(err, settings)
        if failure is None:
            raise
        wait_for_storage(settings, failure)
    return fn()


def _tell(study, trial, outcome: Outcome, settings: Settings, who: str) -> bool:
    """Tell the storage how ``trial`` ended (through :func:`storage_call`, so a tell that reached the database before
    it went away is not told twice); False when another process had already ended it (:func:`fail_silent_trials`
    while the database was away), whose FAIL then stands, with a note on stderr."""
    from optuna.trial import TrialState

    state = TrialState[outcome.state]
    values = outcome.values if state == TrialState.COMPLETE else None
    frozen = storage_call(settings, lambda: study.tell(trial, values, state=state, skip_if_finished=True))
    if frozen.state == state:
        return True
    print(f"note: {who}trial {trial.number} was marked {frozen.state.name} by another process meanwhile (no heartbeat "
          "while the database was away); its result is dropped", file=sys.stderr, flush=True)
    return False


def optimize(study, runner: TrialRunner, n_trials: int, on_trial: Optional[Callable[[str], None]] = None) -> bool:
    """Run up to ``n_trials`` trials of ``study`` in this process (fewer if ``settings.timeout`` passes).

    Trials are asked and told explicitly, so every outcome is recorded as designed (see the module
    docstring) and Ctrl-C leaves the running trial FAIL (user attribute ``reason``) with its MLflow
    run KILLED. ``on_trial`` receives each trial's progress line (default: stderr unless quiet). Before each trial
    the trials of lost processes are marked FAIL (:func:`fail_silent_trials`), and the running trial keeps its
    heartbeat (:func:`heartbeat`).

    The storage going away (a PostgreSQL restart) costs the trial that was running: the sweep waits for the storage
    (:func:`wait_for_storage`), marks that trial FAIL with reason ``storage lost: ...`` (its MLflow run FAILED), says
    so in one line and goes on.

    Returns:
        True if interrupted by Ctrl-C, else False.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: the storage did not come back within ``FL_DB_RETRY_S``; the running trial
            stays RUNNING in it until its heartbeat is stale (the next invocation, or another process, marks it
            FAIL).
        Exception: another error outside a trial's training (MLflow, a bug); the running trial is told FAIL first.
    """
    from optuna.trial import TrialState

    settings = runner.settings
    who = f"w{runner.worker} " if runner.worker else ""
    if on_trial is None:
        def on_trial(line: str) -> None:
            if not settings.quiet:
                print(line, file=sys.stderr, flush=True)

    deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
    trial = None
    try:
        for _ in range(n_trials):
            if deadline is not None and time.monotonic() >= deadline:
                break
            storage_call(settings, lambda: fail_silent_trials(study))
            trial = storage_call(settings, study.ask)
            t0 = time.perf_counter()
            try:
                with heartbeat(study, trial, functools.partial(note_outage, settings)):
                    outcome = runner(trial)
            except Exception as err:
                failure = storage_failure(err, settings)
                if failure is None:
                    raise
                waited = wait_for_storage(settings, failure)
                cause = storefail.after_answering(failure.cause)
                outcome = Outcome("FAIL", reason=f"storage lost: {cause}")
                storage_call(settings, functools.partial(trial.set_user_attr, "reason", outcome.reason))
                print(f"note: {who}trial {trial.number} ended FAIL: the Optuna storage {cause}; it answered "
                      f"again after {waited:.0f} s and the sweep goes on", file=sys.stderr, flush=True)
            _tell(study, trial, outcome, settings, who)
            line = trial_line(trial.number, outcome, trial.params, time.perf_counter() - t0, runner.worker)
            trial = None
            on_trial(line)
    except KeyboardInterrupt:
        if trial is not None:
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return True
    except BaseException as err:  # the trial must not stay RUNNING in the storage
        if trial is not None and storage_failure(err, settings) is None:  # (it cannot be told a failed storage)
            failure = envfail.classify(err)
            trial.set_user_attr("reason", f"environment failure: {failure}" if failure else error_reason(err)[0])
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        raise
    return False


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads; returns the previous value (to restore it)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    return previous


def die_with_parent(parent_pid: int, poll_s: float = 1.0, use_prctl: bool = True) -> str:
    """Make this process end when its parent ``parent_pid`` ends, however it ends (SIGKILL included).

    On Linux the kernel sends this process SIGKILL when the parent exits
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes; strictly when the parent's thread that
    started it exits: start workers from a thread that lives as long as the parent). Where prctl is
    not available (or ``use_prctl`` is False) a daemon thread checks ``os.getppid()`` every
    ``poll_s`` seconds and ends the process with ``os._exit`` once it changed (POSIX reparents an
    orphan; on Windows the id never changes, so nothing ends it there). Either way, a parent
    that died before this call (before the signal was armed) ends this process at once
    (status :data:`EXIT_PARENT_GONE`). Call it first thing in a child's entry point.

    Returns:
        How the parent is watched: ``"prctl"`` or ``"poll"``. Nothing is raised.
    """
    how = "poll"
    if use_prctl and sys.platform.startswith("linux"):
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):  # no libc symbol: poll
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(EXIT_PARENT_GONE)
    if how == "poll":
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(poll_s)
            os._exit(EXIT_PARENT_GONE)

        threading.Thread(target=watch, name="watch-parent", daemon=True).start()
    return how


def _worker_main(settings: Settings, n_trials: int, worker: int, parent_pid: int, failures=None) -> None:
    """Entry point of spawned worker process ``worker`` (1..W) of process ``parent_pid``. An environment failure
    (the storage gone for good, MLflow's store, a stalled database) ends it with one line, ``error: worker <w>:
    <line>``, exit status 3, and a note of it on the queue ``failures`` for the process that started it."""
    die_with_parent(parent_pid)  # first: a worker must not outlive a killed tune.py
    prefix = f"worker {worker}: "
    storewait.set_line_prefix(prefix)

    def report(failure: BaseException) -> None:
        if failures is not None:
            failures.put({"worker": worker, "line": str(failure), "store": getattr(failure, "store", None)})

    storewait.on_stall(report)
    try:
        _work(settings, n_trials, worker)
    except Exception as err:
        failure = envfail.classify(err)
        if failure is None or envfail.debug():
            raise
        report(failure)
        if not failure.quiet:
            print(f"error: {prefix}{failure}", file=sys.stderr, flush=True)
        # The fault path does no more work than it must: the trial's MLflow run is ended and the line is out, so the
        # interpreter's own teardown (garbage, threads, the storage's pool on a dead server) is skipped.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(envfail.EXIT_STATUS)


def _work(settings: Settings, n_trials: int, worker: int) -> None:
    import optuna

    set_threads(settings.threads)
    quiet_optuna()
    tracking = None
    if settings.experiment:
        from fl_core.store.tracking import Tracking

        tracking = Tracking(settings.experiment)
    runner = TrialRunner(settings, tracking, worker)
    study = optuna.load_study(study_name=settings.study_name, storage=open_storage(settings.storage),
                              **sampler_and_pruner(settings, runner.space, worker))
    interrupted = optimize(study, runner, n_trials)
    sys.exit(EXIT_INTERRUPTED if interrupted else 0)


def split_trials(n_trials: int, workers: int) -> List[int]:
    """Per-worker trial counts that add up to ``n_trials``."""
    return [n_trials // workers + (1 if w < n_trials % workers else 0) for w in range(workers)]


def count_finished(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


@dataclass
class WorkersEnd:
    """How the worker processes of :func:`run_workers` ended."""

    interrupted: bool  # Ctrl-C
    errors: int  # workers that ended with an error (a traceback on stderr, or an environment failure)
    failures: List[Dict[str, Any]]  # environment failures, each said in one line: {"worker", "line", "store"}


def run_workers(study, settings: Settings, n_trials: int, workers: int) -> WorkersEnd:
    """Run the trials in ``workers`` spawned processes on the shared storage, with a progress bar in this process
    on a terminal (:func:`fl_core.progress.bar`; a daemon thread polls ``study``; it never blocks this one, and a
    storage that fails only stops the bar). Each worker prints its trial lines to stderr and dies with this process
    (:func:`die_with_parent`), even when it is killed with SIGKILL; an environment failure ends a worker with one
    line of its own."""
    import multiprocessing as mp

    counts = [c for c in split_trials(n_trials, workers) if c > 0]
    start = count_finished(study)
    done = {"n": 0}
    ctx = mp.get_context("spawn")
    failures_queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker_main, args=(settings, c, w + 1, os.getpid(), failures_queue),
                         name=f"sweep-worker-{w + 1}")
             for w, c in enumerate(counts)]
    for p in procs:
        p.start()
    stop = threading.Event()

    def poll() -> None:
        with storewait.unwatched():
            while not stop.wait(0.5):
                try:
                    done["n"] = count_finished(study) - start
                except Exception:  # the storage failed: the workers say so
                    pass

    bar = progress.bar(total=n_trials, unit="trial", desc=settings.study_name, enabled=not settings.quiet)
    if bar is not None:  # a terminal: the bar follows the study's count
        threading.Thread(target=poll, name="sweep-progress", daemon=True).start()
    interrupted = False
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.5)
            if bar is not None:
                bar.n = done["n"]
                bar.refresh()
    except KeyboardInterrupt:  # the workers got the same SIGINT: let them close their trials
        interrupted = True
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    finally:
        for p in procs:
            p.join()
        stop.set()
    failures = []
    while not failures_queue.empty():
        failures.append(failures_queue.get())
    if bar is not None:
        if not failures:  # the storage answers: the final count
            done["n"] = count_finished(study) - start
        bar.n = done["n"]
        bar.close()
    interrupted = interrupted or any(p.exitcode == EXIT_INTERRUPTED for p in procs)
    errors = sum(1 for p in procs if p.exitcode not in (0, EXIT_INTERRUPTED))
    return WorkersEnd(interrupted, errors, failures)
