"""Convergence on a problem with a known optimum: f(x_r) - f* of a grid's experiments against rounds and uplink floats,
and which method gets lowest (docs/algorithms.md, FedBCGD's convex problem; a model with ``objective_metrics``, e.g.
``model=logreg_binary``, logs the ``objective_gap`` column this reads)::

    python -m pipeline.convergence --params params_convex.yaml --results results --out results/convex \\
        [--fastest LABEL --claim TEXT]

Inputs, per experiment of the params file: ``<results>/<name>/runs.csv`` (``objective_gap`` and ``comm_up_floats``,
per seed and round) and ``experiment.json`` (the algorithm). Methods are the experiments grouped by algorithm label
(:func:`pipeline.labels.run_label`); a method run at several settings (a learning-rate grid) is represented by
its experiment with the lowest mean final gap, as a paper tunes each method on its grid.

Two criteria, each over the seeds every chosen experiment finished: the gap at the last round (the mean over seeds;
the per-seed winner) and the gap at the common uplink budget U, the smallest final cumulative uplink per client
among the chosen experiments (every method spent at least U): per seed, the gap of the last round whose uplink is
<= U. With ``--fastest LABEL`` the verdict is ``holds`` when that method has the lowest mean gap by both criteria
and the lowest gap in every seed by both, ``does not hold`` when it is lowest by neither (in the mean), ``mixed``
otherwise.

Outputs in ``--out``: ``objective_gap.png`` / ``.pdf`` (gap against rounds and against uplink floats per client, log
scale; each chosen experiment's mean over seeds with a min-max band, the other settings thin), ``convergence.md``
(every experiment's numbers, the chosen ones marked, the verdict line) and ``convergence.json`` (the numbers).
Exit status 2, one line, on a bad params file, an experiment without results or without ``objective_gap``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from fl_core.store import owned
from fl_core.config import ConfigError

from .figures import _legend_below, _new_figure, _tidy, method_styles, save_figure
from .files import write_text
from .grid import load_grid
from .labels import markdown_table, run_label
from .results import load_experiments, numeric_columns, read_runs_rows

GAP, UP = "objective_gap", "comm_up_floats"


@dataclass
class Curve:
    """One experiment's gap curves: {seed: (rounds [R], uplink floats per client [R], gap [R])}."""

    name: str
    method: str
    label: str
    seeds: Dict[int, tuple] = field(default_factory=dict)

    def final(self, seed: int) -> float:
        return float(self.seeds[seed][2][-1])

    def at_uplink(self, seed: int, budget: float) -> float:
        """The gap of the last round whose cumulative uplink is <= ``budget`` (NaN if none is)."""
        _, up, gap = self.seeds[seed]
        ok = np.nonzero(up <= budget * (1 + 1e-12))[0]
        return float(gap[ok[-1]]) if len(ok) else math.nan

    def mean_final(self, seeds: Sequence[int]) -> float:
        return float(np.mean([self.final(s) for s in seeds]))


def load_curves(params: Path, results: Path) -> List[Curve]:
    """Every experiment of the grid ``params`` with its per-seed gap curves.

    Raises:
        ConfigError: a bad params file, an experiment without results (names it and the file), or a runs.csv without
            ``objective_gap`` (a model without a known optimum).
    """
    grid = load_grid(params)
    out = []
    for e in load_experiments(grid, results):
        if e.metrics is None:
            raise ConfigError(f"experiments.{e.name}: {e.problem} (run its train stage first)")
        rows = read_runs_rows(Path(results) / e.name / "runs.csv")
        cols = numeric_columns(rows or [])
        if GAP not in cols:
            raise ConfigError(f"experiments.{e.name}: runs.csv has no {GAP} column (the model logs none; use a model "
                              "with a known optimum, e.g. model=logreg_binary)")
        method = run_label(e.metrics) if e.metrics.get("stack") or e.metrics.get("algorithm") else e.name
        own = [o for o in e.overrides if not o.startswith("algorithm=")]
        c = Curve(e.name, method, method + (f" ({', '.join(own)})" if own else ""))
        for seed, by_round in cols[GAP].items():
            rounds = np.array(sorted(by_round))
            up = cols.get(UP, {}).get(seed, {})
            c.seeds[seed] = (rounds, np.array([up.get(r, math.nan) for r in rounds]),
                             np.array([by_round[r] for r in rounds]))
        out.append(c)
    return out


def choose(curves: List[Curve]) -> Dict[str, Curve]:
    """Method label -> its experiment with the lowest mean final gap over the seeds all of them finished."""
    seeds = common_seeds(curves)
    best: Dict[str, Curve] = {}
    for c in curves:
        if c.method not in best or c.mean_final(seeds) < best[c.method].mean_final(seeds):
            best[c.method] = c
    return best


def common_seeds(curves: Sequence[Curve]) -> List[int]:
    """The seeds every curve has (sorted).

    Raises:
        ConfigError: no seed is common to all of them.
    """
    seeds = set.intersection(*(set(c.seeds) for c in curves)) if curves else set()
    if not seeds:
        raise ConfigError("no seed finished in every experiment: nothing to compare")
    return sorted(seeds)


def compare(chosen: Dict[str, Curve]) -> Dict:
    """The two criteria for the chosen experiments: ``budget`` U, ``last`` / ``uplink``: {method: {"mean", "per_seed"}},
    and ``winner`` per criterion: the method of the lowest mean and, per seed, the method of the lowest gap."""
    curves = list(chosen.values())
    seeds = common_seeds(curves)
    budget = min(float(np.nanmax(c.seeds[s][1])) for c in curves for s in seeds)
    out: Dict = {"seeds": seeds, "budget": budget, "last": {}, "uplink": {}, "winner": {}}
    for key, value in (("last", lambda c, s: c.final(s)), ("uplink", lambda c, s: c.at_uplink(s, budget))):
        for m, c in chosen.items():
            per_seed = {s: value(c, s) for s in seeds}
            out[key][m] = {"experiment": c.name, "mean": float(np.mean(list(per_seed.values()))),
                           "per_seed": per_seed}
        out["winner"][key] = {"mean": min(out[key], key=lambda m: out[key][m]["mean"]),
                              "per_seed": {s: min(out[key], key=lambda m: out[key][m]["per_seed"][s]) for s in seeds}}
    return out


def verdict(result: Dict, fastest: str, claim: str) -> str:
    """One line: whether method ``fastest`` (a label, or the start of one before a space: ``FedBCGD+`` names
    ``FedBCGD+ paper, N=5, lambda=0.8``) is lowest by both criteria (:func:`compare`)."""
    w = result["winner"]
    named = [m for m in result["last"] if m == fastest or m.startswith(fastest + " ")]
    if len(named) != 1:
        return (f"verdict: {claim}: not measured ({len(named)} methods labelled {fastest!r}; methods: "
                f"{'; '.join(result['last'])})")
    fastest = named[0]
    by_mean = [w[k]["mean"] == fastest for k in ("last", "uplink")]
    every_seed = all(v == fastest for k in ("last", "uplink") for v in w[k]["per_seed"].values())
    state = "holds" if all(by_mean) and every_seed else "does not hold" if not any(by_mean) else "mixed"
    last, up = result["last"], result["uplink"]
    return (f"verdict: {claim}: {state}: lowest f(x_R) - f* at the last round {w['last']['mean']} "
            f"({_g(last[w['last']['mean']]['mean'])}; {fastest} {_g(last[fastest]['mean'])}), at equal uplink "
            f"({_g(result['budget'])} floats per client) {w['uplink']['mean']} "
            f"({_g(up[w['uplink']['mean']]['mean'])}; {fastest} {_g(up[fastest]['mean'])}), over "
            f"{len(result['seeds'])} seed(s)")


def _sd(xs: Sequence[float]) -> float:
    """Sample standard deviation (ddof = 1; 0 for one value), as the project's summaries."""
    return float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def _g(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def figure(curves: List[Curve], chosen: Dict[str, Curve], path: Path) -> List[Path]:
    """Gap against rounds (left) and against cumulative uplink floats per client (right), log y."""
    fig = _new_figure(10.0, 4.2)
    axes = fig.subplots(1, 2, sharey=True)
    styles = method_styles([c.method for c in curves])
    picked = {c.name for c in chosen.values()}
    handles, labels = [], []
    for c in curves:
        st = styles[c.method]
        seeds = sorted(c.seeds)
        rounds = c.seeds[seeds[0]][0]
        gaps = np.array([c.seeds[s][2] for s in seeds if len(c.seeds[s][2]) == len(rounds)])
        ups = np.array([c.seeds[s][1] for s in seeds if len(c.seeds[s][1]) == len(rounds)])
        mean, lo, hi = gaps.mean(0), gaps.min(0), gaps.max(0)
        for ax, x in ((axes[0], rounds), (axes[1], ups.mean(0))):
            if c.name in picked:
                line, = ax.plot(x, mean, **st.line_kwargs())
                ax.fill_between(x, lo, hi, color=st.color, alpha=0.15, lw=0)
            else:
                line, = ax.plot(x, mean, color=st.color, lw=0.7, alpha=0.5, linestyle=":")
        if c.name in picked:
            handles.append(line)
            labels.append(c.label)
    for ax, xlabel in ((axes[0], "round"), (axes[1], "cumulative uplink floats per client")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel, fontsize=9)
        _tidy(ax)
    axes[0].set_ylabel("f(x_r) - f*", fontsize=9)
    fig.suptitle("Objective gap (mean over seeds, min-max band; dotted: the other settings of each method)",
                 fontsize=10)
    _legend_below(fig, handles, labels, 10.0)
    return save_figure(fig, path)


def report(curves: List[Curve], chosen: Dict[str, Curve], result: Dict, line: Optional[str]) -> str:
    """convergence.md: every experiment's final gap and gap at the uplink budget (mean +- std over the common
    seeds), the chosen ones marked, then the verdict line."""
    seeds, budget = result["seeds"], result["budget"]
    picked = {c.name for c in chosen.values()}
    rows = []
    for c in curves:
        fin = [c.final(s) for s in seeds]
        at = [c.at_uplink(s, budget) for s in seeds]
        rows.append([c.name + (" *" if c.name in picked else ""), c.label, f"{np.mean(fin):.3g} +- {_sd(fin):.2g}",
                     f"{np.mean(at):.3g} +- {_sd(at):.2g}",
                     _g(float(np.mean([c.seeds[s][1][-1] for s in seeds])))])
    text = ["# Convergence to the optimum", "",
            f"f(x_r) - f* per experiment over seeds {', '.join(map(str, seeds))} (mean +- sample std). `*`: the "
            f"method's setting with the lowest final gap, drawn bold in objective_gap.png. Equal uplink: the gap of "
            f"the last round within {_g(budget)} floats per client, the least any chosen setting sent.", "",
            markdown_table(["experiment", "method", "final gap", f"gap at {_g(budget)} uplink floats", "uplink floats"],
                           rows, "lllrr"), ""]
    if line:
        text += [line, ""]
    return "\n".join(text)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    p.add_argument("--results", type=Path, default=Path("results"))
    p.add_argument("--out", type=Path, required=True, help="folder of the figure and the tables")
    p.add_argument("--fastest", help="the method label the claim says converges fastest (a row label of the tables, or its first "
                        "word)")
    p.add_argument("--claim", default="the named method converges fastest", help="the claim, for the verdict line")
    args = p.parse_args(argv)
    try:
        curves = load_curves(args.params, args.results)
        chosen = choose(curves)
        result = compare(chosen)
        owned.check(args.out, owned.with_temporaries(["objective_gap.png", "objective_gap.pdf", "convergence.md",
                                                      "convergence.json"]), "convergence folder", "choose another --out")
    except (ConfigError, owned.ForeignFolder) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    line = verdict(result, args.fastest, args.claim) if args.fastest else None
    figure(curves, chosen, args.out / "objective_gap.png")
    write_text(args.out / "convergence.md", report(curves, chosen, result, line))
    write_text(args.out / "convergence.json", json.dumps(
        {**{k: v for k, v in result.items() if k != "winner"}, "winner": result["winner"], "verdict": line,
         "chosen": {m: c.name for m, c in chosen.items()}}, indent=2, default=str) + "\n")
    print(line or f"convergence: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
