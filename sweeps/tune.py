"""Optuna sweeps over the FL pipeline: ``python sweeps/tune.py --space NAME --n-trials N [OVERRIDES]``.

One trial = one configuration sampled from a search space (``sweeps/spaces/<name>.yaml``, schema in
:mod:`sweeps.spaces`), trained for ``--seeds K`` seeds (``seed=1..K``) on the digits default or any
experiment given by Hydra overrides. The objective is the validation accuracy: with
``dataset.validation_fraction=0.2`` the core holds out a stratified 20 % of the training set and
every ``test_*`` metric of the simulator is measured on it (logged here as ``val_*``). A trial's
value is the mean over seeds of the mean of the last ``train.final_window`` evaluations. The test
set is touched once, at the end: the best configuration is retrained with
``dataset.validation_fraction=0`` and its test accuracy reported as ``best_test_acc``.

The sweep fixes ``dataset.validation_fraction``, ``seed`` and the trial settings
(:data:`sweeps.spaces.TRIAL_FIXED`); a command-line override or a space that sets one is refused.

Modules: :mod:`sweeps.spaces` (search spaces, overrides), :mod:`sweeps.runner` (storage, sampler,
pruner, trials, workers; how a trial ends), :mod:`sweeps.outputs` (MLflow parent run, test run,
``best.yaml``, summary, ``trials.csv``, plots). Documentation: ``docs/sweeps.md``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import List, NoReturn, Optional, Tuple

if __package__ in (None, ""):  # run as a script (python sweeps/tune.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fl_core import progress
from fl_core.store import envfail, storefail, storewait
from fl_core.paths import project_root
from sweeps.runner import optimize
from sweeps.settings import EXIT_INTERRUPTED, OBJECTIVES, SAMPLERS, Settings
from sweeps.storage import (GRACE_S, StorageError, default_storage, end_orphaned_runs, fail_silent_trials,
                            fail_stale_trials, is_url, open_storage, setup_lock, shown_storage, storage_call)
from sweeps.study import label_study, parse_pruner, quiet_optuna, sampler_and_pruner
from sweeps.trials import DataCache, TrialRunner, error_reason
from sweeps.workers import run_workers, set_threads
from sweeps.batch import auto_batch, parse_batch
from sweeps.spaces import SpaceError, check_space, load_space, override_key, space_names


_EPILOG = ("Examples:\n"
           "  python sweeps/tune.py --space SPACE --n-trials 20   (SPACE: a file of sweeps/spaces/ or a YAML path)\n"
           "  python sweeps/tune.py --space cross --n-trials 60 --workers 2 --objectives acc,uplink\n"
           "  python sweeps/tune.py --space lr --n-trials 16 --batch 8   (8 trials at a time, one population)\n"
           "  python sweeps/tune.py --space lr --n-trials 30 --seeds 3 partition.alpha=0.1 train.rounds=40\n"
           "The sweep fixes dataset.validation_fraction, seed, engine.checkpoint_every, engine.progress and\n"
           "tracking.enabled (overriding them is refused). See docs/sweeps.md.")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors end in one line, ``error: <what>`` naming the option and what it takes, and
    exit status 2 (no usage block: ``--help`` shows it, as ever)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {_one_line(message)}\n")


_TYPES = {"int": "an integer", "float": "a number"}


def _one_line(message: str) -> str:
    """argparse's error ``message`` as the project's other errors read: ``--sampler must be one of tpe, cmaes, gp,
    random, nsga2, got 'bogus'``, ``--n-trials must be an integer, got 'x'``; others as argparse says them."""
    message = " ".join(message.split())
    found = re.fullmatch(r"argument (\S+): invalid choice: (.+?) \(choose from (.+)\)", message)
    if found:
        option, value, choices = found.groups()
        allowed = ", ".join(c.strip().strip("'\"") for c in choices.split(","))
        return f"{option.split('/')[0]} must be one of {allowed}, got {value}"
    found = re.fullmatch(r"argument (\S+): invalid (\w+) value: (.+)", message)
    if found:
        option, kind, value = found.groups()
        return f"{option.split('/')[0]} must be {_TYPES.get(kind, 'a ' + kind)}, got {value}"
    found = re.fullmatch(r"argument (\S+): (.+)", message)
    if found:
        return f"{found.group(1).split('/')[0]}: {found.group(2)} (see --help)"
    return f"{message} (see --help)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python sweeps/tune.py",
        description="Optuna sweep over the FL pipeline: validation accuracy (mean of the last "
                    "train.final_window rounds, mean over --seeds) per trial, per-round pruning, parallel "
                    "workers, MLflow (a parent run per study, a nested run per trial). Running the same "
                    "command again resumes the study. Options and KEY=VALUE overrides may come in any order.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", required=True, help=f"search space: a name ({', '.join(space_names())}) or a YAML file")
    p.add_argument("--n-trials", type=int, required=True, metavar="N",
                   help="trials to add in this invocation (over all workers; 0: only rewrite the outputs)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop starting trials after S seconds (per worker)")
    p.add_argument("--workers", type=int, default=1, metavar="W",
                   help="parallel worker processes (default 1: trials run in this process)")
    p.add_argument("--batch", default="auto", metavar="K|auto",
                   help="trials each worker trains at once as one population (one vectorised pass per round over "
                        "every trial's seeds; trials that differ in more than eta_l, the weight decay, eta_g and the "
                        "rules' replica parameters train in separate passes). auto (default): the fewest trials (of 1, 2, 4, "
                        "8, 16, within the device's memory and --n-trials) whose round the timing probe predicts "
                        "within 10%% of the fastest per trial; 1: one trial at a time. With K > 1 the trials "
                        "train on engine.executor=auto unless the overrides name vectorized")
    p.add_argument("--storage", default=None, metavar="PATH|URL",
                   help="journal file (default sweeps/studies/<study>.log) or an RDB URL for many machines, "
                        "e.g. postgresql+psycopg://user@host/db (psycopg 3 is installed with the project; "
                        "postgresql+psycopg2:// needs pip install psycopg2-binary, mysql+pymysql:// pip install "
                        "pymysql); sqlite:/// works as is. Run the same command on every machine: see "
                        "docs/scaling.md")
    p.add_argument("--study-name", default=None, metavar="NAME", help="default: the space's name")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="default tpe (multivariate, constant liar)")
    p.add_argument("--sampler-seed", type=int, default=None, metavar="S",
                   help="seed of the sampler: with --workers 1 the sampler uses S; with --workers W > 1 "
                        "worker w = 1..W uses S + w")
    p.add_argument("--pruner", default=None, metavar="{median,hyperband,none,threshold:X}",
                   help="default median; threshold:X prunes when validation accuracy < X; "
                        "multi-objective studies never prune")
    p.add_argument("--seeds", type=int, default=1, metavar="K", help="run seeds 1..K per trial (default 1)")
    p.add_argument("--objectives", default="acc", metavar="acc[,uplink]",
                   help="acc (maximise validation accuracy) or acc,uplink (also minimise cumulative uplink "
                        "floats per client in units of d: Pareto front)")
    p.add_argument("--out", default=None, metavar="DIR", help="outputs (default sweeps/results/<study>/)")
    p.add_argument("--experiment", default=None,
                   help="MLflow experiment (default: tracking.experiment + '-sweeps')")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--no-test", action="store_true", help="do not retrain the best configuration on the test set "
                                                          "(a test accuracy measured earlier is still reported)")
    p.add_argument("--fail-stale", action=argparse.BooleanOptionalAction, default=None,
                   help="before starting, mark FAIL (reason 'stale: ...') the RUNNING trials whose process on "
                        "this machine is gone (e.g. killed); default: on for a journal file, off for an RDB URL")
    p.add_argument("--threads", type=int, default=1, metavar="T", help="torch threads per worker (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr: no bar, no per-trial lines, "
                   "no study and outputs lines (notes, warnings and errors remain; the summary goes to stdout)")
    p.add_argument("--debug", action="store_true", help="an environment failure (a folder not writable, a full "
                   "disk, the storage or MLflow's store locked or gone) shows its traceback instead of one line and "
                   "exit status 3 (also FL_DEBUG=1)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides of the base experiment, e.g. train.rounds=30 partition=iid")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run a sweep. Exit status: 0 done, 2 bad arguments/space/config/storage (one line, nothing run),
    130 interrupted, 1 an error stopped the sweep or a worker (the outputs of the trials done are
    written), 3 an environment failure (a folder not writable, a full disk, the storage gone for longer than
    ``FL_DB_RETRY_S`` or not answering, MLflow's store locked or unreachable: one line, with ``--workers`` one per
    worker, :func:`fl_core.store.envfail.run_cli`; the MLflow parent run ends FAILED where MLflow answers, and the next
    invocation writes the outputs; ``--debug`` or ``FL_DEBUG=1``: the traceback)."""
    from fl_core.store import envfail

    return envfail.run_cli(_exit_status, argv)


def _exit_status(argv: List[str]) -> int:
    try:
        return _main(argv)
    except SystemExit as stop:  # argparse and pipeline.common.fail (one-line errors)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)


def _main(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    t_start = time.perf_counter()
    objectives = _check_args(args)
    space, base_cfg = _load_space(args)
    if len(objectives) > 1 and args.pruner not in (None, "none"):
        print("note: multi-objective studies cannot prune; --pruner ignored", file=sys.stderr)
    settings = _settings(args, space, base_cfg, objectives)
    out = Path(args.out) if args.out else project_root() / "sweeps" / "results" / settings.study_name
    _check_out(out)
    kwargs, cache = _sampler_and_data(settings, space, base_cfg)
    executor = _batch_executor(args, space)
    study, tracking = _set_up(args, settings, space, kwargs)
    previous_threads = set_threads(settings.threads)  # the probes of --batch auto time the trials' threads
    forget = storewait.on_stall(lambda failure: _end_parent_on(failure, settings, tracking))
    try:
        why = _resolve_batch(args, settings, space, cache, executor)  # after the storage: its errors come first
        if tracking is not None and settings.parent_run_id:
            tracking.client.set_tag(settings.parent_run_id, "batch", str(settings.batch))
        if not args.quiet:
            print(f"study {settings.study_name!r}: {len(study.trials)} trial(s) so far in "
                  f"{shown_storage(settings.storage)}; space {space.name} ({', '.join(space.keys())}); --batch "
                  f"{settings.batch} ({why})", file=sys.stderr)
        status, error, failure = _run_trials(args, study, settings, tracking, cache)
        if failure is not None:  # one line (per worker), no outputs: the storage or MLflow may be what failed
            _end_parent_on(failure, settings, tracking)
            raise failure
        if error:
            print(f"error: {error}; writing the outputs of the trials done", file=sys.stderr)
        status = _finish_sweep(args, study, settings, space, out, t_start, status, error, tracking)
    finally:
        forget()
        set_threads(previous_threads)
    return {"finished": 0, "interrupted": EXIT_INTERRUPTED}.get(status, 1)


def _batch_executor(args: argparse.Namespace, space) -> Optional[str]:
    """The ``engine.executor`` the overrides or the space's base name (None: none). ``--batch`` K > 1 with one that
    cannot train a population: one line, exit 2, before anything runs."""
    from pipeline.common import fail

    named = [o.split("=", 1)[1] for o in [*space.base, *args.overrides] if override_key(o) == "engine.executor"]
    executor = named[-1] if named else None
    if args.batch_k is not None and args.batch_k > 1 and executor not in (None, "auto", "vectorized"):
        fail(f"--batch {args.batch_k} trains trials together on the vectorised executor; engine.executor={executor} "
             "trains them one at a time: drop it (the batch uses engine.executor=auto) or use --batch 1")
    return executor


def _resolve_batch(args: argparse.Namespace, settings: Settings, space, cache, executor: Optional[str]) -> str:
    """``settings.batch`` from ``--batch`` (``auto``: :func:`sweeps.batch.auto_batch`, K at most the trials a worker
    runs) and why, in words."""
    if args.batch_k is not None:
        settings.batch = args.batch_k
        return "one trial at a time" if args.batch_k == 1 else "as given"
    if executor not in (None, "auto", "vectorized"):
        settings.batch = 1
        return f"auto: 1, engine.executor={executor} trains one trial at a time"
    settings.batch, why = auto_batch(space, settings, cache, -(-args.n_trials // args.workers))
    return why


def _check_out(out: Path) -> None:
    """Refuse, in one line and exit 2, an output folder that holds files a sweep does not write (a folder of the user's:
    :mod:`fl_core.store.owned`), before the study or any trial starts."""
    from fl_core.store import owned
    from pipeline.common import fail
    from sweeps.outputs import OUTPUT_FILES

    try:
        owned.check(out, owned.with_temporaries(OUTPUT_FILES), "sweep output folder", "choose another --out")
    except owned.ForeignFolder as err:
        fail(str(err))


def _end_parent_on(failure, settings: Settings, tracking) -> None:
    """After an environment failure: end the study's MLflow parent run FAILED with ``fl.end_reason`` ``environment
    failure: <line>`` (best effort; not when MLflow's own store is what failed: the next invocation reopens it)."""
    from fl_core.store.tracking import ENV_FAILURE

    if tracking is None or not settings.parent_run_id:
        return
    store = getattr(failure, "store", None)
    if store and storefail.identity(store) == storefail.identity(tracking.uri):
        return
    try:
        tracking.end_parent(settings.parent_run_id, "FAILED", f"{ENV_FAILURE}{failure}")
    except Exception:  # noqa: BLE001  (then the next invocation ends it as an orphan)
        pass


def _check_args(args: argparse.Namespace) -> List[str]:
    """The objectives of ``--objectives`` (e.g. ["acc", "uplink"]) once the overrides and numeric options are
    valid; else one line on stderr and exit 2."""
    from pipeline.common import fail

    bad = [o for o in args.overrides if "=" not in o and not o.startswith("~")]
    if bad:
        fail(f"{bad[0]!r} is not a KEY=VALUE override (see --help)")
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if "acc" not in objectives or set(objectives) - set(OBJECTIVES) or len(set(objectives)) != len(objectives):
        fail(f"--objectives must be acc or acc,uplink, got {args.objectives!r}")
    for name, value, lo in (("--n-trials", args.n_trials, 0), ("--workers", args.workers, 1),
                            ("--seeds", args.seeds, 1), ("--threads", args.threads, 1)):
        if value < lo:
            fail(f"{name} must be >= {lo}, got {value}")
    if args.timeout is not None and args.timeout <= 0:
        fail(f"--timeout must be > 0, got {args.timeout:g}")
    try:
        args.batch_k = parse_batch(args.batch)
    except ValueError as err:
        fail(str(err))
    return objectives


def _load_space(args: argparse.Namespace):
    """(the search space, the base experiment's composed config with the overrides), ``--pruner`` checked;
    a bad pruner, space or override: one line on stderr and exit 2."""
    from pipeline.common import fail

    try:
        if args.pruner is not None:
            parse_pruner(args.pruner)
        space = load_space(args.space)
        base_cfg = check_space(space, args.overrides)
    except (SpaceError, ValueError) as err:
        fail(str(err))
    return space, base_cfg


def _settings(args: argparse.Namespace, space, base_cfg, objectives: List[str]) -> Settings:
    """The sweep's :class:`Settings` from the command line, the space and the base config."""
    study_name = args.study_name or space.name
    return Settings(space=str(space.path.resolve()), overrides=list(args.overrides),
                    seeds=list(range(1, args.seeds + 1)), objectives=objectives, study_name=study_name,
                    storage=args.storage or default_storage(study_name), rounds=int(base_cfg.train.rounds),
                    final_window=int(base_cfg.train.final_window),
                    sampler=args.sampler, sampler_seed=args.sampler_seed, pruner=args.pruner or "median",
                    experiment=None if args.no_mlflow else (args.experiment or
                                                           f"{base_cfg.tracking.experiment}-sweeps"),
                    threads=args.threads, timeout=args.timeout, quiet=args.quiet)


def _sampler_and_data(settings: Settings, space, base_cfg):
    """(the ``sampler`` / ``pruner`` keyword arguments of the study, the process's :class:`DataCache` holding the
    base config's data). A bad sampler or missing data: one line on stderr and exit 2."""
    from pipeline.common import fail

    quiet_optuna()
    try:
        kwargs = sampler_and_pruner(settings, space)
        cache = DataCache()
        cache.get(base_cfg)  # missing data files stop the sweep here, with one line
    except (ValueError, RuntimeError) as err:
        fail(str(err).strip().splitlines()[0])
    return kwargs, cache


def _set_up(args: argparse.Namespace, settings: Settings, space, kwargs):
    """(the study, the MLflow :class:`~fl_core.store.tracking.Tracking` or None): under the storage's setup lock
    (:func:`sweeps.storage.setup_lock`: one process at a time, on any machine) open the storage, create or load
    the study, check its signature, mark stale trials FAIL (``--fail-stale``), end orphaned MLflow runs and
    create or reopen the parent run (``settings.parent_run_id``). A storage failure, a lock held too long or
    another signature: one line on stderr and exit 2."""
    from pipeline.common import fail

    with ExitStack() as setup:
        try:
            setup.enter_context(setup_lock(settings.storage, on_wait=_note))
        except StorageError as err:
            fail(str(err))
        study = _open_study(settings, kwargs)
        _check_signature(study, settings, space)
        label_study(study, settings, space)  # objective names and what the dashboard's first screen shows
        if args.fail_stale if args.fail_stale is not None else not is_url(settings.storage):
            _fail_stale(study)
        _fail_silent(study)
        tracking = None
        if settings.experiment:
            from fl_core.store.tracking import Tracking

            tracking = Tracking(settings.experiment)
            _end_orphaned_runs(tracking)
        from sweeps.outputs import ensure_parent_run

        settings.parent_run_id = ensure_parent_run(study, settings, space, tracking)
    return study, tracking


def _open_study(settings: Settings, kwargs):
    """The Optuna study, created or loaded from ``settings.storage`` (call it under :func:`setup_lock`). A storage
    failure: one line naming ``--storage`` on stderr and exit 2."""
    import optuna

    from pipeline.common import fail

    try:
        storage = open_storage(settings.storage)
        return optuna.create_study(study_name=settings.study_name, storage=storage,
                                   directions=settings.directions(), load_if_exists=True, **kwargs)
    except StorageError as err:
        fail(str(err))
    except Exception as err:  # the storage failed after opening (e.g. the server went away)
        failure = envfail.classify(err)
        if failure is not None:
            raise failure from err
        first = storefail.redact(envfail.first_line(err), settings.storage)  # a message may quote the URL
        fail(f"--storage {shown_storage(settings.storage)}: {type(err).__name__}: {first}")


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


def _check_signature(study, settings: Settings, space) -> None:
    """Record the settings that define the study (space, base, overrides, seeds, objectives) in a new study;
    an existing study created with other settings: one line on stderr and exit 2."""
    from pipeline.common import fail

    signature = {"space": space.name, "base": space.base, "overrides": settings.overrides, "seeds": settings.seeds,
                 "objectives": settings.objectives}
    old = study.user_attrs.get("signature")
    if old is None:
        study.set_user_attr("signature", signature)
    elif old != signature:
        diff = next(k for k in signature if old.get(k) != signature[k])
        fail(f"study {settings.study_name!r} in {shown_storage(settings.storage)} was created with "
             f"{diff}={old.get(diff)!r}; this command has {signature[diff]!r}: use another --study-name or the same "
             "settings")


def _fail_silent(study) -> None:
    """Mark FAIL the trials whose Optuna heartbeat stopped (:func:`sweeps.storage.fail_silent_trials`: an RDB storage;
    any machine), with one line on stderr."""
    failed = fail_silent_trials(study)
    if failed:
        print(f"note: trial(s) {', '.join(map(str, failed))} had no heartbeat for over {GRACE_S} s (their process or "
              "machine is gone): marked FAIL (stale)", file=sys.stderr)


def _fail_stale(study) -> None:
    """Mark FAIL the trials left RUNNING by a process that is gone (:func:`sweeps.storage.fail_stale_trials`),
    with one line on stderr."""
    stale = fail_stale_trials(study)
    if stale:
        print(f"note: trial(s) {', '.join(map(str, stale))} were left RUNNING by a process that is gone: "
              "marked FAIL (stale)", file=sys.stderr)


def _run_trials(args: argparse.Namespace, study, settings: Settings, tracking,
                cache: DataCache) -> Tuple[str, Optional[str], Optional[envfail.EnvironmentFailure]]:
    """Run ``--n-trials`` trials, in this process or in ``--workers`` processes; (status: finished |
    interrupted | failed, the error or None, the environment failure or None: quiet when every worker that failed
    said its own line). Ctrl-C and errors end the trials, not the sweep."""
    error = None
    try:
        if args.workers == 1:
            interrupted = _run_in_process(study, TrialRunner(settings, tracking, 0, cache), args.n_trials)
        else:
            end = run_workers(study, settings, args.n_trials, args.workers)
            interrupted = end.interrupted
            if end.failures:
                lines = "; ".join(f"worker {f['worker']}: {f['line']}" for f in end.failures)
                first = end.failures[0]
                return "failed", None, envfail.EnvironmentFailure(
                    f"{len(end.failures)} worker(s) of the sweep", f"stopped ({lines})", "see their lines above",
                    quiet=len(end.failures) == end.errors, store=first["store"])
            if end.errors:
                error = f"{end.errors} worker process(es) ended with an error (traceback above)"
        return ("failed" if error else "interrupted" if interrupted else "finished"), error, None
    except KeyboardInterrupt:
        return "interrupted", error, None
    except Exception as err:  # an environment failure: one line; a bug: keep what is done
        failure = envfail.classify(err)
        if failure is not None and not envfail.debug():
            return "failed", None, failure
        traceback.print_exc()
        reason, where = error_reason(err)
        reason = storefail.redact(reason, settings.storage, tracking.uri if tracking is not None else None)
        return "failed", f"{reason.removeprefix('error: ')} (at {where})", None


def _finish_sweep(args: argparse.Namespace, study, settings: Settings, space, out: Path, t_start: float,
                  status: str, error: Optional[str], tracking) -> str:
    """Write the outputs of the trials done (:func:`sweeps.outputs.finish_study`); returns the final status.
    Ctrl-C while writing: written again without a test run; an error: the parent run is ended FAILED."""
    from sweeps.outputs import finish_study

    try:
        storage_call(settings, lambda: fail_silent_trials(study))  # not left RUNNING by a lost worker
        _, status = finish_study(study, settings, space, out, t_start, status=status,
                                 run_test=not args.no_test, tracking=tracking, error=error)
    except KeyboardInterrupt:  # while writing the outputs: write them again, without a test run
        _, status = finish_study(study, settings, space, out, t_start, status="interrupted", run_test=False,
                                 tracking=tracking, error=error)
    except Exception as err:  # the trials stay in the study; end the parent run so that it does not stay RUNNING
        failure = envfail.classify(err)
        if failure is not None and not envfail.debug():
            _end_parent_on(failure, settings, tracking)
            raise failure from err
        traceback.print_exc()
        print(f"error: writing the outputs failed (above); the trials are kept in "
              f"{shown_storage(settings.storage)}: run with --n-trials 0 to write them again", file=sys.stderr)
        if tracking is not None and settings.parent_run_id:
            tracking.end_parent(settings.parent_run_id, "FAILED")
        status = "failed"
    return status


def _end_orphaned_runs(tracking) -> None:
    """Before any run is created: end the MLflow runs a killed process of this machine left RUNNING
    (:func:`sweeps.storage.end_orphaned_runs`), with one line on stderr; a failure is only reported."""
    try:
        ended = end_orphaned_runs(tracking.client, tracking.experiment_id)
    except Exception as err:  # housekeeping: the sweep itself may still work
        first = storefail.redact((str(err).strip().splitlines() or [''])[0], tracking.uri)
        print(f"warning: MLflow: could not look for orphaned runs ({type(err).__name__}: {first})", file=sys.stderr)
        return
    if ended:
        print(f"note: ended {len(ended)} MLflow run(s) left RUNNING on this machine by a process that is gone "
              "(status KILLED, tag fl.end_reason)", file=sys.stderr)


def _run_in_process(study, runner: TrialRunner, n_trials: int) -> bool:
    """The trials in this process (``--workers 1``), with a progress bar on a terminal (:func:`fl_core.progress.bar`;
    elsewhere, e.g. a log file, the trial lines only); True if interrupted."""
    bar = progress.bar(total=n_trials, unit="trial", desc=runner.settings.study_name,
                       enabled=not runner.settings.quiet and n_trials > 0)
    if bar is None:  # quiet, nothing to run, or not a terminal: optimize prints the trial lines unless quiet
        return optimize(study, runner, n_trials)

    def on_trial(line: str) -> None:
        bar.write(line, file=sys.stderr)
        bar.update(1)

    try:
        return optimize(study, runner, n_trials, on_trial=on_trial)
    finally:
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
