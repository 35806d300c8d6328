"""Counter-based seeding: every random draw of a run is a pure function of its keys.

A run's randomness (client sampling, batch order, model init) is derived from
``(seed, purpose, round, client)`` instead of one evolving generator, so a run
resumed from a checkpoint, or trained by another executor, draws exactly the
same numbers as an uninterrupted sequential run.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from .lazy import lazy_import

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


def _key(k) -> int:
    if isinstance(k, str):
        return zlib.crc32(k.encode())
    return int(k)


def derive_seed(*keys) -> int:
    """A 63-bit seed from integer or string keys (order matters)."""
    ss = np.random.SeedSequence([_key(k) for k in keys])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


# numpy.random.SeedSequence's hash constants (numpy/random/bit_generator.pyx, after M. E. O'Neill's seed_seq_fe)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _POOL_SIZE, _M32 = 0xCA01F9DD, 0x4973F715, 4, 0xFFFFFFFF


def derive_seeds(keys: Sequence, last: Sequence[int]) -> np.ndarray:
    """``[derive_seed(*keys, x) for x in last]`` as int64 [len(last)], computed for all ``x`` at once.

    The same numbers as :func:`derive_seed` (tested): NumPy's ``SeedSequence`` entropy mixing and
    ``generate_state`` written on uint32 arrays, one lane per ``x``, so a round's thousand clients cost one
    pass instead of a thousand ``SeedSequence`` objects. A key or ``x`` outside [0, 2**32) (more than one
    uint32 word of entropy) falls back to :func:`derive_seed` per element.

    Raises:
        ValueError: a negative key or ``x`` (as :func:`derive_seed`).
    """
    words = [_key(k) for k in keys]
    xs = np.asarray(last, dtype=np.int64).reshape(-1)
    if any(not 0 <= w <= _M32 for w in words) or (xs.size and not (0 <= xs.min() and xs.max() <= _M32)):
        return np.array([derive_seed(*keys, int(x)) for x in xs], dtype=np.int64)
    n = xs.size
    entropy = [np.full(n, w, dtype=np.uint32) for w in words] + [xs.astype(np.uint32)]
    shift = np.uint32(16)
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _M32
        value = value * np.uint32(hash_const)
        return value ^ (value >> shift)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        return r ^ (r >> shift)

    pool = [hashmix(entropy[i] if i < len(entropy) else np.zeros(n, dtype=np.uint32)) for i in range(_POOL_SIZE)]
    for i_src in range(_POOL_SIZE):
        for i_dst in range(_POOL_SIZE):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(_POOL_SIZE, len(entropy)):
        for i_dst in range(_POOL_SIZE):
            pool[i_dst] = mix(pool[i_dst], hashmix(entropy[i_src]))
    hash_const = _INIT_B
    state = []
    for i in range(2):  # generate_state(1, np.uint64): two uint32 words, little-endian
        value = pool[i % _POOL_SIZE] ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_B) & _M32
        value = value * np.uint32(hash_const)
        state.append(value ^ (value >> shift))
    seed = state[0].astype(np.uint64) | (state[1].astype(np.uint64) << np.uint64(32))
    return (seed >> np.uint64(1)).astype(np.int64)


def numpy_rng(*keys) -> np.random.Generator:
    """A NumPy generator seeded from ``keys``."""
    return np.random.default_rng(np.random.SeedSequence([_key(k) for k in keys]))


def torch_generator(*keys, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded from ``keys``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*keys))
    return g
