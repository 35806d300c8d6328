"""Python's cyclic garbage collector around the round loop and the ``auto`` probe's timed calls.

CPython collects its oldest generation when enough objects have survived into it; such a full collection walks every
tracked object of the process (torch, MLflow and their imports: about 0.5 M objects, 0.1-0.3 s on one core). A round
of 1,000 small clients creates thousands of short-lived objects (contexts, updates, tensors), some of which survive a
young collection while their round runs, so every few dozen rounds a full collection lands inside a round: that round
then takes 10-25 times the median (docs/benchmarks.md). :func:`frozen_heap` moves what exists when the loop starts
into the collector's permanent generation (``gc.freeze``; again after the first round, :func:`refreeze`), so the collections during the loop only walk what the run
itself allocated; :func:`paused` keeps the collector out of timed calls (as ``timeit`` does).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # runs inside frozen_heap now (threads of one process may run several)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Exclude the objects alive at entry from garbage collections until the outermost exit.

    Entry collects the young generations (0 and 1: what was allocated recently, cheap) and freezes everything else
    (``gc.freeze``, no walk over the heap); exit unfreezes (``gc.unfreeze``: the objects return to the oldest
    generation and are collected as usual afterwards). Nested or concurrent uses (threads) count: only the first
    entry freezes and only the last exit unfreezes. A cycle among the frozen objects that becomes garbage during the
    block is freed after it.
    """
    global _depth
    with _lock:
        if _depth == 0:
            gc.collect(1)
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()


def refreeze() -> None:
    """Inside :func:`frozen_heap`: freeze what was allocated since (after a run's first round: the modules a logger
    or a kernel imports on first use, which would otherwise make the next full collections long); outside, nothing."""
    with _lock:
        if _depth:
            gc.collect(1)
            gc.freeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (``gc.disable``; restored at exit); at exit a collection of
    the youngest generation frees the cycles the block left (with the collector off they all stay young)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect(0)
