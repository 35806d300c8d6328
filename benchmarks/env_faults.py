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
  ``outputs_write``, ``prepare_write``, ``partition_write``: :data:`fl_core.store.faults.WRITE_POINTS`);
- ``engine.executor=distributed`` under ``torchrun`` (2 ranks): rank 1 SIGKILLed, and rank 1 frozen (SIGSTOP), once
  rank 0's second checkpoint exists, with plain ``torchrun`` and with ``python -m pipeline.torchrun``;
- the tracking store: the SQLite store locked by a second process (``BEGIN EXCLUSIVE``) from the first checkpoint
  until the command ends, ``MLFLOW_TRACKING_URI`` at a port nothing listens on, a ``sqlite:///`` store in a folder
  that does not exist, an ``mlflow server`` SIGKILLed after the first checkpoint and started again at once;
- PostgreSQL under a 2-worker ``sweeps/tune.py`` sweep (a throwaway server, ``tests/pg.py``; MLflow in the project's
  SQLite store): stopped (``pg_ctl stop -m fast``), frozen (SIGSTOP to every server process) or stopped and started
  again, once 2 trials have ended and one runs; the stopped and frozen servers answer again before the rerun.

Measured per case: the exit status; the seconds from the fault to the command's exit (a fault present at the start:
the command's whole wall time; an injected one: from the moment the point fired, ``FL_FAULT_STAMP``; torchrun: also
when rank 0 ended); stderr lines and tracebacks (plain torchrun: the ranks' lines + torchrun's own report); MLflow
runs left RUNNING by the failing command (read from the store); then the same command again (with the fault
removed): its exit status, the runs (one parent and one child per seed, all FINISHED), the metrics lost (every
(seed, metric, step) of an uninterrupted run missing or different, timings excepted) and leftover files.

Targets (the exit status is 0 when every case meets them): exit status 3; at most 60 s from the fault to the exit
(a frozen rank: rank 0 within ``engine.dist_timeout_s`` + 30 s); at most 3 stderr lines (plain torchrun: the ranks')
and no traceback; no run left RUNNING; the rerun exits 0 with one clean run per seed, no metric lost, no leftover.

A case whose fault is the tracking store itself may leave runs RUNNING (only that store could end them): the next
start ends them as orphans and continues them, so for those the target is no run RUNNING after the rerun. The sweep
cases also count the Optuna trials RUNNING after the failing command and after the rerun (target 0), and judge the
rerun by one MLflow parent of the study, FINISHED, at most one MLflow run per trial; a restarted server must let the
sweep finish (exit 0).

Cases are registered with :func:`case` (name, kind, what they need: ``torchrun``, ``postgres``, ``mounts``).
``--busy N`` runs N CPU-bound processes beside the whole campaign (:class:`Busy`): the targets hold on a loaded
machine too.

Usage (from the repository root)::

    .venv/bin/python benchmarks/env_faults.py                  # every case (about 8 min on 2 cores)
    .venv/bin/python benchmarks/env_faults.py --no-torchrun    # the single-process cases
    .venv/bin/python benchmarks/env_faults.py --cases tracking,sweep --no-mounts   # the stores' cases (about 8 min)
    .venv/bin/python benchmarks/env_faults.py --cases tracking,sweep --no-mounts --busy 1   # beside a busy CPU
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
from fl_core.store import envfail, faults  # noqa: E402

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
    store_failed: bool = False  # the tracking store itself failed: only the next start can end the runs it holds
    running_after: Optional[int] = None  # MLflow runs RUNNING after the rerun
    trials_left: Optional[int] = None  # Optuna trials RUNNING after the failing command (a sweep)
    trials_after: Optional[int] = None  # ... and after the rerun

    def ok(self) -> bool:
        timely = self.to_exit_s is not None and (self.rank0_exit_s if self.rank0_exit_s is not None
                                                 else self.to_exit_s) <= self.limit_s
        left_ok = not self.left_running or self.store_failed
        return (self.status == self.expect_status and timely and self.lines <= 3 and self.tracebacks == 0
                and left_ok and not self.running_after and not self.trials_after and self.rerun_status == 0
                and self.runs_ok and not self.metrics_lost and not self.leftovers)


@dataclass
class Case:
    name: str
    kind: str  # path | disk | data | dist | tracking | sweep
    run: Callable[["Context"], Outcome]
    needs: Tuple[str, ...] = ()  # "torchrun", "postgres"; "mounts" cases fall back to injected faults without them
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
    rest_s: Optional[float] = None  # the grid reference's seconds from its 1st checkpoint to its exit (this load)


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


def _wait_for_checkpoint(run: Run, folder: Path) -> bool:
    """Poll until the run's first checkpoint of seed 1 exists in ``folder`` (False if the run ended first)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while run.proc.poll() is None and time.monotonic() < deadline:
        if list(folder.glob("*/seed_1.pt")):
            return True
        time.sleep(0.05)
    return False


def _observe(out: Outcome, project: Path, err: str) -> None:
    """What a failing first run left: its stderr lines and tracebacks, its first line, the MLflow runs still RUNNING
    and the temporary files in ``project``."""
    out.lines, out.tracebacks = count(err)
    out.first_line = next((ln for ln in err.splitlines() if ln.strip()), "")
    out.left_running = running(project)
    out.leftovers = temporaries(project)


def _rerun_and_judge(ctx: Context, out: Outcome, chain: "kill.Chain", argv: List[str], name: str = NAME,
                     reference: Optional[str] = "grid", env: Optional[Dict[str, str]] = None,
                     ignore: Tuple[str, ...] = ()) -> None:
    """The same command again (``env``: the environment it keeps, the fault removed): its exit status, then (unless
    ``name`` is empty) experiment ``name``'s runs judged against ``ctx.references[reference]`` and those RUNNING, and
    the leftover files of kill.leftovers not under the folders ``ignore``."""
    out.rerun_status, err, _ = Run(chain, argv, extra_env=env).wait()
    if out.rerun_status != 0:
        out.notes.append(f"{out.case}: rerun exit {out.rerun_status}: {kill.last_line(err)}")
    if name:
        judge_runs(out, chain.project, name, ctx.references.get(reference) if reference else None)
        out.running_after = running(chain.project)
    out.leftovers += [f"after the rerun: {p}" for p in kill.leftovers(chain.project) if not p.startswith(ignore)]


def fail_then_rerun(ctx: Context, label: str, params: Dict, argv: List[str], fault: Optional[str] = None,
                    rerun: Optional[List[str]] = None, reference: Optional[str] = None, name: str = NAME,
                    prepare: Optional[Callable[["kill.Chain"], None]] = None, fault_desc: str = "",
                    nothing_created: bool = False, env: Optional[Dict[str, str]] = None) -> Outcome:
    """The common shape of a case: ``prepare(chain)``, the command with ``fault`` and ``env`` (its first run),
    measures, then ``rerun`` (default: the same command) without them, and the end state. ``nothing_created``: the
    failing command must not create any file (a folder check: no lock file, no MLflow store, no results folder)."""
    chain = kill.Chain(ctx.base, label, params)
    if prepare is not None:
        prepare(chain)
    before = {str(p.relative_to(chain.project)) for p in chain.project.rglob("*")}
    out = Outcome(label, fault_desc or (f"FL_FAULT={fault}" if fault else "real"))
    first = Run(chain, argv, fault, extra_env=env)
    out.status, err, ended = first.wait()
    stamp = first.fault_time()
    out.to_exit_s = ended - (stamp if stamp is not None else first.t0)
    _observe(out, chain.project, err)
    if nothing_created:
        out.leftovers += sorted({str(p.relative_to(chain.project)) for p in chain.project.rglob("*")} - before)
    _rerun_and_judge(ctx, out, chain, rerun or argv, name, reference)
    return out


# --------------------------------------------------------------------------- cases: folders


def _file_at(rel: str) -> Callable[["kill.Chain"], None]:
    def prep(chain: "kill.Chain") -> None:
        (chain.project / rel).write_text("a file where a folder is needed\n")
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
        def prep(chain: "kill.Chain") -> None:
            (chain.project / "ro").mkdir()
            mount(chain.project / "ro", "ro,size=1m")
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
        return Outcome(label, "needs a private mount namespace (root and unshare): not run")
    chain = kill.Chain(ctx.base, label, grid(ctx.rounds, "ck"))
    (chain.project / "ck").mkdir()
    mount(chain.project / "ck", "size=64m")
    out = Outcome(label, "real: tmpfs filled after the 1st checkpoint")
    first = Run(chain, py("pipeline.train", "--grid", NAME))
    filler = chain.project / "ck" / "filler"
    fault_at = fill(filler) if _wait_for_checkpoint(first, chain.project / "ck" / NAME) else None
    out.status, err, ended = first.wait()
    out.to_exit_s = ended - fault_at if fault_at is not None else None
    if fault_at is None:
        out.notes.append(f"{label}: the run ended before its first checkpoint could be seen")
    _observe(out, chain.project, err)
    filler.unlink(missing_ok=True)
    _rerun_and_judge(ctx, out, chain, py("pipeline.train", "--grid", NAME), ignore=("ck/",))
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
    def prep(chain: "kill.Chain") -> None:
        subprocess.run(py("pipeline.train", "--grid", NAME), cwd=chain.project, env=chain.env(), capture_output=True,
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
        _rerun_and_judge(ctx, out, chain, command(), "dist", "dist")
        if (chain.project / "checkpoints" / "dist").exists():
            out.leftovers.append("after the rerun: checkpoints/dist/")
        return out
    run.__doc__ = f"engine.executor=distributed, 2 ranks: rank 1 {action} ({launcher})."
    return run


def _workers(pid: int) -> List[int]:
    """The pids of the sweep workers of ``tune.py`` at ``pid``: its children started by multiprocessing's spawn (not
    its resource tracker), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            cmd = (d / "cmdline").read_text()
        except (OSError, IndexError, ValueError):
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            out.append(int(d.name))
    return sorted(out)


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


# --------------------------------------------------------------------------- cases: the tracking store


def hold_sqlite_lock(db: Path) -> subprocess.Popen:
    """A second process holding an exclusive lock on the SQLite file ``db`` until it is killed (returns once held)."""
    code = ("import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=120)\n"
            "c.execute('BEGIN EXCLUSIVE')\n"
            "print('held', flush=True)\n"
            "time.sleep(3600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "held":
        holder.kill()
        raise RuntimeError(f"could not lock {db}")
    return holder


@case("store_locked", "tracking")
def _store_locked(ctx: Context) -> Outcome:
    """The SQLite store locked by a second process from the 1st checkpoint until the command ends (real lock)."""
    label = "tracking store locked by another process (SQLite)"
    chain = kill.Chain(ctx.base, label, grid(ctx.rounds))
    out = Outcome(label, "real: BEGIN EXCLUSIVE in a second process after the 1st checkpoint, held to the end",
                  store_failed=True)
    argv = py("pipeline.train", "--grid", NAME)
    run = Run(chain, argv)
    holder, fault_at = None, None
    if _wait_for_checkpoint(run, chain.project / "checkpoints" / NAME):
        holder = hold_sqlite_lock(chain.project / "mlflow.db")
        fault_at = time.time()
    try:
        out.status, err, ended = run.wait()
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    if fault_at is None:
        out.notes.append(f"{label}: the run ended before its first checkpoint could be seen")
    else:
        out.to_exit_s = ended - fault_at
    _observe(out, chain.project, err)
    _rerun_and_judge(ctx, out, chain, argv)
    return out


@case("store_missing_folder", "tracking")
def _store_missing_folder(ctx: Context) -> Outcome:
    """MLFLOW_TRACKING_URI=sqlite:/// in a folder that does not exist: refused, nothing created."""
    chain_env: Dict[str, str] = {}  # filled once the project folder exists, read by the first run

    def prep(chain: "kill.Chain") -> None:
        chain_env["MLFLOW_TRACKING_URI"] = f"sqlite:///{chain.project / 'typo' / 'mlflow.db'}"

    return fail_then_rerun(ctx, "sqlite:/// store in a missing folder", grid(ctx.rounds),
                          py("pipeline.train", "--grid", NAME), reference="grid", prepare=prep,
                          fault_desc="real: MLFLOW_TRACKING_URI=sqlite:///.../typo/mlflow.db", nothing_created=True,
                          env=chain_env)


@case("tracking_port_dead", "tracking")
def _tracking_port_dead(ctx: Context) -> Outcome:
    """MLFLOW_TRACKING_URI at a port nothing listens on, with the default retry settings (real)."""
    out = fail_then_rerun(ctx, "tracking server port dead", grid(ctx.rounds), py("pipeline.train", "--grid", NAME),
                          reference="grid", fault_desc="real: MLFLOW_TRACKING_URI=http://127.0.0.1:<free port>",
                          env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{_free_port()}"})
    out.store_failed = True
    return out


SERVER_READY_S = 120.0  # mlflow server's start on 2 loaded cores: 5-15 s


def _mlflow_server(project: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on the project's store (so the campaign reads its runs from mlflow.db), its own group."""
    return subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{project / 'mlflow.db'}", "--artifacts-destination",
                             str(project / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=open(project.parent / "logs" / "server.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})


def _server_ready(port: int, deadline: float) -> bool:
    import urllib.request

    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as res:
                if res.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


@case("tracking_server_restarted", "tracking")
def _tracking_server_restarted(ctx: Context) -> Outcome:
    """mlflow server SIGKILLed after the 1st checkpoint and started again at once; MLflow's retries carry the run."""
    from fl_core.store.tracking import ensure_store

    label = "tracking server killed and restarted"
    chain = kill.Chain(ctx.base, label, grid(ctx.rounds))
    ensure_store(f"sqlite:///{chain.project / 'mlflow.db'}")  # the server's schema, built once beforehand
    port = _free_port()
    server = _mlflow_server(chain.project, port)
    out = Outcome(label, "real: SIGKILL to mlflow server after the 1st checkpoint, started again at once",
                  expect_status=0)
    try:
        if not _server_ready(port, time.monotonic() + SERVER_READY_S):
            out.notes.append(f"{label}: the server did not start")
            return out
        argv = py("pipeline.train", "--grid", NAME)
        env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
        run = Run(chain, argv, extra_env=env)
        fault_at = answered_at = None
        if _wait_for_checkpoint(run, chain.project / "checkpoints" / NAME):
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            fault_at = time.time()
            server = _mlflow_server(chain.project, port)
            answered_at = time.time() if _server_ready(port, time.monotonic() + SERVER_READY_S) else None
            if answered_at is not None:
                out.notes.append(f"{label}: the server answered again {answered_at - fault_at:.1f} s after the kill")
        out.status, err, ended = run.wait()
        if fault_at is None:
            out.notes.append(f"{label}: the run ended before its first checkpoint could be seen")
        else:
            out.to_exit_s = ended - fault_at
            if answered_at is not None:  # what the time to exit is made of: the restart, then the run's own work
                rest = "" if ctx.rest_s is None else (f"; the uninterrupted reference took {ctx.rest_s:.1f} s from its "
                                                      "1st checkpoint to its exit")
                out.notes.append(f"{label}: the run ended {ended - answered_at:.1f} s after the server answered "
                                 f"again{rest}")
        _observe(out, chain.project, err)
        _rerun_and_judge(ctx, out, chain, argv, env=env)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
    return out


# --------------------------------------------------------------------------- cases: PostgreSQL under a sweep

SWEEP_SPACE = """\
description: the learning rate on a small digits run (benchmarks/env_faults.py)
base: [model=mlp, partition=iid, partition.num_clients=3, train.rounds=30, train.local_steps=2, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-3, high: 0.5, log: true}
"""
SWEEP_TRIALS, SWEEP_WORKERS = 12, 2


def _pg():
    """``tests/pg.py``: the throwaway PostgreSQL server of the tests."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import pg

    return pg


def postgres_available() -> bool:
    return _pg().find_bin_dir() is not None


def _wait_for_trials(run: Run, url: str) -> bool:
    """Poll until 2 of the sweep's trials have ended and one runs (False if the sweep ended first)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while run.proc.poll() is None and time.monotonic() < deadline:
        try:
            states = _pg().trial_states(url)
        except Exception:  # noqa: BLE001  (the tables do not exist yet)
            states = {}
        if sum(n for s, n in states.items() if s != "RUNNING") >= 2 and states.get("RUNNING"):
            return True
        time.sleep(0.1)
    return False


def _judge_sweep(out: Outcome, project: Path, url: str) -> None:
    """After the rerun: one MLflow parent of the study, FINISHED; at most one MLflow run per trial; no run and no
    trial RUNNING."""
    states = _pg().trial_states(url)
    out.trials_after = states.get("RUNNING", 0)
    _client, runs = kill.mlflow_runs(project)
    parents = [r for r in runs if r.data.tags.get("sweep_role") == "study"]
    trial_runs = [r.data.tags.get("optuna_trial") for r in runs if r.data.tags.get("sweep_role") == "trial"]
    twice = len(trial_runs) - len(set(trial_runs))
    out.runs_after = (f"{sum(states.values())} trials ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))}); "
                      f"{len(parents)} parent {'/'.join(sorted({r.info.status for r in parents}))}, "
                      f"{len(trial_runs)} trial runs" + (f", {twice} twice" if twice else ""))
    out.runs_ok = len(parents) == 1 and parents[0].info.status == "FINISHED" and not twice
    out.running_after = sum(r.info.status == "RUNNING" for r in runs)


def _sweep_case(action: str):
    def run(ctx: Context) -> Outcome:
        pg = _pg()
        label = {"stop": "PostgreSQL stopped during a sweep", "freeze": "PostgreSQL frozen (SIGSTOP) during a sweep",
                 "restart": "PostgreSQL restarted during a sweep"}[action]
        fault = {"stop": "real: pg_ctl stop -m fast once 2 trials ended", "freeze": "real: SIGSTOP to every server "
                 "process once 2 trials ended", "restart": "real: pg_ctl stop -m fast, then start, once 2 trials "
                 "ended"}[action]
        out = Outcome(label, fault, expect_status=0 if action == "restart" else envfail.EXIT_STATUS)
        chain = kill.Chain(ctx.base, label, {})
        (chain.project / "space.yaml").write_text(SWEEP_SPACE)
        server = pg.PostgresServer(pg.find_bin_dir())
        frozen: List[int] = []
        try:
            server.start()
            url = server.create_database("optuna")

            def command(n: int) -> List[str]:
                return py("sweeps.tune", "--space", "space.yaml", "--storage", url, "--study-name", "s", "--n-trials",
                          str(n), "--workers", str(SWEEP_WORKERS), "--batch", "1", "--no-test", "--quiet", "--out",
                          "out")  # one trial at a time per worker, as the campaign's tables were measured

            first = Run(chain, command(SWEEP_TRIALS))
            fault_at = None
            worker_ends: List[List[float]] = []
            if _wait_for_trials(first, url):
                for pid in _workers(first.proc.pid):  # when each worker ends (a note: where the time goes)
                    worker_ends.append([])
                    threading.Thread(target=_watch_exit, args=(pid, worker_ends[-1]), daemon=True).start()
                fault_at = time.time()  # the fault begins with the command: pg_ctl ends the sessions at once
                if action == "freeze":
                    frozen = server.freeze()
                else:
                    server.halt()
                if time.time() - fault_at > 1.0:
                    out.notes.append(f"{label}: {'the freeze' if action == 'freeze' else 'pg_ctl stop'} took "
                                     f"{time.time() - fault_at:.1f} s (counted: the seconds to exit run from its "
                                     "start)")
                if action == "restart":
                    server.resume()
                    out.notes.append(f"{label}: the server answered again {time.time() - fault_at:.1f} s after the "
                                     "stop")
            out.status, err, ended = first.wait()
            if fault_at is None:
                out.notes.append(f"{label}: the sweep ended before 2 trials had ended and one was running")
            else:
                out.to_exit_s = ended - fault_at
                time.sleep(0.1)  # the watchers' last poll
                ends = [f"{e[0] - fault_at:.1f}" for e in worker_ends if e]
                if ends:
                    out.notes.append(f"{label}: the workers ended {', '.join(ends)} s after the fault, tune.py "
                                     f"{out.to_exit_s:.1f} s")
            out.lines, out.tracebacks = count(err)
            out.first_line = next((ln for ln in err.splitlines() if ln.startswith(("error:", "note:"))), "")
            out.left_running = running(chain.project)
            if frozen:
                server.thaw(frozen)
                frozen = []
            elif action == "stop":
                server.resume()
            out.trials_left = _pg().trial_states(url).get("RUNNING", 0)
            second = Run(chain, command(2))
            out.rerun_status, err2, _ = second.wait()
            if out.rerun_status != 0:
                out.notes.append(f"{label}: rerun exit {out.rerun_status}: {kill.last_line(err2)}")
            _judge_sweep(out, chain.project, url)
        finally:
            if frozen:
                server.thaw(frozen)
            server.stop()
        return out
    run.__doc__ = {"stop": "PostgreSQL (the Optuna storage) stopped during a 2-worker sweep and started after it "
                           "ended (real).",
                   "freeze": "PostgreSQL frozen with SIGSTOP during a 2-worker sweep, thawed after it ended (real).",
                   "restart": "PostgreSQL stopped and started again at once during a 2-worker sweep (real)."}[action]
    return run


case("pg_stopped", "sweep", ("postgres",))(_sweep_case("stop"))
case("pg_frozen", "sweep", ("postgres",))(_sweep_case("freeze"))
case("pg_restarted", "sweep", ("postgres",))(_sweep_case("restart"))


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
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode != 0:
        return
    os.environ[NS_ENV] = "1"
    os.execvp("unshare", ["unshare", "-m", "--propagation", "private", sys.executable, __file__, *argv])


# --------------------------------------------------------------------------- references and the table


def references(ctx: Context, dist: bool, grid_run: bool = True) -> None:
    """Uninterrupted runs whose every (seed, metric, step) a rerun must reproduce."""
    if grid_run:
        chain = kill.Chain(ctx.base, "reference-grid", grid(ctx.rounds))
        run = Run(chain, py("pipeline.train", "--grid", NAME))
        first = time.time() if _wait_for_checkpoint(run, chain.project / "checkpoints" / NAME) else None
        rc, err, ended = run.wait()
        ctx.rest_s = ended - first if first is not None else None
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
SWEEP_COLUMN = "Optuna trials RUNNING: left, after the rerun"  # after "runs left RUNNING" when a sweep case ran


def cells(o: Outcome, sweep: bool = False) -> List[str]:
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
    left = num(o.left_running, "{}") + (" (the failed store's)" if o.left_running and o.store_failed else "")
    rerun = f"{num(o.rerun_status, '{}')}, {o.runs_after}"
    if o.running_after is not None:
        rerun += f", {o.running_after} RUNNING"
    row = [o.case, o.fault, status, exit_s, lines, tbs, left, rerun, num(o.metrics_lost, "{}"), str(len(o.leftovers)),
           "pass" if o.ok() else "FAIL"]
    if sweep:
        row.insert(7, "-" if o.trials_left is None else f"{o.trials_left}, {num(o.trials_after, '{}')}")
    return row


def table(outcomes: List[Outcome]) -> str:
    sweep = any(o.trials_left is not None for o in outcomes)
    header = HEADER[:7] + [SWEEP_COLUMN] + HEADER[7:] if sweep else HEADER
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 4) + "---|---|"]
    rows += ["| " + " | ".join(c.replace("|", "/") for c in cells(o, sweep)) + " |" for o in outcomes]
    return "\n".join(rows)


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


#: one CPU-bound process of --busy: a pure Python spin (one core each) that ends once the campaign (its parent, argv[1])
#: is gone, also when the campaign is killed before it could stop it
BUSY_CODE = ("import os, sys\n"
             "parent = int(sys.argv[1])\n"
             "while os.getppid() == parent:\n"
             "    for _ in range(1000000):\n"
             "        pass\n")


class Busy:
    """``--busy N``: N CPU-bound processes (:data:`BUSY_CODE`, a ``while True: pass``) for the whole campaign, so its
    timings are taken on a loaded machine; they are killed (by pid) at the end. Each runs in a session of its own, as
    another user's job would: with the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``)
    CPU time is shared fairly between sessions first, and the commands under test run in sessions of their own too,
    so N busy processes of the campaign's own session would take CPU time from the campaign only, not from them. A
    thread samples the 1-minute load average every 5 s for the table's header (its maximum)."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY_CODE, str(os.getpid())], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                      for _ in range(n)]
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, float(Path("/proc/loadavg").read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
            if self._stop.wait(5.0):
                return

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="comma-separated case names or kinds (default: all; see --list)")
    p.add_argument("--no-torchrun", action="store_true", help="leave out the torchrun cases")
    p.add_argument("--no-mounts", action="store_true", help="no private mount namespace: injected faults instead")
    p.add_argument("--no-postgres", action="store_true", help="leave out the PostgreSQL cases (a throwaway server "
                   "under a sweep)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the runs (default 8)")
    p.add_argument("--dist-timeout", type=float, default=20.0, help="engine.dist_timeout_s of the torchrun cases "
                   "(default 20)")
    p.add_argument("--busy", type=int, default=0, metavar="N", help="run N CPU-bound processes (python -c 'while "
                   "True: pass') beside the whole campaign, killed at its end: the timings under load (default 0)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary project folders")
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="also write the table here")
    args = p.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:30s} {c.kind:8s} {c.doc}")
        return 0
    if not args.no_mounts:
        enter_namespace(argv)
    wanted = [w for w in args.cases.split(",") if w]
    chosen = [c for c in CASES.values() if (not wanted or c.name in wanted or c.kind in wanted)
              and not (args.no_torchrun and "torchrun" in c.needs)]
    if any("postgres" in c.needs for c in chosen) and (args.no_postgres or not postgres_available()):
        if not args.no_postgres:
            print("note: no PostgreSQL server binaries (/usr/lib/postgresql/*/bin): the sweep cases are left out",
                  file=sys.stderr)
        chosen = [c for c in chosen if "postgres" not in c.needs]
    unknown = [w for w in wanted if w not in CASES and w not in {c.kind for c in CASES.values()}]
    if unknown:
        p.error(f"unknown case {unknown[0]!r} (see --list)")
    ctx = Context(Path(tempfile.mkdtemp(prefix="fl-env-faults-")), args.rounds, args.dist_timeout,
                  mounts_possible() and not args.no_mounts)
    t0 = time.perf_counter()
    code_before, load_before = kill.code_state(), load()
    outcomes: List[Outcome] = []
    busy = Busy(max(0, args.busy))
    try:
        print(f"[{0:7.1f} s] references", file=sys.stderr, flush=True)
        references(ctx, any(c.kind == "dist" for c in chosen), any(c.kind != "sweep" for c in chosen))
        for c in chosen:
            print(f"[{time.perf_counter() - t0:7.1f} s] {c.name} (load {load()})", file=sys.stderr, flush=True)
            outcomes.append(c.run(ctx))
    finally:
        busy.stop()
        for m in reversed(MOUNTED):
            subprocess.run(["umount", "-l", str(m)], capture_output=True, check=False)
        if args.keep:
            print(f"kept: {ctx.base}", file=sys.stderr)
        else:
            shutil.rmtree(ctx.base, ignore_errors=True)
    wall = time.perf_counter() - t0
    load_end = load()
    passed = all(o.ok() for o in outcomes)
    code = f"git {kill.git_head()}, fl_core/ + pipeline/ sources {code_before}"
    if kill.code_state() != code_before:
        code += " (WARNING: the sources changed during the campaign)"
    notes = [n for o in outcomes for n in o.notes]
    notes += [f"{o.case}: first line: {o.first_line[:300]}" for o in outcomes if o.first_line]
    notes += [f"{o.case}: leftover: {', '.join(o.leftovers[:6])}" for o in outcomes if o.leftovers]
    text = "\n".join([
        f"Environment-failure campaign, {_dt.date.today().isoformat()}, {kill.machine()}, "
        f"{args.busy} busy process{'' if args.busy == 1 else 'es'} beside it (--busy), load average "
        f"{load_before} at the start, {load_end} at the end, 1-minute peak {busy.peak:.2f}; OMP_NUM_THREADS=1; "
        f"{args.rounds} rounds, seeds {SEEDS}; "
        f"mounts: {'private namespace (real read-only and full tmpfs)' if ctx.mounts else 'none (injected faults)'}; "
        f"engine.dist_timeout_s={args.dist_timeout:g}; {code}",
        "",
        table(outcomes),
        "",
        *[f"- {n}" for n in notes],
    ])
    return kill.finish_report(text, wall, passed, args.out)


if __name__ == "__main__":
    sys.exit(main())
