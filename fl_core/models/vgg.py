"""VGG-9: the model of FedNLR (ALGORITHMS.md section 2.4).

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
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel
from .cnn import NeuronLayersMixin

# (name, out channels) of the six convolutions; a 2x2 max-pool follows conv2, conv4 and conv6
_CONVS = (("conv1", 32), ("conv2", 64), ("conv3", 128), ("conv4", 128), ("conv5", 256), ("conv6", 256))
_HIDDEN = 512


class VGG9(NeuronLayersMixin, FLModel):
    """VGG-9 / ``ModerateCNN`` (ALGORITHMS.md 2.4) for ``[B, C_in, H, W]`` inputs.

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
