"""Build a ready-to-run :class:`~fl_core.engine.simulator.Simulator` from a composed config."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from ..algorithms import build_algorithm, prepare_model
from ..data.sampling import sample_clients
from ..experiment import ResolvedExperiment, fingerprint
from ..models import build_model
from ..schema import ConfigError
from . import autoprobe, diskstate, kernels, memory
from .autoprobe import ExecutorTiming, time_executors
from .executors import EXECUTORS, ClientData
from .localwork import LocalWork
from .simulator import RunLogger, Simulator
from ..params import ParamSpec


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU.

    Raises:
        ValueError: CUDA requested but not available (names ``engine.device``).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"engine.device={name} but no CUDA device is available (use cpu or auto)")
    return torch.device(name)


def client_data(ds, partition, device: torch.device, dtype: torch.dtype = torch.float32) -> ClientData:
    """Normalised training tensors of ``ds`` on ``device`` with ``partition``'s client index arrays."""
    return ClientData(ds.normalize(ds.x_train).to(device, dtype), ds.y_train.to(device), partition.client_indices,
                      ds.num_classes)


PROBE_TIE = 0.05  # predictions within 5 % of each other: keep the device's default executor


def vectorized_fit(cfg, model: torch.nn.Module, algo, data: ClientData, state_bytes: int,
                   world_size: int = 1, held_bytes: int = 0, replicas: int = 1) -> memory.Fit:
    """Whether the vectorised executor fits this run's rounds on the model's device (:mod:`.memory`).

    n is the number of round 1's sampled clients (``cfg.train``'s sampler and ``cfg.seed``, as the timing probe
    takes them; with ``world_size`` K > 1 ranks, each rank's share ceil(n / K)), C = ``engine.max_parallel_clients``
    (0: n), B = ``train.batch_size``; the activations are measured on one training sample
    (:func:`.memory.activation_bytes`), the available memory read now, with the model and the data in place.

    Args:
        cfg: the composed config; model, algo: the run's model (on its device) and algorithm stack (not changed);
        data: the clients' training data; state_bytes: one client's state (:func:`.diskstate.client_state_bytes`);
        world_size: ranks that share each round's clients (``engine.executor=distributed``).
        held_bytes: what the run adds to the device whichever executor trains (the in-memory store's client states
            when they live on this device).
        replicas: the replicas of a population that train together (:mod:`.population`): n is theirs together.
    """
    t = cfg.train
    device = next(model.parameters()).device
    n = len(sample_clients(len(data.indices), t.participation, t.sampler, int(cfg.seed), 1)) * max(1, int(replicas))
    n = -(-n // max(1, int(world_size)))
    sample = data.x[:1]
    d = sum(p.numel() for p in model.parameters())
    need = memory.vectorized_memory(
        d=d, float_bytes=sample.element_size(), round_clients=n,
        max_parallel_clients=int(cfg.engine.max_parallel_clients), batch_size=int(t.batch_size),
        activation_per_sample=memory.activation_bytes(model, sample), state_bytes=state_bytes,
        sample_bytes=sample.numel() * sample.element_size(),
        extra_vectors=memory.extra_vectors(algo, float(t.momentum), str(t.optimizer)), held_bytes=held_bytes)
    available, where = memory.available_bytes(device)
    return memory.Fit(need, available, where)


def choose_executor(requested: str, algo, model: torch.nn.Module, device: torch.device,
                    probe: Optional[Callable[[], ExecutorTiming]] = None,
                    fit: Optional[Callable[[], memory.Fit]] = None, replicas: int = 1) -> Tuple[str, str]:
    """Resolve ``engine.executor`` (``auto`` included) to an executor name and the reason for it.

    A name other than ``auto`` is taken as given; ``vectorized`` is checked against the memory first (below).
    ``auto`` takes the sequential executor when the vectorised one cannot run (a hook of the algorithm stack only
    runs sequentially, or the model has buffers) or cannot fit (``fit``: its memory estimate above
    :data:`.memory.FIT_FRACTION` of the available memory; the reason gives both and the
    ``engine.max_parallel_clients`` that would fit); otherwise it calls ``probe`` (:func:`.autoprobe.time_executors`
    through :func:`.autoprobe.cached_timing`: one local step of some of round 1's clients with each executor, on
    copies, timed in alternating calls of which each executor's fastest counts; once per workload and process) and
    takes the executor with the lower predicted round time; within ``PROBE_TIE`` (5 %) of each other, or without a probe, or when the probe fails,
    the device's default: vectorised on CUDA, sequential on the CPU. The probe runs only in that last case, never
    when the choice is forced. Both executors train the same model up to float rounding, so the choice changes
    speed, not results.

    Args:
        requested: ``engine.executor`` (``sequential``, ``vectorized``, ``auto`` or another registered name).
        algo: the algorithm stack; model: the model (its buffers decide); device: where the run trains.
        probe: returns the :class:`ExecutorTiming` (called at most once), or None (device default).
        fit: returns the vectorised executor's :class:`.memory.Fit` (:func:`vectorized_fit`; called at most once,
            only for ``auto`` and ``vectorized`` with a stack and a model it can run), or None (no memory check).
        replicas: the replicas the probe's round is for (a population trained together; only named in the reason).

    Returns:
        (executor name, reason): the reason is one line, logged as the MLflow tag ``executor_reason``.

    Raises:
        ConfigError: ``engine.executor=vectorized`` where it does not fit (one line: the estimate, the available
            memory and the ``engine.max_parallel_clients`` that fits, or ``engine.executor=sequential``).
    """
    runnable = algo.vectorizable and not any(True for _ in model.buffers())
    if requested == "vectorized" and runnable and fit is not None:
        check = fit()
        if not check.fits:
            raise ConfigError(f"engine.executor=vectorized needs {check.estimate()}: set engine.max_parallel_clients="
                              f"{check.chunk} (fits) or engine.executor=sequential (or auto)" if check.chunk else
                              f"engine.executor=vectorized needs {check.problem()}: set engine.executor=sequential "
                              "(or auto)")
    if requested != "auto":
        return requested, "engine.executor=" + requested
    if not algo.vectorizable:
        return "sequential", f"auto: {algo.describe()} has hooks that only run sequentially"
    if any(True for _ in model.buffers()):
        return "sequential", "auto: the model has buffers (e.g. BatchNorm)"
    if fit is not None:
        check = fit()
        if not check.fits:
            return "sequential", f"auto: the vectorized executor would need {check.problem()}"
    default = "vectorized" if device.type == "cuda" else "sequential"
    where = "CUDA" if device.type == "cuda" else "CPU"
    if probe is None:
        return default, f"auto: {where} device default ({default}), no timing probe"
    try:
        timing = probe()
    except Exception as err:  # any failure of the probe leaves the device's default
        first = (str(err).splitlines() or [""])[0][:200]
        return default, (f"auto: {where} device default ({default}); the timing probe failed: "
                         f"{type(err).__name__}: {first}")
    seq, vec = timing.round_s["sequential"], timing.round_s["vectorized"]
    if abs(seq - vec) <= PROBE_TIE * max(seq, vec):
        name, why = default, f"within {PROBE_TIE:.0%}, {where} default"
    else:
        name, why = ("vectorized", "faster") if vec < seq else ("sequential", "faster")
    n = timing.clients
    calls = len(timing.samples.get("sequential", ()))
    how = f"fastest of {calls} alternating calls each, " if calls else ""
    again = ", measured once for this workload in this process" if timing.cached else ""
    pop = f" of a population of {replicas} replicas" if replicas > 1 else ""
    return name, (f"auto: {name} ({why}): predicted round 1{pop} on {where}: vectorized {1e3 * vec:.1f} ms, "
                  f"sequential {1e3 * seq:.1f} ms, from one local step of {n['vectorized']} and "
                  f"{n['sequential']} of its {timing.sampled} clients ({how}probe {timing.probe_s:.2f} s{again})")


def job_key(cfg) -> Tuple[str, int]:
    """What identifies one seed's run to the ranks of ``engine.executor=distributed``: (the experiment's fingerprint,
    :func:`fl_core.experiment.fingerprint`, and the seed), as :meth:`.ResolvedExperiment.job_key` gives it. Every
    rank composes the same command, so every rank computes the same key."""
    return fingerprint(cfg), int(cfg.seed)


def _distribute(inner, key: Tuple[str, int]):
    """``engine.executor=distributed``: on rank 0 the :class:`~.distributed.DistributedExecutor` around this rank's
    executor ``inner`` for the seed's job ``key``; on a worker rank ``inner`` itself (it serves rank 0's tasks,
    :func:`~.distributed.serve`)."""
    from . import distributed

    rank, size, _ = distributed.world()
    inner.reason = f"engine.executor=distributed over {size} rank(s); each rank: {inner.name} ({inner.reason})"
    return distributed.DistributedExecutor(inner, key) if rank == 0 else inner


def model_targets(model: torch.nn.Module, data: ClientData, y_test: torch.Tensor) -> Tuple[ClientData, torch.Tensor]:
    """The clients' data and the test labels with the model's targets: relabelled by ``model.label_map`` (int64
    [num_classes], the target of each dataset class; the clients keep their samples), or unchanged without one."""
    label_map = getattr(model, "label_map", None)
    if label_map is None:
        return data, y_test
    label_map = label_map.to(data.y.device)
    return (ClientData(data.x, label_map[data.y], data.indices, int(label_map.max()) + 1),
            label_map.to(y_test.device)[y_test])


def build_simulator(cfg, ds, partition, *, device: torch.device = torch.device("cpu"),  # noqa: B008 (immutable)
                    data: Optional[ClientData] = None, logger: Optional[RunLogger] = None,
                    checkpoint_path: Optional[Path] = None,
                    callbacks: Optional[List[Callable]] = None, cache_dir: Optional[Path] = None,
                    experiment: Optional[ResolvedExperiment] = None, replicas: int = 1) -> Simulator:
    """Model, algorithm stack, executor and round loop for one seed of ``cfg``.

    Args:
        cfg: composed config (see :func:`fl_core.config.compose`): the seed's config of ``experiment``.
        ds: the :class:`~fl_core.data.FLDataset`; partition: its :class:`~fl_core.data.Partition`.
        device: where data, model and states live.
        data: pre-built :class:`ClientData` to share across seeds (else built here).
        logger, checkpoint_path, callbacks: passed to the simulator.
        cache_dir: where the model may cache what it computes from the data (``FLModel.bind_training_data``), or
            None: nothing is written.
        experiment: the experiment ``cfg`` is a seed of (:func:`fl_core.experiment.resolve`), whose fingerprint names
            the seed's job between the ranks of ``engine.executor=distributed``; None: computed from ``cfg``.
        replicas: how many replicas like this one are meant to train together as a population (an experiment's
            seeds, a sweep's batch; :mod:`.population`): ``engine.executor=auto`` then times R of them one after
            another on the sequential executor against one pass of all of them on the vectorised one
            (:func:`.autoprobe.time_executors`). 1: a single run.

    A model with a ``label_map`` trains and is tested on its own targets (:func:`model_targets`); the model then
    sees the clients' data once (``bind_training_data``) before the executor is chosen.

    The simulator gets the clients' training label counts [N, C] (``data.label_counts``, the partition's
    histogram over the tensors the clients train on), so every evaluation also reports the per-client
    accuracy summary ``client_acc_mean`` / ``_std`` / ``_worst10``.
    """
    kernels.apply(cfg.engine.kernels, device, cfg.engine.threads, cfg.engine.float32_precision,
                  bool(cfg.engine.deterministic))
    dtype = DTYPES[cfg.engine.dtype]
    data = data or client_data(ds, partition, device, dtype)
    model = build_model(cfg.model, cfg.dataset.name, ds.input_shape, ds.num_classes,
                        input_norm=(ds.mean, ds.std)).to(device, dtype)
    prepare_model(cfg.algorithm, model)  # parameters a rule trains besides the network's (a head), before the layout
    data, y_test = model_targets(model, data, ds.y_test.to(device))
    if hasattr(model, "bind_training_data"):
        model.bind_training_data(data.x, data.y, torch.cat(data.indices), cache_dir)
    spec = ParamSpec.from_model(model)
    t = cfg.train
    algo = build_algorithm(cfg.algorithm, spec, model, momentum=float(t.momentum), optimizer=str(t.optimizer))
    distributed = cfg.engine.executor == "distributed"
    kwargs = executor_kwargs(cfg)
    state_bytes = diskstate.client_state_bytes(algo, spec.d, dtype)  # the rule's declared state, nothing allocated
    store, store_reason = diskstate.choose(cfg.engine.client_state, partition.num_clients, state_bytes)
    rank, ranks = 0, 1  # engine.executor=distributed: each of torchrun's ranks trains a share; rank 0 holds the store
    if distributed:
        from .distributed import world

        rank, ranks, _ = world()
    # the in-memory store keeps every client's state on the host (Simulator._open_store): RAM the run will take
    held = partition.num_clients * state_bytes if store == "memory" and device.type == "cpu" and rank == 0 else 0
    replicas = 1 if distributed else max(1, int(replicas))
    name, reason = choose_executor(cfg.engine.rank_executor if distributed else cfg.engine.executor, algo, model,
                                   device, probe=lambda: autoprobe.cached_timing(
                                       autoprobe.workload_key(cfg, model, data, kwargs, replicas),
                                       lambda: time_executors(cfg, model, algo, data, kwargs, replicas=replicas)),
                                   fit=lambda: vectorized_fit(cfg, model, algo, data, state_bytes, ranks, held),
                                   replicas=replicas)

    if name == "vectorized":
        kwargs["max_parallel_clients"] = cfg.engine.max_parallel_clients
    executor = EXECUTORS[name](model, algo, data, **kwargs)
    executor.reason = reason
    if distributed:
        executor = _distribute(executor, experiment.job_key(cfg.seed) if experiment is not None else job_key(cfg))
    sim = Simulator(model=model, algorithm=algo, executor=executor,
                     x_test=ds.normalize(ds.x_test).to(device, dtype), y_test=y_test,
                     num_clients=partition.num_clients, participation=t.participation, sampler=t.sampler,
                     rounds=t.rounds, lr=t.lr, lr_decay=t.lr_decay, eval_every=t.eval_every,
                     eval_batch_size=cfg.engine.eval_batch_size, seed=int(cfg.seed),
                     checkpoint_path=checkpoint_path, checkpoint_every=cfg.engine.checkpoint_every,
                     logger=logger, callbacks=callbacks,
                     neuron_drift_samples=cfg.tracking.neuron_drift_samples,
                     layer_cosine=cfg.tracking.layer_cosine, drift_every=int(cfg.tracking.drift),
                     client_loss_trace=cfg.tracking.client_loss_trace,
                     client_label_counts=torch.stack(data.label_counts).cpu(), client_state=store,
                     local_work=LocalWork(int(t.local_epochs), t.local_epochs_max, float(t.stragglers),
                                          bool(t.drop_stragglers)))
    sim.client_state_reason = store_reason
    sim.replica_key = replica_key(cfg)
    return sim


SHARED_SECTIONS = ("algorithm", "model", "dataset", "partition")  # what a population's replicas share (replica_key)


def executor_kwargs(cfg) -> dict:
    """The keyword arguments every executor of ``cfg``'s run is built with (the local-step settings of ``train``
    and the seed)."""
    t = cfg.train
    return dict(batch_size=t.batch_size, local_epochs=t.local_epochs, weight_decay=t.weight_decay,
                momentum=float(t.momentum), grad_clip=t.grad_clip, seed=int(cfg.seed), augmentation=t.augmentation,
                crop_padding=t.crop_padding, local_steps=t.local_steps, optimizer=str(t.optimizer))


def population_timing(cfg, sim: Simulator, replicas: int) -> ExecutorTiming:
    """``engine.executor=auto``'s timing probe for a population of ``replicas`` replicas like ``sim`` (:func:`build_simulator`
    with ``replicas``; measured once per workload and process, :func:`.autoprobe.cached_timing`): the predicted round
    of all of them on each executor.

    Raises:
        whatever the probe raises (:func:`.autoprobe.time_executors`).
    """
    kwargs, data = executor_kwargs(cfg), sim.executor.data
    return autoprobe.cached_timing(autoprobe.workload_key(cfg, sim.model, data, kwargs, replicas),
                                   lambda: time_executors(cfg, sim.model, sim.algo, data, kwargs, replicas=replicas))


def replica_key(cfg) -> str:
    """What replicas of a population must share beyond the simulator's own settings: the rule stack's, the model's,
    the dataset's and the partition's config sections (a rule's hyperparameters are not in its description, and the
    batched hooks run on the first replica's instance; :func:`.population.can_share`), but the keys a replica
    carries itself (:func:`fl_core.config.replica_keys`: eta_g and the rules' replica parameters)."""
    import json

    from ..config import drop_keys, replica_keys, to_container

    c = to_container(cfg)
    return json.dumps(drop_keys({k: c[k] for k in SHARED_SECTIONS}, replica_keys()), sort_keys=True, default=str)


def population_chunk(cfg, sim: Simulator, replicas: int) -> int:
    """The clients a population of ``replicas`` replicas like ``sim`` (seed or eta_l apart) trains at once
    (:meth:`~.executors.VectorizedExecutor.run_population`): ``engine.max_parallel_clients`` when set, else 0 (all of
    a round's clients of every replica) when that fits in memory (:func:`vectorized_fit` for them together, the
    replicas' in-memory client states held), else the most that fit (at least one client)."""
    if int(cfg.engine.max_parallel_clients):
        return int(cfg.engine.max_parallel_clients)
    dtype = DTYPES[cfg.engine.dtype]
    state_bytes = diskstate.client_state_bytes(sim.algo, sim.spec.d, dtype)
    held = sim.num_clients * state_bytes * replicas if sim.client_state == "memory" and sim.device.type == "cpu" else 0
    fit = vectorized_fit(cfg, sim.model, sim.algo, sim.executor.data, state_bytes, held_bytes=held, replicas=replicas)
    return 0 if fit.fits else max(1, fit.chunk)
