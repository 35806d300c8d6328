"""What the unrolled recurrent layers share (:class:`~fl_core.models.mnist1d.GRULayer`,
:class:`~fl_core.models.char_lstm.LSTMLayer`): the hidden width and ``torch.nn.RNNBase``'s initialisation.

They are written out step by step with matrix products because the fused ``torch.nn.GRU`` / ``torch.nn.LSTM``
kernels have no ``torch.func.vmap`` rule, so both executors train them.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["UnrolledLayer"]


class UnrolledLayer(nn.Module):
    """A recurrent layer of ``hidden_size`` units whose parameters (registered by the subclass before it calls
    :meth:`reset_parameters`) start uniform in ``+-1/sqrt(hidden_size)``, as every parameter of ``torch.nn.GRU`` and
    ``torch.nn.LSTM`` does."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size

    def reset_parameters(self) -> None:
        """Every parameter uniform in ``+-1/sqrt(hidden)`` (as ``torch.nn.GRU`` and ``torch.nn.LSTM``); the simulator
        calls it under the run's initialisation seed, like every layer's."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)
