"""FedBug's table layout (Kao et al., Tables 1-4), this study's section of its report (``report.layouts`` in
``params.yaml``; :func:`pipeline.report.load_layouts`).

One table per partition: rows the vanilla bases ("Vanilla") and FedBug with its GU percentage P ("FedBug 20%"; an
ablation's other settings keep their name: "FedBug top-down 20%"), columns the base rules; cells the final accuracy,
mean +- std over seeds, the best per column in bold. Rows and columns come from each run's stored rule stack
(``stack`` in ``experiment.json``): the wrapper's shown P and the wrapped rule's label.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from pipeline.labels import markdown_table
from pipeline.report import accuracy_cells
from pipeline.results import Experiment

WRAPPER = "fedbug"  # the rule whose rows this layout shows
VANILLA = "Vanilla"


def _level_label(level: Dict) -> str:
    return str(level.get("label") or level.get("name") or "?")


def split(stack: Dict) -> Tuple[str, str, Optional[float]]:
    """(row, column, P) of one run's stack: FedBug P = 0.1 over FedDyn -> ("FedBug 10%", "FedDyn", 0.1); a rule
    without FedBug -> ("Vanilla", its label, None)."""
    inner = stack.get("inner")
    if stack.get("name") != WRAPPER or not isinstance(inner, dict):
        return VANILLA, _level_label(stack), None
    shown = [(str(k), str(v)) for k, v in stack.get("shown") or []]
    p = next((float(v) for k, v in shown if k == "P"), None)
    others = [(f"{k}={v}" if k else v).replace("_", "-") for k, v in shown if k != "P"]
    row = _level_label(stack) + (f" {', '.join(others)}" if others else "")
    if p is not None:
        row += f" {100 * p:g}%"
    return row, _level_label(inner), p


def layout(experiments: List[Experiment]) -> List[str]:
    """The "FedBug layout" section: nothing when no experiment runs FedBug."""
    stacks = {e.name: (e.metrics or {}).get("stack") for e in experiments}
    if not any(isinstance(s, dict) and s.get("name") == WRAPPER for s in stacks.values()):
        return []
    out = ["## FedBug layout", "",
           "As in the FedBug paper's tables: rows are the vanilla base and FedBug with GU percentage P, "
           "columns the base algorithms; final test accuracy (%), mean \u00b1 std over seeds, best per "
           "column in bold.", ""]
    unstructured = [e.name for e in experiments if not isinstance(stacks[e.name], dict)]
    parts: List[str] = []
    for e in experiments:
        if e.col_label not in parts:
            parts.append(e.col_label)
    for part in parts:
        cells: Dict[Tuple[str, str], Experiment] = {}
        order: Dict[str, Tuple[int, float, str]] = {}
        cols: List[str] = []
        for e in experiments:
            if e.col_label != part or not isinstance(stacks[e.name], dict):
                continue
            r, c, p = split(stacks[e.name])
            cells[(r, c)] = e
            # Vanilla first, then FedBug rows without P, then by P
            order.setdefault(r, (0, 0.0, r) if r == VANILLA else (1, 0.0, r) if p is None else (2, p, r))
            if c not in cols:
                cols.append(c)
        if not cells:
            continue
        rows = sorted(order, key=order.get)
        out += [f"### {part}", "", markdown_table([""] + cols, accuracy_cells(rows, cols, cells),
                                                  "l" + "r" * len(cols)), ""]
    if unstructured:
        out += ["Not in these tables (their results were written before runs stored their rule stack; train them "
                "again): " + ", ".join(f"`{n}`" for n in unstructured) + ".", ""]
    return out
