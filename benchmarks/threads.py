#!/usr/bin/env python
"""Threads benchmark: a single ``fl-train`` run idle and beside one busy process, at ``engine.threads=1`` (the
default) and ``engine.threads=0`` (PyTorch's own choice: one thread per core).

Each row starts a fresh ``python -m pipeline.train`` (tracking, checkpoints and the progress bar off, results in a
temporary folder) and times it from start to exit with a monotonic clock. "Beside a busy process" starts, before
the run, one process that multiplies 512 x 512 float32 matrices in a loop at ``--busy-threads`` torch threads
(default 0: one per core, as a second run at PyTorch's default would) and stops it after the run. The rows take
turns (idle 1, idle 0, busy 1, busy 0, idle 1, ...) so that a change in the machine touches every row alike;
``--repeats`` turns after one warm-up turn that is not counted. ``OMP_NUM_THREADS`` is removed from the children's
environment, so ``engine.threads=0`` means one thread per core.

Workloads (``--workload``):

- ``digits``: the default config (FedAvg on digits, 10 clients, participation 0.5, E = 3, B = 16), 10 rounds.
- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 20 rounds.

Prints a Markdown table: min / median / max wall seconds per row, and per thread setting the ratio of the busy
median to the idle median (the slow-down a neighbour causes). Run from the project root::

    python benchmarks/threads.py                          # digits, 3 repeats
    python benchmarks/threads.py --workload mnist1d --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.startup import machine  # noqa: E402  (after the path is set)

WORKLOADS: Dict[str, List[str]] = {
    "digits": ["train.rounds=10"],
    "mnist1d": ["dataset=mnist1d", "model=m1d_cnn", "partition.num_clients=100", "train.participation=0.1",
                "train.rounds=20"],
}
BUSY = ("import os, sys, torch\n"
        "parent = os.getppid()\n"
        "torch.set_num_threads(int(sys.argv[1]) or torch.get_num_threads())\n"
        "a = torch.randn(512, 512)\n"
        "while os.getppid() == parent:  # ends with the benchmark, however that ends\n"
        "    a = torch.tanh(a @ a)\n")


def child_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def one_run(workload: str, threads: int, busy: bool, busy_threads: int, tmp: Path) -> float:
    """Wall seconds of one ``fl-train`` run, beside a busy process when ``busy``."""
    neighbour = (subprocess.Popen([sys.executable, "-c", BUSY, str(busy_threads)], env=child_env())
                 if busy else None)
    try:
        if neighbour is not None:
            time.sleep(1.0)  # the neighbour has loaded torch and spins before the run starts
        shutil.rmtree(tmp / "results", ignore_errors=True)  # a finished run would be read back, not trained
        cmd = [sys.executable, "-m", "pipeline.train", *WORKLOADS[workload], f"engine.threads={threads}", "seed=1",
               "tracking.enabled=false", "engine.progress=false", "engine.checkpoint_every=0",
               f"results_dir={tmp / 'results'}", f"engine.checkpoint_dir={tmp / 'ck'}", f"data_dir={tmp / 'data'}",
               "name=threads_probe"]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=child_env(), check=True, capture_output=True)
        return time.monotonic() - t0
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy-threads", type=int, default=0, help="the busy process's torch threads (0: one per core)")
    args = p.parse_args(argv)
    rows = [(t, b) for b in (False, True) for t in (1, 0)]
    times: Dict[tuple, List[float]] = {r: [] for r in rows}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fl-threads-") as d:
        for turn in range(args.repeats + 1):
            for t, b in rows:
                s = one_run(args.workload, t, b, args.busy_threads, Path(d))
                if turn:
                    times[(t, b)].append(s)
                print(f"turn {turn} threads={t} {'busy' if b else 'idle'}: {s:.1f} s", file=sys.stderr)
    print(f"{machine()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; workload {args.workload}, "
          f"{args.repeats} repeats, busy process at {args.busy_threads or 'one per core'} thread(s)\n")
    print("| engine.threads | neighbour | wall s min / median / max | busy / idle |")
    print("|---|---|---|---|")
    for t, b in rows:
        xs = times[(t, b)]
        ratio = statistics.median(xs) / statistics.median(times[(t, False)]) if b else None
        print(f"| {t} | {'one busy process' if b else 'none'} | {min(xs):.1f} / {statistics.median(xs):.1f} / "
              f"{max(xs):.1f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
