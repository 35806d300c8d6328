"""Summarize every experiment of the grid: ``python -m pipeline.report [--params F] [--results D] [--out F]``.

Reads the experiment names of ``params.yaml`` (in its order) and, for each name, ``<results>/<name>/
metrics.json``, ``experiment.json`` and ``runs.csv`` written by the train stage. Writes, each atomically
(a temporary file renamed over the target), next to ``--out``:

* ``report.md``: an "All experiments" table, a "Comparison" table (algorithm x partition, final
  accuracy, best cell per column in bold), each method's difference to FedAvg on the same partition
  with its paired-seed spread, the curves figure, a "How to read" note, and the experiments that
  have no results yet ("Missing") or lost seeds ("Notes"); last, when the grid has a claims file
  (``--claims``, default ``claims.yaml`` beside ``params.yaml``), the "Claims" table: each paper claim with its
  measured effect, 95% interval and verdict (:mod:`pipeline.claims`, docs/claims.md).
* ``curves.png`` and ``curves.pdf`` (the same figure, for a draft): one column per partition; test
  accuracy in % (mean over seeds with a min-max band, one y-axis for every partition) and training
  loss (mean over seeds) per round, one line style per algorithm, one legend below the panels.
* ``uplink.png`` and ``uplink.pdf``: the same columns, test accuracy in % (mean over seeds) against the floats
  each participating client has uploaded so far, in units of the model size d (FedAvg: 1 d per round).
* ``summary.csv``: one row per experiment with results, the numbers of the first table as plain
  fractions.
* ``test_acc.csv``: test accuracy as a fraction per round (mean over seeds), one column per experiment: the
  data of the overlay chart of ``dvc plots show``.
* ``metrics.json``: the headline numbers as fractions, grouped by number then experiment (``final.fedavg``,
  ``final_std.fedavg``, ``best...``, ``worst10...``, ``rounds_to_target...``, ``uplink_to_target...`` in d):
  what ``dvc metrics show`` and ``dvc exp show`` list (:func:`root_metrics`).

Machine-readable files hold fractions; the tables of ``report.md`` show percentages and say so in their
headers.

Exit status: 0 when at least one experiment has results; 2 (one-line ``error:`` on stderr, nothing
written) for an unreadable ``params.yaml``, a malformed claims file (naming the file, claim and key) or when
no experiment has results.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from fl_core.algorithms import registry
from fl_core.config import ConfigError
from fl_core.metrics import mean_std
from fl_core.runstore import EXPERIMENT_FILE, METRICS_FILE

from .files import write_text
from .grid import Grid, load_grid

DASH = "\u2014"
UPLINK_FIGURE = "uplink.png"  # beside the curves figure
PM = "\u00b1"

SUMMARY_COLUMNS = ["experiment", "algorithm", "algorithm_label", "partition", "partition_label", "dataset",
                   "model", "rounds", "target_acc", "n_seeds", "failed_seeds",
                   "final_acc_mean", "final_acc_std", "best_acc_mean", "best_acc_std",
                   "rounds_to_target_mean", "rounds_to_target_std", "target_reached",
                   "final_train_loss_mean", "final_train_loss_std",
                   "final_test_loss_mean", "final_test_loss_std",
                   "final_client_acc_mean_mean", "final_client_acc_mean_std",
                   "final_client_acc_worst10_mean", "final_client_acc_worst10_std",
                   "comm_up_floats", "comm_down_floats"]


# --------------------------------------------------------------------------- labels

def _algo_name(name: str) -> str:
    """The paper name of a rule (the registry's label: ``fedbcgd_plus`` -> ``FedBCGD+``), else ``name``."""
    return registry.label(name)


def _parse_algorithm(s: str) -> Optional[str]:
    """``name[params](inner)`` -> readable label, or None if ``s`` does not have that shape."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*(?:\((.*)\))?\s*", s)
    if not m:
        return None
    name, params, inner = m.groups()
    label = _algo_name(name)
    if params:
        label += " " + ", ".join(p.strip() for p in params.split(",") if p.strip())
    if inner is not None:
        inner_label = _parse_algorithm(inner)
        if inner_label is None:
            return None
        label += f" ({inner_label})"
    return label


def algorithm_label(s: str) -> str:
    """A readable algorithm label from the engine's description string.

    ``"fedbug[P=0.2](fedavg)"`` -> ``"FedBug P=0.2 (FedAvg)"``, ``"fedprox"`` -> ``"FedProx"``.
    Strings of another shape are returned unchanged.
    """
    s = str(s or "").strip()
    if not s:
        return "?"
    return _parse_algorithm(s) or s


_PART_RE = re.compile(r"^(?P<ds>.+?)-(?P<body>(?:iid|dirichlet|shards)(?:-.*)?)-s(?P<seed>-?\d+)$")


_NATURAL_RE = re.compile(r"^(?P<ds>.+)-natural-n(?P<n>\d+)$")
_SYNTHETIC_RE = re.compile(r"^synthetic-(?:iid|a(?P<a>[^-]+)-b(?P<b>[^-]+))-n\d+-tf[^-]+-s-?\d+$")
_MNIST1D_RE = re.compile(r"^mnist1d(?P<shuf>-shuffled)?-s-?\d+$")


def dataset_label(tag: str) -> str:
    """A readable name of a dataset variant from its tag (``fl_core.data.dataset_tag``).

    ``"synthetic-a1-b1-n30-tf0.2-s0"`` -> ``"Synthetic(1,1)"``, ``"synthetic-iid-n30-tf0.2-s0"`` ->
    ``"Synthetic IID"``, ``"mnist1d-s42"`` -> ``"MNIST-1D"``, ``"mnist1d-shuffled-s42"`` -> ``"MNIST-1D shuffled"``,
    ``"emnist-byclass"`` -> ``"EMNIST byclass"``;
    any other tag (``"digits"``, ``"cifar10"``) unchanged.
    """
    m = _SYNTHETIC_RE.match(tag)
    if m:
        return "Synthetic IID" if m.group("a") is None else f"Synthetic({m.group('a')},{m.group('b')})"
    m = _MNIST1D_RE.match(tag)
    if m:
        return "MNIST-1D shuffled" if m.group("shuf") else "MNIST-1D"
    if tag.startswith("emnist-"):
        return f"EMNIST {tag[len('emnist-'):]}"
    return tag


def _parse_partition(key: str) -> Optional[Dict[str, str]]:
    """Fields of a partition key (see ``fl_core.data.partition.partition_key``), or None."""
    m = _NATURAL_RE.match(key)
    if m:  # the dataset's own devices: no seed
        return {"dataset": m.group("ds"), "kind": "natural", "clients": m.group("n")}
    m = _PART_RE.match(key)
    if not m:
        return None
    parts = re.split(r"-(?![\d.])", m.group("body"))  # "a1e-05" stays one token
    out: Dict[str, str] = {"dataset": m.group("ds"), "kind": parts[0], "seed": m.group("seed")}
    rest = parts[1:]
    if out["kind"] == "dirichlet":
        if not rest or rest[0] not in ("per_client", "per_class", "fixed_size_reuse"):
            return None
        out["variant"] = rest.pop(0)
    for tok in rest:
        for prefix, name in (("sgm", "sigma"), ("min", "min_size"), ("spc", "samples_per_client"), ("a", "alpha"),
                             ("n", "clients"), ("S", "classes")):
            if tok.startswith(prefix) and len(tok) > len(prefix):
                out[name] = tok[len(prefix):]
                break
        else:
            return None
    if out["kind"] == "dirichlet" and "alpha" not in out:
        return None
    if out["kind"] == "shards" and "classes" not in out:
        return None
    return out


def partition_label(key: str, verbose: bool = False) -> str:
    """A readable partition label from a partition key; the raw key if it cannot be parsed.

    ``"digits-iid-n20-sgm0-s0"`` -> ``"IID"``, ``"digits-dirichlet-per_client-a0.3-n20-s0"`` ->
    ``"Dirichlet α=0.3"``, ``"...-dirichlet-per_class-a0.5-..."`` -> ``"Dirichlet α=0.5 (per class)"``,
    ``"cifar100-shards-S20-n20-s0"`` -> ``"Shards (20 classes/client)"``, ``"synthetic-a1-b1-n30-tf0.2-s0-natural-n30"``
    -> ``"Synthetic(1,1), natural"`` (the devices are the clients).
    With ``verbose`` the dataset, number of clients and every other field of the key are added, so
    different keys give different labels.
    """
    key = str(key or "")
    p = _parse_partition(key)
    if p is None:
        return key or "?"
    kind = p["kind"]
    extra: List[str] = []
    if kind == "natural":
        label = f"{dataset_label(p['dataset'])}, natural"
        if verbose:
            extra.append(f"{p['clients']} devices")
        return f"{label} ({', '.join(extra)})" if extra else label
    if kind == "iid":
        label = "IID"
    elif kind == "dirichlet":
        label = f"Dirichlet \u03b1={p['alpha']}"
        if p["variant"] == "per_class":
            extra.append("per class")
        elif p["variant"] == "fixed_size_reuse":
            extra.append(f"{p.get('samples_per_client', '?')}/client, reused")
    else:
        label = "Shards"
        extra.append(f"{p['classes']} classes/client")
    if p.get("sigma") not in (None, "0"):
        extra.append(f"size \u03c3={p['sigma']}")
    if verbose:
        if "clients" in p:
            extra.append(f"{p['clients']} client{'' if p['clients'] == '1' else 's'}")
        if "min_size" in p:
            extra.append(f"min size {p['min_size']}")
        extra.append(f"seed {p['seed']}")
        label = f"{dataset_label(p['dataset'])}: {label}"
    return f"{label} ({', '.join(extra)})" if extra else label


# --------------------------------------------------------------------------- loading

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


def read_curves(path: Path) -> Optional[Dict[str, np.ndarray]]:
    """Per-round test accuracy (mean, min, max over seeds) and training-loss mean from ``runs.csv``.

    Rounds without an evaluation (empty ``test_acc``) are left out of the accuracy arrays. ``acc_up`` is, at
    each round of ``acc_round``, the floats each participating client has uploaded up to and including that
    round (``comm_up_floats``, cumulative in ``runs.csv``; mean over seeds; NaN without that column). Returns
    None when the file is missing, empty or lacks the ``round`` column.
    """
    rows = read_runs_rows(path)
    if rows is None:
        return None
    acc: Dict[int, List[float]] = {}
    loss: Dict[int, List[float]] = {}
    up: Dict[int, Dict[int, float]] = {}  # seed -> round -> floats uploaded per client so far (cumulative)
    for r in rows:
        rnd = _float(r.get("round"))
        if math.isnan(rnd):
            continue
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
                exp.curves = read_curves(d / "runs.csv")
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
        e.row_label = algorithm_label(e.metrics.get("algorithm", ""))

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


# --------------------------------------------------------------------------- formatting

def _num(v) -> Optional[float]:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt_pct(mean, std) -> str:
    """``0.85, 0.0707`` -> ``"85.00 ± 7.07"`` (percent); a dash when the mean is missing."""
    m, s = _num(mean), _num(std)
    if m is None:
        return DASH
    return f"{100 * m:.2f} {PM} {100 * (s or 0.0):.2f}"


def fmt_plain(mean, std, digits: int = 4) -> str:
    """Mean ± std with ``digits`` decimals; a dash when the mean is missing."""
    m, s = _num(mean), _num(std)
    if m is None:
        return DASH
    return f"{m:.{digits}f} {PM} {(s or 0.0):.{digits}f}"


def fmt_rounds(m: Dict) -> str:
    """Rounds to target, e.g. ``"12.5 ± 2.1 (2/3 seeds)"``; a dash when no seed reached it."""
    reached = int(m.get("target_reached") or 0)
    n = len(m.get("seeds") or [])
    mean = _num(m.get("rounds_to_target_mean"))
    if not reached or mean is None:
        return DASH
    return f"{mean:.1f} {PM} {(_num(m.get('rounds_to_target_std')) or 0.0):.1f} ({reached}/{n} seeds)"


def fmt_floats_d(m: Dict) -> str:
    """Mean cumulative uplink floats per client to reach the target, in units of the model size d."""
    up, d = _num(m.get("up_floats_to_target_mean")), _num(m.get("model_d"))
    if up is None or not d:
        return DASH
    return f"{up / d:.1f}d"


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "|".join({"l": ":---", "r": "---:", "c": ":---:"}[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _join_values(values: Sequence) -> str:
    vals = []
    for v in values:
        if v is not None and v not in vals:
            vals.append(v)
    return ", ".join(str(v) for v in vals) if vals else "?"


# --------------------------------------------------------------------------- report

def accuracy_cells(rows: List[str], cols: List[str], cells: Dict[Tuple[str, str], Experiment]) -> List[List[str]]:
    """Table rows: the row label, then final accuracy mean +- std per column; the best per column in
    bold (compared at the shown precision, ties all bold; no bold in a column with one value)."""
    best: Dict[str, Optional[float]] = {}
    for c in cols:
        vals = [round(100 * v, 2) for r in rows if (r, c) in cells
                for v in [_num(cells[(r, c)].metrics.get("final_acc_mean"))] if v is not None]
        best[c] = max(vals) if len(vals) >= 2 else None
    table = []
    for r in rows:
        line = [r]
        for c in cols:
            e = cells.get((r, c))
            if e is None:
                line.append(DASH)
                continue
            text = "FAILED" if e.failed else fmt_pct(e.metrics.get("final_acc_mean"), e.metrics.get("final_acc_std"))
            v = _num(e.metrics.get("final_acc_mean"))
            line.append(f"**{text}**" if v is not None and best[c] is not None and round(100 * v, 2) == best[c]
                        else text)
        table.append(line)
    return table


def comparison(exps: List[Experiment]) -> Tuple[List[str], List[str], Dict[Tuple[str, str], Experiment]]:
    """Row labels, column labels (first-appearance order) and the experiment of each cell."""
    rows: List[str] = []
    cols: List[str] = []
    cells: Dict[Tuple[str, str], Experiment] = {}
    for e in exps:
        if e.row_label not in rows:
            rows.append(e.row_label)
        if e.col_label not in cols:
            cols.append(e.col_label)
        cells[(e.row_label, e.col_label)] = e
    return rows, cols, cells


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


def fedavg_references(exps: List[Experiment]) -> Dict[str, Experiment]:
    """{partition column: the plain FedAvg experiment of that column}, where exactly one exists."""
    found: Dict[str, List[Experiment]] = {}
    for e in exps:
        if not e.failed and e.row_label == "FedAvg":
            found.setdefault(e.col_label, []).append(e)
    return {c: es[0] for c, es in found.items() if len(es) == 1}


def differences(exps: List[Experiment]) -> Dict[str, Dict[str, float]]:
    """{experiment name: :func:`paired_difference` to the FedAvg experiment of its partition column}."""
    refs = fedavg_references(exps)
    out: Dict[str, Dict[str, float]] = {}
    for e in exps:
        ref = refs.get(e.col_label)
        if ref is None or ref is e or e.failed:
            continue
        d = paired_difference(e, ref)
        if d is not None:
            out[e.name] = d
    return out


def differences_section(exps: List[Experiment]) -> List[str]:
    """Report lines: per method, its final-accuracy difference to FedAvg on the same partition and seeds."""
    diffs = differences(exps)
    if not diffs:
        return []
    rows = []
    for e in exps:
        d = diffs.get(e.name)
        if d is None:
            continue
        lo, hi = confidence_interval(d)
        ci = DASH if lo is None else f"[{lo:+.2f}, {hi:+.2f}]" + (" *" if lo > 0 or hi < 0 else "")
        rows.append([e.row_label, e.col_label, f"{d['mean']:+.2f} {PM} {d['std']:.2f}", str(d["n"]), ci])
    out = ["## Difference to FedAvg", "",
           "Final test accuracy minus FedAvg's on the same partition and the same seeds, in percentage points: "
           f"mean {PM} std over the paired seeds, and the 95% confidence interval of the mean difference "
           "(Student t over the seeds); * marks an interval that excludes 0.", ""]
    out.append(_table(["algorithm", "partition", "vs FedAvg (pp)", "seeds", "95% CI (pp)"], rows, "llrrl"))
    out.append("")
    return out


# ``report/metrics.json``, the one metrics file DVC tracks: (group, key of the experiment's metrics.json). Groups
# come first and experiments second, so that the leftmost columns of ``dvc exp show`` (the ones it keeps when
# the terminal is narrow) are every experiment's final accuracy.
HEADLINE = (("final", "final_acc_mean"), ("final_std", "final_acc_std"),
            ("best", "best_acc_mean"), ("best_std", "best_acc_std"),
            ("worst10", "final_client_acc_worst10_mean"),
            ("rounds_to_target", "rounds_to_target_mean"))


def root_metrics(exps: List[Experiment]) -> Dict[str, Dict[str, float]]:
    """The headline numbers ``dvc metrics show`` / ``dvc exp show`` list, as ``{group: {experiment: value}}``.

    Groups: ``final`` / ``final_std`` (test accuracy as a fraction, mean over the last ``train.final_window``
    evaluations of each seed, then mean and std over seeds), ``best`` / ``best_std`` (highest test accuracy of
    any round), ``worst10`` (accuracy of the final model on the tenth of clients where it is lowest),
    ``rounds_to_target`` (first round at the target accuracy, mean over the seeds that reached it) and
    ``uplink_to_target`` (floats each client uploaded until then, in units of the model size d). Fractions and
    d rounded to 4 decimals. An experiment without a value (never reached the target, failed) is left out of
    that group, and a group no experiment has is left out, so no column is empty; the report's tables carry
    everything else (percentages, client accuracy, losses, the difference to FedAvg)."""
    out: Dict[str, Dict[str, float]] = {}
    for group, key in HEADLINE:
        vals = {e.name: round(v, 4) for e in exps if (v := _num((e.metrics or {}).get(key))) is not None}
        if vals:
            out[group] = vals
    up = {}
    for e in exps:
        m = e.metrics or {}
        floats, d = _num(m.get("up_floats_to_target_mean")), _num(m.get("model_d"))
        if floats is not None and d:
            up[e.name] = round(floats / d, 4)
    if up:
        out["uplink_to_target"] = up
    return out


def accuracy_table_csv(exps: List[Experiment]) -> str:
    """``test_acc.csv``: ``round`` and one column per experiment with its test accuracy as a fraction (mean
    over seeds) per round, for ``dvc plots show`` to overlay; empty where an experiment has no value."""
    curves = {e.name: e.curves for e in exps if e.curves is not None and len(e.curves["acc_round"])}
    rounds = sorted({int(r) for c in curves.values() for r in c["acc_round"]})
    values = {n: {int(r): float(a) for r, a in zip(c["acc_round"], c["acc_mean"])} for n, c in curves.items()}
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["round"] + list(curves))
    for r in rounds:
        w.writerow([r] + [f"{values[n][r]:.4g}" if r in values[n] else "" for n in curves])
    return buf.getvalue()


INF = "\u221e"


def _uplink_per_round(m: Dict) -> Optional[float]:
    up, rounds = _num(m.get("comm_up_floats")), _num(m.get("rounds"))
    return up / rounds if up is not None and rounds else None


def communication_layout(exps: List[Experiment]) -> List[str]:
    """FedBCGD's table layout (its Tables 2-6): final accuracy with the uplink floats per client to reach
    the target in brackets, e.g. ``55.70 ± 0.40 (77.0d)``, or ``(∞)`` when no seed reached it.

    Shown only when the experiments upload different amounts per round (otherwise "rounds to target"
    already says it)."""
    ups = {round(u, 3) for e in exps for u in [_uplink_per_round(e.metrics)] if u is not None}
    if len(ups) < 2:
        return []
    row_labels, col_labels, cells = comparison(exps)
    acc = accuracy_cells(row_labels, col_labels, cells)
    rows = []
    for r, line in zip(row_labels, acc):
        out = [line[0]]
        for c, text in zip(col_labels, line[1:]):
            e = cells.get((r, c))
            if e is None:
                out.append(text)
                continue
            floats = fmt_floats_d(e.metrics)
            out.append(f"{text} ({INF if floats == DASH else floats})")
        rows.append(out)
    target = _num(exps[0].metrics.get("target_acc")) if exps else None
    return ["## Accuracy and uplink to target (FedBCGD layout)", "",
            "Final test accuracy (%), mean \u00b1 std over seeds; in brackets the cumulative uplink floats per "
            "participating client, in units of the model size d, when the test accuracy first reached "
            + (f"{100 * target:g}%" if target is not None else "the target")
            + " (mean over the seeds that reached it; \u221e: no seed did).", "",
            _table(["algorithm"] + col_labels, rows, "l" + "r" * len(col_labels)), ""]


def split_fedbug(algorithm: str) -> Tuple[str, str]:
    """(row, column) of FedBug's paper layout: ``fedbug[P=0.2](feddyn[alpha=0.01])`` -> ("FedBug 20%", "FedDyn");
    a plain base -> ("Vanilla", its name). Ablation strategies keep their name in the row."""
    m = re.fullmatch(r"fedbug\[([^\]]*)\]\((.*)\)", str(algorithm or "").strip())
    inner = m.group(2) if m else str(algorithm or "")
    base = _algo_name(re.split(r"[\[(]", inner, maxsplit=1)[0])
    if not m:
        return "Vanilla", base
    parts = [p.strip() for p in m.group(1).split(",") if p.strip()]
    p_val = next((p[2:] for p in parts if p.startswith("P=")), None)
    others = [p for p in parts if not p.startswith("P=")]
    row = "FedBug" + (f" {', '.join(o.replace('_', '-') for o in others)}" if others else "")
    if p_val is not None:
        row += f" {100 * float(p_val):g}%"
    return row, base


def fedbug_layout(exps: List[Experiment]) -> List[str]:
    """FedBug's table layout (its Tables 1-4): one table per partition, rows Vanilla / FedBug P,
    columns the base algorithms; cells final accuracy mean +- std, the best per column in bold."""
    if not any(str(e.metrics.get("algorithm", "")).startswith("fedbug[") for e in exps):
        return []
    out = ["## FedBug layout", "",
           "As in the FedBug paper's tables: rows are the vanilla base and FedBug with GU percentage P, "
           "columns the base algorithms; final test accuracy (%), mean \u00b1 std over seeds, best per "
           "column in bold.", ""]
    parts: List[str] = []
    for e in exps:
        if e.col_label not in parts:
            parts.append(e.col_label)

    def row_key(r: str):
        if r == "Vanilla":
            return (0, 0.0, r)
        m = re.search(r"([\d.]+)%$", r)
        return (1 if not r.startswith("FedBug ") or m is None else 2, float(m.group(1)) if m else 0.0, r)

    for part in parts:
        cells: Dict[Tuple[str, str], Experiment] = {}
        rows: List[str] = []
        cols: List[str] = []
        for e in exps:
            if e.col_label != part:
                continue
            r, c = split_fedbug(e.metrics.get("algorithm", ""))
            cells[(r, c)] = e
            rows.append(r) if r not in rows else None
            cols.append(c) if c not in cols else None
        rows.sort(key=row_key)
        table = accuracy_cells(rows, cols, cells)
        out += [f"### {part}", "", _table([""] + cols, table, "l" + "r" * len(cols)), ""]
    return out


def _common_target(ms: List[Dict]) -> Optional[float]:
    """The target accuracy (fraction) when every experiment has the same one, else None."""
    target = _num(ms[0].get("target_acc")) if ms else None
    targets = {_num(m.get("target_acc")) for m in ms}
    return target if target is not None and len(targets) == 1 else None


def _header_lines(grid: Grid, exps_all: List[Experiment], exps: List[Experiment], params_name: str,
                  target: Optional[float]) -> List[str]:
    """The title and the one-paragraph description of the grid (seeds, dataset, model, rounds, target)."""
    ms = [e.metrics for e in exps]
    return ["# Federated learning results", "",
            f"Produced by `python -m pipeline.report` from `{params_name}`: {len(exps_all)} experiment(s) "
            f"({len(exps)} with results), seeds {', '.join(map(str, grid.seeds))} ({len(grid.seeds)} per experiment), "
            f"dataset {_join_values([m.get('dataset') for m in ms])}, "
            f"model {_join_values([m.get('model') for m in ms])}, "
            f"{_join_values([m.get('rounds') for m in ms])} rounds"
            + (f", target accuracy {100 * target:g}%" if target is not None else "")
            + f". *final* is {_final_window_text(ms)} of each seed.",
            ""]


def _experiments_section(exps: List[Experiment], target: Optional[float]) -> List[str]:
    """The "All experiments" table: one row per experiment with results, its numbers as mean ± std over seeds."""
    rows = []
    for e in exps:
        m = e.metrics
        rows.append([f"`{e.name}`", e.row_label, e.col_label,
                     "FAILED" if e.failed else fmt_pct(m.get("final_acc_mean"), m.get("final_acc_std")),
                     fmt_pct(m.get("best_acc_mean"), m.get("best_acc_std")),
                     fmt_pct(m.get("final_client_acc_mean_mean"), m.get("final_client_acc_mean_std")),
                     fmt_pct(m.get("final_client_acc_worst10_mean"), m.get("final_client_acc_worst10_std")),
                     fmt_rounds(m),
                     fmt_plain(m.get("final_train_loss_mean"), m.get("final_train_loss_std")),
                     fmt_floats_d(m)])
    tgt = f" ({100 * target:g}%)" if target is not None else ""
    return ["## All experiments", "",
            _table(["experiment", "algorithm", "partition", "final acc (%)", "best acc (%)",
                    "client acc (%)", "worst 10% clients (%)",
                    f"rounds to target{tgt}", "final train loss", "uplink to target (d)"],
                   rows, "lllrrrrrrr"),
            ""]


def _comparison_section(exps: List[Experiment]) -> List[str]:
    """The "Comparison" table: algorithm x partition, final accuracy, the best per column in bold."""
    row_labels, col_labels, cells = comparison(exps)
    rows = accuracy_cells(row_labels, col_labels, cells)
    window = _final_window_text([e.metrics for e in exps])
    return ["## Comparison", "", f"Final test accuracy (%, {window}), mean \u00b1 std over seeds; the best per "
            "column is in bold.", "",
            _table(["algorithm"] + col_labels, rows, "l" + "r" * len(col_labels)),
            ""]


def _curves_section(curves_name: str) -> List[str]:
    """The "Curves" section: the two figures (PNG, relative to the report: per round, and against the uplink in
    ``uplink.png`` beside it) and links to their PDFs."""
    pdf_name = str(Path(curves_name).with_suffix(".pdf").as_posix())
    up_name = str(Path(curves_name).with_name(UPLINK_FIGURE).as_posix())
    up_pdf = str(Path(up_name).with_suffix(".pdf").as_posix())
    return ["## Curves", "", f"![Test accuracy and training loss per round]({curves_name})", "",
            "Test accuracy against the floats each participating client has uploaded (cumulative, in units of "
            "the model size d): methods that send less per round move left.", "",
            f"![Test accuracy against uplink per client]({up_name})", "",
            f"The same figures as PDF, for a draft: [{pdf_name}]({pdf_name}), [{up_pdf}]({up_pdf}).", ""]


def _final_window_text(ms: List[Dict]) -> str:
    """When *final acc* is taken, from the experiments' ``final_window`` (evaluations averaged)."""
    windows = {int(w) for w in (_num(m.get("final_window")) for m in ms) if w is not None}
    if len(windows) > 1:
        return "the mean over each experiment's last `train.final_window` evaluations"
    if windows and windows != {1}:
        return f"the mean over the last {next(iter(windows))} evaluations"
    return "after the last round"


def _how_to_read_section(ms: List[Dict], target: Optional[float]) -> List[str]:
    """The "How to read" notes: what each column of the tables and the curves show."""
    window = _final_window_text(ms)
    return ["## How to read", "",
            f"- *final acc*: test accuracy of the global model, {window}; *best acc*: the "
            "highest test accuracy over all rounds. Both in %, as mean \u00b1 std over seeds "
            "(std is the sample standard deviation, ddof = 1; 0 for a single seed).",
            "- *rounds to target*: the first round whose test accuracy is >= the target accuracy"
            + (f" ({100 * target:g}%)" if target is not None else "")
            + "; mean \u00b1 std over the seeds that reached it, with how many did "
            f"(k/n seeds); {DASH} if none did.",
            "- *client acc*: accuracy of the final global model on each client's own label distribution "
            "(the test set reweighted by the client's label histogram), mean over all clients; *worst 10% "
            "clients*: the mean over the tenth of clients where it is lowest. Both mean \u00b1 std over seeds.",
            "- *final train loss*: mean training loss of the participating clients in the last round.",
            "- *uplink to target*: floats each participating client has uploaded (cumulative, mean over the "
            "seeds that reached the target) when the target is first reached, in units of the model size d "
            "(FedAvg: 1d per round; FedBCGD about d/N; QSGD/Top-k as float equivalents).",
            "- Curves: mean over seeds; the shaded band spans the minimum and maximum over seeds.",
            "- `summary.csv` holds the numbers of the first table as plain fractions.",
            ""]


def _problem_sections(exps: List[Experiment], missing: List[Experiment]) -> List[str]:
    """The "Failed", "Notes" and "Missing" sections: experiments whose every seed failed, that lost seeds, or
    that have no results; each section only when it has entries."""
    out: List[str] = []
    failed = [e for e in exps if e.failed]
    if failed:
        out += ["## Failed", "", "Experiments whose every seed failed (the reason as the run recorded it):", ""]
        out += [f"- `{e.name}`: FAILED: {_cell(e.failed)}" for e in failed]
        out.append("")
    noted = [e for e in exps if e.notes]
    if noted:
        out += ["## Notes", ""]
        out += [f"- `{e.name}`: {'; '.join(e.notes)}" for e in noted]
        out.append("")
    if missing:
        out += ["## Missing", "", "Experiments of the grid without results (run `dvc repro`):", ""]
        out += [f"- `{e.name}`: {e.problem}" for e in missing]
        out.append("")
    return out


def build_report(grid: Grid, results_dir: Path, experiments: Optional[List[Experiment]] = None,
                 params_name: str = "params.yaml", curves_name: str = "curves.png",
                 claims: Optional[Sequence] = None, claims_name: str = "claims.yaml") -> str:
    """The markdown report of ``grid``'s experiments under ``results_dir``; with ``claims`` it ends with the
    "Claims" table (:func:`pipeline.claims.claims_section`).

    Args:
        grid: the experiment grid (its order is the order of the tables).
        results_dir: folder holding ``<name>/metrics.json``.
        experiments: already loaded experiments (from :func:`load_experiments`); loaded if None.
        params_name: how the grid file is named in the text.
        curves_name: the figure's path relative to the report (its PDF has the same stem).
        claims: the study's claims (:func:`pipeline.claims.load_claims`), measured on these experiments.
        claims_name: how the claims file is named in the text.
    """
    exps_all = experiments if experiments is not None else load_experiments(grid, Path(results_dir))
    exps = [e for e in exps_all if e.metrics is not None]
    missing = [e for e in exps_all if e.metrics is None]
    ms = [e.metrics for e in exps]
    target = _common_target(ms)

    out = _header_lines(grid, exps_all, exps, params_name, target)
    out += _experiments_section(exps, target)
    out += _comparison_section(exps)
    out += differences_section(exps)
    out += fedbug_layout(exps)
    out += communication_layout(exps)
    out += _curves_section(curves_name)
    out += _how_to_read_section(ms, target)
    out += _problem_sections(exps, missing)
    if claims:
        from .claims import claims_section, evaluate  # claims builds on this module's paired differences

        out += claims_section(evaluate(claims, exps_all, Path(results_dir)), claims_name)
    return "\n".join(out)


def summary_csv(exps: List[Experiment]) -> str:
    """``summary.csv``: one row per experiment with results, numbers as plain fractions."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=SUMMARY_COLUMNS, lineterminator="\n")
    w.writeheader()
    for e in exps:
        if e.metrics is None:
            continue
        m = e.metrics
        row = {k: m.get(k) for k in SUMMARY_COLUMNS}
        row.update(experiment=e.name, algorithm_label=e.row_label, partition_label=e.col_label,
                   n_seeds=len(m.get("seeds") or []),
                   failed_seeds=" ".join(map(str, m.get("failed_seeds") or [])))
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def plot_curves(exps: List[Experiment], path: Path) -> List[Path]:
    """The curves figure (:func:`pipeline.figures.comparison_figure`) as ``path`` (PNG) and a PDF beside
    it with the same stem: per partition column, test accuracy in % (mean, min-max band over seeds)
    above training loss (mean), one line per algorithm, one legend. Returns the written paths."""
    from .figures import comparison_figure  # figures imports this module's labels

    exps = [e for e in exps if e.metrics is not None]
    return comparison_figure([(e.row_label, e.col_label, e.curves) for e in exps], path)


def plot_uplink(exps: List[Experiment], path: Path) -> List[Path]:
    """The accuracy-vs-uplink figure (:func:`pipeline.figures.uplink_figure`) as ``path`` (PNG) and a PDF beside
    it: per partition column, test accuracy in % (mean over seeds) against each client's cumulative uplink in
    units of d, one line per algorithm. Returns the written paths."""
    from .figures import uplink_figure  # figures imports this module's labels

    exps = [e for e in exps if e.metrics is not None]
    return uplink_figure([(e.row_label, e.col_label, e.curves) for e in exps], path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Summarize the experiments of the grid: writes report.md, curves.png/.pdf, uplink.png/.pdf, "
                    "summary.csv, "
                    "test_acc.csv (accuracy per round, one column per experiment) and metrics.json (final "
                    "accuracy per experiment, for dvc metrics show) in the folder of --out, from "
                    "<results>/<name>/metrics.json, experiment.json and runs.csv.",
        epilog="Exit status: 0 when at least one experiment has results, 2 when none has (or the grid or the "
               "claims file cannot be read), 3 when the report's folder is not writable or the disk is full (one "
               "line; --debug or FL_DEBUG=1: the traceback). Experiments without results are listed under "
               "'Missing'.")
    p.add_argument("--params", type=Path, default=Path("params.yaml"), metavar="FILE",
                   help="the experiment grid (default: params.yaml)")
    p.add_argument("--results", type=Path, default=Path("results"), metavar="DIR",
                   help="folder with one sub-folder per experiment (default: results)")
    p.add_argument("--claims", type=Path, default=None, metavar="FILE",
                   help="the study's paper claims, whose verdicts end the report (default: claims.yaml beside "
                        "--params, when it exists; docs/claims.md)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="the markdown report; curves.png/.pdf, uplink.png/.pdf, summary.csv, test_acc.csv and "
                        "metrics.json "
                        "go beside it "
                        "(default: <results>/report.md)")
    p.add_argument("--debug", action="store_true",
                   help="an environment failure (a folder not writable, a full disk) shows its traceback instead of "
                        "one line (also FL_DEBUG=1)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status (an environment failure: one line and 3,
    :func:`fl_core.envfail.run_cli`)."""
    from fl_core import envfail

    return envfail.run_cli(_main, argv)


def _main(argv: List[str]) -> int:
    from fl_core import envfail

    from .claims import default_claims_path, load_claims  # claims builds on this module

    args = _parser().parse_args(argv)
    out = args.out if args.out is not None else args.results / "report.md"
    try:
        grid = load_grid(args.params)
        claims_path = args.claims
        if claims_path is None and default_claims_path(args.params).exists():
            claims_path = default_claims_path(args.params)
        claims = load_claims(claims_path, list(grid.experiments)) if claims_path is not None else None
    except (ConfigError, yaml.YAMLError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    exps = load_experiments(grid, args.results)
    done = [e for e in exps if e.metrics is not None]
    if not done:
        print(f"error: no results found under {args.results.as_posix().rstrip('/')}/ (run dvc repro)",
              file=sys.stderr)
        return 2
    envfail.check_folder(out.parent, "report folder", "--out")  # before any figure is drawn
    curves = out.parent / "curves.png"
    plot_curves(done, curves)
    plot_uplink(done, out.parent / UPLINK_FIGURE)
    write_text(out.parent / "summary.csv", summary_csv(done))
    write_text(out.parent / "test_acc.csv", accuracy_table_csv(done))
    write_text(out.parent / "metrics.json", json.dumps(root_metrics(done), indent=2) + "\n")
    write_text(out, build_report(grid, args.results, exps, params_name=args.params.name,
                                  curves_name=curves.name, claims=claims,
                                  claims_name=claims_path.name if claims_path is not None else "claims.yaml"))
    missing = len(exps) - len(done)
    print(f"report: {out} ({len(done)} experiment(s)" + (f", {missing} missing" if missing else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
