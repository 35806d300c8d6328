"""Trials trained K at a time as one population (``tune.py --batch K``; docs/sweeps.md, Batches).

A worker with ``--batch K`` > 1 (:class:`BatchLoop`):

1. **Asks** up to K trials, one after another; each is sampled (every ``suggest`` of its space) before the next is
   asked, so a sampler that sees running trials (TPE's constant liar, GPSampler) sees the ones before it. A trial
   whose combination does not compose ends at once, PRUNED "infeasible: ...".
2. **Groups** them: trials whose configs differ only in the keys a replica carries
   (:func:`fl_core.experiment.population_key`: eta_l, the weight decay, eta_g, the rules' replica parameters such as
   FedBug's P, FedNLR's mu schedule, FedBCGD's lambda, FedDyn's alpha) share a pass; the group of the oldest waiting
   trial trains next, the others wait.
3. **Trains** the group as one population (:func:`pipeline.experiment.train_population`): every seed of every trial
   is a replica, in chunks that fit in memory. Each evaluated round is reported to Optuna at the same step as a trial
   trained alone (``seed_index * R + round``). After every pass the trials with a new report are asked
   ``should_prune`` in a shuffled order; a pruned trial's replicas leave the population; a seed whose loss diverged
   or whose rule found its setting infeasible ends its trial (PRUNED, as alone); a trial whose seeds all finished is
   told COMPLETE. Each slot that frees is refilled with the next asked trial when it can share the pass (it begins at
   round 0 and trains alone until it has caught up: a pass takes the replicas at the lowest round); otherwise the
   trial waits for the next group.
4. A group that cannot train as one population (one trial with nothing left to ask, configs that cannot share a
   pass, or ``engine.executor=auto`` finding the sequential executor faster for it) trains its trials one after
   another exactly as ``--batch 1`` does (:meth:`~sweeps.trials.TrialRunner.train`).

Nothing is left RUNNING: Ctrl-C, an error outside a trial's training or an environment failure tells every trial of
the worker that is not finished FAIL with the reason (``skip_if_finished``), its MLflow run KILLED or FAILED; the
storage lost and back within ``FL_DB_RETRY_S`` costs the trial whose call it interrupted (FAIL, "storage lost:
...": what reached the storage is not known; the other trials of the pass go on), or every trial in progress when
it interrupted anything else, and the sweep goes on, as with one trial at a time (:func:`sweeps.runner.optimize`).
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from fl_core.config import ConfigError, to_container
from fl_core.store import envfail, faults
from pipeline.experiment import ExperimentRunner, Observer, Part, Steer, train_population

from .spaces import merge_overrides
from .storage import fail_silent_trials, heartbeat, note_outage, storage_back, storage_call, storage_failure
from .trials import (InfeasibleConfig, Outcome, Started, TrialRunner, error_reason, failure_outcome,
                     resolve_trial, seeds_result, tell_outcome, trial_line)

BATCH_MAX = 16  # --batch auto: at most this, and what the memory estimate allows
KNEE = 0.10  # --batch auto: the fewest trials whose predicted time per trial is within this share of the best
# what a population of trials trains on unless the overrides name vectorized (engine.executor=auto times the
# population's round on both executors: fl_core.engine.factory.build_simulator's replicas); not in a trial's overrides
BATCH_EXECUTOR = "engine.executor=auto"


@dataclass
class Slot:
    """One asked trial of a batch: started (sampled, MLflow run open), its experiment resolved, waiting or training,
    until it is told.

    Attributes:
        st: the started trial (:class:`~sweeps.trials.Started`).
        exp: its :class:`fl_core.experiment.ResolvedExperiment` (one config per seed).
        key: what it must share with the trials of its pass (:func:`fl_core.experiment.population_key`).
        part: its index among the parts of the population it trains in (-1: not training).
        runs: seed -> its :class:`pipeline.experiment.SeedRun` once that seed has ended.
        fresh: (seed index, round, row) of its newest report since the pruner was last asked, or None.
        verdict: how it ends, decided before its seeds have all ended (pruned, diverged, infeasible), and the MLflow
            status of that end.
        configured: its config and rule stack were recorded (:meth:`TrialRunner.on_config`).
        trained: one of its seeds has ended a round.
        beat: its heartbeat while it is asked and not told (:func:`sweeps.storage.heartbeat`).
        lost: the storage's failure that interrupted one of its reports (it ends FAIL "storage lost"), or None.
    """

    st: Started
    exp: Any = None
    key: Optional[str] = None
    part: int = -1
    runs: Dict[int, Any] = field(default_factory=dict)
    fresh: Optional[Tuple[int, int, Dict[str, float]]] = None
    verdict: Optional[Tuple[Outcome, str]] = None
    configured: bool = False
    trained: bool = False
    beat: Any = None
    lost: Optional[envfail.EnvironmentFailure] = None

    @property
    def number(self) -> int:
        return self.st.trial.number


class _SlotObserver(Observer):
    """What the population tells of one slot's seeds: its config and rule stack once built, each round (MLflow,
    the Optuna report), each seed's end (a failed seed decides how the trial ends; the last seed settles it)."""

    def __init__(self, loop: "BatchLoop", slot: Slot):
        self.loop, self.slot = loop, slot
        self.index = {int(cfg.seed): i for i, cfg in enumerate(slot.exp.configs)}

    def built(self, run) -> None:
        if not self.slot.configured:
            self.slot.configured = True
            try:
                self.loop.runner.on_config(self.slot.st, to_container(run.cfg), run.sim.algo.describe())
            except Exception as err:
                if not self.loop.lost_in(self.slot, err):
                    raise

    def round(self, seed: int, r: int, row: Dict[str, float]) -> None:
        i = self.index[seed]
        self.slot.trained = True
        try:
            step = self.loop.runner.report(self.slot.st, i, r, row)
        except Exception as err:
            if not self.loop.lost_in(self.slot, err):
                raise
            return
        if step is not None and self.slot.verdict is None:
            self.slot.fresh = (i, r, row)

    def finished(self, run) -> None:
        from fl_core.engine.simulator import RunStopped

        slot = self.slot
        slot.runs[run.seed] = run
        if run.failure is not None and not isinstance(run.failure, RunStopped) and slot.verdict is None:
            slot.verdict = (failure_outcome(run.failure), "KILLED")  # diverged or infeasible: its other seeds stop
        if len(slot.runs) == len(self.index):
            try:
                self.loop.settle(slot)
            except Exception as err:
                if not self.loop.lost_in(slot, err):
                    raise
                self.loop.settle(slot)  # now FAIL "storage lost"


class BatchLoop:
    """Runs up to ``n_trials`` trials of ``study``, ``settings.batch`` at once (module docstring); ``on_trial``
    receives each trial's progress line."""

    def __init__(self, study, runner: TrialRunner, n_trials: int, on_trial: Callable[[str], None]):
        self.study, self.runner, self.s = study, runner, runner.settings
        self.k = max(1, int(self.s.batch))
        self.n_trials = n_trials
        self.on_trial = on_trial
        self.deadline = None if self.s.timeout is None else time.monotonic() + self.s.timeout
        self.asked = 0
        self.pending: List[Slot] = []  # asked, waiting for a group
        self.live: Dict[int, Slot] = {}  # trial number -> every slot asked and not told yet
        self.group: List[Slot] = []  # the slots of the population in progress
        self.rng = random.Random(self.s.sampler_seed)  # the order the pruner is asked in
        self.who = f"w{runner.worker} " if runner.worker else ""

    # ------------------------------------------------------------------ the loop
    def run(self) -> bool:
        """Train the trials; True if interrupted by Ctrl-C (every unfinished trial told FAIL), else False.

        Raises:
            fl_core.store.envfail.EnvironmentFailure: the storage did not answer again within ``FL_DB_RETRY_S``
                (the trials stay RUNNING until their heartbeat is stale), or another environment failure (the
                unfinished trials told FAIL first).
            Exception: an error outside a trial's training; the unfinished trials are told FAIL first.
        """
        try:
            while True:
                try:
                    self._fill()
                    if not self.pending:
                        return False
                    self._train(self._take_group())
                except Exception as err:
                    failure = storage_failure(err, self.s)
                    if failure is None:
                        raise
                    self._storage_lost(failure)
        except KeyboardInterrupt:
            self._end_all("interrupted (Ctrl-C)", "KILLED")
            return True
        except BaseException as err:
            failure = envfail.classify(err)
            if storage_failure(err, self.s) is not None:  # it cannot be told: its MLflow runs end FAILED
                for slot in list(self.live.values()):
                    self.runner.end_run(slot.st.logger, failure)
                    self._forget(slot)
            else:
                self._end_all(f"environment failure: {failure}" if failure else error_reason(err)[0], "FAILED",
                              failure)
            raise

    def _more(self) -> bool:
        """Whether another trial may be asked: this worker's budget and ``--timeout``."""
        return self.asked < self.n_trials and (self.deadline is None or time.monotonic() < self.deadline)

    def _fill(self) -> None:
        """Ask trials until K wait (or no more may be asked)."""
        while len(self.pending) < self.k and self._more():
            slot = self._ask()
            if slot is not None:
                self.pending.append(slot)

    def _ask(self) -> Optional[Slot]:
        """Ask and start one trial: sampled, its MLflow run open, its heartbeat on, its experiment resolved; None
        when it ended at once (infeasible: the combination does not compose)."""
        from fl_core.experiment import population_key

        storage_call(self.s, lambda: fail_silent_trials(self.study))
        trial = storage_call(self.s, self.study.ask)
        self.asked += 1
        beat = heartbeat(self.study, trial, functools.partial(note_outage, self.s))
        beat.__enter__()
        slot = Slot(Started(trial, [], None, time.perf_counter()), beat=beat)
        self.live[trial.number] = slot
        slot.st = self.runner.start(trial)
        try:  # in a batch the trials train on engine.executor=auto unless the overrides name vectorized
            slot.exp = resolve_trial(merge_overrides([BATCH_EXECUTOR], slot.st.overrides), self.s.seeds, self.s.threads)
        except InfeasibleConfig as err:
            self._end(slot, Outcome("PRUNED", reason=f"infeasible: {err}"), "KILLED")
            return None
        slot.st.rounds = int(slot.exp.cfg0.train.rounds)
        slot.key = population_key(slot.exp.cfg0)
        return slot

    def _take_group(self) -> List[Slot]:
        """The waiting slots that share a pass with the oldest one, at most K of them (removed from the queue)."""
        key = self.pending[0].key
        group = [s for s in self.pending if s.key == key][:self.k]
        self.pending = [s for s in self.pending if s not in group]
        return group

    # ------------------------------------------------------------------ one group
    def _train(self, group: List[Slot]) -> None:
        """Train ``group`` as one population, refilled as its trials end; alone (as ``--batch 1``) when it cannot
        be one."""
        if len(group) == 1 and not self._more() and not any(s.key == group[0].key for s in self.pending):
            self._alone(group)  # nothing could join it: exactly --batch 1's path
            return
        self.group = list(group)
        parts: List[Part] = []
        for slot in group:
            parts.append(self._part(slot, len(parts)))
        try:
            trained = train_population(parts, functools.partial(self._steer, parts, group[0].key),
                                       replicas=self.k * len(self.s.seeds))
        except Exception as err:
            if storage_failure(err, self.s) is not None or envfail.classify(err) is not None:
                raise
            self._group_failed(err)
            trained = []
        group, self.group = self.group, []
        if trained is None:  # it cannot be one population: one trial after another, as --batch 1
            self._alone(group)

    def _part(self, slot: Slot, index: int) -> Part:
        slot.part = index
        runner = ExperimentRunner(slot.exp, self.runner.cache.get(slot.exp.cfg0))
        return Part(runner, list(slot.exp.configs), [_SlotObserver(self, slot)])

    def _alone(self, slots: List[Slot]) -> None:
        for slot in slots:
            self._told(slot, self.runner.train(slot.st))

    def _steer(self, parts: List[Part], key: str) -> Optional[Steer]:
        """Between two passes: ask the pruner about the trials with a new report (shuffled), stop the replicas of
        the trials that end early, refill the freed slots."""
        faults.point("between_passes")
        asking = [s for s in self.group if s.fresh is not None and s.verdict is None and s.number in self.live]
        self.rng.shuffle(asking)
        for slot in asking:
            i, r, row = slot.fresh
            slot.fresh = None
            if not self.s.multi and storage_call(self.s, slot.st.trial.should_prune):
                slot.verdict = (Outcome("PRUNED", reason="pruned: " + self.runner.pruned_at(slot.st, i, r, row)),
                                "KILLED")
        stop: Dict[Tuple[int, int], str] = {}
        for slot in self.group:
            if slot.verdict is not None and slot.number in self.live:
                stop.update({(slot.part, int(cfg.seed)): slot.verdict[0].reason
                             for cfg in slot.exp.configs if int(cfg.seed) not in slot.runs})
        running = [s for s in self.group if s.number in self.live and s.verdict is None]
        join: List[Part] = []
        while len(running) + len(join) < self.k:
            slot = self._next_for(key)
            if slot is None:
                break
            join.append(self._part(slot, len(parts) + len(join)))
            self.group.append(slot)
        return Steer(stop, join)

    def _next_for(self, key: str) -> Optional[Slot]:
        """The next trial for a free slot of the population of ``key``: a waiting one of that key, else a newly asked
        one if it shares the pass (else it waits for a later group); None when none."""
        for slot in self.pending:
            if slot.key == key:
                self.pending.remove(slot)
                return slot
        while self._more():
            slot = self._ask()
            if slot is None:
                continue  # ended at once (infeasible): ask again
            if slot.key == key:
                return slot
            self.pending.append(slot)
            return None
        return None

    def _group_failed(self, err: BaseException) -> None:
        """An exception out of the population's training that is none of its trials' own (not a pruner, a diverged
        seed or an infeasible setting): every trial of the group not told yet ends, FAIL with the error (the study
        goes on), or PRUNED infeasible when the configs could not be built (a ConfigError / ValueError before any
        round)."""
        unsettled = [s for s in self.group if s.number in self.live]
        before = not any(s.trained for s in self.group) and isinstance(err, (ConfigError, ValueError))
        for slot in unsettled:
            if before:
                self._end(slot, Outcome("PRUNED", reason=f"infeasible: {envfail.first_line(err)}"), "KILLED")
            else:
                self._told(slot, self.runner.failed(slot.st, err))

    # ------------------------------------------------------------------ ends
    def settle(self, slot: Slot) -> None:
        """Every seed of ``slot`` has ended: tell its outcome (its verdict, else COMPLETE from its seeds)."""
        if slot.number not in self.live:
            return
        if slot.lost is not None:
            self._end_lost(slot, slot.lost, slot.verdict[0])
            return
        if slot.verdict is not None:
            self._end(slot, *slot.verdict)
            return
        runs = [slot.runs[int(cfg.seed)] for cfg in slot.exp.configs]
        self._end(slot, self.runner.completed(slot.st, seeds_result(runs)), "FINISHED")

    def _end(self, slot: Slot, outcome: Outcome, status: str) -> None:
        """Close ``slot``'s MLflow run with ``status`` and tell its outcome."""
        self._told(slot, self.runner.finish(slot.st, outcome, status))

    def _told(self, slot: Slot, outcome: Outcome) -> None:
        """Tell the storage ``outcome`` of a slot whose MLflow run is closed; its progress line."""
        trial = slot.st.trial
        tell_outcome(self.study, trial, outcome, self.s, self.who)
        self._forget(slot)
        self.on_trial(trial_line(trial.number, outcome, trial.params, time.perf_counter() - slot.st.t0,
                                 self.runner.worker))

    def _forget(self, slot: Slot) -> None:
        self.live.pop(slot.number, None)
        if slot.beat is not None:
            slot.beat.__exit__(None, None, None)
            slot.beat = None

    def lost_in(self, slot: Slot, err: BaseException) -> bool:
        """``err`` came out of a call for ``slot`` (its config recorded, a round reported, its end told): when it is
        the storage's failure and the storage answers again within ``FL_DB_RETRY_S``, that trial alone ends FAIL
        "storage lost: ..." (what reached the storage before it went away is not known; its replicas stop, its MLflow
        run ends FAILED), one line says so, the others go on: True. False when ``err`` is not the storage's.

        Raises:
            fl_core.store.envfail.EnvironmentFailure: the storage did not answer again in time."""
        failure = storage_failure(err, self.s)
        if failure is None:
            return False
        reason = storage_back(self.s, failure, f"{self.who}trial {slot.number}")
        if slot.lost is None:
            slot.verdict, slot.lost = (Outcome("FAIL", reason=reason), "FAILED"), failure
        return True

    def _storage_lost(self, failure: envfail.EnvironmentFailure) -> None:
        """The storage failed and answers again within ``FL_DB_RETRY_S`` (:func:`wait_for_storage` raises
        otherwise): every trial in progress or waiting ends FAIL "storage lost: ..." (its MLflow run FAILED), one
        line says so, and the sweep goes on."""
        ended = sorted(self.live)
        outcome = Outcome("FAIL", reason=storage_back(self.s, failure,
                                                      f"{self.who}trial(s) {', '.join(map(str, ended))}"))
        for slot in [self.live[n] for n in ended]:
            self._end_lost(slot, failure, outcome)
        self.pending, self.group = [], []

    def _end_lost(self, slot: Slot, failure: envfail.EnvironmentFailure, outcome: Outcome) -> None:
        """End ``slot`` FAIL "storage lost" after the storage answered again: its MLflow run FAILED with the
        environment failure, its ``reason`` recorded, the storage told."""
        self.runner.end_run(slot.st.logger, failure)
        self.runner.forget(slot.st)
        storage_call(self.s, functools.partial(slot.st.trial.set_user_attr, "reason", outcome.reason))
        self._told(slot, outcome)

    def _end_all(self, reason: str, status: str, failure: Optional[BaseException] = None) -> None:
        """Every trial not told yet ends FAIL with ``reason``: its MLflow run closed with ``status`` (FAILED with the
        environment failure where that is ``failure``), the storage told (``skip_if_finished``)."""
        from optuna.trial import TrialState

        for slot in list(self.live.values()):
            trial = slot.st.trial
            try:
                if failure is None and self.runner.is_open(slot.st):
                    self.runner.finish(slot.st, Outcome("FAIL", reason=reason), status)
                else:  # its MLflow run ended otherwise (or never opened: it failed while it was sampled)
                    if failure is not None:
                        self.runner.end_run(slot.st.logger, failure)
                        self.runner.forget(slot.st)
                    trial.set_user_attr("reason", reason)
                self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            finally:
                self._forget(slot)


def optimize_batch(study, runner: TrialRunner, n_trials: int, on_trial: Callable[[str], None]) -> bool:
    """:class:`BatchLoop` over ``study``: True if interrupted by Ctrl-C."""
    return BatchLoop(study, runner, n_trials, on_trial).run()


def parse_batch(text: str) -> Optional[int]:
    """``--batch``: ``auto`` -> None (:func:`auto_batch` decides), an integer >= 1 -> itself.

    Raises:
        ValueError: anything else (one line naming the option).
    """
    if text == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1 or str(k) != text.strip().lstrip("+"):
        raise ValueError(f"--batch must be auto or an integer >= 1, got {text!r}")
    return k


def auto_batch(space, settings, cache, n_trials: int = BATCH_MAX) -> Tuple[int, str]:
    """``--batch auto``: how many trials a worker trains at once. The memory bound M: the largest K <=
    :data:`BATCH_MAX` for which a population of K trials (K x ``--seeds`` replicas) of the base experiment fits the
    device in one pass by the vectorised executor's memory estimate (:func:`fl_core.engine.factory.vectorized_fit`,
    the in-memory client states held). Within it, the fewest trials that train about as fast as any: the timing
    probe of ``engine.executor=auto`` (:func:`fl_core.engine.factory.population_timing`, once per population size)
    predicts the vectorised round of K = 1, 2, 4, 8, 16 trials' replicas (capped at the bound), and K is the smallest
    whose predicted time a round per trial is within :data:`KNEE` of the best of them (more trials at once would only
    delay the sampler's feedback: docs/sweeps.md, Batches). 1 when the base's rule stack or model does not run on the vectorised
    executor, one trial does not fit, or the vectorised pass of M trials is not faster than their replicas one after
    another on the sequential executor. K is at most ``n_trials``, the trials one worker runs. Returns (K, why: one
    line)."""
    from fl_core.engine import diskstate
    from fl_core.engine.factory import DTYPES, population_timing, vectorized_fit
    from fl_core.engine.memory import FIT_FRACTION, size_text

    if n_trials <= 1:
        return 1, f"auto: 1, {max(0, n_trials)} trial(s) to run"
    overrides = space.experiment_overrides([], [*settings.overrides, "engine.executor=sequential"], [])
    try:
        exp = resolve_trial(overrides, settings.seeds[:1], settings.threads)
        cfg = exp.cfg0
        sim = ExperimentRunner(exp, cache.get(cfg)).simulator(cfg)
    except (InfeasibleConfig, ConfigError, ValueError) as err:  # the base alone does not build: its trials say why
        return 1, f"auto: 1, the base experiment does not build ({envfail.first_line(err)})"
    if not sim.algo.vectorizable or any(True for _ in sim.model.buffers()):
        return 1, f"auto: 1, {sim.algo.describe()} on model={cfg.model.name} does not run on the vectorised executor"
    state_bytes = diskstate.client_state_bytes(sim.algo, sim.spec.d, DTYPES[cfg.engine.dtype])
    seeds = len(settings.seeds)
    fit, bound = None, 0
    for k in range(min(BATCH_MAX, n_trials), 0, -1):
        held = sim.num_clients * state_bytes * k * seeds if sim.device.type == "cpu" else 0
        fit = vectorized_fit(cfg, sim.model, sim.algo, sim.executor.data, state_bytes, held_bytes=held,
                             replicas=k * seeds)
        if fit.fits:
            bound = k
            break
    if not bound:
        return 1, f"auto: 1, one trial's population does not fit in one pass ({fit.estimate()})"
    cap = min(BATCH_MAX, n_trials)
    memory = (f"{f'memory allows {bound} of at most {cap}' if bound < cap else f'at most {cap}, which memory allows'} (about {size_text(fit.need.total())} for {fit.need.clients} clients at once, "
              f"within {FIT_FRACTION:.0%} of the {size_text(fit.available)} {fit.where})")
    sizes = sorted({min(c, bound) for c in (1, 2, 4, 8, BATCH_MAX)})
    try:
        rounds = {k: population_timing(cfg, sim, k * seeds).round_s for k in sizes}
    except Exception as err:  # noqa: BLE001  (the probe failed: the memory bound alone decides)
        return bound, f"auto: {bound}, {memory}; the timing probe failed ({envfail.first_line(err)})"
    if rounds[bound]["vectorized"] >= rounds[bound]["sequential"]:
        return 1, (f"auto: 1, the vectorised pass of {bound} trials ({1e3 * rounds[bound]['vectorized']:.0f} ms a round "
                   f"predicted) is not faster than their replicas one after another "
                   f"({1e3 * rounds[bound]['sequential']:.0f} ms); {memory}")
    per = {k: rounds[k]["vectorized"] / k for k in sizes}  # predicted seconds a round per trial
    best = min(per.values())
    k = next(k for k in sizes if per[k] <= (1.0 + KNEE) * best)
    shown = ", ".join(f"{1e3 * per[n]:.1f} ms at {n}" for n in sizes)
    return k, f"auto: {k}, the fewest trials within {KNEE:.0%} of the best time a round per trial ({shown}); {memory}"
