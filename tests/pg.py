"""A throwaway PostgreSQL server for tests: initdb in a temporary folder, ``pg_ctl start`` on 127.0.0.1 and a free
port with trust authentication, databases created over TCP, ``pg_ctl stop -m immediate`` and the folder removed at
the end; :meth:`PostgresServer.halt`, :meth:`~PostgresServer.resume`, :meth:`~PostgresServer.freeze` and
:meth:`~PostgresServer.thaw` stop, restart, freeze and thaw it under a client (tests/test_env_faults.py).

The server binaries are found as the newest ``/usr/lib/postgresql/<version>/bin/pg_ctl`` (Debian's layout), else
``pg_ctl`` on PATH (its own folder must hold ``initdb`` and ``postgres``). PostgreSQL refuses to run as root: as
root every server command runs as the ``postgres`` user (``runuser -u postgres --``) in a folder that user owns;
``runuser`` is looked up on PATH and then in ``/usr/sbin`` and ``/sbin``, which a plain user's PATH often lacks.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

SERVER_USER = "postgres"  # the account the server runs as when the tests run as root
START_TIMEOUT_S = 60  # pg_ctl start -w -t: how long to wait for the server to accept connections
STOP_TIMEOUT_S = 30


class PostgresError(RuntimeError):
    """The server could not be set up or started; the message holds the command's output or the log's tail."""


def find_bin_dir() -> Optional[Path]:
    """The folder of the newest PostgreSQL server binaries (``pg_ctl``, ``initdb``, ``postgres``), or None if
    there is none (``/usr/lib/postgresql/*/bin``, then ``pg_ctl`` on PATH, links resolved)."""
    def version(path: Path) -> tuple:
        return tuple(int(p) for p in re.findall(r"\d+", path.parent.parent.name)) or (0,)

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=version)
    candidates = [p.parent for p in reversed(found)]
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for folder in candidates:
        if all(os.access(folder / exe, os.X_OK) for exe in ("pg_ctl", "initdb", "postgres")):
            return folder
    return None


def find_runuser() -> str:
    """The path of ``runuser``: on PATH, else in ``/usr/sbin`` or ``/sbin`` (a login shell's PATH for root holds
    them, ``env -i PATH=/usr/bin:/bin`` does not).

    Raises:
        PostgresError: there is no ``runuser``, so a root process cannot start the server.
    """
    found = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
    if found is None:
        raise PostgresError("runuser not found on PATH, /usr/sbin or /sbin: as root the server cannot be started")
    return found


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_states(url: str) -> Dict[str, int]:
    """{state: count} of the Optuna trials in the database ``url`` (read with psycopg directly: no Optuna, no
    heartbeat)."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database, connect_timeout=5) as conn:
        return dict(conn.execute("SELECT state, count(*) FROM trials GROUP BY state").fetchall())


class PostgresServer:
    """One PostgreSQL server in a temporary folder, on 127.0.0.1 only, user ``postgres`` without a password.

    Usage: ``server = PostgresServer(bin_dir); server.start(); server.create_database("x"); ...; server.stop()``
    (:meth:`stop` also removes the folder, and is safe after a failed :meth:`start`).
    """

    def __init__(self, bin_dir: Path):
        self.bin_dir = Path(bin_dir)
        self.root: Optional[Path] = None  # the temporary folder: data/, sockets/, server.log
        self.port: Optional[int] = None
        self.started = False

    # ------------------------------------------------------------------ commands

    def _as_server_user(self, args: List[str]) -> List[str]:
        return [find_runuser(), "-u", SERVER_USER, "--", *args] if os.geteuid() == 0 else list(args)

    def _run(self, args: List[str], timeout: float) -> str:
        """Run a server command (as :data:`SERVER_USER` when root) in :attr:`root`; its output.

        Raises:
            PostgresError: a non-zero exit status or a timeout, with the output.
        """
        cmd = self._as_server_user(args)
        try:
            res = subprocess.run(cmd, cwd=self.root, capture_output=True, check=False, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise PostgresError(f"{' '.join(cmd)}: no exit within {timeout:g} s\n"
                                f"{err.stdout or ''}{err.stderr or ''}") from err
        if res.returncode != 0:
            raise PostgresError(f"{' '.join(cmd)}: exit status {res.returncode}\n{res.stdout}{res.stderr}\n"
                                f"{self.log_tail()}")
        return res.stdout

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log file (empty before it exists)."""
        log = self.root / "server.log" if self.root else None
        if log is None or not log.exists():
            return ""
        return "server.log: ..." + log.read_text(errors="replace")[-chars:]

    # ------------------------------------------------------------------ life cycle

    def start(self, attempts: int = 3) -> None:
        """initdb (trust authentication, UTF-8, no fsync) and start the server on a free port of 127.0.0.1,
        its Unix socket in the temporary folder; waits until it accepts connections.

        Raises:
            PostgresError: initdb or the start failed (``attempts`` ports tried: another process may take a free
                port between the choice and the start), with the command's output and the log's tail.
        """
        self.root = Path(tempfile.mkdtemp(prefix="fl-pg-"))
        (self.root / "sockets").mkdir()
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam(SERVER_USER)
            for path in (self.root, self.root / "sockets"):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._run([str(self.bin_dir / "initdb"), "-D", str(self.root / "data"), "--auth=trust", "-U", SERVER_USER,
                   "-E", "UTF8", "--locale=C", "--no-sync"], timeout=120)
        error: Optional[PostgresError] = None
        for _ in range(attempts):
            self.port = free_port()
            try:
                self.resume()
                return
            except PostgresError as err:
                error = err
                if "already in use" not in self.log_tail():
                    break
        assert error is not None
        raise error

    def halt(self) -> None:
        """Stop the server as an administrator would (``pg_ctl stop -m fast``: the sessions are ended, the clients
        get "terminating connection due to administrator command"), keeping its folder for :meth:`resume`."""
        self._run([str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.root / "data"), "-m", "fast", "-w", "-t",
                   str(STOP_TIMEOUT_S)], timeout=STOP_TIMEOUT_S + 10)
        self.started = False

    def resume(self) -> None:
        """``pg_ctl start`` on :attr:`port` and the data folder (:meth:`start`, and again after :meth:`halt`); waits
        until the server accepts connections."""
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root / 'sockets'} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run([str(self.bin_dir / "pg_ctl"), "start", "-D", str(self.root / "data"), "-l",
                   str(self.root / "server.log"), "-w", "-t", str(START_TIMEOUT_S), "-o", options],
                  timeout=START_TIMEOUT_S + 30)
        self.started = True

    def pids(self) -> List[int]:
        """The postmaster's process id and those of its children (backends, background workers), from /proc."""
        postmaster = int((self.root / "data" / "postmaster.pid").read_text().splitlines()[0])
        found = [postmaster]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                        found.append(int(entry.name))
                except (OSError, IndexError, ValueError):
                    continue
        return found

    def freeze(self) -> List[int]:
        """SIGSTOP the postmaster and every child: the server accepts TCP connections (the kernel does) and answers
        nothing; returns the process ids for :meth:`thaw`."""
        import signal

        # The postmaster first, so no new backend is forked while the children are listed; a backend that exits
        # between listing and signalling (a client that just disconnected) is skipped: it serves nothing.
        postmaster = self.pids()[0]
        os.kill(postmaster, signal.SIGSTOP)
        frozen = [postmaster]
        for pid in self.pids()[1:]:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            frozen.append(pid)
        return frozen

    def thaw(self, frozen: List[int]) -> None:
        """SIGCONT the processes :meth:`freeze` stopped."""
        import signal

        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Stop the server at once (``pg_ctl stop -m immediate``; its postmaster killed if that fails) and remove
        the temporary folder. Safe to call more than once and after a failed :meth:`start`."""
        if self.root is None:
            return
        try:
            if (self.root / "data" / "postmaster.pid").exists():
                try:
                    self._run([str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.root / "data"), "-m", "immediate",
                               "-w", "-t", str(STOP_TIMEOUT_S)], timeout=STOP_TIMEOUT_S + 10)
                except PostgresError:
                    self._kill_postmaster()
        finally:
            self.started = False
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _kill_postmaster(self) -> None:
        """SIGKILL the postmaster named in ``postmaster.pid`` and wait (bounded) for it to go."""
        import signal

        try:
            pid = int((self.root / "data" / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return
            time.sleep(0.1)

    # ------------------------------------------------------------------ databases

    def url(self, database: str, driver: str = "psycopg") -> str:
        """The SQLAlchemy URL of ``database`` here: ``postgresql+<driver>://postgres@127.0.0.1:<port>/<database>``."""
        return f"postgresql+{driver}://{SERVER_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` (over TCP, as ``postgres``); returns its :meth:`url`."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=SERVER_USER, dbname="postgres",
                             autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
