"""FedDyn, FedExP, FedDecorr and the FedBug ablations (docs/algorithms.md, FedDyn, FedExP,
FedDecorr, FedBug, Invariants)."""

from __future__ import annotations

import pytest
import torch

from fl_core.algorithms import FedExP, decorrelation_loss
from fl_core.engine.state import ClientStateStore

from conftest import run_sim

MLP = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.min_size=5"]


# ----------------------------------------------------------------------------- FedDyn

def _feddyn_run(digits, rounds, *extra):
    """Run FedDyn and keep the store and server state of the last round."""
    from fl_core.config import compose
    from fl_core.data import make_partition
    from fl_core.engine.factory import build_simulator

    from conftest import TINY

    cfg = compose(TINY + MLP + ["algorithm=feddyn", f"train.rounds={rounds}", *extra])
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    sim = build_simulator(cfg, digits, part)
    seen = {}
    orig_run, orig_agg = sim.executor.run_round, sim.algo.aggregate

    def run_round(rctx, ids, store):
        seen["store"], seen["global_before"] = store, rctx.global_flat.clone()
        ups = orig_run(rctx, ids, store)
        seen["updates"] = ups
        return ups

    def aggregate(rctx, state, ups):
        step = orig_agg(rctx, state, ups)
        seen["cloud"], seen["state"] = step.model, step.state
        return step

    sim.executor.run_round, sim.algo.aggregate = run_round, aggregate
    res = sim.run()
    return sim, res, seen, part


def test_feddyn_history_sign_and_cloud_model(digits):
    sim, res, seen, part = _feddyn_run(digits, 1)
    store: ClientStateStore = seen["store"]
    for u in seen["updates"]:
        # after its first round a client's memory is exactly its update theta_i - theta (g_i = -alpha_i hist_i)
        assert torch.equal(store.get(u.client_id, lambda: None)["hist"], u.delta)
    N = part.num_clients
    hist_mean_all = sum(s["hist"] for _, s in store.items()) / N  # clients that never trained hold 0
    sel = seen["state"]["sel"]
    assert torch.allclose(seen["cloud"] - sel, hist_mean_all, atol=1e-6)  # cloud - mean_S = mean_N hist_i
    alpha = sim.algo.alpha
    expected_h = -(alpha / N) * torch.stack([u.delta for u in seen["updates"]]).sum(0)  # 1/N, not 1/|S|
    assert torch.allclose(seen["state"]["h"], expected_h, atol=1e-9)
    assert torch.equal(res.final_flat, sel)  # eval_model=sel evaluates the plain average of the active clients


def test_feddyn_memory_accumulates_over_rounds(digits):
    _, _, seen, _ = _feddyn_run(digits, 3, "train.participation=1.0", "train.sampler=fixed")
    # with full participation every client trained 3 times: hist_i = sum of its 3 updates, nonzero
    assert all(s["hist"].abs().sum() > 0 for _, s in seen["store"].items())


def test_feddyn_with_tiny_alpha_and_zero_state_is_uniform_fedavg(digits):
    _, dyn = run_sim(digits, *MLP, "algorithm=feddyn", "algorithm.feddyn.alpha=1e-12", "train.rounds=1")
    _, avg = run_sim(digits, *MLP, "algorithm=fedavg", "algorithm.aggregation=uniform", "train.rounds=1")
    assert (dyn.final_flat - avg.final_flat).abs().max() < 1e-6


def test_feddyn_adaptive_alpha(digits):
    from fl_core.algorithms import FedDyn, RoundContext, ClientContext

    rctx = RoundContext(round=1, lr=0.1, global_flat=torch.zeros(3), spec=None, num_clients=4, mean_client_size=50.0)
    algo = FedDyn(0.01, adaptive_alpha=True)
    assert algo.client_alpha(ClientContext(rctx, 0, 100, 10)) == pytest.approx(0.005)  # w_i = 2
    assert FedDyn(0.01, adaptive_alpha=False).client_alpha(ClientContext(rctx, 0, 100, 10)) == 0.01


# ----------------------------------------------------------------------------- FedExP

def test_fedexp_step_size_by_hand():
    # two clients, uniform p: D1 = (2, 0), D2 = (0, 2): A = (4 + 4)/2 = 4, mean = (1, 1), B = 2
    d = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    p = torch.tensor([0.5, 0.5])
    # official: max(1, 0.5 * 4 / (2 + 2 * 0.5)) = max(1, 2/3) = 1 ; with eps = 0: 0.5*4/2 = 1
    assert FedExP.step_size(d, p, eps=0.5) == 1.0
    # opposite updates: D1 = (2, 0), D2 = (-2, 0.2): mean = (0, 0.1), B = 0.01, A = (4 + 4.04)/2 = 4.02
    d2 = torch.tensor([[2.0, 0.0], [-2.0, 0.2]])
    assert FedExP.step_size(d2, p, eps=0.001) == pytest.approx(0.5 * 4.02 / (0.01 + 2 * 0.001))
    # FedBug's code: mean_i |D_i|^2 / (|D_bar|^2 + |S|) = 4.02 / (0.01 + 2)
    assert FedExP.step_size(d2, p, eps=0.001, variant="fedbug_code") == pytest.approx(max(1.0, 4.02 / 2.01))


def test_fedexp_step_is_never_below_one_and_one_client_gives_one():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        m = int(torch.randint(1, 6, (1,), generator=g))
        d = torch.randn(m, 7, generator=g)
        p = torch.rand(m, generator=g)
        assert FedExP.step_size(d, p / p.sum(), eps=1e-3) >= 1.0
    assert FedExP.step_size(torch.randn(1, 7, generator=g), torch.ones(1), eps=1e-3) == 1.0


def test_fedexp_reports_the_midpoint_of_the_last_two_iterates(digits):
    from fl_core.algorithms import FedExP as F

    from fl_core.algorithms.base import ClientUpdate, RoundContext

    algo = F(aggregation="uniform")
    x0 = torch.zeros(3)
    up = ClientUpdate(0, 1, 1, torch.tensor([2.0, 4.0, 6.0]), 0.0)
    rctx = RoundContext(round=1, lr=0.1, global_flat=x0, spec=None)
    first = algo.aggregate(rctx, algo.init_server_state(x0), [up])  # eta_g = 1 for a single client: x_1 = x_0 + d
    assert first.evaluate is None and torch.equal(first.eval_model(), first.model)  # round 1: x_1
    second = algo.aggregate(RoundContext(round=2, lr=0.1, global_flat=first.model, spec=None), first.state, [up])
    assert torch.equal(second.eval_model(), 0.5 * (first.model + second.model))
    sim, res = run_sim(digits, *MLP, "algorithm=fedexp", "train.rounds=3")
    assert all(r["fedexp_eta_g"] >= 1.0 for r in res.history)


# ----------------------------------------------------------------------------- FedDecorr

def test_decorrelation_loss_by_hand():
    z = torch.tensor([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]])  # perfectly correlated dims
    # z_hat = [[-1,-1],[0,0],[1,1]], G = [[2,2],[2,2]], mean off-diagonal G^2 = 4, / N_b = 3
    assert decorrelation_loss(z).item() == pytest.approx(4.0 / 3.0, rel=1e-6)
    assert decorrelation_loss(z[:1]).item() == 0.0  # batch of one


def test_decorrelation_loss_is_invariant_to_per_dimension_affine_maps_and_ignores_padding():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(16, 5, generator=g)
    scaled = z * torch.tensor([3.0, 0.5, 2.0, 10.0, 1.0]) + torch.tensor([1.0, -2.0, 0.0, 5.0, 3.0])
    assert decorrelation_loss(scaled).item() == pytest.approx(decorrelation_loss(z).item(), rel=1e-4)
    padded = torch.cat([z, torch.randn(4, 5, generator=g) * 100])
    w = torch.cat([torch.ones(16), torch.zeros(4)])
    assert decorrelation_loss(padded, w).item() == pytest.approx(decorrelation_loss(z).item(), rel=1e-5)


def test_feddecorr_with_beta_zero_is_fedavg(digits):
    _, dec = run_sim(digits, *MLP, "algorithm=feddecorr", "algorithm.feddecorr.beta=0.0")
    _, avg = run_sim(digits, *MLP, "algorithm=fedavg")
    assert torch.equal(dec.final_flat, avg.final_flat)


# ----------------------------------------------------------------------------- FedBug ablations

def _bug(strategy, P=0.5, M=4):
    from fl_core.algorithms import FedAvg, FedBug

    return FedBug(FedAvg(), P, unit_of=list(range(M)), num_units=M, strategy=strategy)


def test_fedbug_strategies_units():
    K = 8  # P = 0.5, M = 4: m(k) = min(4, ceil(k)) over P*K = 4 steps -> 1, 2, 3, 4, 4, ...
    assert [list(_bug("bottom_up").trainable_units(k, K)) for k in (1, 2, 5)] == [[0], [0, 1], [0, 1, 2, 3]]
    assert [list(_bug("top_down").trainable_units(k, K)) for k in (1, 2, 5)] == [[3], [2, 3], [0, 1, 2, 3]]
    assert all(list(_bug("fixed_last").trainable_units(k, K)) == [0, 1, 2] for k in range(1, K + 1))
    assert all(list(_bug("fixed_last_two").trainable_units(k, K)) == [0, 1] for k in range(1, K + 1))
    rows = _bug("bottom_up").schedule_rows([8, 8, 6])
    assert [r["trainable_units"] for r in rows if r["K_i"] == 6] == [2, 3, 4, 4, 4, 4]


@pytest.mark.parametrize("strategy,frozen", [("fixed_last", 1), ("fixed_last_two", 2)])
def test_fixed_layers_never_move(digits, strategy, frozen):
    sim, res = run_sim(digits, *MLP, "algorithm=fedbug", f"algorithm.fedbug.strategy={strategy}", "train.rounds=2")
    init = sim._fresh_state()["global"]
    sl = sim.spec.unit_slices()
    M = sim.spec.num_units
    for u in range(M):
        same = all(torch.equal(init[s], res.final_flat[s]) for s in sl[u])
        assert same == (u >= M - frozen), f"unit {u}"


def test_fedbug_logs_its_schedule(digits):
    _, res = run_sim(digits, *MLP, "algorithm=fedbug", "algorithm.fedbug.gu_percentage=0.5")
    assert all(0 < r["fedbug_trainable_share"] < 1 and r["fedbug_gu_steps_mean"] >= 1 for r in res.history)


# ----------------------------------------------------------------------------- FedBug needs several units

def test_fedbug_refuses_a_single_unit_model(digits):
    """logreg is one unit: gradual unfreezing would change nothing (or, with fixed_last, train nothing)."""
    from fl_core.config import ConfigError

    for strategy in ("bottom_up", "fixed_last"):
        with pytest.raises(ConfigError) as err:
            run_sim(digits, "model=logreg", "algorithm=fedbug", f"algorithm.fedbug.strategy={strategy}")
        assert str(err.value) == ("algorithm.fedbug needs a model with at least 2 units (this model has 1); with one "
                                  "unit there is nothing to unfreeze gradually: pick a model with several layers "
                                  "(e.g. model=mlp) or drop the fedbug wrapper")
    # a plain logreg run is fine
    sim, res = run_sim(digits, "model=logreg", "algorithm=fedavg", "train.rounds=1")
    assert sim.spec.num_units == 1 and len(res.history) == 1


def test_fedbug_names_the_model_when_given_and_accepts_two_units():
    from fl_core.algorithms import FedAvg, FedBug
    from fl_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^algorithm\.fedbug needs a model with at least 2 units "
                                          r"\(model=logreg has 1\); "):
        FedBug(FedAvg(), 0.5, unit_of=[0, 0], num_units=1, model_name="logreg")
    with pytest.raises(ConfigError, match=r"^algorithm\.fedbug\.strategy=fixed_last_two needs a model with >= 3 "
                                          r"units, got 2$"):
        FedBug(FedAvg(), 0.5, unit_of=[0, 1], num_units=2, strategy="fixed_last_two")
    two = FedBug(FedAvg(), 0.5, unit_of=[0, 0, 1], num_units=2)  # K = 4, P*K = 2 steps: unit 1, then both
    assert [list(two.trainable_units(k, 4)) for k in (1, 2, 3)] == [[0], [0, 1], [0, 1]]


def test_fedbug_on_a_multi_unit_model_still_trains_its_units_gradually(digits):
    sim, res = run_sim(digits, *MLP, "algorithm=fedbug", "algorithm.fedbug.gu_percentage=0.5", "train.rounds=1")
    assert sim.spec.num_units == 3 and res.history[0]["fedbug_trainable_share"] < 1
    init = sim._fresh_state()["global"]
    assert all(not torch.equal(init[s], res.final_flat[s]) for unit in sim.spec.unit_slices() for s in unit)
