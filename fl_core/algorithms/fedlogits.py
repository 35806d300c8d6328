"""Logit adjustments during local training: FedRS and FedLC (docs/algorithms.md, FedRS and FedLC).

- FedRS (Li & Zhan 2021): logits of classes missing from the client's data are scaled by alpha
  (z_c <- z_c * alpha for c not in A_i); alpha = 1 is FedAvg.
- FedLC (Zhang et al. 2022): z'_c = z_c - tau * n_{i,c}^(-1/4); tau = 0 is FedAvg. A class absent
  locally has n = 0: ``missing=exclude`` removes it from the softmax (z' = -1e9, the reference port's
  -inf made finite so padded samples stay finite), ``missing=clamp`` counts it as 1.
Both act on the training loss only, never at test time; server as FedAvg; d up, d down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..lazy import lazy_import
from ..schema import checked, param
from .base import Objective
from .fedavg import FedAvg
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class FedRSParams:
    alpha: float = param(0.5, "logit scale of the classes missing from the client (FedNLR; FedDecorr default)",
                         ge=0, le=1)


@dataclass
class FedLCParams:
    tau: float = param(1.0, "calibration strength (FedNLR 1; FedDecorr default 0.1)", ge=0)
    missing: str = param("exclude", "classes absent locally: exclude (logit -inf, reference) | clamp (count 1)",
                         choices=("exclude", "clamp"))

EXCLUDED_LOGIT = 1e9


class FedRS(FedAvg):
    name = "fedrs"

    def __init__(self, alpha: float = 0.5, aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        self.alpha = float(checked(FedRSParams, "algorithm.fedrs", alpha=alpha).alpha)

    def shown(self):
        return (("alpha", f"{self.alpha:g}"),)

    def local_objective(self, ctx, params, logits, features, y):
        present = ctx.label_counts > 0  # [C] (from the whole local set, not the batch)
        scale = torch.where(present, torch.ones_like(logits[0]), torch.full_like(logits[0], self.alpha))
        return Objective(logits * scale)


class FedLC(FedAvg):
    name = "fedlc"

    def __init__(self, tau: float = 1.0, missing: str = "exclude", aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        checked(FedLCParams, "algorithm.fedlc", tau=tau, missing=missing)
        self.tau = float(tau)
        self.missing = missing

    def shown(self):
        return (("tau", f"{self.tau:g}"),)

    def calibration(self, label_counts: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The subtracted term tau * n_c^(-1/4) per class [C] (EXCLUDED_LOGIT for excluded classes), in ``dtype``
        (None: float32)."""
        n = label_counts.to(torch.float32 if dtype is None else dtype)
        if self.missing == "clamp":
            return self.tau * n.clamp_min(1.0) ** -0.25
        safe = self.tau * n.clamp_min(1.0) ** -0.25
        return torch.where(n > 0, safe, torch.full_like(safe, EXCLUDED_LOGIT))

    def local_objective(self, ctx, params, logits, features, y):
        if self.tau == 0.0:
            return Objective(logits)
        return Objective(logits - self.calibration(ctx.label_counts, logits.dtype))


register(Rule(
    name="fedrs", kind="base", label="FedRS", citation="Li & Zhan, KDD 2021, Eq. (5)",
    summary="restricted softmax: logits of classes the client lacks are scaled by alpha during training",
    params=FedRSParams, neutral=("algorithm.fedrs.alpha=1",),
    build=lambda p, ctx: FedRS(p.alpha, ctx.aggregation, ctx.eta_g)))

register(Rule(
    name="fedlc", kind="base", label="FedLC", citation="Zhang et al., ICML 2022, Eq. (9)",
    summary="logit calibration: z_c - tau * n_c^(-1/4) with the client's class counts, during training",
    params=FedLCParams, neutral=("algorithm.fedlc.tau=0",),
    build=lambda p, ctx: FedLC(p.tau, p.missing, ctx.aggregation, ctx.eta_g)))
