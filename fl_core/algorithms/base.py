"""The algorithm interface: a rule is a small object of hooks the engine calls, grouped in five parts.

The engine never branches on rule names. The parts and their hooks (docs/architecture.md, "The parts of a rule"):

- client objective: ``train_logits`` (the logits the cross-entropy sees) and ``local_loss`` (extra loss terms);
- local update: ``transform_grads`` (gradient transforms), ``update_mask`` (which tensors move),
  ``ctx.lr_scale`` (per-element step sizes, set in ``client_begin``);
- message: ``finish_client`` (what the client uploads, ``ClientUpdate.sent`` counts it; client state);
- aggregator: ``pseudo_gradient`` (the server's direction D from the messages) or a whole ``aggregate``;
- server optimiser: ``algorithm.server_opt`` (:mod:`.serveropt`), composed over any rule that has a
  pseudo-gradient; the plain step is ``theta <- theta + eta_g D``.

One local step of client i at step k (1-indexed, counted across epochs; docs/algorithms.md, One local step)::

    loss  = CE(algo.train_logits(ctx, model(x)), y) + algo.local_loss(ctx, params, logits, features, y)
    grads = algo.transform_grads(ctx, k, params, grads)
    mask  = algo.update_mask(ctx, k)        # which parameter tensors may move (None: all)
    clip over trainable params (if configured); SGD step (times ctx.lr_scale) with weight decay on trainable params

Executor services a rule asks for by declaring them (both executors provide each): ``needs_full_gradient``
(full-batch gradient at the received model), ``needs_anchor_gradient`` (the step's batch gradient at the
received model), ``forward_of`` (a forward pass of another parameter vector on the step's batch), the
``probe`` of ``client_begin`` (activation statistics) and ``post_training`` (a step after the last round).

Wrappers (FedBug, ...) hold a base algorithm and override only the hooks they change, so FedBug(FedProx)
composes without either knowing the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..lazy import lazy_import
from ..params import ParamSpec

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


class InfeasibleSetting(ValueError):
    """A configuration that composes but that the rule cannot run, found once training starts (e.g. FedBug's
    code schedule with P * K_i < M). The message names the offending key; tuners treat it as infeasible."""


@dataclass
class RoundContext:
    """What every client of round ``round`` (1-indexed) receives."""

    round: int
    lr: float  # eta_l of this round (after lr decay)
    global_flat: torch.Tensor  # [d] broadcast model (read-only)
    spec: ParamSpec
    lr0: float = 0.0  # eta_l of round 1 (before decay)
    num_clients: int = 1  # N, all clients of the federation
    mean_client_size: float = 1.0  # mean n_j over all N clients
    sampled: Tuple[int, ...] = ()  # the clients S of this round (sorted)
    seed: int = 0  # the run seed (for algorithm randomness keyed by seed and round)
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)  # algorithm broadcast (e.g. SCAFFOLD's c)
    # client -> its local epochs this round when the round plans them (train.local_epochs_max, train.stragglers;
    # fl_core.engine.localwork); empty: every client runs train.local_epochs
    epochs: Dict[int, int] = field(default_factory=dict)

    def global_params(self) -> Dict[str, torch.Tensor]:
        return self.spec.views(self.global_flat)


@dataclass
class ClientContext:
    """One client's view of the round.

    In the vectorised executor the hooks that run under ``vmap`` (``local_loss``) see the per-client
    values ``num_samples``, ``num_steps``, ``label_counts`` and ``state`` as tensors of that client
    (0-d for the counts) and ``client_id = -1``; ``sample_weight`` [B] then marks padding samples
    with 0. Write hooks with arithmetic that works for both ints and tensors.
    """

    round: RoundContext
    client_id: int
    num_samples: Any  # n_i (int, or 0-d tensor under vmap)
    num_steps: Any  # K_i = E_i * ceil(n_i / B) (E_i: its epochs this round), or train.local_steps when > 0
    label_counts: Optional[torch.Tensor] = None  # [C] local class counts
    state: Optional[Dict[str, torch.Tensor]] = None  # persistent client state (store-backed)
    sample_weight: Optional[torch.Tensor] = None  # [B] 1 for real samples, 0 for padding (vectorised only)
    lr_scale: Optional[Dict[str, torch.Tensor]] = None  # per-parameter lr multipliers (FedNLR), set in client_begin
    # set by the executor when the algorithm asks for them (FedBCGD+, docs/algorithms.md, FedBCGD+):
    full_grad: Optional[torch.Tensor] = None  # [d] (vectorised: [C, d]) full-batch gradient at the received model
    anchor_grads: Optional[Dict[str, torch.Tensor]] = None  # this step's batch gradient at the received model
    # set by the executor before every local_loss when the rule names vectors in ``forward_of``:
    # name -> (logits [B, C], features [B, f]) of that parameter vector on this step's batch (no gradient)
    reference_outputs: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None


@dataclass
class ClientUpdate:
    """What one client hands back to the server.

    ``sent`` counts the message: floats uploaded per part (docs/algorithms.md, Communication accounting). It
    starts as ``{"delta": d}`` (the model update, dense); a rule that uploads more adds its parts
    (``sent["delta_c"] = d``), one that uploads less or compresses rewrites ``sent["delta"]`` (a parameter block,
    2k for Top-k). The round's uplink is the mean of :meth:`up_floats` over its clients.
    """

    client_id: int
    num_samples: int
    num_steps: int
    delta: torch.Tensor  # [d] theta_i - theta (after - received)
    train_loss: float  # mean task loss (CE) over the client's local steps
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    sent: Dict[str, float] = field(default_factory=dict)  # floats uploaded per message part

    def __post_init__(self):
        self.sent.setdefault("delta", float(self.delta.numel()))

    def up_floats(self) -> float:
        """Floats this client uploads this round: the sum over the parts of its message."""
        return float(sum(self.sent.values()))


class Algorithm:
    """Base class: FedAvg-compatible defaults for every hook (no extra loss, all params train).

    ``vectorizable``: the client-side hooks also run in the vectorised executor, i.e.
    ``local_loss`` and ``transform_grads`` work under ``torch.func.vmap`` (per-client values come
    from ``ctx.label_counts`` / ``ctx.state`` tensors, never from Python ints of the context) and
    ``update_mask`` is a plain function of (ctx, k).
    """

    name = "base"
    vectorizable = True
    # executor services (FedBCGD+'s SVRG client, docs/algorithms.md, FedBCGD+): ``needs_full_gradient`` makes the
    # executor set ``ctx.full_grad`` (mean training loss over ALL the client's samples, at the received model, train
    # mode, no augmentation) before the first step; ``needs_anchor_gradient`` makes it set ``ctx.anchor_grads`` (the
    # same step's mini-batch, same augmentation, at the received model) before every ``transform_grads``.
    needs_full_gradient = False
    needs_anchor_gradient = False
    # executor service "forward pass of another parameter vector": each entry names a vector, ``global`` (the
    # received model) or ``state:<key>`` (the vector ``ctx.state[<key>]`` [d] of the client's state); before every
    # ``local_loss`` the executor sets ``ctx.reference_outputs[entry] = (logits, features)`` of that vector on the
    # step's batch (same augmentation, eval mode, no gradient; MOON's global and previous local model)
    forward_of: Tuple[str, ...] = ()
    # ``update.extra`` keys that are uploaded vectors of the same size as the model payload and that
    # an uplink quantiser (QSGD) compresses too (FedBCGD+'s Delta c)
    compressed_extras: Tuple[str, ...] = ()

    # ------------------------------------------------------------------ state
    def init_server_state(self, global_flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {}

    def init_client_state(self, global_flat: torch.Tensor) -> Optional[Dict[str, torch.Tensor]]:
        return None

    # ------------------------------------------------------------------ client side
    def broadcast(self, server_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Extra tensors the server sends with the model (``RoundContext.extra``; SCAFFOLD's c)."""
        return {}

    def client_begin(self, ctx: ClientContext, probe) -> None:
        """Called once per client before its first local step. ``probe()`` returns the received global
        model's mean activation per neuron over the client's whole local data (list over
        ``model.neuron_layers()``, tensors [M_l]); FedNLR sets ``ctx.lr_scale`` from it."""

    def train_logits(self, ctx: ClientContext, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, C] the local cross-entropy is computed on (FedRS, FedLC); training only."""
        return logits

    def local_loss(self, ctx: ClientContext, params: Dict[str, torch.Tensor], logits: torch.Tensor,
                   features: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """Extra loss terms added to the mean cross-entropy (scalar), or None."""
        return None

    def transform_grads(self, ctx: ClientContext, k: int, params: Dict[str, torch.Tensor],
                        grads: Dict[str, torch.Tensor]) -> None:
        """Modify gradients IN PLACE before masking, clipping and the SGD step (SCAFFOLD's correction).
        In the vectorised executor ``grads`` and ``ctx.state`` carry a leading client dim [C, ...]."""

    def update_mask(self, ctx: ClientContext, k: int) -> Optional[Sequence[bool]]:
        """Per parameter tensor (ParamSpec order): may it move at local step k? None = all may."""
        return None

    def finish_client(self, ctx: ClientContext, update: ClientUpdate) -> ClientUpdate:
        """Turn the raw local result into the message (and update ``ctx.state`` in place)."""
        return update

    # ------------------------------------------------------------------ server side
    def aggregation_weights(self, updates: List[ClientUpdate]) -> torch.Tensor:
        raise NotImplementedError

    def pseudo_gradient(self, rctx: RoundContext, server_state: Dict[str, torch.Tensor],
                        updates: List[ClientUpdate]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The aggregator: the server's update direction D [d] from the round's messages (FedAvg: the weighted
        mean of the Delta_i) and the rule's new server state (SCAFFOLD's c). A server optimiser
        (:mod:`.serveropt`, ``algorithm.server_opt``) turns D into the new model; the plain server step is
        ``theta <- theta + eta_g D`` (:meth:`aggregate`). Rules whose server step is not a step along one
        direction (FedDyn, FedExP, FedDC, FedBCGD) override :meth:`aggregate` instead and have none."""
        raise NotImplementedError(f"{self.describe()} has no pseudo-gradient (it does not take algorithm.server_opt)")

    def aggregate(self, rctx: RoundContext, server_state: Dict[str, torch.Tensor],
                  updates: List[ClientUpdate]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Return the new global model [d] and the new server state: by default the plain server step
        ``theta <- theta + eta_g D`` on :meth:`pseudo_gradient` (``self.eta_g``, 1 if the rule has none)."""
        direction, state = self.pseudo_gradient(rctx, server_state, updates)
        return rctx.global_flat + getattr(self, "eta_g", 1.0) * direction, state

    def comm_floats(self, d: int) -> Tuple[float, float]:
        """The closed form of the floats sent (up, down) per participating client per round (docs/algorithms.md,
        Communication accounting); the engine counts what is actually sent (``ClientUpdate.sent`` and the
        broadcast), tests compare the two where the closed form is exact."""
        return float(d), float(d)

    def eval_flat(self, server_state: Dict[str, torch.Tensor], global_flat: torch.Tensor) -> torch.Tensor:
        """The model [d] to evaluate after a round (default: the broadcast global model)."""
        return global_flat

    def round_metrics(self, rctx: RoundContext, server_state: Dict[str, torch.Tensor],
                      updates: List[ClientUpdate]) -> Dict[str, float]:
        """Extra per-round metrics logged with step = round (e.g. FedExP's eta_g)."""
        return {}

    def post_training(self, post: "PostTraining") -> Optional[torch.Tensor]:
        """After the last round: an improved model [d] to evaluate and keep (CCVR), or None."""
        return None

    def schedule_rows(self, num_steps: Sequence[int]) -> Optional[List[Dict[str, float]]]:
        """A table describing what the algorithm does over local steps (FedBug: units per step), or None."""
        return None

    def describe(self) -> str:
        return self.name


@dataclass
class PostTraining:
    """What :meth:`Algorithm.post_training` may use: the model, the final global vector, the clients' data."""

    model: torch.nn.Module
    global_flat: torch.Tensor
    spec: ParamSpec
    data: Any  # ClientData: x, y, indices, label_counts
    seed: int
    num_classes: int


class Wrapper(Algorithm):
    """An algorithm that wraps a base algorithm; every hook defaults to the base's."""

    def __init__(self, base: Algorithm):
        self.base = base

    @property
    def vectorizable(self) -> bool:  # type: ignore[override]
        return type(self).wrapper_vectorizable and self.base.vectorizable

    wrapper_vectorizable = True

    @property
    def needs_full_gradient(self) -> bool:  # type: ignore[override]
        return self.base.needs_full_gradient

    @property
    def needs_anchor_gradient(self) -> bool:  # type: ignore[override]
        return self.base.needs_anchor_gradient

    @property
    def compressed_extras(self) -> Tuple[str, ...]:  # type: ignore[override]
        return self.base.compressed_extras

    @property
    def forward_of(self) -> Tuple[str, ...]:  # type: ignore[override]
        return self.base.forward_of

    def describe(self) -> str:
        return f"{self.name}({self.base.describe()})"

    def init_server_state(self, global_flat):
        return self.base.init_server_state(global_flat)

    def init_client_state(self, global_flat):
        return self.base.init_client_state(global_flat)

    def local_loss(self, ctx, params, logits, features, y):
        return self.base.local_loss(ctx, params, logits, features, y)

    def transform_grads(self, ctx, k, params, grads):
        self.base.transform_grads(ctx, k, params, grads)

    def broadcast(self, server_state):
        return self.base.broadcast(server_state)

    def client_begin(self, ctx, probe):
        self.base.client_begin(ctx, probe)

    def train_logits(self, ctx, logits):
        return self.base.train_logits(ctx, logits)

    def post_training(self, post):
        return self.base.post_training(post)

    def update_mask(self, ctx, k):
        return self.base.update_mask(ctx, k)

    def finish_client(self, ctx, update):
        return self.base.finish_client(ctx, update)

    def aggregation_weights(self, updates):
        return self.base.aggregation_weights(updates)

    def pseudo_gradient(self, rctx, server_state, updates):
        return self.base.pseudo_gradient(rctx, server_state, updates)

    def aggregate(self, rctx, server_state, updates):
        return self.base.aggregate(rctx, server_state, updates)

    def comm_floats(self, d):
        return self.base.comm_floats(d)

    def eval_flat(self, server_state, global_flat):
        return self.base.eval_flat(server_state, global_flat)

    def round_metrics(self, rctx, server_state, updates):
        return self.base.round_metrics(rctx, server_state, updates)

    def schedule_rows(self, num_steps):
        return self.base.schedule_rows(num_steps)
