"""Shared helpers of the pipeline stages: data access and devices (re-exported from ``fl_core``), atomic file
writes, CLI errors."""

from __future__ import annotations

import sys

from fl_core.data.access import dataset_for, partition_for  # noqa: F401  (re-exported)
from fl_core.engine.factory import resolve_device  # noqa: F401  (re-exported)

from .files import atomic_write, write_json, write_text  # noqa: F401  (re-exported)


def fail(message: str, code: int = 2) -> "None":
    """Print a one-line error to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
