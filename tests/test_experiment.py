"""One experiment resolved once (fl_core.experiment): its default name, its fingerprint (pinned: a run resumed after
a change of the code must find its earlier checkpoint), its keys, and who reads it."""

import pytest

from fl_core.config import ConfigError, compose
from fl_core.experiment import ResolvedExperiment, derive_name, fingerprint, resolve

# (overrides, fingerprint, default name) as the code before fl_core.experiment computed them
# (pipeline.train.experiment_fingerprint / derive_name at commit 0cc88c4)
PINNED = [
    ([], "92770554bbff", "fedavg_shards-s2_digits"),
    (["algorithm=fedprox", "partition=dirichlet", "partition.alpha=0.3", "train.rounds=7"], "5eb6cb4a17d0",
     "fedprox_dirichlet-a0.3_digits"),
    (["algorithm.wrappers=[fedbug]", "algorithm.server_opt=adam", "engine.kernels=portable", "seed=3"],
     "e77891971301", "fedbug-p0.2-fedadam_shards-s2_digits"),
    # the compression presets, wrappers then, message transforms now (same numbers)
    (["algorithm=topk"], "b949d09c61a8", "topk-fedavg_shards-s2_digits"),
    (["algorithm=fedpaq"], "091eeaade854", "qsgd-fedavg_shards-s2_digits"),
    (["algorithm=qsgd"], "466c6b766ab9", "qsgd-fedavg_shards-s2_digits"),
    # written before partition.balance_cap, dataset.subset / max_clients and the ${natural_clients:} resolver
    (["dataset=synthetic", "partition=natural"], "ce2635844863", "fedavg_natural_synthetic"),
    (["partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5"], "741338416077",
     "fedavg_dirichlet-a0.5_digits"),
    (["dataset=quadratic", "partition=natural", "algorithm=scaffold"], "2a722d0ed180", "scaffold_natural_quadratic"),
]


@pytest.mark.parametrize("overrides,fp,name", PINNED)
def test_fingerprint_and_default_name_are_those_of_before(overrides, fp, name):
    cfg = compose(overrides)
    assert fingerprint(cfg) == fp
    assert derive_name(cfg) == name


def test_the_fingerprint_leaves_out_the_seed_and_what_does_not_change_the_numbers():
    base = fingerprint(compose([]))
    assert fingerprint(compose(["seed=7"])) == base
    assert fingerprint(compose(["engine.progress=false", "tracking.enabled=false"])) == base
    # a section of a rule not in the stack (compose refuses it from a user; user=() lets it through, as sweeps do)
    assert fingerprint(compose(["algorithm.fedprox.mu=0.5"], user=())) == base
    assert fingerprint(compose(["train.lr=0.5"])) != base


def test_resolve_describes_the_experiment_once():
    from fl_core.data import dataset_tag, partition_key
    from fl_core.models import resolve_model_name

    cfgs = [compose(["partition=dirichlet", "partition.alpha=0.3", "algorithm.wrappers=[fedbug]", f"seed={s}"])
            for s in (2, 1)]
    exp = resolve(cfgs)
    assert isinstance(exp, ResolvedExperiment)
    assert exp.name == derive_name(cfgs[0]) == "fedbug-p0.2-fedavg_dirichlet-a0.3_digits"
    assert exp.fingerprint == fingerprint(cfgs[0]) == fingerprint(cfgs[1])
    assert exp.rules == ("fedavg", "fedbug")
    assert exp.dataset == "digits" and exp.dataset_tag == dataset_tag(cfgs[0].dataset)
    assert exp.partition_key == partition_key(cfgs[0].partition, exp.dataset_tag)
    assert exp.model == resolve_model_name("auto", "digits") != "auto"  # model=auto resolved for the dataset
    assert exp.seeds == (2, 1) and exp.configs == tuple(cfgs) and exp.cfg0 is cfgs[0]
    assert exp.job_key(1) == (exp.fingerprint, 1)
    with pytest.raises(AttributeError):
        exp.name = "other"  # frozen
    assert resolve([compose(["name=mine"])]).name == "mine"
    with pytest.raises(ConfigError):
        resolve([])


def test_the_distributed_job_key_is_the_fingerprint_and_the_seed():
    from fl_core.engine.factory import job_key

    cfg = compose(["seed=4"])
    assert job_key(cfg) == (fingerprint(cfg), 4) == resolve([cfg]).job_key(4)
