"""Federated quadratic problems whose fixed points are known in closed form (docs/algorithms.md, Fixed points on
quadratic problems): ``dataset=quadratic``.

Device i = 0..K-1 (K = ``dataset.num_devices``) holds

    f_i(x) = 1/2 (x - b_i)^T A_i (x - b_i),   x in R^m (m = ``dataset.dim``),

drawn by :func:`fl_core.theory.quadratic.random_problem` from ``dataset.seed``: every A_i has its eigenvalues in
[mu, L] (``dataset.strong_convexity``, ``dataset.smoothness``), A_i = (1 - s_A) A_0 + s_A R_i with s_A =
``dataset.a_spread`` (0: equal curvatures), b_i = s_b z_i with s_b = ``dataset.b_spread`` (0: one common minimiser).

The engine trains models on samples, so f_i is written as least squares over m samples of device i: the rows
a_ij of M_i = sqrt(m) A_i^{1/2} and the targets y_ij = a_ij^T b_i, for which
1/(2m) sum_j (a_ij^T x - y_ij)^2 = f_i(x). A sample's input is the vector [a_ij, -y_ij] (float32 [1, 1, m + 1]),
so that the residual a_ij^T x - y_ij is the input times [x, 1]: the ``quadratic`` model
(:class:`fl_core.models.quadratic.QuadraticModel`) holds x and turns the residual r into logits whose
cross-entropy for label 0 is r^2 / 2 + log 2 (every label is 0), so a local step of the engine is a gradient step
on f_i exactly, and with ``train.batch_size`` >= m every local step is a full gradient step.

The test set is the training set (the problem has no held-out data): ``test_loss`` is F(x) + log 2 with
F = (1/K) sum_i f_i (all devices hold m samples, so the sample weights are p_i = 1/K); the model logs
F(x) - F(x*) and ||x - x*|| (``objective_gap``, ``opt_distance``) every round. The samples are stored in float32;
:func:`problem_of` gives the problem the stored samples define (A_i, b_i recomputed in float64 from the rows),
against which fixed points are computed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..theory.quadratic import Quadratic, random_problem
from .dataset import FLDataset

__all__ = ["quadratic_dataset", "quadratic_provenance", "problem_of", "rows_of"]


def quadratic_provenance(cfg: Any) -> dict:
    """What the data of ``cfg`` is generated from (the prepared cache's signature, the MLflow input source)."""
    return {"generator": "fl_core.data.quadratic (federated quadratics, fl_core.theory.quadratic.random_problem)",
            "args": {"num_devices": int(cfg.num_devices), "dim": int(cfg.dim), "smoothness": float(cfg.smoothness),
                     "strong_convexity": float(cfg.strong_convexity), "a_spread": float(cfg.a_spread),
                     "b_spread": float(cfg.b_spread), "seed": int(cfg.seed)}}


def rows_of(problem: Quadratic) -> np.ndarray:
    """float64 [K, m, m + 1]: device i's m samples [a_ij, -y_ij], the rows of M_i = sqrt(m) A_i^{1/2} and
    y_i = M_i b_i."""
    K, m = problem.b.shape
    out = np.empty((K, m, m + 1))
    for i in range(K):
        w, v = np.linalg.eigh(problem.A[i])
        M = math.sqrt(m) * (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
        out[i, :, :m] = M
        out[i, :, m] = -(M @ problem.b[i])
    return out


def quadratic_dataset(cfg: Any) -> FLDataset:
    """The problem of ``cfg`` (``dataset.num_devices``, ``dim``, ``smoothness``, ``strong_convexity``, ``a_spread``,
    ``b_spread``, ``seed``) as an :class:`FLDataset`: float32 ``[K m, 1, 1, m + 1]`` samples, device by device, label
    0, 2 classes (the model's logits; class 1 holds no sample), ``devices``; the test set is the training set.

    Raises:
        ValueError: out-of-range keys (one line naming the key; the config checks these first).
    """
    K, m = int(cfg.num_devices), int(cfg.dim)
    L, mu = float(cfg.smoothness), float(cfg.strong_convexity)
    if K < 1 or m < 1:
        raise ValueError(f"dataset.num_devices and dataset.dim must be >= 1, got {K} and {m}")
    if not (math.isfinite(L) and math.isfinite(mu) and 0 < mu <= L):
        raise ValueError(f"dataset.strong_convexity must be in (0, dataset.smoothness], got {mu:g} and L = {L:g}")
    problem = random_problem(K, m, L=L, mu=mu, a_spread=float(cfg.a_spread), b_spread=float(cfg.b_spread),
                             seed=int(cfg.seed))
    x = torch.from_numpy(rows_of(problem).astype(np.float32)).reshape(K * m, 1, 1, m + 1).contiguous()
    y = torch.zeros(K * m, dtype=torch.int64)
    return FLDataset(name="quadratic", x_train=x, y_train=y, x_test=x.clone(), y_test=y.clone(), num_classes=2,
                     scale=1.0, mean=(0.0,), std=(1.0,),
                     devices=torch.arange(K, dtype=torch.int64).repeat_interleave(m),
                     provenance=quadratic_provenance(cfg))


def problem_of(x_train: torch.Tensor, devices: torch.Tensor) -> Quadratic:
    """The quadratic the stored samples define, in float64: for device i with rows [a_ij, -y_ij] (n_i of them),
    A_i = (1/n_i) sum_j a_ij a_ij^T, b_i = A_i^{-1} (1/n_i) sum_j a_ij y_ij, p_i = n_i / n, so that
    1/(2 n_i) sum_j (a_ij^T x - y_ij)^2 = f_i(x) + const.

    Args:
        x_train: [n, 1, 1, m + 1] (or [n, m + 1]) samples of :func:`quadratic_dataset`.
        devices: int64 [n], each sample's device.
    """
    rows = x_train.reshape(x_train.shape[0], -1).double().numpy()
    dev = devices.numpy()
    K = int(dev.max()) + 1
    A, b, n = [], [], []
    for i in range(K):
        r = rows[dev == i]
        a, y = r[:, :-1], -r[:, -1]
        Ai = a.T @ a / len(r)
        A.append(Ai)
        b.append(np.linalg.solve(Ai, a.T @ y / len(r)))
        n.append(len(r))
    n_arr = np.asarray(n, dtype=float)
    return Quadratic(np.stack(A), np.stack(b), n_arr / n_arr.sum())
