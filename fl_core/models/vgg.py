"""VGG models: VGG-9 of FedNLR and VGG-11 / VGG-19 of FedBCGD (docs/algorithms.md, Model catalogue).

VGG-9 (:class:`VGG9`)
---------------------
VGG-9 is FedMA's / NIID-Bench's ``ModerateCNN``: six 3x3 convolutions (padding 1) in three blocks of two,
each block ending in a 2x2 max-pool, then three fully connected layers::

    input [B, 3, 32, 32]
    conv1 Conv(3, 32)    ReLU                           [B, 32, 32, 32]
    conv2 Conv(32, 64)   ReLU  MaxPool2                 [B, 64, 16, 16]
    conv3 Conv(64, 128)  ReLU
    conv4 Conv(128, 128) ReLU  MaxPool2  Dropout2d(0.05) [B, 128, 8, 8]
    conv5 Conv(128, 256) ReLU
    conv6 Conv(256, 256) ReLU  MaxPool2                 [B, 256, 4, 4]
    flatten 4096   Dropout(0.1)
    fc1 Linear(4096, 512) ReLU
    fc2 Linear(512, 512)  ReLU   Dropout(0.1)           features [B, 512]
    fc3 Linear(512, C)                                  logits [B, C]

L = 9 weighted layers with M_l = [32, 64, 128, 128, 256, 256, 512, 512, C] neurons (output channels / units).
d = 3,491,530 for C = 10 and 3,537,700 for C = 100 (3x32x32 inputs).

Initialisation (FedNLR [S3] section 7.1: "Kaiming uniform for convolutional layers and Xavier normal for
linear layers"): conv weights ``nn.init.kaiming_uniform_`` with its defaults (fan_in, gain sqrt(2); bound
sqrt(6 / fan_in)), linear weights ``nn.init.xavier_normal_`` (std sqrt(2 / (fan_in + fan_out))); the paper says
nothing about biases, so they keep PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

The dropout layers make the model stochastic in train mode only; there are no buffers (no BatchNorm).
Every ReLU is functional and applied after the registered layer, so a forward hook on a layer of
:meth:`VGG9.neuron_layers` sees the pre-activation output (and nothing modifies it in place).

VGG-11 / VGG-19 (:class:`VGG11`, :class:`VGG19`)
-------------------------------------------------
The CIFAR-style VGGs of the FedBCGD repository ([BC] ``models/VGG.py``; docs/algorithms.md, Model catalogue): Simonyan &
Zisserman's configurations A (VGG-11) and E (VGG-19) of 3x3 convolutions (padding 1, with bias, ReLU, no
BatchNorm), a 2x2 max-pool after each of the five stages, flatten, and the repository's two-layer head::

    VGG-11 convs  64 | 128 | 256 256 | 512 512 | 512 512               (conv1 .. conv8,  "|" = MaxPool2)
    VGG-19 convs  64 64 | 128 128 | 256 x4 | 512 x4 | 512 x4           (conv1 .. conv16)
    input [B, 3, 32, 32] -> [B, 512, 1, 1] -> flatten 512
    fc1 Linear(512, h) ReLU        features [B, h]
    fc2 Linear(h, C)               logits [B, C]       h = 100 for C <= 10, 256 otherwise (repo: CIFAR-10 / -100)

Parameter counts (3x32x32 inputs, weights + biases):

    VGG-11 convs 9,220,480;  C = 10: + fc1 51,300 + fc2 1,010  = 9,272,790
                             C = 100: + fc1 131,328 + fc2 25,700 = 9,377,508
    VGG-19 convs 20,024,384; C = 10: 20,076,694;  C = 100: 20,181,412

The FedBCGD paper's block tables (Tables 8 and 10) list the same conv weight counts but other classifier sizes
("FC-2048", "FC-100"), which do not fit a 512-d flatten; the repository's head is kept (docs/algorithms.md,
Model catalogue; the last two rows of Table 10, 131,072 = 512x256 and 25,600 = 256x100, are exactly the
repository's CIFAR-100 head). No buffers, no dropout: the forward pass is deterministic.

Initialisation (``init``; the paper states none, docs/algorithms.md, Model catalogue): ``kaiming`` (default) is
torchvision's VGG initialisation -- conv weights ``kaiming_normal_(mode="fan_out", nonlinearity="relu")``, linear
weights N(0, 0.01^2), all biases 0; ``torch`` keeps PyTorch's layer defaults. Without normalisation the PyTorch
defaults (std 1/sqrt(3 fan_in), i.e. the second moment shrinks about 6x per conv+ReLU) wash the input out of a deep
VGG: at init on N(0, 1) inputs, VGG-19's logits vary across inputs by ~2e-7 of their size (they are set
by the biases) and the first conv's relative gradient is ~1e-8; with ``kaiming`` both are ~1e-1 / ~1e-3.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel
from .cnn import NeuronLayersMixin

# (name, out channels) of the six convolutions; a 2x2 max-pool follows conv2, conv4 and conv6
_CONVS = (("conv1", 32), ("conv2", 64), ("conv3", 128), ("conv4", 128), ("conv5", 256), ("conv6", 256))
_HIDDEN = 512


class VGG9(NeuronLayersMixin, FLModel):
    """VGG-9 / ``ModerateCNN`` (docs/algorithms.md, Model catalogue) for ``[B, C_in, H, W]`` inputs.

    The flatten size is ``256 * (H // 8) * (W // 8)``: 4096 for 32x32 inputs as in NIID-Bench; other input
    sizes work as long as ``H, W >= 8``. Features: the classifier's 512-d input (relu(fc2) after the second
    dropout, which is the identity in eval mode), so ``fc3(features) == logits`` always.

    FedBug units (M = 9): one per weighted layer, conv1 .. conv6, fc1, fc2, fc3 (each with its bias).
    ``neuron_layers()`` lists the same nine layers in forward order; fc3 is the classifier.
    """

    unit_prefixes = tuple((name,) for name in (*(n for n, _ in _CONVS), "fc1", "fc2", "fc3"))
    NEURON_LAYERS = (*((n, "conv") for n, _ in _CONVS), ("fc1", "linear"), ("fc2", "linear"), ("fc3", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        if h < 8 or w < 8:
            raise ValueError(f"vgg9 needs inputs of at least 8x8, got {h}x{w}")
        in_ch = c
        for name, out_ch in _CONVS:
            setattr(self, name, nn.Conv2d(in_ch, out_ch, 3, padding=1))
            in_ch = out_ch
        self.drop_conv = nn.Dropout2d(0.05)
        self.drop_flat = nn.Dropout(0.1)
        self.fc1 = nn.Linear(in_ch * (h // 8) * (w // 8), _HIDDEN)
        self.fc2 = nn.Linear(_HIDDEN, _HIDDEN)
        self.drop_feat = nn.Dropout(0.1)
        self.fc3 = nn.Linear(_HIDDEN, num_classes)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """FedNLR's init: Kaiming-uniform conv weights, Xavier-normal linear weights, default biases.

        Draws from torch's global generator (the caller seeds it). The biases were already drawn by the
        layers' own ``reset_parameters`` in ``__init__`` and are left as they are.
        """
        for _, module, kind in self.neuron_layers():
            if kind == "conv":
                nn.init.kaiming_uniform_(module.weight)  # a=0, fan_in, leaky_relu gain sqrt(2)
            else:
                nn.init.xavier_normal_(module.weight)

    def init_parameters(self) -> None:
        """The run's seeded initialisation ends here (FLModel.init_parameters): FedNLR's init again, so a run
        starts from it and not from the layers' defaults that the run's per-layer reset draws first."""
        self.reset_parameters()

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [B, C_in, H, W]`` -> ``(logits [B, C], features [B, 512])``."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        x = self.drop_conv(F.max_pool2d(F.relu(self.conv4(x)), 2))
        x = F.relu(self.conv5(x))
        x = F.max_pool2d(F.relu(self.conv6(x)), 2)
        x = F.relu(self.fc1(self.drop_flat(x.flatten(1))))
        f = self.drop_feat(F.relu(self.fc2(x)))
        return self.fc3(f), f


# --------------------------------------------------------------------------- VGG-11 / VGG-19 (FedBCGD)

# conv output widths in forward order, "M" = 2x2 max-pool (Simonyan & Zisserman's configurations A and E)
VGG_CFGS: Dict[str, Tuple[Union[int, str], ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}


def _layer_names(cfg: Sequence[Union[int, str]]) -> Tuple[str, ...]:
    """``conv1 .. convK, fc1, fc2`` for a VGG configuration with K convolutions."""
    return (*(f"conv{i + 1}" for i in range(sum(v != "M" for v in cfg))), "fc1", "fc2")


def repo_head_width(num_classes: int) -> int:
    """Hidden width h of the FedBCGD repository's VGG head ``512 -> h -> C`` (docs/algorithms.md, Model catalogue).

    The repository has 100 for CIFAR-10 and 256 for CIFAR-100; other class counts follow the same split
    (h = 100 up to 10 classes, 256 above -- an extrapolation, e.g. 256 for Tiny-ImageNet's 200 classes).
    """
    return 100 if int(num_classes) <= 10 else 256


class FedBCGDVGG(NeuronLayersMixin, FLModel):
    """CIFAR-style VGG without normalisation and with the FedBCGD repository's head (docs/algorithms.md, Model
    catalogue).

    Layers: ``conv1 .. convK`` (``nn.Conv2d(in, out, 3, padding=1)``, ReLU, a 2x2 max-pool after the last conv
    of each of the five stages), ``fc1 = Linear(512 * (H // 32) * (W // 32), h)`` + ReLU, ``fc2 = Linear(h, C)``
    (the classifier, FedBCGD's shared block). Input ``[B, C_in, H, W]`` with ``H, W >= 32`` (32x32 in the
    papers: flatten 512; 64x64 gives 2048). Output logits ``[B, C]``; features: relu(fc1) ``[B, h]``, so
    ``fc2(features) == logits``.

    FedBug units (M = K + 2): one per weighted layer, conv1 .. convK, fc1, fc2 (each with its bias).
    ``neuron_layers()`` lists the same layers in forward order; fc2 is the classifier.

    Args:
        input_shape: ``(C_in, H, W)``.
        num_classes: C.
        hidden: head width h; ``None`` = :func:`repo_head_width` (100 for C <= 10, else 256).
        init: ``kaiming`` (torchvision's VGG init, default) | ``torch`` (PyTorch's layer defaults); see the
            module docstring. Draws from torch's global generator (the caller seeds it).

    Raises:
        ValueError: inputs smaller than 32x32, ``hidden < 1`` or an unknown ``init``.
    """

    INITS = ("kaiming", "torch")

    CFG: Sequence[Union[int, str]] = ()
    MODEL_NAME = ""

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, hidden: Optional[int] = None,
                 init: str = "kaiming"):
        super().__init__()
        c, h, w = input_shape
        if init not in self.INITS:
            raise ValueError(f"{self.MODEL_NAME} init must be one of {', '.join(self.INITS)}, got {init!r}")
        if h < 32 or w < 32:
            raise ValueError(f"{self.MODEL_NAME} needs inputs of at least 32x32, got {h}x{w}")
        width = repo_head_width(num_classes) if hidden is None else int(hidden)
        if width < 1:
            raise ValueError(f"{self.MODEL_NAME} head width must be >= 1, got {width}")
        self.hidden = width
        in_ch, k, pool_after = c, 0, []
        for v in self.CFG:
            if v == "M":
                pool_after.append(k)
                continue
            k += 1
            setattr(self, f"conv{k}", nn.Conv2d(in_ch, int(v), 3, padding=1))
            in_ch = int(v)
        self.num_convs = k
        self._pool_after = frozenset(pool_after)  # conv numbers followed by a 2x2 max-pool
        stages = len(pool_after)
        self.fc1 = nn.Linear(in_ch * (h // 2 ** stages) * (w // 2 ** stages), width)
        self.fc2 = nn.Linear(width, num_classes)
        self.init = init
        if init == "kaiming":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torchvision's VGG init: conv ``kaiming_normal_`` (fan_out, ReLU gain), linear N(0, 0.01^2), biases 0."""
        for _, module, kind in self.neuron_layers():
            if kind == "conv":
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            else:
                nn.init.normal_(module.weight, 0.0, 0.01)
            nn.init.zeros_(module.bias)

    def init_parameters(self) -> None:
        """The run's seeded initialisation ends here (FLModel.init_parameters): with ``init="kaiming"`` torchvision's
        VGG init again, so ``model.vgg_init=kaiming`` holds for a run and not only for the constructor."""
        if self.init == "kaiming":
            self.reset_parameters()

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [B, C_in, H, W]`` -> ``(logits [B, C], features [B, h])``."""
        for i in range(1, self.num_convs + 1):
            x = F.relu(getattr(self, f"conv{i}")(x))
            if i in self._pool_after:
                x = F.max_pool2d(x, 2)
        f = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(f), f


class VGG11(FedBCGDVGG):
    """VGG-11 of FedBCGD (configuration A, 8 convs): d = 9,272,790 (C = 10) / 9,377,508 (C = 100); M = 10 units.

    FedBCGD blocks (paper Table 8, ``BLOCK_TABLES["VGG11"]`` in :mod:`fl_core.algorithms.fedbcgd`):
    {conv1, conv2}, {conv3, conv4}, {conv5, conv6}, {conv7, conv8}, {fc1}; shared {fc2}.
    """

    CFG = VGG_CFGS["vgg11"]
    MODEL_NAME = "vgg11"
    unit_prefixes = tuple((n,) for n in _layer_names(CFG))
    NEURON_LAYERS = tuple((n, "conv" if n.startswith("conv") else "linear") for n in _layer_names(CFG))


class VGG19(FedBCGDVGG):
    """VGG-19 of FedBCGD (configuration E, 16 convs): d = 20,076,694 (C = 10) / 20,181,412 (C = 100); M = 18 units.

    FedBCGD blocks (paper Table 10, ``BLOCK_TABLES["VGG19"]``): {conv1 .. conv8}, {conv9, conv10},
    {conv11, conv12}, {conv13, conv14}, {conv15, conv16, fc1}; shared {fc2}.
    """

    CFG = VGG_CFGS["vgg19"]
    MODEL_NAME = "vgg19"
    unit_prefixes = tuple((n,) for n in _layer_names(CFG))
    NEURON_LAYERS = tuple((n, "conv" if n.startswith("conv") else "linear") for n in _layer_names(CFG))
