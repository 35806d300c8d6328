"""What a sweep leaves behind: the MLflow parent run, the test run of the best configuration,
``best.yaml``, ``summary.md|json``, ``trials.csv`` and the plots (all written atomically)."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from fl_core.config import ConfigError
from fl_core.paths import project_root
from pipeline.files import atomic_write, write_text
from fl_core.schema import format_value

from .settings import Settings
from .storage import owner_tags, shown_storage
from .study import quiet_optuna
from .trials import DataCache, error_reason, round_metrics, train_seeds
from .spaces import (VALIDATION_FRACTION, Space, display_path, make_override, merge_overrides, override_key,
                     overrides_mapping)

# =========================================================================== MLflow parent run


def ensure_parent_run(study, settings: Settings, space: Space, tracking) -> Optional[str]:
    """The study's MLflow parent run: the one recorded in the study's user attribute
    ``mlflow_parent_run_id`` if it still exists (set RUNNING again, owned by this process: its
    :func:`~sweeps.storage.owner_tags` replaced, a ``fl.end_reason`` of an earlier end dropped),
    else a new one; None without MLflow."""
    if tracking is None:
        return None
    from fl_core.store.tracking import git_commit

    run_id = study.user_attrs.get("mlflow_parent_run_id")
    if run_id:
        try:
            run = tracking.client.get_run(run_id)
            tracking.client.update_run(run_id, status="RUNNING")
            if "fl.end_reason" in run.data.tags:  # ended as orphaned by end_orphaned_runs: running again
                tracking.client.delete_tag(run_id, "fl.end_reason")
            for k, v in owner_tags().items():
                tracking.client.set_tag(run_id, k, v)
        except Exception:  # another store, or the run was deleted: start a new parent
            run_id = None
    if not run_id:
        tags = {"sweep_role": "study", "optuna_study": settings.study_name, "space": space.name,
                "objectives": ",".join(settings.objectives), "git_commit": git_commit(project_root()),
                **owner_tags()}
        run_id = tracking.start_parent(f"sweep-{settings.study_name}", tags)
        tracking.log_params(run_id, {"space": space.name, "space_file": str(space.path), "seeds": settings.seeds,
                                     "objectives": ",".join(settings.objectives),
                                     "base_overrides": " ".join(space.base), "overrides": " ".join(settings.overrides),
                                     "validation_fraction": VALIDATION_FRACTION})
        study.set_user_attr("mlflow_parent_run_id", run_id)
    tags = {"sampler": settings.sampler, "pruner": settings.pruner, "storage": shown_storage(settings.storage)}
    for k, v in tags.items():
        tracking.client.set_tag(run_id, k, v)
    return run_id


# =========================================================================== the best configuration


def best_trial(study, settings: Settings):
    """The best COMPLETE trial: the highest accuracy (for several objectives: the highest accuracy
    on the Pareto front); None if no trial completed."""
    if settings.multi:
        front = study.best_trials
        i = settings.objectives.index("acc")
        return max(front, key=lambda t: t.values[i]) if front else None
    try:
        return study.best_trial
    except ValueError:
        return None


def cached_test(study, settings: Settings, trial) -> Optional[Dict[str, Any]]:
    """The test result of ``trial`` stored by an earlier :func:`test_best` (same seeds), else None."""
    cached = study.user_attrs.get("best_test")
    if cached and cached.get("trial") == trial.number and cached.get("seeds") == settings.seeds:
        return cached
    return None


def test_best(study, settings: Settings, trial, tracking=None) -> Dict[str, Any]:
    """Retrain the best trial's configuration on the full training set
    (``dataset.validation_fraction=0``) for the same seeds and measure the test accuracy.

    The result is cached in the study's user attribute ``best_test`` (keyed by trial number and
    seeds, see :func:`cached_test`), so a resumed study with an unchanged best does not train again.

    Returns:
        {"trial", "test_acc" (mean over seeds), "per_seed", "seeds", "overrides"}.
    """
    cached = cached_test(study, settings, trial)
    if cached:
        return cached
    overrides = merge_overrides(trial.user_attrs["overrides"], ["dataset.validation_fraction=0.0"])
    logger = None
    if tracking is not None and settings.parent_run_id:
        logger = tracking.child_logger(settings.parent_run_id, f"{settings.study_name}/best-test",
                                       {"sweep_role": "best_test", "optuna_study": settings.study_name,
                                        "optuna_trial": str(trial.number), **owner_tags()},
                                       {"sweep.overrides": " ".join(overrides)}, 10_000)
        logger.open(None)
    holder: Dict[str, int] = {"R": 1}

    def on_config(cfg, algo):
        holder["R"] = int(cfg["train"]["rounds"])

    def on_round(i, r, row):
        if logger is not None:
            logger.log_round(i * holder["R"] + r, round_metrics(row, "test"))

    try:
        res = train_seeds(overrides, settings.seeds, DataCache(1), on_round=on_round, on_config=on_config,
                          threads=settings.threads)
    except BaseException as err:
        if logger is not None:
            logger.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", repr(err))
        raise
    out = {"trial": trial.number, "test_acc": res.mean_acc, "per_seed": res.final_acc, "seeds": settings.seeds,
           "overrides": overrides}
    if logger is not None:
        logger.log_summary({"best_test_acc": res.mean_acc})
        logger.close("FINISHED")
    study.set_user_attr("best_test", out)
    return out


def command_path(path: Path) -> str:
    """``path`` for a command run from the project root: relative to it when inside, else absolute."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(project_root()))
    except ValueError:
        return str(p)


def _pinned_for_dvc(overrides: Sequence[str], params_yaml: Path) -> List[str]:
    """``overrides`` plus, for every shared key of ``params_yaml`` they do not set, that key at the
    value it has in the configuration of ``overrides`` (the grid applies its shared sections first)."""
    from omegaconf import OmegaConf

    from fl_core.config import compose
    from pipeline.grid import load_grid

    try:
        shared = load_grid(params_yaml).shared
    except (ConfigError, OSError, yaml.YAMLError):
        return list(overrides)
    cfg = compose(list(overrides), user=())  # the best trial's overrides, held to the rule by check_space
    have = {override_key(o) for o in overrides}
    pins = []
    for ov in shared:
        key = override_key(ov)
        if key not in have:
            if "." not in key:  # a config group the grid chooses (partition: {name: shards}): pin the choice
                pins.append(make_override(key, OmegaConf.select(cfg, f"{key}.name", default=None)))
                continue
            value = OmegaConf.select(cfg, key, default=None)
            pins.append(make_override(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value))
    return list(overrides) + pins


def write_best_yaml(path: Path, settings: Settings, trial, value_text: str, test: Optional[Dict]) -> Dict[str, str]:
    """Write the best configuration in the params.yaml grid format (two experiments: ``<study>_best``
    on the full training set, evaluated on the test set, and ``<study>_best_val`` with the
    validation split, which reproduces the tuned value).

    Returns:
        Commands that use it, to run from the project root (paths as :func:`command_path`):
        ``train``, ``train_val``, ``dvc`` (a ``dvc exp run -S`` line) and ``overrides`` (one
        ``pipeline.train`` command line with overrides).
    """
    name = re.sub(r"[^A-Za-z0-9_-]", "_", settings.study_name) + "_best"
    val = list(trial.user_attrs["overrides"])
    full = merge_overrides(val, ["dataset.validation_fraction=0.0"])
    doc = {"seeds": list(settings.seeds),
           "experiments": {name: overrides_mapping(full), f"{name}_val": overrides_mapping(val)}}
    shown = shlex.quote(command_path(path))
    dvc_entry = overrides_mapping(_pinned_for_dvc(full, project_root() / "params.yaml"))
    entry = "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in dvc_entry.items()) + "}"
    # the trials ran with --threads torch threads: another count changes the losses in the last digits
    # (and, over many rounds, possibly an accuracy), so the commands pin it for an exact reproduction
    python = f"OMP_NUM_THREADS={settings.threads} python -m pipeline.train"
    cmds = {
        "train": f"{python} --grid {name} --params {shown}",
        "train_val": f"{python} --grid {name}_val --params {shown}",
        "overrides": f"{python} " + " ".join(shlex.quote(o) for o in full + [make_override("seed", settings.seeds[0])]),
        "dvc": "dvc exp run -S " + shlex.quote(f"++experiments.{name}={entry}"),
    }
    test_text = f"{test['test_acc']:.4f}" if test else "not measured"
    header = [f"Best configuration of Optuna study '{settings.study_name}' (trial {trial.number}): {value_text}",
              f"on the validation split (dataset.validation_fraction={VALIDATION_FRACTION}), seeds {settings.seeds}.",
              f"Test accuracy of {name} (full training set, test split): {test_text}.",
              "Grid format of params.yaml (pipeline/grid.py). Run from the project root:",
              f"  {cmds['train']}        # test accuracy",
              f"  {cmds['train_val']}    # reproduces the tuned value",
              "Into the DVC grid (params.yaml's shared keys pinned to the tuned configuration's values):",
              f"  {cmds['dvc']}"]
    write_text(path, "".join(f"# {h}\n" for h in header) + yaml.safe_dump(doc, sort_keys=False, width=100))
    return cmds


# =========================================================================== plots and summary


def write_plots(study, settings: Settings, out: Path) -> Tuple[List[Path], List[str]]:
    """Optimisation history, parameter importances, parallel coordinates, intermediate values
    (one objective) or the Pareto front (several), as PNG files in ``out``.

    Returns:
        (files written, one-line notes for plots skipped, e.g. importances with < 2 complete trials).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    quiet_optuna()
    i = settings.objectives.index("acc")
    acc = {"target": (lambda t: t.values[i]), "target_name": "val_acc"} if settings.multi else \
        {"target_name": "val_acc"}
    plots: Dict[str, Callable[[], Any]] = {
        "history": lambda: ovm.plot_optimization_history(study, **acc),
        "importances": lambda: ovm.plot_param_importances(study, **acc),
        "parallel_coordinate": lambda: ovm.plot_parallel_coordinate(study, **acc),
    }
    if settings.multi:
        plots["pareto_front"] = lambda: ovm.plot_pareto_front(
            study, target_names=[{"acc": "val_acc", "uplink": "uplink (d)"}[o] for o in settings.objectives])
    else:
        plots["intermediate_values"] = lambda: ovm.plot_intermediate_values(study)
    files, notes = [], []
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    for name, make in plots.items():
        if name == "importances" and len(complete) < 2:
            notes.append(f"{name}: skipped (needs at least 2 complete trials, have {len(complete)})")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = make()
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            path = out / f"{name}.png"
            atomic_write(path, lambda p, fig=fig: fig.savefig(p, dpi=100, format="png"))
            files.append(path)
        except Exception as err:  # a plot is a convenience: report and go on
            notes.append(f"{name}: skipped ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        finally:
            plt.close("all")
    return files, notes


def _fmt_params(params: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def summarize(study, settings: Settings, space: Space, best, test: Optional[Dict], runtime_s: float,
              status: str) -> Dict[str, Any]:
    """The summary written to summary.json (and rendered by :func:`summary_markdown`).

    ``status``: finished | interrupted | failed (this invocation).
    """
    trials = study.trials
    states = {s: sum(1 for t in trials if t.state.name == s) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    out: Dict[str, Any] = {
        "study": settings.study_name, "space": space.name, "space_file": str(space.path),
        "storage": shown_storage(settings.storage), "objectives": settings.objectives,
        "directions": settings.directions(),
        "sampler": settings.sampler, "pruner": "none" if settings.multi else settings.pruner,
        "batch": settings.batch, "seeds": settings.seeds, "overrides": settings.overrides, "trials": len(trials),
        "complete": states["COMPLETE"], "pruned": states["PRUNED"], "failed": states["FAIL"],
        "running": states["RUNNING"], "runtime_s": round(runtime_s, 1),
        "pruned_by": {kind: sum(1 for t in trials if t.state.name == "PRUNED"
                                and str(t.user_attrs.get("reason", "")).startswith(kind))
                      for kind in ("pruned", "diverged", "infeasible")},
        "failed_by": {kind: sum(1 for t in trials if t.state.name == "FAIL"
                                and str(t.user_attrs.get("reason", "")).startswith(kind))
                      for kind in ("error", "interrupted", "stale")},
        "trial_time_s": round(sum(t.duration.total_seconds() for t in trials if t.duration is not None), 1),
        "status": status, "interrupted": status == "interrupted", "mlflow_parent_run_id": settings.parent_run_id,
        "mlflow_experiment": settings.experiment,
    }
    if best is not None:
        out["best"] = {"trial": best.number, "values": best.values, "params": best.params,
                       "val_acc": best.values[settings.objectives.index("acc")],
                       "val_acc_per_seed": best.user_attrs.get("val_acc_per_seed"),
                       "uplink_d": best.user_attrs.get("uplink_d"), "algorithm": best.user_attrs.get("algorithm"),
                       "overrides": best.user_attrs.get("overrides")}
        out["best_value"] = best.values[0] if not settings.multi else best.values
        out["best_test_acc"] = test["test_acc"] if test else None
    if settings.multi:
        out["pareto_front"] = [{"trial": t.number, "values": t.values, "params": t.params,
                                "algorithm": t.user_attrs.get("algorithm")}
                               for t in sorted(study.best_trials, key=lambda t: t.number)]
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    acc_i = settings.objectives.index("acc")
    for key in space.conditional:
        per: Dict[str, Any] = {}
        for t in complete:
            choice = format_value(t.params.get(key))
            if choice not in per or t.values[acc_i] > per[choice]["val_acc"]:
                per[choice] = {"trial": t.number, "val_acc": t.values[acc_i], "params": t.params}
        out[f"best_per_{key}"] = per
    return out


def summary_markdown(s: Dict[str, Any], top: List[Any], objectives: List[str]) -> str:
    """A readable summary (also printed at the end of a sweep)."""
    lines = [f"# Sweep `{s['study']}` (space `{s['space']}`)", "",
             "| trials | complete | pruned | failed | running | this run | trial time |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['trials']} | {s['complete']} | {s['pruned']} | {s['failed']} | {s['running']} | "
             f"{s['runtime_s']:.0f} s | {s['trial_time_s']:.0f} s |", ""]
    by = s["pruned_by"]
    if s["pruned"]:
        lines += [f"Pruned: {by['pruned']} by the pruner, {by['diverged']} diverged (non-finite loss), "
                  f"{by['infeasible']} infeasible configurations.", ""]
    fb = s["failed_by"]
    if s["failed"]:
        lines += [f"Failed: {fb['error']} by an error (reason in trials.csv), {fb['interrupted']} interrupted, "
                  f"{fb['stale']} stale (left RUNNING by a killed process).", ""]
    lines.append(f"Objective: {', '.join(f'{o} ({d})' for o, d in zip(objectives, s['directions']))}; "
                 f"val_acc = mean over seeds {s['seeds']} of the mean of the last `train.final_window` "
                 f"evaluations on the validation split; uplink in units of d (model size).")
    if s["status"] == "interrupted":
        lines.append("**Interrupted** (Ctrl-C): the study is intact; run the same command to continue.")
    elif s["status"] == "failed":
        lines.append(f"**Stopped by an error**: {s.get('error', 'see the log')}. The trials done are kept in the "
                     "study; run the same command to continue.")
    lines.append("")
    lines += _best_markdown(s, objectives)
    for key in [k for k in s if k.startswith("best_per_")]:
        lines += ["", f"Best per `{key[len('best_per_'):]}`:", "", "| value | trial | val_acc | params |",
                  "|---|---:|---:|---|"]
        for choice, e in sorted(s[key].items(), key=lambda kv: -kv[1]["val_acc"]):
            lines.append(f"| {choice} | {e['trial']} | {e['val_acc']:.4f} | {_fmt_params(e['params'])} |")
    if "pareto_front" in s:
        lines += ["", "Pareto front:", "", "| trial | " + " | ".join(objectives) + " | params |",
                  "|---:|" + "---:|" * len(objectives) + "---|"]
        for e in s["pareto_front"]:
            lines.append(f"| {e['trial']} | " + " | ".join(f"{v:.4f}" for v in e["values"])
                         + f" | {_fmt_params(e['params'])} |")
    if top:
        lines += ["", "Top trials:", "", "| trial | " + " | ".join(objectives) + " | params |",
                  "|---:|" + "---:|" * len(objectives) + "---|"]
        for t in top:
            lines.append(f"| {t.number} | " + " | ".join(f"{v:.4f}" for v in t.values)
                         + f" | {_fmt_params(t.params)} |")
    return "\n".join(lines) + "\n"


def _best_markdown(s: Dict[str, Any], objectives: List[str]) -> List[str]:
    """The summary's lines on the best trial (values, algorithm, params, commands to rerun it)."""
    b = s.get("best")
    if b is None:
        return ["No complete trial yet."]
    test = s.get("best_test_acc")
    head = f"**Best trial {b['trial']}**: val_acc {b['val_acc']:.4f}"
    if "uplink" in objectives:
        head += f", uplink {b['uplink_d']:.2f} d"
    head += f", test accuracy (best_test_acc) {test:.4f}" if test is not None else ", test accuracy not measured"
    lines = [head, "", f"- algorithm: `{b.get('algorithm')}`", f"- params: {_fmt_params(b['params'])}",
             f"- overrides: `{' '.join(b.get('overrides') or [])}`"]
    cmds = s.get("commands") or {}
    if cmds:
        lines += ["- from the project root:", f"  - pipeline: `{cmds['train']}`",
                  f"  - same, one seed: `{cmds['overrides']}`", f"  - DVC grid: `{cmds['dvc']}`"]
    return lines


def finish_study(study, settings: Settings, space: Space, out: Path, t_start: float, *, status: str,
                 run_test: bool, tracking=None, error: Optional[str] = None) -> Tuple[Dict[str, Any], str]:
    """After the trials: test the best configuration (``run_test``; else a cached result is reported),
    write best.yaml, plots, trials.csv and the summary, then log them to the MLflow parent run and end it,
    unless trials of the study are still RUNNING (other processes or machines on the same storage): then the
    parent run stays RUNNING, for the process that finishes the last trial to end.

    Every file is written before MLflow is touched, and an error or Ctrl-C in the test run only
    drops the test accuracy, so nothing computed is lost.

    Args:
        status: finished | interrupted | failed: how the trials ended (the parent run ends FINISHED,
            KILLED or FAILED accordingly).
        error: with status failed, the one-line error (shown in the summary).

    Returns:
        (the summary, the final status: ``status``, or interrupted/failed if the test run or MLflow
        was interrupted or failed).
    """
    best = best_trial(study, settings)
    test, status, error = _best_test(study, settings, best, run_test, tracking, status, error)
    summary = summarize(study, settings, space, best, test, time.perf_counter() - t_start, status)
    if error:
        summary["error"] = error
    plots, notes = _write_outputs(study, settings, out, summary, best, test)
    for n in notes:
        print(f"note: plot {n}", file=sys.stderr)
    if not settings.quiet:
        print(f"outputs: {display_path(out)}/", file=sys.stderr)
    if tracking is not None and settings.parent_run_id:
        status = _end_parent_run(tracking, settings, study, summary, best, test, out, plots, status)
    return summary, status


def _best_test(study, settings: Settings, best, run_test: bool, tracking, status: str,
               error: Optional[str]) -> Tuple[Optional[Dict[str, Any]], str, Optional[str]]:
    """(the best trial's test result or None, status, error): the cached result, else (``run_test`` and
    status finished) a test run; Ctrl-C in it makes status interrupted, an error makes it failed with
    that error (printed on stderr)."""
    test = cached_test(study, settings, best) if best is not None else None
    if best is not None and test is None and run_test and status == "finished":
        try:
            test = test_best(study, settings, best, tracking)
        except KeyboardInterrupt:
            status = "interrupted"
        except Exception as err:
            reason, where = error_reason(err)
            print(f"error: test run of the best configuration: {reason} (at {where})", file=sys.stderr)
            status, error = "failed", f"test run of trial {best.number}: {reason}"
    return test, status, error


#: every file a sweep writes into its output folder (``--out``, default ``sweeps/results/<study>/``): a folder holding
#: anything else is not the sweep's to write into (fl_core.store.owned)
OUTPUT_FILES = ("best.yaml", "trials.csv", "summary.md", "summary.json", "history.png", "importances.png",
                "parallel_coordinate.png", "intermediate_values.png", "pareto_front.png")


def _write_outputs(study, settings: Settings, out: Path, summary: Dict[str, Any], best,
                   test: Optional[Dict]) -> Tuple[List[Path], List[str]]:
    """Write best.yaml (with a best trial), the plots, trials.csv, summary.md and summary.json into ``out``
    (``summary`` gains ``commands``, ``plots``, ``plot_notes``) and print summary.md; (plot files, plot notes)."""
    if best is not None:
        acc = best.values[settings.objectives.index("acc")]
        summary["commands"] = write_best_yaml(out / "best.yaml", settings, best, f"val_acc {acc:.4f}", test)
    plots, notes = write_plots(study, settings, out)
    summary["plots"] = [p.name for p in plots]
    summary["plot_notes"] = notes
    df = study.trials_dataframe(attrs=("number", "values" if settings.multi else "value", "state", "duration",
                                       "params", "user_attrs"))
    atomic_write(out / "trials.csv", lambda p: df.to_csv(p, index=False))
    acc_i = settings.objectives.index("acc")
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    top = sorted(complete, key=lambda t: -t.values[acc_i])[:5]
    md = summary_markdown(summary, top, settings.objectives)
    write_text(out / "summary.md", md)
    write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    print(md, end="")
    return plots, notes


def _end_parent_run(tracking, settings: Settings, study, summary: Dict[str, Any], best, test, out: Path,
                    plots: List[Path], status: str) -> str:
    """Log the outputs to the MLflow parent run and end it, unless trials still run (:func:`_log_parent`); returns
    ``status``, or failed if MLflow failed (then the parent run is ended FAILED if it still can be)."""
    try:
        _log_parent(tracking, settings, study, summary, best, test, out, plots, status)
    except Exception as err:  # the files are written: say so and end with an error
        reason, where = error_reason(err)
        print(f"error: MLflow parent run {settings.parent_run_id}: {reason} (at {where}); the outputs in "
              f"{display_path(out)}/ are complete", file=sys.stderr)
        status = "failed"
        try:
            tracking.end_parent(settings.parent_run_id, "FAILED")
        except Exception:
            pass
    return status


def _log_parent(tracking, settings: Settings, study, summary: Dict[str, Any], best, test, out: Path,
                plots: List[Path], status: str) -> None:
    """Metrics (at step = number of trials), tags and the output files to the parent run, which then ends with
    ``status`` (FINISHED | KILLED | FAILED), or stays RUNNING while ``summary["running"]`` trials run."""
    from mlflow.entities import Metric

    metrics = {"trials_complete": summary["complete"], "trials_pruned": summary["pruned"],
               "trials_failed": summary["failed"]}
    if best is not None:
        metrics["best_val_acc"] = summary["best"]["val_acc"]
        if test:
            metrics["best_test_acc"] = test["test_acc"]
    ts = int(time.time() * 1000)
    tracking.client.log_batch(settings.parent_run_id,
                              metrics=[Metric(k, float(v), ts, len(study.trials)) for k, v in metrics.items()])
    if best is not None:
        tracking.client.set_tag(settings.parent_run_id, "best_trial", str(best.number))
    if summary.get("error"):
        tracking.client.set_tag(settings.parent_run_id, "failure_reason", summary["error"][:5000])
    files = [out / n for n in ("summary.md", "summary.json", "best.yaml", "trials.csv")] + plots
    tracking.log_artifacts(settings.parent_run_id, files)
    if summary["running"]:  # trials of other processes (other machines) still run: the last one ends the run
        print(f"note: {summary['running']} trial(s) of the study still RUNNING (other processes or machines, or "
              "left by a killed one): the MLflow parent run stays RUNNING; the process that ends the last one "
              "ends it", file=sys.stderr)
        return
    tracking.end_parent(settings.parent_run_id,
                        {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))
