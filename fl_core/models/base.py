"""The model interface the engine relies on."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn


class FLModel(nn.Module):
    """A classifier that also exposes its penultimate features and its ordered units.

    Subclasses set ``self.unit_prefixes``: an ordered list (input side first) of
    lists of module-name prefixes. A unit is what FedBug freezes and unfreezes as
    one piece (docs/algorithms.md, FedBug units: for CNNs one conv/linear layer with
    its bias; the classifier is the last unit).
    """

    unit_prefixes: Sequence[Sequence[str]] = ()

    # int64 [num_classes]: the training target of each dataset class, or None (the dataset's labels as they are).
    # With a map the factory relabels the training and test labels (the partition stays over the dataset's classes)
    # and the model's targets are 0..label_map.max().
    label_map: Optional[torch.Tensor] = None

    def bind_training_data(self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor,
                           cache_dir: Optional[Path] = None) -> None:
        """Called once by the factory before training with the data the clients train on: a model whose loss
        (:meth:`penalty`) or per-round metrics (:meth:`objective_metrics`) depend on the data computes what it
        needs here. The default does nothing.

        Args:
            x: the training inputs [M, ...] as the model reads them (normalised, on the device).
            y: their targets [M] (after :attr:`label_map`).
            index: int64 [n], every client's sample indices back to back (a sample held by two clients counts
                twice; the clients' data is ``x[index]``).
            cache_dir: a folder where results computed from the data may be cached across processes, or None.
        """

    def penalty(self, params: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """A term of the parameters alone added to every local step's loss (both executors, the full-batch and
        anchor gradients): 0-d tensor, or None (the default: no penalty). ``params`` maps parameter names to
        tensors (one client's slice under the vectorised executor's ``vmap``), so the penalty must be written
        with plain tensor operations of them."""
        return None

    def objective_metrics(self, params: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Per-round metrics of the global model ``params`` (name -> tensor) that the simulator adds to every round's
        row; {} by default (nothing is computed)."""
        return {}

    def problem_params(self) -> Dict[str, float]:
        """Constants the model derived from the data in :meth:`bind_training_data`, logged as run parameters
        (``model.<key>``); {} by default."""
        return {}

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(logits [B, C], features [B, f])``; features are the penultimate representation."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)[0]

    def init_parameters(self) -> None:
        """The model's own initialisation over its layers' defaults; nothing here.

        A run draws its global model (and MOON its clients' initial networks) with ``torch.manual_seed``, then
        ``reset_parameters()`` of every submodule that has one, in module order, then this method. A model whose
        initialisation is not its layers' defaults, or with parameters outside such layers, or loaded from a file,
        overrides it (:class:`~fl_core.models.vit.VisionTransformerFL`).
        """

    def feature_dim(self) -> int:
        """f, the width of the features ``[B, f]`` of :meth:`forward_features`: ``in_features`` of the classifier,
        the module named by the last prefix of the last unit (every model here ends in its linear classifier there;
        tests/test_moon.py checks it against a forward pass for every model and layout).

        Raises:
            ValueError: that module is not an ``nn.Linear`` (names the model).
        """
        name = list(self.unit_prefixes[-1])[-1] if self.unit_prefixes else ""
        head = dict(self.named_modules()).get(name)
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(self).__name__} has no linear classifier as its last unit to read the feature "
                             "width from")
        return int(head.in_features)

    def attach_head(self, name: str, module: nn.Module) -> None:
        """Register ``module`` as submodule ``name`` beside the network: :meth:`forward_features` does not use it; a
        rule applies it to the features in its loss (a projection head). Its parameters join the model's, so they
        are initialised with it, trained, averaged and checkpointed like the others; they come last in
        ``named_parameters()`` (the flat vector and the initialisation order of the other parameters are unchanged)
        and form one unit placed before the classifier's, the last (input side first, as in a network whose head
        sits between the features and the classifier).

        Raises:
            ValueError: ``name`` is already a submodule, or the model has no units.
        """
        if not self.unit_prefixes:
            raise ValueError(f"{type(self).__name__} has no units to place a head among")
        if name in dict(self.named_children()):
            raise ValueError(f"{type(self).__name__} already has a submodule {name!r}")
        self.add_module(name, module)
        units = tuple(self.unit_prefixes)
        self.unit_prefixes = units[:-1] + ((name,),) + units[-1:]

    def units(self) -> List[List[str]]:
        """Parameter names per unit, ordered from the input to the output.

        Every named parameter belongs to exactly one unit.

        Raises:
            ValueError: if a parameter matches no unit or several units.
        """
        names = [n for n, _ in self.named_parameters()]
        out: List[List[str]] = [[] for _ in self.unit_prefixes]
        for n in names:
            hits = [u for u, prefixes in enumerate(self.unit_prefixes)
                    if any(n == p or n.startswith(p + ".") for p in prefixes)]
            if len(hits) != 1:
                raise ValueError(f"parameter {n!r} of {type(self).__name__} is in {len(hits)} units, expected 1")
            out[hits[0]].append(n)
        return out


def conv_out(size: int, kernel: int, padding: int = 0, stride: int = 1) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def conv_pool_size(h: int, w: int, stages: int, kernel: int, model: str, min_size: int) -> tuple:
    """Spatial size after ``stages`` x (valid conv ``kernel`` + 2x2 max-pool).

    Raises:
        ValueError: the input is too small for the model (names the model and ``min_size``).
    """
    oh, ow = h, w
    for _ in range(stages):
        oh, ow = conv_out(oh, kernel) // 2, conv_out(ow, kernel) // 2
    if oh < 1 or ow < 1:
        raise ValueError(f"{model} needs inputs of at least {min_size}x{min_size}, got {h}x{w}")
    return oh, ow
