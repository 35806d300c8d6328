"""Client partitions of fl_core.data.partition (docs/algorithms.md, Data; Invariants 12)."""

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
    # docs/algorithms.md, Lognormal client sizes: floor(s_i / sum(s) * |D|), the shortfall goes to client 0
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
    PartitionConfig(name="dirichlet", variant="fixed_size_reuse", num_clients=9, alpha=0.3, samples_per_client=50),
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
        PartitionConfig(name="dirichlet", variant="fixed_size_reuse", size_sigma=0.5),
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


# --------------------------------------------------------------------------- dirichlet B (FedBCGD)


def _reuse(n=20, alpha=0.3, spc=100, seed=0):
    return PartitionConfig(name="dirichlet", variant="fixed_size_reuse", num_clients=n, alpha=alpha,
                           samples_per_client=spc, seed=seed)


def _assert_valid_reuse(p: Partition, labels: np.ndarray, n: int, spc: int, num_classes: int = C):
    """Invariant 12 (docs/algorithms.md, Invariants) for variant B: exactly ``spc`` valid indices per client;
    duplicates allowed."""
    assert p.num_clients == n
    assert np.all(p.sizes == spc)
    for i, ix in enumerate(p.client_indices):
        assert ix.dtype == np.int64 and ix.shape == (spc,)
        assert ix.min() >= 0 and ix.max() < len(labels)
        assert np.array_equal(p.label_hist[i], np.bincount(labels[ix], minlength=num_classes))
    assert p.label_hist.shape == (n, num_classes) and np.array_equal(p.sizes, p.label_hist.sum(1))


@pytest.mark.parametrize("alpha", [0.05, 0.6, 100.0])
@pytest.mark.parametrize("n,spc", [(20, 100), (100, 500), (3, 1)])
def test_fixed_size_reuse_exact_sizes(labels, alpha, n, spc):
    p = make_partition(_reuse(n, alpha, spc), labels, C)
    _assert_valid_reuse(p, labels, n, spc)


def test_fixed_size_reuse_duplicates_across_clients(labels):
    # 100 x 500 = 50,000 draws from 3,000 samples (FedBCGD's CIFAR setting on a small set): reuse is forced
    p = make_partition(_reuse(100, 0.6, 500), labels, C)
    _assert_valid_reuse(p, labels, 100, 500)
    held = _all_indices(p)
    assert len(held) == 50_000 and len(np.unique(held)) <= 3000
    stats = p.stats()
    assert stats["total"] == 50_000 and stats["distinct_samples"] == len(np.unique(held)) < stats["total"]
    owners = [{i for i, ix in enumerate(p.client_indices) if k in set(ix.tolist())} for k in held[:20].tolist()]
    assert max(len(o) for o in owners) > 1  # the same sample on several clients
    # few draws: no pool runs out, so no index is used twice and some are never used
    q = make_partition(_reuse(5, 0.6, 40), labels, C)
    assert len(np.unique(_all_indices(q))) == 200 and q.stats()["distinct_samples"] == 200


def test_fixed_size_reuse_exhausted_class_is_reshuffled_and_reused():
    """Demand above supply: class 0 has 7 samples but ~200 draws. Pools are consumed in whole passes, each
    pass a fresh permutation of the class, so usage counts of a class's indices differ by at most one and
    every full pass (in client order, then draw order) is a permutation of the class's indices."""
    y = np.concatenate([np.zeros(7, np.int64), np.ones(1000, np.int64)])
    y = np.random.default_rng(1).permutation(y)
    cfg = PartitionConfig(name="dirichlet", variant="fixed_size_reuse", num_clients=4, alpha=1e4,
                          samples_per_client=100)
    p = make_partition(cfg, y, 2)
    _assert_valid_reuse(p, y, 4, 100, num_classes=2)
    seq = _all_indices(p)
    class0 = np.flatnonzero(y == 0)
    drawn0 = seq[y[seq] == 0]
    assert len(drawn0) > 5 * len(class0)  # alpha = 1e4: about half of the 400 draws
    uses = np.array([(drawn0 == k).sum() for k in class0])
    assert uses.min() >= 5 and uses.max() - uses.min() <= 1
    passes = [drawn0[j:j + 7] for j in range(0, len(drawn0) - 6, 7)]
    assert all(np.array_equal(np.sort(ps), class0) for ps in passes)
    assert len({tuple(ps) for ps in passes}) > 1  # reshuffled, not replayed in the same order
    # class 1 (1000 samples, ~200 draws) never runs out: no index twice
    drawn1 = seq[y[seq] == 1]
    assert len(np.unique(drawn1)) == len(drawn1)


def test_fixed_size_reuse_matches_the_reference_steps(labels):
    """Variant B of docs/algorithms.md, Dirichlet label skew, written out step by step ([BC]
    ``data_from_dirichlet``, with the project's generator): pools shuffled once, priors in one call, per client
    its labels from q_i, next index of the class pool, reshuffle on exhaustion."""
    n, spc, alpha = 12, 400, 0.2
    rng = numpy_rng("partition", 0)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(C)]
    q = rng.dirichlet([alpha] * C, size=n)
    ptr = [0] * C
    expected = []
    for i in range(n):
        client = []
        for c in rng.choice(C, size=spc, p=q[i] / q[i].sum()):
            if ptr[c] >= len(pools[c]):
                pools[c] = rng.permutation(pools[c])
                ptr[c] = 0
            client.append(pools[c][ptr[c]])
            ptr[c] += 1
        expected.append(client)
    p = make_partition(_reuse(n, alpha, spc), labels, C)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(p.client_indices, expected))
    assert (p.label_hist.sum(0) > np.bincount(labels, minlength=C)).any()  # some pool was reshuffled


def test_fixed_size_reuse_deterministic_in_seed(labels):
    a, b = make_partition(_reuse(), labels, C), make_partition(_reuse(), labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    c = make_partition(_reuse(seed=1), labels, C)
    assert any(not np.array_equal(x, y) for x, y in zip(a.client_indices, c.client_indices))
    # other fields of the config do not matter for this variant
    d = make_partition(replace(_reuse(), min_size=3, classes_per_client=7, shards_variant="mcmahan_sort_shard"),
                       labels, C)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, d.client_indices))


@pytest.mark.parametrize("seed", [0, 1])
def test_fixed_size_reuse_alpha_controls_skew(labels, seed):
    """Labels are drawn from q_i ~ Dir(alpha 1_C), whatever the class sizes: alpha large -> about uniform over
    the classes (not the global label mix); alpha small -> a few classes per client."""
    big = make_partition(_reuse(10, 1e4, 2000, seed), labels, C)
    small = make_partition(_reuse(10, 0.05, 2000, seed), labels, C)
    share_big = big.label_hist / 2000
    tv_big = 0.5 * np.abs(share_big - 1 / C).sum(1)  # multinomial noise alone: ~0.03
    assert tv_big.mean() < 0.05 and tv_big.max() < 0.08
    assert np.all((big.label_hist > 0).sum(1) == C)
    tv_small = 0.5 * np.abs(small.label_hist / 2000 - 1 / C).sum(1)
    assert tv_small.mean() > 0.5
    assert (small.label_hist > 0).sum(1).mean() < 5


def test_fixed_size_reuse_empty_class_never_drawn():
    y = np.random.default_rng(2).integers(0, 9, 900)  # class 9 of 10 has no samples
    for alpha in (0.01, 1.0):
        p = make_partition(_reuse(30, alpha, 50), y, 10)
        _assert_valid_reuse(p, y, 30, 50, num_classes=10)
        assert p.label_hist[:, 9].sum() == 0
    # a prior with all its mass on the empty class: drawn uniformly among the non-empty classes
    y1 = np.repeat([0, 1], 50)
    p = make_partition(_reuse(40, 1e-3, 60), y1, 3)  # tiny alpha: most priors are one-hot
    _assert_valid_reuse(p, y1, 40, 60, num_classes=3)
    assert p.label_hist[:, 2].sum() == 0


def test_fixed_size_reuse_errors(labels):
    with pytest.raises(PartitionError, match=r"^partition\.samples_per_client must be >= 1, got 0$"):
        make_partition(_reuse(spc=0), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.size_sigma.*iid and dirichlet/per_client only"):
        make_partition(replace(_reuse(), size_sigma=0.3), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.alpha must be > 0"):
        make_partition(_reuse(alpha=0.0), labels, C)
    with pytest.raises(PartitionError, match=r"^partition\.variant must be one of per_client, per_class, "
                                             r"fixed_size_reuse, got 'fedbcgd'$"):
        make_partition(replace(_reuse(), variant="fedbcgd"), labels, C)


def test_partition_key_fixed_size_reuse():
    base = _reuse(100, 0.6, 500)
    assert partition_key(base, "cifar100") == "cifar100-dirichlet-fixed_size_reuse-a0.6-n100-spc500-s0"
    keys = {
        partition_key(base, "cifar100"),
        partition_key(replace(base, samples_per_client=1000), "cifar100"),
        partition_key(replace(base, alpha=0.1), "cifar100"),
        partition_key(replace(base, num_clients=50), "cifar100"),
        partition_key(replace(base, seed=1), "cifar100"),
        partition_key(replace(base, variant="per_client"), "cifar100"),
        partition_key(replace(base, variant="per_class"), "cifar100"),
    }
    assert len(keys) == 7
    for k in keys:
        assert re.fullmatch(r"[A-Za-z0-9._+-]+", k)
    # fields this variant does not use leave the key alone; samples_per_client leaves the others' keys alone
    assert partition_key(base, "d") == partition_key(replace(base, min_size=3, size_sigma=0.0, classes_per_client=9),
                                                     "d")
    a = PartitionConfig(name="dirichlet", variant="per_client")
    assert partition_key(a, "d") == partition_key(replace(a, samples_per_client=7), "d")


def test_fixed_size_reuse_save_load_plot_and_cache(tmp_path, labels, monkeypatch):
    cfg = _reuse(30, 0.3, 200)
    p = get_partition(cfg, "toy", labels, C, tmp_path)
    folder = tmp_path / "partitions" / partition_key(cfg, "toy")
    assert (folder / "labels_per_client.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["config"]["samples_per_client"] == 200 and stats["config"]["variant"] == "fixed_size_reuse"
    assert stats["total"] == 6000 > stats["distinct_samples"] and stats["sizes"] == [200] * 30
    q = Partition.load(folder)  # duplicates survive the concatenated npz layout
    assert all(np.array_equal(x, y) for x, y in zip(p.client_indices, q.client_indices))
    assert np.array_equal(p.label_hist, q.label_hist)

    def boom(*a, **k):
        raise AssertionError("make_partition called although the partition is cached")

    monkeypatch.setattr(part_mod, "make_partition", boom)
    r = get_partition(cfg, "toy", labels, C, tmp_path)
    assert all(np.array_equal(x, y) for x, y in zip(p.client_indices, r.client_indices))
    monkeypatch.undo()
    # another samples_per_client is another folder, not the cached one
    s = get_partition(replace(cfg, samples_per_client=150), "toy", labels, C, tmp_path)
    assert np.all(s.sizes == 150) and len(list((tmp_path / "partitions").iterdir())) == 2


@pytest.mark.parametrize("variant", ["per_client", "per_class", "fixed_size_reuse"])
@pytest.mark.parametrize("alpha", [math.inf, math.nan])
def test_dirichlet_refuses_a_non_finite_alpha(labels, variant, alpha):
    """Dir(inf) would give NaN priors: refused like in the config validation, pointing at partition=iid."""
    cfg = PartitionConfig(name="dirichlet", variant=variant, alpha=alpha, num_clients=10, samples_per_client=50)
    with pytest.raises(PartitionError) as err:
        make_partition(cfg, labels, C)
    assert str(err.value) == (f"partition.alpha must be a finite number > 0, got {alpha} "
                              f"(use partition=iid for an IID split)")
    with pytest.raises(PartitionError, match=r"^partition\.alpha must be > 0, got -inf$"):
        make_partition(replace(cfg, alpha=-math.inf), labels, C)
    assert make_partition(PartitionConfig(name="iid", alpha=alpha, num_clients=10), labels, C).num_clients == 10


def test_partition_files_are_the_same_bytes_on_every_python():
    """partition.npz is written with every zip field fixed (fl_core.data.partition.write_npz): np.savez's bytes
    differed between Python 3.11.2 and 3.11.7 (zip64 placeholders), and so did data/partitions' hash in dvc.lock.
    The md5 below was measured on both versions; np.load reads the file back."""
    import hashlib
    import io

    from fl_core.data.partition import write_npz

    buf = io.BytesIO()
    write_npz(buf, indices=np.arange(100, dtype=np.int64), num_classes=np.int64(10))
    assert hashlib.md5(buf.getvalue()).hexdigest() == "e30940ba17cabcaf628bc36d55172b7c"
    with np.load(io.BytesIO(buf.getvalue())) as z:
        assert z["indices"].tolist() == list(range(100)) and int(z["num_classes"]) == 10
