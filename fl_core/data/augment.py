"""Per-sample training augmentation, batched on the device (docs/algorithms.md, Augmentation and normalisation).

Modes (``train.augmentation``):
- ``none``: no augmentation (the IID-to-non-IID study, digits).
- ``crop_flip``: torchvision-style ``RandomCrop(H, padding)`` + ``RandomHorizontalFlip()`` on every
  sample (FedBCGD, FedExP).
- ``fedbug``: Acar/FedBug on CIFAR: horizontal flip with p = 0.5, then with p = 0.5 a random crop from
  the zero-padded image (padding in normalised space, since FedBug normalises before augmenting).
- ``flip``: horizontal flip with p = 0.5 only (FedBug on Tiny-ImageNet, whose crop code is disabled).

The random draws of a mini-batch are a pure function of ``(seed, round, client, step)`` and are
made for a full batch of B samples, so the sequential and the vectorised executor (whose batches
are padded to B) augment every real sample identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schema import AUGMENTATIONS
from ..seeding import torch_generator

MODES = AUGMENTATIONS  # train.augmentation's choices, declared once in the schema


@dataclass
class AugmentParams:
    flip: torch.Tensor  # bool [B]
    dy: torch.Tensor  # int64 [B], crop offset in [0, 2*padding]
    dx: torch.Tensor  # int64 [B]


def draw(mode: str, batch_size: int, padding: int, seed: int, round_idx: int, client_id: int,
         step: int) -> AugmentParams:
    """The augmentation parameters of one mini-batch (on the CPU; B = ``batch_size`` entries)."""
    g = torch_generator("augment", seed, round_idx, client_id, step)
    flip = torch.rand(batch_size, generator=g) < 0.5
    dy = torch.randint(0, 2 * padding + 1, (batch_size,), generator=g)
    dx = torch.randint(0, 2 * padding + 1, (batch_size,), generator=g)
    if mode == "flip":
        dy = torch.full_like(dy, padding)
        dx = torch.full_like(dx, padding)
    elif mode == "fedbug":
        crop = torch.rand(batch_size, generator=g) < 0.5
        dy = torch.where(crop, dy, torch.full_like(dy, padding))  # offset = padding: the original image
        dx = torch.where(crop, dx, torch.full_like(dx, padding))
    return AugmentParams(flip, dy, dx)


def apply(x: torch.Tensor, p: AugmentParams, padding: int) -> torch.Tensor:
    """Flip and crop every sample of ``x`` [..., C, H, W] (leading dims flattened to the B of ``p``).

    Crops are taken from the image zero-padded by ``padding`` pixels on each side; the output has
    the input's shape. ``p`` may be on the CPU; it is moved to ``x``'s device.
    """
    shape = x.shape
    c, h, w = shape[-3:]
    x = x.reshape(-1, c, h, w)
    n = x.shape[0]
    dev = x.device
    flip, dy, dx = p.flip.to(dev)[:n], p.dy.to(dev)[:n], p.dx.to(dev)[:n]
    x = torch.where(flip.view(n, 1, 1, 1), x.flip(-1), x)
    if padding > 0:
        xp = F.pad(x, (padding, padding, padding, padding))
        rows = (dy.view(n, 1) + torch.arange(h, device=dev)).view(n, 1, h, 1).expand(n, c, h, w + 2 * padding)
        xp = xp.gather(2, rows)
        cols = (dx.view(n, 1) + torch.arange(w, device=dev)).view(n, 1, 1, w).expand(n, c, h, w)
        x = xp.gather(3, cols)
    return x.reshape(shape)


def stack(params: list) -> AugmentParams:
    """Concatenate the parameters of several batches (client after client) for one batched apply."""
    return AugmentParams(torch.cat([p.flip for p in params]), torch.cat([p.dy for p in params]),
                         torch.cat([p.dx for p in params]))
