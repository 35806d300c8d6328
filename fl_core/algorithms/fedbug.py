"""FedBug: bottom-up gradual unfreezing (Kao & Wang; ALGORITHMS.md section 5).

A wrapper over any base algorithm. The model is split into M ordered units (input side first).
During the first P*K_i of a client's K_i local steps the units are unfrozen one by one; only
units 1..m(k) move at local step k (1-indexed, counted across epochs)::

    paper [FedBug Alg. 1 line 7]:  m(k) = min(M, ceil(k * M / (P * K_i)))
    code  [FedBug StopGradScheduler]: f = floor(P * K_i / M),  m(k) = min(M, floor((k-1)/f) + 1)

A frozen unit gets no update at all: no gradient, no weight decay, no base-algorithm correction,
and it is left out of the gradient-norm clip. P = 0 is exactly the base algorithm.
Communication is the base algorithm's.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional

from .base import Algorithm, ClientContext, Wrapper


def unfrozen_units(k: int, num_steps: int, num_units: int, gu_percentage: float, schedule: str = "paper") -> int:
    """m(k): how many units (from the input side) are trainable at local step k.

    Args:
        k: local step, 1-indexed, 1 <= k <= num_steps.
        num_steps: K_i, the client's local steps this round.
        num_units: M.
        gu_percentage: P in [0, 1]; 0 means no gradual unfreezing (m = M).
        schedule: ``paper`` or ``code`` (see the module docstring).

    Raises:
        ValueError: ``code`` schedule with P*K_i < M (the reference code asserts the period f > 0).
    """
    if gu_percentage <= 0:
        return num_units
    p = Fraction(str(gu_percentage))
    if schedule == "paper":
        return min(num_units, math.ceil(Fraction(k * num_units) / (p * num_steps)))
    period = int(gu_percentage * num_steps // num_units)
    if period <= 0:
        raise ValueError(f"algorithm.fedbug.schedule=code needs P*K_i >= M, got P={gu_percentage}, "
                         f"K_i={num_steps}, M={num_units}")
    return min(num_units, (k - 1) // period + 1)


class FedBug(Wrapper):
    name = "fedbug"

    def __init__(self, base: Algorithm, gu_percentage: float, unit_of: List[int], num_units: int,
                 schedule: str = "paper"):
        super().__init__(base)
        if not 0.0 <= gu_percentage <= 1.0:
            raise ValueError(f"algorithm.fedbug.gu_percentage must be in [0, 1], got {gu_percentage}")
        self.gu_percentage = float(gu_percentage)
        self.unit_of = list(unit_of)
        self.num_units = int(num_units)
        self.schedule = schedule

    def describe(self) -> str:
        return f"fedbug[P={self.gu_percentage}]({self.base.describe()})"

    def update_mask(self, ctx: ClientContext, k: int) -> Optional[List[bool]]:
        base_mask = self.base.update_mask(ctx, k)
        if self.gu_percentage == 0.0:
            return base_mask
        m = unfrozen_units(k, ctx.num_steps, self.num_units, self.gu_percentage, self.schedule)
        mask = [u < m for u in self.unit_of]
        if base_mask is not None:
            mask = [a and b for a, b in zip(mask, base_mask)]
        return mask
