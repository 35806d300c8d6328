"""What every reader of a dataset's files shares (:mod:`.sources`, :mod:`.leaf`): a caught error quoted in one line
for a :class:`~fl_core.data.dataset.DataSourceError`'s message (:func:`one_line`), and the per-channel mean and std
of the images read, the same to the bit on every machine (:func:`channel_stats`). It imports none of the readers, so
each of them can import it without going round a circle."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

__all__ = ["channel_stats", "one_line"]


def one_line(err: BaseException, with_type: bool = True) -> str:
    """``err`` as one printable line of at most 200 characters: ``Type: first line of the message`` (without
    ``Type: `` when ``with_type`` is false, unless the message is empty)."""
    lines = str(err).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if with_type or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= 200 else text[:197] + "..."


def channel_stats(x: torch.Tensor, scale: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) standard deviation of ``x / scale``, the same to the bit on every CPU and
    thread count (docs/reliability.md, Numbers on another CPU).

    A float reduction in torch (or BLAS) sums in an order that depends on the CPU's instruction set and the number
    of threads, so ``(x / scale).std(dim=(0, 2, 3))`` differed in the last digits between one and two threads
    (0.37600559619114615 against 0.37600559619096297 on the digits split), and with it the prepared data and
    ``dvc.lock``. Here no float is summed in an order a machine chooses:

    - uint8 images: the sums are exact integers, ``S1 = sum k`` and ``S2 = sum k^2`` per channel (counted with
      ``numpy.bincount``, integers: any order gives the same sum); the mean ``S1 / (n scale)`` and the variance
      ``(n S2 - S1^2) / (n scale)^2`` are exact fractions, each rounded once to float64; the std is the square
      root of that float64 variance (IEEE's square root is correctly rounded).
    - float images: two passes of :func:`math.fsum` (exactly rounded sums) over the float64 values: the mean, then
      the mean squared deviation from it.

    Args:
        x: uint8 or float ``[N, C, H, W]`` (a tensor or an array), N >= 1.
        scale: the raw maximum the values are divided by (``FLDataset.scale``).

    Returns:
        ``(mean, std)``, one float per channel.
    """
    a = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 4 or a.shape[0] == 0:
        raise ValueError(f"channel_stats needs a non-empty [N, C, H, W] array, got shape {tuple(a.shape)}")
    means, stds = [], []
    for c in range(a.shape[1]):
        values = a[:, c].reshape(-1)
        n = values.size
        if values.dtype == np.uint8:
            counts = np.bincount(values, minlength=256).tolist()  # Python ints: exact sums below
            s1 = sum(k * m for k, m in enumerate(counts))
            s2 = sum(k * k * m for k, m in enumerate(counts))
            unit = Fraction(float(scale)) * n  # n * scale, exactly
            means.append(float(Fraction(s1) / unit))
            stds.append(math.sqrt(Fraction(n * s2 - s1 * s1) / (unit * unit)))
        else:
            floats = (values.astype(np.float64) / float(scale)).tolist()
            mean = math.fsum(floats) / n
            means.append(mean)
            stds.append(math.sqrt(math.fsum((v - mean) ** 2 for v in floats) / n))
    return tuple(means), tuple(stds)
