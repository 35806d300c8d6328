"""FedDecorr (Shi et al. 2023; docs/algorithms.md, FedDecorr): decorrelate the penultimate features.

Local loss = CE + beta * L_dec(z), z [N_b, f] the batch's penultimate features (the model's
``forward_features``)::

    z_hat = (z - mean_batch z) / sqrt(var_batch z + 1e-8)     per dimension, unbiased variance
    G     = z_hat^T z_hat                                      (f x f, not divided by N_b)
    L_dec = mean_{a != b} G_ab^2 / N_b,    0 for N_b = 1

Server as FedAvg. Communication d up, d down.
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
class FedDecorrParams:
    beta: float = param(0.01, "weight of the decorrelation loss (FedBug paper 0.01, FedBug code 0.001)", ge=0)


def decorrelation_loss(z: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """L_dec of features ``z`` [N, f]; ``weight`` [N] (1 real, 0 padding) restricts it to the real samples.

    Returns a 0-d tensor (dtype of ``z``); 0 when fewer than two samples are real. Works under
    ``torch.func.vmap``. Computed in float64: for a nearly constant feature 1/sqrt(var + 1e-8) can
    magnify float32 rounding of the batch mean by ~1e4, which made the result depend on how the
    batch sum was ordered (a padded batch vs an exact one).
    """
    out_dtype = z.dtype
    z = z.double()
    w = torch.ones(z.shape[0], dtype=z.dtype, device=z.device) if weight is None else weight.to(z.dtype)
    n = w.sum()
    wc = w[:, None]
    mean = (z * wc).sum(0) / n.clamp_min(1.0)
    centred = (z - mean) * wc
    var = (centred ** 2).sum(0) / (n - 1).clamp_min(1.0)
    zh = centred / torch.sqrt(var + 1e-8)
    g = zh.T @ zh
    f = g.shape[0]
    off = (g ** 2).sum() - (torch.diagonal(g) ** 2).sum()
    loss = off / (f * (f - 1)) / n.clamp_min(1.0)
    return torch.where(n > 1, loss, torch.zeros_like(loss)).to(out_dtype)


class FedDecorr(FedAvg):
    name = "feddecorr"

    def __init__(self, beta: float, aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        self.beta = float(checked(FedDecorrParams, "algorithm.feddecorr", beta=beta).beta)

    def shown(self):
        return (("beta", f"{self.beta:g}"),)

    def local_objective(self, ctx, params, logits, features, y):
        if self.beta == 0.0:
            return Objective(logits)
        return Objective(logits, self.beta * decorrelation_loss(features, ctx.sample_weight))


register(Rule(
    name="feddecorr", kind="base", label="FedDecorr", citation="Shi et al., ICLR 2023, Eq. (5)",
    summary="FedAvg plus a loss that decorrelates the dimensions of the penultimate features",
    params=FedDecorrParams, neutral=("algorithm.feddecorr.beta=0",),
    build=lambda p, ctx: FedDecorr(p.beta, ctx.aggregation, ctx.eta_g)))
