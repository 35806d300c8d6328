"""Fully connected models: an MLP (McMahan's 2NN shape) and multinomial logistic regression.

Both have ``neuron_layers()`` (see :class:`~fl_core.models.cnn.NeuronLayersMixin`).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch.nn.functional as F
from torch import nn

from .base import FLModel
from .cnn import NeuronLayersMixin


class MLP(NeuronLayersMixin, FLModel):
    """flatten-fc(hidden)-fc(hidden)-fc(C) with ReLU. Features: the second hidden layer ``[B, hidden]``.

    Units (M = 3): fc1, fc2, fc3.
    """

    unit_prefixes = (("fc1",), ("fc2",), ("fc3",))
    NEURON_LAYERS = (("fc1", "linear"), ("fc2", "linear"), ("fc3", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, hidden: int = 200):
        super().__init__()
        d_in = math.prod(input_shape)
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward_features(self, x):
        h = F.relu(self.fc1(x.flatten(1)))
        f = F.relu(self.fc2(h))
        return self.fc3(f), f


class LogisticRegression(NeuronLayersMixin, FLModel):
    """A single linear layer on the flattened input. Features: the flattened input. Units (M = 1): fc."""

    unit_prefixes = (("fc",),)
    NEURON_LAYERS = (("fc", "linear"),)  # the classifier is the only layer

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward_features(self, x):
        f = x.flatten(1)
        return self.fc(f), f
