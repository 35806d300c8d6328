"""The in-memory dataset every source returns (:class:`FLDataset`) and the error a source raises
(:class:`DataSourceError`); the sources (:mod:`.sources`, :mod:`.synthetic`, :mod:`.mnist1d`) build on this module,
which imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class DataSourceError(RuntimeError):
    """The raw files of a dataset are missing or unreadable, or the source is unknown.

    The message is one line that names the config key, the path, and the fix.
    """


@dataclass
class FLDataset:
    """A dataset held in memory: raw integer images, or the float vectors of a generated source.

    Attributes:
        name: source name (``dataset.name``).
        x_train: uint8 ``[N, C, H, W]`` training images, raw values in ``[0, scale]``; or, for the generated
            sources (``synthetic``, ``mnist1d``), float32 ``[N, 1, 1, L]`` vectors of L features (``scale = 1``).
        y_train: int64 ``[N]`` training labels in ``[0, num_classes)``.
        x_test: ``[M, C, H, W]`` test images (the dtype of ``x_train``).
        y_test: int64 ``[M]`` test labels.
        num_classes: number of classes C.
        scale: the raw maximum (255.0 for 8-bit images, 16.0 for sklearn digits, 1.0 for float data);
            ``x / scale`` lies in ``[0, 1]`` for images.
        mean: per-channel mean of ``x / scale`` (length C_in).
        std: per-channel standard deviation of ``x / scale`` (length C_in).
        devices: None, or int64 ``[N]``: the device (natural client) that generated each training sample, ids
            ``0..num_devices-1`` (``synthetic``, ``quadratic``; the writers of ``femnist``, the speakers of
            ``shakespeare``; used by ``partition=natural``).
        provenance: for a generated source, the generator and every argument it was called with; for ``femnist`` /
            ``shakespeare``, the format read and the writer count (JSON-able; recorded as the MLflow dataset input's
            source); empty otherwise.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    devices: Optional[torch.Tensor] = None
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.dtype not in (torch.uint8, torch.float32) or x.dim() != 4 or x.dtype != self.x_train.dtype:
                raise ValueError(f"x_{split} must be uint8 or float32 [N, C, H, W] (both splits alike), "
                                 f"got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"y_{split} must be int64 [{x.shape[0]}], got {y.dtype} {tuple(y.shape)}")
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        if len(self.mean) != self.x_train.shape[1] or len(self.std) != self.x_train.shape[1]:
            raise ValueError(f"mean/std need one value per channel ({self.x_train.shape[1]})")
        if self.devices is not None and (self.devices.dtype != torch.int64
                                         or self.devices.shape != self.y_train.shape):
            raise ValueError(f"devices must be int64 [{self.y_train.shape[0]}], got {self.devices.dtype} "
                             f"{tuple(self.devices.shape)}")

    @property
    def num_devices(self) -> int:
        """How many devices generated the training set (0 for a dataset without devices)."""
        return 0 if self.devices is None or not self.devices.numel() else int(self.devices.max()) + 1

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Map raw images to the model's input space.

        Args:
            x: uint8 (or any numeric) tensor ``[..., C, H, W]`` of raw values, on any device.

        Returns:
            float32 ``(x / scale - mean) / std`` with per-channel mean/std, on ``x.device``.
        """
        shape = (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(shape)
        return (x.to(torch.float32) / self.scale - mean) / std
