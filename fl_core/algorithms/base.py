"""The algorithm interface: a rule is a small object of nine hooks the engine calls, and two declarations.

The engine never branches on rule names. The hooks (:data:`HOOKS`; docs/architecture.md, "The parts of a rule"),
with the shapes they see (d: model size, B: batch, C: classes, P: parameter tensors, |S|: the round's clients):

=====================  ===============================================================================================
state                  ``init_server_state(global [d]) -> {name: tensor}``; ``init_client_state(global [d]) ->
                       {name: tensor} | None`` (a client's state before its first participation, store-backed)
client init            ``broadcast(server_state) -> {name: tensor}`` (``RoundContext.extra``, sent with the model);
                       ``client_begin(ctx, probe)``: once per client before its first step; sets the client's
                       local-step plan on ``ctx`` (``ctx.lr_scale``: per-element step sizes, ``ctx.step_mask``:
                       which of the P tensors move at step k)
client objective       ``local_objective(ctx, params, logits [B, C], features [B, f], y [B]) -> Objective`` (the
                       logits the cross-entropy sees, the rule's extra loss terms: a scalar or None)
client step            ``local_step(ctx, k, params, grads)``: edits the gradients in place before clipping and the
                       SGD step (vectorised: a leading client dim [C, ...])
client final           ``finish_client(ctx, update) -> ClientUpdate``: the message (``update.sent`` counts it) and
                       the client's new state (``ctx.state``, in place)
server                 ``aggregate(rctx, server_state, updates) -> ServerStep`` (the new model [d], the new state,
                       the pseudo-gradient D [d] a server optimiser takes, the round's metrics, the model to evaluate)
after training         ``post_training(post) -> [d] | None``
=====================  ===============================================================================================

One local step of client i at step k (1-indexed, counted across epochs; docs/algorithms.md, One local step), the
same in both executors (:func:`fl_core.engine.executors.step_loss` composes the loss once)::

    logits_ce, extra = algo.local_objective(ctx, params, logits, features, y)      # model(x) = (logits, features)
    loss  = CE(logits_ce, y) + extra + model.penalty(params)
    algo.local_step(ctx, k, params, grads)
    mask  = ctx.step_mask(k) if ctx.step_mask else None   # which parameter tensors may move (None: all)
    clip over trainable params (if configured); SGD step (times ctx.lr_scale) with weight decay on trainable params

Declarations (not hooks): :attr:`Algorithm.needs` (a frozen :class:`Needs`: the executor services the rule asks for;
wrappers combine theirs with the base's automatically), :attr:`Algorithm.compressed_extras` (message parts a
transform treats like the model update), :meth:`Algorithm.comm_floats` (the closed form of what is sent, for tests and
docs; the engine counts what is sent) and :meth:`Algorithm.describe` (a :class:`Description`). FedBug also offers
``schedule_rows`` (a table of its unfreezing schedule, a description the pipeline prints, no engine hook).

Executor services and the general question each answers (docs/architecture.md, Executor services):

- ``Needs.full_gradient``: "what is the gradient of the client's whole local objective at the received model?"
  (``ctx.full_grad``; FedBCGD+'s SVRG control variate today; any variance-reduced local step).
- ``Needs.anchor_gradient``: "what is this step's batch gradient at the received model?" (``ctx.anchor_grads``).
- ``Needs.forward_of``: "what does another parameter vector (the received model, a vector of the client's state)
  output on this step's batch?" (``ctx.reference_outputs``; MOON's contrastive terms; any distillation to a model).
- the ``probe`` of ``client_begin``: "how active is each neuron of the received model on this client's data?"
  (FedNLR's step sizes; any data-dependent client plan).
- ``post_training``: "is there a better model to keep after the last round?" (CCVR's recalibrated classifier).

Message transforms (:mod:`.transforms`: Top-k, QSGD, ...) act on what a client uploads, after the rule's
``finish_client``; they are no rule and have no hooks here.

Wrappers (FedBug, ...) hold a base algorithm and override only the hooks they change; every hook of :data:`HOOKS`
forwards to the base by construction (:class:`Wrapper`), so FedBug(FedProx) composes without either knowing the other
and a new hook needs no edit in :class:`Wrapper`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..lazy import lazy_import
from ..params import ParamSpec

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch

#: The engine's hooks, in the order a round calls them. :class:`Wrapper` forwards each of them to its base.
HOOKS: Tuple[str, ...] = ("init_server_state", "init_client_state", "broadcast", "client_begin", "local_objective",
                          "local_step", "finish_client", "aggregate", "post_training")


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

    In the vectorised executor the hook that runs under ``vmap`` (``local_objective``) see the per-client
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
    # which parameter tensors (ParamSpec order) may move at local step k: step_mask(k) -> [P] bools or None (all);
    # set in client_begin (FedBug's unfreezing, FedBCGD's block), None: all move at every step
    step_mask: Optional[Callable[[int], Optional[Sequence[bool]]]] = None
    # set by the executor when the algorithm asks for them (Needs; FedBCGD+, docs/algorithms.md, FedBCGD+):
    full_grad: Optional[torch.Tensor] = None  # [d] (vectorised: [C, d]) full-batch gradient at the received model
    anchor_grads: Optional[Dict[str, torch.Tensor]] = None  # this step's batch gradient at the received model
    # set by the executor before every local_objective when the rule names vectors in ``forward_of``:
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


@dataclass(frozen=True)
class Needs:
    """The executor services a rule asks for (module docstring: the general question each answers). A wrapper's
    needs are its own combined with its base's (:meth:`combine`), so a stack asks for what any of its rules asks for.

    Attributes:
        full_gradient: set ``ctx.full_grad`` [d] (vectorised [C, d]) before the first step: the gradient of the
            client's mean local objective over ALL its samples at the received model (train mode, no augmentation).
        anchor_gradient: set ``ctx.anchor_grads`` (name -> tensor) before every ``local_step``: the same step's
            mini-batch gradient (same augmentation) at the received model.
        forward_of: vectors whose forward pass the objective uses: ``global`` (the received model) or
            ``state:<key>`` (``ctx.state[<key>]`` [d]); before every ``local_objective`` the executor sets
            ``ctx.reference_outputs[entry] = (logits [B, C], features [B, f])`` (same batch and augmentation, eval
            mode, no gradient).
        vectorizable: the client-side hooks also run in the vectorised executor: ``local_objective`` and
            ``local_step`` work under ``torch.func.vmap`` (per-client values from ``ctx.label_counts`` /
            ``ctx.state`` tensors, never from Python ints of the context) and ``ctx.step_mask`` is a plain function
            of k.
    """

    full_gradient: bool = False
    anchor_gradient: bool = False
    forward_of: Tuple[str, ...] = ()
    vectorizable: bool = True

    def combine(self, other: "Needs") -> "Needs":
        """What a stack of two rules needs: either's services, both vectorizable."""
        return Needs(self.full_gradient or other.full_gradient, self.anchor_gradient or other.anchor_gradient,
                     tuple(dict.fromkeys(self.forward_of + other.forward_of)),
                     self.vectorizable and other.vectorizable)


class Objective(NamedTuple):
    """What :meth:`Algorithm.local_objective` returns: the logits [B, C] the cross-entropy is computed on (FedRS,
    FedLC change them; training only) and the rule's extra loss terms (a scalar, or None)."""

    logits: Any
    extra: Any = None


@dataclass
class ServerStep:
    """What :meth:`Algorithm.aggregate` returns.

    Attributes:
        model: [d] the new global model.
        state: the rule's new server state.
        direction: [d] the pseudo-gradient D when the server step is a step along one direction (FedAvg: the
            weighted mean of the Delta_i), which a server optimiser (:mod:`.serveropt`) takes; None for rules
            whose step is not (FedDyn, FedExP, FedDC, FedBCGD), which then refuse ``algorithm.server_opt``.
        metrics: extra per-round metrics (logged with step = round; FedExP's eta_g).
        evaluate: [d] the model to evaluate after the round (None: ``model``; FedDyn's ``sel``).
    """

    model: Any
    state: Dict[str, Any]
    direction: Any = None
    metrics: Dict[str, float] = field(default_factory=dict)
    evaluate: Any = None

    def eval_model(self):
        return self.model if self.evaluate is None else self.evaluate

    def __iter__(self):
        """A ServerStep unpacks as ``(model, state)`` (``new, state = algo.aggregate(...)``)."""
        return iter((self.model, self.state))

    def __getitem__(self, i):
        return (self.model, self.state)[i]


def plain_step(rctx: RoundContext, direction, state: Dict[str, Any], eta_g: float = 1.0,
               metrics: Optional[Dict[str, float]] = None) -> ServerStep:
    """The plain server step ``theta <- theta + eta_g D`` on the pseudo-gradient D [d]."""
    return ServerStep(rctx.global_flat + eta_g * direction, state, direction, dict(metrics or {}))


class Description(str):
    """What :meth:`Algorithm.describe` returns: the text a run shows (``fedbug[P=0.2](fedavg)``) and its structure.

    It is a ``str`` (the text, so metrics files, tags and titles keep it as before) with three read-only
    attributes: ``name`` (the rule's registry name, or a preset's: ``fedavgm``), ``shown`` (ordered (key, value
    text) pairs; key "" for a bare item such as ``ef``) and ``inner`` (the wrapped rule's Description, or None).
    The text is ``name[k1=v1,v2,...](inner)``, the brackets only when something is shown.
    """

    __slots__ = ("name", "shown", "inner")

    def __new__(cls, name: str, shown: Sequence[Tuple[str, Any]] = (), inner: Optional["Description"] = None):
        shown = tuple((str(k), str(v)) for k, v in shown)
        own = str(name) + ("[" + ",".join(f"{k}={v}" if k else v for k, v in shown) + "]" if shown else "")
        self = super().__new__(cls, own if inner is None else f"{own}({inner})")
        object.__setattr__(self, "name", str(name))
        object.__setattr__(self, "shown", shown)
        object.__setattr__(self, "inner", inner)
        return self

    def __setattr__(self, key, value):
        raise AttributeError("Description is read-only")

    def __reduce__(self):
        return (Description, (self.name, self.shown, self.inner))

    def to_dict(self) -> Dict[str, Any]:
        """{"name", "shown": [[key, value], ...], "inner": the inner's dict or None} (JSON-ready)."""
        return {"name": self.name, "shown": [list(kv) for kv in self.shown],
                "inner": None if self.inner is None else self.inner.to_dict()}


class Algorithm:
    """Base class: FedAvg-compatible defaults for every hook (no extra loss, all params train); ``aggregate`` has
    none (FedAvg's is the weighted mean and the plain step)."""

    name = "base"
    needs: Needs = Needs()
    # ``update.extra`` keys that are uploaded vectors of the same size as the model payload and that a message
    # transform (QSGD) compresses too (FedBCGD+'s Delta c): a declaration of the message, no hook
    compressed_extras: Tuple[str, ...] = ()
    # the parameters declared ``param(..., replica=True)`` that ``local_objective`` reads (the batched hook, which
    # runs on the first replica's instance): attributes of this instance, read as a float or, in a population whose
    # replicas differ in them, as each client's 0-dim tensor under vmap (the executor binds them; no Python branch
    # on their value there). Replica parameters read only in the per-replica hooks (client_begin, finish_client,
    # aggregate, ...) are not listed: each replica's own instance holds them.
    replica_params: Tuple[str, ...] = ()

    @property
    def vectorizable(self) -> bool:
        """``needs.vectorizable`` (kept as an attribute: the executor factory reads it)."""
        return self.needs.vectorizable

    def layer_stack(self) -> List["Algorithm"]:
        """This rule and the rules it wraps, outermost first (one instance per layer of the stack)."""
        return [self]

    # ------------------------------------------------------------------ state
    def init_server_state(self, global_flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The server state before round 1 from the initial model [d] (SCAFFOLD's c [d])."""
        return {}

    def init_client_state(self, global_flat: torch.Tensor) -> Optional[Dict[str, torch.Tensor]]:
        """A client's state before its first participation (tensors, each [d] or smaller), or None: no state."""
        return None

    # ------------------------------------------------------------------ client side
    def broadcast(self, server_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Extra tensors the server sends with the model (``RoundContext.extra``; SCAFFOLD's c [d])."""
        return {}

    def client_begin(self, ctx: ClientContext, probe) -> None:
        """Client init: called once per client before its first local step; sets the client's step plan on ``ctx``:
        ``ctx.lr_scale`` (name -> per-element step multipliers, broadcast to the tensor's shape) and
        ``ctx.step_mask`` (k -> [P] bools, None: all tensors move). ``probe()`` returns the received model's mean
        activation per neuron over the client's whole local data (list over ``model.neuron_layers()``, tensors
        [M_l]); FedNLR sets ``ctx.lr_scale`` from it. A wrapper that sets a plan combines it with its base's."""

    def local_objective(self, ctx: ClientContext, params: Dict[str, torch.Tensor], logits: torch.Tensor,
                        features: torch.Tensor, y: torch.Tensor) -> Objective:
        """The rule's part of the local loss on one batch: params name -> tensor (the client's current ones, with
        gradient), logits [B, C], features [B, f], labels y [B]. Returns the logits the cross-entropy sees and the
        extra terms added to it (scalar or None). Runs under ``vmap`` in the vectorised executor."""
        return Objective(logits, None)

    def local_step(self, ctx: ClientContext, k: int, params: Dict[str, torch.Tensor],
                   grads: Dict[str, torch.Tensor]) -> None:
        """Modify the gradients (name -> tensor) of local step k (1-indexed) IN PLACE before masking, clipping and the
        SGD step (SCAFFOLD's correction). In the vectorised executor ``params``, ``grads`` and ``ctx.state`` carry a
        leading client dim [C, ...] and ``ctx`` is the chunk's (``client_id`` -1)."""

    def finish_client(self, ctx: ClientContext, update: ClientUpdate) -> ClientUpdate:
        """Client final: turn the raw local result (``update.delta`` [d]) into the message (parts in
        ``update.extra``, counted in ``update.sent``) and update ``ctx.state`` in place."""
        return update

    # ------------------------------------------------------------------ server side
    def aggregate(self, rctx: RoundContext, server_state: Dict[str, torch.Tensor],
                  updates: List[ClientUpdate]) -> ServerStep:
        """The server's round from the |S| messages: the new model [d] and state, the pseudo-gradient D [d] (None
        when the step is not along one direction), the round's metrics and the model to evaluate (:class:`ServerStep`;
        :func:`plain_step` makes ``theta + eta_g D``)."""
        raise NotImplementedError(f"{self.describe()} has no aggregate")

    def post_training(self, post: "PostTraining") -> Optional[torch.Tensor]:
        """After the last round: an improved model [d] to evaluate and keep (CCVR), or None."""
        return None

    # ------------------------------------------------------------------ declarations (no engine hooks)
    def comm_floats(self, d: int) -> Tuple[float, float]:
        """The closed form of the floats sent (up, down) per participating client per round (docs/algorithms.md,
        Communication accounting); the engine counts what is actually sent (``ClientUpdate.sent`` and the
        broadcast), tests compare the two where the closed form is exact."""
        return float(d), float(d)

    def schedule_rows(self, num_steps: Sequence[int]) -> Optional[List[Dict[str, float]]]:
        """A table describing what the rule does over local steps (FedBug: units per step), or None."""
        return None

    def shown(self) -> Tuple[Tuple[str, Any], ...]:
        """The (key, value text) pairs :meth:`describe` shows after the name (key "" for a bare item)."""
        return ()

    def describe(self) -> Description:
        return Description(self.name, self.shown())


@dataclass
class PostTraining:
    """What :meth:`Algorithm.post_training` may use: the model, the final global vector, the clients' data."""

    model: torch.nn.Module
    global_flat: torch.Tensor
    spec: ParamSpec
    data: Any  # ClientData: x, y, indices, label_counts
    seed: int
    num_classes: int


#: What a :class:`Wrapper` forwards to its base: the hooks and the declarations that are methods.
FORWARDED: Tuple[str, ...] = HOOKS + ("comm_floats", "schedule_rows")


def _forward(hook: str) -> Callable:
    def forward(self, *args, **kwargs):
        return getattr(self.base, hook)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = hook
    forward.__doc__ = f"The base's :meth:`Algorithm.{hook}` (forwarded by :class:`Wrapper`)."
    return forward


class Wrapper(Algorithm):
    """An algorithm that wraps a base algorithm: every hook of :data:`HOOKS` (and ``comm_floats``,
    ``schedule_rows``) is the base's unless the wrapper's class defines it, by construction (the forwarding methods
    are generated from :data:`FORWARDED`). ``own_needs``: the services the wrapper itself asks for, combined with the
    base's; ``describe`` shows the wrapper around its base's description."""

    own_needs: Needs = Needs()

    def __init__(self, base: Algorithm):
        self.base = base

    @property
    def needs(self) -> Needs:  # type: ignore[override]
        return self.base.needs.combine(type(self).own_needs)

    @property
    def compressed_extras(self) -> Tuple[str, ...]:  # type: ignore[override]
        return self.base.compressed_extras

    def describe(self) -> Description:
        return Description(self.name, self.shown(), self.base.describe())

    def layer_stack(self) -> List[Algorithm]:
        return [self] + self.base.layer_stack()


for _hook in FORWARDED:
    setattr(Wrapper, _hook, _forward(_hook))
del _hook


class Transform:
    """A message transform: what a client uploads passes through an ordered list of them after the rule's
    ``finish_client`` (``algorithm.transforms``, first to last; Top-k, QSGD, ...). Each has its own parameters, may
    keep its own client state (keys it adds to the client's state, e.g. Top-k's error-feedback residual [d]),
    rewrites the message's count (``update.sent``: communication stays measured from what is sent) and may report
    round metrics. It is no rule and has no engine hook: :class:`Transformed` applies it inside the stack.
    """

    name = "transform"

    def init_state(self, global_flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The transform's part of a client's initial state (keys of its own), {} for none."""
        return {}

    def apply(self, ctx: ClientContext, update: ClientUpdate, inner: Algorithm) -> ClientUpdate:
        """The message after the transform: ``update`` is what ``inner`` (the rule and the earlier transforms)
        uploads; ``ctx.state`` holds the transform's state. Rewrite ``update.sent`` for what it changes."""
        return update

    def round_metrics(self, rnd: int) -> Dict[str, float]:
        """Metrics of round ``rnd`` over the clients it transformed (e.g. the mean residual norm)."""
        return {}

    def comm_floats(self, inner: Algorithm, d: int) -> Tuple[float, float]:
        """The closed form of (up, down) floats per client and round once the transform acts on ``inner``'s."""
        return inner.comm_floats(d)

    def shown(self) -> Tuple[Tuple[str, Any], ...]:
        return ()


class Transformed(Wrapper):
    """A rule (or an already transformed one) whose message passes through ``transform``: the composition that puts
    a :class:`Transform` into the stack, so the engine applies transforms through the ordinary hooks and knows no
    transform. ``Transformed(Transformed(rule, topk), qsgd)`` is ``algorithm.transforms=[topk,qsgd]``."""

    def __init__(self, base: Algorithm, transform: Transform):
        super().__init__(base)
        self.transform = transform
        self.name = transform.name

    def shown(self):
        return self.transform.shown()

    def init_client_state(self, global_flat):
        state = self.base.init_client_state(global_flat)
        own = self.transform.init_state(global_flat)
        if not own:
            return state
        clash = set(own) & set(state or {})
        if clash:
            raise ValueError(f"{self.name}: the rule already keeps a client state {sorted(clash)[0]!r}")
        return {**(state or {}), **own}

    def finish_client(self, ctx, update):
        return self.transform.apply(ctx, self.base.finish_client(ctx, update), self.base)

    def aggregate(self, rctx, server_state, updates):
        step = self.base.aggregate(rctx, server_state, updates)
        own = self.transform.round_metrics(rctx.round)
        if own:
            step.metrics = {**step.metrics, **own}
        return step

    def comm_floats(self, d):
        return self.transform.comm_floats(self.base, d)
