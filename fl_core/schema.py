"""The bottom of the config layer: the error type, the range and choice checks, and the schemas of the
sections that are not rules (dataset, partition, model, train, engine, tracking).

Every other part of the project may import this module; it imports nothing of the project. The rules'
own parameter dataclasses live in their files (:mod:`fl_core.algorithms`) and declare their ranges with
:func:`param`; :mod:`fl_core.config` assembles the whole experiment schema from both.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional, Sequence


class ConfigError(ValueError):
    """A configuration value is out of range or not one of the allowed choices."""


DATASETS = ("digits", "cifar10", "cifar100", "mnist", "fmnist", "tiny_imagenet", "cinic10", "synthetic", "mnist1d",
            "emnist", "quadratic", "femnist", "shakespeare")
EMNIST_SPLITS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")  # dataset.split (Cohen et al. 2017)
GENERATED_DATASETS = ("synthetic", "mnist1d", "quadratic")  # generated from dataset.seed; float vectors [1, 1, L], not images
# datasets made of devices: partition=natural makes each device a client
DEVICE_DATASETS = ("synthetic", "quadratic", "femnist", "shakespeare")
# the devices of these are read from files (LEAF's JSON or TensorFlow Federated's h5; fl_core/data/leaf.py): writers,
# speakers. How many there are is known once the files are read; dataset.max_clients keeps a seeded subset
FILE_DEVICE_DATASETS = ("femnist", "shakespeare")
TEXT_DATASETS = ("shakespeare",)  # inputs are character indices [1, 1, L], not images
FEMNIST_SUBSETS = ("all", "digits", "lowercase", "lowercase_a_j")  # dataset.subset: 62, 10, 26 or 10 classes
MODELS = ("auto", "small_cnn", "std_cnn", "mcmahan_cnn", "mlp", "logreg", "tiny_cnn", "resnet18", "resnet34", "vgg9",
          "vgg11", "vgg19", "m1d_mlp", "m1d_cnn", "m1d_gru", "vit_b_16", "vit_tiny",
          "logreg_binary", "pfl_cnn", "quadratic", "char_lstm")
# logreg_binary: dataset classes -> labels 1 (b = +1) / 0 (b = -1); docs/algorithms.md, FedBCGD's convex problem
BINARY_MAPS = ("first_class", "parity", "lt_half", "digits_letters")
PARTITIONS = ("iid", "dirichlet", "shards", "natural")
DIRICHLET_VARIANTS = ("per_client", "per_class", "fixed_size_reuse")
SAMPLERS = ("bernoulli", "fixed")
AGGREGATIONS = ("weighted", "uniform")
EXECUTORS = ("sequential", "vectorized", "auto", "distributed")
RANK_EXECUTORS = ("sequential", "vectorized", "auto")  # what each rank of engine.executor=distributed runs
AUGMENTATIONS = ("none", "crop_flip", "fedbug", "flip")
KERNELS = ("native", "portable")  # engine.kernels (fl_core/engine/kernels.py)
FLOAT32_PRECISIONS = ("highest", "high", "medium")  # engine.float32_precision (fl_core/engine/kernels.py)
LOCAL_OPTIMIZERS = ("sgd", "adam")


# --------------------------------------------------------------------------- checks


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def check_cuda_kernels(float32_precision: str, deterministic: bool, device: str) -> None:
    """``engine.float32_precision`` and ``engine.deterministic`` change CUDA kernels only: a value other than the
    default (``highest``, true) on a ``device`` that is not CUDA (``engine.device``, or a resolved device's type;
    ``auto`` passes) is refused, as is an unknown precision.

    Raises:
        ConfigError: one line naming the key and the value to use.
    """
    check_choice("engine.float32_precision", float32_precision, FLOAT32_PRECISIONS)
    if device.startswith("cuda") or device == "auto":
        return
    where = "on the CPU" if device == "cpu" else "elsewhere"
    if float32_precision != "highest":
        raise ConfigError(f"engine.float32_precision={float32_precision} allows TF32/bfloat16 in CUDA kernels; "
                          f"engine.device={device} trains {where} (use engine.float32_precision=highest)")
    if not deterministic:
        raise ConfigError(f"engine.deterministic=false lets CUDA pick kernels that differ from run to run; "
                          f"engine.device={device} trains {where}, whose kernels repeat (use engine.deterministic=true)")


def fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def check_range(key: str, value: float, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {fmt(value)}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ConfigError(f"{key} must be {'<' if hi_open else '<='} {hi}, got {fmt(value)}")


def check_finite(key: str, value: Any) -> None:
    """A float ``value`` must be finite: NaN and +-inf get ``<key> must be a finite number, got inf``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {fmt(value)}")


def check_finite_positive(key: str, value: Any, hint: str) -> None:
    """``value`` must be a finite number > 0: NaN and +inf get ``<key> must be a finite number > 0, got inf
    (<hint>)``; values <= 0 (-inf included) keep :func:`check_range`'s ``<key> must be > 0, got -1``."""
    if isinstance(value, float) and (math.isnan(value) or value == math.inf):
        raise ConfigError(f"{key} must be a finite number > 0, got {fmt(value)} ({hint})")
    check_range(key, value, 0, lo_open=True)




# --------------------------------------------------------------------------- parameters that describe themselves

def select(root: Any, key: str) -> Any:
    """The value at the dotted path ``key`` of ``root`` (a DictConfig, a dataclass or nested dicts), or None."""
    node = root
    for part in key.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, dict) or hasattr(node, "get") else getattr(node, part, None)
    return node


def format_value(v: Any) -> str:
    """A Python or config value as Hydra override text: ``True`` -> ``true``, ``None`` -> ``null``, lists
    ``[a,b]``, numbers and strings as ``str`` writes them (full precision)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig":
        return "[" + ",".join(format_value(x) for x in v) + "]"
    return str(v)


@dataclass(frozen=True)
class When:
    """A parameter has an effect only when the key ``key`` (a dotted path from the config root) has one of
    ``values``; for a list-valued key (``algorithm.wrappers``), when the list holds one of them.

    A value the user sets for a parameter whose condition does not hold is refused (``fl_core.config``), so no
    key is accepted and then ignored; ``fl-train --help`` and the docs show the condition (:meth:`text`).
    """

    key: str
    values: tuple
    negate: bool = False  # the parameter has an effect only when the key has NONE of the values

    def holds(self, root: Any) -> bool:
        value = select(root, self.key)
        if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
            found = any(v in self.values for v in value)
        else:
            found = value in self.values
        return found != self.negate

    def text(self) -> str:
        shown = "|".join(format_value(v) for v in self.values)
        if self.key.endswith(("wrappers", "transforms")):
            return f"{self.key} {'not ' if self.negate else ''}containing {shown}"
        return f"{self.key}{'!=' if self.negate else '='}{shown}"


def when(key: str, *values: Any) -> When:
    """:class:`When` ``key`` has one of ``values`` (see :func:`param`'s ``when``)."""
    return When(key, tuple(values))


def unless(key: str, *values: Any) -> When:
    """:class:`When` ``key`` has none of ``values``."""
    return When(key, tuple(values), negate=True)


def param(default: Any = MISSING, help: str = "", *, ge: Optional[float] = None, gt: Optional[float] = None,
          le: Optional[float] = None, lt: Optional[float] = None, choices: Optional[Sequence[Any]] = None,
          integer: bool = False, when: Any = (), replica: bool = False, nullable: bool = False):
    """A dataclass field that carries its own description and allowed values.

    ``help`` is the one-line description shown by ``fl-train --help`` and in the docs' parameter tables;
    ``ge`` / ``gt`` / ``le`` / ``lt`` bound a number (closed / open), ``choices`` lists the allowed values,
    ``integer`` requires a whole number. :func:`check_fields` enforces them with one-line errors naming
    the key, e.g. ``algorithm.fedprox.mu must be >= 0, got -1``; a float must be finite. ``when`` (a
    :class:`When` or a tuple of them, all of which must hold) says when the parameter has an effect: a value the
    user sets while it does not hold is refused (``fl_core.config.inactive_keys``). ``replica``: the value may differ
    between the replicas of one population (runs trained in one vectorised pass, :mod:`fl_core.engine.population`;
    every such key: :func:`fl_core.config.replica_keys`). Each replica has its own rule instance, so a value read in
    the per-replica hooks (state, ``broadcast``, ``client_begin`` and the step plan it sets, ``finish_client``,
    ``aggregate``) needs nothing more; a value the batched hooks read (``local_objective``) must be the instance
    attribute of the same name, listed in the rule's ``replica_params``, read as a float or as each client's 0-dim
    tensor (no Python branch on its value there). ``tests/test_population.py`` trains a population over every such
    key against the separate runs.
    ``nullable``: null is allowed besides the bounded values (a field whose default is null always allows it).
    """
    conds = (when,) if isinstance(when, When) else tuple(when)
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt,
            "choices": tuple(choices) if choices is not None else None, "integer": integer, "when": conds,
            "replica": replica, "nullable": nullable}
    return field(default=default, metadata=meta)


def describe_range(f) -> str:
    """The allowed values of a :func:`param` field in words: ``[0, 1]``, ``> 0``, ``paper | code``, or ''."""
    m = f.metadata
    if m.get("choices"):
        return " | ".join(str(c) for c in m["choices"])
    lo = f"[{fmt(m['ge'])}" if m.get("ge") is not None else (f"({fmt(m['gt'])}" if m.get("gt") is not None else None)
    hi = f"{fmt(m['le'])}]" if m.get("le") is not None else (f"{fmt(m['lt'])})" if m.get("lt") is not None else None)
    if lo and hi:
        return f"{lo}, {hi}"
    if lo:
        return (">= " if lo.startswith("[") else "> ") + lo[1:]
    if hi:
        return ("<= " if hi.endswith("]") else "< ") + hi[:-1]
    return ""


def checked(schema: type, prefix: str, **values: Any) -> Any:
    """An instance of the :func:`param` dataclass ``schema`` from ``values``, checked by :func:`check_fields`, so a
    rule's constructor enforces the same ranges as the config (one declaration, one message).

    Raises:
        ConfigError: one line naming ``<prefix>.<field>`` and the allowed values.
    """
    obj = schema(**values)
    check_fields(schema, obj, prefix)
    return obj


def check_fields(schema: type, node: Any, prefix: str) -> None:
    """Check every :func:`param` field of the dataclass ``schema`` on ``node`` (an instance or a DictConfig
    with its fields).

    Raises:
        ConfigError: one line naming ``<prefix>.<field>`` and the allowed values.
    """
    for f in fields(schema):
        m = f.metadata
        if not m:
            continue
        key, value = f"{prefix}.{f.name}", getattr(node, f.name)
        if m.get("choices") is not None:
            check_choice(key, value, m["choices"])
            continue
        if value is None and (f.default is None or m.get("nullable")):
            continue  # an optional value left unset
        if m.get("integer") and (isinstance(value, bool) or int(value) != value):
            raise ConfigError(f"{key} must be an integer, got {fmt(value)}")
        if any(m.get(b) is not None for b in ("ge", "gt", "le", "lt")):
            lo = m["ge"] if m.get("ge") is not None else m.get("gt")
            hi = m["le"] if m.get("le") is not None else m.get("lt")
            check_finite(key, value)
            check_range(key, value, lo, hi, lo_open=m.get("gt") is not None, hi_open=m.get("lt") is not None)


# --------------------------------------------------------------------------- the sections that are not rules

# Keys that came after experiments' fingerprints were pinned, each with the condition under which it counts: where
# the condition does not hold the key is left out of the fingerprint (fl_core.experiment.result_sections), so the
# results written before it existed keep theirs. dataset=quadratic's keys count for that dataset only, the
# writer/speaker datasets' keys for theirs, partition.balance_cap only when it turns the cap off.
QUADRATIC_KEYS = ("dim", "smoothness", "strong_convexity", "a_spread", "b_spread")
LATE_KEYS = {
    **{f"dataset.{k}": When("dataset.name", ("quadratic",)) for k in QUADRATIC_KEYS},
    "dataset.subset": When("dataset.name", ("femnist",)),
    "dataset.max_clients": When("dataset.name", FILE_DEVICE_DATASETS),
    "partition.balance_cap": When("partition.balance_cap", (False,)),
}


@dataclass
class DatasetConfig:
    """Where the data comes from. ``name`` picks a source of :mod:`fl_core.data.sources`."""

    name: str = param("digits", "data source", choices=DATASETS)
    root: str = param("data/raw", "folder of the official files of CIFAR/MNIST/... (relative: to the project root)")
    download: bool = param(False, "let torchvision download into root (needs a network; femnist, shakespeare: "
                           "TensorFlow Federated's h5 files)", when=unless("dataset.name", "digits", *GENERATED_DATASETS))
    verify: bool = param(True, "check the official archives' MD5 sums where torchvision knows them",
                         when=unless("dataset.name", "digits", *GENERATED_DATASETS, *FILE_DEVICE_DATASETS))
    test_fraction: float = param(0.25, "digits: held-out share (stratified, fixed split); synthetic: test share of "
                                 "every device (FedProx: 0.2)", gt=0, lt=1,
                                 when=when("dataset.name", "digits", "synthetic"))
    split_seed: int = param(0, "digits: seed of the train/test split; femnist, shakespeare: of the "
                            "dataset.max_clients writers kept; any dataset: of the validation split")
    seed: int = param(0, "synthetic, mnist1d, quadratic: seed of the generator (mnist1d's authors use 42)", ge=0, integer=True,
                      when=when("dataset.name", *GENERATED_DATASETS))
    alpha: float = param(1.0, "synthetic: std of u_k, the common mean of device k's W_k and b_k entries (FedProx "
                         "Sec. 5.1; it shifts all logits alike, so no label changes)", ge=0,
                         when=(when("dataset.name", "synthetic"), when("dataset.iid", False)))
    beta: float = param(1.0, "synthetic: std of B_k, the mean of device k's input mean v_k (how much the devices' "
                        "inputs differ)", ge=0, when=(when("dataset.name", "synthetic"), when("dataset.iid", False)))
    iid: bool = param(False, "synthetic: the IID control (one W, b for every device, v_k = 0; alpha, beta unused)",
                      when=when("dataset.name", "synthetic"))
    num_devices: int = param(30, "synthetic, quadratic: K devices (synthetic: lognormal sample counts); "
                             "partition=natural makes each one a client", ge=1, integer=True,
                             when=when("dataset.name", "synthetic", "quadratic"))
    dim: int = param(10, "quadratic: m, the dimension of x (each device holds m samples)", ge=1, integer=True,
                     when=when("dataset.name", "quadratic"))
    smoothness: float = param(1.0, "quadratic: L, the largest eigenvalue any A_i may have", gt=0,
                              when=when("dataset.name", "quadratic"))
    strong_convexity: float = param(0.1, "quadratic: mu, the smallest eigenvalue any A_i may have (0 < mu <= L)",
                                    gt=0, when=when("dataset.name", "quadratic"))
    a_spread: float = param(1.0, "quadratic: how much the curvatures differ, A_i = (1 - s) A_0 + s R_i (0: equal "
                            "A_i)", ge=0, le=1, when=when("dataset.name", "quadratic"))
    b_spread: float = param(1.0, "quadratic: std of the devices' minimisers b_i (0: one common minimiser)", ge=0,
                            when=when("dataset.name", "quadratic"))
    shuffle_positions: bool = param(False, "mnist1d: the authors' spatially shuffled control (one fixed "
                                    "permutation of the 40 positions for every sequence)",
                                    when=when("dataset.name", "mnist1d"))
    split: str = param("byclass", "emnist: the official split read: byclass (62 classes), bymerge | balanced (47), "
                       "letters (26), digits | mnist (10)", choices=EMNIST_SPLITS, when=when("dataset.name", "emnist"))
    subset: str = param("all", "femnist: all (62 classes: digits, upper- and lower-case letters) | digits (10) | "
                        "lowercase (26 lower-case letters) | lowercase_a_j (10: 'a'-'j', FedProx's FEMNIST); a "
                        "writer left without samples is dropped",
                        choices=FEMNIST_SUBSETS, when=when("dataset.name", "femnist"))
    max_clients: Optional[int] = param(None, "femnist, shakespeare: keep this many writers / speakers, drawn with "
                                       "dataset.split_seed (null: all of them)", ge=1, integer=True,
                                       when=when("dataset.name", *FILE_DEVICE_DATASETS))
    validation_fraction: float = param(
        0.0, "> 0: hold out this share of the TRAINING set (stratified, seeded by split_seed) and evaluate on it "
        "instead of the test set; every test_* metric is then a validation metric (tuning)", ge=0, lt=1)


@dataclass
class PartitionConfig:
    """How the training set is split across clients (docs/algorithms.md, Data)."""

    name: str = param("iid", "client split; natural: each device of the dataset is a client (synthetic, "
                      "quadratic; femnist's writers, shakespeare's speakers)",
                      choices=PARTITIONS)
    num_clients: Optional[int] = param(10, "N, the number of clients (natural: dataset.num_devices; femnist, "
                                       "shakespeare: dataset.max_clients, null = every writer in the files)", ge=1,
                                       nullable=True)
    alpha: float = param(0.3, "Dirichlet concentration (a finite number > 0; checked in validate)",
                         when=when("partition.name", "dirichlet"))
    variant: str = param("per_client", "dirichlet: per_client (A, Acar/FedBug) | per_class (C, NIID-Bench) | "
                         "fixed_size_reuse (B, FedBCGD: each client draws samples_per_client labels from its prior; a "
                         "class list is reshuffled and reused when exhausted)", choices=DIRICHLET_VARIANTS,
                         when=when("partition.name", "dirichlet"))
    samples_per_client: int = param(500, "dirichlet fixed_size_reuse (B) only", ge=1,
                                    when=(when("partition.name", "dirichlet"),
                                          when("partition.variant", "fixed_size_reuse")))
    min_size: int = param(10, "dirichlet per_class: redraw until every client has this many samples", ge=0,
                          when=(when("partition.name", "dirichlet"), when("partition.variant", "per_class")))
    balance_cap: bool = param(True, "dirichlet per_class: a client already holding |D|/N samples gets no share of "
                              "later classes (NIID-Bench's cap); false: the plain per-class Dirichlet split",
                              when=(when("partition.name", "dirichlet"), when("partition.variant", "per_class")))
    classes_per_client: int = param(2, "shards: S classes per client (#label-S)", ge=1,
                                    when=when("partition.name", "shards"))
    shards_variant: str = param("label_S", "label_S (NIID-Bench #label-S) | mcmahan_sort_shard (sort, N*S shards)",
                                choices=("label_S", "mcmahan_sort_shard"), when=when("partition.name", "shards"))
    size_sigma: float = param(0.0, "lognormal client sizes (SGM); 0 = balanced; iid and dirichlet/per_client", ge=0)
    seed: int = param(0, "partition seed: one partition serves every training seed (as in Acar/FedBug)",
                      when=unless("partition.name", "natural"))


@dataclass
class ModelConfig:
    name: str = param("auto", "auto: small_cnn (digits), mcmahan_cnn (mnist, fmnist, emnist, femnist), std_cnn (CIFAR), "
                      "tiny_cnn (Tiny-ImageNet), vgg9 (CINIC-10), logreg (synthetic), m1d_cnn (mnist1d), quadratic "
                      "(quadratic), char_lstm (shakespeare); m1d_*: the MNIST-1D authors' models; pfl_cnn: "
                      "pfl-research's CIFAR-10 CNN; char_lstm: LEAF's/FedProx's Shakespeare LSTM", choices=MODELS)
    hidden: int = param(200, "mlp width", ge=1, when=when("model.name", "mlp"))
    units: str = param("default", "FedBug units: resnet module (M=4) | block (M=8/16); tiny_cnn code5 | paper6")
    norm_groups: int = param(2, "ResNets: GroupNorm(norm_groups, C) in place of BatchNorm", ge=1,
                             when=when("model.name", "resnet18", "resnet34"))
    vgg_init: str = param("kaiming", "vgg11/vgg19: kaiming (torchvision's VGG init) | torch (PyTorch layer defaults)",
                          choices=("kaiming", "torch"), when=when("model.name", "vgg11", "vgg19"))
    weights: Optional[str] = param(None, "vit_b_16: a local file of torchvision's ImageNet weights (ViT_B_16_Weights."
                                   "IMAGENET1K_V1, vit_b_16-c867db91.pth), loaded but the head; null: random init",
                                   when=when("model.name", "vit_b_16"))
    binary_map: str = param("first_class", "logreg_binary: the classes labelled 1 (b = +1), the rest 0: first_class "
                            "(class 0; FedBCGD sec. 12.5) | parity (even classes) | lt_half (c < C/2) | "
                            "digits_letters (classes 0-9, the digits of EMNIST)", choices=BINARY_MAPS,
                            when=when("model.name", "logreg_binary"))
    lambda_factor: float = param(1e-4, "logreg_binary: lambda = lambda_factor * L, L = lambda_max(A^T A) / (4n) of "
                                 "the clients' training features (FedBCGD sec. 5.3: 1e-4)", gt=0,
                                 when=when("model.name", "logreg_binary"))
    nonconvex: bool = param(False, "logreg_binary: regulariser lambda * sum x_j^2 / (1 + x_j^2) instead of "
                            "lambda/2 ||x||^2 (our stand-in; docs/algorithms.md, FedBCGD's convex problem)",
                            when=when("model.name", "logreg_binary"))


@dataclass
class TrainConfig:
    rounds: int = param(30, "R communication rounds", ge=1)
    participation: float = param(0.5, "client participation rate p", gt=0, le=1)
    sampler: str = param("bernoulli", "bernoulli: each client w.p. p, redraw if empty | fixed: round(pN) clients",
                         choices=SAMPLERS)
    local_epochs: int = param(3, "E; with local_epochs_max: the smallest E_i of the draw", ge=1,
                              when=when("train.local_steps", 0))
    local_epochs_max: Optional[int] = param(
        None, "null = every client runs E epochs; an integer b >= E: each client draws its own E_i uniformly from "
        "the integers E..b every round (as the experiments of FedNova, Wang et al. 2020; seeded by (seed, round, "
        "client))", ge=1,
        integer=True, when=when("train.local_steps", 0))
    stragglers: float = param(
        0.0, "fraction s of each round's sampled clients that straggle (chosen anew each round): a straggler runs "
        "a uniform 1..E_i-1 epochs (FedProx, Li et al. 2020, Sec. 5.2); needs E >= 2", ge=0, lt=1,
        when=when("train.local_steps", 0))
    drop_stragglers: bool = param(
        False, "true: the stragglers are left out of the round, as if not sampled (FedAvg in Li et al. 2020, Sec. "
        "5.2); false: their partial work is aggregated", when=unless("train.stragglers", 0))
    local_steps: int = param(0, "> 0: exactly this many local steps K per client per round (LocalSGD), instead of "
                             "E epochs", ge=0)
    batch_size: int = param(16, "B", ge=1)
    lr: float = param(0.05, "eta_l", gt=0, replica=True)
    lr_decay: float = param(1.0, "eta_l(r) = lr * lr_decay**(r-1)", gt=0, le=1)
    weight_decay: float = param(0.0, "L2 added to the gradient of trainable parameters", ge=0, replica=True)
    optimizer: str = param("sgd", "the clients' local optimiser: sgd (plain, or with momentum) | adam "
                           "(torch.optim.Adam: betas (0.9, 0.999), eps 1e-8, L2 weight decay; a new state for every "
                           "client and round)", choices=LOCAL_OPTIMIZERS)
    momentum: float = param(0.0, "rho, the clients' local SGD momentum (torch.optim.SGD: dampening 0, no Nesterov; "
                            "a new buffer for every client and round); 0 = plain SGD", ge=0, lt=1,
                            when=when("train.optimizer", "sgd"))
    grad_clip: Optional[float] = param(None, "max global grad norm over trainable params; None = off", gt=0)
    augmentation: str = param("none", "none | crop_flip (torchvision style) | fedbug (flip, then crop w.p. 0.5) | "
                              "flip", choices=AUGMENTATIONS)
    crop_padding: int = param(4, "zero padding of the random crop, pixels", ge=0,
                              when=when("train.augmentation", "crop_flip", "fedbug"))
    eval_every: int = param(1, "evaluate the global model every this many rounds (and at the last round)", ge=1)
    target_acc: float = param(0.9, "report: rounds to reach this test accuracy", ge=0, le=1)
    final_window: int = param(5, "report: final accuracy = mean over the last this many evaluations (FedNLR: 5 / 30)",
                              ge=1)


@dataclass
class EngineConfig:
    executor: str = param("sequential", "sequential (reference) | vectorized (torch.func) | auto | distributed "
                          "(the round's clients over the ranks of a torchrun start)", choices=EXECUTORS)
    rank_executor: str = param("sequential", "engine.executor=distributed: the executor each rank trains its share "
                               "with", choices=RANK_EXECUTORS)
    dist_timeout_s: float = param(300.0, "engine.executor=distributed: seconds a rank waits in a collective for the "
                                  "others (the process group's timeout): a frozen or lost rank ends the run within it; "
                                  "must exceed the longest gap between two rounds' collectives (docs/reliability.md)",
                                  gt=0, when=when("engine.executor", "distributed"))
    max_parallel_clients: int = param(0, "vectorized: clients trained at once (0 = all sampled clients)", ge=0)
    population: bool = param(True, "vectorized: an experiment's seeds train as one population, each round's clients "
                             "of every seed in one pass, each seed with its own numbers (false: one seed after "
                             "another; docs/architecture.md, Populations)", when=when("engine.executor", "vectorized",
                                                                                     "auto"))
    device: str = param("cpu", "cpu | cuda | cuda:N | auto (checked in validate)")
    dtype: str = param("float32", "float32 | float64 (slow; for numerical checks)", choices=("float32", "float64"))
    kernels: str = param("native", "CPU kernels: native (PyTorch's choice for this CPU: fastest; the same numbers on "
                         "the same machine) | portable (the same numbers on every x86-64 CPU with AVX2: AVX2 loops, "
                         "MKL's compatible branch, no oneDNN, 1 thread; docs/reliability.md)", choices=KERNELS)
    threads: int = param(1, "torch's CPU threads for the run (0 = PyTorch's default, one per core); 1 keeps a run "
                         "near its idle speed beside other jobs, and portable kernels need it (docs/benchmarks.md, "
                         "Threads)", ge=0)
    float32_precision: str = param("highest", "CUDA float32 arithmetic: highest (true float32 in matrix products and "
                                   "cuDNN convolutions: the default, for reproducible numbers) | high (TF32 allowed in "
                                   "both) | medium (bfloat16 allowed in matrix products, TF32 in convolutions); the "
                                   "levels of torch.set_float32_matmul_precision (docs/scaling.md, On a GPU)",
                                   choices=FLOAT32_PRECISIONS)
    deterministic: bool = param(True, "CUDA: deterministic kernels (cuDNN's deterministic convolutions, "
                                "torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8), so a seed "
                                "repeats its numbers on the same GPU | false: PyTorch's choice, which may differ from "
                                "run to run (docs/scaling.md, On a GPU)")
    checkpoint_every: int = param(10, "rounds; 0 = never", ge=0)
    checkpoint_dir: str = param("checkpoints", "where attempts keep their checkpoints")
    eval_batch_size: int = param(1024, "samples per evaluation batch", ge=1)
    progress: bool = param(True, "a progress bar per experiment, drawn when stderr is a terminal (none in a log file)")
    client_state: str = param("auto", "where per-client rule states live: memory | disk (beside the checkpoint, only "
                              "the round's clients in memory) | auto (disk when all N clients' states exceed 4 GiB)",
                              choices=("memory", "disk", "auto"))


@dataclass
class TrackingConfig:
    enabled: bool = param(True, "log to MLflow")
    experiment: str = param("fl-pipeline", "MLflow experiment")
    log_every: int = param(10, "flush buffered per-round metrics every this many rounds", ge=1)
    log_model: bool = param(True, "each seed's final model as an MLflow model (mlflow.pytorch, name 'model'; the "
                            "parent's tag fl.best_model_uri names the best seed's)", when=when("tracking.enabled", True))
    neuron_drift_samples: int = param(0, "> 0: per-round neuron-drift probe on this many test samples (FedNLR "
                                      "sec. 4)", ge=0)
    drift: int = param(5, "drift measures every this many rounds and at the last (0: never): client drift, update "
                       "dissimilarity, cosine to the mean update (whole model and per layer), local progress; MLflow "
                       "drift/, rounds.csv drift_*", ge=0, integer=True)
    layer_cosine: bool = param(False, "per-round cosine similarity of client updates per layer, mean over client "
                               "pairs")
    client_loss_trace: int = param(0, "> 0: log the local training loss of clients 0..n-1 every round they train",
                                   ge=0)
    detail_metrics: bool = param(False, "also log the per-client and per-layer values (client_loss/<i>, cos_<layer>, "
                                 "*_l<layer>) to MLflow as detail/<key>; they are always in details/seed_<s>.csv",
                                 when=when("tracking.enabled", True))


SECTIONS = {"dataset": DatasetConfig, "partition": PartitionConfig, "model": ModelConfig, "train": TrainConfig,
            "engine": EngineConfig, "tracking": TrackingConfig}  # the sections that are not rules, in check order
