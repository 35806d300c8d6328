"""Optuna sweeps over the FL pipeline: ``python sweeps/tune.py --space NAME --n-trials N [OVERRIDES]``.

One trial = one configuration sampled from a search space (``sweeps/spaces/<name>.yaml``, schema
below), trained for ``--seeds K`` seeds (``seed=1..K``) on the digits default or any experiment
given by Hydra overrides. The objective is the validation accuracy: with
``dataset.validation_fraction=0.2`` the core holds out a stratified 20 % of the training set and
every ``test_*`` metric of the simulator is measured on it (logged here as ``val_*``). A trial's
value is the mean over seeds of the mean of the last ``train.final_window`` evaluations. The test
set is touched once, at the end: the best configuration is retrained with
``dataset.validation_fraction=0`` and its test accuracy reported as ``best_test_acc``.

Search-space schema (validated on load; errors name the file and the key)::

    description: free text
    base: [algorithm=fedbug, train.rounds=20]   # Hydra overrides applied before the sampled values
    params:                                      # override key -> distribution
      algorithm.fedbug.gu_percentage: {type: float, low: 0.0, high: 1.0}
      train.lr: {type: float, low: 0.01, high: 0.3, log: true}      # optional: log, step
      algorithm.fedbcgd.blocks: {type: int, low: 1, high: 3}
      algorithm.name: {type: categorical, choices: [fedavg, fedprox]}
    conditional:                                 # parameters sampled only when a categorical of
      algorithm:                                 # `params` takes a given value
        fedbug: {base: [...], params: {...}}

Precedence of overrides (later wins): ``dataset.validation_fraction=0.2``, the space's ``base``,
the base of the chosen conditional branch, the command-line overrides, the sampled values, and the
fixed trial settings (no checkpoints, no progress bar, no MLflow from the engine; the sweep logs).

Pruning: each evaluated round reports its validation accuracy with
``step = seed_index * train.rounds + round`` (seed 1's rounds first, then seed 2's, ...), so a
pruner compares trials at the same seed and round and keeps pruning through every seed.
Multi-objective studies do not prune. Two more outcomes end a trial as PRUNED, with the reason in
the trial's user attribute ``reason`` and the MLflow tag ``failure_reason``: a run whose loss
becomes non-finite (``RunFailed``: "diverged") and a sampled combination that a rule rejects
(a ``ValueError`` naming a key, e.g. FedBug's code schedule with P * K_i < M: "infeasible").
Optuna's samplers ignore FAIL trials but rank PRUNED ones below every finished trial, so the
search learns to avoid such regions; the study continues. FAIL is left for Ctrl-C and errors.

Outputs (``sweeps/results/<study>/`` or ``--out``): ``best.yaml`` (params.yaml grid format:
``python -m pipeline.train --grid <study>_best --params best.yaml``), ``summary.md``,
``summary.json``, ``trials.csv`` and PNG plots, also artifacts of the study's MLflow parent run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script (python sweeps/tune.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from fl_core.config import ConfigError
from fl_core.paths import project_root

SPACES_DIR = Path(__file__).resolve().parent / "spaces"
VALIDATION_FRACTION = 0.2
# settings of every trial run: the sweep logs to MLflow itself and never resumes a trial
TRIAL_FIXED = ("engine.checkpoint_every=0", "engine.progress=false", "tracking.enabled=false")
OBJECTIVES = {"acc": "maximize", "uplink": "minimize"}  # uplink: cumulative floats per client, in units of d
SAMPLERS = ("tpe", "cmaes", "gp", "random", "nsga2")
EXIT_INTERRUPTED = 130


# =========================================================================== search spaces


class SpaceError(ValueError):
    """A search-space file is malformed; the one-line message names the file and the key."""


@dataclass(frozen=True)
class Param:
    """One searched override: ``kind`` float | int | categorical (Optuna's suggest_* of that kind)."""

    key: str
    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: Tuple[Any, ...] = ()

    def suggest(self, trial) -> Any:
        """The value ``trial`` samples (or was enqueued with) under the name ``self.key``."""
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_categorical(self.key, list(self.choices))

    def corners(self) -> Tuple[Any, Any]:
        """The two extreme values (low/high, or the first/last choice) for validating a space."""
        if self.kind == "categorical":
            return self.choices[0], self.choices[-1]
        cast = int if self.kind == "int" else float
        return cast(self.low), cast(self.high)


@dataclass
class Branch:
    """What a conditional value adds: overrides (``base``) and parameters."""

    base: List[str] = field(default_factory=list)
    params: Dict[str, Param] = field(default_factory=dict)


@dataclass
class Space:
    """A loaded, validated search space (see the module docstring for the YAML schema)."""

    name: str
    path: Path
    description: str
    base: List[str]
    params: Dict[str, Param]
    conditional: Dict[str, Dict[Any, Branch]] = field(default_factory=dict)

    def keys(self) -> List[str]:
        """Every override key the space may sample, conditional ones included."""
        out = list(self.params)
        for branches in self.conditional.values():
            for br in branches.values():
                out += [k for k in br.params if k not in out]
        return out

    def sample(self, trial) -> Tuple[List[str], Dict[str, Any]]:
        """Sample one configuration.

        Returns:
            (the overrides of the chosen conditional branches, {override key: sampled value}).
        """
        values = {key: p.suggest(trial) for key, p in self.params.items()}
        extra: List[str] = []
        for key, branches in self.conditional.items():
            branch = branches.get(values[key])
            if branch is not None:
                extra += branch.base
                values.update({k: p.suggest(trial) for k, p in branch.params.items()})
        return extra, values

    def corner_configs(self) -> Iterator[Tuple[str, List[str], List[str]]]:
        """(label, branch overrides, sampled overrides) of the configurations that :func:`check_space`
        composes: every parameter at its low and at its high end, and each categorical choice once."""
        paths: List[Tuple[str, Dict[str, Any], Optional[Branch]]] = [("", {}, None)]
        for key, branches in self.conditional.items():
            paths += [(f"{key}={format_value(v)}: ", {key: v}, branches.get(v)) for v in self.params[key].choices]
        for label, forced, branch in paths:
            params = {**self.params, **(branch.params if branch else {})}
            extra = branch.base if branch else []

            def at(end: int, fixed: Optional[Dict[str, Any]] = None) -> List[str]:
                values = {k: p.corners()[end] for k, p in params.items()}
                values.update(forced)
                values.update(fixed or {})
                return [make_override(k, v) for k, v in values.items()]

            for end, name in ((0, "low"), (1, "high")):
                yield f"{label}every parameter at its {name} end", extra, at(end)
            for key, p in params.items():
                if p.kind == "categorical" and key not in forced:
                    for c in p.choices[1:-1]:
                        yield f"{label}{key}={format_value(c)}", extra, at(0, {key: c})


_KEY = re.compile(r"^\+{0,2}[A-Za-z_][\w\-]*(\.[A-Za-z_][\w\-]*)*$")
_SPEC_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
              "categorical": {"type", "choices"}}


def _number(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or value is None:
        raise SpaceError(f"{where}: {name} must be a number, got {value!r}")
    try:
        return float(value)  # YAML reads 1e-4 (no dot) as text: accept it
    except (TypeError, ValueError):
        raise SpaceError(f"{where}: {name} must be a number, got {value!r}") from None


def _parse_param(where: str, key: str, spec: Any) -> Param:
    if not _KEY.match(str(key)):
        raise SpaceError(f"{where}: {key!r} is not a config key (e.g. train.lr or algorithm)")
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: must be a mapping like {{type: float, low: 0.0, high: 1.0}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in _SPEC_KEYS:
        raise SpaceError(f"{where}.type must be one of float, int, categorical, got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        raise SpaceError(f"{where}: unknown field {unknown[0]!r} for type {kind} "
                         f"(allowed: {', '.join(sorted(_SPEC_KEYS[kind]))})")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{where}.choices must be a non-empty list, got {choices!r}")
        for c in choices:
            if not (c is None or isinstance(c, (bool, int, float, str))):
                raise SpaceError(f"{where}.choices: {c!r} is not a scalar (write a list as a string, e.g. "
                                 f"'[fednlr,fedbug]')")
        if len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{where}.choices has duplicates: {choices!r}")
        return Param(str(key), kind, choices=tuple(choices))
    for name in ("low", "high"):
        if name not in spec:
            raise SpaceError(f"{where}: {name} is missing")
    low, high = _number(where, "low", spec["low"]), _number(where, "high", spec["high"])
    if kind == "int" and not (low.is_integer() and high.is_integer()):
        raise SpaceError(f"{where}: low and high of an int must be integers, got {spec['low']!r}, {spec['high']!r}")
    if not low < high:
        raise SpaceError(f"{where}: low must be < high, got low={spec['low']!r} high={spec['high']!r}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{where}.log must be true or false, got {log!r}")
    if log and low <= 0:
        raise SpaceError(f"{where}: a log scale needs low > 0, got {spec['low']!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(where, "step", step)
        if step <= 0 or (kind == "int" and not step.is_integer()):
            raise SpaceError(f"{where}.step must be a positive {'integer' if kind == 'int' else 'number'}, "
                             f"got {spec['step']!r}")
        if log:
            raise SpaceError(f"{where}: step and log cannot be combined (Optuna)")
    return Param(str(key), kind, low, high, log, step)


def _parse_overrides(where: str, value: Any) -> List[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and ("=" in v or v.startswith("~"))
                                              for v in value):
        raise SpaceError(f"{where} must be a list of Hydra overrides like [algorithm=fedbug, train.rounds=20], "
                         f"got {value!r}")
    return list(value)


def _parse_params(where: str, value: Any) -> Dict[str, Param]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpaceError(f"{where} must map override keys to distributions, got {value!r}")
    return {str(k): _parse_param(f"{where}.{k}", k, v) for k, v in value.items()}


def space_path(ref: str) -> Path:
    """``ref`` is a file (``.yaml``/``.yml`` or an existing path) or the name of ``sweeps/spaces/<ref>.yaml``."""
    p = Path(ref)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return SPACES_DIR / f"{ref}.yaml"


def _display(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_space(ref: str) -> Space:
    """Read and validate a search space.

    Args:
        ref: a space name (``fedbug`` -> ``sweeps/spaces/fedbug.yaml``) or a YAML file path.

    Raises:
        SpaceError: one line naming the file and the offending key (missing file, unknown field,
            low >= high, a conditional on a non-categorical, a value that is not a choice, ...).
    """
    path = space_path(ref)
    shown = _display(path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        raise SpaceError(f"{shown}: no such search space (names: {known}; or give a YAML file)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpaceError(f"{shown}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise SpaceError(f"{shown}: must be a mapping with params (and description, base, conditional)")
    unknown = sorted(set(raw) - {"description", "base", "params", "conditional"})
    if unknown:
        raise SpaceError(f"{shown}: unknown top-level key {unknown[0]!r} (allowed: description, base, params, "
                         "conditional)")
    base = _parse_overrides(f"{shown}: base", raw.get("base"))
    params = _parse_params(f"{shown}: params", raw.get("params"))
    if not params:
        raise SpaceError(f"{shown}: params is empty (nothing to search)")
    conditional: Dict[str, Dict[Any, Branch]] = {}
    cond = raw.get("conditional") or {}
    if not isinstance(cond, dict):
        raise SpaceError(f"{shown}: conditional must map a categorical of params to its values, got {cond!r}")
    seen: Dict[str, Param] = dict(params)
    for key, branches in cond.items():
        where = f"{shown}: conditional.{key}"
        p = params.get(str(key))
        if p is None or p.kind != "categorical":
            raise SpaceError(f"{where}: {key!r} must be a categorical of params")
        if not isinstance(branches, dict):
            raise SpaceError(f"{where} must map values of {key} to {{base: [...], params: {{...}}}}")
        conditional[str(key)] = {}
        for value, br in branches.items():
            bwhere = f"{where}.{value}"
            if value not in p.choices:
                raise SpaceError(f"{bwhere}: {value!r} is not one of the choices of {key} {list(p.choices)}")
            br = br or {}
            if not isinstance(br, dict) or set(br) - {"base", "params"}:
                raise SpaceError(f"{bwhere}: a branch holds only base and params, got {br!r}")
            branch = Branch(_parse_overrides(f"{bwhere}.base", br.get("base")),
                            _parse_params(f"{bwhere}.params", br.get("params")))
            for k, bp in branch.params.items():
                if k in params:
                    raise SpaceError(f"{bwhere}.params.{k}: already a top-level parameter")
                if k in seen and seen[k] != bp:  # Optuna: one name, one distribution
                    raise SpaceError(f"{bwhere}.params.{k}: defined differently in another branch "
                                     "(a parameter name must keep one distribution)")
                seen[k] = bp
            conditional[str(key)][value] = branch
    desc = str(raw.get("description") or "").strip()
    return Space(path.stem, path, desc, base, params, conditional)


def check_space(space: Space, overrides: Sequence[str]) -> Any:
    """Compose the space's extreme configurations with ``overrides`` so that an unknown key or an
    out-of-range value stops the sweep before any trial.

    Returns:
        The composed base configuration (the space's ``base`` + ``overrides``, nothing sampled).

    Raises:
        SpaceError: a command-line override sets a searched key, or a configuration does not
            compose (the message names the file, the configuration and the config key).
    """
    from fl_core.config import compose

    tuned = set(space.keys())
    for ov in overrides:
        if override_key(ov) in tuned:
            raise SpaceError(f"{override_key(ov)} is searched by {_display(space.path)}: remove {ov!r} from "
                             "the overrides (or from the space)")
    head = [f"dataset.validation_fraction={VALIDATION_FRACTION}"] + space.base
    try:
        base_cfg = compose(merge_overrides(head, overrides))
    except ConfigError as err:
        raise SpaceError(f"{_display(space.path)}: base + overrides: {err}") from None
    for label, extra, sampled in space.corner_configs():
        try:
            compose(merge_overrides(head, extra, overrides, sampled))
        except ConfigError as err:
            raise SpaceError(f"{_display(space.path)}: {label}: {err}") from None
    return base_cfg


# =========================================================================== overrides


def format_value(v: Any) -> str:
    """A Python value as Hydra override text: ``True`` -> ``true``, ``None`` -> ``null``, floats
    exactly (repr), lists as ``[a,b]``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    return str(v)


def make_override(key: str, value: Any) -> str:
    return f"{key}={format_value(value)}"


def override_key(ov: str) -> str:
    """``'++train.lr=0.1'`` -> ``'train.lr'`` (prefixes +, ++ and ~ dropped)."""
    return ov.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: Sequence[str]) -> List[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one."""
    out: "OrderedDict[str, str]" = OrderedDict()
    for group in groups:
        for ov in group:
            key = override_key(ov)
            out.pop(key, None)
            out[key] = ov
    return list(out.values())


def _typed(text: str) -> Any:
    """Override text -> a YAML value that renders back to the same text (else the text itself)."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, (bool, int, float, list)) or v is None:
        return v if format_value(v) == text else text
    return text


def overrides_mapping(overrides: Sequence[str]) -> Dict[str, Any]:
    """``["train.lr=0.1", "partition=dirichlet"]`` -> ``{"train.lr": 0.1, "partition": "dirichlet"}``
    (the experiment-entry format of params.yaml, see :mod:`pipeline.grid`)."""
    out: Dict[str, Any] = {}
    for ov in overrides:
        k, _, v = ov.partition("=")
        out[k] = _typed(v)
    return out


# =========================================================================== settings, storage, sampler


@dataclass
class Settings:
    """Everything a worker process needs to run trials (picklable: sent to spawned workers)."""

    space: str  # the space file
    overrides: List[str]  # command-line Hydra overrides
    seeds: List[int]
    objectives: List[str]
    study_name: str
    storage: str  # URL or journal file path
    sampler: str = "tpe"
    sampler_seed: Optional[int] = None
    pruner: str = "median"
    experiment: Optional[str] = None  # MLflow experiment; None: no MLflow
    parent_run_id: Optional[str] = None
    threads: int = 1
    timeout: Optional[float] = None
    quiet: bool = False

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1

    def directions(self) -> List[str]:
        return [OBJECTIVES[o] for o in self.objectives]


def default_storage(study_name: str) -> str:
    """The journal file that keeps a study by default: ``sweeps/studies/<study>.log`` (gitignored)."""
    return str(project_root() / "sweeps" / "studies" / f"{study_name}.log")


def open_storage(spec: str):
    """An Optuna storage: an RDB URL (``postgresql://``, ``sqlite:///``, ``mysql://``) as is, else a
    journal file (parent folders created), safe for several processes on one machine."""
    if "://" in spec:
        return spec
    path = Path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


def make_sampler(name: str, seed: Optional[int], multi: bool, conditional: bool):
    """The Optuna sampler ``name`` (one of :data:`SAMPLERS`).

    TPE is multivariate with constant liar (parallel workers); ``group`` decomposition is switched
    on for spaces with conditional parameters.

    Raises:
        ValueError: CMA-ES with several objectives.
    """
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=conditional, constant_liar=True)
    if name == "cmaes":
        if multi:
            raise ValueError("--sampler cmaes handles one objective only (use tpe, nsga2, gp or random)")
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


def parse_pruner(spec: str) -> Tuple[str, Optional[float]]:
    """``median`` | ``hyperband`` | ``none`` | ``threshold:X`` (prune when val_acc < X) -> (kind, X).

    Raises:
        ValueError: anything else.
    """
    if spec in ("median", "hyperband", "none"):
        return spec, None
    if spec.startswith("threshold:"):
        try:
            x = float(spec.split(":", 1)[1])
        except ValueError:
            x = float("nan")
        if 0.0 <= x <= 1.0:
            return "threshold", x
    raise ValueError(f"--pruner must be median, hyperband, none or threshold:X (X in [0, 1]), got {spec!r}")


def make_pruner(spec: str, rounds: int, num_seeds: int, multi: bool):
    """The pruner for reports at steps 1 .. num_seeds * rounds (see the module docstring).

    median: no pruning before 5 trials finished nor in the first third of seed 1's rounds;
    hyperband: resources from rounds // 4 to num_seeds * rounds steps, reduction factor 3;
    threshold:X: prune as soon as an evaluated validation accuracy is below X (after the same
    warm-up as median). Multi-objective studies get no pruner.
    """
    import optuna

    kind, x = parse_pruner(spec)
    warmup = max(0, rounds // 3)
    if multi or kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=warmup)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, rounds // 4), max_resource=num_seeds * rounds,
                                              reduction_factor=3)
    return optuna.pruners.ThresholdPruner(lower=x, n_warmup_steps=warmup)


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def load_study(settings: Settings, worker: int = 0):
    """The study of ``settings`` with this process's sampler (seeded ``sampler_seed + worker``) and pruner."""
    import optuna

    _quiet_optuna()
    space = load_space(settings.space)
    base_rounds = settings_rounds(settings, space)
    seed = None if settings.sampler_seed is None else settings.sampler_seed + worker
    return optuna.load_study(study_name=settings.study_name, storage=open_storage(settings.storage),
                             sampler=make_sampler(settings.sampler, seed, settings.multi, bool(space.conditional)),
                             pruner=make_pruner(settings.pruner, base_rounds, len(settings.seeds), settings.multi))


def settings_rounds(settings: Settings, space: Space) -> int:
    from fl_core.config import compose

    head = [f"dataset.validation_fraction={VALIDATION_FRACTION}"] + space.base
    return int(compose(merge_overrides(head, settings.overrides)).train.rounds)


# =========================================================================== training


class DataCache:
    """Dataset, partition and device tensors per (dataset, partition, device) config, kept for the
    last ``size`` combinations of this process (trials differ mostly in algorithm settings)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._items: "OrderedDict[str, tuple]" = OrderedDict()

    def get(self, cfg) -> tuple:
        """(dataset, partition, client data, device) of ``cfg``; raises what the data loaders raise."""
        from fl_core.config import to_container
        from fl_core.engine.factory import DTYPES, client_data
        from pipeline.common import dataset_for, partition_for, resolve_device

        c = to_container(cfg)
        key = json.dumps([c["dataset"], c["partition"], c["data_dir"], c["engine"]["device"], c["engine"]["dtype"]],
                         sort_keys=True)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        device = resolve_device(cfg.engine.device)
        ds = dataset_for(cfg, write_cache=False)
        part = partition_for(cfg, ds, write_cache=False)
        item = (ds, part, client_data(ds, part, device, DTYPES[cfg.engine.dtype]), device)
        self._items[key] = item
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return item


class InfeasibleConfig(RuntimeError):
    """A sampled configuration is infeasible: it does not compose, the simulator cannot be built,
    or a rule rejects it once running (``ValueError`` naming a key, e.g. FedBug's code schedule
    with P * K_i < M). The trial ends PRUNED with this reason and the study continues."""


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@dataclass
class SeedsResult:
    """Outcome of training one configuration for several seeds."""

    final_acc: List[float]  # per seed: mean of the last train.final_window evaluations (fraction)
    uplink_d: float  # cumulative uplink floats per client after the last round, in units of d (model size)
    algorithm: str  # the algorithm stack, e.g. fedbug[P=0.2](fedavg)

    @property
    def mean_acc(self) -> float:
        return sum(self.final_acc) / len(self.final_acc)


def train_seeds(overrides: Sequence[str], seeds: Sequence[int], cache: DataCache,
                on_round: Optional[Callable[[int, int, Dict[str, float]], None]] = None,
                on_config: Optional[Callable[[Dict[str, Any], str], None]] = None) -> SeedsResult:
    """Train ``overrides`` (experiment overrides, no seed) once per seed.

    Args:
        overrides: Hydra overrides of the experiment; :data:`TRIAL_FIXED` and ``seed=s`` are appended.
        seeds: run seeds, e.g. [1, 2, 3].
        cache: the process's :class:`DataCache`.
        on_round: called as ``on_round(seed_index, round, row)`` after every round (``row`` as the
            simulator's history rows: ``test_acc``/``test_loss`` on evaluated rounds, ``train_loss``,
            ``comm_up_floats``, ...); it may raise ``optuna.TrialPruned``.
        on_config: called once, before training, with the first seed's composed config (plain dict)
            and the algorithm stack's description.

    Raises:
        InfeasibleConfig: see :class:`InfeasibleConfig`.
        fl_core.engine.simulator.RunFailed: a run's loss became non-finite.
    """
    from fl_core.config import compose, to_container
    from fl_core.engine import factory
    from fl_core.metrics import summarize_run

    accs: List[float] = []
    uplink, algo = 0.0, ""
    for i, seed in enumerate(seeds):
        try:
            cfg = compose(merge_overrides(overrides, TRIAL_FIXED, [f"seed={seed}"]))
            ds, part, data, device = cache.get(cfg)
            callbacks = [] if on_round is None else [lambda r, row, i=i: on_round(i, r, row)]
            sim = factory.build_simulator(cfg, ds, part, device=device, data=data, callbacks=callbacks)
        except (ConfigError, ValueError) as err:
            raise InfeasibleConfig(_first_line(err)) from None
        if i == 0:
            algo = sim.algo.describe()
            if on_config is not None:
                on_config(to_container(cfg), algo)
        try:
            result = sim.run()
        except ValueError as err:
            raise InfeasibleConfig(_first_line(err)) from None
        accs.append(float(summarize_run(result.history, cfg.train.target_acc, cfg.train.final_window)["final_acc"]))
        uplink = float(result.history[-1]["comm_up_floats"]) / sim.spec.d
    return SeedsResult(accs, uplink, algo)


@dataclass
class Outcome:
    """How a trial ended: Optuna state name, objective values (COMPLETE only) and a reason."""

    state: str
    values: Optional[List[float]] = None
    reason: str = ""


def _metrics(row: Dict[str, float], prefix: str) -> Dict[str, float]:
    out = {k: row[k] for k in ("train_loss", "comm_up_floats", "round_time_s") if k in row}
    if "test_acc" in row:
        out[f"{prefix}_acc"], out[f"{prefix}_loss"] = row["test_acc"], row["test_loss"]
    return out


class TrialRunner:
    """Runs one Optuna trial: sample, train every seed (reporting for pruning), log to MLflow."""

    def __init__(self, settings: Settings, tracking=None, worker: int = 0):
        self.settings = settings
        self.space = load_space(settings.space)
        self.tracking = tracking
        self.worker = worker
        self.cache = DataCache()

    def experiment_overrides(self, trial) -> List[str]:
        """Sample ``trial`` and return its experiment overrides (validation split on, no seed)."""
        extra, values = self.space.sample(trial)
        return merge_overrides([f"dataset.validation_fraction={VALIDATION_FRACTION}"], self.space.base, extra,
                               self.settings.overrides, [make_override(k, v) for k, v in values.items()])

    def _logger(self, trial, overrides: List[str]):
        if self.tracking is None:
            return None
        s = self.settings
        tags = {"sweep_role": "trial", "optuna_study": s.study_name, "optuna_trial": str(trial.number),
                "space": self.space.name, "worker": str(self.worker)}
        params = {**{f"optuna.{k}": v for k, v in trial.params.items()}, "sweep.overrides": " ".join(overrides),
                  "sweep.seeds": ",".join(map(str, s.seeds))}
        logger = self.tracking.child_logger(s.parent_run_id, f"{s.study_name}/trial-{trial.number}", tags,
                                            params, log_every=1_000_000)  # buffered: written at close
        logger.open(None)
        return logger

    def __call__(self, trial) -> Outcome:
        """Run ``trial``; KeyboardInterrupt propagates after its MLflow run is closed as KILLED."""
        import optuna

        from fl_core.engine.simulator import RunFailed
        from fl_core.tracking import flatten

        s = self.settings
        t0 = time.perf_counter()
        overrides = self.experiment_overrides(trial)
        trial.set_user_attr("overrides", overrides)
        trial.set_user_attr("worker", self.worker)
        logger = self._logger(trial, overrides)
        rounds = {"R": 1}

        def on_config(cfg: Dict[str, Any], algo: str) -> None:
            rounds["R"] = int(cfg["train"]["rounds"])
            trial.set_user_attr("algorithm", algo)
            if logger is not None:
                skip = {"seed"}
                self.tracking.log_params(logger.run_id, {k: v for k, v in flatten(cfg).items() if k not in skip})
                self.tracking.client.set_tag(logger.run_id, "algorithm", algo)

        def on_round(i: int, r: int, row: Dict[str, float]) -> None:
            step = i * rounds["R"] + r
            if logger is not None:
                logger.log_round(step, _metrics(row, "val"))
            if "test_acc" in row and not s.multi:
                trial.report(float(row["test_acc"]), step)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"val_acc {row['test_acc']:.4f} at seed {s.seeds[i]} round {r} "
                                             f"(step {step})")

        def finish(outcome: Outcome, status: str) -> Outcome:
            trial.set_user_attr("duration_s", round(time.perf_counter() - t0, 3))
            if outcome.reason:
                trial.set_user_attr("reason", outcome.reason)
            if logger is not None:
                self.tracking.client.set_tag(logger.run_id, "optuna_state", outcome.state)
                logger.close(status, outcome.reason or None)
            return outcome

        try:
            res = train_seeds(overrides, s.seeds, self.cache, on_round=on_round, on_config=on_config)
        except optuna.TrialPruned as err:
            return finish(Outcome("PRUNED", reason=f"pruned: {err}"), "KILLED")
        except RunFailed as err:
            return finish(Outcome("PRUNED", reason=f"diverged: {err}"), "KILLED")
        except InfeasibleConfig as err:
            return finish(Outcome("PRUNED", reason=f"infeasible: {err}"), "KILLED")
        except KeyboardInterrupt:
            finish(Outcome("FAIL", reason="interrupted (Ctrl-C)"), "KILLED")
            raise
        except BaseException as err:
            finish(Outcome("FAIL", reason=f"error: {err!r}"), "FAILED")
            raise
        trial.set_user_attr("val_acc_per_seed", res.final_acc)
        trial.set_user_attr("uplink_d", res.uplink_d)
        values = [res.mean_acc if o == "acc" else res.uplink_d for o in s.objectives]
        if logger is not None:
            logger.log_summary({"objective_val_acc": res.mean_acc, "uplink_d": res.uplink_d,
                                **{f"val_acc_final_seed{sd}": a for sd, a in zip(s.seeds, res.final_acc)}})
        return finish(Outcome("COMPLETE", values), "FINISHED")


def _trial_line(number: int, outcome: Outcome, params: Dict[str, Any], duration: float, worker: int) -> str:
    vals = "/".join(f"{v:.4f}" for v in outcome.values) if outcome.values else "-"
    shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                      for k, v in params.items())
    why = f"  [{outcome.reason}]" if outcome.reason and outcome.state != "COMPLETE" else ""
    who = f"w{worker} " if worker else ""
    return f"{who}trial {number:>3} {outcome.state:<8} {vals:>15}  {shown}  ({duration:.1f}s){why}"


def optimize(settings: Settings, n_trials: Optional[int], worker: int = 0,
             on_trial: Optional[Callable[[str], None]] = None) -> bool:
    """Run up to ``n_trials`` trials (None: until the timeout) of the study in this process.

    Trials are asked and told explicitly, so every outcome is recorded as designed (PRUNED for
    pruned, diverged and infeasible runs, see the module docstring) and Ctrl-C leaves the running
    trial FAIL (user attribute ``reason``) with its MLflow run KILLED.

    Returns:
        True if interrupted by Ctrl-C, else False.
    """
    import torch
    from optuna.trial import TrialState

    torch.set_num_threads(max(1, settings.threads))
    study = load_study(settings, worker)
    tracking = None
    if settings.experiment:
        from fl_core.tracking import Tracking

        tracking = Tracking(settings.experiment)
    runner = TrialRunner(settings, tracking, worker)
    deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
    done, trial = 0, None
    try:
        while n_trials is None or done < n_trials:
            if deadline is not None and time.monotonic() >= deadline:
                break
            trial = study.ask()
            t0 = time.perf_counter()
            try:
                outcome = runner(trial)
            except BaseException:  # Ctrl-C or a bug: the trial must not stay RUNNING in the storage
                study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                raise
            if outcome.state == "COMPLETE":
                study.tell(trial, outcome.values)
            else:
                study.tell(trial, state=TrialState[outcome.state])
            done += 1
            line = _trial_line(trial.number, outcome, trial.params, time.perf_counter() - t0, worker)
            trial = None
            (on_trial or (lambda msg: None if settings.quiet else print(msg, flush=True)))(line)
    except KeyboardInterrupt:
        if trial is not None:  # interrupted between ask and tell
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return True
    return False


def _worker_main(settings: Settings, n_trials: Optional[int], worker: int) -> None:
    """Entry point of a spawned worker process."""
    interrupted = optimize(settings, n_trials, worker)
    sys.exit(EXIT_INTERRUPTED if interrupted else 0)


def split_trials(n_trials: Optional[int], workers: int) -> List[Optional[int]]:
    """Per-worker trial counts that add up to ``n_trials`` (None: unlimited for every worker)."""
    if n_trials is None:
        return [None] * workers
    return [n_trials // workers + (1 if w < n_trials % workers else 0) for w in range(workers)]


def run_workers(settings: Settings, n_trials: Optional[int], workers: int) -> Tuple[bool, int]:
    """Run the trials in ``workers`` spawned processes on the shared storage, with a progress bar
    in this process (polling the storage).

    Returns:
        (interrupted, number of workers that exited with an error).
    """
    import multiprocessing as mp

    from tqdm.auto import tqdm

    counts = [c for c in split_trials(n_trials, workers) if c is None or c > 0]
    study = load_study(settings)
    start = _count_finished(study)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(settings, c, w + 1), name=f"sweep-worker-{w + 1}")
             for w, c in enumerate(counts)]
    for p in procs:
        p.start()
    interrupted = False
    bar = None if settings.quiet else tqdm(total=n_trials, unit="trial", desc=settings.study_name, file=sys.stderr)
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(1.0)
            if bar is not None:
                bar.n = _count_finished(study) - start
                bar.refresh()
    except KeyboardInterrupt:  # the workers got the same SIGINT: let them close their trials
        interrupted = True
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    finally:
        for p in procs:
            p.join()
        if bar is not None:
            bar.n = _count_finished(study) - start
            bar.close()
    interrupted = interrupted or any(p.exitcode == EXIT_INTERRUPTED for p in procs)
    errors = sum(1 for p in procs if p.exitcode not in (0, EXIT_INTERRUPTED))
    return interrupted, errors


def _count_finished(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


# =========================================================================== MLflow parent run


def ensure_parent_run(study, settings: Settings, space: Space) -> Optional[str]:
    """The study's MLflow parent run: the one recorded in the study's user attribute
    ``mlflow_parent_run_id`` if it still exists (set RUNNING again), else a new one."""
    if not settings.experiment:
        return None
    from fl_core.tracking import Tracking, git_commit

    tracking = Tracking(settings.experiment)
    run_id = study.user_attrs.get("mlflow_parent_run_id")
    if run_id:
        try:
            tracking.client.get_run(run_id)
            tracking.client.update_run(run_id, status="RUNNING")
        except Exception:  # another store, or the run was deleted: start a new parent
            run_id = None
    if not run_id:
        tags = {"sweep_role": "study", "optuna_study": settings.study_name, "space": space.name,
                "objectives": ",".join(settings.objectives), "git_commit": git_commit(project_root())}
        run_id = tracking.start_parent(f"sweep-{settings.study_name}", tags)
        tracking.log_params(run_id, {"space": space.name, "space_file": str(space.path), "seeds": settings.seeds,
                                     "objectives": ",".join(settings.objectives),
                                     "base_overrides": " ".join(space.base), "overrides": " ".join(settings.overrides),
                                     "validation_fraction": VALIDATION_FRACTION})
        study.set_user_attr("mlflow_parent_run_id", run_id)
    for k, v in {"sampler": settings.sampler, "pruner": settings.pruner, "storage": settings.storage}.items():
        tracking.client.set_tag(run_id, k, v)
    return run_id


# =========================================================================== results


def best_trial(study, settings: Settings):
    """The best COMPLETE trial: the highest accuracy (for several objectives: the highest accuracy
    on the Pareto front); None if no trial completed."""
    if settings.multi:
        front = study.best_trials
        i = settings.objectives.index("acc")
        return max(front, key=lambda t: t.values[i]) if front else None
    try:
        return study.best_trial
    except ValueError:
        return None


def test_best(study, settings: Settings, trial, tracking=None) -> Dict[str, Any]:
    """Retrain the best trial's configuration on the full training set
    (``dataset.validation_fraction=0``) for the same seeds and measure the test accuracy.

    The result is cached in the study's user attribute ``best_test`` (keyed by trial number), so a
    resumed study with an unchanged best does not train again.

    Returns:
        {"trial", "test_acc" (mean over seeds), "per_seed", "overrides"}.
    """
    cached = study.user_attrs.get("best_test")
    if cached and cached.get("trial") == trial.number and cached.get("seeds") == settings.seeds:
        return cached
    overrides = merge_overrides(trial.user_attrs["overrides"], ["dataset.validation_fraction=0.0"])
    logger = None
    if tracking is not None and settings.parent_run_id:
        logger = tracking.child_logger(settings.parent_run_id, f"{settings.study_name}/best-test",
                                       {"sweep_role": "best_test", "optuna_study": settings.study_name,
                                        "optuna_trial": str(trial.number)},
                                       {"sweep.overrides": " ".join(overrides)}, 10_000)
        logger.open(None)
    holder: Dict[str, int] = {"R": 1}

    def on_config(cfg, algo):
        holder["R"] = int(cfg["train"]["rounds"])

    def on_round(i, r, row):
        if logger is not None:
            logger.log_round(i * holder["R"] + r, _metrics(row, "test"))

    try:
        res = train_seeds(overrides, settings.seeds, DataCache(1), on_round=on_round, on_config=on_config)
    except BaseException as err:
        if logger is not None:
            logger.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", repr(err))
        raise
    out = {"trial": trial.number, "test_acc": res.mean_acc, "per_seed": res.final_acc, "seeds": settings.seeds,
           "overrides": overrides}
    if logger is not None:
        logger.log_summary({"best_test_acc": res.mean_acc})
        logger.close("FINISHED")
    study.set_user_attr("best_test", out)
    return out


def _pinned_for_dvc(overrides: Sequence[str], params_yaml: Path) -> List[str]:
    """``overrides`` plus, for every shared key of ``params_yaml`` they do not set, that key at the
    value it has in the configuration of ``overrides`` (the grid applies its shared sections first)."""
    from omegaconf import OmegaConf

    from fl_core.config import compose
    from pipeline.grid import load_grid

    try:
        shared = load_grid(params_yaml).shared
    except (ConfigError, OSError, yaml.YAMLError):
        return list(overrides)
    cfg = compose(list(overrides))
    have = {override_key(o) for o in overrides}
    pins = []
    for ov in shared:
        key = override_key(ov)
        if key not in have:
            value = OmegaConf.select(cfg, key, default=None)
            pins.append(make_override(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value))
    return list(overrides) + pins


def _hydra_dict(mapping: Dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in mapping.items()) + "}"


def write_best_yaml(path: Path, settings: Settings, trial, value_text: str, test: Optional[Dict]) -> Dict[str, str]:
    """Write the best configuration in the params.yaml grid format (two experiments: ``<study>_best``
    on the full training set, evaluated on the test set, and ``<study>_best_val`` with the
    validation split, which reproduces the tuned value).

    Returns:
        Commands that use it: ``train``, ``train_val``, ``dvc`` (a ``dvc exp run -S`` line) and
        ``overrides`` (one ``pipeline.train`` command line with overrides).
    """
    name = re.sub(r"[^A-Za-z0-9_-]", "_", settings.study_name) + "_best"
    val = list(trial.user_attrs["overrides"])
    full = merge_overrides(val, ["dataset.validation_fraction=0.0"])
    doc = {"seeds": list(settings.seeds),
           "experiments": {name: overrides_mapping(full), f"{name}_val": overrides_mapping(val)}}
    shown = _display(path)
    dvc_entry = overrides_mapping(_pinned_for_dvc(full, project_root() / "params.yaml"))
    cmds = {
        "train": f"python -m pipeline.train --grid {name} --params {shown}",
        "train_val": f"python -m pipeline.train --grid {name}_val --params {shown}",
        "overrides": "python -m pipeline.train " + " ".join(full + [f"seed={settings.seeds[0]}"]),
        "dvc": f"dvc exp run -S '++experiments.{name}={_hydra_dict(dvc_entry)}'",
    }
    test_text = f"{test['test_acc']:.4f}" if test else "not measured"
    header = [f"Best configuration of Optuna study '{settings.study_name}' (trial {trial.number}): {value_text}",
              f"on the validation split (dataset.validation_fraction={VALIDATION_FRACTION}), seeds {settings.seeds}.",
              f"Test accuracy of {name} (full training set, test split): {test_text}.",
              "Grid format of params.yaml (pipeline/grid.py). Run with the pipeline:",
              f"  {cmds['train']}        # test accuracy",
              f"  {cmds['train_val']}    # reproduces the tuned value",
              "Into the DVC grid (params.yaml's shared keys pinned to the tuned configuration's values):",
              f"  {cmds['dvc']}"]
    text = "".join(f"# {h}\n" for h in header) + yaml.safe_dump(doc, sort_keys=False, width=100)
    _write_text(path, text)
    return cmds


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_plots(study, settings: Settings, out: Path) -> Tuple[List[Path], List[str]]:
    """Optimisation history, parameter importances, parallel coordinates, intermediate values
    (one objective) or the Pareto front (several), as PNG files in ``out``.

    Returns:
        (files written, one-line notes for plots skipped, e.g. importances with < 2 complete trials).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    _quiet_optuna()
    i = settings.objectives.index("acc")
    acc = {"target": (lambda t: t.values[i]), "target_name": "val_acc"} if settings.multi else \
        {"target_name": "val_acc"}
    plots: Dict[str, Callable[[], Any]] = {
        "history": lambda: ovm.plot_optimization_history(study, **acc),
        "importances": lambda: ovm.plot_param_importances(study, **acc),
        "parallel_coordinate": lambda: ovm.plot_parallel_coordinate(study, **acc),
    }
    if settings.multi:
        plots["pareto_front"] = lambda: ovm.plot_pareto_front(
            study, target_names=[{"acc": "val_acc", "uplink": "uplink (d)"}[o] for o in settings.objectives])
    else:
        plots["intermediate_values"] = lambda: ovm.plot_intermediate_values(study)
    files, notes = [], []
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    for name, make in plots.items():
        if name == "importances" and len(complete) < 2:
            notes.append(f"{name}: skipped (needs at least 2 complete trials, have {len(complete)})")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = make()
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            path = out / f"{name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=100)
            plt.close(fig)
            files.append(path)
        except Exception as err:  # a plot is a convenience: report and go on
            notes.append(f"{name}: skipped ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
            plt.close("all")
    return files, notes


def _fmt_params(params: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def summarize(study, settings: Settings, space: Space, best, test: Optional[Dict], runtime_s: float,
              interrupted: bool) -> Dict[str, Any]:
    """The summary written to summary.json (and rendered by :func:`summary_markdown`)."""
    trials = study.trials
    states = {s: sum(1 for t in trials if t.state.name == s) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    out: Dict[str, Any] = {
        "study": settings.study_name, "space": space.name, "space_file": str(space.path),
        "storage": settings.storage, "objectives": settings.objectives, "directions": settings.directions(),
        "sampler": settings.sampler, "pruner": "none" if settings.multi else settings.pruner,
        "seeds": settings.seeds, "overrides": settings.overrides, "trials": len(trials),
        "complete": states["COMPLETE"], "pruned": states["PRUNED"], "failed": states["FAIL"],
        "running": states["RUNNING"], "runtime_s": round(runtime_s, 1),
        "pruned_by": {kind: sum(1 for t in trials if t.state.name == "PRUNED"
                                and str(t.user_attrs.get("reason", "")).startswith(kind))
                      for kind in ("pruned", "diverged", "infeasible")},
        "trial_time_s": round(sum(t.duration.total_seconds() for t in trials if t.duration is not None), 1),
        "interrupted": interrupted, "mlflow_parent_run_id": settings.parent_run_id,
        "mlflow_experiment": settings.experiment,
    }
    if best is not None:
        out["best"] = {"trial": best.number, "values": best.values, "params": best.params,
                       "val_acc": best.values[settings.objectives.index("acc")],
                       "val_acc_per_seed": best.user_attrs.get("val_acc_per_seed"),
                       "uplink_d": best.user_attrs.get("uplink_d"), "algorithm": best.user_attrs.get("algorithm"),
                       "overrides": best.user_attrs.get("overrides")}
        out["best_value"] = best.values[0] if not settings.multi else best.values
        out["best_test_acc"] = test["test_acc"] if test else None
    if settings.multi:
        out["pareto_front"] = [{"trial": t.number, "values": t.values, "params": t.params,
                                "algorithm": t.user_attrs.get("algorithm")}
                               for t in sorted(study.best_trials, key=lambda t: t.number)]
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    acc_i = settings.objectives.index("acc")
    for key in space.conditional:
        per: Dict[str, Any] = {}
        for t in complete:
            choice = format_value(t.params.get(key))
            if choice not in per or t.values[acc_i] > per[choice]["val_acc"]:
                per[choice] = {"trial": t.number, "val_acc": t.values[acc_i], "params": t.params}
        out[f"best_per_{key}"] = per
    return out


def summary_markdown(s: Dict[str, Any], top: List[Any], objectives: List[str]) -> str:
    """A readable summary (also printed at the end of a sweep)."""
    lines = [f"# Sweep `{s['study']}` (space `{s['space']}`)", "",
             "| trials | complete | pruned | failed | running | this run | trial time |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['trials']} | {s['complete']} | {s['pruned']} | {s['failed']} | {s['running']} | "
             f"{s['runtime_s']:.0f} s | {s['trial_time_s']:.0f} s |", ""]
    by = s["pruned_by"]
    if s["pruned"]:
        lines += [f"Pruned: {by['pruned']} by the pruner, {by['diverged']} diverged (non-finite loss), "
                  f"{by['infeasible']} infeasible configurations.", ""]
    lines.append(f"Objective: {', '.join(f'{o} ({d})' for o, d in zip(objectives, s['directions']))}; "
                 f"val_acc = mean over seeds {s['seeds']} of the mean of the last `train.final_window` "
                 f"evaluations on the validation split; uplink in units of d (model size).")
    if s.get("interrupted"):
        lines.append("**Interrupted** (Ctrl-C): the study is intact; run the same command to continue.")
    lines.append("")
    b = s.get("best")
    if b is None:
        lines.append("No complete trial yet.")
    else:
        test = s.get("best_test_acc")
        head = f"**Best trial {b['trial']}**: val_acc {b['val_acc']:.4f}"
        if "uplink" in objectives:
            head += f", uplink {b['uplink_d']:.2f} d"
        head += f", test accuracy (best_test_acc) {test:.4f}" if test is not None else ", test accuracy not measured"
        lines += [head, "", f"- algorithm: `{b.get('algorithm')}`", f"- params: {_fmt_params(b['params'])}",
                  f"- overrides: `{' '.join(b.get('overrides') or [])}`"]
        cmds = s.get("commands") or {}
        if cmds:
            lines += [f"- pipeline: `{cmds['train']}`", f"- same, one seed: `{cmds['overrides']}`",
                      f"- DVC grid: `{cmds['dvc']}`"]
    for key in [k for k in s if k.startswith("best_per_")]:
        lines += ["", f"Best per `{key[len('best_per_'):]}`:", "", "| value | trial | val_acc | params |",
                  "|---|---:|---:|---|"]
        for choice, e in sorted(s[key].items(), key=lambda kv: -kv[1]["val_acc"]):
            lines.append(f"| {choice} | {e['trial']} | {e['val_acc']:.4f} | {_fmt_params(e['params'])} |")
    if "pareto_front" in s:
        lines += ["", "Pareto front:", "", "| trial | " + " | ".join(objectives) + " | params |",
                  "|---:|" + "---:|" * len(objectives) + "---|"]
        for e in s["pareto_front"]:
            lines.append(f"| {e['trial']} | " + " | ".join(f"{v:.4f}" for v in e["values"])
                         + f" | {_fmt_params(e['params'])} |")
    if top:
        lines += ["", "Top trials:", "", "| trial | " + " | ".join(objectives) + " | params |",
                  "|---:|" + "---:|" * len(objectives) + "---|"]
        for t in top:
            lines.append(f"| {t.number} | " + " | ".join(f"{v:.4f}" for v in t.values)
                         + f" | {_fmt_params(t.params)} |")
    return "\n".join(lines) + "\n"


def finish_study(settings: Settings, space: Space, out: Path, t_start: float, interrupted: bool,
                 run_test: bool = True) -> Dict[str, Any]:
    """After the trials: test the best configuration, write best.yaml, plots, trials.csv and the
    summary (also as artifacts and metrics of the MLflow parent run), and end the parent run."""
    study = load_study(settings)
    tracking = None
    if settings.experiment:
        from fl_core.tracking import Tracking

        tracking = Tracking(settings.experiment)
    best = best_trial(study, settings)
    test = None
    if best is not None and run_test and not interrupted:
        import torch

        torch.set_num_threads(max(1, settings.threads))
        test = test_best(study, settings, best, tracking)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(study, settings, space, best, test, time.perf_counter() - t_start, interrupted)
    if best is not None:
        acc = best.values[settings.objectives.index("acc")]
        summary["commands"] = write_best_yaml(out / "best.yaml", settings, best, f"val_acc {acc:.4f}", test)
    plots, notes = write_plots(study, settings, out)
    summary["plots"] = [p.name for p in plots]
    summary["plot_notes"] = notes
    df = study.trials_dataframe(attrs=("number", "values" if settings.multi else "value", "state", "duration",
                                       "params"))
    df.to_csv(out / "trials.csv", index=False)
    acc_i = settings.objectives.index("acc")
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    top = sorted(complete, key=lambda t: -t.values[acc_i])[:5]
    md = summary_markdown(summary, top, settings.objectives)
    _write_text(out / "summary.md", md)
    _write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    if tracking is not None and settings.parent_run_id:
        from mlflow.entities import Metric

        step = len(study.trials)
        metrics = {"trials_complete": summary["complete"], "trials_pruned": summary["pruned"],
                   "trials_failed": summary["failed"]}
        if best is not None:
            metrics["best_val_acc"] = summary["best"]["val_acc"]
            if test:
                metrics["best_test_acc"] = test["test_acc"]
        ts = int(time.time() * 1000)
        tracking.client.log_batch(settings.parent_run_id,
                                  metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])
        if best is not None:
            tracking.client.set_tag(settings.parent_run_id, "best_trial", str(best.number))
        files = [out / n for n in ("summary.md", "summary.json", "best.yaml", "trials.csv")] + plots
        tracking.log_artifacts(settings.parent_run_id, files)
        tracking.end_parent(settings.parent_run_id, "KILLED" if interrupted else "FINISHED")
    print(md, end="")
    for n in notes:
        print(f"note: plot {n}", file=sys.stderr)
    print(f"outputs: {_display(out)}/", file=sys.stderr)
    return summary


# =========================================================================== CLI


def build_parser() -> argparse.ArgumentParser:
    spaces = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
    p = argparse.ArgumentParser(
        prog="python sweeps/tune.py",
        description="Optuna sweep over the FL pipeline: validation accuracy (mean of the last "
                    "train.final_window rounds, mean over --seeds) per trial, per-round pruning, parallel "
                    "workers, MLflow (a parent run per study, a nested run per trial). Running the same "
                    "command again resumes the study.",
        epilog="Examples:\n"
               "  python sweeps/tune.py --space fedbug --n-trials 20\n"
               "  python sweeps/tune.py --space cross --n-trials 60 --workers 2 --objectives acc,uplink\n"
               "  python sweeps/tune.py --space lr --n-trials 30 --seeds 3 partition.alpha=0.1 train.rounds=40\n"
               "See docs/sweeps.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", required=True, help=f"search space: a name ({spaces}) or a YAML file")
    p.add_argument("--n-trials", type=int, required=True, metavar="N",
                   help="trials to add in this invocation (over all workers; 0: only rewrite the outputs)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop starting trials after S seconds")
    p.add_argument("--workers", type=int, default=1, metavar="W", help="parallel worker processes (default 1)")
    p.add_argument("--storage", default=None,
                   help="journal file (default sweeps/studies/<study>.log) or an RDB URL "
                        "(postgresql://..., sqlite:///...) for many machines")
    p.add_argument("--study-name", default=None, metavar="NAME", help="default: the space's name")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="default tpe (multivariate, constant liar)")
    p.add_argument("--sampler-seed", type=int, default=None, metavar="S",
                   help="seed of the sampler (with --workers W, worker w = 1..W uses S + w)")
    p.add_argument("--pruner", default=None, metavar="{median,hyperband,none,threshold:X}",
                   help="default median; threshold:X prunes when validation accuracy < X; "
                        "multi-objective studies never prune")
    p.add_argument("--seeds", type=int, default=1, metavar="K", help="run seeds 1..K per trial (default 1)")
    p.add_argument("--objectives", default="acc", metavar="acc[,uplink]",
                   help="acc (maximise validation accuracy) or acc,uplink (also minimise cumulative uplink "
                        "floats per client in units of d: Pareto front)")
    p.add_argument("--out", default=None, metavar="DIR", help="outputs (default sweeps/results/<study>/)")
    p.add_argument("--experiment", default=None,
                   help="MLflow experiment (default: tracking.experiment + '-sweeps')")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--no-test", action="store_true", help="do not retrain the best configuration on the test set")
    p.add_argument("--threads", type=int, default=1, metavar="T", help="torch threads per worker (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-trial lines")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides of the base experiment, e.g. train.rounds=30 partition=iid")
    return p


def check_data(cfg) -> None:
    """Load the base configuration's dataset and partition once, so that missing files stop the
    sweep with one line before any trial.

    Raises:
        fl_core.data.DataSourceError, fl_core.data.PartitionError, ValueError (device).
    """
    DataCache(1).get(cfg)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _signature(space: Space, settings: Settings) -> Dict[str, Any]:
    return {"space": space.name, "base": space.base, "overrides": settings.overrides, "seeds": settings.seeds,
            "objectives": settings.objectives}


def main(argv: Optional[List[str]] = None) -> int:
    """Run a sweep. Exit status: 0 done, 2 bad arguments/space/config (one line, nothing run),
    130 interrupted (outputs written for the trials done), 1 a worker process crashed."""
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    bad = [o for o in args.overrides if "=" not in o and not o.startswith("~")]
    if bad:
        return _fail(f"{bad[0]!r} is not a KEY=VALUE override (see --help)")
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if "acc" not in objectives or set(objectives) - set(OBJECTIVES) or len(set(objectives)) != len(objectives):
        return _fail(f"--objectives must be acc or acc,uplink, got {args.objectives!r}")
    for name, value, lo in (("--n-trials", args.n_trials, 0), ("--workers", args.workers, 1),
                            ("--seeds", args.seeds, 1), ("--threads", args.threads, 1)):
        if value < lo:
            return _fail(f"{name} must be >= {lo}, got {value}")
    if args.timeout is not None and args.timeout <= 0:
        return _fail(f"--timeout must be > 0, got {args.timeout:g}")
    try:
        if args.pruner is not None:
            parse_pruner(args.pruner)
        space = load_space(args.space)
        base_cfg = check_space(space, args.overrides)
    except (SpaceError, ValueError) as err:
        return _fail(str(err))
    if len(objectives) > 1 and args.pruner not in (None, "none"):
        print("note: multi-objective studies cannot prune; --pruner ignored", file=sys.stderr)
    study_name = args.study_name or space.name
    settings = Settings(space=str(space.path.resolve()), overrides=list(args.overrides),
                        seeds=list(range(1, args.seeds + 1)), objectives=objectives, study_name=study_name,
                        storage=args.storage or default_storage(study_name), sampler=args.sampler,
                        sampler_seed=args.sampler_seed, pruner=args.pruner or "median",
                        experiment=None if args.no_mlflow else (args.experiment or
                                                               f"{base_cfg.tracking.experiment}-sweeps"),
                        threads=args.threads, timeout=args.timeout, quiet=args.quiet)
    import optuna

    _quiet_optuna()
    try:
        make_sampler(settings.sampler, None, settings.multi, bool(space.conditional))
        check_data(base_cfg)
    except (ValueError, RuntimeError) as err:
        return _fail(str(err).splitlines()[0])
    storage = open_storage(settings.storage)
    study = optuna.create_study(study_name=study_name, storage=storage, directions=settings.directions(),
                                load_if_exists=True)
    signature = _signature(space, settings)
    old = study.user_attrs.get("signature")
    if old is None:
        study.set_user_attr("signature", signature)
    elif old != signature:
        diff = next(k for k in signature if old.get(k) != signature[k])
        return _fail(f"study {study_name!r} in {settings.storage} was created with {diff}={old.get(diff)!r}; "
                     f"this command has {signature[diff]!r}: use another --study-name or the same settings")
    settings.parent_run_id = ensure_parent_run(study, settings, space)
    out = Path(args.out) if args.out else project_root() / "sweeps" / "results" / study_name
    print(f"study {study_name!r}: {len(study.trials)} trial(s) so far in {settings.storage}; "
          f"space {space.name} ({', '.join(space.keys())})", file=sys.stderr)
    errors = 0
    try:
        if args.n_trials == 0:
            interrupted = False
        elif args.workers == 1:
            interrupted = _run_in_process(settings, args.n_trials)
        else:
            interrupted, errors = run_workers(settings, args.n_trials, args.workers)
        finish_study(settings, space, out, t_start, interrupted, run_test=not args.no_test)
    except KeyboardInterrupt:  # during the test run or the outputs: write what can be written
        finish_study(settings, space, out, t_start, True, run_test=False)
        return EXIT_INTERRUPTED
    if errors:
        print(f"error: {errors} worker process(es) ended with an error (see above)", file=sys.stderr)
        return 1
    return EXIT_INTERRUPTED if interrupted else 0


def _run_in_process(settings: Settings, n_trials: int) -> bool:
    from tqdm.auto import tqdm

    if settings.quiet:
        return optimize(settings, n_trials)
    bar = tqdm(total=n_trials, unit="trial", desc=settings.study_name, file=sys.stderr)

    def on_trial(line: str) -> None:
        bar.write(line, file=sys.stderr)
        bar.update(1)

    try:
        return optimize(settings, n_trials, on_trial=on_trial)
    finally:
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
