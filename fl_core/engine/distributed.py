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

A lost or frozen rank (docs/reliability.md, When the environment fails): every collective waits at most
``engine.dist_timeout_s`` (the process group's timeout), so a frozen rank stops the run within that time instead of
gloo's default 30 minutes. Every rank beats a heartbeat (a counter in the rendezvous store, every
min(1 s, timeout / 10)); rank 0 watches them. When a collective fails (a peer closed its connection, or the
timeout passed), or torchrun sends rank 0 SIGTERM because a worker ended, rank 0 names the rank: its process ended
or is stopped (same machine: ``/proc``), or its heartbeat stopped; it raises a
:class:`~fl_core.store.envfail.EnvironmentFailure` (one line, exit status 3, the MLflow runs ended FAILED) and the other
ranks exit quietly (rank 1 speaks when rank 0 is the lost one).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..store import envfail
from ..algorithms.base import ClientUpdate, RoundContext
from .executors import Executor, NonFiniteLossError
from .state import ClientStateStore

STOP = None  # the task that ends a worker's loop
DEFAULT_TIMEOUT_S = 300.0  # engine.dist_timeout_s (fl_core/schema.py; why this value: docs/reliability.md)
IGNORE = object()  # on_sigterm(): a failure is already being handled, ignore the signal
AGAIN = "then run the same torchrun command again to resume from rank 0's last checkpoint"


def world() -> Tuple[int, int, int]:
    """(rank, world size K, local rank) from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); (0, 1, 0)
    without it."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda`` -> ``cuda:<LOCAL_RANK>`` (one GPU per process), anything else unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", world()[2])
    return device


def init(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> Tuple[int, int]:
    """Join the process group of a torchrun start (env://; gloo on CPU, NCCL on CUDA); (rank, K).

    Without torchrun's variables this is a group of one (K = 1), which trains every client in this process.

    Args:
        device: this rank's device (picks the backend).
        timeout_s: ``engine.dist_timeout_s``, seconds: the process group's timeout (the longest any collective
            waits for the other ranks) and the heartbeat's scale (module docstring).

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
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=size,
                            timeout=timedelta(seconds=float(timeout_s)))
    global _watch, _failure
    _failure = None
    _watch = _Watch(rank, size, float(timeout_s))
    _watch.start()
    return rank, size


def shutdown() -> None:
    """Leave the process group (if any). After a lost rank the group is left as it is (destroying it could wait on
    the lost rank), and SIGTERM is ignored from here on: the process is ending with its exit status, which the
    SIGTERM torchrun sends every rank once one has ended must not replace."""
    global _watch
    if _failure is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _watch is not None:
        _watch.stop()
        _watch = None
    if dist.is_initialized() and _failure is None:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- lost and frozen ranks

_watch: Optional["_Watch"] = None
_failure: Optional[envfail.EnvironmentFailure] = None  # set once a collective failed: the group is broken


def _proc_state(pid: int) -> str:
    """The state letter of process ``pid`` on this machine (``R``, ``S``, ``D``, ``T``, ``Z``, ...), or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return "?"


class _Watch:
    """Heartbeats of the ranks in the rendezvous store (a client of its own, keys ``fl-watch/...``): every rank adds
    1 to ``beat/<rank>`` every ``interval`` seconds and publishes its pid and host once; a thread records when the
    counters it watches last moved (rank 0 watches every worker, a worker watches rank 0), by its own clock, so the
    machines' clocks need not agree. Best effort: without a store, or once it is gone, the thread stops quietly and
    the diagnosis uses what it has."""

    def __init__(self, rank: int, size: int, timeout_s: float):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.interval = max(0.05, min(1.0, timeout_s / 10))
        self.watched = list(range(1, size)) if rank == 0 else [0]
        self.last: Dict[int, Tuple[int, float]] = {}  # rank -> (counter, monotonic time it last moved)
        self.peers: Dict[int, Dict[str, Any]] = {}  # rank -> {"pid", "host"}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self.store = None

    def start(self) -> None:
        try:
            self.store = dist.PrefixStore("fl-watch/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=max(5.0, min(30.0, self.timeout_s))), wait_for_workers=False))
            self.store.set(f"rank/{self.rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
            self.store.add(f"beat/{self.rank}", 1)
        except Exception:  # noqa: BLE001  (no store: no heartbeats; the process group still has its timeout)
            self.store = None
            return
        threading.Thread(target=self._run, name="fl-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def mark_ended(self, why: str) -> None:
        """Rank 0 ends the run on purpose (a lost rank): the workers whose collectives fail next stay quiet."""
        try:
            if self.store is not None:
                self.store.set(f"ended/{self.rank}", why[:500])
        except Exception:  # noqa: BLE001
            pass

    def ended(self, r: int) -> bool:
        try:
            return self.store is not None and bool(self.store.check([f"ended/{r}"]))
        except Exception:  # noqa: BLE001
            return False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                for r in self.watched:
                    count = self.store.add(f"beat/{r}", 0)
                    if r not in self.last or self.last[r][0] != count:
                        self.last[r] = (count, now)
                    if r not in self.peers and self.store.check([f"rank/{r}"]):
                        self.peers[r] = json.loads(self.store.get(f"rank/{r}"))
                self._stop.wait(self.interval)
        except Exception:  # noqa: BLE001  (the store went away: the run is ending)
            return

    def silent_for(self, r: int) -> float:
        """Seconds since rank ``r``'s heartbeat last moved, as this rank's thread saw it."""
        return time.monotonic() - self.last.get(r, (0, self.started))[1]

    def lost(self, *, reaped_only: bool = False) -> List[Tuple[int, str, str]]:
        """(rank, `` (pid P on HOST)``, what happened) for every watched rank found gone or frozen. ``reaped_only``: a
        process on this machine counts as gone only once torchrun has reaped it (no ``/proc`` entry), not while it is
        a zombie or alive (torchrun stopping every rank at once is an interruption, not a lost rank)."""
        out = []
        host = socket.gethostname()
        for r in self.watched:
            info = self.peers.get(r, {})
            where = f" (pid {info['pid']} on {info['host']})" if info else ""
            if info.get("host") == host:
                state = _proc_state(int(info["pid"]))
                if state == "gone" or (state == "Z" and not reaped_only):
                    out.append((r, where, "is gone: its process ended"))
                    continue
                if state in ("T", "t"):
                    out.append((r, where, "stopped responding: its process is stopped (state T: SIGSTOP or a "
                                          f"debugger), no heartbeat for {self.silent_for(r):.0f} s"))
                    continue
            quiet = self.silent_for(r)
            if self.store is not None and quiet > max(3 * self.interval, 2.0):
                out.append((r, where, f"stopped responding: no heartbeat for {quiet:.0f} s"))
        return out


def _diagnose(err: BaseException, wait_s: float,
              lost: Optional[List[Tuple[int, str, str]]] = None) -> envfail.EnvironmentFailure:
    """The failure a failed collective stands for. Rank 0 names the lost rank (waiting up to ``wait_s`` for the
    heartbeats to show which one) and tells the workers it ends the run; a worker's failure is quiet (rank 0 says
    it), except on rank 1 when rank 0 itself is the one lost. ``lost``: the ranks already found (:meth:`_Watch.lost`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = envfail.first_line(err)
    timeout_s = _watch.timeout_s if _watch is not None else DEFAULT_TIMEOUT_S
    timed_out = "timed out" in first.lower() or "timeout" in first.lower()
    deadline = time.monotonic() + wait_s
    while lost is None and _watch is not None and not (rank != 0 and _watch.ended(0)):
        found = _watch.lost()
        if found or time.monotonic() >= deadline:
            lost = found
            break
        time.sleep(_watch.interval)
    lost = lost or []
    if rank != 0:
        if rank == 1 and lost and _watch is not None and not _watch.ended(0):
            _, where, what = lost[0]
            return envfail.EnvironmentFailure(f"rank 0 of this torchrun start{where}", what, f"see its output, {AGAIN}")
        return envfail.EnvironmentFailure("a rank of this torchrun start", f"is gone ({first[:160]})",
                                          "rank 0 says which", quiet=True)
    if lost:
        r, where, what = lost[0]
        more = f" (and {len(lost) - 1} other rank(s))" if len(lost) > 1 else ""
        why = ("see why it ended (its output; the OOM killer in dmesg)" if what.startswith("is gone") else
               "see why it hangs (torchrun stops it after its --shutdown-timeout, 30 s by default)")
        failure = envfail.EnvironmentFailure(f"rank {r} of this torchrun start{where}{more}", what, f"{why}, {AGAIN}")
    elif timed_out:
        failure = envfail.EnvironmentFailure(
            "a torch.distributed collective", f"waited longer than engine.dist_timeout_s={timeout_s:g} s while "
            "every rank was alive", f"raise engine.dist_timeout_s above the longest round, {AGAIN}")
    else:
        failure = envfail.EnvironmentFailure("a peer rank of this torchrun start", f"failed ({first[:160]})",
                                             f"see the other ranks' output, {AGAIN}")
    if _watch is not None:
        _watch.mark_ended(str(failure))
    return failure


def _collective(fn: Callable, *args, **kwargs):
    """Run a collective; a failure of the group (a rank lost or frozen) becomes the rank's
    :class:`~fl_core.store.envfail.EnvironmentFailure` (:func:`_diagnose`), raised again by every later collective."""
    global _failure
    if _failure is not None:
        raise _failure
    try:
        return fn(*args, **kwargs)
    except RuntimeError as err:  # DistBackendError, gloo's RuntimeErrors: a peer closed, or the timeout passed
        _failure = _diagnose(err, wait_s=4 * (_watch.interval if _watch is not None else 0))
        raise _failure from err


def on_sigterm() -> Any:
    """What SIGTERM means on rank 0 of a torchrun start (pipeline/train.py's handler): :data:`IGNORE` while a
    failure is already being handled; the failure when a peer rank ended before it (torchrun stops the other ranks
    when one ends: it has reaped that one, or its heartbeat stopped), so the line names the rank; None otherwise
    (an interruption)."""
    global _failure
    if _failure is not None:
        return IGNORE
    if _watch is None or _watch.rank != 0 or not dist.is_initialized():
        return None
    lost = _watch.lost(reaped_only=True)
    if not lost:
        return None
    _failure = _diagnose(RuntimeError("torchrun stopped this rank after another rank ended"), 0, lost)
    return _failure


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
            fl_core.store.envfail.EnvironmentFailure: a rank is gone or frozen (names it; module docstring).
        """
        if self.size == 1:
            return self.inner.run_round(rctx, client_ids, store)
        ids = [int(c) for c in client_ids]
        shares = [ids[r::self.size] for r in range(self.size)]
        carried = {r: (shares[r], {c: _cpu(store.get(c, lambda: None)) for c in shares[r]})
                   for r in range(1, self.size)}
        task = {"job": self.job, "rctx": _cpu_rctx(rctx), "shares": carried}
        _collective(dist.broadcast_object_list, [task], src=0)
        own = self.inner.run_round(rctx, shares[0], store)
        replies: List[Optional[dict]] = [None] * self.size
        _collective(dist.gather_object, None, replies, dst=0)
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
    """Rank 0: end the workers' :func:`serve` loops (no-op in a group of one, or once a rank was lost)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0 and _failure is None:
        _collective(dist.broadcast_object_list, [STOP], src=0)


def serve(executor_for: Callable[[Tuple[str, int]], Executor], on_task: Optional[Callable[[], None]] = None) -> int:
    """A worker rank's loop: train the share of every task rank 0 broadcasts, until it broadcasts the stop.

    Args:
        executor_for: ``(experiment, seed) -> Executor`` for this rank (built once per job and kept).
        on_task: called at every task (fault injection points, progress).

    Returns:
        The number of tasks served.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: rank 0 or another rank is gone; quiet (rank 0 says it) unless this is
            rank 1 and rank 0 is the one lost.
    """
    rank = dist.get_rank()
    executors: Dict[Tuple[str, int], Executor] = {}
    served = 0
    while True:
        box = [None]
        _collective(dist.broadcast_object_list, box, src=0)
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
        _collective(dist.gather_object, reply, None, dst=0)
        served += 1
