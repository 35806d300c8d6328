"""Executors: who trains the sampled clients of a round.

:class:`SequentialExecutor` is the reference: one ``nn.Module`` and one local optimiser (``torch.optim.SGD`` or
``torch.optim.Adam`` semantics, ``train.optimizer``) per client, clients one after another, exactly the local step
of docs/algorithms.md, One local step. Faster executors must reproduce its global parameters (tests compare them).
A client's local epochs this round are ``RoundContext.epochs[cid]`` when the round plans them
(:mod:`.localwork`: drawn epochs, stragglers), else ``train.local_epochs``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..algorithms.base import Algorithm, ClientContext, ClientUpdate, InfeasibleSetting, RoundContext
from ..data import augment
from ..seeding import derive_seeds, torch_generator
from .probes import layer_activation_means
from .state import ClientStateStore, flatten_params, load_flat


def overrides(algo: Algorithm, hook: str) -> bool:
    """Whether ``algo``'s class defines hook ``hook`` other than :class:`Algorithm`'s default (a no-op, or ``None``
    / the update unchanged); a wrapper always counts as defining it (it forwards). The vectorised executor skips
    the per-client calls of a default hook."""
    return getattr(type(algo), hook) is not getattr(Algorithm, hook)


def step_loss(algo: Algorithm, model: torch.nn.Module, ctx: ClientContext, params: Dict[str, torch.Tensor],
              logits: torch.Tensor, features: torch.Tensor, y: torch.Tensor,
              weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The local objective of one batch, composed in this one place for both executors, the full-batch and the anchor
    gradients: (total, ce) with ce the mean cross-entropy on the rule's logits (``algo.local_objective``) and total =
    ce + the rule's extra terms + the model's ``penalty(params)`` (a term of the parameters alone, e.g. a regulariser;
    :class:`~fl_core.models.base.FLModel`). ``weight`` [B] (vectorised executor): per-sample weights, 0 for padding;
    the mean is then over the weighted samples."""
    ce_logits, extra = algo.local_objective(ctx, params, logits, features, y)
    if weight is None:
        ce = F.cross_entropy(ce_logits, y)
    else:
        ce = (F.cross_entropy(ce_logits, y, reduction="none") * weight).sum() / weight.sum().clamp_min(1.0)
    penalty = model.penalty(params) if hasattr(model, "penalty") else None
    if penalty is not None:
        extra = penalty if extra is None else extra + penalty
    return (ce if extra is None else ce + extra), ce


class NonFiniteLossError(RuntimeError):
    """A client's training loss became NaN or infinite."""


def local_steps(num_samples: int, batch_size: int, local_epochs: int) -> int:
    """K_i = E * ceil(n_i / B) (docs/algorithms.md, Notation)."""
    return local_epochs * math.ceil(num_samples / batch_size)


def client_steps(num_samples: int, batch_size: int, local_epochs: int, steps: int = 0) -> int:
    """K_i of a client in one round: ``steps`` when > 0 (``train.local_steps``, LocalSGD; docs/algorithms.md,
    Centralised training and LocalSGD), else E epochs, :func:`local_steps`. An empty client takes no step either
    way (K_i = 0)."""
    if steps < 0:
        raise ValueError(f"train.local_steps must be >= 0, got {steps}")
    if steps > 0:
        return steps if num_samples > 0 else 0
    return local_steps(num_samples, batch_size, local_epochs)


def batch_schedule(seed: int, round_idx: int, client_id: int, num_samples: int, batch_size: int,
                   local_epochs: int, steps: int = 0) -> List[torch.Tensor]:
    """The client's mini-batches for a round: positions into its local index array.

    Each epoch is a fresh permutation of ``range(num_samples)`` cut into batches of ``batch_size``
    (the last one may be smaller), so ``len(result) == local_steps(...)``. With ``steps`` > 0
    (``train.local_steps``) the epochs run on, ignoring ``local_epochs``, until exactly ``steps``
    batches are drawn (the last epoch cut short), so ``len(result) == client_steps(...)``; the first
    batches are those of the E-epoch schedule. The permutations are a pure function of
    ``(seed, round_idx, client_id)``: every executor and a resumed run draw the same.
    """
    g = torch_generator("batches", seed, round_idx, client_id)
    out: List[torch.Tensor] = []
    if num_samples == 0:  # an empty client takes no step (K_i = 0)
        return out
    if steps > 0:
        while len(out) < steps:
            out.extend(torch.randperm(num_samples, generator=g).split(batch_size))
        return out[:steps]
    for _ in range(local_epochs):
        perm = torch.randperm(num_samples, generator=g)
        out.extend(perm.split(batch_size))
    return out


@torch.no_grad()
def sgd_step(named_params, lr: float, weight_decay: float, lr_scale: Optional[Dict[str, torch.Tensor]] = None,
             momentum: float = 0.0, buffers: Optional[Dict[str, torch.Tensor]] = None):
    """One SGD step on the parameters that have a gradient (docs/algorithms.md, One local step).

    ``momentum`` = 0: plain SGD, p <- p - lr * s_p * (grad + wd * p). ``momentum`` = rho > 0: SGD with momentum
    as ``torch.optim.SGD`` (dampening 0, no Nesterov)::

        d_p = grad + wd * p
        buf = d_p at p's first step with a gradient, else rho * buf + d_p
        p  <- p - lr * s_p * buf

    with the buffers in ``buffers`` (name -> tensor of p's shape; filled here, empty at the start of a client's
    local training). ``s_p`` is a per-element learning-rate multiplier set by the rule (``lr_scale[name]``,
    broadcast to p's shape; 1 when absent); it scales the step, not the buffer. Without multipliers this is
    ``torch.optim.SGD`` to the bit, with and without momentum (tested); parameters whose grad is None (frozen)
    get no update, no weight decay and keep their buffer, as in torch.

    Raises:
        ValueError: ``momentum`` > 0 without ``buffers``.
    """
    if momentum and buffers is None:
        raise ValueError("sgd_step: momentum > 0 needs a dict of momentum buffers")
    for name, p in named_params:
        if p.grad is None:
            continue
        d_p = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
        if momentum:
            buf = buffers.get(name)
            if buf is None:
                buf = buffers[name] = torch.clone(d_p).detach()
            else:
                buf.mul_(momentum).add_(d_p)
            d_p = buf
        if lr_scale is not None and name in lr_scale:
            d_p = d_p * lr_scale[name]
        p.add_(d_p, alpha=-lr)


ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults (Kingma & Ba, ICLR 2015, Algorithm 1)
ADAM_EPS = 1e-8
LOCAL_OPTIMIZERS = ("sgd", "adam")


@torch.no_grad()
def adam_step(named_params, lr: float, weight_decay: float, lr_scale: Optional[Dict[str, torch.Tensor]],
              state: Dict[str, Dict[str, torch.Tensor]], betas=ADAM_BETAS, eps: float = ADAM_EPS):
    """One Adam step on the parameters that have a gradient (Kingma & Ba, ICLR 2015, Algorithm 1), written as
    ``torch.optim.Adam`` (no amsgrad, L2 weight decay added to the gradient) computes it on the CPU::

        g = grad + wd * p;   t <- t + 1;   m <- m + (1 - b1) (g - m);   v <- b2 v + (1 - b2) g^2
        p <- p - (lr / (1 - b1^t)) * s_p * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    ``state`` maps a parameter name to its ``{"step": int, "exp_avg": m, "exp_avg_sq": v}`` (p's shape; filled here,
    empty at the start of a client's local training: a new optimiser per client and round). Only a parameter
    with a gradient steps and counts t, so a frozen tensor keeps its moments and its t, as in torch. ``s_p`` is the
    rule's per-element step multiplier (``lr_scale[name]``, broadcast to p's shape; 1 when absent); it scales the
    step, not the moments. Without multipliers this is ``torch.optim.Adam(foreach=False)`` to the bit (tested).
    """
    b1, b2 = betas
    for name, p in named_params:
        if p.grad is None:
            continue
        g = p.grad if weight_decay == 0 else p.grad.add(p, alpha=weight_decay)
        st = state.get(name)
        if st is None:
            st = state[name] = {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        st["step"] += 1
        t = st["step"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = lr / (1 - b1 ** t)
        denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
        if lr_scale is not None and name in lr_scale:
            p.add_(m / denom * lr_scale[name], alpha=-step_size)
        else:
            p.addcdiv_(m, denom, value=-step_size)


def full_gradient(model: torch.nn.Module, algo: Algorithm, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor,
                  chunk: int = 1024) -> torch.Tensor:
    """Gradient [d] of the client's mean training loss over ALL its samples at the model's current parameters.

    The loss is the one a local step minimises (:func:`step_loss`), computed in train mode without augmentation, in chunks of ``chunk`` samples
    weighted by their size (so the result is the gradient of the mean over the n_i samples; the extra
    loss is added per chunk with the same weights). Rules ask for it with ``Needs.full_gradient`` (a
    variance-reduced local step uses it as its control variate). An empty client gets zeros.
    """
    named = list(model.named_parameters())
    params = dict(named)
    model.train()
    for _, p in named:
        p.grad = None
    n = int(y.numel())
    for s in range(0, n, chunk):
        xb, yb = x[s:s + chunk], y[s:s + chunk]
        logits, feats = model.forward_features(xb)
        total, _ = step_loss(algo, model, ctx, params, logits, feats, yb)
        (total * (yb.numel() / n)).backward()
    out = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in named])
    for _, p in named:
        p.grad = None
    return out.detach().clone()


class ClientData:
    """Training data on the device plus each client's index array and label counts."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, client_indices: Sequence, num_classes: int):
        self.x = x  # float32 [N, C, H, W], normalised, on the device
        self.y = y  # int64 [N], on the device
        self.num_classes = num_classes
        self.indices = [torch.as_tensor(ix, dtype=torch.long, device=x.device) for ix in client_indices]
        self.label_counts = [torch.bincount(y[ix], minlength=num_classes) for ix in self.indices]

    def size(self, client_id: int) -> int:
        return int(self.indices[client_id].numel())


class _FeatureForward(torch.nn.Module):
    """Exposes ``model.forward_features`` as ``forward`` for ``torch.func.functional_call``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.forward_features(x)


def reference_vector(entry: str, rctx: RoundContext, state: Optional[Dict[str, torch.Tensor]]) -> torch.Tensor:
    """The parameter vector a ``forward_of`` entry names: ``global`` -> the received model [d];
    ``state:<key>`` -> the client's ``state[<key>]`` ([d], or stacked [C, d] in the vectorised executor).

    Raises:
        ValueError: an entry of another form, or a state key the client's state does not hold.
    """
    if entry == "global":
        return rctx.global_flat
    if entry.startswith("state:") and state is not None and entry[6:] in state:
        return state[entry[6:]]
    raise ValueError(f"forward_of entry {entry!r}: expected 'global' or 'state:<key>' of the client's state "
                     f"(keys: {', '.join(state or {}) or 'none'})")


class Executor:
    """What every executor shares: the model, the algorithm stack, the data and the local-step settings."""

    name = "executor"
    reason = ""  # why this executor was chosen (set by the factory, logged as an MLflow tag)

    def __init__(self, model: torch.nn.Module, algorithm: Algorithm, data: ClientData, *, batch_size: int,
                 local_epochs: int, weight_decay: float = 0.0, grad_clip: Optional[float] = None, seed: int = 0,
                 augmentation: str = "none", crop_padding: int = 4, local_steps: int = 0, momentum: float = 0.0,
                 optimizer: str = "sgd"):
        if local_steps < 0:
            raise ValueError(f"train.local_steps must be >= 0, got {local_steps}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"train.momentum must be in [0, 1), got {momentum}")
        if optimizer not in LOCAL_OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(LOCAL_OPTIMIZERS)}, got {optimizer!r}")
        if optimizer != "sgd" and momentum:
            raise ValueError(f"train.momentum={momentum} is for train.optimizer=sgd, got train.optimizer={optimizer}")
        if augmentation not in augment.MODES:
            raise ValueError(f"train.augmentation must be one of {', '.join(augment.MODES)}, got {augmentation!r}")
        self.augmentation = augmentation
        self.crop_padding = crop_padding
        self.model = model
        self.algo = algorithm
        self.needs = algorithm.needs  # the stack's executor services, fixed once it is built: read per step
        self.data = data
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.local_steps = local_steps  # > 0: exactly this many steps per client and round instead of E epochs
        self.weight_decay = weight_decay
        self.momentum = float(momentum)  # rho of the local SGD (sgd_step); 0: plain SGD
        self.optimizer = optimizer  # the local optimiser: sgd (sgd_step) or adam (adam_step)
        self.grad_clip = grad_clip
        self.seed = seed
        self._fwd = _FeatureForward(model)
        # n_i and K_i of every client (fixed for the run): one list look-up per client and round
        self._sizes = [int(ix.numel()) for ix in data.indices]
        self._steps = [client_steps(n, batch_size, local_epochs, local_steps) for n in self._sizes]

    @torch.no_grad()
    def forward_at(self, spec, flat: torch.Tensor, x: torch.Tensor):
        """(logits, features) of the model with parameters ``flat`` [d] on ``x`` [B, ...] (eval mode, no gradient;
        the model's own parameters are untouched): the executor service behind ``Needs.forward_of``."""
        training = self.model.training
        self.model.eval()
        try:
            views = {f"model.{n}": v for n, v in spec.views(flat).items()}
            return torch.func.functional_call(self._fwd, views, (x,))
        finally:
            self.model.train(training)

    def reference_outputs(self, ctx: ClientContext, x: torch.Tensor):
        """``ctx.reference_outputs`` of this step's batch ``x``: entry -> (logits, features) for every entry of
        ``algo.needs.forward_of`` (:func:`reference_vector`), or None when the rule names none."""
        if not self.needs.forward_of:
            return None
        return {e: self.forward_at(ctx.round.spec, reference_vector(e, ctx.round, ctx.state), x)
                for e in self.needs.forward_of}

    def epochs_of(self, rctx: RoundContext, cid: int) -> int:
        """Client ``cid``'s local epochs in round ``rctx``: the round's plan (``rctx.epochs``) or E."""
        return rctx.epochs.get(cid, self.local_epochs) if rctx.epochs else self.local_epochs

    def steps_of(self, rctx: RoundContext, cid: int) -> int:
        """K_i of client ``cid`` in round ``rctx`` (:func:`client_steps` with its epochs this round)."""
        if rctx.epochs and cid in rctx.epochs:
            return client_steps(self._sizes[cid], self.batch_size, rctx.epochs[cid], self.local_steps)
        return self._steps[cid]

    def client_context(self, rctx: RoundContext, cid: int, store: ClientStateStore) -> ClientContext:
        """Client ``cid``'s context for the round, with its stored state (or the algorithm's initial one)."""
        cid = int(cid)
        state = store.get(cid, lambda: self.algo.init_client_state(rctx.global_flat))
        if state is not None:  # the store may live in host memory; compute where the data is
            state = {k: v.to(self.data.x.device) for k, v in state.items()}
        return ClientContext(round=rctx, client_id=cid, num_samples=self._sizes[cid],
                             num_steps=self.steps_of(rctx, cid), label_counts=self.data.label_counts[cid], state=state)

    def client_contexts(self, rctx: RoundContext, ids: Sequence[int], store: ClientStateStore) -> List[ClientContext]:
        """:meth:`client_context` of every client of ``ids`` (ints), in order. When the rule keeps no client state
        (an empty store and ``init_client_state`` None) every state is None without a store look-up per client."""
        if len(store) == 0 and self.algo.init_client_state(rctx.global_flat) is None:
            sizes, counts = self._sizes, self.data.label_counts
            steps = [self.steps_of(rctx, c) for c in ids] if rctx.epochs else [self._steps[c] for c in ids]
            return [ClientContext(round=rctx, client_id=c, num_samples=sizes[c], num_steps=k,
                                  label_counts=counts[c]) for c, k in zip(ids, steps)]
        return [self.client_context(rctx, c, store) for c in ids]

    def batches(self, rctx: RoundContext, ctx: ClientContext) -> List[torch.Tensor]:
        """Client ``ctx``'s mini-batches of the round (:func:`batch_schedule`; ``len == ctx.num_steps``)."""
        return batch_schedule(self.seed, rctx.round, ctx.client_id, ctx.num_samples, self.batch_size,
                              self.epochs_of(rctx, ctx.client_id), self.local_steps)

    def run_round(self, rctx: RoundContext, client_ids: Sequence[int], store: ClientStateStore) -> List[ClientUpdate]:
        raise NotImplementedError

    def probe(self, cid: int):
        """A callable giving ``(means, spatial)`` of the current ``self.model`` over client ``cid``'s data
        (:func:`~fl_core.engine.probes.layer_activation_means`)."""
        return lambda: layer_activation_means(self.model, self.data.x[self.data.indices[cid]])

    def augment_params(self, rctx: RoundContext, cid: int, k: int,
                       seed: Optional[int] = None) -> Optional[augment.AugmentParams]:
        """Augmentation draws of client ``cid``'s k-th local step (1-indexed), or None without augmentation;
        ``seed``: the run seed of the client's replica in a population (default: this executor's)."""
        if self.augmentation == "none":
            return None
        return augment.draw(self.augmentation, self.batch_size, self.crop_padding,
                            self.seed if seed is None else seed, rctx.round, cid, k)


class SequentialExecutor(Executor):
    """Trains clients one after another with a plain module and torch.optim.SGD (the reference)."""

    name = "sequential"

    def run_round(self, rctx: RoundContext, client_ids: Sequence[int], store: ClientStateStore) -> List[ClientUpdate]:
        """Train every client in ``client_ids`` from ``rctx.global_flat`` and return their updates.

        Raises:
            NonFiniteLossError: a client's loss became NaN/inf (names round and client).
        """
        updates = []
        for cid in client_ids:
            ctx = self.client_context(rctx, cid, store)
            update = self._train_client(ctx)
            update = self.algo.finish_client(ctx, update)
            store.put(int(cid), ctx.state)
            updates.append(update)
        return updates

    def _train_client(self, ctx: ClientContext) -> ClientUpdate:
        model, algo, data = self.model, self.algo, self.data
        rctx = ctx.round
        load_flat(model, rctx.global_flat)
        algo.client_begin(ctx, self.probe(ctx.client_id))
        idx = data.indices[ctx.client_id]
        if self.needs.full_gradient:
            ctx.full_grad = full_gradient(model, algo, ctx, data.x[idx], data.y[idx])
        anchor = self._anchor_model(rctx) if self.needs.anchor_gradient else None
        model.train()
        named = list(model.named_parameters())
        params: Dict[str, torch.Tensor] = dict(named)
        batches = self.batches(rctx, ctx)
        bufs: Dict[str, torch.Tensor] = {}  # momentum buffers: new for every client and round
        moments: Dict[str, Dict[str, torch.Tensor]] = {}  # Adam's state: new for every client and round
        loss_sum = torch.zeros((), dtype=data.x.dtype, device=data.x.device)
        for k, pos in enumerate(batches, start=1):
            mask = ctx.step_mask(k) if ctx.step_mask is not None else None
            for j, (_, p) in enumerate(named):
                p.requires_grad_(True if mask is None else bool(mask[j]))
            b = idx[pos.to(idx.device)]
            x, y = data.x[b], data.y[b]
            aug = self.augment_params(rctx, ctx.client_id, k)
            if aug is not None:
                x = augment.apply(x, aug, self.crop_padding)
            ctx.reference_outputs = self.reference_outputs(ctx, x)
            logits, feats = model.forward_features(x)
            total, loss = step_loss(algo, model, ctx, params, logits, feats, y)
            for _, p in named:
                p.grad = None
            total.backward()
            trainable = [p for _, p in named if p.grad is not None]
            if anchor is not None:
                ctx.anchor_grads = self._anchor_grads(anchor, ctx, x, y)
            algo.local_step(ctx, k, params, {n: p.grad for n, p in named if p.grad is not None})
            if self.grad_clip is not None and trainable:
                torch.nn.utils.clip_grad_norm_(trainable, self.grad_clip)
            if self.optimizer == "adam":
                adam_step(named, rctx.lr, self.weight_decay, ctx.lr_scale, moments)
            else:
                sgd_step(named, rctx.lr, self.weight_decay, ctx.lr_scale, self.momentum, bufs)
            loss_sum += loss.detach()
        for _, p in named:
            p.requires_grad_(True)
        mean_loss = float(loss_sum) / max(1, len(batches))
        if not math.isfinite(mean_loss):
            raise NonFiniteLossError(f"non-finite training loss ({mean_loss}) in round {rctx.round}, "
                                     f"client {ctx.client_id}")
        delta = flatten_params(model) - rctx.global_flat
        return ClientUpdate(ctx.client_id, ctx.num_samples, len(batches), delta, mean_loss)

    def _anchor_model(self, rctx: RoundContext) -> torch.nn.Module:
        """A second copy of the model holding the received global parameters (for ``ctx.anchor_grads``)."""
        if getattr(self, "_anchor", None) is None:
            self._anchor = copy.deepcopy(self.model)
        load_flat(self._anchor, rctx.global_flat)
        self._anchor.train()
        return self._anchor

    def _anchor_grads(self, anchor: torch.nn.Module, ctx: ClientContext, x: torch.Tensor,
                      y: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Gradient of the step's training loss on batch (x, y) at the received model, by parameter name."""
        named = list(anchor.named_parameters())
        logits, feats = anchor.forward_features(x)
        total, _ = step_loss(self.algo, anchor, ctx, dict(named), logits, feats, y)
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
        return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(named, grads)}


EXECUTORS = {"sequential": SequentialExecutor}


@dataclass
class _Chunk:
    """One chunk of clients in :class:`VectorizedExecutor`, stacked [C, ...] while its local steps run."""

    rctx: RoundContext
    ctxs: List[ClientContext]
    params: Dict[str, torch.Tensor]  # the clients' parameters [C, *shape]
    lr_scale: Dict[str, torch.Tensor]  # step-size multipliers [C, *shape] of the tensors some client scales
    steps: torch.Tensor  # K_i [C]
    client: Dict[str, Any]  # per-client values vmap slices: num_samples, num_steps, label_counts, state, ...
    pos: torch.Tensor  # batch positions [C, Kmax, B] (:meth:`VectorizedExecutor._schedule`)
    w: torch.Tensor  # sample weights [C, Kmax, B], 0 = padding
    kmax: int
    batched_ctx: ClientContext  # the hooks' context of all C clients at once
    anchor: Optional[Dict[str, torch.Tensor]]  # the received parameters [C, *shape] (needs.anchor_gradient)
    loss_sum: torch.Tensor  # [C]
    bufs: Dict[str, torch.Tensor]  # momentum buffers [C, *shape]
    moments: Dict[str, tuple]  # Adam's (m, v, step count [C]) per tensor
    masked: bool  # some client has a step mask
    population: bool = False  # the clients come from the rounds of several replicas (:meth:`run_population`)
    weight_decay: Any = 0.0  # the L2 coefficient: one float, or [C] (a population over train.weight_decay)
    # run_population: a client whose step plan raises InfeasibleSetting ends its replica alone (recorded in failed:
    # position in the chunk -> the error); run_round: it is raised
    isolated: bool = False
    failed: Dict[int, BaseException] = dataclasses.field(default_factory=dict)


@dataclass
class PopulationJob:
    """One replica's share of a population round (:meth:`VectorizedExecutor.run_population`): its own executor
    (its rule stack's instance and seed), its round's context, the clients it trains and its client-state store."""

    executor: "VectorizedExecutor"
    rctx: RoundContext
    client_ids: Sequence[int]
    store: ClientStateStore


class VectorizedExecutor(Executor):
    """Trains the sampled clients of a round together: one ``torch.func.vmap``'ed grad step per local step.

    The clients' parameters are stacked ``[C, ...]``. Every local step k gathers each client's
    mini-batch from device-resident data (the same batches as :func:`batch_schedule`, padded to B
    with zero-weight samples), computes all C gradients with ``vmap(grad(loss))``, and applies
    the SGD step where a ``[C, P]`` mask allows it: per-client masks cover unequal step counts K_i
    (a client with fewer steps simply stops moving) and per-client schedules such as gradual unfreezing's
    m(k). With ``train.momentum`` each client keeps its momentum buffers ``[C, ...]`` for the round, and a
    masked tensor keeps its buffer too (:func:`sgd_step`); with ``train.optimizer=adam`` each client keeps its
    moments ``[C, ...]`` and a step count per tensor ``[C]``, which a masked tensor does not advance
    (:func:`adam_step`). Clipping is per client over its trainable tensors,
    as ``clip_grad_norm_`` does.
    Clients are processed in chunks of ``max_parallel_clients`` (0: all at once) to bound memory.

    Matches :class:`SequentialExecutor` up to float32 rounding (tests state the tolerance).
    Needs ``algorithm.vectorizable`` and a model without buffers that change in training (no BatchNorm).
    """

    name = "vectorized"

    def __init__(self, model: torch.nn.Module, algorithm: Algorithm, data: ClientData, *, batch_size: int,
                 local_epochs: int, weight_decay: float = 0.0, grad_clip: Optional[float] = None, seed: int = 0,
                 augmentation: str = "none", crop_padding: int = 4, local_steps: int = 0, momentum: float = 0.0,
                 optimizer: str = "sgd", max_parallel_clients: int = 0):
        if not algorithm.vectorizable:
            raise ValueError(f"engine.executor=vectorized: {algorithm.describe()} has hooks that only run "
                             "sequentially (use engine.executor=sequential or auto)")
        if any(True for _ in model.buffers()):
            raise ValueError("engine.executor=vectorized: the model has buffers (e.g. BatchNorm); use sequential")
        super().__init__(model, algorithm, data, batch_size=batch_size, local_epochs=local_epochs,
                         weight_decay=weight_decay, grad_clip=grad_clip, seed=seed, augmentation=augmentation,
                         crop_padding=crop_padding, local_steps=local_steps, momentum=momentum, optimizer=optimizer)
        self.max_parallel_clients = max_parallel_clients
        self._names = [n for n, _ in model.named_parameters()]
        # every client's index array back to back on the host, and where each starts (the batch schedule)
        self._flat_indices = torch.cat([ix.cpu() for ix in data.indices] or [torch.zeros(0, dtype=torch.long)])
        self._offsets = [0]
        for n in self._sizes[:-1]:
            self._offsets.append(self._offsets[-1] + n)
        # randomness="different": each client draws its own dropout masks (VGG-9); with dropout the two
        # executors agree in distribution only, without it to float rounding.
        self._grad_fn = torch.func.vmap(torch.func.grad(self._loss, has_aux=True), in_dims=(0, 0, 0, 0, 0, None),
                                        randomness="different")

    def _loss(self, params, x, y, w, client, rctx):
        """Loss of one client (vmap removes the leading client dim): mean CE over real samples + hooks. In a
        population the client's own replica's round values (received model, rule broadcast) come in ``client``, and
        the rule parameters in which the replicas differ (``replica_params``) in ``client["hyper"]``, bound to the
        rule stack's layers for the call."""
        hyper = client.get("hyper")
        if not hyper:
            return self._client_loss(params, x, y, w, client, rctx)
        layers = self.algo.layer_stack()
        saved = []
        try:
            for key, value in hyper.items():
                j, attr = key.split(".", 1)
                saved.append((layers[int(j)], attr, getattr(layers[int(j)], attr)))
                setattr(layers[int(j)], attr, value)
            return self._client_loss(params, x, y, w, client, rctx)
        finally:
            for layer, attr, value in reversed(saved):
                setattr(layer, attr, value)

    def _client_loss(self, params, x, y, w, client, rctx):
        if "round" in client:
            rctx = dataclasses.replace(rctx, global_flat=client["round"]["global_flat"],
                                       extra=client["round"]["extra"])
        logits, feats = torch.func.functional_call(self._fwd, {f"model.{n}": p for n, p in params.items()}, (x,))
        ctx = ClientContext(round=rctx, client_id=-1, num_samples=client["num_samples"],
                            num_steps=client["num_steps"], label_counts=client["label_counts"],
                            state=client["state"], sample_weight=w, reference_outputs=client.get("reference_outputs"))
        total, loss = step_loss(self.algo, self.model, ctx, params, logits, feats, y, weight=w)
        return total, loss.detach()

    def run_round(self, rctx: RoundContext, client_ids: Sequence[int], store: ClientStateStore) -> List[ClientUpdate]:
        """Train ``client_ids`` (in chunks) from ``rctx.global_flat``; same contract as the sequential executor."""
        chunk = self.max_parallel_clients or len(client_ids)
        updates: List[ClientUpdate] = []
        for s in range(0, len(client_ids), chunk):
            updates.extend(self._train_chunk(rctx, [int(c) for c in client_ids[s:s + chunk]], store))
        return updates

    def run_population(self, jobs: Sequence[PopulationJob],
                       chunk: Optional[int] = None) -> List[Union[List[ClientUpdate], Exception]]:
        """Train the clients of several replicas' rounds (same model and rule stack, same round number; each
        replica its own received model, rule broadcast, eta_l, weight decay, rule parameters listed in
        ``replica_params``, seed and client states) in one pass: the vmap axis is (replica x client), in chunks of
        ``chunk`` clients (0: all; None: ``max_parallel_clients``). Each client's batches, augmentation and hooks are
        those of its replica (:func:`batch_schedule` with the replica's seed; its own rule instance's
        ``client_begin``, step plan and ``finish_client``), so each replica's updates are those of its own
        :meth:`run_round` up to float rounding.

        Returns:
            per job, its clients' updates in order, or the exception that ends that replica alone: the
            :class:`NonFiniteLossError` of its first client whose loss became non-finite, or the
            :class:`~fl_core.algorithms.base.InfeasibleSetting` its rule raised for one of its clients (in
            ``client_begin`` or its step plan). The other replicas' updates are unaffected.
        """
        ctxs: List[ClientContext] = []
        spans: List[Tuple[int, int]] = []  # each job's clients: ctxs[start:end]
        errors: Dict[int, Exception] = {}  # job -> the exception that ends its replica
        for j, job in enumerate(jobs):
            ex = job.executor
            mine = ex.client_contexts(job.rctx, [int(c) for c in job.client_ids], job.store)
            try:
                ex._begin_clients(job.rctx, mine)
            except InfeasibleSetting as err:  # this replica's setting: it fails alone, its clients do not train
                errors[j], mine = err, []
            spans.append((len(ctxs), len(ctxs) + len(mine)))
            ctxs.extend(mine)
        size = (self.max_parallel_clients if chunk is None else chunk) or len(ctxs) or 1
        hyper = self._replica_values(jobs, spans)
        decay = self._replica_decays(jobs, spans)
        updates: List[ClientUpdate] = []
        bad: Dict[int, Exception] = {}  # position in ctxs -> why its replica fails
        for s in range(0, len(ctxs), size):
            part = ctxs[s:s + size]
            chunk = self._stack_chunk(jobs[0].rctx, part, {k: v[s:s + size] for k, v in hyper.items()},
                                      None if decay is None else decay[s:s + size])
            chunk.isolated = True
            for k in range(chunk.kmax):
                self._chunk_step(chunk, k)
            ups, b = self._chunk_updates(chunk)
            updates.extend(ups)
            for i in b:
                bad.setdefault(s + i, NonFiniteLossError(_non_finite(ups[i].train_loss, part[i].round.round,
                                                                     part[i].client_id)))
            for i, err in chunk.failed.items():
                bad[s + i] = err
        out: List[Union[List[ClientUpdate], Exception]] = []
        for j, (job, (start, end)) in enumerate(zip(jobs, spans)):
            failed = [bad[i] for i in range(start, end) if i in bad]
            if j in errors or failed:
                infeasible = [e for e in failed if isinstance(e, InfeasibleSetting)]
                out.append(errors.get(j) or (infeasible or failed)[0])
            else:
                out.append(job.executor._finish_clients(ctxs[start:end], updates[start:end], job.store))
        return out

    def _replica_decays(self, jobs: Sequence[PopulationJob], spans: List[Tuple[int, int]]) -> Optional[torch.Tensor]:
        """Each client's weight decay [N] (its replica's ``train.weight_decay``) when the replicas of ``jobs`` differ
        in it, else None (this executor's value for all)."""
        values = [float(job.executor.weight_decay) for job in jobs]
        if len(set(values)) < 2:
            return None
        return torch.tensor([v for v, (a, b) in zip(values, spans) for _ in range(b - a)],
                            dtype=self.data.x.dtype, device=self.data.x.device)

    def _replica_values(self, jobs: Sequence[PopulationJob], spans: List[Tuple[int, int]]) -> Dict[str, torch.Tensor]:
        """The rule parameters in which the replicas of ``jobs`` differ (the ``replica_params`` of each layer of the
        rule stack, :meth:`~fl_core.algorithms.base.Algorithm.layer_stack`), per client of the population: ``"<layer>.<attr>"``
        -> [N] (each client its replica's value); {} when the replicas agree (this executor is ``jobs[0]``'s)."""
        lead = self.algo.layer_stack()
        stacks = [job.executor.algo.layer_stack() for job in jobs]
        out: Dict[str, torch.Tensor] = {}
        for j, layer in enumerate(lead):
            for attr in layer.replica_params:
                values = [float(getattr(layers[j], attr)) for layers in stacks]
                if len(set(values)) > 1:
                    out[f"{j}.{attr}"] = torch.tensor([v for v, (a, b) in zip(values, spans) for _ in range(b - a)],
                                                      dtype=self.data.x.dtype, device=self.data.x.device)
        return out

    def local_settings(self) -> Tuple[Any, ...]:
        """What this executor imposes on every client it trains (batch size, local epochs or steps, momentum, local
        optimiser, clipping, augmentation): a population's lead executor trains every replica's clients with its
        own, so replicas must agree on them (:func:`~.population.can_share`); the weight decay may differ (each
        client gets its replica's, :meth:`run_population`)."""
        return (self.batch_size, self.local_epochs, self.local_steps, self.momentum, self.optimizer, self.grad_clip,
                self.augmentation, self.crop_padding)

    def _round_values(self, rctx: RoundContext, ctxs: List[ClientContext]):
        """(the hooks' round context of the chunk, the per-client round values vmap slices or None):
        ``rctx`` itself when every client received it; in a population, its copy with the received models
        [C, d] and the rule's broadcast [C, ...] of each client's replica, and eta_l [C] where the replicas differ."""
        rounds = [c.round for c in ctxs]
        if all(r is rctx for r in rounds):
            return rctx, None
        dev = self.data.x.device
        uniq: Dict[int, RoundContext] = {}
        for r in rounds:
            uniq.setdefault(id(r), r)
        slot = {key: i for i, key in enumerate(uniq)}
        which = torch.tensor([slot[id(r)] for r in rounds], device=dev)
        glob = torch.stack([r.global_flat for r in uniq.values()])[which]  # [C, d]
        extra = {k: torch.stack([r.extra[k] for r in uniq.values()])[which] for k in rctx.extra}
        lrs = [float(r.lr) for r in rounds]
        lr = lrs[0] if len(set(lrs)) == 1 else torch.tensor(lrs, dtype=self.data.x.dtype, device=dev)
        return dataclasses.replace(rctx, global_flat=glob, extra=extra, lr=lr), {"global_flat": glob,
                                                                                 "extra": extra}

    def _schedule(self, rctx: RoundContext, ctxs: List[ClientContext]):
        """Positions [C, Kmax, B] into the training set and sample weights [C, Kmax, B] (0 = padding).

        Client c's row k holds its k-th mini-batch of :func:`batch_schedule` (the same generator, seeded by
        :func:`~fl_core.seeding.derive_seeds` for the whole chunk, and the same permutations), padded with
        weight 0; the per-client Python work is one ``manual_seed`` and one ``randperm`` per epoch, the
        placement is one scatter for the chunk."""
        C, B = len(ctxs), self.batch_size
        steps = [c.num_steps for c in ctxs]
        kmax = max(steps)
        pos = torch.zeros(C * kmax * B, dtype=torch.long)
        w = torch.zeros(C * kmax * B, dtype=self.data.x.dtype)
        seeds = self._batch_seeds(rctx, ctxs)
        g = torch.Generator()  # re-seeded per client: manual_seed resets it whole, as a fresh generator
        perms: List[torch.Tensor] = []
        meta: List[tuple] = []  # per permutation: (row c, its first step, K_i, client offset, n_i)
        for c, (ctx, k_i, s) in enumerate(zip(ctxs, steps, seeds)):
            if k_i == 0:  # an empty client draws nothing (batch_schedule)
                continue
            n = ctx.num_samples
            per_epoch = -(-n // B)
            g.manual_seed(s)
            for e in range(-(-k_i // per_epoch)):  # E epochs, or as many as train.local_steps needs
                perms.append(torch.randperm(n, generator=g))
                meta.append((c, e * per_epoch, k_i, self._offsets[ctx.client_id], n))
        if perms:
            local = torch.cat(perms)  # positions into each client's index array
            rows, first, k_of, off, lens = (torch.tensor(col, dtype=torch.long) for col in zip(*meta))
            j = torch.arange(local.numel()) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)  # within its epoch
            k = torch.repeat_interleave(first, lens) + torch.div(j, B, rounding_mode="floor")
            keep = k < torch.repeat_interleave(k_of, lens)  # train.local_steps cuts the last epoch short
            lin = ((torch.repeat_interleave(rows, lens) * kmax + k) * B + j % B)[keep]
            pos[lin] = self._flat_indices[torch.repeat_interleave(off, lens) + local][keep]
            w[lin] = 1.0
        dev = self.data.x.device
        return pos.view(C, kmax, B).to(dev), w.view(C, kmax, B).to(dev), kmax

    def _batch_seeds(self, rctx: RoundContext, ctxs: List[ClientContext]) -> List[int]:
        """Each client's batch-generator seed of the round (:func:`batch_schedule`): keyed by its replica's run
        seed in a population, by this executor's otherwise."""
        if all(c.round is rctx for c in ctxs):
            return derive_seeds(("batches", self.seed, rctx.round), [c.client_id for c in ctxs]).tolist()
        seeds = [0] * len(ctxs)
        rows: Dict[int, List[int]] = {}
        for i, c in enumerate(ctxs):
            rows.setdefault(int(c.round.seed), []).append(i)
        for run_seed, ix in rows.items():
            vals = derive_seeds(("batches", run_seed, rctx.round), [ctxs[i].client_id for i in ix]).tolist()
            for i, v in zip(ix, vals):
                seeds[i] = v
        return seeds

    def _stacked_reference_outputs(self, batched_ctx: ClientContext, x: torch.Tensor):
        """:meth:`reference_outputs` of every client of the chunk at once: x [C, B, ...] -> entry -> (logits
        [C, B, K], features [C, B, f]), each client's from its own vector (the global one is shared)."""
        rctx = batched_ctx.round
        out = {}
        for e in self.needs.forward_of:
            vec = reference_vector(e, rctx, batched_ctx.state)
            if vec.dim() == 1:  # one vector for all clients
                out[e] = torch.func.vmap(lambda xb, v=vec: self.forward_at(rctx.spec, v, xb))(x)
            else:
                out[e] = torch.func.vmap(lambda v, xb: self.forward_at(rctx.spec, v, xb))(vec, x)
        return out

    def _train_chunk(self, rctx: RoundContext, ids: List[int], store: ClientStateStore) -> List[ClientUpdate]:
        """Train the clients ``ids`` together: begin them, stack them, run local steps 1..Kmax, finish them."""
        ctxs = self.client_contexts(rctx, ids, store)
        self._begin_clients(rctx, ctxs)
        chunk = self._stack_chunk(rctx, ctxs)
        for k in range(chunk.kmax):
            self._chunk_step(chunk, k)
        return self._finish_chunk(chunk, store)

    def _begin_clients(self, rctx: RoundContext, ctxs: List[ClientContext]) -> None:
        """Each client's ``client_begin`` at the received model, and its full local gradient where the rule needs it."""
        data, algo, needs = self.data, self.algo, self.needs
        load_flat(self.model, rctx.global_flat)  # the received model, for client_begin's probe
        for ctx in ctxs if overrides(algo, "client_begin") or needs.full_gradient else ():
            algo.client_begin(ctx, self.probe(ctx.client_id))
            if needs.full_gradient:
                ix = data.indices[ctx.client_id]
                ctx.full_grad = full_gradient(self.model, algo, ctx, data.x[ix], data.y[ix])

    def _stack_chunk(self, rctx: RoundContext, ctxs: List[ClientContext],
                     hyper: Optional[Dict[str, torch.Tensor]] = None,
                     weight_decay: Optional[torch.Tensor] = None) -> _Chunk:
        """The chunk's starting point stacked [C, ...]: the received parameters, step-size multipliers, per-client
        values (with ``hyper``: the rule parameters in which a population's replicas differ, each [C];
        :meth:`_replica_values`; ``weight_decay`` [C]: each client's replica's, where they differ), batch schedule,
        anchor and optimiser state."""
        data, needs, dev = self.data, self.needs, self.data.x.device
        C = len(ctxs)
        rctx, per_client = self._round_values(rctx, ctxs)
        g = rctx.global_params()  # [*shape], or [C, *shape] in a population
        if per_client is None:
            params = {n: g[n].detach().unsqueeze(0).expand(C, *g[n].shape).clone() for n in self._names}
        else:
            params = {n: g[n].detach().clone() for n in self._names}
        lr_scale = self._stacked_lr_scale(ctxs, g)
        steps = torch.tensor([c.num_steps for c in ctxs], device=dev)
        # per-client values as stacked tensors [C, ...] (vmap hands each client its slice)
        dtype = data.x.dtype
        client = {"num_samples": torch.tensor([float(c.num_samples) for c in ctxs], dtype=dtype, device=dev),
                  "num_steps": steps.to(dtype),
                  "label_counts": torch.stack([c.label_counts for c in ctxs]),
                  "state": ({k: torch.stack([c.state[k] for c in ctxs]) for k in ctxs[0].state}
                            if ctxs[0].state is not None else {})}
        if per_client is not None:
            client["round"] = per_client
        if hyper:
            client["hyper"] = hyper
        pos, w, kmax = self._schedule(rctx, ctxs)
        batched_ctx = ClientContext(round=rctx, client_id=-1, num_samples=client["num_samples"],
                                    num_steps=client["num_steps"], label_counts=client["label_counts"],
                                    state=client["state"])
        if needs.full_gradient:
            batched_ctx.full_grad = torch.stack([c.full_grad for c in ctxs])  # [C, d]
        anchor = None
        if needs.anchor_gradient:
            anchor = {n: (g[n].detach().unsqueeze(0).expand(C, *g[n].shape) if per_client is None
                          else g[n].detach()) for n in self._names}
        loss_sum = torch.zeros(C, dtype=dtype, device=dev)
        # momentum buffers [C, *shape], new for every chunk and round; a zero buffer makes the first step's
        # rho * 0 + d_p = d_p, the sequential executor's buf = d_p
        bufs = {n: torch.zeros_like(params[n]) for n in self._names} if self.momentum else {}
        # Adam's moments [C, *shape] and step counts [C] per tensor, new for every chunk and round
        moments = {n: (torch.zeros_like(params[n]), torch.zeros_like(params[n]),
                       torch.zeros(C, dtype=torch.long, device=dev)) for n in self._names} \
            if self.optimizer == "adam" else {}
        return _Chunk(rctx=rctx, ctxs=ctxs, params=params, lr_scale=lr_scale, steps=steps, client=client, pos=pos,
                      w=w, kmax=kmax, batched_ctx=batched_ctx, anchor=anchor, loss_sum=loss_sum, bufs=bufs,
                      moments=moments, masked=any(c.step_mask is not None for c in ctxs),
                      population=per_client is not None,
                      weight_decay=self.weight_decay if weight_decay is None else weight_decay)

    def _stacked_lr_scale(self, ctxs: List[ClientContext], g: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per-client step-size multipliers stacked [C, *shape] for the tensors some client scales; 1 where a
        client has none."""
        lr_scale = {}
        scaled = any(c.lr_scale for c in ctxs)
        shapes = dict(zip(ctxs[0].round.spec.names, ctxs[0].round.spec.shapes)) if scaled else {}
        for n in self._names if scaled else ():
            if any(c.lr_scale and n in c.lr_scale for c in ctxs):
                shape, dtype = tuple(shapes[n]), g[n].dtype
                ones = torch.ones((1,) * len(shape), dtype=dtype, device=self.data.x.device)
                lr_scale[n] = torch.stack([(c.lr_scale[n] if c.lr_scale and n in c.lr_scale else ones)
                                           .to(dtype).expand(shape) for c in ctxs])
        return lr_scale

    def _chunk_step(self, chunk: _Chunk, k: int) -> None:
        """Local step k + 1 of every client: its batch, the gradients under vmap, the step mask, the rule's
        ``local_step``, clipping and the masked update; adds the step's loss of the clients still training."""
        rctx, wk = chunk.rctx, chunk.w[:, k]
        x, y = self._step_batch(chunk, k)
        grads, loss = self._grad_fn(chunk.params, x, y, wk, chunk.client, rctx)
        active = k < chunk.steps  # [C]
        mask = self._step_mask(chunk, k, active)
        if chunk.anchor is not None:
            chunk.batched_ctx.anchor_grads, _ = self._grad_fn(chunk.anchor, x, y, wk, chunk.client, rctx)
        self.algo.local_step(chunk.batched_ctx, k + 1, chunk.params, grads)
        coef = self._clip_coefficients(grads, mask) if self.grad_clip is not None else None
        self._masked_update(chunk, grads, mask, coef)
        chunk.loss_sum += torch.where(active, loss, torch.zeros_like(loss))

    def _step_batch(self, chunk: _Chunk, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every client's mini-batch of step k + 1, (x [C, B, ...], y [C, B]), augmented; sets the reference
        outputs the rule reads on it."""
        b = chunk.pos[:, k]
        x, y = self.data.x[b], self.data.y[b]  # [C, B, ...]
        if self.augmentation != "none":
            aug = augment.stack([self.augment_params(chunk.rctx, ctx.client_id, k + 1,
                                                     ctx.round.seed if chunk.population else None)
                                 for ctx in chunk.ctxs])
            x = augment.apply(x, aug, self.crop_padding)
        if self.needs.forward_of:  # [C, B, ...] per entry; vmap hands each client its slice
            chunk.client["reference_outputs"] = self._stacked_reference_outputs(chunk.batched_ctx, x)
        return x, y

    def _step_mask(self, chunk: _Chunk, k: int, active: torch.Tensor) -> torch.Tensor:
        """Which tensor of which client moves at step k + 1, [C, P]: the clients' step masks, and only clients
        with steps left (``active`` [C])."""
        C, P = len(chunk.ctxs), len(self._names)
        masks = [self._client_mask(chunk, i, k) for i in range(C)] if chunk.masked else [None]
        if all(m is None for m in masks):  # every tensor of every client may move: the mask is `active`
            return active[:, None].expand(C, P)
        mask = torch.tensor([[True] * P if m is None else list(m) for m in masks], device=self.data.x.device)
        mask &= active[:, None]  # [C, P]
        return mask

    def _client_mask(self, chunk: _Chunk, i: int, k: int) -> Optional[Sequence[bool]]:
        """Client ``i``'s step mask at step k + 1 (None: every tensor moves). In a population, a client whose step
        plan raises :class:`~fl_core.algorithms.base.InfeasibleSetting` (its replica's setting) stops moving and is
        recorded in ``chunk.failed``: its replica fails alone (:meth:`run_population`)."""
        ctx = chunk.ctxs[i]
        if i in chunk.failed:
            return [False] * len(self._names)
        if ctx.step_mask is None:
            return None
        try:
            return ctx.step_mask(k + 1)
        except InfeasibleSetting as err:
            if not chunk.isolated:
                raise
            chunk.failed[i] = err
            return [False] * len(self._names)

    def _clip_coefficients(self, grads: Dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Per-client gradient scale [C] of ``clip_grad_norm_`` over the client's trainable tensors."""
        sq = torch.stack([grads[n].pow(2).flatten(1).sum(1) for n in self._names], 1)  # [C, P]
        norm = (sq * mask).sum(1).sqrt()
        return (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)

    def _masked_update(self, chunk: _Chunk, grads: Dict[str, torch.Tensor], mask: torch.Tensor,
                       coef: Optional[torch.Tensor]) -> None:
        """Every tensor's SGD or Adam step where ``mask`` [C, P] lets it move (clipped by ``coef`` [C] if given)."""
        C = len(chunk.ctxs)
        for j, n in enumerate(self._names):
            p, gr = chunk.params[n], grads[n]
            shape = (C,) + (1,) * (p.dim() - 1)
            if coef is not None:
                gr = gr * coef.view(shape)
            d_p = self._decayed(chunk, gr, p, shape)
            moves = mask[:, j].view(shape)
            if self.optimizer == "adam":
                step = self._adam_step(chunk, n, d_p, mask[:, j], moves, shape)
            else:
                step = self._sgd_step(chunk, n, d_p, moves)
            chunk.params[n] = torch.where(moves, p - step, p)

    @staticmethod
    def _decayed(chunk: _Chunk, grad: torch.Tensor, p: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
        """The gradient with the L2 term, grad + wd * p [C, *shape]: one wd for the chunk, or each client's own ([C]
        viewed as ``shape``; a population over ``train.weight_decay``)."""
        wd = chunk.weight_decay
        if isinstance(wd, torch.Tensor):
            return grad + wd.view(shape) * p
        return grad + wd * p if wd else grad

    def _adam_step(self, chunk: _Chunk, n: str, d_p: torch.Tensor, mask_j: torch.Tensor, moves: torch.Tensor,
                   shape: Tuple[int, ...]) -> torch.Tensor:
        """:func:`adam_step` per client for tensor ``n``: its step [C, *shape]; a masked client keeps its moments
        and its step count."""
        m, v, t = chunk.moments[n]
        b1, b2 = ADAM_BETAS
        t = t + mask_j
        m = torch.where(moves, torch.lerp(m, d_p, 1 - b1), m)
        v = torch.where(moves, v * b2 + (1 - b2) * d_p * d_p, v)
        chunk.moments[n] = (m, v, t)
        tf = t.clamp_min(1).to(chunk.params[n].dtype).view(shape)
        step = m / (v.sqrt() / (1 - b2 ** tf).sqrt() + ADAM_EPS) * (self._lr(chunk, shape) / (1 - b1 ** tf))
        if n in chunk.lr_scale:
            step = step * chunk.lr_scale[n]
        return step

    def _sgd_step(self, chunk: _Chunk, n: str, d_p: torch.Tensor, moves: torch.Tensor) -> torch.Tensor:
        """:func:`sgd_step` per client for tensor ``n``: its step [C, *shape]; a masked (frozen, or finished)
        client's momentum buffer stays as it is."""
        if self.momentum:
            chunk.bufs[n] = d_p = torch.where(moves, self.momentum * chunk.bufs[n] + d_p, chunk.bufs[n])
        if n in chunk.lr_scale:
            d_p = d_p * chunk.lr_scale[n]
        return self._lr(chunk, (d_p.shape[0],) + (1,) * (d_p.dim() - 1)) * d_p

    @staticmethod
    def _lr(chunk: _Chunk, shape: Tuple[int, ...]):
        """eta_l of the chunk's clients (its round context's): one float, or [C] viewed as ``shape`` (a population
        over eta_l)."""
        lr = chunk.rctx.lr
        return lr.view(shape) if isinstance(lr, torch.Tensor) else lr

    def _finish_chunk(self, chunk: _Chunk, store: ClientStateStore) -> List[ClientUpdate]:
        """The clients' updates (delta, mean loss over their steps; the rule's ``finish_client``), their states
        stored; a non-finite loss raises :class:`NonFiniteLossError`."""
        updates, bad = self._chunk_updates(chunk)
        if bad:
            raise NonFiniteLossError(_non_finite(updates[bad[0]].train_loss, chunk.rctx.round,
                                                 chunk.ctxs[bad[0]].client_id))
        return self._finish_clients(chunk.ctxs, updates, store)

    def _chunk_updates(self, chunk: _Chunk) -> Tuple[List[ClientUpdate], List[int]]:
        """The chunk's clients' updates (delta from the model each received, mean loss over their steps) and
        the positions of those whose loss is not finite."""
        ctxs, C = chunk.ctxs, len(chunk.ctxs)
        flat = torch.cat([chunk.params[n].reshape(C, -1) for n in self._names], 1)  # [C, d]
        deltas = flat - chunk.batched_ctx.round.global_flat  # [d] or, in a population, [C, d]
        mean = chunk.loss_sum / chunk.steps.clamp_min(1)
        bad = torch.nonzero(~torch.isfinite(mean)).flatten().tolist()
        updates = [ClientUpdate(ctx.client_id, ctx.num_samples, ctx.num_steps, delta, loss)
                   for ctx, delta, loss in zip(ctxs, deltas.unbind(0), mean.tolist())]
        return updates, bad

    def _finish_clients(self, ctxs: List[ClientContext], updates: List[ClientUpdate],
                        store: ClientStateStore) -> List[ClientUpdate]:
        """The rule's ``finish_client`` of each client (this executor's rule stack) and its state stored."""
        if overrides(self.algo, "finish_client"):
            updates = [self.algo.finish_client(ctx, up) for ctx, up in zip(ctxs, updates)]
        for ctx in ctxs:
            if ctx.state is not None:
                store.put(ctx.client_id, ctx.state)
        return updates


def _non_finite(loss: float, round_idx: int, client_id: int) -> str:
    return f"non-finite training loss ({loss}) in round {round_idx}, client {client_id}"


EXECUTORS["vectorized"] = VectorizedExecutor
