#!/usr/bin/env python
"""Config-key audit: every key of the config either changes the run or is refused.

The project's rule is that no config key is accepted and then ignored. This script measures it. For every
preset ``P`` of ``conf/algorithm/`` it trains, in memory (:func:`fl_core.api.run`, nothing written, nothing
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
its other values makes a context of its own (the preset plus that one override; if the config refuses it alone,
with ``algorithm.aggregation=null``, ``=uniform`` or ``algorithm.eta_g=1`` beside it), whose baseline is trained
and whose in-stack rule keys and ``algorithm.eta_g`` / ``algorithm.aggregation`` are audited the same way. The
sections that are not rules get the contexts of :data:`NONRULE_SWITCHES` (partition=dirichlet and its variants,
partition=iid, participation 0.5, crop_flip augmentation, model=mlp), audited once, on ``algorithm=fedavg``.
A NO-OP is then explained from the contexts where the same key changes the run: ``out-of-stack section``,
``switched off by K=v`` (K's value in the NO-OP's context; the key changes the run where K has another value),
or ``no effect measured`` (in no context of the preset).

The script also runs the cross-cutting cases :data:`CROSS`: a misspelt key added with ``+``, an infinite
learning rate, and FedProx with the server optimiser Adam against FedProx over 5 rounds of the default setting.

Run from the project root::

    PYTHONPATH=$PWD python benchmarks/key_audit.py                       # everything (about 20-40 minutes)
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
from fl_core.api import run as api_run  # noqa: E402
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
    "model.units": ["module", "block", "code5", "paper6"],
}
# Contexts that switch on keys of the sections that are not rules: (overrides, section audited).
NONRULE_SWITCHES: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("partition.name=dirichlet",), "partition"),
    (("partition.name=dirichlet", "partition.variant=per_class"), "partition"),
    (("partition.name=dirichlet", "partition.variant=fixed_size_reuse"), "partition"),
    (("partition.name=iid",), "partition"),
    (("train.participation=0.5",), "train"),
    (("train.augmentation=crop_flip",), "train"),
    (("model.name=mlp",), "model"),
)
NONRULE_SWITCH_PRESET = "fedavg"
# Beside a switch the config refuses alone (e.g. fedexp.variant=fedbug_code needs aggregation uniform or null).
COMPANIONS: Tuple[Tuple[str, ...], ...] = ((), ("algorithm.aggregation=null",), ("algorithm.aggregation=uniform",),
                                           ("algorithm.eta_g=1",))
# Cross-cutting cases: (name, overrides, reference overrides or None, seeds). Default setting unless tiny.
DEFAULT_SHORT = ("train.rounds=5", "tracking.enabled=false", "engine.checkpoint_every=0", "engine.progress=false")
CROSS: Tuple[Tuple[str, Tuple[str, ...], Optional[Tuple[str, ...]], Tuple[int, ...]], ...] = (
    ("misspelt key added with +", TINY + ("algorithm=fedavg", "+train.roudns=3"), TINY + ("algorithm=fedavg",), (0,)),
    ("infinite learning rate", TINY + ("algorithm=fedavg", "train.lr=1e400"), TINY + ("algorithm=fedavg",), (0,)),
    ("fedprox + server_opt=adam, 5 rounds, default setting",
     DEFAULT_SHORT + ("algorithm=fedprox", "algorithm.server_opt=adam"), DEFAULT_SHORT + ("algorithm=fedprox",),
     (0, 1, 2)),
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
    final_acc: Optional[float] = None
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
    kind: str = "preset"  # preset | rule-switch | nonrule-switch

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
    base = merge(merge(TINY, [f"algorithm={ctx.preset}"]) + list(setting), ctx.switch)
    rec: Dict[str, Any] = {"preset": ctx.preset, "switch": list(ctx.switch), "label": ctx.label, "kind": ctx.kind,
                           "overrides": base, "keys": []}
    b1, cfg = trial(base)
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
        for sw in rule_switches(cfg, all_keys()):
            base = merge(TINY, [f"algorithm={p}"]) + list(setting)
            chosen = None
            for comp in COMPANIONS:
                try:
                    ccfg = compose(merge(base, sw + comp))
                except ConfigError:
                    continue
                chosen = (sw + comp, ccfg)
                break
            if chosen is None:
                log(f"  {p}: switch {sw[0]} refused with every companion; skipped")
                continue
            stack_secs = set(registry.stack_sections(registry.stack(chosen[1].algorithm)))
            ks = [k for k in keys if (k.kind == "rule" and k.section.split(".")[1] in stack_secs)
                  or k.key in ("algorithm.eta_g", "algorithm.aggregation")]
            if ks:
                out.append(Context(p, chosen[0], ks, "rule-switch"))
    if switches and NONRULE_SWITCH_PRESET in names:
        for sw, sec in NONRULE_SWITCHES:
            ks = [k for k in keys if k.section == sec]
            if ks:
                out.append(Context(NONRULE_SWITCH_PRESET, sw, ks, "nonrule-switch"))
    return out


# --------------------------------------------------------------------------- reasons, table, summary


def explain(records: List[Dict[str, Any]]) -> None:
    """Give every NO-OP row a ``reason`` from the contexts where the same key changes the run."""
    changes: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for rec in records:
        for row in rec["keys"]:
            if row["status"] == "changes":
                changes.setdefault((rec["preset"], row["key"]), []).append(rec)
                if rec["kind"] == "nonrule-switch":
                    changes.setdefault(("*", row["key"]), []).append(rec)
    current = {(rec["preset"], tuple(rec["switch"])): {r["key"]: r["current"] for r in rec["keys"]}
               for rec in records}
    for rec in records:
        for row in rec["keys"]:
            if row["status"] != "NO-OP":
                continue
            if row["stack"] == "out":
                row["reason"] = "out-of-stack section"
                continue
            where = changes.get((rec["preset"], row["key"]), []) + (changes.get(("*", row["key"]), [])
                                                                   if row["kind"] == "nonrule" else [])
            by = []
            for other in where:
                if other is rec:
                    continue
                if not rec["switch"]:  # the key works where another key has another value: that key's value here
                    for s in other["switch"]:
                        k = s.split("=", 1)[0]
                        here = _value_in(rec, k, current)
                        by.append(f"{k.replace('algorithm.', '')}={hydra_value(here)}")
                elif not other["switch"]:
                    by += [s.replace("algorithm.", "") for s in rec["switch"]]
            by = list(dict.fromkeys(by))
            row["reason"] = ("switched off by " + " or ".join(by[:4])) if by else "no effect measured"


def _value_in(rec: Dict[str, Any], key: str, current: Dict) -> Any:
    vals = current.get((rec["preset"], tuple(rec["switch"])), {})
    if key in vals:
        return vals[key]
    try:
        return _plain(get_value(compose(rec["overrides"]), key))
    except Exception:  # noqa: BLE001
        return "?"


def table(records: List[Dict[str, Any]]) -> List[str]:
    lines = [f"{'preset':<13} {'context':<42} {'key':<42} {'stack':<6} {'status':<8} {'value':<22} detail",
             "-" * 170]
    for rec in records:
        if rec["status"] != "ok":
            lines.append(f"{rec['preset']:<13} {rec['label']:<42} {'(baseline)':<42} {'':<6} {rec['status']:<8} "
                         f"{'':<22} {rec.get('message', '')}")
            continue
        if not rec.get("deterministic", True):
            lines.append(f"{rec['preset']:<13} {rec['label']:<42} {'(baseline)':<42} {'':<6} nondeterministic")
        for row in rec["keys"]:
            detail = row.get("message") or ""
            if row["status"] == "changes":
                detail = ",".join(row.get("diff") or [])
            elif row["status"] == "NO-OP":
                detail = row.get("reason", "")
            val = "" if row.get("value") is None and row["status"] == "skipped" else hydra_value(row.get("value"))
            lines.append(f"{rec['preset']:<13} {rec['label'][:42]:<42} {row['key']:<42} {row['stack']:<6} "
                         f"{row['status']:<8} {val[:22]:<22} {detail}")
    return lines


def _reason_class(reason: str) -> int:
    for i, prefix in enumerate(("out-of-stack", "switched off", "no effect")):
        if reason.startswith(prefix):
            return i
    return 3


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
              f"{'preset':<13} {'context':<42} {'key':<42} {'stack':<6} {'value':<14} reason"]
    for r, row in sorted(noops, key=lambda x: (_reason_class(x[1].get("reason", "")), x[0]["preset"],
                                               x[0]["label"], x[1]["key"])):
        lines.append(f"{r['preset']:<13} {r['label'][:42]:<42} {row['key']:<42} {row['stack']:<6} "
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
               "status": a.status, "message": a.message, "final_acc": a.final_acc, "run_failure": a.run_failure}
        if cfg is not None:
            rec["note"] = _cross_note(name, cfg)
        if b is not None:
            rec.update(reference_status=b.status, reference_final_acc=b.final_acc,
                       diff=differs(a, b) if a.status == b.status == "ok" else None)
        out.append(rec)
        acc = "-" if a.final_acc is None else f"{a.final_acc:.4f}"
        racc = "-" if b is None or b.final_acc is None else f"{b.final_acc:.4f}"
        verdict = a.status if a.status != "ok" else ("accepted; run " + ("bit-identical to the reference"
                                                                         if b is not None and not rec["diff"]
                                                                         else f"differs ({','.join(rec['diff'])})"))
        lines.append(f"  {name}: {' '.join(ov)}")
        lines.append(f"    -> {verdict}{(': ' + a.message) if a.message else ''}")
        if rec.get("note"):
            lines.append(f"    composed: {rec['note']}")
        lines.append(f"    final accuracy (mean of seeds {','.join(map(str, seeds))}) {acc}"
                     + (f"; reference ({' '.join(x for x in ref if x not in ov)}) {racc}" if ref else "")
                     + (f"; run stopped: {a.run_failure}" if a.run_failure else ""))
    return lines, out


def _cross_note(name: str, cfg: Any) -> str:
    if "misspelt" in name:
        return f"train.roudns={cfg.train.get('roudns')}, train.rounds={cfg.train.rounds}"
    if "learning rate" in name:
        return f"train.lr={cfg.train.lr}"
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
