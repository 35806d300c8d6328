"""FedAvg (McMahan et al. 2017; docs/algorithms.md, FedAvg).

Client: K_i plain SGD steps from the broadcast model. Server (Option I; the plain server step on the
pseudo-gradient D, any ``algorithm.server_opt`` replaces it)::

    weighted:  theta <- theta + eta_g * sum_i (n_i / n_S) * Delta_i
    uniform:   theta <- theta + (eta_g / |S|) * sum_i Delta_i      (FedBug's Alg. 1 line 13)

Communication: d floats up and d down per participating client per round.
"""

from __future__ import annotations

from typing import List

from ..lazy import lazy_import
from .base import Algorithm, ClientUpdate, plain_step
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


class FedAvg(Algorithm):
    name = "fedavg"

    def __init__(self, aggregation: str = "weighted", eta_g: float = 1.0):
        if aggregation not in ("weighted", "uniform"):
            raise ValueError(f"algorithm.aggregation must be weighted or uniform, got {aggregation!r}")
        self.aggregation = aggregation
        self.eta_g = float(eta_g)

    def aggregation_weights(self, updates: List[ClientUpdate]) -> torch.Tensor:
        """p_i over the participating clients ([|S|], sums to 1)."""
        if self.aggregation == "uniform":
            return torch.full((len(updates),), 1.0 / len(updates), dtype=torch.float64)
        n = torch.tensor([u.num_samples for u in updates], dtype=torch.float64)
        if n.sum() == 0:  # only empty clients sampled (possible with lognormal sizes): nothing to weigh
            return torch.full((len(updates),), 1.0 / len(updates), dtype=torch.float64)
        return n / n.sum()

    def pseudo_gradient(self, rctx, server_state, updates):
        """D = sum_i p_i Delta_i [d]; the server state passes through."""
        p = self.aggregation_weights(updates).to(rctx.global_flat.device, rctx.global_flat.dtype)
        deltas = torch.stack([u.delta for u in updates])  # [|S|, d]
        return p @ deltas, server_state

    def aggregate(self, rctx, server_state, updates):
        """The plain server step theta + eta_g D on :meth:`pseudo_gradient` (D goes with it, for a server
        optimiser)."""
        direction, state = self.pseudo_gradient(rctx, server_state, updates)
        return plain_step(rctx, direction, state, self.eta_g)


register(Rule(
    name="fedavg", kind="base", label="FedAvg",
    citation="McMahan et al., AISTATS 2017, Alg. 1 (FederatedAveraging)",
    summary="local SGD, then the server adds eta_g times the (weighted) mean client update",
    build=lambda p, ctx: FedAvg(ctx.aggregation, ctx.eta_g)))
