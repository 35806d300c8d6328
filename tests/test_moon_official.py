"""MOON against an independent plain-torch loop of the authors' algorithm (QinbinLi/MOON, main.py at 8fcba3c:
``init_nets``, ``train_net_fedcon``, ``local_train_net`` and the ``moon`` branch of ``__main__``), written here
without the engine: one network per client, each round the sampled clients load the global model and train with
torch.optim.SGD (fresh each round) on CE + mu * CE(cosine logits / tau, positive first), their negatives taken from
the pool of the previous round's networks of ALL clients (empty in round 1: no negative); the server takes the
weighted mean of the trained networks; then the pool becomes a copy of every client's network (model_buffer_size 1).

What the loop shares with the engine is only what the comparison needs to be exact: the data, the partition, the
sampled clients (``sample_clients``), each client's batch order (``batch_schedule``; the authors' DataLoader drops
the last partial batch, the engine keeps it) and the documented initial networks (the global one from
``derive_seed("init", seed)``, client i's from ``derive_seed("moon-init", seed, i)``, each by ``manual_seed`` and
``reset_parameters`` in module order). Partial participation 0.5, 3 rounds, float64, |diff| <= 1e-6 on the global
model, with and without the projection head (whose classifier, unlike the authors', stays on the features), both
executors; local momentum 0 and 0.9 (the latter once ``train.momentum`` exists).
"""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F

from fl_core.config import compose
from fl_core.data.sampling import sample_clients
from fl_core.engine.executors import batch_schedule
from fl_core.params import flatten_params
from fl_core.seeding import derive_seed

from conftest import run_sim

SEED, ROUNDS, MU, TAU, LR, WD, B, E, N = 3, 3, 5.0, 0.5, 0.05, 0.01, 32, 1, 6
SETTING = ("algorithm=moon", f"algorithm.moon.mu={MU}", f"algorithm.moon.tau={TAU}", "model=mlp", "model.hidden=8",
           "partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "partition.min_size=5",
           f"partition.num_clients={N}", "train.participation=0.5", "train.sampler=fixed", f"train.rounds={ROUNDS}",
           f"train.local_epochs={E}", f"train.batch_size={B}", f"train.lr={LR}", f"train.weight_decay={WD}",
           "engine.dtype=float64", f"seed={SEED}")
TOL = 1e-6


def has_momentum() -> bool:
    return "momentum" in compose([]).train


def momentum_args(momentum: float):
    if momentum and not has_momentum():
        pytest.skip("train.momentum (local SGD momentum) is not in the config schema yet")
    return [f"train.momentum={momentum}"] if has_momentum() else []


def _init(net: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``net`` initialised as documented: manual_seed(seed), then reset_parameters of every submodule in order."""
    torch.manual_seed(seed)
    for m in net.modules():
        if m is not net and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return net


def _representation(net: torch.nn.Module, x: torch.Tensor, head: bool):
    """(logits, z): the classifier on the features; z the head's projection of them, or the features."""
    logits, h = net.forward_features(x)
    return logits, (net.moon_head(h) if head else h)


def official_moon(sim, head: bool, momentum: float) -> torch.Tensor:
    """The authors' MOON loop on ``sim``'s data and partition; returns the final global model [d]."""
    data = sim.executor.data
    template = copy.deepcopy(sim.model)
    with torch.random.fork_rng(devices=[]):
        global_net = _init(copy.deepcopy(template), derive_seed("init", SEED))
        nets = {k: _init(copy.deepcopy(template), derive_seed("moon-init", SEED, k)) for k in range(N)}
    pool = []  # old_nets_pool: the previous rounds' networks of all clients (model_buffer_size = 1)
    for r in range(1, ROUNDS + 1):
        party = sample_clients(N, 0.5, "fixed", SEED, r).tolist()
        global_net.eval()
        global_w = copy.deepcopy(global_net.state_dict())
        for k in party:
            net = nets[k]
            net.load_state_dict(global_w)
            net.train()
            previous = [old[k] for old in pool]
            opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum, weight_decay=WD)
            idx = data.indices[k]
            for pos in batch_schedule(SEED, r, k, len(idx), B, E):
                x, y = data.x[idx[pos]], data.y[idx[pos]]
                opt.zero_grad()
                out, z = _representation(net, x, head)
                with torch.no_grad():
                    z_glob = _representation(global_net, x, head)[1]
                logits = F.cosine_similarity(z, z_glob, dim=-1).reshape(-1, 1)
                for prev in previous:
                    with torch.no_grad():
                        z_prev = _representation(prev, x, head)[1]
                    logits = torch.cat([logits, F.cosine_similarity(z, z_prev, dim=-1).reshape(-1, 1)], dim=1)
                logits = logits / TAU
                labels = torch.zeros(x.shape[0], dtype=torch.long)
                loss = F.cross_entropy(out, y) + MU * F.cross_entropy(logits, labels)
                loss.backward()
                opt.step()
        sizes = torch.tensor([float(len(data.indices[k])) for k in party], dtype=torch.float64)
        freqs = sizes / sizes.sum()
        new_w = {key: sum(f * nets[k].state_dict()[key] for f, k in zip(freqs, party)) for key in global_w}
        global_net.load_state_dict(new_w)
        old = copy.deepcopy(nets)
        for net in old.values():
            net.eval()
        pool = [old]  # round 1 appends to the empty pool, later rounds replace (FIFO with one slot)
    return flatten_params(global_net)


_SIMS = {}  # (head, momentum) -> a simulator of that setting (its data, partition and model structure)


@lru_cache(maxsize=None)
def _official(head: bool, momentum: float) -> torch.Tensor:
    return official_moon(_SIMS[(head, momentum)], head, momentum)


def _engine(digits, head: bool, momentum: float, executor: str, *extra):
    args = [*SETTING, *momentum_args(momentum), f"engine.executor={executor}", *extra]
    if head:
        args.append("algorithm.moon.projection_dim=4")
    sim, res = run_sim(digits, *args)
    _SIMS.setdefault((head, momentum), sim)
    return sim, res


def test_the_setting_has_first_time_participants_after_round_one():
    seen, late = set(), set()
    for r in range(1, ROUNDS + 1):
        party = set(sample_clients(N, 0.5, "fixed", SEED, r).tolist())
        if r > 1:
            late |= party - seen
        seen |= party
    assert late  # clients whose previous model is their own initial network


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("head", [False, True], ids=["features", "head"])
@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_moon_is_the_authors_loop(digits, executor, head, momentum):
    sim, res = _engine(digits, head, momentum, executor)
    if head:
        assert sim.spec.d == flatten_params(sim.model).numel() and "moon_head.2.weight" in sim.spec.names
    want = _official(head, momentum)
    assert float((res.final_flat - want).abs().max()) <= TOL


def test_the_former_first_previous_is_not_the_authors_loop(digits):
    # first_previous=global: a first-time participant's previous model is the model it receives; that changes the
    # model where a client first trains after round 1 (the difference the authors' loop catches)
    _, official = _engine(digits, False, 0.0, "sequential")
    _, former = _engine(digits, False, 0.0, "sequential", "algorithm.moon.first_previous=global")
    assert float((official.final_flat - former.final_flat).abs().max()) > 1e-4
