"""MOON: model-contrastive federated learning (Li, He and Song, CVPR 2021; docs/algorithms.md, MOON).

Client i adds a contrastive term that pulls the representation of its local model towards the received global
model's and away from its own previous local model's, on the same batch (Eq. (2)-(3) of the paper)::

    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )
    loss  = CE(logits, y) + mu * mean over the batch of l_con

z, z_glob, z_prev [B, f] are the penultimate features (``model.forward_features``) of the local model being
trained, the received global model and the client's previous local model; sim is the cosine similarity. z_glob and
z_prev come from the executor service ``forward_of`` (eval mode, no gradient), so both executors compute the same.
The server is FedAvg's (weighted mean, eta_g; any ``algorithm.server_opt`` composes).

State: the previous local model theta_i^{t-1} [d] per client (``state["prev"]``), set to the model the client
trained this round. A client that has not trained yet has no previous model: its state starts as the model it
first receives, so z_prev = z_glob and l_con is the constant log 2 with zero gradient in that round (the authors'
code starts every client from the round-0 model instead; with full participation the two agree).

Deviations, stated: the project's models have no projection head, so z is the penultimate representation rather
than MOON's projected one. mu = 0 is exactly FedAvg. Communication: d up, d down; client state d floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schema import checked, param
from .fedavg import FedAvg
from .registry import Rule, register

GLOBAL, PREVIOUS = "global", "state:prev"  # the vectors whose forward pass the loss uses (``forward_of``)


@dataclass
class MoonParams:
    mu: float = param(1.0, "weight of the model-contrastive loss (paper: 5 for CIFAR-10, 1 for CIFAR-100)", ge=0)
    tau: float = param(0.5, "temperature of the model-contrastive loss", gt=0)


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's l_con per sample [B] for representations z, z_glob, z_prev [B, f] (Eq. (2) of the paper): the
    cross-entropy of picking the global model's representation (positive) over the previous local model's
    (negative) with cosine similarities divided by the temperature ``tau``."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
    return torch.logsumexp(torch.stack([pos, neg]), 0) - pos


class Moon(FedAvg):
    name = "moon"
    forward_of = (GLOBAL, PREVIOUS)

    def __init__(self, mu: float = 1.0, tau: float = 0.5, aggregation: str = "weighted", eta_g: float = 1.0):
        super().__init__(aggregation, eta_g)
        p = checked(MoonParams, "algorithm.moon", mu=float(mu), tau=float(tau))
        self.mu, self.tau = p.mu, p.tau

    def describe(self) -> str:
        return f"moon[mu={self.mu:g},tau={self.tau:g}]"

    def init_client_state(self, global_flat):
        return {"prev": global_flat.clone()}

    def local_loss(self, ctx, params, logits, features, y):
        if self.mu == 0.0:
            return None
        out = ctx.reference_outputs
        per_sample = contrastive_loss(features, out[GLOBAL][1], out[PREVIOUS][1], self.tau)
        w = ctx.sample_weight  # vectorised executor: 0 marks padding samples
        mean = per_sample.mean() if w is None else (per_sample * w).sum() / w.sum().clamp_min(1.0)
        return self.mu * mean

    def finish_client(self, ctx, update):
        ctx.state["prev"] = ctx.round.global_flat + update.delta  # the model this client trained
        return update


register(Rule(
    name="moon", kind="base", label="MOON", citation="Li, He and Song, CVPR 2021, Eq. (2)-(3)",
    summary="model-contrastive loss: local features pulled to the global model's, pushed from the previous local one",
    params=MoonParams, neutral=("algorithm.moon.mu=0",),
    build=lambda p, ctx: Moon(p.mu, p.tau, ctx.aggregation, ctx.eta_g)))
