"""Dataclass schemas for every config group, and their validation.

Hydra composes ``conf/`` against :class:`ExperimentConfig` (registered as a
structured config), so type errors are caught at composition time. Range and
choice checks that a type cannot express live in :func:`validate`, which raises
:class:`ConfigError` with a one-line message naming the offending key, e.g.
``partition.alpha must be > 0, got -1``.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, List, Optional


class ConfigError(ValueError):
    """A configuration value is out of range or not one of the allowed choices."""


DATASETS = ("digits", "cifar10", "cifar100", "mnist", "fmnist", "tiny_imagenet", "cinic10")
MODELS = ("auto", "small_cnn", "std_cnn", "mcmahan_cnn", "mlp", "logreg", "tiny_cnn", "resnet18", "resnet34", "vgg9",
          "vgg11", "vgg19")
PARTITIONS = ("iid", "dirichlet", "shards")
DIRICHLET_VARIANTS = ("per_client", "per_class", "fixed_size_reuse")
SAMPLERS = ("bernoulli", "fixed")
BASE_ALGORITHMS = ("fedavg", "fedprox", "feddyn", "fedexp", "feddecorr", "scaffold", "fednova", "fedrs", "fedlc",
                   "fedavgm", "fedadam", "fedyogi", "fedadagrad", "feddc", "fedbcgd", "fedbcgd_plus")
WRAPPERS = ("fedbug", "fednlr", "ccvr", "topk", "qsgd")
AGGREGATIONS = ("weighted", "uniform")
EXECUTORS = ("sequential", "vectorized", "auto")
FEDBUG_SCHEDULES = ("paper", "code")
FEDBUG_STRATEGIES = ("bottom_up", "top_down", "fixed_last", "fixed_last_two")
FEDEXP_VARIANTS = ("official", "fedbug_code")
FEDDYN_EVAL = ("sel", "cloud")
AUGMENTATIONS = ("none", "crop_flip", "fedbug", "flip")


@dataclass
class DatasetConfig:
    """Where the data comes from. ``name`` picks a source of :mod:`fl_core.data.sources`."""

    name: str = "digits"
    root: str = "data/raw"  # official files of CIFAR/MNIST live here (relative: to the project root)
    download: bool = False  # let torchvision download into root (needs a network)
    verify: bool = True  # check the official archives' MD5 sums where torchvision knows them
    test_fraction: float = 0.25  # digits only: held-out share (stratified, fixed split)
    split_seed: int = 0  # digits only: seed of the train/test split
    # > 0: hold out this share of the TRAINING set (stratified, seeded by split_seed) and evaluate on it instead
    # of the test set; every test_* metric is then a validation metric (tuning, sweeps/tune.py)
    validation_fraction: float = 0.0


@dataclass
class PartitionConfig:
    """How the training set is split across clients (docs/algorithms.md, Data)."""

    name: str = "iid"
    num_clients: int = 10  # N
    alpha: float = 0.3  # Dirichlet concentration
    # dirichlet: per_client (A, Acar/FedBug) | per_class (C, NIID-Bench) | fixed_size_reuse (B, FedBCGD: each client
    # draws samples_per_client labels from its prior; a class list is reshuffled and reused when exhausted)
    variant: str = "per_client"
    samples_per_client: int = 500  # dirichlet fixed_size_reuse (B) only
    min_size: int = 10  # dirichlet per_class: redraw until every client has this many samples
    classes_per_client: int = 2  # shards: S classes per client (#label-S)
    shards_variant: str = "label_S"  # label_S (NIID-Bench #label-S) | mcmahan_sort_shard (sort, N*S shards)
    size_sigma: float = 0.0  # lognormal client sizes (SGM); 0 = balanced; iid and dirichlet/per_client
    seed: int = 0  # partition seed: one partition serves every training seed (as in Acar/FedBug)


@dataclass
class ModelConfig:
    name: str = "auto"  # auto: small_cnn (digits), mcmahan_cnn ((f)mnist), std_cnn (CIFAR), tiny_cnn (Tiny-ImageNet)
    hidden: int = 200  # mlp width
    units: str = "default"  # FedBug units: resnet module (M=4) | block (M=8/16); tiny_cnn code5 | paper6
    norm_groups: int = 2  # ResNets: GroupNorm(norm_groups, C) in place of BatchNorm
    vgg_init: str = "kaiming"  # vgg11/vgg19: kaiming (torchvision's VGG init) | torch (PyTorch layer defaults)


@dataclass
class FedProxConfig:
    mu: float = 0.01  # proximal coefficient (mu/2)||theta - theta_global||^2


@dataclass
class FedBugConfig:
    gu_percentage: float = 0.2  # P: share of the local steps spent on gradual unfreezing, in [0, 1]
    schedule: str = "paper"  # paper: m(k)=min(M, ceil(kM/(PK))) | code: period floor(PK/M)
    strategy: str = "bottom_up"  # bottom_up (FedBug) | ablations: top_down, fixed_last (FedBABU), fixed_last_two


@dataclass
class FedDynConfig:
    alpha: float = 0.01  # FedDyn regulariser alpha (Acar et al.; FedBug uses 0.01)
    adaptive_alpha: bool = True  # alpha_i = alpha / w_i with w_i = n_i / mean_j n_j (Acar/FedBug code)
    eval_model: str = "sel"  # sel: mean of the active clients' models (FedBug/Acar logs) | cloud: broadcast model


@dataclass
class FedExPConfig:
    variant: str = "official"  # official (Jhunjhunwala et al.) | fedbug_code (FedBug's implementation)
    eps: float = 1e-3  # epsilon of the step size; 0.1 for EMNIST in the paper
    eps_decay: float = 0.998  # eps <- eps * eps_decay**2 after every round
    average_last_two: bool = True  # evaluate (x_t + x_{t+1}) / 2 (official only)


@dataclass
class ScaffoldConfig:
    lr_in_update: str = "actual"  # c-update divides by K * eta_l of the round (actual) | the initial lr (Acar code)


@dataclass
class FedNovaConfig:
    mu: float = 0.0  # proximal term (FedNova's "prox" normaliser) ; 0 = plain SGD, a_i = tau_i


@dataclass
class FedRSConfig:
    alpha: float = 0.5  # logit scale of classes missing from the client (FedNLR; FedDecorr default)


@dataclass
class FedLCConfig:
    tau: float = 1.0  # calibration strength (FedNLR 1; FedDecorr default 0.1)
    missing: str = "exclude"  # classes absent locally: exclude (logit -inf, reference) | clamp (count 1)


@dataclass
class FedNLRConfig:
    mu0: float = 1.0  # mu_l = mu0 + a1 * depth + a2 * log10(M_l)   (FedNLR Eq. 17)
    a1: float = 1.0
    a2: float = 1.0
    depth_term: str = "l_over_L"  # l/L (Eq. 17) | one_over_L (the paper's printed final formula)
    neuron_count: str = "channels"  # M_l of a conv layer: channels | channels_x_hw


@dataclass
class CCVRConfig:
    virtual_per_class: int = 200  # M_c virtual features sampled per class (not in the papers: our default)
    epochs: int = 20  # classifier retraining epochs over the virtual features (our default)
    lr: float = 0.01  # classifier retraining learning rate (our default)
    batch_size: int = 64


@dataclass
class FedAvgMConfig:
    beta: float = 0.9  # server momentum
    form: str = "heavy_ball"  # heavy_ball: v <- beta v + D; x <- x + eta_g v | ema: m <- beta m + (1-beta) D; x <- x + m


@dataclass
class ServerOptConfig:
    beta1: float = 0.9  # FedAdam / FedYogi / FedAdagrad (Reddi et al.): first moment
    beta2: float = 0.99  # second moment (Adam, Yogi)
    tau: float = 1.0e-3  # adaptivity: x <- x + eta_g m / (sqrt(v) + tau)


@dataclass
class FedDCConfig:
    alpha: float = 0.01  # drift penalty (Gao et al.; FedBCGD uses 0.01)


@dataclass
class FedBCGDConfig:
    blocks: int = 5  # N parameter blocks (besides the shared block)
    lam: float = 0.8  # lambda: per-block server heavy-ball momentum (paper best ~0.8; code 0.45)
    block_partition: str = "auto"  # auto (model's table, else contiguous units) | paper | code | units
    shared: bool = True  # ablation "nonshare": no shared block
    momentum: bool = True  # ablation: lambda = 0
    freezing: bool = False  # ablation: clients update only their block + shared block
    plus_variant: str = "paper"  # FedBCGD+: paper (SVRG + full-batch control variates) | code (SCAFFOLD II + momentum)


@dataclass
class CompressionConfig:
    topk_ratio: float = 0.1  # Top-k: share of entries sent (values + indices)
    qsgd_levels: int = 16  # QSGD / FedPAQ: s quantisation levels
    error_feedback: bool = True  # Top-k: keep the residual on the client


@dataclass
class FedDecorrConfig:
    beta: float = 0.01  # weight of the decorrelation loss (FedBug paper 0.01, FedBug code 0.001)


@dataclass
class AlgorithmConfig:
    """The algorithm stack: a base rule optionally wrapped, e.g. FedBug(FedProx)."""

    name: str = "fedavg"  # base rule
    wrappers: List[str] = field(default_factory=list)  # applied inside-out, e.g. [fedbug]
    aggregation: str = "weighted"  # weighted: p_i = n_i/n_S | uniform: p_i = 1/|S|
    eta_g: float = 1.0  # server learning rate
    fedprox: FedProxConfig = field(default_factory=FedProxConfig)
    feddyn: FedDynConfig = field(default_factory=FedDynConfig)
    fedexp: FedExPConfig = field(default_factory=FedExPConfig)
    feddecorr: FedDecorrConfig = field(default_factory=FedDecorrConfig)
    scaffold: ScaffoldConfig = field(default_factory=ScaffoldConfig)
    fednova: FedNovaConfig = field(default_factory=FedNovaConfig)
    fedrs: FedRSConfig = field(default_factory=FedRSConfig)
    fedlc: FedLCConfig = field(default_factory=FedLCConfig)
    fednlr: FedNLRConfig = field(default_factory=FedNLRConfig)
    ccvr: CCVRConfig = field(default_factory=CCVRConfig)
    fedavgm: FedAvgMConfig = field(default_factory=FedAvgMConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    feddc: FedDCConfig = field(default_factory=FedDCConfig)
    fedbcgd: FedBCGDConfig = field(default_factory=FedBCGDConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    fedbug: FedBugConfig = field(default_factory=FedBugConfig)


@dataclass
class TrainConfig:
    rounds: int = 30  # R communication rounds
    participation: float = 0.5  # client participation rate p
    sampler: str = "bernoulli"  # bernoulli: each client w.p. p, redraw if empty | fixed: round(pN) clients
    local_epochs: int = 3  # E
    local_steps: int = 0  # > 0: exactly this many local steps K per client per round (LocalSGD), instead of E epochs
    batch_size: int = 16  # B
    lr: float = 0.05  # eta_l
    lr_decay: float = 1.0  # eta_l(r) = lr * lr_decay**(r-1)
    weight_decay: float = 0.0  # L2 added to the gradient of trainable parameters
    grad_clip: Optional[float] = None  # max global grad norm over trainable params; None = off
    augmentation: str = "none"  # none | crop_flip (torchvision style) | fedbug (flip, then crop w.p. 0.5) | flip
    crop_padding: int = 4  # zero padding of the random crop, pixels
    eval_every: int = 1  # evaluate the global model every this many rounds (and at the last round)
    target_acc: float = 0.9  # report: rounds to reach this test accuracy
    final_window: int = 5  # report: final accuracy = mean over the last this many evaluations (FedNLR: 5 / 30)


@dataclass
class EngineConfig:
    executor: str = "sequential"  # sequential (reference) | vectorized (torch.func) | auto
    max_parallel_clients: int = 0  # vectorized: clients trained at once (0 = all sampled clients)
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    dtype: str = "float32"  # float32 | float64 (slow; for numerical checks)
    checkpoint_every: int = 10  # rounds; 0 = never
    checkpoint_dir: str = "checkpoints"
    eval_batch_size: int = 1024
    progress: bool = True


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "fl-pipeline"  # MLflow experiment
    log_every: int = 10  # flush buffered per-round metrics every this many rounds
    log_model: bool = True  # final state_dict as an artifact
    neuron_drift_samples: int = 0  # > 0: per-round neuron-drift probe on this many test samples (FedNLR sec. 4)
    layer_cosine: bool = False  # per-round cosine similarity of client updates per layer, mean over client pairs
    client_loss_trace: int = 0  # > 0: log the local training loss of clients 0..n-1 every round they train


@dataclass
class ExperimentConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    seed: int = 0
    name: Optional[str] = None  # experiment name (results/<name>/); default derived from the config
    results_dir: str = "results"
    data_dir: str = "data"


# --------------------------------------------------------------------------- validation


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _range(key: str, value: float, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {_fmt(value)}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ConfigError(f"{key} must be {'<' if hi_open else '<='} {hi}, got {_fmt(value)}")


def _finite_positive(key: str, value: Any, hint: str) -> None:
    """``value`` must be a finite number > 0: NaN and +inf get ``<key> must be a finite number > 0, got inf
    (<hint>)``; values <= 0 (-inf included) keep :func:`_range`'s ``<key> must be > 0, got -1``."""
    if isinstance(value, float) and (math.isnan(value) or value == math.inf):
        raise ConfigError(f"{key} must be a finite number > 0, got {_fmt(value)} ({hint})")
    _range(key, value, 0, lo_open=True)


def validate(cfg: Any) -> None:
    """Check ranges and choices of a composed config (DictConfig or ExperimentConfig).

    Raises:
        ConfigError: one line, naming the first offending key and the allowed range.
    """
    d, p, m, a, t, e = cfg.dataset, cfg.partition, cfg.model, cfg.algorithm, cfg.train, cfg.engine
    _choice("dataset.name", d.name, DATASETS)
    _range("dataset.test_fraction", d.test_fraction, 0, 1, lo_open=True, hi_open=True)
    _range("dataset.validation_fraction", d.validation_fraction, 0, 1, hi_open=True)
    _choice("partition.name", p.name, PARTITIONS)
    _range("partition.num_clients", p.num_clients, 1)
    _finite_positive("partition.alpha", p.alpha, "use partition=iid for an IID split")
    _choice("partition.variant", p.variant, DIRICHLET_VARIANTS)
    _range("partition.min_size", p.min_size, 0)
    _range("partition.samples_per_client", p.samples_per_client, 1)
    _range("partition.classes_per_client", p.classes_per_client, 1)
    _choice("partition.shards_variant", p.shards_variant, ("label_S", "mcmahan_sort_shard"))
    _range("partition.size_sigma", p.size_sigma, 0)
    _choice("model.name", m.name, MODELS)
    _choice("model.vgg_init", m.vgg_init, ("kaiming", "torch"))
    _range("model.hidden", m.hidden, 1)
    _range("model.norm_groups", m.norm_groups, 1)
    _choice("algorithm.name", a.name, BASE_ALGORITHMS)
    for i, w in enumerate(a.wrappers):
        _choice(f"algorithm.wrappers[{i}]", w, WRAPPERS)
    _choice("algorithm.aggregation", a.aggregation, AGGREGATIONS)
    _range("algorithm.eta_g", a.eta_g, 0, lo_open=True)
    _range("algorithm.fedprox.mu", a.fedprox.mu, 0)
    _range("algorithm.fedbug.gu_percentage", a.fedbug.gu_percentage, 0, 1)
    _choice("algorithm.fedbug.schedule", a.fedbug.schedule, FEDBUG_SCHEDULES)
    _choice("algorithm.fedbug.strategy", a.fedbug.strategy, FEDBUG_STRATEGIES)
    _range("algorithm.feddyn.alpha", a.feddyn.alpha, 0, lo_open=True)
    _choice("algorithm.feddyn.eval_model", a.feddyn.eval_model, FEDDYN_EVAL)
    _choice("algorithm.fedexp.variant", a.fedexp.variant, FEDEXP_VARIANTS)
    _range("algorithm.fedexp.eps", a.fedexp.eps, 0)
    _range("algorithm.fedexp.eps_decay", a.fedexp.eps_decay, 0, 1, lo_open=True)
    _range("algorithm.feddecorr.beta", a.feddecorr.beta, 0)
    _choice("algorithm.scaffold.lr_in_update", a.scaffold.lr_in_update, ("actual", "initial"))
    _range("algorithm.fednova.mu", a.fednova.mu, 0)
    _range("algorithm.fedrs.alpha", a.fedrs.alpha, 0, 1)
    _range("algorithm.fedlc.tau", a.fedlc.tau, 0)
    _choice("algorithm.fedlc.missing", a.fedlc.missing, ("exclude", "clamp"))
    _range("algorithm.fednlr.mu0", a.fednlr.mu0, 0)
    _range("algorithm.fednlr.a1", a.fednlr.a1, 0)
    _range("algorithm.fednlr.a2", a.fednlr.a2, 0)
    _choice("algorithm.fednlr.depth_term", a.fednlr.depth_term, ("l_over_L", "one_over_L"))
    _choice("algorithm.fednlr.neuron_count", a.fednlr.neuron_count, ("channels", "channels_x_hw"))
    _range("algorithm.ccvr.virtual_per_class", a.ccvr.virtual_per_class, 1)
    _range("algorithm.ccvr.epochs", a.ccvr.epochs, 0)
    _range("algorithm.ccvr.lr", a.ccvr.lr, 0, lo_open=True)
    _range("algorithm.ccvr.batch_size", a.ccvr.batch_size, 1)
    _range("algorithm.fedavgm.beta", a.fedavgm.beta, 0, 1, hi_open=True)
    _choice("algorithm.fedavgm.form", a.fedavgm.form, ("heavy_ball", "ema"))
    _range("algorithm.server_opt.beta1", a.server_opt.beta1, 0, 1, hi_open=True)
    _range("algorithm.server_opt.beta2", a.server_opt.beta2, 0, 1, hi_open=True)
    _range("algorithm.server_opt.tau", a.server_opt.tau, 0, lo_open=True)
    _range("algorithm.feddc.alpha", a.feddc.alpha, 0)
    _range("algorithm.fedbcgd.blocks", a.fedbcgd.blocks, 1)
    _range("algorithm.fedbcgd.lam", a.fedbcgd.lam, 0, 1, hi_open=True)
    _choice("algorithm.fedbcgd.block_partition", a.fedbcgd.block_partition, ("auto", "paper", "code", "units"))
    _choice("algorithm.fedbcgd.plus_variant", a.fedbcgd.plus_variant, ("paper", "code"))
    _range("algorithm.compression.topk_ratio", a.compression.topk_ratio, 0, 1, lo_open=True)
    _range("algorithm.compression.qsgd_levels", a.compression.qsgd_levels, 1)
    _range("train.rounds", t.rounds, 1)
    _range("train.participation", t.participation, 0, 1, lo_open=True)
    _choice("train.sampler", t.sampler, SAMPLERS)
    _range("train.local_epochs", t.local_epochs, 1)
    _range("train.local_steps", t.local_steps, 0)
    _range("train.batch_size", t.batch_size, 1)
    _range("train.lr", t.lr, 0, lo_open=True)
    _range("train.lr_decay", t.lr_decay, 0, 1, lo_open=True)
    _range("train.weight_decay", t.weight_decay, 0)
    if t.grad_clip is not None:
        _range("train.grad_clip", t.grad_clip, 0, lo_open=True)
    _choice("train.augmentation", t.augmentation, AUGMENTATIONS)
    _range("train.crop_padding", t.crop_padding, 0)
    _range("train.eval_every", t.eval_every, 1)
    _range("train.target_acc", t.target_acc, 0, 1)
    _range("train.final_window", t.final_window, 1)
    _choice("engine.executor", e.executor, EXECUTORS)
    if not (e.device in ("cpu", "cuda", "auto") or str(e.device).startswith("cuda:")):
        raise ConfigError(f"engine.device must be cpu, cuda, cuda:N or auto, got {e.device!r}")
    _choice("engine.dtype", e.dtype, ("float32", "float64"))
    _range("engine.checkpoint_every", e.checkpoint_every, 0)
    _range("engine.max_parallel_clients", e.max_parallel_clients, 0)
    _range("engine.eval_batch_size", e.eval_batch_size, 1)
    _range("tracking.log_every", cfg.tracking.log_every, 1)
    _range("tracking.neuron_drift_samples", cfg.tracking.neuron_drift_samples, 0)
    _range("tracking.client_loss_trace", cfg.tracking.client_loss_trace, 0)
    if cfg.name is not None and (not cfg.name or "/" in cfg.name or cfg.name.startswith(".")):
        raise ConfigError(f"name must be a plain folder name, got {cfg.name!r}")


# --------------------------------------------------------------------------- composition

_REGISTERED = False


def _register_schema() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name="schema", node=ExperimentConfig)
        _REGISTERED = True


def _one_line(err: BaseException) -> str:
    """Hydra/OmegaConf messages span several lines (full_key, object_type, ...): keep the first."""
    msg = str(err).strip().splitlines()
    text = msg[0] if msg else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        text = str(cause).strip().splitlines()[0]
        for line in str(cause).splitlines():
            if line.strip().startswith("full_key:"):
                text += f" ({line.strip()})"
                break
    return text


def _explain_missing_option(text: str, config_dir: Optional[str]) -> str:
    """"Could not find 'dataset/x'" -> name the key and list the options in conf/dataset/."""
    import re

    from .paths import conf_dir

    m = re.search(r"Could not find '([\w-]+)/([^']+)'", text)
    if not m:
        return text
    group, value = m.groups()
    folder = Path(config_dir or conf_dir()) / group
    options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    return f"{group} must be one of {', '.join(options)}, got {value!r}"


def compose(overrides: List[str] = (), config_dir: Optional[str] = None):
    """Compose ``conf/config.yaml`` with Hydra overrides and validate it.

    Args:
        overrides: Hydra override strings, e.g. ``["algorithm=fedbug", "train.rounds=5"]``.
        config_dir: folder of the config tree (default: the project's ``conf/``).

    Returns:
        The composed, read-only ``DictConfig`` (schema :class:`ExperimentConfig`).

    Raises:
        ConfigError: a one-line message naming the offending key (unknown key, wrong type, out of range).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .paths import conf_dir

    _register_schema()
    try:
        with initialize_config_dir(config_dir=str(config_dir or conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(_explain_missing_option(_one_line(err), config_dir)) from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_container(cfg) -> dict:
    """A plain-dict copy of a composed config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
