#!/usr/bin/env python3
"""Every shell command that README.md and docs/cli.md print, run as printed in a fresh clone from a plain shell.

The commands are read from the ```bash blocks of the two files (a line ending in ``\\`` continues on the next); each
must have an entry in :data:`PLAN`: ``run`` (run as printed, in order, in one clone), ``long`` (the same, with
``--all`` only: minutes each) or ``skip: <why>`` (it needs what a fresh machine does not have: CIFAR files, a Slurm
cluster, a network). ``tests/test_readme_commands.py`` checks that every printed command has an entry and that
each program it starts exists, so a command added to the docs is either run here or said why not.

A plain shell: ``PATH=/usr/bin:/bin``, no virtual environment active, ``HOME`` a fresh folder (no cache, no MLflow
store of the user's); docs/cli.md's commands run after ``. .venv/bin/activate``, as that page says. The clone is
``git clone`` of this repository's HEAD; ``--venv DIR`` links an existing environment as its ``.venv`` instead of
building one (``make setup``: minutes).

Usage::

    python3 scripts/readme_commands.py --list              # every printed command and its plan
    python3 scripts/readme_commands.py --venv .venv        # run the `run` ones (about 10 min on 2 cores)
    python3 scripts/readme_commands.py --all               # and the long ones, with a fresh `make setup`

Exit status 0 when every command run exits 0, else 1 (the table names each command, its exit status and seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("README.md", "docs/cli.md")

#: how each printed command is checked (exact text as printed, comments and continuations joined)
PLAN: Dict[str, str] = {
    # README.md
    "make repro": "run",
    ".venv/bin/python scripts/tiny_natural_data.py data/tiny": "run",
    ".venv/bin/fl-train dataset=femnist dataset.root=data/tiny partition=natural train.rounds=2": "run",
    ".venv/bin/fl-train dataset=shakespeare dataset.root=data/tiny partition=natural train.rounds=2": "run",
    "make test": "skip: CI runs it on a clean clone (.ci/run)",
    ".venv/bin/dvc exp run -S train.lr=0.1 && make exp-show": "long",
    ".venv/bin/fl-train train.lr=0.1 seed=1,2,3 name=fedavg-lr0.1": "run",
    ".venv/bin/fl-train -m algorithm=fedavg,fedprox train.lr=0.01,0.05 seed=1": "long",
    "make exp-show": "run",
    ".venv/bin/dvc metrics show": "run",
    ".venv/bin/dvc plots show": "run",
    ".venv/bin/dvc exp run -S train.rounds=50": "long",
    ".venv/bin/dvc exp run --queue -S partition.num_clients=20 -S seeds='[1,2,3,4,5]'": "run",
    'PATH="$PWD/.venv/bin:$PATH" .venv/bin/dvc queue start -j 2': "long",
    ".venv/bin/dvc exp show": "run",
    ".venv/bin/fl-train algorithm=scaffold seed=1,2,3": "run",
    ".venv/bin/fl-train partition=dirichlet partition.alpha=0.3 algorithm=fedbug "
    "algorithm.fedbug.gu_percentage=0.5 train.rounds=50 seed=1": "run",
    ".venv/bin/fl-train -m algorithm=fedavg,fedprox seed=1,2 train.rounds=10 'name=${algorithm.name}-r10'": "run",
    ".venv/bin/fl-train --help": "run",
    ".venv/bin/fl-train --cfg train.lr=0.1": "run",
    ".venv/bin/python -m pipeline.train +experiment=fedbug_cifar100 dataset.root=/data/cifar "
    "algorithm.name=feddyn algorithm.fedbug.gu_percentage=0.4 train.participation=0.01 seed=1":
        "skip: needs the CIFAR-100 files under /data/cifar",
    ".venv/bin/python sweeps/tune.py --space fedbug --n-trials 20": "long",
    ".venv/bin/python sweeps/tune.py --space cross --n-trials 60 --workers 2 --objectives acc,uplink": "long",
    ".venv/bin/python sweeps/tune.py --space lr --n-trials 16 --batch 8": "run",
    ".venv/bin/python -m pipeline.train dataset=cifar10 dataset.root=/data/cifar partition=dirichlet "
    "algorithm=fedbug train.rounds=300": "skip: needs the CIFAR-10 files under /data/cifar",
    # docs/cli.md (in the activated environment)
    "fl-train dataset=digits partition=dirichlet partition.alpha=0.3 algorithm=fedbug train.rounds=50 seed=1": "run",
    "fl-train --cfg algorithm=fedprox algorithm.fedprox.mu=0.1": "run",
    "fl-train --cfg hydra algorithm=fedprox": "run",
    "fl-train --info dataset=mnist1d": "run",
    "fl-train --hydra-help": "run",
    "fl-train --grid fedbug": "run",
    "fl-train algorithm=fedprox seed=1,2,3": "run",
    "fl-train algorithm=fedprox seed=range(1,6)": "long",
    "fl-train -m algorithm=fedavg,fedprox seed=1,2,3 train.rounds=100 'name=${algorithm.name}-r100'": "long",
    "fl-train -m partition=dirichlet partition.alpha=0.1,0.3,1.0 algorithm=fedavg,fedbug seed=1,2,3": "long",
    "fl-train -m 'algorithm=glob(fed*,exclude=fedbcgd*)' seed=range(1,4)": "skip: every rule, 3 seeds each: hours",
    "fl-train -m train.lr=0.01,0.05,0.1 'name=fedavg-lr${train.lr}' seed=1,2,3": "long",
    "fl-train -m model=mlp,small_cnn 'name=fedavg-${model.name}'": "run",
    "fl-train -m algorithm=fedprox engine.executor=vectorized train.lr=0.01,0.1 algorithm.fedprox.mu=0,0.1 "
    "'name=fedprox-lr${train.lr}-mu${algorithm.fedprox.mu}' seed=1,2,3": "long",
    "pip install hydra-joblib-launcher": "skip: installs from a package index (a network)",
    "fl-train -m hydra/launcher=joblib hydra.launcher.n_jobs=2 algorithm=fedavg,fedprox seed=1,2,3":
        "skip: needs hydra-joblib-launcher (pip install -e '.[parallel]')",
    "pip install hydra-submitit-launcher": "skip: installs from a package index (a network)",
    "fl-train -m 'hydra.searchpath=[file://launchers]' hydra/launcher=slurm algorithm=fedavg,fedprox,fedbug "
    "seed=1,2,3 engine.device=cuda dataset=cifar10 dataset.root=/data/cifar": "skip: needs a Slurm cluster with GPUs",
    "dvc exp run -S train.lr=0.1": "long",
    "dvc exp show --only-changed --sort-by final.feddyn --sort-order desc": "run",
    "dvc exp show --drop '.*_std\\.|best|worst10' --no-pager": "run",
    "dvc exp show --csv > exps.csv": "run",
}


def printed_commands() -> List[Tuple[str, str]]:
    """(source file, command) of every shell line in the ```bash blocks of :data:`SOURCES`, in order: comments
    dropped, a line ending in ``\\`` joined with the next, leading indentation removed."""
    found: List[Tuple[str, str]] = []
    for name in SOURCES:
        text = (ROOT / name).read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
            pending = ""
            for raw in block.splitlines():
                line = re.sub(r"\s+#\s.*$", "", raw).strip()
                if not line or line.startswith("#"):
                    continue
                if line.endswith("\\"):
                    pending += line[:-1].strip() + " "
                    continue
                found.append((name, (pending + line).strip()))
                pending = ""
    return found


def _clone(dest: Path, venv: Path | None) -> None:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    if venv is not None:  # `make` must not set it up again: that would point its editable install at this clone
        (dest / ".venv").symlink_to(venv.resolve(), target_is_directory=True)
        (dest / ".venv" / ".installed").touch()  # newer than the clone's pyproject.toml


def _plain_env(home: Path) -> Dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "GIT_AUTHOR_NAME": "readme", "GIT_AUTHOR_EMAIL": "readme@localhost",
           "GIT_COMMITTER_NAME": "readme", "GIT_COMMITTER_EMAIL": "readme@localhost"}
    return env


def run(commands: List[Tuple[str, str]], work: Path, include_long: bool) -> List[Tuple[str, str, str, float]]:
    """Run the commands in the clone ``work``; rows (source, command, outcome, seconds)."""
    home = work.parent / "home"
    home.mkdir(exist_ok=True)
    env = _plain_env(home)
    rows = []
    for source, cmd in commands:
        plan = PLAN[cmd]
        if plan.startswith("skip") or (plan == "long" and not include_long):
            rows.append((source, cmd, plan if plan != "long" else "skip: long (--all)", 0.0))
            continue
        shell = f". .venv/bin/activate && {cmd}" if source == "docs/cli.md" else cmd
        t0 = time.time()
        proc = subprocess.run(["bash", "-c", shell], cwd=work, env=env, capture_output=True, text=True, check=False)
        took = time.time() - t0
        if cmd.endswith("queue start -j 2"):  # the workers run in the background: wait for the queue to empty
            while "Queued" in (q := subprocess.run([".venv/bin/dvc", "queue", "status"], cwd=work, env=env,
                                                    capture_output=True, text=True, check=False).stdout) \
                    or "Running" in q:
                time.sleep(5)
            ok = "Failed" not in q
            took = time.time() - t0
            outcome = "ok" if proc.returncode == 0 and ok else f"queue: {q.strip().splitlines()[1:2]}"
        else:
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:120]
            outcome = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {tail}"
        rows.append((source, cmd, outcome, took))
        print(f"{outcome[:60]:60s} {took:7.1f} s  {cmd[:90]}", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print every printed command and its plan, run nothing")
    p.add_argument("--all", action="store_true", help="run the long commands too")
    p.add_argument("--venv", type=Path, default=None, help="link this environment as the clone's .venv "
                   "(default: `make repro` builds one)")
    p.add_argument("--keep", action="store_true", help="keep the clone")
    args = p.parse_args(argv)
    commands = printed_commands()
    missing = [c for _, c in commands if c not in PLAN]
    if missing:
        print(f"error: {len(missing)} printed command(s) have no plan in scripts/readme_commands.py, e.g. {missing[0]}",
              file=sys.stderr)
        return 2
    if args.list:
        for source, cmd in commands:
            print(f"{source:12s} {PLAN[cmd]:50s} {cmd}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="readme-commands-"))
    try:
        _clone(tmp / "clone", args.venv)
        rows = run(commands, tmp / "clone", args.all)
    finally:
        if args.keep:
            print(f"clone kept: {tmp / 'clone'}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("| source | command | outcome | s |\n|---|---|---|---:|")
    for source, cmd, outcome, took in rows:
        print(f"| {source} | `{cmd}` | {outcome} | {took:.0f} |")
    return 0 if all(o == "ok" or o.startswith("skip") for _, _, o, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
