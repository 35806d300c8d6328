"""Python API: run an experiment from a notebook or a script and get its numbers back.

    from pipeline.api import run
    fedavg = run(["partition=dirichlet", "partition.alpha=0.1"], seeds=(1, 2))
    scaffold = run(["partition=dirichlet", "partition.alpha=0.1", "algorithm=scaffold"], seeds=(1, 2))
    print(fedavg.summary["final_acc_mean"], scaffold.summary["final_acc_mean"])
    fedavg.history.groupby("round").test_acc.mean().plot()

``overrides`` are the Hydra overrides of ``python -m pipeline.train`` (``conf/``). With
``write=False`` (the default) nothing is written and nothing is tracked: the seeds train in this
process and the result lives in memory. With ``write=True`` the experiment runs exactly as the CLI
runs it (``results/<name>/``, MLflow, checkpoints, resume; :func:`pipeline.observer.run_experiment`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


@dataclass
class ExperimentResult:
    """What :func:`run` returns.

    Attributes:
        history: pandas DataFrame, one row per (seed, round): ``seed``, ``round`` and every metric the
            run logged (``test_acc`` as a fraction in [0, 1], ``test_loss``, ``train_loss``, ``lr``,
            ``client_acc_mean`` / ``_std`` / ``_worst10``: the global model's accuracy on each client's
            label distribution, fractions; ``comm_up_floats`` / ``comm_down_floats`` in floats per
            client, cumulative, ...).
        summary: mean and std over the seeds that finished (``final_acc_mean``, ``final_acc_std``,
            ``best_acc_*``, ``rounds_to_target_*``, ``up_floats_to_target_*``, ``final_client_acc_mean_*``,
            ``final_client_acc_worst10_*``), ``failures`` {seed: reason}
            and ``per_seed`` (each seed's own summary); with ``write=True`` and tracking, ``mlflow_run_id``: the
            experiment's MLflow parent run (its children are the seeds).
        models: {seed: final ``state_dict``} of the seeds that finished.
        config: the resolved config of the first seed (a plain dict; ``seed`` differs per seed).
    """

    history: Any
    summary: Dict[str, Any]
    models: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)


def run(overrides: Sequence[str] = (), seeds: Sequence[int] = (1, 2, 3), *, write: bool = False,
        track: Optional[bool] = None, progress: Optional[bool] = None,
        on_round: Optional[Callable[[int, int, Dict[str, Any]], None]] = None) -> ExperimentResult:
    """Train one experiment (``overrides``) for every seed in ``seeds`` and return its results.

    Args:
        overrides: Hydra overrides, e.g. ``["algorithm=fedprox", "algorithm.fedprox.mu=0.01"]``; a
            ``seed=`` override is not allowed (use ``seeds``).
        seeds: the run seeds.
        write: False: train in memory, write no file; True: run as ``python -m pipeline.train`` does
            (outputs under ``results/<name>/``, checkpoints, MLflow when tracking is enabled).
        track: with ``write=True``, override ``tracking.enabled`` (None keeps the config's value).
            Without writing nothing is tracked, so ``track=True`` is refused there.
        progress: a progress bar over all seeds' rounds (tqdm's notebook-aware ``tqdm.auto``, on stderr); None keeps
            ``engine.progress`` (true by default), False turns it off.
        on_round: called as ``on_round(seed, round, row)`` after every trained round of every seed, ``row`` that
            round's metrics (``test_acc`` a fraction, ``train_loss``, ... as in ``history``); for live plots or early
            looks. A round read back from a finished run is not trained again and not reported.

    The runs use ``engine.threads`` torch threads (1 by default); the caller's thread count is restored afterwards.

    Returns:
        :class:`ExperimentResult`.

    Raises:
        fl_core.config.ConfigError: a bad override or value (one line naming the key), a ``seed=``
            override, no seeds, or ``track=True`` without ``write``.
        fl_core.data.DataSourceError, fl_core.data.PartitionError: unreadable data or a partition that
            cannot be built.
        fl_core.store.envfail.EnvironmentFailure, OSError: with ``write=True``, the environment failed (``results_dir`` or
            ``engine.checkpoint_dir`` a file or not writable, a full disk); :func:`fl_core.store.envfail.classify` gives
            the one line, and the same call again resumes (docs/reliability.md, When the environment fails).
    """
    import pandas as pd

    from fl_core.config import ConfigError, compose, to_container

    overrides = list(overrides)
    if any(o.split("=", 1)[0].lstrip("+~") == "seed" for o in overrides):
        raise ConfigError("seed: pass the seeds as run(..., seeds=(1, 2, 3)), not as an override")
    if not seeds:
        raise ConfigError("seeds: at least one seed is needed")
    seeds = [int(s) for s in seeds]
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"seeds: seed {twice[0]} is given more than once (each seed is one run of the mean "
                          "+- std)")
    if track and not write:
        raise ConfigError("track=True needs write=True (an in-memory run is not tracked)")
    extra = [] if track is None else [f"tracking.enabled={'true' if track else 'false'}"]
    if progress is not None:
        extra.append(f"engine.progress={'true' if progress else 'false'}")
    cfgs = [compose(overrides + extra + [f"seed={int(s)}"]) for s in seeds]

    import torch

    threads = torch.get_num_threads()  # the runs use engine.threads; the caller's count comes back afterwards
    try:
        if write:
            from pipeline.observer import run_experiment

            summary = run_experiment(cfgs, adhoc=True, on_round=on_round)
            histories, models = _read_back(cfgs[0], summary)
        else:
            summary, histories, models = _in_memory(cfgs, on_round)
    finally:
        torch.set_num_threads(threads)
    rows = [{"seed": s, **row} for s, hist in histories.items() for row in hist]
    history = pd.DataFrame(rows)
    config = to_container(cfgs[0])
    return ExperimentResult(history=history, summary=summary, models=models, config=config)


def _in_memory(cfgs: List, on_round: Optional[Callable] = None) -> tuple:
    """Train every seed in this process without files or tracking, with a progress bar when ``engine.progress``;
    (summary, histories, models)."""
    from fl_core import progress
    from fl_core.experiment import resolve
    from fl_core.metrics import summarize_run, summarize_seeds

    from .experiment import ExperimentRunner, Observer, OnRound

    exp = resolve(cfgs)
    cfg0 = exp.cfg0
    runner = ExperimentRunner(exp)
    histories, models, summaries, failures = {}, {}, {}, {}
    bar = progress.bar(total=int(cfg0.train.rounds) * len(exp.seeds), desc=str(cfg0.name or "run"), unit="round",
                       enabled=bool(cfg0.engine.progress))  # None off a terminal
    observers: List[Observer] = [] if bar is None else [OnRound(lambda seed, r, row: bar.update(1))]
    if on_round is not None:
        observers.append(OnRound(on_round))
    try:
        runs = runner.train(exp.configs, observers)
    finally:
        if bar is not None:
            bar.close()
    for run in runs:
        histories[run.seed] = run.history
        if run.failure is not None:
            failures[run.seed] = str(run.failure)
            continue
        models[run.seed] = run.result.state_dict
        summaries[run.seed] = summarize_run(run.history, run.cfg.train.target_acc, run.cfg.train.final_window)
    return summarize_seeds(summaries, failures), histories, models


def _read_back(cfg0, summary: Dict) -> tuple:
    """Histories and models of a written experiment, from its ``details/`` and ``models/`` files."""
    import csv
    from pathlib import Path

    out = Path(cfg0.results_dir) / summary["experiment"]
    histories, models = {}, {}
    for seed in summary.get("seeds_run") or summary.get("seeds") or []:
        path = out / "details" / f"seed_{seed}.csv"
        if path.exists():
            with open(path, newline="") as f:
                histories[int(seed)] = [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]
        model = out / "models" / f"seed_{seed}.pt"
        if model.exists():
            models[int(seed)] = torch.load(model, weights_only=True)
    return histories, models


def _num(v: str) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
