"""The tracking store and the databases failing: one line naming the store (password masked), the cause and what to do.

Importing this module registers its classifiers with :func:`fl_core.store.envfail.register` (:mod:`fl_core.store.tracking` and
:mod:`sweeps.runner` import it), so an error of these kinds ends a command with ``error: <line>`` and exit status 3:

- **SQLite** (through SQLAlchemy: MLflow's store, an Optuna ``sqlite:///`` storage): locked by another process for
  the busy timeout (:func:`fl_core.store.storewait.sqlite_busy_timeout_s`), cannot be opened, full, read-only, an I/O
  error. E.g. ``tracking store sqlite:///.../mlflow.db is locked by another process for 30 s; retry, or set
  MLFLOW_TRACKING_URI to a tracking server``.
- **PostgreSQL** (psycopg 3 or psycopg2 through SQLAlchemy): refused, lost (server shut down or restarted), timed out
  (``connect_timeout``, ``statement_timeout``), a server that stopped answering (:func:`stalled`).
- **MLflow's HTTP client** (``requests``): a tracking server that does not answer after MLflow's retries (connection
  refused or reset, a timeout) or answers with server errors (5xx) after them.

Which store: the URL comes from the failing SQLAlchemy connection (a frame of the traceback) or the HTTP request;
:func:`name_store` gives a URL its role in the messages (``tracking store``, ``Optuna storage``); other databases are
``database <url>``. Errors are recognised by type name and module, so neither MLflow, SQLAlchemy nor a driver is
imported here. :func:`missing_folder` is the check of a ``sqlite:///`` URI whose folder does not exist.

Secrets never leave memory (:mod:`fl_core.store.storeurl`, whose names this module passes on): :func:`mask` is how every
storage or tracking URI is shown (messages, MLflow tags,
summaries: password and ``?password=`` / ``?token=`` values as ``***``; SQLAlchemy is imported only when it is
called), and :func:`redact` cleans a driver's or a library's message that may quote the URL or its password.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple
from urllib.parse import urlsplit

from . import envfail, storewait
from .storeurl import (HIDDEN, SECRET_KEY, _role, identity, mask, name_store, redact,  # noqa: F401  (the display
                       secrets)  # of a store's URI, imported with its failures by the callers)
from .storewait import stalled  # noqa: F401  (likewise)

AGAIN = envfail.AGAIN


def _type(err: BaseException) -> Tuple[str, str]:
    return type(err).__module__, type(err).__name__


def _mro_names(err: BaseException) -> set:
    return {c.__name__ for c in type(err).__mro__}


# --------------------------------------------------------------------------- SQLAlchemy errors: which database


def _engine_url(err: BaseException) -> Optional[str]:
    """The URL of the SQLAlchemy engine whose connection raised ``err``: the innermost traceback frame whose
    ``self`` is a SQLAlchemy Connection or Engine (or has one as ``engine``)."""
    tb, found = err.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        engine = owner if type(owner).__name__ == "Engine" else getattr(owner, "engine", None)
        url = getattr(engine, "url", None)
        if url is not None and type(url).__module__.startswith("sqlalchemy"):
            try:
                found = url.render_as_string(hide_password=False)
            except Exception:  # noqa: BLE001
                pass
        tb = tb.tb_next
    return found


def _dbapi_error(err: BaseException) -> Optional[BaseException]:
    """``err``'s driver error when ``err`` is a SQLAlchemy ``DBAPIError`` (its ``orig``), else None."""
    if not type(err).__module__.startswith("sqlalchemy") or "DBAPIError" not in _mro_names(err):
        return None
    return getattr(err, "orig", None)


_SQLITE = [  # message of sqlite3.OperationalError -> (cause, action); None action: the role's or the default
    ("database is locked", None, None),
    ("database table is locked", None, None),
    ("unable to open database file", "cannot be opened (unable to open database file: its folder is missing or not "
                                     "writable)", "fix the folder or point the URI elsewhere"),
    ("database or disk is full", "is out of space (database or disk is full)", "free space there"),
    ("attempt to write a readonly database", "is not writable (read-only database)",
     "make it writable or point the URI elsewhere"),
    ("disk i/o error", "gave an input/output error (a failing disk or network file system)",
     "check the disk or point the URI elsewhere"),
]


def _sqlite_failure(url: Optional[str], orig: BaseException) -> Optional[envfail.EnvironmentFailure]:
    text = str(orig).strip().lower()
    for needle, known_cause, known_action in _SQLITE:
        if text.startswith(needle):
            label, role_action = _role(url) if url else ("a SQLite database", "")
            cause, action = known_cause, known_action
            if cause is None:  # locked
                cause = f"is locked by another process for {storewait.sqlite_busy_timeout_s():g} s"
                action = role_action or f"retry, or raise {storewait.SQLITE_BUSY_ENV}"
            resource = f"{label} {mask(url)}" if url else label
            return envfail.EnvironmentFailure(resource, cause, f"{action}, {AGAIN}", store=mask(url) if url else None)
    return None


REFUSED = "refused the connection (connection refused: is the server running?)"
LOST_REFUSED = "lost its connection (connection refused: is the server running?)"


def after_answering(cause: str) -> str:
    """``cause`` of a store that had answered earlier in this process: a refused connection then means it went
    away, so it reads as a lost one (whether the failing call held a connection or opened a new one is timing)."""
    return LOST_REFUSED if cause == REFUSED else cause


_PG_LOST = ("server closed the connection", "terminating connection", "connection is closed", "consuming input failed",
            "connection is lost", "ssl connection has been closed", "could not receive data", "could not send data",
            "connection reset", "the database system is shutting down", "the database system is starting up",
            "the database system is in recovery mode", "broken pipe")


def _pg_cause(orig: BaseException) -> str:
    """How a PostgreSQL driver error reads after the database's name."""
    first = envfail.first_line(orig)
    low = str(orig).lower()
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate == "57014" or "statement timeout" in low:
        return f"did not finish a statement within its statement_timeout ({first})"
    if "connection refused" in low:
        return REFUSED
    if "timeout expired" in low or "timed out" in low:
        return f"does not answer ({first})"
    if sqlstate in ("57P01", "57P02", "57P03") or any(s in low for s in _PG_LOST):
        return f"lost its connection ({first})"
    return f"failed ({first})"


def _pg_failure(url: Optional[str], orig: BaseException) -> envfail.EnvironmentFailure:
    label, action = _role(url) if url else ("a PostgreSQL database", "")
    return envfail.EnvironmentFailure(f"{label} {mask(url)}" if url else label, redact(_pg_cause(orig), url),
                                      f"{action or 'check that the PostgreSQL server runs and answers'}, {AGAIN}",
                                      store=mask(url) if url else None)


@envfail.register
def _classify_database(err: BaseException) -> Optional[envfail.EnvironmentFailure]:
    """SQLAlchemy's errors of a SQLite or PostgreSQL database the environment broke (see the module docstring)."""
    orig = _dbapi_error(err)
    if orig is None:
        return None
    module = type(orig).__module__
    url = _engine_url(err)
    if module.startswith("sqlite3"):
        return _sqlite_failure(url, orig) if "OperationalError" in _mro_names(orig) else None
    if module.startswith(("psycopg", "psycopg2")):
        if getattr(err, "connection_invalidated", False) or _mro_names(orig) & {"OperationalError", "InterfaceError"}:
            return _pg_failure(url, orig)
    return None


# --------------------------------------------------------------------------- MLflow's HTTP client


def _http_reason(err: BaseException) -> str:
    """Why an HTTP request failed, from the innermost useful error of ``err`` (urllib3's MaxRetryError reason)."""
    for e in envfail.chain(err):
        reason = getattr(e, "reason", None)
        if reason is not None and isinstance(reason, BaseException):
            err = reason
    text = str(err)
    if "Connection refused" in text:
        return "connection refused"
    if "too many" in text and "error responses" in text:
        found = re.search(r"too many (\d+) error responses", text)
        return f"it answered {found.group(1) if found else 'server'} errors"
    if "timed out" in text.lower() or "Timeout" in type(err).__name__:
        return "no answer within MLFLOW_HTTP_REQUEST_TIMEOUT"
    if "RemoteDisconnected" in text or "Connection aborted" in text or "reset" in text.lower():
        return "the connection was closed"
    return envfail.first_line(err)[:200]


@envfail.register
def _classify_http(err: BaseException) -> Optional[envfail.EnvironmentFailure]:
    """``requests``' connection errors, timeouts and retries exhausted on server errors, raised under MLflow's HTTP
    client after its own retries (:func:`fl_core.store.storewait.http_defaults`)."""
    module, name = _type(err)
    if not module.startswith("requests") or name not in ("ConnectionError", "ConnectTimeout", "ReadTimeout",
                                                         "Timeout", "RetryError"):
        return None
    request_url = getattr(getattr(err, "request", None), "url", None) or ""
    parts = urlsplit(request_url)
    server = f"{parts.scheme}://{parts.netloc}" if parts.netloc else "the tracking server"
    retries, pauses, timeout = storewait.http_retry_window_s()
    reason = redact(_http_reason(err), request_url, server)
    label, action = _role(server)
    label = "tracking server" if label == "database" else label
    tries = f"{retries} time{'' if retries == 1 else 's'} over about {pauses:.0f} s"
    settings = ("FL_HTTP_RETRY_S / MLFLOW_HTTP_REQUEST_MAX_RETRIES" if storewait.http_deadline_installed()
                else "MLFLOW_HTTP_REQUEST_MAX_RETRIES / MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")  # what sets the window
    if reason.startswith("it answered"):
        cause = f"fails ({reason}; MLflow retried {tries}): its log says why (its backend store?)"
    else:
        cause = f"does not answer ({reason}; MLflow retried {tries}, {settings})"
    return envfail.EnvironmentFailure(f"{label} {mask(server)}", cause,
                                      f"{action or 'start it or set MLFLOW_TRACKING_URI to one that answers'}, {AGAIN}",
                                      store=mask(server))


# --------------------------------------------------------------------------- a SQLite URI whose folder is missing


def sqlite_path(uri: str) -> Optional[str]:
    """The file of a ``sqlite:///`` URI (relative to the working folder when relative), None for other URIs and an
    in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else os.path.abspath(path)


def missing_folder(uri: str, label: str, action: str) -> Optional[envfail.EnvironmentFailure]:
    """The failure of a ``sqlite:///`` ``uri`` whose folder does not exist (SQLite, MLflow and SQLAlchemy would
    create the folder or fail later), else None. ``action``: what to do instead (without "then run ...")."""
    path = sqlite_path(uri)
    if path is None or os.path.isdir(os.path.dirname(path)):
        return None
    folder = os.path.dirname(path)
    return envfail.EnvironmentFailure(f"{label} {mask(uri)}", f"is in a folder that does not exist ({folder})",
                                      f"create the folder or {action}, {AGAIN}", store=mask(uri))
