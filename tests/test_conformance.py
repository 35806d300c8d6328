"""Conformance suite, generated from the rule registry (fl_core/algorithms/registry.py): a rule is covered by
registering it.

For every base rule:
- the sequential and the vectorised executor give the same model (float64, |diff| <= 1e-9), or the vectorised
  one refuses the rule with one line, in this setting and with unequal clients and partial participation;
- with its ``neutral`` overrides it equals its ``reference`` (FedProx with mu = 0 is FedAvg, ...);
- the uplink and downlink counted from the messages equal the rule's closed form ``comm_floats`` (|S| a
  multiple of the block count, so FedBCGD's closed form is exact too);
- a run stopped after round 1 and resumed from its checkpoint ends with the uninterrupted run's model.
For every wrapper over every base: the stack runs, its counted communication equals its closed form, with
the wrapper's ``neutral`` overrides it equals the base alone (so it forwards every part it does not change),
and at its defaults the two executors agree (or the vectorised one refuses) and a resumed run equals the
uninterrupted one. For every server optimiser over every base that has a pseudo-gradient: the stack runs, its
communication is the base's closed form, the two executors agree, a resumed run equals the uninterrupted one
(the optimiser's state is in the checkpoint), and with the optimiser's ``neutral`` overrides it equals the base alone; every base
without one refuses it with one line.

Setting: digits, MLP (hidden 16), 4 IID clients (equal step counts), all clients every round, 2 rounds,
E = 1, B = 64, float64.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from fl_core.algorithms import registry
from fl_core.config import compose
from fl_core.schema import ConfigError
from fl_core.data import make_partition
from fl_core.engine.factory import build_simulator

BASES = registry.names("base")
WRAPPERS = registry.names("wrapper")
SERVER_OPTS = tuple(n for n in registry.names("server") if n != registry.NO_SERVER_OPT)
WITH_PSEUDO_GRADIENT = tuple(b for b in BASES if registry.get(b).eta_g)
# Top-k's message selects the k largest |entries|: where two magnitudes tie exactly (seen for MOON on this setting,
# round 2), executor rounding of 1e-17 picks the other entry and the models part by ~1e-3. Its executor comparison
# runs at its neutral ratio 1 (no selection); at its default ratio both executors train to 1e-17 before selecting.
SELECTING = ("topk",)
TOL = 1e-9

# unequal clients (padding, unequal K_i) and partial participation, for the executor comparison of every base
UNEQUAL = ("partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "partition.min_size=5",
           "partition.num_clients=6", "train.participation=0.5", "train.sampler=bernoulli", "train.batch_size=16")
SETTING = ("model=mlp", "model.hidden=16", "partition=iid", "partition.num_clients=4", "train.participation=1.0",
           "train.sampler=fixed", "train.rounds=2", "train.local_epochs=1", "train.batch_size=64", "train.lr=0.05",
           "engine.dtype=float64", "engine.progress=false", "engine.checkpoint_every=0", "tracking.enabled=false")


def _stack(base: str, wrapper: str = "", extra=(), server_opt: str = "") -> tuple:
    """The base's preset, with the server optimiser ``server_opt`` and wrapped by ``wrapper`` (their sections at
    the schema's defaults), plus ``extra``."""
    own = [f"algorithm={base}"] + ([f"algorithm.wrappers=[{wrapper}]"] if wrapper else [])
    own += [f"algorithm.server_opt={server_opt}"] if server_opt else []
    return tuple(own) + tuple(extra)


@lru_cache(maxsize=None)
def _digits():
    from fl_core.data import load_source

    return load_source(compose([]).dataset, Path(__file__).resolve().parents[1] / "data" / "raw")


def _sim(overrides, executor="sequential", **kw):
    cfg = compose(list(SETTING) + list(overrides) + [f"engine.executor={executor}"])
    ds = _digits()
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes)
    return build_simulator(cfg, ds, part, **kw)


@lru_cache(maxsize=None)
def _run(overrides: tuple, executor: str = "sequential"):
    """(final model [d], history, the simulator's algorithm, d) of one run; cached across tests."""
    sim = _sim(overrides, executor)
    res = sim.run()
    return res.final_flat, res.history, sim.algo, sim.spec.d


def _close(a, b):
    return float((a - b).abs().max()) <= TOL


def _comm_matches_closed_form(overrides):
    _, hist, algo, d = _run(overrides)
    up, down = algo.comm_floats(d)
    rounds = len(hist)
    assert hist[-1]["comm_up_floats"] == pytest.approx(rounds * up, rel=1e-12), "uplink counted != closed form"
    assert hist[-1]["comm_down_floats"] == pytest.approx(rounds * down, rel=1e-12), "downlink counted != closed form"


# --------------------------------------------------------------------------- bases

def _sequential_equals_vectorized(stack: tuple) -> None:
    seq, _, algo, _ = _run(stack)
    if not algo.vectorizable:
        with pytest.raises(ValueError, match=r"^engine.executor=vectorized: .* only run sequentially"):
            _sim(stack, "vectorized")
        return
    vec, _, _, _ = _run(stack, "vectorized")
    assert _close(seq, vec), f"{' '.join(stack)}: sequential and vectorised differ by {float((seq - vec).abs().max()):.3g}"


@pytest.mark.parametrize("base", BASES)
def test_base_sequential_equals_vectorized(base):
    _sequential_equals_vectorized(_stack(base))
    _sequential_equals_vectorized(_stack(base, extra=UNEQUAL))


def test_the_unequal_setting_has_unequal_clients_and_partial_rounds():
    sim = _sim(_stack("fedavg", extra=UNEQUAL))
    sizes = {sim.executor.data.size(i) for i in range(6)}
    hist = _run(_stack("fedavg", extra=UNEQUAL))[1]
    assert len(sizes) > 2 and {h["num_clients"] for h in hist} != {6}


@pytest.mark.parametrize("base", [b for b in BASES if registry.get(b).neutral])
def test_base_with_neutral_settings_equals_its_reference(base):
    rule = registry.get(base)
    got, _, _, _ = _run(_stack(base, extra=rule.neutral))
    ref, _, _, _ = _run(tuple(rule.reference))
    assert _close(got, ref), f"{base} {' '.join(rule.neutral)} differs from {' '.join(rule.reference)}"


@pytest.mark.parametrize("base", BASES)
def test_base_counted_communication_equals_closed_form(base):
    _comm_matches_closed_form(_stack(base))


def _resumed_equals_uninterrupted(stack: tuple, ck: Path) -> None:
    class Stop(Exception):
        pass

    def stop_after_round_1(r, row):
        if r == 1:
            raise Stop

    extra = ("engine.checkpoint_every=1",)
    with pytest.raises(Stop):
        _sim(stack + extra, checkpoint_path=ck, callbacks=[stop_after_round_1]).run()
    assert ck.exists()
    res = _sim(stack + extra, checkpoint_path=ck).run()
    assert res.resumed_from == 1
    full, hist, _, _ = _run(stack)
    assert _close(res.final_flat, full), f"{' '.join(stack)}: resumed run differs from the uninterrupted one"
    assert [h["comm_up_floats"] for h in res.history] == [h["comm_up_floats"] for h in hist]


@pytest.mark.parametrize("base", BASES)
def test_base_resumed_equals_uninterrupted(base, tmp_path):
    _resumed_equals_uninterrupted(_stack(base), tmp_path / "ck.pt")


# --------------------------------------------------------------------------- wrappers over every base

def _half(rows, cols):
    """(row, col) pairs of the matrix: those whose index sum is a multiple of 3 run in the fast suite, the others with
    the slow tests (each row still meets a third of the columns, each column a third of the rows; the whole matrix
    runs in CI)."""
    return [pytest.param(r, c, marks=() if (i + j) % 3 == 0 else pytest.mark.slow)
            for i, r in enumerate(rows) for j, c in enumerate(cols)]


@pytest.mark.parametrize("wrapper,base", _half(WRAPPERS, BASES))
def test_wrapper_over_every_base(wrapper, base, tmp_path):
    rule = registry.get(wrapper)
    stack = _stack(base, wrapper, rule.neutral)
    got, hist, algo, _ = _run(stack)
    assert torch.isfinite(got).all() and algo.describe().startswith(wrapper)
    _comm_matches_closed_form(stack)
    active = _stack(base, wrapper)  # the wrapper at its defaults: both executors, and resumed = uninterrupted
    _sequential_equals_vectorized(stack if wrapper in SELECTING else active)
    _resumed_equals_uninterrupted(active, tmp_path / "ck.pt")
    if rule.neutral:  # the same config without the wrapper
        ref, _, _, _ = _run(_stack(base))
        assert _close(got, ref), f"{wrapper}({base}) with {' '.join(rule.neutral)} differs from {base}"


# --------------------------------------------------------------------------- server optimisers over every base

@pytest.mark.parametrize("opt,base", _half(SERVER_OPTS, WITH_PSEUDO_GRADIENT))
def test_server_optimiser_over_every_base(opt, base, tmp_path):
    rule = registry.get(opt)
    stack = _stack(base, server_opt=opt)
    got, hist, algo, d = _run(stack)
    assert torch.isfinite(got).all() and all(h["server_update_norm"] > 0 for h in hist)
    assert algo.describe().startswith(rule.preset if base == "fedavg" else opt), algo.describe()
    _comm_matches_closed_form(stack)
    assert algo.comm_floats(d) == _run(_stack(base))[2].comm_floats(d)  # the optimiser sends nothing
    _sequential_equals_vectorized(stack)
    _resumed_equals_uninterrupted(stack, tmp_path / "ck.pt")
    if rule.neutral:
        neutral, _, _, _ = _run(_stack(base, extra=rule.neutral, server_opt=opt))
        ref, _, _, _ = _run(_stack(base))
        assert _close(neutral, ref), f"{opt} over {base} with {' '.join(rule.neutral)} differs from {base}"


@pytest.mark.parametrize("base", [b for b in BASES if b not in WITH_PSEUDO_GRADIENT])
def test_a_base_without_pseudo_gradient_refuses_a_server_optimiser(base):
    with pytest.raises(ConfigError, match=rf"^algorithm.server_opt=adam does not compose with {base}, whose server "
                                          r"step is not a step along a pseudo-gradient"):
        compose(list(SETTING) + list(_stack(base, server_opt="adam")))


@pytest.mark.parametrize("opt", SERVER_OPTS)
def test_server_optimiser_composes_under_every_wrapper(opt):
    for wrapper in WRAPPERS:
        stack = _stack("fedprox", wrapper, registry.get(wrapper).neutral, server_opt=opt)
        got, _, algo, _ = _run(stack)
        ref, _, _, _ = _run(_stack("fedprox", server_opt=opt))
        assert algo.describe().startswith(wrapper) and f"{opt}[" in algo.describe()
        if registry.get(wrapper).neutral:
            assert _close(got, ref), f"{wrapper}({opt} over fedprox), neutral, differs from {opt} over fedprox"


def test_every_registered_rule_has_a_preset():
    """The suite composes each rule from its conf/algorithm/<preset>.yaml (a server optimiser: the published rule
    it makes over FedAvg; sgd, the base's own step, needs none)."""
    root = Path(__file__).resolve().parents[1] / "conf" / "algorithm"
    missing = [r.preset_name for r in registry.rules()
               if r.name != registry.NO_SERVER_OPT and not (root / f"{r.preset_name}.yaml").exists()]
    assert not missing, f"no conf/algorithm/<name>.yaml for {missing}"
