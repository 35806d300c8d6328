"""Binary logistic regression: FedBCGD's convex problem (Liu et al., ACM MM 2024, sec. 5.3 and 12.5, Figures 8-9;
docs/algorithms.md, FedBCGD's convex problem).

The problem over the n training samples the clients hold (a_i the flattened, normalised input; b_i = +1 for label 1,
-1 for label 0)::

    f(x) = (1/n) sum_i log(1 + exp(-b_i a_i^T x)) + r(x)
    r(x) = lambda/2 ||x||^2                          (paper, Eq. (136))
    r(x) = lambda sum_j x_j^2 / (1 + x_j^2)           (model.nonconvex=true: our stand-in, not the paper's Fig. 9(b))
    lambda = model.lambda_factor * L,   L = lambda_max(A^T A) / (4n)

L is the smoothness constant of the data term (its Hessian is (1/n) A^T diag(s_i (1 - s_i)) A <= A^T A / (4n)).
There is no bias, as in the paper's f. The model returns the logits [0, z] with z = a^T x, so the engine's
cross-entropy of target t in {0, 1} is log(1 + exp(-b z)) with b = 2t - 1 exactly; the regulariser is the model's
:meth:`BinaryLogisticRegression.penalty`, added to every local step's loss. x is stored as
:data:`COORDINATE_BLOCKS` = 5 contiguous parameter chunks ``x.0`` .. ``x.4`` (the paper's N = 5 coordinate
blocks: FedBCGD's block tables hold whole parameters), one FedBug unit.

The reference optimum x* (full-batch L-BFGS in float64, from x = 0) is computed at the first
:meth:`~BinaryLogisticRegression.objective_metrics` call and cached per process and, with a cache folder, as a file
keyed by the data (features, targets, the clients' sample indices), lambda_factor and the regulariser.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..schema import BINARY_MAPS, ConfigError, check_choice, check_finite_positive
from .base import FLModel

COORDINATE_BLOCKS = 5  # FedBCGD sec. 5.3 / Fig. 8: N = 5 coordinate blocks of x
CACHE_FORMAT = 1  # bump when the cached optimum's content changes
LBFGS_GTOL = 1e-10  # stop when every coordinate of the gradient is below this (float64)
LBFGS_MAX_ITER = 5000


def binary_label_map(kind: str, num_classes: int) -> torch.Tensor:
    """The label (1: b = +1, 0: b = -1) of each of the dataset's ``num_classes`` classes; the group holding class 0 is
    always labelled 1.

    ``first_class``: class 0 against the rest (FedBCGD sec. 12.5: "we only consider classifying the first class in
    EMNIST"); ``parity``: the even classes; ``lt_half``: the classes c < C/2; ``digits_letters``: classes 0-9, the
    digits of EMNIST (byclass, bymerge, balanced), against the letters.

    Returns:
        int64 [num_classes] of 0 and 1, both present.

    Raises:
        ConfigError: an unknown ``kind`` (names ``model.binary_map``), fewer than 2 classes, or ``digits_letters`` on a
            dataset with 10 classes or fewer (it needs the letters after the digits).
    """
    check_choice("model.binary_map", kind, BINARY_MAPS)
    if num_classes < 2:
        raise ConfigError(f"model.binary_map={kind} needs a dataset with at least 2 classes, got {num_classes}")
    c = torch.arange(num_classes)
    if kind == "digits_letters" and num_classes <= 10:
        raise ConfigError(f"model.binary_map=digits_letters needs a dataset whose classes 0-9 are digits and the rest "
                          f"letters (EMNIST), got {num_classes} classes (use first_class, parity or lt_half)")
    positive = {"first_class": c == 0, "parity": c % 2 == 0, "lt_half": 2 * c < num_classes,
                "digits_letters": c < 10}[kind]
    return positive.long()


def block_sizes(d: int, blocks: int = COORDINATE_BLOCKS) -> Tuple[int, ...]:
    """Sizes of ``blocks`` contiguous chunks of d coordinates, as ``numpy.array_split`` cuts them (the first d mod
    blocks chunks one longer); a chunk may be empty when d < blocks."""
    return tuple(int(len(a)) for a in np.array_split(np.arange(d), blocks))


def logistic_loss(z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(-b z)) elementwise, without overflow (``logaddexp(0, -b z)``)."""
    t = -b * z
    return torch.logaddexp(torch.zeros_like(t), t)


def regulariser(w: torch.Tensor, lam: float, nonconvex: bool) -> torch.Tensor:
    """r(w): lambda/2 ||w||^2, or lambda sum_j w_j^2 / (1 + w_j^2) when ``nonconvex`` (0-d tensor)."""
    sq = w * w
    return lam * (sq / (1 + sq)).sum() if nonconvex else 0.5 * lam * sq.sum()


def regulariser_grad(w: torch.Tensor, lam: float, nonconvex: bool) -> torch.Tensor:
    """The gradient of :func:`regulariser`: lambda w, or 2 lambda w / (1 + w^2)^2."""
    return 2 * lam * w / (1 + w * w) ** 2 if nonconvex else lam * w


class LogisticObjective:
    """f(w) = (1/n) sum_i log(1 + exp(-b_i a_i^T w)) + r(w) over the clients' samples, in float64.

    Args:
        x: the training inputs [M, ...] (any float dtype, any device); a_i = x[i].flatten().
        y: their targets [M] in {0, 1} (b = 2y - 1).
        index: int64 [n], the rows the clients hold, with multiplicity.
        lam, nonconvex: the regulariser (:func:`regulariser`); ``lam`` may be set after :meth:`smoothness`.
        chunk: rows converted to float64 at a time (bounds the memory).

    Shared, never copied: ``copy.deepcopy`` of a model returns the same objective.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, lam: float = 0.0,
                 nonconvex: bool = False, chunk: int = 16384):
        self.x, self.index = x, index.to(x.device)
        self.b = (2.0 * y.to(torch.float64) - 1.0).to(x.device)
        self.n = int(self.index.numel())
        self.d = int(np.prod(x.shape[1:]))
        self.lam, self.nonconvex, self.chunk = float(lam), bool(nonconvex), int(chunk)

    def __deepcopy__(self, memo):
        return self

    def rows(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """(A_chunk float64 [m, d], b_chunk float64 [m]) over the n rows."""
        for s in range(0, self.n, self.chunk):
            ix = self.index[s:s + self.chunk]
            yield self.x[ix].reshape(len(ix), -1).to(torch.float64), self.b[ix]

    def smoothness(self) -> float:
        """L = lambda_max(A^T A) / (4n), the smoothness constant of the data term.

        Raises:
            ValueError: the clients hold no sample (n = 0).
        """
        if self.n == 0:
            raise ValueError("logreg_binary: the clients hold no training sample")
        gram = torch.zeros(self.d, self.d, dtype=torch.float64, device=self.x.device)
        for a, _ in self.rows():
            gram += a.T @ a
        return float(torch.linalg.eigvalsh(gram)[-1]) / (4 * self.n)

    @torch.no_grad()
    def value(self, w: torch.Tensor) -> float:
        """f(w) for w [d] (any dtype; evaluated in float64)."""
        w = w.to(self.x.device, torch.float64).reshape(-1)
        total = sum(float(logistic_loss(a @ w, b).sum()) for a, b in self.rows())
        return total / self.n + float(regulariser(w, self.lam, self.nonconvex))

    @torch.no_grad()
    def value_and_grad(self, w: torch.Tensor) -> Tuple[float, torch.Tensor]:
        """(f(w), grad f(w) [d] float64): grad = -(1/n) A^T (b sigma(-b A w)) + grad r(w)."""
        w = w.to(self.x.device, torch.float64).reshape(-1)
        total, g = 0.0, torch.zeros_like(w)
        for a, b in self.rows():
            z = a @ w
            total += float(logistic_loss(z, b).sum())
            g -= a.T @ (b * torch.sigmoid(-b * z))
        return (total / self.n + float(regulariser(w, self.lam, self.nonconvex)),
                g / self.n + regulariser_grad(w, self.lam, self.nonconvex))

    def minimise(self, gtol: float = LBFGS_GTOL, max_iter: int = LBFGS_MAX_ITER) -> Dict[str, Any]:
        """Full-batch L-BFGS (``torch.optim.LBFGS``, strong-Wolfe line search, float64) from w = 0.

        Returns:
            ``{"x_star": float64 [d] on the CPU, "f_star": f(x*), "grad_norm": ||grad f(x*)||_2, "iterations"}``.
            For the convex problem x* is the unique minimiser (to ``gtol``); for ``nonconvex`` a stationary point.
        """
        w = torch.zeros(self.d, dtype=torch.float64, device=self.x.device, requires_grad=True)
        opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter, tolerance_grad=gtol,
                                tolerance_change=0.0, history_size=50, line_search_fn="strong_wolfe")

        def closure():
            f, g = self.value_and_grad(w.detach())
            w.grad = g
            return torch.tensor(f, dtype=torch.float64)

        opt.step(closure)
        f, g = self.value_and_grad(w.detach())
        state = opt.state[w]
        return {"x_star": w.detach().cpu().clone(), "f_star": f, "grad_norm": float(g.norm()),
                "iterations": int(state.get("n_iter", 0))}


def data_key(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> str:
    """SHA-256 of the features (bytes, shape, dtype), the targets and the clients' sample indices."""
    h = hashlib.sha256()
    for tensor in (x, y, index):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


_SMOOTHNESS: Dict[str, float] = {}  # data key -> L (this process)
_OPTIMA: Dict[str, Dict[str, Any]] = {}  # problem key -> {L, lam, x_star, f_star, grad_norm, iterations}


def _read_cache(path: Path, key: str) -> Optional[Dict[str, Any]]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # absent, truncated or foreign: solve again
        return None
    if not isinstance(blob, dict) or blob.get("format") != CACHE_FORMAT or blob.get("key") != key:
        return None
    return blob


def _write_cache(path: Path, blob: Dict[str, Any]) -> None:
    """Atomic write (temporary file + rename); a folder that cannot be written only costs the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(blob, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass


class BinaryLogisticRegression(FLModel):
    """z = a^T x on the flattened input a [B, d], logits [B, 2] = [0, z]; features: a. No bias (the paper's f).

    Parameters: x as :data:`COORDINATE_BLOCKS` contiguous chunks ``x.0`` .. ``x.4`` (:func:`block_sizes`), zero at
    construction (the run starts from x = 0, where f = log 2). Units (M = 1): all of x.

    Args:
        input_shape: (C, H, W) of one input; d = C H W.
        num_classes: the dataset's class count C (the map's domain).
        binary_map: ``model.binary_map`` (:func:`binary_label_map`).
        lambda_factor: ``model.lambda_factor`` > 0: lambda = lambda_factor * L, set by :meth:`bind_training_data`.
        nonconvex: ``model.nonconvex``: the non-convex regulariser.

    Raises:
        ConfigError: a bad map or class count (:func:`binary_label_map`), or a ``lambda_factor`` that is not a finite
            number > 0 (names ``model.lambda_factor``).
    """

    unit_prefixes = (("x",),)

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, binary_map: str = "first_class",
                 lambda_factor: float = 1e-4, nonconvex: bool = False):
        super().__init__()
        check_finite_positive("model.lambda_factor", float(lambda_factor), "lambda = lambda_factor * L")
        self.label_map = binary_label_map(binary_map, int(num_classes))
        self.lambda_factor, self.nonconvex = float(lambda_factor), bool(nonconvex)
        self.d = int(np.prod(input_shape))
        self.x = nn.ParameterList([nn.Parameter(torch.zeros(k)) for k in block_sizes(self.d)])
        self.lam: Optional[float] = None  # lambda; set by bind_training_data
        self.smoothness_L: Optional[float] = None
        self.objective: Optional[LogisticObjective] = None
        self._key: Optional[str] = None
        self._cache_dir: Optional[Path] = None

    def feature_dim(self) -> int:
        """d: the features are the flattened input."""
        return self.d

    def forward_features(self, x):
        """x [B, C, H, W] -> (logits [B, 2] = [0, a^T x], features a = x.flatten(1) [B, d])."""
        a = x.flatten(1)
        z = a @ torch.cat(list(self.x))
        return torch.stack([torch.zeros_like(z), z], 1), a

    def coordinates(self, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        """x [..., d] from ``params`` (name -> tensor, other parameters ignored)."""
        return torch.cat([params[f"x.{j}"] for j in range(len(self.x))], -1)

    # ------------------------------------------------------------------ the problem
    def bind_training_data(self, x, y, index, cache_dir=None):
        """Set lambda = lambda_factor * L from the clients' data (L: :meth:`LogisticObjective.smoothness`, once per
        data in this process, or read from the cache) and keep the objective for :meth:`objective_metrics`."""
        dkey = data_key(x, y, index)
        self._key = hashlib.sha256(f"{dkey}|{self.lambda_factor!r}|{self.nonconvex}".encode()).hexdigest()
        self._cache_dir = None if cache_dir is None else Path(cache_dir)
        self.objective = LogisticObjective(x, y, index, nonconvex=self.nonconvex)
        cached = _OPTIMA.get(self._key) or (self._cache_path() and _read_cache(self._cache_path(), self._key))
        if cached:
            _OPTIMA[self._key] = cached
            _SMOOTHNESS.setdefault(dkey, float(cached["L"]))
        if dkey not in _SMOOTHNESS:
            _SMOOTHNESS[dkey] = self.objective.smoothness()
        self.smoothness_L = _SMOOTHNESS[dkey]
        self.lam = self.objective.lam = self.lambda_factor * self.smoothness_L

    def _cache_path(self) -> Optional[Path]:
        return None if self._cache_dir is None else self._cache_dir / f"logreg_binary-{self._key[:24]}.pt"

    def _bound(self) -> LogisticObjective:
        if self.objective is None:
            raise RuntimeError("BinaryLogisticRegression: call bind_training_data first (the factory does)")
        return self.objective

    def optimum(self) -> Dict[str, Any]:
        """The reference optimum ``{"x_star", "f_star", "grad_norm", "iterations", "L", "lam"}`` (L-BFGS,
        :meth:`LogisticObjective.minimise`), solved once per problem key and written to the cache folder if any."""
        obj = self._bound()
        found = _OPTIMA.get(self._key)
        if found is None or "x_star" not in found:
            found = {"format": CACHE_FORMAT, "key": self._key, "L": self.smoothness_L, "lam": self.lam,
                     **obj.minimise()}
            _OPTIMA[self._key] = found
            if self._cache_path() is not None:
                _write_cache(self._cache_path(), found)
        return found

    def penalty(self, params):
        """r(x) (``lam`` from :meth:`bind_training_data`)."""
        if self.lam is None:
            raise RuntimeError("BinaryLogisticRegression: call bind_training_data first (the factory does)")
        return regulariser(self.coordinates(params), self.lam, self.nonconvex)

    def objective_metrics(self, params):
        """``objective`` f(x_r), ``objective_gap`` f(x_r) - f* and ``opt_distance`` ||x_r - x*||_2 of the global model
        (float64 over the clients' samples)."""
        obj = self._bound()
        w = self.coordinates(params).detach().to(obj.x.device, torch.float64)
        opt = self.optimum()
        f = obj.value(w)
        return {"objective": f, "objective_gap": f - float(opt["f_star"]),
                "opt_distance": float((w - opt["x_star"].to(w.device)).norm())}

    def problem_params(self):
        """{"L": L, "lambda": lambda} once bound (MLflow params ``model.L``, ``model.lambda``), else {}."""
        return {} if self.lam is None else {"L": self.smoothness_L, "lambda": self.lam}
