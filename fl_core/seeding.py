"""Counter-based seeding: every random draw of a run is a pure function of its keys.

A run's randomness (client sampling, batch order, model init) is derived from
``(seed, purpose, round, client)`` instead of one evolving generator, so a run
resumed from a checkpoint, or trained by another executor, draws exactly the
same numbers as an uninterrupted sequential run.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def _key(k) -> int:
    if isinstance(k, str):
        return zlib.crc32(k.encode())
    return int(k)


def derive_seed(*keys) -> int:
    """A 63-bit seed from integer or string keys (order matters)."""
    ss = np.random.SeedSequence([_key(k) for k in keys])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(*keys) -> np.random.Generator:
    """A NumPy generator seeded from ``keys``."""
    return np.random.default_rng(np.random.SeedSequence([_key(k) for k in keys]))


def torch_generator(*keys, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded from ``keys``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*keys))
    return g
