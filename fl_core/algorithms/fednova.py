"""FedNova (Wang et al. 2020; docs/algorithms.md, FedNova): normalised averaging.

Client i runs tau_i local steps and sends d_i = Delta_i / a_i with its normaliser a_i
(:func:`normalizer`; plain SGD: a_i = tau_i; with local momentum rho = ``train.momentum``:
a_i = sum_{k=1..tau_i} (1 - rho^k) / (1 - rho); with FedNova's proximal term mu:
a_i = [1 - (1 - eta_l mu)^tau_i] / (eta_l mu); momentum and mu together are refused). tau_i is the client's real
step count this round, so drawn epochs (``train.local_epochs_max``) and stragglers (``train.stragglers``) give the
heterogeneous tau_i the normalisation is made for. ``train.optimizer=adam`` is refused: a_i is derived for SGD
steps (Wang et al. 2020: the a_i of plain, momentum and proximal SGD), and an Adam step is not a fixed linear
combination of the local gradients.
Server, p_i = n_i / n_S over the participants (1 / |S| with ``aggregation=uniform``)::

    tau_eff = sum_i p_i a_i;        theta <- theta + eta_g * tau_eff * sum_i p_i d_i

With equal tau_i (and mu = 0) this is FedAvg with the same weights. Communication: d + 1 floats up, d down.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lazy import lazy_import
from ..schema import ConfigError, checked, fmt, param
from .base import Objective, ServerStep
from .fedavg import FedAvg
from .fedprox import proximal_term
from .registry import Rule, refuse_local_adam, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class FedNovaParams:
    mu: float = param(0.0, "proximal term (FedNova's prox normaliser); 0 = plain SGD, a_i = tau_i", ge=0)


def normalizer(tau: int, lr: float = 0.0, mu: float = 0.0, rho: float = 0.0) -> float:
    """a_i (the L1 norm of FedNova's a_i vector, a float) for tau local steps: plain SGD (tau), SGD with momentum
    rho in [0, 1), or the proximal variant (mu > 0, learning rate lr; takes precedence over rho).

    momentum: sum_{k=1..tau} (1 - rho^k) / (1 - rho) = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
    (Wang et al., NeurIPS 2020, the local-momentum example of a_i; code JYWa/FedNova ``local_normalizing_vec``);
    prox: [1 - (1 - lr mu)^tau] / (lr mu). rho = 0 and mu = 0 give tau.
    """
    if mu > 0:
        return (1.0 - (1.0 - lr * mu) ** tau) / (lr * mu)
    if rho > 0:
        return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
    return float(tau)


class FedNova(FedAvg):
    name = "fednova"

    def __init__(self, mu: float = 0.0, eta_g: float = 1.0, aggregation: str = "weighted", momentum: float = 0.0):
        """``momentum``: rho of the clients' local SGD (``train.momentum``), which sets a_i.

        Raises:
            ConfigError: mu out of range, or mu > 0 with momentum > 0 (names both keys).
        """
        super().__init__(aggregation, eta_g)
        self.mu = float(checked(FedNovaParams, "algorithm.fednova", mu=mu).mu)
        self.rho = float(momentum)
        if self.mu > 0 and self.rho > 0:
            raise ConfigError(f"train.momentum={fmt(self.rho)} does not compose with algorithm.fednova.mu="
                              f"{fmt(self.mu)}: FedNova's normaliser a_i is derived for local momentum or for the "
                              "proximal term, not both (Wang et al. 2020); set train.momentum=0 or "
                              "algorithm.fednova.mu=0")

    def local_objective(self, ctx, params, logits, features, y):
        return Objective(logits, None if self.mu == 0.0 else proximal_term(ctx, params, self.mu))

    def finish_client(self, ctx, update):
        a = normalizer(update.num_steps, ctx.round.lr, self.mu, self.rho)
        update.extra["a"] = torch.tensor(a, dtype=torch.float64)
        update.sent["a"] = 1.0
        return update

    def _normalised(self, updates):
        """(tau_eff, sum_i p_i d_i [d]): the effective step count and the normalised mean update."""
        p = self.aggregation_weights(updates)  # [|S|] float64
        a = torch.stack([u.extra["a"] for u in updates])
        live = a > 0  # a client with no local step contributes nothing
        d = torch.stack([u.delta for u in updates])
        coef = torch.where(live, p / a.clamp_min(1e-12), torch.zeros_like(p)).to(d)
        return float((p * a).sum()), coef @ d

    def pseudo_gradient(self, rctx, server_state, updates):
        """D = tau_eff * sum_i p_i d_i [d] (what a server optimiser receives)."""
        tau_eff, mean = self._normalised(updates)
        return tau_eff * mean, server_state

    def aggregate(self, rctx, server_state, updates):
        """theta + (eta_g tau_eff) sum_i p_i d_i ((eta_g tau_eff) as one scalar, as Eq. (7) is written); the
        direction a server optimiser takes is :meth:`pseudo_gradient`'s."""
        tau_eff, mean = self._normalised(updates)
        return ServerStep(rctx.global_flat + self.eta_g * tau_eff * mean, server_state, tau_eff * mean)

    def comm_floats(self, d):
        return float(d) + 1.0, float(d)


def _build(p, ctx):
    refuse_local_adam(ctx, "algorithm.name=fednova", "its normaliser a_i counts SGD steps (plain, momentum or "
                      "proximal; Wang et al. 2020), and an Adam step has no such a_i")
    return FedNova(p.mu, ctx.eta_g, ctx.aggregation, ctx.momentum)


register(Rule(
    name="fednova", kind="base", label="FedNova", citation="Wang et al., NeurIPS 2020, Eq. (6)-(7)",
    summary="normalised averaging: each update is divided by its number of local steps, then rescaled by tau_eff",
    params=FedNovaParams, neutral=("algorithm.fednova.mu=0",),  # and equal step counts K_i
    build=_build))
