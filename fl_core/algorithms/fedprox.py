"""FedProx (Li et al. 2020; docs/algorithms.md, FedProx).

Client objective F_i(theta_i) + (mu/2)||theta_i - theta||^2, the anchor theta being a detached
copy of the received global model; server as FedAvg. mu = 0 is exactly FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import checked, param
from .base import Objective
from .fedavg import FedAvg
from .registry import Rule, register


@dataclass
class FedProxParams:
    mu: float = param(0.01, "proximal coefficient: (mu/2)||theta_i - theta||^2 is added to the local loss", ge=0,
                      replica=True)


def proximal_term(ctx, params, mu):
    """(mu/2) ||theta_i - theta||^2 with theta the received global model (a detached anchor); ``mu`` a float or, in a
    population over mu, the client's 0-dim tensor."""
    anchor = ctx.round.global_params()
    return 0.5 * mu * sum(((p - anchor[n]) ** 2).sum() for n, p in params.items())


class FedProx(FedAvg):
    name = "fedprox"
    replica_params = ("mu",)  # a population may train several mu at once (local_objective reads it)

    def __init__(self, mu: float, aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        self.mu = float(checked(FedProxParams, "algorithm.fedprox", mu=mu).mu)

    def local_objective(self, ctx, params, logits, features, y):
        if isinstance(self.mu, float) and self.mu == 0.0:  # (a population's mu per client is a tensor)
            return Objective(logits)
        # Frozen parameters (FedBug) equal the anchor exactly, so summing over all of them adds 0
        # and keeps the hook free of per-tensor flags (it also runs under torch.func.vmap).
        return Objective(logits, proximal_term(ctx, params, self.mu))


register(Rule(
    name="fedprox", kind="base", label="FedProx", citation="Li et al., MLSys 2020, Eq. (2)",
    summary="FedAvg with a proximal term that keeps the local model near the received one",
    params=FedProxParams, neutral=("algorithm.fedprox.mu=0",),
    build=lambda p, ctx: FedProx(p.mu, ctx.aggregation, ctx.eta_g)))
