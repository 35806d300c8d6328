"""``make studies-status``: which paper study is stale against the code, and how long its refresh takes.

For every folder ``studies/<s>/`` with a ``dvc.yaml`` this asks DVC (``dvc status --json`` in that folder) which of
its stages would run again, and reads the last measured refresh of the study from ``studies/refresh_times.csv``
(wall and CPU minutes of a ``dvc repro`` of the study, the machine, the date and the commit it ran on;
``make study-refresh STUDY=<s>`` runs that ``dvc repro`` timed and appends a row; the newest row per study counts). Prints one Markdown table row per
study::

    | study | stages | changed | not built here | last refresh | committed report |

``changed`` counts the stages DVC would run because something they are made from changed (``train-<experiment>`` one
each, or one per group of rows): the code, a parameter, the command, or an output that git holds; ``not built here`` counts the other stages DVC
would run, whose only difference is an output or a dependency that is absent and that git does not hold (the study's
data folders and per-row results on a fresh clone: they are rebuilt, nothing changed) (:func:`classify`);
``committed report`` says whether ``studies/<s>/results/report.md`` is in git. Exit status 0 whatever the state (it reports, it does not check);
2 when DVC cannot be run (one line).

    python -m pipeline.studies_status            # every study
    python -m pipeline.studies_status fedbug     # one
    python -m pipeline.studies_status --refresh fedbug   # dvc repro there, timed into refresh_times.csv
    python -m pipeline.studies_status --verify   # and rerun every row's first rounds against the fingerprint

A study that reads local data files (not bundled or generated) and cannot find them says so under the table, with
the data source's line (where the files go) and the one command that refreshes it once they are there
(:func:`needs_data`). ``--verify`` adds a column: every row's first rounds trained again on this code and compared
with the study's committed ``results/fingerprint.json`` (:mod:`pipeline.fingerprint`, tolerance-based): ``current``
when every row agrees, else the rows that changed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from fl_core.store import procs

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ROOT / "studies"
REFRESH_TIMES = STUDIES / "refresh_times.csv"
REFRESH_COLUMNS = ("study", "wall_min", "cpu_min", "machine", "date", "commit")


def dvc_command() -> List[str]:
    """The DVC of the project's environment (``.venv/bin/dvc`` beside the interpreter running this), else ``dvc``
    on PATH."""
    here = Path(sys.executable).parent / "dvc"
    if here.exists():
        return [str(here)]
    found = shutil.which("dvc")
    if found is None:
        raise FileNotFoundError("dvc not found beside this python or on PATH (run `make setup`)")
    return [found]


class StudyBusy(RuntimeError):
    """A study whose DVC lock another command holds: its status cannot be read now (the row says so)."""


def stale_entries(folder: Path) -> Dict[str, list]:
    """``{stage: its dvc status --json entries}`` for the stages of ``folder/dvc.yaml`` (not of a ``dvc.yaml`` in a
    subfolder) that ``dvc status`` says would run again (``{}``: up to date).

    Raises:
        StudyBusy: another DVC command holds the study's lock (a ``dvc repro`` or refresh running there).
        RuntimeError: DVC failed (its last line).
    """
    res = subprocess.run([*dvc_command(), "status", "--json", "dvc.yaml"], cwd=folder, capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        out = res.stderr or res.stdout
        if "rwlock" in out or "Unable to acquire lock" in out:
            raise StudyBusy(f"{folder.name}: another DVC command runs in this study (a dvc repro or study-refresh)")
        tail = out.strip().splitlines()
        raise RuntimeError(f"dvc status in {folder.relative_to(ROOT)}: {tail[-1] if tail else res.returncode}")
    return json.loads(res.stdout or "{}")


CHANGED, NOT_BUILT = "changed", "not built"


def classify(changes: List[dict], tracked: Callable[[str], bool]) -> Optional[str]:
    """Why a stage would run again, from its ``dvc status --json`` entries: :data:`CHANGED` (a dependency modified or
    new, a parameter, the command, an output modified, or absent while git holds it), :data:`NOT_BUILT` (only
    outputs and dependencies that are absent and that git does not hold, ``tracked(path)`` False: regenerable), None
    (nothing).

    ``changes`` looks like ``[{"changed deps": {"code/fl_core": "modified", "data/prepared": "deleted"}},
    {"changed outs": {"results/x/runs.csv": "not in cache"}}, "always changed"]``; a parameter file's entry holds a
    dict of its changed keys."""
    why = None
    for entry in changes:
        if not isinstance(entry, dict):
            return CHANGED  # "always changed", "changed command"
        for kind, paths in entry.items():
            if kind not in ("changed deps", "changed outs") or not isinstance(paths, dict):
                return CHANGED
            for path, state in paths.items():
                absent = state in ("deleted", "not in cache")
                if isinstance(state, dict) or not absent or tracked(path):
                    return CHANGED
                why = NOT_BUILT
    return why


def git_files(folder: Path) -> Callable[[str], bool]:
    """Whether a path relative to ``folder`` is held by git (a file, or a folder holding one)."""
    res = subprocess.run(["git", "ls-files", "-z", "."], cwd=folder, capture_output=True, check=False)
    files = [f for f in res.stdout.decode().split("\0") if f] if res.returncode == 0 else []
    held = set(files)
    for f in files:  # and every folder above a held file
        parts = Path(f).parts
        held.update(str(Path(*parts[:i])) for i in range(1, len(parts)))
    return lambda path: os.path.normpath(path) in held


def stage_count(folder: Path) -> int:
    """How many stages ``dvc.yaml`` of ``folder`` expands to (``foreach`` over ``experiments`` counted per entry),
    from ``dvc stage list``."""
    res = subprocess.run([*dvc_command(), "stage", "list", "--name-only", "dvc.yaml"], cwd=folder, check=False,
                         capture_output=True, text=True)
    return len([ln for ln in res.stdout.splitlines() if ln.strip()]) if res.returncode == 0 else 0


def refresh_times(path: Path = REFRESH_TIMES) -> Dict[str, Dict[str, str]]:
    """The newest row of ``studies/refresh_times.csv`` per study (``{}`` when the file is absent)."""
    if not path.exists():
        return {}
    rows: Dict[str, Dict[str, str]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            rows[row["study"]] = row
    return rows


def studies(names: Optional[List[str]] = None) -> List[Path]:
    """The study folders (those holding a ``dvc.yaml``), or the named ones.

    Raises:
        FileNotFoundError: a named study has no ``studies/<name>/dvc.yaml``.
    """
    if not names:
        return sorted(p.parent for p in STUDIES.glob("*/dvc.yaml"))
    out = []
    for n in names:
        if not (STUDIES / n / "dvc.yaml").exists():
            known = ", ".join(p.parent.name for p in sorted(STUDIES.glob("*/dvc.yaml")))
            raise FileNotFoundError(f"study {n!r}: no studies/{n}/dvc.yaml (studies: {known})")
        out.append(STUDIES / n)
    return out


READ_FREE = ("digits", "synthetic", "mnist1d", "quadratic")  # bundled or generated: no local files needed


def needs_data(folder: Path) -> Optional[str]:
    """Why the study in ``folder`` cannot run here, or None: a dataset of its grid that is read from local files
    (not bundled or generated) whose files are absent; the data source's own one-line message (where the files go).
    Nothing is written; a study whose ``data/prepared`` holds a prepared dataset is taken as able to run."""
    import yaml

    from fl_core.config import ConfigError, compose
    from fl_core.data import DataSourceError
    from fl_core.data.access import dataset_for

    from .grid import load_grid

    if (folder / "data" / "prepared").is_dir() and any((folder / "data" / "prepared").iterdir()):
        return None
    raw = yaml.safe_load((folder / "params.yaml").read_text()) or {}
    if not isinstance(raw.get("dataset"), dict) or raw["dataset"].get("name") in READ_FREE:
        if not any(str(k).startswith("dataset") for ov in (raw.get("experiments") or {}).values() for k in ov):
            return None
    grid = load_grid(folder / "params.yaml")
    names = list(grid.experiments)
    rows = [names[0]] + [n for n in names[1:] if any(o.startswith("dataset") for o in grid.experiments[n])]
    from .fingerprint import inside

    with inside(folder):  # the study's relative data paths
        seen = set()
        for name in rows:
            try:
                cfg = compose(grid.overrides(name, grid.seeds[0]), user=grid.experiments[name])
            except ConfigError:
                continue  # a bad row is the stage's to report
            if cfg.dataset.name in READ_FREE or cfg.dataset.name in seen:
                continue
            seen.add(cfg.dataset.name)
            try:
                dataset_for(cfg, write_cache=False)
            except DataSourceError as err:
                return str(err).splitlines()[0]
    return None


def refresh_machine() -> str:
    """The machine as a refresh records it: CPU and cores, and the 15-minute load average at the refresh's end (a
    refresh runs one training process: a load well above 1 means other work shared the cores, and the wall time is
    not comparable; the CPU time is)."""
    try:
        load = f", load {os.getloadavg()[2]:.1f}"
    except OSError:  # no load average on this platform
        load = ""
    return f"{procs.machine()}{load}"


def refresh(folder: Path, path: Path = REFRESH_TIMES) -> int:
    """``dvc repro`` in ``folder`` (the project's environment first on PATH, as ``make repro`` runs it), timed: wall
    and CPU minutes (the children's user + system time) appended to ``studies/refresh_times.csv`` with the machine,
    the date and the commit; DVC's exit status (a failed refresh appends nothing)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    code = subprocess.run([*dvc_command(), "repro"], cwd=folder, env=env, check=False).returncode
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        return code
    from .fingerprint import write as write_fingerprint

    written = write_fingerprint(folder)
    print(f"{folder.name}: fingerprint of every row's first rounds in {written.relative_to(ROOT)}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, check=False,
                            text=True).stdout.strip() or "?"
    machine = refresh_machine()
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(REFRESH_COLUMNS)
        w.writerow([folder.name, f"{wall / 60:.1f}", f"{cpu / 60:.1f}", machine, time.strftime("%Y-%m-%d"), commit])
    stamp_report(folder, f"{machine}, commit {commit}, {time.strftime('%Y-%m-%d')}, `make study-refresh "
                         f"STUDY={folder.name}` in {wall / 60:.1f} min ({cpu / 60:.1f} min of CPU)", env)
    print(f"{folder.name}: refreshed in {wall / 60:.1f} min ({cpu / 60:.1f} min of CPU); {path.relative_to(ROOT)}")
    return 0


PRODUCED = "> Produced on "


def stamp_report(folder: Path, produced: str, env: Optional[dict] = None) -> None:
    """Name where ``folder``'s report was produced: a first line ``> Produced on <produced>.`` in
    ``results/report.md`` (replacing an earlier one), then ``dvc commit`` of the report stage, so that DVC takes the
    stamped file as the stage's output (the study stays up to date). Nothing when the study has no report."""
    report = folder / "results" / "report.md"
    if not report.exists():
        return
    lines = report.read_text().splitlines(keepends=True)
    if lines and lines[0].startswith(PRODUCED):
        lines = lines[1:]
        if lines and not lines[0].strip():
            lines = lines[1:]
    report.write_text(f"{PRODUCED}{produced}.\n\n" + "".join(lines))
    subprocess.run([*dvc_command(), "commit", "--force", "report"], cwd=folder, env=env, check=True,
                   capture_output=True)


def verify_rows(folder: Path, missing: Optional[str]) -> str:
    """The verify column of ``folder``: ``current (n rows)``, ``changed: k of n rows (<row>: <first difference>)``,
    or why it cannot be said (no fingerprint, local data files needed); one line per changed row on stderr."""
    from fl_core.data import DataSourceError

    from . import fingerprint

    if missing is not None:  # needs_data(folder)
        return "needs local data files (below)"
    try:
        tell = sys.stderr.isatty()  # the row in training, on a terminal only
        checks = fingerprint.verify(folder, progress=lambda row: tell and print(
            f"  {folder.name}: {row} ...".ljust(60), end="\r", file=sys.stderr, flush=True))
    except FileNotFoundError:
        return f"no fingerprint (make study-refresh STUDY={folder.name} writes one)"
    except DataSourceError as err:
        return f"needs local data files ({str(err).splitlines()[0]})"
    if tell:
        print(" " * 60, end="\r", file=sys.stderr)
    changed = [c for c in checks if c.status == fingerprint.CHANGED]
    for c in changed:
        print(f"{folder.name}: {c.row}: {c.detail}", file=sys.stderr)
    if not changed:
        return f"current ({len(checks)} rows)"
    return f"changed: {len(changed)} of {len(checks)} rows ({changed[0].row}: {changed[0].detail})"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.studies_status",
                                description="Which paper study is stale against the code, and its refresh time.")
    p.add_argument("study", nargs="*", help="study folder names under studies/ (default: all)")
    p.add_argument("--refresh", action="store_true", help="run `dvc repro` in each named study, timed, record the "
                   "time in studies/refresh_times.csv and write the study's fingerprint (results/fingerprint.json)")
    p.add_argument("--verify", action="store_true", help="train the first rounds of every row again and compare "
                   "them with the study's committed fingerprint: current / changed per study (a few minutes)")
    args = p.parse_args(argv)
    try:
        folders = studies(args.study)
        if args.refresh:
            if not args.study:
                print("error: --refresh needs the study names (python -m pipeline.studies_status --refresh STUDY ...)",
                      file=sys.stderr)
                return 2
            return max(refresh(folder) for folder in folders)
        times = refresh_times()
        verify = " verified on this code (first rounds of every row) |" if args.verify else ""
        print("| study | stages | changed | not built here | last refresh (wall / CPU, machine, date, commit) | "
              f"committed report |{verify}")
        print("|---|---:|---:|---:|---|---|" + ("---|" if args.verify else ""))
        notes = []
        for folder in folders:
            tracked = git_files(folder)
            t = times.get(folder.name)
            last = (f"{t['wall_min']} / {t['cpu_min']} min, {t['machine']}, {t['date']}, {t['commit']}"
                    if t else "never measured")
            report = "yes" if tracked("results/report.md") else "no"
            try:
                why = [classify(changes, tracked) for changes in stale_entries(folder).values()]
            except StudyBusy:
                print(f"| {folder.name} | {stage_count(folder)} | busy: a DVC command runs here | | {last} | {report} |"
                      + (" not verified while it runs |" if args.verify else ""), flush=True)
                continue
            built = str(why.count(NOT_BUILT))
            missing = needs_data(folder) if (why.count(NOT_BUILT) or why.count(CHANGED) or args.verify) else None
            if missing is not None:
                built += " (needs local data files)"
                notes.append(f"{folder.name}: needs local data files: {missing}\n  once they are there: "
                             f"make study-refresh STUDY={folder.name}")
            cells = f"| {folder.name} | {stage_count(folder)} | {why.count(CHANGED)} | {built} | {last} | {report} |"
            if args.verify:
                cells += f" {verify_rows(folder, missing)} |"
            print(cells, flush=True)
        for note in notes:
            print(note)
    except (FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
