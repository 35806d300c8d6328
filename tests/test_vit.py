"""Vision Transformers of fl_core.models.vit (docs/algorithms.md, Model catalogue, FedBCGD blocks and FedBCGD): units,
shapes, the ImageNet input preset, local pretrained weights, the ViT-B block table against FedBCGD's Table 11, FedNLR's
refusal, and runs of the ViT presets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_core.algorithms import block_partition
from fl_core.compat import torchvision
from fl_core.config import ConfigError, ModelConfig, compose
from fl_core.models import build_model
from fl_core.models.vit import ViTTiny, load_torchvision_weights
from fl_core.params import ParamSpec

from test_sources import write_cifar100

ROOT = Path(__file__).resolve().parent.parent
CIFAR100 = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))  # the dataset's mean / std of x / 255
LAYER = 7_087_872  # one ViT-B encoder layer, weights and biases
EMBEDDINGS = 589_824 + 768 + 768 + 151_296  # conv_proj weight + bias, class_token, pos_embedding
FINAL_NORM = 1_536
TABLE11_BLOCK, TABLE11_SHARED = 14_299_520, 153_600  # FedBCGD Table 11: "ViT-Block 1..5" and the shared "FC-100"


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def b16():
    """ViT-B/16 for 100 classes (built once: ~1 s, ~350 MB)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(name="vit_b_16"), "cifar100", (3, 32, 32), 100, input_norm=CIFAR100)


@pytest.fixture(scope="module")
def saved_b16(tmp_path_factory):
    """A randomly initialised torchvision vit_b_16 with ImageNet's 1000-class head, saved as its state dict (the
    layout of ViT_B_16_Weights.IMAGENET1K_V1's file)."""
    torch.manual_seed(1)
    state = torchvision().models.vit_b_16(weights=None).state_dict()
    path = tmp_path_factory.mktemp("weights") / "vit_b_16-random.pth"
    torch.save(state, path)
    return path, state


# ------------------------------------------------------------------------------------------------ units and shapes

@pytest.mark.parametrize("name", ["vit_tiny", "vit_b_16"])
def test_units_cover_every_parameter_once(b16, name):
    model = b16 if name == "vit_b_16" else build_model(ModelConfig(name=name), "cifar100", (3, 32, 32), 100)
    units = model.units()  # raises if a parameter is in 0 or 2+ units
    flat = [n for u in units for n in u]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters()) and len(flat) == len(set(flat))
    assert len(units) == 12 and all(units)  # one unit per encoder layer
    assert units[0][:4] == ["class_token", "conv_proj.weight", "conv_proj.bias", "encoder.pos_embedding"]
    assert all(n.startswith("encoder.layers.encoder_layer_0.") for n in units[0][4:])
    assert units[-1][-4:] == ["encoder.ln.weight", "encoder.ln.bias", "heads.head.weight", "heads.head.bias"]
    for i, unit in enumerate(units[1:-1], start=1):
        assert all(n.startswith(f"encoder.layers.encoder_layer_{i}.") for n in unit)
    assert model.feature_dim() == (768 if name == "vit_b_16" else 64)  # the head's input: the classifier is last
    assert list(model.buffers()) == []  # the vectorised executor needs no buffers


def test_vit_tiny_shapes_counts_and_torchvision_equivalence():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="vit_tiny"), "cifar100", (3, 32, 32), 100)
    assert _count(m) == 607_296 + 65 * 100 == 613_796
    assert _count(ViTTiny((3, 32, 32), 10)) == 607_296 + 65 * 10
    m.init_parameters()
    x = torch.randn(5, 3, 32, 32)
    logits, f = m.forward_features(x)
    assert logits.shape == (5, 100) and f.shape == (5, 64)
    assert torch.count_nonzero(logits) == 0  # torchvision's zero-initialised head
    torch.nn.init.normal_(m.heads.head.weight)
    # the same function as torchvision's VisionTransformer with the same tensors
    ref = torchvision().models.VisionTransformer(image_size=32, patch_size=4, num_layers=12, num_heads=4,
                                                  hidden_dim=64, mlp_dim=256, num_classes=100)
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.allclose(m(x), ref(x), atol=1e-5)
        # other channel counts and sizes: its own patch embedding, 7x7 patches + the class token
        g = ViTTiny((1, 28, 28), 10)
        assert g.conv_proj.in_channels == 1 and g(torch.randn(2, 1, 28, 28)).shape == (2, 10)
        assert g.encoder.pos_embedding.shape == (1, 50, 64)
    for shape in ((3, 32, 30), (3, 30, 30), (1, 1, 40)):
        with pytest.raises(ValueError, match=r"^vit_tiny needs square images with a side divisible by its patch "
                                             rf"size 4, got inputs \[{shape[0]}, {shape[1]}, {shape[2]}\]$"):
            ViTTiny(shape, 10)


def test_vit_b_16_structure_counts_and_refusals(b16):
    ref = torchvision().models.vit_b_16(weights=None, num_classes=100)
    assert [(n, p.shape) for n, p in b16.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert _count(b16) == 85_798_656 + 769 * 100 == 12 * LAYER + EMBEDDINGS + FINAL_NORM + 769 * 100
    layer0 = sum(p.numel() for n, p in b16.named_parameters() if n.startswith("encoder.layers.encoder_layer_0."))
    assert layer0 == LAYER
    with pytest.raises(ValueError, match=r"^vit_b_16 needs RGB images \[3, H, W\] \(its patch embedding is the "
                                         r"ImageNet one\), got inputs \[1, 8, 8\]$"):
        build_model(ModelConfig(name="vit_b_16"), "digits", (1, 8, 8), 10)


@pytest.mark.parametrize("size", [32, 64])
def test_vit_b_16_input_is_torchvisions_imagenet_preset(b16, size):
    """prepare() on the dataset-normalised batch = the weights' own preset (resize 256, centre crop 224, ImageNet
    normalisation) on the raw image in [0, 1]; only the batch in flight is 224x224."""
    torch.manual_seed(2)
    raw = torch.rand(3, 3, size, size)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in CIFAR100)
    preset = torchvision().models.ViT_B_16_Weights.IMAGENET1K_V1.transforms()
    assert (preset.resize_size, preset.crop_size) == ([256], [224])
    got = b16.prepare((raw - mean) / std)
    assert got.shape == (3, 3, 224, 224)
    assert torch.allclose(got, preset(raw), atol=1e-5)


def test_vit_b_16_forward_is_torchvisions_on_the_prepared_input(b16):
    ref = torchvision().models.vit_b_16(weights=None, num_classes=100)
    torch.manual_seed(3)
    for p in b16.heads.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ref.load_state_dict(b16.state_dict())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        logits, f = b16.forward_features(x)
        assert logits.shape == (1, 100) and f.shape == (1, 768)
        assert torch.allclose(logits, ref(b16.prepare(x)), atol=1e-4)
    b16.init_parameters()  # back to the fixture's zero head


def test_init_parameters_is_torchvisions_init_drawn_from_the_seed():
    a, b = ViTTiny((3, 32, 32), 10), ViTTiny((3, 32, 32), 10)
    for m in (a, b):
        torch.manual_seed(5)
        m.init_parameters()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # a pure function of the seed
    p = dict(a.named_parameters())
    assert not p["class_token"].any() and not p["heads.head.weight"].any() and not p["conv_proj.bias"].any()
    assert abs(p["encoder.pos_embedding"].std().item() / 0.02 - 1) < 0.1
    assert abs(p["conv_proj.weight"].std().item() / (1 / 48) ** 0.5 - 1) < 0.15  # truncated normal, fan_in 3*4*4
    layer = "encoder.layers.encoder_layer_3."
    assert not p[layer + "self_attention.in_proj_bias"].any() and not p[layer + "self_attention.out_proj.bias"].any()
    assert p[layer + "mlp.0.bias"].abs().max() < 1e-5 and p[layer + "mlp.0.weight"].abs().max() <= (6 / 320) ** 0.5
    assert torch.equal(p[layer + "ln_1.weight"], torch.ones(64))


# --------------------------------------------------------------------------------------------- FedBCGD blocks

def test_vit_b_16_fedbcgd_blocks_against_table_11(b16):
    """Six blocks of two encoder layers (embeddings in Block 1, the final LayerNorm in Block 6), the head shared;
    Table 11's equal blocks of 14,299,520 are no whole-tensor grouping (docs/algorithms.md, FedBCGD blocks)."""
    spec = ParamSpec.from_model(b16)
    blocks, shared = block_partition(b16, spec.names, 0, "auto")  # blocks=0: the table's N = 6
    assert (blocks, shared) == block_partition(b16, spec.names, 6, "paper")
    flat = sorted(i for b in blocks for i in b) + sorted(shared)
    assert sorted(flat) == list(range(len(spec.names))) and len(flat) == len(set(flat))
    sizes = [sum(spec.numels[i] for i in b) for b in blocks]
    assert sizes == [EMBEDDINGS + 2 * LAYER, 2 * LAYER, 2 * LAYER, 2 * LAYER, 2 * LAYER, 2 * LAYER + FINAL_NORM]
    assert sizes == [14_918_400, 14_175_744, 14_175_744, 14_175_744, 14_175_744, 14_177_280]
    assert [spec.names[i] for i in shared] == ["heads.head.weight", "heads.head.bias"]
    assert sum(spec.numels[i] for i in shared) == 769 * 100
    # the documented difference to Table 11 (five printed blocks of 14,299,520; N = 6 in section 5.2)
    assert [s - TABLE11_BLOCK for s in sizes] == [618_880, -123_776, -123_776, -123_776, -123_776, -122_240]
    # why no grouping of whole tensors gives Table 11: every tensor but the head's holds a multiple of 768 entries
    assert all(spec.numels[i] % 768 == 0 for b in blocks for i in b) and TABLE11_BLOCK % 768 == 128
    # what it is instead: the backbone without the final LayerNorm cut into six equal shares
    assert 6 * TABLE11_BLOCK == spec.d - 769 * 100 - FINAL_NORM == sum(sizes) - FINAL_NORM
    # the shared "FC-100" row is the weight of a 200-class (Tiny-ImageNet) head
    assert TABLE11_SHARED == 768 * 200


def test_vit_tiny_uses_the_vit_b_block_table():
    m = ViTTiny((3, 32, 32), 100)
    spec = ParamSpec.from_model(m)
    blocks, shared = block_partition(m, spec.names, 0, "auto")
    assert len(blocks) == 6 and [spec.names[i] for i in shared] == ["heads.head.weight", "heads.head.bias"]
    firsts = [spec.names[b[0]] for b in blocks]
    assert firsts[0] == "class_token"
    assert firsts[1:] == [f"encoder.layers.encoder_layer_{i}.ln_1.weight" for i in (2, 4, 6, 8, 10)]
    assert spec.names[blocks[-1][-1]] == "encoder.ln.bias"
    assert sum(spec.numels[i] for b in blocks for i in b) + sum(spec.numels[i] for i in shared) == spec.d


def test_fednlr_refuses_the_vits():
    from fl_core.algorithms import build_algorithm

    m = ViTTiny((3, 32, 32), 10)
    cfg = compose(["algorithm=fednlr"])
    with pytest.raises(ValueError, match=r"^algorithm.wrappers=\[fednlr\] needs a model with neuron_layers\(\)$"):
        build_algorithm(cfg.algorithm, ParamSpec.from_model(m), m)


def test_ccvr_retrains_the_vit_head(tmp_path):
    """CCVR's classifier is the last neuron layer, else the last prefix of the last unit (heads.head here)."""
    from fl_core.algorithms.ccvr import classifier_name
    from fl_core.data import load_source, make_partition
    from fl_core.engine.factory import build_simulator
    from fl_core.models.resnet import ResNet18GN
    from fl_core.models.vgg import VGG11

    assert classifier_name(ViTTiny((3, 32, 32), 10)) == "heads.head"
    assert classifier_name(ResNet18GN((3, 32, 32), 10, units="block")) == "fc"
    assert classifier_name(VGG11((3, 32, 32), 10)) == "fc2" and classifier_name(None) == "fc"
    write_cifar100(tmp_path, n_train=20, n_test=4)
    cfg = compose(["dataset=cifar100", f"dataset.root={tmp_path}", "dataset.verify=false", "model=vit_tiny",
                   "algorithm=ccvr", "algorithm.ccvr.epochs=1", "partition=iid", "partition.num_clients=2",
                   "train.rounds=1", "train.local_epochs=1", "engine.device=cpu", "engine.executor=sequential",
                   "engine.checkpoint_every=0", "engine.progress=false", "tracking.enabled=false"])
    ds = load_source(cfg.dataset, Path(cfg.dataset.root))
    sim = build_simulator(cfg, ds, make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes))
    row = sim.run().history[-1]
    assert 0.0 <= row["post_test_acc"] <= 1.0


# ---------------------------------------------------------------------------------------------- weights file

def test_weights_load_all_but_the_head(saved_b16):
    path, state = saved_b16
    torch.manual_seed(4)
    m = build_model(ModelConfig(name="vit_b_16", weights=str(path)), "cifar10", (3, 32, 32), 10)
    own = m.state_dict()
    assert state["heads.head.weight"].shape == (1000, 768) and own["heads.head.weight"].shape == (10, 768)
    assert not own["heads.head.weight"].any() and not own["heads.head.bias"].any()  # the fresh 10-class head
    for key in ("encoder.layers.encoder_layer_5.mlp.0.weight", "conv_proj.weight", "encoder.pos_embedding",
                "class_token", "encoder.ln.weight"):
        assert torch.equal(own[key], state[key]), key
    assert all(torch.equal(own[k], state[k]) for k in own if not k.startswith("heads."))
    # a run's seeded initialisation (every layer's reset, then the model's own) keeps the pretrained network
    torch.manual_seed(9)
    for sub in m.modules():
        if sub is not m and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    m.init_parameters()
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items() if not k.startswith("heads."))
    assert not m.heads.head.weight.any()


def test_weights_with_legacy_mlp_names_load(tmp_path):
    """Older torchvision files name the MLP's linears linear_1 / linear_2 (torchvision renames them on loading)."""
    torch.manual_seed(6)
    m = ViTTiny((3, 32, 32), 10)
    legacy = {k.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2."): v
              for k, v in m.state_dict().items()}
    assert "encoder.layers.encoder_layer_0.mlp.linear_1.weight" in legacy
    torch.save(legacy, tmp_path / "legacy.pth")
    other = ViTTiny((3, 32, 32), 10)
    load_torchvision_weights(other, str(tmp_path / "legacy.pth"))
    assert torch.equal(other.encoder.layers[0].mlp[0].weight, m.encoder.layers[0].mlp[0].weight)


def test_weights_errors_are_one_line_naming_the_path_and_the_key(b16, tmp_path):
    missing = tmp_path / "nowhere.pth"
    with pytest.raises(ConfigError) as err:
        build_model(ModelConfig(name="vit_b_16", weights=str(missing)), "cifar100", (3, 32, 32), 100)
    assert str(err.value) == (f"model.weights={missing}: no such file (a local copy of torchvision's vit_b_16 "
                              "ImageNet weights, vit_b_16-c867db91.pth)")
    ok = {k: v for k, v in list(b16.state_dict().items())[:3]}  # class_token, conv_proj.weight, conv_proj.bias
    cases = {
        "typo": ({**ok, "encoder.pos_embeding": torch.zeros(1, 197, 768)},
                 "key encoder.pos_embedding is missing (it has encoder.pos_embeding, which the model has not); "
                 "expected a torchvision vit_b_16 state dict"),
        "shape": ({"class_token": torch.zeros(1, 1, 768), "conv_proj.weight": torch.zeros(768, 3, 32, 32)},
                  "key conv_proj.weight has shape [768, 3, 32, 32], the model needs [768, 3, 16, 16]"),
        "list": ([torch.zeros(1)], "not a state dict (a mapping of parameter names to tensors), got list"),
    }
    for name, (obj, message) in cases.items():
        path = tmp_path / f"{name}.pth"
        torch.save(obj, path)
        with pytest.raises(ConfigError) as err:
            load_torchvision_weights(b16, str(path))
        assert str(err.value) == f"model.weights={path}: {message}"
    (tmp_path / "garbage.pth").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=rf"^model.weights={tmp_path / 'garbage.pth'}: torch.load cannot read it: "):
        load_torchvision_weights(b16, str(tmp_path / "garbage.pth"))
    tiny = ViTTiny((3, 32, 32), 10)
    torch.save({**tiny.state_dict(), "extra.weight": torch.zeros(1)}, tmp_path / "extra.pth")
    with pytest.raises(ConfigError) as err:
        load_torchvision_weights(tiny, str(tmp_path / "extra.pth"))
    assert str(err.value) == f"model.weights={tmp_path / 'extra.pth'}: key extra.weight is not in the model"
    assert "\n" not in str(err.value)


def test_weights_key_only_for_vit_b_16():
    with pytest.raises(ConfigError, match=r"^model.weights has no effect with model.name=vit_tiny: it is used only "
                                          r"with model.name=vit_b_16; remove it$"):
        compose(["model=vit_tiny", "model.weights=/x/vit.pth"])
    assert compose(["model=vit_b_16", "model.weights=/x/vit.pth"]).model.weights == "/x/vit.pth"


# ----------------------------------------------------------------------------------------------- fl-train runs

def _train(args, cwd):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=cwd, env=env, capture_output=True,
                          check=False, text=True, timeout=600)


def _tiny_cifar100(tmp_path):
    root = tmp_path / "data"
    write_cifar100(root, n_train=40, n_test=4)
    return ["+experiment=fedbcgd_vit_cifar100", f"dataset.root={root}", "dataset.verify=false",
            "partition.samples_per_client=4", "engine.device=cpu", "engine.executor=sequential",
            "engine.progress=false", "tracking.enabled=false", "seed=1", "name=vit"]


@pytest.mark.slow  # ~10 s: the CLI on the ViT preset (test_presets runs its round in the fast suite)
def test_fl_train_vit_tiny_preset_two_rounds(tmp_path):
    proc = _train(_tiny_cifar100(tmp_path) + ["model=vit_tiny", "partition.num_clients=4", "train.rounds=2",
                                               "train.participation=0.5"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results" / "vit"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rounds"] == 2 and 0.0 <= metrics["final_acc_mean"] <= 1.0
    info = json.loads((out / "experiment.json").read_text())
    assert "fedbcgd" in info["algorithm"]
    rows = (out / "rounds.csv").read_text().splitlines()
    head = rows[0].split(",")
    last = dict(zip(head, rows[-1].split(",")))
    # FedBCGD with the six-block table: each client uploads one block (~d/6) and the shared head, downloads d
    d = 607_296 + 65 * 100
    assert float(last["comm_down_floats"]) == 2 * d
    assert float(last["comm_up_floats"]) < 2 * (max(107_328, 100_096) + 6_500) + 1


@pytest.mark.slow  # fl-train in a subprocess (about 8 s)
def test_fl_train_weights_error_is_one_line(tmp_path):
    missing = tmp_path / "nowhere.pth"
    proc = _train(_tiny_cifar100(tmp_path) + ["partition.num_clients=2", f"model.weights={missing}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: model.weights={missing}: no such file (a local copy of torchvision's "
                                   "vit_b_16 ImageNet weights, vit_b_16-c867db91.pth)")
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_fl_train_vit_b_16_pretrained_one_local_step(tmp_path, saved_b16):
    path, state = saved_b16
    proc = _train(_tiny_cifar100(tmp_path) + [f"model.weights={path}", "partition.num_clients=2", "train.rounds=1",
                                               "train.participation=1.0", "train.local_steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results" / "vit"
    assert json.loads((out / "metrics.json").read_text())["rounds"] == 1
    final = torch.load(out / "models" / "seed_1.pt", map_location="cpu", weights_only=True)
    assert final["heads.head.weight"].shape == (100, 768)
    body = [k for k in final if not k.startswith("heads.")]
    assert sorted(body) == sorted(k for k in state if not k.startswith("heads."))
    # the run started from the file: one local step moves the network little, and FedBCGD's round 1 with 2 clients
    # over 6 blocks leaves the blocks without an owner exactly as loaded
    assert max((final[k] - state[k]).abs().max().item() for k in body) < 0.5
    same = {k.split(".")[2] for k in body if k.startswith("encoder.layers.") and torch.equal(final[k], state[k])}
    moved = {k.split(".")[2] for k in body if k.startswith("encoder.layers.") and not torch.equal(final[k], state[k])}
    assert len(same - moved) == 8 and len(moved) == 4  # 4 blocks of 2 layers untouched, 2 blocks updated


@pytest.mark.slow  # ViT-B/16 weights written and read (about 10 s)
def test_a_run_starts_from_the_pretrained_network(tmp_path, saved_b16):
    """The simulator's seeded initialisation (the layers' resets, then the model's init_parameters) keeps the file's
    tensors: model.weights is not accepted and then overwritten."""
    from fl_core.data import load_source, make_partition
    from fl_core.engine.factory import build_simulator

    path, state = saved_b16
    cfg = compose(_tiny_cifar100(tmp_path)[:-2] + [f"model.weights={path}", "partition.num_clients=2"])
    ds = load_source(cfg.dataset, Path(cfg.dataset.root))
    sim = build_simulator(cfg, ds, make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes))
    views = sim.spec.views(sim._fresh_state()["global"])
    assert all(torch.equal(v, state[k]) for k, v in views.items() if not k.startswith("heads."))
    assert not views["heads.head.weight"].any() and views["heads.head.weight"].shape == (100, 768)
