"""The model of ``dataset=quadratic`` (:mod:`fl_core.data.quadratic`): the point x in R^m itself.

A sample's input is [a, -y] (float [1, 1, m + 1]); the residual is r = a^T x - y = input . [x, 1]. The model returns
the logits [0, u(r)] with

    u(r) = log(exp(r^2 / 2 + log 2) - 1),

so that the engine's cross-entropy for label 0, log(1 + exp(u)), is r^2 / 2 + log 2 exactly: a client's mean loss
over its samples is f_i(x) + log 2 and its gradient that of f_i (docs/algorithms.md, Fixed points on quadratic
problems). u is computed as c + log(1 - exp(-c)) with c = r^2 / 2 + log 2 >= log 2, which stays finite for any r.
x starts at 0 (no random initialisation). The model predicts class 1 for every sample (u > 0), so the test accuracy
is 0 throughout: the measures of this problem are ``objective_gap`` F(x) - F(x*) and ``opt_distance`` ||x - x*||, which
:meth:`QuadraticModel.objective_metrics` adds to every round, in float64 over the training samples
(:func:`fl_core.data.quadratic.problem_of`).
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch
from torch import nn

from .base import FLModel


def residual_logits(r: torch.Tensor) -> torch.Tensor:
    """[B] residuals -> [B, 2] logits [0, u(r)] whose cross-entropy for label 0 is r^2 / 2 + log 2 (module
    docstring)."""
    c = 0.5 * r * r + math.log(2.0)
    u = c + torch.log(-torch.expm1(-c))
    return torch.stack([torch.zeros_like(u), u], dim=1)


class QuadraticModel(FLModel):
    """x in R^m for samples [a, -y] of length m + 1 (``input_shape`` [1, 1, m + 1]). One unit (``x``); features: the
    residual [B, 1]."""

    unit_prefixes = (("x",),)

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        super().__init__()
        width = math.prod(input_shape)
        if width < 2 or num_classes != 2:
            raise ValueError(f"model.name=quadratic needs dataset=quadratic (samples [a, -y], 2 logits), got input "
                             f"{tuple(input_shape)} and {num_classes} classes")
        self.x = nn.Parameter(torch.zeros(width - 1))
        self._rows = None  # (rows [n, m + 1] float64, x* [m], F*) once bound

    def init_parameters(self) -> None:
        """x = 0."""
        with torch.no_grad():
            self.x.zero_()

    def feature_dim(self) -> int:
        return 1

    def forward_features(self, inp):
        flat = inp.flatten(1)
        r = flat[:, :-1] @ self.x + flat[:, -1]
        return residual_logits(r), r[:, None]

    def bind_training_data(self, x, y, index, cache_dir=None):
        """Hold the clients' samples (float64, on the CPU) and the least-squares optimum x* of F over them."""
        rows = x[index].reshape(len(index), -1).detach().double().cpu().numpy()
        a, t = rows[:, :-1], -rows[:, -1]
        x_star = np.linalg.lstsq(a, t, rcond=None)[0]
        self._rows = (rows, x_star, self._value(rows, x_star))

    @staticmethod
    def _value(rows: np.ndarray, x: np.ndarray) -> float:
        r = rows[:, :-1] @ x + rows[:, -1]
        return float(0.5 * np.mean(r * r))

    def objective_metrics(self, params):
        """``objective`` F(x) = (1/n) sum r^2 / 2 over the clients' samples (= sum_i p_i f_i(x)), ``objective_gap``
        F(x) - F(x*) and ``opt_distance`` ||x - x*||_2, in float64."""
        if self._rows is None:
            raise RuntimeError("QuadraticModel: call bind_training_data first (the factory does)")
        rows, x_star, f_star = self._rows
        x = params["x"].detach().double().cpu().numpy().reshape(-1)
        f = self._value(rows, x)
        return {"objective": f, "objective_gap": f - f_star, "opt_distance": float(np.linalg.norm(x - x_star))}
