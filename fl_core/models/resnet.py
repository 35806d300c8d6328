"""ResNet-18 / ResNet-34 with GroupNorm, as used by FedBug / Acar et al. (docs/algorithms.md, Model catalogue
and FedBug units).

The networks are torchvision's ImageNet-style ResNets (7x7 stride-2 stem conv + 3x3 stride-2 max-pool, four
stages of basic blocks with widths 64/128/256/512, adaptive average pooling, ``fc = Linear(512, C)``), built
through torchvision's ``norm_layer`` argument so that every BatchNorm -- stem, blocks and downsample
shortcuts -- is a ``GroupNorm(norm_groups, channels)`` (GN(2) in the papers). GroupNorm keeps no running
statistics, so the models have parameters only and no buffers: everything the server averages is in
``named_parameters()`` (docs/algorithms.md, Notation).

Parameter counts for 3-channel inputs: ResNet-18 d = 11,227,812 (C = 100), 11,181,642 (C = 10);
ResNet-34 d = 21,335,972 (C = 100), 21,289,802 (C = 10). GroupNorm has the same affine parameters as
BatchNorm, so these equal torchvision's BN ResNets with a C-way fc.

torchvision is imported through :func:`fl_core.compat.torchvision` only.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from fl_core.compat import torchvision

from .base import FLModel
from .cnn import resolve_units

# basic blocks per stage (layer1..layer4)
STAGES: Dict[str, Tuple[int, int, int, int]] = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}
_STEM = ("conv1", "bn1")
_MIN_WIDTH = 64  # the narrowest GroupNorm (stem and layer1); every width is a multiple of it


def module_units(stages: Sequence[int]) -> List[List[str]]:
    """FedBug unit "M" (M = 4): {conv1, bn1, layer1}, {layer2}, {layer3}, {layer4, fc} (docs/algorithms.md,
    FedBug units)."""
    del stages  # the same four units for every depth
    return [[*_STEM, "layer1"], ["layer2"], ["layer3"], ["layer4", "fc"]]


def block_units(stages: Sequence[int]) -> List[List[str]]:
    """FedBug unit "B": one unit per residual block, the stem glued to ``layer1.0`` and ``fc`` to the last block.

    ResNet-18 gives M = 8 units, ResNet-34 M = 16 (docs/algorithms.md, FedBug units).
    """
    units = [[f"layer{s + 1}.{b}"] for s, n in enumerate(stages) for b in range(n)]
    units[0] = [*_STEM, *units[0]]
    units[-1] = [*units[-1], "fc"]
    return units


class ResNetGN(FLModel):
    """torchvision ResNet-18/34 with ``GroupNorm(norm_groups, C)`` in place of every BatchNorm (docs/algorithms.md,
    Model catalogue).

    Input ``[B, C_in, H, W]`` (3x32x32 CIFAR or 3x64x64 Tiny-ImageNet in the papers; any ``C_in`` -- a
    non-RGB input only changes the stem conv's input channels); output logits ``[B, C]``; features: the
    globally average-pooled output of ``layer4`` ``[B, 512]``, the input of ``fc``.

    Parameter names are torchvision's (``conv1.weight``, ``bn1.weight`` -- a GroupNorm despite the name --,
    ``layer1.0.conv1.weight``, ``layer2.0.downsample.1.bias``, ``fc.weight``, ...).

    FedBug units (``units``; docs/algorithms.md, FedBug units):

    - ``module`` (= ``default``, M = 4): {conv1, bn1, layer1}, {layer2}, {layer3}, {layer4, fc}.
    - ``block`` (M = 8 for ResNet-18, 16 for ResNet-34): one unit per basic block (with its norms and
      shortcut), the stem in the first unit and the classifier in the last.

    Args:
        depth_name: ``resnet18`` or ``resnet34``.
        input_shape: ``(C_in, H, W)``.
        num_classes: C.
        units: ``default`` | ``module`` | ``block``.
        norm_groups: GroupNorm groups; must divide 64.

    Raises:
        ValueError: unknown ``units``, or ``norm_groups`` not a positive divisor of 64.
    """

    UNIT_LAYOUTS = {"module": module_units, "block": block_units}
    DEFAULT_UNITS = "module"

    def __init__(self, depth_name: str, input_shape: Tuple[int, int, int], num_classes: int,
                 units: str = "default", norm_groups: int = 2):
        super().__init__()
        if depth_name not in STAGES:
            raise ValueError(f"depth_name must be one of {', '.join(STAGES)}, got {depth_name!r}")
        layout = resolve_units(depth_name, units, tuple(self.UNIT_LAYOUTS), self.DEFAULT_UNITS)
        groups = int(norm_groups)
        if groups < 1 or _MIN_WIDTH % groups:
            raise ValueError(f"model.norm_groups must be a positive divisor of {_MIN_WIDTH} "
                             f"(the narrowest ResNet width), got {norm_groups!r}")
        self.depth_name = depth_name
        self.units_name = layout
        self.norm_groups = groups
        self.unit_prefixes = self.UNIT_LAYOUTS[layout](STAGES[depth_name])

        def norm_layer(channels: int) -> nn.GroupNorm:
            return nn.GroupNorm(groups, channels)

        net = getattr(torchvision().models, depth_name)(weights=None, num_classes=num_classes,
                                                         norm_layer=norm_layer)
        c_in = input_shape[0]
        if c_in != net.conv1.in_channels:
            stem = nn.Conv2d(c_in, 64, kernel_size=7, stride=2, padding=3, bias=False)
            nn.init.kaiming_normal_(stem.weight, mode="fan_out", nonlinearity="relu")  # torchvision's conv init
            net.conv1 = stem
        # adopt torchvision's children so that parameter names carry no wrapper prefix
        for name, child in net.named_children():
            self.add_module(name, child)

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        f = torch.flatten(self.avgpool(x), 1)
        return self.fc(f), f


class ResNet18GN(ResNetGN):
    """ResNet-18 (basic blocks 2-2-2-2) with GroupNorm; units ``module`` (M = 4) | ``block`` (M = 8)."""

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, units: str = "default",
                 norm_groups: int = 2):
        super().__init__("resnet18", input_shape, num_classes, units=units, norm_groups=norm_groups)


class ResNet34GN(ResNetGN):
    """ResNet-34 (basic blocks 3-4-6-3) with GroupNorm; units ``module`` (M = 4) | ``block`` (M = 16)."""

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, units: str = "default",
                 norm_groups: int = 2):
        super().__init__("resnet34", input_shape, num_classes, units=units, norm_groups=norm_groups)
