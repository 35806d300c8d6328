"""The client-state store (checkpoint files: :mod:`fl_core.store.durable`).

The flat parameter layout (:class:`~fl_core.params.ParamSpec`, ``flatten_params``, ``load_flat``) lives in
:mod:`fl_core.params`, below the algorithms and the engine; it is re-exported here for convenience.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from ..params import ParamSpec, flatten_params, load_flat

__all__ = ["ClientStateStore", "ParamSpec", "flatten_params", "load_flat"]


class ClientStateStore:
    """Per-client algorithm state (control variates, gradient memories, residuals, ...), kept in host memory.

    Only clients that have participated hold an entry, so N large clients cost nothing until they train;
    states move to the device only for the clients of the current round.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._states: Dict[int, Dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        """Clients that hold a state."""
        return len(self._states)

    def get(self, client_id: int, default_factory) -> Optional[Dict[str, torch.Tensor]]:
        if client_id not in self._states:
            init = default_factory()
            if init is None:
                return None
            self._states[client_id] = {k: v.to(self.device) for k, v in init.items()}
        return self._states[client_id]

    def put(self, client_id: int, state: Optional[Dict[str, torch.Tensor]]) -> None:
        if state is not None:
            self._states[client_id] = {k: v.detach().to(self.device) for k, v in state.items()}

    def items(self) -> Iterable[Tuple[int, Dict[str, torch.Tensor]]]:
        return self._states.items()

    def state_dict(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """For a checkpoint: {client id (int): {key: CPU tensor}}, nothing else, so that the weights-only loader of
        :func:`fl_core.store.durable.load` reads it back."""
        return {i: {k: v.cpu() for k, v in s.items()} for i, s in self._states.items()}

    def load_state_dict(self, sd: Dict[int, Dict[str, torch.Tensor]]) -> None:
        self._states = {int(i): {k: v.to(self.device) for k, v in s.items()} for i, s in sd.items()}
