"""Equivalences and invariants of FedAvg, FedProx and FedBug (docs/algorithms.md, FedAvg, FedProx, FedBug,
Invariants)."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.algorithms import ClientUpdate, FedAvg, RoundContext, unfrozen_units
from fl_core.engine.state import ParamSpec
from fl_core.models import build_model
from fl_core.config import compose

from conftest import run_sim


# ----------------------------------------------------------------------------- FedAvg aggregation

def _update(cid, n, delta):
    return ClientUpdate(cid, n, 1, torch.tensor(delta, dtype=torch.float32), 0.0)


def _rctx(g):
    model = build_model(compose([]).model, "digits", (1, 8, 8), 10)
    spec = ParamSpec.from_model(model)
    return RoundContext(round=1, lr=0.1, global_flat=torch.tensor(g, dtype=torch.float32), spec=spec)


def test_fedavg_weighted_aggregation_by_hand():
    # sizes 10 and 30: p = (0.25, 0.75); theta = 1 + 2 * (0.25*4 + 0.75*(-4)) = 1 + 2*(-2) = -3
    algo = FedAvg("weighted", eta_g=2.0)
    new, _ = algo.aggregate(_rctx([1.0, 0.0]), {}, [_update(0, 10, [4.0, 8.0]), _update(1, 30, [-4.0, 0.0])])
    assert torch.allclose(new, torch.tensor([-3.0, 4.0]))


def test_fedavg_uniform_aggregation_by_hand():
    algo = FedAvg("uniform", eta_g=1.0)
    new, _ = algo.aggregate(_rctx([1.0, 0.0]), {}, [_update(0, 10, [4.0, 8.0]), _update(1, 30, [-4.0, 0.0])])
    assert torch.allclose(new, torch.tensor([1.0, 4.0]))


def test_weighted_and_uniform_agree_on_equal_sizes_and_differ_otherwise():
    ups_equal = [_update(0, 20, [1.0, 2.0]), _update(1, 20, [3.0, -2.0]), _update(2, 20, [0.5, 0.5])]
    ups_unequal = [_update(0, 5, [1.0, 2.0]), _update(1, 50, [3.0, -2.0]), _update(2, 20, [0.5, 0.5])]
    w, u = FedAvg("weighted"), FedAvg("uniform")
    g = _rctx([0.0, 0.0])
    assert torch.allclose(w.aggregate(g, {}, ups_equal)[0], u.aggregate(g, {}, ups_equal)[0])
    assert not torch.allclose(w.aggregate(g, {}, ups_unequal)[0], u.aggregate(g, {}, ups_unequal)[0])


def test_weighted_and_uniform_runs_differ_with_unequal_clients(digits):
    # Dirichlet per_class gives unequal client sizes, so the two aggregations must diverge.
    common = ["partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "train.rounds=2",
              "partition.min_size=5"]
    _, a = run_sim(digits, *common, "algorithm.aggregation=weighted")
    _, b = run_sim(digits, *common, "algorithm.aggregation=uniform")
    assert not torch.equal(a.final_flat, b.final_flat)


# ----------------------------------------------------------------------------- equivalences

def test_fedprox_with_mu_zero_equals_fedavg(digits):
    _, avg = run_sim(digits, "algorithm=fedavg", "partition=dirichlet")
    _, prox = run_sim(digits, "algorithm=fedprox", "algorithm.fedprox.mu=0.0", "partition=dirichlet")
    assert torch.equal(avg.final_flat, prox.final_flat)
    _, prox1 = run_sim(digits, "algorithm=fedprox", "algorithm.fedprox.mu=1.0", "partition=dirichlet")
    assert not torch.equal(avg.final_flat, prox1.final_flat)


@pytest.mark.parametrize("base", ["fedavg", "fedprox"])
def test_fedbug_with_p_zero_equals_its_base(digits, base):
    _, ref = run_sim(digits, f"algorithm={base}", "train.weight_decay=0.001")
    _, bug = run_sim(digits, "algorithm=fedbug", f"algorithm.name={base}", "algorithm.fedbug.gu_percentage=0.0",
                     "train.weight_decay=0.001")
    assert torch.equal(ref.final_flat, bug.final_flat)
    _, bug2 = run_sim(digits, "algorithm=fedbug", f"algorithm.name={base}", "algorithm.fedbug.gu_percentage=0.5",
                      "train.weight_decay=0.001")
    assert not torch.equal(ref.final_flat, bug2.final_flat)


# ----------------------------------------------------------------------------- FedBug schedule

@pytest.mark.parametrize("K,P,first_all", [(50, 0.1, 5), (50, 0.2, 9), (50, 0.4, 17), (100, 0.1, 9),
                                           (100, 0.2, 17), (100, 0.4, 33)])
def test_fedbug_worked_schedules(K, P, first_all):
    """docs/algorithms.md, FedBug: one new module every f = P*K/M steps; all M = 5 trainable from step (M-1)f+1."""
    M = 5
    f = round(P * K / M)
    ms = [unfrozen_units(k, K, M, P) for k in range(1, K + 1)]
    assert ms[0] == 1  # the first module trains from step 1
    assert ms.index(M) + 1 == first_all
    for k in range(1, K + 1):
        assert ms[k - 1] == min(M, (k - 1) // f + 1)
        assert ms[k - 1] == unfrozen_units(k, K, M, P, schedule="code")  # paper == code when P*K/M is an integer


def test_fedbug_schedule_non_integer_period_and_edges():
    # K=6, M=4, P=0.5: m(k) = min(4, ceil(k*4/3)) = 2, 3, 4, 4, 4, 4
    assert [unfrozen_units(k, 6, 4, 0.5) for k in range(1, 7)] == [2, 3, 4, 4, 4, 4]
    assert all(unfrozen_units(k, 10, 5, 0.0) == 5 for k in range(1, 11))
    # P = 1: the last module trains only during the last 1/M of the steps
    ms = [unfrozen_units(k, 50, 5, 1.0) for k in range(1, 51)]
    assert ms.count(5) == 10
    with pytest.raises(ValueError, match="algorithm.fedbug.schedule=code"):
        unfrozen_units(1, 4, 5, 0.5, schedule="code")


def test_frozen_units_are_bit_identical_while_frozen(digits):
    """Record the model after every local step: units above m(k) never move, with wd > 0 and FedProx on."""
    from fl_core.config import compose
    from fl_core.data import make_partition
    from fl_core.engine.factory import build_simulator

    cfg = compose(["partition.num_clients=4", "train.rounds=1", "train.participation=1.0", "train.sampler=fixed",
                   "train.local_epochs=3", "train.batch_size=16", "train.weight_decay=0.01", "engine.progress=false",
                   "engine.checkpoint_every=0", "tracking.enabled=false", "algorithm=fedbug", "algorithm.name=fedprox",
                   "algorithm.fedprox.mu=0.1", "algorithm.fedbug.gu_percentage=0.6"])
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    sim = build_simulator(cfg, digits, part)
    ex, spec = sim.executor, sim.spec
    from fl_core.engine import executors

    seen = []  # (k, m(k), K_i, params after step k)
    orig_step = executors.sgd_step

    state = {"k": 0}

    def spy_step(*a, **kw):
        out = orig_step(*a, **kw)
        state["k"] += 1
        flat = torch.cat([p.detach().reshape(-1) for p in ex.model.parameters()]).clone()
        seen.append((state["k"], flat))
        return out

    executors.sgd_step = spy_step
    try:
        sim_global = []
        orig_train = ex._train_client

        def train_client(ctx):
            state["k"] = 0
            seen.clear()
            out = orig_train(ctx)
            sim_global.append((ctx.num_steps, ctx.round.global_flat.clone(), list(seen)))
            return out

        ex._train_client = train_client
        sim.run()
    finally:
        executors.sgd_step = orig_step
    assert sim_global, "no client trained"
    slices = spec.unit_slices()
    M = spec.num_units
    checked_frozen = 0
    for K, g, steps in sim_global:
        assert len(steps) == K
        for k, flat in steps:
            m = unfrozen_units(k, K, M, 0.6)
            for u in range(M):
                moved = any(not torch.equal(flat[s], g[s]) for s in slices[u])
                if u >= m:
                    assert not moved, f"unit {u} moved at step {k} while frozen (m={m})"
                    checked_frozen += 1
                elif u == m - 1 or k == K:
                    assert moved, f"unit {u} trainable at step {k} but did not move"
    assert checked_frozen > 0


def test_fedbug_composes_with_fedprox(digits):
    sim, res = run_sim(digits, "algorithm=fedbug", "algorithm.name=fedprox", "algorithm.fedprox.mu=0.01")
    assert sim.algo.describe() == "fedbug[P=0.2](fedprox)"
    assert all(math.isfinite(r["train_loss"]) for r in res.history)


def test_sgd_step_is_torch_sgd_bit_for_bit():
    from fl_core.engine.executors import sgd_step

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    b = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    b.load_state_dict(a.state_dict())
    opt = torch.optim.SGD(b.parameters(), lr=0.07, weight_decay=0.003)
    for _ in range(5):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        for m in (a, b):
            for p in m.parameters():
                p.grad = None
            torch.nn.functional.cross_entropy(m(x), y).backward()
        a[2].bias.grad = None  # a frozen tensor: no update, no weight decay
        b[2].bias.grad = None
        sgd_step(list(a.named_parameters()), 0.07, 0.003)
        opt.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    # a per-element multiplier scales the whole step, weight decay included
    w = a[0].weight.detach().clone()
    a[0].weight.grad = torch.ones_like(w)
    scale = torch.linspace(0.5, 2.0, 7)[:, None]
    sgd_step([("0.weight", a[0].weight)], 0.1, 0.01, {"0.weight": scale})
    assert torch.allclose(a[0].weight, w - 0.1 * scale * (1.0 + 0.01 * w))
