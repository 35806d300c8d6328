"""Fault injection: kill this process with SIGKILL at a named point (tests and ``benchmarks/faults.py``).

The switch is the environment variable ``FL_FAULT``, read here and nowhere else::

    FL_FAULT=checkpoint_write python -m pipeline.train ...        # killed inside the first checkpoint write
    FL_FAULT=checkpoint_write@3 python -m pipeline.train ...      # ... inside the third one
    FL_FAULT=after_record:INT python -m pipeline.train ...        # Ctrl-C there instead of a kill

``POINT[@N][:SIGNAL]`` fires the N-th time this process reaches ``POINT`` (default: the first
time) by sending SIGNAL (``KILL``, the default, ``INT`` or ``TERM``) to the own process. SIGKILL
cannot be caught, so the process ends exactly as under ``kill -9`` or a lost machine: no
``finally`` block, no MLflow call and no file write runs after the point. Unset (the normal case)
the points cost one dictionary lookup.

Points (where they sit is part of the reliability contract, see ``docs/reliability.md``):
"""

from __future__ import annotations

import os
import signal
from typing import Dict

ENV = "FL_FAULT"

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

__doc__ += "\n".join(f"\n- ``{k}``: {v}." for k, v in {**POINTS, **WORKER_POINTS}.items())

_hits: Dict[str, int] = {}


def point(name: str) -> None:
    """Mark the named point; SIGKILL the own process if ``FL_FAULT`` selects this hit of it.

    Raises:
        KeyError: ``name`` is not one of :data:`POINTS` or :data:`WORKER_POINTS`.
    """
    if name not in POINTS and name not in WORKER_POINTS:
        raise KeyError(f"unknown fault point {name!r}")
    spec = os.environ.get(ENV)
    if not spec:
        return
    spec, _, sig = spec.partition(":")
    target, _, nth = spec.partition("@")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIG" + (sig or "KILL")))
