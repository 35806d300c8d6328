"""Compression baselines: QSGD, Top-k with error feedback, FedPAQ (docs/algorithms.md, Top-k, QSGD,
FedPAQ and Communication accounting)."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.algorithms import ClientContext, ClientUpdate, FedAvg, RoundContext
from fl_core.algorithms.base import Algorithm, Transformed
from fl_core.algorithms.compression import QSGD, TopK, qsgd, qsgd_floats, topk, topk_dense, topk_floats, topk_k
from fl_core.seeding import torch_generator


from conftest import run_sim


def _topk(base, *args, **kw):
    """``base`` with the Top-k transform on its upload (``algorithm.transforms=[topk]``)."""
    return Transformed(base, TopK(*args, **kw))


def _qsgd(base, *args, **kw):
    return Transformed(base, QSGD(*args, **kw))


def _ctx(rnd, cid, state=None, d=5, seed=0):
    rctx = RoundContext(round=rnd, lr=0.1, global_flat=torch.zeros(d, dtype=torch.float64), spec=None)
    if seed:
        rctx.seed = seed
    return ClientContext(round=rctx, client_id=cid, num_samples=10, num_steps=3, state=state)


def _update(cid, delta):
    return ClientUpdate(client_id=cid, num_samples=10, num_steps=3, delta=delta, train_loss=0.0)


# ----------------------------------------------------------------------------- QSGD

def test_qsgd_is_unbiased():
    v = torch.tensor([0.3, -1.2, 0.0, 2.5, -0.07, 0.9, 1e-4, -2.0], dtype=torch.float64)
    s, n = 4, 20_000
    g = torch_generator("test-qsgd", 0)
    qs = torch.stack([qsgd(v, s, g)[0] for _ in range(n)])
    norm = float(v.norm())
    r = v.abs() * s / norm
    p = r - r.floor()
    se = (norm / s) * torch.sqrt(p * (1 - p) / n)  # std error of the mean of each entry
    err = (qs.mean(0) - v).abs()
    assert torch.all(err <= 5 * se + 1e-12), (err, se)
    # the variance matches the Bernoulli rounding, Var = (||v||/s)^2 p (1 - p) (entries with enough hits)
    ok = p * (1 - p) > 0.05
    assert torch.allclose(qs.var(0)[ok], ((norm / s) ** 2 * p * (1 - p))[ok], rtol=0.1)
    assert torch.all(qs[:, p == 0] == v[p == 0])  # an entry on a level is never rounded


@pytest.mark.parametrize("s", [1, 4, 16, 2 ** 20])
def test_qsgd_levels_and_signs(s):
    g = torch_generator("test-qsgd-levels", s)
    v = torch.randn(1000, generator=g, dtype=torch.float64)
    q, bits = qsgd(v, s, g)
    norm = float(v.norm())
    xi = q.abs() * s / norm
    assert torch.allclose(xi, xi.round(), atol=1e-6)  # a multiple of ||v||/s
    l = torch.floor(v.abs() * s / norm)
    assert torch.all((xi.round() == l) | (xi.round() == l + 1))  # one of the two neighbouring levels
    nz = q != 0
    assert torch.equal(torch.sign(q[nz]), torch.sign(v[nz]))
    assert bits == 1000 * (1 + math.ceil(math.log2(s + 1))) + 32
    if s == 1:
        assert torch.all((q == 0) | torch.isclose(q.abs(), torch.tensor(norm, dtype=q.dtype)))  # 0 or +-||v||
    if s == 2 ** 20:
        assert (q - v).abs().max() <= norm / s + 1e-12


def test_qsgd_zero_and_single_entry():
    g = torch_generator("test-qsgd-zero")
    q, _ = qsgd(torch.zeros(7), 16, g)
    assert torch.equal(q, torch.zeros(7))
    # one non-zero entry: |v_a| = ||v||, so xi = s exactly and Q(v) = v
    v = torch.tensor([0.0, -3.0, 0.0])
    assert torch.allclose(qsgd(v, 5, g)[0], v)


def test_qsgd_deterministic_by_seed():
    v = torch.randn(500, generator=torch_generator("v"))
    a, _ = qsgd(v, 8, torch_generator("qsgd", 3, 1, 2))
    b, _ = qsgd(v, 8, torch_generator("qsgd", 3, 1, 2))
    c, _ = qsgd(v, 8, torch_generator("qsgd", 3, 1, 3))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_qsgd_wrapper_keys_draws_by_run_round_and_client():
    algo = _qsgd(FedAvg("uniform"), levels=4)
    assert algo.describe() == "qsgd[s=4](fedavg)" and algo.vectorizable
    delta = torch.randn(200, generator=torch_generator("d"), dtype=torch.float64)
    def out(rnd, cid, seed=0):
        return algo.finish_client(_ctx(rnd, cid, seed=seed), _update(cid, delta.clone())).delta

    a = out(2, 5)
    out(2, 1)  # another client in between changes nothing
    assert torch.equal(out(2, 5), a)
    assert not torch.equal(out(3, 5), a) and not torch.equal(out(2, 6), a) and not torch.equal(out(2, 5, seed=1), a)
    assert torch.equal(a, qsgd(delta, 4, torch_generator("qsgd", 0, 0, 2, 5))[0])


# ----------------------------------------------------------------------------- Top-k

def test_topk_by_hand():
    v = torch.tensor([0.1, -3.0, 2.0, 0.5, -2.5])
    values, idx = topk(v, 2)
    assert sorted(idx.tolist()) == [1, 4]
    assert sorted(values.tolist()) == [-3.0, -2.5]
    assert torch.equal(topk_dense(v, 3), torch.tensor([0.0, -3.0, 2.0, 0.0, -2.5]))
    assert topk_k(1000, 0.1) == 100 and topk_k(5, 0.01) == 1 and topk_k(5, 1.0) == 5


class _Marker(Algorithm):
    """A base that doubles the delta in finish_client and keeps a state of its own (to check the wrapping)."""

    name = "marker"

    def init_client_state(self, global_flat):
        return {"own": torch.zeros_like(global_flat)}

    def finish_client(self, ctx, update):
        ctx.state["own"] = ctx.state["own"] + 1
        update.delta = 2 * update.delta
        return update

    def comm_floats(self, d):
        return d + 7.0, 2.0 * d


def test_topk_error_feedback_conserves_the_update():
    d, rounds = 50, 6
    algo = _topk(_Marker(), ratio=0.1)
    assert algo.describe() == "topk[0.1,ef](marker)" and algo.vectorizable
    state = algo.init_client_state(torch.zeros(d, dtype=torch.float64))
    assert set(state) == {"own", "residual"} and torch.equal(state["residual"], torch.zeros(d, dtype=torch.float64))
    g = torch_generator("ef")
    raw_sum = torch.zeros(d, dtype=torch.float64)
    sent_sum = torch.zeros(d, dtype=torch.float64)
    for r in range(1, rounds + 1):
        delta = torch.randn(d, generator=g, dtype=torch.float64)
        ctx = _ctx(r, 0, state=state, d=d)
        up = algo.finish_client(ctx, _update(0, delta))
        state = ctx.state
        assert int((up.delta != 0).sum()) == 5  # k = 0.1 * 50
        raw_sum += 2 * delta  # the base's finish_client ran first (it doubles)
        sent_sum += up.delta
    assert torch.equal(state["own"], torch.full((d,), float(rounds), dtype=torch.float64))  # base state intact
    assert torch.allclose(sent_sum + state["residual"], raw_sum, atol=1e-12)
    assert state["residual"].abs().max() > 0


def test_topk_without_error_feedback_keeps_nothing():
    d = 40
    algo = _topk(FedAvg(), ratio=0.25, error_feedback=False)
    assert algo.describe() == "topk[0.25,no_ef](fedavg)"
    assert algo.init_client_state(torch.zeros(d)) is None  # no residual is stored
    g = torch_generator("no-ef")
    for r in range(1, 4):
        delta = torch.randn(d, generator=g)
        ctx = _ctx(r, 0, state=None, d=d)
        up = algo.finish_client(ctx, _update(0, delta.clone()))
        assert torch.equal(up.delta, topk_dense(delta, 10))  # only this round's delta, nothing carried
        assert ctx.state is None or "residual" not in ctx.state


# ------------------------------------------------------- communication (docs/algorithms.md, Communication accounting)

def test_comm_floats_match_section_13():
    d = 1000
    # s = 16: 17 levels -> ceil(log2 17) = 5 bits + 1 sign bit per entry, + the norm
    assert qsgd_floats(d, 16) == pytest.approx(d * 6 / 32 + 1) == pytest.approx(188.5)
    assert qsgd_floats(d, 1) == pytest.approx(d * 2 / 32 + 1)
    assert topk_floats(100) == 200
    assert _qsgd(FedAvg(), 16).comm_floats(d) == (pytest.approx(188.5), 1000.0)
    assert _topk(FedAvg(), 0.1).comm_floats(d) == (200.0, 1000.0)
    # what the base uploads besides its delta is sent uncompressed; the downlink is the base's
    assert _topk(_Marker(), 0.1).comm_floats(d) == (207.0, 2000.0)
    assert _qsgd(_Marker(), 16).comm_floats(d) == (pytest.approx(195.5), 2000.0)


def test_comm_floats_of_a_partial_upload_base():
    class Block(FedAvg):  # uploads only a quarter of the delta (as FedBCGD's block)
        def comm_floats(self, d):
            return d / 4, float(d)

    assert _qsgd(Block(), 16).comm_floats(1000) == (pytest.approx(250 * 6 / 32 + 1), 1000.0)
    assert _topk(Block(), 0.1).comm_floats(1000) == (50.0, 1000.0)


# ----------------------------------------------------------------------------- end to end

def _registered(name):
    from fl_core.algorithms import registry

    assert name in registry.names("transform"), f"transform {name!r} is not in the rule registry"


@pytest.mark.parametrize("algorithm,wrapper", [("topk", "topk"), ("fedpaq", "qsgd")])
def test_end_to_end_differs_from_fedavg(digits, algorithm, wrapper):
    _registered(wrapper)
    sim, res = run_sim(digits, "model=mlp", f"algorithm={algorithm}", "train.rounds=2")
    base_agg = "uniform" if algorithm == "fedpaq" else "weighted"
    _, avg = run_sim(digits, "model=mlp", "algorithm=fedavg", f"algorithm.aggregation={base_agg}", "train.rounds=2")
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in res.history)
    assert not torch.equal(res.final_flat, avg.final_flat)
    d = sim.spec.d
    up = res.history[-1]["comm_up_floats"] / len(res.history)
    expected = 2 * topk_k(d, 0.1) if algorithm == "topk" else qsgd_floats(d, 16)
    assert up == pytest.approx(expected)
    metric = "topk_residual_norm" if algorithm == "topk" else "qsgd_rel_error"
    assert all(r[metric] > 0 for r in res.history)
