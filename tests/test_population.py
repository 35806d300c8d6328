"""Populations (fl_core.engine.population): an experiment's seeds, or runs that differ only in eta_l, trained in
one vectorised pass per round give each replica the numbers of its own separate run (float64, to the executors'
tolerance), resume after a kill inside the population, and fail one replica alone."""

from __future__ import annotations

import pytest

from fl_core.engine import population
from fl_core.engine.simulator import RunFailed

from test_conformance import BASES, TOL, UNEQUAL, _run, _sim, _stack
from test_heterogeneity import ADAM, DRAWN, DROP

SEEDS = (1, 2, 3)


def _rows(history):
    return [{k: v for k, v in row.items() if k != "round_time_s"} for row in history]


def _assert_as_apart(stack: tuple, variants) -> None:
    """``variants`` (extra overrides per replica) trained as one population equal their separate sequential runs."""
    sims = [_sim(stack + v, "vectorized") for v in variants]
    if not population.can_share(sims):
        pytest.fail(f"{' '.join(stack)}: the replicas cannot share a pass")
    got = population.run_together(sims)
    for v, res in zip(variants, got):
        assert not isinstance(res, RunFailed), f"{v}: {res}"
        ref, hist, _, _ = _run(stack + v)
        gap = float((res.final_flat - ref).abs().max())
        assert gap <= TOL, f"{' '.join(stack + v)}: population and separate run differ by {gap:.3g}"
        _same_rows(res.history, hist, v)


def _same_rows(got, want, label) -> None:
    assert len(got) == len(want), label
    for a, b in zip(_rows(got), _rows(want)):
        assert a.keys() == b.keys(), label
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-7, abs=1e-9), (label, a["round"], k)


def _seeds(*extra):
    return [tuple(extra) + (f"seed={s}",) for s in SEEDS]


# every other base runs with the slow tests (all of them in CI); tests/test_conformance.py covers each base fast
@pytest.mark.parametrize("base", [pytest.param(b, marks=pytest.mark.slow) if i % 2 else b for i, b in enumerate(BASES)])
def test_the_seeds_of_every_base_as_one_population_equal_their_separate_runs(base):
    stack = _stack(base, extra=UNEQUAL)
    if not _sim(stack).algo.vectorizable:
        pytest.skip(f"{base} has hooks that only run sequentially: its seeds run apart")
    _assert_as_apart(stack, _seeds())


@pytest.mark.parametrize("stack", [_stack("scaffold", "fedbug", UNEQUAL), _stack("fedavg", "fednlr", UNEQUAL),
                                   _stack("fedavg", extra=UNEQUAL + ("algorithm.transforms=[qsgd]",)),
                                   _stack("fedprox", extra=UNEQUAL + ADAM), _stack("feddyn", extra=UNEQUAL + DROP),
                                   _stack("fedavg", extra=UNEQUAL + DRAWN + ("train.momentum=0.9",))])
def test_wrappers_transforms_and_local_work_as_one_population_equal_their_separate_runs(stack):
    _assert_as_apart(stack, _seeds())


def test_a_population_over_eta_l_equals_the_separate_runs():
    _assert_as_apart(_stack("fedprox", extra=UNEQUAL), [(f"train.lr={lr}",) for lr in (0.01, 0.05, 0.2)])
    _assert_as_apart(_stack("scaffold", extra=UNEQUAL), [(f"train.lr={lr}", f"seed={s}")
                                                         for lr, s in ((0.02, 1), (0.1, 2))])


def test_a_population_over_a_rules_replica_parameter_equals_the_separate_runs():
    """FedProx's mu is carried by each replica (``param(..., replica=True)``): runs that differ in it (mu = 0, the
    FedAvg case, among them), alone or beside eta_l and the seed, and with a wrapper around the rule (the parameter
    then sits one layer down the stack), train as one population with each run's own numbers."""
    _assert_as_apart(_stack("fedprox", extra=UNEQUAL), [(f"algorithm.fedprox.mu={mu}",) for mu in (0.0, 0.1, 1.0)])
    _assert_as_apart(_stack("fedprox", "fedbug", UNEQUAL), [("algorithm.fedprox.mu=0.01", "train.lr=0.05"),
                                                            ("algorithm.fedprox.mu=0.5", "seed=2")])


# every key a replica may carry (fl_core.config.replica_keys): the stack it is tested on and the values a population
# trains at once, each with an edge value (P = 0, lambda = 0, alpha small, eps = 0, beta = 0, no weight decay)
REPLICA_CASES = {
    "train.lr": (_stack("fedavg", extra=UNEQUAL), (0.01, 0.05, 0.2)),
    "train.weight_decay": (_stack("fedavg", extra=UNEQUAL + ("train.momentum=0.9",)), (0.0, 1e-3, 0.1)),
    "algorithm.eta_g": (_stack("fedavg", extra=UNEQUAL), (0.5, 1.0, 1.7)),
    "algorithm.fedprox.mu": (_stack("fedprox", extra=UNEQUAL), (0.0, 0.1, 1.0)),
    "algorithm.feddyn.alpha": (_stack("feddyn", extra=UNEQUAL), (1e-4, 0.01, 0.3)),
    "algorithm.fedexp.eps": (_stack("fedexp", extra=UNEQUAL), (0.0, 1e-3, 0.1)),
    "algorithm.fedexp.eps_decay": (_stack("fedexp", extra=UNEQUAL), (0.5, 0.998, 1.0)),
    "algorithm.fednlr.mu0": (_stack("fedavg", "fednlr", UNEQUAL), (0.5, 1.0, 2.0)),
    "algorithm.fednlr.a1": (_stack("fedavg", "fednlr", UNEQUAL), (0.0, 1.0, 2.0)),
    "algorithm.fednlr.a2": (_stack("fedavg", "fednlr", UNEQUAL), (0.0, 1.0, 2.0)),
    "algorithm.fedavgm.beta": (_stack("fedavgm", extra=UNEQUAL), (0.0, 0.5, 0.9)),
    "algorithm.adaptive.beta1": (_stack("fedadam", extra=UNEQUAL), (0.0, 0.5, 0.9)),
    "algorithm.adaptive.beta2": (_stack("fedyogi", extra=UNEQUAL), (0.0, 0.9, 0.99)),
    "algorithm.adaptive.tau": (_stack("fedadam", extra=UNEQUAL), (1e-4, 1e-3, 1e-1)),
    "algorithm.fedbcgd.lam": (_stack("fedbcgd", extra=UNEQUAL), (0.0, 0.45, 0.8)),
    "algorithm.fedbug.gu_percentage": (_stack("fedprox", "fedbug", UNEQUAL), (0.0, 0.3, 1.0)),
}


def test_every_replica_key_has_its_population_test_and_every_batched_one_is_bound():
    """Each key declared ``replica=True`` (fl_core.config.replica_keys) is tried below as a population against the
    separate runs, and a rule's ``replica_params`` (the values ``local_objective`` reads, bound per client) are
    replica keys of its own section, held as floats."""
    from fl_core.algorithms import registry
    from fl_core.config import replica_keys

    assert set(REPLICA_CASES) == set(replica_keys())
    for name in registry.names("base") + registry.names("wrapper"):
        rule = registry.get(name)
        stack = (f"algorithm={rule.preset_name}",) if rule.kind == "base" else _stack("fedavg", name)
        layer = next(lay for lay in _sim(stack).algo.layer_stack() if lay.name == name)
        for attr in layer.replica_params:
            assert f"algorithm.{rule.config_section}.{attr}" in replica_keys(), (name, attr)
            assert isinstance(getattr(layer, attr), float), (name, attr)


@pytest.mark.parametrize("key", sorted(REPLICA_CASES))
def test_a_population_over_each_replica_key_equals_the_separate_runs(key):
    """A population whose replicas differ in ``key`` (an edge value among them; the middle one with another seed too)
    gives each replica the numbers of its own separate sequential run, float64 to 1e-9 (``_assert_as_apart``)."""
    stack, values = REPLICA_CASES[key]
    _assert_as_apart(stack, [(f"{key}={v}",) + (("seed=2",) if i == 1 else ()) for i, v in enumerate(values)])


def test_a_population_mixing_several_replica_keys_equals_the_separate_runs():
    """FedBug(FedProx) replicas that differ in P, mu, eta_l, the weight decay and the seed at once."""
    stack = _stack("fedprox", "fedbug", UNEQUAL)
    _assert_as_apart(stack, [("algorithm.fedbug.gu_percentage=0", "algorithm.fedprox.mu=0.5", "train.lr=0.02"),
                             ("algorithm.fedbug.gu_percentage=0.6", "train.weight_decay=0.01", "seed=2"),
                             ("algorithm.fedbug.gu_percentage=1.0", "algorithm.fedprox.mu=0", "train.lr=0.1")])


def test_a_replica_whose_setting_is_infeasible_fails_alone():
    """FedBug's code schedule needs P * K_i >= M: the replica with P = 0.01 raises InfeasibleSetting for its clients
    once running; it ends FAILED alone (``RunFailed.cause``), and the others keep the numbers of their separate runs."""
    from fl_core.algorithms import InfeasibleSetting

    stack = _stack("fedavg", "fedbug", UNEQUAL + ("algorithm.fedbug.schedule=code",))
    variants = [("algorithm.fedbug.gu_percentage=0.5",), ("algorithm.fedbug.gu_percentage=0.01",),
                ("algorithm.fedbug.gu_percentage=1.0", "seed=2")]
    got = population.run_together([_sim(stack + v, "vectorized") for v in variants])
    assert isinstance(got[1], RunFailed) and isinstance(got[1].cause, InfeasibleSetting), got[1]
    assert "P*K_i >= M" in str(got[1])
    for i in (0, 2):
        assert float((got[i].final_flat - _run(stack + variants[i])[0]).abs().max()) <= TOL


def test_steering_stops_replicas_between_passes_and_adds_new_ones_that_train_as_apart():
    """``steer`` after round 1 stops replica 1 (RunStopped, with its round-1 history) and adds a replica at round 0;
    it catches up alone, then trains with the others, and every replica that ran to its end equals its separate run."""
    from fl_core.engine.population import Steer
    from fl_core.engine.simulator import RunStopped

    stack = _stack("fedprox", extra=UNEQUAL + ("train.rounds=3",))
    variants = [("algorithm.fedprox.mu=0",), ("algorithm.fedprox.mu=0.3",), ("train.lr=0.2", "seed=2")]
    newcomer = ("algorithm.fedprox.mu=1.0", "seed=3")
    calls, ended = [], []

    def steer():
        calls.append(1)
        if len(calls) == 1:
            return Steer(stop={1: "pruned: by the test"}, join=[_sim(stack + newcomer, "vectorized")])
        return None

    got = population.run_together([_sim(stack + v, "vectorized") for v in variants],
                                  on_done=lambda i, o: ended.append(i), steer=steer)
    assert len(got) == 4 and sorted(ended) == [0, 1, 2, 3]
    assert isinstance(got[1], RunStopped) and str(got[1]) == "pruned: by the test" and len(got[1].history) == 1
    for i, v in ((0, variants[0]), (2, variants[2]), (3, newcomer)):
        assert not isinstance(got[i], RunFailed), got[i]
        gap = float((got[i].final_flat - _run(stack + v)[0]).abs().max())
        assert gap <= TOL, (v, gap)
        _same_rows(got[i].history, _run(stack + v)[1], v)


def test_replicas_that_differ_in_model_or_rule_do_not_share_a_pass():
    assert not population.can_share([_sim(("algorithm=fedavg",), "vectorized"),
                                     _sim(("algorithm=fedprox",), "vectorized")])
    assert not population.can_share([_sim(("model.hidden=8",), "vectorized"), _sim((), "vectorized")])
    # the lead executor's local-step settings would train the other replica's clients: refused
    assert not population.can_share([_sim(("train.batch_size=32",), "vectorized"), _sim((), "vectorized")])
    # a rule parameter the replicas do not carry (not replica=True) would be the first replica's for all: refused
    assert not population.can_share([_sim(("algorithm=feddyn", "algorithm.feddyn.adaptive_alpha=false"), "vectorized"),
                                     _sim(("algorithm=feddyn",), "vectorized")])
    # (the local optimiser's momentum is the lead executor's for every client: refused)
    assert not population.can_share([_sim(("train.momentum=0.5",), "vectorized"), _sim((), "vectorized")])
    assert population.can_share([_sim(("algorithm=fedprox", "algorithm.fedprox.mu=0.1"), "vectorized"),
                                 _sim(("algorithm=fedprox",), "vectorized")])
    assert not population.can_share([_sim(("seed=1",)), _sim(("seed=2",))])  # the sequential executor
    assert not population.can_share([_sim((), "vectorized")])


def test_a_diverging_replica_fails_alone_and_the_others_are_as_apart():
    stack = _stack("fedavg", extra=UNEQUAL)
    variants = [("train.lr=0.05",), ("train.lr=1e300",), ("train.lr=0.05", "seed=2")]
    got = population.run_together([_sim(stack + v, "vectorized") for v in variants])
    assert isinstance(got[1], RunFailed) and "non-finite" in str(got[1])
    for i in (0, 2):
        assert float((got[i].final_flat - _run(stack + variants[i])[0]).abs().max()) <= TOL


def test_a_population_killed_between_replicas_resumes_each_from_its_own_checkpoint(tmp_path):
    """Replica 0 stops after its round 2 is checkpointed, the others hold round 1's: the rerun catches them up
    and every replica ends with the parameters of an uninterrupted run."""
    class Stop(Exception):
        pass

    def stop(r, row):
        if r == 2:
            raise Stop

    stack = _stack("scaffold", extra=UNEQUAL + ("engine.checkpoint_every=1", "train.rounds=4"))
    paths = [tmp_path / f"seed{s}.pt" for s in SEEDS]
    sims = [_sim(stack + v, "vectorized", checkpoint_path=p, callbacks=[stop] if i == 0 else [])
            for i, (v, p) in enumerate(zip(_seeds(), paths))]
    with pytest.raises(Stop):
        population.run_together(sims)
    again = [_sim(stack + v, "vectorized", checkpoint_path=p) for v, p in zip(_seeds(), paths)]
    assert [s.restore() for s in again] == [2, 1, 1]
    got = population.run_together(again)
    for v, res in zip(_seeds(), got):
        full = _sim(stack + v, "vectorized").run()
        assert float((res.final_flat - full.final_flat).abs().max()) <= TOL, v
        _same_rows(res.history, full.history, v)


def test_a_population_in_chunks_equals_its_separate_runs():
    stack = _stack("scaffold", extra=UNEQUAL)
    sims = [_sim(stack + v, "vectorized") for v in _seeds()]
    got = population.run_together(sims, chunk=2)  # 2 clients at once across the replicas' rounds
    for v, res in zip(_seeds(), got):
        assert float((res.final_flat - _run(stack + v)[0]).abs().max()) <= TOL


def test_the_api_trains_an_experiments_seeds_as_one_population_with_each_seeds_own_numbers(monkeypatch):
    """Through the one runner (pipeline.experiment): seeds 1 and 2 together give, bit for bit, what each gives
    alone (float32, the digits MLP; each alone is not a population), and every round is heard once per seed."""
    import torch

    from pipeline.api import run

    over = ["engine.executor=vectorized", "train.rounds=3", "model=mlp", "partition.num_clients=6",
            "train.participation=0.5"]
    heard, passes = [], []
    lock_step = population._lock_step
    monkeypatch.setattr(population, "_lock_step", lambda sims, *a: passes.append(len(sims)) or lock_step(sims, *a))
    both = run(over, seeds=(1, 2), progress=False, on_round=lambda s, r, row: heard.append((s, r)))
    assert passes == [2]
    assert sorted(heard) == [(s, r) for s in (1, 2) for r in (1, 2, 3)]
    for s in (1, 2):
        alone = run(over, seeds=(s,), progress=False)
        for k, v in alone.models[s].items():
            assert torch.equal(both.models[s][k], v), (s, k)
        cols = [c for c in alone.history.columns if c not in ("round_time_s", "seed")]
        mine = both.history[both.history.seed == s][cols].reset_index(drop=True)
        assert mine.equals(alone.history[cols].reset_index(drop=True)), s
