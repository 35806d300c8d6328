"""A study's paper claims as data (``claims.yaml``) and their verdicts against the study's results.

Each study keeps the claims of its paper that its experiments can test in ``claims.yaml`` beside its
``params.yaml`` (format and rule: docs/claims.md)::

    claims:
      - id: fedbug_beats_fedavg_noniid     # unique in the file; letters, digits, '_' and '-'
        claim: "FedBug (P = 0.2) improves FedAvg's final accuracy under Dirichlet 0.3"
        source: "FedBug (Kao et al.), Table 2"
        metric: final_acc                   # a per-seed metric (METRICS)
        a: fedbug_p20_dir                   # treatment arm: an experiment of params.yaml
        b: fedavg_dir                       # control arm; omitted (and forbidden) with expect: value
        expect: greater                     # greater | less | similar | value
        value: 0.94                         # only with expect: value (metric units)
        tolerance: 0.03                     # >= 0, metric units: similar / value need it; greater / less: a minimum effect
        needs: cifar100                     # optional: the dataset without which the claim cannot be measured

Measured effect (:func:`measure`): the paired difference a - b over the seeds both arms finished with a
value of the metric (mean, and the 95% Student-t interval mean +- t_{0.975, n-1} s / sqrt(n), s the sample
standard deviation of the differences: :func:`pipeline.results.paired_values` and
:func:`pipeline.results.confidence_interval`, the numbers of the report's "Difference to FedAvg" table); for
``expect: value`` a's own mean and interval over its seeds.

Verdict (:func:`verdict`), with [lo, hi] that interval and t the tolerance (0 when omitted):

* greater: ``reproduced`` if lo > t; ``not reproduced`` if hi <= t; less: the mirror image (hi < -t;
  lo >= -t).
* similar: ``reproduced`` if -t <= lo and hi <= t (the interval inside +-t); ``not reproduced`` if
  lo > t or hi < -t (entirely outside).
* value v: the same with [v - t, v + t] around a's interval.
* otherwise (the interval straddles a bound, or fewer than 2 paired seeds give no interval):
  ``inconclusive at N seeds``.
* an arm without results (no metrics.json, or every seed failed): ``needs data: <needs>`` when the claim
  names the dataset it needs, else ``not run``. Arms with results but no common seed holding the metric
  (``rounds_to_target`` when no seed of either arm reached the target): ``inconclusive at 0 seeds``.
* ``rounds_to_target`` / ``up_floats_to_target`` of a seed that never reached the target is +inf (it needed more
  than the run): when one arm reached the target in every seed where the other never did (and no seed has finite
  values in both), the difference is that infinity in every seed, and the verdict follows from the interval
  [inf, inf] (a - b < 0 not reproduced when a never got there); a mix of finite and infinite differences is
  ``inconclusive``.

Errors: :func:`load_claims` raises :class:`ClaimsError` (a :class:`fl_core.config.ConfigError`) with one line
naming the file, the claim and the key, for an unknown or missing key, a claim arm that is not an
experiment of the grid, a bad ``expect``, metric, tolerance, value or dataset; the report and study
commands exit 2 on it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from fl_core.config import ConfigError
from fl_core.metrics import SUMMARY_KEYS
from fl_core.schema import DATASETS

from .grid import load_yaml
from .labels import DASH, markdown_table
from .results import (Experiment, confidence_interval, numeric_columns, paired_values, read_runs_rows, sample_stats,
                      seed_values)

CLAIMS_FILE = "claims.yaml"
EXPECTS = ("greater", "less", "similar", "value")
REQUIRED = ("id", "claim", "source", "metric", "a", "expect")
OPTIONAL = ("b", "value", "tolerance", "needs")

# Per-seed metrics of the train stage's summaries (experiment.json ``per_seed``; fl_core.metrics.summarize_run).
TO_TARGET = ("rounds_to_target", "up_floats_to_target")  # lower is better; never reached: +inf (censored)
SEED_METRICS = tuple(SUMMARY_KEYS) + ("final_client_acc_std", "comm_up_floats", "comm_down_floats")
# Per-seed metrics computed here from the seed's rows of runs.csv (see _run_metric).
RUN_METRICS = ("early_acc", "oscillation", "min_test_loss", "client_loss_spread", "cos_mean", "drift_client_mean",
               "drift_client_max", "drift_dissimilarity", "drift_cosine", "drift_progress", "final_opt_distance",
               "final_objective_gap")
# cos_<layer>: tracking.layer_cosine's per-layer columns; drift_cos_<layer>: tracking.drift's
LAYER_COSINE = re.compile(r"(drift_)?cos_[A-Za-z0-9_.]+")
METRICS = SEED_METRICS + RUN_METRICS
_ID = re.compile(r"[A-Za-z0-9_-]+")


class ClaimsError(ConfigError):
    """A malformed ``claims.yaml``: one line ``<file>: claim '<id>': <key>: <problem>``."""


@dataclass(frozen=True)
class Claim:
    """One claim of ``claims.yaml`` (see the module docstring for the keys and their units)."""

    id: str
    claim: str
    source: str
    metric: str
    a: str
    expect: str
    b: Optional[str] = None
    value: Optional[float] = None
    tolerance: Optional[float] = None
    needs: Optional[str] = None


@dataclass
class Outcome:
    """A claim measured on the results: ``mean`` / ``lo`` / ``hi`` (the 95% interval; None with fewer than
    2 seeds) of a - b (or of a, for ``expect: value``) in metric units over ``n`` seeds, the verdict, and
    ``note``, why nothing was measured ('' otherwise)."""

    claim: Claim
    verdict: str
    mean: Optional[float] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    n: int = 0
    note: str = ""


# ----------------------------------------------------------------------------- loading


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def known_metric(name: str) -> bool:
    """Whether ``name`` is a per-seed metric a claim may compare (:data:`METRICS`, ``cos_<layer>`` or
    ``drift_cos_<layer>``)."""
    return name in METRICS or bool(LAYER_COSINE.fullmatch(name))


def _bad(where: str, key: str, problem: str) -> ClaimsError:
    """The one-line error of ``key`` in the claim at ``where``."""
    return ClaimsError(f"{where}: {key}: {problem}")


def _check_keys(raw: dict, where: str, seen: set) -> None:
    """No unknown key, every required one a non-empty string, an id of the allowed characters not used before."""
    unknown = sorted(str(k) for k in raw if k not in REQUIRED + OPTIONAL)
    if unknown:
        raise _bad(where, unknown[0], f"unknown key (allowed: {', '.join(REQUIRED + OPTIONAL)})")
    for key in REQUIRED:
        if key not in raw or raw[key] is None:
            raise _bad(where, key, "missing")
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise _bad(where, key, f"must be a non-empty string, got {raw[key]!r}")
    if not _ID.fullmatch(raw["id"]):
        raise _bad(where, "id", "may hold letters, digits, '_' and '-' only")
    if raw["id"] in seen:
        raise _bad(where, "id", "used by an earlier claim of the file (ids are unique)")


def _check_compared(raw: dict, where: str, experiments: Sequence[str]) -> None:
    """expect, metric and a; then b and value as expect needs (:func:`_check_value`, :func:`_check_pair`)."""
    expect = raw["expect"]
    if expect not in EXPECTS:
        raise _bad(where, "expect", f"{expect!r} is not one of {', '.join(EXPECTS)}")
    if not known_metric(raw["metric"]):
        raise _bad(where, "metric", f"{raw['metric']!r} is not a per-seed metric (one of {', '.join(METRICS)}, or "
                                    "cos_<layer>, drift_cos_<layer>)")
    known = set(experiments)
    if raw["a"] not in known:
        raise _bad(where, "a", f"{raw['a']!r} is not an experiment of the study's params.yaml")
    if expect == "value":
        _check_value(raw, where)
    else:
        _check_pair(raw, where, known)


def _check_value(raw: dict, where: str) -> None:
    """expect: value: no b, and a finite published value."""
    if raw.get("b") is not None:
        raise _bad(where, "b", "not with expect: value (a's mean is compared with the published value)")
    if not _is_number(raw.get("value")):
        raise _bad(where, "value", f"expect: value needs a finite number, got {raw.get('value')!r}")


def _check_pair(raw: dict, where: str, known: set) -> None:
    """expect: a comparison of a with b: b another experiment of the grid, and no value."""
    b = raw.get("b")
    if b is None:
        raise _bad(where, "b", f"missing (expect: {raw['expect']} compares a with b)")
    if not isinstance(b, str) or b not in known:
        raise _bad(where, "b", f"{b!r} is not an experiment of the study's params.yaml")
    if b == raw["a"]:
        raise _bad(where, "b", "the same experiment as a")
    if raw.get("value") is not None:
        raise _bad(where, "value", "only with expect: value")


def _check_tolerance_and_needs(raw: dict, where: str) -> None:
    """A tolerance (>= 0; required by similar and value) and a needs that names a dataset, where given."""
    tol = raw.get("tolerance")
    if tol is None and raw["expect"] in ("similar", "value"):
        raise _bad(where, "tolerance",
                   f"missing (expect: {raw['expect']} needs the allowed gap, in the metric's units)")
    if tol is not None and (not _is_number(tol) or tol < 0):
        raise _bad(where, "tolerance", f"must be a number >= 0, got {tol!r}")
    needs = raw.get("needs")
    if needs is not None and needs not in DATASETS:
        raise _bad(where, "needs", f"{needs!r} is not a dataset (one of {', '.join(DATASETS)})")


def _claim(path: Path, i: int, raw, experiments: Sequence[str], seen: set) -> Claim:
    """One entry of the ``claims`` list, checked (see :func:`load_claims`): its keys, what it compares, its
    tolerance and dataset, in that order."""
    if not isinstance(raw, dict):
        raise ClaimsError(f"{path}: claims[{i}]: must be a mapping of keys (id, claim, source, ...), got {raw!r}")
    cid = raw.get("id")
    where = f"{path}: claim {cid!r}" if isinstance(cid, str) and cid else f"{path}: claims[{i}]"
    _check_keys(raw, where, seen)
    _check_compared(raw, where, experiments)
    _check_tolerance_and_needs(raw, where)
    seen.add(cid)
    tol = raw.get("tolerance")
    return Claim(id=cid, claim=raw["claim"].strip(), source=raw["source"].strip(), metric=raw["metric"],
                 a=raw["a"], expect=raw["expect"], b=raw.get("b"),
                 value=None if raw.get("value") is None else float(raw["value"]),
                 tolerance=None if tol is None else float(tol), needs=raw.get("needs"))


def load_claims(path: Path, experiments: Sequence[str]) -> List[Claim]:
    """The claims of ``path`` (a ``claims.yaml``), checked against the grid's experiment names.

    Raises:
        ClaimsError: one line naming ``path``, the claim (its id, else ``claims[i]``) and the key: a top level
            other than a mapping with the one key ``claims``, an empty list, an unknown or missing key, a
            duplicate id, an arm that is not in ``experiments``, a bad expect, metric, value, tolerance or
            ``needs`` dataset; a missing file or a YAML syntax error (:func:`pipeline.grid.load_yaml`).
    """
    path = Path(path)
    raw = load_yaml(path, "the study's claims")
    if not isinstance(raw, dict) or set(raw) != {"claims"}:
        extra = sorted(str(k) for k in raw if k != "claims") if isinstance(raw, dict) else []
        what = f"unknown top-level key {extra[0]!r}" if extra else "needs the one top-level key 'claims'"
        raise ClaimsError(f"{path}: {what} (the file is 'claims:' followed by a list of claims)")
    items = raw["claims"]
    if not isinstance(items, list) or not items:
        raise ClaimsError(f"{path}: claims: must be a non-empty list of claims")
    seen: set = set()
    return [_claim(path, i, item, experiments, seen) for i, item in enumerate(items)]


def default_claims_path(params: Path) -> Path:
    """``claims.yaml`` beside the grid file ``params``."""
    return Path(params).parent / CLAIMS_FILE


# ----------------------------------------------------------------------------- per-seed values


def _per_seed_columns(rows: List[Dict[str, str]]) -> Dict[str, Dict[str, np.ndarray]]:
    """{seed: {column: values in round order}} of the finite numbers of runs.csv's rows."""
    out: Dict[str, Dict[str, np.ndarray]] = {}
    for k, per_seed in numeric_columns(rows).items():
        for seed, d in per_seed.items():
            out.setdefault(str(seed), {})[k] = np.array([d[i] for i in sorted(d)], dtype=float)
    return out


def _run_metric(cols: Dict[str, np.ndarray], metric: str) -> Optional[float]:
    """One seed's value of a runs.csv metric, or None when its columns are missing:

    * ``early_acc``: mean test accuracy (fraction) over the first third of the evaluated rounds (at least one);
    * ``oscillation``: mean |acc_r - acc_{r-1}| over the second half of the evaluated rounds (needs > 3);
    * ``min_test_loss``: the smallest test loss over the evaluated rounds;
    * ``cos_mean`` / ``cos_<layer>``: the mean over rounds of that column (tracking.layer_cosine);
    * ``drift_*`` (``drift_cosine``, ``drift_cos_<layer>``, ...): the mean over the rounds that have that column
      (tracking.drift; docs/algorithms.md, Drift measures);
    * ``final_opt_distance`` / ``final_objective_gap``: the last round's ||x - x*|| / F(x) - F(x*) of a model that
      logs them (``opt_distance``, ``objective_gap``: the convex and quadratic problems);
    * ``client_loss_spread``: the standard deviation (ddof 0) across the traced clients (``client_loss/<i>``,
      tracking.client_loss_trace, at least 2) of each client's mean local loss over the second half of the
      rounds it trained in.
    """
    acc = cols.get("test_acc")
    if metric == "early_acc":
        return float(acc[: max(1, len(acc) // 3)].mean()) if acc is not None and len(acc) else None
    if metric == "oscillation":
        return float(np.abs(np.diff(acc[len(acc) // 2:])).mean()) if acc is not None and len(acc) > 3 else None
    if metric == "min_test_loss":
        loss = cols.get("test_loss")
        return float(loss.min()) if loss is not None and len(loss) else None
    if metric == "client_loss_spread":
        late = [float(v[len(v) // 2:].mean()) for k, v in cols.items() if k.startswith("client_loss") and len(v)]
        return float(np.std(late)) if len(late) >= 2 else None
    if metric in ("final_opt_distance", "final_objective_gap"):
        v = cols.get(metric[len("final_"):])
        return float(v[-1]) if v is not None and len(v) else None
    v = cols.get(metric)
    return float(v.mean()) if v is not None and len(v) else None


def metric_values(exp: Experiment, metric: str, results_dir: Path) -> Dict[str, float]:
    """{seed: value} of ``metric`` for the seeds of ``exp`` that finished (metric units: accuracies are
    fractions, losses as logged). Summary metrics come from ``experiment.json`` (:func:`pipeline.results.seed_values`),
    the others from ``<results_dir>/<exp>/runs.csv`` (:func:`_run_metric`); seeds without a value are left out."""
    if metric in SEED_METRICS:
        vals = seed_values(exp, metric)
        if metric in TO_TARGET:  # a finished seed that never reached the target needed more than the whole run
            for seed in seed_values(exp, "final_acc"):
                vals.setdefault(seed, math.inf)
        return vals
    finished = set(seed_values(exp, "final_acc"))
    rows = read_runs_rows(Path(results_dir) / exp.name / "runs.csv")
    if rows is None:
        return {}
    out = {}
    for seed, cols in _per_seed_columns(rows).items():
        v = _run_metric(cols, metric)
        if v is not None and math.isfinite(v) and (not finished or seed in finished):
            out[seed] = v
    return out


# ----------------------------------------------------------------------------- the rule


def _plural(n: int) -> str:
    return f"{n} seed" + ("" if n == 1 else "s")


def verdict(expect: str, n: int, lo: Optional[float], hi: Optional[float], tolerance: Optional[float] = None,
            value: Optional[float] = None) -> str:
    """The verdict of a measured claim from its 95% interval [lo, hi] over ``n`` seeds (metric units).

    greater: reproduced if lo > t, not reproduced if hi <= t (t = tolerance, 0 when None); less: reproduced if
    hi < -t, not reproduced if lo >= -t; similar: reproduced if [lo, hi] lies inside [-t, t], not reproduced if
    it lies entirely outside (lo > t or hi < -t); value: the same around ``value``. Else, or without an
    interval (``lo`` / ``hi`` None: fewer than 2 seeds), ``inconclusive at n seeds``.

    Raises:
        ValueError: an unknown ``expect``, or similar / value without a tolerance, value without a value.
    """
    if expect not in EXPECTS:
        raise ValueError(f"expect must be one of {', '.join(EXPECTS)}, got {expect!r}")
    if expect in ("similar", "value") and tolerance is None:
        raise ValueError(f"expect: {expect} needs a tolerance")
    if expect == "value" and value is None:
        raise ValueError("expect: value needs a value")
    inconclusive = f"inconclusive at {_plural(n)}"
    if lo is None or hi is None:
        return inconclusive
    t = float(tolerance or 0.0)
    if expect == "greater":
        ok, wrong = lo > t, hi <= t
    elif expect == "less":
        ok, wrong = hi < -t, lo >= -t
    else:
        c = 0.0 if expect == "similar" else float(value)
        ok, wrong = (c - t <= lo and hi <= c + t), (lo > c + t or hi < c - t)
    return "reproduced" if ok else "not reproduced" if wrong else inconclusive


def _censored(claim: Claim, a: Dict[str, float], b: Optional[Dict[str, float]]) -> Optional[Outcome]:
    """The outcome of a to-target claim (:data:`TO_TARGET`) where a seed never reached the target (its value +inf:
    more than the run), or None when no value is infinite. A seed where neither arm reached it says nothing and is
    left out. When every remaining seed's difference is infinite with one sign (one arm reached the target in every
    such seed, the other in none), the difference is that infinity in all of them: its interval [inf, inf] gives the
    verdict as any interval does (a - b < 0 is then not reproduced when a never got there). Otherwise (some seeds
    finite, or signs mixed) no interval can be formed: inconclusive, with a note."""
    if claim.metric not in TO_TARGET:
        return None
    if claim.expect == "value":
        diffs = list(a.values())
    else:
        common = sorted(set(a) & set(b), key=lambda s: (len(s), s))
        diffs = [a[s] - b[s] for s in common if not (math.isinf(a[s]) and math.isinf(b[s]))]
    if not any(math.isinf(d) for d in diffs):
        return None
    arms = claim.a if claim.b is None else f"{claim.a} vs {claim.b}"
    late = sum(1 for d in diffs if d == math.inf)
    note = (f"{arms}: {claim.a} never reached the target in {late} of {len(diffs)} seeds" if claim.b is None else
            f"{claim.a} never reached the target in {late} and {claim.b} in {sum(d == -math.inf for d in diffs)} "
            f"of the {len(diffs)} seeds where one of them did")
    if len(diffs) >= 2 and all(d == diffs[0] for d in diffs):
        inf = diffs[0]
        return Outcome(claim, verdict(claim.expect, len(diffs), inf, inf, claim.tolerance, claim.value), inf, inf,
                       inf, len(diffs), note)
    return Outcome(claim, f"inconclusive at {_plural(len(diffs))}", n=len(diffs), note=note)


def measure(claim: Claim, a: Optional[Dict[str, float]], b: Optional[Dict[str, float]] = None) -> Outcome:
    """Measure ``claim`` from its arms' per-seed values ({seed: value}; None: the arm has no results) and give
    the :func:`verdict`: a - b paired over the common seeds, or a alone for ``expect: value``."""
    missing = [name for name, vals in ((claim.a, a), (claim.b, b)) if name is not None and vals is None]
    if missing:
        if claim.needs:
            return Outcome(claim, f"needs data: {claim.needs}", note=f"no results for {', '.join(missing)}")
        return Outcome(claim, "not run", note=f"no results for {', '.join(missing)}")
    if claim.metric in TO_TARGET and b is not None:  # a seed where neither arm reached the target says nothing
        neither = {s for s in set(a) & set(b) if math.isinf(a[s]) and math.isinf(b[s])}
        a, b = ({s: v for s, v in arm.items() if s not in neither} for arm in (a, b))
    censored = _censored(claim, a, b)
    if censored is not None:
        return censored
    if claim.expect == "value":
        d = sample_stats(list(a.values())) if a else None
    else:
        d = paired_values(a, b)
    if d is None:  # the arms ran, but no seed holds the metric in both (a target no seed of one arm reached)
        return Outcome(claim, verdict(claim.expect, 0, None, None, claim.tolerance, claim.value),
                       note=f"no seed with a {claim.metric} in " + (claim.a if claim.b is None else "both arms"))
    lo, hi = confidence_interval(d)
    n = int(d["n"])
    return Outcome(claim, verdict(claim.expect, n, lo, hi, claim.tolerance, claim.value), d["mean"], lo, hi, n)


def evaluate(claims: Sequence[Claim], experiments: Sequence[Experiment], results_dir: Path) -> List[Outcome]:
    """:func:`measure` every claim on the loaded experiments (:func:`pipeline.results.load_experiments`); an
    experiment without metrics, or whose every seed failed, counts as without results."""
    by_name = {e.name: e for e in experiments}
    cache: Dict[tuple, Optional[Dict[str, float]]] = {}

    def values(name: Optional[str], metric: str) -> Optional[Dict[str, float]]:
        if name is None:
            return None
        if (name, metric) not in cache:
            e = by_name.get(name)
            ran = e is not None and e.metrics is not None and not e.failed
            cache[(name, metric)] = metric_values(e, metric, results_dir) if ran else None
        return cache[(name, metric)]

    return [measure(c, values(c.a, c.metric), values(c.b, c.metric)) for c in claims]


# ----------------------------------------------------------------------------- the report table


def _scale(metric: str):
    """(factor, difference unit, value unit) of a metric in the table: accuracies in % / pp, floats in millions."""
    if "acc" in metric:
        return 100.0, " pp", "%"
    if "floats" in metric:
        return 1e-6, " M floats", " M floats"
    return 1.0, "", ""


def _expected(c: Claim) -> str:
    f, du, vu = _scale(c.metric)
    t = f * (c.tolerance or 0.0)
    if c.expect == "greater":
        return f"a - b > {t:g}{du}"
    if c.expect == "less":
        return f"a - b < {-t if t else 0:g}{du}"
    if c.expect == "similar":
        return f"a - b within \u00b1{t:g}{du}"
    return f"a within {f * c.value:g} \u00b1 {t:g}{vu}"


def _effect(o: Outcome) -> str:
    c = o.claim
    if o.mean is None or math.isinf(o.mean):  # nothing measured, or a target one arm never reached (the note)
        return f"{DASH} ({o.note})" if o.note else DASH
    f, du, vu = _scale(c.metric)
    unit = vu if c.expect == "value" else du
    spec = ("" if c.expect == "value" else "+") + (".2f" if unit else ".4g")

    def num(x: float) -> str:
        return format(f * x, spec)

    arms = f"`{c.a}`" if c.b is None else f"`{c.a}` - `{c.b}`"
    ci = "no interval" if o.lo is None else f"[{num(o.lo)}, {num(o.hi)}]"
    return f"{arms} ({c.metric}): {num(o.mean)}{unit} {ci} ({_plural(o.n)})"


def claims_section(outcomes: Sequence[Outcome], claims_name: str = CLAIMS_FILE) -> List[str]:
    """The report's "Claims" section: the rule in two sentences, then one row per claim (claim and id, source,
    expected effect, measured effect with its 95% interval, verdict) and the count of reproduced claims."""
    rows = [[f"{o.claim.claim} (`{o.claim.id}`)", o.claim.source, _expected(o.claim), _effect(o), f"**{o.verdict}**"]
            for o in outcomes]
    measured = [o for o in outcomes if o.mean is not None]
    n_ok = sum(o.verdict == "reproduced" for o in outcomes)
    return ["## Claims", "",
            f"The paper claims of `{claims_name}` against our runs. Measured effect: the difference a - b paired over "
            "the seeds both arms finished (for a published value, a itself), mean and 95% Student-t interval; "
            "accuracies in % (differences in percentage points). Verdict: *reproduced* when the interval lies "
            "entirely on the expected side of the bound (inside the tolerance for *similar* / a value), *not "
            "reproduced* when entirely on the wrong side (outside), else *inconclusive* at that many seeds "
            "(docs/claims.md).", "",
            markdown_table(["claim", "source", "expected", "measured effect (95% CI)", "verdict"], rows, "lllll"), "",
            f"{n_ok} of {len(measured)} measured claims reproduced ({len(outcomes)} claims).", ""]
