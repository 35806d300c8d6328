"""Worker processes of a sweep (``--workers W``): spawned on the shared storage, each running its share of the
trials (:func:`sweeps.runner.optimize`), dying with the process that started them (:func:`die_with_parent`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List

from fl_core import progress
from fl_core.store import envfail, storewait

from .runner import optimize
from .settings import EXIT_INTERRUPTED, Settings
from .storage import open_storage
from .study import quiet_optuna, sampler_and_pruner
from .trials import TrialRunner

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for this process when its parent exits
EXIT_PARENT_GONE = 1  # exit status of a worker whose parent is already gone when it starts


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads; returns the previous value (to restore it)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    return previous


def die_with_parent(parent_pid: int, poll_s: float = 1.0, use_prctl: bool = True) -> str:
    """Make this process end when its parent ``parent_pid`` ends, however it ends (SIGKILL included).

    On Linux the kernel sends this process SIGKILL when the parent exits
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes; strictly when the parent's thread that
    started it exits: start workers from a thread that lives as long as the parent). Where prctl is
    not available (or ``use_prctl`` is False) a daemon thread checks ``os.getppid()`` every
    ``poll_s`` seconds and ends the process with ``os._exit`` once it changed (POSIX reparents an
    orphan; on Windows the id never changes, so nothing ends it there). Either way, a parent
    that died before this call (before the signal was armed) ends this process at once
    (status :data:`EXIT_PARENT_GONE`). Call it first thing in a child's entry point.

    Returns:
        How the parent is watched: ``"prctl"`` or ``"poll"``. Nothing is raised.
    """
    how = "poll"
    if use_prctl and sys.platform.startswith("linux"):
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):  # no libc symbol: poll
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(EXIT_PARENT_GONE)
    if how == "poll":
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(poll_s)
            os._exit(EXIT_PARENT_GONE)

        threading.Thread(target=watch, name="watch-parent", daemon=True).start()
    return how


def _worker_main(settings: Settings, n_trials: int, worker: int, parent_pid: int, failures=None) -> None:
    """Entry point of spawned worker process ``worker`` (1..W) of process ``parent_pid``. An environment failure
    (the storage gone for good, MLflow's store, a stalled database) ends it with one line, ``error: worker <w>:
    <line>``, exit status 3, and a note of it on the queue ``failures`` for the process that started it."""
    die_with_parent(parent_pid)  # first: a worker must not outlive a killed tune.py
    prefix = f"worker {worker}: "
    storewait.set_line_prefix(prefix)

    def report(failure: BaseException) -> None:
        if failures is not None:
            failures.put({"worker": worker, "line": str(failure), "store": getattr(failure, "store", None)})

    storewait.on_stall(report)
    try:
        _work(settings, n_trials, worker)
    except Exception as err:
        failure = envfail.classify(err)
        if failure is None or envfail.debug():
            raise
        report(failure)
        if not failure.quiet:
            print(f"error: {prefix}{failure}", file=sys.stderr, flush=True)
        # The fault path does no more work than it must: the trial's MLflow run is ended and the line is out, so the
        # interpreter's own teardown (garbage, threads, the storage's pool on a dead server) is skipped.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(envfail.EXIT_STATUS)


def _work(settings: Settings, n_trials: int, worker: int) -> None:
    import optuna

    set_threads(settings.threads)
    quiet_optuna()
    tracking = None
    if settings.experiment:
        from fl_core.store.tracking import Tracking

        tracking = Tracking(settings.experiment)
    runner = TrialRunner(settings, tracking, worker)
    study = optuna.load_study(study_name=settings.study_name, storage=open_storage(settings.storage),
                              **sampler_and_pruner(settings, runner.space, worker))
    interrupted = optimize(study, runner, n_trials)
    sys.exit(EXIT_INTERRUPTED if interrupted else 0)


def split_trials(n_trials: int, workers: int) -> List[int]:
    """Per-worker trial counts that add up to ``n_trials``."""
    return [n_trials // workers + (1 if w < n_trials % workers else 0) for w in range(workers)]


def count_finished(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


@dataclass
class WorkersEnd:
    """How the worker processes of :func:`run_workers` ended."""

    interrupted: bool  # Ctrl-C
    errors: int  # workers that ended with an error (a traceback on stderr, or an environment failure)
    failures: List[Dict[str, Any]]  # environment failures, each said in one line: {"worker", "line", "store"}


def run_workers(study, settings: Settings, n_trials: int, workers: int) -> WorkersEnd:
    """Run the trials in ``workers`` spawned processes on the shared storage, with a progress bar in this process
    on a terminal (:func:`fl_core.progress.bar`; a daemon thread polls ``study``; it never blocks this one, and a
    storage that fails only stops the bar). Each worker prints its trial lines to stderr and dies with this process
    (:func:`die_with_parent`), even when it is killed with SIGKILL; an environment failure ends a worker with one
    line of its own."""
    import multiprocessing as mp

    counts = [c for c in split_trials(n_trials, workers) if c > 0]
    start = count_finished(study)
    done = {"n": 0}
    ctx = mp.get_context("spawn")
    failures_queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker_main, args=(settings, c, w + 1, os.getpid(), failures_queue),
                         name=f"sweep-worker-{w + 1}")
             for w, c in enumerate(counts)]
    for p in procs:
        p.start()
    stop = threading.Event()

    def poll() -> None:
        with storewait.unwatched():
            while not stop.wait(0.5):
                try:
                    done["n"] = count_finished(study) - start
                except Exception:  # the storage failed: the workers say so
                    pass

    bar = progress.bar(total=n_trials, unit="trial", desc=settings.study_name, enabled=not settings.quiet)
    if bar is not None:  # a terminal: the bar follows the study's count
        threading.Thread(target=poll, name="sweep-progress", daemon=True).start()
    interrupted = False
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.5)
            if bar is not None:
                bar.n = done["n"]
                bar.refresh()
    except KeyboardInterrupt:  # the workers got the same SIGINT: let them close their trials
        interrupted = True
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    finally:
        for p in procs:
            p.join()
        stop.set()
    failures = []
    while not failures_queue.empty():
        failures.append(failures_queue.get())
    if bar is not None:
        if not failures:  # the storage answers: the final count
            done["n"] = count_finished(study) - start
        bar.n = done["n"]
        bar.close()
    interrupted = interrupted or any(p.exitcode == EXIT_INTERRUPTED for p in procs)
    errors = sum(1 for p in procs if p.exitcode not in (0, EXIT_INTERRUPTED))
    return WorkersEnd(interrupted, errors, failures)
