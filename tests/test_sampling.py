"""Client samplers of fl_core.data.sampling (docs/algorithms.md, Client sampling; Invariants 13)."""

import numpy as np
import pytest

from fl_core.config import ConfigError
from fl_core.data.sampling import expected_bernoulli_size, fixed_sample_size, sample_clients


def test_expected_bernoulli_size_formula():
    # docs/algorithms.md, Client sampling: N=100, p=0.01 -> about 1.58 given non-empty; p=0.1 -> about 10.
    assert expected_bernoulli_size(100, 0.01) == pytest.approx(1.5774, abs=1e-3)
    assert expected_bernoulli_size(100, 0.1) == pytest.approx(10.0, abs=1e-3)
    assert expected_bernoulli_size(7, 1.0) == 7.0


def test_bernoulli_never_empty_and_mean_matches():
    n, p, rounds = 100, 0.01, 500
    sizes = []
    for r in range(rounds):
        s = sample_clients(n, p, "bernoulli", seed=3, round_idx=r)
        assert s.dtype == np.int64 and s.size >= 1
        assert np.all(np.diff(s) > 0) and s.min() >= 0 and s.max() < n
        sizes.append(s.size)
    # a plain Bernoulli draw is empty w.p. 0.366, so about 180 of 500 rounds needed a redraw
    assert np.mean(sizes) == pytest.approx(expected_bernoulli_size(n, p), abs=0.15)


def test_bernoulli_mean_moderate_participation():
    n, p = 50, 0.2
    sizes = [sample_clients(n, p, "bernoulli", seed=0, round_idx=r).size for r in range(400)]
    assert np.mean(sizes) == pytest.approx(expected_bernoulli_size(n, p), rel=0.05)
    assert len(set(sizes)) > 3  # realised size varies


def test_bernoulli_full_participation_is_everyone():
    assert np.array_equal(sample_clients(9, 1.0, "bernoulli", 0, 5), np.arange(9))


@pytest.mark.parametrize("n,p,m", [(20, 0.4, 8), (100, 0.1, 10), (10, 0.01, 1), (7, 1.0, 7), (30, 0.1, 3)])
def test_fixed_returns_exactly_m_distinct(n, p, m):
    assert fixed_sample_size(n, p) == m
    for r in range(20):
        s = sample_clients(n, p, "fixed", seed=1, round_idx=r)
        assert s.dtype == np.int64 and len(s) == m and len(np.unique(s)) == m
        assert np.all(np.diff(s) > 0) and 0 <= s.min() and s.max() < n


def test_fixed_covers_all_clients_uniformly():
    counts = np.zeros(20)
    for r in range(500):
        counts[sample_clients(20, 0.25, "fixed", seed=0, round_idx=r)] += 1
    assert counts.sum() == 500 * 5
    assert counts.min() > 90 and counts.max() < 160  # expected 125 each


@pytest.mark.parametrize("sampler", ["bernoulli", "fixed"])
def test_deterministic_per_seed_and_round(sampler):
    a = [sample_clients(40, 0.3, sampler, seed=7, round_idx=r) for r in range(10)]
    b = [sample_clients(40, 0.3, sampler, seed=7, round_idx=r) for r in range(10)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # rounds differ from each other, and another seed gives other draws
    assert any(not np.array_equal(a[0], x) for x in a[1:])
    c = [sample_clients(40, 0.3, sampler, seed=8, round_idx=r) for r in range(10)]
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))
    # order of calls does not matter (no hidden state)
    assert np.array_equal(sample_clients(40, 0.3, sampler, seed=7, round_idx=4), a[4])


def test_bad_arguments_name_the_key():
    with pytest.raises(ConfigError, match="train.sampler"):
        sample_clients(10, 0.5, "poisson", 0, 0)
    with pytest.raises(ConfigError, match="train.participation"):
        sample_clients(10, 0.0, "fixed", 0, 0)
    with pytest.raises(ConfigError, match="train.participation"):
        sample_clients(10, 1.5, "bernoulli", 0, 0)
