"""Populations: several replicas of one experiment (its seeds) trained in one pass per round.

A replica is one :class:`~.simulator.Simulator` with its own global model, rule state (its own rule stack's
instance), client sampling stream, batch order, initialisation, client-state store, checkpoint, logger and server
step. The replicas advance in lock-step: in each pass the replicas at the lowest round each sample and broadcast
(:meth:`~.simulator.Simulator.start_round`), the clients of all of them train in one vectorised pass whose vmap
axis is (replica x client) (:meth:`~.executors.VectorizedExecutor.run_population`), and each replica aggregates,
evaluates, logs and checkpoints its own round (:meth:`~.simulator.Simulator.end_round`). Every random draw stays a
function of its replica's ``(seed, round, client)`` (:mod:`fl_core.seeding`), so a replica's numbers are those of
its separate run up to float rounding, and a replica resumed from its checkpoint rejoins the others (replicas at
different rounds after a kill catch up first: a pass takes only the replicas at the lowest round).

A replica whose loss becomes non-finite, or whose rule finds its setting infeasible once running
(``InfeasibleSetting``: a setting of that replica that its rule cannot run), ends FAILED alone; the others
go on. The caller may stop replicas between passes and add new ones (:class:`Steer`: a sweep's pruner and the trials
that refill its batch). Replicas that cannot share a pass
(another executor, a rule stack or model that differs: :func:`can_share`) run one after another, each with
:func:`run_one` (:class:`pipeline.experiment.ExperimentRunner` decides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

from ..algorithms.base import InfeasibleSetting
from . import gcpause
from .executors import NonFiniteLossError, PopulationJob, VectorizedExecutor
from .simulator import RunFailed, RunResult, RunStopped, Simulator

Outcome = Union[RunResult, RunFailed, RunStopped]


def vectorized(sim: Simulator) -> bool:
    """Whether ``sim`` trains on the vectorised executor itself (not wrapped by another, e.g. distributed): the
    executor a population needs."""
    return type(sim.executor) is VectorizedExecutor


def can_share(sims: Sequence[Simulator]) -> bool:
    """Whether ``sims`` can train as one population: at least two, each on the vectorised executor (not wrapped by
    another, e.g. distributed), built by the factory from configs with the same rule stack, model, dataset and
    partition sections (:func:`.factory.replica_key`: so one model architecture, federation and client data, and a
    rule's hyperparameters, as the batched hooks run on the first replica's instance, but the keys a replica carries
    itself, :func:`fl_core.config.replica_keys`), of one round count and local-step settings
    (:meth:`~.executors.VectorizedExecutor.local_settings`); the seed, eta_l, the weight decay, eta_g and the rules'
    replica parameters may differ."""
    if len(sims) < 2 or not all(vectorized(s) and s.replica_key is not None for s in sims):
        return False  # (a simulator not built by the factory: what it shares is unknown)

    def key(s: Simulator) -> tuple:
        return s.replica_key, s.rounds, s.executor.local_settings()

    return all(key(s) == key(sims[0]) for s in sims[1:])


Done = Optional[Callable[[int, Outcome], None]]


@dataclass
class Steer:
    """What the caller of :func:`run_together` decides between two passes.

    Attributes:
        stop: replica index -> reason: end these replicas now (:meth:`~.simulator.Simulator.stop`: their logger's run
            KILLED, outcome :class:`~.simulator.RunStopped`), e.g. the trials a sweep's pruner stopped.
        join: new replicas (simulators that :func:`can_share` with the population) that begin now, from their own
            round (0, or their checkpoint's), and take the next indices in order; a pass takes the replicas at the
            lowest round, so a newcomer trains alone until it has caught up with the others.
    """

    stop: Dict[int, str] = field(default_factory=dict)
    join: List[Simulator] = field(default_factory=list)


def run_together(sims: Sequence[Simulator], chunk: int = 0, on_done: Done = None,
                 steer: Optional[Callable[[], Optional[Steer]]] = None) -> List[Outcome]:
    """Run the simulators ``sims`` (:func:`can_share`; or one that ``steer`` may join others to) to their end as one
    population, ``chunk`` clients at once (0:
    all of a round's clients of every replica; :func:`.factory.population_chunk`). ``on_done(i, outcome)`` hears of
    each replica as soon as it ends (it may raise to stop the rest). ``steer()``, when given, is asked after every
    pass (after the ``on_done`` calls of the replicas that ended in it) and may stop replicas or add new ones
    (:class:`Steer`); the population runs until no replica is left and ``steer`` adds none. Returns, in index order
    (the joined replicas after ``sims``), each one's :class:`~.simulator.RunResult` or the
    :class:`~.simulator.RunFailed` it ended with (its logger's run closed FAILED; a non-finite loss, or an
    ``InfeasibleSetting`` its rule raised: ``RunFailed.cause``) or the :class:`~.simulator.RunStopped` of a replica
    ``steer`` stopped.

    Raises:
        ValueError: the simulators cannot share a pass (run them one after another instead: :func:`run_one`), or
            ``steer`` adds one that cannot share it with them.
    """
    if not (can_share(sims) or (len(sims) == 1 and vectorized(sims[0]) and sims[0].replica_key is not None)):
        raise ValueError("these simulators cannot train as one population (can_share): run them one by one")
    with gcpause.frozen_heap():
        return _lock_step(list(sims), chunk, on_done, steer)


def run_one(sim: Simulator) -> Outcome:
    """``sim.run()``, or the :class:`~.simulator.RunFailed` it raised."""
    try:
        return sim.run()
    except RunFailed as err:
        return err


def _lock_step(sims: List[Simulator], chunk: int, on_done: Done,
               steer: Optional[Callable[[], Optional[Steer]]] = None) -> List[Outcome]:
    states: Dict[int, tuple] = {}  # i -> (round state, client store, resumed from)
    results: Dict[int, Outcome] = {}

    def done(i: int, outcome: Outcome) -> None:
        results[i] = outcome
        del states[i]
        if on_done is not None:
            on_done(i, outcome)

    def begin(i: int) -> None:
        states[i] = sims[i].begin()
        st, store, resumed = states[i]
        if st["round"] >= sims[i].rounds:  # a checkpoint of the last round: nothing left to train
            done(i, sims[i].finish_run(st, store, resumed))

    for i in range(len(sims)):
        begin(i)
    first_pass = True
    while True:
        if states:
            _one_pass(sims, states, chunk, done)
        if first_pass:  # the first pass imported what it uses: freeze it too
            gcpause.refreeze()
            first_pass = False
        plan = steer() if steer is not None else None
        if plan is not None:
            for i, reason in plan.stop.items():
                if i in states:
                    st, store, _ = states[i]
                    done(i, sims[i].stop(st, store, reason))
            for sim in plan.join:
                if not can_share([sims[0], sim]):
                    raise ValueError("a replica added to the population cannot share its pass (can_share)")
                sims.append(sim)
                begin(len(sims) - 1)
        if not states:
            break
    return [results[i] for i in range(len(sims))]


def _one_pass(sims: List[Simulator], states: Dict[int, tuple], chunk: int, done: Callable[[int, Outcome], None]):
    """One round of the replicas at the lowest round, their clients in one vectorised pass; each replica then ends
    its round, or fails alone (a non-finite loss, an ``InfeasibleSetting`` of its rule)."""
    r = min(st["round"] for st, _, _ in states.values()) + 1
    group = [i for i, (st, _, _) in states.items() if st["round"] + 1 == r]
    starts = {i: sims[i].start_round(r, states[i][0]) for i in group}
    jobs = [PopulationJob(sims[i].executor, starts[i].rctx, starts[i].clients, states[i][1]) for i in group]
    trained = sims[group[0]].executor.run_population(jobs, chunk)
    for i, updates in zip(group, trained):
        st, store, resumed = states[i]
        try:
            if isinstance(updates, Exception):
                raise updates
            sims[i].end_round(starts[i], st, store, updates)
        except (NonFiniteLossError, InfeasibleSetting) as err:  # this replica's own: it ends alone
            done(i, sims[i].fail(st, store, err))
            continue
        if st["round"] >= sims[i].rounds:
            done(i, sims[i].finish_run(st, store, resumed))
