#!/usr/bin/env python
"""Fault campaign: kill ``python -m pipeline.train`` again and again and check that exactly one clean run results.

Every scenario works in its own temporary project folder (``tempfile.mkdtemp``) holding a
``params.yaml`` and its own MLflow store (``MLFLOW_TRACKING_URI=sqlite:///<folder>/mlflow.db``);
the CLI runs as a subprocess with that folder as working directory, ``PYTHONPATH=<repo root>`` and
``OMP_NUM_THREADS=1`` (float sums depend on the thread count, so the reference and every resumed run
use the same). The grid: seeds [1, 2], 10 clients (Dirichlet), SCAFFOLD, 40 rounds, participation
0.5, one local epoch, batch 32, lr 0.05, a checkpoint every 2 rounds, every round logged.

Scenarios:

1. ``reference``: one uninterrupted run; its final models and its wall time T.
2. ``random kills``: chains of attempts (``--chains``, default 4); each attempt is SIGKILLed at a time
   drawn uniformly from (0.5 s, T + ``--margin``) by ``random.Random(--seed)`` (``Popen.wait`` with
   that timeout), until an attempt finishes by itself (at most 40 attempts per chain). Target: at least
   5 kills per requested chain (20 with the defaults); when attempts finished before enough kills
   landed, more chains are run (at most 3 x ``--chains`` extra) and the table says so.
3. ``named points``: one chain per point of :data:`fl_core.store.faults.POINTS`, killed there with
   ``FL_FAULT`` (``@2`` for ``checkpoint_write`` and ``checkpoint_swap`` so that a previous checkpoint
   exists; ``results/exp/old.txt`` is created first so that ``outputs_swap`` is reached), then one plain
   rerun.
4. ``corrupt checkpoint``: killed at ``checkpoint_write@3``; then ``seed_1.pt`` truncated to 100 bytes
   (the rerun must warn and resume from the ``.prev``), and in a second chain ``seed_1.pt`` and
   ``seed_1.pt.prev`` both garbage (two warnings, seed 1 from scratch).
5. ``two writers``: A starts; once ``results/.locks/exp.lock.holder`` exists, B runs the same command:
   B must exit 2 with one stderr line naming A's pid, A must finish with 0 (and its end state is
   measured like a chain's).
6. ``diverging grid``: experiments ``good`` (fedavg) and ``bad`` (fedavg, lr 100), one seed, 4 clients,
   full participation, batch 64, 4 rounds (with the main grid's 10 clients at participation 0.5 and
   batch 32, lr 100 leaves the loss huge but finite): ``--grid bad`` and ``--grid good`` must both
   exit 0, ``results/bad/metrics.json`` must say ``status: failed`` and ``python -m pipeline.report``
   must list "- `bad`: FAILED".

Measured after every chain of scenarios 1-5 (targets in brackets): final models equal to the
reference (``torch.equal`` on every tensor of both seeds) [all chains]; MLflow parent runs tagged
``fl.experiment=exp`` [1]; seeds whose number of child runs is not 1 [0]; duplicated (key, step)
pairs over all child runs [0]; runs not FINISHED [0]; leftover files under the project (``*.tmp``,
``*.prev``, ``*.corrupt``, ``.*.staging``, ``.*.old``, ``*.removed``, ``*.holder``, ``.*.init`` (a
new MLflow store being built), a remaining
``checkpoints/exp``, and in scenario 3 the pre-created ``results/exp/old.txt``) [0]; retrained seeds
[0]: a seed that had a completion record ``seed_<s>.done.pt`` when an attempt started but whose
"done earlier" line is missing from that attempt's stderr although the attempt completed or printed a
line about a later seed. Every attempt must end with 0 or by the kill (-9); anything else is listed.

Usage (from the repository root)::

    .venv/bin/python benchmarks/faults.py                       # the full campaign (about 18 min on 2 cores)
    .venv/bin/python benchmarks/faults.py --quick               # smoke check: 2 chains, 20 rounds
    .venv/bin/python benchmarks/faults.py --chains 6 --seed 3 --keep --out /tmp/faults_table.md

Prints a markdown table and the total wall time; exit status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere, without an install
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from fl_core.store import faults  # noqa: E402

SEEDS = [1, 2]
NAME = "exp"
KILLS_PER_CHAIN = 5  # target: at least this many random kills per requested chain (20 for the default 4)
MAX_ATTEMPTS = 40
RUN_TIMEOUT = 900.0  # seconds: an attempt that runs longer is a hang (killed and reported)
LEFTOVER = re.compile(r"(\.tmp|\.prev|\.corrupt(\.\d+)?|\.removed|\.holder)$")
HIDDEN_LEFTOVER = (".staging", ".old", ".init")  # .<name>.staging / .<name>.old outputs, .mlflow.db.<pid>.init
SEED_LINE = re.compile(rf"^{NAME} seed (\d+):|seed_(\d+)\.", re.M)


def grid(rounds: int) -> Dict:
    return {
        "seeds": SEEDS,
        "partition": {"num_clients": 10},
        "train": {"rounds": rounds, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "engine": {"checkpoint_every": 2, "progress": False},
        "tracking": {"log_every": 1},
        "experiments": {NAME: {"algorithm": "scaffold", "partition": "dirichlet"}},
    }


def diverging_grid() -> Dict:
    """Scenario 6. lr 100 under the main grid's shared settings (10 clients, participation 0.5, batch 32)
    blows the loss up to ~1e12 but keeps it finite (a dead network at 10 % accuracy), which is not a
    divergence the engine can detect; with 4 clients, full participation and batch 64 (as in
    tests/test_faults.py) the loss is NaN in round 1."""
    return {"seeds": [1], "partition": {"num_clients": 4},
            "train": {"rounds": 4, "participation": 1.0, "local_epochs": 1, "batch_size": 64, "lr": 0.05},
            "engine": {"checkpoint_every": 2, "progress": False}, "tracking": {"log_every": 1},
            "experiments": {"good": {"algorithm": "fedavg", "partition": "iid"},
                            "bad": {"algorithm": "fedavg", "partition": "iid", "train.lr": 100}}}


# --------------------------------------------------------------------------- processes


class Chain:
    """One project folder: its params.yaml, MLflow store and the logs of its attempts."""

    def __init__(self, base: Path, label: str, params: Dict):
        folder = Path(tempfile.mkdtemp(prefix=re.sub(r"\W+", "_", label) + "-", dir=base))
        self.project, self.logs = folder / "project", folder / "logs"
        self.project.mkdir()
        self.logs.mkdir()
        (self.project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        self.label = label
        self.n = 0
        self.kills = 0
        self.retrained = 0
        self.bad_exits: List[str] = []  # attempts that ended neither with 0 nor by the kill

    def env(self, fault: Optional[str] = None) -> Dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{self.project / 'mlflow.db'}"}
        env.pop(faults.ENV, None)
        if fault:
            env[faults.ENV] = fault
        return env

    def start(self, args: List[str], fault: Optional[str] = None, module: str = "pipeline.train") -> "Attempt":
        """Start the command (stdout and stderr to files in the logs folder)."""
        self.n += 1
        att = Attempt(self.n, self.logs / f"{self.n:02d}.err", records(self.project))
        with open(self.logs / f"{self.n:02d}.out", "w") as fo, open(att.err, "w") as fe:
            att.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=self.project,
                                        env=self.env(fault), stdout=fo, stderr=fe)
        return att

    def finish(self, att: "Attempt", *, expect_kill: bool = False, ok_rc: Tuple[int, ...] = (0,)) -> Tuple[int, str]:
        """Wait for an attempt, count its kill and its retrained seeds; returns (returncode, stderr)."""
        try:
            rc = att.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            att.proc.kill()
            rc = att.proc.wait()
            self.bad_exits.append(f"attempt {att.n}: hung for {RUN_TIMEOUT:.0f} s, killed")
        text = att.err.read_text(errors="replace")
        if rc == -signal.SIGKILL:
            if expect_kill:
                self.kills += 1
            else:
                self.bad_exits.append(f"attempt {att.n}: killed by SIGKILL without a fault")
        elif rc not in ok_rc:
            self.bad_exits.append(f"attempt {att.n}: exit {rc}: {last_line(text)}")
        self.retrained += retrained(att.had, text, completed=rc == 0)
        return rc, text

    def run(self, args: List[str], fault: Optional[str] = None) -> Tuple[int, str]:
        return self.finish(self.start(args, fault), expect_kill=fault is not None)


@dataclass
class Attempt:
    """One start of the command: its number in the chain, stderr file, the seeds with a completion
    record when it started, and the process."""

    n: int
    err: Path
    had: List[int]
    proc: Optional[subprocess.Popen] = None


def last_line(text: str) -> str:
    """The last stderr line, or for a traceback its last exception line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if "Traceback" in text:
        exc = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
        lines = exc or lines
    return lines[-1][:300] if lines else "(no stderr)"


def records(project: Path) -> List[int]:
    """Seeds with a completion record in the attempt folder(s) of the experiment."""
    return sorted({int(p.name.split("_")[1].split(".")[0])
                   for p in (project / "checkpoints" / NAME).glob("*/seed_*.done.pt")})


def retrained(had: List[int], stderr: str, completed: bool) -> int:
    """Seeds of ``had`` trained again by an attempt (see the module docstring)."""
    mentioned = [int(a or b) for a, b in SEED_LINE.findall(stderr)]
    n = 0
    for s in had:
        if f"{NAME} seed {s}: done earlier" in stderr:
            continue
        later = [m for m in mentioned if m in SEEDS and SEEDS.index(m) > SEEDS.index(s)]
        if completed or later:
            n += 1
    return n


# --------------------------------------------------------------------------- measures


@dataclass
class Measure:
    models_equal: bool = False
    parents_off: int = 0  # chains whose number of parents is not 1
    children_off: int = 0  # (chain, seed) pairs whose number of child runs is not 1
    duplicated: int = 0
    not_finished: int = 0
    leftovers: int = 0
    unreadable: bool = False  # the MLflow store could not be opened: its measures are unknown
    notes: List[str] = field(default_factory=list)


def load_models(project: Path) -> Optional[Dict[int, Dict]]:
    import torch

    try:
        return {s: torch.load(project / "results" / NAME / "models" / f"seed_{s}.pt", map_location="cpu")
                for s in SEEDS}
    except Exception:  # missing or unreadable: not equal
        return None


def models_equal(got: Optional[Dict], ref: Dict) -> bool:
    import torch

    if got is None:
        return False
    for s in SEEDS:
        if got[s].keys() != ref[s].keys():
            return False
        if not all(torch.equal(got[s][k], ref[s][k]) for k in ref[s]):
            return False
    return True


def mlflow_runs(project: Path):
    import logging

    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    ids = [e.experiment_id for e in client.search_experiments()]
    runs, token = [], None
    while ids:
        page = client.search_runs(ids, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    return client, runs


def leftovers(project: Path, old_txt: bool = False) -> List[str]:
    found = [str(p.relative_to(project)) for p in project.rglob("*")
             if LEFTOVER.search(p.name) or (p.name.startswith(".") and p.name.endswith(HIDDEN_LEFTOVER))]
    if (project / "checkpoints" / NAME).exists():
        found.append(f"checkpoints/{NAME}/")
    if old_txt and (project / "results" / NAME / "old.txt").exists():
        found.append(f"results/{NAME}/old.txt")
    return found


def measure(chain: Chain, ref: Optional[Dict], old_txt: bool = False) -> Measure:
    m = Measure()
    if ref is not None:
        m.models_equal = models_equal(load_models(chain.project), ref)
        if not m.models_equal:
            m.notes.append(f"{chain.label}: final models differ from the reference (or are missing)")
    try:
        client, runs = mlflow_runs(chain.project)
        parents = [r for r in runs
                   if r.data.tags.get("fl.role") == "parent" and r.data.tags.get("fl.experiment") == NAME]
        if len(parents) != 1:
            m.parents_off = 1
            m.notes.append(f"{chain.label}: {len(parents)} parent runs")
        children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        for s in SEEDS:
            k = sum(1 for c in children if c.data.tags.get("fl.seed") == str(s))
            if k != 1:
                m.children_off += 1
                m.notes.append(f"{chain.label}: seed {s} has {k} child runs")
        for c in children:
            for key in c.data.metrics:
                steps = [h.step for h in client.get_metric_history(c.info.run_id, key)]
                d = len(steps) - len(set(steps))
                if d:
                    m.duplicated += d
                    m.notes.append(f"{chain.label}: run {c.info.run_id} metric {key}: {d} duplicated step(s)")
        bad = [r for r in runs if r.info.status != "FINISHED"]
        m.not_finished = len(bad)
        for r in bad:
            m.notes.append(f"{chain.label}: run {r.info.run_name} is {r.info.status} "
                           f"({r.data.tags.get('fl.end_reason', 'no fl.end_reason')})")
    except Exception as err:  # noqa: BLE001  (a store MLflow cannot open is a finding, not a crash)
        m.unreadable = True
        first = (str(err).strip().splitlines() or [""])[0][:200]
        m.notes.append(f"{chain.label}: MLflow store {chain.project / 'mlflow.db'} cannot be opened: "
                       f"{type(err).__name__}: {first}")
    left = leftovers(chain.project, old_txt)
    m.leftovers = len(left)
    if left:
        m.notes.append(f"{chain.label}: leftover files: {', '.join(left[:10])}")
    if chain.retrained:
        m.notes.append(f"{chain.label}: {chain.retrained} seed(s) retrained (logs in {chain.logs})")
    for b in chain.bad_exits:
        m.notes.append(f"{chain.label}: {b}")
    return m


@dataclass
class Row:
    scenario: str
    chains: int = 0
    kills: int = 0
    equal: int = 0
    compared: int = 0
    parents_off: int = 0
    children_off: int = 0
    duplicated: int = 0
    not_finished: int = 0
    leftovers: int = 0
    retrained: int = 0
    bad_exits: int = 0
    unreadable: int = 0  # chains whose MLflow store could not be opened
    kills_target: Optional[int] = None
    measured: bool = True  # False: no chain measures apply (scenario 6: pass/fail only)
    notes: List[str] = field(default_factory=list)

    def add(self, chain: Chain, m: Measure, compared: bool = True) -> None:
        self.chains += 1
        self.kills += chain.kills
        self.compared += int(compared)
        self.equal += int(compared and m.models_equal)
        self.parents_off += m.parents_off
        self.children_off += m.children_off
        self.duplicated += m.duplicated
        self.not_finished += m.not_finished
        self.leftovers += m.leftovers
        self.retrained += chain.retrained
        self.bad_exits += len(chain.bad_exits)
        self.unreadable += int(m.unreadable)
        self.notes += m.notes

    def ok(self) -> bool:
        if not self.measured:
            return True
        return (self.equal == self.compared and not (self.parents_off or self.children_off or self.duplicated
                                                    or self.not_finished or self.leftovers or self.retrained
                                                    or self.bad_exits or self.unreadable)
                and (self.kills_target is None or self.kills >= self.kills_target))

    def cells(self) -> List[str]:
        if not self.measured:
            return [self.scenario, str(self.chains), str(self.kills)] + ["n/a"] * (len(HEADER) - 3)
        kills = str(self.kills) + (f" (target >= {self.kills_target})" if self.kills_target is not None else "")
        equal = f"{self.equal} / {self.compared}" if self.compared else "reference"
        unk = f" + {self.unreadable} store(s) unreadable" if self.unreadable else ""
        return [self.scenario, str(self.chains), kills, equal, f"{self.parents_off}{unk}", f"{self.children_off}{unk}",
                f"{self.duplicated}{unk}", f"{self.not_finished}{unk}", str(self.leftovers), str(self.retrained)]


# --------------------------------------------------------------------------- scenarios


def reference(base: Path, params: Dict, row: Row) -> Tuple[Dict, float]:
    chain = Chain(base, "reference", params)
    t0 = time.perf_counter()
    rc, err = chain.run(["--grid", NAME])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"error: the reference run failed (exit {rc}): {last_line(err)}")
    ref = load_models(chain.project)
    row.add(chain, measure(chain, None), compared=False)
    row.notes.append(f"reference: wall time T = {wall:.1f} s")
    return ref, wall


def random_chain(base: Path, params: Dict, label: str, rng: random.Random, lo: float, hi: float) -> Chain:
    chain = Chain(base, label, params)
    for _ in range(MAX_ATTEMPTS):
        when = rng.uniform(lo, hi)
        att = chain.start(["--grid", NAME])
        try:
            att.proc.wait(timeout=when)  # the random kill time
        except subprocess.TimeoutExpired:
            att.proc.send_signal(signal.SIGKILL)
        rc, _ = chain.finish(att, expect_kill=True)
        if rc != -signal.SIGKILL:
            return chain
    chain.bad_exits.append(f"no attempt finished by itself in {MAX_ATTEMPTS} attempts")
    return chain


def random_kills(base: Path, params: Dict, ref: Dict, row: Row, chains: int, seed: int, T: float,
                 margin: float) -> None:
    rng = random.Random(seed)
    row.kills_target = KILLS_PER_CHAIN * chains
    n = 0
    while n < chains or (row.kills < row.kills_target and n < 4 * chains):
        n += 1
        chain = random_chain(base, params, f"random-{n}", rng, 0.5, T + margin)
        row.add(chain, measure(chain, ref))
        print(f"  random chain {n}: {chain.n} attempts, {chain.kills} kills", file=sys.stderr, flush=True)
    if n > chains:
        row.notes.append(f"random kills: {n - chains} chain(s) beyond the requested {chains}, run because "
                         f"attempts finished before {row.kills_target} kills had landed")


def named_points(base: Path, params: Dict, ref: Dict, row: Row) -> None:
    row.kills_target = len(faults.POINTS)
    for point in faults.POINTS:
        chain = Chain(base, f"point-{point}", params)
        (chain.project / "results" / NAME).mkdir(parents=True)
        (chain.project / "results" / NAME / "old.txt").write_text("outputs of an earlier run\n")
        fault = f"{point}@2" if point in ("checkpoint_write", "checkpoint_swap") else point
        rc, err = chain.run(["--grid", NAME], fault)
        if rc != -signal.SIGKILL:
            chain.bad_exits.append(f"FL_FAULT={fault}: expected a kill, got exit {rc}")
        chain.run(["--grid", NAME])
        row.add(chain, measure(chain, ref, old_txt=True))
        print(f"  point {point}: kill exit {rc}", file=sys.stderr, flush=True)


def corrupt_checkpoint(base: Path, params: Dict, ref: Dict, row: Row) -> None:
    row.kills_target = 2
    for variant in ("truncated", "garbage"):
        chain = Chain(base, f"corrupt-{variant}", params)
        rc, _ = chain.run(["--grid", NAME], "checkpoint_write@3")
        attempts = list((chain.project / "checkpoints" / NAME).glob("*/seed_1.pt"))
        if rc != -signal.SIGKILL or len(attempts) != 1 or not Path(str(attempts[0]) + ".prev").exists():
            chain.bad_exits.append(f"kill at checkpoint_write@3: exit {rc}, checkpoints {attempts}")
            row.add(chain, measure(chain, ref))
            continue
        ck = attempts[0]
        if variant == "truncated":
            ck.write_bytes(ck.read_bytes()[:100])
        else:
            ck.write_bytes(b"not a checkpoint at all")
            Path(str(ck) + ".prev").write_bytes(b"\x00garbage\xff" * 10)
        rc, err = chain.run(["--grid", NAME])
        warnings = err.count("is unreadable")
        if variant == "truncated":
            # seed_1.pt held round 4 and seed_1.pt.prev round 2 (checkpoints at rounds 2 and 4, killed writing 6)
            want = f"{NAME} seed 1: resumed from round 2"
            good = warnings == 1 and "moved it to seed_1.pt.corrupt" in err and want in err
            expect = f"1 warning, moved to seed_1.pt.corrupt, '{want}'"
        else:
            good = warnings == 2 and "resumed" not in err
            expect = "2 warnings, seed 1 from scratch (no 'resumed')"
        if not good:
            chain.bad_exits.append(f"rerun stderr does not show {expect}: {err.strip()[-500:]!r}")
        row.notes.append(f"corrupt-{variant}: rerun exit {rc}, {warnings} 'unreadable' warning(s); expected "
                         f"{expect}: {'yes' if good else 'NO'}")
        row.add(chain, measure(chain, ref))


def two_writers(base: Path, params: Dict, ref: Dict, row: Row) -> Tuple[bool, str]:
    chain = Chain(base, "two-writers", params)
    a = chain.start(["--grid", NAME])
    holder = chain.project / "results" / ".locks" / f"{NAME}.lock.holder"
    deadline = time.monotonic() + 300
    while not holder.exists() and a.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not holder.exists():
        a.proc.kill()
        a.proc.wait()
        return False, f"A never wrote {holder.name} (A exit {a.proc.returncode})"
    b = chain.start(["--grid", NAME])
    b_rc, b_text = chain.finish(b, ok_rc=(2,))
    a_rc, _ = chain.finish(a)
    lines = [ln for ln in b_text.strip().splitlines() if ln.strip()]
    b_ok = b_rc == 2 and len(lines) == 1 and f"pid {a.proc.pid}" in lines[0]
    row.add(chain, measure(chain, ref))
    detail = (f"B exit {b_rc}, {len(lines)} stderr line(s){': ' + lines[0][:160] if lines else ''}; "
              f"A (pid {a.proc.pid}) exit {a_rc}")
    return b_ok and a_rc == 0, detail


def diverging(base: Path) -> Tuple[bool, str]:
    chain = Chain(base, "diverging", diverging_grid())
    bad_rc, bad_err = chain.run(["--grid", "bad"])
    good_rc, _ = chain.run(["--grid", "good"])
    rep_rc, _ = chain.finish(chain.start(["--params", "params.yaml", "--results", "results"],
                                         module="pipeline.report"))
    report = chain.project / "results" / "report.md"
    text = report.read_text() if report.exists() else ""
    try:
        status = json.loads((chain.project / "results" / "bad" / "metrics.json").read_text()).get("status")
    except (OSError, ValueError):
        status = None
    ok = bad_rc == 0 and good_rc == 0 and rep_rc == 0 and status == "failed" and "- `bad`: FAILED" in text
    line = next((ln for ln in text.splitlines() if ln.startswith("- `bad`")), "(no '- `bad`' line in report.md)")
    return ok, (f"--grid bad exit {bad_rc} (metrics.json status {status}), --grid good exit {good_rc}, "
                f"report exit {rep_rc}: {line[:160]}")


# --------------------------------------------------------------------------- main


def code_state() -> str:
    """Hash of the Python files of fl_core/ and pipeline/ (to notice edits during a campaign)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted([*ROOT.glob("fl_core/**/*.py"), *ROOT.glob("pipeline/**/*.py")]):
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (head or "?") + (" + uncommitted changes" if dirty else "")


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"nproc {os.cpu_count()}, CPU {cpu}"


HEADER = ["scenario", "chains", "kills", "models equal / chains", "parents != 1", "children != 1 per seed",
          "duplicated (key, step)", "runs not FINISHED", "leftover files", "retrained seeds"]


def table(rows: List[Row], checks: List[Tuple[str, bool, str]]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * 2 + "---:|" * (len(HEADER) - 2)]
    out += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    if checks:
        out += ["", "| scenario | result | details |", "|---|---|---|"]
        out += [f"| {name} | {'pass' if ok else 'FAIL'} | {detail.replace('|', '/')} |" for name, ok, detail in checks]
    return "\n".join(out)


def finish_report(text: str, wall: float, passed: bool, out: Optional[Path]) -> int:
    """A campaign's end: ``text`` and its total wall time and verdict printed, also written to ``out`` if given;
    the exit status (0 when every target is met, 1 otherwise)."""
    text += f"\n\nTotal wall time: {wall:.0f} s ({wall / 60:.1f} min). Every target met: {'yes' if passed else 'NO'}."
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0 if passed else 1


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chains", type=int, default=4, help="random-kill chains (default 4; target 5 kills each)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill times (default 0)")
    p.add_argument("--margin", type=float, default=2.0,
                   help="start-up margin added to T for the kill times, seconds (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke check: 2 chains, 20 rounds")
    p.add_argument("--keep", action="store_true", help="keep the temporary project folders")
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="also write the table here")
    args = p.parse_args(argv)
    rounds = 20 if args.quick else 40
    chains = 2 if args.quick else args.chains
    params = grid(rounds)

    t0 = time.perf_counter()
    code_before = code_state()
    base = Path(tempfile.mkdtemp(prefix="fl-faults-"))
    rows: List[Row] = []
    checks: List[Tuple[str, bool, str]] = []
    try:
        def step(msg):
            print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

        step("1. reference")
        r1 = Row("1. reference")
        ref, T = reference(base, params, r1)
        rows.append(r1)
        step(f"2. random kills (T = {T:.1f} s)")
        r2 = Row("2. random kills")
        random_kills(base, params, ref, r2, chains, args.seed, T, args.margin)
        rows.append(r2)
        step("3. named points")
        r3 = Row("3. named points")
        named_points(base, params, ref, r3)
        rows.append(r3)
        step("4. corrupt checkpoint")
        r4 = Row("4. corrupt checkpoint")
        corrupt_checkpoint(base, params, ref, r4)
        rows.append(r4)
        step("5. two writers")
        r5 = Row("5. two same-name processes (pass/fail below)")
        ok5, detail5 = two_writers(base, params, ref, r5)
        rows.append(r5)
        checks.append(("5. two same-name processes", ok5 and r5.ok(), detail5))
        step("6. diverging grid")
        ok6, detail6 = diverging(base)
        rows.append(Row("6. grid with a diverging experiment (pass/fail below)", chains=1, measured=False))
        checks.append(("6. grid with a diverging experiment", ok6, detail6))
    finally:
        if args.keep:
            print(f"kept: {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0
    code_after = code_state()
    code = f"code: git {git_head()}, fl_core/ + pipeline/ sources {code_before}"
    if code_after != code_before:
        code += (f" at the start, {code_after} at the end: WARNING, the code changed during the campaign, "
                 "so the numbers mix versions")

    passed = all(r.ok() for r in rows) and all(ok for _, ok, _ in checks)
    notes = [n for r in rows for n in r.notes]
    text = "\n".join([
        f"Fault campaign, {_dt.date.today().isoformat()}, {machine()}, torch threads OMP_NUM_THREADS=1; "
        f"{rounds} rounds, seeds {SEEDS}, --chains {chains} --seed {args.seed} --margin {args.margin:g}; "
        f"{len(faults.POINTS)} fault points; {code}",
        "",
        table(rows, checks),
        "",
        *[f"- {n}" for n in notes],
    ])
    return finish_report(text, wall, passed, args.out)


if __name__ == "__main__":
    sys.exit(main())
