"""How the report and the figures name things: readable labels of algorithm descriptions, dataset tags and
partition keys, and the plain-text pieces of the report's tables (numbers, the dash, markdown tables).

Both :mod:`pipeline.report` and :mod:`pipeline.figures` build on these; neither imports the other for them.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence

from fl_core.algorithms import registry

DASH = "\u2014"


def _algo_name(name: str) -> str:
    """The paper name of a rule (the registry's label: ``fedbcgd_plus`` -> ``FedBCGD+``), else ``name``."""
    return registry.label(name)


def stack_label(stack: Dict[str, Any]) -> str:
    """The label of a stored rule stack (``stack`` of ``experiment.json``: :func:`fl_core.algorithms.registry.
    described`): each level's label (the stored one, else the registry's), its shown items (``key=value``, a bare
    item as it is) after a space, the wrapped level in brackets: ``FedBug P=0.2 (FedAvg)``."""
    label = str(stack.get("label") or _algo_name(str(stack.get("name", "?"))))
    shown = [f"{k}={v}" if k else str(v) for k, v in (stack.get("shown") or [])]
    if shown:
        label += " " + ", ".join(shown)
    inner = stack.get("inner")
    if isinstance(inner, dict):
        label += f" ({stack_label(inner)})"
    return label


def algorithm_label(desc: Any) -> str:
    """A readable algorithm label from a run's structured description.

    ``desc`` is a stored stack (a dict, :func:`stack_label`) or a :class:`~fl_core.algorithms.base.Description`
    (``fedbug[P=0.2](fedavg)`` -> ``"FedBug P=0.2 (FedAvg)"``). A plain string (the text of a results folder written
    before runs stored their stack) is not parsed: a registered rule or preset name gives its label (``"fedprox"``
    -> ``"FedProx"``), any other text is shown as it is.
    """
    if isinstance(desc, dict):
        return stack_label(desc)
    structure = registry.described(desc)
    if structure is not None:
        return stack_label(structure)
    s = str(desc or "").strip()
    if not s:
        return "?"
    return _algo_name(s)


def run_label(metrics: Dict[str, Any]) -> str:
    """The algorithm label of one experiment's results (merged ``metrics.json`` and ``experiment.json``): from its
    ``stack``, or, in a folder written before runs stored it, from the ``algorithm`` text (:func:`algorithm_label`)."""
    stack = (metrics or {}).get("stack")
    return algorithm_label(stack if isinstance(stack, dict) else (metrics or {}).get("algorithm", ""))


_PART_RE = re.compile(r"^(?P<ds>.+?)-(?P<body>(?:iid|dirichlet|shards)(?:-.*)?)-s(?P<seed>-?\d+)$")


_NATURAL_RE = re.compile(r"^(?P<ds>.+)-natural-(?:n(?P<n>\d+)|all)$")
_SYNTHETIC_RE = re.compile(r"^synthetic-(?:iid|a(?P<a>[^-]+)-b(?P<b>[^-]+))-n\d+-tf[^-]+-s-?\d+$")
_MNIST1D_RE = re.compile(r"^mnist1d(?P<shuf>-shuffled)?-s-?\d+$")
_WRITERS_RE = re.compile(r"^(?P<ds>femnist|shakespeare)(?:-(?P<subset>digits|lowercase|lowercase_a_j))?"
                         r"(?:-c(?P<c>\d+)-s-?\d+)?$")


def dataset_label(tag: str) -> str:
    """A readable name of a dataset variant from its tag (``fl_core.data.dataset_tag``).

    ``"synthetic-a1-b1-n30-tf0.2-s0"`` -> ``"Synthetic(1,1)"``, ``"synthetic-iid-n30-tf0.2-s0"`` ->
    ``"Synthetic IID"``, ``"mnist1d-s42"`` -> ``"MNIST-1D"``, ``"mnist1d-shuffled-s42"`` -> ``"MNIST-1D shuffled"``,
    ``"emnist-byclass"`` -> ``"EMNIST byclass"``, ``"femnist-lowercase_a_j"`` -> ``"FEMNIST lowercase_a_j"``,
    ``"shakespeare-c143-s0"`` -> ``"Shakespeare (143 speakers)"``;
    any other tag (``"digits"``, ``"cifar10"``) unchanged.
    """
    m = _SYNTHETIC_RE.match(tag)
    if m:
        return "Synthetic IID" if m.group("a") is None else f"Synthetic({m.group('a')},{m.group('b')})"
    m = _MNIST1D_RE.match(tag)
    if m:
        return "MNIST-1D shuffled" if m.group("shuf") else "MNIST-1D"
    if tag.startswith("emnist-"):
        return f"EMNIST {tag[len('emnist-'):]}"
    m = _WRITERS_RE.match(tag)
    if m:
        name = "FEMNIST" if m.group("ds") == "femnist" else "Shakespeare"
        who = "writers" if m.group("ds") == "femnist" else "speakers"
        subset = f" {m.group('subset')}" if m.group("subset") else ""
        return f"{name}{subset}" + (f" ({m.group('c')} {who})" if m.group("c") else "")
    return tag


def _parse_partition(key: str) -> Optional[Dict[str, str]]:
    """Fields of a partition key (see ``fl_core.data.partition.partition_key``), or None."""
    m = _NATURAL_RE.match(key)
    if m:  # the dataset's own devices: no seed; "all": every writer in the files
        return {"dataset": m.group("ds"), "kind": "natural", "clients": m.group("n") or "all"}
    m = _PART_RE.match(key)
    if not m:
        return None
    parts = re.split(r"-(?![\d.])", m.group("body"))  # "a1e-05" stays one token
    out: Dict[str, str] = {"dataset": m.group("ds"), "kind": parts[0], "seed": m.group("seed")}
    rest = parts[1:]
    if out["kind"] == "dirichlet":
        if not rest or rest[0] not in ("per_client", "per_class", "fixed_size_reuse"):
            return None
        out["variant"] = rest.pop(0)
    for tok in rest:
        if tok == "nocap" and out.get("variant") == "per_class":  # partition.balance_cap=false
            out["nocap"] = "1"
            continue
        for prefix, name in (("sgm", "sigma"), ("min", "min_size"), ("spc", "samples_per_client"), ("a", "alpha"),
                             ("n", "clients"), ("S", "classes")):
            if tok.startswith(prefix) and len(tok) > len(prefix):
                out[name] = tok[len(prefix):]
                break
        else:
            return None
    if out["kind"] == "dirichlet" and "alpha" not in out:
        return None
    if out["kind"] == "shards" and "classes" not in out:
        return None
    return out


def partition_label(key: str, verbose: bool = False) -> str:
    """A readable partition label from a partition key; the raw key if it cannot be parsed.

    ``"digits-iid-n20-sgm0-s0"`` -> ``"IID"``, ``"digits-dirichlet-per_client-a0.3-n20-s0"`` ->
    ``"Dirichlet α=0.3"``, ``"...-dirichlet-per_class-a0.5-..."`` -> ``"Dirichlet α=0.5 (per class)"``,
    ``"cifar100-shards-S20-n20-s0"`` -> ``"Shards (20 classes/client)"``, ``"synthetic-a1-b1-n30-tf0.2-s0-natural-n30"``
    -> ``"Synthetic(1,1), natural"`` (the devices are the clients), ``"femnist-natural-all"`` -> ``"FEMNIST, natural"``,
    ``"...-per_class-a0.1-n100-min1-nocap-s0"`` -> ``"Dirichlet α=0.1 (per class, no cap)"``.
    With ``verbose`` the dataset, number of clients and every other field of the key are added, so
    different keys give different labels.
    """
    key = str(key or "")
    p = _parse_partition(key)
    if p is None:
        return key or "?"
    kind = p["kind"]
    extra: List[str] = []
    if kind == "natural":
        label = f"{dataset_label(p['dataset'])}, natural"
        if verbose:
            extra.append(f"{p['clients']} devices")
        return f"{label} ({', '.join(extra)})" if extra else label
    if kind == "iid":
        label = "IID"
    elif kind == "dirichlet":
        label = f"Dirichlet \u03b1={p['alpha']}"
        if p["variant"] == "per_class":
            extra.append("per class, no cap" if p.get("nocap") else "per class")
        elif p["variant"] == "fixed_size_reuse":
            extra.append(f"{p.get('samples_per_client', '?')}/client, reused")
    else:
        label = "Shards"
        extra.append(f"{p['classes']} classes/client")
    if p.get("sigma") not in (None, "0"):
        extra.append(f"size \u03c3={p['sigma']}")
    if verbose:
        if "clients" in p:
            extra.append(f"{p['clients']} client{'' if p['clients'] == '1' else 's'}")
        if "min_size" in p:
            extra.append(f"min size {p['min_size']}")
        extra.append(f"seed {p['seed']}")
        label = f"{dataset_label(p['dataset'])}: {label}"
    return f"{label} ({', '.join(extra)})" if extra else label


# --------------------------------------------------------------------------- text

def _num(v) -> Optional[float]:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    """A markdown table: ``header``, ``rows`` of cells (``|`` escaped) and one alignment per column (``l``, ``r``,
    ``c``)."""
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "|".join({"l": ":---", "r": "---:", "c": ":---:"}[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
