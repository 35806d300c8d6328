"""The study's sampler and pruner, and the labels that say what a sweep optimises (optuna-dashboard's first screen)."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

from fl_core.store import envfail
from fl_core.schema import format_value

from .spaces import VALIDATION_FRACTION, Space, make_override

from .settings import METRIC_NAMES, OBJECTIVES, SAMPLERS, Settings


def make_sampler(name: str, seed: Optional[int], multi: bool, conditional: bool):
    """The Optuna sampler ``name`` (one of :data:`SAMPLERS`).

    TPE is multivariate with constant liar (parallel workers); ``group`` decomposition is switched
    on for spaces with conditional parameters.

    Raises:
        ValueError: CMA-ES with several objectives.
    """
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=conditional, constant_liar=True)
    if name == "cmaes":
        if multi:
            raise ValueError("--sampler cmaes handles one objective only (use tpe, nsga2, gp or random)")
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


def parse_pruner(spec: str) -> Tuple[str, Optional[float]]:
    """``median`` | ``hyperband`` | ``none`` | ``threshold:X`` (prune when val_acc < X) -> (kind, X).

    Raises:
        ValueError: anything else.
    """
    if spec in ("median", "hyperband", "none"):
        return spec, None
    if spec.startswith("threshold:"):
        try:
            x = float(spec.split(":", 1)[1])
        except ValueError:
            x = float("nan")
        if 0.0 <= x <= 1.0:
            return "threshold", x
    raise ValueError(f"--pruner must be median, hyperband, none or threshold:X (X in [0, 1]), got {spec!r}")


def make_pruner(spec: str, rounds: int, num_seeds: int, multi: bool):
    """The pruner for reports at steps 1 .. num_seeds * rounds (see the module docstring).

    Warm-up: Optuna prunes at steps >= ``rounds // 3`` only; steps count on over the seeds
    (``seed_index * rounds + round``), so the warm-up covers seed 1's rounds 1 .. rounds // 3 - 1
    and nothing of the later seeds (none at all for rounds < 6).
    median: no pruning before 5 trials are COMPLETE nor during the warm-up; the trial's best value
    so far (over all its steps) is compared with the median of the complete trials at the same step;
    hyperband: resources from rounds // 4 to num_seeds * rounds steps, reduction factor 3, no warm-up;
    threshold:X: prune as soon as an evaluated validation accuracy is below X (after the same
    warm-up as median). Multi-objective studies get no pruner.

    Raises:
        ValueError: see :func:`parse_pruner`.
    """
    import optuna

    kind, x = parse_pruner(spec)
    warmup = max(0, rounds // 3)
    if multi or kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=warmup)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, rounds // 4), max_resource=num_seeds * rounds,
                                              reduction_factor=3)
    return optuna.pruners.ThresholdPruner(lower=x, n_warmup_steps=warmup)


def _not_sqlalchemy_fallback(record) -> bool:
    """A logging filter: False for Optuna's warning that it retries a query of all trials another way after a
    SQLAlchemy error (the query repeats the IN list), which on a lost database precedes the error itself and on a
    large study only announces a slower query."""
    return not str(record.msg).startswith("Caught an error from sqlalchemy")


def quiet_optuna() -> None:
    """Optuna's log at WARNING, without its experimental warnings, the heartbeat warning of explicit ask and tell,
    and (unless ``--debug`` / ``FL_DEBUG=1``) the multi-line warning of its all-trials query's fallback."""
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not envfail.debug():
        rdb = logging.getLogger("optuna.storages._rdb.storage")
        if _not_sqlalchemy_fallback not in rdb.filters:
            rdb.addFilter(_not_sqlalchemy_fallback)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the sweep asks and tells its trials and beats their heartbeat itself (heartbeat)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def sampler_and_pruner(settings: Settings, space: Space, worker: int = 0) -> Dict[str, Any]:
    """``sampler`` (seeded ``sampler_seed + worker``) and ``pruner`` keyword arguments of
    ``optuna.create_study`` / ``load_study`` for this process.

    Raises:
        ValueError: see :func:`make_sampler`.
    """
    seed = None if settings.sampler_seed is None else settings.sampler_seed + worker
    return {"sampler": make_sampler(settings.sampler, seed, settings.multi, bool(space.conditional)),
            "pruner": make_pruner(settings.pruner, settings.rounds, len(settings.seeds), settings.multi)}


def _param_text(p) -> str:
    """``"float [0.005, 0.5] log"``, ``"int [1, 3]"``, ``"fedavg | fedprox"``: one parameter's distribution."""
    if p.kind == "categorical":
        return " | ".join(format_value(c) for c in p.choices)
    scale = " log" if p.log else (f" step {p.step:g}" if p.step is not None else "")
    return f"{p.kind} [{p.low:g}, {p.high:g}]{scale}"


def _pruning_text(settings: Settings) -> str:
    """What the pruner of ``settings`` does, in the words of docs/sweeps.md (How trials end, Pruning steps)."""
    kind, x = parse_pruner(settings.pruner)
    r, warmup = settings.rounds, max(0, settings.rounds // 3)
    when = f"from step {warmup} on" if warmup > 0 else "at every step"
    reasons = ("diverged (non-finite loss) or infeasible (a combination that does not build)")
    if settings.multi:
        return ("none: multi-objective studies cannot prune (no intermediate values); a PRUNED trial's user "
                "attribute reason starts with " + reasons)
    reasons = "a PRUNED trial's user attribute reason starts with pruned (the pruner), " + reasons
    if kind == "none":
        rule = "none; "
    elif kind == "median":
        rule = (f"median: stops a trial whose best val_acc so far is below the median of the COMPLETE trials at "
                f"the same step, {when} once 5 trials are COMPLETE; ")
    elif kind == "hyperband":
        rule = (f"hyperband: budgets from {max(1, r // 4)} to {len(settings.seeds) * r} steps, reduction factor 3; ")
    else:
        rule = f"threshold: stops a trial as soon as val_acc < {x:g}, {when}; "
    return (rule + f"step = seed_index * {r} + round (val_acc of every evaluated round: the intermediate values); "
            + reasons)


def study_labels(settings: Settings, space: Space) -> Dict[str, str]:
    """The study's user attributes that say what a sweep optimises (:func:`label_study`), as text.

    Keys: ``objective`` (each objective's name, direction and meaning), ``search_space`` (every searched
    override with its distribution, ``;`` between them; a conditional branch's as ``if algorithm=fedbug: ...``),
    ``base`` (the overrides of the base experiment: the space's base, the command line, the validation split),
    ``pruning`` (the pruner of the latest invocation, what a step is, how a PRUNED trial's reason reads) and
    ``space`` (the space's name and description).
    """
    seeds = settings.seeds
    over = f"seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    meaning = {"acc": (f"validation accuracy (fraction; {VALIDATION_FRACTION:.0%} of the training set held out), "
                       f"mean of the last {settings.final_window} evaluation(s), mean over {over}"),
               "uplink": "cumulative uplink floats per client after the last round, in units of d (model size)"}
    objective = "; ".join(f"{METRIC_NAMES[o]} ({OBJECTIVES[o]}): {meaning[o]}" for o in settings.objectives)
    searched = [f"{k}: {_param_text(p)}" for k, p in space.params.items()]
    for key, branches in space.conditional.items():
        for value, branch in branches.items():
            if branch.params:
                searched.append(f"if {make_override(key, value)}: " +
                                ", ".join(f"{k}: {_param_text(p)}" for k, p in branch.params.items()))
    return {"objective": objective, "search_space": "; ".join(searched),
            "base": " ".join(space.experiment_overrides([], settings.overrides, [])),
            "pruning": _pruning_text(settings),
            "space": f"{space.name}: {space.description}" if space.description else space.name}


def label_study(study, settings: Settings, space: Space) -> Dict[str, str]:
    """Name the study's objectives (``study.set_metric_names``: ``val_acc``, ``uplink``) and set the user
    attributes of :func:`study_labels`, so that optuna-dashboard's first screen says what was optimised, over
    which parameters and why trials were pruned (the names also label Optuna's plots and ``trials_dataframe``).
    Called by every invocation, under the storage's setup lock (a space's ranges or the pruner may change between
    invocations); an attribute already holding the value is not written again.

    Returns:
        The user attributes set (key -> text).
    """
    names = [METRIC_NAMES[o] for o in settings.objectives]
    if study.metric_names != names:
        study.set_metric_names(names)
    labels = study_labels(settings, space)
    current = study.user_attrs
    for key, text in labels.items():
        if current.get(key) != text:
            study.set_user_attr(key, text)
    return labels

