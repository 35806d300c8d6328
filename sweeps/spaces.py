"""Search spaces of the sweeps (``sweeps/spaces/<name>.yaml``) and the overrides a trial runs with.

Schema (validated on load; errors name the file and the key)::

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

Precedence of a trial's overrides (later wins): the space's ``base``, the base of the chosen
conditional branch, the command-line overrides, the sampled values, then the settings the sweep
fixes (:data:`VALIDATION`, then :data:`TRIAL_FIXED` and ``seed``). The fixed keys
(:data:`FIXED_KEYS`) may not be set by a space or on the command line.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

from fl_core.schema import ConfigError
from fl_core.schema import format_value

SPACES_DIR = Path(__file__).resolve().parent / "spaces"
VALIDATION_FRACTION = 0.2
# the objective is measured on a held-out share of the training set (part of the experiment: best.yaml keeps it)
VALIDATION = (f"dataset.validation_fraction={VALIDATION_FRACTION}",)
# settings of every trial run (not of the experiment): the sweep logs to MLflow itself and never resumes a trial
TRIAL_FIXED = ("engine.checkpoint_every=0", "engine.progress=false", "tracking.enabled=false")


class SpaceError(ValueError):
    """A search space or the overrides are unusable; the one-line message names the file and the key."""


# =========================================================================== overrides


def make_override(key: str, value: Any) -> str:
    """``("train.lr", 0.1)`` -> ``"train.lr=0.1"`` (values as :func:`fl_core.schema.format_value` writes them)."""
    return f"{key}={format_value(value)}"


def override_key(ov: str) -> str:
    """``'++train.lr=0.1'`` -> ``'train.lr'`` (prefixes +, ++ and ~ dropped)."""
    return ov.split("=", 1)[0].lstrip("+~")


# keys the sweep sets itself (a space or a command-line override setting one is refused)
FIXED_KEYS = tuple(override_key(o) for o in VALIDATION + TRIAL_FIXED) + ("seed",)


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


_WHY_FIXED = {"dataset.validation_fraction": f"trials are scored on a {VALIDATION_FRACTION:g} validation split",
              "seed": "trials run seeds 1..K of --seeds K"}


def fixed_key_error(overrides: Sequence[str], where: str) -> Optional[str]:
    """One line naming the first override of ``overrides`` that sets a key the sweep fixes, else None."""
    for ov in overrides:
        key = override_key(ov)
        if key in FIXED_KEYS:
            why = _WHY_FIXED.get(key, f"trials run with {' '.join(TRIAL_FIXED)}")
            return f"{key} is fixed by the sweep ({why}): remove {ov!r} from {where}"
    return None


# =========================================================================== spaces


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

    def experiment_overrides(self, extra: Sequence[str], overrides: Sequence[str], sampled: Sequence[str]) -> List[str]:
        """The overrides of one experiment (no seed, no trial settings), in precedence order: the
        space's base, the branches' ``extra`` overrides, the command line, the sampled values and
        :data:`VALIDATION`."""
        return merge_overrides(self.base, extra, overrides, sampled, VALIDATION)

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

            def at(end: int, fixed: Optional[Dict[str, Any]] = None, params=params, forced=forced) -> List[str]:
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


def _check_param_key(where: str, key: Any) -> None:
    """The key of a parameter: a config key, not one the sweep fixes."""
    if not _KEY.match(str(key)):
        raise SpaceError(f"{where}: {key!r} is not a config key (e.g. train.lr or algorithm)")
    if override_key(str(key)) in FIXED_KEYS:
        raise SpaceError(f"{where}: {override_key(str(key))} is fixed by the sweep and cannot be searched")


def _param_kind(where: str, spec: Any) -> str:
    """The ``type`` of a parameter's mapping, whose other fields are those of that type."""
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: must be a mapping like {{type: float, low: 0.0, high: 1.0}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in _SPEC_KEYS:
        raise SpaceError(f"{where}.type must be one of float, int, categorical, got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        raise SpaceError(f"{where}: unknown field {unknown[0]!r} for type {kind} "
                         f"(allowed: {', '.join(sorted(_SPEC_KEYS[kind]))})")
    return kind


def _parse_choices(where: str, spec: Dict[str, Any]) -> Tuple[Any, ...]:
    """The ``choices`` of a categorical: a non-empty list of distinct scalars."""
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        raise SpaceError(f"{where}.choices must be a non-empty list, got {choices!r}")
    for c in choices:
        if not (c is None or isinstance(c, (bool, int, float, str))):
            raise SpaceError(f"{where}.choices: {c!r} is not a scalar (write a list as a string, e.g. "
                             f"'[a,b]')")
    if len(set(map(repr, choices))) != len(choices):
        raise SpaceError(f"{where}.choices has duplicates: {choices!r}")
    return tuple(choices)


def _parse_range(where: str, key: str, kind: str, spec: Dict[str, Any]) -> Param:
    """A float or int parameter: low < high (integers for an int), log, then step (:func:`_parse_step`)."""
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
    return Param(key, kind, low, high, log, _parse_step(where, kind, spec, log))


def _parse_step(where: str, kind: str, spec: Dict[str, Any], log: bool) -> Optional[float]:
    """The optional ``step`` of a float or int parameter: positive (an integer for an int), not with log."""
    step = spec.get("step")
    if step is not None:
        step = _number(where, "step", step)
        if step <= 0 or (kind == "int" and not step.is_integer()):
            raise SpaceError(f"{where}.step must be a positive {'integer' if kind == 'int' else 'number'}, "
                             f"got {spec['step']!r}")
        if log:
            raise SpaceError(f"{where}: step and log cannot be combined (Optuna)")
    return step


def _parse_param(where: str, key: str, spec: Any) -> Param:
    """One entry of ``params``: its key (:func:`_check_param_key`), its type (:func:`_param_kind`), then the
    fields of that type (:func:`_parse_choices`, :func:`_parse_range`)."""
    _check_param_key(where, key)
    kind = _param_kind(where, spec)
    if kind == "categorical":
        return Param(str(key), kind, choices=_parse_choices(where, spec))
    return _parse_range(where, str(key), kind, spec)


def _parse_overrides(where: str, value: Any) -> List[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and ("=" in v or v.startswith("~"))
                                              for v in value):
        raise SpaceError(f"{where} must be a list of Hydra overrides like [train.rounds=20, train.lr=0.05], "
                         f"got {value!r}")
    fixed = fixed_key_error(value, "base")
    if fixed:
        raise SpaceError(f"{where}: {fixed}")
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
    try:
        if p.suffix in (".yaml", ".yml") or p.exists():
            return p
    except OSError:  # e.g. a folder on the way that cannot be searched: a path, load_space says why
        return p
    return SPACES_DIR / f"{ref}.yaml"


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when below it (for messages), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def yaml_error_text(err: "yaml.YAMLError", text: str) -> str:
    """``"YAML syntax error at line L, column C: <problem>"`` (1-based) for an error of
    ``yaml.safe_load(text)``; the position is left out where PyYAML gives none."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or getattr(err, "reason", None)
    if mark is not None:
        line, column = mark.line + 1, mark.column + 1
    elif isinstance(getattr(err, "position", None), int):  # ReaderError: a character YAML does not allow
        pos = err.position
        line, column = text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1
    else:
        line = column = None
    problem = " ".join(str(problem or (str(err).strip().splitlines() or [type(err).__name__])[0]).split())
    where = f" at line {line}, column {column}" if line is not None else ""
    return f"YAML syntax error{where}: {problem}"


def space_names() -> List[str]:
    """The shipped spaces: the names of ``sweeps/spaces/*.yaml``."""
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def load_space(ref: str) -> Space:
    """Read and validate a search space.

    Args:
        ref: a space name (``fedbug`` -> ``sweeps/spaces/fedbug.yaml``) or a YAML file path.

    Raises:
        SpaceError: one line naming the file and the offending key (missing or unreadable file,
            a YAML syntax error with its line and column, unknown field, low >= high, a conditional
            on a non-categorical, a value that is not a choice, a key the sweep fixes, ...).
    """
    path = space_path(ref)
    shown = display_path(path)
    raw = _read_space(path, shown)
    base = _parse_overrides(f"{shown}: base", raw.get("base"))
    params = _parse_params(f"{shown}: params", raw.get("params"))
    if not params:
        raise SpaceError(f"{shown}: params is empty (nothing to search)")
    conditional = _parse_conditional(shown, raw.get("conditional") or {}, params)
    desc = str(raw.get("description") or "").strip()
    return Space(path.stem, path, desc, base, params, conditional)


def _read_space(path: Path, shown: str) -> Dict[str, Any]:
    """The YAML mapping of a space file, with known top-level keys only (``shown``: its path in messages)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpaceError(f"{shown}: no such search space (names: {', '.join(space_names())}; "
                         "or give a YAML file)") from None
    except IsADirectoryError:
        raise SpaceError(f"{shown}: is a directory, not a search space file") from None
    except OSError as err:  # permissions, I/O
        raise SpaceError(f"{shown}: cannot read the search space ({err.strerror or type(err).__name__})") from None
    except UnicodeDecodeError as err:
        raise SpaceError(f"{shown}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpaceError(f"{shown}: {yaml_error_text(err, text)}") from None
    if not isinstance(raw, dict):
        raise SpaceError(f"{shown}: must be a mapping with params (and description, base, conditional)")
    unknown = sorted(set(raw) - {"description", "base", "params", "conditional"})
    if unknown:
        raise SpaceError(f"{shown}: unknown top-level key {unknown[0]!r} (allowed: description, base, params, "
                         "conditional)")
    return raw


def _parse_conditional(shown: str, cond: Any, params: Dict[str, Param]) -> Dict[str, Dict[Any, Branch]]:
    """The ``conditional`` section: for a categorical of ``params``, a branch per value (:func:`_parse_branch`)."""
    if not isinstance(cond, dict):
        raise SpaceError(f"{shown}: conditional must map a categorical of params to its values, got {cond!r}")
    conditional: Dict[str, Dict[Any, Branch]] = {}
    seen: Dict[str, Param] = dict(params)
    for key, branches in cond.items():
        where = f"{shown}: conditional.{key}"
        p = params.get(str(key))
        if p is None or p.kind != "categorical":
            raise SpaceError(f"{where}: {key!r} must be a categorical of params")
        if not isinstance(branches, dict):
            raise SpaceError(f"{where} must map values of {key} to {{base: [...], params: {{...}}}}")
        conditional[str(key)] = {}
        for value, raw_branch in branches.items():
            bwhere = f"{where}.{value}"
            if value not in p.choices:
                raise SpaceError(f"{bwhere}: {value!r} is not one of the choices of {key} {list(p.choices)}")
            conditional[str(key)][value] = _parse_branch(bwhere, raw_branch, params, seen)
    return conditional


def _parse_branch(bwhere: str, raw_branch: Any, params: Dict[str, Param], seen: Dict[str, Param]) -> Branch:
    """One branch of ``conditional`` (its base and params); a parameter new to the space, or with the distribution
    it has in the other branches (``seen``, which it joins)."""
    br = raw_branch or {}
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
    return branch


def check_space(space: Space, overrides: Sequence[str]) -> Any:
    """Check the command-line ``overrides`` against the space and compose its extreme configurations,
    so that an unknown key or an out-of-range value stops the sweep before any trial.

    Returns:
        The composed base configuration (the space's ``base`` + ``overrides``, nothing sampled).

    Raises:
        SpaceError: a command-line override sets a searched key or a key the sweep fixes, or a
            configuration does not compose (the message names the file, the configuration and the
            config key).
    """
    from fl_core.config import compose

    fixed = fixed_key_error(overrides, "the overrides")
    if fixed:
        raise SpaceError(fixed)
    tuned = set(space.keys())
    for ov in overrides:
        if override_key(ov) in tuned:
            raise SpaceError(f"{override_key(ov)} is searched by {display_path(space.path)}: remove {ov!r} from "
                             "the overrides (or from the space)")
    # the space's base is the sweep's preset: its own keys must each change its run; over it, what the command line,
    # a branch and the sampler set must change the trial's (fl_core.config.compose, ``user``)
    try:
        compose(space.experiment_overrides([], [], []))
    except ConfigError as err:
        raise SpaceError(f"{display_path(space.path)}: base: {err}") from None
    try:
        base_cfg = compose(space.experiment_overrides([], overrides, []), user=list(overrides))
    except ConfigError as err:
        raise SpaceError(f"{display_path(space.path)}: base + overrides: {err}") from None
    for label, extra, sampled in space.corner_configs():
        try:
            compose(space.experiment_overrides(extra, overrides, sampled), user=[*extra, *overrides, *sampled])
        except ConfigError as err:
            raise SpaceError(f"{display_path(space.path)}: {label}: {err}") from None
    return base_cfg
