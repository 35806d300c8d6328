"""Server optimisers on the FedAvg pseudo-gradient (docs/algorithms.md, FedAvgM; FedAdam, FedYogi,
FedAdagrad; Invariants 9).

Clients train exactly as in FedAvg and send Delta_i. The server forms the pseudo-gradient
``Delta_bar = sum_{i in S} p_i Delta_i`` (p_i = FedAvg's weights: n_i / n_S, or 1/|S| with
``aggregation=uniform``) and feeds it to a stateful server rule instead of ``x <- x + eta_g Delta_bar``.

FedAvgM (Hsu et al. 2019, "Measuring the effects of non-identical data distribution ...")::

    heavy_ball:  v <- beta v + Delta_bar;                x <- x + eta_g v
    ema:         v <- beta v + (1 - beta) Delta_bar;     x <- x + v          (eta_g is ignored)

The EMA form is what FedDecorr's and FedBug's code call FedAvgM (beta = 0.9, server lr fixed to 1). Its state
is exactly (1 - beta) times the heavy-ball state, so EMA with beta == heavy-ball with eta_g = 1 - beta
(docs/algorithms.md, Invariants 9): the heavy-ball form's effective step on a constant pseudo-gradient is
eta_g / (1 - beta), the EMA form's is 1. beta = 0 (heavy-ball) is FedAvg.

FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2), all
element-wise, no bias correction::

    m <- beta1 m + (1 - beta1) Delta_bar
    adam:     v <- beta2 v + (1 - beta2) Delta_bar^2
    yogi:     v <- v - (1 - beta2) Delta_bar^2 sign(v - Delta_bar^2)      (sign(0) = 0)
    adagrad:  v <- v + Delta_bar^2                                        (beta2 unused)
    x <- x + eta_g m / (sqrt(v) + tau)

m and v start at 0, as in FedDecorr's ``approach/fedoptim.py`` (defaults beta1 = 0.9, beta2 = 0.99,
tau = 1e-3, server lr 1.0; its run script uses server lr 0.01). Reddi's paper initialises v >= tau^2
instead; with the zero init the first step of Adam and Yogi is, per coordinate,
``eta_g (1 - beta1) Delta / (sqrt(1 - beta2) |Delta| + tau)`` (Adagrad: ``sqrt(1 - beta2)`` -> 1), i.e.
up to eta_g (1 - beta1) / sqrt(1 - beta2) = eta_g for every coordinate with |Delta| >> tau: keep eta_g
small (the conf files use 0.01). Yogi's v stays >= 0: it moves by exactly (1 - beta2) Delta_bar^2
towards Delta_bar^2, so where it decreases (v > Delta_bar^2) it ends above beta2 Delta_bar^2.

Every rule logs ``server_update_norm`` = ||x_new - x|| each round (kept in the server state).
All arithmetic runs in the global vector's dtype and device; the state (d floats for FedAvgM, 2d for the
adaptive rules) lives in the server state, so checkpoints resume it. Communication: d up, d down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

from ..schema import ConfigError, checked, param
from .base import ClientUpdate, RoundContext
from .fedavg import FedAvg
from .registry import Rule, register


@dataclass
class FedAvgMParams:
    beta: float = param(0.9, "server momentum", ge=0, lt=1)
    form: str = param("heavy_ball", "heavy_ball: v <- beta v + D, x <- x + eta_g v | ema: m <- beta m + (1-beta) D, "
                      "x <- x + m", choices=("heavy_ball", "ema"))


@dataclass
class ServerOptParams:
    beta1: float = param(0.9, "first-moment decay (FedAdam, FedYogi, FedAdagrad)", ge=0, lt=1)
    beta2: float = param(0.99, "second-moment decay (FedAdam, FedYogi)", ge=0, lt=1)
    tau: float = param(1.0e-3, "adaptivity: x <- x + eta_g m / (sqrt(v) + tau)", gt=0)


def _check_fedavgm(a, prefix: str) -> None:
    if a.fedavgm.form == "ema" and a.eta_g is not None and float(a.eta_g) != 1.0:
        raise ConfigError(f"algorithm.eta_g={float(a.eta_g):g} is not used by fedavgm with {prefix}.form=ema "
                          f"(x <- x + m); use form=heavy_ball for a server learning rate, or leave algorithm.eta_g=1")


def pseudo_gradient(algo: FedAvg, rctx: RoundContext, updates: List[ClientUpdate]) -> torch.Tensor:
    """Delta_bar = sum_i p_i Delta_i [d] in the global vector's dtype (FedAvg's weights p_i)."""
    g = rctx.global_flat
    p = algo.aggregation_weights(updates).to(g.device, g.dtype)
    deltas = torch.stack([u.delta for u in updates]).to(g.device, g.dtype)  # [|S|, d]
    return p @ deltas


class FedAvgM(FedAvg):
    """FedAvg with server momentum (heavy-ball or EMA form, see the module docstring)."""

    name = "fedavgm"

    def __init__(self, beta: float = 0.9, form: str = "heavy_ball", aggregation: str = "weighted",
                 eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        p = checked(FedAvgMParams, "algorithm.fedavgm", beta=float(beta), form=form)
        self.beta, self.form = p.beta, p.form

    def describe(self) -> str:
        lr = f",eta_g={self.eta_g:g}" if self.form == "heavy_ball" and self.eta_g != 1.0 else ""
        return f"fedavgm[beta={self.beta:g},{self.form}{lr}]"

    def init_server_state(self, global_flat):
        return {"v": torch.zeros_like(global_flat),
                "update_norm": torch.zeros((), dtype=global_flat.dtype, device=global_flat.device)}

    def aggregate(self, rctx, server_state, updates):
        g = rctx.global_flat
        d = pseudo_gradient(self, rctx, updates)
        v = server_state["v"].to(g.device, g.dtype)
        if self.form == "heavy_ball":
            v = self.beta * v + d
            new = g + self.eta_g * v
        else:
            v = self.beta * v + (1.0 - self.beta) * d
            new = g + v
        return new, {"v": v, "update_norm": torch.linalg.vector_norm(new - g)}

    def round_metrics(self, rctx, server_state, updates) -> Dict[str, float]:
        return {"server_update_norm": float(server_state["update_norm"])}


class FedAdaptive(FedAvg):
    """Reddi et al.'s adaptive server optimisers; ``rule`` in {adam, yogi, adagrad}."""

    name = "fedadaptive"
    RULES = ("adam", "yogi", "adagrad")

    def __init__(self, rule: str, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        if rule not in self.RULES:
            raise ValueError(f"server optimiser rule must be one of {', '.join(self.RULES)}, got {rule!r}")
        self.rule = rule
        p = checked(ServerOptParams, "algorithm.server_opt", beta1=float(beta1), beta2=float(beta2), tau=float(tau))
        self.beta1, self.beta2, self.tau = p.beta1, p.beta2, p.tau

    def describe(self) -> str:
        b2 = "" if self.rule == "adagrad" else f",beta2={self.beta2:g}"
        return f"{self.name}[eta_g={self.eta_g:g},beta1={self.beta1:g}{b2},tau={self.tau:g}]"

    def init_server_state(self, global_flat):
        return {"m": torch.zeros_like(global_flat), "v": torch.zeros_like(global_flat),
                "update_norm": torch.zeros((), dtype=global_flat.dtype, device=global_flat.device)}

    def aggregate(self, rctx, server_state, updates):
        g = rctx.global_flat
        d = pseudo_gradient(self, rctx, updates)
        d2 = d * d
        m = self.beta1 * server_state["m"].to(g.device, g.dtype) + (1.0 - self.beta1) * d
        v = server_state["v"].to(g.device, g.dtype)
        if self.rule == "adam":
            v = self.beta2 * v + (1.0 - self.beta2) * d2
        elif self.rule == "yogi":
            v = v - (1.0 - self.beta2) * d2 * torch.sign(v - d2)
        else:
            v = v + d2
        new = g + self.eta_g * m / (v.sqrt() + self.tau)
        return new, {"m": m, "v": v, "update_norm": torch.linalg.vector_norm(new - g)}

    def round_metrics(self, rctx, server_state, updates) -> Dict[str, float]:
        return {"server_update_norm": float(server_state["update_norm"])}


class FedAdam(FedAdaptive):
    name = "fedadam"

    def __init__(self, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, aggregation: str = "weighted",
                 eta_g: float = 1.0):
        super().__init__("adam", beta1, beta2, tau, aggregation, eta_g)


class FedYogi(FedAdaptive):
    name = "fedyogi"

    def __init__(self, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, aggregation: str = "weighted",
                 eta_g: float = 1.0):
        super().__init__("yogi", beta1, beta2, tau, aggregation, eta_g)


class FedAdagrad(FedAdaptive):
    name = "fedadagrad"

    def __init__(self, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, aggregation: str = "weighted",
                 eta_g: float = 1.0):
        super().__init__("adagrad", beta1, beta2, tau, aggregation, eta_g)


register(Rule(
    name="fedavgm", kind="base", label="FedAvgM", citation="Hsu et al., arXiv:1909.06335, 2019, Sec. 3",
    summary="FedAvg with server momentum on the mean update (heavy-ball or EMA form)",
    params=FedAvgMParams, check=_check_fedavgm,
    neutral=("algorithm.fedavgm.beta=0", "algorithm.fedavgm.form=heavy_ball"),
    build=lambda p, ctx: FedAvgM(p.beta, p.form, ctx.aggregation, ctx.eta_g)))

for _name, _cls, _label in (("fedadam", FedAdam, "FedAdam"), ("fedyogi", FedYogi, "FedYogi"),
                            ("fedadagrad", FedAdagrad, "FedAdagrad")):
    register(Rule(
        name=_name, kind="base", label=_label, citation="Reddi et al., ICLR 2021, Alg. 2",
        summary=f"FedAvg with the adaptive server optimiser {_label[3:]} on the mean update",
        params=ServerOptParams, section="server_opt",
        build=lambda p, ctx, _cls=_cls: _cls(p.beta1, p.beta2, p.tau, ctx.aggregation, ctx.eta_g)))
