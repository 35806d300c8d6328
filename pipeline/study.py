"""Figures and findings of the IID-to-non-IID study: ``python -m pipeline.study [--params F] [--results D]``.

The study ("Understanding federated learning from IID to non-IID"; docs/algorithms.md, The IID-to-non-IID study) varies
one factor at a time. Its grid is an ordinary experiment grid (``params.yaml``, run by the train stage);
the ``report.sweeps`` section of the same file groups the experiments into sweeps::

    report:
      sweeps:
        iid_epochs:                         # sweep name (findings refer to it)
          title: "IID: local epochs E"
          experiments: {iid_e1: "E=1", iid_e2: "E=2", iid_e5: "E=5"}   # name -> label, smallest value first
      cosine: {iid: iid_base, noniid: dir_base}    # experiments run with tracking.layer_cosine=true
      clients: {iid: iid_base, noniid: dir_base}   # ... and with tracking.client_loss_trace > 0
      labels: {"alpha=0.1": dir_a01, ...}          # experiments whose partitions are drawn per alpha

Outputs under ``<results>/study/``:

* ``<sweep>.png``: test accuracy, test loss and training loss per round, one line per setting (mean over
  seeds) with a min-max band over seeds; the minimum of each mean test-loss curve is marked.
* ``cosine_layers.png``: per layer, the mean pairwise cosine similarity of client updates per round, IID vs
  non-IID; ``client_losses.png``: the traced clients' local training losses; ``labels_per_client.png``:
  the label histogram of every client for each alpha.
* ``findings.md``: the paper's findings, the claims of ``claims.yaml`` beside the grid (docs/claims.md), each
  with its measured effect paired over seeds, its 95% interval and a verdict (:mod:`pipeline.claims`, the table
  that also ends the study's report), then the figures; ``stats.csv``: per-experiment numbers of the curves
  (means over seeds).

The figures are also logged as artifacts of an MLflow run "study-figures" in ``tracking.experiment``.
Exit status 0, or 2 when the grid, the sweep section or the claims file cannot be read (one line naming the key).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from fl_core.store import owned
from fl_core.config import ConfigError

from .files import atomic_write, write_text
from .grid import load_grid
from .claims import claims_section, default_claims_path, evaluate, load_claims
from .results import load_experiments, numeric_columns, read_runs_rows

# ----------------------------------------------------------------------------- per-experiment curves


@dataclass
class Curves:
    """Per-round values of one experiment: ``values[metric][seed] -> (rounds [R], values [R])``."""

    name: str
    values: Dict[str, Dict[int, Tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def metric(self, key: str) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
        return self.values.get(key, {})

    def band(self, key: str) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(rounds, mean, min, max) over seeds on the rounds every seed has; None without data."""
        per = self.metric(key)
        if not per:
            return None
        common = sorted(set.intersection(*[set(r.tolist()) for r, _ in per.values()]))
        if not common:
            return None
        stack = np.array([[dict(zip(r.tolist(), v.tolist()))[c] for c in common] for r, v in per.values()])
        return np.array(common, dtype=float), stack.mean(0), stack.min(0), stack.max(0)


def read_runs(path: Path, name: str) -> Optional[Curves]:
    """Every numeric per-round column of ``runs.csv`` (one row per seed and round), or None if missing."""
    rows = read_runs_rows(path)
    if rows is None:
        return None
    cv = Curves(name)
    for k, per_seed in numeric_columns(rows).items():
        cv.values[k] = {s: (np.array(sorted(d), dtype=float), np.array([d[i] for i in sorted(d)], dtype=float))
                        for s, d in per_seed.items()}
    return cv


@dataclass
class Stats:
    """The numbers the findings compare (means over seeds)."""

    final_acc: float = float("nan")  # test accuracy, mean of the last `window` evaluated rounds
    early_acc: float = float("nan")  # mean test accuracy over the first third of the rounds
    min_test_loss: float = float("nan")  # minimum over rounds of the seed-mean test loss
    min_test_loss_round: float = float("nan")
    final_test_loss: float = float("nan")
    final_train_loss: float = float("nan")
    oscillation: float = float("nan")  # mean |acc_r - acc_{r-1}| over the second half of the rounds
    cosine: Dict[str, float] = field(default_factory=dict)  # layer -> mean over rounds
    client_loss_spread: float = float("nan")  # std across traced clients of their mean local loss, late rounds


def stats_of(cv: Curves, window: int = 3) -> Stats:
    """Summary numbers of one experiment's curves (see :class:`Stats`)."""
    st = Stats()
    acc = cv.band("test_acc")
    if acc is not None:
        mean = acc[1]
        st.final_acc = float(mean[-window:].mean())
        st.early_acc = float(mean[: max(1, len(mean) // 3)].mean())
        diffs = [np.abs(np.diff(v[len(v) // 2:])).mean() for _, v in cv.metric("test_acc").values() if len(v) > 3]
        st.oscillation = float(np.mean(diffs)) if diffs else float("nan")
    loss = cv.band("test_loss")
    if loss is not None:
        i = int(np.argmin(loss[1]))
        st.min_test_loss, st.min_test_loss_round = float(loss[1][i]), float(loss[0][i])
        st.final_test_loss = float(loss[1][-1])
    tl = cv.band("train_loss")
    if tl is not None:
        st.final_train_loss = float(tl[1][-window:].mean())
    for key in cv.values:
        if key.startswith("cos_") and key != "cos_mean":
            b = cv.band(key)
            if b is not None:
                st.cosine[key[4:]] = float(b[1].mean())
    traced = [k for k in cv.values if k.startswith("client_loss")]
    if len(traced) >= 2:
        late = []
        for k in traced:
            vals = np.concatenate([v[len(v) // 2:] for _, v in cv.metric(k).values()])
            if len(vals):
                late.append(float(vals.mean()))
        if len(late) >= 2:
            st.client_loss_spread = float(np.std(late))
    return st


# ----------------------------------------------------------------------------- sweep definitions


@dataclass
class Sweep:
    name: str
    title: str
    settings: List[Tuple[str, str]]  # (experiment, label), smallest value first


def read_sweeps(params: Path, experiments: Sequence[str]) -> Tuple[List[Sweep], Dict]:
    """The ``report`` section of ``params``: its sweeps and the cosine / clients / labels picks.

    Raises:
        ConfigError: a malformed section or an experiment that the grid does not hold (names the key).
    """
    raw = (yaml.safe_load(Path(params).read_text()) or {}).get("report") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{params}: report must be a mapping")
    known = set(experiments)
    sweeps = []
    for name, spec in (raw.get("sweeps") or {}).items():
        if not isinstance(spec, dict) or not isinstance(spec.get("experiments"), dict) or not spec["experiments"]:
            raise ConfigError(f"report.sweeps.{name}: needs 'experiments', a mapping of experiment -> label")
        for e in spec["experiments"]:
            if e not in known:
                raise ConfigError(f"report.sweeps.{name}.experiments: {e!r} is not an experiment of {params}")
        sweeps.append(Sweep(str(name), str(spec.get("title", name)),
                            [(str(e), str(lab)) for e, lab in spec["experiments"].items()]))
    extra = {}
    for key in ("cosine", "clients", "labels"):
        sec = raw.get(key) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"report.{key} must be a mapping of label -> experiment")
        for lab, e in sec.items():
            if e not in known:
                raise ConfigError(f"report.{key}.{lab}: {e!r} is not an experiment of {params}")
        extra[key] = {str(k): str(v) for k, v in sec.items()}
    return sweeps, extra


# ----------------------------------------------------------------------------- figures


def _fig(nrows: int, ncols: int, w: float, h: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w * ncols, h * nrows))
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=100, format="png"))
    return path


def plot_sweep(sweep: Sweep, curves: Dict[str, Curves], path: Path) -> Path:
    """Test accuracy, test loss (minimum marked) and training loss per round for every setting of ``sweep``."""
    fig, ax = _fig(1, 3, 5.2, 4.0)
    for i, (exp, lab) in enumerate(sweep.settings):
        cv = curves.get(exp)
        if cv is None:
            continue
        color = f"C{i % 10}"
        for j, (key, scale) in enumerate((("test_acc", 100.0), ("test_loss", 1.0), ("train_loss", 1.0))):
            b = cv.band(key)
            if b is None:
                continue
            r, mean, lo, hi = b
            ax[0][j].plot(r, scale * mean, color=color, lw=1.6, label=lab)
            ax[0][j].fill_between(r, scale * lo, scale * hi, color=color, alpha=0.15, lw=0)
            if key == "test_loss":
                k = int(np.argmin(mean))
                ax[0][j].plot([r[k]], [mean[k]], marker="v", color=color, ms=8, mec="black")
    for j, lab in enumerate(("test accuracy (%)", "test loss (\u25bc: minimum)", "training loss")):
        ax[0][j].set_ylabel(lab)
        ax[0][j].set_xlabel("round")
        ax[0][j].grid(alpha=0.3)
    if ax[0][0].get_legend_handles_labels()[0]:
        ax[0][0].legend(fontsize=8)
    fig.suptitle(f"{sweep.title} (mean over seeds, min\u2013max band)")
    return _save(fig, path)


def plot_cosine(iid: Optional[Curves], non: Optional[Curves], path: Path) -> Optional[Path]:
    """Per layer: mean pairwise cosine similarity of client updates per round, IID vs non-IID."""
    if iid is None or non is None:
        return None
    layers = [k for k in iid.values if k.startswith("cos_") and k != "cos_mean" and k in non.values]
    if not layers:
        return None
    fig, ax = _fig(1, len(layers), 4.0, 3.4)
    for j, key in enumerate(layers):
        for cv, lab, color in ((iid, "IID", "C0"), (non, "non-IID", "C3")):
            r, mean, lo, hi = cv.band(key)
            ax[0][j].plot(r, mean, color=color, label=lab)
            ax[0][j].fill_between(r, lo, hi, color=color, alpha=0.15, lw=0)
        ax[0][j].set_title(key[4:])
        ax[0][j].set_xlabel("round")
        ax[0][j].grid(alpha=0.3)
    ax[0][0].set_ylabel("cosine similarity of client updates")
    ax[0][0].legend(fontsize=8)
    fig.suptitle("Layer-wise cosine similarity of client updates (mean over client pairs and seeds)")
    return _save(fig, path)


def plot_client_losses(iid: Optional[Curves], non: Optional[Curves], path: Path) -> Optional[Path]:
    """The traced clients' local training losses per round (first seed), IID and non-IID side by side."""
    if iid is None or non is None:
        return None
    fig, ax = _fig(1, 2, 5.5, 4.0)
    drew = False
    for j, (cv, title) in enumerate(((iid, "IID"), (non, "non-IID"))):
        keys = sorted(k for k in cv.values if k.startswith("client_loss"))
        for i, k in enumerate(keys):
            per = cv.metric(k)
            seed = min(per)
            r, v = per[seed]
            ax[0][j].plot(r, v, marker=".", color=f"C{i % 10}", label=k.split("/")[-1].replace("client_loss", "")
                          .strip("_") or k)
            drew = True
        ax[0][j].set_title(f"{title} (seed {min(cv.metric(keys[0])) if keys else '-'})")
        ax[0][j].set_xlabel("round")
        ax[0][j].set_ylabel("local training loss")
        ax[0][j].grid(alpha=0.3)
        if ax[0][j].get_legend_handles_labels()[0]:
            ax[0][j].legend(fontsize=7, title="client")
    if not drew:
        return None
    fig.suptitle("Training loss of individual clients (rounds they took part in)")
    return _save(fig, path)


def plot_labels(picks: Dict[str, str], results: Path, path: Path) -> Optional[Path]:
    """Labels per client (stacked bars of the partition's label histogram) for each alpha."""
    hists = []
    for lab, exp in picks.items():
        p = results / exp / "partition" / "stats.json"
        if p.exists():
            hists.append((lab, np.array(json.loads(p.read_text())["label_hist"], dtype=float)))
    if not hists:
        return None
    fig, ax = _fig(1, len(hists), 3.6, 3.4)
    for j, (lab, h) in enumerate(hists):
        bottom = np.zeros(h.shape[0])
        for c in range(h.shape[1]):
            ax[0][j].bar(np.arange(h.shape[0]), h[:, c], bottom=bottom, color=f"C{c % 10}", width=0.85)
            bottom += h[:, c]
        ax[0][j].set_title(lab)
        ax[0][j].set_xlabel("client")
    ax[0][0].set_ylabel("samples (colour = class)")
    fig.suptitle("Labels per client")
    return _save(fig, path)


# ----------------------------------------------------------------------------- main


def build(params: Path, results: Path, claims: Optional[Path] = None) -> Tuple[List[Path], str]:
    """Write every figure, ``findings.md`` and ``stats.csv`` under ``<results>/study``; returns (files, findings).

    ``claims`` is the study's claims file (default: ``claims.yaml`` beside ``params`` when it exists; without
    one ``findings.md`` holds only the figures).

    Raises:
        ConfigError: see :func:`read_sweeps`, :func:`pipeline.grid.load_grid` and
            :func:`pipeline.claims.load_claims` (raised before anything is written).
    """
    grid = load_grid(params)
    sweeps, extra = read_sweeps(params, list(grid.experiments))
    if claims is None and default_claims_path(params).exists():
        claims = default_claims_path(params)
    claim_list = load_claims(claims, list(grid.experiments)) if claims is not None else []
    out = results / "study"
    owned.check(out, owned.with_temporaries(["*.png", "findings.md", "stats.csv"]), "study folder",
                f"move it away (the study's figures go to {out})")
    curves: Dict[str, Curves] = {}
    for name in grid.experiments:
        cv = read_runs(results / name / "runs.csv", name)
        if cv is not None:
            curves[name] = cv
    window = 3
    stats = {n: stats_of(cv, window) for n, cv in curves.items()}
    files: List[Path] = []
    for sw in sweeps:
        files.append(plot_sweep(sw, curves, out / f"{sw.name}.png"))
    cos, cl = extra["cosine"], extra["clients"]
    f = plot_cosine(curves.get(cos.get("iid", "")), curves.get(cos.get("noniid", "")), out / "cosine_layers.png")
    files += [f] if f else []
    f = plot_client_losses(curves.get(cl.get("iid", "")), curves.get(cl.get("noniid", "")), out / "client_losses.png")
    files += [f] if f else []
    f = plot_labels(extra["labels"], results, out / "labels_per_client.png")
    files += [f] if f else []

    lines = ["# IID to non-IID study: findings", "",
             f"From `{params}` and `{results}/<experiment>/` by `python -m pipeline.study`.", ""]
    if claim_list:
        lines += claims_section(evaluate(claim_list, load_experiments(grid, results), results), claims.name)
    else:
        lines += [f"No claims file ({default_claims_path(params)}): no verdicts.", ""]
    lines += ["## Figures", ""]
    lines += [f"![{p.stem}]({p.name})" for p in files]
    text = "\n".join(lines) + "\n"
    write_text(out / "findings.md", text)
    scalars = ("final_acc", "early_acc", "min_test_loss", "min_test_loss_round", "final_test_loss",
               "final_train_loss", "oscillation", "client_loss_spread")
    layers = sorted({layer for st in stats.values() for layer in st.cosine})  # the layers the runs logged
    rows = [",".join(("experiment",) + scalars + tuple(f"cos_{l}" for l in layers))]
    for n, st in stats.items():
        rows.append(",".join([n] + [f"{getattr(st, k):.6g}" for k in scalars]
                             + [f"{st.cosine.get(l, float('nan')):.6g}" for l in layers]))
    write_text(out / "stats.csv", "\n".join(rows) + "\n")
    files += [out / "findings.md", out / "stats.csv"]
    return files, text


def _log_mlflow(params: Path, files: List[Path]) -> None:
    """The figures as artifacts of a run "study-figures" in the grid's MLflow experiment (best effort)."""
    raw = yaml.safe_load(Path(params).read_text()) or {}
    experiment = ((raw.get("tracking") or {}).get("experiment")) or "fl-pipeline"
    if (raw.get("tracking") or {}).get("enabled") is False:
        return
    from fl_core.store.tracking import Tracking

    tr = Tracking(experiment)
    run_id = tr.start_parent("study-figures", {"kind": "study-figures"})
    tr.log_artifacts(run_id, files, "study")
    tr.end_parent(run_id)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.study",
                                description="Figures and findings of the IID-to-non-IID study from the grid's "
                                            "results (writes <results>/study/).")
    p.add_argument("--params", type=Path, default=Path("params.yaml"), metavar="FILE",
                   help="the experiment grid with its report.sweeps section (default: params.yaml)")
    p.add_argument("--results", type=Path, default=Path("results"), metavar="DIR",
                   help="folder with one sub-folder per experiment (default: results)")
    p.add_argument("--claims", type=Path, default=None, metavar="FILE",
                   help="the paper's claims whose verdicts findings.md lists (default: claims.yaml beside --params, "
                        "when it exists; docs/claims.md)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the figures to MLflow")
    args = p.parse_args(argv)
    try:
        files, text = build(args.params, args.results, args.claims)
    except (ConfigError, owned.ForeignFolder) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.no_mlflow:
        _log_mlflow(args.params, files)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
