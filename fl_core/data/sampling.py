"""Which clients train in a round (docs/algorithms.md, Client sampling).

Two samplers (``train.sampler``):

- ``bernoulli`` (FedBug/FedDyn/FedDC): every client is active independently with
  probability ``p``; an empty draw is repeated with a fresh generator
  ``numpy_rng("sample", seed, round, retry)`` for ``retry = 1, 2, ...`` (the first draw
  is ``retry = 0``). The realised size is random with mean
  :func:`expected_bernoulli_size`.
- ``fixed`` (FedNLR, FedBCGD, FedExP, the S2 study): exactly
  ``m = max(1, round(p * N))`` distinct clients, uniformly without replacement.
  ``round`` is Python's (ties to even: 0.5 * 5 -> 2).

The draw is a pure function of ``(seed, round_idx)`` (see :mod:`fl_core.seeding`), so a
resumed run samples the same clients as an uninterrupted one.
"""

from __future__ import annotations

import numpy as np

from fl_core.schema import ConfigError
from fl_core.seeding import numpy_rng

__all__ = ["sample_clients", "expected_bernoulli_size", "fixed_sample_size"]


def fixed_sample_size(num_clients: int, participation: float) -> int:
    """``m = max(1, round(participation * num_clients))``: clients per round of the fixed sampler."""
    return max(1, int(round(participation * num_clients)))


def sample_clients(num_clients: int, participation: float, sampler: str, seed: int, round_idx: int) -> np.ndarray:
    """The clients active in round ``round_idx``.

    Args:
        num_clients: N >= 1.
        participation: p in (0, 1].
        sampler: ``"bernoulli"`` or ``"fixed"``.
        seed: the run seed.
        round_idx: the round number (any integer; the caller's convention).

    Returns:
        Sorted, distinct int64 client ids in ``[0, N)``; never empty.

    Raises:
        ConfigError: N < 1, p outside (0, 1], or an unknown sampler.
    """
    num_clients = int(num_clients)
    if num_clients < 1:
        raise ConfigError(f"partition.num_clients must be >= 1, got {num_clients}")
    if not 0 < participation <= 1:
        raise ConfigError(f"train.participation must be in (0, 1], got {participation}")
    if sampler == "bernoulli":
        retry = 0
        while True:
            rng = numpy_rng("sample", int(seed), int(round_idx), retry)
            active = np.flatnonzero(rng.random(num_clients) < participation)
            if active.size:
                return active.astype(np.int64)
            retry += 1
    if sampler == "fixed":
        m = fixed_sample_size(num_clients, participation)
        rng = numpy_rng("sample", int(seed), int(round_idx))
        return np.sort(rng.choice(num_clients, size=m, replace=False)).astype(np.int64)
    raise ConfigError(f"train.sampler must be one of bernoulli, fixed, got {sampler!r}")


def expected_bernoulli_size(num_clients: int, p: float) -> float:
    """E[|S_r|] of the Bernoulli sampler given a non-empty draw: ``N p / (1 - (1 - p)^N)``."""
    n = int(num_clients)
    return n * p / (1.0 - (1.0 - p) ** n)
