"""The generated datasets (docs/algorithms.md, Synthetic(alpha, beta) and MNIST-1D): FedProx's Synthetic(alpha,
beta) with partition=natural, MNIST-1D from the authors' generator, and the MNIST-1D authors' models."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_core.config import ConfigError, ModelConfig, compose
from fl_core.data import get_dataset, load_source, make_partition
from fl_core.data.partition import PartitionError
from fl_core.data.synthetic import covariance_diagonal, generate_devices
from fl_core.models import AUTO_MODEL, build_model
from fl_core.models.mnist1d import GRULayer
from fl_core.seeding import numpy_rng

ROOT = Path(__file__).resolve().parent.parent


def _synthetic(*overrides):
    cfg = compose(["dataset=synthetic", *overrides])
    return load_source(cfg.dataset, ROOT)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A data_dir holding the prepared MNIST-1D (generated once; the runs below read the cache)."""
    data_dir = tmp_path_factory.mktemp("data")
    get_dataset(compose(["dataset=mnist1d"]).dataset, data_dir, ROOT)
    return data_dir


@pytest.fixture(scope="module")
def mnist1d(prepared):
    return get_dataset(compose(["dataset=mnist1d"]).dataset, prepared, ROOT)


# --------------------------------------------------------------------------- Synthetic(alpha, beta)


def test_synthetic_is_a_function_of_its_seed_and_arguments():
    a, b = _synthetic(), _synthetic()
    for name in ("x_train", "y_train", "x_test", "y_test", "devices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    other = _synthetic("dataset.seed=1")
    assert other.x_train.shape != a.x_train.shape or not torch.equal(other.x_train, a.x_train)
    half = _synthetic("dataset.beta=0.5")
    assert not torch.equal(half.x_train, a.x_train)


def test_alpha_shifts_every_logit_alike_so_no_label_changes():
    # u_k is the mean of every entry of W_k and b_k: it adds u_k (sum x + 1) to all ten logits, so with the same
    # draws the argmax, hence every label, is the same for any alpha (FedProx's generator has the same property)
    a, b = _synthetic("dataset.alpha=0"), _synthetic("dataset.alpha=3")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert torch.equal(a.y_test, b.y_test)
    assert a.provenance["args"]["alpha"] == 0.0 and b.provenance["args"]["alpha"] == 3.0


def test_synthetic_shapes_classes_devices_and_split():
    ds = _synthetic("dataset.num_devices=12", "dataset.test_fraction=0.2")
    assert ds.x_train.dtype == torch.float32 and ds.x_train.shape[1:] == (1, 1, 60) == ds.x_test.shape[1:]
    assert ds.num_classes == 10 and ds.input_shape == (1, 1, 60)
    assert 0 <= int(ds.y_train.min()) and int(ds.y_train.max()) < 10
    assert ds.num_devices == 12 and set(ds.devices.tolist()) == set(range(12))
    # the generator's own draws, in its order: sizes floor(lognormal(4, 2)) + 50, then the per-device split
    sizes = np.floor(numpy_rng("synthetic", 0).lognormal(4.0, 2.0, 12)).astype(np.int64) + 50
    train = np.bincount(ds.devices.numpy(), minlength=12)
    assert (train == np.floor(0.8 * sizes + 1e-9)).all()
    assert train.sum() + ds.x_test.shape[0] == sizes.sum() and (sizes >= 50).all()
    # identity normalisation: the model sees the generated values
    assert torch.equal(ds.normalize(ds.x_train), ds.x_train)
    assert ds.provenance["args"] == {"iid": False, "alpha": 1.0, "beta": 1.0, "num_devices": 12,
                                     "test_fraction": 0.2, "seed": 0}


def test_sigma_is_diagonal_with_j_to_the_minus_1_2():
    # IID control: v_k = 0, so every x ~ N(0, Sigma). 200 devices draw about 90,000 vectors; a variance estimate
    # then has a relative standard error sqrt(2 / n) < 0.5 %, so 3 % is > 6 standard errors, and the sample
    # correlations of independent coordinates have standard error 1 / sqrt(n) < 0.004, so 0.02 is > 5.
    x = np.concatenate([x for x, _ in generate_devices(0.0, 0.0, True, 200, numpy_rng("sigma-test", 0))])
    assert x.shape[0] > 50_000
    var = x.var(axis=0)
    law = np.arange(1, 61) ** -1.2
    assert np.allclose(covariance_diagonal(), law)
    assert np.max(np.abs(var / law - 1)) < 0.03
    slope = np.polyfit(np.log(np.arange(1, 61)), np.log(var), 1)[0]
    assert abs(slope + 1.2) < 0.01
    corr = np.corrcoef(x, rowvar=False)
    assert np.max(np.abs(corr - np.eye(60))) < 0.02


def test_beta_is_a_standard_deviation_and_iid_shares_one_rule():
    # device k's inputs have mean v_k with entries ~ N(B_k, 1), B_k ~ N(0, beta^2): averaged over the 60 features
    # and the device's samples, a device's mean is B_k up to ~0.13 noise. With beta = 2 the spread over 300
    # devices is 2 (standard error ~0.09); read as a variance it would be sqrt(2) = 1.41.
    devs = generate_devices(0.0, 2.0, False, 300, numpy_rng("beta-test", 0))
    spread = np.std([x.mean() for x, _ in devs])
    assert abs(spread - 2.0) < 0.35
    # alpha = beta = 0 still gives every device its own v_k ~ N(0, 1) and its own W_k; the IID control does not
    noniid = generate_devices(0.0, 0.0, False, 150, numpy_rng("iid-test", 0))
    iid = generate_devices(0.0, 0.0, True, 150, numpy_rng("iid-test", 0))
    big = [i for i, (x, _) in enumerate(iid) if len(x) >= 200]
    assert len(big) >= 20
    mean_gap = {name: np.mean([np.abs(d[i][0].mean(0)).mean() for i in big]) for name, d in
                (("noniid", noniid), ("iid", iid))}
    assert mean_gap["iid"] < 0.1 and mean_gap["noniid"] > 0.5  # |v_k| entries ~0.8 on average vs 0

    def label_tv(devs):  # mean total-variation distance of the big devices' label histograms to the pooled one
        hists = np.array([np.bincount(devs[i][1], minlength=10) / len(devs[i][1]) for i in big])
        pooled = hists.mean(0)
        return np.mean(0.5 * np.abs(hists - pooled).sum(1))

    assert label_tv(iid) < 0.1 and label_tv(noniid) > 0.3


def test_natural_partition_is_the_devices():
    cfg = compose(["dataset=synthetic", "partition=natural", "dataset.num_devices=7"])
    assert cfg.partition.num_clients == 7
    ds = load_source(cfg.dataset, ROOT)
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes, ds.devices.numpy())
    assert part.num_clients == 7
    for k, ix in enumerate(part.client_indices):
        assert np.array_equal(ix, np.flatnonzero(ds.devices.numpy() == k))
    with pytest.raises(PartitionError, match=r"^partition.name=natural needs a dataset made of devices"):
        make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes)


@pytest.mark.parametrize("overrides,message", [
    (["partition=natural"], "partition.name=natural needs a dataset made of devices (synthetic, quadratic, femnist, "
                            "shakespeare), got dataset.name=digits"),
    (["dataset=synthetic", "partition=natural", "partition.num_clients=10"],
     "partition.num_clients=10 must equal dataset.num_devices=30 with partition=natural (one client per device; "
     "set dataset.num_devices)"),
    (["dataset=synthetic", "dataset.alpha=-1"], "dataset.alpha must be >= 0, got -1"),
    (["dataset=synthetic", "dataset.beta=-0.5"], "dataset.beta must be >= 0, got -0.5"),
    (["dataset=synthetic", "dataset.num_devices=0"], "dataset.num_devices must be >= 1, got 0"),
    (["dataset=synthetic", "partition=natural", "partition.size_sigma=0.5"],
     "partition.size_sigma=0.5: the devices of partition=natural keep their own sizes (set it to 0)"),
    (["dataset=synthetic", "dataset.seed=-1"], "dataset.seed must be >= 0, got -1"),
    (["dataset=synthetic", "dataset.iid=true", "dataset.alpha=0.5"],
     "dataset.alpha has no effect with dataset.iid=true: it is used only with dataset.iid=false; remove it"),
    (["dataset.shuffle_positions=true"], "dataset.shuffle_positions has no effect with dataset.name=digits: it is "
                                         "used only with dataset.name=mnist1d; remove it"),
    (["dataset=mnist1d", "dataset.num_devices=3"], "dataset.num_devices has no effect with dataset.name=mnist1d: it "
                                                   "is used only with dataset.name=synthetic|quadratic; remove it"),
    (["dataset=mnist1d", "train.augmentation=flip"], "train.augmentation=flip flips and crops images; "
                                                     "dataset=mnist1d holds feature vectors (use "
                                                     "train.augmentation=none)"),
])
def test_bad_generator_arguments_get_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value) == message


def test_the_cli_refuses_bad_generator_arguments_with_exit_2(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", "dataset=synthetic", "dataset.beta=-1"],
                          cwd=tmp_path, env=env, capture_output=True, check=False, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: dataset.beta must be >= 0, got -1"
    assert list(tmp_path.iterdir()) == []


def test_prepared_cache_keeps_devices_and_follows_the_arguments(tmp_path):
    cfg = compose(["dataset=synthetic", "dataset.num_devices=5"]).dataset
    first = get_dataset(cfg, tmp_path, ROOT)
    cached = get_dataset(cfg, tmp_path, ROOT)
    assert torch.equal(cached.devices, first.devices) and cached.provenance == first.provenance
    other = get_dataset(compose(["dataset=synthetic", "dataset.num_devices=5", "dataset.seed=3"]).dataset,
                        tmp_path, ROOT)
    assert not torch.equal(other.y_train[:20], first.y_train[:20]) or other.y_train.shape != first.y_train.shape


# --------------------------------------------------------------------------- MNIST-1D


def test_mnist1d_is_the_authors_published_data(mnist1d):
    ds = mnist1d
    assert ds.x_train.shape == (4000, 1, 1, 40) and ds.x_test.shape == (1000, 1, 1, 40)
    assert ds.num_classes == 10 and sorted(set(ds.y_train.tolist())) == list(range(10))
    # seed 42 reproduces the authors' mnist1d_data.pkl (their repository's published file): its label arrays'
    # SHA-256 and a few of its values, to float32 precision
    sha = lambda y: hashlib.sha256(y.numpy().astype(np.int64).tobytes()).hexdigest()  # noqa: E731
    assert sha(ds.y_train) == "d97dc7aecec8ad6b5d8f143ba3e9c4bd7e25c420d7dfc2eb990591cfc0ed3e15"
    assert sha(ds.y_test) == "8de99be3ff9dab15ae0dc072c3d6ced7cf6b33d365888ce4a386fc944489452c"
    assert np.allclose(ds.x_train[0, 0, 0, :6].numpy(), [-0.33201, -0.47191, -0.7787, -1.00974, -0.88235, 0.10393],
                       atol=1e-5)
    assert np.allclose(ds.x_test[-1, 0, 0, -4:].numpy(), [0.44723, 0.65988, 0.87773, 1.19315], atol=1e-5)
    assert ds.provenance["version"] == "0.0.2.post1" and ds.provenance["args"]["seed"] == 42
    assert "url" not in ds.provenance["args"]


def test_mnist1d_never_uses_the_network_nor_the_global_rng(monkeypatch):
    import urllib.request

    import mnist1d.data
    import requests

    def refuse(*a, **k):
        raise AssertionError("network or download used")

    monkeypatch.setattr(requests, "get", refuse)
    monkeypatch.setattr(mnist1d.data, "get_dataset", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    ds = load_source(compose(["dataset=mnist1d", "dataset.seed=7"]).dataset, ROOT / "nowhere")
    assert np.array_equal(np.random.get_state()[1], before)
    assert ds.x_train.shape == (4000, 1, 1, 40)


def test_shuffle_positions_is_one_fixed_permutation(mnist1d):
    shuffled = load_source(compose(["dataset=mnist1d", "dataset.shuffle_positions=true"]).dataset, ROOT)
    assert torch.equal(shuffled.y_train, mnist1d.y_train) and torch.equal(shuffled.y_test, mnist1d.y_test)
    a = torch.cat([mnist1d.x_train, mnist1d.x_test]).reshape(-1, 40).double()
    b = torch.cat([shuffled.x_train, shuffled.x_test]).reshape(-1, 40).double()
    # position j of the shuffled data is position perm[j] of the original, for every sequence
    dist = torch.cdist(b.T, a.T)  # [40, 40]: distance between whole columns
    perm = dist.argmin(1)
    assert sorted(perm.tolist()) == list(range(40)) and perm.tolist() != list(range(40))
    assert torch.allclose(b, a[:, perm], atol=1e-5)
    assert torch.allclose(b.sort(1).values, a.sort(1).values, atol=1e-5)  # each sequence keeps its values


# --------------------------------------------------------------------------- the MNIST-1D authors' models


@pytest.mark.parametrize("name,count", [
    # logistic regression (LinearBase): 40*10 + 10 = 410
    ("logreg", 410),
    # MLPBase(hidden 100): (40*100 + 100) + (100*100 + 100) + (100*10 + 10) = 4,100 + 10,100 + 1,010 = 15,210
    ("m1d_mlp", 15_210),
    # ConvBase: conv1 1*25*5 + 25 = 150, conv2 and conv3 25*25*3 + 25 = 1,900 each, linear 125*10 + 10 = 1,260
    ("m1d_cnn", 5_210),
    # GRUBase: per direction 3*6*1 + 3*6*6 + 3*6 + 3*6 = 162, two directions 324; linear (2*6*40)*10 + 10 = 4,810
    ("m1d_gru", 5_134),
])
def test_reference_models_have_the_authors_sizes(name, count):
    m = build_model(ModelConfig(name=name), "mnist1d", (1, 1, 40), 10)
    assert sum(p.numel() for p in m.parameters()) == count
    logits, feats = m.forward_features(torch.randn(3, 1, 1, 40))
    assert logits.shape == (3, 10) and feats.shape == (3, m.feature_dim())
    assert not list(m.buffers())
    flat = [n for u in m.units() for n in u]
    assert sorted(flat) == sorted(n for n, _ in m.named_parameters())


def test_auto_models_and_shapes_that_do_not_fit():
    assert AUTO_MODEL["mnist1d"] == "m1d_cnn" and AUTO_MODEL["synthetic"] == "logreg"
    assert sum(p.numel() for p in build_model(ModelConfig(name="auto"), "synthetic", (1, 1, 60), 10).parameters()) \
        == 60 * 10 + 10
    for name in ("m1d_cnn", "m1d_gru"):
        with pytest.raises(ValueError) as err:
            build_model(ModelConfig(name=name), "cifar10", (3, 32, 32), 10)
        assert str(err.value) == (f"model.name={name} takes 1-D sequences [1, 1, L] (dataset=mnist1d), got "
                                  f"dataset=cifar10 with inputs [3, 32, 32]")


def test_cnn_is_the_authors_conv1d_arithmetic():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="m1d_cnn"), "mnist1d", (1, 1, 40), 10)
    x = torch.randn(4, 1, 1, 40)
    h = x.view(-1, 1, 40)
    for conv, pad in ((m.conv1, 1), (m.conv2, 1), (m.conv3, 1)):
        h = torch.nn.functional.conv1d(h, conv.weight.squeeze(2), conv.bias, stride=2, padding=pad).relu()
    assert h.shape == (4, 25, 5)
    assert torch.allclose(m(x), m.fc(h.flatten(1)), atol=1e-6)


def test_gru_is_torch_gru_and_is_reinitialised_by_the_run_seed():
    torch.manual_seed(0)
    ref = torch.nn.GRU(1, 6, batch_first=True, bidirectional=True)
    ours = GRULayer(1, 6)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 40, 1)
    assert torch.allclose(ref(x)[0], ours(x), atol=1e-6)
    # the simulator's initialisation (reset_parameters under its seed) reaches every GRU parameter
    a, b = (build_model(ModelConfig(name="m1d_gru"), "mnist1d", (1, 1, 40), 10) for _ in range(2))
    assert not torch.equal(a.gru.weight_hh_l0, b.gru.weight_hh_l0)
    for m in (a, b):
        torch.manual_seed(1)
        for mod in m.modules():
            if mod is not m and hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------- training runs


def _run(overrides, executor, data_dir):
    from pipeline.api import run

    base = ["train.rounds=2", "train.batch_size=20", "engine.progress=false", "tracking.enabled=false",
            "engine.checkpoint_every=0", "engine.dtype=float64", f"engine.executor={executor}", f"data_dir={data_dir}"]
    return run(list(overrides) + base, seeds=(1,))


@pytest.mark.parametrize("overrides", [
    ("dataset=synthetic", "partition=natural", "dataset.num_devices=6", "train.local_steps=3"),
    ("dataset=mnist1d", "partition=iid", "partition.num_clients=8", "train.local_steps=3"),
    ("dataset=mnist1d", "model=m1d_gru", "partition=iid", "partition.num_clients=40", "train.local_steps=2",
     "train.sampler=fixed", "train.participation=0.05"),
])
def test_two_rounds_on_both_executors_agree(overrides, prepared):
    seq, vec = _run(overrides, "sequential", prepared), _run(overrides, "vectorized", prepared)
    assert list(seq.history["round"]) == [1, 2]
    assert np.isfinite(seq.history["test_loss"]).all()
    for name, p in seq.models[1].items():
        assert torch.allclose(p, vec.models[1][name], atol=1e-9), name
    first = seq.history["test_loss"].iloc[0]
    assert not np.allclose(first, np.log(10.0), atol=1e-6)  # it trained (not a blank model)


# --------------------------------------------------------------------------- variants in one grid


def test_each_variant_has_its_own_cache_file_and_partition_key():
    from fl_core.data import dataset_tag, partition_key, prepared_path

    cfgs = [compose(o) for o in (["dataset=synthetic", "partition=natural"],
                                 ["dataset=synthetic", "partition=natural", "dataset.beta=0.5"],
                                 ["dataset=synthetic", "partition=natural", "dataset.iid=true"],
                                 ["dataset=mnist1d"], ["dataset=mnist1d", "dataset.shuffle_positions=true"])]
    tags = [dataset_tag(c.dataset) for c in cfgs]
    assert tags == ["synthetic-a1-b1-n30-tf0.2-s0", "synthetic-a1-b0.5-n30-tf0.2-s0", "synthetic-iid-n30-tf0.2-s0",
                    "mnist1d-s42", "mnist1d-shuffled-s42"]
    assert len({prepared_path(c.dataset, Path("d")) for c in cfgs}) == 5
    assert len({partition_key(c.partition, t) for c, t in zip(cfgs, tags)}) == 5
    assert dataset_tag(compose(["dataset=digits"]).dataset) == "digits"  # the read sources keep their names


def _tree_digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a DVC grid prepared and trained (about 18 s)
def test_a_grid_of_variants_is_prepared_once_and_training_writes_no_data(tmp_path, monkeypatch):
    """The prepare and partition stages cache every variant of the grid; the train stages only read them (a
    train stage that rewrote ``data/`` would change the prepare stage's output and make every ``dvc repro`` start
    again)."""
    import yaml

    from pipeline import partition as partition_stage
    from pipeline import prepare as prepare_stage
    from pipeline import train as train_stage

    params = {"seeds": [1], "dataset": {"name": "synthetic", "num_devices": 4}, "partition": {"name": "natural"},
              "model": {"name": "logreg"},
              "train": {"rounds": 1, "participation": 1.0, "local_epochs": 1, "batch_size": 10, "lr": 0.01},
              "engine": {"executor": "sequential", "checkpoint_every": 0},
              "experiments": {"s00": {"algorithm": "fedavg", "dataset.alpha": 0.0, "dataset.beta": 0.0},
                              "s11": {"algorithm": "fedavg"}, "iid": {"algorithm": "fedavg", "dataset.iid": True}}}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    Path("params.yaml").write_text(yaml.safe_dump(params))
    assert prepare_stage.main(["--params", "params.yaml"]) == 0
    assert partition_stage.main(["--params", "params.yaml"]) == 0
    assert sorted(p.name for p in Path("data/prepared").iterdir()) == [
        "synthetic-a0-b0-n4-tf0.2-s0.pt", "synthetic-a1-b1-n4-tf0.2-s0.pt", "synthetic-iid-n4-tf0.2-s0.pt"]
    before = _tree_digest(Path("data"))
    assert len([k for k in before if k.endswith("partition.npz")]) == 3
    for name in params["experiments"]:
        assert train_stage.main(["--grid", name, "--params", "params.yaml"]) == 0
    assert _tree_digest(Path("data")) == before
