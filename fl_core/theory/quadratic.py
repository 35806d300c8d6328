"""Closed-form fixed points of federated rules on quadratic problems, in float64 with numpy: the references that
runs of the engine are checked against (they share no code with it).

The problem (N clients, dimension d): client i's objective and the global one

    f_i(x) = 1/2 (x - b_i)^T A_i (x - b_i),        f(x) = sum_i p_i f_i(x),

with A_i symmetric positive definite [d, d], b_i [d] and weights p_i >= 0 summing to 1 (the data-size weights of
FedAvg's aggregation). The global minimiser is

    x* = (sum_i p_i A_i)^{-1} sum_i p_i A_i b_i                                      (:func:`minimizer`).

Each round every client starts from the server's x and takes K_i full-batch gradient steps at eta_l. On f_i a step
is the affine map y -> b_i + (I - eta_l A_i)(y - b_i), so after K_i steps y_i(x) = b_i + M_i (x - b_i) with
M_i = (I - eta_l A_i)^{K_i}. A server step x <- x + eta_g (sum_i p_i y_i(x) - x) with any eta_g > 0 stops where the
average does not move, so these fixed points do not depend on eta_g (convergence does):

- **FedAvg** (:func:`local_gd_fixed_point` with mu = 0): sum_i p_i (I - M_i)(x - b_i) = 0, i.e.
  x = (sum_i p_i (I - M_i))^{-1} sum_i p_i (I - M_i) b_i (Charles & Konecny, AISTATS 2021, sec. 3; Malinovsky et al.,
  ICML 2020). With K_i = 1 it is x* (I - M_i = eta_l A_i); with all A_i equal it is x* for any K; otherwise its
  distance from x* grows with eta_l K and with the spread of the A_i and b_i. For small eta_l it tends to the
  minimiser of sum_i p_i K_i f_i: unequal K_i tilt it towards the clients that take more steps (FedNova's objective
  inconsistency, Wang et al., NeurIPS 2020, sec. 3).
- **FedProx** (mu > 0): each local step is on f_i(y) + mu/2 ||y - x||^2, the map y -> c_i + N_i (y - c_i) with
  N_i = I - eta_l (A_i + mu I) and c_i = (A_i + mu I)^{-1}(A_i b_i + mu x); the fixed point solves
  sum_i p_i (I - N_i^{K_i}) (A_i + mu I)^{-1} A_i (x - b_i) = 0. With exact local solves (K_i -> infinity) that is the
  proximal equation sum_i p_i (A_i + mu I)^{-1} A_i (x - b_i) = 0 (:func:`proximal_fixed_point`; Li et al., MLSys
  2020). mu = 0 gives FedAvg's.
- **FedNova** (:func:`fednova_fixed_point`): the server averages the normalised directions (x - y_i) / K_i (times
  tau_eff), so sum_i p_i (I - M_i)(x - b_i) / K_i = 0. Unequal K_i no longer tilt it: for small eta_l it tends to
  x*, whatever the K_i (Wang et al. 2020, Theorem 1's objective); the O(eta_l K) drift of local steps remains.
- **SCAFFOLD, FedDyn, FedDC** with full participation: x* itself (their corrections cancel the drift at a fixed
  point: Karimireddy et al., ICML 2020; Acar et al., ICLR 2021; Gao et al., CVPR 2022).

Every function takes A [N, d, d], b [N, d], p [N] (array-likes, float64) and returns x [d] (float64). The matrices
of a client commute (all are polynomials in A_i), so each weighted sum is symmetric positive definite for eta_l
below 1 / L (L the largest eigenvalue of the A_i) and the linear solves are well posed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple, Union

import numpy as np

Steps = Union[int, Sequence[int]]


@dataclass(frozen=True)
class Quadratic:
    """A federated quadratic problem: ``A`` [N, d, d] symmetric positive definite, ``b`` [N, d], ``p`` [N] weights
    summing to 1 (module docstring)."""

    A: np.ndarray
    b: np.ndarray
    p: np.ndarray

    @property
    def num_clients(self) -> int:
        return int(self.A.shape[0])

    @property
    def dim(self) -> int:
        return int(self.A.shape[1])

    def objective(self, x: np.ndarray) -> float:
        """f(x) = sum_i p_i 1/2 (x - b_i)^T A_i (x - b_i)."""
        r = np.asarray(x, dtype=np.float64)[None, :] - self.b
        return float(0.5 * np.einsum("i,ij,ijk,ik->", self.p, r, self.A, r))


def _check(A, b, p) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    A, b, p = (np.asarray(v, dtype=np.float64) for v in (A, b, p))
    if A.ndim != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"A must be [N, d, d], got shape {A.shape}")
    n, d = A.shape[:2]
    if b.shape != (n, d) or p.shape != (n,):
        raise ValueError(f"b must be [{n}, {d}] and p [{n}], got {b.shape} and {p.shape}")
    if np.any(p < 0) or not np.isclose(p.sum(), 1.0):
        raise ValueError(f"p must be non-negative weights summing to 1, got sum {p.sum():.6g}")
    if not np.allclose(A, np.swapaxes(A, 1, 2)):
        raise ValueError("every A_i must be symmetric")
    return A, b, p


def _steps(K: Steps, n: int) -> np.ndarray:
    k = np.broadcast_to(np.asarray(K, dtype=np.int64), (n,))
    if np.any(k < 1):
        raise ValueError(f"local steps K_i must be >= 1, got {k.min()}")
    return k


def _weighted_solve(G: np.ndarray, b: np.ndarray, p: np.ndarray) -> np.ndarray:
    """x solving sum_i p_i G_i (x - b_i) = 0."""
    lhs = np.einsum("i,ijk->jk", p, G)
    rhs = np.einsum("i,ijk,ik->j", p, G, b)
    return np.linalg.solve(lhs, rhs)


def _local_gd_gains(A: np.ndarray, eta_l: float, k: np.ndarray, mu: float) -> np.ndarray:
    """G_i = (I - N_i^{K_i}) (A_i + mu I)^{-1} A_i with N_i = I - eta_l (A_i + mu I), [N, d, d]: K_i local steps
    from x move client i by -G_i (x - b_i) (mu = 0: G_i = I - M_i)."""
    eye = np.eye(A.shape[1])
    G = np.empty_like(A)
    for i in range(len(A)):
        reg = A[i] + mu * eye
        G[i] = (eye - np.linalg.matrix_power(eye - eta_l * reg, int(k[i]))) @ np.linalg.solve(reg, A[i])
    return G


def minimizer(A, b, p) -> np.ndarray:
    """x* = (sum_i p_i A_i)^{-1} sum_i p_i A_i b_i, the minimiser of f."""
    A, b, p = _check(A, b, p)
    return _weighted_solve(A, b, p)


def local_gd_fixed_point(A, b, p, eta_l: float, K: Steps, mu: float = 0.0) -> np.ndarray:
    """The fixed point of K_i local gradient steps at ``eta_l`` per round, averaged with weights p (FedAvg; FedProx
    with ``mu`` > 0); ``K`` an int or one per client. Raises ValueError for bad shapes, weights, K_i < 1, eta_l <= 0
    or mu < 0."""
    A, b, p = _check(A, b, p)
    if eta_l <= 0 or mu < 0:
        raise ValueError(f"need eta_l > 0 and mu >= 0, got eta_l={eta_l}, mu={mu}")
    return _weighted_solve(_local_gd_gains(A, eta_l, _steps(K, len(p)), mu), b, p)


def proximal_fixed_point(A, b, p, mu: float) -> np.ndarray:
    """FedProx with exact local solves: sum_i p_i (A_i + mu I)^{-1} A_i (x - b_i) = 0 (``mu`` > 0)."""
    A, b, p = _check(A, b, p)
    if mu <= 0:
        raise ValueError(f"need mu > 0, got {mu}")
    eye = np.eye(A.shape[1])
    G = np.stack([np.linalg.solve(A[i] + mu * eye, A[i]) for i in range(len(p))])
    return _weighted_solve(G, b, p)


def fednova_fixed_point(A, b, p, eta_l: float, K: Steps) -> np.ndarray:
    """FedNova's fixed point: sum_i p_i (I - M_i)(x - b_i) / K_i = 0 with M_i = (I - eta_l A_i)^{K_i}."""
    A, b, p = _check(A, b, p)
    if eta_l <= 0:
        raise ValueError(f"need eta_l > 0, got eta_l={eta_l}")
    k = _steps(K, len(p))
    return _weighted_solve(_local_gd_gains(A, eta_l, k, 0.0) / k[:, None, None], b, p)


def random_problem(num_clients: int, dim: int, *, L: float = 1.0, mu: float = 0.1, a_spread: float = 1.0,
                   b_spread: float = 1.0, seed: int = 0, weights: str = "equal") -> Quadratic:
    """A random problem whose heterogeneity is set by two numbers.

    A_i = (1 - a_spread) A_0 + a_spread R_i, where A_0 and each R_i have eigenvalues drawn uniformly in [mu, L]
    (random orthogonal eigenvectors), so every A_i is L-smooth and mu-strongly convex and ``a_spread`` = 0 makes
    them equal; b_i = b_spread * z_i with z_i ~ N(0, I_d). ``weights``: ``equal`` (p_i = 1/N) or ``random``
    (p_i proportional to U(0.5, 1.5)).

    Raises:
        ValueError: num_clients or dim below 1, not 0 < mu <= L, a_spread outside [0, 1], b_spread < 0, or an unknown
            ``weights``.
    """
    if num_clients < 1 or dim < 1 or not 0 < mu <= L or not 0 <= a_spread <= 1 or b_spread < 0:
        raise ValueError(f"random_problem: need num_clients, dim >= 1, 0 < mu <= L, 0 <= a_spread <= 1, "
                         f"b_spread >= 0; got {num_clients}, {dim}, mu={mu}, L={L}, a_spread={a_spread}, "
                         f"b_spread={b_spread}")
    rng = np.random.default_rng(seed)

    def spd() -> np.ndarray:
        q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
        return (q * rng.uniform(mu, L, dim)) @ q.T

    a0 = spd()
    A = np.stack([(1 - a_spread) * a0 + a_spread * spd() for _ in range(num_clients)])
    A = 0.5 * (A + np.swapaxes(A, 1, 2))
    b = b_spread * rng.standard_normal((num_clients, dim))
    if weights == "equal":
        p = np.full(num_clients, 1.0 / num_clients)
    elif weights == "random":
        p = rng.uniform(0.5, 1.5, num_clients)
        p /= p.sum()
    else:
        raise ValueError(f"random_problem: weights must be equal or random, got {weights!r}")
    return Quadratic(A, b, p)
