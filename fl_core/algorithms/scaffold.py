"""SCAFFOLD (Karimireddy et al. 2020; docs/algorithms.md, SCAFFOLD), option II.

Client i corrects every local gradient with the control variates: g <- g + c - c_i (applied to the
trainable tensors only, so FedBug-frozen units get no correction). After its K_i steps (the steps
actually taken)::

    c_i+ = c_i - c + (x - y_i) / (K_i eta_l)          Delta c_i = c_i+ - c_i      (uses the old c_i)

Server (N = all clients)::

    x <- x + eta_g / |S| * sum_i Delta y_i            c <- c + (1 / N) * sum_i Delta c_i

eta_l is the round's learning rate (``lr_in_update=actual``) or the initial one (``initial``, as in
Acar's code). The c_i update assumes plain local SGD steps; ``train.momentum`` > 0 and ``train.optimizer=adam``
are refused. K_i is the client's real step count this round (drawn epochs and stragglers included).
Communication: 2d up (Delta y, Delta c), 2d down (x, c); state c_i (d per client), c (d).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lazy import lazy_import
from ..schema import checked, param
from .base import Algorithm, plain_step
from .registry import Rule, refuse_local_adam, refuse_local_momentum, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class ScaffoldParams:
    lr_in_update: str = param("actual", "c-update divides by K * eta_l of the round (actual) or the initial eta_l "
                              "(initial, Acar's code); the same without decay", choices=("actual", "initial"))


def add_drift_correction(ctx, grads) -> None:
    """SCAFFOLD's correction g <- g + c - c_i IN PLACE on the given gradients (the server's c in
    ``ctx.round.extra["c"]``, the client's c_i in ``ctx.state["c"]``; flat [d] or stacked [C, d])."""
    spec = ctx.round.spec
    c = spec.views(ctx.round.extra["c"])
    ci = spec.views(ctx.state["c"])
    for n, g in grads.items():
        g.add_(c[n] - ci[n])


class Scaffold(Algorithm):
    name = "scaffold"

    def __init__(self, eta_g: float = 1.0, lr_in_update: str = "actual"):
        checked(ScaffoldParams, "algorithm.scaffold", lr_in_update=lr_in_update)
        self.eta_g = float(eta_g)
        self.lr_in_update = lr_in_update

    def init_server_state(self, global_flat):
        return {"c": torch.zeros_like(global_flat)}

    def init_client_state(self, global_flat):
        return {"c": torch.zeros_like(global_flat)}

    def broadcast(self, server_state):
        return {"c": server_state["c"]}

    def local_step(self, ctx, k, params, grads):
        add_drift_correction(ctx, grads)

    def finish_client(self, ctx, update):
        update.sent["delta_c"] = float(update.delta.numel())
        if update.num_steps == 0:
            update.extra["delta_c"] = torch.zeros_like(update.delta)
            return update
        lr = ctx.round.lr if self.lr_in_update == "actual" else ctx.round.lr0
        c_old = ctx.state["c"]
        c_new = c_old - ctx.round.extra["c"] - update.delta / (update.num_steps * lr)
        update.extra["delta_c"] = c_new - c_old
        ctx.state["c"] = c_new
        return update

    def pseudo_gradient(self, rctx, server_state, updates):
        """D = mean_i Delta y_i [d] (x <- x + eta_g D, or a server optimiser on D); c <- c + sum_i Delta c_i / N."""
        deltas = torch.stack([u.delta for u in updates])
        dc = torch.stack([u.extra["delta_c"] for u in updates]).sum(0)
        return deltas.mean(0), {"c": server_state["c"] + dc / rctx.num_clients}

    def aggregate(self, rctx, server_state, updates):
        direction, state = self.pseudo_gradient(rctx, server_state, updates)
        return plain_step(rctx, direction, state, getattr(self, "eta_g", 1.0))

    def comm_floats(self, d):
        return 2.0 * d, 2.0 * d


MOMENTUM_WHY = ("option II's (x - y_i) / (K_i eta_l) is the mean corrected gradient only for plain local SGD steps "
                "(Karimireddy et al., Alg. 1)")


def _build(p, ctx):
    refuse_local_momentum(ctx, "algorithm.name=scaffold", MOMENTUM_WHY)
    refuse_local_adam(ctx, "algorithm.name=scaffold", MOMENTUM_WHY)
    return Scaffold(ctx.eta_g, p.lr_in_update)


register(Rule(
    name="scaffold", kind="base", label="SCAFFOLD", citation="Karimireddy et al., ICML 2020, Alg. 1 (option II)",
    summary="control variates c and c_i correct every local gradient for client drift",
    params=ScaffoldParams, aggregation=("uniform",),
    build=_build))
