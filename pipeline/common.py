"""Shared helpers of the pipeline stages: CLI errors (torch-free, so ``fl-train --help`` stays light; the data and
device helpers are :mod:`fl_core.data.access` and :mod:`fl_core.engine.factory`, the atomic writes
:mod:`pipeline.files`)."""

from __future__ import annotations

import sys


def fail(message: str, code: int = 2) -> "None":
    """Print a one-line error to stderr (on a line of its own: a progress bar still open is closed first) and exit
    with ``code``."""
    from fl_core.progress import end_line

    end_line()
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
