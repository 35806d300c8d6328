"""FedBCGD's dealing of the round's clients to the N client-blocks (docs/algorithms.md, FedBCGD;
fl_core/algorithms/fedbcgd.py, module docstring, Dealing): floor/ceil(|S|/N) owners per block, the extra owners
rotating from a seeded start, so every block is trained equally often over rounds."""

from __future__ import annotations

import math

import pytest
import torch

from fl_core.algorithms import FedBCGD, FedBCGDPlus, RoundContext, assign_blocks, block_partition, build_algorithm
from fl_core.algorithms.fedbcgd import deal_start
from fl_core.config import compose
from fl_core.data.sampling import sample_clients
from fl_core.engine.state import ParamSpec
from fl_core.models import build_model
from fl_core.schema import ConfigError

from conftest import run_sim
from test_fedbcgd_suite import _toy  # parameters [2], [2], [1]: blocks {a}, {b}, shared {head}

ROUNDS = 1000
# the MLP of test_fedbcgd_suite: blocks fc1 (64 * 200 + 200) and fc2 (200 * 200 + 200), shared fc3 (200 * 10 + 10)
MLP = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.min_size=5",
       "train.sampler=fixed", "train.participation=0.5", "algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2"]
FC1, FC2, FC3 = 13000, 40200, 2010


def _counts(num_sampled, num_blocks, seed, r, dealing="balanced"):
    return [len(o) for o in assign_blocks(list(range(100, 100 + num_sampled)), num_blocks, seed, r, dealing)]


@pytest.mark.parametrize("num_blocks", [4, 5])
@pytest.mark.parametrize("num_sampled", [3, 7, 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_block_gets_its_share_of_owners_over_1000_rounds(num_sampled, num_blocks, seed):
    totals = [0] * num_blocks
    lo, hi = num_sampled // num_blocks, -(-num_sampled // num_blocks)
    for r in range(1, ROUNDS + 1):
        counts = _counts(num_sampled, num_blocks, seed, r)
        assert sum(counts) == num_sampled and all(c in (lo, hi) for c in counts), (r, counts)
        totals = [t + c for t, c in zip(totals, counts)]
    fair = ROUNDS * num_sampled / num_blocks
    assert all(abs(t - fair) <= 0.03 * fair for t in totals), totals
    # the cyclic pointer is stricter than the 3%: with constant |S| no block is more than one owner off
    assert max(totals) - min(totals) <= 1, totals


@pytest.mark.parametrize("num_blocks", [4, 5])
@pytest.mark.parametrize("num_sampled", [3, 7, 10])
def test_round_robin_keeps_the_repository_dealing(num_sampled, num_blocks):
    """``round_robin``: the client at shuffled position t owns block t mod N every round (the old dealing,
    written out here); its extra owners always go to the low blocks."""
    sampled = list(range(100, 100 + num_sampled))
    totals = [0] * num_blocks
    for r in range(1, 51):
        order = torch.randperm(num_sampled, generator=_gen(3, r)).tolist()
        old = [[sampled[order[t]] for t in range(j, num_sampled, num_blocks)] for j in range(num_blocks)]
        assert assign_blocks(sampled, num_blocks, 3, r, "round_robin") == old
        totals = [t + len(o) for t, o in zip(totals, old)]
    m = num_sampled % num_blocks
    assert totals == [50 * (num_sampled // num_blocks + (j < m)) for j in range(num_blocks)]


def _gen(seed, r):
    from fl_core.seeding import torch_generator

    return torch_generator("fedbcgd", seed, r)


@pytest.mark.parametrize("num_blocks", [4, 5])
@pytest.mark.parametrize("num_sampled", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_fewer_clients_than_blocks_every_block_is_trained_in_every_window(num_sampled, num_blocks, seed):
    window = math.ceil(num_blocks / num_sampled)
    owned = [{j for j, c in enumerate(_counts(num_sampled, num_blocks, seed, r)) if c} for r in range(1, 201)]
    for start in range(len(owned) - window + 1):
        assert set().union(*owned[start:start + window]) == set(range(num_blocks)), (start, owned[start:start + window])
    # the repository's round robin never trains blocks |S| + 1 .. N
    rr = set().union(*({j for j, c in enumerate(_counts(num_sampled, num_blocks, seed, r, "round_robin")) if c}
                       for r in range(1, 201)))
    assert rr == set(range(num_sampled))


def test_bernoulli_rounds_are_balanced_in_expectation():
    """|S| varies by round (10 clients, p = 0.5): every block still gets |S|/N owners per round on average."""
    num_blocks, totals, sizes = 3, [0, 0, 0], 0
    for r in range(1, ROUNDS + 1):
        sampled = [int(c) for c in sample_clients(10, 0.5, "bernoulli", 1, r)]
        counts = [len(o) for o in assign_blocks(sampled, num_blocks, 1, r)]
        assert max(counts) - min(counts) <= 1
        totals = [t + c for t, c in zip(totals, counts)]
        sizes += len(sampled)
    fair = sizes / num_blocks
    assert all(abs(t - fair) <= 0.03 * fair for t in totals), (totals, fair)


def test_the_dealing_is_a_function_of_seed_round_and_sampled():
    sampled = (2, 5, 7, 8, 11, 13, 17)
    first = [assign_blocks(sampled, 4, 9, r) for r in range(1, 30)]
    again = [assign_blocks(sampled, 4, 9, r) for r in reversed(range(1, 30))][::-1]  # no hidden state: any order
    assert first == again
    for owners in first:
        assert sorted(c for o in owners for c in o) == list(sampled)
    # the start is seeded: over seeds every block is the first to get an extra owner
    assert {deal_start(7, 4, seed, 1) for seed in range(40)} == {0, 1, 2, 3}
    # with |S| a multiple of N there are no extra owners: balanced is round_robin exactly
    for r in range(1, 10):
        assert assign_blocks(sampled[:4], 4, 9, r) == assign_blocks(sampled[:4], 4, 9, r, "round_robin")
    # the pointer advances by |S| mod N each round
    assert all((deal_start(7, 4, 9, r + 1) - deal_start(7, 4, 9, r)) % 4 == 3 for r in range(1, 30))


def test_the_rule_deals_with_assign_blocks_and_fedbcgd_plus_shares_it():
    cfg = compose(["model=mlp", "algorithm=fedbcgd_plus", "algorithm.fedbcgd.blocks=2",
                   "algorithm.fedbcgd.dealing=round_robin"])
    model = build_model(cfg.model, "digits", (1, 8, 8), 10)
    spec = ParamSpec.from_model(model)
    plus = build_algorithm(cfg.algorithm, spec, model)
    assert isinstance(plus, FedBCGDPlus) and plus.dealing == "round_robin"
    blocks, shared = block_partition(model, spec.names, 2, "units")
    for algo, dealing in ((plus, "round_robin"), (FedBCGD(spec, blocks, shared), "balanced")):
        for r in (1, 2, 3):
            rctx = RoundContext(round=r, lr=0.1, global_flat=torch.zeros(spec.d), spec=spec, num_clients=6,
                                sampled=(0, 2, 3), seed=4)
            assert algo._owners(rctx) == assign_blocks((0, 2, 3), 2, 4, r, dealing)


def test_unknown_dealing_is_one_line_naming_the_key():
    msg = r"^algorithm.fedbcgd.dealing must be one of balanced, round_robin, got 'fair'$"
    with pytest.raises(ConfigError, match=msg):
        assign_blocks((0, 1, 2), 2, 0, 1, "fair")
    _, spec = _toy()
    with pytest.raises(ConfigError, match=msg):
        FedBCGD(spec, [[0], [1]], [2], dealing="fair")
    for preset in ("fedbcgd", "fedbcgd_plus"):  # the config is refused when it is composed
        with pytest.raises(ConfigError, match=msg):
            compose(["model=mlp", f"algorithm={preset}", "algorithm.fedbcgd.dealing=fair"])


def test_measured_uplink_equals_a_hand_count(digits):
    """|S| = 3 of 6 clients (fixed sampler, seed 0) over the MLP's N = 2 blocks for 4 rounds: the engine's
    uplink is, round by round, the mean over the clients of (their block + the shared block), with the owner
    counts written out by hand; the extra owner alternates between fc1 and fc2."""
    sim, res = run_sim(digits, *MLP, "train.rounds=4")
    assert sim.algo.dealing == "balanced" and sim.algo.shared_floats == FC3
    assert sim.spec.d == FC1 + FC2 + FC3
    counts = []
    for r in range(1, 5):
        sampled = [int(c) for c in sample_clients(6, 0.5, "fixed", 0, r)]
        counts.append([len(o) for o in assign_blocks(sampled, 2, 0, r)])
    assert counts == [[1, 2], [2, 1], [1, 2], [2, 1]]  # seed 0 starts the pointer at block 2
    per_round = {(1, 2): (1 * (FC1 + FC3) + 2 * (FC2 + FC3)) / 3, (2, 1): (2 * (FC1 + FC3) + 1 * (FC2 + FC3)) / 3}
    total = 0.0
    for r, c in enumerate(counts):
        total += per_round[tuple(c)]
        assert res.history[r]["comm_up_floats"] == pytest.approx(total, rel=1e-12)
    # two rounds deal the extra owner once to each block: the count is the closed form every second round
    up, down = sim.algo.comm_floats(sim.spec.d)
    assert res.history[1]["comm_up_floats"] == pytest.approx(2 * up, rel=1e-12)
    assert res.history[3]["comm_up_floats"] == pytest.approx(4 * up, rel=1e-12)
    assert res.history[3]["comm_down_floats"] == 4 * down == 4 * sim.spec.d
    # the repository's round robin gives fc1 (the smaller block here) two owners every round
    _, rr = run_sim(digits, *MLP, "train.rounds=4", "algorithm.fedbcgd.dealing=round_robin")
    assert rr.history[3]["comm_up_floats"] == pytest.approx(4 * per_round[(2, 1)], rel=1e-12)


def test_a_resumed_run_deals_as_the_uninterrupted_one(digits, tmp_path):
    """|S| = 3 over N = 2 (a pointer that moves every round), stopped after round 2 and resumed."""
    class Stop(Exception):
        pass

    def stop_after_2(r, row):
        if r == 2:
            raise Stop

    common = (*MLP, "train.rounds=4", "engine.checkpoint_every=1")
    _, ref = run_sim(digits, *common)
    ck = tmp_path / "ck.pt"
    with pytest.raises(Stop):
        run_sim(digits, *common, checkpoint_path=ck, callbacks=[stop_after_2])
    _, res = run_sim(digits, *common, checkpoint_path=ck)
    assert res.resumed_from == 2
    assert torch.equal(res.final_flat, ref.final_flat)
    assert [h["comm_up_floats"] for h in res.history] == [h["comm_up_floats"] for h in ref.history]
