"""System heterogeneity and the local optimiser (docs/algorithms.md, Local work; fl_core/engine/localwork.py).

- the plan: drawn epochs E_i ~ U{E..b} and straggler epochs ~ U{1..E_i-1} are in range, a pure function of
  (seed, round, client), and cover their range; the straggler count is |S| - round((1 - s)|S|), at most |S| - 1;
- fixed epochs through the plan (b = E) are the plain path bit for bit, in both executors;
- both executors agree (float64, 1e-9) with drawn epochs, stragglers kept and dropped, for FedAvg, FedProx,
  SCAFFOLD and FedNova; FedNova receives each client's real step count and equals FedAvg when all steps are equal;
- stragglers: the counts per round, a dropped straggler neither trains nor reaches the aggregate or the rule's
  state (hand-checked round), kept stragglers send their partial work; uplink counts what is sent;
- a run resumed from its checkpoint has the uninterrupted run's history and model;
- ``train.optimizer=adam``: ``adam_step`` is ``torch.optim.Adam`` to the bit; both executors train a client as a new
  ``torch.optim.Adam`` per client and round (frozen tensors keep their moments); every base agrees across executors
  or refuses adam in one line;
- the one-line refusals of the new keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fl_core.algorithms import FedAvg
from fl_core.algorithms.base import RoundContext
from fl_core.config import compose
from fl_core.engine.executors import SequentialExecutor, VectorizedExecutor, adam_step, batch_schedule, client_steps
from fl_core.engine.localwork import LocalWork, num_stragglers, plan_round
from fl_core.engine.state import ClientStateStore, flatten_params, load_flat
from fl_core.schema import ConfigError

from test_conformance import (BASES, SETTING, UNEQUAL, _close, _run, _sequential_equals_vectorized, _sim, _stack)
from test_momentum import _Alternating, _alternating

DRAWN = ("train.local_epochs=1", "train.local_epochs_max=3")
STRAGGLE = ("train.local_epochs=3", "train.stragglers=0.5")
DROP = STRAGGLE + ("train.drop_stragglers=true",)
ADAM = ("train.optimizer=adam", "train.lr=0.01")
FOUR = ("fedavg", "fedprox", "scaffold", "fednova")


# --------------------------------------------------------------------------- the plan


def test_drawn_epochs_are_in_range_deterministic_and_cover_the_range():
    work = LocalWork(2, 5)
    seen = set()
    for r in range(1, 30):
        plan = plan_round(work, 7, r, range(10))
        assert plan == plan_round(work, 7, r, list(range(10)))  # a pure function of (seed, round, client)
        assert plan.train == tuple(range(10)) and plan.stragglers == ()
        assert all(2 <= e <= 5 for e in plan.epochs.values())
        seen |= set(plan.epochs.values())
        # a client's draw does not depend on who else is sampled
        assert plan_round(work, 7, r, [3, 8]).epochs == {3: plan.epochs[3], 8: plan.epochs[8]}
    assert seen == {2, 3, 4, 5}
    assert plan_round(work, 7, 1, range(10)) != plan_round(work, 8, 1, range(10))
    assert plan_round(LocalWork(3, 3), 0, 1, [0, 4]).epochs == {0: 3, 4: 3}


@pytest.mark.parametrize("n, s, want", [(10, 0.9, 9), (10, 0.5, 5), (10, 0.3, 3), (10, 0.0, 0), (1, 0.5, 0),
                                        (3, 0.5, 1), (2, 0.5, 1), (4, 0.99, 3), (5, 0.1, 1), (7, 0.1, 1)])
def test_number_of_stragglers(n, s, want):
    # |S| - round((1 - s)|S|), half to even (3 * 0.5 = 1.5 -> 2 active, 5 * 0.9 = 4.5 -> 4 active), at least
    # one active client
    assert num_stragglers(n, s) == want


def test_stragglers_are_drawn_per_round_and_run_fewer_epochs():
    work = LocalWork(4, 6, stragglers=0.3)
    chosen = set()
    for r in range(1, 40):
        plan = plan_round(work, 0, r, range(10))
        full = plan_round(LocalWork(4, 6), 0, r, range(10)).epochs  # the E_i the stragglers fall short of
        assert len(plan.stragglers) == 3 and plan.train == tuple(range(10))
        assert plan == plan_round(work, 0, r, range(10))
        for c in range(10):
            if c in plan.stragglers:
                assert 1 <= plan.epochs[c] <= full[c] - 1
            else:
                assert plan.epochs[c] == full[c]
        chosen.add(plan.stragglers)
        dropped = plan_round(LocalWork(4, 6, 0.3, drop_stragglers=True), 0, r, range(10))
        assert dropped.stragglers == plan.stragglers  # the same stragglers whether dropped or kept (as Li et al.)
        assert dropped.train == tuple(c for c in range(10) if c not in plan.stragglers)
        assert dropped.epochs == {c: full[c] for c in dropped.train}
    assert len(chosen) > 20  # chosen anew each round


# --------------------------------------------------------------------------- fixed epochs: the plain path


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fixed_epochs_through_the_plan_are_the_plain_path_bit_for_bit(executor):
    plain = _sim(_stack("scaffold", extra=UNEQUAL + ("train.local_epochs=2",)), executor)
    planned = _sim(_stack("scaffold", extra=UNEQUAL + ("train.local_epochs=2", "train.local_epochs_max=2")), executor)
    assert plain.local_work is None and planned.local_work is not None  # b = E goes through the plan
    a, b = plain.run(), planned.run()
    assert torch.equal(a.final_flat, b.final_flat)
    drop = ("round_time_s",)
    assert [{k: v for k, v in h.items() if k not in drop} for h in a.history] == \
        [{k: v for k, v in h.items() if k not in drop} for h in b.history]


def test_local_step_metrics_are_the_clients_steps():
    sim = _sim(_stack("fedavg", extra=UNEQUAL + DRAWN))
    res = sim.run()
    sizes = [sim.executor.data.size(i) for i in range(6)]
    from fl_core.data.sampling import sample_clients

    for h in res.history:
        r = int(h["round"])
        sampled = sample_clients(6, 0.5, "bernoulli", 0, r).tolist()
        plan = plan_round(sim.local_work, 0, r, sampled)
        steps = [client_steps(sizes[c], 16, plan.epochs[c]) for c in plan.train]
        assert (h["local_steps_mean"], h["local_steps_min"], h["local_steps_max"]) == \
            (sum(steps) / len(steps), min(steps), max(steps))
        assert "stragglers" not in h
    assert any(h["local_steps_min"] < h["local_steps_max"] for h in res.history)


# --------------------------------------------------------------------------- both executors


@pytest.mark.parametrize("base", FOUR)
@pytest.mark.parametrize("work", [DRAWN, STRAGGLE, DROP], ids=["drawn", "stragglers", "dropped"])
def test_sequential_equals_vectorized_with_heterogeneous_steps(base, work):
    _sequential_equals_vectorized(_stack(base, extra=UNEQUAL + work))
    _sequential_equals_vectorized(_stack(base, extra=work))


def test_fednova_uses_each_clients_real_steps():
    seen = []
    sim = _sim(_stack("fednova", extra=DRAWN))
    orig = sim.algo.finish_client

    def spy(ctx, update):
        out = orig(ctx, update)
        seen.append((ctx.round.round, update.client_id, update.num_steps, float(out.extra["a"])))
        return out

    sim.algo.finish_client = spy
    sim.run()
    size = sim.executor.data.size(0)  # IID, 4 equal clients
    for r, cid, steps, a in seen:
        e = plan_round(sim.local_work, 0, r, range(4)).epochs[cid]
        assert steps == client_steps(size, 64, e) == a
    assert len({s for _, _, s, _ in seen}) > 1


def test_fednova_equals_fedavg_with_equal_steps_and_differs_with_drawn_ones():
    equal = ("train.local_epochs=2", "train.local_epochs_max=2")
    nova, _, _, _ = _run(_stack("fednova", extra=equal))
    avg, _, _, _ = _run(_stack("fedavg", extra=equal))
    assert _close(nova, avg)
    nova, hist, _, _ = _run(_stack("fednova", extra=DRAWN))
    avg, _, _, _ = _run(_stack("fedavg", extra=DRAWN))
    assert any(h["local_steps_min"] < h["local_steps_max"] for h in hist)
    assert float((nova - avg).abs().max()) > 1e-4


# --------------------------------------------------------------------------- stragglers


def test_straggler_counts_per_round_match_the_fraction():
    for extra in (("train.stragglers=0.3",), ("train.stragglers=0.3", "train.drop_stragglers=true")):
        _, hist, _, _ = _run(_stack("fedavg", extra=("partition.num_clients=10", "train.local_epochs=2") + extra))
        assert [h["stragglers"] for h in hist] == [3, 3]
        assert [h["num_clients"] for h in hist] == ([7, 7] if len(extra) == 2 else [10, 10])


def _spied(stack):
    """The simulator of ``stack`` and a list that gets (rctx, ids, updates) of every round's training."""
    sim = _sim(stack)
    calls = []
    orig = sim.executor.run_round

    def spy(rctx, ids, store):
        ups = orig(rctx, ids, store)
        calls.append((rctx, list(ids), ups))
        return ups

    sim.executor.run_round = spy
    return sim, calls


def test_dropped_stragglers_are_out_of_the_round_hand_checked():
    """Round 1 of FedAvg with dropped stragglers = the kept clients' weighted mean, trained by hand from the
    initial model; the stragglers are not trained, not in rctx.sampled, and send nothing (uplink)."""
    stack = _stack("fedavg", extra=("partition.num_clients=6", "train.rounds=1") + DROP)
    sim, calls = _spied(stack)
    g0 = copy.deepcopy(sim)._fresh_state()["global"]
    res = sim.run()
    (rctx, ids, ups), = calls
    plan = plan_round(sim.local_work, 0, 1, range(6))
    assert len(plan.stragglers) == 3 and ids == list(plan.train) and rctx.sampled == plan.train
    assert not set(ids) & set(plan.stragglers)
    ex = sim.executor
    n = torch.tensor([float(ex.data.size(c)) for c in ids], dtype=torch.float64)
    want = g0.clone()
    for c, w in zip(ids, n / n.sum()):
        m = copy.deepcopy(sim.model)
        load_flat(m, g0)
        m.train()
        for pos in batch_schedule(0, 1, c, ex.data.size(c), 64, 3):
            b = ex.data.indices[c][pos]
            for p in m.parameters():
                p.grad = None
            F.cross_entropy(m(ex.data.x[b]), ex.data.y[b]).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(p.grad, alpha=-0.05)
        want += w * (flatten_params(m) - g0)
    assert float((res.final_flat - want).abs().max()) <= 1e-12
    d = sim.spec.d
    assert res.history[0]["comm_up_floats"] == pytest.approx(3 * d / 6, rel=1e-12)  # 3 of 6 sampled sent d
    assert res.history[0]["comm_down_floats"] == d


def test_a_dropped_straggler_leaves_the_rules_state_alone(tmp_path):
    """SCAFFOLD, round 1 (all 6 clients sampled, 3 dropped): the checkpoint after round 1 holds a control variate
    c_i for the kept clients only, and c = sum of their Delta c_i / N (as if the dropped ones were not sampled)."""
    from fl_core.store import durable

    class Stop(Exception):
        pass

    def stop(r, row):
        raise Stop

    ck = tmp_path / "ck.pt"
    stack = _stack("scaffold", extra=("partition.num_clients=6", "engine.checkpoint_every=1") + DROP)
    sim, calls = _spied(stack)
    sim.checkpoint_path, sim.callbacks = ck, [stop]
    with pytest.raises(Stop):
        sim.run()
    (rctx, ids, ups), = calls
    plan = plan_round(sim.local_work, 0, 1, range(6))
    assert ids == list(plan.train) and len(plan.stragglers) == 3
    saved = durable.load(ck)
    assert sorted(saved["clients"]) == list(plan.train)
    want_c = torch.stack([u.extra["delta_c"] for u in ups]).sum(0) / 6
    assert float((saved["server"]["c"] - want_c.cpu()).abs().max()) <= 1e-15


def test_kept_stragglers_send_their_partial_work():
    sim, calls = _spied(_stack("fedprox", extra=("partition.num_clients=6",) + STRAGGLE))
    res = sim.run()
    size = sim.executor.data.size(0)
    for rctx, ids, ups in calls:
        plan = plan_round(sim.local_work, 0, rctx.round, range(6))
        assert ids == list(range(6)) and len(plan.stragglers) == 3
        for u in ups:
            e = 3 if u.client_id not in plan.stragglers else plan.epochs[u.client_id]
            assert u.num_steps == client_steps(size, 64, e)
            assert e < 3 or u.client_id not in plan.stragglers
    assert res.history[-1]["comm_up_floats"] == pytest.approx(2 * sim.spec.d, rel=1e-12)  # all 6 sent, 2 rounds
    kept, _, _, _ = _run(_stack("fedprox", extra=("partition.num_clients=6",) + STRAGGLE))
    dropped, _, _, _ = _run(_stack("fedprox", extra=("partition.num_clients=6",) + DROP))
    none, _, _, _ = _run(_stack("fedprox", extra=("partition.num_clients=6", "train.local_epochs=3")))
    assert not torch.equal(kept, dropped) and not torch.equal(kept, none) and not torch.equal(dropped, none)


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("stack", [_stack("fedavg", extra=UNEQUAL + DRAWN), _stack("scaffold", extra=UNEQUAL + DROP),
                                   _stack("fednova", extra=UNEQUAL + STRAGGLE + ("train.local_epochs_max=4",)),
                                   _stack("fedprox", extra=UNEQUAL + ADAM)])
def test_resumed_equals_uninterrupted(stack, tmp_path):
    class Stop(Exception):
        pass

    def stop_after_round_1(r, row):
        if r == 1:
            raise Stop

    ck = tmp_path / "ck.pt"
    extra = ("engine.checkpoint_every=1", "train.rounds=3")
    with pytest.raises(Stop):
        _sim(stack + extra, checkpoint_path=ck, callbacks=[stop_after_round_1]).run()
    res = _sim(stack + extra, checkpoint_path=ck).run()
    assert res.resumed_from == 1
    full = _sim(stack + ("train.rounds=3",)).run()
    assert torch.equal(res.final_flat, full.final_flat)

    def rows(h):
        return [{k: v for k, v in row.items() if k != "round_time_s"} for row in h]

    assert rows(res.history) == rows(full.history)


# --------------------------------------------------------------------------- adam


def test_adam_step_is_torch_adam_bit_for_bit_with_frozen_steps():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)).double()
    b = copy.deepcopy(a)
    opt = torch.optim.Adam(b.parameters(), lr=0.01, weight_decay=0.003, foreach=False)
    state = {}
    for step in range(6):
        x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
        for m in (a, b):
            for p in m.parameters():
                p.grad = None
            F.cross_entropy(m(x), y).backward()
            if step in (0, 3, 4):  # frozen before its first step, and later with moments
                m[2].bias.grad = None
        adam_step(list(a.named_parameters()), 0.01, 0.003, None, state)
        opt.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
        for n, p in b.named_parameters():
            if p in opt.state:
                assert state[n]["step"] == int(opt.state[p]["step"])
                assert torch.equal(state[n]["exp_avg"], opt.state[p]["exp_avg"])
                assert torch.equal(state[n]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert state["2.bias"]["step"] == 3


def test_adam_first_step_hand_computed():
    """Adam's first step moves every coordinate by lr * g / (|g| + eps / sqrt(1 - b2)) ~ lr * sign(g)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    p.grad = torch.tensor([0.5, -3.0], dtype=torch.float64)
    adam_step([("p", p)], 0.1, 0.0, {"p": torch.tensor([2.0, 1.0], dtype=torch.float64)}, {})
    # m = 0.1 g, v = 0.001 g^2 -> m / (1 - 0.9) = g, sqrt(v / (1 - 0.999)) = |g|; times s = (2, 1)
    want = torch.tensor([1.0 - 0.1 * 2 * 0.5 / (0.5 + 1e-8), -2.0 + 0.1 * 3.0 / (3.0 + 1e-8)], dtype=torch.float64)
    assert torch.allclose(p.detach(), want, rtol=0, atol=1e-15)


def _torch_adam(model, data, rctx, cid, *, batch_size, epochs, seed, weight_decay, mask=None):
    """Delta [d] of client ``cid`` trained by a new torch.optim.Adam for the round."""
    m = copy.deepcopy(model)
    load_flat(m, rctx.global_flat)
    m.train()
    params = list(m.parameters())
    opt = torch.optim.Adam(params, lr=rctx.lr, weight_decay=weight_decay, foreach=False)
    idx = data.indices[cid]
    for k, pos in enumerate(batch_schedule(seed, rctx.round, cid, data.size(cid), batch_size, epochs), start=1):
        for p, allowed in zip(params, mask(k) if mask else [True] * len(params)):
            p.requires_grad_(allowed)
        opt.zero_grad(set_to_none=True)
        b = idx[pos]
        logits, _ = m.forward_features(data.x[b])
        F.cross_entropy(logits, data.y[b]).backward()
        opt.step()
    return flatten_params(m) - rctx.global_flat


@pytest.mark.parametrize("alternating", [False, True])
def test_both_executors_train_a_client_as_a_new_torch_adam_per_round(alternating):
    sim = _sim(UNEQUAL)  # unequal K_i: the vectorised executor masks finished clients
    base = sim.executor
    algo = _Alternating() if alternating else FedAvg()
    kw = dict(batch_size=base.batch_size, local_epochs=base.local_epochs, seed=base.seed, weight_decay=0.01,
              optimizer="adam")
    seq = SequentialExecutor(sim.model, algo, base.data, **kw)
    vec = VectorizedExecutor(copy.deepcopy(sim.model), algo, base.data, **kw)
    ids = list(range(len(base.data.indices)))
    g = flatten_params(sim.model).clone()
    mask = (lambda k: _alternating(len(sim.spec.names), k)) if alternating else None
    for r in (1, 2):
        rctx = RoundContext(round=r, lr=0.01, lr0=0.01, global_flat=g, spec=sim.spec, num_clients=len(ids),
                            sampled=tuple(ids), epochs={c: 1 + (c + r) % 3 for c in ids})
        got_seq = seq.run_round(rctx, ids, ClientStateStore("cpu"))
        got_vec = vec.run_round(rctx, ids, ClientStateStore("cpu"))
        for u, v in zip(got_seq, got_vec):
            ref = _torch_adam(sim.model, base.data, rctx, u.client_id, batch_size=base.batch_size,
                              epochs=rctx.epochs[u.client_id], seed=base.seed, weight_decay=0.01, mask=mask)
            assert torch.equal(u.delta, ref), f"round {r} client {u.client_id}: sequential != torch.optim.Adam"
            assert float((v.delta - ref).abs().max()) <= 1e-12, f"round {r} client {u.client_id}: vectorised"
        g = g + torch.stack([u.delta for u in got_seq]).mean(0)


ADAM_REFUSED = {
    "scaffold": r"^train.optimizer=adam does not compose with algorithm.name=scaffold: .*; set train.optimizer=sgd$",
    "feddc": r"^train.optimizer=adam does not compose with algorithm.name=feddc: .*; set train.optimizer=sgd$",
    "fednova": r"^train.optimizer=adam does not compose with algorithm.name=fednova: .*; set train.optimizer=sgd$",
}


# every other base runs with the slow tests (all of them in CI); tests/test_conformance.py covers each base fast
@pytest.mark.parametrize("base", [pytest.param(b, marks=pytest.mark.slow) if i % 2 else b for i, b in enumerate(BASES)])
def test_every_base_with_adam_sequential_equals_vectorized_or_refuses(base):
    if base in ADAM_REFUSED:
        with pytest.raises(ConfigError, match=ADAM_REFUSED[base]):
            _sim(_stack(base, extra=ADAM))
        return
    _sequential_equals_vectorized(_stack(base, extra=ADAM + UNEQUAL))
    sgd, _, _, _ = _run(_stack(base, extra=("train.lr=0.01",)))
    adam, _, _, _ = _run(_stack(base, extra=ADAM))
    assert not torch.equal(sgd, adam), f"{base}: train.optimizer=adam changed nothing"


def test_fedbcgd_plus_code_variant_refuses_adam_and_the_paper_variant_takes_it():
    with pytest.raises(ConfigError, match=r"^train.optimizer=adam does not compose with "
                                          r"algorithm.fedbcgd.plus_variant=code: .*; set train.optimizer=sgd$"):
        _sim(_stack("fedbcgd_plus", extra=ADAM + ("algorithm.fedbcgd.plus_variant=code",)))
    _sim(_stack("fedbcgd_plus", extra=ADAM + ("algorithm.fedbcgd.plus_variant=paper",)))


def test_sgd_typed_is_the_plain_path_bit_for_bit():
    plain, _, _, _ = _run(_stack("fedavg", extra=UNEQUAL))
    typed, _, _, _ = _run(_stack("fedavg", extra=UNEQUAL + ("train.optimizer=sgd",)))
    assert torch.equal(plain, typed)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra, message", [
    (("train.drop_stragglers=true",),
     r"^train.drop_stragglers has no effect with train.stragglers=0.0: it is used only with train.stragglers!=0; "
     r"remove it$"),
    (("train.local_epochs=3", "train.local_epochs_max=2"),
     r"^train.local_epochs_max must be >= train.local_epochs \(3\), got 2$"),
    (("train.stragglers=0.5",),
     r"^train.stragglers=0.5 needs train.local_epochs >= 2 \(a straggler runs 1..E_i-1 epochs\), "
     r"got train.local_epochs=1$"),
    (("train.local_epochs=2", "train.stragglers=1.0"), r"^train.stragglers must be < 1, got 1$"),
    (("train.local_epochs_max=0",), r"^train.local_epochs_max must be >= 1, got 0$"),
    (("train.local_epochs_max=2.5",), r"train.local_epochs_max"),
    (("train.local_steps=3", "train.local_epochs_max=4"),
     r"^train.local_epochs_max counts local work in epochs; it does not compose with train.local_steps=3 "
     r"\(set train.local_steps=0\)$"),
    (("train.local_steps=3", "train.stragglers=0.5"),
     r"^train.stragglers counts local work in epochs; it does not compose with train.local_steps=3"),
    (("train.optimizer=adam", "train.momentum=0.9"),
     r"^train.momentum=0.9 does not compose with train.optimizer=adam: .*; set train.momentum=0$"),
    (("train.optimizer=adam", "train.momentum=0"),
     r"^train.momentum has no effect with train.optimizer=adam: it is used only with train.optimizer=sgd; "
     r"remove it$"),
    (("train.optimizer=rmsprop",), r"^train.optimizer must be one of sgd, adam, got 'rmsprop'$"),
])
def test_refusals_are_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as err:  # match: re.search
        compose(list(SETTING) + list(extra))
    assert "\n" not in str(err.value)


def test_local_work_refuses_bad_values_when_built_directly():
    with pytest.raises(ValueError, match=r"^train.stragglers needs train.local_epochs >= 2, got 1$"):
        LocalWork(1, stragglers=0.5)
    with pytest.raises(ValueError, match=r"^train.local_epochs_max must be >= train.local_epochs \(3\), got 2$"):
        LocalWork(3, 2)
    with pytest.raises(ValueError, match=r"^train.optimizer must be one of sgd, adam, got 'lbfgs'$"):
        SequentialExecutor(torch.nn.Linear(1, 1), FedAvg(), None, batch_size=1, local_epochs=1, optimizer="lbfgs")
