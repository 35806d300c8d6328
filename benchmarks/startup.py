#!/usr/bin/env python
"""Start-up benchmark: how long ``fl-train`` takes to do nothing, and what a one-round run costs besides training.

Every row starts a fresh process (``<venv>/bin/fl-train``, or ``python -m pipeline.train`` where the console script
is missing) in the project folder ``--project`` (default: this checkout; with ``PYTHONPATH`` set to it, so another
checkout can be measured with this script), ``--repeats`` times after ``--warmup`` runs that are not counted, the
rows taking turns (row 1, row 2, ..., row 1, ...) so that a change in the machine's load touches every row alike.
``--baseline DIR`` adds every row for a second checkout (e.g. the commit before a change), in the same turns, so
that the two are compared under the same load. Wall time is a monotonic clock read around the child process; CPU
time is the child's user + system time (``getrusage(RUSAGE_CHILDREN)``), which other jobs on the machine change much
less than the wall time.

Rows:

- ``fl-train --help`` and ``fl-train --cfg``: the whole process, nothing trained.
- ``1 round, 1 seed``: ``fl-train name=startup_probe seed=1 train.rounds=1`` (the default config: FedAvg on digits,
  10 clients, participation 0.5, E = 3, B = 16) into a temporary ``results_dir``, ``engine.checkpoint_dir``,
  ``data_dir`` (no prepared dataset: the run reads the source, i.e. the user's digits array cache, filled by the
  warm-up where it is empty) and MLflow store (``MLFLOW_TRACKING_URI``: one SQLite file per checkout for all
  repeats, created by the warm-up: a new store takes seconds to create). ``training s``
  is the run's own ``round_time_s`` (sampling, local training, aggregation, evaluation; ``details/round_times.csv``),
  ``overhead s`` = wall - training, per repeat: interpreter start, imports, config, data, model, MLflow, the
  figures and files, exit.
- ``1 round, tracking off``: the same with ``tracking.enabled=false`` (what MLflow adds is the difference).

The figures are min / median / max over the repeats; quote the median. ``OMP_NUM_THREADS`` is passed on as it is
(set it to 1 on a shared machine). The table names the machine and the load average before and after.

    python benchmarks/startup.py                       # 5 repeats after 1 warm-up
    python benchmarks/startup.py --repeats 10 --baseline /path/to/the/checkout/before
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fl_core.store.procs import machine  # noqa: E402,F401  (after the path is set; benchmarks/threads.py takes it from here)


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def versions() -> str:
    out = [f"Python {platform.python_version()}"]
    for pkg in ("torch", "mlflow", "hydra-core", "matplotlib"):
        try:
            out.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def entry() -> List[str]:
    """The ``fl-train`` console script beside this interpreter, else ``python -m pipeline.train``."""
    script = Path(sys.executable).parent / "fl-train"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pipeline.train"]


class Row:
    """One command in one checkout and its timings; ``train``: a training run (its own folders, its training time
    read back)."""

    def __init__(self, checkout: str, project: Path, name: str, args: List[str], train: bool):
        self.checkout, self.project, self.name, self.args, self.train = checkout, project, name, args, train
        self.wall: List[float] = []
        self.cpu: List[float] = []
        self.training: List[float] = []

    def command(self, scratch: Path, i: int) -> List[str]:
        if not self.train:
            return entry() + self.args
        tag = f"{self.checkout}-{self.name.replace(' ', '_').replace(',', '')}-{i}"
        return entry() + self.args + [f"results_dir={scratch / 'results' / tag}",
                                      f"engine.checkpoint_dir={scratch / 'checkpoints' / tag}",
                                      f"data_dir={scratch / 'data'}"]

    def run_once(self, scratch: Path, i: int, count: bool) -> None:
        cmd = self.command(scratch, i)
        path = [str(self.project)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
               "MLFLOW_TRACKING_URI": f"sqlite:///{scratch / f'mlflow-{self.checkout}.db'}"}
        r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        done = subprocess.run(cmd, cwd=self.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, check=False)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            tail = "\n".join(done.stdout.strip().splitlines()[-5:])
            raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{tail}")
        if not count:
            return
        self.wall.append(wall)
        self.cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        if self.train:
            self.training.append(_training_seconds(cmd))

    def cells(self) -> List[str]:
        wall, cpu = _stats(self.wall), _stats(self.cpu)
        if not self.train:
            return [self.checkout, self.name, wall, cpu, "", ""]
        overhead = [w - t for w, t in zip(self.wall, self.training)]
        return [self.checkout, self.name, wall, cpu, _stats(self.training), _stats(overhead)]


def _training_seconds(cmd: List[str]) -> float:
    """Sum of ``round_time_s`` of the run's ``details/round_times.csv``."""
    results = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("results_dir=")))
    with open(results / "startup_probe" / "details" / "round_times.csv", newline="") as f:
        return sum(float(r["round_time_s"]) for r in csv.DictReader(f))


def _stats(xs: List[float]) -> str:
    if not xs:
        return ""
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="counted runs of every row (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="runs of every row before counting (default 1)")
    ap.add_argument("--project", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    ap.add_argument("--baseline", type=Path, help="a second checkout, measured in the same turns")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    checkouts = [("project", args.project)] + ([("baseline", args.baseline)] if args.baseline else [])
    for flag, folder in checkouts:
        if not (folder / "pipeline" / "train.py").is_file():
            ap.error(f"--{flag}: {folder} holds no pipeline/train.py")
    run = ["name=startup_probe", "seed=1", "train.rounds=1"]
    rows = [row for flag, folder in checkouts for row in (
        Row(flag, folder.resolve(), "fl-train --help", ["--help"], False),
        Row(flag, folder.resolve(), "fl-train --cfg", ["--cfg"], False),
        Row(flag, folder.resolve(), "1 round, 1 seed", run, True),
        Row(flag, folder.resolve(), "1 round, tracking off", run + ["tracking.enabled=false"], True))]
    before = load()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fl-startup-") as tmp:
        n = 0
        for i in range(args.warmup + args.repeats):
            for row in rows:
                row.run_once(Path(tmp), n, count=i >= args.warmup)
                n += 1
    print(f"Command: {' '.join(entry())}; " + ", ".join(f"{flag} {folder.resolve()}" for flag, folder in checkouts)
          + f"; {args.repeats} repeats after {args.warmup} warm-up, {time.perf_counter() - t0:.0f} s in all")
    print(f"Machine: {machine()}; {versions()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"Load average (1 / 5 / 15 min): {before} before, {load()} after")
    print()
    print("| checkout | command | wall s (min / median / max) | CPU s | training s | overhead s (wall - training) |")
    print("|---|---|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: r.checkout != "baseline"):
        print("| " + " | ".join(row.cells()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
