"""model=logreg_binary, FedBCGD's convex problem (docs/algorithms.md, FedBCGD's convex problem; paper sec. 5.3, 12.5):
the engine's cross-entropy is the binary logistic loss, lambda comes from the data's smoothness constant, the local
steps minimise f exactly (penalty included, both executors), the reference optimum is a minimiser, and every round
logs f(x_r), f(x_r) - f* and ||x_r - x*||."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fl_core.config import ConfigError, ModelConfig, compose
from fl_core.models import build_model
from fl_core.models import logreg_binary as lb
from fl_core.models.logreg_binary import (BinaryLogisticRegression, LogisticObjective, binary_label_map, block_sizes,
                                          regulariser, regulariser_grad)

from conftest import ROOT, run_sim

LOGREG = ["model=logreg_binary"]


@pytest.fixture(autouse=True)
def _fresh_memo():
    """Each test solves its own problems (the per-process memo of L and x* is emptied before and after)."""
    lb._SMOOTHNESS.clear()
    lb._OPTIMA.clear()
    yield
    lb._SMOOTHNESS.clear()
    lb._OPTIMA.clear()


def _bound_model(digits, binary_map="first_class", lambda_factor=1e-4, nonconvex=False, dtype=torch.float64):
    """A logreg_binary model bound to every digits training sample (index 0..M-1), and its objective."""
    m = BinaryLogisticRegression(digits.input_shape, digits.num_classes, binary_map, lambda_factor, nonconvex)
    m = m.to(dtype)
    x = digits.normalize(digits.x_train).to(dtype)
    y = m.label_map[digits.y_train]
    m.bind_training_data(x, y, torch.arange(len(y)))
    return m, x, y


# --------------------------------------------------------------------------- the loss and the map


def test_cross_entropy_of_the_two_logits_is_the_binary_logistic_loss():
    torch.manual_seed(0)
    m = BinaryLogisticRegression((1, 2, 3), 4).double()
    with torch.no_grad():
        for p in m.x:
            p.normal_()
    a = torch.randn(64, 1, 2, 3, dtype=torch.float64) * 3
    t = torch.randint(0, 2, (64,))
    logits, feats = m.forward_features(a)
    z = a.flatten(1) @ torch.cat(list(m.x)).detach()
    b = 2.0 * t.double() - 1.0  # label 1 -> b = +1, label 0 -> b = -1
    by_formula = torch.log(1 + torch.exp(-b * z))
    assert torch.allclose(F.cross_entropy(logits, t, reduction="none"), by_formula, rtol=1e-12, atol=1e-14)
    assert torch.equal(logits[:, 0], torch.zeros(64, dtype=torch.float64)) and torch.equal(feats, a.flatten(1))
    assert torch.allclose(lb.logistic_loss(z, b), by_formula, rtol=1e-12, atol=1e-14)
    # far from 0 the stable form keeps its precision: log(1 + e^-40) = e^-40, log(1 + e^40) = 40 + e^-40
    big = torch.tensor([40.0, -40.0], dtype=torch.float64)
    assert torch.allclose(lb.logistic_loss(big, torch.ones(2, dtype=torch.float64)),
                          torch.tensor([math.exp(-40), 40 + math.exp(-40)], dtype=torch.float64), rtol=1e-14)


@pytest.mark.parametrize("kind,classes,positive", [
    ("first_class", 10, [0]), ("parity", 10, [0, 2, 4, 6, 8]), ("lt_half", 10, [0, 1, 2, 3, 4]),
    ("lt_half", 5, [0, 1, 2]), ("digits_letters", 62, list(range(10))), ("parity", 3, [0, 2]),
])
def test_binary_maps(kind, classes, positive):
    m = binary_label_map(kind, classes)
    assert m.dtype == torch.int64 and m.tolist() == [int(c in positive) for c in range(classes)]


def test_block_sizes_are_five_contiguous_chunks_and_one_unit():
    assert block_sizes(64) == (13, 13, 13, 13, 12) and block_sizes(784) == (157, 157, 157, 157, 156)
    m = build_model(ModelConfig(name="logreg_binary"), "digits", (1, 8, 8), 10)
    assert [n for n, _ in m.named_parameters()] == [f"x.{j}" for j in range(5)]
    assert m.units() == [[f"x.{j}" for j in range(5)]]
    assert all(float(p.detach().abs().sum()) == 0 for p in m.parameters())  # x_0 = 0


# --------------------------------------------------------------------------- L, lambda and the regularisers


def test_smoothness_constant_of_a_tiny_matrix_by_hand():
    # A = [[1, 0], [0, 2], [1, 1]]: A^T A = [[2, 1], [1, 5]], lambda_max = (7 + sqrt(13)) / 2, n = 3
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]).view(3, 1, 1, 2)
    y = torch.tensor([1, 0, 1])
    want = (7 + math.sqrt(13)) / 2 / (4 * 3)
    assert LogisticObjective(a, y, torch.arange(3)).smoothness() == pytest.approx(want, rel=1e-12)
    # a row held twice counts twice: [1, 1] twice -> A^T A = [[3, 2], [2, 6]], lambda_max = (9 + sqrt(9 + 16)) / 2
    # = 7, n = 4
    twice = LogisticObjective(a, y, torch.tensor([0, 1, 2, 2]), chunk=1).smoothness()
    assert twice == pytest.approx(7 / 16, rel=1e-12)
    m = BinaryLogisticRegression((1, 1, 2), 2, lambda_factor=0.01)
    m.bind_training_data(a, y, torch.arange(3))
    assert m.lam == pytest.approx(0.01 * want, rel=1e-12) and m.problem_params() == {"L": m.smoothness_L,
                                                                                     "lambda": m.lam}


def test_the_regularisers_and_their_gradients_by_hand():
    w = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64, requires_grad=True)
    # nonconvex: lambda * sum w^2 / (1 + w^2) = 0.5 * (0 + 1/2 + 4/5); gradient 2 lambda w / (1 + w^2)^2
    r = regulariser(w, 0.5, nonconvex=True)
    assert float(r.detach()) == pytest.approx(0.5 * (0.5 + 0.8), rel=1e-14)
    (g,) = torch.autograd.grad(r, w)
    assert torch.allclose(g, torch.tensor([0.0, 0.25, -2.0 / 25], dtype=torch.float64), rtol=1e-14)
    assert torch.allclose(regulariser_grad(w.detach(), 0.5, True), g, rtol=1e-14)
    # convex: lambda/2 ||w||^2 = 0.25 * 5; gradient lambda w
    r = regulariser(w, 0.5, nonconvex=False)
    assert float(r.detach()) == pytest.approx(1.25, rel=1e-14)
    (g,) = torch.autograd.grad(r, w)
    assert torch.allclose(g, 0.5 * w.detach()) and torch.allclose(regulariser_grad(w.detach(), 0.5, False), g)
    # the model's penalty is the regulariser of its coordinates, whatever else params holds
    m = BinaryLogisticRegression((1, 1, 3), 2, nonconvex=True).double()
    m.lam = 0.5
    params = {"x.0": w[:1], "x.1": w[1:2], "x.2": w[2:], "x.3": w[3:], "x.4": w[3:], "head.weight": torch.ones(2)}
    assert float(m.penalty(params).detach()) == pytest.approx(0.65, rel=1e-14)


@pytest.mark.parametrize("nonconvex", [False, True])
def test_the_analytic_gradient_is_the_autograd_gradient_of_f(digits, nonconvex):
    m, x, y = _bound_model(digits, nonconvex=nonconvex)
    obj = m.objective
    w = torch.randn(obj.d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    f, g = obj.value_and_grad(w)
    wr = w.clone().requires_grad_(True)
    b = 2.0 * y.double() - 1.0
    by_formula = torch.log1p(torch.exp(-b * (x.flatten(1) @ wr))).mean() + regulariser(wr, m.lam, nonconvex)
    (g_auto,) = torch.autograd.grad(by_formula, wr)
    assert f == pytest.approx(float(by_formula.detach()), rel=1e-12) and f == pytest.approx(obj.value(w), rel=1e-14)
    assert torch.allclose(g, g_auto, rtol=1e-10, atol=1e-14)


# --------------------------------------------------------------------------- the reference optimum


@pytest.mark.parametrize("nonconvex", [False, True])
def test_the_lbfgs_optimum_is_stationary_and_beats_every_point_checked(digits, nonconvex):
    m, _, _ = _bound_model(digits, nonconvex=nonconvex)
    obj, opt = m.objective, m.optimum()
    x_star, f_star = opt["x_star"], opt["f_star"]
    _, g = obj.value_and_grad(x_star)
    assert float(g.abs().max()) <= lb.LBFGS_GTOL and opt["grad_norm"] == pytest.approx(float(g.norm()))
    assert f_star == pytest.approx(obj.value(x_star), rel=1e-15)
    gen = torch.Generator().manual_seed(0)
    others = [torch.zeros_like(x_star)] + [x_star + s * torch.randn(x_star.shape, dtype=torch.float64, generator=gen)
                                          for s in (1e-4, 1e-2, 1.0) for _ in range(5)]
    assert all(obj.value(w) > f_star for w in others)
    assert obj.value(torch.zeros_like(x_star)) == pytest.approx(math.log(2), rel=1e-14)  # f(0) = log 2
    if not nonconvex:  # strongly convex: f(w) - f* >= (lambda/2) ||w - x*||^2
        assert all(obj.value(w) - f_star >= 0.5 * m.lam * float((w - x_star).norm()) ** 2 * (1 - 1e-9)
                   for w in others)


def test_the_optimum_is_cached_by_data_map_and_lambda(digits, tmp_path, monkeypatch):
    x = digits.normalize(digits.x_train).double()

    def bound(binary_map="first_class", factor=1e-4):
        m = BinaryLogisticRegression(digits.input_shape, 10, binary_map, factor).double()
        m.bind_training_data(x, m.label_map[digits.y_train], torch.arange(len(x)), tmp_path)
        return m

    first = bound().optimum()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("logreg_binary-")
    lb._SMOOTHNESS.clear()
    lb._OPTIMA.clear()  # a new process: read from the file, never solved again
    monkeypatch.setattr(LogisticObjective, "minimise", lambda self: pytest.fail("solved again"))
    monkeypatch.setattr(LogisticObjective, "smoothness", lambda self: pytest.fail("L computed again"))
    again = bound()
    assert again.smoothness_L == first["L"] and torch.equal(again.optimum()["x_star"], first["x_star"])
    monkeypatch.undo()
    bound("parity").optimum()  # another map, another lambda: other problems, other files
    bound(factor=1e-3).optimum()
    assert len(list(tmp_path.iterdir())) == 3


# --------------------------------------------------------------------------- training


def test_a_run_logs_the_objective_its_gap_and_the_distance_every_round(digits):
    sim, res = run_sim(digits, *LOGREG, "partition=dirichlet", "partition.alpha=0.1", "train.rounds=4")
    m = sim.model
    opt = m.optimum()
    for row in res.history:
        assert {"objective", "objective_gap", "opt_distance"} <= set(row)
        assert row["objective_gap"] > 0 and row["opt_distance"] > 0
        assert row["objective"] - row["objective_gap"] == pytest.approx(opt["f_star"], abs=1e-12)
    last = res.history[-1]
    w = m.coordinates(sim.spec.views(res.final_flat)).double()
    assert last["objective"] == pytest.approx(m.objective.value(w), rel=1e-12)
    assert last["opt_distance"] == pytest.approx(float((w - opt["x_star"]).norm()), rel=1e-9)
    assert res.history[-1]["objective"] < math.log(2)  # below f(x_0 = 0)
    # the clients and the test set see the map's labels; the partition stays over the 10 digits
    data = sim.executor.data
    assert torch.equal(data.y, m.label_map[digits.y_train]) and data.num_classes == 2
    assert torch.equal(sim.y_test, m.label_map[digits.y_test])


def test_local_steps_are_gradient_steps_on_f_with_the_penalty(digits):
    """One client holding every sample, full batches, 3 steps: exactly gradient descent on f (the cross-entropy
    of the two logits plus the model's penalty) in float64, with each executor."""
    common = [*LOGREG, "model.lambda_factor=0.5", "model.nonconvex=true", "partition.num_clients=1",
              "train.participation=1.0", "train.local_steps=3", "train.batch_size=4096", "train.lr=0.3",
              "train.rounds=2", "engine.dtype=float64"]
    for executor in ("sequential", "vectorized"):
        sim, res = run_sim(digits, *common, f"engine.executor={executor}")
        obj = sim.model.objective
        assert sim.model.lam > 1.0  # the penalty is large: a run without it would end elsewhere
        w = torch.zeros(obj.d, dtype=torch.float64)
        for _ in range(2 * 3):  # 2 rounds of 3 steps
            w = w - 0.3 * obj.value_and_grad(w)[1]
        assert torch.allclose(sim.model.coordinates(sim.spec.views(res.final_flat)), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stack", [
    ["algorithm=fedavg"], ["algorithm=fedbcgd"], ["algorithm=fedbcgd_plus"],
    ["algorithm=fedbcgd_plus", "algorithm.fedbcgd.plus_variant=code"], ["algorithm=scaffold"],
])
@pytest.mark.parametrize("nonconvex", ["false", "true"])
def test_sequential_and_vectorized_executors_agree_with_the_penalty(digits, stack, nonconvex):
    setting = [*LOGREG, f"model.nonconvex={nonconvex}", "model.lambda_factor=0.1", *stack, "partition=dirichlet",
               "partition.alpha=0.1", "partition.num_clients=10", "train.participation=0.5", "train.sampler=fixed",
               "train.rounds=3", "engine.dtype=float64"]
    seq, a = run_sim(digits, *setting, "engine.executor=sequential")
    vec, b = run_sim(digits, *setting, "engine.executor=vectorized")
    assert torch.allclose(a.final_flat, b.final_flat, rtol=0, atol=1e-12)
    for ra, rb in zip(a.history, b.history):
        assert ra["objective_gap"] == pytest.approx(rb["objective_gap"], rel=1e-9)


def test_fedbcgd_uploads_one_of_five_coordinate_blocks(digits):
    sim, res = run_sim(digits, *LOGREG, "algorithm=fedbcgd", "partition.num_clients=10", "train.participation=0.5",
                       "train.sampler=fixed", "train.rounds=2")
    assert sim.algo.block_params == [[0], [1], [2], [3], [4]] and sim.algo.shared_params == []
    assert res.history[-1]["comm_up_floats"] == pytest.approx(2 * 64 / 5)  # 5 clients: one per block
    assert sim.algo.comm_floats(64) == (64 / 5, 64.0)


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("overrides,message", [
    ([*LOGREG, "model.binary_map=odd"],
     "model.binary_map must be one of first_class, parity, lt_half, digits_letters, got 'odd'"),
    ([*LOGREG, "model.lambda_factor=0"], "model.lambda_factor must be > 0, got 0"),
    ([*LOGREG, "model.lambda_factor=-1e-4"], "model.lambda_factor must be > 0, got -0.0001"),
    ([*LOGREG, "model.lambda_factor=inf"], "model.lambda_factor must be a finite number, got inf"),
    (["model=mlp", "model.lambda_factor=0.1"],
     "model.lambda_factor has no effect with model.name=mlp: it is used only with model.name=logreg_binary; remove it"),
    (["model.nonconvex=true"],
     "model.nonconvex has no effect with model.name=auto: it is used only with model.name=logreg_binary; remove it"),
])
def test_bad_model_keys_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value) == message


def test_a_map_the_dataset_cannot_take_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^model.binary_map=digits_letters needs a dataset whose classes 0-9 are "
                                          r"digits and the rest letters \(EMNIST\), got 10 classes"):
        build_model(compose([*LOGREG, "model.binary_map=digits_letters"]).model, "digits", (1, 8, 8), 10)
    with pytest.raises(ConfigError, match=r"^model.lambda_factor must be a finite number > 0, got nan"):
        BinaryLogisticRegression((1, 8, 8), 10, lambda_factor=float("nan"))


def _cli(args, cwd):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=cwd, env=env, capture_output=True,
                          check=False, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["model.binary_map=odd"],
     "error: model.binary_map must be one of first_class, parity, lt_half, digits_letters, got 'odd'"),
    (["model.lambda_factor=0"], "error: model.lambda_factor must be > 0, got 0"),
    (["model.binary_map=digits_letters"],
     "error: model.binary_map=digits_letters needs a dataset whose classes 0-9 are digits and the rest letters "
     "(EMNIST), got 10 classes (use first_class, parity or lt_half)"),
])
def test_the_cli_exits_2_with_one_line_and_writes_nothing(tmp_path, args, message):
    proc = _cli([*LOGREG, *args], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a CLI run with MLflow (~17 s on 2 cores)
def test_the_cli_writes_the_objective_columns_params_and_the_cached_optimum(tmp_path):
    proc = _cli([*LOGREG, "algorithm=fedbcgd", "train.rounds=2", "partition.num_clients=10", "seed=1", "name=convex",
                 "engine.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results" / "convex"
    header = (out / "runs.csv").read_text().splitlines()[0].split(",")
    assert {"objective", "objective_gap", "opt_distance"} <= set(header)
    assert {"objective", "objective_gap", "opt_distance"} <= set((out / "rounds.csv").read_text().splitlines()[0]
                                                                 .split(","))
    cached = list((tmp_path / "data" / "objectives").glob("logreg_binary-*.pt"))
    assert len(cached) == 1
    blob = torch.load(cached[0], weights_only=True)
    assert json.loads((out / "metrics.json").read_text())["seeds"] == [1]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fl-pipeline")
    child = next(r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags)
    assert float(child.data.params["model.L"]) == pytest.approx(blob["L"])
    assert float(child.data.params["model.lambda"]) == pytest.approx(1e-4 * blob["L"])
    gaps = client.get_metric_history(child.info.run_id, "diag/objective_gap")
    assert [m.step for m in gaps] == [1, 2] and all(m.value > 0 for m in gaps)


# --------------------------------------------------------------------------- the preset and the study grid


def test_the_preset_composes_and_runs_on_digits(digits):
    cfg = compose(["+experiment=fedbcgd_emnist_logreg"])
    assert (cfg.model.name, cfg.model.binary_map, cfg.model.lambda_factor, cfg.model.nonconvex) == \
        ("logreg_binary", "first_class", 1e-4, False)
    t = cfg.train
    assert (t.local_epochs, t.batch_size, t.participation, t.lr_decay, t.weight_decay) == (1, 50, 0.1, 0.998, 0.0)
    assert (cfg.partition.name, cfg.partition.alpha, cfg.partition.num_clients) == ("dirichlet", 0.1, 100)
    assert cfg.algorithm.name == "fedbcgd" and cfg.algorithm.fedbcgd.blocks == 5
    for rows in (["algorithm=fedavg"], ["algorithm=fedbcgd_plus"], ["model.nonconvex=true"]):
        cfg = compose(["+experiment=fedbcgd_emnist_logreg", *rows, "partition.samples_per_client=20",
                       "train.rounds=2", "engine.device=cpu", "engine.progress=false", "engine.checkpoint_every=0",
                       "tracking.enabled=false"])
        from fl_core.data import make_partition
        from fl_core.engine.factory import build_simulator

        part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
        res = build_simulator(cfg, digits, part).run()
        assert res.history[-1]["objective_gap"] > 0


def test_the_study_grid_composes():
    from pipeline.grid import load_grid

    path = ROOT / "studies" / "fedbcgd" / "params_convex.yaml"
    grid = load_grid(path)
    want = {f"convex_{a}_lr{lr}" for a in ("fedavg", "fedbcgd", "fedbcgd_plus") for lr in ("003", "01", "03")}
    assert set(grid.experiments) == want
    for name, own in grid.experiments.items():
        cfg = compose(grid.overrides(name, grid.seeds[0]), user=own)
        assert cfg.model.name == "logreg_binary" and cfg.partition.alpha == 0.1
        assert cfg.train.lr == float("0." + name.rsplit("_lr", 1)[1][1:]) and cfg.train.local_epochs == 1
    # the convex stages train every experiment of the grid and report on all of them
    import yaml

    stages = yaml.safe_load((ROOT / "studies" / "fedbcgd" / "dvc.yaml").read_text())["stages"]
    assert set(stages["convex_train"]["foreach"]) == want
    assert {f"results/{n}/runs.csv" for n in want} <= set(stages["convex_report"]["deps"])


# --------------------------------------------------------------------------- the convergence report


def _fake_results(tmp_path, gaps):
    """A params file and results of experiments {name: (algorithm, lr, {seed: [(uplink, gap) per round]})}; the
    algorithm a rule name or a Description, stored with its structure as the train stage stores it."""
    import yaml

    from fl_core.algorithms import registry

    exps = {name: {"algorithm": alg.split("[")[0], "train.lr": lr} for name, (alg, lr, _) in gaps.items()}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"seeds": [1, 2], "model": {"name": "logreg_binary"},
                                                          "experiments": exps}))
    for name, (alg, _, per_seed) in gaps.items():
        d = tmp_path / "results" / name
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({"seeds": sorted(per_seed)}))
        (d / "experiment.json").write_text(json.dumps({"algorithm": alg, "stack": registry.described(alg),
                                                       "model_d": 64}))
        lines = ["seed,round,comm_up_floats,objective_gap"]
        lines += [f"{s},{r + 1},{up},{g}" for s, rows in per_seed.items() for r, (up, g) in enumerate(rows)]
        (d / "runs.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "params.yaml", tmp_path / "results"


def test_the_convergence_report_picks_each_methods_best_setting_and_judges_the_claim(tmp_path, capsys):
    from fl_core.algorithms.base import Description
    from pipeline import convergence

    rows = lambda up, gaps: [(up * (r + 1), g) for r, g in enumerate(gaps)]  # noqa: E731
    params, results = _fake_results(tmp_path, {
        "a_slow": ("fedavg", 0.01, {1: rows(64, [0.5, 0.4, 0.3]), 2: rows(64, [0.5, 0.4, 0.35])}),
        "a_fast": ("fedavg", 0.1, {1: rows(64, [0.3, 0.1, 0.05]), 2: rows(64, [0.3, 0.12, 0.06])}),
        "b": (Description("fedbcgd_plus", [("", "paper"), ("N", 5), ("lambda", 0.8)]), 0.1,
              {1: rows(26, [0.4, 0.2, 0.1]), 2: rows(26, [0.4, 0.25, 0.08])}),
    })
    out = tmp_path / "out"
    assert convergence.main(["--params", str(params), "--results", str(results), "--out", str(out),
                             "--fastest", "FedBCGD+", "--claim", "B is fastest"]) == 0
    line = capsys.readouterr().out.strip()
    # last round: FedAvg (lr 0.1) 0.055 < FedBCGD+ 0.09; equal uplink 78 floats: FedAvg round 1 (0.3) > FedBCGD+
    # round 3 (0.09): lowest by one criterion of two
    assert line.startswith("verdict: B is fastest: mixed: lowest f(x_R) - f* at the last round FedAvg (0.055; "
                           "FedBCGD+ paper, N=5, lambda=0.8 0.09), at equal uplink (78 floats per client) FedBCGD+")
    res = json.loads((out / "convergence.json").read_text())
    assert res["chosen"] == {"FedAvg": "a_fast", "FedBCGD+ paper, N=5, lambda=0.8": "b"} and res["budget"] == 78
    assert (out / "objective_gap.png").exists() and (out / "objective_gap.pdf").exists()
    assert "a_fast *" in (out / "convergence.md").read_text() and line in (out / "convergence.md").read_text()
    assert convergence.main(["--params", str(params), "--results", str(results), "--out", str(out),
                             "--fastest", "FedAvg", "--claim", "A"]) == 0
    assert capsys.readouterr().out.startswith("verdict: A: mixed")
    (results / "b" / "runs.csv").write_text("seed,round,comm_up_floats\n1,1,26\n")
    assert convergence.main(["--params", str(params), "--results", str(results), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("error: experiments.b: runs.csv has no objective_gap column (the model "
                                               "logs none; use a model with a known optimum, e.g. "
                                               "model=logreg_binary)")
