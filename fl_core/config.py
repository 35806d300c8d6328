"""The experiment's config schema, its validation and its composition.

Hydra composes ``conf/`` against :class:`ExperimentConfig` (registered as a structured config), so type errors
are caught at composition time. The schema is assembled from two sources:

- the sections that are not rules (:mod:`fl_core.schema`: dataset, partition, model, train, engine, tracking),
- the rule registry (:mod:`fl_core.algorithms.registry`): ``algorithm`` holds the shared keys (``name``,
  ``wrappers``, ``aggregation``, ``eta_g``, ``server_opt``) and one sub-section per registered parameter dataclass.

Range and choice checks that a type cannot express live in :func:`validate`, which raises :class:`ConfigError`
with a one-line message naming the offending key, e.g. ``partition.alpha must be > 0, got -1``.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .algorithms import registry
from .schema import (DEVICE_DATASETS, FILE_DEVICE_DATASETS, GENERATED_DATASETS, SECTIONS, TEXT_DATASETS, ConfigError,
                     DatasetConfig, EngineConfig, ModelConfig, PartitionConfig, TrackingConfig, TrainConfig,
                     check_cuda_kernels, check_fields, fmt, format_value, select)
from .schema import check_finite_positive as _finite_positive

AGGREGATIONS = registry.AGGREGATIONS
BASE_ALGORITHMS = registry.names("base")
WRAPPERS = registry.names("wrapper")


def _algorithm_config() -> type:
    """``AlgorithmConfig``: the shared keys, then one field per section of the rule registry."""
    shared = [
        ("name", str, field(default="fedavg")),  # base rule (registry: kind base)
        ("wrappers", List[str], field(default_factory=list)),  # applied inside-out, e.g. [fedbug]
        ("transforms", List[str], field(default_factory=list)),  # message transforms in order, e.g. [topk, qsgd]
        # weighted: p_i = n_i/n_S | uniform: p_i = 1/|S| | null: the base rule's own (registry.aggregation)
        ("aggregation", Optional[str], field(default=None)),
        # server learning rate; null: the server step's own. Each replica of a population keeps its own (server side)
        ("eta_g", Optional[float], field(default=None, metadata={"replica": True})),
        # the server optimiser on the base's pseudo-gradient (registry: kind server); sgd: the base's own step
        ("server_opt", str, field(default=registry.NO_SERVER_OPT)),
    ]
    rules = [(sec, schema, field(default_factory=schema)) for sec, schema in registry.sections().items()]
    cls = make_dataclass("AlgorithmConfig", shared + rules)
    cls.__module__ = __name__
    cls.__doc__ = ("The algorithm stack: a base rule optionally wrapped, e.g. FedBug(FedProx); one section per "
                   "registered rule parameter dataclass.")
    return cls


AlgorithmConfig = _algorithm_config()


@dataclass
class ExperimentConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # type: ignore[valid-type]
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    seed: int = 0
    name: Optional[str] = None  # experiment name (results/<name>/); default derived from the config
    results_dir: str = "results"
    data_dir: str = "data"


# --------------------------------------------------------------------------- validation


def validate(cfg: Any) -> None:
    """Check ranges and choices of a composed config (DictConfig or ExperimentConfig).

    Every field of the non-rule sections declares its allowed values (:func:`fl_core.schema.param`) and is
    checked from that declaration, the ``algorithm`` section from the rule registry; what a declaration cannot
    say (a finite Dirichlet alpha, the device string, the experiment name) is checked here.

    Raises:
        ConfigError: one line, naming the first offending key and the allowed range.
    """
    for name in ("dataset", "partition", "model"):
        check_fields(SECTIONS[name], getattr(cfg, name), name)
    _finite_positive("partition.alpha", cfg.partition.alpha, "use partition=iid for an IID split")
    _check_natural(cfg)
    _check_validation_split(cfg)
    registry.check_algorithm(cfg.algorithm)
    for name in ("train", "engine", "tracking"):
        check_fields(SECTIONS[name], getattr(cfg, name), name)
    check_local_work(cfg.train)
    if cfg.dataset.name in (*GENERATED_DATASETS, *TEXT_DATASETS) and cfg.train.augmentation != "none":
        what = "character sequences" if cfg.dataset.name in TEXT_DATASETS else "feature vectors"
        raise ConfigError(f"train.augmentation={cfg.train.augmentation} flips and crops images; "
                          f"dataset={cfg.dataset.name} holds {what} (use train.augmentation=none)")
    if cfg.engine.kernels == "portable" and int(cfg.engine.threads) != 1:
        raise ConfigError(f"engine.threads={cfg.engine.threads}: engine.kernels=portable runs on 1 thread (its sums are "
                          "split the same way on every machine); use engine.threads=1")
    device = str(cfg.engine.device)
    if not (device in ("cpu", "cuda", "auto") or device.startswith("cuda:")):
        raise ConfigError(f"engine.device must be cpu, cuda, cuda:N or auto, got {cfg.engine.device!r}")
    check_cuda_kernels(cfg.engine.float32_precision, bool(cfg.engine.deterministic), device)
    _check_name(cfg.name)
    if not 0 <= int(cfg.seed) < 2**63:  # the seeds derived from it (fl_core.seeding) take 63-bit non-negative keys
        raise ConfigError(f"seed must be an integer in [0, 2**63), got {cfg.seed}")


#: the longest experiment name in bytes (UTF-8): ``results/.<name>.staging`` and ``.locks/<name>.lock.holder`` must
#: stay within the 255 bytes a file name may have
NAME_MAX_BYTES = 200


def _check_name(name: Optional[str]) -> None:
    """``name`` (None: derived from the config) must be a plain folder name: not empty, no ``/``, not starting with
    ``.``, printable characters only (no newline, tab or other control character), at most :data:`NAME_MAX_BYTES`
    bytes in UTF-8.

    Raises:
        ConfigError: one line naming ``name`` (non-printable characters shown escaped).
    """
    if name is None:
        return
    shown = shown_value(name)
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"name must be a plain folder name (no '/', not starting with '.'), got {shown}")
    if not name.isprintable():
        raise ConfigError(f"name must be printable characters only (no newline, tab or other control character), "
                          f"got {shown}")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > NAME_MAX_BYTES:
        raise ConfigError(f"name is {size} bytes long, at most {NAME_MAX_BYTES} are allowed (a folder name on disk); "
                          "choose a shorter name=...")


def shown_value(text: str) -> str:
    """``text`` in quotes for a one-line message, each newline or other non-printable character escaped (``\\n``)."""
    return "'" + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) + "'"


def natural_clients(*, _root_: Any) -> Any:
    """The resolver ``${natural_clients:}`` of conf/partition/natural.yaml: the number of clients of a natural
    partition, ``dataset.max_clients`` for the writer datasets (null: every writer in the files) and
    ``dataset.num_devices`` for the generated ones."""
    d = _root_.dataset
    return d.max_clients if d.name in FILE_DEVICE_DATASETS else d.num_devices


def _check_natural(cfg: Any) -> None:
    """``partition=natural`` needs a dataset made of devices, one client per device.

    Raises:
        ConfigError: another dataset (names ``partition.name``), ``partition.num_clients`` !=
            ``dataset.num_devices`` (``dataset.max_clients`` for femnist and shakespeare; conf/partition/natural.yaml
            derives it; a different value set by hand), or ``partition.size_sigma`` != 0; a ``partition.num_clients``
            of null with another partition.
    """
    if cfg.partition.name != "natural":
        if cfg.partition.num_clients is None:
            raise ConfigError(f"partition.num_clients=null counts the devices of partition=natural; "
                              f"partition={cfg.partition.name} needs a number of clients")
        return
    if cfg.dataset.name not in DEVICE_DATASETS:
        raise ConfigError(f"partition.name=natural needs a dataset made of devices ({', '.join(DEVICE_DATASETS)}), "
                          f"got dataset.name={cfg.dataset.name}")
    if cfg.dataset.name in FILE_DEVICE_DATASETS:
        if cfg.partition.num_clients != cfg.dataset.max_clients:
            who = "writer" if cfg.dataset.name == "femnist" else "speaker"
            raise ConfigError(f"partition.num_clients={format_value(cfg.partition.num_clients)} must equal "
                              f"dataset.max_clients={format_value(cfg.dataset.max_clients)} with partition=natural "
                              f"(one client per {who}; set dataset.max_clients, null for all of them)")
    elif cfg.partition.num_clients is None or int(cfg.partition.num_clients) != int(cfg.dataset.num_devices):
        raise ConfigError(f"partition.num_clients={format_value(cfg.partition.num_clients)} must equal "
                          f"dataset.num_devices={cfg.dataset.num_devices} with partition=natural (one client per "
                          f"device; set dataset.num_devices)")
    if float(cfg.partition.size_sigma) != 0:
        raise ConfigError(f"partition.size_sigma={cfg.partition.size_sigma}: the devices of partition=natural keep "
                          f"their own sizes (set it to 0)")


def _check_validation_split(cfg: Any) -> None:
    """``dataset.validation_fraction`` > 0 holds out a stratified share of the whole training set: refused where that
    is not a clean validation split, one line naming the key: shakespeare (its overlapping 80-character windows would
    put the same text on both sides) and the writers of femnist with ``partition=natural`` (a writer could lose all
    its samples, and its client with them)."""
    if not float(cfg.dataset.validation_fraction or 0.0) > 0:
        return
    if cfg.dataset.name in TEXT_DATASETS:
        raise ConfigError(f"dataset.validation_fraction={fmt(float(cfg.dataset.validation_fraction))}: "
                          f"dataset={cfg.dataset.name}'s examples are overlapping windows of the same text, so a "
                          f"held-out share is not unseen; tune on the test split of other speakers instead (set it to 0)")
    if cfg.dataset.name in FILE_DEVICE_DATASETS and cfg.partition.name == "natural":
        raise ConfigError(f"dataset.validation_fraction={fmt(float(cfg.dataset.validation_fraction))} does not "
                          f"compose with partition=natural on dataset={cfg.dataset.name}: the held-out share is drawn "
                          f"over all writers and may take a writer's every sample (set it to 0)")


def check_local_work(t: Any) -> None:
    """What the ``train`` keys of the local work cannot say one by one (their ranges are checked before).

    Raises:
        ConfigError: one line naming the key: ``train.local_epochs_max`` below ``train.local_epochs``;
            ``train.stragglers`` > 0 with E = 1 (a straggler runs 1..E_i - 1 epochs); drawn epochs or
            stragglers with ``train.local_steps`` > 0 (they are counted in epochs); ``train.momentum`` > 0 with
            ``train.optimizer=adam`` (Adam keeps its own moments).
    """
    drawn = t.local_epochs_max is not None
    if t.local_steps > 0 and (drawn or t.stragglers > 0):
        key = "train.local_epochs_max" if drawn else "train.stragglers"
        raise ConfigError(f"{key} counts local work in epochs; it does not compose with train.local_steps="
                          f"{t.local_steps} (set train.local_steps=0)")
    if drawn and t.local_epochs_max < t.local_epochs:
        raise ConfigError(f"train.local_epochs_max must be >= train.local_epochs ({t.local_epochs}), got "
                          f"{t.local_epochs_max}")
    if t.stragglers > 0 and t.local_epochs < 2:
        raise ConfigError(f"train.stragglers={fmt(float(t.stragglers))} needs train.local_epochs >= 2 (a straggler "
                          f"runs 1..E_i-1 epochs), got train.local_epochs={t.local_epochs}")
    if t.optimizer == "adam" and t.momentum:
        raise ConfigError(f"train.momentum={fmt(float(t.momentum))} does not compose with train.optimizer=adam: "
                          "Adam keeps its own moment estimates (betas 0.9, 0.999); set train.momentum=0")


# --------------------------------------------------------------------------- the keys a user types


@functools.lru_cache(maxsize=None)
def schema_fields() -> Dict[str, Any]:
    """Every key of the schema as a dotted path -> its dataclass field (None for a section such as ``train`` or
    ``algorithm.fedprox``); built once (the schema is fixed when this module is imported). Do not mutate."""
    out: Dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                out[prefix + f.name] = None
                walk(value, prefix + f.name + ".")
            else:
                out[prefix + f.name] = f

    walk(ExperimentConfig(), "")
    return out


@functools.lru_cache(maxsize=None)
def replica_keys() -> tuple:
    """The keys in which the replicas of one population may differ (runs trained in one vectorised pass,
    :mod:`fl_core.engine.population`): every schema field declared ``replica`` (:func:`fl_core.schema.param`), in
    schema order: ``train.lr``, ``train.weight_decay``, ``algorithm.eta_g`` and the rules' replica parameters
    (FedProx's mu, FedBug's P, FedNLR's mu0 / a1 / a2, FedBCGD's lambda, FedDyn's alpha, FedExP's eps, the server
    optimisers' betas and tau). The seed and the experiment's name differ between replicas too."""
    return tuple(k for k, f in schema_fields().items() if f is not None and f.metadata.get("replica"))


def drop_keys(c: Dict[str, Any], keys: Sequence[str]) -> Dict[str, Any]:
    """``c`` (a plain nested dict of a config, :func:`to_container`) without the dotted ``keys`` it holds, changed in
    place and returned; a key whose section ``c`` does not hold is skipped."""
    for key in keys:
        *path, last = key.split(".")
        node: Any = c
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return c


def _is_group(key: str, config_dir: Optional[str]) -> bool:
    """Whether ``key`` of an override ``key=value`` chooses a config group (``algorithm=fedprox``,
    ``+experiment=fedbug_cifar10``) rather than setting a value."""
    from .paths import conf_dir

    return "/" in key or ("." not in key and (Path(config_dir or conf_dir()) / key).is_dir())


def override_keys(overrides: Sequence[str], config_dir: Optional[str] = None) -> List[str]:
    """The value keys that ``overrides`` set, as typed (``+train.rounds=3`` -> ``train.rounds``); config group
    choices, deletions, Hydra's own keys and overrides Hydra cannot parse (compose reports those) are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except HydraException:
        return []
    keys = []
    for o in parsed:
        key = o.key_or_group
        if o.type == OverrideType.DEL or key.split(".")[0] == "hydra" or _is_group(key, config_dir):
            continue
        keys.append(key)
    return keys


def check_known_keys(keys: Sequence[str]) -> None:
    """Every key must be a key of the schema (a section or a field): a typo, with or without ``+``, is refused
    with the closest known key.

    Raises:
        ConfigError: ``unknown key train.roudns (did you mean train.rounds?)``.
    """
    known = schema_fields()
    for key in keys:
        if key in known or "[" in key:
            continue
        close = difflib.get_close_matches(key, [k for k, f in known.items() if f is not None], n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "see fl-train --help for the keys"
        raise ConfigError(f"unknown key {key} ({hint})")


def inactive_keys(cfg: Any, keys: Sequence[str]) -> Dict[str, str]:
    """The keys among ``keys`` that cannot change the composed run ``cfg``, each with the reason in one line.

    A key of a rule section (``algorithm.<section>.*``) is inactive when no rule of the resolved stack (base,
    server optimiser, wrappers) reads that section; any key is inactive when a condition it declares
    (:func:`fl_core.schema.param`'s ``when``) does not hold, e.g. ``algorithm.fedbcgd.lam`` with
    ``algorithm.fedbcgd.momentum=false`` or ``partition.alpha`` with ``partition=shards``.
    """
    known = schema_fields()
    a = cfg.algorithm
    stack = registry.stack(a)
    used = set(registry.stack_sections(stack))
    out: Dict[str, str] = {}
    for key in keys:
        parts = key.split(".")
        if parts[0] == "algorithm" and len(parts) > 1 and parts[1] in registry.sections() and parts[1] not in used:
            out[key] = (f"{key} is not used by this run's rules ({' + '.join(stack)}); to train "
                        f"{registry.section_labels(parts[1])} use {registry.how_to_use(parts[1])}")
            continue
        f = known.get(key)
        for cond in (f.metadata.get("when", ()) if f is not None else ()):
            if not cond.holds(cfg):
                now = format_value(select(cfg, cond.key))
                out[key] = f"{key} has no effect with {cond.key}={now}: it is used only with {cond.text()}; remove it"
                break
    return out


# --------------------------------------------------------------------------- composition

_REGISTERED = False


def _register_schema() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from hydra.core.config_store import ConfigStore

        from omegaconf import OmegaConf

        ConfigStore.instance().store(name="schema", node=ExperimentConfig)
        if not OmegaConf.has_resolver("natural_clients"):
            OmegaConf.register_new_resolver("natural_clients", natural_clients)
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


def _explain_unreadable(err: BaseException, overrides: Sequence[str]) -> Optional[str]:
    """An override Hydra's grammar cannot read unquoted (a non-ASCII letter, a space, a newline: antlr's
    ``LexerNoViableAltException``) -> one line naming it, with the quoted form that works where one does; None for
    other errors."""
    if "LexerNoViableAltException" not in f"{type(err.__cause__).__name__} {str(err)[:60]}":
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides(overrides=[override])
        except Exception:  # noqa: BLE001  (the one Hydra cannot read)
            key, _, value = override.partition("=")
            if not value.isprintable():
                return (f"cannot read the override {shown_value(override)}: a value may not hold a newline, a tab or "
                        "another control character")
            return (f"cannot read the override {shown_value(override)}: Hydra's grammar takes unquoted values of "
                    f"ASCII letters, digits and a few signs only; quote the value, e.g. \"{key}='{value}'\"")
    return None


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


def compose(overrides: List[str] = (), config_dir: Optional[str] = None, user: Optional[Sequence[str]] = None):
    """Compose ``conf/config.yaml`` with Hydra overrides and validate it.

    Every key the user typed must change the run: unknown keys are refused (with the closest known key), and so
    are keys the resolved run does not read (:func:`inactive_keys`). Values that presets set are not the
    user's: only ``user`` (default: all of ``overrides``) is held to that.

    Args:
        overrides: Hydra override strings, e.g. ``["algorithm=fedbug", "train.rounds=5"]``.
        config_dir: folder of the config tree (default: the project's ``conf/``).
        user: the overrides the user typed for this run (a params file's grid passes the experiment's own; its
            shared sections are checked over the whole grid instead, :meth:`pipeline.grid.Grid.compose_all`).

    Returns:
        The composed, read-only ``DictConfig`` (schema :class:`ExperimentConfig`), with ``algorithm.aggregation``
        and ``algorithm.eta_g`` resolved to the rules' own where they were null.

    Raises:
        ConfigError: a one-line message naming the offending key (unknown key, wrong type, out of range, a key
            the run does not use).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .paths import conf_dir

    _register_schema()
    typed = override_keys(overrides, config_dir)
    check_known_keys(typed)
    try:
        with initialize_config_dir(config_dir=str(config_dir or conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(_explain_unreadable(err, overrides) or _explain_missing_option(_one_line(err), config_dir)) from None
    validate(cfg)
    if cfg.algorithm.aggregation is None:  # null: the base rule's own way of averaging (registry.aggregation)
        cfg.algorithm.aggregation = registry.aggregation(cfg.algorithm)
    if cfg.algorithm.eta_g is None:  # null: the server step's own (registry.eta_g)
        cfg.algorithm.eta_g = registry.eta_g(cfg.algorithm)
    unused = inactive_keys(cfg, typed if user is None else override_keys(user, config_dir))
    if unused:
        raise ConfigError(next(iter(unused.values())))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_container(cfg) -> dict:
    """A plain-dict copy of a composed config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
