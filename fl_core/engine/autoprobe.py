"""The timing probe of ``engine.executor=auto``: how long the sequential and the vectorised executor take for one local
step of some of round 1's clients, measured robustly and once per workload (docs/architecture.md, docs/benchmarks.md).

Robust to a busy machine: how many clients each call trains is sized on one torch thread (with more threads than
free cores, every parallel operation may wait for a thread held off its core, and a one-client call then costs what a
hundred clients' do); after a warm-up, the two executors' timed calls alternate (sequential, vectorised, sequential,
...; :data:`PROBE_MIN_REPEATS` to :data:`PROBE_REPEATS` each), Python's garbage collector is off during them, and
each executor counts its fastest call (:func:`call_time`): another process on the cores, or a pause of the
interpreter, only ever adds time to a call, so the fastest of several alternating calls is the one least disturbed,
for both executors alike. A one-shot timing instead charges a whole stall to whichever executor it hit.

Amortised: :func:`cached_timing` keeps the result per workload (:func:`workload_key`: device, threads, data shape,
client sizes, model, rule stack, the local-step settings, clients per round; not the seed, the learning rate or the
number of rounds), so the seeds of an experiment and the trials of a search in one process probe once. The probe runs
when the simulator is built, never during the rounds, and the executor it picks is the plain executor: ``auto`` adds
nothing per round.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithms.base import RoundContext
from ..config import drop_keys, replica_keys, to_container
from ..data.sampling import sample_clients
from ..params import ParamSpec, flatten_params
from . import gcpause
from .executors import ClientData, Executor, SequentialExecutor, VectorizedExecutor, client_steps
from .state import ClientStateStore

PROBE_BUDGET_S = 0.05  # seconds of sequential training per timed call (sets how many clients it trains)
PROBE_REPEATS = 5  # timed calls per executor, interleaved; the fastest counts
PROBE_MIN_REPEATS = 3  # ... but 3 suffice when one predicted round is PROBE_CLEAR times the other
PROBE_CLEAR = 3.0
PROBE_CAP_S = 0.5  # the vectorised chunk grows by doublings while its next call would take at most this long
EXECUTOR_NAMES = ("sequential", "vectorized")

Timed = Callable[[str, List[int]], float]  # (executor name, client ids) -> seconds of that executor's round


def call_time(samples: Sequence[float]) -> float:
    """The time an executor's call takes on an undisturbed machine, from its repeated timings (seconds): the
    fastest. Load from other processes and interpreter pauses only add time, so the minimum is the least
    disturbed call (``timeit``'s rule); a median would keep a neighbour's share when it is busy through half
    the calls.

    Raises:
        ValueError: no timing.
    """
    if not samples:
        raise ValueError("call_time: no timing")
    return min(samples)


def predict_round(call_s: Dict[str, float], clients: Dict[str, int], steps: Sequence[int], chunk: int) -> Dict[str, float]:
    """Seconds of one round's local training per executor, from the seconds of one local step of ``clients[name]``
    clients (``call_s``) and the round's step counts K_i (``steps``, one per sampled client).

    sequential = (seconds per client step) x sum K_i; vectorised = per chunk of ``chunk`` clients, (seconds per
    step of m clients) x chunk size / m x the chunk's largest K_i (its clients step together).
    """
    seq = call_s["sequential"] / clients["sequential"] * sum(steps)
    vec = 0.0
    for s in range(0, len(steps), max(1, chunk)):
        part = steps[s:s + max(1, chunk)]
        vec += call_s["vectorized"] * len(part) / clients["vectorized"] * max(part)
    return {"sequential": seq, "vectorized": vec}


@dataclass(frozen=True)
class ExecutorTiming:
    """What the ``auto`` probe measured (:func:`time_executors`).

    Attributes:
        round_s: executor name -> predicted seconds of local training in round 1 (all its sampled clients).
        clients: executor name -> how many of round 1's sampled clients it trained per timed call.
        sampled: the number of round 1's sampled clients.
        probe_s: wall seconds the whole probe took (warm-up included).
        samples: executor name -> seconds of each timed call, in the order taken (the two executors alternate);
            empty when the timing was not measured call by call.
        cached: True when this is an earlier probe's result for the same workload (:func:`cached_timing`).
    """

    round_s: Dict[str, float]
    clients: Dict[str, int]
    sampled: int
    probe_s: float
    samples: Dict[str, Tuple[float, ...]] = field(default_factory=dict)
    cached: bool = False

    @classmethod
    def from_samples(cls, samples: Dict[str, Sequence[float]], clients: Dict[str, int], steps: Sequence[int],
                     chunk: int, probe_s: float) -> "ExecutorTiming":
        """The timing of interleaved calls: each executor's :func:`call_time` scaled to the round
        (:func:`predict_round`; ``steps``: round 1's K_i, ``chunk``: clients trained at once, 0 for all)."""
        call_s = {name: call_time(samples[name]) for name in EXECUTOR_NAMES}
        return cls(predict_round(call_s, clients, steps, chunk or len(steps)), dict(clients), len(steps), probe_s,
                   {name: tuple(samples[name]) for name in EXECUTOR_NAMES})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_executors(cfg, model: torch.nn.Module, algo, data: ClientData, kwargs: Dict,
                   budget_s: float = PROBE_BUDGET_S, repeats: int = PROBE_REPEATS, replicas: int = 1) -> ExecutorTiming:
    """Time one local step of the sequential and the vectorised executor on round 1's clients; predict the round.

    With ``replicas`` R > 1 the round predicted is that of a population of R replicas like this run
    (:mod:`.population`): R times round 1's clients, which the sequential executor trains one replica after another
    and the vectorised one in one pass (the probe's calls then train round 1's clients R times over).

    Each executor trains the first m of round 1's sampled clients (``cfg.train``'s sampler and ``cfg.seed``;
    the clients with data first) for one local step each (``local_steps=1``), on deep copies of ``model`` and
    ``algo`` (hooks and state included) and a fresh client-state store.

    Sizing, on one torch thread (where a process on another core holds off one of several threads, every
    parallel operation waits for it, and one client's call can cost what a hundred clients' do; one thread only
    shares its core): after a warm-up call each, m is what the executor trains in about ``budget_s`` seconds, at
    least 1 and at most the sampled clients and ``engine.max_parallel_clients``. The sequential executor's from
    the fastest of up to five one-client calls (as many as fit in twice the budget; its cost is linear in the
    clients); the vectorised one's grown from there towards the round's chunk, whose cost per client it predicts
    best (it falls with m for small clients, and rises for convolutions, which ``vmap`` groups): towards the
    budget in one jump while a step of m clients takes under ``budget_s / 2``, then by doublings while the next
    call would take at most :data:`PROBE_CAP_S` (extrapolated linearly).

    Timing, at the run's thread count (after a warm-up call each): ``repeats`` calls per executor, alternating
    (sequential, vectorised, sequential, ...), with Python's garbage collector off (:func:`.gcpause.paused`);
    after :data:`PROBE_MIN_REPEATS` of them it stops once one prediction is :data:`PROBE_CLEAR` times the other.
    The prediction (:func:`predict_round`) takes each executor's fastest call (:func:`call_time`).

    The run is not changed: the global torch RNG (and the device's CUDA RNG) is restored afterwards, the
    model, the algorithm and their states are copies, and the batch and augmentation draws are keyed by
    (seed, round, client), so the run draws them again the same.

    Args:
        cfg: the composed config (``train``, ``engine.max_parallel_clients``, ``seed``).
        model, algo: the run's model (on its device) and algorithm stack; not modified.
        data: the clients' training data.
        kwargs: the executors' keyword arguments (batch size, epochs, ... as the factory passes them).
        budget_s: seconds of sequential training per timed call (sets m).
        repeats: timed calls per executor at most (>= 1).
        replicas: the replicas that will train together (1: a single run).

    Returns:
        an :class:`ExecutorTiming` (seconds) with every timed call in ``samples``.

    Raises:
        whatever an executor raises on these clients (e.g. ``InfeasibleSetting`` for a rule that cannot run one
        local step, ``torch.OutOfMemoryError``); the factory's ``choose_executor`` then keeps the device's default.
    """
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    sampled, steps, chunk, order = _round1_clients(cfg, data, kwargs, replicas)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), gcpause.paused():
        executors, rctx = _probe_executors(cfg, model, algo, data, kwargs, sampled)
        timed = _timer(executors, rctx, device)
        m = _size_calls(timed, order, min(len(order), chunk), budget_s)
        if torch.get_num_threads() != 1:  # warm-up at the run's thread count
            _warm_up(timed, order)
        samples = _interleaved_samples(timed, order, m, steps, chunk, repeats)
        executors.clear()  # the vectorised executor refers to itself: unreachable now, its cycle is freed at exit
    return ExecutorTiming.from_samples(samples, m, steps, chunk, time.perf_counter() - t0)


def _round1_clients(cfg, data: ClientData, kwargs: Dict,
                    replicas: int = 1) -> Tuple[List[int], List[int], int, List[int]]:
    """Round 1's sampled clients (``cfg.train``'s sampler, ``cfg.seed``), their local step counts K_i, the clients
    trained at once (``engine.max_parallel_clients``, 0: all), and the order the probe trains them in: the clients
    with data first. With ``replicas`` R > 1, the steps and the order are R times over (a population's round) and
    the chunk is all of them unless ``engine.max_parallel_clients`` is set."""
    t = cfg.train
    r = max(1, int(replicas))
    sampled = sample_clients(len(data.indices), t.participation, t.sampler, int(cfg.seed), 1).tolist()
    sizes = [data.size(c) for c in sampled]
    steps = [client_steps(n, kwargs["batch_size"], kwargs["local_epochs"], kwargs.get("local_steps", 0))
             for n in sizes] * r
    chunk = int(cfg.engine.max_parallel_clients) or len(sampled) * r
    order = ([c for c, n in zip(sampled, sizes) if n > 0] + [c for c, n in zip(sampled, sizes) if n == 0]) * r
    return sampled, steps, chunk, order


def _probe_executors(cfg, model: torch.nn.Module, algo, data: ClientData, kwargs: Dict,
                     sampled: List[int]) -> Tuple[Dict[str, Executor], RoundContext]:
    """The two executors for one local step (``local_steps=1``) on deep copies of ``model`` and ``algo``, and round
    1's context for them (the copied model's parameters, the copied algorithm's initial broadcast)."""
    t = cfg.train
    num_clients = len(data.indices)
    m_copy, a_copy = copy.deepcopy((model, algo))
    one = dict(kwargs, local_steps=1)
    executors = {"sequential": SequentialExecutor(m_copy, a_copy, data, **one),
                 "vectorized": VectorizedExecutor(m_copy, a_copy, data, **one)}
    g = flatten_params(m_copy)
    rctx = RoundContext(round=1, lr=float(t.lr), lr0=float(t.lr), global_flat=g,
                        spec=ParamSpec.from_model(m_copy), num_clients=num_clients,
                        mean_client_size=sum(map(data.size, range(num_clients))) / num_clients,
                        sampled=tuple(sampled), seed=int(cfg.seed),
                        extra=a_copy.broadcast(a_copy.init_server_state(g)))
    return executors, rctx


def _timer(executors: Dict[str, Executor], rctx: RoundContext, device: torch.device) -> Timed:
    """``timed(name, ids)``: the wall seconds of executor ``name``'s round on clients ``ids`` (a fresh client-state
    store each call), the device synchronised before and after."""

    def timed(name: str, ids: List[int]) -> float:
        _sync(device)
        start = time.perf_counter()
        executors[name].run_round(rctx, ids, ClientStateStore("cpu"))
        _sync(device)
        return time.perf_counter() - start

    return timed


def _warm_up(timed: Timed, order: List[int]) -> None:
    """One untimed one-client call per executor: first calls initialise kernels (and vmap's imports)."""
    timed("sequential", order[:1])
    timed("vectorized", order[:1])


def _size_calls(timed: Timed, order: List[int], limit: int, budget_s: float) -> Dict[str, int]:
    """Executor name -> how many clients its timed calls train (1 to ``limit``), sized on one torch thread (no
    waits for a thread another process holds off its core) after a warm-up call each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _warm_up(timed, order)
        seq = _size_sequential(timed, order, limit, budget_s)
        return {"sequential": seq, "vectorized": _size_vectorized(timed, order, seq, limit, budget_s)}
    finally:
        torch.set_num_threads(threads)


def _size_sequential(timed: Timed, order: List[int], limit: int, budget_s: float) -> int:
    """The clients the sequential executor trains in about ``budget_s``, from the fastest of up to five one-client
    calls (as many as fit in twice the budget; its cost is linear in the clients)."""
    ones = [timed("sequential", order[:1])]
    while len(ones) < 5 and sum(ones) < 2 * budget_s:  # a light model: up to 5 one-client calls
        ones.append(timed("sequential", order[:1]))
    return max(1, min(limit, int(budget_s / max(min(ones), 1e-9))))


def _size_vectorized(timed: Timed, order: List[int], start: int, limit: int, budget_s: float) -> int:
    """The vectorised executor's clients, grown from ``start`` towards ``limit`` (the round's chunk): in one jump
    towards the budget while a call takes under ``budget_s / 2``, then by doublings while the next call would take
    at most :data:`PROBE_CAP_S` (extrapolated linearly)."""
    mv, tv = start, timed("vectorized", order[:start])
    for _ in range(12):  # grow the vectorised chunk towards the round's (12 doublings reach 4,096 clients)
        if mv >= limit:
            break
        quick = tv < budget_s / 2  # towards the budget in one jump
        nxt = min(limit, max(2 * mv, int(mv * budget_s / max(tv, 1e-9))) if quick else 2 * mv)
        if not quick and tv * nxt / mv > PROBE_CAP_S:  # the next call would take longer than the cap
            break
        mv, tv = nxt, timed("vectorized", order[:nxt])
    return mv


def _interleaved_samples(timed: Timed, order: List[int], m: Dict[str, int], steps: List[int], chunk: int,
                         repeats: int) -> Dict[str, List[float]]:
    """Executor name -> the seconds of its timed calls on ``order[:m[name]]``, alternating between the executors (a
    disturbance hits one call of one executor, not a whole side): ``repeats`` each at most, fewer once, after
    :data:`PROBE_MIN_REPEATS`, one predicted round is :data:`PROBE_CLEAR` times the other."""
    samples: Dict[str, List[float]] = {name: [] for name in EXECUTOR_NAMES}
    for i in range(max(1, repeats)):
        for name in EXECUTOR_NAMES:
            samples[name].append(timed(name, order[:m[name]]))
        if i + 1 >= PROBE_MIN_REPEATS:
            pred = predict_round({n: call_time(v) for n, v in samples.items()}, m, steps, chunk)
            if max(pred.values()) > PROBE_CLEAR * min(pred.values()):
                break  # a clear winner: more calls would not change it
    return samples


def workload_key(cfg, model: torch.nn.Module, data: ClientData, kwargs: Dict, replicas: int = 1) -> str:
    """What the probe's result depends on, as a string (the key of :func:`cached_timing`): the model's device and
    the torch thread count, the data's dtype and sample shape, every client's size, the ``dataset``, ``model`` and
    ``algorithm`` sections, the executors' local-step settings (``kwargs`` less the seed), the sampler and
    participation, ``engine.max_parallel_clients``, ``engine.kernels``, the model's parameter count and the replicas
    that train together (``replicas``, a population). Not the keys a replica carries
    (:func:`fl_core.config.replica_keys`: eta_l, the rules' tuned parameters), the
    seed or the number of rounds: they change which clients round 1 samples, not what a round
    of this workload costs."""
    c = drop_keys(to_container(cfg), replica_keys())  # a replica's own values do not change what a round costs
    sizes = hashlib.sha256(json.dumps([int(ix.numel()) for ix in data.indices]).encode()).hexdigest()
    blob = {"device": str(next(model.parameters()).device), "threads": torch.get_num_threads(),
            "dtype": str(data.x.dtype), "shape": list(data.x.shape[1:]), "num_classes": data.num_classes,
            "sizes": sizes, "dataset": c["dataset"], "model": c["model"], "algorithm": c["algorithm"],
            "executor": {k: v for k, v in kwargs.items() if k != "seed"},
            "sampler": [c["train"]["sampler"], c["train"]["participation"]],
            "engine": [c["engine"]["max_parallel_clients"], c["engine"]["kernels"]],
            "d": sum(p.numel() for p in model.parameters()), "replicas": max(1, int(replicas))}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


_cache: Dict[str, ExecutorTiming] = {}
_cache_lock = threading.Lock()


def cached_timing(key: str, probe: Callable[[], ExecutorTiming]) -> ExecutorTiming:
    """``probe()``'s result for workload ``key`` (:func:`workload_key`), measured once per process: later calls
    with the same key return it with ``cached=True`` and do not time anything. A probe that raises is not kept."""
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return replace(hit, cached=True)
    timing = probe()
    with _cache_lock:
        _cache[key] = timing
    return timing


def clear_cache(key: Optional[str] = None) -> None:
    """Forget the probe's result for ``key``, or every result (the next ``auto`` build probes again)."""
    with _cache_lock:
        if key is None:
            _cache.clear()
        else:
            _cache.pop(key, None)
