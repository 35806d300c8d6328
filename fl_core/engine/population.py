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

A replica whose loss becomes non-finite ends FAILED alone; the others go on. Replicas that cannot share a pass
(another executor, a rule stack or model that differs: :func:`can_share`) run one after another, each with
:func:`run_one` (:class:`pipeline.experiment.ExperimentRunner` decides).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

from . import gcpause
from .executors import NonFiniteLossError, PopulationJob, VectorizedExecutor
from .simulator import RunFailed, RunResult, Simulator

Outcome = Union[RunResult, RunFailed]


def vectorized(sim: Simulator) -> bool:
    """Whether ``sim`` trains on the vectorised executor itself (not wrapped by another, e.g. distributed): the
    executor a population needs."""
    return type(sim.executor) is VectorizedExecutor


def can_share(sims: Sequence[Simulator]) -> bool:
    """Whether ``sims`` can train as one population: at least two, each on the vectorised executor (not wrapped by
    another, e.g. distributed), built by the factory from configs with the same rule stack, model, dataset and
    partition sections (:func:`.factory.replica_key`: so one model architecture, federation and client data, and a
    rule's hyperparameters, as the batched hooks run on the first replica's instance, but those a replica carries
    itself, ``replica_params``), of one round count and local-step settings
    (:meth:`~.executors.VectorizedExecutor.local_settings`); eta_l and the seed may differ."""
    if len(sims) < 2 or not all(vectorized(s) and s.replica_key is not None for s in sims):
        return False  # (a simulator not built by the factory: what it shares is unknown)

    def key(s: Simulator) -> tuple:
        return s.replica_key, s.rounds, s.executor.local_settings()

    return all(key(s) == key(sims[0]) for s in sims[1:])


Done = Optional[Callable[[int, Outcome], None]]


def run_together(sims: Sequence[Simulator], chunk: int = 0, on_done: Done = None) -> List[Outcome]:
    """Run the simulators ``sims`` (:func:`can_share`) to their end as one population, ``chunk`` clients at once (0:
    all of a round's clients of every replica; :func:`.factory.population_chunk`). ``on_done(i, outcome)`` hears of
    each replica as soon as it ends (it may raise to stop the rest). Returns, in order, each one's
    :class:`~.simulator.RunResult` or the :class:`~.simulator.RunFailed` it ended with (its logger's run closed
    FAILED).

    Raises:
        ValueError: the simulators cannot share a pass (run them one after another instead: :func:`run_one`).
    """
    if not can_share(sims):
        raise ValueError("these simulators cannot train as one population (can_share): run them one by one")
    with gcpause.frozen_heap():
        return _lock_step(list(sims), chunk, on_done)


def run_one(sim: Simulator) -> Outcome:
    """``sim.run()``, or the :class:`~.simulator.RunFailed` it raised."""
    try:
        return sim.run()
    except RunFailed as err:
        return err


def _lock_step(sims: List[Simulator], chunk: int, on_done: Done) -> List[Outcome]:
    states = {i: sim.begin() for i, sim in enumerate(sims)}  # i -> (round state, client store, resumed from)
    results: Dict[int, Outcome] = {}

    def done(i: int, outcome: Outcome) -> None:
        results[i] = outcome
        del states[i]
        if on_done is not None:
            on_done(i, outcome)

    for i, (st, store, resumed) in list(states.items()):
        if st["round"] >= sims[i].rounds:  # a checkpoint of the last round: nothing left to train
            done(i, sims[i].finish_run(st, store, resumed))
    first_pass = True
    while states:
        r = min(st["round"] for st, _, _ in states.values()) + 1
        group = [i for i, (st, _, _) in states.items() if st["round"] + 1 == r]
        starts = {i: sims[i].start_round(r, states[i][0]) for i in group}
        jobs = [PopulationJob(sims[i].executor, starts[i].rctx, starts[i].clients, states[i][1]) for i in group]
        trained = sims[group[0]].executor.run_population(jobs, chunk)
        for i, updates in zip(group, trained):
            st, store, resumed = states[i]
            try:
                if isinstance(updates, NonFiniteLossError):
                    raise updates
                sims[i].end_round(starts[i], st, store, updates)
            except NonFiniteLossError as err:
                done(i, sims[i].fail(st, store, err))
                continue
            if st["round"] >= sims[i].rounds:
                done(i, sims[i].finish_run(st, store, resumed))
        if first_pass:  # the first pass imported what it uses: freeze it too
            gcpause.refreeze()
            first_pass = False
    return [results[i] for i in range(len(sims))]
