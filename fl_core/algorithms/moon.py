"""MOON: model-contrastive federated learning (Li, He and Song, CVPR 2021; docs/algorithms.md, MOON).

Client i adds to the cross-entropy a contrastive term that pulls the representation of the model it trains towards
the received global model's (positive) and pushes it from its own previous local model's (negative), on the same
batch (Eq. (2)-(3) and Algorithm 1 of the paper)::

    l_con = -log( exp(cos(z, z_glob) / tau) / (exp(cos(z, z_glob) / tau) + exp(cos(z, z_prev) / tau)) )
    loss  = CE(logits, y) + mu * mean over the batch of l_con

Representations: h, h_glob, h_prev [B, f] are the penultimate features (``model.forward_features``) of the local
model, the received global model theta and the client's previous model; h_glob and h_prev come from the executor
service ``forward_of`` (eval mode, no gradient, same batch and augmentation), so both executors compute the same.
With ``projection_dim`` = 0 (default) z = h (the authors' code with ``--use_project_head 0``). With ``projection_dim``
= P > 0, z = g(h) [B, P] with the paper's projection head g = Linear(f, f) - ReLU - Linear(f, P) (P = 256 in the
paper), a submodule ``moon_head`` of the model (``FLModel.attach_head``): its f^2 + f + f P + P parameters are
part of the flat vector [d], so they are initialised with the model (after its other parameters, whose draws are
unchanged), trained, averaged and sent like the rest; each model's own head maps its own features (z_glob = g_glob(
h_glob), z_prev = g_prev(h_prev)). The classifier stays on h and the head is used by l_con only (the authors' code
puts the classifier on g(h); docs/algorithms.md, MOON, lists this deviation).

The previous model theta_i^prev [d] is the client state ``prev`` (``init_client_state``; store-backed, so in
checkpoints), set after training to the model the client trained, theta + Delta_i. Before a client's first
training, ``first_previous`` decides (the authors' main.py keeps a pool of the previous round's networks of ALL
clients, ``old_nets_pool`` with ``model_buffer_size`` 1):

- ``official`` (default, the authors' code): in round 1 the pool is empty, so l_con has no negative: it is the
  cross-entropy of the positive alone, exactly 0 with zero gradient (MOON's round 1 is FedAvg). From round 2 on, a
  client that has never trained contrasts against its own initial network, drawn independently of the global model
  (``init_nets`` builds one network per client). That network is drawn here by the model's own initialisation, as
  the run draws the global model (``torch.manual_seed``, then ``reset_parameters()`` of every submodule, on a copy
  of the model with its device and dtype), seeded with ``derive_seed("moon-init", run seed, client id)``
  (:func:`initial_vector`), inside ``torch.random.fork_rng`` so the run's own random stream is untouched. It is a
  pure function of (run seed, client id), the same for both executors and a resumed run; it cannot equal the
  authors' networks, which are drawn one after another from one PyTorch stream. State: ``fresh`` (0-d, 1 until
  the client's first training) marks it.
- ``global`` (the rule before this option): a client's ``prev`` starts as the first model it receives, so in that
  round z_prev = z_glob and l_con is the constant log 2 with zero gradient (up to the rounding of its two softmax
  weights, 1/2 each: ~1e-8 relative in float32). With full participation the two options give the same model up
  to that rounding (neither adds a gradient in round 1, and no client is a first-time participant later).
  ``global`` with ``projection_dim`` 0 is the former rule to the bit.

The server is FedAvg's (weighted mean, eta_g; any ``algorithm.server_opt`` composes); mu = 0 is exactly FedAvg
(a head needs mu > 0: it would never be trained). Communication: d up, d down; client state d floats (+1 official).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..lazy import lazy_import
from ..params import flatten_params
from ..schema import ConfigError, checked, param
from ..seeding import derive_seed
from .base import Needs, Objective
from .fedavg import FedAvg
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch

GLOBAL, PREVIOUS = "global", "state:prev"  # the vectors whose forward pass the loss uses (``forward_of``)
HEAD = "moon_head"  # the projection head's submodule name (``projection_dim`` > 0)
FIRST_PREVIOUS = ("official", "global")


@dataclass
class MoonParams:
    mu: float = param(1.0, "weight of the model-contrastive loss (paper: 5 for CIFAR-10, 1 for CIFAR-100 and "
                      "Tiny-ImageNet)", ge=0)
    tau: float = param(0.5, "temperature of the model-contrastive loss (paper: 0.5)", gt=0)
    first_previous: str = param("official", "previous model of a client that has not trained yet: official = none "
                                "in round 1 (l_con = 0), its own seeded initial network afterwards (authors' code) | "
                                "global = the first model it receives (l_con = log 2, no gradient)",
                                choices=FIRST_PREVIOUS)
    projection_dim: int = param(0, "output width P of the projection head Linear(f, f)-ReLU-Linear(f, P) that l_con "
                                "is computed on (paper: 256); 0 = no head, l_con on the penultimate features",
                                ge=0, integer=True)


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: Optional[torch.Tensor],
                     tau: float) -> torch.Tensor:
    """MOON's l_con per sample [B] for representations z, z_glob, z_prev [B, r] (Eq. (2) of the paper): the
    cross-entropy of picking the global model's representation (positive) over the previous local model's
    (negative), with cosine similarities divided by the temperature ``tau`` (> 0).

    ``z_prev`` None: no negative (the authors' round 0, empty model pool): the cross-entropy of the positive alone,
    exactly 0 with exactly zero gradient (the graph still reaches z, so every parameter gets a zero gradient).
    """
    pos = torch.nn.functional.cosine_similarity(z, z_glob, dim=-1) / tau
    if z_prev is None:
        return torch.logsumexp(pos.unsqueeze(0), 0) - pos
    neg = torch.nn.functional.cosine_similarity(z, z_prev, dim=-1) / tau
    return torch.logsumexp(torch.stack([pos, neg]), 0) - pos


def head_names(prefix: str = HEAD) -> Tuple[str, str, str, str]:
    """Parameter names of the projection head ``nn.Sequential(Linear, ReLU, Linear)`` registered as ``prefix``:
    W1 [f, f], b1 [f], W2 [P, f], b2 [P]."""
    return (f"{prefix}.0.weight", f"{prefix}.0.bias", f"{prefix}.2.weight", f"{prefix}.2.bias")


def project(p: Dict[str, torch.Tensor], h: torch.Tensor, prefix: str = HEAD) -> torch.Tensor:
    """g(h) = W2 relu(W1 h + b1) + b2: features h [B, f] -> [B, P] with the head parameters of ``p`` (name ->
    tensor: a model's parameters, or ``ParamSpec.views`` of a flat vector; works under ``torch.func.vmap``)."""
    w1, b1, w2, b2 = (p[n] for n in head_names(prefix))
    fn = torch.nn.functional
    return fn.linear(fn.relu(fn.linear(h, w1, b1)), w2, b2)


def attach_projection_head(model: torch.nn.Module, out_dim: int) -> None:
    """Give ``model`` (an ``FLModel``) the head Linear(f, f) - ReLU - Linear(f, out_dim) as submodule ``moon_head``
    (``FLModel.attach_head``; f = ``model.feature_dim()``), on the model's device and dtype; built without
    touching the global random stream (the run initialises it with the model). A head of these sizes that is
    already there is kept: the registry attaches it before the stack is built (``Rule.prepare_model``), and
    :class:`Moon` attaches it when built directly on a model without one.

    Raises:
        ConfigError: the model has no feature width or no units, or holds a head of other sizes (names
            ``algorithm.moon.projection_dim``).
    """
    key = f"algorithm.moon.projection_dim={out_dim}"
    try:
        f = model.feature_dim()
    except (AttributeError, ValueError) as err:
        raise ConfigError(f"{key}: the head needs the width of the model's features ({err})") from None
    p0 = next(model.parameters())
    have = dict(model.named_children()).get(HEAD)
    if have is not None:
        shapes = [tuple(p.shape) for p in have.parameters()]
        if shapes != [(f, f), (f,), (out_dim, f), (out_dim,)]:
            raise ConfigError(f"{key}: the model already has a {HEAD} of other sizes {shapes}")
        return
    with torch.random.fork_rng(devices=[]):
        head = torch.nn.Sequential(torch.nn.Linear(f, f), torch.nn.ReLU(), torch.nn.Linear(f, out_dim))
    try:
        model.attach_head(HEAD, head.to(p0.device, p0.dtype))
    except (AttributeError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None


def initial_vector(model: torch.nn.Module, seed: int) -> torch.Tensor:
    """The flat parameters [d] of ``model`` initialised as a run initialises its global model (``Simulator``:
    ``torch.manual_seed(seed)``, then ``reset_parameters()`` of every submodule that has one, in module order, then
    the model's ``init_parameters()``), on
    ``model`` itself (a scratch copy: its parameters are overwritten); the global random stream (CPU, and the
    model's CUDA device) is restored afterwards."""
    with torch.no_grad():
        dev = next(model.parameters()).device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            for m in model.modules():
                if m is not model and hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            if hasattr(model, "init_parameters"):  # as the simulator: the model's own init last
                model.init_parameters()
        return flatten_params(model)


class Moon(FedAvg):
    """MOON's client objective and previous-model state over FedAvg's server (module docstring).

    Args:
        mu, tau: l_con's weight (>= 0) and temperature (> 0).
        aggregation, eta_g: FedAvg's (``algorithm.aggregation``, ``algorithm.eta_g``).
        first_previous: ``official`` | ``global``, a first-time participant's previous model.
        projection_dim: P >= 0, the projection head's output width (0: none); needs ``model`` and mu > 0.
        model: the run's model (``BuildContext.model``); the head is attached to it, and ``official`` draws the
            clients' initial networks on a copy of it. May be None only without a head; ``official`` then fails
            when a first-time client trains after round 1.

    Raises:
        ConfigError: a value out of range, or a head the model cannot take (one line naming the key).
    """

    name = "moon"
    needs = Needs(forward_of=(GLOBAL, PREVIOUS))

    def __init__(self, mu: float = 1.0, tau: float = 0.5, aggregation: str = "weighted", eta_g: float = 1.0,
                 first_previous: str = "official", projection_dim: int = 0, model: Optional[torch.nn.Module] = None):
        super().__init__(aggregation, eta_g)
        p = checked(MoonParams, "algorithm.moon", mu=float(mu), tau=float(tau), first_previous=str(first_previous),
                    projection_dim=projection_dim)
        _check_head(p.projection_dim, p.mu)
        self.mu, self.tau, self.first_previous, self.projection_dim = p.mu, p.tau, p.first_previous, p.projection_dim
        if self.projection_dim:
            if model is None:
                raise ConfigError(f"algorithm.moon.projection_dim={self.projection_dim} needs the model to attach "
                                  "the head to")
            attach_projection_head(model, self.projection_dim)
        # a scratch copy for the clients' initial networks (official), made after the head is attached
        self._scratch = copy.deepcopy(model) if (model is not None and self.first_previous == "official") else None

    def shown(self):
        return ((("mu", f"{self.mu:g}"), ("tau", f"{self.tau:g}"))
                + ((("P", self.projection_dim),) if self.projection_dim else ())
                + ((("first_previous", "global"),) if self.first_previous == "global" else ()))

    def init_client_state(self, global_flat):
        if self.first_previous == "global":
            return {"prev": global_flat.clone()}
        return {"prev": global_flat.clone(), "fresh": torch.ones((), dtype=global_flat.dtype,
                                                                  device=global_flat.device)}

    def client_begin(self, ctx, probe):
        """``official``: a client that has never trained gets its own initial network as ``prev`` (from round 2 on;
        round 1 uses no negative)."""
        state = ctx.state
        if state is None or "fresh" not in state or ctx.round.round <= 1 or not bool(state["fresh"]):
            return
        if self._scratch is None:
            raise ValueError("algorithm.moon.first_previous=official: the rule was built without its model, so it "
                             "cannot draw a client's initial network")
        seed = derive_seed("moon-init", int(ctx.round.seed), int(ctx.client_id))
        state["prev"] = initial_vector(self._scratch, seed).to(state["prev"].device, state["prev"].dtype)

    def local_objective(self, ctx, params, logits, features, y):
        if self.mu == 0.0:
            return Objective(logits)
        out = ctx.reference_outputs
        z, z_glob = features, out[GLOBAL][1]
        no_negative = self.first_previous == "official" and ctx.round.round <= 1  # the authors' empty pool
        z_prev = None if no_negative else out[PREVIOUS][1]
        if self.projection_dim:
            spec = ctx.round.spec
            z = project(params, z)
            z_glob = project(spec.views(ctx.round.global_flat), z_glob)
            z_prev = None if z_prev is None else project(spec.views(ctx.state["prev"]), z_prev)
        per_sample = contrastive_loss(z, z_glob, z_prev, self.tau)
        w = ctx.sample_weight  # vectorised executor: 0 marks padding samples
        mean = per_sample.mean() if w is None else (per_sample * w).sum() / w.sum().clamp_min(1.0)
        return Objective(logits, self.mu * mean)

    def finish_client(self, ctx, update):
        ctx.state["prev"] = ctx.round.global_flat + update.delta  # the model this client trained
        if "fresh" in ctx.state:
            ctx.state["fresh"] = torch.zeros_like(ctx.state["fresh"])
        return update


def _check_head(projection_dim: int, mu: float) -> None:
    if projection_dim and mu == 0:
        raise ConfigError(f"algorithm.moon.projection_dim={projection_dim} needs algorithm.moon.mu > 0: the head is "
                          "trained by l_con alone (set algorithm.moon.projection_dim=0 for mu = 0)")


def _check(a, prefix: str) -> None:
    m = a.moon
    _check_head(int(m.projection_dim), float(m.mu))


register(Rule(
    name="moon", kind="base", label="MOON", citation="Li, He and Song, CVPR 2021, Eq. (2)-(3)",
    summary="model-contrastive loss: local features pulled to the global model's, pushed from the previous local one",
    params=MoonParams, neutral=("algorithm.moon.mu=0",), check=_check,
    prepare_model=lambda p, model: attach_projection_head(model, int(p.projection_dim)) if p.projection_dim else None,
    build=lambda p, ctx: Moon(p.mu, p.tau, ctx.aggregation, ctx.eta_g, p.first_previous, p.projection_dim,
                              ctx.model)))
