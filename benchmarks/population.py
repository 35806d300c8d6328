#!/usr/bin/env python
"""Populations benchmark: an experiment's 3 seeds trained as one population against one seed, against the same 3
seeds one after another on the same executor, and on the sequential executor (the default grid's).

Each row starts a fresh ``python -m pipeline.train`` (tracking, checkpoints and the progress bar off, results in a
temporary folder, ``engine.threads=1``) and times it from start to exit with a monotonic clock, so interpreter and
data start-up count as a user pays them. The rows take turns (1 seed, population, apart, sequential, 1 seed, ...) so
that a change in the machine touches every row alike; ``--repeats`` turns after one warm-up turn that is not
counted.

Workloads (``--workload``):

- ``digits``: the default config (FedAvg on digits, 10 clients, participation 0.5, E = 3, B = 16), 30 rounds.
- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 50 rounds.

Prints a Markdown table: min / median / max wall seconds per row and the ratio of its median to one seed's. Run
from the project root::

    python benchmarks/population.py                          # digits, 3 repeats
    python benchmarks/population.py --workload mnist1d --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.startup import machine  # noqa: E402  (after the path is set)

WORKLOADS: Dict[str, List[str]] = {
    "digits": ["train.rounds=30"],
    "mnist1d": ["dataset=mnist1d", "model=m1d_cnn", "partition.num_clients=100", "train.participation=0.1",
                "train.rounds=50"],
}
ROWS: List[Tuple[str, List[str]]] = [
    ("1 seed, vectorized", ["seed=1", "engine.executor=vectorized"]),
    ("3 seeds, vectorized, one population", ["seed=1,2,3", "engine.executor=vectorized"]),
    ("3 seeds, vectorized, one after another", ["seed=1,2,3", "engine.executor=vectorized",
                                                "engine.population=false"]),
    ("3 seeds, sequential executor", ["seed=1,2,3", "engine.executor=sequential"]),
]
_names = itertools.count()


def one_run(workload: str, extra: List[str], tmp: Path) -> float:
    """Wall seconds of one ``fl-train`` run (a new experiment name each time, so nothing is read back)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipeline.train", *WORKLOADS[workload], *extra, "engine.threads=1",
           "tracking.enabled=false", "engine.progress=false", "engine.checkpoint_every=0",
           f"results_dir={tmp / 'results'}", f"engine.checkpoint_dir={tmp / 'ck'}", f"name=population_{next(_names)}"]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    times: Dict[str, List[float]] = {label: [] for label, _ in ROWS}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fl-population-") as d:
        for turn in range(args.repeats + 1):
            for label, extra in ROWS:
                s = one_run(args.workload, extra, Path(d))
                if turn:
                    times[label].append(s)
                print(f"turn {turn} {label}: {s:.1f} s", file=sys.stderr)
    print(f"{machine()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; workload {args.workload} "
          f"({' '.join(WORKLOADS[args.workload])}), {args.repeats} repeats after one warm-up\n")
    print("| run | wall s min / median / max | / 1 seed |")
    print("|---|---|---|")
    one = statistics.median(times[ROWS[0][0]])
    for label, _ in ROWS:
        xs = times[label]
        print(f"| {label} | {min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f} | "
              f"{statistics.median(xs) / one:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
