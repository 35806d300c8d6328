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

import functools
import gc
import os
import signal
import sys
from pathlib import Path
from typing import Dict, List, Optional

# Only light modules at the top: ``--help``, ``--hydra-help``, ``--cfg`` and ``--info`` import no torch, MLflow or
# matplotlib (tests/test_cli.py checks it). What a run needs (the engine, the data, the figures) is imported by the
# functions that use it.
from fl_core.store import envfail, faults
from fl_core.config import ConfigError, compose
from fl_core.experiment import resolve
from fl_core.store.owned import ForeignFolder
from fl_core.store.runstore import EXPERIMENT_FILE, ExperimentBusy

from .common import fail
from .experiment import ExperimentRunner
from .observer import Interrupted, end_startup, pause_startup, run_experiment, run_experiments

__all__ = ["main", "run_experiment", "run_experiments", "train_jobs", "train_one", "usage"]


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


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point (see :func:`usage` and the module docstring); returns the exit status.

    ``argv`` None (``fl-train``, ``python -m pipeline.train``): ``sys.argv``, with the garbage collector paused for
    the start-up (:func:`pipeline.observer.end_startup`) and, once the command is done, every object frozen so that the exit collects
    nothing; a list (tests, the jobs of ``-m``): those arguments, the collector left as it is. An environment failure
    ends with one ``error:`` line and status 3 (:func:`fl_core.store.envfail.run_cli`; ``--debug``: the traceback)."""
    if argv is not None:
        return envfail.run_cli(functools.partial(_main, from_command_line=False), argv)
    pause_startup()
    try:
        return envfail.run_cli(functools.partial(_main, from_command_line=True), None)
    finally:
        end_startup()
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
        end_startup()
        distributed.serve(executor_for, on_task=lambda: faults.point("worker_task"))
    finally:
        distributed.shutdown()
    return 0

if __name__ == "__main__":
    sys.exit(main())
