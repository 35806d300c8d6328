"""The distributed executor: one round's clients spread over K processes with ``torch.distributed``.

Started with ``torchrun --nproc_per_node K -m pipeline.train ... engine.executor=distributed`` (or K
machines with ``--nnodes``). Rank 0 runs the experiment exactly as one process does: the round loop,
aggregation, evaluation, MLflow, checkpoints and outputs. Ranks 1..K-1 are workers: they hold the same
model, rule stack and data and train the clients rank 0 hands them. Per round:

1. rank 0 splits the sampled clients S into K shares, client ``S[j]`` to rank ``j mod K``, and broadcasts
   each worker's share with those clients' states from its :class:`~.state.ClientStateStore` (a client's
   state travels to the rank that trains it; a client without a state gets its initial one there);
2. every rank trains its share with its own executor (``engine.rank_executor``: sequential or vectorised)
   on its own device (``engine.device=cuda``: rank r uses ``cuda:<LOCAL_RANK>``);
3. rank 0 gathers the updates and the states after training, stores the states and returns the updates in
   the order of S, so aggregation sees what the single-process executor would hand it.

Every client's training depends only on (seed, round, client) and the received model, so the result equals
the single-process executor's to float rounding (bitwise on the CPU with the same thread count; models with
dropout draw other masks and agree in distribution only). Rule objects that keep per-round statistics in
memory (a compressor's residual norm or quantisation error, from ``finish_client``) see only rank 0's clients.

Failures: a worker whose client diverges sends the error back (rank 0 ends the run as FAILED, as a single
process would); a rank that dies makes the collectives of the others fail, so the whole run stops without
writing anything more, and the same command resumes from rank 0's last checkpoint. Transport: the object
collectives of ``torch.distributed`` (pickled CPU tensors; gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..algorithms.base import ClientUpdate, RoundContext
from .executors import Executor, NonFiniteLossError
from .state import ClientStateStore

STOP = None  # the task that ends a worker's loop


def world() -> Tuple[int, int, int]:
    """(rank, world size K, local rank) from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); (0, 1, 0)
    without it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda`` -> ``cuda:<LOCAL_RANK>`` (one GPU per process), anything else unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", world()[2])
    return device


def init(device: torch.device) -> Tuple[int, int]:
    """Join the process group of a torchrun start (env://; gloo on CPU, NCCL on CUDA); (rank, K).

    Without torchrun's variables this is a group of one (K = 1), which trains every client in this process.

    Raises:
        ValueError: WORLD_SIZE > 1 but MASTER_ADDR / MASTER_PORT are missing (names them; start with torchrun).
    """
    rank, size, _ = world()
    if size == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"engine.executor=distributed with WORLD_SIZE={size} needs {', '.join(missing)}: start "
                         "with torchrun --nproc_per_node K -m pipeline.train ...")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device))
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=size)
    return rank, size


def shutdown() -> None:
    """Leave the process group (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _cpu(obj):
    """``obj`` with every tensor moved to the CPU (for pickling across ranks)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _to(rctx: RoundContext, device: torch.device) -> RoundContext:
    rctx.global_flat = rctx.global_flat.to(device)
    rctx.extra = {k: v.to(device) for k, v in rctx.extra.items()}
    return rctx


def train_share(executor: Executor, rctx: RoundContext, ids: Sequence[int],
                states: Dict[int, Optional[Dict[str, torch.Tensor]]]) -> dict:
    """Train clients ``ids`` with ``executor`` from the received states; the reply a worker sends: ``updates``
    (CPU) and ``states`` after training, or ``error`` = (kind, message) when a client diverged."""
    store = ClientStateStore("cpu")
    for cid, state in states.items():
        store.put(cid, state)
    try:
        updates = executor.run_round(_to(rctx, executor.data.x.device), list(ids), store)
    except NonFiniteLossError as err:
        return {"error": ("non_finite", str(err))}
    return {"updates": [_cpu_update(u) for u in updates],
            "states": {u.client_id: _cpu(store.get(u.client_id, lambda: None)) for u in updates}}


def _cpu_update(u: ClientUpdate) -> ClientUpdate:
    u.delta = u.delta.detach().cpu()
    u.extra = _cpu(u.extra)
    return u


class DistributedExecutor(Executor):
    """Rank 0's executor: trains its share with ``inner`` and the rest on the worker ranks (module docstring).

    Args:
        inner: this rank's executor (sequential or vectorised), built on the run's model, rule stack and data.
        job: what identifies the run to the workers (experiment name and seed); they build the same executor.
    """

    name = "distributed"

    def __init__(self, inner: Executor, job: Tuple[str, int]):
        self.inner = inner
        self.job = job
        self.rank, self.size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.model, self.algo, self.data = inner.model, inner.algo, inner.data  # what the simulator reads
        self.reason = inner.reason

    def run_round(self, rctx: RoundContext, client_ids: Sequence[int], store: ClientStateStore) -> List[ClientUpdate]:
        """Train ``client_ids`` over the K ranks; the updates in the order of ``client_ids``.

        Raises:
            NonFiniteLossError: a client's loss diverged on any rank (names round and client).
            RuntimeError (from torch.distributed): a rank is gone.
        """
        if self.size == 1:
            return self.inner.run_round(rctx, client_ids, store)
        ids = [int(c) for c in client_ids]
        shares = [ids[r::self.size] for r in range(self.size)]
        carried = {r: (shares[r], {c: _cpu(store.get(c, lambda: None)) for c in shares[r]})
                   for r in range(1, self.size)}
        task = {"job": self.job, "rctx": _cpu_rctx(rctx), "shares": carried}
        dist.broadcast_object_list([task], src=0)
        own = self.inner.run_round(rctx, shares[0], store)
        replies: List[Optional[dict]] = [None] * self.size
        dist.gather_object(None, replies, dst=0)
        by_client = {u.client_id: u for u in own}
        device = rctx.global_flat.device
        for reply in replies[1:]:
            if "error" in reply:
                raise NonFiniteLossError(reply["error"][1])
            for u in reply["updates"]:
                u.delta = u.delta.to(device)
                u.extra = {k: v.to(device) for k, v in u.extra.items()}
                store.put(u.client_id, reply["states"].get(u.client_id))
                by_client[u.client_id] = u
        return [by_client[c] for c in ids]


def _cpu_rctx(rctx: RoundContext) -> RoundContext:
    from dataclasses import replace

    return replace(rctx, global_flat=rctx.global_flat.detach().cpu(),
                   extra={k: v.detach().cpu() for k, v in rctx.extra.items()})


def stop_workers() -> None:
    """Rank 0: end the workers' :func:`serve` loops (no-op in a group of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        dist.broadcast_object_list([STOP], src=0)


def serve(executor_for: Callable[[Tuple[str, int]], Executor], on_task: Optional[Callable[[], None]] = None) -> int:
    """A worker rank's loop: train the share of every task rank 0 broadcasts, until it broadcasts the stop.

    Args:
        executor_for: ``(experiment, seed) -> Executor`` for this rank (built once per job and kept).
        on_task: called at every task (fault injection points, progress).

    Returns:
        The number of tasks served.
    """
    rank = dist.get_rank()
    executors: Dict[Tuple[str, int], Executor] = {}
    served = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        task = box[0]
        if task is STOP:
            return served
        if on_task is not None:
            on_task()
        job = tuple(task["job"])
        if job not in executors:
            executors[job] = executor_for(job)
        ids, states = task["shares"][rank]
        reply = train_share(executors[job], task["rctx"], ids, states)
        dist.gather_object(reply, None, dst=0)
        served += 1
