"""Raw dataset sources, and the cached "prepared" tensors every run starts from.

A source turns the official files of a dataset into an :class:`FLDataset`: uint8
image tensors ``[N, C, H, W]`` plus int64 labels, for a train and a test split,
and the per-channel statistics used by :meth:`FLDataset.normalize`
(docs/algorithms.md, Augmentation and normalisation).

Sources (``dataset.name``):

- ``digits``: scikit-learn's bundled 8x8 digits (offline). Values 0..16, so
  ``scale = 16``; a stratified train/test split with ``dataset.test_fraction``
  and ``dataset.split_seed``; mean/std measured on the training split.
- ``cifar10`` / ``cifar100``: torchvision's readers of the official python
  pickles under ``dataset.root`` (``cifar-10-batches-py/``, ``cifar-100-python/``).
  With ``dataset.verify=false`` torchvision's MD5 check is replaced by a check
  that the files exist.
- ``mnist`` / ``fmnist``: torchvision's readers of the idx files under
  ``dataset.root/MNIST/raw`` and ``dataset.root/FashionMNIST/raw``. torchvision
  only knows MD5 sums of the downloaded ``.gz`` archives, so ``verify`` has no
  effect on already extracted files.
- ``tiny_imagenet``: the official ``tiny-imagenet-200/`` folder under ``dataset.root``
  (read with PIL, see :func:`_tiny_imagenet`): 200 classes of 64x64 RGB images,
  100,000 training images and the 10,000 labelled official validation images as
  the test set; mean = std = 0.5 per channel, as FedBug normalises it.
  ``dataset.download=true`` fetches and unpacks ``tiny-imagenet-200.zip``
  (MD5-checked unless ``dataset.verify=false``).
- ``cinic10``: CINIC-10 (Darlow et al. 2018) in its ImageFolder layout under
  ``dataset.root/cinic-10/`` (or ``CINIC-10/``), read with PIL (see :func:`_cinic10`):
  ``train/`` (90,000 images) is the training set and ``test/`` (90,000) the test
  set; ``valid/`` is not used. 32x32 RGB, 10 classes; mean/std are the CINIC-10
  authors' training-set values. It cannot be downloaded automatically.

Every reader turns a missing, unreadable, empty, truncated or garbage file into a one-line
:class:`DataSourceError` that names the file (CIFAR and MNIST files are only diagnosed one by one
when torchvision's reader fails or returns inconsistent arrays, so a good dataset is read once).

:func:`get_dataset` caches the result as ``<data_dir>/prepared/<name>.pt``.
"""

from __future__ import annotations

import math
import os
import pickle
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fl_core.compat import torchvision

__all__ = [
    "DataSourceError",
    "FLDataset",
    "SOURCES",
    "load_source",
    "prepared_path",
    "get_dataset",
    "holdout_validation",
]

SOURCES = ("digits", "cifar10", "cifar100", "mnist", "fmnist", "tiny_imagenet", "cinic10")
_PREPARED_FORMAT = 1  # bump when the layout of the prepared file changes

# Per-channel statistics of x/255 on the official training sets (docs/algorithms.md, Augmentation and normalisation).
_CIFAR10_STATS = ((0.491, 0.482, 0.447), (0.247, 0.243, 0.262))
_CIFAR100_STATS = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
_MNIST_STATS = ((0.1307,), (0.3081,))
_FMNIST_STATS = ((0.2860,), (0.3530,))
_TINY_STATS = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # FedBug's Tiny-ImageNet normalisation, not measured

_TINY_FOLDER = "tiny-imagenet-200"
_TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
_TINY_SIZE = 64
_TINY_LAYOUT = (f"{_TINY_FOLDER}/ with wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and "
                f"val/val_annotations.txt, as unpacked from the official tiny-imagenet-200.zip")
_CINIC_FOLDERS = ("cinic-10", "CINIC-10")  # tried in this order under dataset.root
_CINIC_STATS = ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835))  # Darlow et al.
_CINIC_SIZE = 32
_CINIC_LAYOUT = ("cinic-10/ (or CINIC-10/) with train/<class>/*.png and test/<class>/*.png, i.e. the official "
                 "CINIC-10.tar.gz unpacked into that folder")
# file types torchvision's ImageFolder accepts
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
_ROOT_HOLDS = {"cifar10": "cifar-10-batches-py/", "cifar100": "cifar-100-python/", "mnist": "MNIST/raw/",
               "fmnist": "FashionMNIST/raw/", "tiny_imagenet": f"{_TINY_FOLDER}/", "cinic10": "cinic-10/"}
_PROGRESS_MIN = 1000  # show a progress bar when decoding more images than this


class DataSourceError(RuntimeError):
    """The raw files of a dataset are missing or unreadable, or the source is unknown.

    The message is one line that names the config key, the path, and the fix.
    """


@dataclass
class FLDataset:
    """A dataset held in memory as raw integer tensors.

    Attributes:
        name: source name (``dataset.name``).
        x_train: uint8 ``[N, C, H, W]`` training images, raw values in ``[0, scale]``.
        y_train: int64 ``[N]`` training labels in ``[0, num_classes)``.
        x_test: uint8 ``[M, C, H, W]`` test images.
        y_test: int64 ``[M]`` test labels.
        num_classes: number of classes C.
        scale: the raw maximum (255.0 for 8-bit images, 16.0 for sklearn digits);
            ``x / scale`` lies in ``[0, 1]``.
        mean: per-channel mean of ``x / scale`` (length C_in).
        std: per-channel standard deviation of ``x / scale`` (length C_in).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise ValueError(f"x_{split} must be uint8 [N, C, H, W], got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"y_{split} must be int64 [{x.shape[0]}], got {y.dtype} {tuple(y.shape)}")
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        if len(self.mean) != self.x_train.shape[1] or len(self.std) != self.x_train.shape[1]:
            raise ValueError(f"mean/std need one value per channel ({self.x_train.shape[1]})")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Map raw images to the model's input space.

        Args:
            x: uint8 (or any numeric) tensor ``[..., C, H, W]`` of raw values, on any device.

        Returns:
            float32 ``(x / scale - mean) / std`` with per-channel mean/std, on ``x.device``.
        """
        shape = (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(shape)
        return (x.to(torch.float32) / self.scale - mean) / std


def holdout_validation(ds: FLDataset, fraction: float, seed: int = 0) -> FLDataset:
    """Carve a validation split out of the training set (for tuning; ``dataset.validation_fraction``).

    Returns a dataset whose training split is the remaining ``1 - fraction`` of ``ds``'s training
    set and whose *test* split is the held-out validation share (stratified by label when every
    class has at least two samples; a pure function of ``seed``, so every trial of a study sees the
    same split). Normalisation statistics are kept from ``ds``. The real test set is not used.

    Raises:
        ValueError: ``fraction`` outside (0, 1) or a split that leaves either side empty
            (names ``dataset.validation_fraction``).
    """
    from sklearn.model_selection import train_test_split

    n = int(ds.y_train.numel())
    if not 0.0 < float(fraction) < 1.0 or not 1 <= math.ceil(n * float(fraction)) < n:
        raise ValueError(f"dataset.validation_fraction must leave both splits non-empty (in (0, 1)), "
                         f"got {fraction} for {n} training samples")
    y = ds.y_train.numpy()
    strat = y if np.bincount(y).min(initial=2) >= 2 and len(np.unique(y)) <= math.ceil(n * float(fraction)) else None
    tr, va = train_test_split(np.arange(n), test_size=float(fraction), random_state=int(seed), stratify=strat)
    tr, va = torch.from_numpy(np.sort(tr)), torch.from_numpy(np.sort(va))
    return FLDataset(name=ds.name, x_train=ds.x_train[tr].contiguous(), y_train=ds.y_train[tr].contiguous(),
                     x_test=ds.x_train[va].contiguous(), y_test=ds.y_train[va].contiguous(),
                     num_classes=ds.num_classes, scale=ds.scale, mean=ds.mean, std=ds.std)


# --------------------------------------------------------------------------- error helpers


def _one_line(err: BaseException, with_type: bool = True) -> str:
    """``err`` as one printable line of at most 200 characters: ``Type: first line of the message``."""
    lines = str(err).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if with_type or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= 200 else text[:197] + "..."


def _os_reason(err: OSError) -> str:
    """``Type: strerror`` of an OSError, without the file name it repeats."""
    return f"{type(err).__name__}: {err.strerror}" if err.strerror else _one_line(err)


def _folder_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a readable folder: ``"missing"``, ``"not a folder"``, ``"permission denied"``
    or an OS error; None when it can be listed and entered."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as err:  # permission denied on a parent folder, loops, ...
        return _one_line(err)
    if not stat.S_ISDIR(mode):
        return "not a folder"
    if not os.access(path, os.R_OK | os.X_OK):
        return "permission denied"
    return None


def _file_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a readable regular file: ``"missing"``, ``"not a file"``, ``"permission denied"``
    or an OS error; None otherwise (its content is not looked at)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as err:
        return _one_line(err)
    if not stat.S_ISREG(mode):
        return "not a file"
    if not os.access(path, os.R_OK):
        return "permission denied"
    return None


def _check_root(root: Path, holds: str) -> None:
    """``dataset.root`` must be a readable folder if it exists (each source reports a missing one);
    ``holds`` names what it should contain (for the message).

    Raises:
        DataSourceError: ``root`` is a file, or cannot be listed or entered.
    """
    problem = _folder_problem(root)
    if problem == "not a folder":
        raise DataSourceError(f"dataset.root: {root} is not a folder; set dataset.root to the folder that "
                              f"holds {holds}")
    if problem not in (None, "missing"):
        raise DataSourceError(f"dataset.root: cannot read the folder {root} ({problem})")


# --------------------------------------------------------------------------- sources


def _digits(cfg: Any) -> FLDataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.asarray(bunch.images)  # float64 [1797, 8, 8], integer values 0..16
    x = torch.from_numpy(np.rint(images).astype(np.uint8)).unsqueeze(1)
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    idx_train, idx_test = train_test_split(
        np.arange(len(y)),
        test_size=float(cfg.test_fraction),
        random_state=int(cfg.split_seed),
        stratify=bunch.target,
    )
    idx_train = torch.from_numpy(np.sort(idx_train))
    idx_test = torch.from_numpy(np.sort(idx_test))
    x_train = x[idx_train]
    scaled = x_train.to(torch.float64) / 16.0
    mean = tuple(scaled.mean(dim=(0, 2, 3)).tolist())
    std = tuple(scaled.std(dim=(0, 2, 3), unbiased=False).tolist())
    return FLDataset(
        name="digits",
        x_train=x_train.contiguous(),
        y_train=y[idx_train].contiguous(),
        x_test=x[idx_test].contiguous(),
        y_test=y[idx_test].contiguous(),
        num_classes=10,
        scale=16.0,
        mean=mean,
        std=std,
    )


def _unverified(cls: type) -> type:
    """A subclass of a torchvision CIFAR reader that only checks that the files exist.

    torchvision compares MD5 sums of the data files (``_check_integrity``) and of
    the meta file (inside ``_load_meta``); both are reduced to existence checks.
    """

    def _check_integrity(self) -> bool:
        folder = os.path.join(self.root, self.base_folder)
        return all(os.path.isfile(os.path.join(folder, f)) for f, _ in self.train_list + self.test_list)

    attrs = {
        "_check_integrity": _check_integrity,
        "meta": {**cls.meta, "md5": None},  # check_integrity(path, None) = file exists
        "__doc__": f"{cls.__name__} without the MD5 check (dataset.verify=false).",
    }
    return type(f"Unverified{cls.__name__}", (cls,), attrs)


def _cifar(cfg: Any, root: Path, hundred: bool) -> FLDataset:
    """CIFAR-10 / CIFAR-100 through torchvision's reader of the official python pickles.

    Raises:
        DataSourceError: files missing, unreadable, truncated, empty or garbage (names the file), the MD5
            check failing with ``dataset.verify=true`` (names the files), or labels out of range.
    """
    datasets = torchvision().datasets
    base = datasets.CIFAR100 if hundred else datasets.CIFAR10
    reader = base if cfg.verify else _unverified(base)
    title = "CIFAR-100" if hundred else "CIFAR-10"
    num_classes = 100 if hundred else 10
    _download(cfg, title, root, lambda: reader(str(root), train=True, download=True))
    try:
        train = reader(str(root), train=True, download=False)
        test = reader(str(root), train=False, download=False)
        for split in (train, test):  # a garbage file can unpickle into arrays of the wrong kind
            labels = np.asarray(split.targets, dtype=np.int64)
            if (split.data.dtype != np.uint8 or labels.shape != (len(split.data),)
                    or (labels.size and not 0 <= labels.min() <= labels.max() < num_classes)):
                raise ValueError("inconsistent arrays")
    except Exception as err:  # pickle errors, EOFError, OSError, RuntimeError (not found / MD5), ...
        raise _cifar_error(base, title, root, bool(cfg.verify), num_classes, err) from None
    mean, std = _CIFAR100_STATS if hundred else _CIFAR10_STATS

    def to_tensor(data: np.ndarray) -> torch.Tensor:  # HWC uint8 numpy -> [N, 3, 32, 32]
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).permute(0, 3, 1, 2).contiguous()

    return FLDataset(
        name=cfg.name,
        x_train=to_tensor(train.data),
        y_train=torch.as_tensor(train.targets, dtype=torch.int64),
        x_test=to_tensor(test.data),
        y_test=torch.as_tensor(test.targets, dtype=torch.int64),
        num_classes=num_classes,
        scale=255.0,
        mean=mean,
        std=std,
    )


def _cifar_error(base: type, title: str, root: Path, verify: bool, num_classes: int,
                 err: BaseException) -> DataSourceError:
    """The one-line error for a CIFAR read that failed with ``err``: find the file to blame.

    In this order: the folder or a file is missing ("not found"), a folder or file cannot be opened,
    a file is not a CIFAR pickle of the expected layout (truncated, empty, garbage; whatever
    ``verify``), a file fails the MD5 check (``verify``), else ``err`` itself.
    """
    folder = root / base.base_folder
    batches = [f for f, _ in base.train_list + base.test_list]
    meta = base.meta["filename"]
    files = batches + [meta]
    problem = _folder_problem(folder)
    if problem not in (None, "missing", "not a folder"):
        return DataSourceError(f"dataset.root: cannot read the folder {folder} ({problem})")
    missing = files if problem else [f for f in files if _file_problem(folder / f) == "missing"]
    if missing:
        what = "" if problem else f", missing {', '.join(missing)}"
        return DataSourceError(
            f"dataset.root: {title} not found under {root} (expected {base.base_folder}/ in the official "
            f"python format{what}; or set dataset.download=true)"
        )
    labels_key = "fine_labels" if num_classes == 100 else "labels"
    for f in files:
        path = folder / f
        try:
            reason = _cifar_file_problem(path, None if f == meta else labels_key, num_classes, base.meta["key"])
        except OSError as io_err:
            return DataSourceError(f"dataset.root: cannot read {path} ({_file_problem(path) or _os_reason(io_err)})")
        if reason:
            what = "meta file" if f == meta else "batch"
            return DataSourceError(f"dataset.root: {path} is not a readable {title} {what} ({reason}); "
                                   f"replace it with the official file")
    if verify:
        from torchvision.datasets.utils import check_integrity

        md5 = dict(base.train_list + base.test_list)
        md5[meta] = base.meta["md5"]
        failed = [f for f in files if not check_integrity(str(folder / f), md5[f])]
        if len(failed) == 1:
            return DataSourceError(
                f"dataset.root: {folder / failed[0]} failed torchvision's MD5 check of the {title} files; "
                f"replace it with the official file or set dataset.verify=false"
            )
        if failed:
            return DataSourceError(
                f"dataset.root: {title} files under {folder} failed torchvision's MD5 check "
                f"({', '.join(failed)}); replace them with the official files or set dataset.verify=false"
            )
    return DataSourceError(f"dataset.root: cannot read {title} under {folder} ({_one_line(err)})")


def _cifar_file_problem(path: Path, labels_key: Optional[str], num_classes: int, meta_key: str) -> Optional[str]:
    """Why ``path`` is not a CIFAR batch (``labels_key`` given) or meta file (``labels_key`` None).

    Returns a short reason such as ``"truncated or corrupt: pickle data was truncated"``, or None when
    the file holds what torchvision expects: a dict with a uint8 ``data`` array ``[N, 3072]`` and ``N``
    labels in ``[0, num_classes)`` (batch), or a dict with ``meta_key`` (meta file).

    Raises:
        OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        if not f.read(1):
            return "truncated or corrupt: the file is empty"
        f.seek(0)
        try:
            entry = pickle.load(f, encoding="latin1")
        except OSError:
            raise
        except Exception as err:  # UnpicklingError, EOFError, ValueError, ImportError, MemoryError, ...
            return f"truncated or corrupt: {_one_line(err, with_type=False)}"
    fmt = "not in the official format"
    if not isinstance(entry, dict):
        return f"{fmt}: it holds a {type(entry).__name__}, not a dict"
    if labels_key is None:
        return None if meta_key in entry else f"{fmt}: no {meta_key!r} entry"
    data, labels = entry.get("data"), entry.get(labels_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = (f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray)
               else "missing" if data is None else type(data).__name__)
        return f"{fmt}: 'data' must be a uint8 array [N, 3072], got {got}"
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        y = None
    if labels is None or y is None or y.shape != (len(data),):
        return f"{fmt}: {labels_key!r} must list one integer label per image ({len(data)})"
    if y.size and not 0 <= y.min() <= y.max() < num_classes:
        bad = y.min() if y.min() < 0 else y.max()
        return f"{fmt}: label {bad} outside 0..{num_classes - 1}"
    return None


_MNIST_FILES = {  # file under <Folder>/raw -> (idx magic number, images?)
    "train-images-idx3-ubyte": (2051, True),
    "train-labels-idx1-ubyte": (2049, False),
    "t10k-images-idx3-ubyte": (2051, True),
    "t10k-labels-idx1-ubyte": (2049, False),
}


def _mnist(cfg: Any, root: Path, fashion: bool) -> FLDataset:
    """MNIST / FashionMNIST through torchvision's reader of the extracted idx files.

    Raises:
        DataSourceError: files missing, unreadable, truncated, empty or garbage (names the file), image
            and label counts that differ, or labels out of range.
    """
    datasets = torchvision().datasets
    reader = datasets.FashionMNIST if fashion else datasets.MNIST
    title = "FashionMNIST" if fashion else "MNIST"
    _download(cfg, title, root, lambda: reader(str(root), train=True, download=True))
    try:
        train = reader(str(root), train=True, download=False)
        test = reader(str(root), train=False, download=False)
        for split in (train, test):
            if (split.data.dtype != torch.uint8 or tuple(split.data.shape[1:]) != (28, 28)
                    or split.targets.shape != (split.data.shape[0],)
                    or (split.targets.numel() and not 0 <= int(split.targets.min()) <= int(split.targets.max()) < 10)):
                raise ValueError("inconsistent arrays")
    except Exception as err:  # AssertionError, RuntimeError (not found, view), ValueError, OSError, ...
        raise _mnist_error(reader.__name__, title, root, err) from None
    mean, std = _FMNIST_STATS if fashion else _MNIST_STATS
    return FLDataset(
        name=cfg.name,
        x_train=train.data.to(torch.uint8).unsqueeze(1).contiguous(),
        y_train=train.targets.to(torch.int64),
        x_test=test.data.to(torch.uint8).unsqueeze(1).contiguous(),
        y_test=test.targets.to(torch.int64),
        num_classes=10,
        scale=255.0,
        mean=mean,
        std=std,
    )


def _mnist_error(folder_name: str, title: str, root: Path, err: BaseException) -> DataSourceError:
    """The one-line error for an MNIST read that failed with ``err``: find the file to blame.

    Checks, in order: torchvision's legacy cache ``<Folder>/processed/{training,test}.pt`` (read
    instead of ``raw/`` when both files exist) loads; the raw folder and its four idx files exist and
    can be opened; every idx file has the right magic number, dimensions, size and label range;
    images and labels of a split have the same count. Falls back to ``err``.
    """
    raw = root / folder_name / "raw"
    processed = root / folder_name / "processed"
    legacy = [processed / "training.pt", processed / "test.pt"]
    if all(p.is_file() for p in legacy):
        for path in legacy:
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True)
                ok = (isinstance(obj, (tuple, list)) and len(obj) == 2
                      and all(isinstance(t, torch.Tensor) for t in obj))
                reason = None if ok else "not a pair of tensors"
            except Exception as load_err:  # noqa: BLE001 (whatever a broken file raises)
                reason = _one_line(load_err, with_type=False)
            if reason:
                return DataSourceError(f"dataset.root: {path} is not a readable {title} file of torchvision's "
                                       f"legacy cache (truncated or corrupt: {reason}); delete {processed} "
                                       f"so that the idx files in {raw} are read")
    problem = _folder_problem(raw)
    if problem not in (None, "missing", "not a folder"):
        return DataSourceError(f"dataset.root: cannot read the folder {raw} ({problem})")
    missing = list(_MNIST_FILES) if problem else [f for f in _MNIST_FILES if _file_problem(raw / f) == "missing"]
    if missing:
        what = "" if problem else f"; missing {', '.join(missing)}"
        return DataSourceError(
            f"dataset.root: {title} not found under {root} (expected {folder_name}/raw/ with "
            f"{', '.join(_MNIST_FILES)}{what}; or set dataset.download=true)"
        )
    counts = {}
    for f, (magic, images) in _MNIST_FILES.items():
        path = raw / f
        try:
            data = path.read_bytes()
        except OSError as io_err:
            return DataSourceError(f"dataset.root: cannot read {path} ({_file_problem(path) or _os_reason(io_err)})")
        reason, counts[f] = _idx_problem(data, magic, images)
        if reason:
            return DataSourceError(f"dataset.root: {path} is not a readable {title} idx file ({reason}); "
                                   f"replace it with the official file")
    for split in ("train", "t10k"):
        n_img, n_lab = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if n_img != n_lab:
            return DataSourceError(
                f"dataset.root: {raw / f'{split}-images-idx3-ubyte'} holds {n_img} images but "
                f"{raw / f'{split}-labels-idx1-ubyte'} {n_lab} labels; replace them with the official files"
            )
    return DataSourceError(f"dataset.root: cannot read the {title} idx files under {raw} ({_one_line(err)})")


def _idx_problem(data: bytes, magic: int, images: bool) -> tuple[Optional[str], int]:
    """Why ``data`` is not an MNIST idx file (28x28 uint8 images or uint8 labels 0..9), and its item count.

    Returns ``(reason, n)``: reason None for a good file; n is the count the header announces (0 if unknown).
    """
    bad = "truncated or corrupt"
    if not data:
        return f"{bad}: the file is empty", 0
    if data[:2] == b"\x1f\x8b":
        return f"{bad}: it is a gzip archive, unpack it", 0
    if len(data) < 4:
        return f"{bad}: {len(data)} bytes, shorter than the idx header", 0
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        return f"{bad}: magic number {found:#010x}, expected {magic:#010x}", 0
    ndim = 3 if images else 1
    head = 4 + 4 * ndim
    if len(data) < head:
        return f"{bad}: {len(data)} bytes, shorter than the {head}-byte idx header", 0
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    need = head + math.prod(dims)
    if len(data) != need:
        return f"{bad}: {len(data)} bytes where the header announces {need}", dims[0]
    if images and dims[1:] != [28, 28]:
        return f"not in the official format: images are {dims[1]}x{dims[2]}, expected 28x28", dims[0]
    if not images and dims[0] and max(data[head:]) > 9:
        return f"not in the official format: label {max(data[head:])} outside 0..9", dims[0]
    return None, dims[0]


def _tiny_imagenet(cfg: Any, root: Path) -> FLDataset:
    """Tiny-ImageNet from the official ``root/tiny-imagenet-200/`` layout (docs/algorithms.md, Augmentation and
    normalisation; Model catalogue).

    - ``wnids.txt``: the 200 WordNet ids, one per line; class index = position in the *sorted* ids, as
      in FedBug's ImageFolder reader (sorted folder names), so partitions match its class order.
    - train: ``train/<wnid>/images/*.JPEG`` (500 per class), ordered by class, then file name.
    - test: the official validation set ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``
      (tab-separated: file name, wnid, 4 bounding-box coordinates), re-sorted by class, then file name -- the
      same images FedBug re-folders by class and uses as its test set. The unlabelled official
      ``test/`` folder is not used.

    Images are decoded with PIL and converted to RGB (a few official images are grayscale);
    every image must be 64x64. Returns uint8 ``[100000, 3, 64, 64]`` / ``[10000, 3, 64, 64]``
    for the official files.

    Raises:
        DataSourceError: the folder or one of its index files is missing, unreadable or malformed, a
            class folder holds no image, an image is missing, cannot be decoded (empty, truncated,
            garbage) or is not 64x64 (the message names the file).
    """
    base = root / _TINY_FOLDER
    if cfg.download and not (base / "wnids.txt").is_file():
        def fetch() -> None:
            from_url = torchvision().datasets.utils.download_and_extract_archive
            from_url(_TINY_URL, download_root=str(root), md5=_TINY_MD5 if cfg.verify else None)

        _download(cfg, "Tiny-ImageNet", root, fetch)
    wnids_file = base / "wnids.txt"
    annotations = base / "val" / "val_annotations.txt"
    if not (wnids_file.is_file() and (base / "train").is_dir() and annotations.is_file()):
        raise DataSourceError(
            f"dataset.root: Tiny-ImageNet not found under {root} (expected {_TINY_LAYOUT}; "
            f"or set dataset.download=true)"
        )
    wnids = sorted(line.strip() for line in _read_index(wnids_file).splitlines() if line.strip())
    val_lines = [line for line in _read_index(annotations).splitlines() if line.strip()]
    index = {w: i for i, w in enumerate(wnids)}
    if not wnids or len(index) != len(wnids):
        raise DataSourceError(f"dataset.root: {wnids_file} must list distinct class ids, one per line")
    if not val_lines:
        raise DataSourceError(f"dataset.root: {annotations} lists no image (truncated or corrupt); "
                              f"replace it with the official file")

    train: list[tuple[Path, int]] = []
    for w, c in index.items():
        folder = base / "train" / w / "images"
        if not folder.is_dir():
            raise DataSourceError(f"dataset.root: Tiny-ImageNet class {w} of wnids.txt has no folder {folder}")
        try:
            images = [f for f in sorted(folder.iterdir()) if f.suffix.lower() in (".jpeg", ".jpg")]
        except OSError as err:
            raise DataSourceError(f"dataset.root: cannot list the folder {folder} ({_os_reason(err)})") from None
        if not images:
            raise DataSourceError(f"dataset.root: the Tiny-ImageNet folder {folder} has no JPEG images")
        train += [(f, c) for f in images]
    test: list[tuple[Path, int]] = []
    for line in val_lines:
        row = line.split("\t")  # file, wnid and the bounding box x0, y0, x1, y1
        if len(row) != 6 or row[1] not in index or not all(v.strip().isdigit() for v in row[2:]):
            raise DataSourceError(f"dataset.root: {annotations} has a line that is not a file name, a class of "
                                  f"wnids.txt and 4 box coordinates (truncated or corrupt): {line[:80]!r}")
        test.append((base / "val" / "images" / row[0], index[row[1]]))
    test.sort(key=lambda item: (item[1], item[0].name))
    return _image_dataset(cfg.name, train, test, ("train", "val"), "Tiny-ImageNet", _TINY_SIZE, len(wnids),
                          _TINY_STATS)


def _cinic10(cfg: Any, root: Path) -> FLDataset:
    """CINIC-10 from its ImageFolder layout ``root/cinic-10/`` or ``root/CINIC-10/`` (docs/algorithms.md, FedNLR and
    Paper settings).

    - train: ``train/<class>/*.png`` (9,000 per class in the official files), test: ``test/<class>/*.png``
      (9,000 per class). ``valid/`` (another 90,000 images) is not read: there is no option to add it to
      the training set.
    - Class index = position of the class folder name in the sorted folder names of ``train/``, as in
      torchvision's ``ImageFolder`` (official: airplane, automobile, bird, cat, deer, dog, frog, horse, ship,
      truck -> 0..9, the CIFAR-10 order). ``test/`` must have the same class folders.
    - Within a class, files are taken in sorted name order (flat folders; subfolders are ignored).
    - Images are decoded with PIL and converted to RGB (CINIC-10 has some grayscale PNGs); every image
      must be 32x32. Mean/std are the CINIC-10 authors' values for ``x / 255``.

    Returns uint8 ``[90000, 3, 32, 32]`` train and test tensors for the official files.

    Raises:
        DataSourceError: the folder, ``train/`` or ``test/`` is missing or cannot be listed; a class folder
            has no image; the test classes differ from the train classes; an image cannot be decoded (empty,
            truncated, garbage) or is not 32x32 (the message names the file).
    """
    base = next((root / f for f in _CINIC_FOLDERS if (root / f / "train").is_dir() and (root / f / "test").is_dir()),
                None)
    if base is None:
        extra = "; CINIC-10 cannot be downloaded by dataset.download" if cfg.download else ""
        raise DataSourceError(f"dataset.root: CINIC-10 not found under {root} (expected {_CINIC_LAYOUT}{extra})")

    def listing(split: str) -> tuple[list[str], list[list[Path]]]:
        folder = base / split
        try:
            classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
            files = [sorted(f for f in (folder / c).iterdir() if f.is_file() and f.suffix.lower() in _IMAGE_SUFFIXES)
                     for c in classes]
        except OSError as err:
            where = err.filename or folder
            raise DataSourceError(f"dataset.root: cannot list the CINIC-10 folder {where} ({_os_reason(err)})") from None
        if not classes:
            raise DataSourceError(f"dataset.root: the CINIC-10 folder {folder} has no class folders "
                                  f"(expected {_CINIC_LAYOUT})")
        for c, fs in zip(classes, files):
            if not fs:
                raise DataSourceError(f"dataset.root: the CINIC-10 class folder {folder / c} has no image files")
        return classes, files

    classes, train_files = listing("train")
    test_classes, test_files = listing("test")
    if test_classes != classes:
        raise DataSourceError(f"dataset.root: the class folders of {base / 'test'} ({', '.join(test_classes)}) "
                              f"differ from those of {base / 'train'} ({', '.join(classes)})")
    train = [(f, c) for c, fs in enumerate(train_files) for f in fs]
    test = [(f, c) for c, fs in enumerate(test_files) for f in fs]
    return _image_dataset(cfg.name, train, test, ("train", "test"), "CINIC-10", _CINIC_SIZE, len(classes),
                          _CINIC_STATS)


def _read_index(path: Path) -> str:
    """The text of an index file (Tiny-ImageNet's ``wnids.txt``, ``val_annotations.txt``).

    Raises:
        DataSourceError: the file cannot be read or is not text (names the file).
    """
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise DataSourceError(f"dataset.root: cannot read {path} ({_os_reason(err)})") from None
    except UnicodeDecodeError:
        raise DataSourceError(f"dataset.root: {path} is not a text file (truncated or corrupt); "
                              f"replace it with the official file") from None


def _image_dataset(name: str, train: list, test: list, splits: tuple, title: str, size: int, num_classes: int,
                   stats: tuple) -> FLDataset:
    """An FLDataset from (file, label) lists of an image-folder layout (Tiny-ImageNet, CINIC-10)."""
    return FLDataset(
        name=name,
        x_train=_decode_images(train, splits[0], title, size),
        y_train=torch.tensor([c for _, c in train], dtype=torch.int64),
        x_test=_decode_images(test, splits[1], title, size),
        y_test=torch.tensor([c for _, c in test], dtype=torch.int64),
        num_classes=num_classes,
        scale=255.0,
        mean=stats[0],
        std=stats[1],
    )


def _decode_images(items: list[tuple[Path, int]], split: str, title: str, size: int) -> torch.Tensor:
    """Decode ``items``' image files into one preallocated uint8 ``[N, 3, size, size]`` tensor (RGB).

    ``title`` names the dataset in the progress bar (shown above ``_PROGRESS_MIN`` images) and in errors.

    Raises:
        DataSourceError: a file is missing or cannot be opened, cannot be decoded (empty, truncated,
            garbage) or is not ``size x size``; the message names the file.
    """
    from PIL import Image, UnidentifiedImageError

    out = torch.empty((len(items), 3, size, size), dtype=torch.uint8)
    view = out.numpy()
    paths = [p for p, _ in items]
    if len(paths) > _PROGRESS_MIN:
        from tqdm.auto import tqdm

        paths = tqdm(paths, desc=f"{title} {split}", unit="img", leave=False)
    for i, path in enumerate(paths):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise DataSourceError(f"dataset.root: the {title} image {path} does not exist; "
                                  f"replace it with the official file") from None
        except OSError as err:  # permission denied, a folder, ...
            raise DataSourceError(f"dataset.root: cannot read the {title} image {path} ({_os_reason(err)})") from None
        with f:
            try:
                if not f.read(1):
                    raise ValueError("the file is empty")
                f.seek(0)
                with Image.open(f) as img:
                    rgb = np.asarray(img.convert("RGB"))
            except Exception as err:  # UnidentifiedImageError, OSError (truncated), SyntaxError (broken PNG), ...
                reason = ("not an image file" if isinstance(err, UnidentifiedImageError)
                          else _one_line(err, with_type=False))
                raise DataSourceError(f"dataset.root: {path} is not a readable {title} image (truncated or "
                                      f"corrupt: {reason}); replace it with the official file") from None
        if rgb.shape != (size, size, 3):
            raise DataSourceError(f"dataset.root: {title} image {path} is {rgb.shape[1]}x{rgb.shape[0]}, "
                                  f"expected {size}x{size}")
        view[i] = rgb.transpose(2, 0, 1)
    return out


def _download(cfg: Any, title: str, root: Path, fetch) -> None:
    """Run torchvision's download when ``dataset.download`` is set; one-line error on failure."""
    if not cfg.download:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fetch()
    except Exception as err:  # network errors come as URLError, RuntimeError, OSError, ...
        raise DataSourceError(
            f"dataset.download: could not download {title} into {root} ({type(err).__name__}: {err}); "
            f"place the official files there and set dataset.download=false"
        ) from None


def load_source(cfg: Any, root: Path) -> FLDataset:
    """Read a dataset from its raw source.

    Args:
        cfg: a :class:`~fl_core.config.DatasetConfig` (or a DictConfig with its fields).
        root: the resolved dataset root directory (unused by ``digits``).

    Returns:
        The dataset with uint8 images and int64 labels.

    Raises:
        DataSourceError: unknown ``dataset.name``; ``root`` is a file or cannot be read; files
            missing under ``root`` (and ``dataset.download`` false), failing the MD5 check, unreadable,
            empty, truncated or garbage (the message names the file where one is to blame), or a
            failed download.
    """
    name = cfg.name
    root = Path(root)
    if name == "digits":
        return _digits(cfg)
    if name in _ROOT_HOLDS:
        _check_root(root, _ROOT_HOLDS[name])
    if name in ("cifar10", "cifar100"):
        return _cifar(cfg, root, hundred=name == "cifar100")
    if name in ("mnist", "fmnist"):
        return _mnist(cfg, root, fashion=name == "fmnist")
    if name == "tiny_imagenet":
        return _tiny_imagenet(cfg, root)
    if name == "cinic10":
        return _cinic10(cfg, root)
    raise DataSourceError(f"dataset.name must be one of {', '.join(SOURCES)}, got {name!r}")


# --------------------------------------------------------------------------- prepared cache


def prepared_path(cfg: Any, data_dir: Path) -> Path:
    """Where :func:`get_dataset` caches a dataset: ``data_dir / "prepared" / f"{name}.pt"``."""
    return Path(data_dir) / "prepared" / f"{cfg.name}.pt"


def _signature(cfg: Any) -> dict:
    """The config fields the prepared tensors depend on (a cached file must match them)."""
    sig: dict = {"format": _PREPARED_FORMAT, "name": str(cfg.name)}
    if cfg.name == "digits":
        sig.update(test_fraction=float(cfg.test_fraction), split_seed=int(cfg.split_seed))
    return sig


def _to_blob(ds: FLDataset, signature: dict) -> dict:
    return {
        "signature": signature,
        "name": ds.name,
        "x_train": ds.x_train,
        "y_train": ds.y_train,
        "x_test": ds.x_test,
        "y_test": ds.y_test,
        "num_classes": int(ds.num_classes),
        "scale": float(ds.scale),
        "mean": list(ds.mean),
        "std": list(ds.std),
    }


def _from_blob(blob: dict) -> FLDataset:
    return FLDataset(
        name=blob["name"],
        x_train=blob["x_train"],
        y_train=blob["y_train"],
        x_test=blob["x_test"],
        y_test=blob["y_test"],
        num_classes=int(blob["num_classes"]),
        scale=float(blob["scale"]),
        mean=tuple(blob["mean"]),
        std=tuple(blob["std"]),
    )


def _read_prepared(path: Path, signature: dict) -> FLDataset | None:
    """The cached dataset at ``path`` if it exists, is readable and matches ``signature``."""
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or blob.get("signature") != signature:
            return None
        return _from_blob(blob)
    except Exception:  # truncated or foreign file: rebuild it
        return None


def _save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def get_dataset(cfg: Any, data_dir: Path, project_root: Path) -> FLDataset:
    """Load the prepared dataset, building and caching it on first use.

    The cache ``prepared_path(cfg, data_dir)`` is reused only when it was built
    from the same source settings (for ``digits``: ``test_fraction`` and
    ``split_seed``); otherwise the source is read again and the file replaced.
    Writes are atomic (temporary file + ``os.replace``).

    Args:
        cfg: dataset config; a relative ``cfg.root`` is resolved against ``project_root``.
        data_dir: the data directory holding ``prepared/``.
        project_root: base of relative ``cfg.root`` paths.

    Raises:
        DataSourceError: see :func:`load_source`; or the prepared file cannot be written (names
            ``data_dir`` and the file).
    """
    path = prepared_path(cfg, data_dir)
    signature = _signature(cfg)
    cached = _read_prepared(path, signature)
    if cached is not None:
        return cached
    root = Path(cfg.root).expanduser()
    if not root.is_absolute():
        root = Path(project_root) / root
    ds = load_source(cfg, root.resolve())
    try:
        _save_atomic(_to_blob(ds, signature), path)
    except OSError as err:  # data_dir is a file, read-only, full, ...
        raise DataSourceError(f"data_dir: cannot write the prepared dataset {path} ({_os_reason(err)})") from None
    return ds
