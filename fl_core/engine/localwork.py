"""System heterogeneity: how many local epochs each client of a round runs, and who straggles.

docs/algorithms.md, Local work. Three ``train`` keys set it; with their defaults every client runs E epochs
(``train.local_epochs``) and this module is not used:

- ``train.local_epochs_max`` = b: each client i of round r draws E_i uniformly from the integers E..b (inclusive),
  as the experiments of Wang et al. (NeurIPS 2020) with heterogeneous local work draw a client's epochs each round;
- ``train.stragglers`` = s in [0, 1): each round, :func:`num_stragglers` of the round's sampled clients S, chosen
  uniformly at random, are stragglers; a straggler runs E'_i epochs drawn uniformly from 1..E_i - 1 (Li et al.,
  MLSys 2020, Sec. 5.2, "systems heterogeneity"; their code draws the stragglers with ``np.random.choice`` over the
  selected clients and a straggler's epochs with ``np.random.randint(1, E)``);
- ``train.drop_stragglers``: the stragglers are left out of the round entirely, as if they had not been sampled:
  they do not train, send nothing, and the rule's per-client state (control variates, gradient memories) and the
  aggregate do not see them (the baseline of Li et al., Sec. 5.2, that "simply drops" them); otherwise they train
  their E'_i epochs and are aggregated like everyone else.

Every draw is a pure function of ``(seed, round, client)`` (:mod:`fl_core.seeding`), never of a running
generator: both executors and a run resumed from a checkpoint draw the same epochs and the same stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from ..seeding import derive_seeds, numpy_rng


@dataclass(frozen=True)
class LocalWork:
    """The local-work keys of ``train``.

    Attributes:
        epochs: E (``train.local_epochs``), >= 1; the smallest draw when ``epochs_max`` is set.
        epochs_max: b (``train.local_epochs_max``) >= E, or None: every client runs E (before stragglers).
        stragglers: s (``train.stragglers``) in [0, 1); > 0 needs E >= 2.
        drop_stragglers: ``train.drop_stragglers``.

    Raises:
        ValueError: a value out of range (one line naming the key).
    """

    epochs: int
    epochs_max: Optional[int] = None
    stragglers: float = 0.0
    drop_stragglers: bool = False

    def __post_init__(self):
        if self.epochs < 1:
            raise ValueError(f"train.local_epochs must be >= 1, got {self.epochs}")
        if self.epochs_max is not None and self.epochs_max < self.epochs:
            raise ValueError(f"train.local_epochs_max must be >= train.local_epochs ({self.epochs}), "
                             f"got {self.epochs_max}")
        if not 0.0 <= self.stragglers < 1.0:
            raise ValueError(f"train.stragglers must be in [0, 1), got {self.stragglers}")
        if self.stragglers > 0 and self.epochs < 2:
            raise ValueError(f"train.stragglers needs train.local_epochs >= 2, got {self.epochs}")

    @property
    def varies(self) -> bool:
        """Whether any client may run other than E epochs (else the plan is the plain round)."""
        return self.epochs_max is not None or self.stragglers > 0


@dataclass(frozen=True)
class RoundWork:
    """One round's local work.

    Attributes:
        train: the clients that train and are aggregated, sorted (S, less the stragglers when they are dropped).
        epochs: client -> its epochs this round, for every client of ``train`` (E_i, or E'_i for a straggler).
        stragglers: the round's stragglers, sorted (dropped or not).
    """

    train: Tuple[int, ...]
    epochs: Dict[int, int] = field(default_factory=dict)
    stragglers: Tuple[int, ...] = ()


def num_stragglers(num_sampled: int, fraction: float) -> int:
    """How many of the |S| = ``num_sampled`` clients straggle: |S| - round((1 - s) |S|) (Python's round, half to
    even, as Li et al.'s code keeps round(K (1 - s)) clients active), at most |S| - 1: at least one client of
    every round runs its full epochs (a round with nobody to aggregate would have no update)."""
    if num_sampled <= 1 or fraction <= 0:
        return 0
    return min(num_sampled - 1, num_sampled - round((1.0 - fraction) * num_sampled))


def _uniform(keys: tuple, clients: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> Dict[int, int]:
    """client -> an integer uniform on lo..hi (inclusive, per client), keyed by ``keys`` + the client id (the
    bias of the modulo on a 63-bit seed is below 1e-15)."""
    seeds = derive_seeds(keys, list(clients)).tolist()
    return {int(c): int(a) + s % (int(b) - int(a) + 1) for c, s, a, b in zip(clients, seeds, lo, hi)}


def plan_round(work: LocalWork, seed: int, round_idx: int, sampled: Sequence[int]) -> RoundWork:
    """The local work of round ``round_idx`` (1-indexed) for the sampled clients ``sampled`` (ids).

    E_i ~ U{E..b} keyed by (seed, round, client); the stragglers a uniform subset of size :func:`num_stragglers`
    of sorted S, keyed by (seed, round); a straggler's E'_i ~ U{1..E_i - 1} keyed by (seed, round, client).
    """
    clients = sorted(int(c) for c in sampled)
    if work.epochs_max is None:
        epochs = {c: work.epochs for c in clients}
    else:
        epochs = _uniform(("local_epochs", seed, round_idx), clients, [work.epochs] * len(clients),
                          [work.epochs_max] * len(clients))
    n = num_stragglers(len(clients), work.stragglers)
    if n == 0:
        return RoundWork(tuple(clients), epochs)
    pick = numpy_rng("stragglers", seed, round_idx).permutation(len(clients))[:n]
    late = tuple(sorted(clients[int(j)] for j in pick))
    if work.drop_stragglers:
        dropped = set(late)
        kept = tuple(c for c in clients if c not in dropped)
        return RoundWork(kept, {c: epochs[c] for c in kept}, late)
    epochs.update(_uniform(("straggler_epochs", seed, round_idx), late, [1] * n, [epochs[c] - 1 for c in late]))
    return RoundWork(tuple(clients), epochs, late)
