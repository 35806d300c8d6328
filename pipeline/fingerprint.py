"""A study's fingerprint: the first rounds of every row, committed with its report, and their rerun.

``make study-refresh`` writes ``studies/<s>/results/fingerprint.json`` after the study's ``dvc repro``: per row of
its grid (``params.yaml``), the first seed's first :data:`ROUNDS` rounds of ``train_loss``, ``test_loss`` and
``test_acc`` as ``results/<row>/runs.csv`` holds them. ``make studies-status VERIFY=1``
(``python -m pipeline.studies_status --verify``) trains those first rounds again on the current code, in this process
and as the study's stages train them (the rows of a stage and their seeds as one population; the full config,
stopped once every row's first seed has its round :data:`ROUNDS`; nothing written, nothing tracked),
and compares: a row is *current* when every number is within the tolerance (:data:`LOSS_RTOL` relative on the
losses, :data:`ACC_ATOL` on the accuracy: a few test samples; the fingerprint is not compared bit for bit, since
float sums differ between CPU kinds, docs/reliability.md), else *changed* with the first difference named. A study
whose committed results were produced by the current code is current in every row, whatever the code's hashes say.
"""

from __future__ import annotations

import csv
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from fl_core.config import ConfigError

from .files import write_text
from .grid import load_grid

ROUNDS = 2  # rounds of each row in the fingerprint
KEYS = ("train_loss", "test_loss", "test_acc")
LOSS_RTOL = 1e-3  # relative, on train_loss and test_loss
ACC_ATOL = 0.005  # fraction of the test set
FILE = "fingerprint.json"
CURRENT, CHANGED, MISSING = "current", "changed", "no fingerprint"


def _num(v: str) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _rows_of(runs_csv: Path, seed: int) -> List[Dict[str, float]]:
    """The first :data:`ROUNDS` rounds of ``seed`` in a row's ``runs.csv``, the numbers of :data:`KEYS` each."""
    out = []
    with runs_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            if int(float(row["seed"])) == seed and int(float(row["round"])) <= ROUNDS:
                out.append({"round": int(float(row["round"])),
                            **{k: _num(row.get(k)) for k in KEYS if _num(row.get(k)) is not None}})
    return sorted(out, key=lambda r: r["round"])


def build(folder: Path, params: str = "params.yaml", results: str = "results") -> Dict:
    """The fingerprint of the study in ``folder`` from its results (rows without ``runs.csv`` are left out).

    Returns:
        ``{"rounds": ROUNDS, "seed": first seed, "rows": {row: [{"round": r, "train_loss": ..., ...}, ...]}}``.
    """
    grid = load_grid(folder / params)
    seed = grid.seeds[0]
    rows = {}
    for name in grid.experiments:
        runs = folder / results / name / "runs.csv"
        if runs.is_file():
            rows[name] = _rows_of(runs, seed)
    return {"rounds": ROUNDS, "seed": seed, "rows": rows}


def write(folder: Path) -> Path:
    """Write :func:`build`'s fingerprint to ``folder/results/fingerprint.json``; its path."""
    path = folder / "results" / FILE
    write_text(path, json.dumps(build(folder), indent=1, sort_keys=False) + "\n")
    return path


class _Enough(Exception):
    """Raised by the observer after the fingerprint's last round: the run has given what is compared."""


@dataclass
class RowCheck:
    row: str
    status: str  # CURRENT / CHANGED
    detail: str = ""


def differs(got: Dict[str, float], want: Dict[str, float]) -> Optional[str]:
    """The first number of ``want`` that ``got`` misses or does not match within the tolerance, as a phrase; None
    when they agree."""
    for key in KEYS:
        if key not in want:
            continue
        a, b = got.get(key), want[key]
        if a is None:
            return f"round {want['round']}: no {key}"
        tol = ACC_ATOL if key == "test_acc" else LOSS_RTOL * max(1.0, abs(b))
        if not (math.isfinite(a) and abs(a - b) <= tol) and not (math.isnan(a) and math.isnan(b)):
            return f"round {want['round']}: {key} {a:.6g}, committed {b:.6g}"
    return None


@contextmanager
def inside(folder: Path) -> Iterator[None]:
    """Run in ``folder`` (a study's relative data and results paths) with one torch thread, then come back."""
    import torch

    here, threads = Path.cwd(), torch.get_num_threads()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)


def verify(folder: Path, rows: Optional[List[str]] = None, progress=None) -> List[RowCheck]:
    """Train the first :data:`ROUNDS` rounds of every row of the study in ``folder`` (or of ``rows``) as its DVC stage
    trains them (the rows of one stage and all their seeds as one population where they share a pass,
    :func:`pipeline.grid.train_groups`; a float32 replica's numbers may depend on the population it is in) and
    compare the fingerprint's seed with the study's committed ``results/fingerprint.json``.

    Args:
        progress: called as ``progress(row)`` before each stage's rows (its first row).

    Returns:
        One :class:`RowCheck` per row of the grid (``changed`` also for a row the fingerprint lacks).

    Raises:
        FileNotFoundError: the study has no ``results/fingerprint.json``.
        ConfigError, DataSourceError: a row does not compose, or its data is absent (e.g. a study that needs local
            data files).
    """
    from fl_core.config import compose
    from fl_core.experiment import resolve

    from .experiment import ExperimentRunner, OnRound, Part, train_together
    from .grid import train_groups

    path = folder / "results" / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no fingerprint (make study-refresh STUDY={folder.name} writes it)")
    committed = json.loads(path.read_text())
    seed = int(committed["seed"])
    grid = load_grid(folder / "params.yaml")
    wanted = rows or list(grid.experiments)
    out: Dict[str, RowCheck] = {}
    with inside(folder):
        for group in train_groups(grid):
            names = [n for n in group if n in wanted and committed["rows"].get(n)]
            out.update({n: RowCheck(n, CHANGED, "not in the fingerprint") for n in group
                        if n in wanted and not committed["rows"].get(n)})
            if not names:
                continue
            if progress is not None:
                progress(names[0])
            last = max(r["round"] for n in names for r in committed["rows"][n])
            got: Dict[str, Dict[int, Dict[str, float]]] = {n: {} for n in names}
            parts = []
            for name in names:
                cfgs = []
                for s in grid.seeds:
                    over = grid.overrides(name, s) + ["engine.progress=false", "tracking.enabled=false",
                                                      "engine.checkpoint_every=0"]
                    try:
                        cfgs.append(compose(over, user=grid.experiments[name]))
                    except ConfigError as err:
                        raise ConfigError(f"experiments.{name}: {err}") from None

                def heard(s, r, row, name=name, got=got, last=last):
                    if s == seed:
                        got[name][r] = {k: float(row[k]) for k in KEYS if row.get(k) is not None}
                    if all(last in rounds for rounds in got.values()):
                        raise _Enough  # every row's fingerprint seed has its rounds: the rest is not compared

                parts.append(Part(ExperimentRunner(resolve(cfgs)), cfgs, [OnRound(heard)]))
            try:
                train_together(parts)
            except _Enough:
                pass
            for name in names:
                want = committed["rows"][name]
                problem = next((d for d in (differs(got[name].get(w["round"], {}), w) for w in want) if d), None)
                out[name] = RowCheck(name, CHANGED if problem else CURRENT, problem or "")
    return [out[n] for n in wanted if n in out]


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pipeline.fingerprint STUDY_FOLDER ...``: write each study's fingerprint from its results (what
    ``make study-refresh`` does after the study's ``dvc repro``; for a study reproduced by hand)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m pipeline.fingerprint STUDY_FOLDER ...   write STUDY_FOLDER/results/fingerprint.json "
              "from its rows' runs.csv")
        return 0 if argv else 2
    for arg in argv:
        folder = Path(arg)
        if not (folder / "params.yaml").is_file():
            print(f"error: {folder}: no params.yaml (a study folder, e.g. studies/theory)", file=sys.stderr)
            return 2
        fp = build(folder)
        if not fp["rows"]:
            print(f"error: {folder}: no row has results/<row>/runs.csv (run the study first)", file=sys.stderr)
            return 2
        write(folder)
        print(f"{folder / 'results' / FILE}: {len(fp['rows'])} rows, rounds 1-{ROUNDS} of seed {fp['seed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
