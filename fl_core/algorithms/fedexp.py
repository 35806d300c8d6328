"""FedExP (Jhunjhunwala et al. 2023; docs/algorithms.md, FedExP): an adaptive server step size.

Clients train as in FedAvg. With p_i the aggregation weights over S and Delta_bar = sum p_i Delta_i::

    official:     eta_g = max(1, 0.5 * sum_i p_i ||Delta_i||^2 / (||Delta_bar||^2 + |S| eps))
                  x_{t+1} = x_t + eta_g Delta_bar;   evaluate (x_t + x_{t+1}) / 2 (x_1 after round 1)
                  eps <- eps * eps_decay^2 after every round
    fedbug_code:  eta_g = max(1, mean_i ||Delta_i||^2 / (||Delta_bar||^2 + |S|)), uniform mean,
                  no iterate averaging (FedBug's implementation; docs/algorithms.md,
                  Paper-vs-code switches)

eta_g >= 1 always; with one client eta_g = 1 (then A = B). Logs ``fedexp_eta_g`` every round.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lazy import lazy_import
from ..schema import ConfigError, checked, param, when
from .base import ServerStep
from .fedavg import FedAvg
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


_OFFICIAL = when("algorithm.fedexp.variant", "official")  # fedbug_code: no eps, no iterate averaging


@dataclass
class FedExPParams:
    variant: str = param("official", "official (Jhunjhunwala et al.) | fedbug_code (FedBug's implementation)",
                         choices=("official", "fedbug_code"))
    eps: float = param(1e-3, "epsilon of the step size; 0.1 for EMNIST in the paper", ge=0, when=_OFFICIAL,
                       replica=True)
    eps_decay: float = param(0.998, "eps <- eps * eps_decay**2 after every round", gt=0, le=1, when=_OFFICIAL,
                             replica=True)
    average_last_two: bool = param(True, "evaluate (x_t + x_{t+1}) / 2 (official only)", when=_OFFICIAL)


def _check(a, prefix: str) -> None:
    if a.fedexp.variant == "fedbug_code" and a.aggregation not in (None, "uniform"):
        raise ConfigError(f"algorithm.aggregation={a.aggregation} is not used by fedexp with "
                          f"{prefix}.variant=fedbug_code, which averages uniformly; set algorithm.aggregation=uniform")


class FedExP(FedAvg):
    name = "fedexp"

    def __init__(self, aggregation: str = "weighted", variant: str = "official", eps: float = 1e-3,
                 eps_decay: float = 0.998, average_last_two: bool = True):
        super().__init__(aggregation, 1.0)
        checked(FedExPParams, "algorithm.fedexp", variant=variant, eps=eps, eps_decay=eps_decay,
                average_last_two=average_last_two)
        self.variant = variant
        self.eps0 = float(eps)
        self.eps_decay = float(eps_decay)
        self.average_last_two = average_last_two and variant == "official"

    def shown(self):
        return (("", self.variant),)

    def init_server_state(self, global_flat):
        return {"eps": torch.tensor(self.eps0, dtype=torch.float64), "prev": global_flat.clone(),
                "eta_g": torch.tensor(1.0, dtype=torch.float64), "round": torch.tensor(0)}

    @staticmethod
    def step_size(deltas: torch.Tensor, p: torch.Tensor, eps: float, variant: str = "official") -> float:
        """eta_g for client updates ``deltas`` [|S|, d] with weights ``p`` [|S|] (sum 1)."""
        deltas = deltas.double()
        p = p.to(deltas)
        mean = p @ deltas
        sq = (deltas ** 2).sum(1)
        if variant == "fedbug_code":
            return max(1.0, float(sq.mean() / ((mean ** 2).sum() + deltas.shape[0])))
        return max(1.0, float(0.5 * (p * sq).sum() / ((mean ** 2).sum() + deltas.shape[0] * eps)))

    def aggregate(self, rctx, server_state, updates):
        deltas = torch.stack([u.delta for u in updates])
        if self.variant == "fedbug_code":
            p = torch.full((len(updates),), 1.0 / len(updates), dtype=torch.float64)
        else:
            p = self.aggregation_weights(updates)
        eta = self.step_size(deltas, p, float(server_state["eps"]), self.variant)
        mean = p.to(deltas) @ deltas
        new = rctx.global_flat + eta * mean
        state = {"eps": server_state["eps"] * self.eps_decay ** 2, "prev": rctx.global_flat.clone(),
                 "eta_g": torch.tensor(eta, dtype=torch.float64), "round": server_state["round"] + 1}
        # the model evaluated: the mean of the last two iterates (from round 2 on), or the new one
        last_two = self.average_last_two and int(state["round"]) > 1
        return ServerStep(new, state, metrics={"fedexp_eta_g": float(state["eta_g"])},
                          evaluate=0.5 * (state["prev"] + new) if last_two else None)


register(Rule(
    name="fedexp", kind="base", label="FedExP", citation="Jhunjhunwala et al., ICLR 2023, Eq. (9)",
    summary="FedAvg with an adaptive server step size eta_g >= 1 from the extrapolation rule",
    params=FedExPParams, eta_g=False, check=_check,
    own_aggregation=lambda a: "uniform" if a.fedexp.variant == "fedbug_code" else "weighted",
    build=lambda p, ctx: FedExP(ctx.aggregation if p.variant == "official" else "uniform", p.variant, p.eps,
                                p.eps_decay, p.average_last_two)))
