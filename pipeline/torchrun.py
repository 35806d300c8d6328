"""``python -m pipeline.torchrun [TORCHRUN OPTIONS] -m pipeline.train ...``: torchrun, with one line when a rank fails.

The same launcher as ``torchrun`` (``torch.distributed.run``: the same options, ranks and environment), for
``engine.executor=distributed`` (docs/scaling.md). When a rank fails, torchrun stops the others and reports with a
traceback of its own and a ``ChildFailedError`` table (some 35 lines, besides its warning lines); here the ranks'
own lines stay (rank 0's ``error:`` line names a lost or frozen rank, docs/reliability.md) and the launcher adds one
line, ``torchrun: rank R ended first (exit status S | signal NAME); ...``. Exit status: rank 0's when it failed with
one (3 for a lost rank: fl_core.store.envfail), else 1. ``FL_DEBUG=1`` or ``--debug`` among the arguments (passed on to
the ranks, which then show their tracebacks too) keeps torchrun's own report and log lines.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional

from fl_core.store import envfail


def _quiet_launcher() -> None:
    """torchrun's agent logs each step of a shutdown (``Sending process ... closing signal SIGTERM``, ``failed
    (exitcode: 3)``); the one line of :func:`main` says what they say."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def main(argv: Optional[List[str]] = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); returns the exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = envfail.debug_requested(argv)[0]  # --debug stays in argv: the ranks read it too
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if debug:
        os.environ[envfail.DEBUG_ENV] = "1"
        torchrun(argv)
        return 0
    _quiet_launcher()
    try:
        torchrun(argv)
    except ChildFailedError as err:
        first, failure = err.get_first_failure()
        rank0 = err.failures.get(0)
        status = rank0.exitcode if rank0 is not None and rank0.exitcode > 0 else 1
        ended = ", ".join(f"rank {r}: {_describe(f.exitcode)}" for r, f in sorted(err.failures.items()))
        print(f"torchrun: rank {first} ended first ({_describe(failure.exitcode)}), then the start was stopped "
              f"({ended}); FL_DEBUG=1 shows torchrun's report", file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
