"""Rows of ``fl-train`` runs timed in turns, for the benchmarks that compare whole runs (benchmarks/population.py,
benchmarks/tracking.py).

Each run is a fresh ``python -m pipeline.train`` (checkpoints and the progress bar off, results in a temporary
folder, a new experiment name each time so nothing is read back), timed from start to exit with a monotonic clock.
The rows take turns so that a change in the machine touches each alike; the first turn is a warm-up that is not
counted. The table gives each row's min / median / max wall seconds and its ratio to the first row taken turn by
turn (pairing keeps the ratio meaningful when the machine's speed drifts between turns).
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.startup import machine  # noqa: E402  (after the path is set)

Rows = Sequence[Tuple[str, List[str]]]
_names = itertools.count()


def timed_train(overrides: List[str], tmp: Path, env: Optional[Dict[str, str]] = None) -> float:
    """Wall seconds of one ``fl-train`` run of ``overrides`` with its outputs under ``tmp``; with ``-m`` (a sweep over
    ``train.lr``) each job is named by its eta_l and Hydra's files go under ``tmp`` too."""
    n = next(_names)
    sweep = ["name=bench_%d-lr${train.lr}" % n, f"hydra.sweep.dir={tmp / 'multirun' / str(n)}"] \
        if "-m" in overrides else [f"name=bench_{n}"]
    cmd = [sys.executable, "-m", "pipeline.train", *overrides, "engine.progress=false", "engine.checkpoint_every=0",
           f"results_dir={tmp / 'results'}", f"engine.checkpoint_dir={tmp / 'ck'}", *sweep]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, check=True,
                   capture_output=True)
    return time.monotonic() - t0


def take_turns(rows: Rows, common: List[str], repeats: int, env_of=None) -> Dict[str, List[float]]:
    """``repeats`` counted turns (after one warm-up turn) over ``rows`` (label, overrides added to ``common``);
    ``env_of(tmp)``: extra environment of the runs. Wall seconds per row label, in turn order."""
    times: Dict[str, List[float]] = {label: [] for label, _ in rows}
    with tempfile.TemporaryDirectory(prefix="fl-bench-") as d:
        tmp = Path(d)
        env = env_of(tmp) if env_of else None
        for turn in range(repeats + 1):
            for label, extra in rows:
                s = timed_train([*common, *extra], tmp, env)
                if turn:
                    times[label].append(s)
                print(f"turn {turn} {label}: {s:.1f} s", file=sys.stderr)
    return times


def print_table(rows: Rows, times: Dict[str, List[float]], title: str, load0: float) -> None:
    """The Markdown table of :func:`take_turns`' times, under a line naming the machine and ``title``."""
    print(f"{machine()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {title}\n")
    first = rows[0][0]
    print(f"| run | wall s min / median / max | / {first}, per turn: min / median / max |")
    print("|---|---|---|")
    for label, _ in rows:
        xs = times[label]
        ratios = [x / b for x, b in zip(xs, times[first])]
        shown = "" if label == first else \
            f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"
        print(f"| {label} | {min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f} | {shown} |")
