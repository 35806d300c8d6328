"""Convolutional models (ALGORITHMS.md section 2).

- :class:`StandardCNN`: the "standard CNN" of Acar et al. / FedBug, also FedBCGD's LeNet-5 (section 2.1).
- :class:`McMahanCNN`: the 2-conv CNN of McMahan et al. used by the IID-to-non-IID study (section 2.3, valid padding).
- :class:`SmallCNN`: a small CNN for 8x8 inputs (scikit-learn digits), not from a paper.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel, conv_out


class StandardCNN(FLModel):
    """conv5x5(64)-pool-conv5x5(64)-pool-fc384-fc192-fc(C); d = 797,962 for 3x32x32 inputs and C = 10.

    Input ``[B, C_in, H, W]``; features: relu(fc2) ``[B, 192]``. Units (M = 5): conv1, conv2, fc1, fc2, fc3.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",), ("fc3",))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        h2 = conv_out(conv_out(h, 5) // 2, 5) // 2
        w2 = conv_out(conv_out(w, 5) // 2, 5) // 2
        if h2 < 1 or w2 < 1:
            raise ValueError(f"std_cnn needs inputs of at least 16x16, got {h}x{w}")
        self.fc1 = nn.Linear(64 * h2 * w2, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)

    def forward_features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        f = F.relu(self.fc2(x))
        return self.fc3(f), f


class McMahanCNN(FLModel):
    """conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc(C), valid padding; d = 878,538 for 3x32x32, C = 10.

    Widths are inferred (the study gives none, ALGORITHMS.md 2.3). Features: relu(fc1) ``[B, 512]``.
    Units (M = 4): conv1, conv2, fc1, fc2.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        h2 = conv_out(conv_out(h, 5) // 2, 5) // 2
        w2 = conv_out(conv_out(w, 5) // 2, 5) // 2
        if h2 < 1 or w2 < 1:
            raise ValueError(f"mcmahan_cnn needs inputs of at least 16x16, got {h}x{w}")
        self.fc1 = nn.Linear(64 * h2 * w2, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward_features(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        f = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(f), f


class SmallCNN(FLModel):
    """conv3x3(16, pad 1)-conv3x3(32, pad 1)-pool-fc128-fc(C) for small inputs such as 1x8x8 digits.

    Features: relu(fc1) ``[B, 128]``. Units (M = 4): conv1, conv2, fc1, fc2.
    """

    unit_prefixes = (("conv1",), ("conv2",), ("fc1",), ("fc2",))

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
