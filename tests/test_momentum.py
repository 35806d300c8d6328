"""``train.momentum``: local SGD with momentum in both executors (docs/algorithms.md, One local step).

- ``sgd_step`` with momentum is ``torch.optim.SGD(momentum, weight_decay)`` (dampening 0, no Nesterov) to the bit,
  on a hand-computed 3-step case and with a tensor frozen in the middle (it keeps its buffer);
- both executors train a client as a fresh ``torch.optim.SGD`` per client and round does (sequential: to the bit;
  vectorised: float64 rounding), with a tensor frozen at alternate steps; momentum 0 is the plain path;
- sequential == vectorised (float64, 1e-9) with momentum 0.9 for every base rule of the registry (or the rule
  refuses momentum with one line), with unequal clients, and under FedBug's frozen units;
- a run resumed from its checkpoint equals the uninterrupted run with momentum;
- FedNova's normaliser a_i with momentum (hand-computed; rho = 0 gives tau_i) and the refusals of the rules whose
  local math assumes plain SGD.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fl_core.algorithms import FedAvg, FedNova, normalizer, registry
from fl_core.algorithms.base import RoundContext
from fl_core.config import compose
from fl_core.engine.executors import SequentialExecutor, VectorizedExecutor, batch_schedule, sgd_step
from fl_core.engine.state import ClientStateStore, flatten_params, load_flat
from fl_core.schema import ConfigError

from test_conformance import (BASES, SETTING, UNEQUAL, _close, _resumed_equals_uninterrupted, _run,
                              _sequential_equals_vectorized, _sim, _stack)

MOMENTUM = ("train.momentum=0.9",)
# the rules whose local math assumes plain SGD: the one-line refusal each gives with train.momentum=0.9
REFUSED = {
    "scaffold": r"^train.momentum=0.9 does not compose with algorithm.name=scaffold: option II's .*; "
                r"set train.momentum=0$",
    "feddc": r"^train.momentum=0.9 does not compose with algorithm.name=feddc: its g_i update .*; "
             r"set train.momentum=0$",
}


# --------------------------------------------------------------------------- the step


def test_sgd_step_with_momentum_hand_computed_and_torch_sgd_bit_for_bit():
    """w x with x = 2, loss 0.5 (2w)^2 (grad 4w), lr 0.1, weight decay 0.5, rho 0.9, w0 = 1::

        k=1: d = 4 + 0.5      = 4.5       buf = 4.5                        w = 1 - 0.45      = 0.55
        k=2: d = 2.2 + 0.275  = 2.475     buf = 0.9 * 4.5 + 2.475 = 6.525  w = 0.55 - 0.6525 = -0.1025
        k=3: d = -0.41 - 0.05125 = -0.46125  buf = 5.8725 - 0.46125 = 5.41125  w = -0.643625
    """
    a = torch.nn.Linear(1, 1, bias=False).double()
    b = copy.deepcopy(a)
    for m in (a, b):
        with torch.no_grad():
            m.weight.fill_(1.0)
    opt = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5, foreach=False)
    bufs = {}
    x = torch.tensor([[2.0]], dtype=torch.float64)
    for want_w, want_buf in ((0.55, 4.5), (-0.1025, 6.525), (-0.643625, 5.41125)):
        for m in (a, b):
            m.weight.grad = None
            (0.5 * m(x).pow(2).sum()).backward()
        sgd_step(list(a.named_parameters()), 0.1, 0.5, momentum=0.9, buffers=bufs)
        opt.step()
        assert torch.equal(a.weight, b.weight)
        assert torch.equal(bufs["weight"], opt.state[b.weight]["momentum_buffer"])
        assert float(a.weight.detach()) == pytest.approx(want_w, abs=1e-12)
        assert float(bufs["weight"]) == pytest.approx(want_buf, abs=1e-12)


def test_sgd_step_with_momentum_keeps_a_frozen_tensors_buffer_as_torch_does():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    b = copy.deepcopy(a)
    opt = torch.optim.SGD(b.parameters(), lr=0.07, momentum=0.9, weight_decay=0.003, foreach=False)
    bufs = {}
    for step in range(6):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        for m in (a, b):
            for p in m.parameters():
                p.grad = None
            F.cross_entropy(m(x), y).backward()
            if step in (0, 3, 4):  # frozen at its first step (no buffer yet) and, later, with a buffer
                m[2].bias.grad = None
        before = bufs.get("2.bias", torch.zeros(0)).clone()
        sgd_step(list(a.named_parameters()), 0.07, 0.003, momentum=0.9, buffers=bufs)
        opt.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
        if step in (3, 4):
            assert torch.equal(bufs["2.bias"], before)
    assert set(bufs) == {n for n, _ in a.named_parameters()}


def test_sgd_step_with_momentum_scales_the_step_not_the_buffer():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    s = {"p": torch.tensor([0.5, 2.0], dtype=torch.float64)}
    bufs = {}
    p.grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    sgd_step([("p", p)], 0.1, 0.0, s, momentum=0.5, buffers=bufs)  # buf = 1;  p -= 0.1 s
    p.grad = torch.tensor([2.0, 2.0], dtype=torch.float64)
    sgd_step([("p", p)], 0.1, 0.0, s, momentum=0.5, buffers=bufs)  # buf = 0.5 + 2 = 2.5;  p -= 0.25 s
    assert torch.allclose(bufs["p"], torch.tensor([2.5, 2.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(p.detach(), torch.tensor([1 - 0.35 * 0.5, 2 - 0.35 * 2.0], dtype=torch.float64),
                          rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="momentum > 0 needs a dict of momentum buffers"):
        sgd_step([("p", p)], 0.1, 0.0, momentum=0.5)


# --------------------------------------------------------------------------- the executors against torch.optim.SGD


def _alternating(num_tensors: int, k: int):
    """The first parameter tensor frozen at every even local step k (so it keeps a buffer across a freeze)."""
    return [not (j == 0 and k % 2 == 0) for j in range(num_tensors)]


class _Alternating(FedAvg):
    """FedAvg with the mask :func:`_alternating`."""

    def client_begin(self, ctx, probe):
        ctx.step_mask = lambda k: _alternating(len(ctx.round.spec.names), k)


def _torch_reference(model, data, rctx, cid, *, batch_size, epochs, seed, momentum, weight_decay, mask=None):
    """Delta [d] of client ``cid``: a new torch.optim.SGD for the round, frozen tensors without a gradient."""
    m = copy.deepcopy(model)
    load_flat(m, rctx.global_flat)
    m.train()
    params = list(m.parameters())
    opt = torch.optim.SGD(params, lr=rctx.lr, momentum=momentum, weight_decay=weight_decay, foreach=False)
    idx = data.indices[cid]
    for k, pos in enumerate(batch_schedule(seed, rctx.round, cid, data.size(cid), batch_size, epochs), start=1):
        allowed = mask(k) if mask else [True] * len(params)
        for p, a in zip(params, allowed):
            p.requires_grad_(a)
        opt.zero_grad(set_to_none=True)
        b = idx[pos]
        logits, _ = m.forward_features(data.x[b])
        F.cross_entropy(logits, data.y[b]).backward()
        opt.step()
    return flatten_params(m) - rctx.global_flat


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("alternating", [False, True])
def test_both_executors_train_a_client_as_a_new_torch_sgd_per_round(momentum, alternating):
    sim = _sim(UNEQUAL)  # float64 MLP on digits, clients of unequal sizes (unequal K_i, padded batches)
    base = sim.executor
    algo = _Alternating() if alternating else FedAvg()
    kw = dict(batch_size=base.batch_size, local_epochs=base.local_epochs, seed=base.seed, weight_decay=0.01,
              momentum=momentum)
    seq = SequentialExecutor(sim.model, algo, base.data, **kw)
    vec = VectorizedExecutor(copy.deepcopy(sim.model), algo, base.data, **kw)
    ids = list(range(len(base.data.indices)))
    g = flatten_params(sim.model).clone()
    for r in (1, 2):  # round 2 starts from round 1's mean: new buffers (a carried buffer would show)
        rctx = RoundContext(round=r, lr=0.05, lr0=0.05, global_flat=g, spec=sim.spec, num_clients=len(ids),
                            sampled=tuple(ids))
        got_seq = seq.run_round(rctx, ids, ClientStateStore("cpu"))
        got_vec = vec.run_round(rctx, ids, ClientStateStore("cpu"))
        for u, v in zip(got_seq, got_vec):
            mask = (lambda k: _alternating(len(sim.spec.names), k)) if alternating else None
            ref = _torch_reference(sim.model, base.data, rctx, u.client_id, batch_size=base.batch_size,
                                   epochs=base.local_epochs, seed=base.seed, momentum=momentum, weight_decay=0.01,
                                   mask=mask)
            assert torch.equal(u.delta, ref), f"round {r} client {u.client_id}: sequential != torch.optim.SGD"
            assert float((v.delta - ref).abs().max()) <= 1e-12, f"round {r} client {u.client_id}: vectorised"
        g = g + torch.stack([u.delta for u in got_seq]).mean(0)


def test_momentum_zero_is_the_plain_path_bit_for_bit():
    """train.momentum=0 (the default) gives the same model as a config without the key's effect: the plain SGD
    step, bit for bit, in both executors (the torch.optim.SGD comparison above covers the step itself)."""
    for executor in ("sequential", "vectorized"):
        plain, _, _, _ = _run(_stack("fedavg", extra=UNEQUAL), executor)
        zero, _, _, _ = _run(_stack("fedavg", extra=UNEQUAL + ("train.momentum=0.0",)), executor)
        assert torch.equal(plain, zero)
    with_momentum, _, _, _ = _run(_stack("fedavg", extra=UNEQUAL + MOMENTUM))
    assert not torch.equal(plain, with_momentum)


# --------------------------------------------------------------------------- every base, both executors


# every other base runs with the slow tests (all of them in CI); tests/test_conformance.py covers each base fast
@pytest.mark.parametrize("base", [pytest.param(b, marks=pytest.mark.slow) if i % 2 else b for i, b in enumerate(BASES)])
def test_every_base_with_momentum_sequential_equals_vectorized(base):
    if base in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[base]):
            _sim(_stack(base, extra=MOMENTUM))
        _run(_stack(base))  # and it builds without momentum
        return
    for extra in (MOMENTUM, MOMENTUM + UNEQUAL + ("train.weight_decay=0.01",)):
        _sequential_equals_vectorized(_stack(base, extra=extra))
    plain, _, _, _ = _run(_stack(base))
    moved, _, _, _ = _run(_stack(base, extra=MOMENTUM))
    assert not torch.equal(plain, moved), f"{base}: train.momentum=0.9 changed nothing"


def test_fedbug_frozen_units_with_momentum_sequential_equals_vectorized():
    for extra in (("algorithm.fedbug.gu_percentage=0.6",),
                  ("algorithm.fedbug.gu_percentage=0.6", "algorithm.fedbug.strategy=top_down") + UNEQUAL):
        _sequential_equals_vectorized(_stack("fedavg", "fedbug", MOMENTUM + extra))


def test_fedbcgd_freezing_with_momentum_sequential_equals_vectorized():
    freezing = ("algorithm.fedbcgd.freezing=true",)
    _sequential_equals_vectorized(_stack("fedbcgd", extra=MOMENTUM + freezing))


@pytest.mark.parametrize("stack", [_stack("fedavg", extra=MOMENTUM), _stack("moon", extra=MOMENTUM),
                                   _stack("fednova", extra=MOMENTUM + UNEQUAL),
                                   _stack("fedavg", "fedbug", MOMENTUM)])
def test_resumed_with_momentum_equals_uninterrupted(stack, tmp_path):
    _resumed_equals_uninterrupted(stack, tmp_path / "ck.pt")


# --------------------------------------------------------------------------- FedNova


def test_fednova_normaliser_with_momentum_hand_computed():
    # a_i = sum_{k=1..tau} (1 - rho^k) / (1 - rho): rho = 0.5, tau = 3: (0.5 + 0.75 + 0.875) / 0.5 = 4.25
    assert normalizer(3, rho=0.5) == pytest.approx(4.25, abs=1e-12)
    # rho = 0.9, tau = 2: 1 + 1.9 = 2.9; tau = 1: 1 (the first step is plain SGD)
    assert normalizer(2, rho=0.9) == pytest.approx(2.9, abs=1e-12)
    assert normalizer(1, rho=0.9) == pytest.approx(1.0, abs=1e-12)
    for tau in (0, 1, 5, 17):
        assert normalizer(tau, rho=0.0) == float(tau)  # rho = 0: today's a_i = tau_i
        rho = 0.7
        assert normalizer(tau, rho=rho) == pytest.approx(sum((1 - rho ** k) / (1 - rho) for k in range(1, tau + 1)),
                                                         abs=1e-12)


def test_fednova_sends_the_momentum_normaliser_of_its_steps():
    seen = []
    orig = FedNova.finish_client

    def spy(self, ctx, update):
        out = orig(self, ctx, update)
        seen.append((update.num_steps, float(out.extra["a"])))
        return out

    FedNova.finish_client = spy
    try:
        sim = _sim(_stack("fednova", extra=MOMENTUM + UNEQUAL))
        assert sim.algo.rho == 0.9
        sim.run()
    finally:
        FedNova.finish_client = orig
    assert len({k for k, _ in seen}) > 1  # unequal K_i
    for k, a in seen:
        assert a == normalizer(k, rho=0.9)


def test_fednova_with_momentum_and_equal_steps_is_fedavg_with_momentum():
    nova, _, _, _ = _run(_stack("fednova", extra=MOMENTUM))
    avg, _, _, _ = _run(_stack("fedavg", extra=MOMENTUM))
    assert _close(nova, avg)


def test_fednova_refuses_momentum_with_its_proximal_term():
    with pytest.raises(ConfigError, match=r"^train.momentum=0.9 does not compose with algorithm.fednova.mu=0.1: "
                                          r".*; set train.momentum=0 or algorithm.fednova.mu=0$"):
        _sim(_stack("fednova", extra=MOMENTUM + ("algorithm.fednova.mu=0.1",)))
    with pytest.raises(ConfigError, match="algorithm.fednova.mu"):
        FedNova(mu=0.1, momentum=0.5)
    assert FedNova(mu=0.1).rho == 0.0


# --------------------------------------------------------------------------- refusals and the key


def test_fedbcgd_plus_code_variant_refuses_momentum_and_the_paper_variant_takes_it():
    with pytest.raises(ConfigError, match=r"^train.momentum=0.9 does not compose with "
                                          r"algorithm.fedbcgd.plus_variant=code: .*; set train.momentum=0$"):
        _sim(_stack("fedbcgd_plus", extra=MOMENTUM + ("algorithm.fedbcgd.plus_variant=code",)))
    _sim(_stack("fedbcgd_plus", extra=MOMENTUM + ("algorithm.fedbcgd.plus_variant=paper",)))


def test_a_refusal_names_the_rule_under_a_wrapper_too():
    with pytest.raises(ConfigError, match=REFUSED["scaffold"]):
        _sim(_stack("scaffold", "fedbug", MOMENTUM))


def test_refuse_local_momentum_is_silent_at_zero():
    ctx = registry.BuildContext(algorithm=None, spec=None)
    registry.refuse_local_momentum(ctx, "algorithm.name=x", "why")
    with pytest.raises(ConfigError, match=r"^train.momentum=0.5 does not compose with algorithm.name=x: why; "):
        registry.refuse_local_momentum(registry.BuildContext(algorithm=None, spec=None, momentum=0.5),
                                       "algorithm.name=x", "why")


@pytest.mark.parametrize("value, message", [("1.0", r"^train.momentum must be < 1, got 1$"),
                                            ("-0.1", r"^train.momentum must be >= 0, got -0.1$")])
def test_train_momentum_out_of_range_is_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        compose(list(SETTING) + [f"train.momentum={value}"])
