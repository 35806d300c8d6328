"""The sweep's Optuna storage: opening it (a journal file or an RDB URL), the study-setup lock, the trials of lost
processes (stale, no heartbeat), the heartbeat of running trials, the MLflow runs of killed processes, and what a
storage failure costs (waiting for it to answer again, :func:`storage_call`)."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

from fl_core.store import envfail, procs, storefail, storewait
from fl_core.store.tracking import end_orphaned_runs as tracking_end_orphans

from .settings import HOST, Settings

STALE_REASON = "stale: left RUNNING by an earlier process"


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


def is_store_of(failure, url: Optional[str]) -> bool:
    """Whether the environment failure ``failure`` is that of the store or database at ``url``."""
    store = getattr(failure, "store", None)
    return bool(store and url) and storefail.identity(store) == storefail.identity(url)


def storage_failure(err: BaseException, settings: Settings) -> Optional[envfail.EnvironmentFailure]:
    """The environment failure ``err`` stands for when it is the sweep's RDB storage that failed (lost, refused,
    timed out, locked: :mod:`fl_core.store.storefail`), else None."""
    if not is_url(settings.storage):
        return None
    failure = envfail.classify(err)
    return failure if is_store_of(failure, settings.storage) else None


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


def storage_back(settings: Settings, failure: envfail.EnvironmentFailure, ended: str) -> str:
    """After ``failure`` of the storage: wait until it answers again (:func:`wait_for_storage`), say so in one line
    on stderr (``note: <ended> ended FAIL: the Optuna storage <cause>; it answered again after N s and the sweep goes
    on``, ``ended`` naming the trials it costs, e.g. ``w1 trial 3``) and return their reason ``storage lost: <cause>``.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: it does not answer within ``FL_DB_RETRY_S``.
    """
    waited = wait_for_storage(settings, failure)
    cause = storefail.after_answering(failure.cause)
    print(f"note: {ended} ended FAIL: the Optuna storage {cause}; it answered again after {waited:.0f} s and the sweep "
          "goes on", file=sys.stderr, flush=True)
    return f"storage lost: {cause}"


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

