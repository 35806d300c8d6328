#!/usr/bin/env python
"""Tracking benchmark: what MLflow costs a run, on and off, on one workload.

Each row starts a fresh ``python -m pipeline.train`` (checkpoints and the progress bar off, results in a temporary
folder, one seed, ``engine.threads=1``) and times it from start to exit with a monotonic clock. Rows:

- tracking off (``tracking.enabled=false``);
- tracking on, to a new SQLite store in the temporary folder (``MLFLOW_TRACKING_URI``), the defaults
  (``tracking.log_every=10``, the final model logged);
- tracking on without the model (``tracking.log_model=false``).

The rows take turns, ``--repeats`` counted turns after one warm-up turn. Prints a Markdown table
(:mod:`benchmarks.turns`): min / median / max wall seconds per row and its ratio to tracking off taken turn by turn
(min / median / max of the per-turn ratios: pairing keeps the ratio meaningful when the machine's speed drifts).

Workloads (``--workload``):

- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 200 rounds (vectorised executor).
- ``digits``: the default config, 30 rounds.

Run from the project root::

    python benchmarks/tracking.py --workload mnist1d --repeats 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.turns import print_table, take_turns  # noqa: E402  (after the path is set)

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mnist1d")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    times = take_turns(ROWS, [*WORKLOADS[args.workload], "seed=1", "engine.threads=1"], args.repeats,
                       env_of=lambda tmp: {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
    print_table(ROWS, times, f"workload {args.workload} ({' '.join(WORKLOADS[args.workload])}), {args.repeats} "
                f"repeats after one warm-up", load0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
