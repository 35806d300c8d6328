"""Seed lists and Hydra multirun for ``fl-train`` (``python -m pipeline.train``); see ``docs/cli.md``.

``seed=1,2,3`` (or ``seed=range(1,4)``) is not a sweep here: it is the seed list of an experiment, trained
seed after seed under one MLflow parent, as ``--grid`` does. :func:`split_seeds` takes it out of the
overrides before Hydra sees them.

``fl-train -m KEY=A,B ...`` hands the remaining overrides to Hydra's sweeper and launcher: one job per
combination of the swept values, each job one experiment with the whole seed list, trained by
:func:`pipeline.train.train_one` exactly as ``fl-train KEY=A ... seed=1,2,3`` would (same validation, same
``results/<name>/``, same MLflow runs); ``pipeline.train`` hands that function in (:func:`multirun`), so this module
does not import it. The launcher is Hydra's (``hydra/launcher=basic``: one job after
another; ``joblib``: parallel, ``pip install hydra-joblib-launcher``; ``submitit_slurm``: a Slurm array).

With the basic launcher (the default) and ``engine.executor=vectorized``, jobs whose configs differ only in
``train.lr`` and in rule parameters a replica carries (:func:`population_groups`) train as one population, here
rather than through Hydra's launcher (``train_jobs``: :func:`pipeline.train.train_jobs`), each still its own
experiment.

Before any job starts, every job's config is composed and validated with :func:`fl_core.config.compose`
(a bad value in a swept list gives the usual one-line ``error:``, exit 2), and jobs that would write the same
``results/<name>/`` are refused. Hydra's own files (``multirun.yaml``, each job's ``.hydra/``) go to
``outputs/multirun/<date>/<time>/``; Hydra's logging configuration is left off, so the jobs print what a
single run prints. Exit status: the worst job's (0 all ok, 1 a seed failed, 2 bad input, 3 the environment failed,
130 interrupted).
"""

from __future__ import annotations

import functools
import re
import signal
import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from fl_core.store import envfail
from fl_core.config import ConfigError
from fl_core.experiment import derive_name

SEED = "seed"
SWEEP_ROOT = "outputs/multirun"
TASK_NAME = "fl-train"
PROG = "fl-train -m"


def _parse(args: Sequence[str], config_loader: Any = None) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create(config_loader=config_loader).parse_overrides(list(args))


def _seed_list(override) -> List[int]:
    """The integers of a ``seed=1,2,3`` / ``seed=range(1,4)`` sweep (ConfigError otherwise)."""
    text = override.input_line
    if not override.is_discrete_sweep():
        raise ConfigError(f"{text}: a seed list must be integers, e.g. seed=1,2,3 or seed=range(1,4)")
    try:
        values = list(override.sweep_iterator())
    except Exception as err:  # noqa: BLE001  (glob() without configs, ...): one line
        raise ConfigError(f"{text}: {envfail.first_line(err)}") from None
    seeds: List[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{text}: seeds must be integers, got {v!r}")
        if v in seeds:
            raise ConfigError(f"{text}: seed {v} is listed twice")
        seeds.append(v)
    if not seeds:
        raise ConfigError(f"{text}: the seed list is empty")
    return seeds


def split_seeds(args: Sequence[str], *, sweep_ok: bool = False,
                config_loader: Any = None) -> Tuple[List[str], Optional[List[int]]]:
    """Take the seed list out of Hydra overrides.

    ``seed=1,2,3`` and ``seed=range(1,4)`` become the seed list ``[1, 2, 3]`` of one experiment; the other
    overrides are returned unchanged (as typed). A single ``seed=5`` stays an override (seed list None).

    Args:
        args: Hydra override strings (no options).
        sweep_ok: whether other keys may sweep (``-m``); without it ``algorithm=fedavg,fedprox`` is refused
            with a hint to add ``-m``.
        config_loader: Hydra's config loader, for ``glob()`` sweeps of config groups (``-m`` only).

    Returns:
        (the overrides without the seed list, the seeds or None).

    Raises:
        ConfigError: one line: a seed list that is not distinct integers, a seed list given twice, a sweep
            without ``-m``.
    """
    from hydra.errors import HydraException

    args = list(args)
    try:
        parsed = _parse(args, config_loader)
    except HydraException:
        return args, None  # compose() reports the syntax error, word for word as before
    seeds: Optional[List[int]] = None
    rest: List[str] = []
    for arg, o in zip(args, parsed):
        if o.key_or_group == SEED and o.package is None and o.is_sweep_override():
            if seeds is not None or any(p.key_or_group == SEED for p in parsed if p is not o):
                raise ConfigError(f"{arg}: seed is given more than once")
            seeds = _seed_list(o)
            continue
        if o.is_sweep_override() and not sweep_ok:
            raise ConfigError(f"{arg} sweeps over several values: add -m to run one experiment per value "
                              "(seed lists need no -m; see --help)")
        rest.append(arg)
    return rest, seeds


def seed_override(seeds: Optional[Sequence[int]]) -> List[str]:
    """``[1, 2]`` -> ``["seed=1,2"]``; None or empty -> ``[]`` (the config's seed)."""
    return [f"{SEED}={','.join(str(s) for s in seeds)}"] if seeds else []


# --------------------------------------------------------------------------- the job (runs in the launcher)


def _keep_task_name() -> None:
    """compose() names Hydra's job "app"; give the sweep's jobs (hydra.job.name, Slurm job names) ours back."""
    from hydra.core.utils import JobRuntime

    JobRuntime.instance().set("name", TASK_NAME)


def _job(cfg, seeds: Optional[List[int]], swept: Sequence[str] = (),  # noqa: ARG001  (Hydra's signature)
         *, train_one: Callable[[List[str], List[int]], int]) -> int:
    """One job of the sweep: its overrides (as Hydra expanded them) trained for every seed, via ``train_one``
    (:func:`pipeline.train.train_one`), so that it validates, writes and tracks exactly like a single run.

    Returns the job's exit status; an interrupted job stops the sweep (KeyboardInterrupt)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = [str(o) for o in hc.overrides.task]
    label = " ".join(overrides) or "(defaults)"
    try:
        overrides = _named(overrides, seeds, swept)
    except ConfigError:
        pass  # train_one says what is wrong, in its one line
    print(f"{PROG}: job #{hc.job.num}: {label}" + (f" (seeds {','.join(map(str, seeds))})" if seeds else ""),
          file=sys.stderr, flush=True)
    try:
        status = train_one(overrides, list(seeds or []))
    except Exception:  # noqa: BLE001  a bug: report it, let the other jobs run, fail the sweep
        traceback.print_exc()
        status = 1
    finally:
        _keep_task_name()
    sys.stdout.flush()
    sys.stderr.flush()
    if status == 130:
        raise KeyboardInterrupt  # stop the launcher; the same command again resumes
    return status


# --------------------------------------------------------------------------- the sweep (runs here)


def _hydra_defaults(user_keys: set, sweep_dir: str) -> List[str]:
    """Hydra settings of ours, each unless the command line sets it."""
    defaults = {
        "hydra.sweep.dir": f"hydra.sweep.dir={sweep_dir}",
        "hydra.job.chdir": "hydra.job.chdir=False",  # results/, data/, checkpoints/ stay relative to the cwd
        # no logging configuration: jobs print what a single run prints (Hydra's defaults would send every
        # library's INFO records to stdout and keep .log files per job)
        "hydra/hydra_logging": "hydra/hydra_logging=none",
        "hydra/job_logging": "hydra/job_logging=none",
        "hydra.mode": "hydra.mode=MULTIRUN",
    }
    return [v for k, v in defaults.items() if k not in user_keys]


def _missing_plugin(text: str) -> str:
    import re

    m = re.search(r"Could not find 'hydra/(launcher|sweeper)/([^']+)'", text)
    if not m:
        return text
    kind, name = m.groups()
    hint = {"joblib": "pip install hydra-joblib-launcher, or pip install -e '.[parallel]'",
            "submitit_slurm": "pip install hydra-submitit-launcher",
            "submitit_local": "pip install hydra-submitit-launcher"}.get(name, f"install the Hydra {kind} plugin")
    return f"hydra/{kind}={name} is not installed: {hint}"


GROUPS = ("dataset", "partition", "model", "algorithm", "train", "engine", "tracking")


def _name_hint(name: str, a: List[str], b: List[str]) -> str:
    """``e.g. name='fedavg_iid_digits-lr${train.lr}'``: the first key in which two jobs differ, interpolated."""
    for x, y in zip(a, b):
        if x != y:
            key = x.split("=", 1)[0].lstrip("+~")
            if "/" in key or "@" in key or (key not in GROUPS and "." not in key and key != "seed"):
                break
            ref = f"{key}.name" if key in GROUPS else key
            return f"e.g. name='{name}-{key.rsplit('.', 1)[-1]}${{{ref}}}'"
    return "e.g. name='...${KEY}' with the swept KEY"


NAMED_BY_DEFAULT = ("algorithm", "partition", "dataset")  # derive_name already tells their choices apart


def swept_keys(parsed: List[Any]) -> List[str]:
    """The keys (and groups) a parsed command line sweeps over, besides the seed list and Hydra's own."""
    return [o.key_or_group for o in parsed
            if o.is_sweep_override() and not o.is_hydra_override() and o.key_or_group != SEED]


def job_name(cfg, job: Sequence[str], swept: Sequence[str]) -> str:
    """The results name of one job of a sweep without ``name=``: :func:`fl_core.experiment.derive_name` followed by the
    job's value of every swept key that name does not show, e.g. ``fedavg_shards-s2_digits-lr0.05`` for
    ``-m train.lr=0.01,0.05`` and ``fedavg_shards-s2_digits-m1d_cnn`` for ``-m model=m1d_cnn,m1d_gru``."""
    values = {}
    for o in job:
        key, _, value = str(o).partition("=")
        values[key.lstrip("+~")] = value
    parts = [derive_name(cfg)]
    for key in swept:
        bare = key.lstrip("+~")
        if bare in NAMED_BY_DEFAULT or bare not in values:
            continue
        value = re.sub(r"[^A-Za-z0-9._-]", "_", values[bare])
        parts.append(value if bare in GROUPS or bare == "experiment" else f"{bare.rsplit('.', 1)[-1]}{value}")
    return "-".join(parts)


def _named(job: List[str], seeds: Optional[List[int]], swept: Sequence[str]) -> List[str]:
    """``job`` with ``name=`` from :func:`job_name` added when the sweep has keys to name it by and the user gave no
    name; else ``job`` unchanged."""
    if not swept or any(str(o).split("=", 1)[0].lstrip("+") == "name" for o in job):
        return list(job)
    from fl_core.config import compose

    cfg = compose(list(job) + seed_override(seeds[:1] if seeds else None))
    return list(job) + [f"name={job_name(cfg, job, swept)}"]


def _check_jobs(jobs: List[List[str]], seeds: Optional[List[int]], swept: Sequence[str] = ()) -> None:
    """Compose and validate every job before any runs; refuse jobs that would share ``results/<name>/``.

    Raises:
        ConfigError: the first bad job's one-line message.
    """
    from fl_core.config import compose
    from fl_core.engine.factory import resolve_device

    owners: dict = {}
    devices = set()
    for num, job in enumerate(jobs):
        cfg = compose(job + seed_override(seeds[:1] if seeds else None))
        devices.add(str(cfg.engine.device))
        name = cfg.name or job_name(cfg, job, swept)  # derive_name(cfg) when nothing is swept
        out = Path(cfg.results_dir) / name
        key = out.resolve()
        if key in owners:
            first_num, first = owners[key]
            a = " ".join(x for x, y in zip(first, job) if x != y)
            b = " ".join(y for x, y in zip(first, job) if x != y)
            raise ConfigError(f"jobs #{first_num} ({a}) and #{num} ({b}) would both write {out}/: give each job "
                              f"its own name, {_name_hint(name, first, job)}")
        owners[key] = (num, job)
    for device in sorted(devices):
        resolve_device(device)


def _statuses(returns: Any) -> List[Tuple[int, List[str], int]]:
    """(job number, overrides, exit status) of every job Hydra's sweeper returned."""
    from hydra.core.utils import JobReturn, JobStatus

    out: List[Tuple[int, List[str], int]] = []

    def visit(r: Any) -> None:
        if isinstance(r, JobReturn):
            num = len(out)
            if r.status == JobStatus.COMPLETED and isinstance(r._return_value, int):
                status = r._return_value
            else:  # the task function raised (not ours: it reports and returns); say so
                print(f"error: {PROG}: job #{num} failed: {r._return_value!r}", file=sys.stderr)
                status = 1
            out.append((num, list(r.overrides or []), status))
        elif isinstance(r, (list, tuple)):
            for x in r:
                visit(x)

    visit(returns)
    return out


def _sigterm_as_interrupt(signum, frame):  # noqa: ARG001  (signal handler signature)
    raise KeyboardInterrupt


def _sweep_hydra() -> Any:
    """Hydra's main object for ``conf/``, which runs the sweep; Hydra's global state is left cleared."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    from fl_core.paths import conf_dir

    hydra = Hydra.create_main_hydra2(task_name=TASK_NAME,
                                     config_search_path=create_config_search_path(str(conf_dir())))
    # the sweep needs only this object; compose() (our validation, in here and in the jobs) initializes
    # Hydra's global state itself and refuses to when it is already set
    GlobalHydra.instance().clear()
    return hydra


def _validated_jobs(parsed: List[Any], user_keys: set, seeds: Optional[List[int]]) -> Optional[List[List[str]]]:
    """The jobs of the sweep, each composed and validated here (:func:`_check_jobs`), with Hydra's basic sweeper (the
    product of the swept lists); None with another sweeper, which decides its jobs itself (they validate when they
    run).

    Raises:
        ConfigError: the first bad job's one-line message.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    if "hydra/sweeper" not in user_keys:  # the basic sweeper: its jobs are the product of the lists
        task = [o for o in parsed if not o.is_hydra_override()]
        jobs = [[str(o) for o in job] for batch in BasicSweeper.split_arguments(task, None) for job in batch]
        _check_jobs(jobs, seeds, swept_keys(parsed))
        _keep_task_name()
        return jobs
    from fl_core.config import compose

    compose([])  # registers the config schema that conf/config.yaml builds on
    _keep_task_name()
    return None


def population_key(cfg) -> Optional[str]:
    """What the jobs of one population share (:func:`fl_core.experiment.population_key`: the whole config but the
    name, the seed and the keys a replica carries); None when ``cfg`` trains no population (another executor than
    ``vectorized``, or ``engine.population=false``)."""
    from fl_core.experiment import population_key as key

    if cfg.engine.executor != "vectorized" or not bool(cfg.engine.population):
        return None
    return key(cfg)


def population_groups(jobs: Sequence[Sequence[str]], seeds: Optional[List[int]]) -> List[List[int]]:
    """The job numbers of ``jobs`` (each its overrides, named) grouped into populations, in order of each group's
    first job: jobs with the same :func:`population_key` form one group (trained in one pass), every other job a
    group of its own."""
    from fl_core.config import compose

    return group_by_key([population_key(compose(list(job) + seed_override(seeds[:1] if seeds else None)))
                         for job in jobs])


def group_by_key(keys: Sequence[Optional[str]]) -> List[List[int]]:
    """The positions of ``keys`` grouped by equal key, in order of each group's first position; a None key is a group
    of its own (``["a", None, "a"]`` -> ``[[0, 2], [1]]``)."""
    groups: List[List[int]] = []
    by_key: dict = {}
    for num, key in enumerate(keys):
        if key is None or key not in by_key:
            groups.append([num])
            if key is not None:
                by_key[key] = groups[-1]
        else:
            by_key[key].append(num)
    return groups


def _launch(hydra: Any, args: List[str], train_one: Callable[[List[str], List[int]], int],
            train_jobs: Optional[Callable[[List[List[str]], List[int]], List[int]]] = None) -> List[Tuple[int, List[str], int]]:
    """Check the sweep of ``args`` (its seed list, jobs and Hydra's own settings), say on stderr what runs,
    and run it: with Hydra's basic sweeper and launcher, jobs that can train as one population
    (:func:`population_groups`) are trained together here by ``train_jobs``, the others by ``train_one``; else every
    job by ``train_one`` through ``hydra`` (Hydra's main object). Returns (job number, overrides, exit status) per job
    that ran.

    Raises:
        ConfigError, HydraException, OmegaConfBaseException, ValueError: bad input, before any job runs (what a job
        raises while it trains is that job's: its traceback, status 1).
    """
    from hydra.types import RunMode

    overrides, seeds = split_seeds(args, sweep_ok=True, config_loader=hydra.config_loader)
    parsed = _parse(overrides, hydra.config_loader)
    user_keys = {o.key_or_group for o in parsed}
    jobs = _validated_jobs(parsed, user_keys, seeds)
    count = f"{len(jobs)} job(s)" if jobs is not None else "the sweeper's jobs"
    hydra_args = _hydra_defaults(user_keys, f"{SWEEP_ROOT}/{datetime.now():%Y-%m-%d/%H-%M-%S}") + overrides
    # Hydra's own settings (the launcher and its plugin, hydra.*) are checked here too, before any job
    sweep_cfg = hydra.compose_config(config_name="config", overrides=hydra_args, run_mode=RunMode.MULTIRUN)
    _keep_task_name()
    if jobs is not None and train_jobs is not None and "hydra/launcher" not in user_keys:
        swept = swept_keys(parsed)
        named = [_named(job, seeds, swept) for job in jobs]
        groups = population_groups(named, seeds)
        if any(len(g) > 1 for g in groups):
            return _run_populations(jobs, named, groups, seeds, train_one, train_jobs)
    seeds_text = f"seeds {','.join(map(str, seeds))}" if seeds else "the config's seed"
    launcher = str(sweep_cfg.hydra.launcher.get("_target_", "?")).rsplit(".", 1)[-1]
    print(f"{PROG}: {count} on {launcher}, each one experiment over {seeds_text}; Hydra's files in "
          f"{sweep_cfg.hydra.sweep.dir}/", file=sys.stderr, flush=True)
    return _statuses(hydra.multirun(config_name="config", task_function=functools.partial(_job, seeds=seeds,
                                                                                         swept=swept_keys(parsed),
                                                                                         train_one=train_one),
                                    overrides=hydra_args))


def _run_populations(jobs: List[List[str]], named: List[List[str]], groups: List[List[int]],
                     seeds: Optional[List[int]], train_one: Callable[[List[str], List[int]], int],
                     train_jobs: Callable[[List[List[str]], List[int]], List[int]]) -> List[Tuple[int, List[str], int]]:
    """Run the sweep's ``groups`` of jobs in order: a group of several jobs as one population (``train_jobs``), a
    group of one with ``train_one``; an interrupted group stops the sweep (KeyboardInterrupt)."""
    seeds_text = f"seeds {','.join(map(str, seeds))}" if seeds else "the config's seed"
    together = sum(len(g) for g in groups if len(g) > 1)
    print(f"{PROG}: {len(jobs)} job(s), each one experiment over {seeds_text}; {together} of them train as "
          f"{sum(1 for g in groups if len(g) > 1)} population(s) in one vectorised pass (they differ only in eta_l or "
          "in rule parameters a replica carries), here rather than by Hydra's launcher (no Hydra files)",
          file=sys.stderr, flush=True)
    out: List[Tuple[int, List[str], int]] = []
    for group in groups:
        for num in group:
            label = " ".join(jobs[num]).replace("$\\{", "${").replace("\\}", "}")  # Hydra's escapes undone
            print(f"{PROG}: job #{num}: {label or '(defaults)'}" +
                  (f" (seeds {','.join(map(str, seeds))})" if seeds else ""), file=sys.stderr, flush=True)
        try:
            if len(group) == 1:
                statuses = [train_one(named[group[0]], list(seeds or []))]
            else:
                statuses = train_jobs([named[n] for n in group], list(seeds or []))
        except Exception:  # noqa: BLE001  a bug: report it, let the other jobs run, fail the sweep (as _job)
            traceback.print_exc()
            statuses = [1] * len(group)
        finally:
            _keep_task_name()
        out += [(num, jobs[num], status) for num, status in zip(group, statuses)]
        sys.stdout.flush()
        sys.stderr.flush()
        if 130 in statuses:
            raise KeyboardInterrupt  # the same command again resumes
    return out


def _sweep_status(results: List[Tuple[int, List[str], int]]) -> int:
    """Say on stderr which jobs failed and how many succeeded; returns the worst job's exit status (0: none
    failed)."""
    failed = [(n, o, s) for n, o, s in results if s != 0]
    for num, ovr, status in failed:
        print(f"{PROG}: job #{num} ({' '.join(ovr) or 'defaults'}) exited with status {status}", file=sys.stderr)
    print(f"{PROG}: {len(results) - len(failed)} of {len(results)} job(s) succeeded", file=sys.stderr)
    return max((s for _, _, s in failed), default=0)


def multirun(args: Sequence[str], train_one: Callable[[List[str], List[int]], int],
             train_jobs: Optional[Callable[[List[List[str]], List[int]], List[int]]] = None) -> int:
    """``fl-train -m OVERRIDES``: one experiment per combination of the swept values, launched by Hydra.

    Args:
        args: the command line without ``-m`` / ``--multirun``: Hydra overrides, app keys and ``hydra.*`` /
            ``hydra/...`` alike; ``seed=...`` lists become every job's seed list.
        train_one: trains one job's experiment (its overrides, its seeds) and returns its exit status:
            :func:`pipeline.train.train_one` (a module-level function, so that a launcher can pickle the jobs).
        train_jobs: trains several jobs' experiments as one population and returns each one's exit status
            (:func:`pipeline.train.train_jobs`); None: every job by ``train_one``.

    Returns:
        The exit status: 0 when every job succeeded, else the worst job's (1 a seed failed, 2 bad input,
        3 the environment failed, 130 interrupted).

    Raises:
        SystemExit(2): bad input, with one ``error:`` line, before any job runs.
    """
    from hydra import version
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .common import fail

    args = list(args)
    bad = [a for a in args if a.startswith("-")]
    if bad:
        fail(f"unknown option {bad[0]} with -m (see --help)")
    version.setbase("1.3")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        hydra = _sweep_hydra()
        try:
            results = _launch(hydra, args, train_one, train_jobs)
        except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as err:
            fail(_missing_plugin(envfail.first_line(err)))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume (finished experiments are not "
              "rerun)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        GlobalHydra.instance().clear()
    return _sweep_status(results)
