"""FedDC: local drift decoupling and correction (Gao et al. 2022; docs/algorithms.md, FedDC).

Client i holds a drift h_i and a gradient state g_i; the server a global gradient state g::

    loss = CE + (alpha_i / 2) ||theta - (theta_g - h_i)||^2 + <theta, g - g_i>,   alpha_i = alpha * mean_n / n_i
    after K_i steps, Delta_i = theta_i - theta_g:
        h_i  <- h_i + Delta_i
        g_i+  = g_i - g - Delta_i / (K_i eta_l0)        (eta_l0: the initial lr, as in the reference code)
    server:  g <- g + (1/N) sum_{i in S} (g_i+ - g_i)
             theta_g <- mean_{i in S} theta_i + mean_{all N} h_i

The clients' size weights w_i of the reference code are kept only in alpha_i (balanced data: w_i = 1).
The g_i update assumes plain local SGD steps; ``train.momentum`` > 0 and ``train.optimizer=adam`` are refused.
Communication: 2d up (model and gradient-state change), 2d down (model and g).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lazy import lazy_import
from ..schema import checked, param
from .base import Algorithm, Objective, ServerStep
from .registry import Rule, refuse_local_adam, refuse_local_momentum, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class FedDCParams:
    alpha: float = param(0.01, "drift penalty (Gao et al.; FedBCGD uses 0.01)", ge=0)


class FedDC(Algorithm):
    name = "feddc"

    def __init__(self, alpha: float = 0.01):
        self.alpha = float(checked(FedDCParams, "algorithm.feddc", alpha=alpha).alpha)

    def shown(self):
        return (("alpha", f"{self.alpha:g}"),)

    def init_server_state(self, global_flat):
        return {"g": torch.zeros_like(global_flat), "h_sum": torch.zeros_like(global_flat)}

    def init_client_state(self, global_flat):
        return {"h": torch.zeros_like(global_flat), "g_i": torch.zeros_like(global_flat)}

    def broadcast(self, server_state):
        return {"g": server_state["g"]}

    def local_objective(self, ctx, params, logits, features, y):
        spec = ctx.round.spec
        anchor = ctx.round.global_params()
        h = spec.views(ctx.state["h"])
        corr = spec.views(ctx.round.extra["g"] - ctx.state["g_i"])
        alpha_i = self.alpha * ctx.round.mean_client_size / ctx.num_samples
        quad = sum(((p - anchor[n] + h[n]) ** 2).sum() for n, p in params.items())
        lin = sum((p * corr[n]).sum() for n, p in params.items())
        return Objective(logits, 0.5 * alpha_i * quad + lin)

    def finish_client(self, ctx, update):
        ctx.state["h"] = ctx.state["h"] + update.delta
        update.sent["delta_g"] = float(update.delta.numel())
        if update.num_steps == 0:
            update.extra["delta_g"] = torch.zeros_like(update.delta)
            return update
        g_new = ctx.state["g_i"] - ctx.round.extra["g"] - update.delta / (update.num_steps * ctx.round.lr0)
        update.extra["delta_g"] = g_new - ctx.state["g_i"]
        ctx.state["g_i"] = g_new
        return update

    def aggregate(self, rctx, server_state, updates):
        deltas = torch.stack([u.delta for u in updates])
        h_sum = server_state["h_sum"] + deltas.sum(0)
        g = server_state["g"] + torch.stack([u.extra["delta_g"] for u in updates]).sum(0) / rctx.num_clients
        new = rctx.global_flat + deltas.mean(0) + h_sum / rctx.num_clients
        return ServerStep(new, {"g": g, "h_sum": h_sum})

    def comm_floats(self, d):
        return 2.0 * d, 2.0 * d


def _build(p, ctx):
    why = ("its g_i update Delta_i / (K_i eta_l0) is the mean local gradient only for plain local SGD steps "
           "(Gao et al., Alg. 1)")
    refuse_local_momentum(ctx, "algorithm.name=feddc", why)
    refuse_local_adam(ctx, "algorithm.name=feddc", why)
    return FedDC(p.alpha)


register(Rule(
    name="feddc", kind="base", label="FedDC", citation="Gao et al., CVPR 2022, Alg. 1",
    summary="local drift decoupling and correction: a drift variable h_i bridges local and global models",
    params=FedDCParams, aggregation=("uniform",), eta_g=False,
    build=_build))
