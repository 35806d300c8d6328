"""pipeline.figures: distinct method styles, the comparison / experiment / schedule figures (PNG + PDF)."""

from __future__ import annotations

import gc
import itertools
import warnings

import numpy as np
import pytest
from matplotlib.ticker import MaxNLocator

from pipeline.figures import (build_comparison_figure, build_experiment_figure, build_schedule_figure,
                              comparison_figure, experiment_figure, figure_paths, method_styles,
                              partition_title, readable_title, schedule_figure, uplink_figure,
                              drift_figure)

ROUNDS = np.arange(1, 9, dtype=float)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _data(final: float):
    mean = final * (1 - np.exp(-ROUNDS / 3))
    return {"acc_round": ROUNDS, "acc_mean": mean, "acc_min": mean - 0.02, "acc_max": mean + 0.02,
            "loss_round": ROUNDS, "loss_mean": 2.0 * np.exp(-ROUNDS / 4)}


METHODS = ["FedAvg", "FedProx", "FedBug P=0.2 (FedAvg)"]
PANELS = ["IID", "Dirichlet \u03b1=0.3"]
# FedAvg and FedProx coincide (the case the old figure hid); FedBug's Dirichlet run has no runs.csv
CURVES = [(m, p, None if (m, p) == (METHODS[2], PANELS[1]) else _data(0.9 if m != METHODS[2] else 0.8))
          for p in PANELS for m in METHODS]


def _written(paths):
    png, pdf = paths
    assert png.suffix == ".png" and pdf.suffix == ".pdf" and png.stem == pdf.stem
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000
    assert not [p for p in png.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def _no_warnings(fn, *args):
    """``fn(*args)`` raises no warning. A socket another test of this worker process left to the garbage collector
    may be finalised meanwhile (its ResourceWarning is not the figure's: figures open no sockets)."""
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="unclosed <socket", category=ResourceWarning)
        out = fn(*args)
    assert [str(w.message) for w in caught] == []
    return out


def _tick_values(ax, axis: str):
    """The tick values inside the view (after a draw) and their labels."""
    ax.figure.canvas.draw()
    a = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    ticks = [(t.get_loc(), t.label1.get_text()) for t in a.get_major_ticks() if lo <= t.get_loc() <= hi]
    assert ticks
    return ticks


# --------------------------------------------------------------------------- styles

def test_styles_pairwise_distinct_and_stable():
    labels = [f"method {i}" for i in range(20)]
    styles = method_styles(labels)
    assert list(styles) == labels
    triples = [(s.color, s.linestyle, s.marker) for s in styles.values()]
    assert len(set(triples)) == 20
    # any two of the 20 differ in at least two of colour, line style and marker (not only a dash pattern)
    for a, b in itertools.combinations(triples, 2):
        assert sum(x != y for x, y in zip(a, b)) >= 2, (a, b)
    assert len({s.color for s in list(styles.values())[:10]}) == 10  # the first 10: distinct colours
    assert method_styles(labels) == styles  # stable
    assert method_styles(labels[:5]) == {k: styles[k] for k in labels[:5]}  # a prefix keeps its styles
    assert method_styles(["a", "b", "a"]) == method_styles(["a", "b"])  # repeats count once
    assert len({(s.color, s.linestyle, s.marker) for s in method_styles(map(str, range(60))).values()}) == 60
    for s in styles.values():  # markers spaced out along the line
        assert isinstance(s.markevery, tuple) and 0 < s.markevery[1] < 1


# --------------------------------------------------------------------------- comparison

def test_comparison_figure_writes_png_and_pdf(tmp_path):
    paths = _no_warnings(comparison_figure, CURVES, tmp_path / "curves.png")
    assert paths == [tmp_path / "curves.png", tmp_path / "curves.pdf"]
    _written(paths)
    assert figure_paths(tmp_path / "x.pdf") == (tmp_path / "x.png", tmp_path / "x.pdf")


def test_comparison_figure_layout():
    fig = _no_warnings(build_comparison_figure, CURVES)
    acc, loss = fig.axes[:2], fig.axes[2:4]
    assert len(fig.axes) == 4
    assert [ax.get_title() for ax in acc] == PANELS  # readable partition labels as given
    # one y-axis per row: accuracy panels together, loss panels together, never accuracy with loss
    assert acc[0].get_shared_y_axes().joined(acc[0], acc[1])
    assert loss[0].get_shared_y_axes().joined(loss[0], loss[1])
    assert not acc[0].get_shared_y_axes().joined(acc[0], loss[0])
    assert acc[0].get_ylim() == acc[1].get_ylim()
    lo, hi = acc[0].get_ylim()
    assert hi > 1 and hi <= 100.5 and lo >= 0  # percent
    assert max(max(line.get_ydata()) for line in acc[0].lines) == pytest.approx(90 * (1 - np.exp(-8 / 3)))
    assert "%" in acc[0].get_ylabel()
    # one legend for the whole figure, every method once, in order
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == METHODS
    # coinciding methods still look different
    styles = {line.get_label(): (line.get_color(), line.get_linestyle(), line.get_marker()) for line in acc[0].lines}
    assert styles["FedAvg"] != styles["FedProx"]
    assert len(acc[1].lines) == 2  # FedBug's missing curves: nothing drawn, no error
    for ax in fig.axes:
        loc = ax.xaxis.get_major_locator()
        assert isinstance(loc, MaxNLocator) and loc._integer
        for value, text in _tick_values(ax, "x"):
            assert float(value).is_integer()
            if text:
                assert "." not in text


def test_uplink_figure_draws_accuracy_against_the_uplink_in_d(tmp_path):
    """Each method's accuracy (%) at its own cumulative uplink (d): a method sending d/4 per round ends at a
    quarter of FedAvg's uplink; a method without uplink counts draws nothing."""
    fedavg = {**_data(0.9), "acc_up_d": ROUNDS.copy()}
    quarter = {**_data(0.8), "acc_up_d": ROUNDS / 4}
    no_counts = _data(0.7)  # runs.csv without comm_up_floats
    curves = [("FedAvg", "IID", fedavg), ("FedBCGD", "IID", quarter), ("Top-k", "IID", no_counts)]
    _written(_no_warnings(uplink_figure, curves, tmp_path / "uplink.png"))
    from pipeline.figures import build_uplink_figure

    fig = build_uplink_figure(curves)
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.lines}
    assert sorted(lines) == ["FedAvg", "FedBCGD"]
    assert list(lines["FedBCGD"].get_xdata()) == list(ROUNDS / 4)
    assert list(lines["FedAvg"].get_ydata()) == pytest.approx(list(90 * (1 - np.exp(-ROUNDS / 3))))
    assert "d" in ax.get_xlabel() and "%" in ax.get_ylabel() and ax.get_title() == "IID"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["FedAvg", "FedBCGD"]


def test_comparison_figure_many_methods_and_partitions():
    curves = [(f"method {i}", f"partition {j}", _data(0.5 + 0.02 * i)) for j in range(6) for i in range(12)]
    fig = _no_warnings(build_comparison_figure, curves)
    acc = [ax for ax in fig.axes if ax.get_title()]
    assert len(acc) == 6 and len(fig.legends) == 1
    assert len(fig.legends[0].get_texts()) == 12
    assert all(acc[0].get_shared_y_axes().joined(acc[0], ax) for ax in acc)
    _no_warnings(build_comparison_figure, [])  # nothing to draw: an empty figure, no error


# --------------------------------------------------------------------------- one experiment

def _history(seed: int):
    rows = []
    for r in range(1, 7):
        row = {"round": r, "train_loss": 2.0 / r + 0.1 * seed}
        if r % 2 == 0:  # evaluated every other round
            row.update(test_acc=0.5 + 0.05 * r + 0.01 * seed, test_loss=1.0 / r)
        rows.append(row)
    return rows


def test_experiment_figure(tmp_path):
    histories = {1: _history(1), 2: _history(2)}
    fig = _no_warnings(build_experiment_figure, histories, "FedAvg on digits, IID, 10 clients")
    acc, test_loss, train_loss = fig.axes
    assert acc.get_ylim()[1] > 1 and "%" in acc.get_ylabel()
    mean = [line for line in acc.lines if line.get_label() == "mean over seeds"][0]
    assert list(mean.get_xdata()) == [2, 4, 6]
    assert list(mean.get_ydata()) == pytest.approx([100 * (0.5 + 0.05 * r + 0.015) for r in (2, 4, 6)])
    assert mean.get_linewidth() > max(line.get_linewidth() for line in acc.lines if line is not mean)
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["seed 1", "seed 2", "mean over seeds"]
    for ax in fig.axes:
        assert all(float(v).is_integer() for v, _ in _tick_values(ax, "x"))
    _written(_no_warnings(experiment_figure, histories, "t", tmp_path / "curves.png"))


@pytest.mark.parametrize("histories", [{}, {0: []}, {0: [{"round": 1, "train_loss": 2.0}], 1: []},
                                       {3: [{"round": 1, "train_loss": float("nan"), "test_acc": ""}]}])
def test_experiment_figure_without_data(tmp_path, histories):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = experiment_figure(histories, "every seed FAILED", tmp_path / "seed_0.png")
    assert [str(w.message) for w in caught] == []
    _written(paths)


def test_experiment_figure_single_seed():
    fig = build_experiment_figure({4: _history(0)}, "")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["seed 4"]
    assert len(fig.axes[0].lines) == 1


# --------------------------------------------------------------------------- schedule

def _schedule(ks, units=3):
    return [{"K_i": K, "step": k, "trainable_units": min(units, 1 + (k - 1) * units // max(1, K // 5)),
             "units": ""} for K in ks for k in range(1, K + 1)]


@pytest.mark.parametrize("ks,units", [((4, 10, 25, 40), 3), ((1,), 1), ((3,), 2), ((2, 5), 4)])
def test_schedule_ticks_are_integers(tmp_path, ks, units):
    rows = _schedule(ks, units)
    fig = _no_warnings(build_schedule_figure, rows, "FedBug P=0.2 (FedAvg)")
    (ax,) = fig.axes
    for axis in ("x", "y"):
        for value, text in _tick_values(ax, axis):
            assert float(value).is_integer() and text and "." not in text, (axis, value, text)
            int(text.replace("\u2212", "-"))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) == min(3, len(ks)) and all("K_i" in lab for lab in labels)
    _written(_no_warnings(schedule_figure, rows, "FedBug", tmp_path / "schedule.png"))


# --------------------------------------------------------------------------- titles

def test_readable_titles():
    key = "digits-dirichlet-per_client-a0.3-n10-sgm0-s0"
    assert partition_title(key) == "digits, Dirichlet \u03b1=0.3, 10 clients"
    assert partition_title(key, dataset=False) == "Dirichlet \u03b1=0.3, 10 clients"
    assert partition_title("cifar100-dirichlet-per_class-a0.5-n20-s0") == \
        "cifar100, Dirichlet \u03b1=0.5 (per class), 20 clients"
    assert partition_title("odd key") == "odd key"
    from fl_core.algorithms.base import Description

    assert readable_title("fedbug_dir", Description("fedbug", [("P", 0.2)], Description("fedavg")), key, seed=1) == \
        "FedBug P=0.2 (FedAvg) on digits, Dirichlet \u03b1=0.3, 10 clients\nexperiment fedbug_dir, seed 1"
    # text without its structure (a folder written before runs stored it) is shown as it is
    assert readable_title("", "fedbug[P=0.2](fedavg)") == "fedbug[P=0.2](fedavg)"
    assert readable_title("x", "fedavg", "digits-iid-n20-sgm0-s0", failed=True) == \
        "FedAvg on digits, IID, 20 clients\nexperiment x, every seed FAILED"
    assert readable_title("x", seed=0, failed=True) == "experiment x, seed 0 (FAILED)"


def test_drift_figure_draws_dissimilarity_on_a_log_axis_and_the_cosine(tmp_path):
    """Per partition: the update dissimilarity (log y, rounds with 0 left out) on top, the cosine below; a method
    run without the drift measures draws nothing in either."""
    dis = np.array([4.0, 2.0, 0.0, 1.0])
    drifting = {**_data(0.9), "drift_dissimilarity_round": np.arange(1.0, 5.0), "drift_dissimilarity_mean": dis,
                "drift_cosine_round": np.arange(1.0, 5.0), "drift_cosine_mean": np.array([0.2, 0.4, 0.6, 0.8])}
    none = _data(0.8)
    curves = [("FedAvg", "IID", drifting), ("FedDyn", "IID", none), ("FedAvg", "Dir(0.1)", drifting)]
    _written(_no_warnings(drift_figure, curves, tmp_path / "drift.png"))
    from pipeline.figures import build_drift_figure

    fig = build_drift_figure(curves)
    top, bottom = fig.axes[0], fig.axes[2]  # panel IID: dissimilarity above, cosine below
    assert [ax.get_title() for ax in fig.axes[:2]] == ["IID", "Dir(0.1)"]
    assert top.get_yscale() == "log" and fig.axes[1].get_yscale() == "log"
    (line,) = top.lines
    assert list(line.get_xdata()) == [1.0, 2.0, 4.0] and list(line.get_ydata()) == [4.0, 2.0, 1.0]
    assert [ln.get_label() for ln in bottom.lines] == ["FedAvg"]
    assert list(bottom.lines[0].get_ydata()) == [0.2, 0.4, 0.6, 0.8]
    assert "dissimilarity" in top.get_ylabel() and "cosine" in bottom.get_ylabel()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["FedAvg"]
