"""How a storage or tracking URI is shown and identified, with its secrets kept in memory.

:func:`mask` is how every storage or tracking URI is shown (messages, MLflow tags, summaries: password and
``?password=`` / ``?token=`` values as ``***``; SQLAlchemy is imported only when it is called), :func:`redact` cleans
a driver's or a library's message that may quote the URL or its password, :func:`identity` names a store across
spellings of its URL, and :func:`name_store` gives a store its role in messages (``tracking store``, ``Optuna
storage``). :mod:`fl_core.store.storefail` (the failures) and :mod:`fl_core.store.storewait` (the deadlines) build on this
module, which imports neither.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

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
