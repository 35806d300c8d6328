"""Splitting a training set across clients (docs/algorithms.md, Data).

Partitions (``partition.name`` / ``partition.variant``):

- ``iid`` (IID partition, Acar/FedBug): shuffle the whole training set once and cut it into
  contiguous chunks of sizes :func:`lognormal_sizes`. With ``size_sigma = 0`` every
  client gets ``floor(|D|/N)`` samples and the ``|D| mod N`` samples left at the end of
  the permutation are dropped, as in Acar et al.
- ``dirichlet`` / ``per_client`` (variant A, Acar/FedDyn/FedBug): one class prior
  ``q_i ~ Dir(alpha 1_C)`` per client and fixed quotas; samples are dealt one at a time
  to a uniformly random client with quota left, the class drawn from ``q_i`` by inverse
  CDF and redrawn while its pool is empty. Every client ends with exactly its quota, no
  index is used twice; the leftover of balanced quotas is dropped as in ``iid``.
- ``dirichlet`` / ``fixed_size_reuse`` (variant B, FedBCGD ``dirichlet_data.data_from_dirichlet``): every
  class pool is shuffled once, one prior ``q_i ~ Dir(alpha 1_C)`` per client, and client by client
  ``partition.samples_per_client`` labels are drawn i.i.d. from ``q_i``; each drawn label takes the
  next index of its class pool, and an exhausted pool is reshuffled and read again from its start.
  Every client has exactly ``samples_per_client`` samples; an index may be held by several clients
  (and twice by one), and some indices by none.
- ``dirichlet`` / ``per_class`` (variant C, NIID-Bench): per class, proportions over clients
  ``p ~ Dir(alpha 1_N)``, zeroed for clients already at or above ``|D|/N`` (the balancing cap;
  ``partition.balance_cap=false`` leaves it out: the plain per-class Dirichlet split); repeated until
  every client has ``min_size`` samples. Every index is used exactly once; sizes vary.
- ``shards`` / ``label_S`` (the default ``partition.shards_variant``; NIID-Bench ``#label-S``
  generalised to any S <= C): client i holds class ``i mod C`` and ``S - 1`` further distinct
  random classes; each class is split evenly (``array_split``) among its holders. Classes
  nobody holds (possible when N < C) are dropped. Exactly S classes per client; sizes vary.
- ``shards`` / ``mcmahan_sort_shard`` (McMahan et al. 2017): the training indices sorted
  by label (stable) are cut into N*S equal shards of ``floor(|D| / (N*S))`` samples and every
  client gets S distinct random shards. Balanced (every client holds exactly
  ``S * floor(|D| / (N*S))`` samples). A client may get fewer than S distinct classes (two
  shards of one class); when the class sizes are not multiples of the shard size, a shard
  straddling a class boundary holds two (or more) classes, so a client can also get more
  than S. The ``|D| mod (N*S)`` samples left over are dropped at random before sorting, so
  that no single class loses them.
- ``natural``: the dataset's own devices are the clients (``synthetic``, FedProx Sec. 5.1; ``quadratic``; the
  writers of ``femnist`` and the speakers of ``shakespeare``): client k holds the training samples of device k
  (``FLDataset.devices``), in their order. No randomness; ``partition.num_clients`` must equal the number of
  devices, or be null (as many clients as the data has devices).

All randomness comes from ``numpy_rng("partition", partition.seed)``: the same config and
labels give the same partition, which is cached on disk and shared by every training
seed (as in Acar/FedBug).

The same on every CPU and thread count (docs/reliability.md, Numbers on another CPU): no torch, no BLAS, no
vectorised transcendental function. The float sums that normalise a draw (the lognormal sizes, the Dirichlet
priors of ``fixed_size_reuse`` and ``per_class``) are NumPy's sums of a 1-D float64 array, the references'
arithmetic: NumPy adds in one fixed order for a given length (pairwise, blocks of 128 with 8 partial sums, one
thread) on every CPU (measured: one result with NumPy's AVX-512, AVX2 and baseline loops). An exactly rounded
``math.fsum`` would be as portable but not the references' sum: it moved a cut of ``per_class`` (a sample to the
next client) in 120 of 288 test draws. Cumulative sums are sequential; sizes and histograms are integers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from bisect import bisect_right
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fl_core.store import envfail, faults
from fl_core.schema import DIRICHLET_VARIANTS, PartitionConfig
from fl_core.seeding import numpy_rng

__all__ = [
    "Partition",
    "PartitionError",
    "lognormal_sizes",
    "make_partition",
    "partition_key",
    "get_partition",
    "plot_label_distribution",
]

log = logging.getLogger(__name__)

_MAX_PER_CLASS_TRIES = 1000  # variant C: attempts before giving up on partition.min_size
_MAX_LABEL_REDRAWS = 64  # variant A: plain redraws before drawing from the renormalised prior


class PartitionError(ValueError):
    """A partition cannot be built from this config; the one-line message names the key."""


# --------------------------------------------------------------------------- Partition


@dataclass
class Partition:
    """Which training samples each client holds.

    Client index arrays are disjoint for every partition but ``dirichlet`` / ``fixed_size_reuse``
    (variant B), where an index may appear on several clients and more than once on one; the label
    histogram and the sizes then count every occurrence.

    Attributes:
        client_indices: one int64 array per client of indices into the training set.
        num_classes: number of classes C of the dataset.
        label_hist: int64 ``[num_clients, num_classes]``; ``label_hist[i, c]`` = samples of
            class c held by client i.
    """

    client_indices: list[np.ndarray]
    num_classes: int
    label_hist: np.ndarray

    @classmethod
    def from_indices(cls, client_indices: list, labels: np.ndarray, num_classes: int) -> "Partition":
        """Build a partition (and its label histogram) from per-client index arrays."""
        labels = np.asarray(labels)
        idx = [np.asarray(ix, dtype=np.int64).reshape(-1) for ix in client_indices]
        hist = np.stack([np.bincount(labels[ix], minlength=num_classes)[:num_classes] for ix in idx])
        return cls(client_indices=idx, num_classes=int(num_classes), label_hist=hist.astype(np.int64))

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[num_clients]``: samples per client (n_i)."""
        return np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def stats(self, config: dict | None = None) -> dict:
        """JSON-able summary: sizes, label histogram, distinct classes per client, and ``config``.

        ``total`` counts every held sample (sum of the sizes), ``distinct_samples`` the distinct training
        indices among them; they differ only when indices are reused across clients (variant B).
        """
        sizes = self.sizes
        held = np.concatenate(self.client_indices) if self.client_indices else np.zeros(0, np.int64)
        return {
            "num_clients": self.num_clients,
            "num_classes": int(self.num_classes),
            "total": int(sizes.sum()),
            "distinct_samples": int(len(np.unique(held))),
            "sizes": sizes.tolist(),
            "min_size": int(sizes.min()) if len(sizes) else 0,
            "mean_size": int(sizes.sum()) / len(sizes) if len(sizes) else 0.0,  # exact sum, one rounding
            "max_size": int(sizes.max()) if len(sizes) else 0,
            "label_hist": self.label_hist.tolist(),
            "classes_per_client": (self.label_hist > 0).sum(axis=1).astype(int).tolist(),
            "config": config,
        }

    def save(self, directory: Path, config: dict | None = None) -> None:
        """Write ``partition.npz``, ``stats.json`` and ``labels_per_client.png`` into ``directory``.

        ``partition.npz`` holds ``indices`` (all clients concatenated, int64), ``offsets``
        (int64 ``[N + 1]``; client i is ``indices[offsets[i]:offsets[i+1]]``), ``num_classes``
        and ``label_hist``. Each file is written to a temporary name and moved into place
        with ``os.replace``; ``partition.npz`` goes last, so its presence means the set is
        complete. Fault point ``partition_write`` sits before its rename.

        Raises:
            OSError: a write failed (a full disk, ...); the temporary file is removed.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        title = str(config.get("key", "")) if isinstance(config, dict) else ""
        with _atomic(directory / "labels_per_client.png") as tmp:
            plot_label_distribution(self, tmp, title=title)
        with _atomic(directory / "stats.json") as tmp:
            tmp.write_text(_stats_json(self.stats(config)))
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        indices = (
            np.concatenate(self.client_indices).astype(np.int64) if self.client_indices else np.zeros(0, np.int64)
        )
        with _atomic(directory / "partition.npz") as tmp:
            with envfail.writing(tmp), open(tmp, "wb") as f:
                write_npz(f, indices=indices, offsets=offsets, num_classes=np.int64(self.num_classes),
                          label_hist=self.label_hist.astype(np.int64))
            faults.point("partition_write", path=tmp)

    @classmethod
    def load(cls, directory: Path) -> "Partition":
        """Read a partition written by :meth:`save`."""
        with np.load(Path(directory) / "partition.npz") as z:
            indices, offsets = z["indices"].astype(np.int64), z["offsets"].astype(np.int64)
            num_classes, hist = int(z["num_classes"]), z["label_hist"].astype(np.int64)
        parts = [indices[offsets[i] : offsets[i + 1]].copy() for i in range(len(offsets) - 1)]
        return cls(client_indices=parts, num_classes=num_classes, label_hist=hist.reshape(len(parts), num_classes))


def write_npz(f: Any, **arrays: np.ndarray) -> None:
    """``np.savez``'s format (a zip of ``<name>.npy`` files; ``np.load`` reads it) into the open binary file ``f``,
    with every zip field fixed: entries stored, dated 1980-01-01, their sizes in the local headers. ``np.savez``
    streams its entries through Python's ``zipfile``, which writes zip64 size placeholders in some Python versions and
    not in others (3.11.2 vs 3.11.7), so the same partition gave other bytes, and another hash in ``dvc.lock``, on
    another machine's Python."""
    import io
    import zipfile

    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3  # Unix, whatever the platform
            info.external_attr = 0o600 << 16
            z.writestr(info, buf.getvalue())


def _stats_json(stats: dict) -> str:
    """JSON with one top-level key per line and one client per line of ``label_hist``."""
    lines = []
    for k, v in stats.items():
        if k == "label_hist" and v:
            rows = ",\n".join(f"  {json.dumps(r)}" for r in v)
            lines.append(f" {json.dumps(k)}: [\n{rows}\n ]")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


class _atomic:
    """Context manager yielding a temporary path next to ``path``; moved onto ``path`` on success."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __enter__(self) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=self.path.suffix, dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            os.replace(self.tmp, self.path)
        elif self.tmp.exists():
            self.tmp.unlink()


# --------------------------------------------------------------------------- sizes


def lognormal_sizes(total: int, num_clients: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Client sizes n_i (docs/algorithms.md, Lognormal client sizes; Acar's ``unbalanced_sgm``).

    ``sigma = 0``: every client gets ``floor(total / N)``; the remainder is not assigned
    (sum = ``N * floor(total / N)``) and nothing is drawn from ``rng``.
    ``sigma > 0``: ``s_i ~ LogNormal(log(floor(total/N)), sigma)``,
    ``n_i = floor(s_i / sum(s) * total)``, and the shortfall ``total - sum(n)`` is added to
    the first client with ``n_i > diff`` (client 0), so the sizes sum to ``total``.
    A client may get 0 samples when sigma is large relative to ``total / N``.

    Returns:
        int64 ``[num_clients]``.
    """
    total, num_clients = int(total), int(num_clients)
    if num_clients < 1:
        raise PartitionError(f"partition.num_clients must be >= 1, got {num_clients}")
    mean_size = total // num_clients
    if sigma == 0:
        return np.full(num_clients, mean_size, dtype=np.int64)
    if sigma < 0 or not math.isfinite(sigma):
        raise PartitionError(f"partition.size_sigma must be a finite number >= 0, got {sigma}")
    if mean_size < 1:
        raise PartitionError(f"partition.num_clients={num_clients} exceeds the {total} training samples")
    s = rng.lognormal(mean=math.log(mean_size), sigma=sigma, size=num_clients)
    sizes = np.floor(s / s.sum() * total).astype(np.int64)  # NumPy's sum: the module docstring
    diff = int(sizes.sum()) - total  # <= 0 after flooring (up to rounding of s/sum(s))
    if diff != 0:
        for i in range(num_clients):
            if sizes[i] > diff:
                sizes[i] -= diff
                break
    return sizes


# --------------------------------------------------------------------------- variants


def _uniforms(rng: np.random.Generator, block: int = 1 << 15) -> Iterator[float]:
    """An endless stream of U[0, 1) floats, drawn from ``rng`` in blocks (fast in Python loops)."""
    while True:
        yield from rng.random(block).tolist()


def _class_pools(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled indices of every class."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _iid(labels: np.ndarray, n: int, sigma: float, rng: np.random.Generator) -> list[np.ndarray]:
    sizes = lognormal_sizes(len(labels), n, sigma, rng)
    perm = rng.permutation(len(labels)).astype(np.int64)
    ends = np.cumsum(sizes)
    return [perm[e - s : e] for s, e in zip(sizes, ends)]


def _dirichlet_per_client(
    labels: np.ndarray, num_classes: int, n: int, alpha: float, sigma: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Variant A of docs/algorithms.md, Dirichlet label skew.

    Class pools are shuffled first (Acar permutes the whole training set at load time,
    which has the same effect); "pools consumed from the end" then takes the last unused
    index of the shuffled pool. A client redraw ("if quota_i == 0: redraw i") is a
    uniform draw among the clients with quota left. The label redraw is rejection
    sampling from q_i restricted to the non-empty pools; after ``_MAX_LABEL_REDRAWS``
    rejections the class is drawn directly from that (same) conditional distribution,
    which keeps tiny alphas fast. Should q_i put no mass at all on the non-empty pools
    (possible only by floating-point underflow), the class is uniform among them.
    """
    quota = lognormal_sizes(len(labels), n, sigma, rng).tolist()
    priors = rng.dirichlet(np.full(num_classes, float(alpha)), size=n)
    cdf = np.cumsum(priors, axis=1)
    cdf /= cdf[:, -1:]
    cdf[:, -1] = 1.0
    cdf_rows = cdf.tolist()
    pools = [p.tolist() for p in _class_pools(labels, num_classes, rng)]
    left = [len(p) for p in pools]  # pool c's unused samples: pools[c][:left[c]]
    taken: list[list[int]] = [[] for _ in range(n)]
    active = [i for i in range(n) if quota[i] > 0]
    u = _uniforms(rng)
    while active:
        k = int(next(u) * len(active))
        i = active[k]
        quota[i] -= 1
        if quota[i] == 0:
            active[k] = active[-1]
            active.pop()
        row = cdf_rows[i]
        for _ in range(_MAX_LABEL_REDRAWS):
            c = bisect_right(row, next(u))
            if left[c] > 0:
                break
        else:
            avail = np.flatnonzero(np.asarray(left) > 0)
            w = np.cumsum(priors[i, avail])
            if w[-1] > 0:
                c = int(avail[min(int(np.searchsorted(w, next(u) * w[-1], side="right")), len(avail) - 1)])
            else:
                c = int(avail[int(next(u) * len(avail))])
        left[c] -= 1
        taken[i].append(pools[c][left[c]])
    return [np.asarray(t, dtype=np.int64) for t in taken]


def _dirichlet_fixed_size_reuse(
    labels: np.ndarray, num_classes: int, n: int, alpha: float, per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Variant B of docs/algorithms.md, Dirichlet label skew (FedBCGD ``dirichlet_data.data_from_dirichlet``).

    Draw order, as in the reference: (1) every class pool shuffled once (:func:`_class_pools`);
    (2) the priors ``q ~ Dir(alpha 1_C)``, ``[n, C]``, in one call; (3) client by client, its
    ``per_client`` labels i.i.d. from ``q_i`` (one ``rng.choice``), then for each drawn label c in
    order the next index of pool c, where an exhausted pool is first reshuffled (``rng.permutation``
    of its current order) and its pointer reset to 0. The pointers persist across clients, so clients
    share one pass over each pool until it is exhausted. Classes without samples get zero prior
    mass (the prior is renormalised over the non-empty classes); a prior with no mass left on them
    (or a non-finite one, by underflow at tiny alpha) draws its labels uniformly among them, as the
    reference does.

    Returns:
        ``n`` int64 arrays of exactly ``per_client`` indices each.
    """
    pools = [p.tolist() for p in _class_pools(labels, num_classes, rng)]
    priors = rng.dirichlet(np.full(num_classes, float(alpha)), size=n)
    valid = np.array([len(p) > 0 for p in pools])
    valid_cls = np.flatnonzero(valid)
    ptr = [0] * num_classes
    out = []
    for i in range(n):
        q = np.where(valid, priors[i], 0.0)
        mass = q.sum()  # NumPy's sum: the module docstring
        if np.isfinite(mass) and mass > 0:
            drawn = rng.choice(num_classes, size=per_client, p=q / mass)
        else:
            drawn = rng.choice(valid_cls, size=per_client, replace=True)
        taken = []
        for c in drawn.tolist():
            pool = pools[c]
            if ptr[c] >= len(pool):
                pool = pools[c] = rng.permutation(pool).tolist()
                ptr[c] = 0
            taken.append(pool[ptr[c]])
            ptr[c] += 1
        out.append(np.asarray(taken, dtype=np.int64))
    return out


def _dirichlet_per_class(
    labels: np.ndarray, num_classes: int, n: int, alpha: float, min_size: int, rng: np.random.Generator,
    balance_cap: bool = True,
) -> list[np.ndarray]:
    """Variant C of docs/algorithms.md, Dirichlet label skew (NIID-Bench ``noniid-labeldir``).

    With ``balance_cap`` (NIID-Bench's code) a client already holding ``|D|/N`` samples gets no share of the
    classes drawn after; without it every class is split by its own ``Dir(alpha 1_N)`` draw alone (the plain
    per-class split). An attempt in which every client still below ``|D|/N`` got zero Dirichlet mass (only
    possible by floating-point underflow at tiny alpha) counts as failed and is redrawn.
    """
    total = len(labels)
    mean_size = total / n
    class_idx = [np.flatnonzero(labels == c) for c in range(num_classes)]
    for _ in range(_MAX_PER_CLASS_TRIES):
        batches: list[list[np.ndarray]] = [[] for _ in range(n)]
        sizes = np.zeros(n, dtype=np.int64)
        ok = True
        for k in range(num_classes):
            idx_k = rng.permutation(class_idx[k])
            p = rng.dirichlet(np.full(n, float(alpha)))
            if balance_cap:
                p = p * (sizes < mean_size)
            s = p.sum()  # NumPy's sum: the module docstring
            if not s > 0:
                ok = False
                break
            cuts = (np.cumsum(p / s) * len(idx_k)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(idx_k, cuts)):
                if len(piece):
                    batches[j].append(piece)
                    sizes[j] += len(piece)
        if ok and sizes.min() >= min_size:
            out = []
            for b in batches:
                ix = np.concatenate(b).astype(np.int64) if b else np.zeros(0, np.int64)
                out.append(rng.permutation(ix))
            return out
    raise PartitionError(
        f"partition.min_size={min_size} not reached after {_MAX_PER_CLASS_TRIES} Dirichlet draws "
        f"(alpha={alpha}, {n} clients, {total} samples); lower partition.min_size or raise partition.alpha"
    )


def _shards(labels: np.ndarray, num_classes: int, n: int, s: int, rng: np.random.Generator) -> list[np.ndarray]:
    """docs/algorithms.md, Shards: the ``#label-S`` scheme (``shards_variant = label_S``)."""
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i in range(n):
        first = i % num_classes
        others = np.delete(np.arange(num_classes), first)
        extra = rng.choice(others, size=s - 1, replace=False) if s > 1 else []
        for c in [first, *(int(c) for c in extra)]:
            holders[c].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c in range(num_classes):
        idx_c = rng.permutation(np.flatnonzero(labels == c))
        if not holders[c]:
            continue  # no client holds class c: its samples are unused
        for i, piece in zip(holders[c], np.array_split(idx_c, len(holders[c]))):
            parts[i].append(piece)
    return [np.concatenate(p).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def _sort_and_shard(labels: np.ndarray, n: int, s: int, rng: np.random.Generator) -> list[np.ndarray]:
    """docs/algorithms.md, Shards: McMahan's scheme (``shards_variant = mcmahan_sort_shard``).

    1. ``r = |D| mod (N*S)`` indices, drawn uniformly without replacement, are dropped (none when
       N*S divides |D|, e.g. CIFAR-10 with N*S = 40 or 400). Cutting the sorted order instead would
       drop the tail of the last class only.
    2. The remaining indices, sorted by label with a stable sort (ties keep index order), are cut into
       N*S contiguous shards of ``floor(|D| / (N*S))``.
    3. A random permutation of the shard ids gives client i the shards ``perm[i*S:(i+1)*S]``; a client's
       indices are its shards concatenated in increasing shard id (so sorted by label).

    Returns int64 index arrays of ``S * floor(|D| / (N*S))`` samples each.
    """
    num_shards = n * s
    shard_size = len(labels) // num_shards
    keep = np.arange(len(labels), dtype=np.int64)
    extra = len(labels) - num_shards * shard_size
    if extra:
        keep = np.sort(rng.choice(keep, size=len(keep) - extra, replace=False))
    order = keep[np.argsort(labels[keep], kind="stable")]
    shards = order.reshape(num_shards, shard_size)
    perm = rng.permutation(num_shards)
    return [shards[np.sort(perm[i * s : (i + 1) * s])].reshape(-1).astype(np.int64) for i in range(n)]


# --------------------------------------------------------------------------- entry points

SHARDS_VARIANTS = ("label_S", "mcmahan_sort_shard")
_DEFAULT_SHARDS_VARIANT = "label_S"
_DEFAULT_SAMPLES_PER_CLIENT = 500  # PartitionConfig.samples_per_client (FedBCGD: 500 for CIFAR)


def _shards_variant(cfg: Any) -> str:
    """``partition.shards_variant`` (``label_S`` for configs written before the field existed)."""
    return str(getattr(cfg, "shards_variant", _DEFAULT_SHARDS_VARIANT))


def _balance_cap(cfg: Any) -> bool:
    """``partition.balance_cap`` (true for configs written before the field existed)."""
    return bool(getattr(cfg, "balance_cap", True))


def _samples_per_client(cfg: Any) -> int:
    """``partition.samples_per_client`` (500 for configs written before the field existed)."""
    return int(getattr(cfg, "samples_per_client", _DEFAULT_SAMPLES_PER_CLIENT))


def _natural(devices: np.ndarray | None, n: int) -> list[np.ndarray]:
    """Client k = the training samples of device k (indices in increasing order).

    Raises:
        PartitionError: no device ids (a dataset without devices), or ``n`` != the number of devices (None: any).
    """
    if devices is None:
        raise PartitionError("partition.name=natural needs a dataset made of devices (dataset=synthetic, quadratic, "
                             "femnist or shakespeare)")
    devices = np.asarray(devices, dtype=np.int64).reshape(-1)
    count = int(devices.max()) + 1 if devices.size else 0
    n = count if n is None else n
    if n != count:
        raise PartitionError(f"partition.num_clients={n} must equal the dataset's {count} devices with "
                             f"partition=natural")
    order = np.argsort(devices, kind="stable")
    return [np.sort(ix) for ix in np.split(order, np.cumsum(np.bincount(devices, minlength=count))[:-1])]


def _check_kind(cfg: Any) -> None:
    """The partition's name, and the fields that depend on it alone (natural's size_sigma, dirichlet's variant)."""
    if cfg.name not in ("iid", "dirichlet", "shards", "natural"):
        raise PartitionError(f"partition.name must be one of iid, dirichlet, shards, natural, got {cfg.name!r}")
    if cfg.name == "natural" and float(cfg.size_sigma) != 0:
        raise PartitionError(f"partition.size_sigma={cfg.size_sigma}: the devices of partition=natural keep their "
                             f"own sizes (set it to 0)")
    if cfg.name == "dirichlet" and cfg.variant not in DIRICHLET_VARIANTS:
        raise PartitionError(
            f"partition.variant must be one of {', '.join(DIRICHLET_VARIANTS)}, got {cfg.variant!r}"
        )


def _check_sizes(cfg: Any, n: int, total: int) -> None:
    """The number of clients against the training set, and size_sigma where the split can use it."""
    if n < 1:
        raise PartitionError(f"partition.num_clients must be >= 1, got {n}")
    if n > total:
        raise PartitionError(f"partition.num_clients={n} exceeds the {total} training samples")
    if not float(cfg.size_sigma) >= 0:
        raise PartitionError(f"partition.size_sigma must be >= 0, got {cfg.size_sigma}")
    if cfg.size_sigma > 0 and (cfg.name == "shards" or (cfg.name == "dirichlet" and cfg.variant != "per_client")):
        raise PartitionError(
            f"partition.size_sigma={cfg.size_sigma}: partition.size_sigma applies to iid and "
            f"dirichlet/per_client only (set it to 0)"
        )


def _check_dirichlet(cfg: Any, n: int, total: int) -> None:
    """alpha, and the sizes the fixed_size_reuse and per_class variants need."""
    if math.isnan(float(cfg.alpha)) or float(cfg.alpha) == math.inf:
        # Dir(inf) gives NaN priors; the IID split is partition=iid
        raise PartitionError(f"partition.alpha must be a finite number > 0, got {cfg.alpha} "
                             f"(use partition=iid for an IID split)")
    if not float(cfg.alpha) > 0:
        raise PartitionError(f"partition.alpha must be > 0, got {cfg.alpha}")
    if cfg.variant == "fixed_size_reuse" and _samples_per_client(cfg) < 1:
        raise PartitionError(f"partition.samples_per_client must be >= 1, got {_samples_per_client(cfg)}")
    if cfg.variant == "per_class" and int(cfg.min_size) * n > total:
        raise PartitionError(
            f"partition.min_size={cfg.min_size} is unreachable: {n} clients x {cfg.min_size} > {total} training samples"
        )


def _check_shards(cfg: Any, n: int, total: int, num_classes: int) -> None:
    """classes_per_client against the dataset's classes, the shards variant, and the samples its shards need."""
    s = int(cfg.classes_per_client)
    if s < 1:
        raise PartitionError(f"partition.classes_per_client must be >= 1, got {s}")
    if s > num_classes:
        raise PartitionError(
            f"partition.classes_per_client={s} exceeds the {num_classes} classes of the dataset"
        )
    variant = _shards_variant(cfg)
    if variant not in SHARDS_VARIANTS:
        raise PartitionError(
            f"partition.shards_variant must be one of {', '.join(SHARDS_VARIANTS)}, got {variant!r}"
        )
    if variant == "mcmahan_sort_shard" and n * s > total:
        raise PartitionError(
            f"partition.classes_per_client={s}: {n} clients x {s} shards exceed the {total} training samples"
        )


def _check(cfg: Any, total: int, num_classes: int) -> None:
    """The partition config against the training set (``total`` samples, ``num_classes`` classes), in this order:
    the kind, the sizes, then the fields of dirichlet or shards; the first problem raises :class:`PartitionError`."""
    n = int(cfg.num_clients)
    _check_kind(cfg)
    _check_sizes(cfg, n, total)
    if cfg.name == "dirichlet":
        _check_dirichlet(cfg, n, total)
    if cfg.name == "shards":
        _check_shards(cfg, n, total, num_classes)


def make_partition(cfg: Any, labels: np.ndarray, num_classes: int, devices: np.ndarray | None = None) -> Partition:
    """Split a training set across ``cfg.num_clients`` clients (docs/algorithms.md, Data).

    Args:
        cfg: a :class:`~fl_core.config.PartitionConfig` (or DictConfig with its fields).
        labels: int ``[|D|]`` training labels in ``[0, num_classes)`` (numpy or CPU tensor).
        num_classes: C.
        devices: int ``[|D|]`` device id of every training sample (``FLDataset.devices``); only
            ``partition=natural`` reads it, and needs it.

    Returns:
        The partition; identical for identical ``cfg``, ``labels`` and ``devices``.

    Raises:
        PartitionError: one line naming the offending ``partition.*`` key.
    """
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    num_classes = int(num_classes)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
    if cfg.name == "natural":  # no randomness; null num_clients: one client per device, however many
        _check_kind(cfg)
        given = None if cfg.num_clients is None else int(cfg.num_clients)
        idx = _natural(None if devices is None else np.asarray(devices), given)
        _check_sizes(cfg, len(idx), len(labels))
        return Partition.from_indices(idx, labels, num_classes)
    _check(cfg, len(labels), num_classes)
    rng = numpy_rng("partition", int(cfg.seed))
    n, sigma = int(cfg.num_clients), float(cfg.size_sigma)
    if cfg.name == "iid":
        idx = _iid(labels, n, sigma, rng)
    elif cfg.name == "shards" and _shards_variant(cfg) == "mcmahan_sort_shard":
        idx = _sort_and_shard(labels, n, int(cfg.classes_per_client), rng)
    elif cfg.name == "shards":
        idx = _shards(labels, num_classes, n, int(cfg.classes_per_client), rng)
    elif cfg.variant == "per_client":
        idx = _dirichlet_per_client(labels, num_classes, n, float(cfg.alpha), sigma, rng)
    elif cfg.variant == "fixed_size_reuse":
        idx = _dirichlet_fixed_size_reuse(labels, num_classes, n, float(cfg.alpha), _samples_per_client(cfg), rng)
    else:
        idx = _dirichlet_per_class(labels, num_classes, n, float(cfg.alpha), int(cfg.min_size), rng,
                                   balance_cap=_balance_cap(cfg))
    return Partition.from_indices(idx, labels, num_classes)


def _num(x: float) -> str:
    """Compact, exact, filesystem-safe spelling of a number: 0.3, 10000, 1e-05."""
    x = float(x)
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def partition_key(cfg: Any, dataset_name: str) -> str:
    """A readable folder name that changes with every field the partition depends on.

    Examples: ``digits-iid-n20-sgm0-s0``, ``cifar10-dirichlet-per_client-a0.3-n100-sgm0-s0``,
    ``cifar10-dirichlet-per_class-a0.5-n20-min10-s0``, ``cifar100-dirichlet-fixed_size_reuse-a0.6-n100-spc500-s0``
    (``spc`` = ``partition.samples_per_client``), ``cifar100-shards-S20-n20-s0``,
    ``cifar10-shards-mcmahan_sort_shard-S2-n100-s0``, ``synthetic-natural-n30``, ``femnist-natural-all`` (every
    writer), ``cifar10-dirichlet-per_class-a0.5-n20-min10-nocap-s0`` (``partition.balance_cap=false``).
    ``partition.shards_variant`` and ``partition.balance_cap`` appear only when they are not the defaults
    (``label_S``, true), so keys written before they existed stay valid.
    """
    ds = re.sub(r"[^A-Za-z0-9._-]", "_", str(dataset_name))
    if cfg.name == "natural":  # no seed: the devices decide
        count = "all" if cfg.num_clients is None else f"n{int(cfg.num_clients)}"
        return re.sub(r"[^A-Za-z0-9._+-]", "_", f"{ds}-natural-{count}")
    n, seed = int(cfg.num_clients), int(cfg.seed)
    if cfg.name == "iid":
        body = f"iid-n{n}-sgm{_num(cfg.size_sigma)}"
    elif cfg.name == "dirichlet" and cfg.variant == "per_client":
        body = f"dirichlet-per_client-a{_num(cfg.alpha)}-n{n}-sgm{_num(cfg.size_sigma)}"
    elif cfg.name == "dirichlet" and cfg.variant == "fixed_size_reuse":
        body = f"dirichlet-fixed_size_reuse-a{_num(cfg.alpha)}-n{n}-spc{_samples_per_client(cfg)}"
    elif cfg.name == "dirichlet":
        cap = "" if _balance_cap(cfg) else "-nocap"
        body = f"dirichlet-{cfg.variant}-a{_num(cfg.alpha)}-n{n}-min{int(cfg.min_size)}{cap}"
    elif cfg.name == "shards":
        variant = _shards_variant(cfg)
        tag = "" if variant == _DEFAULT_SHARDS_VARIANT else f"-{variant}"
        body = f"shards{tag}-S{int(cfg.classes_per_client)}-n{n}"
    else:
        body = str(cfg.name)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", f"{ds}-{body}-s{seed}")


def _cfg_dict(cfg: Any) -> dict:
    """The PartitionConfig fields of ``cfg`` (dataclass or DictConfig) as plain values; ``balance_cap`` only when
    false (the stored config of a partition written before it existed stays the same)."""
    out = {}
    for f in fields(PartitionConfig):
        v = getattr(cfg, f.name, f.default)
        if f.name == "balance_cap" and v:
            continue
        out[f.name] = v if isinstance(v, (str, bool)) or v is None else (int(v) if isinstance(v, int) else float(v))
    return out


def _labels_digest(labels: np.ndarray, devices: np.ndarray | None = None) -> str:
    """SHA-1 of the labels, and of the device ids when a dataset has them (so a cached natural partition is
    reused only for the same devices)."""
    h = hashlib.sha1(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    if devices is not None:
        h.update(b"devices")
        h.update(np.ascontiguousarray(devices, dtype=np.int64).tobytes())
    return h.hexdigest()


def _cached(directory: Path, labels: np.ndarray, num_classes: int, digest: str) -> Partition | None:
    """The saved partition in ``directory`` if it exists and was made from these labels."""
    if not (directory / "partition.npz").is_file():
        return None
    try:
        part = Partition.load(directory)
        saved = json.loads((directory / "stats.json").read_text()).get("config") or {}
    except Exception:
        return None
    if saved.get("labels_sha1") != digest or part.num_classes != num_classes:
        log.warning("partition in %s was made from other training labels; rebuilding it", directory)
        return None
    return part


def get_partition(cfg: Any, dataset_name: str, labels: np.ndarray, num_classes: int, data_dir: Path,
                  devices: np.ndarray | None = None) -> Partition:
    """The partition of ``cfg`` for this training set, cached under ``data_dir/partitions/<key>``.

    A cached partition is reused only if it was built from the same training labels
    (SHA-1 of the label array, stored in ``stats.json``); otherwise it is rebuilt and
    overwritten (with ``devices``, the digest covers the device ids too). The stored config holds
    the PartitionConfig fields plus ``dataset``, ``key``, ``num_train`` and ``labels_sha1``.

    Raises:
        PartitionError: see :func:`make_partition`.
    """
    labels = np.asarray(labels).astype(np.int64).reshape(-1)
    key = partition_key(cfg, dataset_name)
    directory = Path(data_dir) / "partitions" / key
    digest = _labels_digest(labels, devices)
    part = _cached(directory, labels, int(num_classes), digest)
    if part is not None:
        return part
    part = make_partition(cfg, labels, num_classes, devices)
    config = {**_cfg_dict(cfg), "dataset": str(dataset_name), "key": key, "num_train": int(len(labels)),
              "labels_sha1": digest}
    part.save(directory, config)
    return part


# --------------------------------------------------------------------------- plot


def plot_label_distribution(partition: Partition, path: Path, title: str = "") -> None:
    """Stacked bar chart of the label counts of every client, written as PNG to ``path``.

    One bar per client, one colour per class. The bars are drawn as a single
    ``PolyCollection`` (fast for hundreds of clients and classes) on matplotlib's Agg
    canvas directly (no pyplot state, no display needed).
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    hist = np.asarray(partition.label_hist, dtype=np.float64)
    n, c = hist.shape
    fig = Figure(figsize=(min(4 + 0.12 * n, 24), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["tab10" if c <= 10 else "tab20" if c <= 20 else "viridis"]
    colors = [cmap(k) if c <= 20 else cmap(k / max(c - 1, 1)) for k in range(c)]
    half = 0.4 if n <= 200 else 0.5
    top = np.cumsum(hist, axis=1)  # [n, c]
    bottom = top - hist
    keep = hist > 0
    ii, kk = np.nonzero(keep)
    x0, x1 = ii - half, ii + half
    y0, y1 = bottom[ii, kk], top[ii, kk]
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1), np.stack([x1, y0], 1)], 1)
    ax.add_collection(PolyCollection(verts, facecolors=[colors[k] for k in kk], linewidths=0))
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, max(float(top[:, -1].max()) if n and c else 1.0, 1.0) * 1.03)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("client")
    ax.set_ylabel("samples")
    if title:
        ax.set_title(title, fontsize=9)
    if c <= 20:
        handles = [Patch(color=colors[k], label=str(k)) for k in range(c)]
        ax.legend(handles=handles, title="class", fontsize=7, title_fontsize=7, ncol=2, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    with open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
