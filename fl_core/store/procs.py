"""Which process runs a piece of work, and whether it still does (for runs left behind by a kill).

Work that can be orphaned (an MLflow run, an Optuna trial) records its machine, process id and the
process's start time; a later process of the same machine decides from them whether the recorded
process is gone. The start time guards against a reused process id.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Dict, List, Optional

HOST = socket.gethostname()


def _proc_stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat after the command name (state first); None where unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> Optional[float]:
    """Start time (epoch seconds) of process ``pid`` from /proc (Linux); None where unknown."""
    try:
        ticks = int(_proc_stat(pid)[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError, StopIteration):
        return None


def alive(pid: int, since: Optional[float] = None) -> bool:
    """Whether process ``pid`` of this machine is running and, if ``since`` (epoch seconds) is given,
    started no later than that (a later start means the id was reused by another process). A zombie
    (ended, not yet reaped, e.g. an orphan under a PID 1 that does not reap) is not running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists (another user's)
        pass
    except OSError:
        return False
    stat = _proc_stat(pid)
    if stat and stat[0] in ("Z", "X"):
        return False
    start = process_start(pid)
    return not (start is not None and since is not None and start > since + 2.0)


def identity() -> Dict[str, str]:
    """This process as tags: ``fl.host``, ``fl.pid``, ``fl.proc_start`` (epoch seconds, '' if unknown)."""
    start = process_start(os.getpid())
    return {"fl.host": HOST, "fl.pid": str(os.getpid()), "fl.proc_start": "" if start is None else f"{start:.2f}"}


def gone(tags: Dict[str, str], started: Optional[float] = None) -> bool:
    """True if the process recorded by :func:`identity` tags ran on this machine and is no longer running
    (or its id now belongs to a process started after ``fl.proc_start``, else after ``started``).

    Work of other machines, or without usable tags, is never judged gone."""
    if tags.get("fl.host") != HOST:
        return False
    try:
        pid = int(tags["fl.pid"])
        since = float(tags["fl.proc_start"]) if tags.get("fl.proc_start") else started
    except (KeyError, TypeError, ValueError):
        return False
    return not alive(pid, since)


def machine() -> str:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``, else the platform's name) and the cores this process
    may use, e.g. ``AMD EPYC 7B13, 2 cores``: what a benchmark table or a measured refresh names."""
    import platform

    cpu = platform.processor() or platform.machine() or "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores"
