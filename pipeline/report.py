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
* ``drift.png`` and ``drift.pdf``: the same columns, the update dissimilarity and the clients' cosine to their mean
  update per round (docs/algorithms.md, Drift measures);
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
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from fl_core.store import owned
from fl_core.algorithms import registry
from fl_core.config import ConfigError

from .files import write_text
from .grid import Grid, load_grid
from .labels import DASH, _cell, _num, algorithm_label, markdown_table
from .results import Experiment, confidence_interval, load_experiments, paired_difference

UPLINK_FIGURE = "uplink.png"  # beside the curves figure
DRIFT_FIGURE = "drift.png"  # beside the curves figure
#: what the report writes beside its markdown file (a folder holding other files is not the report's to write into)
REPORT_FILES = ("summary.csv", "test_acc.csv", "metrics.json", "curves.png", "curves.pdf", UPLINK_FIGURE, "uplink.pdf",
                DRIFT_FIGURE, "drift.pdf")
# a study's own files beside its report, which the report leaves as they are: the findings written by hand
# (findings.md, findings_*.csv) and the fingerprint of its rows' first rounds (pipeline.fingerprint)
STUDY_NOTES = ("findings.md", "findings_*.csv", "fingerprint.json")
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


# --------------------------------------------------------------------------- formatting

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


def _join_values(values: Sequence) -> str:
    vals = []
    for v in values:
        if v is not None and v not in vals:
            vals.append(v)
    return ", ".join(str(v) for v in vals) if vals else "?"


# --------------------------------------------------------------------------- report

def best_cells(rows: List[str], cols: List[str], cells: Dict[Tuple[str, str], Experiment],
               value: Callable[[Experiment], Optional[float]], text: Callable[[Experiment], str],
               best: Callable[[List[float]], float] = max) -> List[List[str]]:
    """Table rows: the row label, then ``text(e)`` of each column's experiment (the dash for an empty cell, FAILED for
    an experiment whose every seed failed); in bold where ``value(e)`` (the number as shown, None for none) is the
    ``best`` of its column (ties all bold; no bold in a column with fewer than two values)."""
    top: Dict[str, Optional[float]] = {}
    for c in cols:
        vals = [v for r in rows if (r, c) in cells for v in [value(cells[(r, c)])] if v is not None]
        top[c] = best(vals) if len(vals) >= 2 else None
    table = []
    for r in rows:
        line = [r]
        for c in cols:
            e = cells.get((r, c))
            if e is None:
                line.append(DASH)
                continue
            shown = "FAILED" if e.failed else text(e)
            v = value(e)
            line.append(f"**{shown}**" if v is not None and top[c] is not None and v == top[c] else shown)
        table.append(line)
    return table


def accuracy_cells(rows: List[str], cols: List[str], cells: Dict[Tuple[str, str], Experiment]) -> List[List[str]]:
    """Table rows: the row label, then final accuracy mean +- std per column; the best per column in
    bold (compared at the shown precision, ties all bold; no bold in a column with one value)."""
    def value(e: Experiment) -> Optional[float]:
        v = _num(e.metrics.get("final_acc_mean"))
        return None if v is None else round(100 * v, 2)

    return best_cells(rows, cols, cells, value,
                      lambda e: fmt_pct(e.metrics.get("final_acc_mean"), e.metrics.get("final_acc_std")))


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


EXACT = 1e-12  # a final distance to x* below this is float64 rounding (a rule that reaches x* ends near 1e-15)


def objective_mode(exps: List[Experiment]) -> bool:
    """Whether the grid is a problem with a known optimum and no accuracy to report: every experiment with results
    (but those whose every seed failed) logged the distance to the optimum (``opt_distance``: the quadratic and
    convex problems' ``objective_metrics``) and none reached a test accuracy above 0 (the quadratic problem's model
    predicts no label: its accuracy is 0 in every round). The report then shows the distance to x* and the
    objective gap where it shows accuracy otherwise, and leaves the accuracy tables out."""
    live = [e for e in exps if not e.failed]
    return bool(live) and all("opt_distance" in e.objective for e in live) and not any(
        (_num(e.metrics.get("best_acc_mean")) or 0) > 0 for e in exps)


def fmt_objective(value: Optional[Tuple[float, float]]) -> str:
    """``mean ± std`` of a final distance or gap (4 and 2 significant digits), or the dash."""
    return DASH if value is None else f"{value[0]:.4g} {PM} {value[1]:.2g}"


def _objective_experiments_section(exps: List[Experiment]) -> List[str]:
    """The "All experiments" table of a problem with a known optimum (:func:`objective_mode`)."""
    rows = []
    for e in exps:
        m = e.metrics
        up, d = _num(m.get("comm_up_floats")), _num(m.get("model_d"))
        rows.append([f"`{e.name}`", e.row_label, e.col_label,
                     "FAILED" if e.failed else fmt_objective(e.objective.get("opt_distance")),
                     fmt_objective(e.objective.get("objective_gap")),
                     fmt_plain(m.get("final_train_loss_mean"), m.get("final_train_loss_std")),
                     fmt_plain(m.get("final_test_loss_mean"), m.get("final_test_loss_std")),
                     f"{up / d:g}d" if up is not None and d else DASH])
    return ["## All experiments", "",
            markdown_table(["experiment", "algorithm", "partition", "final distance to x*", "final F(x) - F(x*)",
                            "final train loss", "final test loss", "uplink per client (d)"], rows, "lllrrrrr"),
            ""]


def _objective_comparison_section(exps: List[Experiment]) -> List[str]:
    """The "Comparison" table of a problem with a known optimum: algorithm x partition, the final distance to x*,
    the lowest per column in bold (compared at the shown precision, a distance below :data:`EXACT` as 0; no bold in
    a column with one value)."""
    row_labels, col_labels, cells = comparison(exps)

    def shown(e: Experiment) -> Optional[float]:
        v = e.objective.get("opt_distance")
        # below EXACT the distance is float64 rounding: every such rule reached x* and all are bold
        return None if v is None or e.failed else (0.0 if abs(v[0]) < EXACT else float(f"{v[0]:.4g}"))

    rows = best_cells(row_labels, col_labels, cells, shown,
                      lambda e: fmt_objective(e.objective.get("opt_distance")), min)
    return ["## Comparison", "", f"Final distance to the optimum ||x - x*|| after the last round, mean {PM} std over "
            f"seeds; the lowest per column is in bold (distances below {EXACT:g} count as 0: float64 rounding).", "",
            markdown_table(["algorithm"] + col_labels, rows, "l" + "r" * len(col_labels)),
            ""]


def _objective_how_to_read_section() -> List[str]:
    """The "How to read" notes of a problem with a known optimum."""
    return ["## How to read", "",
            "- *final distance to x\\**: ||x - x\\*||, the Euclidean distance of the global model after the last "
            "round to the minimiser x\\* of the global objective F (the problem's `opt_distance`, docs/algorithms.md); "
            "*final F(x) - F(x\\*)*: the objective gap there (`objective_gap`). Both mean \u00b1 std over seeds "
            "(std is the sample standard deviation, ddof = 1; 0 for a single seed).",
            "- *final train loss*: mean training loss of the participating clients in the last round (along their "
            "local steps, so not F at the global model); *final test loss*: the global model's loss on the test set.",
            "- *uplink per client*: floats each participating client uploaded over all rounds, in units of the model "
            "size d (a rule that also uploads a control variate counts it).",
            "- This model predicts no label: its test accuracy is 0 in every round, so the accuracy, "
            f"rounds-to-target and difference-to-{reference_label()} tables are left out (`summary.csv` keeps every "
            "column).",
            "- Curves: the upper panels draw the distance to x\\* per round (log scale), the mean over seeds with a "
            "band from the minimum to the maximum over seeds.",
            ""]


def objective_curves(exps: List[Experiment]) -> List[Experiment]:
    """The experiments with their distance-to-optimum curves in place of the accuracy arrays (``acc_round``,
    ``acc_mean``, ``acc_min``, ``acc_max``; the uplink at each of those rounds in ``acc_up_d``), for the figures
    of :func:`objective_mode`; the experiments themselves are left as they are."""
    import dataclasses

    import numpy as np

    out = []
    for e in exps:
        c = e.curves
        if c is None or not len(c.get("opt_distance_round", ())):
            out.append(dataclasses.replace(e, curves=None))
            continue
        rounds = c["opt_distance_round"]
        up = np.full(len(rounds), np.nan)
        if len(c.get("acc_round", ())) and "acc_up_d" in c:
            at = dict(zip(c["acc_round"].tolist(), c["acc_up_d"].tolist()))
            up = np.array([at.get(r, np.nan) for r in rounds.tolist()], dtype=float)
        out.append(dataclasses.replace(e, curves={
            **c, "acc_round": rounds, "acc_mean": c["opt_distance_mean"], "acc_min": c["opt_distance_min"],
            "acc_max": c["opt_distance_max"], "acc_up_d": up}))
    return out


def reference_label() -> str:
    """The row label of the rule every method is compared with (the registry's reference base: FedAvg)."""
    return algorithm_label(registry.REFERENCE_BASE)


def reference_experiments(exps: List[Experiment]) -> Dict[str, Experiment]:
    """{partition column: the plain reference experiment of that column (FedAvg, :func:`reference_label`)}, where
    exactly one exists."""
    ref = reference_label()
    found: Dict[str, List[Experiment]] = {}
    for e in exps:
        if not e.failed and e.row_label == ref:
            found.setdefault(e.col_label, []).append(e)
    return {c: es[0] for c, es in found.items() if len(es) == 1}


def differences(exps: List[Experiment]) -> Dict[str, Dict[str, float]]:
    """{experiment name: :func:`paired_difference` to the reference (FedAvg) experiment of its partition column}."""
    refs = reference_experiments(exps)
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
    ref = reference_label()
    out = [f"## Difference to {ref}", "",
           f"Final test accuracy minus {ref}'s on the same partition and the same seeds, in percentage points: "
           f"mean {PM} std over the paired seeds, and the 95% confidence interval of the mean difference "
           "(Student t over the seeds); * marks an interval that excludes 0.", ""]
    out.append(markdown_table(["algorithm", "partition", f"vs {ref} (pp)", "seeds", "95% CI (pp)"], rows, "llrrl"))
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
    """Accuracy and communication in one table (the layout of FedBCGD's Tables 2-6): final accuracy with the
    uplink floats per client to reach the target in brackets, e.g. ``55.70 ± 0.40 (77.0d)``, or ``(∞)`` when no
    seed reached it.

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
    target = _common_target([e.metrics for e in exps])
    return ["## Accuracy and uplink to target", "",
            "Final test accuracy (%), mean \u00b1 std over seeds; in brackets the cumulative uplink floats per "
            "participating client, in units of the model size d, when the test accuracy first reached "
            + (f"{100 * target:g}%" if target is not None
               else "the experiment's target accuracy (`train.target_acc`, which differs between the experiments here)")
            + " (mean over the seeds that reached it; \u221e: no seed did).", "",
            markdown_table(["algorithm"] + col_labels, rows, "l" + "r" * len(col_labels)), ""]


_LAYOUTS: Dict[Path, Callable[[List[Experiment]], List[str]]] = {}


def load_layouts(paths: Sequence[Path]) -> List[Callable[[List[Experiment]], List[str]]]:
    """The ``layout(experiments) -> markdown lines`` function of each of a study's layout files (``report.layouts``
    of its params file, :attr:`pipeline.grid.Grid.layouts`), loaded once per file.

    A layout gets the experiments with results (:class:`pipeline.results.Experiment`: ``row_label``, ``col_label``,
    ``metrics`` with the run's ``stack``) and returns its section's lines (nothing when it has nothing to show);
    it builds on :func:`comparison`, :func:`accuracy_cells`, :func:`pipeline.labels.markdown_table` and
    :func:`pipeline.labels.stack_label`.

    Raises:
        ConfigError: a file that cannot be loaded or has no function ``layout`` (one line naming the file).
    """
    import importlib.util

    out = []
    for given in paths:
        path = Path(given)
        if path not in _LAYOUTS:
            try:
                spec = importlib.util.spec_from_file_location(f"_study_layout_{len(_LAYOUTS)}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except Exception as err:  # noqa: BLE001  (a study's file: any failure is one line naming it)
                raise ConfigError(f"{path}: cannot load the report layout ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())})") from None
            fn = getattr(module, "layout", None)
            if not callable(fn):
                raise ConfigError(f"{path}: a report layout must define layout(experiments) -> list of markdown lines")
            _LAYOUTS[path] = fn
        out.append(_LAYOUTS[path])
    return out


def _common_target(ms: List[Dict]) -> Optional[float]:
    """The target accuracy (fraction) when every experiment has the same one, else None."""
    target = _num(ms[0].get("target_acc")) if ms else None
    targets = {_num(m.get("target_acc")) for m in ms}
    return target if target is not None and len(targets) == 1 else None


def _header_lines(grid: Grid, exps_all: List[Experiment], exps: List[Experiment], params_name: str,
                  target: Optional[float], objective: bool = False) -> List[str]:
    """The title and the one-paragraph description of the grid (seeds, dataset, model, rounds, target)."""
    ms = [e.metrics for e in exps]
    return ["# Federated learning results", "",
            f"Produced by `python -m pipeline.report` from `{params_name}`: {len(exps_all)} experiment(s) "
            f"({len(exps)} with results), seeds {', '.join(map(str, grid.seeds))} ({len(grid.seeds)} per experiment), "
            f"dataset {_join_values([m.get('dataset') for m in ms])}, "
            f"model {_join_values([m.get('model') for m in ms])}, "
            f"{_join_values([m.get('rounds') for m in ms])} rounds"
            + (f", target accuracy {100 * target:g}%" if target is not None else "")
            + (". *final* is the value after the last round of each seed." if objective
               else f". *final* is {_final_window_text(ms)} of each seed."),
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
            markdown_table(["experiment", "algorithm", "partition", "final acc (%)", "best acc (%)",
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
            markdown_table(["algorithm"] + col_labels, rows, "l" + "r" * len(col_labels)),
            ""]


def _curves_section(curves_name: str, objective: bool = False) -> List[str]:
    """The "Curves" section: the three figures (PNG, relative to the report: per round, against the uplink in
    ``uplink.png`` beside it, the drift measures in ``drift.png``) and links to their PDFs."""
    pdf_name = str(Path(curves_name).with_suffix(".pdf").as_posix())
    up_name = str(Path(curves_name).with_name(UPLINK_FIGURE).as_posix())
    up_pdf = str(Path(up_name).with_suffix(".pdf").as_posix())
    drift_name = str(Path(curves_name).with_name(DRIFT_FIGURE).as_posix())
    drift_pdf = str(Path(drift_name).with_suffix(".pdf").as_posix())
    top = "Distance to the optimum" if objective else "Test accuracy"
    return ["## Curves", "", f"![{top} and training loss per round]({curves_name})", "",
            f"{top} against the floats each participating client has uploaded (cumulative, in units of "
            "the model size d): methods that send less per round move left.", "",
            f"![{top} against uplink per client]({up_name})", "",
            "Client drift per round (docs/algorithms.md, Drift measures): how much the clients' updates disagree "
            "(update dissimilarity, log scale; 0 when all send the same update) and their mean cosine to the update "
            "the server applies.", "",
            f"![Update dissimilarity and cosine to the mean update per round]({drift_name})", "",
            f"The same figures as PDF, for a draft: [{pdf_name}]({pdf_name}), [{up_pdf}]({up_pdf}), "
            f"[{drift_pdf}]({drift_pdf}).", ""]


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
            "(a client that uploads its whole model once per round: 1d per round; a rule that uploads part of "
            "the model or a compressed update counts what it sends as float equivalents).",
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

    objective = objective_mode(exps)
    out = _header_lines(grid, exps_all, exps, params_name, None if objective else target, objective)
    if objective:
        out += _objective_experiments_section(exps)
        out += _objective_comparison_section(exps)
    else:
        out += _experiments_section(exps, target)
        out += _comparison_section(exps)
        out += differences_section(exps)
    for layout in load_layouts(grid.layouts):  # the study's own tables (report.layouts of its params file)
        out += list(layout(exps))
    if not objective:
        out += communication_layout(exps)
    out += _curves_section(curves_name, objective)
    out += _objective_how_to_read_section() if objective else _how_to_read_section(ms, target)
    out += _problem_sections(exps, missing)
    if claims:
        from .claims import claims_section, evaluate

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


def plot_curves(exps: List[Experiment], path: Path, objective: bool = False) -> List[Path]:
    """The curves figure (:func:`pipeline.figures.comparison_figure`) as ``path`` (PNG) and a PDF beside
    it with the same stem: per partition column, test accuracy in % (mean, min-max band over seeds)
    above training loss (mean), one line per algorithm, one legend; with ``objective`` (:func:`objective_mode`)
    the distance to the optimum (log scale) in place of the accuracy. Returns the written paths."""
    from .figures import ACCURACY, OPT_DISTANCE, comparison_figure  # matplotlib: loaded when a figure is drawn

    exps = [e for e in exps if e.metrics is not None]
    exps = objective_curves(exps) if objective else exps
    return comparison_figure([(e.row_label, e.col_label, e.curves) for e in exps], path,
                             measure=OPT_DISTANCE if objective else ACCURACY)


def plot_uplink(exps: List[Experiment], path: Path, objective: bool = False) -> List[Path]:
    """The accuracy-vs-uplink figure (:func:`pipeline.figures.uplink_figure`) as ``path`` (PNG) and a PDF beside
    it: per partition column, test accuracy in % (mean over seeds) against each client's cumulative uplink in
    units of d, one line per algorithm; with ``objective`` the distance to the optimum. Returns the written
    paths."""
    from .figures import ACCURACY, OPT_DISTANCE, uplink_figure

    exps = [e for e in exps if e.metrics is not None]
    exps = objective_curves(exps) if objective else exps
    return uplink_figure([(e.row_label, e.col_label, e.curves) for e in exps], path,
                         measure=OPT_DISTANCE if objective else ACCURACY)


def plot_drift(exps: List[Experiment], path: Path) -> List[Path]:
    """The drift figure (:func:`pipeline.figures.drift_figure`) as ``path`` (PNG) and a PDF beside it: per partition
    column, the update dissimilarity (log scale) and the clients' cosine to their mean update per round (means over
    seeds; docs/algorithms.md, Drift measures), one line per algorithm. Returns the written paths."""
    from .figures import drift_figure

    exps = [e for e in exps if e.metrics is not None]
    return drift_figure([(e.row_label, e.col_label, e.curves) for e in exps], path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Summarize the experiments of the grid: writes report.md, curves.png/.pdf, uplink.png/.pdf, "
                    "drift.png/.pdf, "
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
                   help="the markdown report; curves.png/.pdf, uplink.png/.pdf, drift.png/.pdf, summary.csv, test_acc.csv and "
                        "metrics.json "
                        "go beside it "
                        "(default: <results>/report.md)")
    p.add_argument("--debug", action="store_true",
                   help="an environment failure (a folder not writable, a full disk) shows its traceback instead of "
                        "one line (also FL_DEBUG=1)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status (an environment failure: one line and 3,
    :func:`fl_core.store.envfail.run_cli`)."""
    from fl_core.store import envfail

    return envfail.run_cli(_main, argv)


def _main(argv: List[str]) -> int:
    from fl_core.store import envfail

    from .claims import default_claims_path, load_claims

    args = _parser().parse_args(argv)
    out = args.out if args.out is not None else args.results / "report.md"
    try:
        grid = load_grid(args.params)
        claims_path = args.claims
        if claims_path is None and default_claims_path(args.params).exists():
            claims_path = default_claims_path(args.params)
        claims = load_claims(claims_path, list(grid.experiments)) if claims_path is not None else None
        load_layouts(grid.layouts)
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
    try:  # the report's files go beside the experiments' folders (which it leaves as they are), nowhere foreign
        owned.check(out.parent, owned.with_temporaries([out.name, *REPORT_FILES]) + [*STUDY_NOTES, "*/*"],
                    "report folder", "choose another --out")
    except owned.ForeignFolder as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    curves = out.parent / "curves.png"
    objective = objective_mode(done)
    plot_curves(done, curves, objective)
    plot_uplink(done, out.parent / UPLINK_FIGURE, objective)
    plot_drift(done, out.parent / DRIFT_FIGURE)
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
