"""Client partitions of fl_core.data.partition (ALGORITHMS.md 1.1-1.4, invariant 14.12)."""

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from fl_core.config import PartitionConfig
from fl_core.data import partition as part_mod
from fl_core.data.partition import (
    Partition,
    PartitionError,
    get_partition,
    lognormal_sizes,
    make_partition,
    partition_key,
)
from fl_core.seeding import numpy_rng

C = 10


@pytest.fixture(scope="module")
def labels():
    """3,000 labels over 10 classes with unequal class sizes (150..450)."""
    counts = np.array([150, 200, 250, 300, 350, 400, 450, 300, 300, 300])
    y = np.repeat(np.arange(C), counts)
    return np.random.default_rng(123).permutation(y)


def _all_indices(p: Partition) -> np.ndarray:
    return np.concatenate(p.client_indices)


def _assert_consistent(p: Partition, labels: np.ndarray, n: int):
    assert p.num_clients == n and len(p.client_indices) == n
    for ix in p.client_indices:
        assert ix.dtype == np.int64
    idx = _all_indices(p)
    assert idx.min() >= 0 and idx.max() < len(labels)
    assert len(np.unique(idx)) == len(idx), "an index is used twice"
    assert p.label_hist.dtype == np.int64 and p.label_hist.shape == (n, C)
    for i, ix in enumerate(p.client_indices):
        assert np.array_equal(p.label_hist[i], np.bincount(labels[ix], minlength=C))
    assert np.array_equal(p.sizes, p.label_hist.sum(1))


def _tv_to_global(p: Partition, labels: np.ndarray) -> np.ndarray:
    glob = np.bincount(labels, minlength=C) / len(labels)
    local = p.label_hist / p.label_hist.sum(1, keepdims=True)
    return 0.5 * np.abs(local - glob).sum(1)


# --------------------------------------------------------------------------- lognormal sizes


def test_lognormal_sigma0_is_balanced_and_draws_nothing():
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    sizes = lognormal_sizes(1347, 20, 0.0, rng)
    assert sizes.dtype == np.int64 and np.all(sizes == 1347 // 20)
    assert sizes.sum() == 20 * 67  # the 7 leftover samples are not assigned (Acar)
    assert rng.bit_generator.state == before


@pytest.mark.parametrize("sigma", [0.3, 0.6, 0.9, 2.0])
@pytest.mark.parametrize("total,n", [(1347, 20), (50000, 100), (101, 7)])
def test_lognormal_sum_rule(sigma, total, n):
    sizes = lognormal_sizes(total, n, sigma, np.random.default_rng(5))
    assert sizes.dtype == np.int64 and sizes.shape == (n,)
    assert sizes.sum() == total and sizes.min() >= 0
    # 1.3: floor(s_i / sum(s) * |D|), the shortfall goes to client 0
    s = np.random.default_rng(5).lognormal(math.log(total // n), sigma, n)
    floors = np.floor(s / s.sum() * total).astype(np.int64)
    assert np.array_equal(sizes[1:], floors[1:])
    assert sizes[0] == floors[0] + (total - floors.sum())


def test_lognormal_is_unbalanced():
    sizes = lognormal_sizes(50000, 100, 0.9, np.random.default_rng(1))
    assert sizes.max() > 3 * sizes.min()


# --------------------------------------------------------------------------- iid


def test_iid_balanced(labels):
    cfg = PartitionConfig(name="iid", num_clients=7)
    p = make_partition(cfg, labels, C)
    _assert_consistent(p, labels, 7)
    assert np.all(p.sizes == len(labels) // 7)
    assert p.sizes.sum() == 7 * (len(labels) // 7)  # remainder dropped
    assert _tv_to_global(p, labels).max() < 0.15


def test_iid_lognormal_uses_every_sample(labels):
    p = make_partition(PartitionConfig(name="iid", num_clients=12, size_sigma=0.6), labels, C)
    _assert_consistent(p, labels, 12)
    assert p.sizes.sum() == len(labels) and p.sizes.max() > p.sizes.min()
    assert np.array_equal(p.sizes, lognormal_sizes(len(labels), 12, 0.6, numpy_rng("partition", 0)))


# --------------------------------------------------------------------------- dirichlet A


@pytest.mark.parametrize("sigma", [0.0, 0.9])
@pytest.mark.parametrize("alpha", [0.05, 0.3, 10.0])
def test_dirichlet_per_client_exact_quotas(labels, alpha, sigma):
    cfg = PartitionConfig(name="dirichlet", variant="per_client", num_clients=15, alpha=alpha, size_sigma=sigma)
    p = make_partition(cfg, labels, C)
    _assert_consistent(p, labels, 15)
    quotas = lognormal_sizes(len(labels), 15, sigma, numpy_rng("partition", cfg.seed))
    assert np.array_equal(p.sizes, quotas)


def test_dirichlet_per_client_tiny_alpha_many_classes():
    """alpha so small that priors are one-hot: pools run dry and the label redraw must cope."""
    y = np.random.default_rng(0).integers(0, 100, 5000)
    cfg = PartitionConfig(name="dirichlet", num_clients=50, alpha=1e-3)
    p = make_partition(cfg, y, 100)
    assert np.all(p.sizes == 100)
    idx = _all_indices(p)
    assert len(np.unique(idx)) == len(idx) == 5000
    for i, ix in enumerate(p.client_indices):
        assert np.array_equal(p.label_hist[i], np.bincount(y[ix], minlength=100))


@pytest.mark.parametrize("seed", [0, 1])
def test_dirichlet_alpha_controls_skew(labels, seed):
    labels = np.tile(labels, 8)  # 2,400 samples per client: sampling noise of the TV distance ~0.03
    big = make_partition(PartitionConfig(name="dirichlet", num_clients=10, alpha=1e4, seed=seed), labels, C)
    small = make_partition(PartitionConfig(name="dirichlet", num_clients=10, alpha=0.05, seed=seed), labels, C)
    tv_big, tv_small = _tv_to_global(big, labels), _tv_to_global(small, labels)
    assert tv_big.mean() < 0.06 and tv_big.max() < 0.09
    assert tv_small.mean() > 0.5
    assert (small.label_hist > 0).sum(1).mean() < (big.label_hist > 0).sum(1).mean()


# --------------------------------------------------------------------------- dirichlet C


@pytest.mark.parametrize("alpha", [0.1, 0.5, 5.0])
def test_dirichlet_per_class_uses_every_index_once(labels, alpha):
    cfg = PartitionConfig(name="dirichlet", variant="per_class", num_clients=20, alpha=alpha, min_size=10)
    p = make_partition(cfg, labels, C)
    _assert_consistent(p, labels, 20)
    assert np.array_equal(np.sort(_all_indices(p)), np.arange(len(labels)))
    assert p.sizes.min() >= 10


def test_dirichlet_per_class_is_unbalanced(labels):
    cfg = PartitionConfig(name="dirichlet", variant="per_class", num_clients=20, alpha=0.1)
    p = make_partition(cfg, labels, C)
    assert p.sizes.max() > 2 * p.sizes.min()


def test_dirichlet_per_class_min_size_failure_names_key(labels):
    # feasible on paper (10 x 250 <= 3000) but practically never reached with alpha=0.01
    cfg = PartitionConfig(name="dirichlet", variant="per_class", num_clients=10, alpha=0.01, min_size=250)
    with pytest.raises(PartitionError, match=r"^partition\.min_size=250 ") as err:
        make_partition(cfg, labels, C)
    assert "\n" not in str(err.value)
    cfg = replace(cfg, min_size=400)  # 10 x 400 > 3000: refused up front
    with pytest.raises(PartitionError, match=r"partition\.min_size=400 is unreachable"):
        make_partition(cfg, labels, C)


# --------------------------------------------------------------------------- shards


@pytest.mark.parametrize("s", [1, 2, 3, 10])
def test_shards_exactly_s_classes(labels, s):
    p = make_partition(PartitionConfig(name="shards", num_clients=20, classes_per_client=s), labels, C)
    _assert_consistent(p, labels, 20)
    assert np.all((p.label_hist > 0).sum(1) == s)
    # 20 clients >= 10 classes: every class has a holder (class i mod C), so nothing is dropped
    assert np.array_equal(np.sort(_all_indices(p)), np.arange(len(labels)))
    for i in range(20):
        assert p.label_hist[i, i % C] > 0


def test_shards_split_class_evenly_among_holders(labels):
    p = make_partition(PartitionConfig(name="shards", num_clients=20, classes_per_client=3), labels, C)
    for c in range(C):
        held = p.label_hist[:, c][p.label_hist[:, c] > 0]
        assert held.max() - held.min() <= 1  # array_split
        assert held.sum() == (labels == c).sum()


def test_shards_too_many_classes(labels):
    with pytest.raises(PartitionError, match=r"^partition\.classes_per_client=11 exceeds the 10 classes"):
        make_partition(PartitionConfig(name="shards", classes_per_client=11), labels, C)


# --------------------------------------------------------------------------- common


ALL_CFGS = [
    PartitionConfig(name="iid", num_clients=9),
    PartitionConfig(name="iid", num_clients=9, size_sigma=0.5),
    PartitionConfig(name="dirichlet", variant="per_client", num_clients=9, alpha=0.3),
    PartitionConfig(name="dirichlet", variant="per_client", num_clients=9, alpha=0.3, size_sigma=0.5),
    PartitionConfig(name="dirichlet", variant="per_class", num_clients=9, alpha=0.3),
    PartitionConfig(name="shards", num_clients=9, classes_per_client=2),
]


@pytest.mark.parametrize("cfg", ALL_CFGS, ids=lambda c: f"{c.name}-{c.variant}-{c.size_sigma}")
def test_same_seed_same_partition_other_seed_differs(labels, cfg):
    a = make_partition(cfg, labels, C)
    b = make_partition(cfg, labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    c = make_partition(replace(cfg, seed=cfg.seed + 1), labels, C)
    assert any(
        len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a.client_indices, c.client_indices)
    )


def test_accepts_torch_labels(labels):
    import torch

    cfg = ALL_CFGS[2]
    a = make_partition(cfg, torch.from_numpy(labels), C)
    b = make_partition(cfg, labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))


def test_too_many_clients_names_key(labels):
    for name in ("iid", "dirichlet", "shards"):
        with pytest.raises(PartitionError, match=r"^partition\.num_clients=5000 exceeds the 3000 training samples$"):
            make_partition(PartitionConfig(name=name, num_clients=5000), labels, C)


@pytest.mark.parametrize(
    "cfg",
    [
        PartitionConfig(name="shards", size_sigma=0.5),
        PartitionConfig(name="dirichlet", variant="per_class", size_sigma=0.5),
    ],
)
def test_size_sigma_only_for_iid_and_per_client(labels, cfg):
    with pytest.raises(PartitionError, match=r"^partition\.size_sigma.*iid and dirichlet/per_client only"):
        make_partition(cfg, labels, C)


def test_unknown_name_and_variant(labels):
    with pytest.raises(PartitionError, match=r"^partition\.name"):
        make_partition(PartitionConfig(name="pathological"), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.variant"):
        make_partition(PartitionConfig(name="dirichlet", variant="fedbcgd"), labels, C)


def test_partition_key():
    base = PartitionConfig(name="dirichlet", variant="per_client", alpha=0.3, num_clients=20)
    assert partition_key(base, "digits") == "digits-dirichlet-per_client-a0.3-n20-sgm0-s0"
    keys = {
        partition_key(base, "digits"),
        partition_key(base, "cifar10"),
        partition_key(replace(base, alpha=0.5), "digits"),
        partition_key(replace(base, alpha=1e-5), "digits"),
        partition_key(replace(base, num_clients=21), "digits"),
        partition_key(replace(base, size_sigma=0.9), "digits"),
        partition_key(replace(base, seed=1), "digits"),
        partition_key(replace(base, variant="per_class"), "digits"),
        partition_key(replace(base, variant="per_class", min_size=5), "digits"),
        partition_key(replace(base, name="iid"), "digits"),
        partition_key(replace(base, name="shards"), "digits"),
        partition_key(replace(base, name="shards", classes_per_client=3), "digits"),
    }
    assert len(keys) == 12
    for k in keys:
        assert re.fullmatch(r"[A-Za-z0-9._+-]+", k)
    # fields a partition does not depend on do not change its key
    iid = replace(base, name="iid")
    assert partition_key(iid, "d") == partition_key(replace(iid, alpha=9.0, min_size=3, classes_per_client=7), "d")
    shards = replace(base, name="shards")
    assert partition_key(shards, "d") == partition_key(replace(shards, alpha=9.0, variant="per_class"), "d")


# --------------------------------------------------------------------------- persistence


def test_save_load_roundtrip_and_stats(tmp_path, labels):
    p = make_partition(PartitionConfig(name="dirichlet", num_clients=8, alpha=0.3, size_sigma=0.4), labels, C)
    p.save(tmp_path / "x", {"note": "hello", "alpha": 0.3})
    assert sorted(f.name for f in (tmp_path / "x").iterdir()) == [
        "labels_per_client.png", "partition.npz", "stats.json"
    ]
    q = Partition.load(tmp_path / "x")
    assert q.num_classes == C and q.num_clients == 8
    assert all(np.array_equal(x, y) and y.dtype == np.int64 for x, y in zip(p.client_indices, q.client_indices))
    assert np.array_equal(p.label_hist, q.label_hist)

    stats = json.loads((tmp_path / "x" / "stats.json").read_text())
    assert stats["num_clients"] == 8
    assert stats["total"] == len(labels) == sum(stats["sizes"])
    assert stats["sizes"] == p.sizes.tolist()
    assert stats["min_size"] == min(stats["sizes"]) and stats["max_size"] == max(stats["sizes"])
    assert stats["mean_size"] == pytest.approx(len(labels) / 8)
    assert stats["label_hist"] == p.label_hist.tolist()
    assert stats["classes_per_client"] == [int((row > 0).sum()) for row in p.label_hist]
    assert stats["config"] == {"note": "hello", "alpha": 0.3}
    assert (tmp_path / "x" / "labels_per_client.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in (tmp_path / "x").iterdir() if f.name.startswith(".")]  # no temp files left


def test_get_partition_caches(tmp_path, labels, monkeypatch):
    cfg = PartitionConfig(name="dirichlet", num_clients=6, alpha=0.5)
    p = get_partition(cfg, "toy", labels, C, tmp_path)
    folder = tmp_path / "partitions" / partition_key(cfg, "toy")
    assert (folder / "partition.npz").is_file()
    saved = json.loads((folder / "stats.json").read_text())["config"]
    assert saved["alpha"] == 0.5 and saved["dataset"] == "toy" and saved["num_train"] == len(labels)

    def boom(*a, **k):
        raise AssertionError("make_partition called although the partition is cached")

    monkeypatch.setattr(part_mod, "make_partition", boom)
    q = get_partition(cfg, "toy", labels, C, tmp_path)
    assert all(np.array_equal(x, y) for x, y in zip(p.client_indices, q.client_indices))

    # other training labels under the same key (e.g. another digits split): rebuilt, not reused
    monkeypatch.undo()
    other = labels[::-1].copy()
    r = get_partition(cfg, "toy", other, C, tmp_path)
    for i, ix in enumerate(r.client_indices):
        assert np.array_equal(r.label_hist[i], np.bincount(other[ix], minlength=C))


# --------------------------------------------------------------------------- shards, McMahan's sort-and-shard


def _mcmahan(n, s, seed=0):
    return PartitionConfig(name="shards", shards_variant="mcmahan_sort_shard", num_clients=n, classes_per_client=s,
                           seed=seed)


@pytest.mark.parametrize("n,s", [(20, 2), (7, 3), (100, 4), (9, 10)])
def test_mcmahan_shards_balanced(labels, n, s):
    p = make_partition(_mcmahan(n, s), labels, C)
    _assert_consistent(p, labels, n)  # no index twice, label_hist right
    shard = len(labels) // (n * s)
    assert np.all(p.sizes == shard * s)  # every client exactly floor(|D|/(N*S)) * S samples
    assert p.sizes.sum() == len(labels) - len(labels) % (n * s)  # only the remainder is dropped
    # each client holds S contiguous runs of the label-sorted order: labels non-decreasing within a shard
    for ix in p.client_indices:
        runs = labels[ix].reshape(s, shard)
        assert np.all(np.diff(runs, axis=1) >= 0)


def test_mcmahan_shards_class_aligned_at_most_s_classes():
    """Classes whose sizes are multiples of the shard size: every shard is one class, so a client holds
    at most S classes (fewer when it drew two shards of the same class), as in McMahan et al."""
    y = np.random.default_rng(3).permutation(np.repeat(np.arange(C), 300))  # 3000 = 20 clients x 2 x 75
    p = make_partition(_mcmahan(20, 2), y, C)
    _assert_consistent(p, y, 20)
    assert np.all(p.sizes == 150)
    k = (p.label_hist > 0).sum(1)
    assert k.max() <= 2 and k.min() >= 1
    assert np.all(p.label_hist % 75 == 0)  # whole shards
    assert np.array_equal(np.sort(_all_indices(p)), np.arange(3000))  # no remainder: every index used
    # with many seeds some client gets two shards of one class (fewer than S classes) -- the label_S
    # variant never does that
    ks = [(make_partition(_mcmahan(20, 2, seed), y, C).label_hist > 0).sum(1).min() for seed in range(10)]
    assert min(ks) == 1


def test_mcmahan_shards_remainder_dropped_at_random(labels):
    # 3000 samples, 7 x 3 = 21 shards of 142: 18 samples dropped, spread over the classes (not the tail of
    # the sorted order, which would take them all from class 9)
    p = make_partition(_mcmahan(7, 3), labels, C)
    used = np.bincount(labels[_all_indices(p)], minlength=C)
    assert used.sum() == 3000 - 18
    assert (np.bincount(labels, minlength=C) - used)[9] < 18


def test_mcmahan_shards_deterministic_and_seeded(labels):
    a, b = make_partition(_mcmahan(20, 2), labels, C), make_partition(_mcmahan(20, 2), labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    c = make_partition(_mcmahan(20, 2, seed=1), labels, C)
    assert any(not np.array_equal(x, y) for x, y in zip(a.client_indices, c.client_indices))
    # a different scheme than label_S on the same config
    d = make_partition(replace(_mcmahan(20, 2), shards_variant="label_S"), labels, C)
    assert any(len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a.client_indices, d.client_indices))


def test_label_s_is_default_and_unchanged(labels):
    cfg = PartitionConfig(name="shards", num_clients=20, classes_per_client=3)
    assert cfg.shards_variant == "label_S"
    a = make_partition(cfg, labels, C)
    b = make_partition(replace(cfg, shards_variant="label_S"), labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    assert np.all((a.label_hist > 0).sum(1) == 3)


def test_mcmahan_shards_errors(labels):
    with pytest.raises(PartitionError, match=r"^partition\.shards_variant must be one of label_S, mcmahan_sort_shard"):
        make_partition(replace(_mcmahan(20, 2), shards_variant="sorted"), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.classes_per_client=10: 2000 clients x 10 shards exceed"):
        make_partition(_mcmahan(2000, 10), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.size_sigma"):
        make_partition(replace(_mcmahan(20, 2), size_sigma=0.5), labels, C)


def test_partition_key_shards_variant():
    label_s = PartitionConfig(name="shards", num_clients=20, classes_per_client=2)
    assert partition_key(label_s, "cifar10") == "cifar10-shards-S2-n20-s0"  # unchanged for the default
    mc = replace(label_s, shards_variant="mcmahan_sort_shard")
    assert partition_key(mc, "cifar10") == "cifar10-shards-mcmahan_sort_shard-S2-n20-s0"
    # other partitions ignore the field
    iid = PartitionConfig(name="iid")
    assert partition_key(iid, "d") == partition_key(replace(iid, shards_variant="mcmahan_sort_shard"), "d")
