#!/usr/bin/env python
"""Batched sweeps benchmark: ``python sweeps/tune.py --batch K`` (K trials at a time, one population) against
``--batch 1`` (one trial at a time), in trials per hour and in the best value found after N trials.

For every workload, search space, study seed S and K, one fresh ``tune.py`` process runs ``--n-trials N`` trials of a
new study (a journal in a temporary folder, ``--sampler-seed S``, the default sampler and pruner: multivariate TPE with
constant liar, the median pruner; no MLflow, no final test run, one torch thread), timed from start to exit, so
start-up and data loading count as a user pays them. Within a study seed the K values take turns, one after another,
so a drift of the machine touches every K alike. Measured per run: the wall seconds, the trials finished (COMPLETE or
PRUNED, from the study's summary) and the best validation accuracy after the N trials.

Workloads (``--workloads``):

- ``mnist1d``: the MNIST-1D CNN recipe, 100 clients, 10 per round, 200 rounds (``dataset=mnist1d model=m1d_cnn
  partition.num_clients=100 train.participation=0.1 train.rounds=200``, over the space's base: Dirichlet split,
  E = 2, B = 16).
- ``digits``: the spaces' own digits base (10 clients, 20 rounds, about 2-4 s a trial on one core).

Prints one Markdown table per workload and space: K, wall seconds (min / median / max over the study seeds), trials
per hour (mean) and its ratio to K = 1 (paired by study seed: min / median / max of the ratios), the best value after
N trials (mean +- standard error over the seeds) and whether it is within one standard error of K = 1's mean (the
larger of the two errors). Run from the project root::

    python benchmarks/sweep_batch.py                                   # mnist1d and digits, lr and fedbug, K 1 4 8 16
    python benchmarks/sweep_batch.py --workloads digits --spaces lr --batches 1 8 --seeds 1 --n-trials 8
"""

from __future__ import annotations

import argparse
import json
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
                "train.rounds=200"],
    "digits": [],
}


def run_sweep(tmp: Path, workload: str, space: str, k: int, seed: int, n_trials: int) -> Dict[str, float]:
    """One fresh ``tune.py`` process: its wall seconds, finished trials and best value (NaN: no COMPLETE trial)."""
    name = f"{workload}-{space}-k{k}-s{seed}"
    cmd = [sys.executable, str(ROOT / "sweeps" / "tune.py"), "--space", space, "--n-trials", str(n_trials),
           "--batch", str(k), "--sampler-seed", str(seed), "--study-name", name, "--storage", str(tmp / f"{name}.log"),
           "--out", str(tmp / name), "--no-mlflow", "--no-test", "--quiet", "--threads", "1", *WORKLOADS[workload]]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
    wall = time.monotonic() - t0
    summary = json.loads((tmp / name / "summary.json").read_text())
    best = summary.get("best_value")
    return {"wall": wall, "finished": float(summary["complete"] + summary["pruned"]),
            "best": float("nan") if best is None else float(best)}


def _se(values: List[float]) -> float:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def table(rows: Dict[int, List[Dict[str, float]]], title: str) -> str:
    """The Markdown table of one workload and space (module docstring)."""
    ks = sorted(rows)
    base = rows[ks[0]]
    rate = {k: [3600.0 * r["finished"] / r["wall"] for r in rows[k]] for k in ks}
    out = [f"{title}", "", f"| K | wall s, min / median / max | trials per hour | / K = {ks[0]} (min / median / max) "
                           "| best val_acc after N, mean +- SE | within 1 SE of K = 1 |",
           "|---:|---|---:|---|---|---|"]
    best0 = [r["best"] for r in base]
    for k in ks:
        walls = [r["wall"] for r in rows[k]]
        ratios = sorted(a / b for a, b in zip(rate[k], rate[ks[0]]))
        best = [r["best"] for r in rows[k]]
        within = abs(statistics.mean(best) - statistics.mean(best0)) <= max(_se(best), _se(best0))
        out.append(f"| {k} | {min(walls):.0f} / {statistics.median(walls):.0f} / {max(walls):.0f} | "
                   f"{statistics.mean(rate[k]):.0f} | {ratios[0]:.2f}x / {statistics.median(ratios):.2f}x / "
                   f"{ratios[-1]:.2f}x | {statistics.mean(best):.4f} +- {_se(best):.4f} | "
                   f"{'yes' if within else 'no'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["mnist1d", "digits"])
    p.add_argument("--spaces", nargs="+", default=["lr", "fedbug"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="study (sampler) seeds")
    p.add_argument("--n-trials", type=int, default=16)
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    results: Dict[Tuple[str, str], Dict[int, List[Dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="fl-sweep-bench-") as d:
        tmp = Path(d)
        for workload in args.workloads:
            for space in args.spaces:
                rows = results.setdefault((workload, space), {k: [] for k in args.batches})
                for seed in args.seeds:
                    for k in args.batches:
                        r = run_sweep(tmp, workload, space, k, seed, args.n_trials)
                        rows[k].append(r)
                        print(f"{workload} {space} seed {seed} K={k}: {r['wall']:.1f} s, {r['finished']:.0f} "
                              f"finished, best {r['best']:.4f}", file=sys.stderr, flush=True)
    print(f"Machine: {machine()}; load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"{args.n_trials} trials per run, study seeds {' '.join(map(str, args.seeds))}.\n")
    for (workload, space), rows in results.items():
        print(table(rows, f"Workload `{workload}` ({' '.join(WORKLOADS[workload]) or 'the space base'}), "
                          f"space `{space}`:") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
