"""Models of fl_core.models: parameter counts (docs/algorithms.md, Model catalogue), FedBug units
(docs/algorithms.md, FedBug units), feature shapes, the GroupNorm ResNets and the registry's ``model.units``
checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_core.schema import MODELS as CONFIG_MODELS
from fl_core.config import ModelConfig
from fl_core.models import AUTO_MODEL, MODELS, build_model, unit_layouts
from fl_core.models.cnn import PflCNN, TinyCNN
from fl_core.models.resnet import ResNet18GN, ResNet34GN
from fl_core.models.vgg import VGG9, VGG11, VGG19, VGG_CFGS, repo_head_width

# (name, input shape, classes) the models are built for in these tests
SHAPES = {
    "small_cnn": ((1, 8, 8), 10),
    "std_cnn": ((3, 32, 32), 10),
    "mcmahan_cnn": ((3, 32, 32), 10),
    "mlp": ((1, 28, 28), 10),
    "logreg": ((1, 8, 8), 10),
    "logreg_binary": ((1, 8, 8), 10),
    "tiny_cnn": ((3, 64, 64), 200),
    "resnet18": ((3, 32, 32), 100),
    "resnet34": ((3, 32, 32), 100),
    "vgg9": ((3, 32, 32), 10),
    "vgg11": ((3, 32, 32), 10),
    "vgg19": ((3, 32, 32), 100),
    "pfl_cnn": ((3, 32, 32), 10),
}
ALL_LAYOUTS = [(name, units) for name in SHAPES for units in ("default", *unit_layouts(name))]


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def built():
    """One model per (name, units); ResNets are the slow part, so build each once."""
    torch.manual_seed(0)
    return {(n, u): build_model(ModelConfig(name=n, units=u), "digits", *SHAPES[n]) for n, u in ALL_LAYOUTS}


def test_registry_matches_config():
    assert set(MODELS) == set(CONFIG_MODELS) - {"auto"}
    assert AUTO_MODEL["tiny_imagenet"] == "tiny_cnn"
    assert unit_layouts("tiny_cnn") == ("code5", "paper6")
    assert unit_layouts("resnet18") == unit_layouts("resnet34") == ("module", "block")
    assert unit_layouts("std_cnn") == ()


@pytest.mark.parametrize("name,units", ALL_LAYOUTS)
def test_units_cover_every_parameter_once(built, name, units):
    model = built[name, units]
    groups = model.units()  # raises if a parameter is in 0 or 2+ units
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters())
    assert len(flat) == len(set(flat))
    assert all(groups), f"{name}/{units} has an empty unit"


@pytest.mark.parametrize("name,expected", [
    ("std_cnn", 797_962),       # C = 10 (docs/algorithms.md, Model catalogue)
    ("mcmahan_cnn", 878_538),   # valid padding, C = 10
    ("tiny_cnn", 530_888),      # 3x64x64, C = 200
    ("resnet18", 11_227_812),   # C = 100, about 11.23M
    ("resnet34", 21_335_972),   # C = 100, about 21.34M
    ("pfl_cnn", 1_626_442),     # 3x32x32, C = 10: 896 + 18,496 + 1,605,760 + 1,290
])
def test_parameter_counts(built, name, expected):
    assert _count(built[name, "default"]) == expected


def test_resnet_counts_cross_checks():
    # the rounded sizes 11.23M / 21.34M (docs/algorithms.md, Model catalogue), to the printed precision
    assert round(11_227_812 / 1e6, 2) == 11.23 and round(21_335_972 / 1e6, 2) == 21.34
    # 10 classes: only fc changes (512*90 + 90 fewer); the 7x7 stem has 7,680 more weights than the
    # 3x3 CIFAR-style stem of FedBCGD's ResNet-18 (d = 11,173,962 for C = 10; docs/algorithms.md, Model catalogue)
    r18 = ResNet18GN((3, 32, 32), 10)
    assert _count(r18) == 11_227_812 - 90 * 513 == 11_173_962 + 3 * 64 * (49 - 9)
    assert r18.fc.weight.shape == (10, 512)


@pytest.mark.parametrize("name,units,m", [
    ("tiny_cnn", "default", 5), ("tiny_cnn", "code5", 5), ("tiny_cnn", "paper6", 6),
    ("resnet18", "default", 4), ("resnet18", "module", 4), ("resnet18", "block", 8),
    ("resnet34", "module", 4), ("resnet34", "block", 16),
    ("std_cnn", "default", 5), ("mcmahan_cnn", "default", 4), ("pfl_cnn", "default", 4),
])
def test_unit_counts(built, name, units, m):
    assert len(built[name, units].units()) == m


def test_tiny_cnn_unit_membership(built):
    code5 = built["tiny_cnn", "code5"].units()
    assert code5[0] == ["conv1.weight", "conv1.bias", "conv3.weight", "conv3.bias"]  # conv3 never frozen [FB]
    assert code5[1:] == [["conv2.weight", "conv2.bias"], ["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"],
                         ["fc3.weight", "fc3.bias"]]
    paper6 = built["tiny_cnn", "paper6"].units()
    assert [g[0].split(".")[0] for g in paper6] == ["conv1", "conv2", "conv3", "fc1", "fc2", "fc3"]
    assert built["tiny_cnn", "default"].units() == code5
    # the layout is per instance, not a class attribute shared by every TinyCNN
    assert TinyCNN.unit_prefixes == () and built["tiny_cnn", "paper6"].unit_prefixes != code5


def test_resnet_unit_membership(built):
    module = built["resnet18", "module"].units()
    assert {"conv1.weight", "bn1.weight", "bn1.bias", "layer1.1.conv2.weight"} <= set(module[0])
    assert all(n.startswith("layer2.") for n in module[1]) and all(n.startswith("layer3.") for n in module[2])
    assert "layer2.0.downsample.0.weight" in module[1] and "layer2.0.downsample.1.bias" in module[1]
    assert module[3][-2:] == ["fc.weight", "fc.bias"] and "layer4.0.conv1.weight" in module[3]

    block = built["resnet18", "block"].units()
    assert {"conv1.weight", "bn1.bias", "layer1.0.conv1.weight"} <= set(block[0])
    assert not any(n.startswith("layer1.1.") for n in block[0])
    assert all(n.startswith("layer1.1.") for n in block[1])
    assert "layer2.0.downsample.0.weight" in block[2]
    assert "fc.weight" in block[-1] and "layer4.1.conv1.weight" in block[-1]
    assert not any(n.startswith("fc.") for g in block[:-1] for n in g)

    block34 = built["resnet34", "block"].units()
    blocks = [sorted({".".join(n.split(".")[:2]) for n in g if n.startswith("layer")}) for g in block34]
    assert blocks == [[f"layer{s}.{b}"] for s, n in zip((1, 2, 3, 4), (3, 4, 6, 3)) for b in range(n)]
    assert "conv1.weight" in block34[0] and block34[-1][-2:] == ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("name", ["resnet18", "resnet34"])
def test_resnet_groupnorm_no_buffers(built, name):
    for units in ("module", "block"):
        model = built[name, units]
        assert list(model.buffers()) == []
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
        assert norms and all(m.num_groups == 2 for m in norms)
    # stem + 2 per block + 1 per downsample shortcut
    blocks = {"resnet18": 8, "resnet34": 16}[name]
    assert len([m for m in built[name, "module"].modules() if isinstance(m, nn.GroupNorm)]) == 1 + 2 * blocks + 3


def test_resnet_norm_groups():
    m = build_model(ModelConfig(name="resnet18", norm_groups=4), "cifar10", (3, 32, 32), 10)
    assert {g.num_groups for g in m.modules() if isinstance(g, nn.GroupNorm)} == {4}
    with pytest.raises(ValueError, match=r"^model\.norm_groups must be a positive divisor of 64.*got 3$"):
        build_model(ModelConfig(name="resnet18", norm_groups=3), "cifar10", (3, 32, 32), 10)


@pytest.mark.parametrize("name,feat", [("small_cnn", 128), ("std_cnn", 192), ("mcmahan_cnn", 512), ("mlp", 200),
                                       ("tiny_cnn", 128), ("resnet18", 512), ("resnet34", 512)])
def test_forward_features_shapes(built, name, feat):
    shape, classes = SHAPES[name]
    model = built[name, "default"].eval()
    x = torch.randn(2, *shape)
    with torch.no_grad():
        logits, f = model.forward_features(x)
        assert logits.shape == (2, classes) and f.shape == (2, feat)
        assert torch.allclose(model(x), logits)
    if name.startswith("resnet"):
        assert torch.allclose(model.fc(f), logits, atol=1e-6)


def test_resnet_other_inputs():
    torch.manual_seed(0)
    m = ResNet18GN((3, 64, 64), 200, units="block")  # Tiny-ImageNet size
    with torch.no_grad():
        logits, f = m.forward_features(torch.randn(1, 3, 64, 64))
    assert logits.shape == (1, 200) and f.shape == (1, 512)
    gray = ResNet34GN((1, 28, 28), 10)  # non-RGB input: only the stem conv changes
    assert gray.conv1.weight.shape == (64, 1, 7, 7)
    with torch.no_grad():
        assert gray(torch.randn(1, 1, 28, 28)).shape == (1, 10)


def test_auto_model_for_tiny_imagenet():
    m = build_model(ModelConfig(name="auto", units="paper6"), "tiny_imagenet", (3, 64, 64), 200)
    assert isinstance(m, TinyCNN) and len(m.units()) == 6


@pytest.mark.parametrize("name,units,allowed", [
    ("resnet18", "paper6", "default, module, block"),
    ("resnet34", "code5", "default, module, block"),
    ("tiny_cnn", "module", "default, code5, paper6"),
    ("std_cnn", "block", "default"),
    ("mlp", "code5", "default"),
])
def test_bad_units_message(name, units, allowed):
    shape, classes = SHAPES[name]
    with pytest.raises(ValueError) as err:
        build_model(ModelConfig(name=name, units=units), "cifar10", shape, classes)
    msg = str(err.value)
    assert msg == f"model.units must be one of {allowed} for {name}, got {units!r}"


def test_bad_units_direct_construction():
    with pytest.raises(ValueError, match=r"^model\.units must be one of default, code5, paper6 for tiny_cnn"):
        TinyCNN((3, 64, 64), 200, units="paper5")
    with pytest.raises(ValueError, match=r"^model\.units must be one of default, module, block for resnet34"):
        ResNet34GN((3, 32, 32), 10, units="blocks")


def test_tiny_cnn_too_small_input():
    with pytest.raises(ValueError, match="tiny_cnn needs inputs of at least 36x36"):
        TinyCNN((3, 32, 32), 10)
    assert TinyCNN((3, 36, 36), 10).fc1.in_features == 64


# ----------------------------------------- VGG-9 (docs/algorithms.md, Model catalogue) and neuron_layers

VGG9_LAYERS = ["conv1", "conv2", "conv3", "conv4", "conv5", "conv6", "fc1", "fc2", "fc3"]


def _vgg9_m(c):
    return [32, 64, 128, 128, 256, 256, 512, 512, c]


@pytest.mark.parametrize("classes,expected", [(10, 3_491_530), (100, 3_537_700)])
def test_vgg9_parameter_count(classes, expected):
    torch.manual_seed(0)
    m = VGG9((3, 32, 32), classes)
    assert _count(m) == expected
    per_layer = {name: sum(p.numel() for p in getattr(m, name).parameters()) for name in VGG9_LAYERS}
    assert per_layer == {"conv1": 896, "conv2": 18_496, "conv3": 73_856, "conv4": 147_584, "conv5": 295_168,
                         "conv6": 590_080, "fc1": 2_097_664, "fc2": 262_656, "fc3": 513 * classes}
    assert m.fc1.in_features == 4096  # 256 * 4 * 4, as NIID-Bench's ModerateCNN
    assert list(m.buffers()) == []  # no BatchNorm: nothing to keep out of the averaged state


def test_vgg9_units_one_per_weighted_layer(built):
    units = built["vgg9", "default"].units()
    assert len(units) == 9
    assert units == [[f"{n}.weight", f"{n}.bias"] for n in VGG9_LAYERS]


def test_vgg9_init_kaiming_uniform_conv_xavier_normal_linear():
    """FedNLR [S3] 7.1: Kaiming-uniform conv weights (bound sqrt(6/fan_in)), Xavier-normal linear weights
    (std sqrt(2/(fan_in+fan_out))); biases keep PyTorch's U(+-1/sqrt(fan_in))."""
    torch.manual_seed(1)
    m = VGG9((3, 32, 32), 10)
    for name, module, kind in m.neuron_layers():
        w = module.weight.detach()
        fan_in = w[0].numel()
        fan_out = w.shape[0] * (w[0, 0].numel() if kind == "conv" else 1)
        assert module.bias.abs().max() <= 1 / fan_in ** 0.5
        if kind == "conv":
            bound = (6 / fan_in) ** 0.5
            assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound, name
            assert abs(w.std().item() / (bound / 3 ** 0.5) - 1) < 0.1, name  # U(-b, b): std b/sqrt(3)
        else:
            std = (2 / (fan_in + fan_out)) ** 0.5
            assert abs(w.std().item() / std - 1) < 0.1, name
            assert abs(w.mean().item()) < 0.2 * std, name
            assert w.abs().max() > 2.5 * std, name  # a normal's tail, beyond any uniform of that std (1.73)
    # not PyTorch's default init (Kaiming-uniform with a = sqrt(5): std 1/sqrt(3 fan_in))
    assert m.conv6.weight.std() > 2 * (1 / (3 * 2304)) ** 0.5
    assert m.fc1.weight.std() > 2 * (1 / (3 * 4096)) ** 0.5


def test_vgg9_forward_features_and_dropout():
    torch.manual_seed(2)
    m = VGG9((3, 32, 32), 100)
    x = torch.randn(4, 3, 32, 32)
    m.eval()
    with torch.no_grad():
        logits, f = m.forward_features(x)
        assert logits.shape == (4, 100) and f.shape == (4, 512)
        assert torch.equal(m(x), logits)  # eval mode: no dropout, deterministic
        assert torch.allclose(m.fc3(f), logits, atol=1e-6) and (f >= 0).all()
    m.train()
    with torch.no_grad():
        a, fa = m.forward_features(x)
        b, _ = m.forward_features(x)
        assert not torch.equal(a, b)  # Dropout2d(0.05) and two Dropout(0.1) are active in train mode
        assert torch.allclose(m.fc3(fa), a, atol=1e-6)  # features are the classifier's input
    # other input sizes: 1x28x28 -> 28/14/7/3, flatten 256*3*3 = 2304 (NIID-Bench's MNIST variant)
    assert VGG9((1, 28, 28), 10).fc1.in_features == 2304
    with pytest.raises(ValueError, match="vgg9 needs inputs of at least 8x8"):
        VGG9((1, 4, 4), 10)


def test_vgg9_registry_and_auto():
    assert MODELS["vgg9"] is VGG9 and AUTO_MODEL["cinic10"] == "vgg9"
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="auto"), "cinic10", (3, 32, 32), 10)
    assert isinstance(m, VGG9) and _count(m) == 3_491_530
    with pytest.raises(ValueError, match=r"^model\.units must be one of default for vgg9"):
        build_model(ModelConfig(name="vgg9", units="block"), "cifar10", (3, 32, 32), 10)


def test_pfl_cnn_layers_shapes_init_and_dropout():
    """pfl-research's CIFAR-10 CNN (PflCNN docstring): every layer's shape, the layers' function written out with
    torch.nn.functional on the model's own weights, Xavier-uniform weights, dropout only in train mode."""
    torch.manual_seed(3)
    m = build_model(ModelConfig(name="pfl_cnn"), "cifar10", (3, 32, 32), 10)
    assert type(m) is PflCNN and MODELS["pfl_cnn"] is PflCNN
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"conv1.weight": (32, 3, 3, 3), "conv1.bias": (32,), "conv2.weight": (64, 32, 3, 3),
                      "conv2.bias": (64,), "fc1.weight": (128, 12_544), "fc1.bias": (128,), "fc2.weight": (10, 128),
                      "fc2.bias": (10,)}
    assert [m.drop_conv.p, m.drop_fc.p] == [0.25, 0.5] and list(m.buffers()) == []
    for layer in (m.conv1, m.conv2, m.fc1, m.fc2):  # xavier_uniform_: U(-a, a), a = sqrt(6 / (fan_in + fan_out))
        w = layer.weight
        rf = w[0, 0].numel() if w.dim() == 4 else 1
        bound = (6 / ((w.shape[0] + w.shape[1]) * rf)) ** 0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    x = torch.randn(5, 3, 32, 32)
    m.eval()
    with torch.no_grad():
        logits, f = m.forward_features(x)
        h = F.max_pool2d(F.relu(F.conv2d(F.relu(F.conv2d(x, m.conv1.weight, m.conv1.bias)), m.conv2.weight,
                                          m.conv2.bias)), 2)
        assert h.shape == (5, 64, 14, 14)
        ref = F.linear(F.relu(F.linear(h.flatten(1), m.fc1.weight, m.fc1.bias)), m.fc2.weight, m.fc2.bias)
        assert logits.shape == (5, 10) and f.shape == (5, 128)
        assert torch.allclose(logits, ref, atol=1e-5) and torch.allclose(m.fc2(f), logits, atol=1e-6)
    m.train()
    with torch.no_grad():
        a, fa = m.forward_features(x)
        assert not torch.equal(a, m(x)) and torch.allclose(m.fc2(fa), a, atol=1e-6)
    assert PflCNN((1, 28, 28), 62).fc1.in_features == 64 * 12 * 12
    with pytest.raises(ValueError, match=r"^pfl_cnn needs inputs of at least 6x6, got 5x5$"):
        PflCNN((3, 5, 5), 10)


NEURON_MODELS = [("small_cnn", "default"), ("std_cnn", "default"), ("mcmahan_cnn", "default"), ("mlp", "default"),
                 ("logreg", "default"), ("tiny_cnn", "code5"), ("tiny_cnn", "paper6"), ("vgg9", "default"),
                 ("vgg11", "default"), ("vgg19", "default"), ("pfl_cnn", "default")]
NEURON_NAMES = {
    "small_cnn": ["conv1", "conv2", "fc1", "fc2"],
    "std_cnn": ["conv1", "conv2", "fc1", "fc2", "fc3"],
    "mcmahan_cnn": ["conv1", "conv2", "fc1", "fc2"],
    "mlp": ["fc1", "fc2", "fc3"],
    "logreg": ["fc"],
    "tiny_cnn": ["conv1", "conv2", "conv3", "fc1", "fc2", "fc3"],
    "vgg9": VGG9_LAYERS,
    "vgg11": [f"conv{i}" for i in range(1, 9)] + ["fc1", "fc2"],
    "vgg19": [f"conv{i}" for i in range(1, 17)] + ["fc1", "fc2"],
    "pfl_cnn": ["conv1", "conv2", "fc1", "fc2"],
}


@pytest.mark.parametrize("name,units", NEURON_MODELS)
def test_neuron_layers(built, name, units):
    """Forward order, kinds, classifier last, every parameter in a listed layer, and hooked outputs that are
    pre-activations nobody modifies in place (FedNLR's probes apply ReLU themselves)."""
    model = built[name, units].eval()
    shape, classes = SHAPES[name]
    layers = model.neuron_layers()
    assert [n for n, _, _ in layers] == NEURON_NAMES[name]
    modules = dict(model.named_modules())
    for n, module, kind in layers:
        assert modules[n] is module
        assert kind == ("conv" if isinstance(module, nn.Conv2d) else "linear")
        assert isinstance(module, nn.Conv2d if kind == "conv" else nn.Linear)
    assert layers[-1][2] == "linear" and layers[-1][1].out_features == classes
    listed = {id(p) for _, m, _ in layers for p in m.parameters()}
    assert listed == {id(p) for p in model.parameters()}

    calls, outputs, copies = [], [], []

    def hook(module, _inp, out):
        calls.append(module)
        outputs.append(out)
        copies.append(out.detach().clone())

    handles = [m.register_forward_hook(hook) for _, m, _ in layers]
    try:
        with torch.no_grad():
            logits = model(torch.randn(3, *shape))
    finally:
        for h in handles:
            h.remove()
    assert calls == [m for _, m, _ in layers]  # each layer runs once, in the listed order
    for out, copy in zip(outputs, copies):
        assert torch.equal(out, copy)  # no in-place ReLU touched the layer output
    assert torch.equal(outputs[-1], logits)  # the last layer's output is the logits
    if len(layers) > 1:
        assert all((copy < 0).any() for copy in copies[:-1])  # pre-activations, not ReLU outputs
    widths = [o.shape[1] for o in outputs]
    if name == "vgg9":
        assert widths == _vgg9_m(classes)
    if name in ("vgg11", "vgg19"):
        assert widths == [v for v in VGG_CFGS[name] if v != "M"] + [repo_head_width(classes), classes]
    assert widths == [m.out_channels if k == "conv" else m.out_features for _, m, k in layers]


# ------------------------------ VGG-11 / VGG-19 of FedBCGD (docs/algorithms.md, Model catalogue)

# Hand count (weights + biases; conv k x k: k*k*in*out + out, linear: in*out + out):
#   VGG-11 convs (cfg A): 3->64 1,792; 64->128 73,856; 128->256 295,168; 256->256 590,080; 256->512 1,180,160;
#                         512->512 x3 2,359,808 each                                     -> sum 9,220,480
#   VGG-19 convs (cfg E): 3->64 1,792; 64->64 36,928; 64->128 73,856; 128->128 147,584; 128->256 295,168;
#                         256->256 x3 590,080; 256->512 1,180,160; 512->512 x7 2,359,808 -> sum 20,024,384
#   repo head, C = 10:  fc1 512->100 51,300 + fc2 100->10 1,010    = 52,310
#   repo head, C = 100: fc1 512->256 131,328 + fc2 256->100 25,700 = 157,028
VGG_CONVS = {"vgg11": 9_220_480, "vgg19": 20_024_384}
VGG_HEADS = {10: 52_310, 100: 157_028}


@pytest.mark.parametrize("name,cls", [("vgg11", VGG11), ("vgg19", VGG19)])
@pytest.mark.parametrize("classes,expected", [(10, {"vgg11": 9_272_790, "vgg19": 20_076_694}),
                                              (100, {"vgg11": 9_377_508, "vgg19": 20_181_412})])
def test_fedbcgd_vgg_parameter_counts(name, cls, classes, expected):
    torch.manual_seed(0)
    m = build_model(ModelConfig(name=name), "cifar10", (3, 32, 32), classes)
    assert type(m) is cls
    assert _count(m) == expected[name] == VGG_CONVS[name] + VGG_HEADS[classes]
    convs = [mod for n, mod, kind in m.neuron_layers() if kind == "conv"]
    assert sum(_count(c) for c in convs) == VGG_CONVS[name]
    assert len(convs) == {"vgg11": 8, "vgg19": 16}[name]
    h = {10: 100, 100: 256}[classes]  # the repository's head: 512->100->10 / 512->256->100
    assert (m.fc1.in_features, m.fc1.out_features, m.fc2.in_features, m.fc2.out_features) == (512, h, h, classes)
    # the conv weight counts of the paper's block tables (FedBCGD Tables 8 and 10, weights only)
    table = {"vgg11": [1728, 73728, 294912, 589824, 1179648, 2359296, 2359296, 2359296],
             "vgg19": [1728, 36864, 73728, 147456, 294912, 589824, 589824, 589824, 1179648] + [2359296] * 7}[name]
    assert [c.weight.numel() for c in convs] == table
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) and c.bias is not None for c in convs)
    assert list(m.buffers()) == []  # no BatchNorm: the vectorised executor accepts it
    assert not any(isinstance(x, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.Dropout)) for x in m.modules())


@pytest.mark.parametrize("name", ["vgg11", "vgg19"])
def test_fedbcgd_vgg_matches_torchvision_features(name):
    """The conv stack equals torchvision's ``make_layers`` of configuration A / E (no BN), layer by layer."""
    from fl_core.compat import torchvision

    vgg = torchvision().models.vgg
    assert list(VGG_CFGS[name]) == list(vgg.cfgs[{"vgg11": "A", "vgg19": "E"}[name]])
    ref = [mod for mod in vgg.make_layers(vgg.cfgs[{"vgg11": "A", "vgg19": "E"}[name]]) if isinstance(mod, nn.Conv2d)]
    m = MODELS[name]((3, 32, 32), 10)
    ours = [mod for _, mod, kind in m.neuron_layers() if kind == "conv"]
    assert [(c.in_channels, c.out_channels) for c in ours] == [(c.in_channels, c.out_channels) for c in ref]
    # same function: copy the weights into torchvision's stack and compare the flattened conv output
    stack = vgg.make_layers(vgg.cfgs[{"vgg11": "A", "vgg19": "E"}[name]])
    with torch.no_grad():
        for a, b in zip(ours, [x for x in stack if isinstance(x, nn.Conv2d)]):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
        x = torch.randn(2, 3, 32, 32)
        flat = stack(x).flatten(1)
        assert flat.shape == (2, 512)
        assert torch.allclose(m.fc2(torch.relu(m.fc1(flat))), m(x), atol=1e-5)


@pytest.mark.parametrize("name,m_units", [("vgg11", 10), ("vgg19", 18)])
def test_fedbcgd_vgg_units_one_per_layer(built, name, m_units):
    units = built[name, "default"].units()
    assert len(units) == m_units
    assert units == [[f"{n}.weight", f"{n}.bias"] for n in NEURON_NAMES[name]]
    assert units[-1] == ["fc2.weight", "fc2.bias"]  # the classifier is the last unit


@pytest.mark.parametrize("name", ["vgg11", "vgg19"])
def test_fedbcgd_vgg_forward_features(built, name):
    shape, classes = SHAPES[name]
    m = built[name, "default"].eval()
    x = torch.randn(3, *shape)
    with torch.no_grad():
        logits, f = m.forward_features(x)
        assert logits.shape == (3, classes) and f.shape == (3, repo_head_width(classes))
        assert torch.equal(m(x), logits)
        assert torch.allclose(m.fc2(f), logits, atol=1e-6) and (f >= 0).all()
        m.train()
        assert torch.equal(m(x), logits)  # no dropout / normalisation: train mode is the same function
    m.eval()


def test_fedbcgd_vgg_other_inputs_and_errors():
    torch.manual_seed(0)
    m = VGG11((3, 64, 64), 200)  # Tiny-ImageNet size: 2x2 after five pools -> flatten 2048; C > 10 -> h = 256
    assert m.fc1.in_features == 2048 and m.fc1.out_features == 256
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 64)).shape == (1, 200)
    assert VGG19((1, 32, 32), 10, hidden=64).fc1.out_features == 64  # explicit head width, gray input
    assert VGG19((1, 32, 32), 10).conv1.weight.shape == (64, 1, 3, 3)
    with pytest.raises(ValueError, match="vgg11 needs inputs of at least 32x32, got 28x28"):
        VGG11((1, 28, 28), 10)
    with pytest.raises(ValueError, match="vgg19 head width must be >= 1"):
        VGG19((3, 32, 32), 10, hidden=0)
    with pytest.raises(ValueError, match=r"^model\.units must be one of default for vgg11"):
        build_model(ModelConfig(name="vgg11", units="block"), "cifar10", (3, 32, 32), 10)
    assert [repo_head_width(c) for c in (2, 10, 11, 100, 200)] == [100, 100, 256, 256, 256]


def test_fedbcgd_vgg_class_attributes_not_shared():
    # each depth has its own layer lists (class attributes computed from its configuration)
    assert len(VGG11.unit_prefixes) == 10 and len(VGG19.unit_prefixes) == 18
    assert VGG11.NEURON_LAYERS[-1] == ("fc2", "linear") and VGG19.NEURON_LAYERS[15] == ("conv16", "conv")


def test_fedbcgd_vgg_init():
    """Default ``kaiming`` = torchvision's VGG init (conv kaiming_normal fan_out, linear N(0, 0.01^2), zero biases);
    ``torch`` keeps PyTorch's defaults."""
    torch.manual_seed(3)
    m = VGG19((3, 32, 32), 100)
    assert m.init == "kaiming"
    for name, module, kind in m.neuron_layers():
        w = module.weight.detach()
        assert torch.count_nonzero(module.bias) == 0, name
        std = (2 / (w.shape[0] * w[0, 0].numel())) ** 0.5 if kind == "conv" else 0.01  # fan_out = out * k * k
        assert abs(w.std().item() / std - 1) < (0.1 if w.numel() > 5000 else 0.25), name
    t = VGG11((3, 32, 32), 10, init="torch")
    assert torch.count_nonzero(t.conv1.bias) > 0 and t.fc1.weight.abs().max() <= 1 / 512 ** 0.5
    with pytest.raises(ValueError, match=r"vgg11 init must be one of kaiming, torch, got 'xavier'"):
        VGG11((3, 32, 32), 10, init="xavier")


def test_fedbcgd_vgg19_signal_reaches_the_logits_only_with_kaiming():
    """Why ``kaiming`` is the default: with PyTorch's init and no normalisation VGG-19's logits barely depend on
    the input at init (they are set by the biases)."""
    x = torch.randn(8, 3, 32, 32)
    ratio = {}
    for init in ("kaiming", "torch"):
        torch.manual_seed(0)
        m = VGG19((3, 32, 32), 100, init=init)
        with torch.no_grad():
            logits = m(x)
        ratio[init] = (logits.std(0).mean() / logits.abs().mean()).item()
    assert ratio["kaiming"] > 1e-2 and ratio["torch"] < 1e-5


@pytest.mark.parametrize("name, overrides", [("vgg11", []), ("vgg19", []), ("vgg9", [])])
def test_a_run_starts_from_the_vgg_init_it_names(tmp_path, name, overrides):
    """The run's seeded initialisation (every layer's reset, then the model's init_parameters) ends in the VGGs' own
    init: zero biases for torchvision's VGG init (vgg11/19, model.vgg_init=kaiming), FedNLR's Xavier-normal linear
    weights for VGG-9; model.vgg_init=torch keeps PyTorch's layer defaults (non-zero biases)."""
    from fl_core.config import compose
    from fl_core.data import load_source, make_partition
    from fl_core.engine.factory import build_simulator
    from fl_core.params import ParamSpec
    from test_sources import write_cifar10

    write_cifar10(tmp_path)
    base = ["dataset=cifar10", f"dataset.root={tmp_path}", "dataset.verify=false", f"model={name}",
            "partition=iid", "partition.num_clients=2", "train.rounds=1", "engine.device=cpu",
            "engine.checkpoint_every=0", "engine.progress=false", "tracking.enabled=false"]

    def initial(extra):
        cfg = compose(base + overrides + extra)
        ds = load_source(cfg.dataset, Path(cfg.dataset.root))
        sim = build_simulator(cfg, ds, make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes))
        spec = ParamSpec.from_model(sim.model)
        return spec.views(sim._fresh_state()["global"])

    g = initial([])
    if name == "vgg9":
        w = g["fc1.weight"]
        assert abs(w.std().item() / (2 / sum(w.shape)) ** 0.5 - 1) < 0.05  # Xavier normal, not PyTorch's uniform
        assert w.abs().max().item() > 3 ** 0.5 * (1 / w.shape[1]) ** 0.5  # outside PyTorch's default bound
        return
    assert all(torch.count_nonzero(v) == 0 for k, v in g.items() if k.endswith(".bias"))
    t = initial(["model.vgg_init=torch"])
    assert torch.count_nonzero(t["conv1.bias"]) > 0
