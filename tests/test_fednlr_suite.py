"""SCAFFOLD, FedNova, FedRS, FedLC, CCVR and FedNLR (docs/algorithms.md, SCAFFOLD, FedNova,
FedRS, FedLC, CCVR, FedNLR, Invariants)."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.algorithms import FedLC, mu_schedule, neuron_scales, normalizer
from fl_core.algorithms.ccvr import client_feature_stats, global_gaussians

from conftest import run_sim

UNEQUAL = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.min_size=5"]


# ----------------------------------------------------------------------------- FedNLR

VGG9_M = [32, 64, 128, 128, 256, 256, 512, 512]


@pytest.mark.parametrize("C,depth,expected", [
    (10, "l_over_L", [2.616, 3.028, 3.441, 3.552, 3.964, 4.075, 4.487, 4.598, 3.000]),
    (100, "l_over_L", [2.616, 3.028, 3.441, 3.552, 3.964, 4.075, 4.487, 4.598, 4.000]),
    (10, "one_over_L", [2.616, 2.917, 3.218, 3.218, 3.519, 3.519, 3.820, 3.820, 2.111]),
    (100, "one_over_L", [2.616, 2.917, 3.218, 3.218, 3.519, 3.519, 3.820, 3.820, 3.111]),
])
def test_mu_schedule_reference_values_for_vgg9(C, depth, expected):
    got = mu_schedule(VGG9_M + [C], depth_term=depth)
    assert [round(m, 3) for m in got] == expected


def test_neuron_rates_have_mean_eta_and_max_min_ratio_mu():
    g = torch.Generator().manual_seed(0)
    for M, mu in [(32, 2.616), (10, 3.0), (512, 4.598)]:
        h = torch.rand(M, generator=g, dtype=torch.float64) * 5
        s, T = neuron_scales(h, mu)
        assert s.mean().item() == pytest.approx(1.0, rel=1e-12)  # mean rate = eta
        assert (s.max() / s.min()).item() == pytest.approx(mu, rel=1e-9)  # max/min = mu_l exactly
        assert T == pytest.approx((h.max() - h.min()).item() / math.log(mu))
        assert torch.equal(torch.argmax(s), torch.argmax(h))  # the most active neuron learns fastest
    s, T = neuron_scales(torch.full((8,), 0.3, dtype=torch.float64), 3.0)  # dead / constant layer
    assert torch.equal(s, torch.ones(8, dtype=torch.float64)) and T == math.inf


def test_fednlr_with_mu_one_is_its_base(digits):
    # mu0 = 1, a1 = a2 = 0 => mu_l = 1 => uniform rates (T infinite): exactly the base algorithm
    _, nlr = run_sim(digits, *UNEQUAL, "algorithm=fednlr", "algorithm.name=fedprox", "algorithm.fednlr.a1=0",
                     "algorithm.fednlr.a2=0")
    _, base = run_sim(digits, *UNEQUAL, "algorithm=fedprox")
    assert torch.equal(nlr.final_flat, base.final_flat)
    _, nlr2 = run_sim(digits, *UNEQUAL, "algorithm=fednlr", "algorithm.name=fedprox")
    assert not torch.equal(nlr2.final_flat, base.final_flat)


def test_fednlr_logs_mu_and_temperature_per_layer(digits):
    sim, res = run_sim(digits, *UNEQUAL, "algorithm=fednlr")
    row = res.history[-1]
    L = len(sim.model.neuron_layers())
    assert [round(row[f"fednlr_mu_l{l}"], 6) for l in range(1, L + 1)] == [
        round(m, 6) for m in mu_schedule([200, 200, 10])]  # MLP: 200, 200, 10 neurons
    assert all(row[f"fednlr_T_l{l}"] > 0 for l in range(1, L + 1))


def test_fedbug_over_fednlr_over_fedprox_composes(digits):
    sim, res = run_sim(digits, *UNEQUAL, "algorithm=fednlr", "algorithm.name=fedprox",
                       "algorithm.wrappers=[fednlr,fedbug]", "algorithm.fedbug.gu_percentage=0.5")
    assert sim.algo.describe() == "fedbug[P=0.5](fednlr(fedprox))"
    assert "fedbug_trainable_share" in res.history[-1] and "fednlr_mu_l1" in res.history[-1]


# ----------------------------------------------------------------------------- SCAFFOLD

def test_scaffold_round_one_equals_fedavg_and_sets_c(digits):
    from fl_core.data import make_partition
    from fl_core.engine.factory import build_simulator

    from conftest import tiny_cfg

    _, avg = run_sim(digits, *UNEQUAL, "algorithm=fedavg", "algorithm.aggregation=uniform", "train.rounds=1")
    cfg = tiny_cfg(*UNEQUAL, "algorithm=scaffold", "train.rounds=1")
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    sim = build_simulator(cfg, digits, part)
    seen = {}
    orig = sim.algo.aggregate

    def spy(rctx, state, ups):
        step = orig(rctx, state, ups)
        seen.update(ups=ups, state=step.state, lr=rctx.lr)
        return step

    sim.algo.aggregate = spy
    res = sim.run()
    assert torch.equal(res.final_flat, avg.final_flat)  # c = c_i = 0: no correction in round 1
    N = part.num_clients
    expected_c = sum(-u.delta / (u.num_steps * seen["lr"]) for u in seen["ups"]) / N  # (1/N) sum (x - y_i)/(K lr)
    assert torch.allclose(seen["state"]["c"], expected_c, atol=1e-7)


def test_scaffold_correction_changes_later_rounds(digits):
    _, avg = run_sim(digits, *UNEQUAL, "algorithm=fedavg", "algorithm.aggregation=uniform")
    _, sca = run_sim(digits, *UNEQUAL, "algorithm=scaffold")
    assert not torch.equal(avg.final_flat, sca.final_flat)


# ----------------------------------------------------------------------------- FedNova

def test_fednova_normalizers_by_hand():
    assert normalizer(10) == 10.0
    # momentum 0.5, tau 3: [3 - 0.5 (1 - 0.125) / 0.5] / 0.5 = (3 - 0.875) / 0.5 = 4.25
    assert normalizer(3, rho=0.5) == pytest.approx(4.25)
    # prox: a <- a (1 - lr mu) + 1 three times from 0 with lr mu = 0.1: 1, 1.9, 2.71
    assert normalizer(3, lr=0.1, mu=1.0) == pytest.approx(2.71)


def test_fednova_with_equal_step_counts_is_weighted_fedavg(digits):
    common = ["model=mlp", "partition=iid", "train.rounds=2"]  # equal sizes => equal tau_i
    _, nova = run_sim(digits, *common, "algorithm=fednova")
    _, avg = run_sim(digits, *common, "algorithm=fedavg")
    assert torch.allclose(nova.final_flat, avg.final_flat, atol=1e-6)
    _, nova_u = run_sim(digits, *UNEQUAL, "algorithm=fednova")
    _, avg_u = run_sim(digits, *UNEQUAL, "algorithm=fedavg")
    assert not torch.allclose(nova_u.final_flat, avg_u.final_flat, atol=1e-6)


# ----------------------------------------------------------------------------- FedRS / FedLC

def test_fedrs_with_alpha_one_is_fedavg(digits):
    _, rs = run_sim(digits, *UNEQUAL, "algorithm=fedrs", "algorithm.fedrs.alpha=1.0")
    _, avg = run_sim(digits, *UNEQUAL, "algorithm=fedavg")
    assert torch.equal(rs.final_flat, avg.final_flat)
    _, rs5 = run_sim(digits, *UNEQUAL, "algorithm=fedrs", "algorithm.fedrs.alpha=0.5",
                     "partition.alpha=0.05")  # alpha 0.05: clients miss classes
    _, avg5 = run_sim(digits, *UNEQUAL, "algorithm=fedavg", "partition.alpha=0.05")
    assert not torch.equal(rs5.final_flat, avg5.final_flat)


def test_fedlc_logits_by_hand():
    from fl_core.algorithms import ClientContext

    lc = FedLC(tau=1.0)
    z = torch.tensor([[2.0, 1.0, 0.5]])
    ctx = ClientContext(round=None, client_id=0, num_samples=17, num_steps=1, label_counts=torch.tensor([16, 1, 0]))
    out = lc.local_objective(ctx, {}, z, None, None).logits
    assert torch.allclose(out[0, :2], torch.tensor([2.0 - 0.5, 1.0 - 1.0]))  # 16^(-1/4) = 0.5, 1^(-1/4) = 1
    assert out[0, 2] < -1e8  # absent class excluded from the softmax
    assert torch.softmax(out, 1)[0, 2] == 0.0
    clamp = FedLC(tau=2.0, missing="clamp").local_objective(ctx, {}, z, None, None).logits
    assert torch.allclose(clamp, torch.tensor([[1.0, -1.0, -1.5]]))


def test_fedlc_with_tau_zero_is_fedavg(digits):
    _, lc = run_sim(digits, *UNEQUAL, "algorithm=fedlc", "algorithm.fedlc.tau=0.0")
    _, avg = run_sim(digits, *UNEQUAL, "algorithm=fedavg")
    assert torch.equal(lc.final_flat, avg.final_flat)


# ----------------------------------------------------------------------------- CCVR

def test_ccvr_global_gaussians_equal_pooled_statistics():
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(60, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=g)
    splits = [slice(0, 17), slice(17, 35), slice(35, 60)]
    stats = [client_feature_stats(feats[s], y[s], 3) for s in splits]
    gauss = global_gaussians(stats)
    for c in range(3):
        z = feats[y == c]
        n, mu, cov = gauss[c]
        assert n == z.shape[0]
        assert torch.allclose(mu, z.mean(0)) and torch.allclose(cov, torch.cov(z.T))


def test_ccvr_recalibrates_only_the_classifier(digits):
    sim, res = run_sim(digits, *UNEQUAL, "algorithm=ccvr", "algorithm.ccvr.epochs=3")
    last = res.history[-1]
    assert "post_test_acc" in last and 0.0 <= last["post_test_acc"] <= 1.0
    _, plain = run_sim(digits, *UNEQUAL, "algorithm=fedavg")
    head = sim.model.neuron_layers()[-1][0]
    for (n, _), sl in zip(sim.model.named_parameters(), [slice(o, o + k) for o, k in
                                                        zip(sim.spec.offsets, sim.spec.numels)]):
        same = torch.equal(res.final_flat[sl], plain.final_flat[sl])
        assert same == (not n.startswith(head + ".")), n
    from fl_core.metrics import summarize_run

    assert summarize_run(res.history, 0.9)["final_acc"] == last["post_test_acc"]


def test_neuron_drift_probe_by_construction(digits):
    from fl_core.algorithms import ClientUpdate
    from fl_core.engine.probes import neuron_drift
    from fl_core.engine.state import load_flat

    sim, _ = run_sim(digits, "model=mlp", "train.rounds=1")
    x = digits.normalize(digits.x_test[:300])
    y = digits.y_test[:300]
    g = sim._fresh_state()["global"]
    counts = {0: torch.tensor([5] * 5 + [0] * 5), 1: torch.tensor([5] * 10)}  # client 0 misses classes 5..9
    zero = [ClientUpdate(0, 25, 1, torch.zeros_like(g), 0.0)]
    out = neuron_drift(sim.model, load_flat, g, zero, counts, x, y, 10)
    assert out["neuron_drift_l1"] == 0.0 and out["neuron_drift"] == 0.0  # nothing moved, nothing dropped
    kill = torch.zeros_like(g)
    views = sim.spec.views(kill)
    views["fc1.bias"].fill_(-1e4)  # every first-layer activation becomes 0
    out = neuron_drift(sim.model, load_flat, g, [ClientUpdate(0, 25, 1, kill, 0.0)], counts, x, y, 10)
    assert out["neuron_drift_l1"] == 1.0
    # a client holding every class has no missing class: no measurement
    assert neuron_drift(sim.model, load_flat, g, [ClientUpdate(1, 50, 1, kill, 0.0)], counts, x, y, 10) == {}
