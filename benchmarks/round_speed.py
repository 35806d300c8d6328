#!/usr/bin/env python
"""Round-speed benchmark: milliseconds per federated round.

Compares, on the same in-memory random data and the same sampled clients:

- ``naive``: the per-client loop of the papers' code, written here: for every sampled client a
  fresh model (the workload's, e.g. :class:`~fl_core.models.cnn.StandardCNN`) loaded with the global
  ``state_dict`` and a new ``torch.optim.SGD``, shuffled mini-batches from index tensors, then a
  data-size weighted average of the client models into the global one.
- ``sequential`` / ``vectorized`` (and any other registered executor): the engine's
  :class:`~fl_core.engine.simulator.Simulator` built by
  :func:`~fl_core.engine.factory.build_simulator`, with MLflow logging on (a temporary SQLite store,
  metrics flushed every round). A row is skipped with a note when the config rejects the executor
  (``ConfigError``), so the script runs before an executor lands.
- ``auto``: ``engine.executor=auto``; the table names the executor it chose, the notes its reason
  (the timed probe at build time, :func:`~fl_core.engine.factory.choose_executor`, is not in the
  round times; its duration is in the reason).

Workloads (FedAvg, IID equal-size partition, fixed sampler):

- ``W0`` (cross-device): 10,000 clients x 5 samples, 1,000 per round, E = 1, B = 5, logistic
  regression (``model=logreg``) on digits-shaped data (1 x 8 x 8, 10 classes).
- ``W0-200``: W0 with 200 clients per round.
- ``W1``: 100 clients x 100 samples, 10 per round, E = 1, B = 50, standard CNN on CIFAR-shaped data.
- ``W2``: 100 clients x 500 samples, 10 per round, E = 5, B = 50, standard CNN on CIFAR-shaped data.
- ``V0``: 20 clients x 32 samples, 4 per round, E = 1, B = 16, ``model=vit_tiny`` (12 layers of width 64) on
  CIFAR-shaped data: a large model's layout at a size a CPU trains (8 local steps per round).
- ``V1`` (CUDA only; skipped with its reason elsewhere): 100 clients x 32 samples, 10 per round, E = 1, B = 16,
  ``model=vit_b_16`` (d = 85.8 M, inputs resized to 224 inside the model) on CIFAR-shaped data: FedBCGD's ViT-B
  setting (B = 16, 10 clients per round) with fewer samples per client (20 local steps per round).

Every row also reports local steps per second (the workload's SGD steps per round / the median round time) and
its peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (tensors), reset at the row's start; on the CPU the
process's peak resident set (``VmHWM``, reset at the row's start through ``/proc/self/clear_refs``; data, model,
libraries and the interpreter included), where the kernel allows the reset, else the process's peak so far.

Timing: median [IQR] over the timed rounds after the warm-up rounds (pooled over ``--repeats``: every row once per
repeat, in the given order and, every other repeat, the reverse one, so a drift in the machine's load or state reaches
all rows alike; the table also gives the spread of the repeats' own medians and, for ``auto``, its median round over
the chosen executor's, repeat by repeat), the slowest round over the median and Python's full garbage collections
in the timed part (how many, the longest pause). ``--busy N`` runs N busy-loop processes throughout (another
CPU-bound job); ``--probes K`` builds the ``auto`` simulator K more times per workload with the probe's cache cleared
and counts its choices. The table names the command, the machine and its load average. Executors: the history's
``round_time_s`` (sampling, local training, aggregation); evaluation is switched off
(``train.eval_every`` > rounds) and the last round, which the simulator always evaluates, is run
but not timed. The "wall" column adds what ``round_time_s`` leaves out (MLflow logging, loop
overhead): the time between consecutive round callbacks. Naive: ``time.perf_counter`` around the
round, with ``torch.cuda.synchronize()`` on CUDA.

Examples::

    python benchmarks/round_speed.py --quick
    python benchmarks/round_speed.py --workloads W0,W1
    python benchmarks/round_speed.py --workloads W0-200,W0 --executors sequential,vectorized,auto --repeats 5 \
        --probes 10 --busy 1
    python benchmarks/round_speed.py --device cuda --workloads W0,W1,W2 --out results/round_speed.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from anywhere, without an install
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fl_core.config import ConfigError, compose  # noqa: E402
from fl_core.data.partition import Partition  # noqa: E402
from fl_core.data.sampling import sample_clients  # noqa: E402
from fl_core.data.sources import FLDataset  # noqa: E402
from fl_core.engine.executors import ClientData  # noqa: E402
from fl_core.engine.factory import build_simulator  # noqa: E402
from fl_core.models import MODELS  # noqa: E402

# Per-channel statistics of x/255 on the CIFAR-10 training set (docs/algorithms.md, Augmentation and normalisation).
CIFAR10_MEAN = (0.491, 0.482, 0.447)
CIFAR10_STD = (0.247, 0.243, 0.262)
NUM_CLASSES = 10


@dataclass(frozen=True)
class DataShape:
    """The random data of a workload: ``dataset.name`` (config and model catalogue), one image's shape,
    the raw maximum and the per-channel mean/std of x / scale used to normalise."""

    name: str
    input_shape: Tuple[int, int, int]
    scale: float
    mean: Tuple[float, ...]
    std: Tuple[float, ...]


DATA_SHAPES: Dict[str, DataShape] = {
    "cifar10": DataShape("cifar10", (3, 32, 32), 255.0, CIFAR10_MEAN, CIFAR10_STD),
    # uniform integers 0..16 (the range of scikit-learn's digits): mean 1/2, std sqrt((17^2 - 1) / 12) / 16
    "digits": DataShape("digits", (1, 8, 8), 16.0, (0.5,), (0.306,)),
}
TEST_SAMPLES = 10  # tiny: only the last (untimed) round evaluates
LR = 0.05  # train.lr (the project default), for the naive loop and the executors alike


@dataclass(frozen=True)
class Workload:
    name: str
    num_clients: int
    samples_per_client: int
    clients_per_round: int
    local_epochs: int
    batch_size: int
    dataset: str = "cifar10"  # a key of DATA_SHAPES
    model: str = "std_cnn"  # a key of fl_core.models.MODELS (model.name)
    cuda_only: str = ""  # non-empty: the workload runs on CUDA only; why not on the CPU (the skipped row's note)

    @property
    def shape(self) -> DataShape:
        return DATA_SHAPES[self.dataset]

    @property
    def participation(self) -> float:
        return self.clients_per_round / self.num_clients

    @property
    def samples_per_round(self) -> int:
        """Samples processed per round: E x n_i x clients."""
        return self.local_epochs * self.samples_per_client * self.clients_per_round

    @property
    def steps_per_round(self) -> int:
        return self.clients_per_round * self.local_epochs * -(-self.samples_per_client // self.batch_size)

    def describe(self) -> str:
        return (f"{self.num_clients:,} clients x {self.samples_per_client} samples, "
                f"{self.clients_per_round:,} per round, E={self.local_epochs}, B={self.batch_size} "
                f"({self.samples_per_round:,} samples, {self.steps_per_round:,} SGD steps per round)")


WORKLOADS: Dict[str, Workload] = {
    "W0": Workload("W0", 10_000, 5, 1_000, 1, 5, dataset="digits", model="logreg"),
    "W0-200": Workload("W0-200", 10_000, 5, 200, 1, 5, dataset="digits", model="logreg"),
    "W1": Workload("W1", 100, 100, 10, 1, 50),
    "W2": Workload("W2", 100, 500, 10, 5, 50),
    "V0": Workload("V0", 20, 32, 4, 1, 16, model="vit_tiny"),
    "V1": Workload("V1", 100, 32, 10, 1, 16, model="vit_b_16",
                   cuda_only="vit_b_16 (85.8 M parameters, every batch resized to 224x224) is a GPU workload: a local "
                             "step of 16 samples is ~1.7 TFLOP; V0 runs the same layout (vit_tiny) on the CPU"),
}
EXECUTOR_ROWS = ("naive", "sequential", "vectorized", "auto", "distributed")
DISTRIBUTED_RANKS = 2  # the distributed row: torchrun --nproc_per_node 2 on this machine (gloo / NCCL)


@dataclass
class Row:
    workload: str
    executor: str
    device: str
    ms: Optional[float] = None  # median ms per round
    wall_ms: Optional[float] = None  # median ms between round ends (includes logging)
    note: str = ""
    spread: str = ""  # min-max of the timed rounds (progress log only)
    chosen: str = ""  # auto: the executor it picked
    reason: str = ""  # auto: why (executor.reason)
    peak_mib: Optional[float] = None  # peak memory of the row (PeakMemory), MiB
    times: List[float] = field(default_factory=list)  # seconds of the timed rounds
    walls: List[float] = field(default_factory=list)  # seconds between timed round ends
    repeat_ms: List[float] = field(default_factory=list)  # each repeat's median ms per round, in repeat order
    vs_chosen: List[float] = field(default_factory=list)  # auto: its repeat i's median / the chosen row's repeat i's
    probes: List[Tuple[str, float]] = field(default_factory=list)  # auto, --probes: (choice, probe s) per fresh probe
    gc_pauses: Optional[List[float]] = None  # seconds of each full garbage collection in the timed rounds (FullGC)


def merge(rows: List[Row]) -> Row:
    """One row from the repeats of a (workload, executor) row: medians over all their timed rounds, each repeat's
    median kept (``repeat_ms``), the smallest of their peak memories (a row's resident set starts from what earlier rows
    left; the smallest peak is the least inflated by them); auto's choices counted when they differ (the first repeat probes, the others reuse
    its result, :func:`fl_core.engine.autoprobe.cached_timing`), the reason of the first repeat."""
    first = rows[0]
    if first.note:
        return first
    times = [t for r in rows for t in r.times]
    walls = [t for r in rows for t in r.walls]
    picks = [r.chosen for r in rows if r.chosen]
    chosen = ", ".join(f"{n} {picks.count(n)}/{len(picks)}" for n in sorted(set(picks))) if len(set(picks)) > 1 \
        else (picks[0] if picks else "")
    reason = first.reason + (f" (repeat 1 of {len(rows)}; the later repeats reuse its probe)"
                             if first.reason and len(rows) > 1 else "")
    peaks = [r.peak_mib for r in rows if r.peak_mib is not None]
    return Row(first.workload, first.executor, first.device, _median_ms(times), _median_ms(walls),
               spread=_spread(times), chosen=chosen, reason=reason, times=times, walls=walls,
               peak_mib=min(peaks) if peaks else None, repeat_ms=[r.ms for r in rows if r.ms is not None],
               gc_pauses=None if first.gc_pauses is None else [p for r in rows for p in (r.gc_pauses or [])])


def pair_auto(merged: List[Row], reps: Dict[str, List[Row]]) -> None:
    """Set each merged auto row's ``vs_chosen``: repeat by repeat, auto's median round / the median round of the
    executor it chose in the same repeat (rows of one repeat run minutes apart at most, so a change in the
    machine's load between repeats cancels out)."""
    for row in merged:
        if row.executor != "auto" or row.note or row.chosen not in reps:
            continue
        pairs = zip(reps["auto"], reps[row.chosen])
        row.vs_chosen = [a.ms / c.ms for a, c in pairs if a.ms and c.ms and a.chosen == row.chosen]


# --------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(table: str, out: Optional[Path]) -> None:
    """The markdown table on stdout, and also in ``out`` (its folder made) when given."""
    print(table, end="")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name} but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class PeakMemory:
    """Peak memory of one row (module docstring): :meth:`start` at the row's start, :meth:`peak_mib` at its end.

    CUDA: ``torch.cuda.max_memory_allocated`` since ``torch.cuda.reset_peak_memory_stats`` (tensors only). CPU: the
    process's peak resident set ``VmHWM`` of ``/proc/self/status``, reset to the current resident set by writing
    ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0); where that fails, ``resource.getrusage``'s ``ru_maxrss``, the
    peak since the process started (:attr:`resettable` is then False and the table says so).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = device.type == "cuda"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        if self.resettable:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def build_model(w: Workload) -> nn.Module:
    """A fresh model of the workload (``model.name`` ``w.model``) on the CPU."""
    return MODELS[w.model](w.shape.input_shape, NUM_CLASSES)


def forward_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward FLOP of one sample, counted analytically on the Conv2d, Linear and MultiheadAttention layers.

    conv: 2 * k_h * k_w * (C_in / groups) * C_out * H_out * W_out; linear: 2 * in * out per row of its output (one
    per sample, one per token in a transformer); self-attention over T tokens of width E: 2 T E 3E (input
    projection) + 2 T E E (output projection, which the attention applies functionally, so its Linear hook does not
    fire) + 4 T T E (scores and their weighted sum). Biases, normalisation, activations, softmax and pooling are left
    out. Output sizes come from one forward pass (batch 1) on the model's device.
    """
    total = 0

    def hook(mod, inp, out):
        nonlocal total
        if isinstance(mod, nn.Conv2d):
            kh, kw = mod.kernel_size
            total += 2 * kh * kw * (mod.in_channels // mod.groups) * mod.out_channels * out.shape[-2] * out.shape[-1]
        elif isinstance(mod, nn.Linear):
            total += 2 * mod.in_features * mod.out_features * (out.numel() // out.shape[-1])
        elif isinstance(mod, nn.MultiheadAttention):
            e = mod.embed_dim
            t = inp[0].numel() // e  # batch 1: the query's tokens
            total += 2 * t * e * 3 * e + 2 * t * e * e + 4 * t * t * e

    kinds = (nn.Conv2d, nn.Linear, nn.MultiheadAttention)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, kinds)]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    return total


def make_dataset(w: Workload, seed: int) -> FLDataset:
    """Random data of the workload's shape: uint8 [N, *input_shape] in [0, scale], 10 classes, its mean/std."""
    g = torch.Generator().manual_seed(seed)
    n = w.num_clients * w.samples_per_client
    s = w.shape
    hi = int(s.scale) + 1
    return FLDataset(
        name=s.name,
        x_train=torch.randint(0, hi, (n, *s.input_shape), dtype=torch.uint8, generator=g),
        y_train=torch.randint(0, NUM_CLASSES, (n,), dtype=torch.int64, generator=g),
        x_test=torch.randint(0, hi, (TEST_SAMPLES, *s.input_shape), dtype=torch.uint8, generator=g),
        y_test=torch.randint(0, NUM_CLASSES, (TEST_SAMPLES,), dtype=torch.int64, generator=g),
        num_classes=NUM_CLASSES, scale=s.scale, mean=s.mean, std=s.std)


def make_partition(w: Workload, ds: FLDataset, seed: int) -> Partition:
    """IID, equal sizes: a random permutation cut into ``num_clients`` pieces."""
    perm = np.random.default_rng(seed).permutation(w.num_clients * w.samples_per_client)
    pieces = np.split(perm.astype(np.int64), w.num_clients)
    return Partition.from_indices(pieces, ds.y_train.numpy(), NUM_CLASSES)


def make_client_data(ds: FLDataset, part: Partition, device: torch.device, chunk: int = 4096) -> ClientData:
    """What :func:`fl_core.engine.factory.client_data` builds, normalised in chunks (lower peak memory)."""
    x = torch.empty(ds.x_train.shape, dtype=torch.float32, device=device)
    for s in range(0, x.shape[0], chunk):
        x[s:s + chunk] = ds.normalize(ds.x_train[s:s + chunk].to(device))
    return ClientData(x, ds.y_train.to(device), part.client_indices, ds.num_classes)


def overrides(w: Workload, executor: str, device: torch.device, rounds: int, seed: int,
              extra: Sequence[str] = ()) -> List[str]:
    return [
        f"dataset={w.dataset}", f"model={w.model}", "partition=iid", "algorithm=fedavg",
        f"partition.num_clients={w.num_clients}",
        f"train.participation={w.participation}", "train.sampler=fixed",
        f"train.local_epochs={w.local_epochs}", f"train.batch_size={w.batch_size}",
        f"train.lr={LR}", "train.lr_decay=1.0", "train.weight_decay=0.0", "train.grad_clip=null",
        f"train.rounds={rounds}", f"train.eval_every={rounds + 1}",
        f"engine.executor={executor}", f"engine.device={device.type}", "engine.checkpoint_every=0",
        "engine.progress=false", "tracking.log_every=1", f"seed={seed}", *extra,
    ]


def _spread(xs: Sequence[float]) -> str:
    return f"min {1e3 * min(xs):.1f}, max {1e3 * max(xs):.1f}" if xs else ""


def _median_ms(xs: Sequence[float]) -> Optional[float]:
    return 1e3 * statistics.median(xs) if xs else None


def _iqr_ms(xs: Sequence[float]) -> Tuple[float, float]:
    """The first and third quartile of ``xs`` (seconds) in ms (``statistics.quantiles``, inclusive method)."""
    if len(xs) < 2:
        return 1e3 * xs[0], 1e3 * xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return 1e3 * q[0], 1e3 * q[2]


class FullGC:
    """Python's full garbage collections (generation 2) while :attr:`active`: the pause of each (``gc.callbacks``).
    A row sets it active from the end of its last warm-up round to the end of its last timed round, so the rounds
    and what the loop does between them (MLflow logging) count."""

    def __init__(self):
        self.active = False
        self.pauses: List[float] = []
        self._start: Optional[float] = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            if self.active:
                self.pauses.append(time.perf_counter() - self._start)
            self._start = None

    def take(self) -> List[float]:
        """The pauses recorded since the last call; stops recording."""
        out, self.pauses, self.active = self.pauses, [], False
        return out


FULL_GC = FullGC()


class BusyNeighbours:
    """``--busy N``: N processes that each keep one core busy (a Python busy loop) while the benchmark runs, the
    load of another CPU-bound job on the machine; stopped (killed, by their process ids) on exit."""

    def __init__(self, count: int):
        self.count = count
        self.procs: List = []

    def __enter__(self) -> "BusyNeighbours":
        import subprocess

        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        if self.procs:
            time.sleep(0.5)  # running before the first row starts
            log(f"--busy {self.count}: busy-loop process(es) {', '.join(str(p.pid) for p in self.procs)}")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- rows


def run_naive(w: Workload, data: ClientData, device: torch.device, warmup: int, timed: int, seed: int) -> Row:
    """The papers' per-client loop: fresh model + optimiser per client, state_dict averaging."""
    torch.manual_seed(seed)
    global_sd = {k: v.detach().clone() for k, v in build_model(w).to(device).state_dict().items()}
    times: List[float] = []
    loss = float("nan")
    FULL_GC.take()
    for r in range(1, warmup + timed + 1):
        FULL_GC.active = r > warmup
        sync(device)
        t0 = time.perf_counter()
        clients = sample_clients(w.num_clients, w.participation, "fixed", seed, r)
        total = sum(data.size(int(c)) for c in clients)
        new_sd = {k: torch.zeros_like(v) for k, v in global_sd.items()}
        losses = []
        for c in clients:
            model = build_model(w).to(device)
            model.load_state_dict(global_sd)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            idx = data.indices[int(c)]
            n = idx.numel()
            loss_sum = torch.zeros((), device=device)
            steps = 0
            for _ in range(w.local_epochs):
                perm = torch.randperm(n, device=device)
                for s in range(0, n, w.batch_size):
                    b = idx[perm[s:s + w.batch_size]]
                    out = F.cross_entropy(model(data.x[b]), data.y[b])
                    opt.zero_grad()
                    out.backward()
                    opt.step()
                    loss_sum += out.detach()
                    steps += 1
            losses.append(float(loss_sum) / steps)  # one host sync per client, as the engine does
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    new_sd[k].add_(v, alpha=n / total)
        global_sd = new_sd
        sync(device)
        dt = time.perf_counter() - t0
        loss = sum(losses) / len(losses)
        if r > warmup:
            times.append(dt)
        log(f"  {w.name} naive round {r}: {1e3 * dt:.1f} ms{' (warm-up)' if r <= warmup else ''}, "
            f"train_loss {loss:.4f}")
    ms = _median_ms(times)
    return Row(w.name, "naive", device.type, ms, ms, spread=_spread(times), times=times, walls=times,
               gc_pauses=FULL_GC.take())


class _Tracking:
    """A lazily created MLflow Tracking on a temporary SQLite store (never the project's store)."""

    def __init__(self):
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self._tracking = None
        self._saved_uri: Optional[str] = None

    def get(self):
        if self._tracking is None:
            from fl_core.store.tracking import Tracking

            self._tmp = tempfile.TemporaryDirectory(prefix="round_speed_mlflow_")
            self._saved_uri = os.environ.pop("MLFLOW_TRACKING_URI", None)  # force the temporary store
            self._tracking = Tracking("round-speed-benchmark", root=Path(self._tmp.name))
            log(f"  MLflow store: {self._tracking.uri}")
        return self._tracking

    def close(self) -> None:
        if self._saved_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = self._saved_uri
        if self._tmp is not None:
            self._tmp.cleanup()


def run_executor(name: str, w: Workload, ds: FLDataset, part: Partition, data: ClientData, device: torch.device,
                 warmup: int, timed: int, seed: int, tracking: Optional[_Tracking], extra: Sequence[str]) -> Row:
    """One executor row: ``warmup`` + ``timed`` + 1 rounds, the timed ones' ``round_time_s``. ``tracking``: the
    rounds are logged to its MLflow store as a user's run logs them; None: no logging (``extra`` should then hold
    ``tracking.enabled=false``; benchmarks/gpu_check.py, which runs where MLflow is not installed)."""
    rounds = warmup + timed + 1  # the last round always evaluates: run it, do not time it
    try:
        cfg = compose(overrides(w, name, device, rounds, seed, extra))
    except ConfigError as err:
        return Row(w.name, name, device.type, note=f"skipped: config rejects it ({err})")
    stamps: Dict[int, float] = {}

    def on_round(r: int, row: Dict[str, float]) -> None:
        stamps[r] = time.perf_counter()
        FULL_GC.active = warmup <= r < warmup + timed  # round r + 1 is timed
        kind = "warm-up" if r <= warmup else "timed" if r <= warmup + timed else "untimed, evaluates"
        log(f"  {w.name} {name} round {r}: {1e3 * row['round_time_s']:.1f} ms ({kind}), "
            f"train_loss {row['train_loss']:.4f}")

    torch.manual_seed(seed)
    try:
        sim = build_simulator(cfg, ds, part, device=device, data=data, callbacks=[on_round])
    except KeyError as err:  # config accepts the name but the registry does not have it (yet)
        return Row(w.name, name, device.type, note=f"skipped: no executor registered as {err}")
    except ValueError as err:  # the executor refuses this model/algorithm
        return Row(w.name, name, device.type, note=f"skipped: {err}")
    logger = None
    if tracking is not None:
        logger = tracking.get().child_logger(None, f"{w.name}/{name}", {"benchmark": "round_speed"},
                                             {"workload": w.name, "executor": name, "device": device.type},
                                             log_every=1)
        sim.logger = logger
    FULL_GC.take()
    FULL_GC.active = warmup == 0
    try:
        result = sim.run()
    except BaseException:
        if logger is not None:
            logger.close("KILLED", "benchmark interrupted")
        raise
    if logger is not None:
        logger.close("FINISHED")
    timed_rows = [h for h in result.history if warmup < h["round"] <= warmup + timed]
    assert all("test_acc" not in h for h in timed_rows), "a timed round evaluated"
    times = [h["round_time_s"] for h in timed_rows]
    walls = [stamps[r] - stamps[r - 1] for r in range(warmup + 1, warmup + timed + 1) if r - 1 in stamps]
    chosen, reason = sim.executor.name, sim.executor.reason
    del sim, result
    return Row(w.name, name, device.type, _median_ms(times), _median_ms(walls), spread=_spread(times),
               chosen=chosen if name == "auto" else "", reason=reason if name == "auto" else "", times=times,
               walls=walls, gc_pauses=FULL_GC.take())


def run_probes(w: Workload, ds: FLDataset, part: Partition, data: ClientData, device: torch.device, seed: int,
               count: int, extra: Sequence[str]) -> List[Tuple[str, float]]:
    """``--probes K``: build the ``auto`` simulator K times with the probe's cache cleared before each (so each build
    probes afresh, as a new process would) and no round run; returns (chosen executor, probe seconds) per build."""
    from fl_core.engine import autoprobe

    cfg = compose(overrides(w, "auto", device, 1, seed, ["tracking.enabled=false", *extra]))
    out = []
    for i in range(count):
        autoprobe.clear_cache()
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        sim = build_simulator(cfg, ds, part, device=device, data=data)
        out.append((sim.executor.name, time.perf_counter() - t0))
        log(f"  {w.name} auto probe {i + 1}/{count}: {sim.executor.reason}")
        del sim
    return out


def run_distributed(w: Workload, device: torch.device, warmup: int, timed: int, seed: int,
                    threads: Optional[int]) -> Row:
    """The ``distributed`` row: ``engine.executor=distributed`` over :data:`DISTRIBUTED_RANKS` processes started
    with torchrun on this machine (each rank: the sequential executor, torchrun's one thread per process unless
    ``--threads``); rank 0 times the rounds as :func:`run_executor` does (without MLflow) and prints them."""
    import json
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(DISTRIBUTED_RANKS),
           "--master_addr", "127.0.0.1", "--master_port", str(port), __file__, "--rank-row", w.name,
           "--warmup", str(warmup), "--rounds", str(timed), "--seed", str(seed), "--device", device.type]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Row(w.name, "distributed", device.type, note=f"skipped: torchrun failed ({last[:160]})")
    out = json.loads(lines[-1])
    return Row(w.name, "distributed", device.type, _median_ms(out["times"]), _median_ms(out["walls"]),
               spread=_spread(out["times"]), times=out["times"], walls=out["walls"],
               note="" if out["times"] else "skipped: no timed round")


def rank_row(args: argparse.Namespace) -> int:
    """One rank of the ``distributed`` row (``--rank-row W``, started by :func:`run_distributed`)."""
    import json

    from fl_core.engine import distributed

    w = WORKLOADS[args.rank_row]
    device = distributed.rank_device(resolve_device(args.device))
    rank, _ = distributed.init(device)
    ds = make_dataset(w, args.seed)
    part = make_partition(w, ds, args.seed)
    data = make_client_data(ds, part, device)
    rounds = args.warmup + args.rounds + 1
    cfg = compose(overrides(w, "distributed", device, rounds, args.seed, ["tracking.enabled=false"]))
    if rank > 0:
        distributed.serve(lambda job: build_simulator(cfg, ds, part, device=device, data=data).executor)
        distributed.shutdown()
        return 0
    stamps: Dict[int, float] = {}
    torch.manual_seed(args.seed)
    sim = build_simulator(cfg, ds, part, device=device, data=data,
                          callbacks=[lambda r, row: stamps.__setitem__(r, time.perf_counter())])
    result = sim.run()
    distributed.stop_workers()
    distributed.shutdown()
    timed = [h["round_time_s"] for h in result.history if args.warmup < h["round"] <= args.warmup + args.rounds]
    walls = [stamps[r] - stamps[r - 1] for r in range(args.warmup + 1, args.warmup + args.rounds + 1)
             if r - 1 in stamps]
    print(json.dumps({"times": timed, "walls": walls}), flush=True)
    return 0


RowSpec = Tuple[str, str, Sequence[str]]  # (the row's label, the executor or "naive", overrides of its config)


def time_rows(w: Workload, ds: FLDataset, part: Partition, data: ClientData, device: torch.device,
              specs: Sequence[RowSpec], repeats: int, warmup: int, timed: int, seed: int,
              tracking: Optional[_Tracking], peak: PeakMemory, *, threads: Optional[int] = None,
              before_naive: Optional[Callable[[], None]] = None,
              stop: Optional[Callable[[], bool]] = None) -> Dict[str, List[Row]]:
    """Every row of ``specs`` once per repeat, interleaved (every other repeat in the reverse order, so a drift in
    the machine's load reaches all rows alike), each with its peak memory (``peak``, reset at the row's start):
    label -> that row's :class:`Row` of each repeat. ``before_naive`` runs before each naive row (the naive loop
    takes the process's kernel settings as the rows before left them); ``stop`` returning True starts no further
    row (a time budget; the labels not reached keep fewer repeats, or none)."""
    reps: Dict[str, List[Row]] = {label: [] for label, _, _ in specs}
    for rep in range(repeats):
        for label, name, extra in (specs if rep % 2 == 0 else specs[::-1]):
            if stop is not None and stop():
                return reps
            peak.start()
            if name == "naive":
                if before_naive is not None:
                    before_naive()
                row = run_naive(w, data, device, warmup, timed, seed)
            elif name == "distributed":
                row = run_distributed(w, device, warmup, timed, seed, threads)
            else:
                row = run_executor(name, w, ds, part, data, device, warmup, timed, seed, tracking, extra)
            if name != "distributed" and not row.note:
                row.peak_mib = peak.peak_mib()
            row.repeat_ms = [row.ms] if row.ms is not None else []
            if row.note:
                log(f"  {w.name} {label}: {row.note}")
            else:
                log(f"  {w.name} {label} (repeat {rep + 1}/{repeats}): median {row.ms:.1f} ms/round "
                    f"({row.spread}){' -> ' + row.chosen if row.chosen else ''}"
                    + (f", peak {row.peak_mib:,.0f} MiB" if row.peak_mib is not None else ""))
            reps[label].append(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return reps


# --------------------------------------------------------------------------- table


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def machine(device: torch.device) -> str:
    """The machine in words: processor (or GPU), cores, RAM, torch and its thread count."""
    cores = os.cpu_count() or 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 if hasattr(os, "sysconf") else 0.0
    return (f"{device_name(device)} ({device.type}), {cores} cores, {ram:.1f} GiB RAM, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def render(rows: List[Row], workloads: List[Workload], device: torch.device, fwd_flops: Dict[str, int],
           peak_tflops: float, warmup: int, timed: int, elapsed_s: float, repeats: int = 1,
           peak_resettable: bool = True, command: str = "", busy: int = 0,
           load: Optional[Tuple[float, float]] = None) -> str:
    """The markdown table and its notes; ``fwd_flops``: workload name -> forward FLOP of one sample (workloads without
    an entry were skipped on this device); ``peak_resettable``: whether the CPU peak could be reset per row
    (:class:`PeakMemory`); ``command``: the command line (written above the table); ``busy``: ``--busy``;
    ``load``: the 1-minute load average at the start and at the end."""
    date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [f"`{command}`", ""] if command else []
    lines += [
        f"Round speed: {machine(device)}, {date}"
        + (f"; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end" if load else "")
        + (f"; {busy} busy-loop process(es) running throughout (--busy {busy})" if busy else ""),
        "",
        "| workload | executor | device | ms/round: median [IQR] | repeats' medians: min / median / max "
        "| slowest round / median | full GCs in timed rounds: count, longest ms | wall ms/round (median) "
        "| local steps/s | peak memory (MiB) | speed-up vs naive "
        "| time / best executor's | auto / chosen, per repeat: median [min, max] | FLOP-floor fraction |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_w = {w.name: w for w in workloads}
    notes: List[str] = []
    for r in rows:
        naive = next((x for x in rows if x.workload == r.workload and x.executor == "naive"), None)
        speed = "n/a"
        if r.ms is not None and naive is not None and naive.ms is not None:
            speed = f"{naive.ms / r.ms:.2f}x"
        engine = [x.ms for x in rows if x.workload == r.workload and x.executor not in ("naive", "auto")
                  and x.ms is not None]
        vs_best = f"{r.ms / min(engine):.2f}" if r.ms is not None and engine and r.executor != "naive" else "n/a"
        frac = "n/a"
        steps = f"{by_w[r.workload].steps_per_round / (r.ms / 1e3):,.1f}" if r.ms is not None else "-"
        peak = f"{r.peak_mib:,.0f}" if r.peak_mib is not None else "-"
        if r.ms is not None and device.type == "cuda":
            floor_ms = 1e3 * 3 * fwd_flops[r.workload] * by_w[r.workload].samples_per_round / (peak_tflops * 1e12)
            frac = f"{floor_ms / r.ms:.3f}"
        ms = _fmt_ms(r.ms)
        if r.times:
            lo, hi = _iqr_ms(r.times)
            ms += f" [{_fmt_ms(lo)}, {_fmt_ms(hi)}]"
        if r.note:
            notes.append(r.note)
            ms = f"{r.note.split(':')[0]} [{len(notes)}]"
        reps = (" / ".join(_fmt_ms(x) for x in (min(r.repeat_ms), statistics.median(r.repeat_ms), max(r.repeat_ms)))
                if len(r.repeat_ms) > 1 else "-")
        paired = (f"{statistics.median(r.vs_chosen):.2f} [{min(r.vs_chosen):.2f}, {max(r.vs_chosen):.2f}]"
                  if r.vs_chosen else "n/a")
        slowest = f"{1e3 * max(r.times) / r.ms:.1f}" if r.times and r.ms else "-"
        gcs = "-" if r.gc_pauses is None else (f"{len(r.gc_pauses)}, {1e3 * max(r.gc_pauses):,.0f}" if r.gc_pauses
                                                 else "0")
        executor = f"auto -> {r.chosen}" if r.chosen else r.executor
        lines.append(f"| {r.workload} | {executor} | {r.device} | {ms} | {reps} | {slowest} | {gcs} "
                     f"| {_fmt_ms(r.wall_ms)} "
                     f"| {steps} | {peak} | {speed} | {vs_best} | {paired} | {frac} |")
    lines.append("")
    for w in workloads:
        if w.name not in fwd_flops:
            lines.append(f"- {w.name}: {w.describe()}; `model={w.model}`: not run on {device.type}.")
            continue
        fwd = fwd_flops[w.name]
        flop = 3 * fwd * w.samples_per_round
        floor = f", floor {1e3 * flop / (peak_tflops * 1e12):.2f} ms at {peak_tflops:g} TFLOP/s" if device.type == "cuda" else ""
        lines.append(f"- {w.name}: {w.describe()}; `model={w.model}` on {w.dataset}-shaped data "
                     f"({fwd / 1e6:.4g} MFLOP/sample forward), {flop / 1e9:.3g} GFLOP per round{floor}; "
                     f"FedAvg, IID, fixed sampler, lr {LR}.")
    for r in rows:
        if r.reason:
            lines.append(f"- {r.workload} auto chose {r.chosen}: \"{r.reason}\"")
        if r.probes:
            picks = [n for n, _ in r.probes]
            secs = [t for _, t in r.probes]
            lines.append(f"- {r.workload} auto's choice over {len(picks)} fresh probes (--probes; cache cleared before "
                         "each build): " + ", ".join(f"{n} {picks.count(n)}/{len(picks)}" for n in sorted(set(picks)))
                         + f"; build with probe {min(secs):.2f} / {statistics.median(secs):.2f} / {max(secs):.2f} s "
                         "(min / median / max).")
    lines += [
        f"- Median [first quartile, third quartile] over {timed} timed rounds after {warmup} warm-up round(s)"
        + (f", pooled over {repeats} interleaved repeats of every row (every other repeat in reverse order); the "
           "repeats' column gives the spread of the repeats' own medians" if repeats > 1 else "")
        + "; slowest round / median: the slowest timed round (of all repeats) over the median; full GCs: Python's "
        "collections of its oldest generation from the end of the warm-up to the end of the last timed round "
        "(rounds and logging), how many and the longest pause. Executors: "
        "`round_time_s` of the history (sampling, training, aggregation). Wall: time between consecutive round ends, "
        "i.e. also "
        "MLflow logging (temporary SQLite store, flushed every round) and loop overhead. Naive: "
        "`perf_counter` around the whole round" + (" with `torch.cuda.synchronize()`." if device.type == "cuda" else "."),
        f"- No evaluation in timed rounds: `train.eval_every` > rounds; the executors' extra last round "
        f"(always evaluated, on a {TEST_SAMPLES}-sample test set) is not timed. The naive loop does no evaluation.",
        "- Speed-up: naive ms / row ms, same run. Time / best executor's: row ms / the lowest ms of the engine's "
        "executors (sequential, vectorized) on the workload, same run (auto's probe runs at build time and is "
        "not in its rounds). Auto / chosen: auto's median round over the median round of the executor it chose, "
        "each repeat with its own (same-repeat) pair, so load that changes between repeats cancels. FLOP floor: 3 x "
        "forward FLOP (conv 2*k*k*Cin*Cout*Hout*Wout + linear 2*in*out per "
        "output row + self-attention 8*T*E^2 + 4*T^2*E; biases/normalisation/activations/pooling excluded) x samples "
        f"per round, at an assumed peak of {peak_tflops:g} TFLOP/s (`--peak-tflops`; H200: ~67 fp32, ~990 bf16 "
        "dense); fraction = floor time / measured time (`n/a` on CPU).",
        "- Local steps/s: the workload's SGD steps per round / the median ms/round. Peak memory: "
        + ("`torch.cuda.max_memory_allocated` (tensors), reset at each row's start."
           if device.type == "cuda" else
           "the process's peak resident set (VmHWM), reset at each row's start to the resident set then (data, model, "
           "libraries and the interpreter included, and what earlier rows left; the auto row includes its probe); "
           "with repeats the smallest over them." if peak_resettable else
           "the process's peak resident set since it started (`ru_maxrss`; the kernel did not allow a reset per "
           "row, so a row shows at least the peak of the rows before it).")
        + " The distributed row's processes are not measured (`-`).",
    ]
    if any(w.model == "std_cnn" for w in workloads):
        fwd = next(fwd_flops[w.name] for w in workloads if w.model == "std_cnn")
        lines.append(f"- The issue's 80.6 MFLOP/sample/step of the standard CNN is 3 x forward minus conv1's input "
                     f"gradient ({(3 * fwd - _conv1_dgrad()) / 1e6:.1f}).")
    lines.append("- Data: random uint8 images of the data set's shape (not the data set), normalised with its "
                 f"mean/std. Total benchmark time {elapsed_s:.0f} s.")
    for i, n in enumerate(notes, start=1):
        lines.append(f"- [{i}] {n}")
    return "\n".join(lines) + "\n"


def _conv1_dgrad() -> int:
    """FLOP of the standard CNN's conv1 input gradient on CIFAR shapes (not needed in training: the input is data)."""
    shape = DATA_SHAPES["cifar10"].input_shape
    m = MODELS["std_cnn"](shape, NUM_CLASSES).conv1
    k = m.kernel_size[0] * m.kernel_size[1]
    hout = shape[1] - m.kernel_size[0] + 1
    return 2 * k * m.in_channels * m.out_channels * hout * hout


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Milliseconds per federated round: a naive per-client loop vs the engine's executors and "
                    "engine.executor=auto (MLflow logging on), on random data of the workload's shape.")
    p.add_argument("--quick", action="store_true",
                   help="W0,W1 only (unless --workloads), 5 timed rounds after 1 warm-up (a few minutes on 2 CPU cores)")
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"), help="where to train (default: auto = cuda if available)")
    p.add_argument("--workloads", default=None, help="comma-separated subset of W0,W0-200,W1,W2,V0,V1 (default: all; "
                                                     "--quick: W0,W1; V1 runs on CUDA only)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per row (default 10; --quick: 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds per row (default 2; --quick: 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times, interleaved (naive, sequential, ..., then the reverse order, "
                        "...); the table gives medians over all their timed rounds and the spread of the repeats' "
                        "medians (default 1)")
    p.add_argument("--executors", default=",".join(EXECUTOR_ROWS),
                   help="comma-separated rows: naive and engine.executor values (default: naive,sequential,vectorized,auto,"
                        "distributed; distributed starts 2 processes with torchrun)")
    p.add_argument("--max-parallel-clients", type=int, default=None,
                   help="engine.max_parallel_clients for the vectorized and auto rows (default: the config's)")
    p.add_argument("--busy", type=int, default=0,
                   help="start this many CPU-bound busy-loop processes for the whole benchmark (another job's load on "
                        "the machine; default 0)")
    p.add_argument("--probes", type=int, default=0,
                   help="after a workload's rows, build the auto simulator this many more times, each with the "
                        "probe's cache cleared, and count its choices (default 0)")
    p.add_argument("--peak-tflops", type=float, default=60.0, help="assumed device peak in TFLOP/s for the FLOP-floor column (default: 60)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="data, partition, model and sampling seed (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--rank-row", default=None, help=argparse.SUPPRESS)  # one rank of the distributed row
    args = p.parse_args(argv)
    args.workloads = args.workloads or ("W0,W1" if args.quick else ",".join(WORKLOADS))
    args.rounds = args.rounds if args.rounds is not None else (5 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.rounds < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--rounds and --repeats must be >= 1 and --warmup >= 0")
    if args.busy < 0 or args.probes < 0:
        p.error("--busy and --probes must be >= 0")
    names = [s.strip() for s in args.workloads.split(",") if s.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        p.error(f"--workloads: unknown {bad or names}; choose from {', '.join(WORKLOADS)}")
    args.workload_list = [WORKLOADS[n] for n in names]
    args.executor_list = [s.strip() for s in args.executors.split(",") if s.strip()]
    if not args.executor_list:
        p.error("--executors is empty")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.rank_row:
        return rank_row(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    runs = [w for w in args.workload_list if device.type == "cuda" or not w.cuda_only]
    fwd = {w.name: forward_flops(build_model(w), w.shape.input_shape) for w in runs}
    log(f"device {device} ({device_name(device)}), torch {torch.__version__}, {torch.get_num_threads()} threads; "
        "forward MFLOP/sample: " + ", ".join(f"{k} {v / 1e6:.4g}" for k, v in fwd.items()))
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    tracking = _Tracking()
    rows: List[Row] = []
    peak = PeakMemory(device)
    busy = BusyNeighbours(args.busy)
    try:
        busy.__enter__()
        for w in args.workload_list:
            if w not in runs:
                rows.append(Row(w.name, "-", device.type, note=f"skipped on {device.type}: {w.cuda_only}"))
                log(f"{w.name}: {rows[-1].note}")
                continue
            log(f"{w.name}: {w.describe()}")
            ds = make_dataset(w, args.seed)
            part = make_partition(w, ds, args.seed)
            data = make_client_data(ds, part, device)  # shared by every row of the workload
            chunk = ([f"engine.max_parallel_clients={args.max_parallel_clients}"]
                     if args.max_parallel_clients is not None else [])
            specs = [(name, name, chunk if name in ("vectorized", "auto") else []) for name in args.executor_list]
            reps = time_rows(w, ds, part, data, device, specs, args.repeats, args.warmup, args.rounds, args.seed,
                             tracking, peak, threads=args.threads)
            merged = [merge(reps[name]) for name in args.executor_list]
            pair_auto(merged, reps)
            auto = next((r for r in merged if r.executor == "auto" and not r.note), None)
            if args.probes and auto is not None:
                extra = ([f"engine.max_parallel_clients={args.max_parallel_clients}"]
                         if args.max_parallel_clients is not None else [])
                auto.probes = run_probes(w, ds, part, data, device, args.seed, args.probes, extra)
            rows.extend(merged)
            del ds, part, data
            gc.collect()
    finally:
        busy.__exit__()
        tracking.close()
    env = "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS",) if k in os.environ)
    args_given = argv if argv is not None else sys.argv[1:]
    command = env + "python benchmarks/round_speed.py" + "".join(f" {a}" for a in args_given)
    table = render(rows, args.workload_list, device, fwd, args.peak_tflops, args.warmup, args.rounds,
                   time.perf_counter() - t_start, args.repeats, peak.resettable, command=command, busy=args.busy,
                   load=(load_start, os.getloadavg()[0]))
    emit(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
