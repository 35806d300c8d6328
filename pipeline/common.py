"""Shared helpers of the pipeline stages: data access, devices, atomic file writes, CLI errors."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fl_core.data import FLDataset, Partition, get_dataset, get_partition, holdout_validation, load_source, make_partition
from fl_core.data.partition import partition_key
from fl_core.data.sources import prepared_path

from .files import atomic_write, write_json, write_text  # noqa: F401  (re-exported)


def dataset_for(cfg, *, write_cache: bool) -> FLDataset:
    """The dataset of ``cfg``: the prepared cache under ``data_dir`` if present.

    With ``write_cache`` (the prepare stage) a missing cache is created; without it (single runs)
    the raw source is read and nothing is written, so ad-hoc runs never touch DVC outputs.
    With ``dataset.validation_fraction > 0`` the returned dataset's test split is the validation
    share held out of the training set (:func:`fl_core.data.holdout_validation`).
    """
    data_dir = Path(cfg.data_dir)
    if write_cache or prepared_path(cfg.dataset, data_dir).exists():
        ds = get_dataset(cfg.dataset, data_dir, project_root=Path.cwd())
    else:
        root = Path(cfg.dataset.root)
        ds = load_source(cfg.dataset, root if root.is_absolute() else Path.cwd() / root)
    fraction = float(getattr(cfg.dataset, "validation_fraction", 0.0) or 0.0)
    if fraction > 0:
        ds = holdout_validation(ds, fraction, int(cfg.dataset.split_seed))
    return ds


def partition_for(cfg, ds: FLDataset, *, write_cache: bool) -> Partition:
    """The partition of ``cfg`` over ``ds``'s training labels (cached like :func:`dataset_for`)."""
    labels = ds.y_train.numpy()
    data_dir = Path(cfg.data_dir)
    key_dir = data_dir / "partitions" / partition_key(cfg.partition, cfg.dataset.name)
    if float(getattr(cfg.dataset, "validation_fraction", 0.0) or 0.0) > 0:  # another training set: never cached
        return make_partition(cfg.partition, labels, ds.num_classes)
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
