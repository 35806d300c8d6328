"""Parameter layout: a model's parameters as one flat vector, and views into it.

This module sits below both the algorithms and the engine (the import contract in pyproject.toml):
rules and executors share the layout without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .lazy import lazy_import

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


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
    def from_model(cls, model: torch.nn.Module) -> "ParamSpec":
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


def flatten_params(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one detached flat vector [d] (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` [d] into the model's parameters in place.

    (``torch.nn.utils.vector_to_parameters`` is not used: it turns the parameters into views of
    ``flat``, so training the model would silently write into the broadcast global vector.)
    """
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        if offset != flat.numel():
            raise ValueError(f"flat vector has {flat.numel()} entries, the model {offset}")
