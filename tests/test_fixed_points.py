"""Every rule against the point theory says it reaches, on federated quadratics (dataset=quadratic; docs/algorithms.md,
Fixed points on quadratic problems).

The engine trains the rules on f_i(x) = 1/2 (x - b_i)^T A_i (x - b_i), written as least squares over each device's
samples (fl_core/data/quadratic.py), with full participation and full-batch local steps (train.batch_size >= the
device's samples, train.local_steps = K), in float64. The expected points are computed independently in numpy
(fl_core/theory/quadratic.py) from the problem the stored samples define:

- FedAvg, and FedNova with equal K_i: the local-GD fixed point x_K (Charles & Konecny 2021; FedNova, Wang et al.
  2020, Sec. 3), away from x* by a bias that grows with eta_l K and vanishes at K = 1;
- FedProx: the same with the proximal term, closer to x* as mu grows (Li et al. 2020);
- the server optimisers over FedAvg (FedAvgM, FedAdam, FedYogi, FedAdagrad): the same x_K (they move the server
  along the mean update, which is zero there);
- SCAFFOLD (Karimireddy et al. 2020, Sec. 4), FedDyn (Acar et al. 2021, Sec. 3) and FedDC (Gao et al. 2022): x*
  exactly with full participation.

The slow set (``make test-slow``) adds the vectorised executor, FedAvg's bias against K, the server optimisers, FedDC
and FedDyn at its default alpha. The FedAvg test also checks the run's own ``opt_distance`` (||x - x*|| of the model, logged every round) against numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_core.config import compose
from fl_core.data import load_source, make_partition
from fl_core.data.quadratic import problem_of, quadratic_dataset, rows_of
from fl_core.engine.factory import build_simulator
from fl_core.theory import quadratic as th

from conftest import ROOT

ETA, K = 0.5, 5
BASE = ["dataset=quadratic", "partition=natural", "dataset.num_devices=5", "dataset.dim=4",
        "dataset.strong_convexity=0.2", "train.participation=1",
        f"train.local_steps={K}", "train.batch_size=64", f"train.lr={ETA}", "train.weight_decay=0",
        "engine.dtype=float64", "engine.progress=false", "engine.checkpoint_every=0", "tracking.enabled=false"]


def run(*overrides: str, rounds: int = 80):
    """(final model [m] as numpy, the problem, the run's history) of a quadratic run with ``overrides``."""
    cfg = compose([*BASE, f"train.rounds={rounds}", f"train.eval_every={rounds}", *overrides])
    ds = load_source(cfg.dataset, ROOT / "data" / "raw")
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes, devices=ds.devices.numpy())
    torch.manual_seed(0)
    res = build_simulator(cfg, ds, part).run()
    return res.final_flat.double().numpy(), problem_of(ds.x_train, ds.devices), res.history


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_samples_define_the_drawn_problem():
    """The least-squares rows give back A_i, b_i of random_problem (to float32 storage), p_i = 1/K."""
    cfg = compose(["dataset=quadratic", "dataset.num_devices=3", "dataset.dim=4", "dataset.seed=7"]).dataset
    drawn = th.random_problem(3, 4, L=1.0, mu=0.1, a_spread=1.0, b_spread=1.0, seed=7)
    rows = rows_of(drawn)
    m = rows[0, :, :4]
    assert np.allclose(m.T @ m / 4, drawn.A[0], atol=1e-12)  # (1/m) M^T M = A
    ds = quadratic_dataset(cfg)
    assert ds.x_train.shape == (12, 1, 1, 5) and ds.devices.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    back = problem_of(ds.x_train, ds.devices)
    assert np.allclose(back.A, drawn.A, rtol=1e-5, atol=1e-6) and np.allclose(back.b, drawn.b, rtol=1e-4, atol=1e-5)
    assert back.p.tolist() == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("executor", ["sequential", pytest.param("vectorized", marks=pytest.mark.slow)])
def test_fedavg_reaches_its_local_gd_fixed_point_not_the_optimum(executor):
    x, prob, hist = run("algorithm=fedavg", f"engine.executor={executor}")
    fixed = th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, K)
    star = th.minimizer(prob.A, prob.b, prob.p)
    assert rel(x, fixed) < 1e-12
    assert rel(fixed, star) > 1e-2  # the bias is there to see
    assert hist[-1]["opt_distance"] == pytest.approx(float(np.linalg.norm(x - star)), rel=1e-9)


@pytest.mark.slow
def test_fedavg_bias_grows_with_local_steps_and_vanishes_at_one():
    """||x_K - x*|| from the engine's runs: 0 at K = 1 (FedAvg is gradient descent on F) and increasing in K."""
    dist = []
    for k in (1, 2, 5, 10):
        x, prob, _ = run("algorithm=fedavg", f"train.local_steps={k}", rounds=80 if k > 1 else 300)
        star = th.minimizer(prob.A, prob.b, prob.p)
        assert rel(x, th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, k)) < 1e-10
        dist.append(rel(x, star))
    assert dist[0] < 1e-12
    assert dist[1] < dist[2] < dist[3]


def test_equal_curvatures_have_no_bias():
    """a_spread = 0 (every A_i equal): local GD's fixed point is x* whatever K (the bias needs unequal A_i)."""
    x, prob, _ = run("algorithm=fedavg", "dataset.a_spread=0")
    assert rel(x, th.minimizer(prob.A, prob.b, prob.p)) < 1e-10


@pytest.mark.parametrize("mu", [pytest.param(0.1, marks=pytest.mark.slow), 1.0])
def test_fedprox_reaches_the_proximal_fixed_point(mu):
    x, prob, _ = run("algorithm=fedprox", f"algorithm.fedprox.mu={mu}")
    assert rel(x, th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, K, mu=mu)) < 1e-12
    fedavg = th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, K)
    star = th.minimizer(prob.A, prob.b, prob.p)
    assert rel(x, star) < rel(fedavg, star)  # the proximal term pulls the fixed point toward x*


def test_fednova_with_equal_steps_is_fedavg():
    x, prob, _ = run("algorithm=fednova")
    assert rel(x, th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, K)) < 1e-12
    assert rel(x, th.fednova_fixed_point(prob.A, prob.b, prob.p, ETA, K)) < 1e-12


@pytest.mark.parametrize("stack", [pytest.param(["algorithm=fedavgm"], marks=pytest.mark.slow),
                                   pytest.param(["algorithm=fedadam"], marks=pytest.mark.slow),
                                   pytest.param(["algorithm=fedyogi"], marks=pytest.mark.slow),
                                   pytest.param(["algorithm=fedadagrad"], marks=pytest.mark.slow)],
                         ids=lambda s: s[0].split("=")[1])
def test_server_optimisers_keep_fedavgs_fixed_point(stack):
    """They approach x_K more slowly (momentum, adaptive steps): after 200 rounds within a thousandth of the bias
    ||x_K - x*||, so at x_K and not at x*."""
    x, prob, _ = run(*stack, rounds=200)
    fixed = th.local_gd_fixed_point(prob.A, prob.b, prob.p, ETA, K)
    assert rel(x, fixed) < 1e-3 * rel(fixed, th.minimizer(prob.A, prob.b, prob.p))


@pytest.mark.parametrize("stack", [["algorithm=scaffold"], pytest.param(["algorithm=feddc"], marks=pytest.mark.slow),
                                   ["algorithm=feddyn", "algorithm.feddyn.alpha=1.0"]],
                         ids=lambda s: s[0].split("=")[1])
@pytest.mark.parametrize("executor", ["sequential", pytest.param("vectorized", marks=pytest.mark.slow)])
def test_drift_corrections_reach_the_optimum(stack, executor):
    x, prob, hist = run(*stack, f"engine.executor={executor}")
    star = th.minimizer(prob.A, prob.b, prob.p)
    assert rel(x, star) < 1e-12
    assert hist[-1]["objective_gap"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.slow
def test_feddyn_reaches_the_optimum_at_its_default_alpha_only_slowly():
    """alpha = 0.01 (the default) corrects the drift at rate alpha: still more than 1e-3 off x* after 300 rounds,
    under 1e-6 after 3000 (alpha = 1 is there within 80)."""
    x, prob, _ = run("algorithm=feddyn", rounds=300)
    star = th.minimizer(prob.A, prob.b, prob.p)
    early = rel(x, star)
    x, _, _ = run("algorithm=feddyn", rounds=3000)
    assert 1e-3 < early and rel(x, star) < 1e-6


@pytest.mark.parametrize("overrides,message", [
    (["dataset.strong_convexity=2"], "dataset.strong_convexity must be in (0, dataset.smoothness], got 2 and L = 1"),
    (["dataset.a_spread=1.5"], "dataset.a_spread must be <= 1, got 1.5"),
    (["dataset.dim=0"], "dataset.dim must be >= 1, got 0"),
    (["dataset.b_spread=-1"], "dataset.b_spread must be >= 0, got -1"),
])
def test_bad_problem_keys_are_refused_in_one_line(overrides, message):
    from fl_core.schema import ConfigError

    with pytest.raises((ConfigError, ValueError)) as err:
        cfg = compose(["dataset=quadratic", *overrides])
        quadratic_dataset(cfg.dataset)
    assert str(err.value) == message


def test_the_quadratic_model_is_exact_least_squares():
    """The logits' cross-entropy for label 0 is r^2 / 2 + log 2 (and its gradient r), also far from 0 in float32."""
    import math

    import torch.nn.functional as F

    from fl_core.models.quadratic import residual_logits

    r = torch.tensor([-40.0, -3.0, 0.0, 1e-4, 2.5, 40.0], dtype=torch.float64, requires_grad=True)
    loss = F.cross_entropy(residual_logits(r), torch.zeros(6, dtype=torch.long), reduction="none")
    assert loss.tolist() == pytest.approx((0.5 * r.detach() ** 2 + math.log(2)).tolist(), rel=1e-12)
    loss.sum().backward()
    assert r.grad.tolist() == pytest.approx(r.detach().tolist(), rel=1e-9, abs=1e-12)
    r32 = torch.tensor([-40.0, 0.0, 40.0])
    assert torch.isfinite(F.cross_entropy(residual_logits(r32), torch.zeros(3, dtype=torch.long))).all()


def test_the_problem_keys_change_a_quadratic_run_and_no_other():
    """dataset.dim & co. are in a quadratic run's fingerprint; the other datasets' fingerprints do not see them."""
    from fl_core.experiment import fingerprint

    assert fingerprint(compose(["dataset=quadratic"])) != fingerprint(compose(["dataset=quadratic", "dataset.dim=5"]))
    assert fingerprint(compose(["dataset=quadratic"])) != fingerprint(
        compose(["dataset=quadratic", "dataset.b_spread=2"]))
    assert fingerprint(compose([])) == "92770554bbff"  # the default grid's, as pinned (tests/test_experiment.py)
