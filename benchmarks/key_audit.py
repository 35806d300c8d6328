#!/usr/bin/env python
"""Config-key audit: every key of the config either changes the run or is refused.

The project's rule is that no config key is accepted and then ignored. This script measures it. For every
preset ``P`` of ``conf/algorithm/`` it trains, in memory (:func:`pipeline.api.run`, nothing written, nothing
tracked), a baseline on a tiny fast setting (:data:`TINY`: digits, 4 clients, 2 rounds of 1 local epoch, full
participation, float64, no checkpoints) and then, for each leaf key, the same run with that ONE key set to
another valid value. Each key gets one of:

- ``refused``: :func:`fl_core.config.compose` (or a rule's constructor) raised ``ConfigError``; its message is
  kept,
- ``changes``: the final global model, the per-round history (every logged metric but wall-clock times) or the
  run's summary (:func:`fl_core.metrics.summarize_run`: final accuracy, rounds to target, ...) differs from the
  baseline,
- ``NO-OP``: accepted and the run is bit-identical to the baseline (the key was ignored),
- ``failed``: accepted by the config, but building or running raised (message kept; e.g. a data set whose files
  are absent).

Keys audited: the ``algorithm`` section (its shared keys ``name``, ``wrappers``, ``aggregation``, ``eta_g``,
``server_opt`` and every field of every rule section, in or out of the preset's stack) and the sections that are
not rules, ``dataset``, ``partition``, ``model``, ``train``. Not audited: ``engine.*`` and ``tracking.*`` (how a
run runs, not what it computes), the top-level ``seed``, ``name``, ``results_dir``, ``data_dir`` and
``dataset.root``. The column ``stack`` says whether a rule section is read by the preset's stack
(:func:`fl_core.algorithms.registry.stack_sections`): ``in`` / ``out``; ``shared`` for the shared algorithm keys,
``-`` for the sections that are not rules.

The other value of a key: another choice (every other choice is tried in turn until one changes the run; a key
of a rule section outside the stack gets only its first other choice), the other boolean, an int + 1 (or - 1)
within its declared range, a float x 0.5 (or +- 0.1, x 2) within its declared range (the ``ge/gt/le/lt`` of
:func:`fl_core.schema.param`); :data:`HINTS` names the values of the few keys a generic value cannot exercise in
two rounds (``train.grad_clip`` unset -> 0.1, ...). ``algorithm.wrappers`` gets one more wrapper,
``algorithm.name`` and ``algorithm.server_opt`` the other registered names.

Switch contexts (off with ``--no-switches``): a key can be read only under some value of another key (FedBCGD's
``lam`` with ``momentum=true``). So for every boolean or choice key of a section in the preset's stack, each of
its other values makes a context of its own: the preset plus that one override (where the config refuses it or
the run cannot train it alone, with the first of :data:`COMPANIONS` beside it that gives a baseline, e.g.
``algorithm.aggregation=uniform``), whose baseline is trained and whose in-stack rule keys and
``algorithm.eta_g`` / ``algorithm.aggregation`` are audited the same way. The same keys are also audited under
:data:`SETTING_SWITCHES` (a decaying lr, partial participation, both over 3 rounds, and partition=dirichlet),
where a rule's state or schedule can show. The sections that are not rules get the contexts of
:data:`NONRULE_SWITCHES` (partition=dirichlet and its variants, partition=iid, participation 0.5, crop_flip
augmentation, stragglers 0.5 at E = 2, model=mlp, dataset=synthetic, dataset=mnist1d, partition=natural on
synthetic), audited once, on ``algorithm=fedavg``. A NO-OP is then explained from the contexts
where the same key changes the run: ``out-of-stack section``; ``switched off by <switch>`` (a NO-OP in a switch
context of a key that changes the preset's own run); ``switched off here; changes under <contexts>``; ``no effect
with this preset; changes with <presets>`` (non-rule keys); ``no effect measured`` (in no context).

The script also runs the cross-cutting cases :data:`CROSS`: a misspelt key added with ``+``, an infinite
learning rate, FedProx with the server optimiser Adam against FedProx over 5 rounds of the default setting
(seeds 0, 1, 2), and FedExP's ``fedbug_code`` variant with ``algorithm.aggregation=null``.

Run from the project root::

    PYTHONPATH=$PWD python benchmarks/key_audit.py                       # everything (about 25 minutes on one core)
    PYTHONPATH=$PWD python benchmarks/key_audit.py --presets fedprox,qsgd --sections algorithm
    PYTHONPATH=$PWD python benchmarks/key_audit.py --sections train,partition --no-switches --no-cross
    PYTHONPATH=$PWD python benchmarks/key_audit.py --json /tmp/key_audit.json --quiet

Prints one table row per (context, key), then per preset the counts of refused / changes / NO-OP / failed and
the list of NO-OP keys with their reason, then the cross-cutting cases. ``--json FILE`` writes all of it,
including every trial (override, status, message, what differed). Runs are deterministic (the baseline of every
context is trained twice and must be bit-identical; a row ``nondeterministic`` says when it is not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import ListConfig  # noqa: E402

from fl_core.algorithms import registry  # noqa: E402
from pipeline.api import run as api_run  # noqa: E402
from fl_core.config import compose  # noqa: E402
from fl_core.paths import conf_dir  # noqa: E402
from fl_core.schema import SECTIONS, ConfigError  # noqa: E402

# The tiny setting every audit run shares (a run takes well under a second on one CPU thread).
TINY = ("dataset=digits", "partition.num_clients=4", "train.rounds=2", "train.local_epochs=1",
        "train.participation=1", "engine.dtype=float64", "engine.executor=sequential", "engine.checkpoint_every=0",
        "engine.progress=false", "tracking.enabled=false")
NONRULE = ("dataset", "partition", "model", "train")
SHARED = ("name", "wrappers", "aggregation", "eta_g", "server_opt")
SKIP = {"dataset.root"}  # a path: where, not what
# Values that exercise a key in two rounds where the generic rule would not (first value that changes wins).
HINTS: Dict[str, List[Any]] = {
    "train.grad_clip": [0.1],  # unset -> a norm small enough to clip
    "train.target_acc": [0.05],  # reached in round 1 of the tiny setting -> rounds_to_target changes
    "train.final_window": [1],  # fewer than the 2 evaluations
    "train.eval_every": [2],
    "partition.min_size": [11, 250],  # 250: above the smallest client of dirichlet/per_class -> redraws
    "model.units": ["module", "block", "code5", "paper6"],
    "train.local_epochs_max": [3],  # unset -> a range above E = 1 (b = E is the fixed run)
    "train.stragglers": [0.5, 0.25],  # refused at E = 1; under the straggler switch (s = 0.5) -> 0.25
}
# Contexts that switch on keys of the sections that are not rules: (overrides, section audited).
NONRULE_SWITCHES: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("partition.name=dirichlet",), "partition"),
    (("partition.name=dirichlet", "partition.variant=per_class"), "partition"),
    (("partition.name=dirichlet", "partition.variant=fixed_size_reuse"), "partition"),
    (("partition.name=iid",), "partition"),
    (("train.participation=0.5",), "train"),
    (("train.augmentation=crop_flip",), "train"),
    (("train.local_epochs=2", "train.stragglers=0.5"), "train"),  # stragglers need E >= 2; drop_stragglers acts
    (("model.name=mlp",), "model"),
    # the generated datasets' keys act only with their dataset (partition=natural only with synthetic's devices)
    (("dataset.name=synthetic",), "dataset"),
    (("dataset.name=mnist1d",), "dataset"),
    (("dataset.name=synthetic", "dataset.num_devices=4", "partition.name=natural"), "partition"),
)
NONRULE_SWITCH_PRESET = "fedavg"
# Beside a switch that the config refuses or the run cannot train alone (fedexp.variant=fedbug_code needs
# aggregation uniform; fedbug.schedule=code needs P*K_i >= M): the first that gives a baseline is kept.
COMPANIONS: Tuple[Tuple[str, ...], ...] = ((), ("algorithm.aggregation=null",), ("algorithm.aggregation=uniform",),
                                           ("algorithm.eta_g=1",), ("algorithm.fedbug.gu_percentage=0.5",))
# Settings under which a rule key may act only (lr_in_update with a decaying lr, states of clients that skip
# rounds, label skew; a third round, as a state a client leaves in round 2 reaches the model in round 3 only):
# per preset, its in-stack rule keys and eta_g / aggregation are audited under each.
SETTING_SWITCHES: Tuple[Tuple[str, ...], ...] = (("train.lr_decay=0.5", "train.rounds=3"),
                                                 ("train.participation=0.5", "train.rounds=3"),
                                                 ("partition.name=dirichlet",))
# Cross-cutting cases: (name, overrides, reference overrides or None, seeds). Default setting unless tiny.
DEFAULT_SHORT = ("train.rounds=5", "tracking.enabled=false", "engine.checkpoint_every=0", "engine.progress=false")
CROSS: Tuple[Tuple[str, Tuple[str, ...], Optional[Tuple[str, ...]], Tuple[int, ...]], ...] = (
    ("misspelt key added with +", TINY + ("algorithm=fedavg", "+train.roudns=3"), TINY + ("algorithm=fedavg",), (0,)),
    ("infinite learning rate", TINY + ("algorithm=fedavg", "train.lr=1e400"), TINY + ("algorithm=fedavg",), (0,)),
    ("fedprox + server_opt=adam, 5 rounds, default setting",
     DEFAULT_SHORT + ("algorithm=fedprox", "algorithm.server_opt=adam"), DEFAULT_SHORT + ("algorithm=fedprox",),
     (0, 1, 2)),
    ("fedexp variant fedbug_code with aggregation=null",
     TINY + ("algorithm=fedexp", "algorithm.fedexp.variant=fedbug_code", "algorithm.aggregation=null"), None, (0,)),
)
TIMING_COLUMNS = ("round_time_s",)
STATUS_ORDER = ("changes", "NO-OP", "failed", "refused")  # a key's status: the first any of its values reached


# --------------------------------------------------------------------------- one run and its fingerprint


@dataclass
class Outcome:
    """One trial: ``status`` ok | refused | failed; for ok the hashes of model, history and summary."""

    status: str
    message: str = ""
    model: str = ""
    history: str = ""
    summary: str = ""
    final_acc: Optional[float] = None  # mean over the seeds that finished
    seed_acc: Dict[str, Optional[float]] = field(default_factory=dict)  # final accuracy per finished seed
    run_failure: str = ""  # the run stopped early (RunFailed: divergence), its history is still compared
    seconds: float = 0.0


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


def _model_hash(state: Optional[Dict[str, torch.Tensor]]) -> str:
    if not state:
        return "none"
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def trial(overrides: Sequence[str], seeds: Sequence[int] = (0,)) -> Tuple[Outcome, Any]:
    """Compose and train ``overrides`` in memory; (outcome, composed config or None)."""
    t0 = time.perf_counter()
    try:
        cfg = compose(list(overrides))
    except ConfigError as err:
        return Outcome("refused", str(err), seconds=time.perf_counter() - t0), None
    try:
        res = api_run(list(overrides), seeds=tuple(seeds))
    except ConfigError as err:  # a rule's constructor (fl_core.schema.checked) after composition
        return Outcome("refused", f"(at build) {err}", seconds=time.perf_counter() - t0), cfg
    except Exception as err:  # noqa: BLE001 - any error of an accepted config is what we report
        return Outcome("failed", _first_line(err), seconds=time.perf_counter() - t0), cfg
    hist = res.history.drop(columns=[c for c in TIMING_COLUMNS if c in res.history.columns])
    hist = hist[sorted(hist.columns)]
    records = hist.to_dict("records")
    summary = {"per_seed": res.summary.get("per_seed"), "failures": res.summary.get("failures")}
    models = "|".join(_model_hash(res.models.get(s)) for s in seeds)
    accs = [s.get("final_acc") for s in (res.summary.get("per_seed") or {}).values()]
    accs = [a for a in accs if a is not None]
    out = Outcome("ok", model=models, history=_sha(repr(records).encode()),
                  summary=_sha(json.dumps(summary, sort_keys=True, default=repr).encode()),
                  final_acc=sum(accs) / len(accs) if accs else None,
                  seed_acc={k: v.get("final_acc") for k, v in (res.summary.get("per_seed") or {}).items()},
                  run_failure="; ".join(f"seed {k}: {v}" for k, v in (res.summary.get("failures") or {}).items()),
                  seconds=time.perf_counter() - t0)
    return out, cfg


def differs(a: Outcome, b: Outcome) -> List[str]:
    """What of the run differs between two ok outcomes: model, history, summary ([] = bit-identical)."""
    return [part for part in ("model", "history", "summary") if getattr(a, part) != getattr(b, part)]


# --------------------------------------------------------------------------- keys and their other values


@dataclass
class Key:
    key: str  # dotted, e.g. algorithm.fedprox.mu
    kind: str  # rule | shared | nonrule
    section: str  # algorithm.<sec> for rule keys, algorithm for shared, the section name otherwise
    meta: Dict[str, Any] = field(default_factory=dict)
    type_name: str = ""


def all_keys() -> List[Key]:
    """Every audited key in a fixed order: the non-rule sections, the shared algorithm keys, the rule sections."""
    out = []
    for sec in NONRULE:
        for f in fields(SECTIONS[sec]):
            if f"{sec}.{f.name}" not in SKIP:
                out.append(Key(f"{sec}.{f.name}", "nonrule", sec, dict(f.metadata), str(f.type)))
    out += [Key(f"algorithm.{k}", "shared", "algorithm") for k in SHARED]
    for sec, schema in registry.sections().items():
        for f in fields(schema):
            out.append(Key(f"algorithm.{sec}.{f.name}", "rule", f"algorithm.{sec}", dict(f.metadata), str(f.type)))
    return out


def selected(key: str, sections: Sequence[str]) -> bool:
    return any(key == s or key.startswith(s + ".") for s in sections)


def get_value(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    if isinstance(node, ListConfig):
        return list(node)
    return node


def _in_range(x: float, m: Dict[str, Any]) -> bool:
    if not math.isfinite(x):
        return False
    return not ((m.get("ge") is not None and x < m["ge"]) or (m.get("gt") is not None and x <= m["gt"])
                or (m.get("le") is not None and x > m["le"]) or (m.get("lt") is not None and x >= m["lt"]))


def candidates(k: Key, cfg: Any) -> List[Any]:
    """The other valid values to try for key ``k`` in config ``cfg``, most telling first."""
    cur = get_value(cfg, k.key)
    if k.key in HINTS:
        return [v for v in HINTS[k.key] if v != cur]
    a = cfg.algorithm
    if k.kind == "shared":
        name = k.key.split(".")[1]
        if name == "name":
            return [n for n in registry.names("base") if n != cur]
        if name == "server_opt":
            return [n for n in registry.names("server") if n != cur]
        if name == "wrappers":
            return [list(cur) + [w] for w in registry.names("wrapper") if w not in cur]
        if name == "aggregation":
            return [v for v in registry.AGGREGATIONS if v != registry.aggregation(a)]
        if name == "eta_g":
            return [float(cur) * 0.5]
    m = k.meta
    if m.get("choices"):
        return [c for c in m["choices"] if c != cur]
    if isinstance(cur, bool):
        return [not cur]
    is_int = isinstance(cur, int) or (cur is None and "int" in k.type_name and "float" not in k.type_name)
    if cur is None:
        pool = [1, 2] if is_int else [0.1, 0.5, 1.0]
    elif is_int:
        pool = [cur + 1, cur - 1]
    elif isinstance(cur, float):
        pool = [cur * 0.5, cur + 0.1, cur - 0.1, cur * 2] if cur != 0 else [0.1, 0.5, 1.0]
    else:
        return []  # a free string without a hint
    ok = [x for x in pool if _in_range(float(x), m) and x != cur]
    return ok[:1]


def hydra_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def merge(base: Sequence[str], extra: Sequence[str]) -> List[str]:
    """``base`` overrides with ``extra`` appended; an override of a key already there replaces it."""
    out = list(base)
    for o in extra:
        lhs = o.split("=", 1)[0].lstrip("+~")
        out = [x for x in out if x.split("=", 1)[0].lstrip("+~") != lhs] + [o]
    return out


# --------------------------------------------------------------------------- contexts


@dataclass
class Context:
    preset: str
    switch: Tuple[str, ...]  # overrides beside algorithm=<preset> that define the context (() = the preset)
    keys: List[Key]
    kind: str = "preset"  # preset | rule-switch | setting-switch | nonrule-switch
    options: List[Tuple[str, ...]] = field(default_factory=list)  # switch + companions, tried in order

    @property
    def label(self) -> str:
        return ",".join(s.replace("algorithm.", "") for s in self.switch) or "-"


def presets() -> List[str]:
    return sorted(p.stem for p in (Path(conf_dir()) / "algorithm").glob("*.yaml"))


def rule_switches(cfg: Any, keys: List[Key]) -> List[Tuple[str, ...]]:
    """One switch per other value of every boolean / choice key of the sections in the stack of ``cfg``."""
    stack = set(registry.stack_sections(registry.stack(cfg.algorithm)))
    out = []
    for k in keys:
        if k.kind == "rule" and k.section.split(".")[1] in stack:
            cur = get_value(cfg, k.key)
            if isinstance(cur, bool):
                out.append((f"{k.key}={hydra_value(not cur)}",))
            elif k.meta.get("choices"):
                out += [(f"{k.key}={hydra_value(c)}",) for c in k.meta["choices"] if c != cur]
    return out


def audit_context(ctx: Context, setting: Sequence[str], log) -> Dict[str, Any]:
    """Baseline (twice) and every key of ``ctx``; the context's record."""
    start = merge(TINY, [f"algorithm={ctx.preset}"]) + list(setting)
    for option in ctx.options or [ctx.switch]:
        base = merge(start, option)
        b1, cfg = trial(base)
        if b1.status == "ok":
            ctx.switch = tuple(option)
            break
    rec: Dict[str, Any] = {"preset": ctx.preset, "switch": list(ctx.switch), "label": ctx.label, "kind": ctx.kind,
                           "overrides": base, "keys": []}
    if b1.status != "ok":
        rec.update(status=b1.status, message=b1.message)
        log(f"  baseline {b1.status}: {b1.message}")
        return rec
    b2, _ = trial(base)
    rec["deterministic"] = b2.status == "ok" and not differs(b1, b2)
    stack = registry.stack(cfg.algorithm)
    stack_secs = registry.stack_sections(stack)
    rec.update(status="ok", stack=stack, stack_sections=stack_secs, baseline=b1.__dict__)
    switched = {s.split("=", 1)[0] for s in ctx.switch}
    for k in ctx.keys:
        if k.key in switched:
            continue
        if k.kind == "rule":
            in_stack = "in" if k.section.split(".")[1] in stack_secs else "out"
        else:
            in_stack = "shared" if k.kind == "shared" else "-"
        cands = candidates(k, cfg)
        if in_stack == "out":
            cands = cands[:1]
        row: Dict[str, Any] = {"key": k.key, "kind": k.kind, "stack": in_stack,
                               "current": _plain(get_value(cfg, k.key)), "trials": []}
        for v in cands:
            ov = merge(base, [f"{k.key}={hydra_value(v)}"])
            out, _ = trial(ov)
            if out.status == "ok":
                diff = differs(out, b1)
                status = "changes" if diff else "NO-OP"
            else:
                diff, status = [], out.status
            row["trials"].append({"value": _plain(v), "status": status, "message": out.message, "diff": diff,
                                  "final_acc": out.final_acc, "run_failure": out.run_failure,
                                  "seconds": round(out.seconds, 3)})
            if status == "changes":
                break
        if not row["trials"]:
            row.update(status="skipped", value=None, message="no other valid value to try")
        else:
            best = min(row["trials"], key=lambda t: STATUS_ORDER.index(t["status"]))
            row.update(status=best["status"], value=best["value"], message=best["message"], diff=best["diff"])
        rec["keys"].append(row)
    return rec


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def build_contexts(names: List[str], sections: Sequence[str], switches: bool, setting: Sequence[str],
                   log) -> List[Context]:
    keys = [k for k in all_keys() if selected(k.key, sections)]
    out: List[Context] = []
    for p in names:
        out.append(Context(p, (), keys))
        if not switches:
            continue
        cfg = compose(merge(merge(TINY, [f"algorithm={p}"]) + list(setting), []))
        base = merge(TINY, [f"algorithm={p}"]) + list(setting)
        for sw, kind in [(sw, "rule-switch") for sw in rule_switches(cfg, all_keys())] + [
                (sw, "setting-switch") for sw in SETTING_SWITCHES]:
            options = []
            for comp in COMPANIONS:
                try:  # what building the stack checks: the composed config with aggregation resolved
                    ccfg = compose(merge(base, sw + comp))
                    registry.check_algorithm(ccfg.algorithm)
                except ConfigError:
                    continue
                options.append(sw + comp)
            if not options:
                log(f"  {p}: switch {sw[0]} refused with every companion; skipped")
                continue
            stack_secs = set(registry.stack_sections(registry.stack(compose(merge(base, options[0])).algorithm)))
            ks = [k for k in keys if (k.kind == "rule" and k.section.split(".")[1] in stack_secs)
                  or k.key in ("algorithm.eta_g", "algorithm.aggregation")]
            if ks:
                out.append(Context(p, options[0], ks, kind, options))
    if switches and NONRULE_SWITCH_PRESET in names:
        for sw, sec in NONRULE_SWITCHES:
            ks = [k for k in keys if k.section == sec]
            if ks:
                out.append(Context(NONRULE_SWITCH_PRESET, sw, ks, "nonrule-switch"))
    return out


# --------------------------------------------------------------------------- reasons, table, summary


def explain(records: List[Dict[str, Any]]) -> None:
    """Give every NO-OP row a ``reason`` from the contexts where the same key changes the run.

    ``out-of-stack section``; ``switched off by <switch>`` (a switch context's NO-OP of a key that changes the
    preset's own run); ``switched off here; changes under <contexts>`` (the key acts only under those switches);
    ``no effect with this preset; changes with <presets>`` (a key of a non-rule section that changes other
    presets' runs); ``no effect measured`` (in no context)."""
    changes: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    base_presets: Dict[str, List[str]] = {}
    nonrule_ctx: Dict[str, List[Dict[str, Any]]] = {}
    for rec in records:
        for row in rec["keys"]:
            if row["status"] == "changes":
                changes.setdefault((rec["preset"], row["key"]), []).append(rec)
                if not rec["switch"]:
                    base_presets.setdefault(row["key"], []).append(rec["preset"])
                if rec["kind"] == "nonrule-switch":
                    nonrule_ctx.setdefault(row["key"], []).append(rec)
    for rec in records:
        for row in rec["keys"]:
            if row["status"] != "NO-OP":
                continue
            own = [c for c in changes.get((rec["preset"], row["key"]), []) if c is not rec]
            others = [p for p in base_presets.get(row["key"], []) if p != rec["preset"]]
            if row["stack"] == "out":
                reason = "out-of-stack section"
            elif rec["switch"] and any(not c["switch"] for c in own):
                reason = f"switched off by {rec['label']}"
            elif own:
                reason = "switched off here; changes under " + " | ".join(c["label"] for c in own[:4])
            elif row["kind"] == "nonrule" and others:
                reason = ("no effect with this preset; changes with " + ", ".join(others[:3])
                          + (f" (+{len(others) - 3} more)" if len(others) > 3 else ""))
            elif row["kind"] == "nonrule" and nonrule_ctx.get(row["key"]):
                reason = "switched off here; changes under " + " | ".join(
                    f"{c['label']} ({c['preset']})" for c in nonrule_ctx[row["key"]][:4])
            else:
                reason = "no effect measured"
            row["reason"] = reason


def table(records: List[Dict[str, Any]]) -> List[str]:
    lines = [f"{'preset':<13} {'context':<50} {'key':<42} {'stack':<6} {'status':<8} {'value':<22} detail",
             "-" * 170]
    for rec in records:
        if rec["status"] != "ok":
            lines.append(f"{rec['preset']:<13} {rec['label']:<50} {'(baseline)':<42} {'':<6} {rec['status']:<8} "
                         f"{'':<22} {rec.get('message', '')}")
            continue
        if not rec.get("deterministic", True):
            lines.append(f"{rec['preset']:<13} {rec['label']:<50} {'(baseline)':<42} {'':<6} nondeterministic")
        for row in rec["keys"]:
            detail = row.get("message") or ""
            if row["status"] == "changes":
                detail = ",".join(row.get("diff") or [])
            elif row["status"] == "NO-OP":
                detail = row.get("reason", "")
            val = "" if row.get("value") is None and row["status"] == "skipped" else hydra_value(row.get("value"))
            lines.append(f"{rec['preset']:<13} {rec['label'][:50]:<50} {row['key']:<42} {row['stack']:<6} "
                         f"{row['status']:<8} {val[:22]:<22} {detail}")
    return lines


def _reason_class(reason: str) -> int:
    for i, prefix in enumerate(("out-of-stack", "switched off", "no effect with", "no effect measured")):
        if reason.startswith(prefix):
            return i
    return 4


def summary(records: List[Dict[str, Any]]) -> Tuple[List[str], Dict[str, Any]]:
    lines = ["", "Per preset (keys audited in the preset's own context | in its switch contexts):",
             f"{'preset':<13} {'refused':>8} {'changes':>8} {'NO-OP':>6} {'failed':>7} {'skipped':>8}   "
             f"{'refused':>8} {'changes':>8} {'NO-OP':>6} {'failed':>7}  contexts"]
    counts: Dict[str, Any] = {}
    for p in dict.fromkeys(r["preset"] for r in records):
        own = [row for r in records if r["preset"] == p and not r["switch"] for row in r["keys"]]
        sw = [row for r in records if r["preset"] == p and r["switch"] for row in r["keys"]]
        c1 = {s: sum(1 for row in own if row["status"] == s) for s in STATUS_ORDER + ("skipped",)}
        c2 = {s: sum(1 for row in sw if row["status"] == s) for s in STATUS_ORDER}
        n = sum(1 for r in records if r["preset"] == p)
        counts[p] = {"preset": c1, "switches": c2, "contexts": n}
        lines.append(f"{p:<13} {c1['refused']:>8} {c1['changes']:>8} {c1['NO-OP']:>6} {c1['failed']:>7} "
                     f"{c1['skipped']:>8}   {c2['refused']:>8} {c2['changes']:>8} {c2['NO-OP']:>6} {c2['failed']:>7}"
                     f"  {n}")
    noops = [(r, row) for r in records for row in r["keys"] if row["status"] == "NO-OP"]
    lines += ["", f"NO-OP keys ({len(noops)}): accepted, and the run is bit-identical to its context's baseline",
              f"{'preset':<13} {'context':<50} {'key':<42} {'stack':<6} {'value':<14} reason"]
    for r, row in sorted(noops, key=lambda x: (_reason_class(x[1].get("reason", "")), x[0]["preset"],
                                               x[0]["label"], x[1]["key"])):
        lines.append(f"{r['preset']:<13} {r['label'][:50]:<50} {row['key']:<42} {row['stack']:<6} "
                     f"{hydra_value(row['value'])[:14]:<14} {row.get('reason', '')}")
    bad = [r for r in records if r["status"] != "ok" or not r.get("deterministic", True)]
    if bad:
        lines += ["", "Contexts without a usable baseline:"]
        lines += [f"  {r['preset']} [{r['label']}]: {r['status']} {r.get('message', '')}"
                  + ("" if r.get("deterministic", True) else " (nondeterministic)") for r in bad]
    return lines, counts


def cross_cases(log) -> Tuple[List[str], List[Dict[str, Any]]]:
    lines, out = ["", "Cross-cutting cases:"], []
    for name, ov, ref, seeds in CROSS:
        log(f"cross: {name}")
        a, cfg = trial(ov, seeds)
        b = trial(ref, seeds)[0] if ref is not None else None
        rec = {"case": name, "overrides": list(ov), "reference": list(ref) if ref else None, "seeds": list(seeds),
               "status": a.status, "message": a.message, "final_acc": a.final_acc, "seed_acc": a.seed_acc,
               "run_failure": a.run_failure}
        if cfg is not None:
            rec["note"] = _cross_note(name, cfg)
        if b is not None:
            rec.update(reference_status=b.status, reference_final_acc=b.final_acc, reference_seed_acc=b.seed_acc,
                       diff=differs(a, b) if a.status == b.status == "ok" else None)
        out.append(rec)
        acc = "-" if a.final_acc is None else f"{a.final_acc:.4f}"
        racc = "-" if b is None or b.final_acc is None else f"{b.final_acc:.4f}"
        diff = rec.get("diff") or []
        if a.status != "ok":
            verdict = a.status
        elif b is None:
            verdict = "accepted; no reference run"
        else:
            verdict = "accepted; run " + (f"differs ({','.join(diff)})" if diff else "bit-identical to the reference")
        lines.append(f"  {name}: {' '.join(ov)}")
        lines.append(f"    -> {verdict}{(': ' + a.message) if a.message else ''}")
        if rec.get("note"):
            lines.append(f"    composed: {rec['note']}")
        lines.append(f"    final accuracy, mean of the finished seeds of {','.join(map(str, seeds))}: {acc} "
                     f"{_accs(a.seed_acc)}" + (f"; reference {racc} {_accs(b.seed_acc)}" if b is not None else ""))
        if a.run_failure:
            lines.append(f"    run stopped: {a.run_failure}")
    return lines, out


def _accs(seed_acc: Dict[str, Optional[float]]) -> str:
    return "(" + ", ".join(f"seed {k}: {'-' if v is None else f'{v:.4f}'}" for k, v in seed_acc.items()) + ")"


def _cross_note(name: str, cfg: Any) -> str:
    if "misspelt" in name:
        return f"train.roudns={cfg.train.get('roudns')}, train.rounds={cfg.train.rounds}"
    if "learning rate" in name:
        return f"train.lr={cfg.train.lr}"
    if "fedexp" in name:
        return f"algorithm.aggregation={cfg.algorithm.aggregation} (null resolved by compose)"
    return f"algorithm.eta_g={cfg.algorithm.eta_g}, server_opt={cfg.algorithm.server_opt}"


# --------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Run from the project root with PYTHONPATH=$PWD. See the module docstring.")
    ap.add_argument("--presets", default="", help="comma-separated presets of conf/algorithm (default: all)")
    ap.add_argument("--sections", default=",".join(NONRULE + ("algorithm",)),
                    help="comma-separated sections or key prefixes to audit, e.g. algorithm,train or "
                         "algorithm.fedbcgd (default: %(default)s)")
    ap.add_argument("--setting", default="", help="extra comma-separated overrides for every audit run "
                    "(appended to the tiny setting)")
    ap.add_argument("--no-switches", action="store_true", help="only each preset's own context")
    ap.add_argument("--no-cross", action="store_true", help="skip the cross-cutting cases")
    ap.add_argument("--json", metavar="FILE", help="write every result as JSON")
    ap.add_argument("--quiet", action="store_true", help="print only the summary, not one row per key")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    known = presets()
    names = [p for p in args.presets.split(",") if p] or known
    unknown = [p for p in names if p not in known]
    if unknown:
        ap.error(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(known)}")
    sections = [s for s in args.sections.split(",") if s]
    setting = [s for s in args.setting.split(",") if s]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    contexts = build_contexts(names, sections, not args.no_switches, setting, log)
    records = []
    for i, ctx in enumerate(contexts, 1):
        t = time.perf_counter()
        records.append(audit_context(ctx, setting, log))
        log(f"[{i}/{len(contexts)}] {ctx.preset} [{ctx.label}]: {len(ctx.keys)} keys, "
            f"{time.perf_counter() - t:.1f} s (total {time.perf_counter() - t0:.0f} s)")
    explain(records)
    audit_s = time.perf_counter() - t0
    lines = [] if args.quiet else table(records)
    sum_lines, counts = summary(records)
    lines += sum_lines
    cross: List[Dict[str, Any]] = []
    if not args.no_cross:
        cross_lines, cross = cross_cases(log)
        lines += cross_lines
    total_s = time.perf_counter() - t0
    lines += ["", f"setting: {' '.join(TINY + tuple(setting))}",
              f"{len(records)} contexts, {sum(len(r['keys']) for r in records)} keys, "
              f"{sum(len(row['trials']) for r in records for row in r['keys'])} trials; audit {audit_s:.0f} s, "
              f"total {total_s:.0f} s"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": list(TINY) + setting, "sections": sections,
                                               "presets": names, "audit_s": audit_s, "total_s": total_s,
                                               "counts": counts, "contexts": records, "cross": cross},
                                              indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
