"""Shared helpers of the pipeline stages: data access, devices, atomic file writes, CLI errors."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fl_core.data import FLDataset, Partition, get_dataset, get_partition, load_source, make_partition
from fl_core.data.partition import partition_key
from fl_core.data.sources import prepared_path

from .files import atomic_write, write_json, write_text  # noqa: F401  (re-exported)


def dataset_for(cfg, *, write_cache: bool) -> FLDataset:
    """The dataset of ``cfg``: the prepared cache under ``data_dir`` if present.

    With ``write_cache`` (the prepare stage) a missing cache is created; without it (single runs)
    the raw source is read and nothing is written, so ad-hoc runs never touch DVC outputs.
    """
    data_dir = Path(cfg.data_dir)
    if write_cache:
        return get_dataset(cfg.dataset, data_dir, project_root=Path.cwd())
    cached = prepared_path(cfg.dataset, data_dir)
    if cached.exists():
        return get_dataset(cfg.dataset, data_dir, project_root=Path.cwd())
    root = Path(cfg.dataset.root)
    return load_source(cfg.dataset, root if root.is_absolute() else Path.cwd() / root)


def partition_for(cfg, ds: FLDataset, *, write_cache: bool) -> Partition:
    """The partition of ``cfg`` over ``ds``'s training labels (cached like :func:`dataset_for`)."""
    labels = ds.y_train.numpy()
    data_dir = Path(cfg.data_dir)
    key_dir = data_dir / "partitions" / partition_key(cfg.partition, cfg.dataset.name)
    if write_cache or key_dir.exists():
        return get_partition(cfg.partition, cfg.dataset.name, labels, ds.num_classes, data_dir)
    return make_partition(cfg.partition, labels, ds.num_classes)


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


def fail(message: str, code: int = 2) -> "None":
    """Print a one-line error to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
