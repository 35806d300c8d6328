"""Executors: who trains the sampled clients of a round.

:class:`SequentialExecutor` is the reference: one ``nn.Module`` and one ``torch.optim.SGD`` per
client, clients one after another, exactly the local step of ALGORITHMS.md section 3. Faster
executors must reproduce its global parameters (tests compare them).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..algorithms.base import Algorithm, ClientContext, ClientUpdate, RoundContext
from ..seeding import torch_generator
from .state import ClientStateStore, flatten_params, load_flat


class NonFiniteLossError(RuntimeError):
    """A client's training loss became NaN or infinite."""


def local_steps(num_samples: int, batch_size: int, local_epochs: int) -> int:
    """K_i = E * ceil(n_i / B) (ALGORITHMS.md section 0)."""
    return local_epochs * math.ceil(num_samples / batch_size)


def batch_schedule(seed: int, round_idx: int, client_id: int, num_samples: int, batch_size: int,
                   local_epochs: int) -> List[torch.Tensor]:
    """The client's mini-batches for a round: positions into its local index array.

    Each epoch is a fresh permutation of ``range(num_samples)`` cut into batches of ``batch_size``
    (the last one may be smaller), so ``len(result) == local_steps(...)``. The permutations are a
    pure function of ``(seed, round_idx, client_id)``: every executor and a resumed run draw the same.
    """
    g = torch_generator("batches", seed, round_idx, client_id)
    out: List[torch.Tensor] = []
    for _ in range(local_epochs):
        perm = torch.randperm(num_samples, generator=g)
        out.extend(perm.split(batch_size))
    return out


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


class SequentialExecutor:
    """Trains clients one after another with a plain module and torch.optim.SGD (the reference)."""

    name = "sequential"

    def __init__(self, model: torch.nn.Module, algorithm: Algorithm, data: ClientData, *, batch_size: int,
                 local_epochs: int, weight_decay: float = 0.0, grad_clip: Optional[float] = None, seed: int = 0):
        self.model = model
        self.algo = algorithm
        self.data = data
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.seed = seed

    def run_round(self, rctx: RoundContext, client_ids: Sequence[int], store: ClientStateStore) -> List[ClientUpdate]:
        """Train every client in ``client_ids`` from ``rctx.global_flat`` and return their updates.

        Raises:
            NonFiniteLossError: a client's loss became NaN/inf (names round and client).
        """
        updates = []
        for cid in client_ids:
            n_i = self.data.size(cid)
            ctx = ClientContext(round=rctx, client_id=int(cid), num_samples=n_i,
                                num_steps=local_steps(n_i, self.batch_size, self.local_epochs),
                                label_counts=self.data.label_counts[cid],
                                state=store.get(int(cid), lambda: self.algo.init_client_state(rctx.global_flat)))
            update = self._train_client(ctx)
            update = self.algo.finish_client(ctx, update)
            store.put(int(cid), ctx.state)
            updates.append(update)
        return updates

    def _train_client(self, ctx: ClientContext) -> ClientUpdate:
        model, algo, data = self.model, self.algo, self.data
        rctx = ctx.round
        load_flat(model, rctx.global_flat)
        model.train()
        named = list(model.named_parameters())
        params: Dict[str, torch.Tensor] = dict(named)
        opt = torch.optim.SGD(model.parameters(), lr=rctx.lr, weight_decay=self.weight_decay)
        idx = data.indices[ctx.client_id]
        batches = batch_schedule(self.seed, rctx.round, ctx.client_id, ctx.num_samples, self.batch_size,
                                 self.local_epochs)
        loss_sum = torch.zeros((), device=data.x.device)
        for k, pos in enumerate(batches, start=1):
            mask = algo.update_mask(ctx, k)
            for j, (_, p) in enumerate(named):
                p.requires_grad_(True if mask is None else bool(mask[j]))
            b = idx[pos.to(idx.device)]
            x, y = data.x[b], data.y[b]
            logits, feats = model.forward_features(x)
            loss = F.cross_entropy(logits, y)
            extra = algo.local_loss(ctx, params, logits, feats, y)
            total = loss if extra is None else loss + extra
            opt.zero_grad(set_to_none=True)
            total.backward()
            trainable = [p for _, p in named if p.grad is not None]
            algo.transform_grads(ctx, k, params, {n: p.grad for n, p in named if p.grad is not None})
            if self.grad_clip is not None and trainable:
                torch.nn.utils.clip_grad_norm_(trainable, self.grad_clip)
            opt.step()  # SGD skips parameters whose grad is None: frozen ones get no weight decay
            loss_sum += loss.detach()
        for _, p in named:
            p.requires_grad_(True)
        mean_loss = float(loss_sum) / max(1, len(batches))
        if not math.isfinite(mean_loss):
            raise NonFiniteLossError(f"non-finite training loss ({mean_loss}) in round {rctx.round}, "
                                     f"client {ctx.client_id}")
        delta = flatten_params(model) - rctx.global_flat
        return ClientUpdate(ctx.client_id, ctx.num_samples, len(batches), delta, mean_loss)


EXECUTORS = {"sequential": SequentialExecutor}
