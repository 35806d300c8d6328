"""The one runner of an experiment's seeds: its data, partition and client data, one simulator per seed, and the
seeds trained as one population where they can share a pass (:mod:`fl_core.engine.population`), else one after
another.

Every caller trains seeds through :class:`ExperimentRunner`: the train stage and ``fl-train``
(:mod:`pipeline.train`: result files, completion records, checkpoints, MLflow children), the Python API
(:mod:`pipeline.api`, in memory), the sweeps (:func:`sweeps.runner.train_seeds`) and a worker rank of
``engine.executor=distributed`` (:func:`pipeline.train._serve`, which only builds the simulators). What a caller
does with a seed's rounds it says through :class:`Observer`: the seed's run logger (built here, with its
simulator), that the seed starts (and from which round), each round's row, and the seed's end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

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
                  callbacks: Sequence[Callable] = ()):
        """The simulator of one seed's config ``cfg`` (:func:`fl_core.engine.factory.build_simulator`)."""
        from fl_core.engine.factory import build_simulator

        i = self.inputs
        return build_simulator(cfg, i.ds, i.part, device=i.device, data=i.data, logger=logger,
                               checkpoint_path=checkpoint_path, callbacks=list(callbacks),
                               cache_dir=self.cache_dir, experiment=self.exp)

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

    def _build(self, cfg, observers: Sequence[Observer], checkpoint_path) -> SeedRun:
        seed = int(cfg.seed)
        logger = next((lg for lg in (ob.logger(seed, cfg) for ob in observers) if lg is not None), None)
        sim = self.simulator(cfg, checkpoint_path=checkpoint_path(seed) if checkpoint_path else None, logger=logger,
                             callbacks=[functools.partial(ob.round, seed) for ob in observers])
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
    eta_l and the rule parameters a replica carries) they train as one population, in chunks that fit in memory
    (:func:`fl_core.engine.factory.population_chunk`). Otherwise each seed is built, trained and reported before the
    next is built (fault point ``between_seeds`` between two). Each seed is reported to its own experiment's
    observers (:class:`Observer`).

    Args:
        parts: the experiments and the seeds of each to train.
        together: False: never as a population.

    Returns:
        per part, one :class:`SeedRun` per config, in order.

    Raises:
        whatever building a simulator raises (ConfigError, ValueError), and what an observer raises.
    """
    from fl_core.engine import factory, population

    out: List[List[SeedRun]] = [[] for _ in parts]
    todo = [(i, cfg) for i, part in enumerate(parts) for cfg in part.cfgs]
    if not todo:
        return out

    def build(k: int) -> SeedRun:
        i, cfg = todo[k]
        return parts[i].runner._build(cfg, parts[i].observers, parts[i].checkpoint_path)

    built = [build(0)]
    cfg0 = todo[0][1]
    if together and bool(cfg0.engine.population) and len(todo) > 1 and population.vectorized(built[0].sim):
        built += [build(k) for k in range(1, len(todo))]
        sims = [run.sim for run in built]
        if population.can_share(sims):
            for (i, _), run in zip(todo, built):
                out[i].append(run)
                _started(run, parts[i].observers)
            chunk = factory.population_chunk(cfg0, sims[0], len(sims))
            population.run_together(sims, chunk, lambda k, outcome: _ended(built[k], parts[todo[k][0]].observers,
                                                                          outcome))
            return out
        built = built[:1]  # replicas that cannot share a pass: one after another, built one at a time
    for k, (i, _) in enumerate(todo):
        if k:
            from fl_core.store import faults

            faults.point("between_seeds")
            built.append(build(k))
        run = built[k]
        out[i].append(run)
        _started(run, parts[i].observers)
        _ended(run, parts[i].observers, population.run_one(run.sim))
    return out


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
