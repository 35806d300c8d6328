"""Shared helpers of the pipeline stages: data access and devices (re-exported from ``fl_core``), atomic file
writes, CLI errors.

The data and device helpers load torch, so they are imported on first use (:func:`__getattr__`): a command that
only needs :func:`fail` (``fl-train --help``) stays light.
"""

from __future__ import annotations

import sys

from .files import atomic_write, write_json, write_text  # noqa: F401  (re-exported)


def __getattr__(name: str):
    """``dataset_for``, ``partition_for`` (:mod:`fl_core.data.access`) and ``resolve_device``
    (:mod:`fl_core.engine.factory`), imported when first asked for.

    Raises:
        AttributeError: any other name.
    """
    if name in ("dataset_for", "partition_for"):
        from fl_core.data import access

        return getattr(access, name)
    if name == "resolve_device":
        from fl_core.engine.factory import resolve_device

        return resolve_device
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fail(message: str, code: int = 2) -> "None":
    """Print a one-line error to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
