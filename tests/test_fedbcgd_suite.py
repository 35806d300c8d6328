"""FedBCGD, FedBCGD+ and FedDC (docs/algorithms.md, FedDC, FedBCGD, FedBCGD+, Communication accounting,
Invariants 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_core.algorithms import (ClientContext, ClientUpdate, FedBCGD, FedBCGDPlus, QSGD, RoundContext, assign_blocks,
                                block_partition, build_algorithm)
from fl_core.algorithms.base import Transformed
from fl_core.algorithms.compression import qsgd_floats
from fl_core.engine.state import ParamSpec
from fl_core.models import build_model
from fl_core.config import compose
from fl_core.data.sampling import sample_clients

from conftest import run_sim

MLP = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.min_size=5",
       "train.sampler=fixed", "train.participation=0.5"]


def _toy():
    """A 'model' of three parameters [2], [2], [1]: blocks {p0}, {p1}, shared {p2}; d = 5."""
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(2))
            self.b = torch.nn.Parameter(torch.zeros(2))
            self.head = torch.nn.Parameter(torch.zeros(1))

        def units(self):
            return [["a"], ["b"], ["head"]]

    m = Toy()
    return m, ParamSpec.from_model(m)


def test_block_averaging_by_hand_with_lambda_zero():
    model, spec = _toy()
    blocks, shared = block_partition(model, spec.names, 2, "units")
    assert blocks == [[0], [1]] and shared == [2]
    algo = FedBCGD(spec, blocks, shared, lam=0.0)
    sampled = (0, 1, 2, 3)
    owners = assign_blocks(sampled, 2, seed=7, round_idx=1)
    assert sorted(owners[0] + owners[1]) == [0, 1, 2, 3] and len(owners[0]) == 2
    deltas = {0: [1.0, 2.0, 3.0, 4.0, 5.0], 1: [3.0, 2.0, 1.0, 0.0, 1.0], 2: [0.0, 0.0, 2.0, 2.0, 3.0],
              3: [2.0, 8.0, 4.0, 6.0, -1.0]}
    rctx = RoundContext(round=1, lr=0.1, global_flat=torch.zeros(5), spec=spec, num_clients=4, sampled=sampled, seed=7)
    from fl_core.algorithms import ClientContext

    ups = []
    for c in sampled:
        u = ClientUpdate(c, 10, 1, torch.tensor(deltas[c]), 0.0)
        ups.append(algo.finish_client(ClientContext(rctx, c, 10, 1), u))
    for u in ups:  # each client uploads its block and the shared block only
        j = int(u.extra["block"])
        kept = [0, 1] if j == 0 else [2, 3]
        assert torch.equal(u.delta[kept], torch.tensor(deltas[u.client_id])[kept]) and u.delta[4] == deltas[u.client_id][4]
    new, st = algo.aggregate(rctx, algo.init_server_state(rctx.global_flat), ups)
    o0, o1 = owners
    exp_a = torch.tensor([deltas[c][:2] for c in o0]).mean(0)  # owners' mean for block 1
    exp_b = torch.tensor([deltas[c][2:4] for c in o1]).mean(0)  # owners' mean for block 2
    exp_s = torch.tensor([deltas[c][4] for c in sampled]).mean()  # all clients for the shared block
    assert torch.allclose(new, torch.cat([exp_a, exp_b, exp_s.view(1)]))


def test_block_partitions_of_the_paper_tables():
    cfg = compose(["model=std_cnn"]).model
    std = build_model(cfg, "cifar10", (3, 32, 32), 10)
    spec = ParamSpec.from_model(std)
    blocks, shared = block_partition(std, spec.names, 4, "auto")  # Table 7: conv1, conv2, fc1, fc2 + shared fc3
    assert [[spec.names[i] for i in b] for b in blocks][0] == ["conv1.weight", "conv1.bias"]
    assert [spec.names[i] for i in shared] == ["fc3.weight", "fc3.bias"]
    blocks, shared = block_partition(std, spec.names, 5, "code")  # repository: shared fc2 + fc3, two empty blocks
    assert [len(b) for b in blocks] == [2, 2, 2, 0, 0] and len(shared) == 4
    cfg18 = compose(["model=resnet18"]).model
    r18 = build_model(cfg18, "cifar10", (3, 32, 32), 10)
    spec18 = ParamSpec.from_model(r18)
    blocks, shared = block_partition(r18, spec18.names, 5, "paper")  # Table 9
    assert spec18.names[blocks[3][0]].startswith("layer4.0.") and [spec18.names[i] for i in shared] == ["fc.weight",
                                                                                                        "fc.bias"]


def test_fedbcgd_with_one_block_is_fedavgm_heavy_ball(digits):
    common = MLP + ["train.rounds=3"]
    _, bc = run_sim(digits, *common, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=1", "algorithm.fedbcgd.lam=0.5")
    _, m = run_sim(digits, *common, "algorithm=fedavgm", "algorithm.fedavgm.beta=0.5", "algorithm.aggregation=uniform")
    assert torch.allclose(bc.final_flat, m.final_flat, atol=1e-6)
    _, bc0 = run_sim(digits, *common, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=1", "algorithm.fedbcgd.lam=0.0")
    _, avg = run_sim(digits, *common, "algorithm=fedavg", "algorithm.aggregation=uniform")
    assert torch.allclose(bc0.final_flat, avg.final_flat, atol=1e-6)


def test_fedbcgd_uplink_is_counted_from_the_blocks_sent(digits):
    """|S| = 3 clients over N = 2 blocks: the measured uplink is the mean of what each client sends (its block
    and the shared block), not the closed form (d - #shared) / N + #shared, which assumes equal owner counts;
    the balanced dealing gives the extra owner to each block in turn, so two rounds add up to the closed form."""
    sim, res = run_sim(digits, *MLP, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2", "train.rounds=2",
                       "train.sampler=fixed")
    d = sim.spec.d
    shared = sim.algo.shared_floats  # the MLP's classifier fc3: 200 * 10 + 10
    assert shared == 2010 and d == 13000 + 40200 + shared  # blocks: fc1 64 * 200 + 200, fc2 200 * 200 + 200
    counts = [[len(o) for o in assign_blocks([int(c) for c in sample_clients(6, 0.5, "fixed", 0, r)], 2, 0, r)]
              for r in (1, 2)]
    # seed 0, fixed sampler, 3 of 6 clients: one client owns fc1 and two fc2 in round 1, the other way in round 2
    assert counts == [[1, 2], [2, 1]]
    round1 = ((13000 + 2010) + 2 * (40200 + 2010)) / 3
    round2 = (2 * (13000 + 2010) + (40200 + 2010)) / 3
    assert res.history[0]["comm_up_floats"] == pytest.approx(round1, rel=1e-12)
    assert res.history[1]["comm_up_floats"] == pytest.approx(round1 + round2, rel=1e-12)
    closed = (d - shared) / 2 + shared
    assert round1 == pytest.approx(closed * 1.1585, rel=1e-4)  # a round alone is 15.8% off the closed form
    assert round1 + round2 == pytest.approx(2 * closed, rel=1e-12)
    assert res.history[1]["comm_down_floats"] == 2 * d


def test_fedbcgd_freezing_ablation_moves_only_own_block(digits):
    sim, res = run_sim(digits, *MLP, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2",
                       "algorithm.fedbcgd.freezing=true", "train.rounds=1")
    _, full = run_sim(digits, *MLP, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2", "train.rounds=1")
    algo = sim.algo
    rctx = RoundContext(round=1, lr=0.05, global_flat=res.final_flat, spec=sim.spec, num_clients=6,
                        sampled=(0, 2, 4, 5), seed=sim.seed)
    for cid in rctx.sampled:  # the trainable tensors are exactly the client's block and the shared block
        j = algo._block_of(rctx, cid)
        ctx = ClientContext(rctx, cid, 10, 1)
        algo.client_begin(ctx, probe=None)
        mask = ctx.step_mask(1)
        assert [i for i, m in enumerate(mask) if m] == sorted(algo.block_params[j] + algo.shared_params)
    # training only the own block changes what the clients upload, hence the model
    assert not torch.allclose(res.final_flat, full.final_flat, atol=1e-4)


# ----------------------------------------------------------------------------- FedBCGD+ (docs/algorithms.md, FedBCGD+)

def _plus(variant="paper", lam=0.0):
    model, spec = _toy()
    blocks, shared = block_partition(model, spec.names, 2, "units")
    return FedBCGDPlus(spec, blocks, shared, lam=lam, variant=variant), spec


def test_fedbcgd_plus_paper_gradient_by_hand():
    """v = g(y; xi) - g(x; xi) + g_full - c_k + c on every trainable tensor."""
    algo, spec = _plus("paper")
    rctx = RoundContext(round=2, lr=0.1, global_flat=torch.zeros(5), spec=spec, num_clients=4, sampled=(0, 1),
                        extra={"c": torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0])})
    ctx = ClientContext(rctx, 0, 10, 4, state={"c": torch.tensor([0.5, 0.0, 1.0, 0.0, 1.0])})
    ctx.full_grad = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    ctx.anchor_grads = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0, 0.0]), "head": torch.tensor([0.5])}
    grads = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 1.0]), "head": torch.tensor([1.0])}
    algo.local_step(ctx, 1, {}, grads)
    assert torch.allclose(grads["a"], torch.tensor([3 - 1 + 0.1 - 0.5 + 1, 4 - 1 + 0.2 - 0 + 1]))
    assert torch.allclose(grads["b"], torch.tensor([0 - 2 + 0.3 - 1 + 2, 1 - 0 + 0.4 - 0 + 2]))
    assert torch.allclose(grads["head"], torch.tensor([1 - 0.5 + 0.5 - 1 + 3]))


def test_fedbcgd_plus_server_control_variates_by_hand():
    """paper: c += (1/M) sum Delta c (block j from its owners, shared from all); code: c += p * blockmean(s_k)."""
    sampled = (0, 1, 2, 3)
    for variant in ("paper", "code"):
        algo, spec = _plus(variant)
        c0 = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0])
        rctx = RoundContext(round=1, lr=0.5, global_flat=torch.zeros(5), spec=spec, num_clients=8, sampled=sampled,
                            seed=3, extra={"c": c0})
        owners = assign_blocks(sampled, 2, seed=3, round_idx=1)
        grads = {c: torch.arange(5, dtype=torch.float32) * (c + 1) for c in sampled}
        deltas = {c: -torch.ones(5) * (c + 1) for c in sampled}
        ups = []
        for c in sampled:
            state = {"c": torch.full((5,), 0.25)}
            if variant == "paper":  # what the server last received of c_k
                state["c_up"] = torch.full((5,), 0.125)
            ctx = ClientContext(rctx, c, 10, 2, state=state)
            ctx.full_grad = grads[c]
            ups.append(algo.finish_client(ctx, ClientUpdate(c, 10, 2, deltas[c].clone(), 0.0)))
            if variant == "paper":  # c_k <- g_full on every coordinate; c_up only on the uploaded ones
                assert torch.equal(ctx.state["c"], grads[c])
                keep = algo.block_masks[int(ups[-1].extra["block"])] | algo.shared_mask
                assert torch.equal(ctx.state["c_up"], torch.where(keep, grads[c], torch.full((5,), 0.125)))
            else:  # c_k+ = c_k - c + (x - y) / (K eta)
                assert torch.allclose(ctx.state["c"], 0.25 - c0 + (c + 1) / (2 * 0.5))
        _, st = algo.aggregate(rctx, algo.init_server_state(rctx.global_flat), ups)
        if variant == "paper":
            sent = {c: grads[c] - 0.125 for c in sampled}
            exp = torch.cat([sum(sent[c][:2] for c in owners[0]) / 8, sum(sent[c][2:4] for c in owners[1]) / 8,
                             sum(sent[c][4:] for c in sampled) / 8])
        else:
            sent = {c: 0.25 - c0 + (c + 1) / (2 * 0.5) - c0 for c in sampled}  # s_k = c_k+ - c
            p = 4 / 8
            exp = p * torch.cat([sum(sent[c][:2] for c in owners[0]) / 2, sum(sent[c][2:4] for c in owners[1]) / 2,
                                 sum(sent[c][4:] for c in sampled) / 4])
        # the server state starts at c = 0 here (init_server_state), the broadcast c0 only enters the clients
        assert torch.allclose(st["c"], exp), variant


FULL_BATCH = MLP + ["train.batch_size=1000", "train.rounds=1", "algorithm.fedbcgd.blocks=2"]


@pytest.mark.parametrize("variant,extra", [("paper", FULL_BATCH), ("code", MLP + ["train.rounds=1",
                                                                                 "algorithm.fedbcgd.blocks=2"])])
def test_fedbcgd_plus_round_one_is_fedbcgd(digits, variant, extra):
    """With c = c_k = 0 the code variant's first round is FedBCGD's; so is the paper variant's when every
    step sees the whole local data (the SVRG term g(y) - g(x) + g_full is then g(y))."""
    _, plus = run_sim(digits, *extra, "algorithm=fedbcgd_plus", f"algorithm.fedbcgd.plus_variant={variant}",
                      "train.local_epochs=2")
    _, bc = run_sim(digits, *extra, "algorithm=fedbcgd", "train.local_epochs=2")
    assert torch.allclose(plus.final_flat, bc.final_flat, atol=1e-6)


def test_fedbcgd_plus_paper_first_step_and_control_variate(digits):
    """One local step (E = 1, B >= n_i): y = x - eta g_full; the client's c_k becomes g_full, computed here
    independently with autograd over the client's whole data."""
    from fl_core.engine.state import ClientStateStore, load_flat

    sim, _ = run_sim(digits, *FULL_BATCH, "algorithm=fedbcgd_plus", "train.local_epochs=1")
    g0 = sim._fresh_state()["global"]
    algo, ex = sim.algo, sim.executor
    rctx = RoundContext(round=1, lr=0.05, global_flat=g0, spec=sim.spec, num_clients=6, sampled=(1, 3, 4), seed=sim.seed,
                        extra=algo.broadcast(algo.init_server_state(g0)))
    store = ClientStateStore()
    ups = ex.run_round(rctx, list(rctx.sampled), store)
    for u in ups:
        load_flat(sim.model, g0)
        ix = ex.data.indices[u.client_id]
        loss = torch.nn.functional.cross_entropy(sim.model(ex.data.x[ix]), ex.data.y[ix])
        g_full = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(sim.model.parameters()))])
        keep = algo.block_masks[int(u.extra["block"])] | algo.shared_mask
        assert torch.allclose(u.delta, torch.where(keep, -0.05 * g_full, torch.zeros_like(g_full)), atol=1e-6)
        assert torch.allclose(u.extra["delta_c"], torch.where(keep, g_full, torch.zeros_like(g_full)), atol=1e-6)
        assert torch.allclose(store.get(u.client_id, lambda: None)["c"], g_full, atol=1e-6)


def test_fedbcgd_plus_server_c_is_the_mean_of_what_clients_uploaded(digits):
    """SCAFFOLD's invariant c = (1/M) sum_k c_up_k after several rounds with changing blocks (docs/algorithms.md,
    FedBCGD+)."""
    from fl_core.engine.state import ClientStateStore

    sim, _ = run_sim(digits, *MLP, "algorithm=fedbcgd_plus", "algorithm.fedbcgd.blocks=2", "train.rounds=1")
    algo, ex = sim.algo, sim.executor
    st = sim._fresh_state()
    g, server = st["global"], st["server"]
    store = ClientStateStore()
    for r, sampled in enumerate([(0, 1, 2, 3), (1, 2, 4, 5), (0, 3, 4, 5)], start=1):
        rctx = RoundContext(round=r, lr=0.05, global_flat=g, spec=sim.spec, num_clients=6, sampled=sampled,
                            seed=sim.seed, extra=algo.broadcast(server))
        ups = ex.run_round(rctx, list(sampled), store)
        g, server = algo.aggregate(rctx, server, ups)
    c_up = sum(state["c_up"] for _, state in store.items())
    assert torch.allclose(server["c"], c_up / 6, atol=1e-6)
    assert not torch.allclose(sum(state["c"] for _, state in store.items()) / 6, server["c"], atol=1e-3)


def test_qsgd_quantises_the_fedbcgd_plus_control_variate_upload():
    algo, spec = _plus("paper")
    q = Transformed(algo, QSGD(4))
    rctx = RoundContext(round=1, lr=0.1, global_flat=torch.zeros(5), spec=spec, num_clients=4, sampled=(0, 1),
                        extra={"c": torch.zeros(5)})
    ctx = ClientContext(rctx, 0, 10, 2, state={"c": torch.zeros(5), "c_up": torch.zeros(5)})
    ctx.full_grad = torch.tensor([0.3, -0.7, 0.2, 0.9, 0.4])
    up = q.finish_client(ctx, ClientUpdate(0, 10, 2, torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5]), 0.0))
    keep = (algo.block_masks[int(up.extra["block"])] | algo.shared_mask)
    for v, raw in ((up.extra["delta_c"], torch.where(keep, ctx.full_grad, torch.zeros(5))),):
        assert torch.all(v[~keep] == 0)
        levels = v / torch.linalg.vector_norm(raw) * 4  # on the grid ||v|| * xi / s
        assert torch.allclose(levels, levels.round(), atol=1e-5) and not torch.equal(v, raw)
    blk = (5 - 1) / 2 + 1  # (d - #shared) / N + #shared
    assert algo.comm_floats(5) == (2 * blk, 10.0)
    assert q.comm_floats(5) == (pytest.approx(2 * qsgd_floats(blk, 4)), 10.0)


# ------------------------------------------------- every algorithm (docs/algorithms.md, Communication accounting)

def _expected_floats(name, d, algo):
    if name in ("scaffold", "feddc"):
        return 2 * d, 2 * d
    if name == "fednova":
        return d + 1, d
    if name == "fedbcgd":
        return (d - algo.shared_floats) / algo.num_blocks + algo.shared_floats, d
    if name == "fedbcgd_plus":
        return 2 * ((d - algo.shared_floats) / algo.num_blocks + algo.shared_floats), 2 * d
    if name == "topk":
        return 2 * round(0.1 * d), d
    if name in ("qsgd", "fedpaq"):
        return d * (1 + 5) / 32 + 1, d  # s = 16 levels: 5 bits for xi, 1 sign bit, + the norm
    return d, d  # FedAvg, FedProx, FedExP, FedDecorr, FedRS, FedLC, FedAvgM, FedAdam/Yogi/Adagrad, FedDyn, wrappers


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "algorithm").glob("*.yaml")))
def test_comm_floats_of_every_algorithm_match_section_13(name):
    cfg = compose(["model=mlp", f"algorithm={name}"])
    model = build_model(cfg.model, "digits", (1, 8, 8), 10)
    spec = ParamSpec.from_model(model)
    algo = build_algorithm(cfg.algorithm, spec, model)
    inner = algo
    while hasattr(inner, "base"):
        inner = inner.base
    up, down = algo.comm_floats(spec.d)
    assert (up, down) == tuple(pytest.approx(v) for v in _expected_floats(name, spec.d, inner))


def test_feddc_first_round_server_model(digits):
    """Round 1 from zero states: the server model is mean_S theta_i + (1/N) sum_S Delta_i."""
    _, dc = run_sim(digits, *MLP, "algorithm=feddc", "algorithm.feddc.alpha=0.0", "train.rounds=1")
    _, avg = run_sim(digits, *MLP, "algorithm=fedavg", "algorithm.aggregation=uniform", "train.rounds=1")
    # alpha = 0 and g = g_i = 0: local training is FedAvg's; the server adds the mean drift over all N
    sim, _ = run_sim(digits, *MLP, "algorithm=fedavg", "train.rounds=1")
    g0 = sim._fresh_state()["global"]
    S = 3  # fixed sampler: round(0.5 * 6) clients
    N = 6
    mean_delta = avg.final_flat - g0
    assert torch.allclose(dc.final_flat, g0 + mean_delta + S * mean_delta / N, atol=1e-6)
