"""The next-character model of LEAF's and FedProx's Shakespeare experiments (docs/algorithms.md, Model catalogue):
``model=char_lstm``.

Source: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Appendix C.1 (Shakespeare: a
two-layer LSTM with an 8-dimensional embedding, 80 characters in, the next one out, 80 classes), with the width of
the authors' code, 256 (their ``main.py``, ``shakespeare.stacked_lstm``; the text says 100 hidden units), the same
model as LEAF's Shakespeare baseline (Caldas et al. 2018, ``models/shakespeare/stacked_lstm.py``); written here anew
in torch.

Inputs are ``[B, 1, 1, L]``: L = 80 character indices in ``[0, V)`` held as floats (``dataset=shakespeare`` stores
them as uint8 with scale 1, mean 0, std 1, so :meth:`~fl_core.data.FLDataset.normalize` only casts). The model
embeds every index (8 values), runs two stacked LSTM layers of 256 units over the L positions from zero states, and
maps the last position's output to V logits (V = ``num_classes``: 80 for LEAF's vocabulary).

Parameters for V = 80: embedding 80*8 = 640; LSTM layer 1: 4*256*(8 + 256) + 2*4*256 = 272,384; layer 2:
4*256*(256 + 256) + 2*4*256 = 526,336; head 256*80 + 80 = 20,560; 819,920 in all.

The LSTM is unrolled over the positions with matrix products (:class:`LSTMLayer`, the equations, parameter names,
shapes and initialisation of ``torch.nn.LSTM``) because ``torch.nn.LSTM``'s fused kernel has no ``torch.func.vmap``
rule: both executors train it. A deviation from the TensorFlow model of the papers: TensorFlow's
``BasicLSTMCell`` adds a forget bias of 1 to the forget gate, and its weights start from Glorot-uniform; here the
gates are ``torch.nn.LSTM``'s (no added forget bias) and every parameter starts uniform in ``+-1/sqrt(256)``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import FLModel
from .recurrent import UnrolledLayer

__all__ = ["CharLSTM", "LSTMLayer"]


class LSTMLayer(UnrolledLayer):
    """One LSTM layer over ``[B, T, input_size]``, unrolled over T, from zero states.

    The equations and the parameter names, shapes and initialisation (uniform in ``+-1/sqrt(hidden)``) of one layer
    of ``torch.nn.LSTM`` with ``batch_first=True``: with the gates in the order i, f, g, o,
    i = sig(W_ii x + b_ii + W_hi h + b_hi), f = sig(...), g = tanh(...), o = sig(...), c' = f * c + i * g,
    h' = o * tanh(c'). Parameters ``weight_ih_l0 [4H, input_size]``, ``weight_hh_l0 [4H, H]``, ``bias_ih_l0 [4H]``,
    ``bias_hh_l0 [4H]``. ``forward`` returns the outputs h_t of every position ``[B, T, H]``; loading one layer of a
    ``torch.nn.LSTM``'s state dict gives the same outputs (tests/test_natural_data.py).
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__(hidden_size)
        self.weight_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates_x = F.linear(x, self.weight_ih_l0, self.bias_ih_l0)  # [B, T, 4H]: the input's part, all positions at once
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = x.new_zeros(x.shape[0], self.hidden_size)
        out = []
        for t in range(x.shape[1]):
            i, f, g, o = (gates_x[:, t] + F.linear(h, self.weight_hh_l0, self.bias_hh_l0)).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(h)
        return torch.stack(out, dim=1)


class CharLSTM(FLModel):
    """Embedding (V x 8) -> LSTM(8 -> 256) -> LSTM(256 -> 256) -> linear(256 -> V) on the last position.

    Features: the last position's output of the second layer ``[B, 256]``. Units (M = 4): embed, lstm1, lstm2, fc.
    No ``neuron_layers`` (a recurrent layer has no conv/linear neurons), so FedNLR refuses it.

    Raises:
        ValueError: inputs that are not sequences ``[1, 1, L]`` (names ``model.name`` and the dataset).
    """

    EMBED, HIDDEN = 8, 256
    unit_prefixes = (("embed",), ("lstm1",), ("lstm2",), ("fc",))

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, dataset: str = ""):
        super().__init__()
        c, h, _ = (int(v) for v in input_shape)
        if c != 1 or h != 1:
            raise ValueError(f"model.name=char_lstm reads character sequences [1, 1, L] (dataset=shakespeare), got "
                             f"dataset={dataset} with inputs {list(input_shape)}")
        self.vocab = int(num_classes)
        self.embed = nn.Embedding(self.vocab, self.EMBED)
        self.lstm1 = LSTMLayer(self.EMBED, self.HIDDEN)
        self.lstm2 = LSTMLayer(self.HIDDEN, self.HIDDEN)
        self.fc = nn.Linear(self.HIDDEN, self.vocab)

    def forward_features(self, x):
        idx = x.reshape(x.shape[0], -1).long()  # [B, L] character indices (floats holding integers)
        seq = self.lstm2(self.lstm1(self.embed(idx)))
        f = seq[:, -1]
        return self.fc(f), f
