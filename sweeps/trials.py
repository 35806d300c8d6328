"""One trial: its overrides sampled, its seeds trained (:func:`train_seeds`), its values reported for pruning, its
MLflow run, and how it ended (:class:`Outcome`; the states are listed in :mod:`sweeps.runner`)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fl_core.store import envfail, storefail, storewait
from fl_core.config import ConfigError, to_container
from pipeline.experiment import Observer

from .spaces import TRIAL_FIXED, load_space, make_override, merge_overrides

from .settings import HOST, Settings
from .storage import is_store_of, owner_tags, storage_call


class DataCache:
    """Dataset, partition and device tensors per (dataset, partition, device) config, kept for the
    last ``size`` combinations of this process (trials differ mostly in algorithm settings)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._items: "OrderedDict[str, Any]" = OrderedDict()

    def get(self, cfg):
        """The :class:`pipeline.experiment.Inputs` of ``cfg`` (dataset, partition, client data, device); raises
        what the data loaders raise."""
        from fl_core.config import to_container
        from pipeline.experiment import Inputs

        c = to_container(cfg)
        key = json.dumps([c["dataset"], c["partition"], c["data_dir"], c["engine"]["device"], c["engine"]["dtype"]],
                         sort_keys=True)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        item = Inputs.load(cfg)
        self._items[key] = item
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return item


class InfeasibleConfig(RuntimeError):
    """A sampled configuration is infeasible: it does not compose, the simulator cannot be built
    (``ConfigError``/``ValueError`` naming a key), or a rule rejects it once running
    (:class:`fl_core.algorithms.InfeasibleSetting`). The trial ends PRUNED with this reason."""


@dataclass
class SeedsResult:
    """Outcome of training one configuration for several seeds."""

    final_acc: List[float]  # per seed: mean of the last train.final_window evaluations (fraction)
    uplink_d: float  # cumulative uplink floats per client after the last round, in units of d (model size)
    algorithm: str  # the algorithm stack, e.g. fedbug[P=0.2](fedavg)

    @property
    def mean_acc(self) -> float:
        return sum(self.final_acc) / len(self.final_acc)


def resolve_trial(overrides: Sequence[str], seeds: Sequence[int], threads: int = 1):
    """The :class:`fl_core.experiment.ResolvedExperiment` of a trial: ``overrides`` (experiment overrides, no seed)
    with :data:`TRIAL_FIXED`, ``engine.threads`` and ``seed=s`` for each of ``seeds``.

    Raises:
        InfeasibleConfig: the combination does not compose (the config validation rejects it, one line).
    """
    from fl_core.config import compose
    from fl_core.experiment import resolve

    try:
        # every key a trial can set was held to "changes the run" by spaces.check_space (the base alone, then
        # the command line, every branch and both ends of every range over it) before the first trial
        return resolve([compose(merge_overrides(overrides, TRIAL_FIXED, [make_override("engine.threads", threads),
                                                                        make_override("seed", seed)]), user=())
                        for seed in seeds])
    except (ConfigError, ValueError) as err:  # a combination the config validation rejects
        raise InfeasibleConfig(envfail.first_line(err)) from None


def seeds_result(runs: Sequence[Any]) -> SeedsResult:
    """The :class:`SeedsResult` of a trial's finished seeds (:class:`pipeline.experiment.SeedRun`, in seed order):
    each seed's ``final_acc`` (:func:`fl_core.metrics.summarize_run`), the last seed's cumulative uplink in units of
    d, the rule stack's description."""
    from fl_core.metrics import summarize_run

    accs = [float(summarize_run(run.history, run.cfg.train.target_acc, run.cfg.train.final_window)["final_acc"])
            for run in runs]
    sim = runs[0].sim
    return SeedsResult(accs, float(runs[-1].history[-1]["comm_up_floats"]) / sim.spec.d, sim.algo.describe())


def failure_outcome(failure: Any) -> "Outcome":
    """How a trial ends on a seed's :class:`~fl_core.engine.simulator.RunFailed`: PRUNED, "infeasible: ..." when its
    rule found the setting infeasible once running (``cause``: ``InfeasibleSetting``), else "diverged: ..." (a
    non-finite loss)."""
    from fl_core.algorithms import InfeasibleSetting

    if isinstance(getattr(failure, "cause", None), InfeasibleSetting):
        return Outcome("PRUNED", reason=f"infeasible: {envfail.first_line(failure)}")
    return Outcome("PRUNED", reason=f"diverged: {failure}")


class _TrialEnded(Exception):
    """A failed seed ended a trial early (:func:`train_seeds`): ``outcome`` says how, ``failure`` is the seed's
    :class:`~fl_core.engine.simulator.RunFailed`."""

    def __init__(self, outcome: "Outcome", failure: Exception):
        super().__init__(outcome.reason)
        self.outcome, self.failure = outcome, failure


def train_seeds(overrides: Sequence[str], seeds: Sequence[int], cache: DataCache,
                on_round: Optional[Callable[[int, int, Dict[str, float]], None]] = None,
                on_config: Optional[Callable[[Dict[str, Any], str], None]] = None, threads: int = 1) -> SeedsResult:
    """Train ``overrides`` (experiment overrides, no seed) once per seed, through the one runner of an
    experiment's seeds (:class:`pipeline.experiment.ExperimentRunner`: one population where they share a pass).

    Args:
        overrides: Hydra overrides of the experiment; :data:`TRIAL_FIXED` and ``seed=s`` are appended.
        seeds: run seeds, e.g. [1, 2, 3].
        cache: the process's :class:`DataCache`.
        on_round: called as ``on_round(seed_index, round, row)`` after every round (``row`` as the
            simulator's history rows: ``test_acc``/``test_loss`` on evaluated rounds, ``train_loss``,
            ``comm_up_floats``, ...); it may raise ``optuna.TrialPruned``.
        on_config: called once, before training, with the first seed's composed config (plain dict)
            and the algorithm stack's description.
        threads: torch threads of the runs (``engine.threads``; ``tune.py --threads``).

    Raises:
        InfeasibleConfig: see :class:`InfeasibleConfig`.
        fl_core.engine.simulator.RunFailed: a run's loss became non-finite.
        Exception: anything else the run raises (a bug, not a property of the configuration).
    """
    from fl_core.algorithms import InfeasibleSetting
    from pipeline.experiment import ExperimentRunner

    exp = resolve_trial(overrides, seeds, threads)
    seen = _SeedsObserver(exp, on_round, on_config)
    try:
        runs = ExperimentRunner(exp, cache.get(exp.cfg0)).train(exp.configs, [seen])
    except InfeasibleSetting as err:  # a rule's setting the data cannot run (before the generic ValueError)
        raise InfeasibleConfig(envfail.first_line(err)) from None
    except _TrialEnded as end:
        if end.outcome.reason.startswith("infeasible: "):
            raise InfeasibleConfig(end.outcome.reason.removeprefix("infeasible: ")) from None
        raise end.failure from None
    except (ConfigError, ValueError) as err:  # a combination the config validation / the builders reject
        if seen.training:
            raise
        raise InfeasibleConfig(envfail.first_line(err)) from None
    return seeds_result(runs)


class _SeedsObserver(Observer):
    """What :func:`train_seeds` hears of a trial's seeds: the first seed's config and rule stack (``on_config``),
    each round (``on_round(seed_index, round, row)``), and a failed seed, which ends the trial."""

    def __init__(self, exp, on_round, on_config):
        self.index = {int(cfg.seed): i for i, cfg in enumerate(exp.configs)}
        self.on_round, self.on_config = on_round, on_config
        self.first = None
        self.training = False

    def built(self, run) -> None:
        if self.first is None:  # the first seed's config and rule stack, before any seed trains
            self.first = run.sim
            if self.on_config is not None:
                self.on_config(to_container(run.cfg), run.sim.algo.describe())

    def started(self, seed: int, resumed_from: int) -> None:
        self.training = True

    def round(self, seed: int, r: int, row: Dict[str, float]) -> None:
        if self.on_round is not None:
            self.on_round(self.index[seed], r, row)

    def finished(self, run) -> None:
        if run.failure is not None:  # the trial ends on its first failing seed
            raise _TrialEnded(failure_outcome(run.failure), run.failure)


@dataclass
class Outcome:
    """How a trial ended: Optuna state name, objective values (COMPLETE only) and a reason."""

    state: str
    values: Optional[List[float]] = None
    reason: str = ""


def round_metrics(row: Dict[str, float], prefix: str) -> Dict[str, float]:
    """The MLflow metrics of one history row, ``test_*`` renamed ``<prefix>_*``."""
    out = {k: row[k] for k in ("train_loss", "comm_up_floats", "round_time_s") if k in row}
    if "test_acc" in row:
        out[f"{prefix}_acc"], out[f"{prefix}_loss"] = row["test_acc"], row["test_loss"]
    return out


def error_reason(err: BaseException) -> Tuple[str, str]:
    """(``"error: <the traceback's last line>"``, where it was raised as ``file:line in function``)."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    frames = traceback.extract_tb(err.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    return f"error: {last}", where


@dataclass
class Started:
    """A trial that has begun: its experiment overrides (sampled), its MLflow run (or None), when it began
    (``perf_counter``) and ``rounds``, the R of its steps (``seed_index * R + round``)."""

    trial: Any
    overrides: List[str]
    logger: Any
    t0: float
    rounds: int = 1


class TrialRunner:
    """Runs one Optuna trial: sample, train every seed (reporting for pruning), log to MLflow. The batch runner
    (:mod:`sweeps.batch`) uses its parts for several trials at once: :meth:`start`, :meth:`on_config`,
    :meth:`report`, :meth:`completed`, :meth:`finish`."""

    def __init__(self, settings: Settings, tracking=None, worker: int = 0, cache: Optional[DataCache] = None):
        self.settings = settings
        self.space = load_space(settings.space)
        self.tracking = tracking
        self.worker = worker
        self.cache = cache or DataCache()
        self._live: Dict[int, Any] = {}  # trial number -> MLflow run in progress (ended FAILED if the process ends)
        storewait.on_stall(self._on_stall)

    def _on_stall(self, failure: BaseException) -> None:
        """A database stopped answering and the process ends (:func:`fl_core.store.storewait.on_stall`): the MLflow
        runs of the trials in progress end FAILED, unless it is MLflow's store that does not answer."""
        for logger in list(self._live.values()):
            self.end_run(logger, failure)

    def end_run(self, logger, failure) -> None:
        """End the trial's MLflow run FAILED with ``fl.end_reason`` ``environment failure: <line>`` (best effort; not
        when MLflow's own store is the one that failed)."""
        from fl_core.store.tracking import ENV_FAILURE

        if logger is None or logger.run_id is None or is_store_of(failure, self.tracking.uri):
            return
        try:
            self.tracking.client.set_tag(logger.run_id, "optuna_state", "FAIL")
            logger.close("FAILED", f"{ENV_FAILURE}{failure}")
        except Exception:  # noqa: BLE001  (the run is then ended as an orphan by the next invocation)
            pass

    def experiment_overrides(self, trial) -> List[str]:
        """Sample ``trial`` and return its experiment overrides (validation split on, no seed)."""
        extra, values = self.space.sample(trial)
        return self.space.experiment_overrides(extra, self.settings.overrides,
                                               [make_override(k, v) for k, v in values.items()])

    def _logger(self, trial, overrides: List[str]):
        if self.tracking is None:
            return None
        s = self.settings
        tags = {"sweep_role": "trial", "optuna_study": s.study_name, "optuna_trial": str(trial.number),
                "space": self.space.name, "worker": str(self.worker), **owner_tags()}
        params = {**{f"optuna.{k}": v for k, v in trial.params.items()}, "sweep.overrides": " ".join(overrides),
                  "sweep.seeds": ",".join(map(str, s.seeds))}
        logger = self.tracking.child_logger(s.parent_run_id, f"{s.study_name}/trial-{trial.number}", tags,
                                            params, log_every=1_000_000)  # buffered: written at close
        logger.open(None)
        return logger

    def start(self, trial) -> Started:
        """Begin ``trial``: tag it with this process (host, pid, worker), sample its experiment overrides (also the
        user attribute ``overrides``) and open its MLflow run."""
        t0 = time.perf_counter()
        overrides = self._trial_overrides(trial)
        logger = self._logger(trial, overrides)
        self._live[trial.number] = logger
        return Started(trial, overrides, logger, t0, int(self.settings.rounds))

    def __call__(self, trial) -> Outcome:
        """Run ``trial``; KeyboardInterrupt propagates after its MLflow run is closed as KILLED."""
        return self.train(self.start(trial))

    def train(self, st: Started) -> Outcome:
        """Train the started trial ``st`` alone (its seeds: :func:`train_seeds`), pruned after any report the pruner
        stops; KeyboardInterrupt propagates after its MLflow run is closed as KILLED."""
        import optuna

        from fl_core.engine.simulator import RunFailed

        s = self.settings

        def on_round(i: int, r: int, row: Dict[str, float]) -> None:
            step = self.report(st, i, r, row)
            if step is not None and st.trial.should_prune():
                raise optuna.TrialPruned(self.pruned_at(st, i, r, row))

        try:
            res = train_seeds(st.overrides, s.seeds, self.cache, on_round=on_round,
                              on_config=functools.partial(self.on_config, st), threads=s.threads)
        except optuna.TrialPruned as err:
            return self.finish(st, Outcome("PRUNED", reason=f"pruned: {err}"), "KILLED")
        except RunFailed as err:
            return self.finish(st, Outcome("PRUNED", reason=f"diverged: {err}"), "KILLED")
        except InfeasibleConfig as err:
            return self.finish(st, Outcome("PRUNED", reason=f"infeasible: {err}"), "KILLED")
        except KeyboardInterrupt:
            self.finish(st, Outcome("FAIL", reason="interrupted (Ctrl-C)"), "KILLED")
            raise
        except Exception as err:  # not a property of the configuration: FAIL, and the study goes on
            failure = envfail.classify(err)
            if failure is not None:  # the environment (the storage, MLflow, the disk): optimize decides
                self.end_run(st.logger, failure)
                raise
            return self.failed(st, err)
        return self.finish(st, self.completed(st, res), "FINISHED")

    def is_open(self, st: Started) -> bool:
        """Whether ``st`` has not been finished (:meth:`finish`) nor forgotten (:meth:`forget`)."""
        return st.trial.number in self._live

    def forget(self, st: Started) -> None:
        """``st``'s MLflow run was ended otherwise (:meth:`end_run`): no longer one in progress."""
        self._live.pop(st.trial.number, None)

    def failed(self, st: Started, err: BaseException) -> Outcome:
        """End ``st`` FAIL on ``err``, an exception that is not a property of its configuration (the reason, one line
        on stderr with where it was raised); the study goes on."""
        reason, where = error_reason(err)
        reason = storefail.redact(reason, self.settings.storage, self.tracking.uri if self.tracking else None)
        print(f"{'w%d ' % self.worker if self.worker else ''}trial {st.trial.number}: {reason} (at {where})",
              file=sys.stderr, flush=True)
        return self.finish(st, Outcome("FAIL", reason=reason), "FAILED", f" (at {where})")

    def _trial_overrides(self, trial) -> List[str]:
        """Tag ``trial`` with this process (host, pid, worker), then sample its experiment overrides
        (also stored as the user attribute ``overrides``)."""
        trial.set_user_attr("host", HOST)  # first: tells a stale trial from a running one (fail_stale_trials)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("worker", self.worker)
        overrides = self.experiment_overrides(trial)
        trial.set_user_attr("overrides", overrides)
        return overrides

    def on_config(self, st: Started, cfg: Dict[str, Any], algo: str) -> None:
        """The trial's composed config (plain dict) and rule stack: R of its steps, the user attribute ``algorithm``,
        the MLflow run's params and tag."""
        from fl_core.store.tracking import run_params

        st.rounds = int(cfg["train"]["rounds"])
        st.trial.set_user_attr("algorithm", algo)
        if st.logger is not None:
            self.tracking.log_params(st.logger.run_id, {k: v for k, v in run_params(cfg).items() if k != "seed"})
            self.tracking.client.set_tag(st.logger.run_id, "algorithm", algo)

    def report(self, st: Started, i: int, r: int, row: Dict[str, float]) -> Optional[int]:
        """Round ``r`` of the trial's seed number ``i`` (0-based): its metrics to MLflow at ``step = i * R + r``, and
        its validation accuracy reported to Optuna at that step (one objective, an evaluated round). Returns the step
        when a value was reported (the pruner may be asked), else None."""
        step = i * st.rounds + r
        if st.logger is not None:
            st.logger.log_round(step, round_metrics(row, "val"))
        if "test_acc" in row and not self.settings.multi:
            st.trial.report(float(row["test_acc"]), step)
            return step
        return None

    def pruned_at(self, st: Started, i: int, r: int, row: Dict[str, float]) -> str:
        """Where the pruner stopped the trial: ``val_acc 0.4210 at seed 1 round 7 (step 7)``."""
        return f"val_acc {row['test_acc']:.4f} at seed {self.settings.seeds[i]} round {r} (step {i * st.rounds + r})"

    def completed(self, st: Started, res: SeedsResult) -> Outcome:
        """The COMPLETE outcome of a trained trial (objective values in ``settings.objectives`` order);
        its per-seed accuracies and uplink go to the trial's user attributes and MLflow summary."""
        s = self.settings
        st.trial.set_user_attr("val_acc_per_seed", res.final_acc)
        st.trial.set_user_attr("uplink_d", res.uplink_d)
        values = [res.mean_acc if o == "acc" else res.uplink_d for o in s.objectives]
        if st.logger is not None:
            st.logger.log_summary({"objective_val_acc": res.mean_acc, "uplink_d": res.uplink_d,
                                   **{f"val_acc_final_seed{sd}": a for sd, a in zip(s.seeds, res.final_acc)}})
        return Outcome("COMPLETE", values)

    def finish(self, st: Started, outcome: Outcome, status: str, detail: str = "") -> Outcome:
        """Record how the trial ended (``duration_s`` since it began, ``reason``) and close its MLflow run
        with ``status`` (FINISHED | KILLED | FAILED; ``detail`` is appended to the reason there); returns
        ``outcome``. The storage failing here ends the MLflow run FAILED and raises."""
        try:
            st.trial.set_user_attr("duration_s", round(time.perf_counter() - st.t0, 3))
            if outcome.reason:
                st.trial.set_user_attr("reason", outcome.reason)
        except Exception as err:
            failure = envfail.classify(err)
            if failure is not None:
                self.end_run(st.logger, failure)
            raise
        self._live.pop(st.trial.number, None)
        logger = st.logger
        if logger is not None:
            self.tracking.client.set_tag(logger.run_id, "optuna_state", outcome.state)
            if outcome.reason:  # the documented tag of every non-COMPLETE trial, whatever close() tags
                self.tracking.client.set_tag(logger.run_id, "failure_reason", (outcome.reason + detail)[:5000])
            logger.close(status, (outcome.reason + detail) or None)
        return outcome


def tell_outcome(study, trial, outcome: Outcome, settings: Settings, who: str) -> bool:
    """Tell the storage how ``trial`` ended (through :func:`storage_call`, so a tell that reached the database before
    it went away is not told twice); False when another process had already ended it (:func:`~sweeps.storage.fail_silent_trials`
    while the database was away), whose FAIL then stands, with a note on stderr."""
    from optuna.trial import TrialState

    state = TrialState[outcome.state]
    values = outcome.values if state == TrialState.COMPLETE else None
    frozen = storage_call(settings, lambda: study.tell(trial, values, state=state, skip_if_finished=True))
    if frozen.state == state:
        return True
    print(f"note: {who}trial {trial.number} was marked {frozen.state.name} by another process meanwhile (no heartbeat "
          "while the database was away); its result is dropped", file=sys.stderr, flush=True)
    return False


def trial_line(number: int, outcome: Outcome, params: Dict[str, Any], duration: float, worker: int) -> str:
    """One progress line per finished trial (``w<k>`` prefix in spawned worker k)."""
    vals = "/".join(f"{v:.4f}" for v in outcome.values) if outcome.values else "-"
    shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                      for k, v in params.items())
    why = f"  [{outcome.reason}]" if outcome.reason and outcome.state != "COMPLETE" else ""
    who = f"w{worker} " if worker else ""
    return f"{who}trial {number:>3} {outcome.state:<8} {vals:>15}  {shown}  ({duration:.1f}s){why}"

