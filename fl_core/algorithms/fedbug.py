"""FedBug: bottom-up gradual unfreezing (Kao & Wang; docs/algorithms.md, FedBug).

A wrapper over any base algorithm. The model is split into M ordered units (input side first).
During the first P*K_i of a client's K_i local steps the units are unfrozen one by one; only
units 1..m(k) move at local step k (1-indexed, counted across epochs)::

    paper [FedBug Alg. 1 line 7]:  m(k) = min(M, ceil(k * M / (P * K_i)))
    code  [FedBug StopGradScheduler]: f = floor(P * K_i / M),  m(k) = min(M, floor((k-1)/f) + 1)

A frozen unit gets no update at all: no gradient, no weight decay, no base-algorithm correction,
and it is left out of the gradient-norm clip. P = 0 is exactly the base algorithm.
Communication is the base algorithm's.

Ablations of FedBug's appendix A.2 (``strategy``): ``top_down`` unfreezes from the output side with
the same m(k); ``fixed_last`` keeps the last unit frozen for the whole training (FedBABU-style) and
``fixed_last_two`` the last two units (P plays no role in those two).
Per round it logs ``fedbug_gu_steps_mean`` (mean number of local steps before every unit trains)
and ``fedbug_trainable_share`` (mean over clients and steps of m(k)/M).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional, Sequence

from dataclasses import dataclass

from ..schema import ConfigError, checked, param, when
from .base import Algorithm, ClientContext, InfeasibleSetting, ServerStep, Wrapper
from .registry import Rule, register

STRATEGIES = ("bottom_up", "top_down", "fixed_last", "fixed_last_two")


_UNFREEZES = when("algorithm.fedbug.strategy", "bottom_up", "top_down")  # fixed_last*: no unfreezing schedule


@dataclass
class FedBugParams:
    gu_percentage: float = param(0.2, "P: share of the local steps spent on gradual unfreezing", ge=0, le=1,
                                 when=_UNFREEZES, replica=True)
    schedule: str = param("paper", "paper: m(k) = min(M, ceil(kM / (PK))) | code: period floor(PK / M)",
                          choices=("paper", "code"), when=_UNFREEZES)
    strategy: str = param("bottom_up", "bottom_up (FedBug) | ablations: top_down, fixed_last (FedBABU), "
                          "fixed_last_two", choices=STRATEGIES)


def unfrozen_units(k: int, num_steps: int, num_units: int, gu_percentage: float, schedule: str = "paper") -> int:
    """m(k): how many units (from the input side) are trainable at local step k.

    Args:
        k: local step, 1-indexed, 1 <= k <= num_steps.
        num_steps: K_i, the client's local steps this round.
        num_units: M.
        gu_percentage: P in [0, 1]; 0 means no gradual unfreezing (m = M).
        schedule: ``paper`` or ``code`` (see the module docstring).

    Raises:
        InfeasibleSetting: ``code`` schedule with P*K_i < M (the reference code asserts the period f > 0).
    """
    if gu_percentage <= 0:
        return num_units
    p = Fraction(str(gu_percentage))
    if schedule == "paper":
        return min(num_units, math.ceil(Fraction(k * num_units) / (p * num_steps)))
    period = int(gu_percentage * num_steps // num_units)
    if period <= 0:
        raise InfeasibleSetting(f"algorithm.fedbug.schedule=code needs P*K_i >= M, got P={gu_percentage}, "
                         f"K_i={num_steps}, M={num_units}")
    return min(num_units, (k - 1) // period + 1)


class FedBug(Wrapper):
    name = "fedbug"

    STRATEGIES = STRATEGIES

    def __init__(self, base: Algorithm, gu_percentage: float, unit_of: List[int], num_units: int,
                 schedule: str = "paper", strategy: str = "bottom_up", model_name: Optional[str] = None):
        """Wrap ``base``; the model's layout comes as ``unit_of`` / ``num_units`` (a ParamSpec's fields).

        ``model_name`` (``model.name``, optional) only serves the error messages.

        Raises:
            ConfigError: ``gu_percentage`` outside [0, 1], an unknown ``strategy``, a model with a single
                unit (nothing to unfreeze gradually: FedBug would be the base algorithm, or with
                ``fixed_last`` train nothing), or ``fixed_last_two`` with fewer than 3 units.
        """
        super().__init__(base)
        checked(FedBugParams, "algorithm.fedbug", gu_percentage=gu_percentage, schedule=schedule, strategy=strategy)
        if num_units < 2:
            which = f"model={model_name} has {num_units}" if model_name else f"this model has {num_units}"
            raise ConfigError(f"algorithm.fedbug needs a model with at least 2 units ({which}); with one unit there "
                              f"is nothing to unfreeze gradually: pick a model with several layers (e.g. model=mlp) "
                              f"or drop the fedbug wrapper")
        if strategy == "fixed_last_two" and num_units < 3:
            raise ConfigError(f"algorithm.fedbug.strategy=fixed_last_two needs a model with >= 3 units, "
                              f"got {num_units}")
        self.gu_percentage = float(gu_percentage)
        self.unit_of = list(unit_of)
        self.num_units = int(num_units)
        self.schedule = schedule
        self.strategy = strategy

    def shown(self):
        what = (("P", f"{self.gu_percentage:g}"),) if self.strategy in ("bottom_up", "top_down") else ()
        return what if self.strategy == "bottom_up" else (("", self.strategy),) + what

    def trainable_units(self, k: int, num_steps: int) -> range:
        """Indices of the units that may move at local step k (1-indexed) of K_i = ``num_steps``."""
        M = self.num_units
        if self.strategy == "fixed_last":
            return range(0, M - 1)
        if self.strategy == "fixed_last_two":
            return range(0, M - 2)
        m = unfrozen_units(k, num_steps, M, self.gu_percentage, self.schedule)
        return range(0, m) if self.strategy == "bottom_up" else range(M - m, M)

    def client_begin(self, ctx: ClientContext, probe) -> None:
        """The base's client init, then ``ctx.step_mask``: the units of :meth:`trainable_units` at step k, and the
        base's own mask if it sets one."""
        self.base.client_begin(ctx, probe)
        if self.gu_percentage == 0.0 and self.strategy in ("bottom_up", "top_down"):
            return
        base_mask, num_steps = ctx.step_mask, int(ctx.num_steps)

        def step_mask(k: int) -> List[bool]:
            units = self.trainable_units(k, num_steps)
            mask = [u in units for u in self.unit_of]
            inner = base_mask(k) if base_mask is not None else None
            if inner is not None:
                mask = [a and b for a, b in zip(mask, inner)]
            return mask

        ctx.step_mask = step_mask

    def _profile(self, K: int):
        counts = [len(self.trainable_units(k, K)) for k in range(1, K + 1)]
        full = next((k for k, c in enumerate(counts, 1) if c == self.num_units), K + 1)
        return counts, full - 1

    def aggregate(self, rctx, server_state, updates) -> ServerStep:
        """The base's server step; its metrics with the round's unfreezing profile added."""
        step = self.base.aggregate(rctx, server_state, updates)
        out = step.metrics = dict(step.metrics)
        profiles = [self._profile(u.num_steps) for u in updates if u.num_steps > 0]
        if profiles:
            out["fedbug_gu_steps_mean"] = sum(p[1] for p in profiles) / len(profiles)
            out["fedbug_trainable_share"] = (sum(sum(c) / (len(c) * self.num_units) for c, _ in profiles)
                                             / len(profiles))
        return step

    def schedule_rows(self, num_steps: Sequence[int]):
        """Trainable units at every local step for each step count K_i in ``num_steps``."""
        rows = []
        for K in sorted(set(int(k) for k in num_steps if k > 0)):
            for k in range(1, K + 1):
                units = self.trainable_units(k, K)
                rows.append({"K_i": K, "step": k, "trainable_units": len(units),
                             "units": " ".join(str(u + 1) for u in units)})
        return rows


register(Rule(
    name="fedbug", kind="wrapper", label="FedBug", citation="Kao & Wang, FedBug, Alg. 1 (line 7)",
    summary="bottom-up gradual unfreezing: during the first P * K_i local steps the units start training one by one",
    params=FedBugParams, neutral=("algorithm.fedbug.gu_percentage=0", "algorithm.fedbug.strategy=bottom_up"),
    named=(("p", "gu_percentage"),),
    build=lambda base, p, ctx: FedBug(base, p.gu_percentage, list(ctx.spec.unit_of), ctx.spec.num_units,
                                      p.schedule, p.strategy)))
