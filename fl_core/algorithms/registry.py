"""The rule registry: every rule file describes itself with one :class:`Rule` and registers it on import.

Everything that lists rules is derived from here, so adding a rule is its file, its yaml and its tests:

- the ``algorithm`` section of the config schema: one sub-section per registered parameter dataclass
  (:func:`sections`; :mod:`fl_core.config` builds ``AlgorithmConfig`` from it),
- the allowed values of ``algorithm.name``, ``algorithm.server_opt`` and ``algorithm.wrappers`` and the checks of
  every section
  (:func:`check_algorithm`),
- ``fl-train --help`` (:func:`help_lines`), the rule table of ``docs/algorithms.md`` (checked by a test),
  the report's labels (:func:`label`), the MLflow params of a run (:func:`stack_sections`),
- the conformance tests (``tests/test_conformance.py`` runs every base, every wrapper over every base).

A rule declares which of the shared keys ``algorithm.aggregation``, ``algorithm.eta_g`` and ``algorithm.server_opt``
it honours; a value it would ignore is refused with one line (no key is accepted and then ignored).

Four kinds of entry compose into one stack: a ``base`` (``algorithm.name``: trains the clients and aggregates), a
``server`` optimiser (``algorithm.server_opt``: the server step on the base's pseudo-gradient; ``sgd`` is the base's
own), any number of ``wrapper`` rules (``algorithm.wrappers``, innermost first) and any number of message
``transform`` entries (``algorithm.transforms``, applied to the upload first to last after the rule's
``finish_client``: Top-k, QSGD; :class:`~fl_core.algorithms.base.Transform`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..params import ParamSpec
from .base import Transformed
from ..schema import ConfigError, check_choice, check_fields, check_finite, check_range, describe_range, fmt

AGGREGATIONS = ("weighted", "uniform")
#: The base every other rule is compared with: the default ``reference`` of a rule's neutral setting and the
#: reference column of the report ("Difference to <its label>").
REFERENCE_BASE = "fedavg"


@dataclass(frozen=True)
class BuildContext:
    """What a rule's builder may use besides its own section.

    ``algorithm``: the whole ``algorithm`` config node (the shared keys ``aggregation`` and ``eta_g``, and every
    section); ``spec``: the model's parameter layout; ``model``: the model itself (for rules that need its
    structure: neuron layers, classifier, block tables), or None in unit tests that build a rule without one.
    """

    algorithm: Any
    spec: ParamSpec
    model: Any = None
    aggregation: str = "weighted"  # algorithm.aggregation, resolved (a rule that averages one way gets its own)
    eta_g: float = 1.0  # algorithm.eta_g
    momentum: float = 0.0  # train.momentum: rho of the clients' local SGD (0: plain SGD)
    optimizer: str = "sgd"  # train.optimizer: the clients' local optimiser (sgd | adam)


def refuse_local_momentum(ctx: BuildContext, key: str, why: str) -> None:
    """For a rule whose math assumes plain local SGD: refuse ``train.momentum`` > 0.

    Raises:
        ConfigError: one line naming ``train.momentum`` and ``key`` (the rule's setting, e.g.
            ``algorithm.name=scaffold``), with ``why``.
    """
    if ctx.momentum:
        raise ConfigError(f"train.momentum={fmt(float(ctx.momentum))} does not compose with {key}: {why}; "
                          "set train.momentum=0")


def refuse_local_adam(ctx: BuildContext, key: str, why: str) -> None:
    """For a rule whose math assumes SGD local steps: refuse ``train.optimizer=adam``.

    Raises:
        ConfigError: one line naming ``train.optimizer`` and ``key`` (the rule's setting), with ``why``.
    """
    if ctx.optimizer != "sgd":
        raise ConfigError(f"train.optimizer={ctx.optimizer} does not compose with {key}: {why}; "
                          "set train.optimizer=sgd")


def neuron_layers(model) -> List[Tuple[str, str, int]]:
    """(module name, kind, neurons M_l) of the model's weighted layers in forward order (``model.neuron_layers()``:
    kind ``conv`` counts output channels, ``linear`` output units), or [] if the model does not expose them."""
    if model is None or not hasattr(model, "neuron_layers"):
        return []
    return [(name, kind, module.out_channels if kind == "conv" else module.out_features)
            for name, module, kind in model.neuron_layers()]


@dataclass(frozen=True)
class Rule:
    """One rule as the rest of the project sees it.

    Attributes:
        name: the config value (``algorithm.name=<name>`` for a base, ``algorithm.server_opt=<name>`` for a server
            optimiser, ``algorithm.wrappers=[<name>]`` for a wrapper).
        kind: ``base`` (trains the clients and aggregates), ``server`` (the server step on a base's pseudo-gradient),
            ``wrapper`` (wraps any base and changes some parts) or ``transform`` (a message transform of the upload).
        label: the name the papers use (``FedProx``), shown in reports and plots.
        citation: the source of the update rule (paper, venue, equation or algorithm).
        summary: one line: what the rule does.
        build: base: ``build(params, ctx) -> Algorithm``; server and wrapper: ``build(base, params, ctx) -> Algorithm``;
            transform: ``build(params, ctx) -> Transform``; with
            ``params`` the rule's section (``algorithm.<section>``; None without one) and ``ctx`` a
            :class:`BuildContext`.
        params: the dataclass of the rule's parameters (fields made with :func:`fl_core.schema.param`), or None.
        section: the config section of ``params`` (default: ``name``). Rules may share one (``fedbcgd`` and
            ``fedbcgd_plus``): the registry checks that they share the same dataclass.
        aggregation: the values of ``algorithm.aggregation`` the rule honours, its default first (wrappers:
            ignored, the base decides). ``algorithm.aggregation=null`` (the wrappers' presets) means the default.
        eta_g: whether the rule honours ``algorithm.eta_g`` (the server step size) and ``algorithm.server_opt`` (it has
            a pseudo-gradient); a rule that does not refuses any value but 1 and ``sgd``.
        check: optional cross-field check ``check(algorithm_node, prefix)`` raising :class:`ConfigError`, run for
            the rules of the stack.
        neutral: overrides under which the rule equals its reference (FedProx: ``algorithm.fedprox.mu=0``; FedBug:
            ``algorithm.fedbug.gu_percentage=0``), or ``()`` if it has none. The conformance tests check it.
        reference: what ``neutral`` makes a base equal (overrides; default FedAvg with its weighted mean); a
            wrapper's and a server optimiser's reference is always its base.
        preset: the file ``conf/algorithm/<preset>.yaml`` that configures the rule (default: ``name``); a server
            optimiser's preset is the published rule it makes over FedAvg (``momentum``: ``fedavgm``), and the
            report labels that name with the rule's ``label``.
        default_eta_g: a server optimiser's step size eta_g when ``algorithm.eta_g`` is unset (null), so that a
            composition such as ``algorithm=fedprox algorithm.server_opt=adam`` gets the optimiser's documented
            step and not the one of whichever preset was loaded (``sgd`` and ``momentum``: 1; adam and yogi
            0.01, as in FedDecorr's run script; adagrad 0.1, the same first step).
        own_aggregation: a base's own ``algorithm.aggregation`` given the ``algorithm`` node, where it depends on
            the rule's parameters (FedExP's ``fedbug_code`` variant averages uniformly); default: the first of
            ``aggregation``.
        named: the rule's parameters that the default experiment name shows after the rule's name, as (prefix,
            field of ``params``) pairs (FedBug: ``(("p", "gu_percentage"),)`` -> ``fedbug-p0.2-fedavg_...``;
            :func:`name_parts`, :func:`fl_core.experiment.derive_name`).
        prepare_model: ``prepare_model(params, model)`` adds the parameters the rule trains besides the network's
            (MOON's projection head) to the model, before the parameter layout is taken and the stack is built
            (:func:`prepare_model`); None for rules that train the network as it is.
    """

    name: str
    kind: str
    label: str
    citation: str
    summary: str
    build: Callable[..., Any]
    params: Optional[type] = None
    section: Optional[str] = None
    aggregation: Tuple[str, ...] = AGGREGATIONS
    eta_g: bool = True
    check: Optional[Callable[[Any, str], None]] = None
    neutral: Tuple[str, ...] = ()
    reference: Tuple[str, ...] = (f"algorithm.name={REFERENCE_BASE}", "algorithm.aggregation=weighted")
    preset: Optional[str] = None
    default_eta_g: float = 1.0
    own_aggregation: Optional[Callable[[Any], str]] = None
    prepare_model: Optional[Callable[[Any, Any], None]] = None
    named: Tuple[Tuple[str, str], ...] = ()

    @property
    def config_section(self) -> Optional[str]:
        return (self.section or self.name) if self.params is not None else None

    @property
    def preset_name(self) -> str:
        return self.preset or self.name


KINDS = ("base", "server", "wrapper", "transform")
NO_SERVER_OPT = "sgd"  # algorithm.server_opt of the base's own server step


_RULES: Dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Add ``rule`` to the registry (called at the bottom of the rule's file).

    Raises:
        ValueError: a second rule of the same name, an unknown kind, or a section shared with another
            parameter dataclass.
    """
    if rule.kind not in KINDS:
        raise ValueError(f"rule {rule.name!r}: kind must be one of {', '.join(KINDS)}, got {rule.kind!r}")
    if rule.name in _RULES:
        raise ValueError(f"rule {rule.name!r} is registered twice")
    if rule.params is not None and not is_dataclass(rule.params):
        raise ValueError(f"rule {rule.name!r}: params must be a dataclass")
    for other in _RULES.values():
        if other.config_section and other.config_section == rule.config_section and other.params is not rule.params:
            raise ValueError(f"rules {other.name!r} and {rule.name!r} share section {rule.config_section!r} "
                             "with different parameter dataclasses")
    if rule.aggregation and not set(rule.aggregation) <= set(AGGREGATIONS):
        raise ValueError(f"rule {rule.name!r}: aggregation must be a subset of {AGGREGATIONS}")
    _RULES[rule.name] = rule
    return rule


def rules(kind: Optional[str] = None) -> List[Rule]:
    """Registered rules in registration order (``kind``: only bases or only wrappers)."""
    return [r for r in _RULES.values() if kind is None or r.kind == kind]


def names(kind: str) -> Tuple[str, ...]:
    return tuple(r.name for r in rules(kind))


def get(name: str) -> Rule:
    """The rule called ``name``.

    Raises:
        ConfigError: no such rule (lists the known ones).
    """
    if name not in _RULES:
        raise ConfigError(f"unknown rule {name!r} (known: {', '.join(_RULES)})")
    return _RULES[name]


def label(name: str) -> str:
    """The paper name of rule or preset ``name`` (``fedbcgd_plus`` -> ``FedBCGD+``, ``fedavgm`` -> ``FedAvgM``), or
    ``name`` if unknown."""
    key = str(name).lower()
    r = _RULES.get(key) or next((r for r in _RULES.values() if r.preset == key), None)
    return r.label if r else name


def described(desc: Any) -> Optional[Dict[str, Any]]:
    """The structure of a rule stack's :class:`~fl_core.algorithms.base.Description` with each level's paper name:
    ``{"name", "label", "shown": [[key, value], ...], "inner": the wrapped level's dict or None}`` (JSON-ready;
    what a run stores as ``stack`` beside the description's text, and what the report's labels and a study's
    layouts read). None for a plain string without structure."""
    if not hasattr(desc, "shown"):
        return None
    return {"name": desc.name, "label": label(desc.name), "shown": [list(kv) for kv in desc.shown],
            "inner": described(desc.inner) if desc.inner is not None else None}


def sections() -> Dict[str, type]:
    """Config section -> parameter dataclass, in registration order."""
    out: Dict[str, type] = {}
    for r in _RULES.values():
        if r.config_section and r.config_section not in out:
            out[r.config_section] = r.params
    return out


def _key(a: Any, key: str, default: Any = None) -> Any:
    """``a.<key>`` of an ``algorithm`` node given as a dict, a DictConfig or a dataclass."""
    return a.get(key, default) if hasattr(a, "get") else getattr(a, key, default)


def stack(a: Any) -> List[str]:
    """The rule names of the ``algorithm`` node ``a`` (a dict, DictConfig or dataclass): the base, the server
    optimiser unless it is ``sgd`` (the base's own step), the wrappers innermost first, then the transforms in the
    order they apply."""
    opt = _key(a, "server_opt") or NO_SERVER_OPT
    return ([_key(a, "name")] + ([opt] if opt != NO_SERVER_OPT else []) + list(_key(a, "wrappers") or [])
            + list(_key(a, "transforms") or []))


def name_parts(a: Any, name: str) -> List[str]:
    """What rule ``name`` of the ``algorithm`` node ``a`` contributes to a default experiment name: its name, then
    each of its :attr:`Rule.named` parameters as prefix and value (floats as ``%g``): ``["fedbug", "p0.2"]``."""
    rule = _RULES[name]
    sec = _key(a, rule.config_section) if rule.config_section else None
    out = [name]
    for prefix, field in rule.named:
        value = _key(sec, field) if sec is not None else None
        out.append(f"{prefix}{value:g}" if isinstance(value, float) else f"{prefix}{value}")
    return out


def trim_sections(a: Dict[str, Any]) -> Dict[str, Any]:
    """The ``algorithm`` container ``a`` (a plain dict) with only the sections of the rules in its :func:`stack`:
    the shared keys and what the stack reads, i.e. what determines a run's numbers (MLflow params, fingerprints)."""
    names = stack(a)
    keep = set(stack_sections(names)) | set(names)
    # an empty ``transforms`` (no message transform, the default) is left out: the key came after the first
    # fingerprints were written, and a run without transforms keeps its fingerprint and MLflow params
    return {k: v for k, v in a.items()
            if (not isinstance(v, dict) or k in keep) and not (k == "transforms" and not v)}


def stack_sections(stack: List[str]) -> List[str]:
    """The config sections the rules of ``stack`` (base, server optimiser, wrappers) read, without repeats."""
    out: List[str] = []
    for name in stack:
        r = _RULES.get(name)
        sec = r.config_section if r else None
        if sec and sec not in out:
            out.append(sec)
    return out


def _check_stack_names(a: Any) -> None:
    """The stack's names: ``algorithm.name`` a base, ``server_opt`` a server optimiser, every wrapper a wrapper (a
    transform given there is pointed at ``algorithm.transforms``), every transform a transform."""
    if a.name not in names("base"):
        raise ConfigError(f"algorithm.name must be one of {', '.join(names('base'))}, got {a.name!r}")
    if a.server_opt not in names("server"):
        raise ConfigError(f"algorithm.server_opt must be one of {', '.join(names('server'))}, got {a.server_opt!r}")
    for i, w in enumerate(a.wrappers):
        if w in names("transform"):
            raise ConfigError(f"algorithm.wrappers[{i}]={w} is a message transform: give it in algorithm.transforms "
                              f"(e.g. algorithm.transforms=[{w}]), not in algorithm.wrappers")
        if w not in names("wrapper"):
            raise ConfigError(f"algorithm.wrappers[{i}] must be one of {', '.join(names('wrapper'))}, got {w!r}")
    for i, t in enumerate(_key(a, "transforms") or []):
        if t not in names("transform"):
            raise ConfigError(f"algorithm.transforms[{i}] must be one of {', '.join(names('transform'))}, got {t!r}")


def check_algorithm(a: Any) -> None:
    """Check the ``algorithm`` node ``a``: the stack's names, every section's fields, and that the base honours
    the shared keys it is given.

    Raises:
        ConfigError: one line naming the offending key.
    """
    _check_stack_names(a)
    if a.aggregation is not None:
        check_choice("algorithm.aggregation", a.aggregation, AGGREGATIONS)
    if a.eta_g is not None:
        check_finite("algorithm.eta_g", a.eta_g)
        check_range("algorithm.eta_g", a.eta_g, 0, lo_open=True)
    for sec, schema in sections().items():
        check_fields(schema, getattr(a, sec), f"algorithm.{sec}")
    for name in stack(a):
        r = _RULES[name]
        if r.check is not None:
            r.check(a, f"algorithm.{r.config_section or r.name}")
    base = _RULES[a.name]
    if a.aggregation is not None and a.aggregation not in base.aggregation:
        raise ConfigError(f"algorithm.aggregation={a.aggregation} is not used by {a.name}, which averages only "
                          f"{' | '.join(base.aggregation)} ({base.citation}); set algorithm.aggregation="
                          f"{base.aggregation[0]} or null (the rule's own)")
    if not base.eta_g and a.eta_g is not None and float(a.eta_g) != 1.0:
        raise ConfigError(f"algorithm.eta_g={fmt(float(a.eta_g))} is not used by {a.name}, whose server step has "
                          f"no server learning rate ({base.citation}); leave algorithm.eta_g=1")
    if not base.eta_g and a.server_opt != NO_SERVER_OPT:
        raise ConfigError(f"algorithm.server_opt={a.server_opt} does not compose with {a.name}, whose server step is "
                          f"not a step along a pseudo-gradient ({base.citation}); leave algorithm.server_opt="
                          f"{NO_SERVER_OPT}")


def aggregation(a: Any) -> str:
    """``algorithm.aggregation`` of node ``a``, or when it is unset (null) the base rule's own (its first allowed
    value: ``weighted`` for FedAvg-type rules, ``uniform`` for SCAFFOLD, FedDyn, FedDC, FedBCGD)."""
    if a.aggregation is not None:
        return str(a.aggregation)
    base = _RULES.get(a.name)
    if base is None:
        return AGGREGATIONS[0]
    return base.own_aggregation(a) if base.own_aggregation is not None else base.aggregation[0]


def eta_g(a: Any) -> float:
    """``algorithm.eta_g`` of node ``a``, or when it is unset (null) the server optimiser's own step size
    (:attr:`Rule.default_eta_g`: 1 for ``sgd`` and ``momentum``, 0.03 for adam and yogi, 0.3 for adagrad)."""
    value = _key(a, "eta_g")
    if value is not None:
        return float(value)
    opt = _RULES.get(_key(a, "server_opt") or NO_SERVER_OPT)
    return float(opt.default_eta_g) if opt is not None else 1.0


def how_to_use(section: str) -> str:
    """The overrides that put a rule reading ``algorithm.<section>`` into the stack, e.g.
    ``algorithm=fedprox (or algorithm.name=fedprox)``; several rules sharing the section are joined with ``|``."""
    hints = []
    for r in _RULES.values():
        if r.config_section != section:
            continue
        if r.kind == "base":
            own = f"algorithm.name={r.name}"
        elif r.kind == "server":
            own = f"algorithm.server_opt={r.name}"
        elif r.kind == "transform":
            own = f"algorithm.transforms=[{r.name}]"
        else:
            own = f"algorithm.wrappers=[{r.name}]"
        hints.append(f"algorithm={r.preset_name} (or {own})")
    return " | ".join(hints)


def section_labels(section: str) -> str:
    """The paper names of the rules that read ``algorithm.<section>`` (``FedBCGD / FedBCGD+``)."""
    return " / ".join(r.label for r in _RULES.values() if r.config_section == section)


def prepare_model(a: Any, model: Any) -> None:
    """Let every rule of the stack of the ``algorithm`` node ``a`` add its own parameters to ``model``
    (:attr:`Rule.prepare_model`), before ``ParamSpec.from_model(model)`` and :func:`build`.

    Raises:
        ConfigError: a rule whose additions the model cannot take (one line naming the key).
    """
    for name in stack(a):
        rule = _RULES[name]
        if rule.prepare_model is not None:
            rule.prepare_model(getattr(a, rule.config_section) if rule.config_section else None, model)


def build(a: Any, spec: ParamSpec, model: Any = None, momentum: float = 0.0, optimizer: str = "sgd"):
    """The algorithm stack of the ``algorithm`` node ``a``: its base, with the server optimiser ``a.server_opt``,
    wrapped by ``a.wrappers`` in order (first = innermost). ``momentum``: ``train.momentum``, ``optimizer``:
    ``train.optimizer`` (the rules read them from :class:`BuildContext`).

    Raises:
        ConfigError: unknown names, a shared key the base does not honour (:func:`check_algorithm`), or
            ``train.momentum`` > 0 or ``train.optimizer=adam`` with a rule that assumes plain local SGD
            (:func:`refuse_local_momentum`, :func:`refuse_local_adam`).
    """
    check_algorithm(a)
    ctx = BuildContext(algorithm=a, spec=spec, model=model, aggregation=aggregation(a), eta_g=eta_g(a),
                       momentum=float(momentum), optimizer=str(optimizer))

    def section(rule: Rule):
        return getattr(a, rule.config_section) if rule.config_section else None

    base = _RULES[a.name]
    algo = base.build(section(base), ctx)
    for name in stack(a)[1:]:
        rule = _RULES[name]
        if rule.kind == "transform":
            algo = Transformed(algo, rule.build(section(rule), ctx))
        else:
            algo = rule.build(algo, section(rule), ctx)
    return algo


def help_lines() -> List[str]:
    """``fl-train --help``'s rule list: one line per rule, and one per parameter with its range and meaning."""
    out = []
    for kind, title in (("base", "algorithm.name (base rules)"),
                        ("server", "algorithm.server_opt (server optimiser over a base with a pseudo-gradient)"),
                        ("wrapper", "algorithm.wrappers (wrap any base)"),
                        ("transform", "algorithm.transforms (message transforms of the upload, applied in order)")):
        out.append(f"  {title}:")
        for r in rules(kind):
            out.append(f"    {r.name:<13} {r.label}: {r.summary}")
    out.append("  rule parameters (algorithm.<section>.<key>, allowed values, meaning):")
    for sec, schema in sections().items():
        for f in fields(schema):
            rng = describe_range(f)
            only = " and ".join(c.text() for c in f.metadata.get("when", ()))
            out.append(f"    algorithm.{sec}.{f.name}" + (f" [{rng}]" if rng else "") + (f" (only with {only})" if only else "")
                       + (f"  {f.metadata.get('help')}" if f.metadata.get("help") else ""))
    return out
