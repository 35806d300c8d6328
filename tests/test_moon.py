"""MOON (docs/algorithms.md, MOON) and the executor service it uses (``forward_of``), and the two rules the
interface was proven with: MOON and a server Adam over FedProx, alone and under FedBug, from the CLI too."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fl_core.algorithms import Moon, contrastive_loss
from fl_core.algorithms.base import ClientContext, ClientUpdate, RoundContext
from fl_core.engine.executors import reference_vector
from fl_core.engine.state import flatten_params, load_flat
from fl_core.params import ParamSpec

from conftest import ROOT, run_sim


# ------------------------------------------------------------------------------------ the contrastive loss

def test_contrastive_loss_by_hand():
    # z = [1, 0]; z_glob = [1, 1] (cos = 1/sqrt 2); z_prev = [0, 1] (cos = 0); tau = 0.5
    # l = -log(e^(sqrt2) / (e^(sqrt2) + e^0)) = log(1 + e^(-sqrt2))
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    got = contrastive_loss(z, torch.tensor([[1.0, 1.0]], dtype=torch.float64),
                           torch.tensor([[0.0, 1.0]], dtype=torch.float64), 0.5)
    assert got.shape == (1,)
    assert float(got) == pytest.approx(math.log(1.0 + math.exp(-math.sqrt(2.0))), rel=1e-12)


def test_contrastive_loss_is_log_two_without_gradient_when_previous_equals_global():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    loss = contrastive_loss(z, ref, ref, 0.3)
    assert torch.allclose(loss, torch.full((5,), math.log(2.0), dtype=torch.float64))
    (g,) = torch.autograd.grad(loss.sum(), z)
    assert float(g.abs().max()) < 1e-12


def test_moon_loss_weighs_out_padding_samples():
    algo = Moon(mu=2.0, tau=0.5)
    gen = torch.Generator().manual_seed(1)
    z, zg, zp = (torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    rctx = RoundContext(round=2, lr=0.1, global_flat=torch.zeros(1), spec=None)  # round 2: the negative is used
    ctx = ClientContext(round=rctx, client_id=0, num_samples=3, num_steps=1,
                        sample_weight=torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64),
                        reference_outputs={"global": (None, zg), "state:prev": (None, zp)})
    got = algo.local_objective(ctx, {}, None, z, None).extra
    want = 2.0 * contrastive_loss(z[:3], zg[:3], zp[:3], 0.5).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    assert Moon(mu=0.0).local_objective(ctx, {}, None, z, None).extra is None


def test_moon_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"^algorithm.moon.tau must be > 0, got 0"):
        Moon(tau=0.0)
    with pytest.raises(ValueError, match=r"^algorithm.moon.mu must be >= 0, got -1"):
        Moon(mu=-1.0)


# ------------------------------------------------------------------------------------ the executor service

def test_forward_of_entries_name_the_global_model_or_a_state_vector():
    g = torch.arange(3.0)
    rctx = RoundContext(round=1, lr=0.1, global_flat=g, spec=None)
    assert reference_vector("global", rctx, None) is g
    prev = torch.ones(3)
    assert reference_vector("state:prev", rctx, {"prev": prev}) is prev
    with pytest.raises(ValueError, match=r"^forward_of entry 'state:c': expected 'global' or 'state:<key>' of the "
                                         r"client's state \(keys: prev\)$"):
        reference_vector("state:c", rctx, {"prev": prev})


def test_forward_at_is_the_model_at_that_vector_and_leaves_the_model_alone(digits):
    sim, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8")
    model, ex = sim.model, sim.executor
    spec = ParamSpec.from_model(model)
    before = flatten_params(model).clone()
    other = before + 0.01 * torch.randn(before.shape, generator=torch.Generator().manual_seed(0))
    x = ex.data.x[:7]
    logits, feats = ex.forward_at(spec, other, x)
    assert torch.equal(flatten_params(model), before) and model.training
    load_flat(model, other)
    model.eval()
    want_logits, want_feats = model.forward_features(x)
    model.train()
    assert torch.allclose(logits, want_logits, atol=1e-6) and torch.allclose(feats, want_feats, atol=1e-6)
    assert not logits.requires_grad


# ------------------------------------------------------------------------------------ MOON end to end

PARTIAL = ["model=mlp", "partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5",
           "partition.min_size=5", "partition.num_clients=6",
           "train.participation=0.5", "train.rounds=3", "engine.dtype=float64"]


def test_moon_sequential_equals_vectorized_with_partial_participation_and_unequal_clients(digits):
    seq_sim, seq = run_sim(digits, "algorithm=moon", "algorithm.moon.mu=5", *PARTIAL, "engine.executor=sequential")
    _, vec = run_sim(digits, "algorithm=moon", "algorithm.moon.mu=5", *PARTIAL, "engine.executor=vectorized")
    sizes = {seq_sim.executor.data.size(i) for i in range(6)}
    assert len(sizes) > 1  # unequal step counts: the vectorised executor pads batches
    assert float((seq.final_flat - vec.final_flat).abs().max()) <= 1e-9


def test_moon_with_a_weight_differs_from_fedavg(digits):
    # mu = 0 equals FedAvg to the bit (conformance suite); mu = 5 must change the model
    _, moon = run_sim(digits, "algorithm=moon", "algorithm.moon.mu=5", *PARTIAL)
    _, avg = run_sim(digits, "algorithm=fedavg", *PARTIAL)
    assert float((moon.final_flat - avg.final_flat).abs().max()) > 1e-4


def test_moon_state_is_the_model_the_client_trained(digits):
    from fl_core.engine.state import ClientStateStore

    sim, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8",
                     "engine.dtype=float64")
    ex, g = sim.executor, flatten_params(sim.model).detach().clone()
    rctx = RoundContext(round=2, lr=0.05, global_flat=g, spec=sim.spec, sampled=(0, 1))
    store = ClientStateStore("cpu")
    updates = ex.run_round(rctx, [0, 1], store)
    for u in updates:
        assert torch.equal(store.get(u.client_id, lambda: None)["prev"], g + u.delta)


# ------------------------------------------------------------------------------------ first-time participants

def test_round_one_has_no_negative_so_moon_is_fedavg_there(digits):
    # the authors' pool is empty in round 0: l_con is the CE of the positive alone, 0 with zero gradient
    one = ["model=mlp", "train.rounds=1", "engine.dtype=float64"]
    _, moon = run_sim(digits, "algorithm=moon", "algorithm.moon.mu=5", *one)
    _, avg = run_sim(digits, "algorithm=fedavg", *one)
    assert torch.equal(moon.final_flat, avg.final_flat)


def test_no_negative_is_zero_loss_with_zero_gradient():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(z, torch.randn(4, 3, generator=gen, dtype=torch.float64), None, 0.5)
    (g,) = torch.autograd.grad(loss.sum(), z)
    assert torch.equal(loss, torch.zeros(4, dtype=torch.float64)) and torch.equal(g, torch.zeros_like(g))


def test_initial_vector_draws_as_the_run_draws_its_global_model(digits):
    from fl_core.algorithms.moon import initial_vector
    from fl_core.seeding import derive_seed

    sim, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8", "seed=4",
                     "algorithm.moon.projection_dim=3")
    rng = torch.get_rng_state()
    got = initial_vector(copy.deepcopy(sim.model), derive_seed("init", 4))
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream is untouched
    sim._restored = None
    assert torch.equal(got, sim._fresh_state()["global"])


def test_a_first_time_client_after_round_one_contrasts_with_its_own_initial_network(digits):
    from fl_core.algorithms.moon import initial_vector
    from fl_core.engine.state import ClientStateStore
    from fl_core.seeding import derive_seed

    sim, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8", "seed=5",
                     "engine.dtype=float64")
    algo, g = sim.algo, flatten_params(sim.model).detach().clone()
    rctx = RoundContext(round=3, lr=0.05, global_flat=g, spec=sim.spec, sampled=(0,), seed=5)
    state = ClientStateStore("cpu").get(0, lambda: algo.init_client_state(g))
    assert float(state["fresh"]) == 1.0 and torch.equal(state["prev"], g)
    ctx = ClientContext(round=rctx, client_id=0, num_samples=1, num_steps=1, state=state)
    algo.client_begin(ctx, None)
    own = initial_vector(copy.deepcopy(sim.model), derive_seed("moon-init", 5, 0))
    assert torch.equal(state["prev"], own) and not torch.equal(own, g)
    other = initial_vector(copy.deepcopy(sim.model), derive_seed("moon-init", 5, 1))
    assert not torch.equal(own, other)  # drawn independently per client
    upd = ClientUpdate(0, 1, 1, torch.full_like(g, 0.5), 0.0)
    algo.finish_client(ctx, upd)
    assert float(state["fresh"]) == 0.0 and torch.equal(state["prev"], g + 0.5)
    algo.client_begin(ctx, None)  # trained once: its previous model stays the one it trained
    assert torch.equal(state["prev"], g + 0.5)


@pytest.mark.parametrize("client_state", ["memory", "disk"])
def test_moon_resumed_equals_uninterrupted_with_late_first_participants(digits, tmp_path, client_state):
    class Stop(Exception):
        pass

    def stop_after_round_1(r, row):
        if r == 1:
            raise Stop

    args = ["algorithm=moon", "algorithm.moon.mu=5", "algorithm.moon.projection_dim=4", *PARTIAL,
            "train.sampler=fixed", "engine.checkpoint_every=1", f"engine.client_state={client_state}"]
    ck = tmp_path / "ck.pt"
    with pytest.raises(Stop):
        run_sim(digits, *args, checkpoint_path=ck, callbacks=[stop_after_round_1])
    _, resumed = run_sim(digits, *args, checkpoint_path=ck)
    _, full = run_sim(digits, *args)
    assert resumed.resumed_from == 1 and torch.equal(resumed.final_flat, full.final_flat)


# ------------------------------------------------------------------------------------ the projection head

MODEL_LAYOUTS = [("small_cnn", "default"), ("std_cnn", "default"), ("mcmahan_cnn", "default"), ("mlp", "default"),
                 ("logreg", "default"), ("tiny_cnn", "code5"), ("tiny_cnn", "paper6"), ("resnet18", "module"),
                 ("resnet18", "block"), ("resnet34", "module"), ("vgg9", "default"), ("vgg11", "default"),
                 ("vgg19", "default"), ("m1d_mlp", "default"), ("m1d_cnn", "default"), ("m1d_gru", "default"),
                 ("vit_tiny", "default"), ("vit_b_16", "default"),
                 ("logreg_binary", "default"), ("pfl_cnn", "default"), ("quadratic", "default"),
                 ("char_lstm", "default")]


@pytest.mark.parametrize("name,units", MODEL_LAYOUTS)
def test_feature_dim_is_the_width_of_the_features_and_a_head_is_a_unit_before_the_classifier(name, units):
    from fl_core.algorithms.moon import attach_projection_head
    from fl_core.config import ModelConfig
    from fl_core.models import MODELS, build_model

    assert {n for n, _ in MODEL_LAYOUTS} == set(MODELS)
    shape, classes = ((3, 64, 64), 200) if name == "tiny_cnn" else ((3, 32, 32), 10)
    dataset = "cifar10"
    if name.startswith("m1d_"):  # the MNIST-1D models read sequences [1, 1, 40]
        shape, dataset = (1, 1, 40), "mnist1d"
    if name == "quadratic":  # samples [a, -y] of dataset=quadratic, two logits
        shape, classes, dataset = (1, 1, 5), 2, "quadratic"
    if name == "char_lstm":  # character indices [1, 1, 80] of dataset=shakespeare, 80 logits
        shape, classes, dataset = (1, 1, 80), 80, "shakespeare"
    m = build_model(ModelConfig(name=name, units=units), dataset, shape, classes)
    x = torch.randint(0, classes, (2, *shape)).float() if name == "char_lstm" else torch.randn(2, *shape)
    with torch.no_grad():
        _, f = m.eval().forward_features(x)
    assert m.feature_dim() == f.shape[1]
    before = ParamSpec.from_model(m)
    attach_projection_head(m, 7)
    after = ParamSpec.from_model(m)
    k = before.num_units
    assert after.names[:len(before.names)] == before.names and after.num_units == k + 1
    assert after.names[len(before.names):] == ("moon_head.0.weight", "moon_head.0.bias", "moon_head.2.weight",
                                                "moon_head.2.bias")
    assert after.d - before.d == f.shape[1] ** 2 + f.shape[1] + 7 * f.shape[1] + 7
    # the head is unit M-1 (before the classifier's, still the last); the other units keep their indices
    assert set(after.unit_of[len(before.names):]) == {k - 1}
    assert [u if u < k - 1 else u + 1 for u in before.unit_of] == list(after.unit_of[:len(before.names)])
    assert m.feature_dim() == f.shape[1]
    attach_projection_head(m, 7)  # the factory builds the stack twice: the head is kept
    assert ParamSpec.from_model(m) == after


def test_the_head_is_initialised_with_the_model_after_its_other_parameters(digits):
    plain, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8")
    head, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8",
                      "algorithm.moon.projection_dim=4")
    g0, g1 = plain._fresh_state()["global"], head._fresh_state()["global"]
    assert torch.equal(g1[:g0.numel()], g0) and g1.numel() > g0.numel()


def test_the_head_maps_each_models_own_features(digits):
    from fl_core.algorithms.moon import project

    sim, _ = run_sim(digits, "algorithm=moon", "train.rounds=1", "model=mlp", "model.hidden=8",
                     "algorithm.moon.projection_dim=4", "engine.dtype=float64")
    h = torch.randn(5, 8, dtype=torch.float64)
    views = sim.spec.views(flatten_params(sim.model))
    assert torch.allclose(project(views, h), sim.model.moon_head(h), atol=1e-12)
    assert torch.allclose(project(dict(sim.model.named_parameters()), h), sim.model.moon_head(h), atol=1e-12)


@pytest.mark.parametrize("wrapper", ["fedbug", "fednlr"])
def test_the_head_composes_with_wrappers_that_read_the_models_structure(digits, wrapper):
    args = [f"algorithm={wrapper}", "algorithm.name=moon", "algorithm.moon.mu=5", "algorithm.moon.projection_dim=4",
            *PARTIAL]
    sim, seq = run_sim(digits, *args, "engine.executor=sequential")
    _, vec = run_sim(digits, *args, "engine.executor=vectorized")
    assert "moon_head.0.weight" in sim.spec.names
    assert float((seq.final_flat - vec.final_flat).abs().max()) <= 1e-9


def test_the_head_is_refused_where_it_cannot_apply():
    from fl_core.config import compose
    from fl_core.schema import ConfigError

    with pytest.raises(ConfigError, match=r"^algorithm.moon.projection_dim=8 needs algorithm.moon.mu > 0: the head "
                                          r"is trained by l_con alone"):
        compose(["algorithm=moon", "algorithm.moon.projection_dim=8", "algorithm.moon.mu=0"])
    with pytest.raises(ConfigError, match=r"^algorithm.moon.projection_dim=8 needs the model to attach the head to$"):
        Moon(projection_dim=8)
    with pytest.raises(ConfigError, match=r"^algorithm.moon.projection_dim=8: the head needs the width of the "
                                          r"model's features"):
        Moon(projection_dim=8, model=torch.nn.Linear(3, 2))
    with pytest.raises(ConfigError, match=r"^algorithm.moon.first_previous must be one of official, global, got 'x'"):
        Moon(first_previous="x")


# ------------------------------------------------------------------------------------ from the CLI

def _cli(args, cwd):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # the callers read the return code


@pytest.mark.slow  # two CLI runs with MLflow (~15 s each on 2 cores)
@pytest.mark.parametrize("args,name,algorithm", [
    (["algorithm=fedbug", "algorithm.name=moon"], "fedbug-p0.2-moon_shards-s2_digits",
     "fedbug[P=0.2](moon[mu=1,tau=0.5])"),
    (["algorithm=fedbug", "algorithm.name=fedprox", "algorithm.server_opt=adam", "algorithm.eta_g=0.01"],
     "fedbug-p0.2-adam-fedprox_shards-s2_digits",
     "fedbug[P=0.2](adam[eta_g=0.01,beta1=0.9,beta2=0.99,tau=0.001](fedprox))"),
])
def test_moon_and_server_adam_fedprox_run_from_the_cli_under_fedbug(tmp_path, args, name, algorithm):
    proc = _cli([*args, "train.rounds=2", "train.local_epochs=1", "train.batch_size=64", "seed=1",
                 "engine.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "results" / name / "experiment.json").read_text())
    assert info["algorithm"] == algorithm
    metrics = json.loads((tmp_path / "results" / name / "metrics.json").read_text())
    assert metrics["rounds"] == 2 and 0.0 < metrics["final_acc_mean"] <= 1.0


def test_presets_of_the_published_server_rules_are_fedavg_with_the_optimiser():
    from fl_core.config import compose

    for preset, opt in (("fedavgm", "momentum"), ("fedadam", "adam"), ("fedyogi", "yogi"), ("fedadagrad", "adagrad")):
        a = compose([f"algorithm={preset}"]).algorithm
        assert (a.name, a.server_opt) == ("fedavg", opt)
    assert (ROOT / "conf" / "algorithm" / "moon.yaml").exists()
