"""fl_core/theory/quadratic.py: the closed-form fixed points equal the limits of the rules' rounds, iterated here in
numpy step by step, and have the properties the theory states (module docstring): K = 1 or equal A_i give x*,
mu = 0 gives FedAvg, many local steps give the proximal equation, FedAvg's bias grows with eta_l K, and for small
eta_l unequal K_i tilt FedAvg towards sum p_i K_i f_i but not FedNova."""

from __future__ import annotations

import numpy as np
import pytest

from fl_core.theory import quadratic as q


def rounds(prob: q.Quadratic, eta_l: float, K, num_rounds: int, mu: float = 0.0, nova: bool = False,
           eta_g: float = 1.0) -> np.ndarray:
    """The rule's rounds from x = 0 with full participation and full-batch local gradient steps."""
    k = np.broadcast_to(np.asarray(K), (prob.num_clients,))
    x = np.zeros(prob.dim)
    for _ in range(num_rounds):
        ys = []
        for i in range(prob.num_clients):
            y = x.copy()
            for _ in range(int(k[i])):
                y = y - eta_l * (prob.A[i] @ (y - prob.b[i]) + mu * (y - x))
            ys.append(y)
        if nova:  # FedNova: normalised directions (x - y_i) / K_i, scaled by tau_eff = sum p_i K_i
            direction = sum(p * (x - y) / ki for p, y, ki in zip(prob.p, ys, k))
            x = x - eta_g * float(np.dot(prob.p, k)) * direction
        else:
            x = x + eta_g * (sum(p * y for p, y in zip(prob.p, ys)) - x)
    return x


def test_a_two_client_case_by_hand():
    # f_1 = 1/2 x^2, f_2 = (x - 1)^2, equal weights, eta_l = 0.1, K = 2: w_i = 1 - (1 - 0.1 a_i)^2 = 0.19, 0.36
    A, b, p = [[[1.0]], [[2.0]]], [[0.0], [1.0]], [0.5, 0.5]
    assert q.local_gd_fixed_point(A, b, p, 0.1, 2)[0] == pytest.approx(0.36 / 0.55, abs=1e-14)
    assert q.minimizer(A, b, p)[0] == pytest.approx(2.0 / 3.0, abs=1e-14)
    assert q.fednova_fixed_point(A, b, p, 0.1, 2)[0] == pytest.approx(0.36 / 0.55, abs=1e-14)  # equal K_i


@pytest.mark.parametrize("rule", ["fedavg", "fedavg_unequal_K", "fedprox", "fedprox_unequal_K", "fednova"])
def test_each_closed_form_is_the_limit_of_the_rounds(rule):
    prob = q.random_problem(5, 4, L=1.0, mu=0.2, seed=3, weights="random")
    eta, K, mu = 0.3, ([1, 3, 7, 2, 5] if "unequal" in rule or rule == "fednova" else 4), 0.0
    if rule.startswith("fedprox"):
        mu = 0.5
        eta = 0.2  # eta (L + mu) < 2: the local steps contract
    if rule == "fednova":
        expected = q.fednova_fixed_point(prob.A, prob.b, prob.p, eta, K)
        got = rounds(prob, eta, K, 4000, nova=True, eta_g=0.2)
    else:
        expected = q.local_gd_fixed_point(prob.A, prob.b, prob.p, eta, K, mu=mu)
        got = rounds(prob, eta, K, 4000, mu=mu, eta_g=0.7)
    assert np.linalg.norm(got - expected) <= 1e-10 * max(1.0, np.linalg.norm(expected))
    assert np.linalg.norm(expected - q.minimizer(prob.A, prob.b, prob.p)) > 1e-3  # a biased point, not x*


def test_one_local_step_or_equal_curvatures_reach_the_minimizer():
    prob = q.random_problem(6, 3, seed=1, weights="random")
    xstar = q.minimizer(prob.A, prob.b, prob.p)
    np.testing.assert_allclose(q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.5, 1), xstar, atol=1e-12)
    same = q.random_problem(6, 3, seed=1, a_spread=0.0, weights="random")
    xstar = q.minimizer(same.A, same.b, same.p)
    for K in (2, 10, 50):
        np.testing.assert_allclose(q.local_gd_fixed_point(same.A, same.b, same.p, 0.5, K), xstar, atol=1e-12)


def test_fedprox_spans_fedavg_and_the_proximal_equation():
    prob = q.random_problem(4, 3, seed=2)
    fedavg = q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.2, 8)
    np.testing.assert_allclose(q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.2, 8, mu=0.0), fedavg, atol=0)
    exact = q.proximal_fixed_point(prob.A, prob.b, prob.p, 0.3)
    np.testing.assert_allclose(q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.2, 3000, mu=0.3), exact, atol=1e-12)
    # a larger mu keeps the clients nearer the server: the proximal point is nearer x* than FedAvg's with long local work
    xstar = q.minimizer(prob.A, prob.b, prob.p)
    long_fedavg = q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.2, 3000)
    assert np.linalg.norm(exact - xstar) < np.linalg.norm(long_fedavg - xstar)


def test_fedavg_bias_grows_with_eta_K():
    # one dimension, two clients: the fixed point weighs b_i by 1 - (1 - eta a_i)^K, which moves monotonically from
    # x* (weights ~ a_i) towards the plain mean of the b_i (weights -> 1) as eta K grows
    A, b, p = [[[0.2]], [[1.0]]], [[-1.0], [2.0]], [0.5, 0.5]
    xstar = q.minimizer(A, b, p)
    bias = [abs(q.local_gd_fixed_point(A, b, p, 0.05, K)[0] - xstar[0]) for K in (1, 2, 4, 8, 16, 32, 64)]
    assert bias[0] == pytest.approx(0.0, abs=1e-14)
    assert all(later > earlier for earlier, later in zip(bias, bias[1:]))
    assert bias[-1] < abs(np.mean(b) - xstar[0])  # bounded by the plain mean's distance


def test_unequal_steps_tilt_fedavg_but_not_fednova_for_small_eta():
    prob = q.random_problem(4, 3, seed=5)
    K = np.array([1, 2, 5, 20])
    eta = 1e-5
    xstar = q.minimizer(prob.A, prob.b, prob.p)
    surrogate = q.minimizer(prob.A, prob.b, prob.p * K / np.dot(prob.p, K))  # argmin sum_i p_i K_i f_i
    fedavg = q.local_gd_fixed_point(prob.A, prob.b, prob.p, eta, K)
    fednova = q.fednova_fixed_point(prob.A, prob.b, prob.p, eta, K)
    gap = np.linalg.norm(surrogate - xstar)
    assert gap > 0.1
    assert np.linalg.norm(fedavg - surrogate) < 1e-3 * gap
    assert np.linalg.norm(fednova - xstar) < 1e-3 * gap


def test_random_problem_has_the_stated_spectrum_and_bad_input_is_refused():
    prob = q.random_problem(3, 5, L=2.0, mu=0.5, seed=0)
    eig = np.linalg.eigvalsh(prob.A)
    assert eig.min() >= 0.5 - 1e-12 and eig.max() <= 2.0 + 1e-12
    assert prob.objective(q.minimizer(prob.A, prob.b, prob.p)) <= prob.objective(np.zeros(5))
    with pytest.raises(ValueError, match="sum"):
        q.minimizer(prob.A, prob.b, [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"A must be \[N, d, d\]"):
        q.minimizer(prob.b, prob.b, prob.p)
    with pytest.raises(ValueError, match="K_i must be >= 1"):
        q.local_gd_fixed_point(prob.A, prob.b, prob.p, 0.1, 0)
    with pytest.raises(ValueError, match="a_spread"):
        q.random_problem(3, 2, a_spread=1.5)
