"""Train one experiment (all its seeds): ``python -m pipeline.train [OVERRIDES] | --grid NAME``.

Single experiment from Hydra overrides (see ``conf/``)::

    python -m pipeline.train dataset=digits partition=dirichlet partition.alpha=0.3 \\
        algorithm=fedbug algorithm.fedbug.gu_percentage=0.2 train.rounds=50 \\
        train.participation=0.5 train.local_epochs=2 train.batch_size=32 train.lr=0.05 seed=1

DVC train stage (every seed of one experiment of ``params.yaml``)::

    python -m pipeline.train --grid fedbug20_dir

Outputs in ``results/<name>/``: ``metrics.json`` (mean +- std over seeds), ``rounds.csv`` (per-round
mean over seeds), ``runs.csv`` (every seed and round), ``curves.png``, ``config.yaml``,
``partition/`` (stats and labels-per-client plot), ``models/seed_<s>.pt``, ``details/`` (per-seed
curves and CSV, the algorithm's local-step schedule such as FedBug's units per step). MLflow: one parent run
per experiment, one child run per seed with every round logged. A run killed midway resumes
from its last checkpoint (``engine.checkpoint_every``) when the same command is run again.

Exit status: 0 on success, 2 for a bad config (one line, nothing written), 1 if a run failed
(e.g. non-finite loss; the other seeds still run).
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fl_core.config import ConfigError, compose, to_container
from fl_core.data import DataSourceError, PartitionError
from fl_core.data.partition import partition_key, plot_label_distribution
from fl_core.engine.diagnostics import effective_update
from fl_core.engine.factory import DTYPES, build_simulator, client_data
from fl_core.engine.simulator import RunFailed, config_fingerprint
from fl_core.metrics import mean_std, summarize_run
from fl_core.models import resolve_model_name
from fl_core.tracking import Tracking, flatten, git_commit
from fl_core.paths import project_root

from .common import atomic_write, dataset_for, fail, partition_for, resolve_device, write_json, write_text

def usage() -> str:
    """The --help text; the choices are read from conf/ so it stays true to the code."""
    from fl_core.paths import conf_dir

    def opts(group):
        return "|".join(sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")))

    return f"""usage: python -m pipeline.train [KEY=VALUE ...]      one experiment from Hydra overrides
       python -m pipeline.train --grid NAME [--params FILE]   experiment NAME of params.yaml (all seeds)
       python -m pipeline.train --cfg [KEY=VALUE ...]    print the composed config and exit

Config groups (conf/): dataset, partition, model, algorithm, train, engine, tracking; presets: +experiment=NAME.
  dataset={opts("dataset")}
  partition={opts("partition")}   partition.num_clients  partition.alpha  partition.variant
  model={opts("model")}
  algorithm={opts("algorithm")}
    algorithm.name (a wrapper's base)  algorithm.wrappers  algorithm.aggregation=weighted|uniform  algorithm.eta_g
    algorithm.fedbug.gu_percentage (P)  algorithm.fedprox.mu  algorithm.fednlr.mu0|a1|a2  algorithm.fedbcgd.lam
  +experiment={opts("experiment")}
  train.rounds  train.participation  train.sampler=bernoulli|fixed  train.local_epochs  train.batch_size
  train.lr  train.weight_decay  train.grad_clip  train.augmentation  engine.executor=sequential|vectorized|auto
  engine.device  seed  name
Outputs go to results/<name>/ and the MLflow store (MLFLOW_TRACKING_URI or sqlite:///<root>/mlflow.db).
A killed run resumes from its checkpoint when the same command runs again.
"""

CURVE_KEYS = ("test_acc", "test_loss", "train_loss")


def derive_name(cfg) -> str:
    """A readable default experiment name, e.g. ``fedbug-p0.2-fedavg_dirichlet-a0.3_digits``."""
    a = cfg.algorithm
    algo = a.name
    for w in a.wrappers:
        algo = f"{w}-p{a.fedbug.gu_percentage:g}-{algo}" if w == "fedbug" else f"{w}-{algo}"
    part = cfg.partition.name
    if part == "dirichlet":
        part += f"-a{cfg.partition.alpha:g}"
    elif part == "shards":
        part += f"-s{cfg.partition.classes_per_client}"
    return f"{algo}_{part}_{cfg.dataset.name}"


def result_sections(cfg) -> Dict:
    """The config sections that determine a run's numbers (for checkpoint names)."""
    c = to_container(cfg)
    return {k: c[k] for k in ("dataset", "partition", "model", "algorithm", "train", "seed")}


def _csv(rows: List[Dict], columns: List[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in columns})
    return buf.getvalue()


def mean_curve(histories: Dict[int, List[Dict]]) -> List[Dict]:
    """Per-round mean (and std of test_acc) over seeds; rounds without evaluation keep train columns."""
    rows = []
    by_round: Dict[int, List[Dict]] = {}
    for hist in histories.values():
        for row in hist:
            by_round.setdefault(int(row["round"]), []).append(row)
    for r in sorted(by_round):
        group = by_round[r]
        out: Dict = {"round": r}
        for k in ("test_acc", "test_loss", "train_loss", "comm_up_floats", "comm_down_floats", "round_time_s"):
            vals = [g[k] for g in group if k in g]
            if vals:
                ms = mean_std(vals)
                out[k] = ms["mean"]
                if k == "test_acc":
                    out["test_acc_std"] = ms["std"]
        rows.append(out)
    return rows


def plot_curves(histories: Dict[int, List[Dict]], title: str, path: Path) -> None:
    """Accuracy, test loss and training loss per round, one line per seed and their mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    mean_rows = mean_curve(histories)
    for ax, key in zip(axes, CURVE_KEYS):
        for seed, hist in histories.items():
            pts = [(r["round"], r[key]) for r in hist if key in r]
            if pts:
                ax.plot(*zip(*pts), lw=0.8, alpha=0.45, label=f"seed {seed}")
        pts = [(r["round"], r[key]) for r in mean_rows if key in r]
        if pts:
            ax.plot(*zip(*pts), lw=2.0, color="black", label="mean")
        ax.set_xlabel("round")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)


class _Progress:
    """One progress bar per experiment (rounds x seeds)."""

    def __init__(self, name: str, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=name, unit="round", dynamic_ncols=True, mininterval=0.5,
                            file=sys.stderr)

    def __call__(self, r: int, row: Dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if "test_acc" in row:
                self.bar.set_postfix(acc=f"{row['test_acc']:.3f}", loss=f"{row['train_loss']:.3f}", refresh=False)

    def skip(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_experiment(cfgs: List, *, callbacks: Optional[list] = None) -> Dict:
    """Train every seed of one experiment and write its outputs.

    Args:
        cfgs: composed configs, one per seed, identical except for ``seed``.
        callbacks: extra ``cb(round, row)`` hooks passed to every simulator (tests).

    Returns:
        The experiment summary written to ``metrics.json``.

    Raises:
        RunFailed: only after every seed ran, if any of them failed (its reason in the message).
    """
    cfg0 = cfgs[0]
    name = cfg0.name or derive_name(cfg0)
    out_dir = Path(cfg0.results_dir) / name
    device = resolve_device(cfg0.engine.device)
    ds = dataset_for(cfg0, write_cache=False)
    part = partition_for(cfg0, ds, write_cache=False)
    # the effective update amount u = eta E |D| / (B K) of the IID-to-non-IID study (ALGORITHMS.md 10)
    u = effective_update(cfg0.train.lr, cfg0.train.local_epochs, int(sum(part.sizes)), cfg0.train.batch_size,
                         part.num_clients, cfg0.train.local_steps)
    data = client_data(ds, part, device, DTYPES[cfg0.engine.dtype])
    model_name = resolve_model_name(cfg0.model.name, cfg0.dataset.name)

    # files that describe the experiment (written before training; the run itself adds the rest)
    container = to_container(cfg0)
    container.pop("seed")
    import yaml

    write_text(out_dir / "config.yaml", yaml.safe_dump({**container, "name": name,
                                                        "seeds": [int(c.seed) for c in cfgs],
                                                        "effective_update_u": u}, sort_keys=False))
    pkey = partition_key(cfg0.partition, cfg0.dataset.name)
    write_json(out_dir / "partition" / "stats.json", part.stats())
    plot_label_distribution(part, out_dir / "partition" / "labels_per_client.png", title=pkey)

    tracking = None
    parent_id = None
    tags = {"algorithm": "", "dataset": cfg0.dataset.name, "partition": pkey, "model": model_name,
            "git_commit": git_commit(project_root()), "experiment": name,
            # with dataset.validation_fraction > 0 the test_* metrics are measured on the held-out validation split
            "eval_split": "validation" if cfg0.dataset.validation_fraction > 0 else "test"}
    if cfg0.tracking.enabled:
        tracking = Tracking(cfg0.tracking.experiment)

    schedule_files: List[Path] = []
    progress = _Progress(name, cfg0.train.rounds * len(cfgs), cfg0.engine.progress)
    histories: Dict[int, List[Dict]] = {}
    summaries: Dict[int, Dict] = {}
    failures: Dict[int, str] = {}
    algo_desc = ""
    model_d = None
    try:
        for cfg in cfgs:
            seed = int(cfg.seed)
            ckpt = None
            if cfg.engine.checkpoint_every:
                fp = config_fingerprint(result_sections(cfg))
                ckpt = Path(cfg.engine.checkpoint_dir) / name / f"seed_{seed}-{fp}.pt"
            logger = None
            sim = build_simulator(cfg, ds, part, device=device, data=data, checkpoint_path=ckpt,
                                  callbacks=[progress] + list(callbacks or []))
            algo_desc = sim.algo.describe()
            model_d = sim.spec.d
            tags["algorithm"] = algo_desc
            if not schedule_files:
                schedule_files = write_schedule(sim, part, cfg, out_dir)
            tags["executor"] = sim.executor.name
            tags["executor_reason"] = sim.executor.reason
            if cfg.engine.executor == "auto" and seed == int(cfgs[0].seed):
                print(f"executor: {sim.executor.name} ({sim.executor.reason})", file=sys.stderr)
            if tracking is not None:
                def parent(tags=dict(tags)):  # created on the first new run; a resumed run brings its own
                    return parent_id or tracking.start_parent(name, tags)

                params = {**flatten(to_container(cfg)), "model.resolved": model_name, "model.d": sim.spec.d,
                          "algorithm.describe": algo_desc, "effective_update_u": u}
                sim.logger = logger = tracking.child_logger(parent, f"{name}/seed{seed}",
                                                            {**tags, "seed": str(seed)}, params,
                                                            cfg.tracking.log_every)
            try:
                result = sim.run()
            except RunFailed as err:
                parent_id = parent_id or (logger.parent_id if logger is not None else None)
                failures[seed] = str(err)
                print(f"error: {name} seed {seed} FAILED: {err}", file=sys.stderr)
                continue
            except BaseException:
                if logger is not None:
                    logger.close("KILLED", "interrupted; run the same command again to resume")
                raise
            parent_id = parent_id or (logger.parent_id if logger is not None else None)
            progress.skip(result.resumed_from)
            histories[seed] = result.history
            summaries[seed] = summarize_run(result.history, cfg.train.target_acc, cfg.train.final_window)
            model_path = out_dir / "models" / f"seed_{seed}.pt"
            atomic_write(model_path, lambda p: torch.save(result.state_dict, p))
            if logger is not None:
                logger.log_summary({f"summary_{k}": v for k, v in summaries[seed].items()
                                    if isinstance(v, (int, float)) and v is not None})
                seed_csv = out_dir / "details" / f"seed_{seed}.csv"
                write_text(seed_csv, _csv(result.history, _history_columns(result.history)))
                seed_png = out_dir / "details" / f"seed_{seed}.png"
                plot_curves({seed: result.history}, f"{name} seed {seed}: {algo_desc}", seed_png)
                arts = [out_dir / "config.yaml", seed_csv, seed_png] + schedule_files
                if cfg.tracking.log_model:
                    arts.append(model_path)
                logger.log_artifacts(arts)
                logger.log_artifacts([out_dir / "partition" / "stats.json",
                                      out_dir / "partition" / "labels_per_client.png"], "partition")
                logger.close("FINISHED")
            sim.discard_checkpoint()
    finally:
        progress.close()

    summary = _experiment_summary(name, cfg0, algo_desc, pkey, model_name, summaries, failures, model_d)
    if histories:
        all_rows = [{"seed": s, **row} for s, h in histories.items() for row in h]
        write_text(out_dir / "runs.csv", _csv(all_rows, ["seed"] + _history_columns(all_rows)))
        mean_rows = mean_curve(histories)
        write_text(out_dir / "rounds.csv", _csv(mean_rows, _history_columns(mean_rows)))
        plot_curves(histories, f"{name}: {algo_desc}, {pkey}", out_dir / "curves.png")
    write_json(out_dir / "metrics.json", summary)
    if tracking is not None and parent_id is not None:
        tracking.log_params(parent_id, {**flatten(container), "seeds": [int(c.seed) for c in cfgs],
                                        "effective_update_u": u})
        tracking.log_artifacts(parent_id, [out_dir / "metrics.json", out_dir / "rounds.csv", out_dir / "curves.png",
                                           out_dir / "config.yaml"])
        tracking.end_parent(parent_id, "FAILED" if failures else "FINISHED")
    if failures:
        raise RunFailed("; ".join(f"seed {s}: {r}" for s, r in failures.items()))
    return summary


def write_schedule(sim, part, cfg, out_dir: Path) -> List[Path]:
    """What the algorithm does over local steps (FedBug: trainable units per step), as CSV and PNG.

    Written for the clients' distinct step counts K_i; nothing for algorithms without a schedule."""
    from fl_core.engine.executors import client_steps

    steps = [client_steps(int(n), cfg.train.batch_size, cfg.train.local_epochs, cfg.train.local_steps)
             for n in part.sizes]
    rows = sim.algo.schedule_rows(steps)
    if not rows:
        return []
    csv_path, png_path = out_dir / "details" / "schedule.csv", out_dir / "details" / "schedule.png"
    write_text(csv_path, _csv(rows, list(rows[0])))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["K_i"] for r in rows})
    shown = sorted({ks[0], ks[len(ks) // 2], ks[-1]})
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for K in shown:
        pts = [(r["step"], r["trainable_units"]) for r in rows if r["K_i"] == K]
        ax.step(*zip(*pts), where="post", label=f"K_i = {K}")
    ax.set_xlabel("local step k")
    ax.set_ylabel("trainable units m(k)")
    ax.set_title(f"{sim.algo.describe()}: units trainable per local step", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(png_path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return [csv_path, png_path]


def _history_columns(rows: List[Dict]) -> List[str]:
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _experiment_summary(name, cfg, algo_desc, pkey, model_name, summaries, failures, model_d=None) -> Dict:
    out: Dict = {"experiment": name, "algorithm": algo_desc, "dataset": cfg.dataset.name, "partition": pkey,
                 "model": model_name, "model_d": model_d, "rounds": int(cfg.train.rounds), "target_acc": float(cfg.train.target_acc),
                 "seeds": sorted(summaries), "failed_seeds": sorted(failures)}
    for key in ("final_acc", "best_acc", "final_test_loss", "final_train_loss", "rounds_to_target",
                "up_floats_to_target"):
        ms = mean_std([s[key] for s in summaries.values()])
        out[f"{key}_mean"] = ms["mean"]
        out[f"{key}_std"] = ms["std"]
    out["target_reached"] = sum(1 for s in summaries.values() if s["rounds_to_target"] is not None)
    if summaries:
        any_s = next(iter(summaries.values()))
        out["comm_up_floats"] = any_s["comm_up_floats"]
        out["comm_down_floats"] = any_s["comm_down_floats"]
    out["per_seed"] = {str(s): v for s, v in summaries.items()}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    show_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    try:
        if argv and argv[0] == "--grid":
            from .grid import load_grid

            if len(argv) < 2:
                fail("--grid needs an experiment name")
            params = Path("params.yaml")
            rest = argv[2:]
            if rest[:1] == ["--params"]:
                if len(rest) < 2:
                    fail("--params needs a file")
                params = Path(rest[1])
                rest = rest[2:]
            if rest:
                fail(f"unexpected argument {rest[0]!r} after --grid NAME (grid runs take their settings "
                     "from params.yaml)")
            cfgs = load_grid(params).compose_all(argv[1])
        else:
            bad = [a for a in argv if a.startswith("-")]
            if bad:
                fail(f"unknown option {bad[0]} (see --help)")
            cfgs = [compose(argv)]
        if show_cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfgs[0]))
            return 0
        resolve_device(cfgs[0].engine.device)
    except (ConfigError, ValueError) as err:
        fail(str(err))
    try:
        summary = run_experiment(cfgs)
    except RunFailed:
        return 1  # each failed seed already printed its one-line reason
    except (DataSourceError, PartitionError) as err:
        fail(str(err))
    out = Path(cfgs[0].results_dir) / summary["experiment"]
    fa, fs = summary["final_acc_mean"], summary["final_acc_std"]
    print(f"{summary['experiment']}: final test accuracy {fa:.4f} +- {fs:.4f} over {len(summary['seeds'])} "
          f"seed(s); results in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
