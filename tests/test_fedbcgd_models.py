"""FedBCGD block tables of VGG-11 and VGG-19 (docs/algorithms.md, Model catalogue, FedBCGD blocks and FedBCGD;
FedBCGD paper Tables 8 and 10)."""

from __future__ import annotations

import pytest
import torch

from fl_core.algorithms import FedBCGD, block_partition
from fl_core.algorithms.fedbcgd import BLOCK_TABLES
from fl_core.config import ModelConfig
from fl_core.engine.state import ParamSpec
from fl_core.models import build_model

# Conv weights per block, weights only, as printed in the paper (Table 8: VGG-11, Table 10: VGG-19).
# Block 5 of both tables also lists FC rows, and the shared block an "FC-100" row, that do not fit the
# repository's head (docs/algorithms.md, Model catalogue and Paper-vs-code switches); those are checked against
# the head below.
PAPER_CONV_WEIGHTS = {
    "vgg11": [1728 + 73728, 294912 + 589824, 1179648 + 2359296, 2 * 2359296, 0],
    "vgg19": [1728 + 36864 + 73728 + 147456 + 294912 + 3 * 589824, 1179648 + 2359296, 2 * 2359296, 2 * 2359296,
              2 * 2359296],
}
# hidden FC (fc1) and classifier (fc2) weights of the repository's head: 512 -> h -> C
HEAD_WEIGHTS = {10: (512 * 100, 100 * 10), 100: (512 * 256, 256 * 100)}


def _model(name: str, classes: int):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), "cifar10", (3, 32, 32), classes)
    return model, ParamSpec.from_model(model)


@pytest.fixture(scope="module")
def models():
    return {(n, c): _model(n, c) for n in ("vgg11", "vgg19") for c in (10, 100)}


@pytest.mark.parametrize("classes", [10, 100])
@pytest.mark.parametrize("name", ["vgg11", "vgg19"])
@pytest.mark.parametrize("kind", ["paper", "auto"])
def test_vgg_paper_table_covers_every_parameter_once(models, name, classes, kind):
    model, spec = models[name, classes]
    blocks, shared = block_partition(model, spec.names, 5, kind)  # raises unless every parameter is in one block
    assert len(blocks) == 5 and all(blocks)  # N = 5 client blocks (paper), none empty
    flat = sorted(i for b in blocks for i in b) + sorted(shared)
    assert sorted(flat) == list(range(len(spec.names))) and len(flat) == len(set(flat))
    # the shared block is the classifier (the last layer), weight and bias
    assert [spec.names[i] for i in shared] == ["fc2.weight", "fc2.bias"]
    assert model.neuron_layers()[-1][0] == "fc2"
    # each layer's weight and bias stay together
    for b in blocks:
        layers = {spec.names[i].rsplit(".", 1)[0] for i in b}
        assert sorted(spec.names[i] for i in b) == sorted(f"{layer}.{p}" for layer in layers for p in ("weight", "bias"))


@pytest.mark.parametrize("classes", [10, 100])
@pytest.mark.parametrize("name", ["vgg11", "vgg19"])
def test_vgg_block_sizes_match_the_paper_conv_rows(models, name, classes):
    model, spec = models[name, classes]
    blocks, shared = block_partition(model, spec.names, 5, "paper")
    weights = [sum(spec.numels[i] for i in b if spec.names[i].startswith("conv") and spec.names[i].endswith(".weight"))
               for b in blocks]
    assert weights == PAPER_CONV_WEIGHTS[name]
    fc1_w, fc2_w = HEAD_WEIGHTS[classes]
    last = {spec.names[i]: spec.numels[i] for i in blocks[-1]}
    assert last["fc1.weight"] == fc1_w  # Block 5 holds the hidden FC ("FC-2048" rows of the tables)
    assert sum(spec.numels[i] for i in shared if spec.names[i].endswith(".weight")) == fc2_w
    if name == "vgg19" and classes == 100:
        # Table 10's last rows: "FC-2048" 131,072 and shared "FC-100" 25,600 = the repository's CIFAR-100 head
        assert (fc1_w, fc2_w) == (131072, 25600)
    # with biases, the blocks and the shared block add up to d
    assert sum(spec.numels[i] for b in blocks for i in b) + sum(spec.numels[i] for i in shared) == spec.d


def test_vgg_block_membership():
    names11 = BLOCK_TABLES["VGG11"]["paper"]
    assert names11 == ([["conv1", "conv2"], ["conv3", "conv4"], ["conv5", "conv6"], ["conv7", "conv8"], ["fc1"]],
                       ["fc2"])
    blocks19, shared19 = BLOCK_TABLES["VGG19"]["paper"]
    assert blocks19[0] == [f"conv{i}" for i in range(1, 9)]
    assert blocks19[1:] == [["conv9", "conv10"], ["conv11", "conv12"], ["conv13", "conv14"],
                            ["conv15", "conv16", "fc1"]]
    assert shared19 == ["fc2"]
    assert "code" not in BLOCK_TABLES["VGG11"] and "code" not in BLOCK_TABLES["VGG19"]  # repo has no VGG partition


def test_vgg_prefixes_do_not_overmatch(models):
    """``conv1`` must not claim ``conv10`` .. ``conv16`` (prefix matching is per dotted component)."""
    model, spec = models["vgg19", 10]
    blocks, _ = block_partition(model, spec.names, 5, "paper")
    first = [spec.names[i] for i in blocks[0]]
    assert "conv1.weight" in first and not any(n.startswith("conv1") and n[5].isdigit() for n in first)


def test_vgg_table_errors_and_other_partitions(models):
    model, spec = models["vgg11", 10]
    with pytest.raises(ValueError, match=r"algorithm\.fedbcgd\.blocks must be 5 for the paper table of VGG11, got 4"):
        block_partition(model, spec.names, 4, "paper")
    with pytest.raises(ValueError, match=r"block_partition=code: no such table for VGG11"):
        block_partition(model, spec.names, 5, "code")
    # auto with another N falls back to the model's units (10 units: 9 without the classifier, shared = fc2)
    blocks, shared = block_partition(model, spec.names, 3, "auto")
    assert len(blocks) == 3 and [spec.names[i] for i in shared] == ["fc2.weight", "fc2.bias"]
    # the "nonshare" ablation: the classifier joins the last block
    blocks, shared = block_partition(model, spec.names, 5, "paper", shared=False)
    assert shared == [] and {spec.names[i] for i in blocks[-1]} == {"fc1.weight", "fc1.bias", "fc2.weight",
                                                                   "fc2.bias"}


@pytest.mark.parametrize("name,classes", [("vgg11", 10), ("vgg19", 100)])
def test_vgg_fedbcgd_upload_floats(models, name, classes):
    """docs/algorithms.md, FedBCGD (uplink): average upload (d - #x_s)/N + #x_s with the table's blocks."""
    model, spec = models[name, classes]
    blocks, shared = block_partition(model, spec.names, 5, "paper")
    algo = FedBCGD(spec, blocks, shared, lam=0.8)
    xs = sum(spec.numels[i] for i in shared)
    assert algo.shared_floats == xs == classes * (100 if classes == 10 else 256) + classes
    up, down = algo.comm_floats(spec.d)
    assert up == pytest.approx((spec.d - xs) / 5 + xs) and down == spec.d
    sizes = [int(m.sum()) for m in algo.block_masks]
    assert sum(sizes) + xs == spec.d
