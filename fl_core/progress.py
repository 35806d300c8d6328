"""Progress bars that keep logs readable: drawn on a terminal only, and never glued to an error line.

A bar refreshes its line with carriage returns; in a log file (stderr redirected, a DVC stage, CI, a Slurm job)
that is hundreds of ``\\r`` fragments on one line, so :func:`bar` draws one only when stderr is a terminal. Before a
command prints its last ``error:`` line it calls :func:`end_line`, which closes the bars still open so that the
error starts a line of its own (:func:`fl_core.store.envfail.run_cli`, :func:`pipeline.common.fail`).
"""

from __future__ import annotations

import sys
from typing import Any, Optional


def on_terminal(stream: Any = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stderr``) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(*, total: Optional[int], desc: str, unit: str, initial: int = 0, enabled: bool = True,
        **kwargs: Any) -> Optional[Any]:
    """A tqdm bar on stderr counting ``unit`` up to ``total`` from ``initial``, or None when ``enabled`` is False or
    stderr is not a terminal (callers skip their updates on None). ``kwargs`` go to tqdm (e.g. ``leave``)."""
    if not enabled or not on_terminal():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, mininterval=0.5,
                file=sys.stderr, **kwargs)


def end_line() -> None:
    """Close every progress bar still open (if tqdm is loaded at all), so that the next line written to stderr starts
    at the beginning of a line. Called before a command's final error line; never raises."""
    tqdm_module = sys.modules.get("tqdm.std")
    if tqdm_module is None:
        return
    try:
        for live in list(getattr(tqdm_module.tqdm, "_instances", ())):
            live.close()
    except Exception:  # noqa: BLE001  (a bar that cannot close must not hide the error that follows)
        pass
