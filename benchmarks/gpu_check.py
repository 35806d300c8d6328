#!/usr/bin/env python3
"""GPU check: the engine on one CUDA device, in one command that fits a short lease of a bare machine.

Run from the project root (docs/benchmarks.md, GPU)::

    python3 benchmarks/gpu_check.py --out /tmp/gpu_check                      # CUDA when there is one
    python3 benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check  # the same parts, small, on the CPU

The machine needs python3 with torch, torchvision, numpy, pyyaml, tqdm, packaging and filelock (the GPU image has
them); what the engine needs beyond that (hydra-core, omegaconf and the antlr4 runtime) comes from the wheels that
``make gpu-kit`` puts in ``gpu-kit/``: when they do not import, the check installs those wheels with
``pip install --no-index`` into a folder under the temporary directory and imports them from there. No package index
and no MLflow are needed: every run here has tracking off.

Parts, in this order; each one reports its error in one line and the check goes on with the next:

1. ``agreement``: the sequential and the vectorised executor train the same 3 rounds (standard CNN on random
   CIFAR-shaped data, 20 clients x 50 samples, 5 per round, E = 1, B = 25) for FedAvg, SCAFFOLD, FedDyn, FedBug over
   FedAvg (P = 0.5) in float32 and Top-k over FedAvg (a transform on the update) in float64; each row gives the
   relative L2 distance between the two final models, ||a - b|| / ||a||, against :data:`AGREE_RTOL`. On CUDA the
   two executors run other kernels (batched against per-client), so they are compared with a tolerance, never
   bitwise; there each float32 row runs with PyTorch's default kernels (``engine.deterministic=false``) and with
   deterministic ones (the default), and the latter row gives each executor's distance between the two (which
   executor the kernel choice moves). Top-k runs in float64 because its selection turns a rounding-sized gap into
   another choice of entries (tests/test_vectorized.py).
2. ``speed``: W1, W2 and W0 of benchmarks/round_speed.py (``--quick``: W1 only), ms per round for the naive per-client
   loop, the sequential and the vectorised executor and ``engine.executor=auto``, in alternating repeats (on CUDA
   also the two executors with TF32 allowed, and with ``engine.deterministic=false``); the
   FLOP-floor fraction on CUDA (3 x forward FLOP x samples per round at the device's plain float32 peak, over the
   measured time) and the peak memory.
3. ``population``: the 3 seeds of one W1 experiment as one population (one vectorised pass per round) against the
   same 3 seeds one after another on the vectorised and on the sequential executor, seconds for the rounds (the
   builds left out), and the largest relative distance between final models: the population's replicas against
   their vectorised runs one after another, those against the sequential runs, and each row's runs against its own
   first repeat (whether the device repeats itself: ``engine.deterministic``).
4. ``trials``: a sweep's batch at the engine level (``tune.py --space lr --batch 16``): 16 W1 experiments that differ
   in eta_l (``--quick``: 4) as one population, against the same one after another on the vectorised and on the
   sequential executor (``--batch 1``'s default), the same columns as ``population`` and the ratio to the sequential
   runs (docs/sweeps.md, Batches).
5. ``vit``: V1 on CUDA (``model=vit_b_16`` with random weights, d = 85.8 M, FedBCGD's B = 16, 10 clients x 32
   samples, all 10 per round, E = 1); on the CPU V0 (``vit_tiny``, the same layout at CPU size). ms per round for
   the sequential and the vectorised executor, and the vectorised executor's peak memory above what the device held
   before its rounds against the engine's own estimate (:func:`fl_core.engine.factory.vectorized_fit`, at the
   ``engine.max_parallel_clients`` it says fits).

Spread: each time is the median over the timed rounds, with the interquartile range and the repeats' medians
(min / max). Peak memory on CUDA is ``torch.cuda.max_memory_allocated`` (tensors); on the CPU the process's peak
resident set (benchmarks/round_speed.py, PeakMemory). ``--budget-s`` bounds the whole check: a part or row that
would start after it is skipped with a note. TF32 stays off (``engine.float32_precision=highest``, the default: off in
matrix products, as PyTorch has it, and in cuDNN convolutions, where PyTorch allows it), so the figures are true
float32, except two rows per workload on CUDA that allow it (``engine.float32_precision=high``).

Output in ``--out``: ``gpu_check.md`` (the tables) and ``gpu_check.json`` (the same figures), rewritten after every
part, so a check stopped halfway leaves what it measured. Exit status 0 when every part ran and every agreement row
is within tolerance, 1 otherwise, 2 for bad arguments or a missing kit.

Expected run time on one H100/H200: under 5 minutes with the defaults (docs/benchmarks.md, GPU, gives the measured
one); ``--device cpu --quick`` on 2 cores: about 2 minutes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere, without an install
    sys.path.insert(0, str(ROOT))

KIT_MODULES = ("hydra", "omegaconf", "antlr4")  # what fl_core imports at run time beyond the GPU image
AGREE_RTOL = {"float32": 1e-4, "float64": 1e-10}  # ||a - b|| / ||a|| of the two executors' final models
AGREE_ROUNDS = 3
AGREE_STACKS = (  # (row name, overrides, dtype)
    ("FedAvg", ["algorithm=fedavg"], "float32"),
    ("SCAFFOLD", ["algorithm=scaffold"], "float32"),
    ("FedDyn", ["algorithm=feddyn"], "float32"),
    ("FedBug (P = 0.5) over FedAvg", ["algorithm=fedbug", "algorithm.fedbug.gu_percentage=0.5"], "float32"),
    ("Top-k (10%) over FedAvg", ["algorithm=topk"], "float64"),
)
POP_SEEDS = (1, 2, 3)
PARTS = ("agreement", "speed", "population", "trials", "vit")
TRIAL_BATCH = 16  # part trials: the eta_l values of one sweep batch (tune.py --batch 16)
FP32_PEAK_TFLOPS = {"H100": 67.0, "H200": 67.0, "A100": 19.5}  # plain float32 (no tensor cores), datasheets (SXM)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_kit(kit: Path) -> str:
    """Make :data:`KIT_MODULES` importable: as they are, or from the wheels in ``kit`` (``pip install --no-index
    --no-deps --target``, into ``<tmp>/fl-gpu-kit-py3X``, put first on ``sys.path``). Returns what it did, one line.

    Raises:
        SystemExit(2): a module is missing and ``kit`` holds no wheel, or pip fails (its last line).
    """
    missing = [m for m in KIT_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return "kit: not needed (" + ", ".join(KIT_MODULES) + " import)"
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: {', '.join(missing)} do not import and {kit} holds no wheels: run `make gpu-kit` "
                         f"where a package index is reachable and bring {kit}/ along (--kit)")
    site = Path(tempfile.gettempdir()) / f"fl-gpu-kit-py{sys.version_info.major}{sys.version_info.minor}"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, wheels)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: installing the wheels of {kit} failed: {last}")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = [m for m in KIT_MODULES if importlib.util.find_spec(m) is None]
    if still:
        raise SystemExit(f"error: {', '.join(still)} still do not import after installing {kit} into {site}")
    return f"kit: {len(wheels)} wheels from {kit} installed into {site} (no index)"


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e5:
        return f"{x:.1e}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.{digits}g}"


class Check:
    """The check's state: device, deadline, the figures so far (:attr:`data`), written after every part."""

    def __init__(self, args: argparse.Namespace, kit_line: str):
        import torch

        self.args = args
        self.torch = torch
        self.device = torch.device(args.device)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        self.deadline = self.start + args.budget_s
        self.data: Dict = {"command": "python3 benchmarks/gpu_check.py " + " ".join(args.argv),
                           "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                           "machine": self.machine(), "kit": kit_line, "parts": [], "agreement": [], "speed": [],
                           "population": [], "trials": [], "vit": []}

    # ------------------------------------------------------------------ machine and output

    def machine(self) -> Dict:
        from benchmarks.round_speed import device_name

        torch = self.torch
        m = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "cpu": device_name(torch.device("cpu")), "cores": os.cpu_count(), "device": str(self.device)}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                     multiprocessors=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                     driver=_driver_version(), cudnn=torch.backends.cudnn.version(),
                     matmul_tf32=torch.backends.cuda.matmul.allow_tf32, cudnn_tf32=torch.backends.cudnn.allow_tf32)
        return m

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def part(self, name: str, fn: Callable[[], None]) -> None:
        """Run one part; its failure is one line in the output and the check goes on."""
        if self.left() <= 0:
            self.data["parts"].append({"name": name, "ok": False, "seconds": 0.0,
                                       "error": f"skipped: the --budget-s {self.args.budget_s:g} s were spent"})
            self.write()
            return
        log(f"== {name}")
        t0 = time.perf_counter()
        error = None
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (every part's failure is reported, the check goes on)
            traceback.print_exc()
            error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        finally:
            gc.collect()
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
        self.data["parts"].append({"name": name, "ok": error is None, "seconds": round(time.perf_counter() - t0, 1),
                                   "error": error})
        log(f"== {name}: {'ok' if error is None else error} ({time.perf_counter() - t0:.1f} s)")
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(render(self.data))

    def ok(self) -> bool:
        return (all(p["ok"] for p in self.data["parts"])
                and all(r.get("within") for r in self.data["agreement"]))

    # ------------------------------------------------------------------ helpers

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def inputs(self, w, seed: int = 0, client_data: bool = True):
        """The workload's random data set, its partition and (``client_data``) the clients' float32 tensors on the
        device, which the rows of one workload share (None: each run builds its own, in its own dtype)."""
        from benchmarks import round_speed as rs

        ds = rs.make_dataset(w, seed)
        part = rs.make_partition(w, ds, seed)
        return ds, part, rs.make_client_data(ds, part, self.device) if client_data else None

    def config(self, w, executor: str, rounds: int, seed: int, extra: Sequence[str] = ()):
        """The composed config of a row: round_speed's overrides for ``w``, the keys of ``extra`` replacing theirs,
        tracking off."""
        from benchmarks import round_speed as rs
        from fl_core.config import compose

        extra = [*extra, "tracking.enabled=false"]
        keys = {o.split("=", 1)[0] for o in extra}
        base = [o for o in rs.overrides(w, executor, self.device, rounds, seed) if o.split("=", 1)[0] not in keys]
        return compose([*base, *extra])

    def build(self, cfg, ds, part, data):
        from fl_core.engine.factory import build_simulator

        self.torch.manual_seed(int(cfg.seed))
        return build_simulator(cfg, ds, part, device=self.device, data=data)

    def fp32_peak(self) -> Optional[float]:
        if self.device.type != "cuda":
            return None
        if self.args.peak_tflops:
            return self.args.peak_tflops
        name = self.torch.cuda.get_device_name(self.device)
        return next((v for k, v in FP32_PEAK_TFLOPS.items() if k in name), None)

    # ------------------------------------------------------------------ parts

    def agreement(self) -> None:
        from benchmarks.round_speed import Workload

        w = Workload("A", 20, 50, 5, 1, 25)
        cuda = self.device.type == "cuda"
        for name, stack, dtype in AGREE_STACKS:
            if self.left() <= 0:
                self.data["agreement"].append({"stack": name, "note": "skipped: time budget"})
                continue
            ds, part, _ = self.inputs(w, self.args.seed, client_data=False)  # float64 rows build their own

            def run(executor: str, extra: Sequence[str], stack=stack, ds=ds, part=part):
                cfg = self.config(w, executor, AGREE_ROUNDS, self.args.seed, [*stack, *extra])
                result = self.build(cfg, ds, part, None).run()
                return result.final_flat, result.history[-1]["train_loss"]

            # on CUDA each float32 row runs with PyTorch's default kernels too, and says how far each executor's
            # deterministic run is from its own run with them (which executor the kernel choice moves)
            modes = [("deterministic", [])]
            if cuda and dtype == "float32":
                modes.insert(0, ("deterministic=false", ["engine.deterministic=false"]))
            finals: Dict[str, Dict] = {}
            for kernels_label, extra in modes:
                (seq, seq_loss), (vec, vec_loss) = (run(e, [f"engine.dtype={dtype}", *extra])
                                                    for e in ("sequential", "vectorized"))
                finals[kernels_label] = {"sequential": seq, "vectorized": vec}
                default = finals.get("deterministic=false") if kernels_label == "deterministic" else None
                rel = _rel(seq, vec)
                tol = AGREE_RTOL[dtype]
                row = {"stack": name, "dtype": dtype, "kernels": kernels_label if cuda else "cpu",
                       "rounds": AGREE_ROUNDS, "rel_l2": rel, "rtol": tol,
                       "max_abs": float((seq.double().cpu() - vec.double().cpu()).abs().max()),
                       "seq_vs_default_kernels": _rel(default["sequential"], seq) if default else None,
                       "vec_vs_default_kernels": _rel(default["vectorized"], vec) if default else None,
                       "train_loss": [seq_loss, vec_loss], "within": rel <= tol}
                self.data["agreement"].append(row)
                log(f"  {name} ({row['kernels']}): relative L2 {rel:.2e} (tolerance {tol:g}) "
                    f"{'ok' if row['within'] else 'OUTSIDE'}")
                self.write()

    def speed(self) -> None:
        from benchmarks import round_speed as rs

        quick = self.args.quick
        plan = [("W1", 1 if quick else 2, 2 if quick else 10)] + ([] if quick else [("W2", 1, 3), ("W0", 1, 3)])
        off = ["tracking.enabled=false"]
        specs = [(e, e, off) for e in ("naive", "sequential", "vectorized", "auto")]
        if self.device.type == "cuda":  # what TF32 buys, what deterministic kernels cost
            specs += [(f"{e}, {label}", e, [*off, key]) for label, key in (
                ("TF32", "engine.float32_precision=high"), ("deterministic=false", "engine.deterministic=false"))
                for e in ("sequential", "vectorized")]
        executors = [label for label, _, _ in specs]
        peak = self.fp32_peak()
        notes = self.data["speed_notes"] = {"fp32_peak_tflops": peak, "forward_mflop": {}, "rounds": {}}
        for wname, warmup, timed in plan:
            w = rs.WORKLOADS[wname]
            fwd = rs.forward_flops(rs.build_model(w), w.shape.input_shape)
            ds, part, data = self.inputs(w, self.args.seed)
            reps = rs.time_rows(w, ds, part, data, self.device, specs, self.args.repeats, warmup, timed,
                                self.args.seed, None, rs.PeakMemory(self.device),
                                before_naive=lambda: engine_defaults(self.device),  # as an earlier row left them
                                stop=lambda: self.left() <= 0)
            seq_ms = None
            for e in executors:
                if not reps[e]:
                    self.data["speed"].append({"workload": wname, "executor": e, "note": "skipped: time budget"})
                    continue
                r = rs.merge(reps[e])
                if r.note:
                    self.data["speed"].append({"workload": wname, "executor": e, "note": r.note})
                    continue
                q1, q3 = rs._iqr_ms(r.times)
                floor_ms = 1e3 * 3 * fwd * w.samples_per_round / (peak * 1e12) if peak else None
                if e == "sequential":
                    seq_ms = r.ms
                self.data["speed"].append({
                    "workload": wname, "executor": e + (f" -> {r.chosen}" if r.chosen else ""), "ms": r.ms,
                    "iqr_ms": [q1, q3], "repeat_ms": r.repeat_ms, "rounds_timed": len(r.times),
                    "steps_per_s": w.steps_per_round / (r.ms / 1e3), "peak_mib": r.peak_mib,
                    "flop_floor_fraction": floor_ms / r.ms if floor_ms else None,
                    "reason": r.reason or None})
            for row in self.data["speed"]:
                if row.get("workload") == wname and row.get("ms") and seq_ms:
                    row["vs_sequential"] = row["ms"] / seq_ms
            notes["forward_mflop"][wname] = fwd / 1e6
            notes["rounds"][wname] = f"{warmup} warm-up + {timed} timed, x{self.args.repeats} repeats"
            del ds, part, data
            self.write()

    def population(self) -> None:
        """The 3 seeds of one W1 experiment as one population against the same seeds one after another."""
        rounds = 3 if self.args.quick else 10
        self._groups("population", [(f"seed {s}", s, []) for s in POP_SEEDS], rounds,
                     f"W1, seeds {list(POP_SEEDS)}, {rounds} rounds")

    def trials(self) -> None:
        """A sweep's batch at the engine level (``tune.py --space lr --batch K``): K W1 experiments that differ in
        eta_l (log-spaced over the ``lr`` space's range) as one population, against the same K one after another on
        the sequential executor (what ``--batch 1`` trains on by default) and on the vectorised one."""
        k = 4 if self.args.quick else TRIAL_BATCH
        rounds = 3 if self.args.quick else 10
        lrs = [0.005 * 100 ** (i / max(1, k - 1)) for i in range(k)]
        self._groups("trials", [(f"eta_l {lr:.3g}", self.args.seed, [f"train.lr={lr!r}"]) for lr in lrs], rounds,
                     f"W1, {k} values of eta_l in [0.005, 0.5] (a batch of {k} trials of the lr space), {rounds} rounds")

    def _groups(self, key: str, variants: Sequence, rounds: int, workload: str) -> None:
        """Rows of part ``key``: ``variants`` ((label, seed, extra overrides) per replica) as one population, one
        after another on the vectorised executor, one after another on the sequential one; seconds for the rounds
        (the builds left out) and the largest relative distance between the final models (module docstring)."""
        from benchmarks import round_speed as rs
        from fl_core.engine.factory import population_chunk
        from fl_core.engine.population import can_share, run_one, run_together

        w = rs.WORKLOADS["W1"]
        ds, part, data = self.inputs(w, self.args.seed)

        def config(executor: str, seed: int, extra):
            return self.config(w, executor, rounds, seed, ["train.eval_every=1000", *extra])

        def sims(executor: str):
            return [self.build(config(executor, s, extra), ds, part, data) for _, s, extra in variants]

        times: Dict[str, List[float]] = {"population": [], "vectorized, one after another": [],
                                         "sequential, one after another": []}
        finals: Dict[str, List] = {k: [] for k in times}  # per repeat: the replicas' final models
        for rep in range(self.args.repeats):
            order = list(times) if rep % 2 == 0 else list(times)[::-1]
            for kind in order:
                if self.left() <= 0:
                    break
                group = sims("sequential" if kind.startswith("sequential") else "vectorized")
                if kind == "population":
                    if not can_share(group):
                        raise RuntimeError(f"the {len(group)} simulators cannot share a pass (population.can_share)")
                    chunk = population_chunk(config("vectorized", variants[0][1], variants[0][2]), group[0],
                                             len(group))
                    self.sync()
                    t0 = time.perf_counter()
                    outs = run_together(group, chunk)
                else:
                    self.sync()
                    t0 = time.perf_counter()
                    outs = [run_one(s) for s in group]
                self.sync()
                times[kind].append(time.perf_counter() - t0)
                finals[kind].append([o.final_flat for o in outs])
                log(f"  {key} {kind}: {times[kind][-1]:.2f} s for {rounds} rounds of {len(group)} replicas")
                del group, outs
        base = {k: statistics.median(ts) if ts else None for k, ts in times.items()}
        compare = {"population": ("vectorized, one after another", "the vectorised runs one after another"),
                   "vectorized, one after another": ("sequential, one after another", "the sequential runs"),
                   "sequential, one after another": ("sequential, one after another", "its own earlier repeats")}
        for kind, ts in times.items():
            if not ts:
                self.data[key].append({"row": kind, "note": "skipped: time budget"})
                continue
            med = statistics.median(ts)
            other, what = compare[kind]
            pairs = ([(a, b) for rep in finals[kind][1:] for a, b in zip(finals[kind][0], rep)] if other == kind else
                     [(a, b) for ra, rb in zip(finals[other], finals[kind]) for a, b in zip(ra, rb)])
            again = [(a, b) for rep in finals[kind][1:] for a, b in zip(finals[kind][0], rep)]
            vec, seq = base["vectorized, one after another"], base["sequential, one after another"]
            self.data[key].append({
                "row": kind, "seconds": med, "repeat_s": ts, "ms_per_round": 1e3 * med / rounds,
                "vs_one_after_another": med / vec if vec else None, "vs_sequential": med / seq if seq else None,
                "max_rel_l2": max((_rel(a, b) for a, b in pairs), default=None), "compared_with": what,
                "run_to_run": max((_rel(a, b) for a, b in again), default=None)})
        self.data[f"{key}_notes"] = {"workload": f"{workload} (builds not timed), x{self.args.repeats} repeats"}
        self.write()

    def vit(self) -> None:
        from benchmarks import round_speed as rs
        from fl_core.engine import diskstate
        from fl_core.engine.factory import DTYPES, vectorized_fit

        cuda = self.device.type == "cuda"
        w = rs.WORKLOADS["V1" if cuda else "V0"]
        warmup, timed = (1, 3) if cuda else (1, 1)
        rounds = warmup + timed + 1
        ds, part, data = self.inputs(w, self.args.seed)
        note = "" if cuda else "V0 (vit_tiny) stands in for V1 on the CPU"
        fit = None
        for executor in ("sequential", "vectorized"):
            if self.left() <= 0:
                self.data["vit"].append({"workload": w.name, "executor": executor, "note": "skipped: time budget"})
                continue
            extra = [] if fit is None or fit.fits else [f"engine.max_parallel_clients={max(1, fit.chunk)}"]
            cfg = self.config(w, executor, rounds, self.args.seed, extra)
            sim = self.build(cfg, ds, part, data)
            self.sync()
            mem = rs.PeakMemory(self.device)
            mem.start()
            base_mib = self.torch.cuda.memory_allocated(self.device) / 2 ** 20 if cuda else None
            result = sim.run()
            peak_mib = mem.peak_mib()
            times = [h["round_time_s"] for h in result.history if warmup < h["round"] <= warmup + timed]
            row = {"workload": w.name, "model": w.model, "executor": executor, "ms": 1e3 * statistics.median(times),
                   "round_ms": [1e3 * t for t in times], "steps_per_s": w.steps_per_round / statistics.median(times),
                   "peak_mib": peak_mib, "d": sim.spec.d, "note": note}
            if executor == "sequential":  # the vectorised row's estimate, from this run's model, rule and data
                state = diskstate.client_state_bytes(sim.algo, sim.spec.d, DTYPES[cfg.engine.dtype])
                fit = vectorized_fit(self.config(w, "vectorized", rounds, self.args.seed), sim.model, sim.algo,
                                     sim.executor.data, state)
            elif fit is not None:
                c = int(cfg.engine.max_parallel_clients) or fit.need.round_clients
                est = fit.need.total(c) / 2 ** 20
                row.update(clients_at_once=c, estimate_mib=est, available_mib=fit.available / 2 ** 20,
                           fits=fit.fits)
                if base_mib is not None:
                    row.update(base_mib=base_mib, measured_over_estimate=(peak_mib - base_mib) / est)
            self.data["vit"].append(row)
            log(f"  {w.name} {executor}: {row['ms']:.0f} ms/round, peak {peak_mib:,.0f} MiB"
                + (f", estimate {row['estimate_mib']:,.0f} MiB" if "estimate_mib" in row else ""))
            del sim, result
            gc.collect()
            if cuda:
                self.torch.cuda.empty_cache()
            self.write()


def engine_defaults(device) -> None:
    """The kernel settings every engine run starts with by default (:func:`fl_core.engine.kernels.apply`: one CPU
    thread, true float32 without TF32, deterministic kernels on CUDA), for the naive rows too."""
    from fl_core.engine import kernels

    kernels.apply("native", device, 1)


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def render(d: Dict) -> str:
    """The markdown of :attr:`Check.data`."""
    m = d["machine"]
    where = (f"{m['gpu']} ({m['gpu_memory_gib']} GiB, {m['multiprocessors']} SMs, compute capability "
             f"{m['capability']}), driver {m['driver']}, cuDNN {m['cudnn']}" if "gpu" in m else f"CPU: {m['cpu']}")
    lines = [f"`{d['command']}`", "",
             f"{where}; {m['cores']} CPU cores; Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}); "
             f"{d['date']}; {d['elapsed_s']} s in all. {d['kit']}.", ""]
    if "gpu" in m:
        lines += [f"PyTorch's TF32 settings at the start: matrix products {m['matmul_tf32']}, cuDNN convolutions "
                  f"{m['cudnn_tf32']}; every row runs without TF32 and with deterministic kernels except the "
                  "TF32 rows (engine.float32_precision=high) and the deterministic=false rows.", ""]
    lines += ["| part | result | seconds |", "|---|---|---:|"]
    lines += [f"| {p['name']} | {'ok' if p['ok'] else p['error']} | {p['seconds']} |" for p in d["parts"]]
    for section in (_agreement_md, _speed_md, _population_md, _trials_md, _vit_md):
        lines += section(d)
    return "\n".join(lines) + "\n"


def _agreement_md(d: Dict) -> List[str]:
    if not d["agreement"]:
        return []
    lines = ["", f"Executors agree ({AGREE_ROUNDS} rounds; relative L2 distance of the final models, "
                 "sequential against vectorised):", "",
             "| rule stack | dtype | kernels | ||a - b|| / ||a|| | tolerance | max abs | sequential: deterministic vs "
             "default kernels | vectorised: the same | final train loss (seq / vec) | within |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def e(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1e}"

    for r in d["agreement"]:
        if "note" in r:
            lines.append(f"| {r['stack']} | - | - | {r['note']} | | | | | | |")
            continue
        lines.append(f"| {r['stack']} | {r['dtype']} | {r.get('kernels', '-')} | {r['rel_l2']:.1e} | {r['rtol']:g} | "
                     f"{r['max_abs']:.1e} | {e(r.get('seq_vs_default_kernels'))} | "
                     f"{e(r.get('vec_vs_default_kernels'))} | "
                     f"{r['train_loss'][0]:.6f} / {r['train_loss'][1]:.6f} | {'yes' if r['within'] else 'NO'} |")
    return lines


def _speed_md(d: Dict) -> List[str]:
    if not d["speed"]:
        return []
    n = d.get("speed_notes", {})
    lines = ["", "Round speed (benchmarks/round_speed.py workloads; " + "; ".join(
        f"{k}: {v}" for k, v in n.get("rounds", {}).items()) + "):", "",
             "| workload | executor | ms/round: median [IQR] | repeats' medians | vs sequential | local steps/s "
             "| peak MiB | FLOP-floor fraction |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["speed"]:
        if "note" in r:
            lines.append(f"| {r['workload']} | {r['executor']} | {r['note']} | | | | | |")
            continue
        ff = r.get("flop_floor_fraction")
        lines.append(
            f"| {r['workload']} | {r['executor']} | {_fmt(r['ms'])} [{_fmt(r['iqr_ms'][0])}, {_fmt(r['iqr_ms'][1])}]"
            f" | {' / '.join(_fmt(x) for x in r['repeat_ms'])} | {r.get('vs_sequential', 0):.2f}x "
            f"| {r['steps_per_s']:,.0f} | {_fmt(r['peak_mib'])} | {f'{ff:.3f}' if ff else 'n/a'} |")
    if n.get("fp32_peak_tflops"):
        lines += ["", f"FLOP floor: 3 x forward FLOP x samples per round at {n['fp32_peak_tflops']:g} TFLOP/s "
                      "(plain float32); forward MFLOP per sample: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in n["forward_mflop"].items()) + "."]
    reasons = [f"{r['workload']}: {r['reason']}" for r in d["speed"] if r.get("reason")]
    if reasons:
        lines += ["", "auto's reasons: " + "; ".join(reasons) + "."]
    return lines


def _population_md(d: Dict, key: str = "population", title: str = "Populations") -> List[str]:
    if not d.get(key):
        return []
    lines = ["", f"{title} (" + d.get(f"{key}_notes", {}).get("workload", "") + "):", "",
             "| row | seconds (median) | ms per round | vs vectorised one after another | vs sequential one after "
             "another | final models: max relative L2 distance | compared with | run to run (same row, repeat 1 "
             "against the others) |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in d[key]:
        if "note" in r:
            lines.append(f"| {r['row']} | {r['note']} | | | | | | |")
            continue
        rel, again = r["max_rel_l2"], r.get("run_to_run")
        vs, seq = r["vs_one_after_another"], r.get("vs_sequential")
        lines.append(f"| {r['row']} | {r['seconds']:.2f} | {_fmt(r['ms_per_round'])} | "
                     f"{'-' if vs is None else f'{vs:.2f}x'} | {'-' if seq is None else f'{seq:.2f}x'} | "
                     f"{'-' if rel is None else f'{rel:.1e}'} | {r['compared_with']} | "
                     f"{'-' if again is None else f'{again:.1e}'} |")
    return lines


def _trials_md(d: Dict) -> List[str]:
    return _population_md(d, "trials", "A sweep's batch as one population")


def _vit_md(d: Dict) -> List[str]:
    if not d["vit"]:
        return []
    lines = ["", "Vision Transformer:", "",
             "| workload | executor | ms/round (median) | local steps/s | peak MiB | clients at once "
             "| estimate MiB | (peak - before) / estimate |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["vit"]:
        if "ms" not in r:
            lines.append(f"| {r['workload']} | {r['executor']} | {r['note']} | | | | | |")
            continue
        ratio = r.get("measured_over_estimate")
        lines.append(f"| {r['workload']} ({r['model']}, d = {r['d']:,}) | {r['executor']} | {_fmt(r['ms'])} | "
                     f"{r['steps_per_s']:,.1f} | {_fmt(r['peak_mib'])} | {r.get('clients_at_once', '-')} | "
                     f"{_fmt(r.get('estimate_mib'))} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    notes = sorted({r["note"] for r in d["vit"] if r.get("note") and "ms" in r})
    if notes:
        lines += ["", "; ".join(notes) + "."]
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.md and gpu_check.json (created)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (CUDA when there is one; default)")
    p.add_argument("--quick", action="store_true", help="small: W1 only with 2 timed rounds, 3-round populations, "
                   "1 repeat (default repeats 2)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of every timed row, alternating their order "
                   "(default: 2, --quick 1)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole check; parts and rows that "
                   "would start later are skipped with a note (default 420)")
    p.add_argument("--parts", default="agreement,speed,population,trials,vit", help="comma-separated parts to run")
    p.add_argument("--kit", type=Path, default=ROOT / "gpu-kit", help="the wheels of `make gpu-kit` (default: "
                   "gpu-kit/ in the project root)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's plain float32 peak for the "
                   "FLOP-floor fraction (default: from the GPU's name, H100/H200 67)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.part_list = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in args.part_list if s not in PARTS]
    if bad:
        p.error(f"--parts: unknown part(s) {', '.join(bad)} ({', '.join(PARTS)})")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    kit_line = ensure_kit(args.kit)
    log(kit_line)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device} but torch {torch.__version__} sees no CUDA device")
    check = Check(args, kit_line)  # records PyTorch's TF32 defaults before they are turned off
    engine_defaults(check.device)
    log(f"device {check.device}: {json.dumps(check.data['machine'])}")
    for name in args.part_list:
        check.part(name, getattr(check, name))
    check.write()
    log(f"wrote {check.out / 'gpu_check.md'} and {check.out / 'gpu_check.json'} "
        f"({time.perf_counter() - check.start:.0f} s)")
    return 0 if check.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
