#!/usr/bin/env python
"""Environment-failure campaign: make the machine fail under ``pipeline.train`` (and the other stages) and measure
how the command ends and whether the same command afterwards leaves exactly one clean run.

Beside the kill campaign (``benchmarks/faults.py``, whose scaffolding it imports: project folders with their own
``params.yaml`` and SQLite MLflow store, subprocesses with ``OMP_NUM_THREADS=1``, the MLflow and leftover checks).
Every case works on throwaway resources it makes itself:

- a file where a folder is needed (real);
- a read-only folder: a read-only tmpfs mounted in a private mount namespace (the campaign starts itself again under
  ``unshare -m`` when it runs as root and may; root ignores permission bits, so ``chmod`` proves nothing), else the
  injected ``FL_FAULT=path_check:EROFS``; a folder without write permission: the injected ``path_check:EACCES``;
- a full disk: a small tmpfs holding ``engine.checkpoint_dir`` that the campaign fills once the run's first checkpoint
  exists (real, with mounts), and ``ENOSPC`` injected at the named write points (``checkpoint_write``,
  ``outputs_write``, ``prepare_write``, ``partition_write``: :data:`fl_core.faults.WRITE_POINTS`);
- ``engine.executor=distributed`` under ``torchrun`` (2 ranks): rank 1 SIGKILLed, and rank 1 frozen (SIGSTOP), once
  rank 0's second checkpoint exists, with plain ``torchrun`` and with ``python -m pipeline.torchrun``.

Measured per case: the exit status; the seconds from the fault to the command's exit (a fault present at the start:
the command's whole wall time; an injected one: from the moment the point fired, ``FL_FAULT_STAMP``; torchrun: also
when rank 0 ended); stderr lines and tracebacks (plain torchrun: the ranks' lines + torchrun's own report); MLflow
runs left RUNNING by the failing command (read from the store); then the same command again (with the fault
removed): its exit status, the runs (one parent and one child per seed, all FINISHED), the metrics lost (every
(seed, metric, step) of an uninterrupted run missing or different, timings excepted) and leftover files.

Targets (the exit status is 0 when every case meets them): exit status 3; at most 60 s from the fault to the exit
(a frozen rank: rank 0 within ``engine.dist_timeout_s`` + 30 s); at most 3 stderr lines (plain torchrun: the ranks')
and no traceback; no run left RUNNING; the rerun exits 0 with one clean run per seed, no metric lost, no leftover.

Cases are registered with :func:`case` (name, kind, what they need); the next part registers the tracking-store
cases the same way (an SQLite store locked by another process, a tracking server's port that does not answer,
PostgreSQL stopped, frozen or restarted under a sweep).

Usage (from the repository root)::

    .venv/bin/python benchmarks/env_faults.py                  # every case (about 8 min on 2 cores)
    .venv/bin/python benchmarks/env_faults.py --no-torchrun    # the single-process cases (about 4 min)
    .venv/bin/python benchmarks/env_faults.py --cases results_dir_file,disk_full_real --keep --out /tmp/env.md
    .venv/bin/python benchmarks/env_faults.py --list
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere, without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import faults as kill  # noqa: E402  (the kill campaign's scaffolding)
from fl_core import envfail, faults  # noqa: E402

NAME = kill.NAME  # "exp"
SEEDS = kill.SEEDS  # [1, 2]
NS_ENV = "FL_ENV_FAULTS_NAMESPACE"  # set when the campaign runs in its private mount namespace
RUN_TIMEOUT = 600.0
SINGLE = ["train.rounds=3", "seed=1,2", f"name={NAME}", "engine.progress=false", "partition.num_clients=4",
          "train.local_epochs=1", "tracking.log_every=1"]
TEMPORARY = re.compile(r"(\.tmp$|\.staging$|\.holder$|^\.fl-write-check-|^\.[^.]+.*\.[a-z0-9_]{8}\.\w+$)")


def grid(rounds: int, checkpoint_dir: str = "checkpoints") -> Dict:
    """The disk cases' grid: the kill campaign's (SCAFFOLD, 10 clients, Dirichlet), fewer rounds."""
    g = kill.grid(rounds)
    g["engine"] = {**g["engine"], "checkpoint_every": 1, "checkpoint_dir": checkpoint_dir}
    return g


def dist_args(rounds: int, timeout_s: float, executor: str = "distributed") -> List[str]:
    args = ["algorithm=scaffold", f"train.rounds={rounds}", "train.local_epochs=1", "seed=1,2", "name=dist",
            "engine.progress=false", "engine.checkpoint_every=1", "tracking.log_every=1", f"engine.executor={executor}"]
    return args + ([f"engine.dist_timeout_s={timeout_s:g}"] if executor == "distributed" else [])


# --------------------------------------------------------------------------- the case registry


@dataclass
class Outcome:
    """What one case measured (module docstring)."""

    case: str
    fault: str
    status: Optional[int] = None
    to_exit_s: Optional[float] = None
    rank0_exit_s: Optional[float] = None
    limit_s: float = 60.0
    lines: int = 0
    launcher_lines: int = 0  # plain torchrun: its own report's lines (not the ranks')
    tracebacks: int = 0
    launcher_tracebacks: int = 0
    first_line: str = ""
    left_running: Optional[int] = None
    rerun_status: Optional[int] = None
    runs_after: str = "-"
    runs_ok: bool = True
    metrics_lost: Optional[int] = None
    leftovers: List[str] = field(default_factory=list)
    expect_status: int = envfail.EXIT_STATUS
    launcher_status: Optional[int] = None  # plain torchrun's own exit status (status: rank 0's, from its report)
    notes: List[str] = field(default_factory=list)

    def ok(self) -> bool:
        timely = self.to_exit_s is not None and (self.rank0_exit_s if self.rank0_exit_s is not None
                                                 else self.to_exit_s) <= self.limit_s
        return (self.status == self.expect_status and timely and self.lines <= 3 and self.tracebacks == 0
                and not self.left_running and self.rerun_status == 0 and self.runs_ok and not self.metrics_lost
                and not self.leftovers)


@dataclass
class Case:
    name: str
    kind: str  # path | disk | data | dist (the next part: tracking)
    run: Callable[["Context"], Outcome]
    needs: Tuple[str, ...] = ()  # "torchrun"; "mounts" cases fall back to injected faults without them
    doc: str = ""


CASES: Dict[str, Case] = {}


def case(name: str, kind: str, needs: Tuple[str, ...] = ()):
    """Register a case: ``fn(ctx) -> Outcome``; its docstring's first line describes it in ``--list``."""
    def deco(fn):
        CASES[name] = Case(name, kind, fn, needs, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return deco


@dataclass
class Context:
    base: Path
    rounds: int
    dist_timeout_s: float
    mounts: bool
    references: Dict[str, Dict] = field(default_factory=dict)  # label -> {(seed, key): [(step, value)]}


# --------------------------------------------------------------------------- running commands


class Run:
    """One command of a case: started in the chain's project with its environment (kill.Chain.env)."""

    def __init__(self, chain: "kill.Chain", argv: List[str], fault: Optional[str] = None, extra_env=None):
        chain.n += 1
        self.err = chain.logs / f"{chain.n:02d}.err"
        self.stamp = chain.logs / f"{chain.n:02d}.stamp"
        env = chain.env(fault)
        env.pop(envfail.DEBUG_ENV, None)
        env[faults.STAMP_ENV] = str(self.stamp)
        env.update(extra_env or {})
        self.t0 = time.time()
        with open(chain.logs / f"{chain.n:02d}.out", "w") as fo, open(self.err, "w") as fe:
            self.proc = subprocess.Popen(argv, cwd=chain.project, env=env, stdout=fo, stderr=fe,
                                         start_new_session=True)

    def wait(self) -> Tuple[int, str, float]:
        """(exit status, stderr, the time.time() it ended); a hang is killed and reported as status None."""
        try:
            rc = self.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = None
            self.proc.wait()
        return rc, self.err.read_text(errors="replace"), time.time()

    def fault_time(self) -> Optional[float]:
        try:
            return float(self.stamp.read_text())
        except (OSError, ValueError):
            return None


def py(module: str, *args: str) -> List[str]:
    return [sys.executable, "-m", module, *args]


def count(text: str) -> Tuple[int, int]:
    """(non-empty lines, tracebacks) of a stderr text."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return len(lines), sum("Traceback (most recent call last)" in ln for ln in lines)


def split_torchrun(text: str) -> Tuple[str, str]:
    """(the ranks' lines, torchrun's own lines) of a plain torchrun's stderr: its agent's log lines (``W1126 ...``,
    ``E1126 ...``) and, from its traceback on, its ChildFailedError report."""
    ranks, own, in_report = [], [], False
    for ln in text.splitlines():
        if ln.startswith("Traceback (most recent call last)") and not in_report and "[rank" not in ln:
            in_report = True
        if in_report or re.match(r"^[WEI]\d{4} \d\d:\d\d:\d\d", ln):
            own.append(ln)
        else:
            ranks.append(ln)
    return "\n".join(ranks), "\n".join(own)


def running(project: Path) -> Optional[int]:
    """MLflow runs with status RUNNING in the project's store (0 when no store was created)."""
    if not (project / "mlflow.db").exists():
        return 0
    _client, runs = kill.mlflow_runs(project)
    return sum(r.info.status == "RUNNING" for r in runs)


def histories(project: Path, name: str) -> Dict:
    """{(seed, metric): [(step, value), ...]} of experiment ``name``'s child runs, timings left out."""
    client, runs = kill.mlflow_runs(project)
    out = {}
    for r in runs:
        tags = r.data.tags
        if tags.get("fl.experiment") != name or "mlflow.parentRunId" not in tags:
            continue
        for key in r.data.metrics:
            if key not in ("round/time_s", "round_time_s"):  # wall-clock round times differ on every run
                out[(tags.get("fl.seed"), key)] = sorted((m.step, m.value)
                                                         for m in client.get_metric_history(r.info.run_id, key))
    return out


def judge_runs(out: Outcome, project: Path, name: str, reference: Optional[Dict]) -> None:
    """After the rerun: one parent and one child per seed, all FINISHED; metrics lost against ``reference``."""
    _client, runs = kill.mlflow_runs(project)
    mine = [r for r in runs if r.data.tags.get("fl.experiment") == name]
    parents = [r for r in mine if r.data.tags.get("fl.role") == "parent"]
    per_seed = {s: sum(1 for r in mine if r.data.tags.get("fl.seed") == str(s) and "mlflow.parentRunId" in r.data.tags)
                for s in SEEDS}
    statuses = sorted({r.info.status for r in mine})
    children = ("1 child per seed" if all(v == 1 for v in per_seed.values())
                else "children per seed " + "/".join(str(per_seed[s]) for s in SEEDS))
    out.runs_after = f"{len(parents)} parent, {children}, {'/'.join(statuses)}"
    out.runs_ok = len(parents) == 1 and all(v == 1 for v in per_seed.values()) and statuses == ["FINISHED"]
    if reference is not None:
        got = histories(project, name)
        lost = 0
        for key, pairs in reference.items():
            have = dict(got.get(key, []))
            lost += sum(1 for step, value in pairs if have.get(step) != value)
        out.metrics_lost = lost


def temporaries(project: Path) -> List[str]:
    return sorted(str(p.relative_to(project)) for p in project.rglob("*") if TEMPORARY.search(p.name))


def fail_then_rerun(ctx: Context, label: str, params: Dict, argv: List[str], fault: Optional[str] = None,
                    rerun: Optional[List[str]] = None, reference: Optional[str] = None, name: str = NAME,
                    prepare: Optional[Callable[[Path], None]] = None, fault_desc: str = "",
                    nothing_created: bool = False) -> Outcome:
    """The common shape of a case: ``prepare(project)``, the command with ``fault`` (its first run), measures, then
    ``rerun`` (default: the same command) without it, and the end state. ``nothing_created``: the failing command
    must not create any file (a folder check: no lock file, no MLflow store, no results folder)."""
    chain = kill.Chain(ctx.base, label, params)
    if prepare is not None:
        prepare(chain.project)
    before = {str(p.relative_to(chain.project)) for p in chain.project.rglob("*")}
    out = Outcome(label, fault_desc or (f"FL_FAULT={fault}" if fault else "real"))
    first = Run(chain, argv, fault)
    out.status, err, ended = first.wait()
    stamp = first.fault_time()
    out.to_exit_s = ended - (stamp if stamp is not None else first.t0)
    out.lines, out.tracebacks = count(err)
    out.first_line = next((ln for ln in err.splitlines() if ln.strip()), "")
    out.left_running = running(chain.project)
    out.leftovers = temporaries(chain.project)
    if nothing_created:
        out.leftovers += sorted({str(p.relative_to(chain.project)) for p in chain.project.rglob("*")} - before)
    second = Run(chain, rerun or argv)
    out.rerun_status, err2, _ = second.wait()
    if out.rerun_status != 0:
        out.notes.append(f"{label}: rerun exit {out.rerun_status}: {kill.last_line(err2)}")
    if name:
        judge_runs(out, chain.project, name, ctx.references.get(reference) if reference else None)
    out.leftovers += [f"after the rerun: {p}" for p in kill.leftovers(chain.project)]
    return out


# --------------------------------------------------------------------------- cases: folders


def _file_at(rel: str) -> Callable[[Path], None]:
    def prep(project: Path) -> None:
        (project / rel).write_text("a file where a folder is needed\n")
    return prep


@case("results_dir_file", "path")
def _results_dir_file(ctx: Context) -> Outcome:
    """results_dir is a file (fl-train): refused before any data is read; nothing created."""
    return fail_then_rerun(ctx, "results_dir is a file", {}, py("pipeline.train", *SINGLE, "results_dir=taken"),
                           rerun=py("pipeline.train", *SINGLE), prepare=_file_at("taken"), fault_desc="real",
                           nothing_created=True)


@case("checkpoint_dir_file", "path")
def _checkpoint_dir_file(ctx: Context) -> Outcome:
    """engine.checkpoint_dir is a file (fl-train): refused, and no empty lock file left in results/.locks."""
    return fail_then_rerun(ctx, "engine.checkpoint_dir is a file", {},
                           py("pipeline.train", *SINGLE, "engine.checkpoint_dir=taken"),
                           rerun=py("pipeline.train", *SINGLE), prepare=_file_at("taken"), fault_desc="real",
                           nothing_created=True)


@case("results_dir_read_only", "path", ("mounts",))
def _results_dir_read_only(ctx: Context) -> Outcome:
    """results_dir on a read-only file system: a read-only tmpfs (else the injected path_check:EROFS)."""
    if ctx.mounts:
        def prep(project: Path) -> None:
            (project / "ro").mkdir()
            mount(project / "ro", "ro,size=1m")
        return fail_then_rerun(ctx, "results_dir read-only", {}, py("pipeline.train", *SINGLE, "results_dir=ro/results"),
                               rerun=py("pipeline.train", *SINGLE), prepare=prep, fault_desc="real: read-only tmpfs",
                               nothing_created=True)
    return fail_then_rerun(ctx, "results_dir read-only", {}, py("pipeline.train", *SINGLE, "results_dir=ro/results"),
                           fault="path_check:EROFS", rerun=py("pipeline.train", *SINGLE), nothing_created=True)


@case("checkpoint_dir_no_permission", "path")
def _checkpoint_dir_eacces(ctx: Context) -> Outcome:
    """engine.checkpoint_dir not writable (permission denied; injected: root ignores permission bits)."""
    return fail_then_rerun(ctx, "engine.checkpoint_dir not writable", {},
                           py("pipeline.train", *SINGLE, "engine.checkpoint_dir=ck"), fault="path_check@2:EACCES",
                           rerun=py("pipeline.train", *SINGLE, "engine.checkpoint_dir=ck"), nothing_created=True)


# --------------------------------------------------------------------------- cases: a full disk


@case("disk_full_real", "disk", ("mounts",))
def _disk_full_real(ctx: Context) -> Outcome:
    """engine.checkpoint_dir on a 64 MiB tmpfs that fills up once the first checkpoint exists (real ENOSPC)."""
    label = "disk full during a run (checkpoint folder)"
    if not ctx.mounts:
        out = Outcome(label, "needs a private mount namespace (root and unshare): not run")
        out.status = None
        return out
    chain = kill.Chain(ctx.base, label, grid(ctx.rounds, "ck"))
    (chain.project / "ck").mkdir()
    mount(chain.project / "ck", "size=64m")
    out = Outcome(label, "real: tmpfs filled after the 1st checkpoint")
    first = Run(chain, py("pipeline.train", "--grid", NAME))
    filler = chain.project / "ck" / "filler"
    fault_at = None
    deadline = time.monotonic() + RUN_TIMEOUT
    while first.proc.poll() is None and time.monotonic() < deadline:
        if list((chain.project / "ck" / NAME).glob("*/seed_1.pt")):
            fault_at = fill(filler)
            break
        time.sleep(0.05)
    out.status, err, ended = first.wait()
    out.to_exit_s = ended - fault_at if fault_at is not None else None
    if fault_at is None:
        out.notes.append(f"{label}: the run ended before its first checkpoint could be seen")
    out.lines, out.tracebacks = count(err)
    out.first_line = next((ln for ln in err.splitlines() if ln.strip()), "")
    out.left_running = running(chain.project)
    out.leftovers = [p for p in temporaries(chain.project)]
    filler.unlink(missing_ok=True)
    second = Run(chain, py("pipeline.train", "--grid", NAME))
    out.rerun_status, err2, _ = second.wait()
    if out.rerun_status != 0:
        out.notes.append(f"{label}: rerun exit {out.rerun_status}: {kill.last_line(err2)}")
    judge_runs(out, chain.project, NAME, ctx.references.get("grid"))
    out.leftovers += [f"after the rerun: {p}" for p in kill.leftovers(chain.project) if not p.startswith("ck/")]
    if list((chain.project / "ck" / NAME).glob("*")):
        out.leftovers.append("after the rerun: ck/exp/")
    return out


def _injected_disk_case(point: str, what: str):
    def run(ctx: Context) -> Outcome:
        return fail_then_rerun(ctx, f"disk full at {what}", grid(ctx.rounds), py("pipeline.train", "--grid", NAME),
                               fault=f"{point}:ENOSPC", reference="grid")
    run.__doc__ = f"ENOSPC injected at {point} ({what})."
    return run


case("disk_full_checkpoint", "disk")(_injected_disk_case("checkpoint_write@3", "a checkpoint write (seed 1, round 3)"))
case("disk_full_outputs", "disk")(_injected_disk_case("outputs_write@6", "an outputs write (seed 1's model)"))
case("disk_full_metrics", "disk")(_injected_disk_case("outputs_write@15", "the outputs' metrics.json"))


@case("disk_full_report", "data")
def _disk_full_report(ctx: Context) -> Outcome:
    """ENOSPC injected at the report's first write (fl-report), after a complete grid run."""
    def prep(project: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}"}
        env.pop(faults.ENV, None)
        subprocess.run(py("pipeline.train", "--grid", NAME), cwd=project, env=env, capture_output=True,
                       timeout=RUN_TIMEOUT, check=True)
    return fail_then_rerun(ctx, "disk full at the report", grid(ctx.rounds), py("pipeline.report"),
                           fault="outputs_write:ENOSPC", name="", prepare=prep)


@case("disk_full_prepare", "data")
def _disk_full_prepare(ctx: Context) -> Outcome:
    """ENOSPC injected at the prepared dataset's write (python -m pipeline.prepare)."""
    return fail_then_rerun(ctx, "disk full at the prepare stage", grid(ctx.rounds), py("pipeline.prepare"),
                           fault="prepare_write:ENOSPC", name="")


@case("disk_full_partition", "data")
def _disk_full_partition(ctx: Context) -> Outcome:
    """ENOSPC injected at the partition's write (python -m pipeline.partition)."""
    return fail_then_rerun(ctx, "disk full at the partition stage", grid(ctx.rounds), py("pipeline.partition"),
                           fault="partition_write:ENOSPC", name="")


# --------------------------------------------------------------------------- cases: torchrun


def _children(pid: int) -> Dict[int, int]:
    """{rank: pid} of the processes whose parent is ``pid`` (torchrun's agent), from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            if "RANK" in env:
                out[int(env["RANK"])] = int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _dist_case(launcher: str, action: str):
    def run(ctx: Context) -> Outcome:
        plain = launcher == "torchrun"
        label = f"rank 1 {'killed (SIGKILL)' if action == 'kill' else 'frozen (SIGSTOP)'}, " \
                f"{'torchrun' if plain else 'python -m pipeline.torchrun'}"
        chain = kill.Chain(ctx.base, label, {})
        head = ([str(Path(sys.executable).with_name("torchrun"))] if plain else py("pipeline.torchrun"))

        def command() -> List[str]:  # the same command, on a free port
            return [*head, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                    "-m", "pipeline.train", *dist_args(ctx.rounds, ctx.dist_timeout_s)]

        out = Outcome(label, f"real: {'SIGKILL' if action == 'kill' else 'SIGSTOP'} to rank 1 after rank 0's 2nd "
                             "checkpoint")
        if action == "stop":
            out.limit_s = ctx.dist_timeout_s + 30
        first = Run(chain, command())
        fault_at, ranks = None, {}
        deadline = time.monotonic() + RUN_TIMEOUT
        while first.proc.poll() is None and time.monotonic() < deadline:
            if list((chain.project / "checkpoints" / "dist").glob("*/seed_1.pt.prev")):
                ranks = _children(first.proc.pid)
                if 1 in ranks and 0 in ranks:
                    os.kill(ranks[1], signal.SIGKILL if action == "kill" else signal.SIGSTOP)
                    fault_at = time.time()
                break
            time.sleep(0.05)
        rank0_end: List[float] = []
        if 0 in ranks:
            threading.Thread(target=_watch_exit, args=(ranks[0], rank0_end), daemon=True).start()
        out.status, err, ended = first.wait()
        if action == "stop" and 1 in ranks:  # never leave a stopped process behind
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(ranks[1], sig)
                except ProcessLookupError:
                    pass
        if fault_at is None:
            out.notes.append(f"{label}: no fault: the run ended before rank 0's 2nd checkpoint was seen")
        else:
            out.to_exit_s = ended - fault_at
            out.rank0_exit_s = (rank0_end[0] - fault_at) if rank0_end else None
        if plain:
            ranks_text, own = split_torchrun(err)
            out.lines, out.tracebacks = count(ranks_text)
            out.launcher_lines, out.launcher_tracebacks = count(own)
            out.launcher_status = out.status
            found = re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: (-?\d+)", own)
            out.status = int(found.group(1)) if found else None
        else:
            out.lines, out.tracebacks = count(err)
        out.first_line = next((ln for ln in err.splitlines() if ln.startswith("error:")), "")
        out.left_running = running(chain.project)
        out.leftovers = temporaries(chain.project)
        second = Run(chain, command())
        out.rerun_status, err2, _ = second.wait()
        if out.rerun_status != 0:
            out.notes.append(f"{label}: rerun exit {out.rerun_status}: {kill.last_line(err2)}")
        judge_runs(out, chain.project, "dist", ctx.references.get("dist"))
        out.leftovers += [f"after the rerun: {p}" for p in kill.leftovers(chain.project)]
        if (chain.project / "checkpoints" / "dist").exists():
            out.leftovers.append("after the rerun: checkpoints/dist/")
        return out
    run.__doc__ = f"engine.executor=distributed, 2 ranks: rank 1 {action} ({launcher})."
    return run


def _watch_exit(pid: int, into: List[float]) -> None:
    while Path(f"/proc/{pid}").exists() and not _zombie(pid):
        time.sleep(0.02)
    into.append(time.time())


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


case("rank_killed", "dist", ("torchrun",))(_dist_case("torchrun", "kill"))
case("rank_killed_wrapper", "dist", ("torchrun",))(_dist_case("pipeline.torchrun", "kill"))
case("rank_frozen", "dist", ("torchrun",))(_dist_case("torchrun", "stop"))
case("rank_frozen_wrapper", "dist", ("torchrun",))(_dist_case("pipeline.torchrun", "stop"))


# --------------------------------------------------------------------------- mounts


MOUNTED: List[Path] = []


def mount(path: Path, options: str) -> None:
    """A tmpfs at ``path`` (in the campaign's private mount namespace), unmounted at the end."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True)
    MOUNTED.append(path)


def fill(path: Path) -> float:
    """Write zeros to ``path`` until the file system is full; the time it became full."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        small = b"\0" * 4096
        try:
            while True:
                f.write(small)
        except OSError:
            pass
    return time.time()


def mounts_possible() -> bool:
    return os.environ.get(NS_ENV) == "1"


def enter_namespace(argv: List[str]) -> None:
    """As root with ``unshare`` allowed: run this campaign again in a private mount namespace (its tmpfs mounts
    vanish with it); otherwise return and the mount cases use injected faults."""
    if os.environ.get(NS_ENV) or os.geteuid() != 0 or shutil.which("unshare") is None:
        return
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return
    os.environ[NS_ENV] = "1"
    os.execvp("unshare", ["unshare", "-m", "--propagation", "private", sys.executable, __file__, *argv])


# --------------------------------------------------------------------------- references and the table


def references(ctx: Context, dist: bool) -> None:
    """Uninterrupted runs whose every (seed, metric, step) a rerun must reproduce."""
    chain = kill.Chain(ctx.base, "reference-grid", grid(ctx.rounds))
    rc, err, _ = Run(chain, py("pipeline.train", "--grid", NAME)).wait()
    if rc != 0:
        raise SystemExit(f"error: the reference run failed (exit {rc}): {kill.last_line(err)}")
    ctx.references["grid"] = histories(chain.project, NAME)
    if dist:
        chain = kill.Chain(ctx.base, "reference-dist", {})
        rc, err, _ = Run(chain, py("pipeline.train", *dist_args(ctx.rounds, 0, "sequential"))).wait()
        if rc != 0:
            raise SystemExit(f"error: the distributed reference run failed (exit {rc}): {kill.last_line(err)}")
        ctx.references["dist"] = histories(chain.project, "dist")


HEADER = ["case", "fault", "exit status", "s to exit after the fault", "stderr lines", "tracebacks",
          "runs left RUNNING", "rerun: exit, runs", "metrics lost", "leftover files", "result"]


def cells(o: Outcome) -> List[str]:
    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    status = num(o.status, "{}")
    if o.launcher_status is not None:
        status = f"rank 0: {status} (torchrun: {o.launcher_status})"
    exit_s = num(o.to_exit_s)
    if o.rank0_exit_s is not None:
        exit_s = f"rank 0 {o.rank0_exit_s:.1f}, command {exit_s}"
    lines = str(o.lines) + (f" + torchrun's {o.launcher_lines}" if o.launcher_lines else "")
    tbs = str(o.tracebacks) + (f" + torchrun's {o.launcher_tracebacks}" if o.launcher_lines else "")
    return [o.case, o.fault, status, exit_s, lines, tbs, num(o.left_running, "{}"),
            f"{num(o.rerun_status, '{}')}, {o.runs_after}", num(o.metrics_lost, "{}"), str(len(o.leftovers)),
            "pass" if o.ok() else "FAIL"]


def table(outcomes: List[Outcome]) -> str:
    rows = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * 2 + "---:|" * (len(HEADER) - 4) + "---|---|"]
    rows += ["| " + " | ".join(c.replace("|", "/") for c in cells(o)) + " |" for o in outcomes]
    return "\n".join(rows)


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="comma-separated case names or kinds (default: all; see --list)")
    p.add_argument("--no-torchrun", action="store_true", help="leave out the torchrun cases")
    p.add_argument("--no-mounts", action="store_true", help="no private mount namespace: injected faults instead")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the runs (default 8)")
    p.add_argument("--dist-timeout", type=float, default=20.0, help="engine.dist_timeout_s of the torchrun cases "
                   "(default 20)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary project folders")
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="also write the table here")
    args = p.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:30s} {c.kind:5s} {c.doc}")
        return 0
    if not args.no_mounts:
        enter_namespace(argv)
    wanted = [w for w in args.cases.split(",") if w]
    chosen = [c for c in CASES.values() if (not wanted or c.name in wanted or c.kind in wanted)
              and not (args.no_torchrun and "torchrun" in c.needs)]
    unknown = [w for w in wanted if w not in CASES and w not in {c.kind for c in CASES.values()}]
    if unknown:
        p.error(f"unknown case {unknown[0]!r} (see --list)")
    ctx = Context(Path(tempfile.mkdtemp(prefix="fl-env-faults-")), args.rounds, args.dist_timeout,
                  mounts_possible() and not args.no_mounts)
    t0 = time.perf_counter()
    code_before, load_before = kill.code_state(), load()
    outcomes: List[Outcome] = []
    try:
        print(f"[{0:7.1f} s] references", file=sys.stderr, flush=True)
        references(ctx, any(c.kind == "dist" for c in chosen))
        for c in chosen:
            print(f"[{time.perf_counter() - t0:7.1f} s] {c.name}", file=sys.stderr, flush=True)
            outcomes.append(c.run(ctx))
    finally:
        for m in reversed(MOUNTED):
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        if args.keep:
            print(f"kept: {ctx.base}", file=sys.stderr)
        else:
            shutil.rmtree(ctx.base, ignore_errors=True)
    wall = time.perf_counter() - t0
    passed = all(o.ok() for o in outcomes)
    code = f"git {kill.git_head()}, fl_core/ + pipeline/ sources {code_before}"
    if kill.code_state() != code_before:
        code += " (WARNING: the sources changed during the campaign)"
    notes = [n for o in outcomes for n in o.notes]
    notes += [f"{o.case}: first line: {o.first_line[:300]}" for o in outcomes if o.first_line]
    notes += [f"{o.case}: leftover: {', '.join(o.leftovers[:6])}" for o in outcomes if o.leftovers]
    text = "\n".join([
        f"Environment-failure campaign, {_dt.date.today().isoformat()}, {kill.machine()}, load average "
        f"{load_before} at the start, {load()} at the end; OMP_NUM_THREADS=1; {args.rounds} rounds, seeds {SEEDS}; "
        f"mounts: {'private namespace (real read-only and full tmpfs)' if ctx.mounts else 'none (injected faults)'}; "
        f"engine.dist_timeout_s={args.dist_timeout:g}; {code}",
        "",
        table(outcomes),
        "",
        *[f"- {n}" for n in notes],
        "",
        f"Total wall time: {wall:.0f} s ({wall / 60:.1f} min). Every target met: {'yes' if passed else 'NO'}.",
    ])
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
