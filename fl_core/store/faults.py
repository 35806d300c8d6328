"""Fault injection: kill this process, or fail a write, at a named point (tests, ``benchmarks/faults.py`` and
``benchmarks/env_faults.py``).

The switch is the environment variable ``FL_FAULT``, read here and nowhere else::

    FL_FAULT=checkpoint_write python -m pipeline.train ...        # killed inside the first checkpoint write
    FL_FAULT=checkpoint_write@3 python -m pipeline.train ...      # ... inside the third one
    FL_FAULT=after_record:INT python -m pipeline.train ...        # Ctrl-C there instead of a kill
    FL_FAULT=checkpoint_write@2:ENOSPC python -m pipeline.train ... # the 2nd checkpoint write finds the disk full

``POINT[@N][:ACTION]`` fires the N-th time this process reaches ``POINT`` (default: the first
time). ACTION is a signal the process sends itself (``KILL``, the default, ``INT``, ``TERM``, or ``STOP``: the
process freezes, as a hung rank), an errno name (``ENOSPC``, ``EROFS``, ``EACCES``, ``EIO``, ...): the point
then raises ``OSError(errno, strerror, <the file or folder being written>)`` as the failed write would, or ``ERROR``:
the point raises :class:`InjectedError`, a stand-in for any error of the command's own (a defect, bad input found
late), which no handler of the project expects. SIGKILL
cannot be caught, so the process ends exactly as under ``kill -9`` or a lost machine: no
``finally`` block, no MLflow call and no file write runs after the point. Unset (the normal case)
the points cost one dictionary lookup. With ``FL_FAULT_STAMP=FILE`` the point writes the time it fired
(``time.time()``) to FILE first, so a campaign can measure how long the process takes to end after the fault.

Points (where they sit is part of the reliability contract, see ``docs/reliability.md``):
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Dict, Optional

ENV = "FL_FAULT"
STAMP_ENV = "FL_FAULT_STAMP"

#: Every named point, with where it sits. A point not listed here is a programming error.
POINTS: Dict[str, str] = {
    "store_init": "a new MLflow SQLite store's schema is built in a temporary file, not yet renamed into place",
    "before_first_checkpoint": "a fresh run's rounds are logged, its first checkpoint is not yet written",
    "checkpoint_write": "the new checkpoint's temporary file is written, not yet renamed into place",
    "checkpoint_swap": "the previous checkpoint is renamed aside, the new one not yet renamed into place",
    "after_last_round": "a seed's last round is done, its completion record not yet written",
    "after_record": "a seed's completion record is written, its checkpoint not yet removed",
    "after_child_model": "a seed's MLflow model is logged, its MLflow run not yet FINISHED",
    "after_child_finished": "a seed's MLflow run is FINISHED, the next seed and the outputs not yet started",
    "between_seeds": "one seed of the experiment is complete, the next one not yet started",
    "outputs_swap": "the old results/<name> is renamed aside, the staged outputs not yet renamed into place",
    "after_outputs": "results/<name> holds the new outputs, the MLflow parent run is not yet ended",
    "after_parent_curves": "the MLflow parent run holds its seed-mean curves, its best-child tags not yet set and "
                           "it is not yet ended",
}
#: Points that only a worker rank of ``engine.executor=distributed`` reaches (tests/test_distributed.py kills there);
#: the rank 0 of such a run reaches the points above.
WORKER_POINTS: Dict[str, str] = {
    "worker_task": "a worker rank of engine.executor=distributed received a round's clients, not yet trained them",
}

#: Points that only a sweep with ``--batch`` K > 1 reaches (tests/test_sweeps_batch.py kills there).
SWEEP_POINTS: Dict[str, str] = {
    "between_passes": "a sweep's batch of trials finished a pass of its population, the pruner not yet asked and no "
                      "trial of the pass told",
}

#: Points where a write can fail, for ``FL_FAULT=POINT:ENOSPC`` and the like (``checkpoint_write`` above is one too;
#: benchmarks/env_faults.py and tests/test_env_faults.py). The kill campaign does not visit them: some are reached
#: only by the data stages.
WRITE_POINTS: Dict[str, str] = {
    "path_check": "a folder the command will write to (results_dir, engine.checkpoint_dir, data_dir) is probed with a "
                  "temporary file, before anything is written",
    "outputs_write": "a file of an experiment's outputs (results/.<name>.staging/) or of the report is written to "
                     "its temporary file, not yet renamed into place",
    "prepare_write": "a prepared dataset (data_dir/prepared/) is written to its temporary file",
    "partition_write": "a partition's partition.npz (data_dir/partitions/<key>/) is written to its temporary file",
}

__doc__ += "\n".join(f"\n- ``{k}``: {v}." for k, v in {**POINTS, **WORKER_POINTS, **SWEEP_POINTS,
                                                                  **WRITE_POINTS}.items())

_hits: Dict[str, int] = {}


class InjectedError(RuntimeError):
    """What ``FL_FAULT=POINT:ERROR`` raises at ``POINT``."""


def point(name: str, path: Optional[object] = None) -> None:
    """Mark the named point; act (module docstring) if ``FL_FAULT`` selects this hit of it.

    Args:
        name: a key of :data:`POINTS`, :data:`WORKER_POINTS`, :data:`SWEEP_POINTS` or :data:`WRITE_POINTS`.
        path: the file or folder being written there (the ``filename`` of an injected ``OSError``).

    Raises:
        KeyError: ``name`` is not a known point.
        OSError: ``FL_FAULT`` selects this hit with an errno action (``POINT:ENOSPC``).
        InjectedError: ``FL_FAULT`` selects this hit with ``ERROR``.
    """
    if not any(name in points for points in (POINTS, WORKER_POINTS, SWEEP_POINTS, WRITE_POINTS)):
        raise KeyError(f"unknown fault point {name!r}")
    spec = os.environ.get(ENV)
    if not spec:
        return
    spec, _, sig = spec.partition(":")
    target, _, nth = spec.partition("@")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    if os.environ.get(STAMP_ENV):
        with open(os.environ[STAMP_ENV], "w") as f:
            f.write(repr(time.time()))
    if sig == "ERROR":
        raise InjectedError(f"error injected at fault point {name}")
    if sig.startswith("E") and isinstance(getattr(errno, sig, None), int):
        code = getattr(errno, sig)
        raise OSError(code, os.strerror(code), None if path is None else os.fspath(path))
    os.kill(os.getpid(), getattr(signal, "SIG" + (sig or "KILL")))
