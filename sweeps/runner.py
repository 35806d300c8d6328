"""The trial loop of a sweep (:func:`optimize`): trials asked, trained and told one at a time, or ``--batch`` K at a
time as one population (:mod:`sweeps.batch`), in this process or in each worker (:mod:`sweeps.workers`).

A trial's value is the validation accuracy (see :mod:`sweeps.spaces` for the overrides a trial runs
with). Each evaluated round reports it with ``step = seed_index * rounds + round`` so that a pruner
compares trials at the same seed and round. How a trial ends (:class:`~sweeps.trials.TrialRunner`):

- COMPLETE: every seed trained;
- PRUNED, reason "pruned: ...": the pruner stopped it;
- PRUNED, reason "diverged: ...": the loss became non-finite (``RunFailed``);
- PRUNED, reason "infeasible: ...": the sampled combination does not compose or build
  (``ConfigError`` / ``ValueError`` naming a key), or a rule rejects it while running
  (:class:`fl_core.algorithms.InfeasibleSetting`, e.g. FedBug's code schedule with P*K_i < M);
- FAIL, reason "error: <exception>": any other exception while training (the study continues);
- FAIL, reason "storage lost: ...": the storage went away during the trial and came back (:func:`optimize`);
- FAIL, reason "interrupted (Ctrl-C)"; FAIL, reason "stale: ..." (:func:`~sweeps.storage.fail_stale_trials`: its
  process on this machine is gone; :func:`~sweeps.storage.fail_silent_trials`: no Optuna heartbeat for
  :data:`~sweeps.storage.GRACE_S` s, any machine).

An environment failure (:mod:`fl_core.store.envfail`: the storage gone for good or not answering, MLflow's store, the disk)
is not a property of the trial: the sweep stops with one line (:func:`optimize`, :func:`sweeps.workers.run_workers`).

Processes killed hard: spawned workers die with the process that started them
(:func:`sweeps.workers.die_with_parent`); every MLflow run of a sweep records its process
(:func:`sweeps.storage.owner_tags`) and the next invocation ends the runs whose process is gone
(:func:`sweeps.storage.end_orphaned_runs`).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable, Optional

from fl_core.store import envfail

from .batch import optimize_batch
from .storage import fail_silent_trials, heartbeat, note_outage, storage_back, storage_call, storage_failure
from .trials import Outcome, TrialRunner, error_reason, tell_outcome, trial_line


def optimize(study, runner: TrialRunner, n_trials: int, on_trial: Optional[Callable[[str], None]] = None) -> bool:
    """Run up to ``n_trials`` trials of ``study`` in this process (fewer if ``settings.timeout`` passes), one at a
    time, or ``settings.batch`` at a time as one population (:mod:`sweeps.batch`, the same outcomes and guarantees).

    Trials are asked and told explicitly, so every outcome is recorded as designed (see the module
    docstring) and Ctrl-C leaves the running trial FAIL (user attribute ``reason``) with its MLflow
    run KILLED. ``on_trial`` receives each trial's progress line (default: stderr unless quiet). Before each trial
    the trials of lost processes are marked FAIL (:func:`fail_silent_trials`), and the running trial keeps its
    heartbeat (:func:`heartbeat`).

    The storage going away (a PostgreSQL restart) costs the trial that was running: the sweep waits for the storage
    (:func:`wait_for_storage`), marks that trial FAIL with reason ``storage lost: ...`` (its MLflow run FAILED), says
    so in one line and goes on.

    Returns:
        True if interrupted by Ctrl-C, else False.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: the storage did not come back within ``FL_DB_RETRY_S``; the running trial
            stays RUNNING in it until its heartbeat is stale (the next invocation, or another process, marks it
            FAIL).
        Exception: another error outside a trial's training (MLflow, a bug); the running trial is told FAIL first.
    """
    from optuna.trial import TrialState

    settings = runner.settings
    who = f"w{runner.worker} " if runner.worker else ""
    if on_trial is None:
        def on_trial(line: str) -> None:
            if not settings.quiet:
                print(line, file=sys.stderr, flush=True)

    if settings.batch > 1:
        return optimize_batch(study, runner, n_trials, on_trial)
    deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
    trial = None
    try:
        for _ in range(n_trials):
            if deadline is not None and time.monotonic() >= deadline:
                break
            storage_call(settings, lambda: fail_silent_trials(study))
            trial = storage_call(settings, study.ask)
            t0 = time.perf_counter()
            try:
                with heartbeat(study, trial, functools.partial(note_outage, settings)):
                    outcome = runner(trial)
            except Exception as err:
                failure = storage_failure(err, settings)
                if failure is None:
                    raise
                outcome = Outcome("FAIL", reason=storage_back(settings, failure, f"{who}trial {trial.number}"))
                storage_call(settings, functools.partial(trial.set_user_attr, "reason", outcome.reason))
            tell_outcome(study, trial, outcome, settings, who)
            line = trial_line(trial.number, outcome, trial.params, time.perf_counter() - t0, runner.worker)
            trial = None
            on_trial(line)
    except KeyboardInterrupt:
        if trial is not None:
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return True
    except BaseException as err:  # the trial must not stay RUNNING in the storage
        if trial is not None and storage_failure(err, settings) is None:  # (it cannot be told a failed storage)
            failure = envfail.classify(err)
            trial.set_user_attr("reason", f"environment failure: {failure}" if failure else error_reason(err)[0])
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        raise
    return False

