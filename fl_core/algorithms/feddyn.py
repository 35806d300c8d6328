"""FedDyn (Acar et al. 2021; docs/algorithms.md, FedDyn).

Client i starts from the broadcast "cloud" model theta and minimises, with its gradient memory
hist_i = sum over its past rounds of (theta_i - theta) (so g_i = -alpha_i hist_i)::

    L_i(w) + alpha_i <w, hist_i> + (alpha_i / 2) ||w - theta||^2      (gradient: dL + alpha_i (hist_i + w - theta))
    after training: hist_i <- hist_i + (theta_i - theta)

with alpha_i = alpha / w_i, w_i = n_i / mean_j n_j when ``adaptive_alpha`` (Acar/FedBug code;
hist_i is not rescaled). Server, with N = all clients and S the active ones::

    h     <- h - (alpha / N) sum_{i in S} (theta_i - theta)
    sel    = (1/|S|) sum_{i in S} theta_i             (the model FedBug/Acar evaluate, "sel")
    cloud  = sel - h / alpha                          (broadcast next round)

Communication: d up, d down; state: hist_i (d per client), h (d).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lazy import lazy_import
from ..schema import checked, param
from .base import Algorithm, Objective, ServerStep
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class FedDynParams:
    alpha: float = param(0.01, "regulariser alpha (Acar et al.; FedBug uses 0.01)", gt=0, replica=True)
    adaptive_alpha: bool = param(True, "alpha_i = alpha / w_i with w_i = n_i / mean_j n_j (Acar/FedBug code)")
    eval_model: str = param("sel", "model evaluated: sel = mean of the active clients' models (FedBug/Acar logs), "
                            "cloud = the broadcast model", choices=("sel", "cloud"))


class FedDyn(Algorithm):
    name = "feddyn"
    replica_params = ("alpha",)  # local_objective reads it: a population may train several alpha at once

    def __init__(self, alpha: float = 0.01, adaptive_alpha: bool = True, eval_model: str = "sel"):
        checked(FedDynParams, "algorithm.feddyn", alpha=alpha, adaptive_alpha=adaptive_alpha, eval_model=eval_model)
        self.alpha = float(alpha)
        self.adaptive_alpha = adaptive_alpha
        self.eval_model = eval_model

    def shown(self):
        return (("alpha", f"{self.alpha:g}"),)

    def client_alpha(self, ctx):
        """alpha_i = alpha * mean_n / n_i (adaptive) or alpha; works for ints and 0-d tensors."""
        if not self.adaptive_alpha:
            return self.alpha
        return self.alpha * ctx.round.mean_client_size / ctx.num_samples

    def init_server_state(self, global_flat):
        return {"h": torch.zeros_like(global_flat), "sel": global_flat.clone()}

    def init_client_state(self, global_flat):
        return {"hist": torch.zeros_like(global_flat)}

    def local_objective(self, ctx, params, logits, features, y):
        anchor = ctx.round.global_params()
        hist = ctx.round.spec.views(ctx.state["hist"])
        lin = sum((p * hist[n]).sum() for n, p in params.items())
        quad = sum(((p - anchor[n]) ** 2).sum() for n, p in params.items())
        return Objective(logits, self.client_alpha(ctx) * (lin + 0.5 * quad))

    def finish_client(self, ctx, update):
        ctx.state["hist"] = ctx.state["hist"] + update.delta
        return update

    def aggregate(self, rctx, server_state, updates):
        deltas = torch.stack([u.delta for u in updates])  # [|S|, d]
        sel = rctx.global_flat + deltas.mean(0)
        h = server_state["h"] - (self.alpha / rctx.num_clients) * deltas.sum(0)
        return ServerStep(sel - h / self.alpha, {"h": h, "sel": sel}, evaluate=sel if self.eval_model == "sel" else None)


register(Rule(
    name="feddyn", kind="base", label="FedDyn", citation="Acar et al., ICLR 2021, Alg. 1",
    summary="dynamic regulariser: a linear term from each client's gradient memory plus a quadratic one",
    params=FedDynParams, aggregation=("uniform",), eta_g=False,
    build=lambda p, ctx: FedDyn(p.alpha, p.adaptive_alpha, p.eval_model)))
