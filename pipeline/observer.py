"""One run of an experiment, exactly once per (name, config, seed): the checked inputs, the experiment's store and
writer lock, its MLflow parent, the seeds it observes while :class:`pipeline.experiment.ExperimentRunner` trains them
(progress, callbacks, each seed's completion record), and what it publishes (:mod:`pipeline.publish`).
:func:`run_experiment` runs one experiment, :func:`run_experiments` several as one population; the command line is
:mod:`pipeline.train`."""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from fl_core import progress
from fl_core.config import ConfigError, to_container
from fl_core.experiment import resolve
from fl_core.metrics import summarize_run
from fl_core.paths import project_root
from fl_core.store import envfail, faults
from fl_core.store.owned import ForeignFolder
from fl_core.store.runstore import ExperimentBusy, ExperimentStore, read_results
from fl_core.store.tracking import Tracking, check_store, dvc_experiment_tags, git_commit

from .experiment import ExperimentRunner, Observer
from .publish import Publishing, write_schedule


def objective_cache(cfg) -> Path:
    """Where a model caches what it computes from the training data (``FLModel.bind_training_data``: logreg_binary's
    reference optimum): ``<data_dir>/objectives/`` (left out of the DVC dependencies by ``.dvcignore``)."""
    return Path(cfg.data_dir) / "objectives"


class Interrupted(Exception):
    """Ctrl-C or SIGTERM during training; ``round`` is the round that was in progress."""

    def __init__(self, round_: int):
        super().__init__(f"interrupted at round {round_}")
        self.round = round_


class _Progress:
    """One progress bar per experiment (rounds x seeds), opened at the first seed that trains so that it
    starts at the rounds already done (finished seeds, the resumed seed's checkpoint); drawn on a terminal only
    (:mod:`fl_core.progress`)."""

    def __init__(self, name: str, total: int, enabled: bool):
        self.name, self.total, self.enabled = name, total, enabled
        self.bar = None  # None off a terminal (fl_core.progress.bar)
        self.opened = False
        self.done = 0  # rounds done before the bar opened
        self.last_round = 0  # last round completed by the seed in training

    def skip(self, n: int) -> None:
        """Count ``n`` rounds that need no training (a seed read from its completion record)."""
        if self.bar is not None:
            self.bar.update(n)
        else:
            self.done += n

    def start(self, seed: int, resumed_from: int) -> None:
        """A seed starts training at round ``resumed_from + 1``; says so when it resumes."""
        self.last_round = resumed_from
        if resumed_from:
            print(f"{self.name} seed {seed}: resumed from round {resumed_from}", file=sys.stderr)
        if self.bar is None and not self.opened:
            self.opened = True
            self.bar = progress.bar(total=self.total, initial=self.done + resumed_from, desc=self.name, unit="round",
                                    enabled=self.enabled)
        elif self.bar is not None:
            self.bar.update(resumed_from)

    def __call__(self, r: int, row: Dict) -> None:
        self.last_round = r
        if self.bar is not None:
            self.bar.update(1)
            if "test_acc" in row:
                self.bar.set_postfix(acc=f"{row['test_acc']:.3f}", loss=f"{row['train_loss']:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_gc_paused = False  # the command's start-up runs without the cyclic garbage collector (end_startup)


def pause_startup() -> None:
    """Start a command (``fl-train`` as a process) with the cyclic garbage collector off until :func:`end_startup`."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def end_startup() -> None:
    """End the start-up of a command (:func:`pipeline.train.main` without ``argv``): move every object allocated so far (the
    modules of torch, MLflow, matplotlib, the data) to the collector's permanent generation and switch the collector
    on again. Called when the first seed starts training, when a worker rank starts serving, and when the command
    ends; a no-op otherwise. Collections while the start-up imports ran traversed every object imported so far, again
    and again: about a fifth of the start-up's CPU time on two cores."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


class ExperimentRun(Publishing, Observer):
    """One run of :func:`run_experiment`: the checked inputs, the store, the MLflow parent, the outputs. It observes
    the seeds the :class:`~pipeline.experiment.ExperimentRunner` trains: their MLflow child runs, progress, callbacks,
    and each seed's completion record, files and child run as soon as it ends."""

    def __init__(self, cfgs: List, callbacks: Optional[list], replace: bool = True, adhoc: bool = False,
                 on_round: Optional[Callable] = None, inputs=None):
        from fl_core.engine.diagnostics import effective_update

        self.cfgs, self.cfg0 = cfgs, cfgs[0]
        self.replace = replace  # False: refuse a results/<name>/ that holds another config's results
        self.adhoc = adhoc  # a run outside the grid: its results/<name>/ carries a .gitignore of its own
        cfg0 = self.cfg0
        # the folders this run writes to, before any data is read or lock taken (fl_core.store.envfail)
        envfail.check_folder(cfg0.results_dir, "results folder", "results_dir")
        envfail.check_folder(cfg0.engine.checkpoint_dir, "checkpoint folder", "engine.checkpoint_dir")
        if cfg0.tracking.enabled:
            check_store()  # a sqlite:/// store in a folder that does not exist
        self.exp = exp = resolve(cfgs)  # name, fingerprint, data and partition keys, model: resolved once
        self.name = exp.name
        self.store = ExperimentStore(self.name, exp.fingerprint, Path(cfg0.results_dir),
                                     Path(cfg0.engine.checkpoint_dir))
        self.store.check_owned()  # a folder the project did not write: one line, nothing created or read yet
        self.runner = ExperimentRunner(exp, inputs, cache_dir=objective_cache(cfg0))
        self.device, self.ds, self.part = self.runner.inputs.device, self.runner.inputs.ds, self.runner.inputs.part
        # the effective update amount u = eta E |D| / (B K) of the IID-to-non-IID study (section 3 of that paper)
        self.u = effective_update(cfg0.train.lr, cfg0.train.local_epochs, int(sum(self.part.sizes)),
                                  cfg0.train.batch_size, self.part.num_clients, cfg0.train.local_steps)
        self.data = self.runner.inputs.data
        self.model_name = exp.model
        self.probe = self._preflight()
        self.algo_desc = self.probe.algo.describe()
        self.model_d = self.probe.spec.d
        self.pkey = exp.partition_key
        self.seeds = list(exp.seeds)
        self.callbacks = list(callbacks or [])
        self.seed_callbacks = [on_round] if on_round is not None else []  # cb(seed, round, row)
        self.progress = _Progress(self.name, cfg0.train.rounds * len(cfgs), cfg0.engine.progress)
        self.tracking: Optional[Tracking] = None
        self.parent_id: Optional[str] = None
        self.records: Dict[int, Dict] = {}
        self._live_loggers: Dict[int, Any] = {}  # seed -> its MLflow child run in training (ended on a failure)
        self._staging: Optional[Path] = None
        self._schedule_files: List[Path] = []
        self._inputs: Optional[List[Dict[str, str]]] = None
        self.summary: Optional[Dict] = None  # what run() returns, set when the experiment's start ends
        commit = git_commit(project_root())
        self.tags = {"algorithm": self.algo_desc, "dataset": cfg0.dataset.name, "partition": self.pkey,
                     "model": self.model_name, "git_commit": commit, "mlflow.source.git.commit": commit,
                     "experiment": self.name,
                     # with dataset.validation_fraction > 0 the test_* metrics are measured on the held-out split
                     "eval_split": "validation" if cfg0.dataset.validation_fraction > 0 else "test",
                     "executor": self.probe.executor.name, "executor_reason": self.probe.executor.reason,
                     "client_state": f"{self.probe.client_state}: {self.probe.client_state_reason}",
                     **dvc_experiment_tags()}

    def _preflight(self):
        """Build seed 1's simulator and push one training sample through the model, before anything is
        written, so that a model that does not fit the data (or a rule that cannot run on the model)
        fails with one line and no file touched.

        Raises:
            ConfigError: naming ``model`` and the dataset's input shape.
        """
        import torch

        cfg = self.cfg0
        shape = tuple(self.ds.input_shape)
        try:
            sim = self.runner.simulator(cfg)
            with torch.no_grad():
                sim.model.eval()
                sim.model(self.data.x[:1])
                sim.model.train()
        except ConfigError:
            raise
        except (RuntimeError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ConfigError(f"model={cfg.model.name} ({self.model_name}) does not fit dataset={cfg.dataset.name} "
                              f"inputs of shape {list(shape)}: {first}") from None
        return sim

    # ------------------------------------------------------------------ the run
    def _refuse_other_config(self) -> None:
        """Without ``replace``: a ConfigError when ``results/<name>/`` holds the published results of another
        config (another fingerprint), so that a reused name never replaces them silently."""
        if self.replace:
            return
        held = read_results(self.store.out)
        other = None if held is None else held.get("fingerprint")
        if other and other != self.store.fingerprint:
            raise ConfigError(f"{self.store.out}/ holds the results of another config of experiment {self.name} "
                              f"(fingerprint {other}, this run's {self.store.fingerprint}): give this run its own "
                              "name=..., or add --overwrite to replace them")

    def run(self) -> Dict:
        with self.session() as todo:
            if todo is not None:
                self.runner.train(todo, [self], checkpoint_path=self.checkpoint_path)
        return self.summary

    @contextlib.contextmanager
    def session(self):
        """One start of the experiment, around the training of its seeds: under its writer lock, recover what a
        killed start left, find or open its MLflow parent and read back the finished seeds; yield the configs of the
        seeds left to train (None: the experiment is done, nothing to train), which the caller trains with this
        object as their observer; then write and publish the outputs and end the parent. ``self.summary`` holds
        the result. On an exception the runs this start opened are ended (:meth:`_end_on_failure`); Ctrl-C /
        SIGTERM becomes :class:`Interrupted`."""
        store, cfg0 = self.store, self.cfg0
        with store.lock():
            store.check_owned()  # again under the lock: what another process may have left meanwhile
            store.recover()
            self._refuse_other_config()
            if cfg0.tracking.enabled:
                self.tracking = Tracking(cfg0.tracking.experiment)
                ended = self.tracking.end_orphans(self.name)
                if ended:
                    print(f"{self.name}: ended {ended} MLflow run(s) left RUNNING by a process that is gone "
                          "(status KILLED)", file=sys.stderr)
            done = store.completed(self.seeds)
            if done is not None:
                print(f"{self.name}: {store.out}/ already holds this experiment (same config and seeds); "
                      "nothing to do (delete that folder to train again)", file=sys.stderr)
                self.summary = done
                yield None
                return
            continuing = store.begin()
            try:
                if self.tracking is not None:
                    self.parent_id = self.tracking.parent_run(self.name, store.fingerprint, self.tags, continuing)
                    self.tracking.log_inputs(self.parent_id, self.inputs())
                yield self._prepare()
                summary = self._complete()
                # the MLflow parent of this experiment, for the caller (not part of the published files)
                self.summary = {**summary, "mlflow_run_id": self.parent_id} if self.parent_id else summary
            except BaseException as err:
                self._end_on_failure(err)
                if isinstance(err, KeyboardInterrupt):
                    raise Interrupted(min(self.progress.last_round + 1, cfg0.train.rounds)) from None
                raise
            finally:
                self.progress.close()

    def checkpoint_path(self, seed: int) -> Optional[Path]:
        """The seed's checkpoint file (None with ``engine.checkpoint_every=0``)."""
        return self.store.checkpoint_path(seed) if self.cfg0.engine.checkpoint_every else None

    def _end_on_failure(self, err: BaseException) -> None:
        """The one place a start that stops on an exception ends what it opened, so that no MLflow run is left RUNNING
        and no staging folder behind: the seed's and the experiment's MLflow runs end KILLED on Ctrl-C / SIGTERM,
        FAILED with ``fl.end_reason`` ``environment failure: <the line>`` on an environment failure
        (:func:`fl_core.store.envfail.classify`), else FAILED with ``stopped by an error: <type>: <first line>``; the same
        command continues them (:func:`fl_core.store.tracking.resumable`). This start's staging folder is removed (the next
        start rebuilds it); checkpoints and completion records stay. When the failure is the tracking store itself
        (locked, unreachable) the runs are not touched, as that would only wait once more: the next start ends or
        continues them. Best effort: the failure may be the disk or the store these steps need."""
        import shutil

        from fl_core.store import storefail
        from fl_core.store.tracking import ENV_FAILURE, STOPPED_BY_ERROR

        failure = envfail.classify(err) if isinstance(err, Exception) else None
        if isinstance(err, (KeyboardInterrupt, Interrupted)):  # (another experiment of the population took it first)
            status, reason = "KILLED", INTERRUPTED
        elif failure is not None:
            status, reason = "FAILED", f"{ENV_FAILURE}{failure}"
        else:
            status, reason = "FAILED", f"{STOPPED_BY_ERROR}{type(err).__name__}: {envfail.first_line(err)}"
        store_down = (self.tracking is not None and failure is not None and failure.store is not None
                      and storefail.identity(failure.store) == storefail.identity(self.tracking.uri))
        if not store_down:
            for logger in self._live_loggers.values():
                with contextlib.suppress(Exception):
                    logger.close(status, reason)
            with contextlib.suppress(Exception):
                if self.tracking is not None and self.parent_id is not None:
                    self.tracking.end_parent(self.parent_id, status, reason)
        shutil.rmtree(self.store.staging, ignore_errors=True)

    def _prepare(self) -> List:
        """The start's staging folder with the experiment's description, the finished seeds read back from their
        completion records (files and MLflow children); returns the configs of the seeds left to train."""
        store = self.store
        staging = store.begin_staging()
        self._write_description(staging)
        self._staging = staging
        self._schedule_files = write_schedule(self.probe, self.part, self.cfg0, staging)
        todo = []
        for cfg in self.cfgs:  # the records in the seeds' order (the outputs list them so)
            seed = int(cfg.seed)
            rec = self.records[seed] = store.load_record(seed)
            if rec is None:
                todo.append(cfg)
        for cfg in self.cfgs:
            seed = int(cfg.seed)
            if self.records[seed] is not None:
                print(f"{self.name} seed {seed}: done earlier (read from its completion record)", file=sys.stderr)
                self.progress.skip(len(self.records[seed]["history"]))
                self._publish_seed(cfg, self.records[seed], None)
        return todo

    def _complete(self) -> Dict:
        """Every seed has its record: write, publish and finish the outputs, end the MLflow parent."""
        store = self.store
        summary = self._write_outputs(self._staging)
        store.publish()
        faults.point("after_outputs")
        self._end_parent(summary)
        store.finish()
        return summary

    # ------------------------------------------------------------------ the seeds (pipeline.experiment.Observer)
    def logger(self, seed: int, cfg):
        """The seed's MLflow child run (None without tracking), built with its simulator."""
        if self.tracking is None:
            return None
        logger = self._live_loggers[seed] = self._child_logger(cfg, seed)
        return logger

    def started(self, seed: int, resumed_from: int) -> None:
        self.progress.start(seed, resumed_from)
        end_startup()

    def round(self, seed: int, r: int, row: Dict) -> None:
        self.progress(r, row)
        for cb in self.callbacks:
            cb(r, row)
        for cb in self.seed_callbacks:
            cb(seed, r, row)

    def finished(self, run) -> None:
        """A seed has ended: its completion record (its checkpoint then removed), files and child run."""
        seed = run.seed
        if run.failure is not None:
            print(f"error: {self.name} seed {seed} FAILED: {run.failure}", file=sys.stderr)
            rec = {"status": "failed", "reason": str(run.failure), "history": run.failure.history}
        else:
            faults.point("after_last_round")
            result = run.result
            rec = {"status": "ok", "history": result.history, "state_dict": result.state_dict,
                   "summary": summarize_run(result.history, run.cfg.train.target_acc, run.cfg.train.final_window)}
        self.store.save_record(seed, rec)
        faults.point("after_record")
        run.sim.discard_checkpoint()
        self.records[seed] = rec
        self._publish_seed(run.cfg, rec, self._live_loggers.get(seed))


INTERRUPTED = "interrupted; run the same command again to resume"


def run_experiment(cfgs: List, *, callbacks: Optional[list] = None, replace: bool = True,
                   adhoc: bool = False, on_round: Optional[Callable] = None) -> Dict:
    """Train every seed of one experiment and publish its outputs, exactly once per (name, config, seed).

    Everything that can fail on the inputs (data files, partition, model vs. input shape, rule vs.
    model) is checked before anything is written. Then, holding the experiment's writer lock, finished
    seeds are read back from their completion records, a seed in training resumes from its checkpoint,
    and MLflow parent and child runs are found by tags and continued (:mod:`fl_core.store.runstore`,
    :mod:`fl_core.store.tracking`). A seed whose loss becomes non-finite ends as FAILED; the experiment
    still completes, with ``status`` in ``metrics.json`` and ``failures`` in ``experiment.json``.

    Args:
        cfgs: composed configs, one per seed, identical except for ``seed``.
        callbacks: extra ``cb(round, row)`` hooks passed to every simulator (tests).
        replace: whether results of another config under the same name are replaced (a grid stage: DVC reruns it
            when its config changes); False refuses them with a ConfigError (``fl-train`` without ``--overwrite``).
        adhoc: a run outside the grid (``fl-train`` with overrides, the API): ``results/<name>/`` gets a
            ``.gitignore`` so that git does not list it.
        on_round: ``on_round(seed, round, row)`` after each trained round of every seed (``row``: that round's
            metrics as logged; the API's callback).

    Returns:
        The experiment summary (``metrics.json`` and ``experiment.json`` merged).

    Raises:
        ConfigError, DataSourceError, PartitionError: bad inputs (nothing written).
        ExperimentBusy: another process writes this experiment (nothing written).
        fl_core.store.envfail.EnvironmentFailure: ``results_dir`` or ``engine.checkpoint_dir`` is a file or not writable
            (nothing written, no lock taken), or a torch.distributed rank was lost.
        OSError: a write failed (a full disk, ...: :func:`fl_core.store.envfail.classify` names it); as for any
            environment failure the MLflow runs are ended FAILED with the reason (``fl.end_reason``), the last
            checkpoint stays valid, no temporary file is left, and the same command resumes.
        mlflow.exceptions.MlflowException: the tracking store failed (:mod:`fl_core.store.storefail` names a locked or
            unreachable one); its runs are left to the next start, which ends or continues them.
        Interrupted: Ctrl-C / SIGTERM; the MLflow runs are ended KILLED and the same command resumes.
    """
    return ExperimentRun(cfgs, callbacks, replace, adhoc, on_round).run()


def run_experiments(groups: List[List], *, replace: bool = True, adhoc: bool = False) -> List[Any]:
    """Train several experiments at once: :func:`run_experiment` for each, with the seeds of all of them trained as
    one population where they can share a pass (experiments that differ only in eta_l or in rule parameters a
    replica carries, on the vectorised executor: :func:`pipeline.experiment.train_together`), else one after
    another. Each experiment keeps its own lock, files, completion records, checkpoints and MLflow runs, as if it
    ran alone; experiments on the same data and partition share the loaded inputs. An experiment that cannot start
    (bad input, another process holds it) or cannot finish (its outputs or MLflow parent fail) ends alone; the
    others train and finish.

    Args:
        groups: per experiment, its composed configs (one per seed).
        replace, adhoc: as for :func:`run_experiment`.

    Returns:
        Per experiment, in order: its summary, or the exception it ended with (ConfigError, DataSourceError,
        PartitionError, ExperimentBusy, ForeignFolder, an environment failure, ...).

    Raises:
        Interrupted: Ctrl-C / SIGTERM (every experiment's runs are ended KILLED; the same command resumes), and
        whatever stops the training itself (every started experiment ends it as :func:`run_experiment` would).
    """
    import json

    from .experiment import Part, train_together

    results: List[Any] = [None] * len(groups)
    shared: Dict[str, Any] = {}
    exps: Dict[int, ExperimentRun] = {}
    for i, cfgs in enumerate(groups):
        c = to_container(cfgs[0])
        key = json.dumps([c["dataset"], c["partition"], c["data_dir"], c["engine"]["device"], c["engine"]["dtype"],
                          c["seed"]], sort_keys=True, default=str)
        try:
            exps[i] = ExperimentRun(cfgs, None, replace, adhoc, inputs=shared.get(key))
        except Exception as err:  # noqa: BLE001  this experiment's input: it ends alone (train_jobs says how)
            results[i] = err
            continue
        shared.setdefault(key, exps[i].runner.inputs)
    started = []  # (i, its session, the configs of its seeds left to train)
    for i, exp in exps.items():
        session = exp.session()
        try:
            todo = session.__enter__()
        except (ConfigError, ExperimentBusy, ForeignFolder) as err:  # its lock, folder or results: it ends alone
            results[i] = err
            continue
        except BaseException as err:
            _leave(started, err)
        started.append((i, session, todo))
    try:
        train_together([Part(exps[i].runner, todo, [exps[i]], exps[i].checkpoint_path)
                        for i, _, todo in started if todo])
    except BaseException as err:
        _leave(started, err)
    for i, session, _ in started:
        try:
            session.__exit__(None, None, None)
            results[i] = exps[i].summary
        except Exception as err:  # noqa: BLE001  its outputs or parent failed: the others still finish
            results[i] = err
    return results


def _leave(started: List, err: BaseException) -> None:
    """End the ``started`` sessions of :func:`run_experiments` on ``err`` (the last started first), then raise what
    they raise (Ctrl-C comes out as :class:`Interrupted`)."""
    for _, session, _ in reversed(started):
        try:
            session.__exit__(type(err), err, err.__traceback__)
        except BaseException as raised:  # noqa: BLE001  (the session's form of err, e.g. Interrupted)
            err = raised
    raise err
