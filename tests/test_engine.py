"""Round loop: resume after a kill, MLflow logging, non-finite losses, torchvision import."""

from __future__ import annotations


import pytest
import torch

from fl_core.engine.simulator import RunFailed
from fl_core.store.tracking import Tracking, mlflow_metric_name

from conftest import run_sim


class Killed(Exception):
    pass


def _kill_after(n):
    def cb(r, row):
        if r == n:
            raise Killed(f"killed after round {r}")
    return cb


def test_interrupted_then_resumed_run_ends_identical(digits, tmp_path):
    common = ["algorithm=fedbug", "algorithm.name=fedprox", "partition=dirichlet", "train.rounds=7",
              "engine.checkpoint_every=2", "train.lr_decay=0.95"]
    _, ref = run_sim(digits, *common)
    ckpt = tmp_path / "ck.pt"
    with pytest.raises(Killed):
        run_sim(digits, *common, checkpoint_path=ckpt, callbacks=[_kill_after(5)])
    assert ckpt.exists()  # last checkpoint: round 4
    assert torch.load(ckpt, weights_only=True)["round"] == 4
    sim, res = run_sim(digits, *common, checkpoint_path=ckpt)
    assert res.resumed_from == 4
    assert torch.equal(ref.final_flat, res.final_flat)
    assert [r["round"] for r in res.history] == list(range(1, 8))
    assert [r["test_acc"] for r in res.history] == [r["test_acc"] for r in ref.history]


def _metric_steps(tracking, run_id, key):
    """Steps of the per-round metric ``key`` (MLflow name: :func:`fl_core.store.tracking.mlflow_metric_name`)."""
    return [m.step for m in tracking.client.get_metric_history(run_id, mlflow_metric_name(key))]


def test_mlflow_run_has_one_test_acc_per_round_also_after_resume(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracking = Tracking("test-engine", root=tmp_path)
    R = 6
    common = [f"train.rounds={R}", "engine.checkpoint_every=2"]

    def logger():
        return tracking.child_logger(None, "run", {"seed": "0"}, {"train.rounds": R}, log_every=1)

    lg = logger()
    with pytest.raises(Killed):
        run_sim(digits, *common, checkpoint_path=tmp_path / "ck.pt", logger=lg, callbacks=[_kill_after(3)])
    lg.close("KILLED")
    assert _metric_steps(tracking, lg.run_id, "test_acc") == [1, 2, 3]  # round 3 logged, checkpoint at 2
    lg2 = logger()
    run_sim(digits, *common, checkpoint_path=tmp_path / "ck.pt", logger=lg2)
    lg2.close("FINISHED")
    assert lg2.run_id == lg.run_id  # the same MLflow run continues
    assert sorted(_metric_steps(tracking, lg.run_id, "test_acc")) == list(range(1, R + 1))
    for key in ("test_loss", "train_loss", "lr", "comm_up_floats", "comm_down_floats", "round_time_s"):
        assert sorted(_metric_steps(tracking, lg.run_id, key)) == list(range(1, R + 1)), key
    run = tracking.client.get_run(lg.run_id)
    assert run.info.status == "FINISHED"
    d = run.data.metrics["comm/up_floats"] / R  # cumulative: R rounds of d floats
    assert d == 71754  # small_cnn on 1x8x8 digits


def test_non_finite_loss_fails_the_run_with_a_reason(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracking = Tracking("test-nan", root=tmp_path)
    lg = tracking.child_logger(None, "nan", {}, {}, log_every=1)
    with pytest.raises(RunFailed, match="non-finite training loss"):
        run_sim(digits, "train.lr=1e8", logger=lg)
    run = tracking.client.get_run(lg.run_id)
    assert run.info.status == "FAILED"
    assert "non-finite" in run.data.tags["failure_reason"]
    assert "\n" not in run.data.tags["failure_reason"]


def test_torchvision_imports_through_compat():
    from fl_core import compat

    tv = compat.torchvision()
    assert compat.TORCHVISION_OPS in (True, False)
    net = tv.models.resnet18(num_classes=7).eval()
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    assert hasattr(tv.datasets, "CIFAR10") and hasattr(tv.datasets, "MNIST")


def test_compat_reraises_unrelated_import_errors(monkeypatch):
    import builtins
    import sys

    from fl_core import compat

    compat.torchvision.cache_clear()
    saved = {k: v for k, v in sys.modules.items() if k == "torchvision" or k.startswith("torchvision.")}
    for k in saved:
        del sys.modules[k]
    real_import = builtins.__import__

    def broken(name, *a, **kw):
        if name == "torchvision":
            raise RuntimeError("something else broke")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", broken)
    try:
        with pytest.raises(RuntimeError, match="something else broke"):
            compat.torchvision()
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        sys.modules.update(saved)
        compat.torchvision.cache_clear()


def test_empty_clients_take_no_step():
    from fl_core.engine.executors import batch_schedule, local_steps

    assert batch_schedule(0, 1, 3, 0, 16, 2) == [] and local_steps(0, 16, 2) == 0
    sched = batch_schedule(0, 1, 3, 37, 16, 2)
    assert [len(b) for b in sched] == [16, 16, 5, 16, 16, 5] and len(sched) == local_steps(37, 16, 2)
    assert sorted(torch.cat(sched[:3]).tolist()) == list(range(37))  # each epoch is a permutation


def test_derive_seeds_equals_derive_seed_per_element():
    import numpy as np

    from fl_core.seeding import derive_seed, derive_seeds

    xs = np.concatenate([np.random.default_rng(0).integers(0, 2**32, 300), [0, 1, 2**32 - 1]])
    for keys in [("batches", 0, 1), ("batches", 12345, 678), (), ("a",), ("a", "b", 3, 4, 5, 6), ("x", 2**40)]:
        assert derive_seeds(keys, xs).tolist() == [derive_seed(*keys, int(x)) for x in xs], keys
    assert derive_seeds(("a",), [2**33]).tolist() == [derive_seed("a", 2**33)]  # two words: the per-element path
    assert derive_seeds(("a",), []).tolist() == []


@pytest.mark.parametrize("batch_size, epochs, steps", [(4, 1, 0), (4, 3, 0), (16, 2, 0), (5, 2, 3), (3, 1, 9)])
def test_vectorized_schedule_is_every_clients_batch_schedule(batch_size, epochs, steps):
    """The vectorised executor's [C, Kmax, B] schedule holds each client's batch_schedule, padded with weight 0
    (empty clients, clients smaller than a batch, a last batch cut short, train.local_steps across epochs)."""
    from fl_core.algorithms import FedAvg
    from fl_core.algorithms.base import RoundContext
    from fl_core.engine.executors import ClientData, VectorizedExecutor, batch_schedule
    from fl_core.engine.state import ClientStateStore
    from fl_core.models.linear import LogisticRegression
    from fl_core.params import ParamSpec, flatten_params

    sizes = [5, 0, 1, 16, 37, 4, 0, 9]
    perm = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(1))
    indices = list(torch.split(perm, sizes))
    data = ClientData(torch.randn(sum(sizes), 1, 2, 2), torch.randint(0, 3, (sum(sizes),)), indices, 3)
    model = LogisticRegression((1, 2, 2), 3)
    ex = VectorizedExecutor(model, FedAvg(), data, batch_size=batch_size, local_epochs=epochs, seed=7, local_steps=steps)
    rctx = RoundContext(round=4, lr=0.1, global_flat=flatten_params(model), spec=ParamSpec.from_model(model))
    ids = [7, 1, 0, 4, 2, 3]  # any order, an empty client among them
    pos, w, kmax = ex._schedule(rctx, ex.client_contexts(rctx, ids, ClientStateStore()))
    for c, cid in enumerate(ids):
        sched = batch_schedule(7, 4, cid, sizes[cid], batch_size, epochs, steps)
        assert w[c].sum() == sum(len(b) for b in sched)
        for k in range(kmax):
            b = sched[k] if k < len(sched) else torch.zeros(0, dtype=torch.long)
            assert torch.equal(pos[c, k, :len(b)], indices[cid][b]) and bool((w[c, k, :len(b)] == 1).all())
            assert bool((w[c, k, len(b):] == 0).all()) and bool((pos[c, k, len(b):] == 0).all())
