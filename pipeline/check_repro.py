"""``make check-repro``: after ``make repro``, are the fresh numbers the committed ones (docs/reliability.md)?

For every experiment of the grid (``results/<name>/metrics.json``, tracked by git) it compares the accuracy metrics
of the working tree with the version committed at ``HEAD`` (``git show HEAD:<path>``):

- ``final_acc_mean``, ``best_acc_mean``, ``final_client_acc_mean_mean`` (fractions; compared in percentage
  points), and ``rounds_to_target_mean`` (rounds);
- ``status`` and ``seeds`` must be equal.

A difference above the tolerance (``--tolerance`` percentage points, default :data:`TOLERANCE_PP`; rounds to
target: ``--rounds-tolerance``) is printed as one line naming the experiment and the metric, and the command exits
1; an experiment without a committed or without a fresh ``metrics.json`` exits 2. The tolerance is the largest
difference measured between two CPU kinds (docs/reliability.md, Numbers on another CPU).

Usage::

    python -m pipeline.check_repro [--params params.yaml] [--results results] [--tolerance PP]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from fl_core.config import ConfigError

from .grid import load_grid

TOLERANCE_PP = 0.5  # percentage points: SCAFFOLD's mean final accuracy moved 0.49 pp from an Intel to an AMD CPU
ROUNDS_TOLERANCE = 2.0
ACC_METRICS = ("final_acc_mean", "best_acc_mean", "final_client_acc_mean_mean")
EQUAL_KEYS = ("status", "seeds")


def committed(path: Path, rev: str = "HEAD") -> Optional[Dict]:
    """``path`` (relative to the repository root, or absolute inside it) as committed at ``rev``; None if absent."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    rel = path.resolve().relative_to(Path(top.stdout.strip()).resolve())
    shown = subprocess.run(["git", "show", f"{rev}:{rel.as_posix()}"], capture_output=True, check=False, text=True)
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def compare(name: str, fresh: Dict, old: Dict, tolerance_pp: float, rounds_tolerance: float) -> List[str]:
    """One line per metric of experiment ``name`` that differs beyond its tolerance (empty: reproduced)."""
    out = []
    for key in EQUAL_KEYS:
        if fresh.get(key) != old.get(key):
            out.append(f"{name}: {key} is {fresh.get(key)!r}, committed {old.get(key)!r}")
    checks = [(k, 100.0, tolerance_pp, "pp") for k in ACC_METRICS] + [
        ("rounds_to_target_mean", 1.0, rounds_tolerance, "rounds")]
    for key, scale, tol, unit in checks:
        a, b = fresh.get(key), old.get(key)
        if a is None and b is None:
            continue
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            if a != b:
                out.append(f"{name}: {key} is {a}, committed {b}")
            continue
        diff = (a - b) * scale
        if abs(diff) > tol:
            out.append(f"{name}: {key} differs by {diff:+.2f} {unit} (fresh {a * scale:.2f}, committed "
                       f"{b * scale:.2f}; tolerance {tol:g} {unit})")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.check_repro",
                                 description="Compare the fresh metrics of the grid with the committed ones.")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--results", default="results")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE_PP, help="accuracy tolerance, percentage points")
    ap.add_argument("--rounds-tolerance", type=float, default=ROUNDS_TOLERANCE, help="rounds to target")
    args = ap.parse_args(argv)
    try:
        grid = load_grid(Path(args.params))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problems, missing = [], []
    for name in grid.experiments:
        path = Path(args.results) / name / "metrics.json"
        if not path.is_file():
            missing.append(f"{name}: no fresh {path} (run make repro first)")
            continue
        old = committed(path)
        if old is None:
            missing.append(f"{name}: {path} is not committed at HEAD: nothing to compare with")
            continue
        problems += compare(name, json.loads(path.read_text()), old, args.tolerance, args.rounds_tolerance)
    for line in missing + problems:
        print(line, file=sys.stderr)
    if missing:
        return 2
    if problems:
        return 1
    print(f"reproduced: {len(grid.experiments)} experiments within {args.tolerance:g} pp (accuracy) and "
          f"{args.rounds_tolerance:g} rounds of the committed metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
