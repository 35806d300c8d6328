"""The dataset and partition of a config, from the prepared caches when present (the pipeline's and the API's
one way to get inputs)."""

from __future__ import annotations

from pathlib import Path

from . import FLDataset, Partition, get_dataset, get_partition, holdout_validation, load_source, make_partition
from .partition import partition_key
from .sources import dataset_tag, prepared_path


def dataset_for(cfg, *, write_cache: bool) -> FLDataset:
    """The dataset of ``cfg``: the prepared cache under ``data_dir`` if present.

    With ``write_cache`` (the prepare stage) a missing or outdated cache is (re)created; without it (single runs)
    a cache built from other source settings (e.g. another ``dataset.test_fraction``) is not used, the raw source
    is read and nothing is written, so ad-hoc runs never touch DVC outputs.
    With ``dataset.validation_fraction > 0`` the returned dataset's test split is the validation
    share held out of the training set (:func:`fl_core.data.holdout_validation`).
    """
    data_dir = Path(cfg.data_dir)
    if write_cache or prepared_path(cfg.dataset, data_dir).exists():
        ds = get_dataset(cfg.dataset, data_dir, project_root=Path.cwd(), write=write_cache)
    else:
        root = Path(cfg.dataset.root)
        ds = load_source(cfg.dataset, root if root.is_absolute() else Path.cwd() / root)
    fraction = float(getattr(cfg.dataset, "validation_fraction", 0.0) or 0.0)
    if fraction > 0:
        ds = holdout_validation(ds, fraction, int(cfg.dataset.split_seed))
    return ds


def partition_for(cfg, ds: FLDataset, *, write_cache: bool) -> Partition:
    """The partition of ``cfg`` over ``ds``'s training labels (and device ids, for ``partition=natural``; cached
    like :func:`dataset_for`)."""
    labels = ds.y_train.numpy()
    devices = None if ds.devices is None else ds.devices.numpy()
    data_dir = Path(cfg.data_dir)
    tag = dataset_tag(cfg.dataset)
    key_dir = data_dir / "partitions" / partition_key(cfg.partition, tag)
    if float(getattr(cfg.dataset, "validation_fraction", 0.0) or 0.0) > 0:  # another training set: never cached
        return make_partition(cfg.partition, labels, ds.num_classes, devices)
    if write_cache or key_dir.exists():
        return get_partition(cfg.partition, tag, labels, ds.num_classes, data_dir, devices)
    return make_partition(cfg.partition, labels, ds.num_classes, devices)
