"""The experiment grid of ``params.yaml``: shared settings + one entry per experiment + seeds.

``params.yaml`` layout::

    seeds: [1, 2, 3]
    dataset: {name: digits}          # shared sections: same keys as conf/, applied to every experiment
    partition: {num_clients: 20}
    train: {rounds: 40, ...}          # `dvc exp run -S train.rounds=5` edits these
    experiments:
      fedavg_iid: {algorithm: fedavg, partition: iid}   # Hydra overrides of this experiment
      fedbug20_dir: {algorithm: fedbug, algorithm.fedbug.gu_percentage: 0.2, partition: dirichlet}

An optional ``report`` section holds what the report of a study adds: ``layouts``, the study's own table layouts,
Python files beside the params file (paths relative to it), each with a function ``layout(experiments) -> list
of markdown lines`` (:func:`pipeline.report.load_layouts`; FedBug's paper layout is ``studies/fedbug/layout.py``)::

    report:
      layouts: [layout.py]

Shared sections become dotted value overrides (``train.rounds=40``); a ``name`` in the shared
``dataset``, ``partition`` or ``model`` section chooses that config group (``partition: {name: shards}``
-> ``partition=shards``). Experiment entries may also choose config groups (``partition: dirichlet``);
experiment entries win over shared values and shared group choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from fl_core.schema import ConfigError, format_value

GRID_KEYS = ("seeds", "experiments")
SHARED_SECTIONS = ("dataset", "partition", "model", "algorithm", "train", "engine", "tracking")


GROUP_SECTIONS = ("dataset", "partition", "model")  # a shared ``name`` key of these chooses the config group


def _dotted(section: str, d: Any) -> List[str]:
    if not isinstance(d, dict):
        return [f"{section}={format_value(d)}"]
    out: List[str] = []
    for k, v in d.items():
        out.extend(_dotted(f"{section}.{k}", v))
    return out


def _shared(section: str, d: Any) -> List[str]:
    """Overrides of a shared section: ``partition: {name: shards, num_clients: 10}`` chooses the group
    (``partition=shards``, with that file's defaults, conf/partition/shards.yaml) and sets the values."""
    if section in GROUP_SECTIONS and isinstance(d, dict) and isinstance(d.get("name"), str):
        from fl_core.paths import conf_dir

        if (conf_dir() / section / f"{d['name']}.yaml").exists():
            rest = {k: v for k, v in d.items() if k != "name"}
            return [f"{section}={d['name']}"] + _dotted(section, rest)
    return _dotted(section, d)


@dataclass
class Grid:
    seeds: List[int]
    shared: List[str]  # overrides from the shared sections
    experiments: Dict[str, List[str]]  # name -> its own overrides
    layouts: List[Path] = field(default_factory=list)  # report.layouts: the study's table layouts (Python files)
    # first-seed configs composed so far, by experiment (check_shared reads the others' from here)
    _first: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def overrides(self, name: str, seed: int) -> List[str]:
        """All overrides of experiment ``name`` for ``seed`` (shared first, the experiment's after; a config
        group the experiment chooses, e.g. ``partition=iid``, replaces the shared choice of that group)."""
        if name not in self.experiments:
            raise ConfigError(f"experiments: no experiment named {name!r} in params.yaml "
                              f"(known: {', '.join(self.experiments)})")
        own = self.experiments[name]
        chosen = {o.split("=", 1)[0] for o in own if "." not in o.split("=", 1)[0]}
        shared = [o for o in self.shared if o.split("=", 1)[0] not in chosen]
        return shared + own + [f"seed={seed}", f"name={name}"]

    def compose_all(self, name: str) -> list:
        """Composed and validated configs of every seed of ``name``.

        The experiment's own overrides must each change its run; a key of the shared sections is a setting of
        the whole grid (``algorithm.fedprox.mu`` for the experiments that run FedProx) and must change the run of
        at least one experiment (:meth:`check_shared`).

        Raises:
            ConfigError: naming the experiment and the offending key.
        """
        from fl_core.config import compose  # the schema imports the rules (torch): only when composing

        cfgs = []
        for s in self.seeds:
            try:
                cfgs.append(compose(self.overrides(name, s), user=self.experiments[name]))
            except ConfigError as err:
                raise ConfigError(f"experiments.{name}: {err}") from None
        self._first[name] = cfgs[0]
        self.check_shared(name, cfgs[0])
        return cfgs

    def check_shared(self, name: str, cfg) -> None:
        """Every shared key that experiment ``name`` (composed: ``cfg``) does not use must be used by another
        experiment of the grid; the others are composed only for such keys, once each.

        Raises:
            ConfigError: ``<key>: no experiment of the grid uses it (<why, for experiment name>)``.
        """
        from fl_core.config import compose, inactive_keys, override_keys

        unused = inactive_keys(cfg, override_keys(self.shared))
        for other in self.experiments:
            if not unused:
                return
            if other == name:
                continue
            other_cfg = self._first.get(other)
            if other_cfg is None:
                other_cfg = self._first[other] = compose(self.overrides(other, self.seeds[0]), user=[])
            unused = {k: why for k, why in unused.items() if k in inactive_keys(other_cfg, [k])}
        if unused:
            key, why = next(iter(unused.items()))
            raise ConfigError(f"{key}: no experiment of the grid uses it ({name}: {why})")


def _read_text(path: Path, what: str) -> str:
    """The text of ``path``; ``what`` says what the file is, for the message.

    Raises:
        ConfigError: ``<path>: file not found (<what>)``, or the file cannot be read (a folder, no
            permission, not UTF-8 text); one line naming the file as given.
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found ({what})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a file ({what})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the file ({err.strerror or type(err).__name__})") from None
    except UnicodeDecodeError as err:
        line = err.object[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not a UTF-8 text file (line {line}: {err.reason})") from None


def load_yaml(path: Path, what: str) -> Any:
    """The parsed content of the YAML file ``path`` (``what`` says what it is, for the messages).

    Raises:
        ConfigError: one line naming ``path`` as given: file not found / unreadable (see
            :func:`_read_text`), or ``<path>: YAML syntax error at line L, column C: <problem>``
            (1-based, where the parser stopped).
    """
    text = _read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        if mark is not None:
            line, column = mark.line + 1, mark.column + 1
        elif isinstance(getattr(err, "position", None), int):  # ReaderError: a character YAML forbids
            before = text[: err.position]
            line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        else:
            line = column = None
        lines = str(err).strip().splitlines()
        problem = getattr(err, "problem", None) or (lines[0] if lines else type(err).__name__)
        where = f" at line {line}, column {column}" if line is not None else ""
        raise ConfigError(f"{path}: YAML syntax error{where}: {' '.join(str(problem).split())}") from None


def load_grid(path: Path = Path("params.yaml")) -> Grid:
    """Read the grid from ``path``.

    Raises:
        ConfigError: one line naming the file as given: missing or unreadable file, a YAML syntax error
            (with line and column), a top level that is not a mapping, no experiments, or a malformed
            entry (names the key).
    """
    path = Path(path)
    raw = load_yaml(path, "the experiment grid")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys such as seeds, experiments, train; "
                          f"got a {type(raw).__name__}")
    unknown = sorted(str(k) for k in set(raw) - set(GRID_KEYS) - set(SHARED_SECTIONS) - {"report"})
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r} "
                          f"(allowed: {', '.join(GRID_KEYS + SHARED_SECTIONS + ('report',))})")
    seeds = raw.get("seeds", [0])
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, got {seeds!r}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"{path}: seeds lists seed {twice[0]} more than once (each seed is one run of the mean "
                          f"+- std), got {seeds!r}")
    exps = raw.get("experiments") or {}
    if not isinstance(exps, dict) or not exps:
        raise ConfigError(f"{path}: experiments must map experiment names to overrides")
    experiments: Dict[str, List[str]] = {}
    for name, ov in exps.items():
        if not str(name).replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"experiments.{name}: names may hold letters, digits, '_' and '-' only")
        if not isinstance(ov, dict):
            raise ConfigError(f"experiments.{name} must be a mapping of overrides, got {ov!r}")
        experiments[str(name)] = [f"{k}={format_value(v)}" for k, v in ov.items()]
    shared: List[str] = []
    for section in SHARED_SECTIONS:
        if section in raw and raw[section] is not None:
            shared.extend(_shared(section, raw[section]))
    return Grid([int(s) for s in seeds], shared, experiments, _layouts(path, raw.get("report")))


def _layouts(path: Path, report: Any) -> List[Path]:
    """The files of ``report.layouts`` in the grid file ``path``, resolved against its folder.

    Raises:
        ConfigError: ``report`` is not a mapping, ``layouts`` not a list of file names, or a file that is not
            there or not a Python file (one line naming the file and the key).
    """
    if report is None:
        return []
    if not isinstance(report, dict):
        raise ConfigError(f"{path}: report must be a mapping, got {report!r}")
    names = report.get("layouts") or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{path}: report.layouts must be a list of Python files (relative to {path.name}), "
                          f"got {names!r}")
    out = []
    for i, name in enumerate(names):
        f = path.parent / name
        if f.suffix != ".py":
            raise ConfigError(f"{path}: report.layouts[{i}]={name} is not a Python file (.py)")
        if not f.is_file():
            raise ConfigError(f"{path}: report.layouts[{i}]={name}: file not found ({f.as_posix()})")
        out.append(f)
    return out


# --------------------------------------------------------------------------- dvc.yaml sync

BEGIN_MARK = "# BEGIN grid deps"
END_MARK = "# END grid deps"
PLOTS_BEGIN = "# BEGIN grid plots"
PLOTS_END = "# END grid plots"


def report_deps(grid: Grid, results_dir: str = "results") -> List[str]:
    """The report stage's dependencies in a study's dvc.yaml: every experiment's metrics.json,
    experiment.json and runs.csv."""
    return [f"{results_dir}/{n}/{f}" for n in grid.experiments
            for f in ("metrics.json", "experiment.json", "runs.csv")]


TRAIN_BEGIN = "# BEGIN grid train"
TRAIN_END = "# END grid train"
ROWS = "{rows}"  # where a train stage's command names its rows (``--grid A,B``)


def train_groups(grid: Grid) -> List[List[str]]:
    """The experiments of ``grid`` grouped into the rows that can share a pass, in order of each group's first row:
    rows whose first seed's configs have the same population key (:func:`pipeline.multirun.population_groups`: the
    vectorised executor with ``engine.population`` on, the same data, partition, model, rule stack and local-step
    settings; they differ in the seed or in keys a replica carries, :func:`fl_core.config.replica_keys`) form one
    group; every other row a group of its own. (As :func:`pipeline.multirun.population_groups` groups the jobs of
    ``fl-train -m``, with each row composed as its grid stage composes it.)

    Raises:
        ConfigError: a row's overrides do not compose (naming the row and the key).
    """
    from fl_core.config import compose

    from .multirun import group_by_key, population_key

    names = list(grid.experiments)
    keys = []
    for name in names:
        try:
            cfg = compose(grid.overrides(name, grid.seeds[0]), user=grid.experiments[name])
        except ConfigError as err:
            raise ConfigError(f"experiments.{name}: {err}") from None
        keys.append(population_key(cfg))
    return [[names[i] for i in group] for group in group_by_key(keys)]


def train_stage_name(rows: List[str]) -> str:
    """The DVC stage of ``rows``: ``train-<row>``, or ``train-<first>-and-<n>-more`` for a group."""
    return f"train-{rows[0]}" if len(rows) == 1 else f"train-{rows[0]}-and-{len(rows) - 1}-more"


@dataclass
class TrainTemplate:
    """The shape every generated train stage of a study follows, read from the first stage of its block: the command
    with :data:`ROWS` where it names the rows, the deps, the params not of one row, and the outputs (``outs``,
    ``metrics``, ``plots``) of one row as paths relative to ``results/<row>/`` with their options."""

    cmd: str
    deps: List[Any]
    params: List[Any]
    per_row: Dict[str, List[Any]]  # section -> [(path under results/<row>/, options or None)]
    results: str = "results"

    @classmethod
    def from_stage(cls, name: str, stage: Dict, where: str) -> "TrainTemplate":
        """The template of the generated stage ``stage`` (named ``name``, in the file ``where``).

        Raises:
            ConfigError: the command does not name its rows with ``--grid A[,B...]``, or an output of the first
                row lies outside ``results/<row>/``.
        """
        import re

        cmd = str(stage.get("cmd", ""))
        m = re.search(r"--grid (\S+)", cmd)
        if m is None:
            raise ConfigError(f"{where}: stage {name}: its cmd must name the rows with --grid A[,B...]")
        first = m.group(1).split(",")[0]
        per_row: Dict[str, List[Any]] = {}
        for section in ("outs", "metrics", "plots"):
            for entry in stage.get(section) or []:
                path, opts = (entry, None) if isinstance(entry, str) else next(iter(entry.items()))
                prefix = f"results/{first}/"
                if not str(path).startswith(prefix):
                    if str(path).startswith("results/"):
                        continue  # another row of the group
                    raise ConfigError(f"{where}: stage {name}: output {path} lies outside results/<row>/")
                per_row.setdefault(section, []).append((str(path)[len(prefix):], opts))
        params = [p for p in stage.get("params") or [] if not (isinstance(p, str) and p.startswith("experiments."))]
        return cls(cmd[: m.start(1)] + ROWS + cmd[m.end(1):], list(stage.get("deps") or []), params, per_row)

    def stage(self, rows: List[str]) -> Dict:
        """The DVC stage that trains ``rows``."""
        out: Dict[str, Any] = {"cmd": self.cmd.replace(ROWS, ",".join(rows)), "deps": list(self.deps),
                               "params": list(self.params) + [f"experiments.{r}" for r in rows]}
        for section, entries in self.per_row.items():
            out[section] = [f"{self.results}/{r}/{path}" if opts is None else {f"{self.results}/{r}/{path}": opts}
                            for r in rows for path, opts in entries]
        return out


class _NoAliases(yaml.SafeDumper):
    """Every stage spelled out (no ``&id`` anchors for the options the stages share)."""

    def ignore_aliases(self, data):  # noqa: ARG002
        return True


def train_block(lines: List[str], grid: Grid, where: str) -> Optional[List[str]]:
    """``lines`` of a dvc.yaml with the stages between ``# BEGIN grid train`` and ``# END grid train`` generated
    from ``grid`` (:func:`train_groups`), each after the shape of the block's first stage (:class:`TrainTemplate`);
    None when the markers are absent.

    Raises:
        ConfigError: the block holds no stage, or its first stage is not a train stage of this shape.
    """
    bounds = _block(lines, TRAIN_BEGIN, TRAIN_END)
    if bounds is None:
        return None
    b, e, indent = bounds
    block = yaml.safe_load("".join(l[len(indent):] if l.startswith(indent) else l for l in lines[b + 1:e])) or {}
    if not isinstance(block, dict) or not block:
        raise ConfigError(f"{where}: the '{TRAIN_BEGIN}' block holds no stage to follow (write one train stage "
                          f"with --grid <row> in it)")
    name, first = next(iter(block.items()))
    template = TrainTemplate.from_stage(name, first, where)
    stages = {train_stage_name(rows): template.stage(rows) for rows in train_groups(grid)}
    text = yaml.dump(stages, Dumper=_NoAliases, sort_keys=False, default_flow_style=None, width=120)
    body = []
    for i, line in enumerate(text.splitlines()):
        if i and not line.startswith(" "):
            body.append("\n")  # a blank line between two stages
        body.append(f"{indent}{line}\n")
    return lines[: b + 1] + body + lines[e:]


def _replace_block(lines: List[str], begin: str, end: str, items: List[str]) -> Optional[List[str]]:
    """``lines`` with the list items between the ``begin`` and ``end`` marker lines replaced by ``items``
    (indented as the begin marker); None when the markers are absent."""
    bounds = _block(lines, begin, end)
    if bounds is None:
        return None
    b, e, indent = bounds
    return lines[: b + 1] + [f"{indent}- {x}\n" for x in items] + lines[e:]


def _block(lines: List[str], begin: str, end: str) -> Optional[tuple]:
    """(the ``begin`` marker's line, the ``end`` marker's line, the begin marker's indentation), or None when a
    marker is absent."""
    try:
        b = next(i for i, l in enumerate(lines) if l.strip().startswith(begin))
        e = next(i for i, l in enumerate(lines) if l.strip().startswith(end))
    except StopIteration:
        return None
    return b, e, lines[b][: len(lines[b]) - len(lines[b].lstrip())]


def sync_dvc(dvc_yaml: Path, grid: Grid) -> bool:
    """Rewrite the generated blocks of ``dvc_yaml`` from ``grid``; True if the file changed.

    Three blocks exist: the train stages (``# BEGIN grid train``, in the studies' pipelines: one stage per group of
    rows that can share a pass, :func:`train_block`), the report stage's deps (``# BEGIN grid deps``: every
    experiment's result files, in the studies' pipelines) and the fields of the overlay chart
    (``# BEGIN grid plots``: one line per experiment, in the project's pipeline).

    Raises:
        ConfigError: ``dvc_yaml`` is missing, unreadable or cannot be written, or has neither block
            (one line naming the file).
    """
    text = _read_text(dvc_yaml, "the DVC pipeline")
    lines = text.splitlines(keepends=True)
    generated = train_block(lines, grid, str(dvc_yaml))
    found = generated is not None
    lines = generated if found else lines
    for begin, end, items in ((BEGIN_MARK, END_MARK, report_deps(grid)),
                              (PLOTS_BEGIN, PLOTS_END, list(grid.experiments))):
        replaced = _replace_block(lines, begin, end, items)
        if replaced is not None:
            lines, found = replaced, True
    if not found:
        raise ConfigError(f"{dvc_yaml}: no generated block (the '{TRAIN_BEGIN}' / '{TRAIN_END}' markers of the "
                          f"train stages, '{BEGIN_MARK}' / '{END_MARK}' of the report deps or '{PLOTS_BEGIN}' / "
                          f"'{PLOTS_END}' of the plots)")
    new = "".join(lines)
    if new != text:
        try:
            Path(dvc_yaml).write_text(new, encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{dvc_yaml}: cannot write the file ({err.strerror or type(err).__name__})") from None
        return True
    return False


def main(argv=None) -> int:
    """``python -m pipeline.grid sync-dvc | list``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("sync-dvc", "list"):
        print("usage: python -m pipeline.grid sync-dvc   update the generated blocks of dvc.yaml from params.yaml\n"
              "       python -m pipeline.grid list       print the experiments and their overrides")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        grid = load_grid(Path("params.yaml"))
        if argv[0] == "list":
            for name, ov in grid.experiments.items():
                print(f"{name}: {' '.join(ov)}")
            return 0
        changed = sync_dvc(Path("dvc.yaml"), grid)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("dvc.yaml updated" if changed else "dvc.yaml already in sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
