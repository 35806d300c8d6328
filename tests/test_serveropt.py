"""Server optimisers: FedAvgM and FedAdam / FedYogi / FedAdagrad (FedAvg with algorithm.server_opt=momentum, adam,
yogi, adagrad; docs/algorithms.md, Server optimisers; FedAvgM; FedAdam, FedYogi, FedAdagrad; Invariants 9), and the
same optimisers composed over other rules."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.algorithms import ClientUpdate, FedAvg, RoundContext
from fl_core.algorithms.serveropt import FedAdagrad, FedAdam, FedAvgM, FedYogi

from conftest import run_sim


def _update(cid, n, delta, dtype=torch.float64):
    return ClientUpdate(cid, n, 1, torch.tensor(delta, dtype=dtype), 0.0)


def _rctx(g, r=1, dtype=torch.float64):
    g = g if isinstance(g, torch.Tensor) else torch.tensor(g, dtype=dtype)
    return RoundContext(round=r, lr=0.1, global_flat=g, spec=None)


def _rounds(algo, x0, deltas_per_round):
    """Run ``algo.aggregate`` over rounds; each round is a list of (n_i, delta_i). Returns (x, state, norms)."""
    x = torch.tensor(x0, dtype=torch.float64)
    state = algo.init_server_state(x)
    norms = []
    for r, ups in enumerate(deltas_per_round, 1):
        rctx = _rctx(x, r)
        step = algo.aggregate(rctx, state, [_update(i, n, d) for i, (n, d) in enumerate(ups)])
        x, state = step.model, step.state
        norms.append(step.metrics["server_update_norm"])
    return x, state, norms


def _close(a, b):
    assert torch.allclose(a, torch.tensor(b, dtype=a.dtype), rtol=1e-12, atol=1e-12), (a, b)


# ----------------------------------------------------------------------------- FedAvgM

def test_fedavgm_heavy_ball_two_rounds_by_hand():
    # round 1: sizes 10, 30 -> p = (1/4, 3/4); D1 = [4,8]/4 + 3[-4,0]/4 = [-2, 2]
    #          v1 = D1 = [-2, 2];  x1 = [1, 0] + 2 v1 = [-3, 4]
    # round 2: D2 = [2,0]/4 + 3[2,4]/4 = [2, 3];  v2 = 0.5 v1 + D2 = [1, 4];  x2 = x1 + 2 v2 = [-1, 12]
    algo = FedAvgM(beta=0.5, form="heavy_ball", aggregation="weighted", eta_g=2.0)
    x, state, norms = _rounds(algo, [1.0, 0.0], [[(10, [4.0, 8.0]), (30, [-4.0, 0.0])],
                                                [(10, [2.0, 0.0]), (30, [2.0, 4.0])]])
    _close(x, [-1.0, 12.0])
    _close(state["opt.v"], [1.0, 4.0])
    assert norms[0] == pytest.approx(2 * math.sqrt(8))  # ||x1 - x0|| = 2 ||[-2, 2]||
    assert norms[1] == pytest.approx(2 * math.sqrt(17))  # ||x2 - x1|| = 2 ||[1, 4]||
    assert algo.describe() == "fedavgm[beta=0.5,heavy_ball,eta_g=2]"
    assert FedAvgM().describe() == "fedavgm[beta=0.9,heavy_ball]"


def test_fedavgm_ema_equals_heavy_ball_with_eta_one_minus_beta():
    # docs/algorithms.md, Invariants 9; EMA ignores eta_g (3.0 here)
    gen = torch.Generator().manual_seed(0)
    rounds = [[(int(n), torch.randn(7, generator=gen, dtype=torch.float64).tolist())
               for n in torch.randint(1, 50, (3,), generator=gen)] for _ in range(6)]
    beta = 0.7
    ema = FedAvgM(beta, "ema", "weighted", eta_g=3.0)
    hb = FedAvgM(beta, "heavy_ball", "weighted", eta_g=1 - beta)
    x0 = torch.randn(7, generator=gen, dtype=torch.float64).tolist()
    xe, se, ne = _rounds(ema, x0, rounds)
    xh, sh, nh = _rounds(hb, x0, rounds)
    assert torch.allclose(xe, xh, rtol=1e-12, atol=1e-12)
    assert torch.allclose(se["opt.v"], (1 - beta) * sh["opt.v"], rtol=1e-12, atol=1e-12)
    assert ne == pytest.approx(nh, rel=1e-10)
    assert not torch.allclose(xe, torch.tensor(x0, dtype=torch.float64))


@pytest.mark.parametrize("aggregation", ["weighted", "uniform"])
def test_fedavgm_beta_zero_is_fedavg(aggregation):
    gen = torch.Generator().manual_seed(1)
    momentum, avg = FedAvgM(0.0, "heavy_ball", aggregation, eta_g=1.5), FedAvg(aggregation, eta_g=1.5)
    x = torch.randn(5, dtype=torch.float32, generator=gen)
    state = momentum.init_server_state(x)
    for r in range(1, 4):
        ups = [ClientUpdate(i, 5 + 7 * i, 1, torch.randn(5, generator=gen), 0.0) for i in range(3)]
        new, state = momentum.aggregate(_rctx(x, r), state, ups)
        ref, _ = avg.aggregate(_rctx(x, r), {}, ups)
        assert torch.equal(new, ref)
        x = new
    assert state["opt.v"].dtype == torch.float32 and state["opt.update_norm"].dtype == torch.float32


def test_fedavgm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="form"):
        FedAvgM(0.9, "nesterov")
    with pytest.raises(ValueError, match="beta"):
        FedAvgM(1.0)


# ----------------------------------------------------------------------------- FedAdam / FedYogi / FedAdagrad

B1, B2, TAU, ETA = 0.9, 0.99, 0.01, 0.5


def test_fedadam_one_and_two_steps_by_hand():
    algo = FedAdam(B1, B2, TAU, "weighted", ETA)
    # step 1, D1 = [0.2, -0.1, 0]:
    #   m1 = 0.1 D1 = [0.02, -0.01, 0];  v1 = 0.01 D1^2 = [4e-4, 1e-4, 0];  sqrt(v1) = [0.02, 0.01, 0]
    #   x1 = x0 + 0.5 m1 / (sqrt(v1) + 0.01) = [1 + 0.01/0.03, 1 - 0.005/0.02, 1 + 0] = [4/3, 0.75, 1]
    x1, s1, n1 = _rounds(algo, [1.0, 1.0, 1.0], [[(10, [0.2, -0.1, 0.0])]])
    _close(s1["opt.m"], [0.02, -0.01, 0.0])
    _close(s1["opt.v"], [4e-4, 1e-4, 0.0])
    _close(x1, [4 / 3, 0.75, 1.0])
    assert n1[0] == pytest.approx(math.sqrt((1 / 3) ** 2 + 0.25 ** 2))
    # the documented zero-init first step: eta (1 - b1) D / (sqrt(1 - b2) |D| + tau)
    D1 = torch.tensor([0.2, -0.1, 0.0], dtype=torch.float64)
    assert torch.allclose(x1 - 1, ETA * (1 - B1) * D1 / (math.sqrt(1 - B2) * D1.abs() + TAU))
    # step 2, D2 = [0.1, 0.3, -0.2]:
    #   m2 = 0.9 m1 + 0.1 D2 = [0.018 + 0.01, -0.009 + 0.03, 0 - 0.02] = [0.028, 0.021, -0.02]
    #   v2 = 0.99 v1 + 0.01 D2^2 = [3.96e-4 + 1e-4, 0.99e-4 + 9e-4, 0 + 4e-4] = [4.96e-4, 9.99e-4, 4e-4]
    x2, s2, _ = _rounds(algo, [1.0, 1.0, 1.0], [[(10, [0.2, -0.1, 0.0])], [(10, [0.1, 0.3, -0.2])]])
    _close(s2["opt.m"], [0.028, 0.021, -0.02])
    _close(s2["opt.v"], [4.96e-4, 9.99e-4, 4e-4])
    _close(x2, [4 / 3 + 0.5 * 0.028 / (math.sqrt(4.96e-4) + 0.01),
                0.75 + 0.5 * 0.021 / (math.sqrt(9.99e-4) + 0.01),
                1.0 - 0.5 * 0.02 / (0.02 + 0.01)])


def test_fedyogi_sign_of_v_minus_d2_matters():
    algo = FedYogi(B1, B2, TAU, "weighted", ETA)
    # step 1 (v = 0 < D^2 everywhere: same as Adam), D1 = [0.2, -0.1, 0.1]:
    #   m1 = [0.02, -0.01, 0.01];  v1 = 0.01 D1^2 = [4e-4, 1e-4, 1e-4]
    #   x1 = 1 + 0.5 m1 / (sqrt(v1) + 0.01) = [1 + 0.01/0.03, 1 - 0.005/0.02, 1 + 0.005/0.02] = [4/3, 0.75, 1.25]
    x1, s1, _ = _rounds(algo, [1.0, 1.0, 1.0], [[(10, [0.2, -0.1, 0.1])]])
    _close(s1["opt.v"], [4e-4, 1e-4, 1e-4])
    _close(x1, [4 / 3, 0.75, 1.25])
    # step 2, D2 = [0.01, 0.3, 0], D2^2 = [1e-4, 9e-2, 0]:
    #   coord 0: v1 = 4e-4 > 1e-4 -> sign +1: v2 = 4e-4 - 0.01 * 1e-4 = 3.99e-4   (Adam: 3.97e-4)
    #   coord 1: v1 = 1e-4 < 9e-2 -> sign -1: v2 = 1e-4 + 0.01 * 9e-2 = 1e-3     (Adam: 9.99e-4)
    #   coord 2: D2 = 0 -> v2 = v1 = 1e-4 (Adam decays it to 0.99e-4)
    #   m2 = 0.9 m1 + 0.1 D2 = [0.018 + 0.001, -0.009 + 0.03, 0.009] = [0.019, 0.021, 0.009]
    rounds = [[(10, [0.2, -0.1, 0.1])], [(10, [0.01, 0.3, 0.0])]]
    x2, s2, _ = _rounds(algo, [1.0, 1.0, 1.0], rounds)
    _close(s2["opt.v"], [3.99e-4, 1e-3, 1e-4])
    _close(s2["opt.m"], [0.019, 0.021, 0.009])
    _close(x2, [4 / 3 + 0.5 * 0.019 / (math.sqrt(3.99e-4) + 0.01),
                0.75 + 0.5 * 0.021 / (math.sqrt(1e-3) + 0.01),
                1.25 + 0.5 * 0.009 / (0.01 + 0.01)])
    _, adam_state, _ = _rounds(FedAdam(B1, B2, TAU, "weighted", ETA), [1.0, 1.0, 1.0], rounds)
    _close(adam_state["opt.v"], [3.97e-4, 9.99e-4, 0.99e-4])


def test_fedadagrad_accumulates_and_ignores_beta2():
    # D1 = [0.2, -0.1], D2 = [0.1, 0.3]:
    #   step 1: m1 = [0.02, -0.01], v1 = D1^2 = [0.04, 0.01]; x1 = 0.5 m1 / (|D1| + 0.01) = [0.01/0.21, -0.005/0.11]
    #   step 2: m2 = [0.018 + 0.01, -0.009 + 0.03] = [0.028, 0.021], v2 = v1 + D2^2 = [0.05, 0.1]
    rounds = [[(10, [0.2, -0.1])], [(10, [0.1, 0.3])]]
    x2, s2, _ = _rounds(FedAdagrad(B1, 0.5, TAU, "weighted", ETA), [0.0, 0.0], rounds)
    _close(s2["opt.v"], [0.05, 0.1])
    _close(s2["opt.m"], [0.028, 0.021])
    _close(x2, [0.01 / 0.21 + 0.5 * 0.028 / (math.sqrt(0.05) + 0.01),
                -0.005 / 0.11 + 0.5 * 0.021 / (math.sqrt(0.1) + 0.01)])
    x2b, _, _ = _rounds(FedAdagrad(B1, 0.99, TAU, "weighted", ETA), [0.0, 0.0], rounds)
    assert torch.equal(x2, x2b)
    # v only grows: a third round with D = 0 leaves v unchanged
    _, s3, _ = _rounds(FedAdagrad(B1, 0.99, TAU, "weighted", ETA), [0.0, 0.0], rounds + [[(10, [0.0, 0.0])]])
    _close(s3["opt.v"], [0.05, 0.1])


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_adaptive_pseudo_gradient_uses_fedavg_weights(cls):
    # sizes 10, 30 -> D = [4,8]/4 + 3[-4,0]/4 = [-2, 2]: the same as one client sending [-2, 2]
    two = cls(B1, B2, TAU, "weighted", ETA)
    one = cls(B1, B2, TAU, "weighted", ETA)
    x = _rctx([1.0, 0.0])
    a, sa = two.aggregate(x, two.init_server_state(x.global_flat), [_update(0, 10, [4.0, 8.0]),
                                                                   _update(1, 30, [-4.0, 0.0])])
    b, sb = one.aggregate(x, one.init_server_state(x.global_flat), [_update(0, 1, [-2.0, 2.0])])
    assert torch.allclose(a, b) and torch.allclose(sa["opt.v"], sb["opt.v"])
    # uniform: D = ([4,8] + [-4,0]) / 2 = [0, 4]
    uni = cls(B1, B2, TAU, "uniform", ETA)
    _, sc = uni.aggregate(x, uni.init_server_state(x.global_flat), [_update(0, 10, [4.0, 8.0]),
                                                                   _update(1, 30, [-4.0, 0.0])])
    _close(sc["opt.m"], [0.0, 0.4])


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_adaptive_state_keeps_the_global_dtype(cls):
    algo = cls()
    x = torch.zeros(4, dtype=torch.float32)
    state = algo.init_server_state(x)
    new, state = algo.aggregate(_rctx(x), state, [_update(0, 3, [0.1, -0.2, 0.0, 0.3], torch.float32)])
    assert new.dtype == torch.float32 and all(t.dtype == torch.float32 for t in state.values())
    assert algo.comm_floats(10) == (10.0, 10.0)


def test_adaptive_names_and_arguments():
    assert FedAdam().describe() == "fedadam[eta_g=0.03,beta1=0.9,beta2=0.99,tau=0.001]"  # as algorithm=fedadam
    assert FedAdagrad().describe() == "fedadagrad[eta_g=0.3,beta1=0.9,tau=0.001]"  # as algorithm=fedadagrad
    assert FedYogi(v0="tau2").describe() == "fedyogi[eta_g=0.03,beta1=0.9,beta2=0.99,tau=0.001,v0=tau2]"
    assert (FedAdam().name, FedYogi().name, FedAdagrad().name) == ("fedadam", "fedyogi", "fedadagrad")
    with pytest.raises(ValueError, match="tau"):
        FedAdam(tau=0.0)
    with pytest.raises(ValueError, match="beta2"):
        FedYogi(beta2=1.0)


# ----------------------------------------------------------------------------- end to end

def needs_registry(f):  # registered now: the end-to-end tests always run
    return f

E2E = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5",
       "partition.min_size=5", "train.rounds=3"]
STACKS = {
    "fedavgm": ["algorithm=fedavgm"],
    "fedavgm_ema": ["algorithm=fedavgm", "algorithm.fedavgm.form=ema"],
    "fedadam": ["algorithm=fedadam", "algorithm.eta_g=0.01"],
    "fedyogi": ["algorithm=fedyogi", "algorithm.eta_g=0.01"],
    "fedadagrad": ["algorithm=fedadagrad", "algorithm.eta_g=0.01"],
}


@needs_registry
@pytest.mark.parametrize("stack", list(STACKS))
def test_server_rules_do_not_depend_on_the_executor(digits, stack):
    sim, seq = run_sim(digits, *E2E, *STACKS[stack], "engine.executor=sequential")
    _, vec = run_sim(digits, *E2E, *STACKS[stack], "engine.executor=vectorized")
    assert sim.algo.name == STACKS[stack][0].split("=")[1]
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < 1e-6, f"max |seq - vec| = {diff}"
    norms = [row["server_update_norm"] for row in seq.history]
    assert len(norms) == 3 and all(n > 0 for n in norms)
    assert all(abs(a["server_update_norm"] - b["server_update_norm"]) < 1e-4 * a["server_update_norm"]
               for a, b in zip(seq.history, vec.history))


@needs_registry
def test_fedavgm_beta_zero_run_is_fedavg(digits):
    _, m = run_sim(digits, *E2E, "algorithm=fedavgm", "algorithm.fedavgm.beta=0.0", "train.rounds=2")
    _, a = run_sim(digits, *E2E, "algorithm=fedavg", "train.rounds=2")
    assert torch.equal(m.final_flat, a.final_flat)
