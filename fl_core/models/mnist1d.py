"""The MNIST-1D reference models (docs/algorithms.md, Model catalogue).

Source: Greydanus and Kobak, "Scaling down deep learning with MNIST-1D", ICML 2024 (the benchmark of Sec. 3,
Fig. 3), and the authors' model definitions ``notebooks/models.py`` of their repository (``greydanus/mnist1d``),
written here anew. The logistic-regression baseline is :class:`~fl_core.models.linear.LogisticRegression`
(``model=logreg``: one linear layer, 40*10 + 10 = 410 parameters, as the authors' ``LinearBase``).

Inputs are ``[B, 1, 1, L]`` (the project's ``[B, C, H, W]`` layout of an MNIST-1D sequence of L = 40 values).
Parameter counts for L = 40 and 10 classes (tests/test_datasets_generated.py checks them):

- :class:`MNIST1DMLP` (``m1d_mlp``): 40 -> 100 -> 100 (residual) -> 10; 15,210 parameters.
- :class:`MNIST1DCNN` (``m1d_cnn``): three stride-2 convolutions of 25 channels, then a linear classifier;
  5,210 parameters.
- :class:`MNIST1DGRU` (``m1d_gru``): a bidirectional GRU of 6 hidden units per direction over the 40 positions,
  every position's outputs into a linear classifier; 5,134 parameters.

Every model is a plain function of its parameters (no buffers, no in-place state), so both executors train it;
the GRU is unrolled over the positions with matrix products (:class:`GRULayer`, the equations of
``torch.nn.GRU``) because ``torch.nn.GRU``'s fused kernel has no ``torch.func.vmap`` rule.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel, conv_out
from .cnn import NeuronLayersMixin
from .recurrent import UnrolledLayer

__all__ = ["MNIST1DMLP", "MNIST1DCNN", "MNIST1DGRU", "GRULayer", "sequence_length"]


def sequence_length(input_shape: Tuple[int, int, int], model: str, dataset: str) -> int:
    """L of inputs ``[1, 1, L]`` (one channel, one row).

    Raises:
        ValueError: another shape; one line naming ``model.name`` and the dataset.
    """
    c, h, w = (int(v) for v in input_shape)
    if c != 1 or h != 1:
        raise ValueError(f"model.name={model} takes 1-D sequences [1, 1, L] (dataset=mnist1d), got dataset={dataset} "
                         f"with inputs {[c, h, w]}")
    return w


class MNIST1DMLP(NeuronLayersMixin, FLModel):
    """The authors' MLP (``MLPBase``): ``h = relu(fc1(x))``, ``h = h + relu(fc2(h))``, logits ``fc3(h)``.

    Any input is flattened (d_in = C*H*W; 40 for MNIST-1D). Hidden width 100 (the authors' default, which their
    benchmark uses). Features: ``h`` after the residual step ``[B, 100]``. Units (M = 3): fc1, fc2, fc3.
    Parameters: d_in*100 + 100 + 100*100 + 100 + 100*C + C (15,210 for d_in = 40, C = 10).
    """

    HIDDEN = 100
    unit_prefixes = (("fc1",), ("fc2",), ("fc3",))
    NEURON_LAYERS = (("fc1", "linear"), ("fc2", "linear"), ("fc3", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, dataset: str = ""):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), self.HIDDEN)
        self.fc2 = nn.Linear(self.HIDDEN, self.HIDDEN)
        self.fc3 = nn.Linear(self.HIDDEN, num_classes)

    def forward_features(self, x):
        h = F.relu(self.fc1(x.flatten(1)))
        h = h + F.relu(self.fc2(h))
        return self.fc3(h), h


class MNIST1DCNN(NeuronLayersMixin, FLModel):
    """The authors' CNN (``ConvBase``): conv(1->25, k5, s2, p1), conv(25->25, k3, s2, p1), conv(25->25, k3, s2, p1),
    ReLU after each, flattened into a linear classifier.

    Lengths 40 -> 19 -> 10 -> 5, so the classifier sees 25*5 = 125 features (the authors' ``linear_in``; computed
    from L here). The 1-D convolutions are ``nn.Conv2d`` with ``1 x k`` kernels on the ``[B, 1, 1, L]`` input: the
    same arithmetic and parameter count as ``nn.Conv1d`` (weights ``[25, 1, 1, 5]`` instead of ``[25, 1, 5]``), and
    the layers are then the project's ``conv`` kind (FedNLR's neuron layers). Features: the flattened conv output
    ``[B, 125]``. Units (M = 4): conv1, conv2, conv3, fc.
    Parameters: (5 + 1)*25 + 2*(25*3 + 1)*25 + 125*C + C = 5,210 for C = 10.
    """

    CHANNELS = 25
    unit_prefixes = (("conv1",), ("conv2",), ("conv3",), ("fc",))
    NEURON_LAYERS = (("conv1", "conv"), ("conv2", "conv"), ("conv3", "conv"), ("fc", "linear"))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, dataset: str = ""):
        super().__init__()
        length = sequence_length(input_shape, "m1d_cnn", dataset)
        c = self.CHANNELS
        self.conv1 = nn.Conv2d(1, c, (1, 5), stride=(1, 2), padding=(0, 1))
        self.conv2 = nn.Conv2d(c, c, (1, 3), stride=(1, 2), padding=(0, 1))
        self.conv3 = nn.Conv2d(c, c, (1, 3), stride=(1, 2), padding=(0, 1))
        out = conv_out(conv_out(conv_out(length, 5, 1, 2), 3, 1, 2), 3, 1, 2)
        if out < 1:
            raise ValueError(f"model.name=m1d_cnn needs sequences of at least 5 values, got dataset={dataset} with "
                             f"length {length}")
        self.fc = nn.Linear(c * out, num_classes)

    def forward_features(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        f = F.relu(self.conv3(h)).flatten(1)
        return self.fc(f), f


class GRULayer(UnrolledLayer):
    """One (optionally bidirectional) GRU layer over ``[B, T, input_size]``, unrolled over T.

    The equations and the parameter names, shapes and initialisation (uniform in ``+-1/sqrt(hidden)``) of
    ``torch.nn.GRU`` with ``batch_first=True``: r = sig(W_ir x + b_ir + W_hr h + b_hr), z = sig(W_iz x + b_iz +
    W_hz h + b_hz), n = tanh(W_in x + b_in + r * (W_hn h + b_hn)), h' = (1 - z) * n + z * h, from h = 0.
    ``reset_parameters`` draws the initialisation again (the simulator's seeded initialisation needs it).
    ``forward`` returns the outputs ``[B, T, D*hidden]`` (D = 2 when bidirectional: forward and backward
    states of each position, concatenated). Loading a ``torch.nn.GRU``'s state dict gives the same outputs
    (tests/test_datasets_generated.py).
    """

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool = True):
        super().__init__(hidden_size)
        self.suffixes = ("_l0", "_l0_reverse") if bidirectional else ("_l0",)
        for s in self.suffixes:
            self.register_parameter(f"weight_ih{s}", nn.Parameter(torch.empty(3 * hidden_size, input_size)))
            self.register_parameter(f"weight_hh{s}", nn.Parameter(torch.empty(3 * hidden_size, hidden_size)))
            self.register_parameter(f"bias_ih{s}", nn.Parameter(torch.empty(3 * hidden_size)))
            self.register_parameter(f"bias_hh{s}", nn.Parameter(torch.empty(3 * hidden_size)))
        self.reset_parameters()

    def _direction(self, x: torch.Tensor, s: str, reverse: bool) -> torch.Tensor:
        w_hh, b_hh = getattr(self, f"weight_hh{s}"), getattr(self, f"bias_hh{s}")
        gates_x = F.linear(x, getattr(self, f"weight_ih{s}"), getattr(self, f"bias_ih{s}"))  # [B, T, 3H]
        h = x.new_zeros(x.shape[0], self.hidden_size)
        steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
        out = [None] * x.shape[1]
        for t in steps:
            xr, xz, xn = gates_x[:, t].chunk(3, dim=-1)
            hr, hz, hn = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = (1 - z) * n + z * h
            out[t] = h
        return torch.stack(out, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._direction(x, s, reverse=s.endswith("reverse")) for s in self.suffixes], dim=-1)


class MNIST1DGRU(FLModel):
    """The authors' GRU (``GRUBase``): a bidirectional GRU, 6 hidden units per direction, reads the L values one
    per step (input size 1, h0 = 0); the outputs of all positions ``[B, L*12]`` feed a linear classifier.

    Features: those flattened outputs ``[B, 480]`` for L = 40. Units (M = 2): gru, fc. No ``neuron_layers``
    (a recurrent layer has no conv/linear neurons), so FedNLR refuses it.
    Parameters: 2 directions x (3*6*1 + 3*6*6 + 2*3*6) = 324 for the GRU, 480*C + C for fc: 5,134 for C = 10.
    """

    HIDDEN = 6
    unit_prefixes = (("gru",), ("fc",))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, dataset: str = ""):
        super().__init__()
        length = sequence_length(input_shape, "m1d_gru", dataset)
        self.gru = GRULayer(1, self.HIDDEN, bidirectional=True)
        self.fc = nn.Linear(2 * self.HIDDEN * length, num_classes)

    def forward_features(self, x):
        seq = x.reshape(x.shape[0], -1, 1)  # [B, 1, 1, L] -> [B, L, 1]
        f = self.gru(seq).flatten(1)
        return self.fc(f), f
