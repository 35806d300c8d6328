"""Train one experiment (all its seeds): ``python -m pipeline.train [OVERRIDES] | --grid NAME``.

Single experiment from Hydra overrides (see ``conf/``)::

    python -m pipeline.train dataset=digits partition=dirichlet partition.alpha=0.3 \\
        algorithm=fedbug algorithm.fedbug.gu_percentage=0.2 train.rounds=50 \\
        train.participation=0.5 train.local_epochs=2 train.batch_size=32 train.lr=0.05 seed=1

DVC train stage (every seed of one experiment of ``params.yaml``)::

    python -m pipeline.train --grid fedbug20_dir

A study's stage that holds several rows of its grid (``python -m pipeline.grid sync-dvc`` groups the rows that can
share a pass) names them all, and they train as one population, each with the outputs it gets alone::

    python -m pipeline.train --grid fedbug10_iid,fedbug20_iid,fedbug40_iid --params params.yaml

Outputs in ``results/<name>/``: ``metrics.json`` (the numbers: mean +- std over seeds, ``status``, the
seeds), ``experiment.json`` (what ran: algorithm, partition, fingerprint, failures, per-seed summaries), ``rounds.csv`` (per-round
mean over seeds), ``runs.csv`` (every seed and round), ``curves.png`` / ``.pdf``, ``config.yaml``,
``partition/`` (stats and labels-per-client plot), ``models/seed_<s>.pt``, ``details/`` (per-seed
curves and CSV, the algorithm's local-step schedule such as FedBug's units per step). MLflow: one parent run
per experiment, one child run per seed with every round logged. The same command run again after a
kill continues the same runs (finished seeds from their completion records, the seed in training
from its checkpoint); after a completed run it does nothing (see :func:`run_experiment`,
``docs/reliability.md``).

Exit status: 0 on success (and for a ``--grid`` experiment whose seeds failed: ``status`` in
``metrics.json`` records it, so a DVC pipeline goes on); 1 if a seed failed in a single run (e.g.
non-finite loss; the other seeds still run); 2 for bad input or an experiment another process
holds (one line, nothing written); 3 when the environment failed (a folder that is a file or not writable, a
full disk, a lost torch.distributed rank: one line, :mod:`fl_core.store.envfail`; ``--debug`` or ``FL_DEBUG=1`` shows
the traceback); 130 when interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import gc
import io
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

# Only light modules at the top: ``--help``, ``--hydra-help``, ``--cfg`` and ``--info`` import no torch, MLflow or
# matplotlib (tests/test_cli.py checks it). What a run needs (the engine, the data, the figures) is imported by the
# functions that use it.
from fl_core import progress
from fl_core.store import envfail, faults
from fl_core.config import ConfigError, compose, to_container
from fl_core.experiment import resolve
from fl_core.metrics import mean_std, summarize_run, summarize_seeds
from fl_core.store.owned import ForeignFolder
from fl_core.paths import project_root
from fl_core.store.runstore import (EXPERIMENT_FILE, METRICS_FILE, ExperimentBusy, ExperimentStore, read_results,
                              split_summary)
from fl_core.store.tracking import (TAG_EXPERIMENT, TAG_FINGERPRINT, TAG_SEED, Tracking, check_store, dvc_experiment_tags,
                              git_commit, resumable, run_params)

from .common import fail
from .experiment import ExperimentRunner, Observer
from .files import atomic_write, write_json, write_text

if TYPE_CHECKING:  # annotations only: a run imports torch where it trains
    import torch


def usage() -> str:
    """The --help text; the choices are read from conf/ and the rule registry so it stays true to the code."""
    from fl_core.paths import conf_dir

    from fl_core.algorithms import registry
    from fl_core.config import replica_keys
    from fl_core.schema import EXECUTORS

    def opts(group):
        return "|".join(sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")))

    rules = "\n".join("  " + line for line in registry.help_lines())
    two = ",".join(r.preset_name for r in registry.rules("base")[:2])  # an example sweep over two presets
    carried = " / ".join(replica_keys())  # the keys a population's replicas may differ in

    return f"""usage: python -m pipeline.train [KEY=VALUE ...]      one experiment from Hydra overrides
       python -m pipeline.train --grid NAME [--params FILE]   experiment NAME of params.yaml (all seeds)
       python -m pipeline.train --grid A,B,... [--params FILE]   several experiments of params.yaml, as one
                                                         population where they can share a pass (a study's stage)
       python -m pipeline.train --cfg [job|hydra|all] [KEY=VALUE ...]   print the composed config and exit
       python -m pipeline.train --info [KEY=VALUE ...]   the config search path, chosen groups and config
       python -m pipeline.train --hydra-help             the override grammar (key=value, group=option, +, ~)
       python -m pipeline.train --overwrite [KEY=VALUE ...]   replace results/<name>/ of another config (else refused)
       python -m pipeline.train -m [KEY=A,B ...]         Hydra multirun: one experiment per combination
       python -m pipeline.train --debug ...              an environment failure shows its traceback (also FL_DEBUG=1)

(fl-train is the same command, installed as a console script.)
Config groups (conf/): dataset, partition, model, algorithm, train, engine, tracking; presets: +experiment=NAME.
  dataset={opts("dataset")}
  partition={opts("partition")}   partition.num_clients  partition.alpha  partition.variant
  model={opts("model")}
  algorithm={opts("algorithm")}   (presets of the rules below)
    algorithm.name (a wrapper's base)  algorithm.wrappers  algorithm.eta_g (server learning rate)  algorithm.server_opt
    algorithm.aggregation=weighted|uniform|null (null: the base rule's own; a rule refuses one it would ignore)
{rules}
  +experiment={opts("experiment")}
  train.rounds  train.participation  train.sampler=bernoulli|fixed  train.local_epochs  train.batch_size
  train.lr  train.weight_decay  train.optimizer=sgd|adam  train.momentum (sgd)  train.grad_clip  train.augmentation
  train.local_epochs_max (null: E for all | b: E_i ~ U{{E..b}} per client and round)
  train.stragglers (fraction s in [0, 1): run U{{1..E_i-1}} epochs)  train.drop_stragglers (only with stragglers > 0)
  engine.executor={"|".join(EXECUTORS)}
    (distributed: start with torchrun --nproc_per_node K -m pipeline.train ...; docs/scaling.md)
  engine.dist_timeout_s (distributed: seconds a rank waits for another before the run ends; docs/reliability.md)
  engine.rank_executor  engine.client_state=memory|disk|auto  engine.device  seed  name
  engine.kernels=native|portable (portable: the same numbers on every x86-64 CPU with AVX2; docs/reliability.md)
  engine.float32_precision=highest|high|medium  engine.deterministic=true|false (CUDA kernels; docs/scaling.md)
Seeds: seed=1,2,3 or seed=range(1,4) trains one experiment for each seed (one MLflow parent, mean +- std).
Multirun (-m, --multirun): every other swept key (algorithm={two}) gives one job, each job one
  experiment with the whole seed list; hydra/launcher=basic (default, one after another) | joblib (parallel:
  pip install hydra-joblib-launcher; hydra.launcher.n_jobs=N) | submitit_slurm. Hydra's files in
  outputs/multirun/<date>/<time>/; exit status: the worst job's. With engine.executor=vectorized and the basic
  launcher, jobs that differ only in {carried} (and the seed) train as one population. See docs/cli.md.
Outputs go to results/<name>/ and the MLflow store (MLFLOW_TRACKING_URI or sqlite:///<root>/mlflow.db; make ui
browses it, docs/tracking.md). Waits on it are bounded: a tracking server 30 s from a request's first failure
(FL_HTTP_RETRY_S; MLflow's MLFLOW_HTTP_REQUEST_MAX_RETRIES=10, MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1 where unset), a locked SQLite store
FL_SQLITE_BUSY_TIMEOUT_S (30 s); docs/reliability.md.
A killed or interrupted run continues when the same command runs again; a completed one is not rerun.
Exit status: 0 ok (also a --grid experiment that failed: see its metrics.json), 1 a seed failed,
2 bad input or experiment busy, 3 the environment failed (a folder not writable, disk full, a lost rank, the
tracking store locked, unreachable or in a missing folder: one line; fix it and run the same command again),
130 interrupted.
"""

def _csv(rows: List[Dict], columns: List[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in columns})
    return buf.getvalue()


TIMING_KEYS = ("round_time_s",)  # wall-clock measurements: differ between identical runs
TIMES_FILE = "round_times.csv"  # details/round_times.csv: every seed's TIMING_KEYS per round (.dvcignore'd)


def _without_timing(rows: List[Dict]) -> List[Dict]:
    """History rows without the wall-clock columns (:data:`TIMING_KEYS`): what the files DVC and git keep hold."""
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def _save_tensors(state: Dict, path: Path) -> None:
    """``torch.save`` through an open file: the archive's inner folder is then always ``archive/`` (given a path,
    torch names it after the file, here a random temporary name), so the same model gives the same bytes."""
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)


OBJECTIVE_KEYS = ("objective", "objective_gap", "opt_distance")  # a model's objective_metrics (logreg_binary)


def mean_curve(histories: Dict[int, List[Dict]]) -> List[Dict]:
    """Per-round mean (and std of test_acc) over seeds; rounds without evaluation keep train columns."""
    rows = []
    by_round: Dict[int, List[Dict]] = {}
    for hist in histories.values():
        for row in hist:
            by_round.setdefault(int(row["round"]), []).append(row)
    for r in sorted(by_round):
        group = by_round[r]
        out: Dict = {"round": r}
        for k in ("test_acc", "test_loss", "train_loss", "client_acc_mean", "client_acc_std", "client_acc_worst10",
                  "comm_up_floats", "comm_down_floats", *OBJECTIVE_KEYS):
            vals = [g[k] for g in group if k in g]
            if vals:
                ms = mean_std(vals)
                out[k] = ms["mean"]
                if k == "test_acc":
                    out["test_acc_std"] = ms["std"]
        rows.append(out)
    return rows


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


class _Experiment(Observer):
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

    def _write_description(self, staging: Path) -> None:
        """config.yaml and the partition's statistics and plot (the files that describe the experiment)."""
        import yaml

        from fl_core.data.partition import plot_label_distribution

        container = to_container(self.cfg0)
        container.pop("seed")
        write_text(staging / "config.yaml", yaml.safe_dump({**container, "name": self.name, "seeds": self.seeds,
                                                           "effective_update_u": self.u}, sort_keys=False))
        write_json(staging / "partition" / "stats.json", self.part.stats())
        if self.adhoc:  # git ignores the folder (a grid experiment's small outputs are tracked instead)
            write_text(staging / ".gitignore", "# results of a run outside the grid (fl-train / the API): not "
                       "tracked by git\n*\n")
        plot_label_distribution(self.part, staging / "partition" / "labels_per_client.png", title=self.pkey)

    # ------------------------------------------------------------------ the seeds (pipeline.experiment.Observer)
    def logger(self, seed: int, cfg):
        """The seed's MLflow child run (None without tracking), built with its simulator."""
        if self.tracking is None:
            return None
        logger = self._live_loggers[seed] = self._child_logger(cfg, seed)
        return logger

    def started(self, seed: int, resumed_from: int) -> None:
        self.progress.start(seed, resumed_from)
        _end_startup()

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

    def _publish_seed(self, cfg, rec: Dict, logger) -> None:
        """The files of a seed with a completion record and its MLflow child run brought to its end."""
        seed = int(cfg.seed)
        files = self._write_seed_files(seed, rec, self._staging)
        if self.tracking is not None:
            self._finish_child(cfg, seed, rec, logger, files + self._schedule_files)
        self._live_loggers.pop(seed, None)
        faults.point("after_child_finished")

    def _child_logger(self, cfg, seed: int):
        derived = {f"model.{k}": v for k, v in self.probe.model.problem_params().items()} \
            if hasattr(self.probe.model, "problem_params") else {}  # constants the model took from the data
        params = {**run_params(to_container(cfg)), "model.resolved": self.model_name, "model.d": self.model_d, **derived,
                  "algorithm.describe": self.algo_desc, "effective_update_u": self.u}
        tags = {**self.tags, "seed": str(seed), TAG_SEED: str(seed), TAG_EXPERIMENT: self.name,
                TAG_FINGERPRINT: self.store.fingerprint}
        return self.tracking.child_logger(self.parent_id, f"{self.name}/seed{seed}", tags, params,
                                          cfg.tracking.log_every, cfg.tracking.detail_metrics)

    def inputs(self) -> List[Dict[str, str]]:
        """The dataset and the partition as MLflow inputs (name, content digest, source)."""
        if self._inputs is None:
            self._inputs = self._describe_inputs()
        return self._inputs

    def _describe_inputs(self) -> List[Dict[str, str]]:
        import hashlib

        import numpy as np

        from fl_core.data import describe_source

        ds, part = self.ds, self.part
        h = hashlib.sha256(ds.y_train.numpy().tobytes())
        h.update(repr(tuple(ds.input_shape)).encode())
        if ds.provenance:  # generated data: the generator's arguments (mnist1d's shuffled control keeps the labels)
            h.update(json.dumps(ds.provenance, sort_keys=True).encode())
        p = hashlib.sha256()
        for ix in part.client_indices:
            p.update(np.asarray(ix, dtype=np.int64).tobytes())
            p.update(b"|")
        split = "validation" if self.cfg0.dataset.validation_fraction > 0 else "test"
        return [{"name": self.cfg0.dataset.name, "digest": h.hexdigest()[:16], "context": "training",
                 "source": f"{describe_source(self.cfg0.dataset)} (evaluation: {split} split)"},
                {"name": self.pkey, "digest": p.hexdigest()[:16], "context": "partition",
                 "source": f"partition={self.cfg0.partition.name} over {part.num_clients} clients"}]

    def _write_seed_files(self, seed: int, rec: Dict, staging: Path) -> List[Path]:
        """details/seed_<s>.csv and .png, and models/seed_<s>.pt for a seed that finished."""
        from .figures import experiment_figure, readable_title

        hist = _without_timing(rec["history"])
        seed_csv, seed_png = staging / "details" / f"seed_{seed}.csv", staging / "details" / f"seed_{seed}.png"
        write_text(seed_csv, _csv(hist, _history_columns(hist)))
        files = [seed_csv] + experiment_figure(
            {seed: hist}, readable_title(self.name, self.algo_desc, self.pkey, seed=seed,
                                         failed=rec["status"] != "ok"), seed_png)
        if rec["status"] == "ok":
            model_path = staging / "models" / f"seed_{seed}.pt"
            atomic_write(model_path, lambda p: _save_tensors(rec["state_dict"], p))
        return files

    def _finish_child(self, cfg, seed: int, rec: Dict, logger, files: List[Path]) -> None:
        """Bring the seed's MLflow child run to its end state, once: every round, the summary, the
        artifacts, the final model (``tracking.log_model``), FINISHED (or FAILED with the reason). A run already
        ended is left as it is."""
        if logger is None:  # read back from its record: find the child, or create it if it never was
            found = self.tracking.child_run(self.parent_id, seed)
            if found is not None and not resumable(found):  # FINISHED, or FAILED by its own numbers
                return
            logger = self._child_logger(cfg, seed)
            logger.open(None)
            for row in rec["history"]:
                logger.log_round(int(row["round"]), {k: v for k, v in row.items() if k != "round"})
            logger.flush()
        if rec["status"] == "ok":
            logger.log_summary({f"summary_{k}": v for k, v in rec["summary"].items()
                                if isinstance(v, (int, float)) and v is not None})
        self.tracking.log_inputs(logger.run_id, self.inputs())
        staging = self.store.staging
        logger.log_artifacts([staging / "config.yaml"] + files)
        logger.log_artifacts([staging / "partition" / "stats.json", staging / "partition" / "labels_per_client.png"],
                             "partition")
        if rec["status"] == "ok" and self.cfg0.tracking.log_model:
            self.tracking.log_model(logger.run_id, self._final_model(rec["state_dict"]), self._model_example())
            faults.point("after_child_model")
        logger.close("FINISHED" if rec["status"] == "ok" else "FAILED", rec.get("reason"))

    def _final_model(self, state_dict: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """A fresh model of this experiment (built as the simulator builds it, without the data a model may bind)
        holding ``state_dict``, on the CPU in eval mode: what MLflow logs."""
        from fl_core.algorithms import prepare_model
        from fl_core.engine.factory import DTYPES
        from fl_core.models import build_model

        cfg, ds = self.cfg0, self.ds
        model = build_model(cfg.model, cfg.dataset.name, ds.input_shape, ds.num_classes,
                            input_norm=(ds.mean, ds.std)).to("cpu", DTYPES[cfg.engine.dtype])
        prepare_model(cfg.algorithm, model)
        model.load_state_dict(state_dict)
        return model.eval()

    def _model_example(self) -> torch.Tensor:
        """[2, *input_shape]: the first two training inputs (as the model takes them), the logged model's input example."""
        return self.data.x[:2].detach().cpu()

    def _write_outputs(self, staging: Path) -> Dict:
        """runs.csv, rounds.csv, curves.png, metrics.json and experiment.json of the finished seeds."""
        from .figures import experiment_figure, readable_title

        ok = {s: r for s, r in self.records.items() if r["status"] == "ok"}
        failures = {s: r["reason"] for s, r in self.records.items() if r["status"] == "failed"}
        histories = {s: r["history"] for s, r in ok.items()}
        summary = _experiment_summary(self.name, self.cfg0, self.algo_desc, self.pkey, self.model_name,
                                      {s: r["summary"] for s, r in ok.items()}, failures, self.model_d)
        summary.update(fingerprint=self.store.fingerprint, seeds_run=sorted(self.records))
        # git and DVC keep runs.csv, rounds.csv and details/seed_<s>.csv: no wall-clock columns there, so that a rerun
        # gives the same bytes (and dvc.lock the same hashes); round_time_s goes to MLflow and details/round_times.csv,
        # which .dvcignore leaves out of the outputs' hashes
        all_rows = [{"seed": s, **row} for s, h in histories.items() for row in _without_timing(h)]
        write_text(staging / "runs.csv", _csv(all_rows, _history_columns(all_rows)))
        times = [{"seed": s, "round": row["round"], **{k: row[k] for k in TIMING_KEYS if k in row}}
                 for s, r in sorted(self.records.items()) for row in r["history"]]
        write_text(staging / "details" / TIMES_FILE, _csv(times, ["seed", "round", *TIMING_KEYS]))
        mean_rows = mean_curve(histories)
        write_text(staging / "rounds.csv", _csv(mean_rows, _history_columns(mean_rows)))
        experiment_figure(histories, readable_title(self.name, self.algo_desc, self.pkey, failed=not histories),
                          staging / "curves.png")
        if not ok:  # keep the folder DVC expects, saying why it holds no model
            write_text(staging / "models" / "README.txt", "No model: every seed failed (see ../experiment.json).\n")
        metrics, info = split_summary(summary)
        write_json(staging / METRICS_FILE, metrics)
        write_json(staging / EXPERIMENT_FILE, info)
        return summary

    @staticmethod
    def _best_seed(records: Dict[int, Dict]) -> Optional[int]:
        """The seed with the highest final accuracy (``final_acc``: the mean of the last ``train.final_window``
        evaluations; the lowest such seed on a tie), or None when no seed has one."""
        scored = [(-r["summary"]["final_acc"], s) for s, r in records.items()
                  if r.get("summary", {}).get("final_acc") is not None]
        return min(scored)[1] if scored else None

    def _end_parent(self, summary: Dict) -> None:
        """The parent's params, summary metrics, seed-mean curves (step = round), artifacts and best-child tags, once
        (a rerun skips what the parent holds); then FINISHED, or FAILED naming the seeds that failed."""
        if self.tracking is None or self.parent_id is None:
            return
        container = to_container(self.cfg0)
        container.pop("seed")
        tr, out = self.tracking, self.store.out
        tr.log_params(self.parent_id, {**run_params(container), "seeds": self.seeds, "effective_update_u": self.u})
        tr.log_metrics_once(self.parent_id, {k: v for k, v in summary.items()
                                             if k.endswith(("_mean", "_std")) and isinstance(v, (int, float))})
        ok = {s: r for s, r in self.records.items() if r["status"] == "ok"}
        # the seed-mean curves of rounds.csv but the per-client accuracy summaries (final values in the metrics)
        tr.log_curves(self.parent_id, [{k: v for k, v in row.items() if not k.startswith("client_acc_")}
                                       for row in mean_curve({s: r["history"] for s, r in ok.items()})])
        faults.point("after_parent_curves")
        best = self._best_seed(ok)
        child = tr.child_run(self.parent_id, best) if best is not None else None
        if child is not None:
            tr.set_best_child(self.parent_id, best, child.info.run_id)
        tr.log_artifacts(self.parent_id, [out / METRICS_FILE, out / EXPERIMENT_FILE, out / "rounds.csv", out / "curves.png", out / "curves.pdf",
                                          out / "config.yaml"])
        failures = summary.get("failures") or {}
        tr.end_parent(self.parent_id, "FAILED" if failures else "FINISHED",
                      "; ".join(f"seed {s}: {r}" for s, r in failures.items()) or None)


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
    return _Experiment(cfgs, callbacks, replace, adhoc, on_round).run()


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
    exps: Dict[int, _Experiment] = {}
    for i, cfgs in enumerate(groups):
        c = to_container(cfgs[0])
        key = json.dumps([c["dataset"], c["partition"], c["data_dir"], c["engine"]["device"], c["engine"]["dtype"],
                          c["seed"]], sort_keys=True, default=str)
        try:
            exps[i] = _Experiment(cfgs, None, replace, adhoc, inputs=shared.get(key))
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


def write_schedule(sim, part, cfg, out_dir: Path) -> List[Path]:
    """What the algorithm does over local steps (FedBug: trainable units per step), as CSV, PNG and PDF.

    Written for the clients' distinct step counts K_i; nothing for algorithms without a schedule."""
    from fl_core.engine.executors import client_steps

    from .figures import schedule_figure

    steps = [client_steps(int(n), cfg.train.batch_size, cfg.train.local_epochs, cfg.train.local_steps)
             for n in part.sizes]
    rows = sim.algo.schedule_rows(steps)
    if not rows:
        return []
    csv_path, png_path = out_dir / "details" / "schedule.csv", out_dir / "details" / "schedule.png"
    write_text(csv_path, _csv(rows, list(rows[0])))
    return [csv_path] + schedule_figure(rows, f"{sim.algo.describe()}: units trainable per local step", png_path)


def _history_columns(rows: List[Dict]) -> List[str]:
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _experiment_summary(name, cfg, algo_desc, pkey, model_name, summaries, failures, model_d=None) -> Dict:
    from fl_core.algorithms import registry

    # the description's text and its structure with the registry's labels (what the report's labels read)
    out: Dict = {"experiment": name, "algorithm": algo_desc, "stack": registry.described(algo_desc),
                 "dataset": cfg.dataset.name, "partition": pkey,
                 "model": model_name, "model_d": model_d, "rounds": int(cfg.train.rounds),
                 "target_acc": float(cfg.train.target_acc), "final_window": int(cfg.train.final_window)}
    seeds = summarize_seeds(summaries, failures)
    per_seed = seeds.pop("per_seed")
    out.update(seeds)
    if summaries:
        any_s = next(iter(summaries.values()))
        out["comm_up_floats"] = any_s["comm_up_floats"]
        out["comm_down_floats"] = any_s["comm_down_floats"]
    out["per_seed"] = per_seed
    return out


def _sigterm_as_interrupt(signum, frame):  # noqa: ARG001  (signal handler signature)
    """SIGTERM is Ctrl-C, except on rank 0 of ``engine.executor=distributed`` when torchrun sends it because another
    rank is gone: then the lost rank is the failure (:func:`fl_core.engine.distributed.on_sigterm`)."""
    from fl_core.engine import distributed

    failure = distributed.on_sigterm()
    if failure is distributed.IGNORE:
        return
    if failure is not None:
        raise failure
    raise KeyboardInterrupt


def train_one(overrides: List[str], seeds: Optional[List[int]] = None) -> int:
    """Train one experiment from Hydra ``overrides`` (no sweeps) for every seed of ``seeds`` (None or empty:
    the config's seed), under one MLflow parent, as ``fl-train OVERRIDES seed=S1,S2,...`` does; used by the
    jobs of ``fl-train -m`` (:mod:`pipeline.multirun`).

    Returns:
        The exit status: 0 ok, 1 a seed failed, 2 bad input (after its one ``error:`` line), 3 the environment
        failed (after its one line), 130 interrupted.
    """
    from .multirun import seed_override

    try:
        return main(list(overrides) + seed_override(seeds))
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 1


def train_jobs(jobs: List[List[str]], seeds: Optional[List[int]] = None) -> List[int]:
    """Train the experiments of several jobs of ``fl-train -m`` (each its Hydra overrides, no sweeps) for every seed
    of ``seeds``, as one population where they can share a pass (:func:`run_experiments`); each experiment validates,
    writes and tracks as ``train_one`` would, and a job that fails ends alone.

    Returns:
        Each job's exit status, as :func:`train_one` gives it: 0 ok, 1 a seed failed (or a bug: its traceback), 2 bad
        input or a busy experiment (after its ``error:`` line), 3 the environment failed (its one line; ``--debug``
        / ``FL_DEBUG=1``: the traceback), 130 interrupted (every job).
    """
    from .multirun import seed_override

    statuses: List[int] = [0] * len(jobs)
    groups, nums = [], []
    for num, job in enumerate(jobs):
        try:
            cfgs = _override_configs(list(job) + seed_override(seeds))
        except ConfigError as err:
            statuses[num] = _job_error(err)
            continue
        except SystemExit as err:  # fail(): its line is printed
            statuses[num] = err.code if isinstance(err.code, int) else 2
            continue
        groups.append(cfgs)
        nums.append(num)
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        results = run_experiments(groups, replace=False, adhoc=True)
    except (Interrupted, KeyboardInterrupt) as err:
        where = f" at round {err.round}" if isinstance(err, Interrupted) else " before training started"
        print(f"interrupted{where}; run the same command again to resume", file=sys.stderr)
        for num in nums:
            statuses[num] = 130
        return statuses
    except Exception as err:  # noqa: BLE001  the training itself failed: every job of the population
        status = _job_error(err)
        for num in nums:
            statuses[num] = status
        return statuses
    finally:
        signal.signal(signal.SIGTERM, previous)
    for num, cfgs, res in zip(nums, groups, results):
        statuses[num] = _job_error(res) if isinstance(res, BaseException) else _outcome(res, cfgs[0], grid=False)
    return statuses


def _job_error(err: BaseException) -> int:
    """Say why a job of :func:`train_jobs` ended as ``train_one`` would, and return its exit status: 2 bad input or a
    busy experiment, 3 an environment failure (raised with ``--debug`` / ``FL_DEBUG=1``), else 1 with the
    traceback."""
    import traceback

    from fl_core.data import DataSourceError, PartitionError
    from fl_core.progress import end_line

    end_line()
    if isinstance(err, (ConfigError, DataSourceError, PartitionError, ExperimentBusy, ForeignFolder)):
        print(f"error: {err}", file=sys.stderr)
        return 2
    failure = envfail.classify(err) if isinstance(err, Exception) else None
    if failure is not None:
        if envfail.debug():
            raise err
        if not failure.quiet:
            print(f"error: {failure}", file=sys.stderr, flush=True)
        return envfail.EXIT_STATUS
    traceback.print_exception(type(err), err, err.__traceback__)
    return 1


def _grid_configs(argv: List[str]) -> List[List]:
    """Per experiment of ``--grid NAME[,NAME...] [--params FILE]``, its composed configs (one per seed); exits 2
    (:func:`fail`) for a missing name or file, a name given twice, or any further argument."""
    from .grid import load_grid

    if len(argv) < 2:
        fail("--grid needs an experiment name")
    names = argv[1].split(",")
    if "" in names or len(set(names)) < len(names):
        fail(f"--grid {argv[1]}: a comma-separated list of distinct experiment names of params.yaml")
    params = Path("params.yaml")
    rest = argv[2:]
    if rest[:1] == ["--params"]:
        if len(rest) < 2:
            fail("--params needs a file")
        params = Path(rest[1])
        rest = rest[2:]
    if rest:
        fail(f"unexpected argument {rest[0]!r} after --grid NAME (grid runs take their settings "
             "from params.yaml)")
    grid = load_grid(params)
    groups = [grid.compose_all(n) for n in names]
    if len(groups) > 1 and any(g[0].engine.executor == "distributed" for g in groups):
        fail(f"--grid {argv[1]}: engine.executor=distributed trains one experiment a command (give one name)")
    return groups


def _train_rows(groups: List[List]) -> int:
    """``--grid A,B,...``: the experiments of a DVC stage that holds several rows of the grid
    (:func:`pipeline.grid.train_groups`), trained as one population where they can share a pass
    (:func:`run_experiments`); each row's outputs are those it gets alone.

    Returns:
        The worst row's exit status as ``--grid NAME`` gives it (0: done, a row whose seeds failed included; 2 a
        row's bad input or busy experiment; 3 an environment failure; 130 interrupted: every row resumes with the
        same command).
    """
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        results = run_experiments(groups, replace=True, adhoc=False)
    except Interrupted as err:
        print(f"interrupted at round {err.round}; run the same command again to resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted before training started", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return max(_job_error(res) if isinstance(res, BaseException) else _outcome(res, cfgs[0], grid=True)
               for cfgs, res in zip(groups, results))


def _override_configs(argv: List[str]) -> List:
    """The composed configs (one per seed of a ``seed=`` list, else one) of Hydra overrides; exits 2
    (:func:`fail`) for an option."""
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        fail(f"unknown option {bad[0]} (see --help)")
    from .multirun import split_seeds

    overrides, seeds = split_seeds(argv)  # seed=1,2,3 / seed=range(1,4): one experiment, these seeds
    return [compose(overrides + [f"seed={s}"]) for s in seeds] if seeds else [compose(overrides)]


def _train(cfgs: List, replace: bool = True, adhoc: bool = False) -> Optional[Dict]:
    """:func:`run_experiment` with SIGTERM taken as Ctrl-C; None when interrupted (said on stderr). Bad inputs
    and a busy experiment exit 2 (:func:`fail`)."""
    from fl_core.data import DataSourceError, PartitionError

    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        return run_experiment(cfgs, replace=replace, adhoc=adhoc)
    except (ConfigError, DataSourceError, PartitionError, ExperimentBusy, ForeignFolder) as err:
        fail(str(err))
    except Interrupted as err:
        print(f"interrupted at round {err.round}; run the same command again to resume", file=sys.stderr)
        return None
    except KeyboardInterrupt:  # before training started: nothing to resume
        print("interrupted before training started", file=sys.stderr)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _outcome(summary: Dict, cfg, grid: bool) -> int:
    """Print the experiment's result (final accuracy, or why it failed) and return the exit status: 1 when a
    seed failed in a single run, else 0."""
    out = Path(cfg.results_dir) / summary["experiment"]
    if summary.get("status") == "failed":
        reasons = "; ".join(f"seed {s}: {r}" for s, r in (summary.get("failures") or {}).items())
        print(f"{summary['experiment']}: FAILED ({reasons}); recorded in {out}/{EXPERIMENT_FILE}", file=sys.stderr)
        return 0 if grid else 1  # a grid stage completes so that the other experiments and the report run
    fa, fs, k = summary["final_acc_mean"], summary["final_acc_std"], summary.get("final_window")
    window = f" (fraction, mean of the last {k} evaluations)" if k and int(k) > 1 else " (fraction, last round)"
    print(f"{summary['experiment']}: final test accuracy{window} {fa:.4f} +- {fs:.4f} over "
          f"{len(summary['seeds'])} seed(s); results in {out}/")
    if summary.get("failed_seeds"):
        return 0 if grid else 1
    return 0


HYDRA_HELP = """Hydra's override grammar, as fl-train reads it (https://hydra.cc/docs/advanced/override_grammar/basic/):
  key=value              set a value: train.rounds=5, train.lr=0.05, algorithm.wrappers=[{wrapper}]
  group=option           choose a config group file: algorithm={base}, dataset=mnist1d, model=m1d_cnn
  +experiment=NAME       add a preset (conf/experiment/NAME.yaml) on top of the defaults
  +key=value / ~key      add a key the config does not have / delete one (fl-train refuses keys a run does not use)
  key=a,b / range(a,b)   a sweep: a seed list with seed=, one job per value with -m (--multirun)
  'key=${other.key}'     an OmegaConf interpolation (quote it for the shell)
Options: --cfg [job|hydra|all] prints the composed config (job: fl-train's, hydra: Hydra's own node, all: both) and
exits; --info prints the config search path, the chosen config groups and the composed config; --help lists the keys."""


def hydra_help() -> str:
    """``--hydra-help``: :data:`HYDRA_HELP` with example rules taken from the registry."""
    from fl_core.algorithms import registry

    return (HYDRA_HELP.replace("{wrapper}", registry.names("wrapper")[0])
            .replace("{base}", registry.rules("base")[1].preset_name))


def _cfg_option(argv: List[str]) -> tuple:
    """``--cfg [job|hydra|all]`` out of ``argv``: (the part asked for, or None without ``--cfg``; the rest). A bare
    ``--cfg`` is ``job``, as in Hydra."""
    if "--cfg" not in argv:
        return None, argv
    i = argv.index("--cfg")
    part = "job"
    rest = argv[:i] + argv[i + 1:]
    if i + 1 < len(argv) and argv[i + 1] in ("job", "hydra", "all"):
        part = argv[i + 1]
        rest = argv[:i] + argv[i + 2:]
    return part, rest


def _describe(cfg, overrides: List[str], part: str, info: bool = False) -> str:
    """What ``--cfg PART`` / ``--info`` print for a composed config: fl-train's config (``job``), Hydra's own node
    (``hydra``: composed by Hydra from the same overrides), or both (``all``); with ``info`` first the config search
    path and the chosen config groups."""
    from omegaconf import OmegaConf

    from fl_core.paths import conf_dir

    out: List[str] = []
    if info:
        out += [f"Config search path: {conf_dir()} (file://, the project's conf/)",
                "Config groups chosen: " + ", ".join(f"{g}={cfg[g].name}" for g in ("dataset", "partition", "model", "algorithm")
                                              if "name" in cfg[g]), ""]
    if part in ("hydra", "all"):
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir

        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            node = hydra_compose(config_name="config", overrides=[o for o in overrides if not o.startswith("-")],
                                 return_hydra_config=True).hydra
        out.append(OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(node, resolve=False)})))
    if part in ("job", "all") or info:
        out.append(OmegaConf.to_yaml(cfg))
    return "\n".join(out).rstrip("\n")


def _restart_for_portable_kernels(cfgs: List, from_command_line: bool) -> None:
    """``engine.kernels=portable`` needs its variables before torch loads (:mod:`fl_core.engine.kernels`): run as a
    command, start this command again with them set (the process is replaced; nothing was written yet); called
    from Python, let the run refuse it in one line."""
    from fl_core.engine import kernels

    if from_command_line and any(c.engine.kernels == "portable" for c in cfgs) and kernels.missing_env():
        env = {**os.environ, **kernels.PORTABLE_ENV}
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "pipeline.train", *sys.argv[1:]], env)


_gc_paused = False  # the command's start-up runs without the cyclic garbage collector (_end_startup)


def _end_startup() -> None:
    """End the start-up of a command (:func:`main` without ``argv``): move every object allocated so far (the
    modules of torch, MLflow, matplotlib, the data) to the collector's permanent generation and switch the collector
    on again. Called when the first seed starts training, when a worker rank starts serving, and when the command
    ends; a no-op otherwise. Collections while the start-up imports ran traversed every object imported so far, again
    and again: about a fifth of the start-up's CPU time on two cores."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point (see :func:`usage` and the module docstring); returns the exit status.

    ``argv`` None (``fl-train``, ``python -m pipeline.train``): ``sys.argv``, with the garbage collector paused for
    the start-up (:func:`_end_startup`) and, once the command is done, every object frozen so that the exit collects
    nothing; a list (tests, the jobs of ``-m``): those arguments, the collector left as it is. An environment failure
    ends with one ``error:`` line and status 3 (:func:`fl_core.store.envfail.run_cli`; ``--debug``: the traceback)."""
    global _gc_paused
    if argv is not None:
        return envfail.run_cli(functools.partial(_main, from_command_line=False), argv)
    if gc.isenabled():
        gc.disable()
        _gc_paused = True
    try:
        return envfail.run_cli(functools.partial(_main, from_command_line=True), None)
    finally:
        _end_startup()
        gc.freeze()


def _main(argv: List[str], from_command_line: bool) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    if "-m" in argv or "--multirun" in argv:
        from .multirun import multirun

        return multirun([a for a in argv if a not in ("-m", "--multirun")], train_one, train_jobs)
    if "--hydra-help" in argv:
        print(hydra_help())
        return 0
    show_cfg, argv = _cfg_option(argv)
    show_info = "--info" in argv
    overwrite = "--overwrite" in argv
    argv = [a for a in argv if a not in ("--info", "--overwrite")]
    grid = bool(argv) and argv[0] == "--grid"
    try:
        groups = _grid_configs(argv) if grid else [_override_configs(argv)]
        if len(groups) > 1 and not (show_cfg or show_info):
            _restart_for_portable_kernels([c for g in groups for c in g], from_command_line)
            return _train_rows(groups)
        cfgs = groups[0]
        if show_cfg or show_info:
            print(_describe(cfgs[0], argv if not grid else [], show_cfg or "job", info=show_info))
            return 0
        _restart_for_portable_kernels(cfgs, from_command_line)
        from fl_core.engine.factory import resolve_device

        device = resolve_device(cfgs[0].engine.device)
        rank = _join_ranks(cfgs[0], device)
    except (ConfigError, ValueError) as err:
        fail(str(err))
    if rank > 0:
        return _serve(cfgs, device)
    try:
        summary = _train(cfgs, replace=grid or overwrite, adhoc=not grid)
    finally:
        _release_ranks(cfgs[0])
    if summary is None:
        return 130
    return _outcome(summary, cfgs[0], grid)


def _join_ranks(cfg, device) -> int:
    """``engine.executor=distributed``: join torchrun's process group; this process's rank (0 otherwise)."""
    if cfg.engine.executor != "distributed":
        return 0
    from fl_core.engine import distributed

    return distributed.init(distributed.rank_device(device), float(cfg.engine.dist_timeout_s))[0]


def _release_ranks(cfg) -> None:
    """Rank 0 of ``engine.executor=distributed``: end the workers' loops and leave the group."""
    if cfg.engine.executor == "distributed":
        from fl_core.engine import distributed

        distributed.stop_workers()
        distributed.shutdown()


def _serve(cfgs: List, device) -> int:
    """A worker rank of ``engine.executor=distributed``: build this rank's executor for each seed rank 0 runs and
    train the clients it hands over (:func:`fl_core.engine.distributed.serve`); writes nothing, logs nothing."""
    from fl_core.engine import distributed

    from .experiment import Inputs

    exp = resolve(cfgs)
    by_job = {exp.job_key(c.seed): c for c in cfgs}
    runner = ExperimentRunner(exp, Inputs.load(cfgs[0], distributed.rank_device(device)))

    def executor_for(job):
        if job not in by_job:
            raise RuntimeError(f"rank 0 runs {job}, which this rank's command does not define (same command on "
                               "every rank?)")
        return runner.simulator(by_job[job]).executor

    try:
        _end_startup()
        distributed.serve(executor_for, on_task=lambda: faults.point("worker_task"))
    finally:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
