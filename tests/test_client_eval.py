"""Per-client evaluation: the global model's accuracy on each client's label distribution (the test set
reweighted by the client's label histogram, as FLGo / PFLlib report), summarised as ``client_acc_mean``,
``client_acc_std`` (ddof = 1) and ``client_acc_worst10`` (docs/algorithms.md, Rounds, learning rate and
evaluation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fl_core.engine.simulator import Simulator, client_acc_summary, client_accuracy, evaluate
from fl_core.metrics import SUMMARY_KEYS, summarize_run, summarize_seeds

from conftest import run_sim

KEYS = ("client_acc_mean", "client_acc_std", "client_acc_worst10")


def _controlled(labels, preds, num_classes=3):
    """Inputs whose identity 'model' predicts ``preds``: x = one-hot logits [M, C], y = ``labels`` [M]."""
    y = torch.tensor(labels)
    x = F.one_hot(torch.tensor(preds), num_classes).float()
    return x, y


# test set: class 0: 4 samples, 3 right (0.75); class 1: 2 samples, 1 right (0.5); class 2: 4 samples, 0 right
LABELS = [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
PREDS = [0, 0, 0, 1, 1, 0, 0, 1, 0, 1]
HIST = [[2, 0, 0],   # a = 0.75
        [1, 1, 0],   # a = (0.75 + 0.5) / 2 = 0.625
        [0, 1, 3]]   # a = (0.5 + 3 * 0) / 4 = 0.125


def test_hand_computed_case():
    x, y = _controlled(LABELS, PREDS)
    ev = evaluate(torch.nn.Identity(), x, y, batch_size=3, client_label_counts=torch.tensor(HIST))  # 4 batches
    assert ev["test_acc"] == 0.4
    a = client_accuracy([3, 1, 0], [4, 2, 4], HIST)
    assert a.tolist() == [0.75, 0.625, 0.125]
    assert ev["client_acc_mean"] == 0.5
    # sample std (ddof = 1): deviations 0.25, 0.125, -0.375 -> (0.0625 + 0.015625 + 0.140625) / 2
    assert ev["client_acc_std"] == pytest.approx(math.sqrt(0.109375), abs=1e-15)
    assert ev["client_acc_worst10"] == 0.125  # ceil(0.1 * 3) = 1 client: the lowest
    assert ev["client_acc_worst10"] <= ev["client_acc_mean"]


def test_without_client_counts_evaluate_is_unchanged():
    x, y = _controlled(LABELS, PREDS)
    assert evaluate(torch.nn.Identity(), x, y, batch_size=4) == {"test_acc": 0.4,
                                                                "test_loss": pytest.approx(
                                                                    F.cross_entropy(x, y).item(), abs=1e-6)}


def test_iid_client_gets_exactly_test_acc():
    torch.manual_seed(0)
    x, y = torch.randn(500, 6), torch.randint(0, 10, (500,))
    model = torch.nn.Linear(6, 10)
    test_hist = torch.bincount(y, minlength=10)
    counts = torch.stack([3 * test_hist, test_hist, torch.randint(0, 50, (10,))])
    ev = evaluate(model, x, y, 64, client_label_counts=counts)
    with torch.no_grad():
        pred = model(x).argmax(1)
    correct = torch.bincount(y[pred == y], minlength=10)
    a = client_accuracy(correct, test_hist, counts)
    assert a[0].item() == pytest.approx(ev["test_acc"], abs=1e-12)
    assert a[1].item() == pytest.approx(ev["test_acc"], abs=1e-12)
    assert 0.0 <= ev["client_acc_worst10"] <= ev["client_acc_mean"] <= 1.0


def test_class_absent_from_the_test_set_is_dropped_and_renormalised():
    a = client_accuracy([3, 1, 0], [4, 2, 0], [[1, 1, 5], [0, 0, 2], [2, 0, 0]])
    assert a[0].item() == 0.625  # class 2 dropped: (0.75 + 0.5) / 2
    assert math.isnan(a[1].item())  # nothing left to weigh: left out of the summary
    assert a[2].item() == 0.75
    s = client_acc_summary(a)
    assert s["client_acc_mean"] == pytest.approx(0.6875, abs=1e-15) and s["client_acc_worst10"] == 0.625
    assert client_acc_summary(torch.tensor([float("nan")])) == {}


def test_summary_worst10_takes_ceil_of_a_tenth_and_single_client_std_is_zero():
    n30 = client_acc_summary(torch.arange(30, dtype=torch.float64) / 30)  # 0.1 * 30 > 3 in floats
    assert n30["client_acc_worst10"] == pytest.approx(1 / 30, abs=1e-15)  # mean of 0, 1/30, 2/30
    n11 = client_acc_summary(torch.arange(11, dtype=torch.float64))
    assert n11["client_acc_worst10"] == 0.5  # ceil(1.1) = 2: mean of 0 and 1
    assert n11["client_acc_std"] == pytest.approx(float(np.std(np.arange(11), ddof=1)), abs=1e-12)
    assert client_acc_summary(torch.tensor([0.3])) == {"client_acc_mean": pytest.approx(0.3), "client_acc_std": 0.0,
                                                       "client_acc_worst10": pytest.approx(0.3)}


def test_simulator_rejects_counts_of_the_wrong_shape():
    with pytest.raises(ValueError, match="client_label_counts"):
        Simulator(model=torch.nn.Linear(2, 3), algorithm=None, executor=None, x_test=None, y_test=None,
                  num_clients=4, participation=1.0, sampler="uniform", rounds=1, lr=0.1,
                  client_label_counts=torch.ones(3, 3))


def test_summarize_run_takes_the_last_evaluation_and_the_post_values():
    base = {"train_loss": 1.0, "comm_up_floats": 1.0, "comm_down_floats": 1.0}
    hist = [{"round": 1, **base, "test_acc": 0.5, "test_loss": 1.0, "client_acc_mean": 0.4, "client_acc_std": 0.1,
             "client_acc_worst10": 0.2},
            {"round": 2, **base, "test_acc": 0.6, "test_loss": 0.9, "client_acc_mean": 0.55, "client_acc_std": 0.05,
             "client_acc_worst10": 0.3},
            {"round": 3, **base}]
    s = summarize_run(hist, 0.9)
    assert (s["final_client_acc_mean"], s["final_client_acc_std"], s["final_client_acc_worst10"]) == (0.55, 0.05, 0.3)
    post = [*hist[:2], {**hist[2], "post_test_acc": 0.7, "post_test_loss": 0.8, "post_client_acc_mean": 0.65,
                        "post_client_acc_std": 0.02, "post_client_acc_worst10": 0.6}]
    s = summarize_run(post, 0.9)
    assert (s["final_client_acc_mean"], s["final_client_acc_std"], s["final_client_acc_worst10"]) == (0.65, 0.02, 0.6)
    bare = [{k: v for k, v in r.items() if not k.startswith(("client_", "post_client_"))} for r in post]
    s = summarize_run(bare, 0.9)
    assert s["final_client_acc_mean"] is None and s["final_acc"] == 0.7
    assert {"final_client_acc_mean", "final_client_acc_worst10"} <= set(SUMMARY_KEYS)
    # a seed summary written before these keys existed still aggregates (its values count as missing)
    seeds = summarize_seeds({0: summarize_run(hist, 0.9), 1: {k: v for k, v in summarize_run(hist, 0.9).items()
                                                              if "client" not in k}})
    assert seeds["final_client_acc_mean_mean"] == 0.55 and seeds["final_client_acc_worst10_std"] == 0.0


def test_end_to_end_rows_and_summary(digits):
    sim, res = run_sim(digits, "partition=dirichlet", "partition.alpha=0.3", "train.eval_every=2")
    rows = res.history
    assert [r["round"] for r in rows if "test_acc" in r] == [2, 3]
    for r in rows:
        assert all(k in r for k in KEYS) == ("test_acc" in r)
    for r in rows[1:]:
        assert all(0.0 <= r[k] <= 1.0 for k in KEYS)
        assert r["client_acc_worst10"] <= r["client_acc_mean"]
    # recomputed from the final model and the partition's label histogram, independently of the engine
    from fl_core.data import make_partition
    from conftest import tiny_cfg

    cfg = tiny_cfg("partition=dirichlet", "partition.alpha=0.3")
    hist = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes).label_hist
    assert np.array_equal(sim.client_label_counts.numpy(), hist)
    with torch.no_grad():
        pred = sim.model(sim.x_test).argmax(1).cpu().numpy()
    y = sim.y_test.cpu().numpy()
    acc_c = np.array([(pred[y == c] == c).mean() for c in range(digits.num_classes)])
    a = (hist / hist.sum(1, keepdims=True)) @ acc_c
    last = rows[-1]
    assert last["client_acc_mean"] == pytest.approx(a.mean(), abs=1e-12)
    assert last["client_acc_std"] == pytest.approx(a.std(ddof=1), abs=1e-12)
    assert last["client_acc_worst10"] == pytest.approx(np.sort(a)[:1].mean(), abs=1e-12)  # ceil(0.6) = 1
    s = summarize_run(rows, 0.9)
    assert (s["final_client_acc_mean"], s["final_client_acc_std"], s["final_client_acc_worst10"]) == \
        tuple(last[k] for k in KEYS)


def test_ccvr_post_step_reports_the_calibrated_models_client_accuracy(digits):
    _, res = run_sim(digits, "partition=dirichlet", "partition.alpha=0.3", "model=mlp", "algorithm=ccvr",
                     "algorithm.ccvr.epochs=2")
    last = res.history[-1]
    assert all(f"post_{k}" in last for k in KEYS)
    assert last["post_client_acc_worst10"] <= last["post_client_acc_mean"]
    s = summarize_run(res.history, 0.9)
    assert s["final_client_acc_mean"] == last["post_client_acc_mean"]
    assert s["final_client_acc_worst10"] == last["post_client_acc_worst10"]


def test_vectorized_and_sequential_give_the_same_client_metrics(digits):
    ov = ["partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "partition.min_size=5",
          "train.sampler=bernoulli", "train.rounds=3", "model=mlp", "engine.dtype=float64"]
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    for a, b in zip(seq.history, vec.history):
        assert [a[k] for k in KEYS] == pytest.approx([b[k] for k in KEYS], abs=1e-12)


class _Killed(Exception):
    pass


def test_resumed_run_reproduces_the_client_metrics(digits, tmp_path):
    common = ["partition=dirichlet", "partition.alpha=0.3", "model=mlp", "train.rounds=4", "engine.checkpoint_every=2"]
    _, ref = run_sim(digits, *common)

    def kill(r, row):
        if r == 3:
            raise _Killed

    with pytest.raises(_Killed):
        run_sim(digits, *common, checkpoint_path=tmp_path / "ck.pt", callbacks=[kill])
    _, res = run_sim(digits, *common, checkpoint_path=tmp_path / "ck.pt")
    assert res.resumed_from == 2
    drop = ("round_time_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in res.history] == \
        [{k: v for k, v in r.items() if k not in drop} for r in ref.history]
