"""Drift measures (fl_core/engine/diagnostics.py, update_drift; docs/algorithms.md, Drift measures): a case worked
by hand, the measures' invariants, the rounds they are computed in, their MLflow names, and both executors giving
the same values."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.engine.diagnostics import update_drift
from fl_core.params import ParamSpec
from fl_core.store.tracking import is_detail, mlflow_metric_name

from conftest import run_sim


def _spec():
    """Two layers: ``a`` (weight [2] and bias [1]) and ``b`` (weight [1]); d = 4."""
    model = torch.nn.Module()
    model.a = torch.nn.Module()
    model.a.weight = torch.nn.Parameter(torch.zeros(2))
    model.a.bias = torch.nn.Parameter(torch.zeros(1))
    model.b = torch.nn.Module()
    model.b.weight = torch.nn.Parameter(torch.zeros(1))
    return ParamSpec.from_model(model)


def test_hand_case():
    spec = _spec()
    assert spec.d == 4
    theta = torch.tensor([3.0, 0.0, 4.0, 0.0])  # ||theta|| = 5
    d1 = torch.tensor([1.0, 0.0, 0.0, 1.0])  # ||d1|| = sqrt(2)
    d2 = torch.tensor([0.0, 2.0, 0.0, 1.0])  # ||d2|| = sqrt(5)
    # n = (1, 3): p = (1/4, 3/4); mean = (1/4, 3/2, 0, 1), ||mean||^2 = 1/16 + 9/4 + 1 = 53/16
    out = update_drift([d1, d2], theta, [1, 3], [2, 4], 0.5, spec)
    mean = torch.tensor([0.25, 1.5, 0.0, 1.0], dtype=torch.float64)
    msq = 53 / 16
    assert out["drift_client_mean"] == pytest.approx((math.sqrt(2) + math.sqrt(5)) / 2 / 5, rel=1e-12)
    assert out["drift_client_max"] == pytest.approx(math.sqrt(5) / 5, rel=1e-12)
    e1 = float(((d1.double() - mean) ** 2).sum())  # 9/16 + 9/4 = 45/16
    e2 = float(((d2.double() - mean) ** 2).sum())  # 1/16 + 1/4 = 5/16
    assert (e1, e2) == (45 / 16, 5 / 16)
    assert out["drift_dissimilarity"] == pytest.approx((0.25 * e1 + 0.75 * e2) / msq, rel=1e-12)  # 60/212
    c1 = float(d1.double() @ mean) / (math.sqrt(2) * math.sqrt(msq))  # (1/4 + 1) / ...
    c2 = float(d2.double() @ mean) / (math.sqrt(5) * math.sqrt(msq))  # (3 + 1) / ...
    assert out["drift_cosine"] == pytest.approx((c1 + c2) / 2, rel=1e-12)
    # layer a: d1^a = (1, 0, 0), d2^a = (0, 2, 0), mean^a = (1/4, 3/2, 0): cos 1 / ..., 3 / ...
    ma = math.sqrt(0.25 ** 2 + 1.5 ** 2)
    assert out["drift_cos_a"] == pytest.approx((0.25 / ma + 3.0 / (2 * ma)) / 2, rel=1e-12)
    assert out["drift_cos_b"] == pytest.approx(1.0, rel=1e-12)  # both moved layer b by +1
    # progress: ||d_i|| / (K_i * eta_l) = sqrt(2) / 1 and sqrt(5) / 2
    assert out["drift_progress"] == pytest.approx((math.sqrt(2) + math.sqrt(5) / 2) / 2, rel=1e-12)


def test_equal_updates_have_no_dissimilarity():
    spec = _spec()
    d = torch.tensor([0.5, -1.0, 2.0, 0.25])
    out = update_drift([d, d.clone(), d.clone()], torch.ones(4), [5, 7, 9], [3, 3, 3], 0.1, spec)  # exact in float32
    assert out["drift_dissimilarity"] == pytest.approx(0.0, abs=1e-15)
    assert out["drift_cosine"] == pytest.approx(1.0, rel=1e-12)
    assert out["drift_cos_a"] == pytest.approx(1.0, rel=1e-12) and out["drift_cos_b"] == pytest.approx(1.0)
    assert out["drift_client_mean"] == out["drift_client_max"] == pytest.approx(float(d.norm()) / 2, rel=1e-6)


def test_opposite_updates_and_zero_cases():
    spec = _spec()
    d = torch.tensor([1.0, 2.0, 0.0, 0.0])
    # equal weights, opposite updates: the mean is 0, so no dissimilarity and no cosine; layer b moved by nobody
    out = update_drift([d, -d], torch.zeros(4), [2, 2], [0, 3], 0.0, spec)
    assert not {"drift_dissimilarity", "drift_cosine", "drift_cos_a", "drift_cos_b"} & set(out)
    assert "drift_client_mean" not in out  # theta = 0: no relative drift
    assert "drift_progress" not in out  # eta_l = 0
    # a client with a zero update is left out of the cosine (not counted as 0), kept in the dissimilarity
    z = torch.zeros(4)
    out = update_drift([d, z], torch.ones(4), [1, 1], [1, 0], 1.0, spec)
    assert out["drift_cosine"] == pytest.approx(1.0, rel=1e-12)  # d against d/2
    assert out["drift_dissimilarity"] == pytest.approx(1.0, rel=1e-12)  # (||d/2||^2 + ||d/2||^2) / 2 / ||d/2||^2
    assert out["drift_progress"] == pytest.approx(float(d.norm()), rel=1e-6)  # the client with K = 0 is left out
    with pytest.raises(ValueError, match=r"update_drift needs S updates \[4\]"):
        update_drift([torch.zeros(3)], torch.zeros(4), [1], [1], 1.0, spec)


def test_mlflow_names():
    assert mlflow_metric_name("drift_cosine") == "drift/cosine"
    assert mlflow_metric_name("drift_client_max") == "drift/client_max"
    assert mlflow_metric_name("drift_dissimilarity") == "drift/dissimilarity"
    assert is_detail("drift_cos_conv1") and not is_detail("drift_cosine")
    assert mlflow_metric_name("drift_cos_conv1") == "detail/drift_cos_conv1"


KEYS = {"drift_client_mean", "drift_client_max", "drift_dissimilarity", "drift_cosine", "drift_progress"}


def test_default_run_logs_drift_every_5_rounds_and_the_last(digits):
    _, res = run_sim(digits, "partition=dirichlet", "partition.alpha=0.1", "train.rounds=11")
    assert [r["round"] for r in res.history if "drift_cosine" in r] == [5, 10, 11]
    _, res = run_sim(digits, "partition=dirichlet", "partition.alpha=0.1", "tracking.drift=1")
    for row in res.history:
        assert KEYS <= set(row)
        assert {k for k in row if k.startswith("drift_cos_")} == {f"drift_cos_{m}" for m in
                                                                  ("conv1", "conv2", "fc1", "fc2")}  # the CNN's layers
        assert 0 <= row["drift_client_mean"] <= row["drift_client_max"]
        assert -1 <= row["drift_cosine"] <= 1 and row["drift_dissimilarity"] >= 0


def test_drift_every_k_rounds_and_off(digits):
    _, res = run_sim(digits, "tracking.drift=2", "train.rounds=5")
    assert [r["round"] for r in res.history if "drift_cosine" in r] == [2, 4, 5]  # every 2nd and the last
    _, res = run_sim(digits, "tracking.drift=0")
    assert not any(k.startswith("drift_") for r in res.history for k in r)


def test_iid_drifts_less_than_dirichlet(digits):
    """Label skew makes the clients' updates disagree: lower cosine to the mean, higher dissimilarity."""
    _, iid = run_sim(digits, "partition=iid", "train.participation=1", "tracking.drift=1")
    _, skew = run_sim(digits, "partition=dirichlet", "partition.alpha=0.05", "train.participation=1", "tracking.drift=1")
    first = lambda res, k: res.history[0][k]  # noqa: E731 (round 1: same initial model)
    assert first(iid, "drift_cosine") > first(skew, "drift_cosine")
    assert first(iid, "drift_dissimilarity") < first(skew, "drift_dissimilarity")


def test_executors_give_the_same_drift(digits):
    ov = ("engine.dtype=float64", "partition=dirichlet", "partition.alpha=0.3", "tracking.drift=1")
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    for a, b in zip(seq.history, vec.history):
        keys = [k for k in a if k.startswith("drift_")]
        assert keys and keys == [k for k in b if k.startswith("drift_")]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-9), k


def test_large_models_take_the_same_values_tensor_by_tensor(monkeypatch):
    """Above STACK_LIMIT entries the updates are stacked per parameter tensor, not once: the same numbers."""
    import fl_core.engine.diagnostics as diag

    spec = _spec()
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(5)]
    args = (deltas, torch.randn(4, generator=g, dtype=torch.float64), [3, 1, 4, 1, 5], [2, 2, 3, 1, 2], 0.3, spec)
    once = update_drift(*args)
    monkeypatch.setattr(diag, "STACK_LIMIT", 0)
    assert update_drift(*args) == pytest.approx(once, rel=1e-14) and len(once) == 7


def test_claims_and_report_read_the_drift_columns(tmp_path):
    """A claim may name a drift measure; the report's curves hold each measure's seed mean at the rounds that have it."""
    from pipeline.claims import known_metric
    from pipeline.results import read_curves

    assert known_metric("drift_dissimilarity") and known_metric("drift_cosine") and known_metric("drift_cos_conv1")
    assert not known_metric("drift_bogus")
    runs = tmp_path / "runs.csv"
    runs.write_text("seed,round,test_acc,train_loss,drift_dissimilarity,drift_cosine\n"
                    "1,1,0.5,2.0,,\n1,2,0.6,1.5,2.0,0.5\n2,1,0.4,2.1,,\n2,2,0.7,1.4,4.0,0.7\n")
    c = read_curves(runs)
    assert list(c["drift_dissimilarity_round"]) == [2.0] and list(c["drift_dissimilarity_mean"]) == [3.0]
    assert list(c["drift_cosine_mean"]) == pytest.approx([0.6])
