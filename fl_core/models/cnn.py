"""Convolutional models (docs/algorithms.md, Model catalogue).

- :class:`StandardCNN`: the "standard CNN" of Acar et al. / FedBug, also FedBCGD's LeNet-5.
- :class:`TinyCNN`: FedBug's 3-conv CNN for 3x64x64 Tiny-ImageNet, FedBug units ``code5`` | ``paper6``.
- :class:`McMahanCNN`: the 2-conv CNN of McMahan et al. used by the IID-to-non-IID study (valid padding).
- :class:`SmallCNN`: a small CNN for 8x8 inputs (scikit-learn digits), not from a paper.
- :class:`PflCNN`: the CIFAR-10 CNN of pfl-research's image-classification benchmark (Granqvist et al. 2024).

Every model here also has ``neuron_layers()`` (:class:`NeuronLayersMixin`): its weighted layers in forward
order, as FedNLR's activation statistics need them (docs/algorithms.md, Neuron layers). All ReLUs are
functional and applied to a layer's output after the layer module returns, so a forward hook on a listed
module sees pre-activations.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel, conv_pool_size


def resolve_units(model: str, units: str, layouts: Sequence[str], default: str) -> str:
    """The unit layout named by ``units`` (``default`` -> ``default``) for ``model``.

    Raises:
        ValueError: ``units`` is neither ``default`` nor one of ``layouts``; the one-line message names
            ``model.units`` and the allowed values.
    """
    if units == "default":
        return default
    if units not in layouts:
        allowed = ", ".join(["default", *layouts])
        raise ValueError(f"model.units must be one of {allowed} for {model}, got {units!r}")
    return units


class NeuronLayersMixin:
    """Adds ``neuron_layers()`` to a model that lists its weighted layers in ``NEURON_LAYERS``.

    ``NEURON_LAYERS`` is a sequence of ``(module name, kind)`` in forward order, kind ``"conv"`` or
    ``"linear"``; the last entry is the classifier. A neuron is an output channel of a conv layer or an
    output unit of a linear layer (docs/algorithms.md, Neuron layers).
    """

    NEURON_LAYERS: Sequence[Tuple[str, str]] = ()

    def neuron_layers(self) -> List[Tuple[str, nn.Module, str]]:
        """``[(name, module, kind), ...]`` for every weighted layer, input side first, classifier last.

        The module's output is the layer's pre-activation (``[B, M_l, H, W]`` for conv, ``[B, M_l]`` for
        linear); the model applies ReLU to it afterwards for every layer but the last.
        """
        return [(name, self.get_submodule(name), kind) for name, kind in self.NEURON_LAYERS]


class StandardCNN(NeuronLayersMixin, FLModel):
    """conv5x5(64)-pool-conv5x5(64)-pool-fc384-fc192-fc(C); d = 797,962 for 3x32x32 inputs and C = 10.

    Input ``[B, C_in, H, W]``; features: relu(fc2) ``[B, 192]``. Units (M = 5): conv1, conv2, fc1, fc2, fc3.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",), ("fc3",))
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("fc1", "linear"), ("fc2", "linear"), ("fc3", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        h2, w2 = conv_pool_size(h, w, 2, 5, "std_cnn", 16)
        self.fc1 = nn.Linear(64 * h2 * w2, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)

    def forward_features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        f = F.relu(self.fc2(x))
        return self.fc3(f), f


class TinyCNN(NeuronLayersMixin, FLModel):
    """FedBug's Tiny-ImageNet CNN (docs/algorithms.md, Model catalogue; [FB] ``utils_models.py``).

    conv5x5(64)-pool-conv5x5(64)-pool-conv5x5(64)-pool-fc256-fc128-fc(C), valid padding, ReLU after every
    layer but the last. For 3x64x64 inputs the spatial sizes are 60-30, 26-13, 9-4, so fc1 sees 64*4*4 = 1024
    features; d = 530,888 for C = 200. Input ``[B, 3, 64, 64]`` (other sizes work if they survive the three
    conv/pool stages); features: relu(fc2) ``[B, 128]``.

    FedBug units (``units``; docs/algorithms.md, FedBug units):

    - ``code5`` (= ``default``, M = 5): what the FedBug code does. It toggles only {conv2, fc1, fc2, fc3} and
      never freezes conv3, so conv3 shares the always-trainable first unit with conv1:
      [{conv1, conv3}, {conv2}, {fc1}, {fc2}, {fc3}].
    - ``paper6`` (M = 6): the paper's reading, one unit per layer: conv1, conv2, conv3, fc1, fc2, fc3.
    """

    UNIT_LAYOUTS: Dict[str, Sequence[Sequence[str]]] = {
        "code5": (("conv1", "conv3"), ("conv2",), ("fc1",), ("fc2",), ("fc3",)),
        "paper6": (("conv1",), ("conv2",), ("conv3",), ("fc1",), ("fc2",), ("fc3",)),
    }
    DEFAULT_UNITS = "code5"
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("conv3", "conv"), ("fc1", "linear"), ("fc2", "linear"),
                     ("fc3", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, units: str = "default"):
        super().__init__()
        layout = resolve_units("tiny_cnn", units, self.UNIT_LAYOUTS, self.DEFAULT_UNITS)
        self.units_name = layout
        self.unit_prefixes = self.UNIT_LAYOUTS[layout]
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.conv3 = nn.Conv2d(64, 64, 5)
        h3, w3 = conv_pool_size(h, w, 3, 5, "tiny_cnn", 36)
        self.fc1 = nn.Linear(64 * h3 * w3, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, num_classes)

    def forward_features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        f = F.relu(self.fc2(x))
        return self.fc3(f), f


class McMahanCNN(NeuronLayersMixin, FLModel):
    """conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc(C), valid padding; d = 878,538 for 3x32x32, C = 10.

    Widths are inferred (the study gives none; docs/algorithms.md, Model catalogue). Features: relu(fc1) ``[B, 512]``.
    Units (M = 4): conv1, conv2, fc1, fc2.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",))
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("fc1", "linear"), ("fc2", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        h2, w2 = conv_pool_size(h, w, 2, 5, "mcmahan_cnn", 16)
        self.fc1 = nn.Linear(64 * h2 * w2, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward_features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        f = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(f), f


class SmallCNN(NeuronLayersMixin, FLModel):
    """conv3x3(16, pad 1)-conv3x3(32, pad 1)-pool-fc128-fc(C) for small inputs such as 1x8x8 digits.

    Features: relu(fc1) ``[B, 128]``. Units (M = 4): conv1, conv2, fc1, fc2.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",))
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("fc1", "linear"), ("fc2", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * (h // 2) * (w // 2), 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward_features(self, x: torch.Tensor):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        f = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(f), f


class PflCNN(NeuronLayersMixin, FLModel):
    """pfl-research's CIFAR-10 CNN (``simple_cnn`` of apple/pfl-research ``benchmarks/model/pytorch/cnn.py``, the model
    of their CIFAR-10 benchmarks; Granqvist et al., "pfl-research", arXiv 2404.06430), layer for layer::

        input [B, C_in, H, W]
        conv1 Conv(C_in, 32, 3x3, valid)  ReLU                          [B, 32, H-2, W-2]
        conv2 Conv(32, 64, 3x3, valid)    ReLU  MaxPool2  Dropout(0.25) [B, 64, (H-4)//2, (W-4)//2]
        flatten 64 * ((H-4)//2) * ((W-4)//2)  (12,544 for 32x32)
        fc1 Linear(., 128)  ReLU  Dropout(0.5)                          features [B, 128]
        fc2 Linear(128, C)                                              logits [B, C]

    d = 1,626,442 for 3x32x32 inputs and C = 10 (conv1 896, conv2 18,496, fc1 1,605,760, fc2 1,290). pfl-research's
    module takes channels-last images ``[B, H, W, C]`` and permutes them to ``[B, C, H, W]`` first; the project's
    data are channels-first already, so that permutation (no parameters) is left out and the flatten order
    (channel, row, column) is the same. Initialisation as theirs: Xavier-uniform weights of every conv and linear
    layer, PyTorch's default biases. The dropout layers act in train mode only; no buffers.

    Features: the classifier's input (dropout(relu(fc1)), the identity in eval mode), so ``fc2(features) ==
    logits``. FedBug units (M = 4) and neuron layers: conv1, conv2, fc1, fc2.

    Raises:
        ValueError: an input smaller than 6x6 (names ``pfl_cnn``).
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",))
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("fc1", "linear"), ("fc2", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        h2, w2 = (h - 4) // 2, (w - 4) // 2
        if h2 < 1 or w2 < 1:
            raise ValueError(f"pfl_cnn needs inputs of at least 6x6, got {h}x{w}")
        self.conv1 = nn.Conv2d(c, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.drop_conv = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * h2 * w2, 128)
        self.drop_fc = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, num_classes)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Xavier-uniform weights for every conv and linear layer (torch's global generator; biases untouched)."""
        for _, module, _ in self.neuron_layers():
            nn.init.xavier_uniform_(module.weight)

    def init_parameters(self) -> None:
        """The run's seeded initialisation ends here (FLModel.init_parameters): Xavier-uniform weights again, so a run
        starts from them and not from the layers' defaults that the run's per-layer reset draws first."""
        self.reset_parameters()

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [B, C_in, H, W]`` -> ``(logits [B, C], features [B, 128])``."""
        x = F.relu(self.conv1(x))
        x = self.drop_conv(F.max_pool2d(F.relu(self.conv2(x)), 2))
        f = self.drop_fc(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(f), f
