#!/usr/bin/env python
"""Populations benchmark: an experiment's 3 seeds trained as one population against one seed, against the same 3
seeds one after another on the same executor, and on the sequential executor (the default grid's); with ``--grid``
the same for five experiments that differ only in eta_l (``fl-train -m train.lr=...``, one seed each).

Each row starts a fresh ``python -m pipeline.train`` (tracking, checkpoints and the progress bar off, results in a
temporary folder, ``engine.threads=1``) and times it from start to exit, so interpreter and data start-up count as
a user pays them; the rows take turns, ``--repeats`` counted turns after one warm-up turn (:mod:`benchmarks.turns`).

Workloads (``--workload``):

- ``digits``: the default config (FedAvg on digits, 10 clients, participation 0.5, E = 3, B = 16), 30 rounds.
- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 50 rounds.

Prints a Markdown table (:mod:`benchmarks.turns`): min / median / max wall seconds per row and its ratio to one
seed's run of the same turn (min / median / max over the turns). Run from the project root::

    python benchmarks/population.py                          # digits, 3 repeats
    python benchmarks/population.py --workload mnist1d --repeats 3
    python benchmarks/population.py --workload mnist1d --grid   # fl-train -m train.lr=<5 values> (one seed each)
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
    "digits": ["train.rounds=30"],
    "mnist1d": ["dataset=mnist1d", "model=m1d_cnn", "partition.num_clients=100", "train.participation=0.1",
                "train.rounds=50"],
}
LRS = "train.lr=0.005,0.01,0.02,0.05,0.1"  # --grid: five values of eta_l, one seed each
GRID_ROWS: List[Tuple[str, List[str]]] = [
    ("1 run (eta_l 0.02), vectorized", ["seed=1", "engine.executor=vectorized", "train.lr=0.02"]),
    ("5 eta_l values, vectorized, one population", ["-m", LRS, "seed=1", "engine.executor=vectorized"]),
    ("5 eta_l values, vectorized, one after another", ["-m", LRS, "seed=1", "engine.executor=vectorized",
                                                       "engine.population=false"]),
    ("5 eta_l values, sequential executor", ["-m", LRS, "seed=1", "engine.executor=sequential"]),
]
ROWS: List[Tuple[str, List[str]]] = [
    ("1 seed, vectorized", ["seed=1", "engine.executor=vectorized"]),
    ("3 seeds, vectorized, one population", ["seed=1,2,3", "engine.executor=vectorized"]),
    ("3 seeds, vectorized, one after another", ["seed=1,2,3", "engine.executor=vectorized",
                                                "engine.population=false"]),
    ("3 seeds, sequential executor", ["seed=1,2,3", "engine.executor=sequential"]),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grid", action="store_true", help="time a 5-value eta_l grid (fl-train -m train.lr=...) as one "
                   "population against its runs one after another, instead of an experiment's seeds")
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = GRID_ROWS if args.grid else ROWS
    times = take_turns(rows, [*WORKLOADS[args.workload], "engine.threads=1", "tracking.enabled=false"], args.repeats)
    print_table(rows, times, f"workload {args.workload} ({' '.join(WORKLOADS[args.workload])}), {args.repeats} "
                f"repeats after one warm-up", load0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
