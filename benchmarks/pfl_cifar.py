#!/usr/bin/env python
"""Seconds per FedAvg round on pfl-research's CIFAR-10 cross-device set-up: this project's executors, and with
``--pfl PYTHON`` pfl-research itself, in the same sitting.

The set-up (pfl-research's benchmark, apple/pfl-research ``benchmarks/image_classification``, config
``baseline.yaml``, dataset ``cifar10_iid``; Granqvist et al., arXiv 2404.06430): 1,000 users x 50 images (the CIFAR-10
training set shuffled and cut into consecutive pieces: IID), a cohort of 50 users per round, E = 1 local epoch,
B = 10 (5 local SGD steps per user, 250 per round), local learning rate 0.1, plain SGD, FedAvg with a central SGD step
of learning rate 1.0 and every user weighing the same, their CIFAR-10 CNN (``model=pfl_cnn``,
:class:`fl_core.models.cnn.PflCNN`; d = 1,626,442). The project's runs use ``algorithm=fedavg
algorithm.aggregation=uniform algorithm.eta_g=1.0``, ``train.sampler=fixed`` (exactly 50 distinct users per round;
pfl's ``random`` sampler draws with replacement), no evaluation in timed rounds, no MLflow, no checkpoints.

Data: ``--cifar-root DIR`` reads the official CIFAR-10 python pickles under ``DIR/cifar-10-batches-py/`` with the
project's loader (:func:`fl_core.data.sources.load_source`); without it, synthetic CIFAR-shaped data of the same sizes
(random uint8 3x32x32 images, 10 random labels), and the output says so: the benchmark measures speed, not accuracy.

Rows (each ``--repeats`` times, interleaved):

- ``fl-pipeline`` / ``sequential`` and ``vectorized``: :func:`fl_core.engine.factory.build_simulator` on the set-up.
- ``pfl-research`` (``--pfl PYTHON``): ``benchmarks/pfl_driver.py`` run by ``PYTHON`` (a separate environment with
  ``pfl`` and ``torch``) on the same users' data, the same initial weights and hyper-parameters: pfl's
  ``SimulatedBackend`` training the cohort's users one after another in that one process, on the CPU.

Seconds per round: wall time between the ends of consecutive rounds (the round callback of either simulator), over
``--rounds`` timed rounds after ``--warmup`` untimed ones; min / median / max over the timed rounds of all repeats.
Ratio: the row's median / the lowest median. CPU seconds per round: the process's CPU time (``time.process_time``, all
its threads) over the same rounds, median and its ratio: what other jobs on a shared machine change least (time a
busy machine takes the core away is not counted). Every row reports the machine (CPU model, cores this process may use),
the 1-minute load average at the row's start and end (other jobs on the machine slow every row), torch's version and
its thread count (``--threads``, also passed to the pfl driver; default: torch's choice in each process).

Examples::

    OMP_NUM_THREADS=1 python benchmarks/pfl_cifar.py --pfl /path/to/pfl-venv/bin/python
    python benchmarks/pfl_cifar.py --cifar-root data/raw --threads 2 --rounds 10 --repeats 3 --out pfl.md
    python benchmarks/pfl_cifar.py --users 20 --cohort 4 --rounds 2   # a quick look at a smaller set-up
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from anywhere, without an install
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.round_speed import CIFAR10_MEAN, CIFAR10_STD, device_name, emit, log  # noqa: E402
from fl_core.config import ConfigError, compose  # noqa: E402
from fl_core.data.partition import Partition  # noqa: E402
from fl_core.data.sources import DataSourceError, FLDataset, load_source  # noqa: E402
from fl_core.engine.factory import build_simulator, client_data  # noqa: E402
from fl_core.models import MODELS  # noqa: E402
from fl_core.seeding import derive_seed  # noqa: E402

NUM_CLASSES = 10
DRIVER = Path(__file__).resolve().with_name("pfl_driver.py")


@dataclass(frozen=True)
class SetUp:
    """pfl-research's CIFAR-10 cross-device set-up (module docstring); the sizes may be changed on the command line."""

    users: int = 1000
    per_user: int = 50
    cohort: int = 50
    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.1
    eta_g: float = 1.0

    @property
    def steps_per_round(self) -> int:
        return self.cohort * self.epochs * -(-self.per_user // self.batch_size)

    def describe(self) -> str:
        return (f"{self.users:,} users x {self.per_user} images, cohort {self.cohort}, E = {self.epochs}, "
                f"B = {self.batch_size}, eta_l = {self.lr:g}, eta_g = {self.eta_g:g} (FedAvg, every user weighs 1), "
                f"model pfl_cnn; {self.steps_per_round:,} local SGD steps per round")


@dataclass
class Row:
    contender: str
    executor: str
    times: List[float] = field(default_factory=list)  # seconds of the timed rounds, all repeats
    cpu_times: List[float] = field(default_factory=list)  # the process's CPU seconds over the same rounds
    torch_version: str = ""
    threads: int = 0
    loads: List[Tuple[float, float]] = field(default_factory=list)  # 1-min load average at each run's start, end
    note: str = ""


def load_avg() -> float:
    return os.getloadavg()[0]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- data


def make_data(setup: SetUp, root: Optional[Path], seed: int) -> Tuple[FLDataset, Partition, str]:
    """The dataset, its IID partition into ``setup.users`` users of ``setup.per_user`` images (a seeded permutation cut
    into consecutive pieces, as pfl-research's ``cifar10_iid``) and a line saying which data it is.

    Raises:
        SystemExit: one line naming ``--cifar-root`` when the files cannot be read, or when they hold fewer images than
            the set-up needs.
    """
    need = setup.users * setup.per_user
    if root is not None:
        cfg = compose(["dataset=cifar10", f"dataset.root={root}"]).dataset
        try:
            ds = load_source(cfg, root)
        except DataSourceError as err:
            raise SystemExit(f"error: --cifar-root {root}: {err}") from None
        if ds.x_train.shape[0] < need:
            raise SystemExit(f"error: --cifar-root {root}: {ds.x_train.shape[0]:,} training images, the set-up needs "
                             f"{need:,} (--users x --per-user)")
        what = f"CIFAR-10 from {root} ({need:,} of its {ds.x_train.shape[0]:,} training images)"
    else:
        g = torch.Generator().manual_seed(seed)
        ds = FLDataset(
            name="cifar10",
            x_train=torch.randint(0, 256, (need, 3, 32, 32), dtype=torch.uint8, generator=g),
            y_train=torch.randint(0, NUM_CLASSES, (need,), dtype=torch.int64, generator=g),
            x_test=torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8, generator=g),
            y_test=torch.randint(0, NUM_CLASSES, (10,), dtype=torch.int64, generator=g),
            num_classes=NUM_CLASSES, scale=255.0, mean=CIFAR10_MEAN, std=CIFAR10_STD)
        what = (f"SYNTHETIC CIFAR-shaped data ({need:,} random uint8 3x32x32 images, 10 random labels; no CIFAR-10 "
                "root given): speed only, the accuracy means nothing")
    perm = np.random.default_rng(seed).permutation(ds.x_train.shape[0])[:need].astype(np.int64)
    part = Partition.from_indices(np.split(perm, setup.users), ds.y_train.numpy(), NUM_CLASSES)
    return ds, part, what


def overrides(setup: SetUp, executor: str, rounds: int, seed: int) -> List[str]:
    return [
        "dataset=cifar10", "model=pfl_cnn", "partition=iid", f"partition.num_clients={setup.users}",
        "algorithm=fedavg", "algorithm.aggregation=uniform", f"algorithm.eta_g={setup.eta_g}",
        f"train.participation={setup.cohort / setup.users}", "train.sampler=fixed",
        f"train.local_epochs={setup.epochs}", f"train.batch_size={setup.batch_size}", f"train.lr={setup.lr}",
        "train.lr_decay=1.0", "train.weight_decay=0.0", "train.momentum=0.0", "train.grad_clip=null",
        f"train.rounds={rounds}", f"train.eval_every={rounds + 1}",
        f"engine.executor={executor}", "engine.device=cpu", "engine.checkpoint_every=0", "engine.progress=false",
        "tracking.enabled=false", f"seed={seed}",
    ]


def initial_state(seed: int, input_shape: Sequence[int]) -> dict:
    """The pfl_cnn weights a project run of ``seed`` starts from, for the pfl row to start there too: the run's seeded
    initialisation (FLModel.init_parameters: ``torch.manual_seed(derive_seed("init", seed))``, every submodule's
    ``reset_parameters()`` in module order, then the model's ``init_parameters()``)."""
    model = MODELS["pfl_cnn"](tuple(input_shape), NUM_CLASSES)
    torch.manual_seed(derive_seed("init", seed))
    for m in model.modules():
        if m is not model and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    model.init_parameters()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- rows


def run_ours(executor: str, setup: SetUp, ds: FLDataset, part: Partition, data, warmup: int, timed: int,
             seed: int) -> Tuple[List[float], List[float]]:
    """Wall seconds and the process's CPU seconds of the timed rounds of one run of the project's ``executor`` (one more
    round runs after them: the simulator evaluates its last round; it is not timed)."""
    rounds = warmup + timed + 1
    cfg = compose(overrides(setup, executor, rounds, seed))
    if setup.cohort != round(cfg.train.participation * setup.users):
        raise SystemExit(f"error: --cohort {setup.cohort} of --users {setup.users} is not a participation the "
                         "fixed sampler reproduces exactly")
    stamps, cpu = {}, {}

    def on_round(r: int, row: dict) -> None:
        stamps[r], cpu[r] = time.perf_counter(), time.process_time()
        kind = "warm-up" if r <= warmup else "timed" if r <= warmup + timed else "untimed, evaluates"
        spent = f"{1e3 * (stamps[r] - stamps[r - 1]):.0f} ms" if r - 1 in stamps else "first"
        log(f"  fl-pipeline {executor} round {r}: {spent} ({kind}), train_loss {row['train_loss']:.4f}")

    torch.manual_seed(seed)
    sim = build_simulator(cfg, ds, part, device=torch.device("cpu"), data=data, callbacks=[on_round])
    sim.run()
    timed_rounds = range(warmup + 1, warmup + timed + 1)
    return [stamps[r] - stamps[r - 1] for r in timed_rounds], [cpu[r] - cpu[r - 1] for r in timed_rounds]


def run_pfl(python: str, blob_path: Path, setup: SetUp, warmup: int, timed: int, seed: int,
            threads: Optional[int]) -> dict:
    """One run of ``benchmarks/pfl_driver.py`` under ``python``; its JSON result.

    Raises:
        SystemExit: one line naming ``--pfl`` when the interpreter does not start or the driver fails (its last line).
    """
    cmd = [python, str(DRIVER), "--data", str(blob_path), "--project-root", str(_ROOT), "--rounds", str(timed),
           "--warmup", str(warmup), "--cohort", str(setup.cohort), "--epochs", str(setup.epochs),
           "--batch-size", str(setup.batch_size), "--lr", str(setup.lr), "--eta-g", str(setup.eta_g),
           "--seed", str(seed)] + (["--threads", str(threads)] if threads else [])
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    except OSError as err:
        raise SystemExit(f"error: --pfl {python}: cannot run it ({err.strerror or err})") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: --pfl {python}: the pfl-research driver failed (exit {proc.returncode}; its "
                         "error is printed above; it needs `pip install torch 'pfl[pytorch]'` in that environment)")
    return json.loads(lines[-1])


def _spread(xs: Sequence[float]) -> Tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


def render(rows: List[Row], setup: SetUp, data_line: str, warmup: int, timed: int, repeats: int,
           elapsed_s: float) -> str:
    machine = f"{device_name(torch.device('cpu'))}, {cores()} cores"
    date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    medians = [statistics.median(r.times) for r in rows if r.times]
    best = min(medians) if medians else None
    cpu_medians = [statistics.median(r.cpu_times) for r in rows if r.cpu_times]
    cpu_best = min(cpu_medians) if cpu_medians else None
    lines = [
        f"pfl-research's CIFAR-10 cross-device set-up: {setup.describe()}. {date}.",
        "",
        "| contender | executor | s/round min | s/round median | s/round max | ratio to fastest "
        "| CPU s/round median | CPU ratio | machine | load (1 min, start -> end) | torch (threads) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        if not r.times:
            lines.append(f"| {r.contender} | {r.executor} | - | {r.note or '-'} | - | - | - | - | {machine} | - | - |")
            continue
        lo, med, hi = _spread(r.times)
        cpu_med = statistics.median(r.cpu_times)
        load = ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in r.loads)
        lines.append(f"| {r.contender} | {r.executor} | {lo:.2f} | {med:.2f} | {hi:.2f} | {med / best:.2f} "
                     f"| {cpu_med:.2f} | {cpu_med / cpu_best:.2f} | {machine} | {load} | {r.torch_version} "
                     f"({r.threads}) |")
    lines += [
        "",
        f"- Data: {data_line}.",
        f"- {timed} timed rounds after {warmup} warm-up round(s) per run"
        + (f", {repeats} interleaved runs per row (min/median/max over all their timed rounds)" if repeats > 1 else "")
        + ". Seconds per round: wall time between the ends of consecutive rounds (sampling, local training, "
          "aggregation; no evaluation, no tracking, no checkpoints). Ratio: row median / lowest median. CPU: the "
          "process's CPU seconds (`time.process_time`, all its threads) over the same rounds, less sensitive to "
          "other jobs on the machine than wall time.",
        "- fl-pipeline: `model=pfl_cnn algorithm=fedavg algorithm.aggregation=uniform algorithm.eta_g=1.0 "
        "train.sampler=fixed` (distinct users per round). pfl-research: `SimulatedBackend` in one process, "
        "`WeightByUser`, `random` user sampler (with replacement), batches in the users' stored order; both start "
        "from the same initial weights.",
        f"- Total benchmark time {elapsed_s:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    d = SetUp()
    p = argparse.ArgumentParser(
        description="Seconds per FedAvg round on pfl-research's CIFAR-10 cross-device set-up (1,000 users x 50 images, "
                    "cohort 50, E=1, B=10, eta_l=0.1, eta_g=1, their CNN): the project's sequential and vectorised "
                    "executors and, with --pfl, pfl-research itself, on the CPU.")
    p.add_argument("--pfl", default=None, metavar="PYTHON",
                   help="python of an environment with pfl-research (`pip install torch 'pfl[pytorch]'`): also run "
                        "pfl-research there (benchmarks/pfl_driver.py) and give its ratio")
    p.add_argument("--cifar-root", type=Path, default=None, metavar="DIR",
                   help="folder holding cifar-10-batches-py/ (the official python version); default: synthetic "
                        "CIFAR-shaped data of the same sizes")
    p.add_argument("--executors", default="sequential,vectorized",
                   help="comma-separated engine.executor values to run (default: sequential,vectorized)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per run (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them, >= 1 (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs per row, interleaved (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads here and in the pfl driver (default: torch's choice, e.g. from "
                        "OMP_NUM_THREADS)")
    p.add_argument("--users", type=int, default=d.users, help=f"users (default {d.users})")
    p.add_argument("--per-user", type=int, default=d.per_user, help=f"images per user (default {d.per_user})")
    p.add_argument("--cohort", type=int, default=d.cohort, help=f"users per round (default {d.cohort})")
    p.add_argument("--seed", type=int, default=0, help="data, partition, initial weights and sampling (default 0)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1 or args.repeats < 1:
        p.error("--rounds, --warmup and --repeats must be >= 1")
    if min(args.users, args.per_user, args.cohort) < 1 or args.cohort > args.users:
        p.error("--users, --per-user and --cohort must be >= 1, and --cohort <= --users")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    args.executor_list = [s.strip() for s in args.executors.split(",") if s.strip()]
    bad = [e for e in args.executor_list if e not in ("sequential", "vectorized", "auto")]
    if bad or not args.executor_list:
        p.error(f"--executors: {bad or 'empty'}; choose from sequential, vectorized, auto")
    if args.pfl is not None and not Path(args.pfl).is_file():
        p.error(f"--pfl {args.pfl}: no such file (give the python of pfl-research's environment)")
    args.setup = SetUp(users=args.users, per_user=args.per_user, cohort=args.cohort)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = args.setup
    t_start = time.perf_counter()
    ds, part, data_line = make_data(setup, args.cifar_root, args.seed)
    log(f"{setup.describe()}\ndata: {data_line}\nmachine: {device_name(torch.device('cpu'))}, {cores()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load_avg():.2f}")
    data = client_data(ds, part, torch.device("cpu"))
    init = initial_state(args.seed, ds.input_shape)
    rows = [Row("fl-pipeline", e, torch_version=torch.__version__, threads=torch.get_num_threads())
            for e in args.executor_list]
    if args.pfl:
        rows.append(Row("pfl-research", "SimulatedBackend (one process)"))
    try:
        with tempfile.TemporaryDirectory(prefix="pfl_cifar_") as tmp:
            blob_path = Path(tmp) / "data.pt"
            if args.pfl:
                users = torch.as_tensor(np.stack(part.client_indices))
                torch.save({"x": ds.x_train, "y": ds.y_train, "scale": ds.scale, "mean": ds.mean, "std": ds.std,
                            "users": users, "num_classes": NUM_CLASSES, "init": init}, blob_path)
            for rep in range(args.repeats):
                for row in rows:
                    log(f"{row.contender} {row.executor} (run {rep + 1}/{args.repeats})")
                    load0 = load_avg()
                    if row.contender == "pfl-research":
                        out = run_pfl(args.pfl, blob_path, setup, args.warmup, args.rounds, args.seed, args.threads)
                        times, cpu_times = out["times"], out["cpu_times"]
                        row.torch_version, row.threads = f"{out['torch']}, pfl {out['pfl']}", out["threads"]
                        log(f"  pfl-research moved the global parameters by {out['moved']:.4g} (L2)")
                    else:
                        times, cpu_times = run_ours(row.executor, setup, ds, part, data, args.warmup, args.rounds,
                                                    args.seed)
                    row.times += times
                    row.cpu_times += cpu_times
                    row.loads.append((load0, load_avg()))
                    log(f"  median {statistics.median(times):.2f} s/round, CPU {statistics.median(cpu_times):.2f} s")
                    gc.collect()
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    table = render(rows, setup, data_line, args.warmup, args.rounds, args.repeats, time.perf_counter() - t_start)
    emit(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
