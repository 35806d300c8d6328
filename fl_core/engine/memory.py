"""The memory the vectorised executor needs for a round and the memory the device has, so that
``engine.executor=auto`` rules it out where it cannot fit (before timing it) and ``engine.executor=vectorized``
refuses in one line before training (docs/scaling.md, Large models).

The vectorised executor (:class:`~.executors.VectorizedExecutor`) trains C clients at once: one chunk of
``engine.max_parallel_clients`` (0: all n of the round's clients). For every client of the chunk it holds on the
device, while the chunk trains (s bytes per float, d parameters):

- the client's parameters and their gradients, ``2 s d`` (the stacked ``[C, ...]`` copies and ``vmap(grad)``'s
  output);
- its local optimiser's state: momentum buffers ``s d`` (``train.momentum`` > 0) or Adam's two moments ``2 s d``
  (``train.optimizer=adam``);
- the vectors the rule asks the executor for: the full-batch gradient (``Needs.full_gradient``; each client's and
  their stack, ``2 s d``), the anchor gradient (``Needs.anchor_gradient``, ``s d``) and per-element step sizes (a
  rule that defines ``client_begin`` may set them, ``s d``);
- its state (``init_client_state``'s tensors, ``state`` bytes) twice: each client's copy on the device and their
  stack;
- during a local step, the activations of its B samples, ``f B a``; at the end of the chunk, instead, the flat
  parameters and the deltas, ``2 s d`` (the activations are gone by then): ``max(f B a, 2 s d)``;
- its batch of inputs, ``B x`` (x bytes per sample).

The updates of the round's earlier chunks (``s d`` each) stay until aggregation, as every executor keeps the
round's updates; and what the run will still add to the device whichever executor trains (``held``: on the CPU, the
states of all N clients in the in-memory client-state store, which fills as clients train) counts too. So for C
clients at once::

    total(C) = held + (n - C) s d + C [s d (2 + v) + 2 state + max(f B a, 2 s d) + B x]

with v the optimiser's and the services' vectors above. ``a`` is measured, not modelled: the bytes of the tensors
autograd saves for the backward pass in one training-mode forward pass of one sample through the model
(:func:`activation_bytes`; parameters left out). ``f`` = :data:`ACTIVATION_FACTOR` = 3 turns them into the peak of a
``vmap(grad)`` step, which also holds the backward pass's transient gradients and the copies ``vmap`` makes where
an operator has no batching rule: on the CPU (peak resident memory of one step) that peak, less the gradients, was
2.6 to 3.2 times the saved bytes for the models measured (docs/scaling.md, Large models). On CUDA (an H200,
ViT-B/16, B = 16, 10 clients) a round's peak was 0.65 of the estimate: there it errs on the safe side.
What the estimate leaves out (the rule's own loss terms, the update's temporaries of one tensor, the allocator's
fragmentation) is the headroom: the executor fits when ``total(C)`` is at most :data:`FIT_FRACTION` of the available
memory (:func:`available_bytes`: free CUDA memory plus what PyTorch's allocator holds unused; on the CPU
``MemAvailable`` of ``/proc/meminfo``, capped by the cgroup's memory limit). Nothing here allocates anything of size d.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .executors import overrides

FIT_FRACTION = 0.8  # the estimate may use at most this share of the available memory (the rest is headroom)
ACTIVATION_FACTOR = 3  # a vmap(grad) step's peak activation memory / the bytes autograd saves (module docstring)
GIB = 2 ** 30


@dataclass(frozen=True)
class VectorizedMemory:
    """The vectorised executor's memory for one round, in bytes (module docstring).

    Attributes:
        round_clients: n, the round's clients (>= 1).
        clients: C, the clients trained at once (1 <= C <= n).
        per_client: bytes per client trained at once (``s d (2 + v) + 2 state + max(f B a, 2 s d) + B x``).
        update: bytes of one client's update, ``s d``.
        held: bytes the run adds to the device whichever executor trains (``held`` above).
    """

    round_clients: int
    clients: int
    per_client: int
    update: int
    held: int = 0

    def total(self, clients: Optional[int] = None) -> int:
        """``total(C)`` in bytes for ``clients`` at once (default: :attr:`clients`)."""
        c = self.clients if clients is None else int(clients)
        return self.held + (self.round_clients - c) * self.update + c * self.per_client

    def largest_chunk(self, budget: int) -> int:
        """The most clients at once (at most n) whose :meth:`total` is within ``budget`` bytes; 0 when not even one
        client fits."""
        if self.total(1) > budget:
            return 0
        if self.per_client <= self.update:  # total(C) does not grow with C
            return self.round_clients
        free = budget - self.held - self.round_clients * self.update
        return min(self.round_clients, free // (self.per_client - self.update))


def vectorized_memory(*, d: int, float_bytes: int, round_clients: int, max_parallel_clients: int, batch_size: int,
                      activation_per_sample: int, state_bytes: int, sample_bytes: int,
                      extra_vectors: int, held_bytes: int = 0) -> VectorizedMemory:
    """:class:`VectorizedMemory` of a round from its sizes (pure arithmetic; module docstring).

    Args:
        d: parameters of the model; float_bytes: s, bytes per float (4 for float32).
        round_clients: n, the round's clients; max_parallel_clients: ``engine.max_parallel_clients`` (0: n).
        batch_size: B; activation_per_sample: a, bytes (:func:`activation_bytes`); sample_bytes: x, bytes of one
            input sample.
        state_bytes: bytes of one client's state (:func:`~.diskstate.client_state_bytes`).
        extra_vectors: v, the [d] vectors per client of the optimiser and the rule's services (:func:`extra_vectors`).
        held_bytes: ``held``, bytes the run adds to the device whichever executor trains.

    Raises:
        ValueError: a negative size, or n or B below 1.
    """
    sizes = dict(d=d, float_bytes=float_bytes, round_clients=round_clients, max_parallel_clients=max_parallel_clients,
                 batch_size=batch_size, activation_per_sample=activation_per_sample, state_bytes=state_bytes,
                 sample_bytes=sample_bytes, extra_vectors=extra_vectors, held_bytes=held_bytes)
    for key, value in sizes.items():
        if value < (1 if key in ("round_clients", "batch_size") else 0):
            raise ValueError(f"vectorized_memory: {key} must be >= {1 if key in ('round_clients', 'batch_size') else 0}"
                             f", got {value}")
    vec = float_bytes * d
    clients = min(round_clients, max_parallel_clients or round_clients)
    per_client = (vec * (2 + extra_vectors) + 2 * state_bytes
                  + max(ACTIVATION_FACTOR * batch_size * activation_per_sample, 2 * vec) + batch_size * sample_bytes)
    return VectorizedMemory(round_clients, clients, per_client, vec, held_bytes)


def extra_vectors(algo, momentum: float, optimizer: str) -> int:
    """v: the [d] vectors per client the vectorised executor keeps besides parameters and gradients, from the local
    optimiser (momentum 1, Adam 2) and the services the rule declares (``Needs.full_gradient`` 2,
    ``Needs.anchor_gradient`` 1, a ``client_begin`` hook 1: it may set per-element step sizes)."""
    v = 2 if optimizer == "adam" else (1 if momentum else 0)
    v += 2 * bool(algo.needs.full_gradient) + bool(algo.needs.anchor_gradient) + overrides(algo, "client_begin")
    return int(v)


def activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of activations the backward pass keeps per sample: what the tensors autograd saves in one
    training-mode forward pass of ``x`` through ``model.forward_features`` and the cross-entropy of its logits
    cover (per storage, from the first to the last byte its saved views reach; a view of a larger storage, such as
    a slice of the training data, counts its own bytes only), the parameters' storages left out, divided by the
    batch size of ``x``.

    Args:
        model: an :class:`~fl_core.models.FLModel` on ``x``'s device; its mode is restored, its parameters are not
            changed, and the random state is restored (a dropout draw does not change the run).
        x: inputs ``[b, ...]`` (b >= 1; one sample is enough: activations grow linearly with the batch).

    Returns:
        bytes per sample (an int >= 0).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    spans = {}  # storage -> (first, last + 1) byte of what the saved tensors cover (views of one storage merge)

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.numel():
            first = t.storage_offset() * t.element_size()
            last = first + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
            lo, hi = spans.get((ptr, t.device), (first, last))
            spans[(ptr, t.device)] = (min(lo, first), max(hi, last))
        return t

    training = model.training
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()
            logits, _ = model.forward_features(x)
            F.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
    finally:
        model.train(training)
    return -(-sum(hi - lo for lo, hi in spans.values()) // max(1, int(x.shape[0])))


def _meminfo_available(path: Path) -> Optional[int]:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path) -> Optional[int]:
    """The cgroup's memory limit minus its usage (v2 ``memory.max`` / ``memory.current``, v1
    ``memory/memory.limit_in_bytes`` / ``memory.usage_in_bytes``); None without a limit."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit).read_text().strip()
            if raw == "max" or int(raw) >= 2 ** 60:  # no limit (v1 writes a huge number)
                continue
            return max(0, int(raw) - int((root / usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_bytes(device: torch.device, meminfo: Path = Path("/proc/meminfo"),
                    cgroup: Path = Path("/sys/fs/cgroup")) -> Tuple[int, str]:
    """Memory available for new tensors on ``device``, in bytes, and what it is (for messages).

    CUDA: ``torch.cuda.mem_get_info``'s free bytes plus what PyTorch's caching allocator reserves but does not use
    (``memory_reserved - memory_allocated``), ``"free on <device>"``. CPU: ``MemAvailable`` of ``meminfo`` (the
    kernel's estimate of what can be allocated without swapping), capped by the cgroup's limit minus its usage under
    ``cgroup`` when one is set; without ``/proc/meminfo``, free pages (``os.sysconf``); ``"of RAM available"``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached)), f"free on {device}"
    avail = _meminfo_available(Path(meminfo))
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_headroom(Path(cgroup))
    return int(avail if limit is None else min(avail, limit)), "of RAM available"


def size_text(n: int) -> str:
    """``n`` bytes for a message: ``12.3 GiB`` from 1 GiB up, else ``45.6 MiB``."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


@dataclass(frozen=True)
class Fit:
    """Whether the vectorised executor fits: its :class:`VectorizedMemory` against the available bytes.

    Attributes:
        need: the estimate; available: bytes (:func:`available_bytes`); where: what ``available`` is, for messages.
    """

    need: VectorizedMemory
    available: int
    where: str

    @property
    def budget(self) -> int:
        """:data:`FIT_FRACTION` of the available bytes."""
        return int(FIT_FRACTION * self.available)

    @property
    def fits(self) -> bool:
        return self.need.total() <= self.budget

    @property
    def chunk(self) -> int:
        """The most clients at once that fit (:meth:`VectorizedMemory.largest_chunk` of :attr:`budget`); 0: none."""
        return self.need.largest_chunk(self.budget)

    def estimate(self) -> str:
        """The estimate against the available memory, for messages: ``about 65.4 GiB for 10 clients at once, more
        than 80% of the 21.5 GiB of RAM available``."""
        c = self.need.clients
        return (f"about {size_text(self.need.total())} for {c} client{'s' if c != 1 else ''} at once, more than "
                f"{FIT_FRACTION:.0%} of the {size_text(self.available)} {self.where}")

    def problem(self) -> str:
        """Why it does not fit, one line: :meth:`estimate` and the ``engine.max_parallel_clients`` that would fit,
        or that not even one client at a time does."""
        if self.chunk == 0:
            return self.estimate() + f"; even one client at a time needs {size_text(self.need.total(1))}"
        return self.estimate() + f"; engine.max_parallel_clients={self.chunk} would fit"
