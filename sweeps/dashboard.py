"""Serve optuna-dashboard on a sweep's storage: ``python -m sweeps.dashboard [--study NAME | --storage PATH|URL]``.

``make dashboard`` runs it (``STUDY=``, ``STORAGE=``, ``PORT=``). The storage is the one :mod:`sweeps.tune`
uses: the journal file ``sweeps/studies/<study>.log`` (``--study``; without it, the only journal file there),
or any ``--storage`` value the sweep takes (a journal file, ``postgresql+psycopg://...``, ``sqlite:///...``).
A storage that does not exist yet is never created: one line says to run a sweep first (exit 2). The app is
``optuna_dashboard.wsgi`` served by ``wsgiref`` (threads), on 127.0.0.1 unless ``--host`` says otherwise.
What its screens show: docs/sweeps.md, *Dashboard*. Needs the ``dashboard`` extra
(``pip install -e '.[dashboard]'``).
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import List, Optional, Tuple

if __package__ in (None, ""):  # run as a script (python sweeps/dashboard.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl_core.paths import project_root
from sweeps.storage import StorageError, default_storage, is_url, open_storage, shown_storage, storage_error
from sweeps.spaces import space_names

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


class DashboardError(RuntimeError):
    """The storage cannot be served (missing, empty, unreachable) or the dashboard cannot start; one line."""


def studies_dir() -> Path:
    """The folder of the sweeps' default journal files, ``sweeps/studies/`` (gitignored)."""
    return project_root() / "sweeps" / "studies"


def _run_first(study: Optional[str]) -> str:
    """The tail of a "run a sweep first" line: a command that creates ``study`` (or an example study)."""
    if study is None:
        return f"run a sweep first, e.g. python sweeps/tune.py --space {space_names()[0]} --n-trials 20"
    if study in space_names():
        return f"run a sweep first, e.g. python sweeps/tune.py --space {study} --n-trials 20"
    return f"run a sweep first, e.g. python sweeps/tune.py --space SPACE --study-name {study} --n-trials 20"


def resolve_storage(study: Optional[str] = None, storage: Optional[str] = None) -> str:
    """The storage to serve: ``storage`` as given, else ``sweeps/studies/<study>.log`` (the default of
    ``sweeps/tune.py``), else the only ``*.log`` journal file in :func:`studies_dir`.

    Raises:
        DashboardError: neither is given and the folder holds no journal file ("run a sweep first") or several
            (naming them: choose one with STUDY=NAME).
    """
    if storage:
        return storage
    if study:
        return default_storage(study)
    journals = sorted(studies_dir().glob("*.log")) if studies_dir().is_dir() else []
    if not journals:
        raise DashboardError(f"no sweep storage in {studies_dir()} yet: {_run_first(None)}")
    if len(journals) > 1:
        names = ", ".join(p.stem for p in journals)
        raise DashboardError(f"{len(journals)} studies in {studies_dir()} ({names}): choose one with "
                             f"make dashboard STUDY=NAME (python -m sweeps.dashboard --study NAME)")
    return str(journals[0])


def open_dashboard_storage(spec: str, study: Optional[str] = None) -> Tuple[object, List[str]]:
    """Open storage ``spec`` for reading without creating it: (the Optuna storage, its study names).

    A journal file must exist; a ``sqlite:///`` file must exist; another RDB URL (PostgreSQL, MySQL) is opened
    without creating Optuna's tables (``RDBStorage(..., skip_table_creation=True)``, as optuna-dashboard's own
    command does) and must hold them. ``study`` only words the "run a sweep first" hint.

    Raises:
        DashboardError: the storage does not exist yet or holds no study ("run a sweep first", naming ``spec``
            with its password as ``***``), or it cannot be opened (a missing driver, an unreachable server: the
            one line of :func:`sweeps.storage.storage_error`).
    """
    shown = shown_storage(spec)
    missing = f"no sweep storage at {shown} yet: {_run_first(study)}"
    if not is_url(spec):
        path = Path(spec)
        if not path.is_file():
            raise DashboardError(missing if not path.exists() else f"{shown}: not a journal file")
        try:
            storage = open_storage(spec)
        except StorageError as err:
            raise DashboardError(str(err)) from None
    else:
        storage = _open_rdb(spec, missing)
    try:
        names = [s.study_name for s in storage.get_all_studies()]
    except Exception as err:  # the server went away, a journal file that is not one
        raise DashboardError(str(storage_error(spec, err))) from None
    if not names:
        raise DashboardError(f"no study in {shown} yet: {_run_first(study)}")
    return storage, names


def _open_rdb(spec: str, missing: str):
    """An ``RDBStorage`` on ``spec`` that creates nothing; DashboardError if it does not exist or has no tables.
    The tables are looked for on a connection of its own first: Optuna's storage writes its version row into a
    database without one."""
    import warnings

    import optuna
    import sqlalchemy

    engine = None
    try:
        url = sqlalchemy.engine.make_url(spec)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
                and not Path(url.database).is_file():
            raise DashboardError(missing)  # SQLite would create an empty file
        engine = sqlalchemy.create_engine(spec, poolclass=sqlalchemy.pool.NullPool)
        tables = set(sqlalchemy.inspect(engine).get_table_names())
        if not {"studies", "version_info"} <= tables:
            raise DashboardError(missing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.storages.RDBStorage(spec, skip_compatibility_check=True, skip_table_creation=True)
    except DashboardError:
        raise
    except Exception as err:  # no driver, unreachable server, bad URL (Optuna wraps SQLAlchemy's errors)
        cause = err.__cause__ if isinstance(err, optuna.exceptions.StorageInternalError) and err.__cause__ else err
        raise DashboardError(str(storage_error(spec, cause))) from None
    finally:
        if engine is not None:
            engine.dispose()


def make_app(storage):
    """optuna-dashboard's WSGI app (a Bottle app) on an open Optuna ``storage``.

    Raises:
        DashboardError: optuna-dashboard is not installed (how to install it).
    """
    try:
        from optuna_dashboard import wsgi
    except ImportError:
        raise DashboardError("optuna-dashboard is not installed: pip install -e '.[dashboard]' "
                             "(make dashboard installs the dev extra, which includes it)") from None
    return wsgi(storage)


def make_server(app, host: str, port: int):
    """A threaded ``wsgiref`` server of ``app`` on ``host:port`` (port 0: a free port), not logging requests.

    Raises:
        DashboardError: the port is in use or the address cannot be bound (one line naming it).
    """
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
    from wsgiref.simple_server import make_server as wsgiref_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *args):  # the page polls the API every few seconds: no line per request
            pass

    try:
        return wsgiref_server(host, port, app, server_class=Server, handler_class=QuietHandler)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise DashboardError(f"port {port} on {host} is in use: choose another, e.g. make dashboard "
                                 f"PORT={port + 1} (--port {port + 1})") from None
        raise DashboardError(f"cannot listen on {host}:{port} ({err.strerror or err})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sweeps.dashboard",
        description="Serve optuna-dashboard on a sweep's storage (the storage python sweeps/tune.py uses). "
                    "It opens on the study list; a study's first screen shows its objective (val_acc), the "
                    "parameter importances, the best trial, the study's attributes (objective, search space, "
                    "base, pruning) and the intermediate values of every trial, pruned ones included. "
                    "See docs/sweeps.md (Dashboard).")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--study", default=None, metavar="NAME",
                       help="serve sweeps/studies/NAME.log (tune.py's default storage of study NAME); default: "
                            "the only journal file in sweeps/studies/")
    which.add_argument("--storage", default=None, metavar="PATH|URL",
                       help="a journal file or an RDB URL (postgresql+psycopg://user@host/db, sqlite:///file.db), "
                            "as tune.py --storage; never created")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this "
                                                        "machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Serve the dashboard until Ctrl-C (exit status 0); 2 with one line on stderr when the storage does not
    exist, is empty or cannot be opened, optuna-dashboard is missing or the port is taken."""
    args = build_parser().parse_args(argv)
    try:
        spec = resolve_storage(args.study, args.storage)
        storage, names = open_dashboard_storage(spec, args.study)
        server = make_server(make_app(storage), args.host, args.port)
    except DashboardError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"optuna-dashboard: {len(names)} stud{'y' if len(names) == 1 else 'ies'} ({', '.join(names)}) in "
          f"{shown_storage(spec)} at http://{host}:{server.server_port}/dashboard (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
