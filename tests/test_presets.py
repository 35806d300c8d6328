"""Every paper preset (conf/experiment/) validates and runs one round on tiny files in the official format."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fl_core.config import compose
from fl_core.data import load_source, make_partition
from fl_core.engine.factory import build_simulator
from fl_core.paths import conf_dir

from test_emnist import emnist_arrays, write_emnist
from test_sources import write_cifar10, write_cifar100, write_cinic10, write_tiny_imagenet

PRESETS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
WRITERS = {
    "cifar10": lambda root: write_cifar10(root, per_batch=40, n_test=8),  # 200 train: 2 per client of 100
    "cifar100": lambda root: write_cifar100(root, n_train=200, n_test=8),
    "tiny_imagenet": lambda root: write_tiny_imagenet(root, per_class=8),
    "cinic10": lambda root: write_cinic10(root, per_class=(20, 1)),
    "emnist": lambda root: write_emnist(root, "byclass", emnist_arrays("byclass", n_train=124, n_test=8)),
}


def test_the_presets_cover_the_paper_tables():
    assert {"fedbug_cifar10", "fedbug_cifar100", "fedbug_tiny", "fedbug_resnet_cifar100", "fedbug_resnet_tiny",
            "fedbug_clients_ablation", "fednlr_cifar10", "fednlr_cifar100", "fednlr_cinic10",
            "fednlr_cifar10_100clients", "fedbcgd_cifar100", "fedbcgd_cifar10", "fedbcgd_rho01",
            "fedbcgd_compression", "fedbcgd_vit_cifar100", "fedbcgd_vit_tiny_imagenet", "moon_cifar10",
            "moon_cifar100"} <= set(PRESETS)


# the presets whose one round takes over 12 s on 2 cores (FedBCGD's convex problem, MOON's CIFAR-100 head, FedBug's
# ResNet and 100-client ablation): they run with the slow tests
SLOW_PRESETS = ("fedbcgd_rho01", "moon_cifar100", "fedbug_resnet_cifar100", "fedbug_clients_ablation")


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PRESETS else p
                                    for p in PRESETS])
def test_preset_validates_and_runs_one_round(preset, tmp_path):
    cfg = compose([f"+experiment={preset}"])
    family = preset.split("_")[0]
    if family == "mnist1d":  # the MNIST-1D authors' recipe: Adam 1e-2, B = 100, 6,000 steps, one client
        assert (cfg.partition.name, cfg.partition.num_clients, cfg.train.participation) == ("iid", 1, 1.0)
        assert (cfg.train.optimizer, cfg.train.lr, cfg.train.batch_size, cfg.train.weight_decay) == ("adam", 0.01, 100, 0)
        assert cfg.train.local_steps == 250 and cfg.train.rounds * cfg.train.local_steps == 6000
    else:
        assert cfg.train.rounds >= 100  # the paper's settings
    if family == "mnist1d":
        pass
    elif family == "fedbcgd":
        assert cfg.algorithm.name == "fedbcgd" and cfg.partition.variant == "fixed_size_reuse"
        assert cfg.train.lr_decay == 0.998
        if cfg.model.name == "vit_b_16":  # FedBCGD section 12.4: pretrained ViT-B, E = 1, B = 16, N = 6 (section 5.2)
            assert cfg.train.local_epochs == 1 and cfg.train.batch_size == 16 and cfg.algorithm.fedbcgd.blocks == 6
            assert cfg.partition.alpha == 0.6 and cfg.model.weights is None  # the user gives the weights file
            assert cfg.train.weight_decay == 0.001
        elif cfg.model.name == "logreg_binary":  # sec. 12.4: E = 1 for the convex problem; lambda is its own L2 term
            assert cfg.train.local_epochs == 1 and cfg.train.batch_size == 50 and cfg.train.weight_decay == 0
        else:
            assert cfg.train.local_epochs == 5 and cfg.train.batch_size == 50 and cfg.train.weight_decay == 0.001
    elif family == "moon":  # Li, He and Song, Sec. 4.1: E = 10, B = 64, local SGD momentum 0.9, head 256
        assert cfg.algorithm.name == "moon" and cfg.algorithm.moon.projection_dim == 256
        assert cfg.train.local_epochs == 10 and cfg.train.batch_size == 64 and cfg.train.momentum == 0.9
        assert cfg.algorithm.moon.mu == (5.0 if preset == "moon_cifar10" else 1.0)
    else:
        assert cfg.algorithm.wrappers == [family]
    if cfg.dataset.name in WRITERS:  # mnist1d is generated, no files
        WRITERS[cfg.dataset.name](tmp_path)
    # tiny files: shrink the partition where the preset's variant reads these keys (a key it does not read is refused)
    small = {"per_class": ["partition.min_size=0"], "fixed_size_reuse": ["partition.samples_per_client=4"]}
    files = [f"dataset.root={tmp_path}", "dataset.verify=false"] if cfg.dataset.name in WRITERS else []
    # ViT-B/16 trains on 224x224 crops: its one-round run is tests/test_vit.py's (slow); here the small ViT, on 20
    # clients (the tiny Tiny-ImageNet tree has 24 images)
    small_model = ["model=vit_tiny", "partition.num_clients=20"] if cfg.model.name == "vit_b_16" else []
    cfg = compose([f"+experiment={preset}", *files, *small_model, "train.rounds=1",
                   f"train.participation={1.0 if family == 'mnist1d' else 0.3}", "engine.device=cpu", "engine.checkpoint_every=0",
                   "engine.progress=false", "tracking.enabled=false"]
                  + (small.get(cfg.partition.variant, []) if cfg.partition.name == "dirichlet" else []))
    ds = load_source(cfg.dataset, Path(cfg.dataset.root))
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes)
    sim = build_simulator(cfg, ds, part)
    res = sim.run()
    row = res.history[-1]
    assert row["round"] == 1 and math.isfinite(row["train_loss"]) and 0.0 <= row["test_acc"] <= 1.0
    if family == "fedbcgd":  # one block + the shared block up, the whole model down
        assert row["comm_up_floats"] < row["comm_down_floats"] == sim.spec.d
    elif family not in ("moon", "mnist1d"):
        assert ("fedbug_trainable_share" in row) or ("fednlr_mu_l1" in row)
