"""Synthetic(alpha, beta): the generated multinomial-logistic data of FedProx (docs/algorithms.md, Data).

Source: Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx), MLSys 2020, Sec. 5.1, after
Shamir et al. 2014; the sample-count law, the parameters' meaning and the IID control follow the FedProx
authors' generators (``data/synthetic_*/generate_*.py`` in their repository), written here anew.

For device k = 0..K-1 (K = ``dataset.num_devices``), all normals drawn independently:

- ``n_k = floor(exp(N(4, 2^2))) + 50`` samples (a lognormal count plus 50, so heavy-tailed sizes);
- ``u_k ~ N(0, alpha^2)``, ``B_k ~ N(0, beta^2)``: ``alpha`` and ``beta`` are *standard deviations* (the
  authors' generator passes them as the scale of ``numpy.random.normal``; the paper writes N(0, alpha));
- ``W_k`` (60 x 10) and ``b_k`` (10) with entries ~ ``N(u_k, 1)``: how far the devices' models differ;
- ``v_k`` (60) with entries ~ ``N(B_k, 1)``: how far the devices' inputs differ;
- ``x ~ N(v_k, Sigma)``, ``Sigma`` diagonal with ``Sigma_jj = j^-1.2`` (j = 1..60);
- ``y = argmax(softmax(W_k^T x + b_k))`` = ``argmax(W_k^T x + b_k)``, one of 10 classes.

``alpha`` changes no sample. Every entry of ``W_k`` and ``b_k`` has the same mean ``u_k``, so ``u_k``
adds ``u_k (sum_j x_j + 1)`` to every class's logit alike and the argmax does not see it: the labels depend on
``W_k - u_k`` and ``b_k - u_k`` only, whose law is free of alpha. The same holds in the authors' generator (they
draw ``mean_b = mean_W``), so their Synthetic(0.5, 0.5) and Synthetic(1, 1) differ through beta alone. Here,
with one seed, the tensors for any two alphas are identical (tests/test_datasets_generated.py); the key is kept
for the paper's naming and recorded in the provenance.

``dataset.iid=true`` is the authors' IID control (their ``synthetic_iid`` generator): one ``W``, ``b`` with
entries ~ N(0, 1) shared by every device and ``v_k = 0`` for every device, so only the sample counts differ
between devices (``alpha`` and ``beta`` play no part).

Each device's samples are shuffled and split into its train and test share: ``n_k - t_k`` training and
``t_k = n_k - floor((1 - f) n_k)`` test samples, f = ``dataset.test_fraction`` (the paper: 20 %; the authors'
generator scripts keep 10 %), each side at least one sample. The training set is the devices' training
shares in device order, with the device of every sample in ``FLDataset.devices``; the test set is the union
of the devices' test shares.

Everything is drawn from one NumPy generator seeded by ``dataset.seed`` (the authors' scripts are unseeded),
so a seed gives the same tensors on every machine.
"""

from __future__ import annotations

import decimal
import math
from typing import Any

import numpy as np
import torch

from fl_core.seeding import numpy_rng

from .dataset import FLDataset

__all__ = ["FEATURES", "CLASSES", "covariance_diagonal", "logits", "generate_devices", "synthetic_dataset",
           "synthetic_provenance"]

FEATURES = 60  # dimension of x (FedProx Sec. 5.1)
CLASSES = 10
SIZE_LOG_MEAN, SIZE_LOG_SIGMA, SIZE_MIN = 4.0, 2.0, 50  # n_k = floor(lognormal(4, 2)) + 50 (authors' generator)
SIGMA_EXPONENT = -1.2  # Sigma_jj = j^-1.2


def covariance_diagonal(dim: int = FEATURES) -> np.ndarray:
    """float64 ``[dim]``: the diagonal of Sigma, ``j^-1.2`` for j = 1..dim, the same on every CPU.

    Each power is computed to 50 significant digits in Python's decimal arithmetic (software: no instruction of the
    processor decides it) and rounded once to float64, i.e. correctly rounded. NumPy's ``**`` takes the processor's
    vector power instead (SVML on a CPU with AVX-512), which is not correctly rounded: ``np.arange(1, 61.) ** -1.2``
    differed in the last bit of j = 20 between a CPU with AVX-512 and one without (docs/reliability.md, Numbers on
    another CPU).
    """
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        exponent = decimal.Decimal(SIGMA_EXPONENT)  # the float64 -1.2, exactly
        return np.array([float(decimal.Decimal(j) ** exponent) for j in range(1, dim + 1)], dtype=np.float64)


def logits(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x @ w + b`` (float64 ``[n, classes]``) with one fixed order of operations on every CPU: the products
    ``x[:, j] * w[j]`` summed over j = 0, 1, ... in turn, then ``b``. ``x @ w`` goes to the BLAS, whose kernel (and
    so its order of summation) depends on the processor and the thread count, and a label is the argmax of these
    values."""
    out = np.zeros((x.shape[0], w.shape[1]), dtype=np.float64)
    for j in range(x.shape[1]):
        out += x[:, j, None] * w[j]  # one rounded product, then one rounded sum, per element
    return out + b


def generate_devices(alpha: float, beta: float, iid: bool, num_devices: int,
                     rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """The samples of every device, before the train/test split.

    Args:
        alpha, beta: standard deviations of ``u_k`` and ``B_k`` (>= 0; unused when ``iid``).
        iid: the IID control (shared W, b; v_k = 0).
        num_devices: K >= 1.
        rng: the generator all draws come from, in this order: the sizes; u, B and the v_k (or, when ``iid``,
            the shared W, b); then per device its W_k, b_k (not when ``iid``) and its x.

    Returns:
        K pairs ``(x float64 [n_k, 60], y int64 [n_k])``.
    """
    sizes = np.floor(rng.lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA, num_devices)).astype(np.int64) + SIZE_MIN
    sd = np.sqrt(covariance_diagonal())
    if iid:
        means = np.zeros((num_devices, FEATURES))
        w_shared = rng.normal(0.0, 1.0, (FEATURES, CLASSES))
        b_shared = rng.normal(0.0, 1.0, CLASSES)
    else:
        u = rng.normal(0.0, float(alpha), num_devices)
        big_b = rng.normal(0.0, float(beta), num_devices)
        means = rng.normal(big_b[:, None], 1.0, (num_devices, FEATURES))
    out = []
    for k in range(num_devices):
        if iid:
            w, b = w_shared, b_shared
        else:
            w = rng.normal(u[k], 1.0, (FEATURES, CLASSES))
            b = rng.normal(u[k], 1.0, CLASSES)
        x = means[k] + sd * rng.standard_normal((int(sizes[k]), FEATURES))
        y = np.argmax(logits(x, w, b), axis=1).astype(np.int64)
        out.append((x, y))
    return out


def synthetic_provenance(cfg: Any) -> dict:
    """What the data of ``cfg`` is generated from (the prepared cache's signature, the MLflow input source)."""
    iid = bool(cfg.iid)
    args = {"iid": iid}
    if not iid:
        args.update(alpha=float(cfg.alpha), beta=float(cfg.beta))
    args.update(num_devices=int(cfg.num_devices), test_fraction=float(cfg.test_fraction), seed=int(cfg.seed))
    return {"generator": "fl_core.data.synthetic (FedProx Synthetic(alpha, beta))", "args": args}


def synthetic_dataset(cfg: Any) -> FLDataset:
    """Synthetic(alpha, beta) of ``cfg`` (``dataset.alpha``, ``beta``, ``iid``, ``num_devices``, ``test_fraction``,
    ``seed``) as an :class:`FLDataset`: float32 ``[N, 1, 1, 60]`` / ``[M, 1, 1, 60]``, 10 classes, ``devices``.

    Raises:
        ValueError: ``dataset.alpha`` or ``dataset.beta`` < 0, ``dataset.num_devices`` < 1 or
            ``dataset.test_fraction`` outside (0, 1) (one line naming the key; the config checks these first).
    """
    for key in ("alpha", "beta"):
        value = float(getattr(cfg, key))
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"dataset.{key} must be a finite number >= 0, got {value:g}")
    k = int(cfg.num_devices)
    if k < 1:
        raise ValueError(f"dataset.num_devices must be >= 1, got {k}")
    f = float(cfg.test_fraction)
    if not 0.0 < f < 1.0:
        raise ValueError(f"dataset.test_fraction must be in (0, 1), got {f:g}")
    rng = numpy_rng("synthetic", int(cfg.seed))
    devices = generate_devices(float(cfg.alpha), float(cfg.beta), bool(cfg.iid), k, rng)
    xs_tr, ys_tr, ds_tr, xs_te, ys_te = [], [], [], [], []
    for dev, (x, y) in enumerate(devices):
        n = len(y)
        n_train = min(max(int(math.floor((1.0 - f) * n + 1e-9)), 1), n - 1)
        order = rng.permutation(n)
        tr, te = order[:n_train], order[n_train:]
        xs_tr.append(x[tr])
        ys_tr.append(y[tr])
        ds_tr.append(np.full(n_train, dev, dtype=np.int64))
        xs_te.append(x[te])
        ys_te.append(y[te])

    def vectors(parts: list) -> torch.Tensor:  # float64 [n, 60] pieces -> float32 [N, 1, 1, 60]
        return torch.from_numpy(np.concatenate(parts).astype(np.float32)).reshape(-1, 1, 1, FEATURES).contiguous()

    return FLDataset(
        name="synthetic",
        x_train=vectors(xs_tr),
        y_train=torch.from_numpy(np.concatenate(ys_tr)),
        x_test=vectors(xs_te),
        y_test=torch.from_numpy(np.concatenate(ys_te)),
        num_classes=CLASSES,
        scale=1.0,
        mean=(0.0,),
        std=(1.0,),
        devices=torch.from_numpy(np.concatenate(ds_tr)),
        provenance=synthetic_provenance(cfg),
    )
