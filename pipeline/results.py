"""The grid's experiments as the train stage left them, and the statistics over their seeds: what the report
(:mod:`pipeline.report`) and the claims (:mod:`pipeline.claims`) both read.

Each experiment's ``metrics.json``, ``experiment.json`` and ``runs.csv`` (``results/<name>/``) are loaded into an
:class:`Experiment`; per-seed values, their mean and spread, paired differences and confidence intervals are
computed from them.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fl_core.metrics import mean_std
from fl_core.store.runstore import EXPERIMENT_FILE, METRICS_FILE

from .grid import Grid
from .labels import _num, partition_label, run_label


@dataclass
class Experiment:
    """One experiment of the grid with its results (``metrics`` is None when they are missing)."""

    name: str
    overrides: List[str]
    metrics: Optional[Dict] = None
    curves: Optional[Dict[str, np.ndarray]] = None  # round, acc_mean/min/max, loss_round, loss_mean
    problem: str = ""  # why metrics are missing
    row_label: str = ""
    col_label: str = ""
    notes: List[str] = field(default_factory=list)
    # a model with a known optimum (``objective_metrics``: the quadratic and convex problems): the last round's
    # ``opt_distance`` ||x - x*|| and ``objective_gap`` F(x) - F(x*), as (mean, std over seeds); empty without them
    objective: Dict[str, Tuple[float, float]] = field(default_factory=dict)

    @property
    def failed(self) -> str:
        """The failure reasons when every seed of the experiment failed (``status: failed``), else ''."""
        m = self.metrics or {}
        if m.get("status") != "failed":
            return ""
        reasons = m.get("failures") or {}
        return "; ".join(f"seed {s}: {r}" for s, r in reasons.items()) or "every seed failed"


def _float(s: str) -> float:
    try:
        v = float(s)
    except (TypeError, ValueError):
        return math.nan
    return v


def read_runs_rows(path: Path) -> Optional[List[Dict[str, str]]]:
    """The rows of a ``runs.csv`` (one per seed and round), or None when it is missing, empty or lacks
    the ``round`` column."""
    if not path.exists():
        return None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "round" not in rows[0]:
        return None
    return rows


def numeric_columns(rows: List[Dict[str, str]]) -> Dict[str, Dict[int, Dict[int, float]]]:
    """{column: {seed: {round: value}}} of the finite numbers in ``runs.csv`` rows (:func:`read_runs_rows`); rows
    without a readable seed or round, empty cells and text are left out."""
    out: Dict[str, Dict[int, Dict[int, float]]] = {}
    for r in rows:
        try:
            seed, rnd = int(float(r.get("seed") or 0)), int(float(r["round"]))
        except (TypeError, ValueError):
            continue
        for k, v in r.items():
            if k in ("seed", "round") or v in (None, ""):
                continue
            try:
                x = float(v)
            except ValueError:
                continue
            if math.isfinite(x):
                out.setdefault(k, {}).setdefault(seed, {})[rnd] = x
    return out


OBJECTIVE_COLUMNS = ("opt_distance", "objective_gap")  # logged by a model with a known optimum


def final_objective(rows: List[Dict[str, str]]) -> Dict[str, Tuple[float, float]]:
    """{column: (mean, std)} over the seeds of each :data:`OBJECTIVE_COLUMNS` column's value at the seed's last
    round that has one (std: ddof = 1, 0 for one seed); columns absent from ``runs.csv`` rows are left out."""
    cols = numeric_columns(rows)
    out: Dict[str, Tuple[float, float]] = {}
    for k in OBJECTIVE_COLUMNS:
        finals = [per_round[max(per_round)] for per_round in cols.get(k, {}).values() if per_round]
        if finals:
            out[k] = (float(np.mean(finals)), float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0)
    return out


DRIFT_CURVES = ("drift_dissimilarity", "drift_cosine")  # the drift measures the report draws per round


def read_curves(path: Path) -> Optional[Dict[str, np.ndarray]]:
    """Per-round test accuracy (mean, min, max over seeds) and training-loss mean from ``runs.csv``.

    Rounds without an evaluation (empty ``test_acc``) are left out of the accuracy arrays. ``acc_up`` is, at
    each round of ``acc_round``, the floats each participating client has uploaded up to and including that
    round (``comm_up_floats``, cumulative in ``runs.csv``; mean over seeds; NaN without that column). For each
    drift measure k of :data:`DRIFT_CURVES` (``tracking.drift``), ``<k>_round`` and ``<k>_mean`` (mean over the
    seeds that measured it; empty arrays without the column); the same, with ``<k>_min`` and ``<k>_max`` over the
    seeds, for each column k of :data:`OBJECTIVE_COLUMNS` (a model with a known optimum). Returns None when the file is missing, empty or lacks
    the ``round`` column.
    """
    rows = read_runs_rows(path)
    return None if rows is None else curves_of(rows)


def curves_of(rows: List[Dict[str, str]]) -> Dict[str, np.ndarray]:
    """:func:`read_curves` of rows already read (:func:`read_runs_rows`)."""
    acc: Dict[int, List[float]] = {}
    loss: Dict[int, List[float]] = {}
    up: Dict[int, Dict[int, float]] = {}  # seed -> round -> floats uploaded per client so far (cumulative)
    drift: Dict[str, Dict[int, List[float]]] = {k: {} for k in DRIFT_CURVES + OBJECTIVE_COLUMNS}
    for r in rows:
        rnd = _float(r.get("round"))
        if math.isnan(rnd):
            continue
        for k in DRIFT_CURVES + OBJECTIVE_COLUMNS:
            v = _float(r.get(k))
            if math.isfinite(v):
                drift[k].setdefault(int(rnd), []).append(v)
        a, lo, u = _float(r.get("test_acc")), _float(r.get("train_loss")), _float(r.get("comm_up_floats"))
        if math.isfinite(a):
            acc.setdefault(int(rnd), []).append(a)
        if math.isfinite(lo):
            loss.setdefault(int(rnd), []).append(lo)
        seed = _float(r.get("seed"))
        if math.isfinite(u) and not math.isnan(seed):
            up.setdefault(int(seed), {})[int(rnd)] = u
    ar = sorted(acc)
    lr = sorted(loss)
    cumulative: Dict[int, List[float]] = {}  # round -> each seed's uplink up to and including it
    for per_round in up.values():
        for rnd, total in per_round.items():
            cumulative.setdefault(rnd, []).append(total)
    return {
        "acc_round": np.array(ar, dtype=float),
        "acc_mean": np.array([np.mean(acc[r]) for r in ar], dtype=float),
        "acc_min": np.array([np.min(acc[r]) for r in ar], dtype=float),
        "acc_max": np.array([np.max(acc[r]) for r in ar], dtype=float),
        "acc_up": np.array([np.mean(cumulative[r]) if r in cumulative else math.nan for r in ar], dtype=float),
        "loss_round": np.array(lr, dtype=float),
        "loss_mean": np.array([np.mean(loss[r]) for r in lr], dtype=float),
        **{out: arr for k, series in drift.items() for out, arr in (
            (f"{k}_round", np.array(sorted(series), dtype=float)),
            (f"{k}_mean", np.array([np.mean(series[r]) for r in sorted(series)], dtype=float)))},
        **{f"{k}_{stat}": np.array([fn(drift[k][r]) for r in sorted(drift[k])], dtype=float)
           for k in OBJECTIVE_COLUMNS for stat, fn in (("min", np.min), ("max", np.max))},
    }


def load_experiments(grid: Grid, results_dir: Path) -> List[Experiment]:
    """Every experiment of ``grid`` (in params.yaml order) with its metrics and curves if present."""
    out: List[Experiment] = []
    for name, overrides in grid.experiments.items():
        exp = Experiment(name, list(overrides))
        d = Path(results_dir) / name
        mpath = d / METRICS_FILE
        if not mpath.exists():
            exp.problem = f"no {mpath.as_posix()}"
        else:
            try:
                m = {}
                for part in (mpath, d / EXPERIMENT_FILE):  # the numbers, then what ran (names, per-seed values)
                    if part == mpath or part.exists():
                        loaded = json.loads(part.read_text())
                        if not isinstance(loaded, dict):
                            raise ValueError(f"{part.name} is not a JSON object")
                        m.update(loaded)
                exp.metrics = m
            except (OSError, ValueError) as err:
                exp.problem = f"unreadable {mpath.as_posix()} ({err})"
        if exp.metrics is not None:
            try:
                rows = read_runs_rows(d / "runs.csv")
                exp.curves = None if rows is None else curves_of(rows)
                exp.objective = final_objective(rows) if rows else {}
            except (OSError, csv.Error, UnicodeDecodeError):
                exp.curves = None
            failed = exp.metrics.get("failed_seeds") or []
            if exp.failed:  # every seed failed: listed under "Failed", nothing else to say
                pass
            elif failed:
                n_ok = len(exp.metrics.get("seeds") or [])
                exp.notes.append(f"seed(s) {', '.join(map(str, failed))} failed; numbers are over the "
                                 f"remaining {n_ok} seed(s)")
            d = _num(exp.metrics.get("model_d"))
            if exp.curves is not None and d:  # the uplink in units of the model size d
                exp.curves["acc_up_d"] = exp.curves["acc_up"] / d
            if exp.curves is None and not exp.failed:
                exp.notes.append("no runs.csv: not in the curves figure")
        out.append(exp)
    _assign_labels([e for e in out if e.metrics is not None])
    return out


def _assign_labels(exps: List[Experiment]) -> None:
    """Row (algorithm) and column (partition) labels of the comparison table, made unique per cell."""
    keys = {str(e.metrics.get("partition", "")) for e in exps}
    short = {k: partition_label(k) for k in keys}
    by_label: Dict[str, List[str]] = {}
    for k, lab in short.items():
        by_label.setdefault(lab, []).append(k)
    col = {}
    for lab, ks in by_label.items():
        if len(ks) == 1:
            col[ks[0]] = lab
            continue
        verbose = {k: partition_label(k, verbose=True) for k in ks}
        unique = len(set(verbose.values())) == len(ks)
        for k in ks:
            col[k] = verbose[k] if unique else k
    for e in exps:
        e.col_label = col[str(e.metrics.get("partition", ""))]
        e.row_label = run_label(e.metrics)

    def collisions() -> set:
        seen: Dict[Tuple[str, str], int] = {}
        for e in exps:
            seen[(e.row_label, e.col_label)] = seen.get((e.row_label, e.col_label), 0) + 1
        return {r for (r, _), n in seen.items() if n > 1}

    clash = collisions()
    if not clash:
        return
    # same algorithm label in one cell: tell the rows apart by their non-partition overrides
    for lab in clash:
        group = [e for e in exps if e.row_label == lab]
        own = {e.name: [o for o in e.overrides if not re.match(r"(partition|dataset)(\.|=)", o)] for e in group}
        common = set.intersection(*(set(v) for v in own.values()))
        for e in group:
            diff = [o for o in own[e.name] if o not in common]
            if diff:
                e.row_label = f"{lab} ({', '.join(diff)})"
    for lab in collisions():
        for e in exps:
            if e.row_label == lab:
                e.row_label = f"{lab} [{e.name}]"


# --------------------------------------------------------------------------- statistics over seeds

def seed_values(e: Experiment, metric: str = "final_acc") -> Dict[str, float]:
    """{seed: ``metric``} of the seeds that finished, from ``experiment.json``'s ``per_seed`` summaries (the
    keys of :data:`fl_core.metrics.SUMMARY_KEYS`, in their units: accuracies as fractions); seeds whose value is
    missing, None or not finite (``rounds_to_target`` of a seed that never reached the target) are left out."""
    per_seed = (e.metrics or {}).get("per_seed") or {}
    out = {}
    for seed, summ in per_seed.items():
        v = _num((summ or {}).get(metric)) if isinstance(summ, dict) else None
        if v is not None:
            out[str(seed)] = v
    return out


def final_acc_per_seed(e: Experiment) -> Dict[str, float]:
    """{seed: final test accuracy (fraction)} of the seeds that finished (from ``experiment.json``)."""
    return seed_values(e, "final_acc")


def sample_stats(values: Sequence[float]) -> Dict[str, float]:
    """``mean``, ``std`` (sample std, ddof = 1; 0 for one value) and ``n`` of ``values`` (at least one)."""
    ms = mean_std(list(values))
    return {"mean": ms["mean"], "std": ms["std"], "n": ms["n"]}


def paired_values(a: Dict[str, float], b: Dict[str, float], scale: float = 1.0) -> Optional[Dict[str, float]]:
    """:func:`sample_stats` of ``scale * (a[s] - b[s])`` over the seeds s in both mappings ({seed: value});
    None without a common seed."""
    common = sorted(set(a) & set(b), key=lambda s: (len(s), s))
    if not common:
        return None
    return sample_stats([scale * (a[s] - b[s]) for s in common])


def paired_difference(e: Experiment, ref: Experiment) -> Optional[Dict[str, float]]:
    """Final test accuracy of ``e`` minus that of ``ref`` on the same seeds, in percentage points:
    ``mean``, ``std`` (sample std over seeds, ddof = 1; 0 for one seed) and ``n`` (seeds both finished).
    Pairing by seed removes what the seeds share (model initialisation, client sampling, the partition
    draw), so the spread is that of the difference itself. None without a common seed."""
    return paired_values(final_acc_per_seed(e), final_acc_per_seed(ref), 100.0)


def confidence_interval(d: Dict[str, float], level: float = 0.95) -> Tuple[Optional[float], Optional[float]]:
    """The ``level`` confidence interval of the mean of a :func:`sample_stats` / :func:`paired_values` /
    :func:`paired_difference` result: mean +- t_{(1+level)/2, n-1} std / sqrt(n) (Student t; scipy), in its
    units; (None, None) for fewer than 2 seeds."""
    n = int(d["n"])
    if n < 2:
        return None, None
    from scipy.stats import t

    half = float(t.ppf((1 + level) / 2, n - 1)) * d["std"] / math.sqrt(n)
    return d["mean"] - half, d["mean"] + half
