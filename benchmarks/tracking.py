#!/usr/bin/env python
"""Tracking benchmark: what MLflow costs a run, on and off, on one workload.

Each row starts a fresh ``python -m pipeline.train`` (checkpoints and the progress bar off, results in a temporary
folder, one seed, ``engine.threads=1``) and times it from start to exit with a monotonic clock. Rows:

- tracking off (``tracking.enabled=false``);
- tracking on, to a new SQLite store in the temporary folder (``MLFLOW_TRACKING_URI``), the defaults
  (``tracking.log_every=10``, the final model logged);
- tracking on without the model (``tracking.log_model=false``).

The rows take turns so that a change in the machine touches each alike; ``--repeats`` turns after one warm-up turn
that is not counted. Prints a Markdown table: min / median / max wall seconds per row and the extra time over
tracking off (median against median, and as a share of it).

Workloads (``--workload``):

- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 200 rounds (vectorised executor).
- ``digits``: the default config, 30 rounds.

Run from the project root::

    python benchmarks/tracking.py --workload mnist1d --repeats 3
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
    "mnist1d": ["dataset=mnist1d", "model=m1d_cnn", "partition.num_clients=100", "train.participation=0.1",
                "train.rounds=200", "engine.executor=vectorized"],
    "digits": ["train.rounds=30"],
}
ROWS: List[Tuple[str, List[str]]] = [
    ("tracking off", ["tracking.enabled=false"]),
    ("tracking on (SQLite store, model logged)", []),
    ("tracking on, no model", ["tracking.log_model=false"]),
]
_names = itertools.count()


def one_run(workload: str, extra: List[str], tmp: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    cmd = [sys.executable, "-m", "pipeline.train", *WORKLOADS[workload], *extra, "seed=1", "engine.threads=1",
           "engine.progress=false", "engine.checkpoint_every=0", f"results_dir={tmp / 'results'}",
           f"engine.checkpoint_dir={tmp / 'ck'}", f"name=tracking_{next(_names)}"]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mnist1d")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    times: Dict[str, List[float]] = {label: [] for label, _ in ROWS}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fl-tracking-") as d:
        for turn in range(args.repeats + 1):
            for label, extra in ROWS:
                s = one_run(args.workload, extra, Path(d))
                if turn:
                    times[label].append(s)
                print(f"turn {turn} {label}: {s:.1f} s", file=sys.stderr)
    print(f"{machine()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; workload {args.workload} "
          f"({' '.join(WORKLOADS[args.workload])}), {args.repeats} repeats after one warm-up\n")
    print("| run | wall s min / median / max | over tracking off |")
    print("|---|---|---|")
    off = statistics.median(times[ROWS[0][0]])
    for label, _ in ROWS:
        xs = times[label]
        extra = statistics.median(xs) - off
        print(f"| {label} | {min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f} | "
              f"{'' if label == ROWS[0][0] else f'+{extra:.1f} s ({extra / off:+.0%})'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
