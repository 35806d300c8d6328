"""FedBCGD and FedDC (ALGORITHMS.md 4.10, 7.1, 13, 14 item 8)."""

from __future__ import annotations

import torch

from fl_core.algorithms import ClientUpdate, FedBCGD, RoundContext, assign_blocks, block_partition
from fl_core.engine.state import ParamSpec
from fl_core.models import build_model
from fl_core.config import compose

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


def test_fedbcgd_uploads_about_d_over_n(digits):
    sim, res = run_sim(digits, *MLP, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2", "train.rounds=2")
    d = sim.spec.d
    shared = sim.algo.shared_floats  # the MLP's classifier fc3: 200 * 10 + 10
    assert shared == 2010
    assert res.history[0]["comm_up_floats"] == (d - shared) / 2 + shared
    assert res.history[1]["comm_down_floats"] == 2 * d


def test_fedbcgd_freezing_ablation_moves_only_own_block(digits):
    sim, res = run_sim(digits, *MLP, "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2",
                       "algorithm.fedbcgd.freezing=true", "train.rounds=1")
    assert res.history[-1]["train_loss"] > 0


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
