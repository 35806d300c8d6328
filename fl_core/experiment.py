"""One experiment resolved once: its name, the fingerprint of what determines its numbers, its rule stack, its data
and partition keys, and its per-seed configs, in one frozen :class:`ResolvedExperiment`.

:func:`resolve` builds it from the composed configs (:func:`fl_core.config.compose`, one per seed); the train stage
(:mod:`pipeline.train`), the Python API (:mod:`pipeline.api`), the sweeps (:mod:`sweeps.runner`) and the engine's
factory (:func:`fl_core.engine.factory.build_simulator`) read it and derive none of it again. The fingerprint is
computed here and nowhere else (:func:`fingerprint`): it names an experiment's checkpoints
(``<checkpoint_dir>/<name>/<fingerprint>/``), its MLflow parent (tag ``fl.fingerprint``) and, with the seed, a
seed's job between the ranks of ``engine.executor=distributed``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

from .algorithms import registry
from .config import ConfigError, to_container
from .schema import LATE_KEYS

RESULT_SECTIONS = ("dataset", "partition", "model", "algorithm", "train", "seed")  # what determines the numbers


def derive_name(cfg: Any) -> str:
    """A readable default experiment name from the rule stack, e.g. ``fedbug-p0.2-fedavg_dirichlet-a0.3_digits``:
    the base; a server optimiser over the reference base as its preset (FedAvg + adam is ``fedadam``), over another
    base before it (``adam-fedprox``); each wrapper, innermost first, then each message transform, before what it
    wraps (``topk-fedavg``), with the parameters its rule declares for names
    (:func:`fl_core.algorithms.registry.name_parts`); then the partition and the dataset."""
    a = cfg.algorithm
    algo = a.name
    if a.server_opt != registry.NO_SERVER_OPT:
        opt = registry.get(a.server_opt)
        algo = opt.preset_name if a.name == registry.REFERENCE_BASE else f"{a.server_opt}-{algo}"
    for w in [*a.wrappers, *(a.transforms or [])]:  # message transforms apply last, so they come first
        algo = "-".join(registry.name_parts(a, w) + [algo])
    part = cfg.partition.name
    if part == "dirichlet":
        part += f"-a{cfg.partition.alpha:g}"
    elif part == "shards":
        part += f"-s{cfg.partition.classes_per_client}"
    return f"{algo}_{part}_{cfg.dataset.name}"


def result_sections(cfg: Any) -> Dict[str, Any]:
    """The config sections that determine a run's numbers: ``algorithm`` with only the sections of the rules in its
    stack (``registry.trim_sections``), so adding a rule changes no other fingerprint; ``engine.kernels`` when it is
    ``portable`` (other numbers than native kernels': a run switched to portable kernels trains again instead of
    continuing the native one; native runs keep their fingerprints); ``engine.float32_precision`` when it allows
    TF32 or bfloat16 (likewise); the seed. A key added after fingerprints were pinned (:data:`~fl_core.schema.LATE_KEYS`:
    the quadratic problem's, the writer datasets', ``partition.balance_cap``) counts only where its condition holds,
    so the results written before it existed keep their fingerprints."""
    c = to_container(cfg)
    c["algorithm"] = registry.trim_sections(c["algorithm"])
    late = [key for key, cond in LATE_KEYS.items() if not cond.holds(c)]  # decided on the whole config first
    for key in late:
        section, name = key.split(".")
        c[section].pop(name, None)
    out = {k: c[k] for k in RESULT_SECTIONS}
    if c["engine"]["kernels"] != "native":
        out["kernels"] = c["engine"]["kernels"]
    if c["engine"].get("float32_precision", "highest") != "highest":
        out["float32_precision"] = c["engine"]["float32_precision"]
    return out


def fingerprint(cfg: Any) -> str:
    """The experiment's fingerprint: a short hash (12 hex digits of SHA-256 over the sorted JSON) of
    :func:`result_sections` without the seed, so every seed of an experiment shares it."""
    sections = result_sections(cfg)
    sections.pop("seed")
    # message transforms were the last wrappers before they had a list of their own, with the same numbers: fold
    # them back so a compression run keeps the fingerprint its results were written under
    algo = sections["algorithm"]
    if algo.get("transforms"):
        algo["wrappers"] = [*algo["wrappers"], *algo.pop("transforms")]
    blob = json.dumps(sections, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True)
class ResolvedExperiment:
    """What one experiment is, resolved once from its composed configs (:func:`resolve`).

    Attributes:
        name: ``cfg.name``, or the default :func:`derive_name` (``results/<name>/``, the MLflow parent's name).
        fingerprint: :func:`fingerprint` of the first seed's config (every seed's is the same).
        rules: the rule stack: base, server optimiser unless ``sgd``, wrappers innermost first (``registry.stack``).
        dataset: ``dataset.name``; dataset_tag: the dataset variant's name in files (``fl_core.data.dataset_tag``).
        partition_key: the partition's key (``fl_core.data.partition_key``; MLflow tag ``partition``).
        model: the model's resolved name (``model=auto`` resolved for the dataset).
        seeds: the run seeds, in the order they train.
        configs: the composed config of each seed, in the order of ``seeds``.
    """

    name: str
    fingerprint: str
    rules: Tuple[str, ...]
    dataset: str
    dataset_tag: str
    partition_key: str
    model: str
    seeds: Tuple[int, ...]
    configs: Tuple[Any, ...]

    @property
    def cfg0(self) -> Any:
        """The first seed's config (what every seed shares, besides ``seed``)."""
        return self.configs[0]

    def job_key(self, seed: int) -> Tuple[str, int]:
        """What identifies one seed's run to the ranks of ``engine.executor=distributed``: (fingerprint, seed). Every
        rank composes the same command, so every rank computes the same key."""
        return self.fingerprint, int(seed)


def resolve(cfgs: Sequence[Any]) -> ResolvedExperiment:
    """Resolve one experiment from its composed configs (one per seed, which differ only in ``seed``).

    Raises:
        ConfigError: no config.
    """
    from .data import dataset_tag, partition_key  # the data and model packages load torch: at run time only
    from .models import resolve_model_name

    if not cfgs:
        raise ConfigError("an experiment needs at least one seed's config")
    cfg0 = cfgs[0]
    tag = dataset_tag(cfg0.dataset)
    return ResolvedExperiment(
        name=cfg0.name or derive_name(cfg0), fingerprint=fingerprint(cfg0), rules=tuple(registry.stack(cfg0.algorithm)),
        dataset=str(cfg0.dataset.name), dataset_tag=tag, partition_key=partition_key(cfg0.partition, tag),
        model=resolve_model_name(cfg0.model.name, cfg0.dataset.name), seeds=tuple(int(c.seed) for c in cfgs),
        configs=tuple(cfgs))


def population_key(cfg: Any) -> str:
    """What the runs of one population must share, as a string: the whole config (:func:`fl_core.config.compose`)
    but the experiment's name, the seed and the keys a replica carries itself (:func:`fl_core.config.replica_keys`:
    eta_l, the weight decay, eta_g, the rules' replica parameters). Two configs with the same key can train in one
    vectorised pass (:mod:`fl_core.engine.population`) where their executor allows it; ``fl-train -m`` and the
    sweeps' batches group by it."""
    from .config import drop_keys, replica_keys

    return json.dumps(drop_keys(to_container(cfg), ("name", "seed", *replica_keys())), sort_keys=True, default=str)
