"""The IID -> non-IID study's baselines and measurements (docs/algorithms.md, Centralised training and
LocalSGD; The IID-to-non-IID study).

- layer-wise update cosine similarity on hand-made updates (pair means computed by hand) and against a
  brute-force loop; the effective update amount u on the paper's numbers;
- centralized training (K = 1) is plain SGD over the whole data; LocalSGD with one local step is
  parallel SGD (both written out by hand here, with the batch order of ``batch_schedule``);
- ``train.local_steps``: exactly K batches (epochs continued and the last one cut short), the same in
  both executors, ``ClientContext.num_steps`` / ``ClientUpdate.num_steps`` = K;
- ``tracking.layer_cosine`` / ``tracking.client_loss_trace`` rows present when on, absent when off.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from fl_core.engine.diagnostics import client_loss_trace, effective_update, layer_cosine, layer_groups
from fl_core.engine.executors import batch_schedule, client_steps, local_steps
from fl_core.engine.state import ParamSpec, load_flat
from fl_core.seeding import torch_generator

from conftest import run_sim

# two layers: "a" = a.weight [2] + a.bias [1] (one layer, bias included), "b" = b.weight [2]
SPEC = ParamSpec(names=("a.weight", "a.bias", "b.weight"), shapes=((2,), (1,), (2,)), numels=(2, 1, 2),
                 offsets=(0, 2, 3), unit_of=(0, 0, 1), num_units=2)


def _deltas(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- cosine
def test_layer_groups_put_weight_and_bias_of_a_module_together():
    assert layer_groups(SPEC) == {"a": [0, 1], "b": [2]}
    spec = ParamSpec(("layer1.0.conv1.weight", "layer1.0.conv1.bias", "w"), ((1,), (1,), (1,)), (1, 1, 1),
                     (0, 1, 2), (0, 0, 0), 1)
    assert list(layer_groups(spec)) == ["layer1.0.conv1", "w"]


def test_layer_cosine_by_hand():
    # layer a: c0 = (1, 0 | 0), c1 = (0, 0 | 1) (only the bias), c2 = (1, 0 | 1)
    #   cos01 = 0, cos02 = 1/sqrt2, cos12 = 1/sqrt2  ->  mean sqrt2/3
    # layer b: c0 = (1, 2), c1 = (-2, -4), c2 = (2, -1)
    #   cos01 = -1, cos02 = 0, cos12 = 0  ->  mean -1/3
    d = _deltas([[1, 0, 0, 1, 2],
                 [0, 0, 1, -2, -4],
                 [1, 0, 1, 2, -1]])
    out = layer_cosine(d, SPEC)
    assert set(out) == {"cos_a", "cos_b", "cos_mean"}
    assert out["cos_a"] == pytest.approx(math.sqrt(2) / 3, abs=1e-12)
    assert out["cos_b"] == pytest.approx(-1 / 3, abs=1e-12)
    assert out["cos_mean"] == pytest.approx((math.sqrt(2) / 3 - 1 / 3) / 2, abs=1e-12)


def test_layer_cosine_identical_opposite_and_too_few_clients():
    x = _deltas([[0.3, -1.2, 0.5, 2.0, 1e-3]])
    same = layer_cosine(x.repeat(4, 1), SPEC)
    assert all(v == pytest.approx(1.0, abs=1e-12) for v in same.values())
    opp = layer_cosine(torch.cat([x, -x]), SPEC)
    assert opp == pytest.approx({"cos_a": -1.0, "cos_b": -1.0, "cos_mean": -1.0}, abs=1e-12)
    scaled = layer_cosine(torch.cat([x, 1e-3 * x, 7 * x]), SPEC)  # scale-free
    assert scaled["cos_mean"] == pytest.approx(1.0, abs=1e-12)
    assert layer_cosine(x, SPEC) == {}  # one client: no pair
    with pytest.raises(ValueError, match="S, 5"):
        layer_cosine(torch.zeros(2, 4), SPEC)


def test_layer_cosine_skips_pairs_with_a_zero_norm_client():
    # client 2 did not move layer b (FedBCGD outside its block, FedBug frozen): only pair (0, 1) counts there;
    # on layer a it moved and all three pairs count
    d = _deltas([[1, 0, 0, 1, 2],
                 [0, 0, 1, -2, -4],
                 [1, 0, 1, 0, 0]])
    out = layer_cosine(d, SPEC)
    assert out["cos_b"] == pytest.approx(-1.0, abs=1e-12)
    assert out["cos_a"] == pytest.approx(math.sqrt(2) / 3, abs=1e-12)
    # nobody but client 0 moved layer a: no pair left, no key; cos_mean is over the layers that have one
    d[1:, :3] = 0
    out = layer_cosine(d, SPEC)
    assert "cos_a" not in out and out["cos_mean"] == out["cos_b"] == pytest.approx(-1.0, abs=1e-12)
    assert layer_cosine(torch.zeros(3, 5), SPEC) == {}


def test_layer_cosine_matches_a_loop_over_pairs_on_a_real_model(digits):
    sim, _ = run_sim(digits, "train.rounds=1")
    g = torch.Generator().manual_seed(0)
    S = 5
    deltas = torch.randn(S, sim.spec.d, generator=g)
    deltas[3, :sim.spec.numels[0] + sim.spec.numels[1]] = 0  # client 3 left the first layer untouched
    out = layer_cosine(deltas, sim.spec)
    views = sim.spec.views(deltas)
    for layer, members in layer_groups(sim.spec).items():
        x = torch.cat([views[sim.spec.names[j]].reshape(S, -1) for j in members], 1).double()
        cos = [F.cosine_similarity(x[i], x[j], dim=0).item() for i, j in itertools.combinations(range(S), 2)
               if x[i].norm() > 0 and x[j].norm() > 0]
        assert out[f"cos_{layer}"] == pytest.approx(sum(cos) / len(cos), abs=1e-9)
    assert set(out) == {f"cos_{n}" for n in layer_groups(sim.spec)} | {"cos_mean"}


# ------------------------------------------------------------------------------------------- u and K_i
def test_effective_update_on_the_study_numbers():
    assert effective_update(0.005, 1, 50000, 50, 10) == pytest.approx(0.5)  # FL base (K = 10, B = 50)
    assert effective_update(0.005, 1, 50000, 500, 1) == pytest.approx(0.5)  # centralized (B = 500)
    assert effective_update(0.25, 1, 50000, 500, 50) == pytest.approx(0.5)  # the excluded "eta = 0.25" case
    assert effective_update(0.1, 3, 1200, 20, 6) == pytest.approx(0.1 * 3 * 10)  # 30 steps of 0.1
    assert effective_update(0.1, 3, 1200, 20, 6, local_steps=7) == pytest.approx(0.7)  # K_l steps of eta
    with pytest.raises(ValueError, match="train.batch_size"):
        effective_update(0.1, 1, 100, 0, 1)


def test_k_steps_client_gets_exactly_k_batches():
    n, B = 37, 16  # ceil(n / B) = 3 batches per epoch: [16, 16, 5]
    for K in (1, 2, 4, 7, 8):
        sched = batch_schedule(0, 1, 3, n, B, 2, steps=K)
        assert len(sched) == K == client_steps(n, B, 2, K)
        assert [len(b) for b in sched] == ([16, 16, 5] * 3)[:K]
    sched = batch_schedule(0, 1, 3, n, B, 2, steps=7)
    epochs = batch_schedule(0, 1, 3, n, B, 2)  # the E-epoch schedule is its prefix (same generator)
    assert all(torch.equal(a, b) for a, b in zip(sched, epochs)) and len(epochs) == local_steps(n, B, 2)
    for e in range(2):  # each full epoch is a permutation; the third is cut after its first batch
        assert sorted(torch.cat(sched[3 * e:3 * e + 3]).tolist()) == list(range(n))
    assert batch_schedule(0, 1, 3, 0, B, 2, steps=5) == [] and client_steps(0, B, 2, 5) == 0
    assert client_steps(n, B, 2, 0) == local_steps(n, B, 2) == 6
    with pytest.raises(ValueError, match="train.local_steps"):
        client_steps(n, B, 2, -1)


# ------------------------------------------------------------------------------------- centralized = SGD
def _sgd_step(model, x, y, lr):
    """One plain SGD step on the mean cross-entropy; returns nothing (updates ``model`` in place)."""
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)


CENTRAL = ["partition=iid", "partition.num_clients=1", "train.participation=1", "train.sampler=fixed", "algorithm=fedavg",
           "algorithm.eta_g=1.0", "train.rounds=3", "train.local_epochs=2", "train.batch_size=64"]


def test_centralized_k1_is_plain_sgd_over_the_whole_data(digits):
    sim, res = run_sim(digits, *CENTRAL)
    data = sim.executor.data
    idx = data.indices[0]
    assert idx.numel() == data.x.shape[0]  # the one client holds the whole training set
    model = copy.deepcopy(sim.model)
    load_flat(model, sim._fresh_state()["global"])  # the run's seeded initial model
    model.train()
    n, B, E, lr = idx.numel(), 64, 2, 0.05
    for r in range(1, 4):
        g = torch_generator("batches", sim.seed, r, 0)  # batch_schedule's key (seed, round, client)
        for _ in range(E):
            for pos in torch.randperm(n, generator=g).split(B):
                _sgd_step(model, data.x[idx[pos]], data.y[idx[pos]], lr)
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    diff = (ref - res.final_flat).abs().max().item()
    assert diff < 1e-6, f"max |FedAvg(K=1) - SGD| = {diff}"
    assert (ref - sim._fresh_state()["global"]).abs().max().item() > 1e-2  # it trained


# -------------------------------------------------------------------------------- LocalSGD = parallel SGD
def test_localsgd_with_one_local_step_is_parallel_sgd(digits):
    R, B, lr = 3, 16, 0.1
    sim, res = run_sim(digits, "train.local_steps=1", "train.participation=1", "train.sampler=fixed",
                       "algorithm=fedavg", "algorithm.aggregation=uniform", f"train.rounds={R}",
                       f"train.batch_size={B}", f"train.lr={lr}", "model=mlp")
    data = sim.executor.data
    model = copy.deepcopy(sim.model)
    x = sim._fresh_state()["global"].clone()
    N = len(data.indices)
    for r in range(1, R + 1):
        grads = []
        for i in range(N):  # g_i: mean gradient of client i on its first mini-batch of a fresh permutation
            idx = data.indices[i]
            pos = torch.randperm(idx.numel(), generator=torch_generator("batches", sim.seed, r, i))[:B]
            load_flat(model, x)
            for p in model.parameters():
                p.grad = None
            F.cross_entropy(model(data.x[idx[pos]]), data.y[idx[pos]]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        x = x - lr * torch.stack(grads).mean(0)  # server: x <- x - eta * (1/K) sum_i g_i
    diff = (x - res.final_flat).abs().max().item()
    assert diff < 1e-6, f"max |LocalSGD(I=1) - parallel SGD| = {diff}"
    assert all(row["num_clients"] == N for row in res.history)


# ------------------------------------------------------------------------------- executors with K steps
UNEQUAL = ["partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "partition.min_size=5",
           "train.rounds=3", "model=mlp", "train.local_steps=7"]


@pytest.mark.parametrize("stack", [["algorithm=fedavg"], ["algorithm=fedbug", "algorithm.fedbug.gu_percentage=0.5"]],
                         ids=["fedavg", "fedbug"])
def test_executors_agree_with_local_steps(digits, stack):
    seq_sim, seq = run_sim(digits, *UNEQUAL, *stack, "engine.executor=sequential")
    vec_sim, vec = run_sim(digits, *UNEQUAL, *stack, "engine.executor=vectorized")
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < 1e-6, f"max |seq - vec| = {diff}"
    for a, b in zip(seq.history, vec.history):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4
    # every client, small (more than an epoch, the last cut short) or large (part of one epoch), takes K = 7 steps
    from fl_core.algorithms.base import RoundContext
    from fl_core.engine.state import ClientStateStore

    per_epoch = [math.ceil(seq_sim.executor.data.size(i) / 32) for i in range(6)]
    assert min(per_epoch) < 7 < max(per_epoch)  # both regimes are present
    for sim in (seq_sim, vec_sim):
        rctx = RoundContext(round=1, lr=0.05, global_flat=seq.final_flat.clone(), spec=sim.spec)
        store = ClientStateStore()
        assert [sim.executor.client_context(rctx, i, store).num_steps for i in range(6)] == [7] * 6
        assert [u.num_steps for u in sim.executor.run_round(rctx, list(range(6)), ClientStateStore())] == [7] * 6


# ------------------------------------------------------------------------------------ rows on and off
def test_study_metrics_in_history_rows_when_on_and_absent_when_off(digits):
    from fl_core.data.sampling import sample_clients

    common = ["train.sampler=fixed", "train.participation=0.5", "train.rounds=3"]
    _, on = run_sim(digits, *common, "tracking.layer_cosine=true", "tracking.client_loss_trace=4")
    _, all6 = run_sim(digits, *common, "tracking.client_loss_trace=6")
    _, off = run_sim(digits, *common)
    layers = {"conv1", "conv2", "fc1", "fc2"}  # the digits CNN
    for row, row6, row_off in zip(on.history, all6.history, off.history):
        sampled = [int(c) for c in sample_clients(6, 0.5, "fixed", 0, int(row["round"]))]
        assert len(sampled) == 3
        assert {k for k in row if k.startswith("cos_")} == {f"cos_{n}" for n in layers} | {"cos_mean"}
        assert all(-1.0 <= row[f"cos_{n}"] <= 1.0 for n in layers)
        assert row["cos_mean"] == pytest.approx(sum(row[f"cos_{n}"] for n in layers) / 4)
        traced = {k for k in row if k.startswith("client_loss/")}
        assert traced == {f"client_loss/{c}" for c in sampled if c < 4}
        assert row["train_loss_clients_min"] <= row["train_loss"] <= row["train_loss_clients_max"]
        assert sum(row6[f"client_loss/{c}"] for c in sampled) / 3 == pytest.approx(row6["train_loss"], rel=1e-6)
        assert not any(k.startswith(("cos_", "client_loss/", "train_loss_clients_")) for k in row_off)
        assert not any(k.startswith("cos_") for k in row6)
        assert row["train_loss"] == row_off["train_loss"]  # diagnostics do not change the run
    assert torch.equal(on.final_flat, off.final_flat)


def test_client_loss_trace_keys():
    from fl_core.algorithms.base import ClientUpdate

    ups = [ClientUpdate(c, 10, 1, torch.zeros(1), loss) for c, loss in ((5, 0.5), (1, 2.0), (0, 1.0))]
    assert client_loss_trace(ups, 2) == {"client_loss/0": 1.0, "client_loss/1": 2.0,
                                         "train_loss_clients_min": 0.5, "train_loss_clients_max": 2.0}
    assert client_loss_trace(ups, 0) == {} and client_loss_trace([], 3) == {}
