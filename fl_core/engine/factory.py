"""Build a ready-to-run :class:`~fl_core.engine.simulator.Simulator` from a composed config."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from ..algorithms import build_algorithm
from ..models import build_model
from . import diskstate
from .executors import EXECUTORS, ClientData
from .simulator import RunLogger, Simulator, config_fingerprint
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


def choose_executor(requested: str, algo, model: torch.nn.Module, device: torch.device) -> Tuple[str, str]:
    """Resolve ``engine.executor`` (``auto`` included) to an executor name and the reason for it.

    ``auto`` picks the vectorised executor on CUDA when every hook of the algorithm stack supports
    it and the model has no buffers; on the CPU it keeps the sequential executor, which the round
    benchmark measured faster there for the models of this project (docs/benchmarks.md).
    """
    if requested != "auto":
        return requested, "engine.executor=" + requested
    if not algo.vectorizable:
        return "sequential", f"auto: {algo.describe()} has hooks that only run sequentially"
    if any(True for _ in model.buffers()):
        return "sequential", "auto: the model has buffers (e.g. BatchNorm)"
    if device.type != "cuda":
        return "sequential", "auto: CPU device, where the sequential executor is faster (docs/benchmarks.md)"
    return "vectorized", "auto: CUDA device and every hook supports vmap"


def job_key(cfg) -> Tuple[str, int]:
    """What identifies one seed's run to the ranks of ``engine.executor=distributed``: (hash of the sections that
    determine the numbers, seed). Every rank composes the same command, so every rank computes the same key."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    return config_fingerprint({k: c[k] for k in ("dataset", "partition", "model", "algorithm", "train")}), int(cfg.seed)


def _distribute(inner, cfg):
    """``engine.executor=distributed``: on rank 0 the :class:`~.distributed.DistributedExecutor` around this rank's
    executor ``inner``; on a worker rank ``inner`` itself (it serves rank 0's tasks, :func:`~.distributed.serve`)."""
    from . import distributed

    rank, size, _ = distributed.world()
    inner.reason = f"engine.executor=distributed over {size} rank(s); each rank: {inner.name} ({inner.reason})"
    return distributed.DistributedExecutor(inner, job_key(cfg)) if rank == 0 else inner


def build_simulator(cfg, ds, partition, *, device: torch.device = torch.device("cpu"),  # noqa: B008 (immutable)
                    data: Optional[ClientData] = None, logger: Optional[RunLogger] = None,
                    checkpoint_path: Optional[Path] = None,
                    callbacks: Optional[List[Callable]] = None) -> Simulator:
    """Model, algorithm stack, executor and round loop for one seed of ``cfg``.

    Args:
        cfg: composed config (see :func:`fl_core.config.compose`).
        ds: the :class:`~fl_core.data.FLDataset`; partition: its :class:`~fl_core.data.Partition`.
        device: where data, model and states live.
        data: pre-built :class:`ClientData` to share across seeds (else built here).
        logger, checkpoint_path, callbacks: passed to the simulator.

    The simulator gets the clients' training label counts [N, C] (``data.label_counts``, the partition's
    histogram over the tensors the clients train on), so every evaluation also reports the per-client
    accuracy summary ``client_acc_mean`` / ``_std`` / ``_worst10``.
    """
    dtype = DTYPES[cfg.engine.dtype]
    data = data or client_data(ds, partition, device, dtype)
    model = build_model(cfg.model, cfg.dataset.name, ds.input_shape, ds.num_classes).to(device, dtype)
    algo = build_algorithm(cfg.algorithm, ParamSpec.from_model(model), model)
    t = cfg.train
    distributed = cfg.engine.executor == "distributed"
    name, reason = choose_executor(cfg.engine.rank_executor if distributed else cfg.engine.executor, algo, model,
                                   device)
    kwargs = dict(batch_size=t.batch_size, local_epochs=t.local_epochs, weight_decay=t.weight_decay,
                  grad_clip=t.grad_clip, seed=int(cfg.seed), augmentation=t.augmentation,
                  crop_padding=t.crop_padding, local_steps=t.local_steps)
    if name == "vectorized":
        kwargs["max_parallel_clients"] = cfg.engine.max_parallel_clients
    executor = EXECUTORS[name](model, algo, data, **kwargs)
    executor.reason = reason
    if distributed:
        executor = _distribute(executor, cfg)
    init = algo.init_client_state(torch.zeros(ParamSpec.from_model(model).d, dtype=dtype, device=device))
    store, store_reason = diskstate.choose(cfg.engine.client_state, partition.num_clients,
                                           sum(v.numel() * v.element_size() for v in (init or {}).values()))
    sim = Simulator(model=model, algorithm=algo, executor=executor,
                     x_test=ds.normalize(ds.x_test).to(device, dtype), y_test=ds.y_test.to(device),
                     num_clients=partition.num_clients, participation=t.participation, sampler=t.sampler,
                     rounds=t.rounds, lr=t.lr, lr_decay=t.lr_decay, eval_every=t.eval_every,
                     eval_batch_size=cfg.engine.eval_batch_size, seed=int(cfg.seed),
                     checkpoint_path=checkpoint_path, checkpoint_every=cfg.engine.checkpoint_every,
                     logger=logger, callbacks=callbacks,
                     neuron_drift_samples=cfg.tracking.neuron_drift_samples,
                     layer_cosine=cfg.tracking.layer_cosine, client_loss_trace=cfg.tracking.client_loss_trace,
                     client_label_counts=torch.stack(data.label_counts).cpu(), client_state=store)
    sim.client_state_reason = store_reason
    return sim
