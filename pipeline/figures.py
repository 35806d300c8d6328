"""Figures a researcher can paste into a draft: the grid's comparison, one experiment's curves, FedBug's schedule.

Every figure is drawn on its own :class:`matplotlib.figure.Figure` with an Agg canvas (no pyplot, so
no global state and no GUI backend) and written twice, as PNG and as PDF with the same stem, each
atomically (:func:`pipeline.files.atomic_write`). The PDF embeds TrueType fonts (``pdf.fonttype``
42, as publishers ask) and carries no creation date, so rerunning a stage on the same inputs gives
the same files.

Each figure has a builder that returns the Figure before saving (``build_*``, for inspection and
tests) and a writer that builds, saves both formats and returns the written paths:

* :func:`comparison_figure` (``results/curves.png`` of the report): one column per partition, test
  accuracy (%) on top and training loss below, one line per method with a min-max band over seeds;
  the accuracy panels share one y-axis, the loss panels another; one legend below the panels.
* :func:`uplink_figure` (``results/uplink.png``): the same panels, test accuracy (%) against each client's
  cumulative uplink in units of d, one line per method.
* :func:`drift_figure` (``results/drift.png``): the same columns, the update dissimilarity (log scale) on top and
  the clients' cosine to their mean update below, per round, one line per method (``tracking.drift``).
* :func:`experiment_figure`: a drop-in for the train stage's per-experiment ``plot_curves(histories,
  title, path)``: test accuracy (%), test loss and training loss per round, one thin line per seed
  and their mean in bold.
* :func:`schedule_figure`: FedBug's trainable units m(k) per local step k, one step line per K_i.

:func:`method_styles` gives each method a (colour, line style, marker) triple that is distinct for
every method of a list and depends only on the method's position in it, so a method keeps its look
from one figure of a grid to the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from .files import atomic_write
from .labels import _num, _parse_partition, algorithm_label, dataset_label, partition_label

# tab10: a qualitative palette whose colours stay apart in print and for the common colour-vision deficiencies
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h")  # 11: coprime with the 10 colours
MARK_STEP = 0.1  # markers every 10% of the line's on-screen length (matplotlib's float markevery)

DPI = 150
SAVE_RC = {"pdf.fonttype": 42, "ps.fonttype": 42}
PDF_METADATA = {"CreationDate": None}  # reproducible PDFs

ACC_LABEL = "test accuracy (%)"


@dataclass(frozen=True)
class Measure:
    """What the upper panels of the comparison and uplink figures draw from a curve's ``acc_*`` arrays: the axis
    label, the factor the values are drawn with, and whether the axis is logarithmic (then it is not clipped to
    0-100)."""

    label: str = ACC_LABEL
    scale: float = 100.0
    log: bool = False


ACCURACY = Measure()
OPT_DISTANCE = Measure("distance to the optimum ||x - x*||", 1.0, True)  # a model with a known optimum


# --------------------------------------------------------------------------- styles

@dataclass(frozen=True)
class Style:
    """How one method is drawn: colour, line style and marker, and where along the line the markers go."""

    color: str
    linestyle: str
    marker: str
    markevery: Tuple[float, float]

    def line_kwargs(self, lw: float = 1.6, markersize: float = 5.0) -> Dict:
        """Keyword arguments of ``Axes.plot`` / ``Line2D`` for this style."""
        return dict(color=self.color, linestyle=self.linestyle, marker=self.marker, markevery=self.markevery,
                    lw=lw, markersize=markersize, markeredgecolor="white", markeredgewidth=0.6)


def style_for(index: int) -> Style:
    """The style of the ``index``-th method (0-based).

    Colour cycles through the 10 colours, line style through the 4 styles, marker through the 11
    markers. So the first 10 methods differ in colour, the first 11 in marker, any two of the first
    20 in at least two of the three (still apart in grey print), and any two of the first 220 in the
    whole triple. Neighbouring methods get different line styles and each method's markers start at
    its own offset along the line, so two lines that coincide (FedAvg and FedProx with a small mu)
    both stay visible.
    """
    i = int(index)
    if i < 0:
        raise ValueError(f"style index must be >= 0, got {index}")
    return Style(color=PALETTE[i % len(PALETTE)],
                 linestyle=LINESTYLES[i % len(LINESTYLES)],
                 marker=MARKERS[i % len(MARKERS)],
                 markevery=(round(MARK_STEP * (i % 5) / 5, 4), MARK_STEP))


def method_styles(labels: Iterable[str]) -> Dict[str, Style]:
    """One :class:`Style` per distinct label, by the label's first position in ``labels``.

    The same ordered list always gives the same styles, and a label keeps its style when labels are
    appended after it.
    """
    out: Dict[str, Style] = {}
    for lab in labels:
        if lab not in out:
            out[lab] = style_for(len(out))
    return out


# --------------------------------------------------------------------------- titles

def partition_title(key: str, dataset: bool = True) -> str:
    """A partition key as a figure title: ``"digits-dirichlet-per_client-a0.3-n10-sgm0-s0"`` ->
    ``"digits, Dirichlet α=0.3, 10 clients"`` (``"Dirichlet α=0.3, 10 clients"`` without ``dataset``).

    Built on :func:`pipeline.labels.partition_label` (so "per class", "size σ" and the like show the
    same way as in the report); a key that cannot be parsed is returned unchanged.
    """
    p = _parse_partition(str(key or ""))
    if p is None:
        return str(key or "") or "?"
    if p["kind"] == "natural":  # the label names the dataset variant already
        return f"{partition_label(key)}, {p['clients']} devices"
    parts = [dataset_label(p["dataset"])] if dataset else []
    parts.append(partition_label(key))
    if "clients" in p:
        parts.append(f"{p['clients']} client{'' if p['clients'] == '1' else 's'}")
    return ", ".join(parts)


def readable_title(experiment: str = "", algorithm: Any = "", partition: str = "",
                   seed: Optional[int] = None, failed: bool = False) -> str:
    """A figure title from the train stage's internal names.

    ``algorithm`` is the rule stack's :class:`~fl_core.algorithms.base.Description` (or its stored structure;
    :func:`pipeline.labels.algorithm_label`): ``readable_title("fedbug_dir", algo.describe(),
    "digits-dirichlet-per_client-a0.3-n10-sgm0-s0", seed=1)`` with FedBug P = 0.2 over FedAvg -> ``"FedBug P=0.2
    (FedAvg) on digits, Dirichlet α=0.3, 10 clients\\nexperiment fedbug_dir, seed 1"``. With ``failed``: ``"(FAILED)"`` after the seed, or ``"every seed FAILED"`` without one.
    Every argument may be left out.
    """
    head = algorithm_label(algorithm) if algorithm else ""
    if partition:
        head = f"{head} on {partition_title(partition)}" if head else partition_title(partition)
    tail = [f"experiment {experiment}"] if experiment else []
    if seed is not None:
        tail.append(f"seed {seed}" + (" (FAILED)" if failed else ""))
    elif failed:
        tail.append("every seed FAILED")
    lines = [s for s in (head, ", ".join(tail)) if s]
    return "\n".join(lines)


# --------------------------------------------------------------------------- helpers

def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _integer_ticks(axis) -> None:
    # min_n_ticks=1: integer ticks even when the view holds a single integer (MaxNLocator would fall back)
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _tidy(ax) -> None:
    ax.grid(alpha=0.3, lw=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9)


def _arr(data: Optional[Mapping], key: str) -> np.ndarray:
    if data is None or data.get(key) is None:
        return np.zeros(0)
    return np.asarray(data[key], dtype=float).reshape(-1)


def figure_paths(path: Path) -> Tuple[Path, Path]:
    """The PNG and PDF written for ``path``: same folder and stem (``curves.png`` -> ``curves.png``, ``curves.pdf``)."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix.lower() in (".png", ".pdf") else path
    return stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")


def save_figure(fig: Figure, path: Path) -> List[Path]:
    """Write ``fig`` as PNG and PDF beside each other (see :func:`figure_paths`), each atomically."""
    png, pdf = figure_paths(path)
    with matplotlib.rc_context(SAVE_RC):
        atomic_write(png, lambda p: fig.savefig(p, format="png", dpi=DPI))
        atomic_write(pdf, lambda p: fig.savefig(p, format="pdf", metadata=PDF_METADATA))
    return [png, pdf]


def _legend_below(fig: Figure, handles: List, labels: List[str], width: float) -> None:
    """One legend for the whole figure, centred below the panels, in as many columns as fit."""
    if not handles:
        return
    col_w = 0.9 + 0.075 * max(len(lab) for lab in labels)  # handle + text at fontsize 9, in inches
    ncols = max(1, min(len(labels), int(width // col_w)))
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=9, frameon=False,
               handlelength=3.2, columnspacing=1.6)


def _legend_rows(n: int, labels: Sequence[str], width: float) -> int:
    if not n:
        return 0
    col_w = 0.9 + 0.075 * max(len(lab) for lab in labels)
    return math.ceil(n / max(1, min(n, int(width // col_w))))


# --------------------------------------------------------------------------- comparison

CurveSpec = Tuple[str, str, Optional[Mapping]]


def _methods_and_panels(curves: Sequence[CurveSpec]) -> Tuple[List[str], List[str]]:
    """The methods and the panels of ``curves``, each in order of first appearance."""
    methods: List[str] = []
    panels: List[str] = []
    for method, panel, _ in curves:
        if method not in methods:
            methods.append(method)
        if panel not in panels:
            panels.append(panel)
    return methods, panels


def _comparison_axes(fig: Figure, n_panels: int, ncol: int, nblock: int) -> Tuple[List, List]:
    """(accuracy axes, loss axes), one pair per panel in ``nblock`` row pairs of ``ncol`` columns (one pair
    when there is no panel); unused slots removed, the y-axes shared per kind, the round axis by all."""
    grid = fig.subplots(2 * nblock, ncol, squeeze=False)
    acc_axes, loss_axes = [], []
    for j in range(n_panels):
        b, c = divmod(j, ncol)
        acc_axes.append(grid[2 * b][c])
        loss_axes.append(grid[2 * b + 1][c])
    for j in range(max(1, n_panels), nblock * ncol):  # unused slots of the last row pair
        b, c = divmod(j, ncol)
        grid[2 * b][c].remove()
        grid[2 * b + 1][c].remove()
    if not n_panels:
        acc_axes, loss_axes = [grid[0][0]], [grid[1][0]]
    for ax in acc_axes[1:]:
        ax.sharey(acc_axes[0])
    for ax in loss_axes[1:]:
        ax.sharey(loss_axes[0])
    for ax in acc_axes[1:] + loss_axes:
        ax.sharex(acc_axes[0])
    return acc_axes, loss_axes


def _draw_curves(curves: Sequence[CurveSpec], panels: List[str], styles: Dict[str, Style], many: bool,
                 acc_axes: List, loss_axes: List, measure: Measure = ACCURACY) -> Tuple[Dict[str, Line2D], float, float]:
    """Draw every experiment's accuracy (mean line, min-max band, in % for :data:`ACCURACY`) and loss (mean line) in
    its panel.

    Returns the legend handle of each method drawn and the range of the finite upper-panel values drawn
    (``inf, -inf`` when there are none)."""
    drawn: Dict[str, Line2D] = {}
    lo, hi = math.inf, -math.inf
    for method, panel, data in curves:
        j = panels.index(panel)
        st = styles[method]
        kw = st.line_kwargs(lw=1.5 if many else 1.8)
        ar, mean = _arr(data, "acc_round"), measure.scale * _arr(data, "acc_mean")
        if len(ar) and len(ar) == len(mean):
            acc_axes[j].plot(ar, mean, label=method, **kw)
            amin, amax = measure.scale * _arr(data, "acc_min"), measure.scale * _arr(data, "acc_max")
            if len(amin) == len(ar) and len(amax) == len(ar):
                acc_axes[j].fill_between(ar, amin, amax, color=st.color, alpha=0.07 if many else 0.15, lw=0)
                vals = np.concatenate([mean, amin, amax])
            else:
                vals = mean
            vals = vals[np.isfinite(vals)]
            if len(vals):
                lo, hi = min(lo, float(vals.min())), max(hi, float(vals.max()))
            drawn.setdefault(method, Line2D([], [], **{**kw, "markevery": None}))
        lr, lm = _arr(data, "loss_round"), _arr(data, "loss_mean")
        if len(lr) and len(lr) == len(lm):
            loss_axes[j].plot(lr, lm, label=method, **kw)
            drawn.setdefault(method, Line2D([], [], **{**kw, "markevery": None}))
    return drawn, lo, hi


def _accuracy_limits(ax, lo: float, hi: float) -> None:
    """The shared accuracy y-axis: the drawn range ``lo..hi`` (%) padded, within 0..100; 0..100 when empty."""
    if math.isfinite(lo):
        pad = max(1.0, 0.04 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad), min(100.0, hi + pad) if hi < 100 else hi + 0.5)
    else:
        ax.set_ylim(0, 100)


def _measure_limits(ax, lo: float, hi: float, measure: Measure) -> None:
    """The shared upper y-axis: :func:`_accuracy_limits` for accuracy, a log scale for a measure that has one."""
    if measure.log:
        ax.set_yscale("log")
    else:
        _accuracy_limits(ax, lo, hi)


def _label_panels(acc_axes: List, loss_axes: List, panels: List[str], ncol: int,
                  measure: Measure = ACCURACY) -> None:
    """Titles, axis labels (y only in the first column), integer round ticks, and a note in empty panels."""
    for j, (a_ax, l_ax) in enumerate(zip(acc_axes, loss_axes)):
        c = j % ncol
        a_ax.set_title(panels[j] if panels else "", fontsize=10)
        if not a_ax.lines:
            _no_data(a_ax, "no results" if not panels else f"no {measure.label.split(' (')[0]} curves")
        if not l_ax.lines and panels:
            _no_data(l_ax, "no loss curves")
        a_ax.tick_params(labelbottom=False)
        l_ax.set_xlabel("round", fontsize=9)
        if c == 0:
            a_ax.set_ylabel(measure.label, fontsize=9)
            l_ax.set_ylabel("training loss", fontsize=9)
        else:
            a_ax.tick_params(labelleft=False)
            l_ax.tick_params(labelleft=False)
        for ax in (a_ax, l_ax):
            _integer_ticks(ax.xaxis)
            _tidy(ax)


def _finish(fig: Figure, methods: List[str], drawn: Dict[str, Line2D], width: float, title: Optional[str]) -> Figure:
    """One legend below the panels for the methods drawn (in ``methods`` order) and the optional title."""
    labels = [m for m in methods if m in drawn]
    _legend_below(fig, [drawn[m] for m in labels], labels, width)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _panel_figure(curves: Sequence[CurveSpec], max_cols: int, row_height: float, title: Optional[str],
                  legend_entries: Optional[int] = None, pad: float = 0.5):
    """The layout the grid's figures share: (methods, panels, styles, many, ncol, rows, width, fig) with one column
    per partition panel (at most ``max_cols``, further ones wrapping onto ``rows`` rows of ``row_height`` inches),
    ``pad`` inches, room for the title and for a legend of ``legend_entries`` methods (default: every method) below."""
    methods, panels = _methods_and_panels(curves)
    ncol = max(1, min(len(panels), max_cols))
    rows = max(1, math.ceil(len(panels) / ncol))
    width = max(6.4, 3.6 * ncol + 0.8)
    n_legend = (len(methods) or 1) if legend_entries is None else legend_entries
    height = row_height * rows + pad + 0.22 * _legend_rows(n_legend, methods or [""], width) + (0.3 if title else 0)
    return methods, panels, method_styles(methods), len(methods) > 6, ncol, rows, width, _new_figure(width, height)


def build_comparison_figure(curves: Sequence[CurveSpec], title: Optional[str] = None, max_cols: int = 4,
                            measure: Measure = ACCURACY) -> Figure:
    """The comparison figure of a grid, before saving.

    Args:
        curves: ``(method, panel, data)`` triples, one per experiment. ``method`` is the legend label
            (e.g. ``"FedBug P=0.2 (FedAvg)"``), ``panel`` the partition label the panel is titled with
            (e.g. ``"Dirichlet α=0.3"``): both shown as given (the report passes its row and column
            labels; use :func:`pipeline.labels.algorithm_label` / :func:`partition_title` for raw
            names). ``data`` is what :func:`pipeline.results.read_curves` returns: arrays ``acc_round``,
            ``acc_mean``, ``acc_min``, ``acc_max`` (accuracy as fractions, drawn in %), ``loss_round``
            and ``loss_mean``; None (or missing/empty arrays) draws nothing for that experiment.
            Methods and panels keep their order of first appearance; styles follow the method order.
        title: an optional title above the panels (none by default: a draft has its caption).
        max_cols: panels per row; more partitions wrap onto further (accuracy, loss) row pairs.
        measure: what the upper panels draw from the ``acc_*`` arrays (:data:`ACCURACY`; :data:`OPT_DISTANCE` for
            a problem with a known optimum, the report passing each seed-mean distance as ``acc_*``).

    Layout: per partition a column with test accuracy (mean line, min-max band over seeds) above
    training loss (mean); every accuracy panel shares one y-axis (in %), every loss panel another,
    all panels share the round axis (integer ticks); one legend below the panels.
    """
    curves = list(curves)
    methods, panels, styles, many, ncol, nblock, width, fig = _panel_figure(
        curves, max_cols, 5.2, title, legend_entries=len({m for m, _, d in curves if d is not None}), pad=0.3)
    acc_axes, loss_axes = _comparison_axes(fig, len(panels), ncol, nblock)
    drawn, lo, hi = _draw_curves(curves, panels, styles, many, acc_axes, loss_axes, measure)
    _measure_limits(acc_axes[0], lo, hi, measure)
    _label_panels(acc_axes, loss_axes, panels, ncol, measure)
    return _finish(fig, methods, drawn, width, title)


def comparison_figure(curves: Sequence[CurveSpec], path: Path, title: Optional[str] = None,
                      max_cols: int = 4, measure: Measure = ACCURACY) -> List[Path]:
    """Build :func:`build_comparison_figure` and write it as ``<stem>.png`` and ``<stem>.pdf``;
    returns the two paths."""
    return save_figure(build_comparison_figure(curves, title=title, max_cols=max_cols, measure=measure), path)


# --------------------------------------------------------------------------- accuracy against uplink

UPLINK_LABEL = "uplink per client (d, cumulative)"


def build_uplink_figure(curves: Sequence[CurveSpec], title: Optional[str] = None, max_cols: int = 4,
                        measure: Measure = ACCURACY) -> Figure:
    """Test accuracy against communication, before saving: the uplink view of :func:`build_comparison_figure`.

    Args:
        curves: ``(method, panel, data)`` triples as for :func:`build_comparison_figure`; ``data`` needs
            ``acc_up_d`` (each participating client's cumulative uplink in units of the model size d at each
            evaluated round, :func:`pipeline.results.load_experiments`) and ``acc_mean`` (fractions, drawn in %).
            An experiment without them draws nothing.
        title: an optional title above the panels.
        max_cols: panels per row.
        measure: what is drawn from ``acc_mean`` (:data:`ACCURACY`, or :data:`OPT_DISTANCE`).

    Layout: one accuracy panel per partition (shared y-axis in %), x the uplink in d (FedAvg: 1 d per round, so
    its line is its per-round curve; FedBCGD about d/N per round, compressed uploads less), one legend below.
    """
    curves = list(curves)
    methods, panels, styles, many, ncol, nrow, width, fig = _panel_figure(curves, max_cols, 3.2, title)
    grid = fig.subplots(nrow, ncol, squeeze=False)
    axes = [grid[j // ncol][j % ncol] for j in range(max(1, len(panels)))]
    for j in range(max(1, len(panels)), nrow * ncol):
        grid[j // ncol][j % ncol].remove()
    for ax in axes[1:]:
        ax.sharey(axes[0])
    drawn: Dict[str, Line2D] = {}
    lo, hi = math.inf, -math.inf
    for method, panel, data in curves:
        x, y = _arr(data, "acc_up_d"), measure.scale * _arr(data, "acc_mean")
        keep = np.isfinite(x) & np.isfinite(y) if len(x) == len(y) else np.zeros(0, dtype=bool)
        if not keep.any():
            continue
        kw = styles[method].line_kwargs(lw=1.5 if many else 1.8)
        axes[panels.index(panel)].plot(x[keep], y[keep], label=method, **kw)
        lo, hi = min(lo, float(y[keep].min())), max(hi, float(y[keep].max()))
        drawn.setdefault(method, Line2D([], [], **{**kw, "markevery": None}))
    _measure_limits(axes[0], lo, hi, measure)
    for j, ax in enumerate(axes):
        ax.set_title(panels[j] if panels else "", fontsize=10)
        if not ax.lines:
            _no_data(ax, "no uplink counts" if panels else "no results")
        ax.set_xlabel(UPLINK_LABEL, fontsize=9)
        if j % ncol == 0:
            ax.set_ylabel(measure.label, fontsize=9)
        else:
            ax.tick_params(labelleft=False)
        _tidy(ax)
    return _finish(fig, methods, drawn, width, title)


def uplink_figure(curves: Sequence[CurveSpec], path: Path, title: Optional[str] = None,
                  max_cols: int = 4, measure: Measure = ACCURACY) -> List[Path]:
    """Build :func:`build_uplink_figure` and write it as ``<stem>.png`` and ``<stem>.pdf``; returns the two
    paths."""
    return save_figure(build_uplink_figure(curves, title=title, max_cols=max_cols, measure=measure), path)


# --------------------------------------------------------------------------- drift

DRIFT_PANELS = (("drift_dissimilarity", "update dissimilarity B\u00b2"), ("drift_cosine", "cosine to mean update"))


def build_drift_figure(curves: Sequence[CurveSpec], title: Optional[str] = None, max_cols: int = 4) -> Figure:
    """The drift measures per round, before saving: the drift view of :func:`build_comparison_figure`.

    Args:
        curves: ``(method, panel, data)`` triples as for :func:`build_comparison_figure`; ``data`` needs
            ``<k>_round`` and ``<k>_mean`` for ``k`` = ``drift_dissimilarity`` and ``drift_cosine`` (mean over seeds,
            :func:`pipeline.results.read_curves`; docs/algorithms.md, Drift measures). An experiment without them
            (run with ``tracking.drift=0``) draws nothing.
        title: an optional title above the panels.
        max_cols: panels per row.

    Layout: per partition, the update dissimilarity sum_i p_i ||Delta_i - Delta_bar||^2 / ||Delta_bar||^2 on a
    log axis on top (shared by the row), the mean cosine of the clients' updates to their mean below (shared, up to
    1), round on x, one legend below.
    """
    curves = list(curves)
    methods, panels, styles, many, ncol, nblock, width, fig = _panel_figure(curves, max_cols, 5.2, title)
    top, bottom = _comparison_axes(fig, len(panels), ncol, nblock)
    drawn: Dict[str, Line2D] = {}
    for method, panel, data in curves:
        j = panels.index(panel)
        kw = styles[method].line_kwargs(lw=1.5 if many else 1.8)
        for ax, (key, _) in zip((top[j], bottom[j]), DRIFT_PANELS):
            x, y = _arr(data, f"{key}_round"), _arr(data, f"{key}_mean")
            keep = np.isfinite(x) & np.isfinite(y) if len(x) == len(y) else np.zeros(0, dtype=bool)
            if key == "drift_dissimilarity" and keep.any():
                keep &= y > 0  # a log axis: a round without dissimilarity is left out
            if keep.any():
                ax.plot(x[keep], y[keep], label=method, **kw)
                drawn.setdefault(method, Line2D([], [], **{**kw, "markevery": None}))
    if any(ax.lines for ax in top):
        top[0].set_yscale("log")
    for j, (t_ax, b_ax) in enumerate(zip(top, bottom)):
        t_ax.set_title(panels[j] if panels else "", fontsize=10)
        for ax in (t_ax, b_ax):
            if not ax.lines:
                _no_data(ax, "no drift measures" if panels else "no results")
            _integer_ticks(ax.xaxis)
            _tidy(ax)
        t_ax.tick_params(labelbottom=False)
        b_ax.set_xlabel("round", fontsize=9)
        if j % ncol == 0:
            t_ax.set_ylabel(DRIFT_PANELS[0][1], fontsize=9)
            b_ax.set_ylabel(DRIFT_PANELS[1][1], fontsize=9)
        else:
            t_ax.tick_params(labelleft=False)
            b_ax.tick_params(labelleft=False)
    return _finish(fig, methods, drawn, width, title)


def drift_figure(curves: Sequence[CurveSpec], path: Path, title: Optional[str] = None,
                 max_cols: int = 4) -> List[Path]:
    """Build :func:`build_drift_figure` and write it as ``<stem>.png`` and ``<stem>.pdf``; returns the two paths."""
    return save_figure(build_drift_figure(curves, title=title, max_cols=max_cols), path)


# --------------------------------------------------------------------------- one experiment

EXPERIMENT_PANELS = (("test_acc", ACC_LABEL, 100.0), ("test_loss", "test loss", 1.0), ("train_loss", "training loss", 1.0))


def _series(hist: Sequence[Mapping], key: str) -> Tuple[List[float], List[float]]:
    pts = sorted((int(r["round"]), v) for r in hist if "round" in r for v in [_num(r.get(key))] if v is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def build_experiment_figure(histories: Mapping[int, Sequence[Mapping]], title: str = "") -> Figure:
    """One experiment's curves, before saving: test accuracy (%), test loss and training loss per round.

    ``histories`` maps each seed to its rows (dicts with ``round`` and any of ``test_acc`` (a
    fraction), ``test_loss``, ``train_loss``; rounds without an evaluation lack the test keys, and
    missing, empty or non-finite values are skipped). Several seeds: one thin line per seed and their
    per-round mean in bold black; a single seed: its line in bold. One legend below the panels; no
    seed with data: empty panels saying so.
    """
    seeds = list(histories)
    fig = _new_figure(12.0, 3.9)
    axes = fig.subplots(1, 3, squeeze=False, sharex=True)[0]
    handles: Dict[str, Line2D] = {}
    for ax, (key, ylabel, scale) in zip(axes, EXPERIMENT_PANELS):
        per_round: Dict[int, List[float]] = {}
        for i, seed in enumerate(seeds):
            xs, ys = _series(histories[seed] or [], key)
            for x, y in zip(xs, ys):
                per_round.setdefault(x, []).append(y)
            if not xs or len(seeds) == 1:
                continue
            label = f"seed {seed}"
            (line,) = ax.plot(xs, scale * np.asarray(ys), color=PALETTE[i % len(PALETTE)], lw=0.9, alpha=0.65,
                              marker="o" if len(xs) == 1 else None, markersize=3, label=label)
            handles.setdefault(label, line)
        if per_round:
            rounds = sorted(per_round)
            mean = [scale * float(np.mean(per_round[r])) for r in rounds]
            label = "mean over seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
            (line,) = ax.plot(rounds, mean, color="black", lw=2.2, marker="o" if len(rounds) == 1 else None,
                              markersize=4, label=label)
            handles.setdefault(label, line)
        else:
            _no_data(ax, "no finished seed" if not any(histories.get(s) for s in seeds) else "not recorded")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xlabel("round", fontsize=9)
        _integer_ticks(ax.xaxis)
        _tidy(ax)
    if not axes[0].lines:
        axes[0].set_ylim(0, 100)
    order = [f"seed {s}" for s in seeds] + ["mean over seeds"]
    labels = [lab for lab in order if lab in handles]
    _legend_below(fig, [handles[lab] for lab in labels], labels, 12.0)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def experiment_figure(histories: Mapping[int, Sequence[Mapping]], title: str, path: Path) -> List[Path]:
    """Drop-in for the train stage's ``plot_curves(histories, title, path)``: writes
    :func:`build_experiment_figure` as ``<stem>.png`` and ``<stem>.pdf``; returns the two paths."""
    return save_figure(build_experiment_figure(histories, title), path)


# --------------------------------------------------------------------------- FedBug schedule

def build_schedule_figure(rows: Sequence[Mapping], title: str = "") -> Figure:
    """FedBug's schedule, before saving: trainable units m(k) at each local step k, a step line per K_i.

    ``rows`` are dicts with ``step`` (1..K_i), ``K_i`` and ``trainable_units``, as the algorithm's
    ``schedule_rows`` gives them. Shown: every K_i when there are at most 3, else the smallest, the
    median and the largest. Integer ticks on both axes.
    """
    ks = sorted({int(r["K_i"]) for r in rows})
    shown = ks if len(ks) <= 3 else sorted({ks[0], ks[len(ks) // 2], ks[-1]})
    styles = method_styles(shown)
    fig = _new_figure(6.4, 3.8)
    ax = fig.subplots()
    top = 0
    for K in shown:
        pts = sorted((int(r["step"]), int(r["trainable_units"])) for r in rows if int(r["K_i"]) == K)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        top = max([top] + ys)
        ax.step(xs, ys, where="mid", label=f"$K_i$ = {K}", **styles[K].line_kwargs(lw=1.8))
    if not shown:
        _no_data(ax, "no schedule")
    ax.set_ylim(0, max(1, top) + 0.5)
    if ks:
        ax.set_xlim(0.5, max(shown) + 0.5)
    ax.set_xlabel("local step k", fontsize=9)
    ax.set_ylabel("trainable units m(k)", fontsize=9)
    _integer_ticks(ax.xaxis)
    _integer_ticks(ax.yaxis)
    _tidy(ax)
    if shown:
        ax.legend(fontsize=8, frameon=False, loc="lower right", handlelength=3.2)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def schedule_figure(rows: Sequence[Mapping], title: str, path: Path) -> List[Path]:
    """Write :func:`build_schedule_figure` as ``<stem>.png`` and ``<stem>.pdf``; returns the two paths."""
    return save_figure(build_schedule_figure(rows, title), path)
