"""The tracking store and the databases failing: one line naming the store (password masked), the cause and what to do.

Importing this module registers its classifiers with :func:`fl_core.envfail.register` (:mod:`fl_core.tracking` and
:mod:`sweeps.runner` import it), so an error of these kinds ends a command with ``error: <line>`` and exit status 3:

- **SQLite** (through SQLAlchemy: MLflow's store, an Optuna ``sqlite:///`` storage): locked by another process for
  the busy timeout (:func:`fl_core.storewait.sqlite_busy_timeout_s`), cannot be opened, full, read-only, an I/O
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

Secrets never leave memory: :func:`mask` is how every storage or tracking URI is shown (messages, MLflow tags,
summaries: password and ``?password=`` / ``?token=`` values as ``***``; SQLAlchemy is imported only when it is
called), and :func:`redact` cleans a driver's or a library's message that may quote the URL or its password.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from . import envfail, storewait

AGAIN = envfail.AGAIN
_ROLES: Dict[str, Tuple[str, str]] = {}  # identity of a store -> (label, action for a locked / unreachable one)


# --------------------------------------------------------------------------- secrets: how a URI is shown

#: query keys whose values are secrets (case-insensitive, anywhere in the key: ``password``, ``sslpassword``,
#: ``access_token``, ``client_secret``, ``pwd``, ...)
SECRET_KEY = re.compile(r"password|passwd|pwd|secret|token", re.IGNORECASE)
HIDDEN = "***"
_QUERY = re.compile(r"[^=&@/?#]+=[^&]*(?:&[^=&]+=[^&]*)*")  # KEY=VALUE pairs: what makes a "?" a query's start


def _userinfo(rest: str) -> Optional[Tuple[str, Optional[str], str]]:
    """(user, password or None, what follows the userinfo's ``@``) of ``rest`` (a URI after ``scheme://``), or None
    when it has no userinfo. Conservative where SQLAlchemy and urllib split oddly: a password may hold a raw ``@``,
    ``/``, ``:``, ``?`` or ``#``, so the userinfo runs to the LAST ``@`` before the query (the first ``?`` after the
    first ``@`` that KEY=VALUE pairs follow) and the password is everything after the user name's ``:``. The user
    name holds no ``/`` or ``?`` (``sqlite:///a@b.db`` has no userinfo)."""
    first = rest.find("@")
    if first < 0:
        return None
    end, q = len(rest), first
    while True:
        q = rest.find("?", q + 1)
        if q < 0:
            break
        if _QUERY.fullmatch(rest[q + 1:].split("#", 1)[0]):
            end = q
            break
    at = rest.rfind("@", 0, end)
    user, colon, password = rest[:at].partition(":")
    if "/" in user or "?" in user:
        return None
    return user, (password if colon else None), rest[at + 1:]


def _split(url: str) -> Tuple[str, Optional[Tuple[str, Optional[str], str]]]:
    scheme, _, rest = url.partition("://")
    return scheme, _userinfo(rest)


def _render_rdb(url: str) -> str:
    """A database URL shown through SQLAlchemy's URL: password ``***``, secret query values ``***``; unchanged when
    it holds neither; ``scheme://***`` when SQLAlchemy cannot parse it."""
    from urllib.parse import quote_plus, urlsplit

    from sqlalchemy.engine import make_url

    scheme, info = _split(url)
    clean = url if info is None or info[1] is None else f"{scheme}://{info[0]}:x@{info[2]}"
    try:
        urlsplit(clean)  # an unclosed [IPv6] host, which SQLAlchemy takes as a host name
        parsed = make_url(clean)
    except Exception:  # noqa: BLE001  (ArgumentError, a port that is not a number, ...)
        return f"{scheme}://{HIDDEN}"
    secret_keys = [k for k in parsed.query if SECRET_KEY.search(k)]
    if parsed.password is None and not secret_keys:
        return url  # nothing to hide: as the user wrote it
    shown = parsed.set(query={}).render_as_string(hide_password=True)
    if parsed.query:
        values = [(k, v) for k in sorted(parsed.query)
                  for v in (parsed.query[k] if isinstance(parsed.query[k], tuple) else (parsed.query[k],))]
        shown += "?" + "&".join(f"{quote_plus(k)}={HIDDEN if SECRET_KEY.search(k) else quote_plus(v)}"
                                for k, v in values)
    return shown


def _render_http(url: str) -> str:
    """An http(s) URL (an MLflow tracking server) with the userinfo's password and secret query values ``***``."""
    from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

    scheme, info = _split(url)
    clean = url if info is None or info[1] is None else f"{scheme}://{info[0]}:{HIDDEN}@{info[2]}"
    try:
        parts = urlsplit(clean)
    except ValueError:  # an unclosed [IPv6] host
        return f"{scheme}://{HIDDEN}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(SECRET_KEY.search(k) for k, _ in pairs):
        return clean
    query = "&".join(f"{quote(k, safe='')}={HIDDEN if SECRET_KEY.search(k) else quote(v, safe='/:@')}"
                     for k, v in pairs)
    return urlunsplit(parts._replace(query=query))


def mask(url: str) -> str:
    """How a storage or tracking URI is shown (messages, logs, MLflow tags, summaries): its password and the values
    of secret query keys (:data:`SECRET_KEY`: ``?password=``, ``?token=``, ...) replaced by ``***``.

    - a database URL (``postgresql+psycopg://u:pw@host/db``, ``sqlite:///...``): parsed with SQLAlchemy's URL (imported
      here, not at module load), e.g. ``postgresql+psycopg://u:***@host/db``; a URL without secrets is returned as
      written; one SQLAlchemy cannot parse shows only its scheme, ``postgresql://***``;
    - an http(s) URL (an MLflow tracking server): ``http://user:***@host:5000/?token=***`` (urllib);
    - a file or journal path (no ``scheme://``): unchanged.

    A password holding a raw ``/``, ``@`` or ``:`` (which SQLAlchemy splits oddly) is hidden whole: the userinfo
    runs to the last ``@`` before the host (:func:`_userinfo`); a ``%2F``-encoded one too.
    """
    url = str(url)
    if "://" not in url:
        return url
    if url.split("://", 1)[0].lower() in ("http", "https"):
        return _render_http(url)
    return _render_rdb(url)


def secrets(url: str) -> List[str]:
    """The secret texts of ``url`` as they may appear in an error message: its password (as written, percent-decoded
    and as SQLAlchemy parses it), the pieces of a password split at a raw ``@ / : ? #`` (SQLAlchemy may take one for
    a host or a port), and the values of secret query keys; longest first."""
    from urllib.parse import parse_qsl, quote, unquote, urlsplit

    url = str(url)
    if "://" not in url:
        return []
    found = set()
    _, info = _split(url)
    if info is not None and info[1]:
        password = info[1]
        found |= {password, unquote(password), quote(unquote(password), safe=" +")}
        found |= {piece for piece in re.split(r"[@/:?#]", password) if piece}
        found |= {unquote(piece) for piece in re.split(r"%2[Ff]|%40|%3[Aa]", password) if piece}
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        if parsed.password:
            found.add(str(parsed.password))
        for k, v in parsed.query.items():
            if SECRET_KEY.search(k):
                found |= set(v) if isinstance(v, tuple) else {v}
    except Exception:  # noqa: BLE001  (not a URL SQLAlchemy parses: urllib's view below)
        pass
    try:
        query = urlsplit(url).query
    except ValueError:
        query = ""
    for piece in re.split(r"[?&#]", url.split("://", 1)[1]):  # raw KEY=VALUE pieces, wherever they are
        key, eq, value = piece.partition("=")
        if eq and SECRET_KEY.search(key) and value:
            found |= {value, unquote(value)}
    found |= {v for k, v in parse_qsl(query, keep_blank_values=True) if SECRET_KEY.search(k)}
    return sorted((s for s in found if s and s != HIDDEN), key=len, reverse=True)


def redact(text: str, *urls: Optional[str]) -> str:
    """``text`` (an error message, a warning) with each of ``urls`` shown by :func:`mask` and every secret of them
    (:func:`secrets`) replaced by ``***``, so that a driver's or a library's message that quotes a URL, a host
    SQLAlchemy took from a password, or a password itself leaks nothing. Secrets shorter than 4 characters are only
    replaced where they stand alone (not inside a longer word)."""
    text = str(text)
    given = [str(u) for u in urls if u]
    for url in sorted(given, key=len, reverse=True):
        text = text.replace(url, mask(url))
    for secret in sorted({s for url in given for s in secrets(url)}, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, HIDDEN)
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", HIDDEN, text)
    return text


def identity(url: str) -> str:
    """What identifies a store across spellings of its URL: scheme family, host, port and database (or path); the
    driver (``+psycopg``), user, password and query are left out."""
    if url.startswith("sqlite:"):
        path = url.split("sqlite:///", 1)[1].split("?", 1)[0] if "sqlite:///" in url else ""
        return "sqlite:" + (os.path.abspath(path) if path and path != ":memory:" else path)
    scheme, info = _split(url)  # the userinfo left out first: a raw "/" or "@" in a password misleads urlsplit
    try:
        parts = urlsplit(url if info is None else f"{scheme}://{info[2]}")
    except ValueError:  # an unclosed [IPv6] host
        return f"{scheme}://?"
    family = parts.scheme.split("+", 1)[0]
    family = "postgresql" if family == "postgres" else family
    default = {"postgresql": 5432, "mysql": 3306, "http": 80, "https": 443}.get(family)
    try:
        port = parts.port or default
    except ValueError:
        port = default
    return f"{family}://{parts.hostname or ''}:{port}{parts.path if family not in ('http', 'https') else ''}"


def name_store(url: str, label: str, action: str = "") -> None:
    """Give the store at ``url`` its role in messages: ``label`` (``tracking store``, ``Optuna storage``) and, where
    useful, what to do when it is locked or does not answer (``action``, without the final "then run ..."). """
    _ROLES[identity(url)] = (label, action)


def _role(url: str) -> Tuple[str, str]:
    return _ROLES.get(identity(url), ("database", ""))


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
        return "refused the connection (connection refused: is the server running?)"
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


def stalled(url: str, waited_s: float, why: str) -> envfail.EnvironmentFailure:
    """The failure of a PostgreSQL server that stopped answering: a statement (or a commit) waited ``waited_s``
    seconds and a new connection got no answer (``why``); :func:`fl_core.storewait.install`'s watcher ends the process
    with it."""
    label, action = _role(url)
    return envfail.EnvironmentFailure(
        f"{label} {mask(url)}",
        f"does not answer (no answer for {waited_s:.0f} s, {storewait.STALL_ENV}; a new connection: "
        f"{redact(why, url)})",
        f"{action or 'check the PostgreSQL server (a frozen or overloaded process, the network)'}, {AGAIN}",
        store=mask(url))


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
    client after its own retries (:func:`fl_core.storewait.http_defaults`)."""
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
