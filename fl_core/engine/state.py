"""Flat parameter views and the client-state store (checkpoint files: :mod:`fl_core.durable`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSpec:
    """Layout of a model's parameters in one flat float vector of length ``d``.

    ``names[j]`` has shape ``shapes[j]`` and occupies ``flat[offsets[j]:offsets[j] + numels[j]]``;
    ``unit_of[j]`` is the index of its unit (FedBug module), input side first.
    """

    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]
    unit_of: Tuple[int, ...]
    num_units: int

    @property
    def d(self) -> int:
        """Model size d in floats."""
        return sum(self.numels)

    @classmethod
    def from_model(cls, model: nn.Module) -> "ParamSpec":
        named = list(model.named_parameters())
        names = tuple(n for n, _ in named)
        units = model.units() if hasattr(model, "units") else [list(names)]
        unit_index = {n: u for u, members in enumerate(units) for n in members}
        numels = tuple(p.numel() for _, p in named)
        offsets, acc = [], 0
        for k in numels:
            offsets.append(acc)
            acc += k
        return cls(names, tuple(tuple(p.shape) for _, p in named), numels, tuple(offsets),
                   tuple(unit_index[n] for n in names), len(units))

    def views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Name -> tensor views into ``flat`` ([..., d] -> [..., *shape]); writes through.

        Leading dims are kept, so a stack of client vectors [C, d] gives [C, *shape] per parameter.
        """
        lead = flat.shape[:-1]
        return {n: flat[..., o:o + k].view(*lead, *s)
                for n, s, k, o in zip(self.names, self.shapes, self.numels, self.offsets)}

    def unit_slices(self) -> List[List[slice]]:
        out: List[List[slice]] = [[] for _ in range(self.num_units)]
        for u, o, k in zip(self.unit_of, self.offsets, self.numels):
            out[u].append(slice(o, o + k))
        return out


def flatten_params(model: nn.Module) -> torch.Tensor:
    """The model's parameters as one detached flat vector [d] (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` [d] into the model's parameters in place.

    (``torch.nn.utils.vector_to_parameters`` is not used: it turns the parameters into views of
    ``flat``, so training the model would silently write into the broadcast global vector.)
    """
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.copy_(flat[offset:offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, the model {offset}")


class ClientStateStore:
    """Per-client algorithm state (SCAFFOLD c_i, FedDyn gradient memory, ...), kept in host memory.

    Only clients that have participated hold an entry, so N large clients cost nothing until they train;
    states move to the device only for the clients of the current round.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._states: Dict[int, Dict[str, torch.Tensor]] = {}

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
        return {i: {k: v.cpu() for k, v in s.items()} for i, s in self._states.items()}

    def load_state_dict(self, sd: Dict[int, Dict[str, torch.Tensor]]) -> None:
        self._states = {int(i): {k: v.to(self.device) for k, v in s.items()} for i, s in sd.items()}
