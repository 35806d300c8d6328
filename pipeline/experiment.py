"""The one runner of an experiment's seeds: its data, partition and client data, one simulator per seed, and the
seeds trained as one population where they can share a pass (:mod:`fl_core.engine.population`), else one after
another.

Every caller trains seeds through :class:`ExperimentRunner`: the train stage and ``fl-train``
(:mod:`pipeline.train`: result files, completion records, checkpoints, MLflow children), the Python API
(:mod:`pipeline.api`, in memory), the sweeps (:func:`sweeps.trials.train_seeds`) and a worker rank of
``engine.executor=distributed`` (:func:`pipeline.train._serve`, which only builds the simulators). What a caller
does with a seed's rounds it says through :class:`Observer`: the seed's run logger (built here, with its
simulator), that the seed starts (and from which round), each round's row, and the seed's end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fl_core.experiment import ResolvedExperiment


class Observer:
    """What a caller hears of the seeds a runner trains; each method does nothing unless overridden.

    ``logger`` is asked once per seed, before its simulator is built (the first observer that returns one gives the
    seed's :class:`~fl_core.engine.simulator.RunLogger`); ``built`` when its simulator is built; ``started`` when the seed begins training at round
    ``resumed_from + 1`` (0: from scratch); ``round`` after each of its rounds is logged (it may raise to stop the
    run, e.g. ``optuna.TrialPruned``); ``finished`` as soon as the seed has ended (a population's seeds end
    together; it may raise to stop the seeds not yet ended)."""

    def logger(self, seed: int, cfg: Any):
        return None

    def built(self, run: "SeedRun") -> None:
        pass

    def started(self, seed: int, resumed_from: int) -> None:
        pass

    def round(self, seed: int, r: int, row: Dict[str, float]) -> None:
        pass

    def finished(self, run: "SeedRun") -> None:
        pass


class OnRound(Observer):
    """An observer of rounds only: ``fn(seed, round, row)``."""

    def __init__(self, fn: Callable[[int, int, Dict[str, float]], None]):
        self.fn = fn

    def round(self, seed: int, r: int, row: Dict[str, float]) -> None:
        self.fn(seed, r, row)


@dataclass
class SeedRun:
    """One seed trained by the runner: its config, its simulator and how it ended (``result``, or ``failure``:
    the :class:`~fl_core.engine.simulator.RunFailed` of a non-finite loss)."""

    seed: int
    cfg: Any
    sim: Any
    result: Any = None
    failure: Any = None

    @property
    def history(self) -> List[Dict[str, float]]:
        return self.failure.history if self.failure is not None else self.result.history


@dataclass
class Inputs:
    """What every seed of an experiment trains on: the dataset, its partition, the clients' tensors and the device."""

    ds: Any
    part: Any
    data: Any
    device: Any

    @classmethod
    def load(cls, cfg, device=None) -> "Inputs":
        """The inputs of ``cfg`` (its dataset, partition, ``engine.device`` unless ``device`` is given, and
        ``engine.dtype``); raises what the data loaders raise (:class:`~fl_core.data.DataSourceError`,
        :class:`~fl_core.data.PartitionError`, ...)."""
        from fl_core.data.access import dataset_for, partition_for
        from fl_core.engine.factory import DTYPES, client_data, resolve_device

        device = resolve_device(cfg.engine.device) if device is None else device
        ds = dataset_for(cfg, write_cache=False)
        part = partition_for(cfg, ds, write_cache=False)
        return cls(ds, part, client_data(ds, part, device, DTYPES[cfg.engine.dtype]), device)


class ExperimentRunner:
    """Trains the seeds of one resolved experiment (:func:`fl_core.experiment.resolve`).

    Args:
        exp: the experiment; its configs differ only in ``seed``.
        inputs: its :class:`Inputs` when the caller holds them (the sweeps' cache), else loaded here.
        cache_dir: where a model may cache what it computes from the data (``FLModel.bind_training_data``); None:
            nothing is written.
    """

    def __init__(self, exp: ResolvedExperiment, inputs: Optional[Inputs] = None, cache_dir: Optional[Path] = None):
        self.exp = exp
        self.inputs = inputs or Inputs.load(exp.cfg0)
        self.cache_dir = cache_dir

    def simulator(self, cfg, *, checkpoint_path: Optional[Path] = None, logger=None,
                  callbacks: Sequence[Callable] = (), replicas: int = 1):
        """The simulator of one seed's config ``cfg`` (:func:`fl_core.engine.factory.build_simulator`; ``replicas``:
        how many train together with it, for ``engine.executor=auto``'s choice)."""
        from fl_core.engine.factory import build_simulator

        i = self.inputs
        return build_simulator(cfg, i.ds, i.part, device=i.device, data=i.data, logger=logger,
                               checkpoint_path=checkpoint_path, callbacks=list(callbacks),
                               cache_dir=self.cache_dir, experiment=self.exp, replicas=replicas)

    def train(self, cfgs: Optional[Sequence] = None, observers: Sequence[Observer] = (), *,
              checkpoint_path: Optional[Callable[[int], Optional[Path]]] = None,
              together: bool = True) -> List[SeedRun]:
        """Train the seeds of ``cfgs`` (default: all of the experiment's), in order: :func:`train_together` with this
        experiment alone.

        Args:
            cfgs: the seeds' configs (a subset of the experiment's: the seeds not done yet).
            observers: see :class:`Observer`.
            checkpoint_path: ``checkpoint_path(seed)``: the seed's checkpoint file, or None for none.
            together: False: never as a population (one seed after another); ``engine.population`` must allow it
                too.

        Returns:
            one :class:`SeedRun` per config, in order.

        Raises:
            whatever building a simulator raises (ConfigError, ValueError), and what an observer raises.
        """
        cfgs = list(self.exp.configs if cfgs is None else cfgs)
        return train_together([Part(self, cfgs, observers, checkpoint_path)], together)[0]

    def _build(self, cfg, observers: Sequence[Observer], checkpoint_path, replicas: int = 1) -> SeedRun:
        seed = int(cfg.seed)
        logger = next((lg for lg in (ob.logger(seed, cfg) for ob in observers) if lg is not None), None)
        sim = self.simulator(cfg, checkpoint_path=checkpoint_path(seed) if checkpoint_path else None, logger=logger,
                             callbacks=[functools.partial(ob.round, seed) for ob in observers], replicas=replicas)
        run = SeedRun(seed, cfg, sim)
        for ob in observers:
            ob.built(run)
        return run


@dataclass
class Part:
    """One experiment's share of :func:`train_together`: its runner, the seeds' configs to train, its observers and
    ``checkpoint_path(seed)`` (None: no checkpoints)."""

    runner: ExperimentRunner
    cfgs: Sequence[Any]
    observers: Sequence[Observer] = ()
    checkpoint_path: Optional[Callable[[int], Optional[Path]]] = None


def train_together(parts: Sequence[Part], together: bool = True) -> List[List[SeedRun]]:
    """Train the seeds of one or more experiments: as one population where they can, else one after another.

    When the first seed's simulator runs on the vectorised executor with ``engine.population`` on and there are
    several seeds in all, every seed's simulator is built, and if they can share a pass
    (:func:`fl_core.engine.population.can_share`: the seeds of one experiment, or experiments that differ only in
    the keys a replica carries, :func:`fl_core.config.replica_keys`) they train as one population, in chunks that fit
    in memory (:func:`fl_core.engine.factory.population_chunk`); ``engine.executor=auto`` chooses for that
    population (:func:`fl_core.engine.factory.build_simulator`'s ``replicas``). Otherwise each seed is built,
    trained and reported before the next is built (fault point ``between_seeds`` between two). Each seed is
    reported to its own experiment's observers (:class:`Observer`).

    Args:
        parts: the experiments and the seeds of each to train.
        together: False: never as a population.

    Returns:
        per part, one :class:`SeedRun` per config, in order.

    Raises:
        whatever building a simulator raises (ConfigError, ValueError), and what an observer raises.
    """
    from fl_core.engine import population

    out: List[List[SeedRun]] = [[] for _ in parts]
    todo = [(i, cfg) for i, part in enumerate(parts) for cfg in part.cfgs]
    if not todo:
        return out
    replicas = len(todo) if together and bool(todo[0][1].engine.population) else 1
    built = [_build(parts, todo[0], replicas)]
    if replicas > 1 and _as_population(parts, todo, built, out, None, replicas):
        return out
    for k, (i, _) in enumerate(todo):
        if k:
            from fl_core.store import faults

            faults.point("between_seeds")
            built.append(_build(parts, todo[k], 1))
        run = built[k]
        out[i].append(run)
        _started(run, parts[i].observers)
        _ended(run, parts[i].observers, population.run_one(run.sim))
    return out


@dataclass
class Steer:
    """What the caller of :func:`train_population` decides between two passes: ``stop`` (part index, seed) ->
    reason, those seeds end now (:class:`~fl_core.engine.simulator.RunStopped`, reported to their observers);
    ``join``: new parts whose seeds begin now in the same population (they must share its pass)."""

    stop: Dict[Tuple[int, int], str] = field(default_factory=dict)
    join: List[Part] = field(default_factory=list)


def train_population(parts: Sequence[Part], steer: Callable[[], Optional[Steer]],
                     replicas: int) -> Optional[List[List[SeedRun]]]:
    """Train the seeds of ``parts`` as one population that ``steer`` may shrink and refill between passes (a sweep's
    batch: :mod:`sweeps.batch`), or nothing when they cannot share a pass (the first seed's simulator is not on the
    vectorised executor, e.g. ``engine.executor=auto`` found the sequential one faster for ``replicas`` replicas;
    or they differ in more than the keys a replica carries): then None, and nothing was trained.

    Args:
        parts: the experiments and their seeds.
        steer: asked after every pass (:class:`Steer`); the parts it adds are appended to ``parts`` (a list).
        replicas: the most replicas that will train at once (the memory estimate's chunking and ``auto``'s choice).

    Returns:
        per part (those ``steer`` added included), one :class:`SeedRun` per config, in order; or None.

    Raises:
        whatever building a simulator raises (ConfigError, ValueError), and what an observer raises.
    """
    parts = parts if isinstance(parts, list) else list(parts)
    out: List[List[SeedRun]] = [[] for _ in parts]
    todo = [(i, cfg) for i, part in enumerate(parts) for cfg in part.cfgs]
    if not todo:
        return out
    built = [_build(parts, todo[0], replicas)]
    return out if _as_population(parts, todo, built, out, steer, replicas) else None


def _build(parts: Sequence[Part], job: Tuple[int, Any], replicas: int) -> SeedRun:
    i, cfg = job
    return parts[i].runner._build(cfg, parts[i].observers, parts[i].checkpoint_path, replicas)


def _as_population(parts: List[Part], todo: List[Tuple[int, Any]], built: List[SeedRun], out: List[List[SeedRun]],
                   steer: Optional[Callable[[], Optional[Steer]]], replicas: int) -> bool:
    """Train ``todo`` (``built`` holds its first seed's run) as one population if it can share a pass: True once
    trained (``out`` filled), False when it cannot (only ``built[0]`` is kept built)."""
    from fl_core.engine import factory, population

    if not population.vectorized(built[0].sim):
        return False
    built += [_build(parts, job, replicas) for job in todo[1:]]
    sims = [run.sim for run in built]
    if len(sims) > 1 and not population.can_share(sims):
        del built[1:]  # replicas that cannot share a pass: one after another, built one at a time
        return False
    owner = [i for i, _ in todo]  # replica index -> its part
    for i, run in zip(owner, built):
        out[i].append(run)
        _started(run, parts[i].observers)
    where = {(i, run.seed): k for k, (i, run) in enumerate(zip(owner, built))}

    def ended(k: int, outcome: Any) -> None:
        _ended(built[k], parts[owner[k]].observers, outcome)

    def steered() -> Optional[population.Steer]:
        plan = steer()
        if plan is None:
            return None
        joined = []
        for part in plan.join:
            parts.append(part)
            out.append([])
            i = len(parts) - 1
            for cfg in part.cfgs:
                run = _build(parts, (i, cfg), replicas)
                where[(i, run.seed)] = len(built)
                built.append(run)
                owner.append(i)
                out[i].append(run)
                _started(run, part.observers)
                joined.append(run.sim)
        return population.Steer({where[key]: why for key, why in plan.stop.items() if key in where}, joined)

    chunk = factory.population_chunk(todo[0][1], sims[0], max(replicas, len(sims)))
    population.run_together(sims, chunk, ended, steered if steer is not None else None)
    return True


def _started(run: SeedRun, observers: Sequence[Observer]) -> None:
    resumed_from = run.sim.restore()
    for ob in observers:
        ob.started(run.seed, resumed_from)


def _ended(run: SeedRun, observers: Sequence[Observer], outcome: Any) -> None:
    from fl_core.engine.simulator import RunFailed

    if isinstance(outcome, RunFailed):
        run.failure = outcome
    else:
        run.result = outcome
    for ob in observers:
        ob.finished(run)
