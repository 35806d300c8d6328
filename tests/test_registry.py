"""The rule registry (fl_core/algorithms/registry.py): what it derives, and the keys a rule would ignore.

- the config schema's sections, the choices of algorithm.name / algorithm.wrappers, --help and the docs' rule
  table come from the registry;
- the engine (fl_core/engine/) names no rule;
- a shared key a rule would ignore (algorithm.aggregation, algorithm.eta_g) is refused with one line, one it
  honours changes the result; FedBCGD blocks that would be empty are refused.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fl_core.algorithms import build_algorithm, registry
from fl_core.config import AlgorithmConfig, ConfigError, compose
from fl_core.models import build_model
from fl_core.params import ParamSpec

ROOT = Path(__file__).resolve().parents[1]


def test_schema_sections_are_the_registered_parameter_dataclasses():
    sections = {f.name: f.default_factory for f in dataclasses.fields(AlgorithmConfig)
                if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    assert sections == registry.sections()
    for r in registry.rules():
        assert r.label and r.citation and r.summary, r.name
        if r.params is not None:
            for f in dataclasses.fields(r.params):
                assert f.metadata.get("help"), f"algorithm.{r.config_section}.{f.name} has no help text"


def test_unknown_names_list_the_registry():
    with pytest.raises(ConfigError, match=r"^algorithm.name must be one of fedavg, .*fedbcgd_plus.*, got 'nope'$"):
        compose(["algorithm.name=nope"])
    # the published server optimisers first, any added after them
    with pytest.raises(ConfigError, match=r"^algorithm.server_opt must be one of sgd, momentum, adam, yogi, adagrad"
                                          r"(, \w+)*, got 'nope'$"):
        compose(["algorithm.server_opt=nope"])
    with pytest.raises(ConfigError, match=r"^algorithm.wrappers\[0\] must be one of .*fedbug.*, got 'nope'$"):
        compose(["algorithm.wrappers=[nope]"])


def test_a_section_field_is_checked_from_its_declaration():
    with pytest.raises(ConfigError, match=r"^algorithm.fedprox.mu must be >= 0, got -1$"):
        compose(["algorithm=fedprox", "algorithm.fedprox.mu=-1"])
    with pytest.raises(ConfigError, match=r"^algorithm.fedbug.schedule must be one of paper, code, got 'x'$"):
        compose(["algorithm=fedbug", "algorithm.fedbug.schedule=x"])


def test_help_lists_every_rule_and_every_parameter():
    from pipeline.train import usage

    text = usage()
    for r in registry.rules():
        assert re.search(rf"^\s+{re.escape(r.name)}\s+{re.escape(r.label)}: ", text, re.M), r.name
    for sec, schema in registry.sections().items():
        for f in dataclasses.fields(schema):
            assert f"algorithm.{sec}.{f.name}" in text


def test_docs_rule_table_is_the_registry():
    """docs/algorithms.md's rule table lists exactly the registered rules with their kind, label and section."""
    text = (ROOT / "docs" / "algorithms.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (base|server|wrapper|transform) \| ([^|]+?) \| ([^|]*?) \|", text, re.M)
    want = [(r.name, r.kind, r.label, f"`algorithm.{r.config_section}`" if r.config_section else "")
            for r in registry.rules()]
    assert [(n, k, lab.strip(), sec.strip()) for n, k, lab, sec in rows] == want


def test_the_engine_names_no_rule():
    # every rule's name and paper label, and the published rule each server optimiser makes over FedAvg; the
    # server optimisers' own names are the optimisers' (sgd, momentum, adam), words of the local step as well
    words = ({r.name for r in registry.rules() if r.kind != "server"} | {r.label for r in registry.rules()}
             | {r.preset for r in registry.rules() if r.preset})
    found = []
    for path in sorted((ROOT / "fl_core" / "engine").glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for w in words:
                # a word of its own, not an attribute (torch.topk is a function, not the Top-k rule)
                if re.search(rf"(?<![.\w]){re.escape(w)}(?![\w+])", line, re.I):
                    found.append(f"{path.name}:{i}: {w}")
    assert not found, "the engine names rules: " + "; ".join(found)


# --------------------------------------------------------------------------- shared keys: honoured or refused

@pytest.mark.parametrize("rule", ["feddyn", "feddc", "fedbcgd", "fedbcgd_plus", "scaffold"])
def test_a_rule_that_averages_uniformly_refuses_weighted(rule):
    with pytest.raises(ConfigError, match=rf"^algorithm.aggregation=weighted is not used by {rule}, which averages "
                                          r"only uniform \(.+\); set algorithm.aggregation=uniform or null"):
        compose([f"algorithm={rule}", "algorithm.aggregation=weighted"])


@pytest.mark.parametrize("rule", ["feddyn", "feddc", "fedbcgd", "fedbcgd_plus", "fedexp"])
def test_a_rule_without_a_server_learning_rate_refuses_eta_g(rule):
    with pytest.raises(ConfigError, match=rf"^algorithm.eta_g=0.5 is not used by {rule}, whose server step"):
        compose([f"algorithm={rule}", "algorithm.eta_g=0.5"])


def test_fedavgm_ema_refuses_eta_g_and_fedexp_code_variant_refuses_weighted():
    with pytest.raises(ConfigError, match=r"^algorithm.eta_g=0.5 is not used by server_opt=momentum with "
                                          r"algorithm.fedavgm.form"):
        compose(["algorithm=fedavgm", "algorithm.fedavgm.form=ema", "algorithm.eta_g=0.5"])
    compose(["algorithm=fedavgm", "algorithm.fedavgm.form=heavy_ball", "algorithm.eta_g=0.5"])
    with pytest.raises(ConfigError, match=r"^algorithm.aggregation=weighted is not used by fedexp with "
                                          r"algorithm.fedexp.variant=fedbug_code"):
        compose(["algorithm=fedexp", "algorithm.fedexp.variant=fedbug_code", "algorithm.aggregation=weighted"])


@pytest.mark.parametrize("base,want", [("fedavg", "weighted"), ("fedprox", "weighted"), ("feddyn", "uniform"),
                                       ("scaffold", "uniform"), ("fedbcgd", "uniform"), ("fednova", "weighted")])
def test_a_wrapper_preset_takes_its_bases_own_aggregation(base, want):
    """algorithm=fedbug sets aggregation: null, resolved at composition to the base's own."""
    assert compose(["algorithm=fedbug", f"algorithm.name={base}"]).algorithm.aggregation == want
    assert compose([f"algorithm.name={base}"]).algorithm.aggregation == want


def _updates(d=4):
    from fl_core.algorithms import ClientUpdate

    g = torch.Generator().manual_seed(0)
    return [ClientUpdate(i, n, 3, torch.randn(d, generator=g, dtype=torch.float64), 0.0)
            for i, n in enumerate([1, 5, 10])]


def test_fednova_honours_uniform_aggregation():
    """FedNova with p_i = 1/|S|: by hand, tau_eff = mean a_i and the step is tau_eff * mean(Delta_i / a_i)."""
    from fl_core.algorithms import RoundContext

    model = torch.nn.Linear(2, 2)
    spec = ParamSpec.from_model(model)
    x = torch.zeros(spec.d, dtype=torch.float64)
    ups = _updates(spec.d)
    for u, a in zip(ups, (2.0, 3.0, 6.0)):
        u.extra["a"] = torch.tensor(a, dtype=torch.float64)
    rctx = RoundContext(round=1, lr=0.1, global_flat=x, spec=spec)
    out = {}
    for agg in ("uniform", "weighted"):
        algo = build_algorithm(compose(["algorithm=fednova", f"algorithm.aggregation={agg}"]).algorithm, spec, model)
        out[agg], _ = algo.aggregate(rctx, {}, ups)
    a = torch.tensor([2.0, 3.0, 6.0], dtype=torch.float64)
    d = torch.stack([u.delta for u in ups])
    assert torch.allclose(out["uniform"], a.mean() * (d / a[:, None]).mean(0))
    p = torch.tensor([1.0, 5.0, 10.0], dtype=torch.float64) / 16
    assert torch.allclose(out["weighted"], (p * a).sum() * (p[:, None] * d / a[:, None]).sum(0))


# --------------------------------------------------------------------------- FedBCGD blocks

def _model(name):
    return build_model(compose([f"model={name}"]).model, "digits", (1, 8, 8), 10)


def test_fedbcgd_refuses_blocks_that_would_be_empty():
    model = _model("small_cnn")  # 4 units: 3 besides the classifier
    spec = ParamSpec.from_model(model)
    cfg = compose(["algorithm=fedbcgd", "algorithm.fedbcgd.blocks=5"])
    with pytest.raises(ConfigError, match=r"^algorithm.fedbcgd.blocks=5 leaves block\(s\) 4, 5 empty: SmallCNN has 3 "
                                          r"units besides the classifier; use algorithm.fedbcgd.blocks <= 3$"):
        build_algorithm(cfg.algorithm, spec, model)


@pytest.mark.parametrize("model,blocks", [("small_cnn", 3), ("mlp", 2)])
def test_fedbcgd_blocks_zero_takes_one_block_per_unit(model, blocks):
    m = _model(model)
    algo = build_algorithm(compose(["algorithm=fedbcgd"]).algorithm, ParamSpec.from_model(m), m)
    assert algo.num_blocks == blocks
    assert all(bool(b.any()) for b in algo.block_masks)


def test_fedbcgd_on_a_single_unit_model_needs_shared_false():
    m = _model("logreg")
    spec = ParamSpec.from_model(m)
    with pytest.raises(ConfigError, match=r"^algorithm.fedbcgd.blocks=0 leaves block\(s\) 1 empty: LogisticRegression "
                                          r"has 0 units besides the classifier; use a model with several units or "
                                          r"algorithm.fedbcgd.shared=false$"):
        build_algorithm(compose(["algorithm=fedbcgd"]).algorithm, spec, m)
    algo = build_algorithm(compose(["algorithm=fedbcgd", "algorithm.fedbcgd.shared=false"]).algorithm, spec, m)
    assert algo.num_blocks == 1 and bool(algo.block_masks[0].all())
