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

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, List, Optional

from .algorithms import registry
from .schema import (SECTIONS, ConfigError, DatasetConfig, EngineConfig, ModelConfig, PartitionConfig,
                     TrackingConfig, TrainConfig, check_fields)
from .schema import check_finite_positive as _finite_positive

AGGREGATIONS = registry.AGGREGATIONS
BASE_ALGORITHMS = registry.names("base")
WRAPPERS = registry.names("wrapper")


def _algorithm_config() -> type:
    """``AlgorithmConfig``: the shared keys, then one field per section of the rule registry."""
    shared = [
        ("name", str, field(default="fedavg")),  # base rule (registry: kind base)
        ("wrappers", List[str], field(default_factory=list)),  # applied inside-out, e.g. [fedbug]
        # weighted: p_i = n_i/n_S | uniform: p_i = 1/|S| | null: the base rule's own (registry.aggregation)
        ("aggregation", Optional[str], field(default=None)),
        ("eta_g", float, field(default=1.0)),  # server learning rate
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
    registry.check_algorithm(cfg.algorithm)
    for name in ("train", "engine", "tracking"):
        check_fields(SECTIONS[name], getattr(cfg, name), name)
    device = str(cfg.engine.device)
    if not (device in ("cpu", "cuda", "auto") or device.startswith("cuda:")):
        raise ConfigError(f"engine.device must be cpu, cuda, cuda:N or auto, got {cfg.engine.device!r}")
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
    if cfg.algorithm.aggregation is None:  # null: the base rule's own way of averaging (registry.aggregation)
        cfg.algorithm.aggregation = registry.aggregation(cfg.algorithm)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_container(cfg) -> dict:
    """A plain-dict copy of a composed config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
