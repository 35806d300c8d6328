"""A run is what the user typed: every key either changes the run or is refused in one line; compositions take
their defaults from their parts (docs/cli.md, "Every key you type changes the run, or the command refuses it")."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from fl_core.algorithms import registry
from fl_core.algorithms.serveropt import Adaptive
from fl_core.config import ConfigError, compose, inactive_keys, schema_fields, to_container


@pytest.mark.parametrize("overrides,message", [
    (["+train.roudns=3"], "unknown key train.roudns (did you mean train.rounds?)"),
    (["train.roudns=3"], "unknown key train.roudns (did you mean train.rounds?)"),
    (["algorithm.fedprox.muu=1"], "unknown key algorithm.fedprox.muu (did you mean algorithm.fedprox.mu?)"),
    (["train.nope=1"], "unknown key train.nope (see fl-train --help for the keys)"),
    (["algorithm.fedprox.mu=0.1"],
     "algorithm.fedprox.mu is not used by this run's rules (fedavg); to train FedProx use algorithm=fedprox "
     "(or algorithm.name=fedprox)"),
    (["algorithm=fedprox", "algorithm.fedbug.gu_percentage=0.3"],
     "algorithm.fedbug.gu_percentage is not used by this run's rules (fedprox); to train FedBug use algorithm=fedbug "
     "(or algorithm.wrappers=[fedbug])"),
    (["algorithm.adaptive.beta1=0.5"],
     "algorithm.adaptive.beta1 is not used by this run's rules (fedavg); to train FedAdam / FedYogi / FedAdagrad use "
     "algorithm=fedadam (or algorithm.server_opt=adam) | algorithm=fedyogi (or algorithm.server_opt=yogi) | "
     "algorithm=fedadagrad (or algorithm.server_opt=adagrad)"),
    (["algorithm=fedbcgd", "algorithm.fedbcgd.momentum=false", "algorithm.fedbcgd.lam=0.5"],
     "algorithm.fedbcgd.lam has no effect with algorithm.fedbcgd.momentum=false: it is used only with "
     "algorithm.fedbcgd.momentum=true; remove it"),
    (["algorithm=fedbcgd", "algorithm.fedbcgd.plus_variant=code"],
     "algorithm.fedbcgd.plus_variant has no effect with algorithm.name=fedbcgd: it is used only with "
     "algorithm.name=fedbcgd_plus; remove it"),
    (["algorithm=fedadagrad", "algorithm.adaptive.beta2=0.9"],
     "algorithm.adaptive.beta2 has no effect with algorithm.server_opt=adagrad: it is used only with "
     "algorithm.server_opt=adam|yogi; remove it"),
    (["algorithm=fedexp", "algorithm.fedexp.variant=fedbug_code", "algorithm.fedexp.eps=0.1"],
     "algorithm.fedexp.eps has no effect with algorithm.fedexp.variant=fedbug_code: it is used only with "
     "algorithm.fedexp.variant=official; remove it"),
    (["algorithm=qsgd", "algorithm.compression.topk_ratio=0.5"],
     "algorithm.compression.topk_ratio has no effect with algorithm.transforms=[qsgd]: it is used only with "
     "algorithm.transforms containing topk; remove it"),
    (["partition.alpha=0.5"],
     "partition.alpha has no effect with partition.name=shards: it is used only with partition.name=dirichlet; "
     "remove it"),
    (["partition=dirichlet", "partition.min_size=3"],
     "partition.min_size has no effect with partition.variant=per_client: it is used only with "
     "partition.variant=per_class; remove it"),
    (["model.hidden=64"], "model.hidden has no effect with model.name=auto: it is used only with model.name=mlp; "
     "remove it"),
    (["train.local_steps=5", "train.local_epochs=2"],
     "train.local_epochs has no effect with train.local_steps=5: it is used only with train.local_steps=0; remove it"),
    (["train.crop_padding=2"], "train.crop_padding has no effect with train.augmentation=none: it is used only with "
     "train.augmentation=crop_flip|fedbug; remove it"),
    (["tracking.enabled=false", "tracking.detail_metrics=true"],
     "tracking.detail_metrics has no effect with tracking.enabled=false: it is used only with tracking.enabled=true; "
     "remove it"),
    (["tracking.enabled=false", "tracking.log_model=false"],
     "tracking.log_model has no effect with tracking.enabled=false: it is used only with tracking.enabled=true; "
     "remove it"),
    (["engine.dist_timeout_s=100"],
     "engine.dist_timeout_s has no effect with engine.executor=sequential: it is used only with "
     "engine.executor=distributed; remove it"),
    (["train.lr=1e400"], "train.lr must be a finite number, got inf"),
    (["train.lr=nan"], "train.lr must be a finite number, got nan"),
    (["algorithm.eta_g=inf"], "algorithm.eta_g must be a finite number, got inf"),
    (["algorithm=fedprox", "algorithm.fedprox.mu=inf"], "algorithm.fedprox.mu must be a finite number, got inf"),
])
def test_a_key_that_cannot_change_the_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("overrides", [
    ["algorithm=fedprox", "algorithm.fedprox.mu=0.1"],
    ["algorithm.name=fedprox", "algorithm.fedprox.mu=0.1"],
    ["algorithm=fedbcgd", "algorithm.fedbcgd.lam=0.5"],
    ["algorithm=fedbcgd_plus", "algorithm.fedbcgd.plus_variant=code"],
    ["algorithm=fedyogi", "algorithm.adaptive.beta2=0.9"],
    ["algorithm=topk", "algorithm.compression.topk_ratio=0.5", "algorithm.compression.error_feedback=false"],
    ["partition=dirichlet", "partition.alpha=0.5", "partition.variant=per_class", "partition.min_size=3"],
    ["model=mlp", "model.hidden=64"],
    ["train.augmentation=crop_flip", "train.crop_padding=2"],
    ["+experiment=fedbcgd_cifar10"],  # a preset's values are not the user's, read or not
])
def test_a_key_the_run_reads_is_accepted(overrides):
    compose(overrides)


def test_every_declared_condition_names_a_key_of_the_schema():
    known = schema_fields()
    for key, f in known.items():
        for cond in (f.metadata.get("when", ()) if f is not None else ()):
            assert cond.key in known and known[cond.key] is not None, (key, cond.key)


def test_every_rule_section_key_is_refused_outside_its_stack():
    cfg = compose([])  # FedAvg alone
    keys = [f"algorithm.{sec}.{f.name}" for sec, schema in registry.sections().items() for f in fields(schema)]
    unused = inactive_keys(cfg, keys)
    assert sorted(unused) == sorted(keys)
    assert all(k.split(".")[1] in registry.sections() for k in unused)


def test_preset_values_are_not_user_keys_and_a_grid_shares_its_settings():
    # algorithm=fedexp sets eps etc.; choosing the fedbug_code variant must not clash with the preset's values
    cfg = compose(["algorithm=fedexp", "algorithm.fedexp.variant=fedbug_code"])
    assert cfg.algorithm.aggregation == "uniform"  # the variant's own, not the preset's
    assert compose(["algorithm=fedexp"]).algorithm.aggregation == "weighted"
    with pytest.raises(ConfigError, match="algorithm.aggregation=weighted is not used by fedexp"):
        compose(["algorithm=fedexp", "algorithm.fedexp.variant=fedbug_code", "algorithm.aggregation=weighted"])


def test_a_server_optimiser_brings_its_own_step_size():
    ours = compose(["algorithm=fedprox", "algorithm.server_opt=adam"])
    preset = compose(["algorithm=fedadam", "algorithm.name=fedprox"])
    assert ours.algorithm.eta_g == 0.03
    assert to_container(ours) == to_container(preset)  # the same run, key for key
    assert compose(["algorithm=fedprox", "algorithm.server_opt=momentum"]).algorithm.eta_g == 1.0
    assert compose(["algorithm=fedprox"]).algorithm.eta_g == 1.0
    assert compose(["algorithm=fedprox", "algorithm.server_opt=yogi", "algorithm.eta_g=0.1"]).algorithm.eta_g == 0.1


def test_fedprox_with_adam_trains_as_the_fedadam_preset_over_fedprox_bit_for_bit():
    from pipeline.api import run

    tiny = ["train.rounds=2", "partition.num_clients=4", "train.local_epochs=1", "engine.progress=false"]
    a = run(["algorithm=fedprox", "algorithm.server_opt=adam"] + tiny, seeds=(1,))
    b = run(["algorithm=fedadam", "algorithm.name=fedprox"] + tiny, seeds=(1,))
    for k, v in a.models[1].items():
        assert torch.equal(v, b.models[1][k]), k


def test_adaptive_v0_tau2_is_reddis_initialisation():
    x, d = torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    beta1, beta2, tau, eta = 0.9, 0.99, 0.1, 0.5
    for rule, v1 in (("adam", beta2 * tau ** 2 + (1 - beta2) * d ** 2),
                     ("adagrad", tau ** 2 + d ** 2),
                     ("yogi", tau ** 2 - (1 - beta2) * d ** 2 * torch.sign(tau ** 2 - d ** 2))):
        opt = Adaptive(rule, beta1, beta2, tau, eta, v0="tau2")
        state = opt.init_state(x)
        assert torch.equal(state["v"], torch.full_like(x, tau ** 2)) and torch.equal(state["m"], torch.zeros_like(x))
        new, state = opt.step(x, d, state)
        assert torch.allclose(state["v"], v1, rtol=0, atol=1e-15)
        assert torch.allclose(new, eta * (1 - beta1) * d / (v1.sqrt() + tau), rtol=0, atol=1e-15)
    zero = Adaptive("adam", beta1, beta2, tau, eta)  # v0=zero: today's numbers
    assert torch.equal(zero.init_state(x)["v"], torch.zeros_like(x))
    assert compose(["algorithm=fedadam", "algorithm.adaptive.v0=tau2"]).algorithm.adaptive.v0 == "tau2"
    with pytest.raises(ConfigError, match="algorithm.adaptive.v0 must be one of zero, tau2"):
        compose(["algorithm=fedadam", "algorithm.adaptive.v0=one"])


def test_duplicate_seeds_are_refused(tmp_path):
    from pipeline.api import run
    from pipeline.grid import load_grid

    (tmp_path / "params.yaml").write_text("seeds: [1, 1]\nexperiments:\n  a: {algorithm: fedavg}\n")
    with pytest.raises(ConfigError, match=r"seeds lists seed 1 more than once"):
        load_grid(tmp_path / "params.yaml")
    with pytest.raises(ConfigError, match=r"^seeds: seed 2 is given more than once"):
        run([], seeds=(1, 2, 2))
