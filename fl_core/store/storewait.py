"""Bounded waits on the tracking store and the databases: how long a command waits for an MLflow tracking server, a
locked SQLite file or a PostgreSQL server before it gives up with one line (:mod:`fl_core.store.storefail` words it).

Every wait is a setting of the library that waits, given a project default only where the user has not set it:

- **MLflow's HTTP client** (:func:`http_defaults`): MLflow retries every request (connection errors, read errors and
  the answers 408, 429, 500, 502, 503, 504) with exponential backoff. Its own defaults (7 retries, backoff factor 2,
  120 s per request) add up to about 4 minutes of silence before a dead server is reported. The project sets
  ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=10`` (MLflow's most), ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1`` and
  ``MLFLOW_HTTP_REQUEST_TIMEOUT=15`` (s per attempt; a request of the project takes well under a second) where they
  are unset, and bounds the retries of one request by a wall-clock deadline (:func:`install_http_deadline`):
  ``FL_HTTP_RETRY_S`` (default 30 s, long enough for a tracking server to restart) from its first failure, the
  retries spread over it (pauses 0, 2, then at most 3.5 s: a restarted server is reached within seconds of answering
  again, not after a 16 s pause), none started after it; so a request gives up at most ``FL_HTTP_RETRY_S`` + one
  attempt's timeout after its first failure, whatever the load.
- **SQLite** (:func:`install`): every SQLite connection SQLAlchemy opens waits ``FL_SQLITE_BUSY_TIMEOUT_S`` (default
  30 s) for a lock held by another process; SQLite's busy handler retries meanwhile with its own backoff (pauses of
  1 ms growing to 100 ms). It replaces MLflow's fixed ``PRAGMA busy_timeout = 20000`` of every session, so that one
  setting bounds every statement, MLflow's and Optuna's.
- **PostgreSQL** (:func:`pg_connect_args`, :func:`with_pg_params`): libpq's ``connect_timeout`` (10 s), TCP keepalives
  (idle 10 s, then every 5 s, 3 probes: a dead peer is noticed within about 25 s), ``tcp_user_timeout`` (30 s:
  data unacknowledged that long drops the connection) and the server's ``statement_timeout`` (60 s, through libpq's
  ``options``), each only where neither the URL nor libpq's environment (``PGCONNECT_TIMEOUT``, ``PGOPTIONS``) sets
  it.
- **A PostgreSQL server that stops answering** (a frozen process: the kernel still acknowledges its packets, so no
  timeout of the connection fires): :func:`install` watches what waits on PostgreSQL engines (statements, COMMIT
  and ROLLBACK, the pool's reset of a returned connection); when one has waited ``FL_DB_STALL_S`` (default 15 s) and
  a new connection to that server gets no answer within its ``connect_timeout``, the process runs its
  :func:`on_stall` hooks (at most 10 s) and ends with one line and exit status 3. A server that answers a new
  connection is only slow: the statement keeps waiting (its ``statement_timeout`` bounds it).
- **A database that went away** (:func:`wait_until_back`): a sweep waits ``FL_DB_RETRY_S`` (default 30 s) for its
  storage to answer again before it gives up; a PostgreSQL restart takes a few seconds. The time is a deadline from
  the first failure of the outage (:func:`outage_began`), shared by every wait of the process until a call to the
  database succeeds again (:func:`answered`): a server that seems back (it answers "starting up" or "shutting down",
  which is no answer here) and fails again does not start a new wait.

The bound these make, from a fault to the exit (measured by ``benchmarks/env_faults.py``, also beside CPU-bound
processes, ``--busy``): a stopped database ``FL_DB_RETRY_S`` (30 s) after the first failure; a frozen one
``FL_DB_STALL_S`` + the probe's ``connect_timeout`` + 1 s + :data:`HOOK_BUDGET_S` (15 + 11 + 10 s); a tracking
server ``FL_HTTP_RETRY_S`` + one ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (30 + 15 s, a refused connection: 30 s); each plus
the process's own exit, which the failing paths keep short (a sweep's worker ends with ``os._exit`` once its line is
out), so 60 s hold on a loaded machine (a store that comes back within the deadline: the command goes on, and its own
work is not part of the bound).

This module imports nothing of the project but :mod:`fl_core.store.envfail`, and SQLAlchemy only inside functions.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from . import envfail
from .storeurl import _role, identity, mask, redact

#: MLflow's HTTP settings and the project's defaults (set where unset, :func:`http_defaults`)
HTTP_DEFAULTS: Dict[str, str] = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "10", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
HTTP_RETRY_ENV, HTTP_RETRY_DEFAULT_S = "FL_HTTP_RETRY_S", 30.0  # the deadline of one request's retries
SQLITE_BUSY_ENV, SQLITE_BUSY_DEFAULT_S = "FL_SQLITE_BUSY_TIMEOUT_S", 30.0
STALL_ENV, STALL_DEFAULT_S = "FL_DB_STALL_S", 15.0
RETRY_ENV, RETRY_DEFAULT_S = "FL_DB_RETRY_S", 30.0
#: libpq parameters given to a PostgreSQL connection unless the URL or libpq's environment sets them
PG_DEFAULTS: Dict[str, object] = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10,
                                  "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30000}
PG_STATEMENT_TIMEOUT_MS = 60000  # the server's statement_timeout (libpq options -c statement_timeout=...)
PG_ENV = {"connect_timeout": "PGCONNECT_TIMEOUT", "options": "PGOPTIONS"}  # libpq's variables for these parameters
HOOK_BUDGET_S = 10.0  # the longest the on_stall hooks may take together before the process ends
PROBE_MARGIN_S = 1.0  # a probe's wait beyond its connect_timeout (libpq's own timer ends the attempt)
#: SQLSTATEs of a server that answers but takes no work: admin_shutdown, crash_shutdown, cannot_connect_now (starting
#: up, shutting down, in recovery); alive for the stall watch, not back for :func:`wait_until_back`
PG_NOT_READY = ("57P01", "57P02", "57P03")


def _seconds(env: str, default: float) -> float:
    """``env`` as a number of seconds > 0, else ``default`` (an unparsable or non-positive value is ignored)."""
    try:
        value = float(os.environ.get(env, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def sqlite_busy_timeout_s() -> float:
    """The busy timeout of SQLite connections in seconds: ``FL_SQLITE_BUSY_TIMEOUT_S``, default 30."""
    return _seconds(SQLITE_BUSY_ENV, SQLITE_BUSY_DEFAULT_S)


def stall_s() -> float:
    """How long a PostgreSQL statement may wait before the server is probed, seconds: ``FL_DB_STALL_S``, default 15."""
    return _seconds(STALL_ENV, STALL_DEFAULT_S)


def retry_s() -> float:
    """How long a sweep waits for a database that went away, seconds: ``FL_DB_RETRY_S``, default 30."""
    return _seconds(RETRY_ENV, RETRY_DEFAULT_S)


def http_retry_s() -> float:
    """The deadline of MLflow's retries of one request from its first failure, seconds: ``FL_HTTP_RETRY_S``,
    default 30."""
    return _seconds(HTTP_RETRY_ENV, HTTP_RETRY_DEFAULT_S)


# --------------------------------------------------------------------------- MLflow's HTTP client


def http_defaults() -> Dict[str, str]:
    """Set MLflow's HTTP retry settings (:data:`HTTP_DEFAULTS`) in ``os.environ`` where unset (MLflow reads them at
    every request) and bound the retries of a request by ``FL_HTTP_RETRY_S`` (:func:`install_http_deadline`);
    returns the MLflow settings in force."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    install_http_deadline()
    return {key: os.environ[key] for key in HTTP_DEFAULTS}


def spread_pause(backoff_s: float, left_s: float, pauses_left: int) -> float:
    """The pause before the next retry of a request whose retries end at a deadline: urllib3's exponential
    ``backoff_s``, but no longer than an even share of the ``left_s`` seconds to the deadline among the
    ``pauses_left`` pauses still to come (this one included), and never past it."""
    return max(0.0, min(backoff_s, max(0.0, left_s) / max(1, pauses_left)))


def http_retry_window_s() -> Tuple[int, float, float]:
    """(retries, seconds of pauses without jitter, timeout per attempt) of MLflow's HTTP client as set now: urllib3
    pauses ``factor * 2 ** (n - 1)`` after the n-th consecutive error (none after the first, at most 120 s), spread
    over ``FL_HTTP_RETRY_S`` (:func:`spread_pause`) where the deadline is installed."""
    def number(key: str, default: float) -> float:
        try:
            return float(os.environ.get(key, default))
        except ValueError:
            return default

    retries = int(number("MLFLOW_HTTP_REQUEST_MAX_RETRIES", 7))
    factor = number("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", 2)
    window = http_retry_s() if http_deadline_installed() else float("inf")
    left, pauses = window, 0.0
    for n in range(1, retries + 1):  # the pause after the n-th consecutive error
        pause = 0.0 if n == 1 else spread_pause(min(120.0, factor * 2 ** (n - 1)), left, retries - n + 1)
        pauses, left = pauses + pause, left - pause
    return retries, pauses, number("MLFLOW_HTTP_REQUEST_TIMEOUT", 120)


_DEADLINE_RETRY: List[Optional[type]] = [None]  # the Retry class installed in MLflow's HTTP client


def _deadline_retry(base: type) -> type:
    """urllib3's ``Retry`` (``base``) with a wall-clock deadline: the first failure of a request starts it
    (:func:`http_retry_s`, read then), the pauses are spread over it (:func:`spread_pause`; a server's Retry-After
    too), and no retry starts after it. The counts of ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` still apply."""

    class DeadlineRetry(base):
        fl_deadline_retry = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.deadline: Optional[float] = None  # time.monotonic() after which no retry starts

        def new(self, **kw):
            retry = super().new(**kw)  # (increment() calls it once per failure: the first one starts the clock)
            retry.deadline = self.deadline if self.deadline is not None else time.monotonic() + http_retry_s()
            return retry

        def _left(self) -> float:
            return float("inf") if self.deadline is None else self.deadline - time.monotonic()

        def is_exhausted(self) -> bool:
            return super().is_exhausted() or self._left() <= 0

        def get_backoff_time(self) -> float:
            backoff = super().get_backoff_time()
            if self.deadline is None or backoff <= 0:
                return backoff
            total = self.total if isinstance(self.total, int) and self.total >= 0 else 0
            return spread_pause(backoff, self._left(), total + 1)

        def get_retry_after(self, response):
            after = super().get_retry_after(response)
            return after if after is None or self.deadline is None else max(0.0, min(after, self._left()))

    return DeadlineRetry


def http_deadline_installed() -> bool:
    """Whether MLflow's HTTP client of this process retries until ``FL_HTTP_RETRY_S`` at most
    (:func:`install_http_deadline`)."""
    return _DEADLINE_RETRY[0] is not None


def install_http_deadline() -> bool:
    """Make MLflow's HTTP client retry with :func:`_deadline_retry` (idempotent; its sessions made before are
    dropped); False where its client is not the one this was written for (urllib3 < 2, or no ``Retry`` in
    ``mlflow.utils.request_utils``): then only the counts bound the retries."""
    if _DEADLINE_RETRY[0] is not None:
        return True
    try:
        import urllib3
        from mlflow.utils import request_utils
    except ImportError:
        return False
    base = getattr(request_utils, "Retry", None)
    cached = getattr(request_utils, "_cached_get_request_session", None)
    if (base is None or not isinstance(base, type) or int(urllib3.__version__.split(".")[0]) < 2
            or not hasattr(cached, "cache_clear")):
        return False
    with _LOCK:
        if _DEADLINE_RETRY[0] is None:
            if not getattr(base, "fl_deadline_retry", False):
                request_utils.Retry = _deadline_retry(base)
            _DEADLINE_RETRY[0] = request_utils.Retry
            cached.cache_clear()
    return True


# --------------------------------------------------------------------------- PostgreSQL connection parameters


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql:", "postgresql+", "postgres:"))


def _query(url: str) -> Dict[str, str]:
    from urllib.parse import parse_qsl, urlsplit

    return dict(parse_qsl(urlsplit(url).query))


def pg_connect_args(url: str) -> Dict[str, object]:
    """libpq parameters for a PostgreSQL ``url`` (SQLAlchemy's ``connect_args``): :data:`PG_DEFAULTS` and
    ``options=-c statement_timeout=60000`` for every parameter that neither the URL's query nor libpq's environment
    variable sets; {} for other databases."""
    if not is_postgres(url):
        return {}
    given = _query(url)
    out: Dict[str, object] = {}
    for key, value in PG_DEFAULTS.items():
        if key not in given and not os.environ.get(PG_ENV.get(key, "")):
            out[key] = value
    if "options" not in given and not os.environ.get("PGOPTIONS"):
        out["options"] = f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS}"
    return out


def with_pg_params(url: str) -> str:
    """``url`` with :func:`pg_connect_args` added to its query (for MLflow's SQLAlchemy store, which takes no
    ``connect_args``); other URLs unchanged."""
    from urllib.parse import urlencode

    extra = pg_connect_args(url)
    if not extra:
        return url
    return url + ("&" if "?" in url else "?") + urlencode({k: str(v) for k, v in extra.items()})


# --------------------------------------------------------------------------- SQLAlchemy: SQLite busy timeout, stalls

_INSTALLED = False
_LOCK = threading.Lock()
_INFLIGHT: Dict[int, Tuple[object, float]] = {}  # thread id -> (engine, monotonic start) of a PostgreSQL statement
_UNWATCHED = threading.local()
_HOOKS: List[Callable[[BaseException], None]] = []
_BUSY_PRAGMA = re.compile(r"^\s*PRAGMA\s+busy_timeout\s*=\s*\d+\s*;?\s*$", re.IGNORECASE)
_WATCHER: Optional[threading.Thread] = None
_PREFIX = [""]  # before the line of a stalled server (a sweep's worker: "worker 2: ")
_OUTAGES: Dict[str, float] = {}  # identity of a database -> time.monotonic() its outage began (this process)


def install() -> None:
    """Listen on every SQLAlchemy engine of the process (idempotent): SQLite connections get the busy timeout of
    :func:`sqlite_busy_timeout_s` (also where MLflow sets its own), and statements on PostgreSQL engines are watched
    for a server that stops answering (module docstring)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.pool import Pool

    event.listen(Engine, "connect", _on_connect)
    event.listen(Engine, "before_cursor_execute", _before_execute, retval=True)
    event.listen(Engine, "after_cursor_execute", _after_execute)
    event.listen(Engine, "handle_error", _clear)
    event.listen(Engine, "commit", _on_end_of_transaction)
    event.listen(Engine, "rollback", _on_end_of_transaction)
    event.listen(Pool, "reset", _on_reset)
    event.listen(Pool, "checkin", _clear)
    event.listen(Pool, "invalidate", _clear)  # a reset that failed on a dead connection: no longer waiting


def _busy_ms() -> int:
    return int(sqlite_busy_timeout_s() * 1000)


def _on_connect(dbapi_connection, _record) -> None:
    if type(dbapi_connection).__module__.startswith("sqlite3"):
        dbapi_connection.execute(f"PRAGMA busy_timeout = {_busy_ms()}")


_LAST: Dict[int, object] = {}  # thread id -> the PostgreSQL engine it last used (for the pool's reset)


def _mark(engine) -> None:
    """This thread waits on ``engine``'s server from now (a statement, a commit or rollback, the pool's reset)."""
    if engine.dialect.name != "postgresql" or getattr(_UNWATCHED, "on", False):
        return
    thread = threading.get_ident()
    _LAST[thread] = engine
    _INFLIGHT[thread] = (engine, time.monotonic())
    _start_watcher()


def _before_execute(conn, _cursor, statement, parameters, _context, _executemany):
    if conn.engine.dialect.name == "sqlite" and _BUSY_PRAGMA.match(statement):
        statement = f"PRAGMA busy_timeout = {_busy_ms()};"
    _mark(conn.engine)
    return statement, parameters


def _on_end_of_transaction(conn) -> None:
    """Before the driver's COMMIT or ROLLBACK (no event follows it: the pool's check-in, the next statement, or a
    connection left idle, whose server the watcher then only probes, ends the mark). Not on a connection already
    invalidated (a statement or COMMIT failed on a server that went away): SQLAlchemy sends it nothing, and a mark
    would stay until the watcher took the outage for a frozen server."""
    if getattr(conn, "invalidated", False) or getattr(conn, "closed", False):
        return
    _mark(conn.engine)


def _on_reset(_dbapi_connection, _record, _reset_state=None) -> None:
    """Before the pool rolls back a connection it takes back (it waits on the server too)."""
    engine = _LAST.get(threading.get_ident())
    if engine is not None:
        _mark(engine)


def _clear(*_args) -> None:
    _INFLIGHT.pop(threading.get_ident(), None)


def _after_execute(conn, *_args) -> None:
    """A statement returned: this thread no longer waits, and its database answers (an outage is over,
    :func:`answered`)."""
    _INFLIGHT.pop(threading.get_ident(), None)
    if _OUTAGES:
        answered(_url_of(conn.engine))


@contextmanager
def unwatched() -> Iterator[None]:
    """Statements of this thread inside the block are not watched for stalls (a progress display that may wait)."""
    before = getattr(_UNWATCHED, "on", False)
    _UNWATCHED.on = True
    try:
        yield
    finally:
        _UNWATCHED.on = before


def on_stall(hook: Callable[[BaseException], None]) -> Callable[[], None]:
    """Run ``hook(failure)`` (an :class:`fl_core.store.envfail.EnvironmentFailure`) before the process ends on a stalled
    server, e.g. to end the MLflow runs it has open; returns a function that removes the hook."""
    _HOOKS.append(hook)
    return lambda: _HOOKS.remove(hook) if hook in _HOOKS else None


def set_line_prefix(prefix: str) -> None:
    """Put ``prefix`` after ``error: `` in the line this process prints when it ends on a stalled server."""
    _PREFIX[0] = prefix


def _start_watcher() -> None:
    global _WATCHER
    if _WATCHER is not None:
        return
    with _LOCK:
        if _WATCHER is None:
            _WATCHER = threading.Thread(target=_watch, name="fl-db-stall-watch", daemon=True)
            _WATCHER.start()


def _watch() -> None:
    """The stall watcher's loop (a daemon thread): every second, probe the server of each statement that has waited
    :func:`stall_s` (again every :func:`stall_s` while the server answers the probes)."""
    probed: Dict[Tuple[int, float], float] = {}  # (thread, statement start) -> when its server last answered
    while True:
        time.sleep(1.0)
        now, limit = time.monotonic(), stall_s()
        waiting = dict(_INFLIGHT)
        probed = {k: v for k, v in probed.items() if k[0] in waiting and waiting[k[0]][1] == k[1]}
        for thread, (engine, t0) in waiting.items():
            if now - t0 < limit or now - probed.get((thread, t0), t0) < limit:
                continue
            answered, why = probe(_url_of(engine))
            if answered:
                probed[(thread, t0)] = time.monotonic()
            elif _INFLIGHT.get(thread, (None, None))[1] == t0:  # still waiting, and the server is silent
                _stalled(engine, time.monotonic() - t0, why)


def _url_of(engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def probe(url: str, connect_args: Optional[Dict[str, object]] = None,
          timeout_s: Optional[float] = None, ready: bool = False) -> Tuple[bool, str]:
    """Whether the database at ``url`` answers a new connection (its own, no pool): (True, "") when it runs
    ``SELECT 1`` or answers with an error of its own (an overloaded server is alive), (False, why) when the
    connection is refused, closed or times out. ``ready``: a server that answers that it takes no work
    (:data:`PG_NOT_READY`: starting up, shutting down) is (False, why) too. Never waits longer than ``timeout_s``
    (default: the connection's ``connect_timeout`` + :data:`PROBE_MARGIN_S`); never raises."""
    import sqlalchemy

    args = {**pg_connect_args(url), **(connect_args or {})}
    limit = timeout_s if timeout_s is not None else _connect_timeout(url, args) + PROBE_MARGIN_S
    result: List[Tuple[bool, str]] = []

    def attempt() -> None:
        engine = None
        try:
            engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=args)
            with unwatched(), engine.connect() as conn:
                conn.execute(sqlalchemy.text("SELECT 1"))
            result.append((True, ""))
        except Exception as err:  # noqa: BLE001  (whatever the driver raises)
            orig = getattr(err, "orig", err)
            sqlstate = getattr(orig, "sqlstate", None)
            if sqlstate and not (ready and sqlstate in PG_NOT_READY):  # the server itself answered: alive
                result.append((True, ""))
            else:
                result.append((False, envfail.first_line(orig)))
        finally:
            if engine is not None:
                engine.dispose()

    worker = threading.Thread(target=attempt, name="fl-db-probe", daemon=True)
    worker.start()
    worker.join(limit)
    if not result:
        return False, f"no answer to a new connection within {limit:g} s"
    return result[0]


def _connect_timeout(url: str, args: Dict[str, object]) -> float:
    """The ``connect_timeout`` a new connection to ``url`` gets, seconds: the URL's, else ``args``' (the project's
    default or the caller's), else libpq's ``PGCONNECT_TIMEOUT``, else 10."""
    for value in (_query(url).get("connect_timeout"), args.get("connect_timeout"),
                  os.environ.get(PG_ENV["connect_timeout"])):
        try:
            if value is not None and float(value) > 0:
                return float(value)
        except ValueError:
            continue
    return 10.0


def stalled(url: str, waited_s: float, why: str) -> envfail.EnvironmentFailure:
    """The failure of a PostgreSQL server that stopped answering: a statement (or a commit) waited ``waited_s``
    seconds and a new connection got no answer (``why``); :func:`fl_core.store.storewait.install`'s watcher ends the process
    with it."""
    label, action = _role(url)
    return envfail.EnvironmentFailure(
        f"{label} {mask(url)}",
        f"does not answer (no answer for {waited_s:.0f} s, {STALL_ENV}; a new connection: "
        f"{redact(why, url)})",
        f"{action or 'check the PostgreSQL server (a frozen or overloaded process, the network)'}, {envfail.AGAIN}",
        store=mask(url))


def _stalled(engine, waited_s: float, why: str) -> None:
    """A statement on ``engine`` waited ``waited_s`` seconds and the server does not answer: hooks, one line, exit 3
    (``FL_DEBUG=1``: every thread's stack first)."""
    failure = stalled(_url_of(engine), waited_s, why)
    done = threading.Event()

    def run_hooks() -> None:
        for hook in list(_HOOKS):
            try:
                hook(failure)
            except Exception:  # noqa: BLE001  (best effort: the process ends anyway)
                pass
        done.set()

    threading.Thread(target=run_hooks, name="fl-db-stall-hooks", daemon=True).start()
    done.wait(HOOK_BUDGET_S)
    if envfail.debug():
        import faulthandler

        faulthandler.dump_traceback(sys.stderr, all_threads=True)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os.write(2, f"error: {_PREFIX[0]}{failure}\n".encode())
    os._exit(envfail.EXIT_STATUS)


def _outage_key(url: str) -> str:
    return identity(url)


def outage_began(url: str) -> float:
    """When (``time.monotonic()``) the outage of the database at ``url`` began in this process: the first call since
    it last answered (:func:`answered`) records now."""
    with _LOCK:
        return _OUTAGES.setdefault(_outage_key(url), time.monotonic())


def answered(url: str) -> None:
    """A call to the database at ``url`` succeeded: its outage, if any, is over (the next failure starts a new one)."""
    if _OUTAGES:
        with _LOCK:
            _OUTAGES.pop(_outage_key(url), None)


def wait_until_back(url: str, within_s: Optional[float] = None, connect_args: Optional[Dict[str, object]] = None,
                    sleep: Callable[[float], None] = time.sleep) -> Tuple[bool, float]:
    """Probe the database at ``url`` (:func:`probe`, ``ready=True``) until it answers, pausing 0.5 s, then doubling
    up to 2 s, until the deadline: ``within_s`` seconds (default :func:`retry_s`) after the outage began
    (:func:`outage_began`: the first failure since the database last answered, so waits that follow one another in
    an outage share one deadline). No probe runs past the deadline. Returns (whether it answers, seconds since the
    outage began)."""
    limit = retry_s() if within_s is None else within_s
    t0 = outage_began(url)
    deadline = t0 + limit
    pause = 0.5
    while True:
        left = deadline - time.monotonic()
        if left > 0:
            ok, _why = probe(url, connect_args, timeout_s=min(left, 15.0), ready=True)
            if ok:
                return True, time.monotonic() - t0
        left = deadline - time.monotonic()
        if left <= 0:
            return False, time.monotonic() - t0
        sleep(min(pause, left))
        pause = min(2.0, pause * 2)


def engine_kwargs(url: str) -> Dict[str, object]:
    """SQLAlchemy ``create_engine`` keyword arguments for ``url`` with the bounded waits (:func:`pg_connect_args`
    as ``connect_args``; {} for other databases)."""
    args = pg_connect_args(url)
    return {"connect_args": args} if args else {}
