"""Every command README.md and docs/cli.md print is checked by ``scripts/readme_commands.py`` (run as printed in a
fresh clone from a plain shell, or skipped with a reason), and every program it starts exists."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))
import readme_commands  # noqa: E402


def test_every_printed_command_has_a_plan_and_no_plan_is_stale():
    printed = [c for _, c in readme_commands.printed_commands()]
    assert printed, "no command found in the docs"
    assert [c for c in printed if c not in readme_commands.PLAN] == []
    assert [c for c in readme_commands.PLAN if c not in printed] == []  # a plan for a command no longer printed
    for cmd, plan in readme_commands.PLAN.items():
        assert plan in ("run", "long") or re.match(r"skip: \S", plan), (cmd, plan)


def _programs(cmd: str):
    """The programs a command line starts: (program, its first arguments) per ``&&`` part, after VAR=value."""
    for part in cmd.split("&&"):
        words = [w for w in shlex.split(part.split(">")[0]) if not re.match(r"^[A-Z_]+=", w)]
        yield words[0], words[1:]


def test_every_program_a_checked_command_starts_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    for cmd, plan in readme_commands.PLAN.items():
        if plan.startswith("skip"):
            continue
        for prog, args in _programs(cmd):
            if prog == "make":
                assert args[0] in targets, cmd
                continue
            name = prog.removeprefix(".venv/bin/")
            assert (BIN / name).exists(), cmd  # fl-train, dvc, python: in the environment `make setup` builds
            if name == "python" and args[0] == "-m":
                assert importlib.util.find_spec(args[1]) is not None, cmd
            elif name == "python":
                assert (ROOT / args[0]).is_file(), cmd


def test_the_stage_launcher_finds_the_environment_from_a_plain_shell(tmp_path):
    """``scripts/python`` (every DVC stage's interpreter) with only /usr/bin and /bin on PATH: the project's .venv
    (here the environment running the tests, linked where `make setup` puts it); without any, one line, exit 2."""
    project = tmp_path / "clone"
    (project / "scripts").mkdir(parents=True)
    (project / "scripts" / "python").write_bytes((ROOT / "scripts" / "python").read_bytes())
    plain = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    none = subprocess.run(["sh", "scripts/python", "-c", "import sys; print(sys.prefix)"], cwd=project, env=plain,
                          capture_output=True, text=True, check=False)
    assert none.returncode == 2 and none.stdout == ""
    assert none.stderr.startswith("error: no Python with the project installed") and none.stderr.count("\n") == 1
    (project / ".venv").symlink_to(BIN.parent, target_is_directory=True)
    found = subprocess.run(["sh", "scripts/python", "-c", "import sys; print(sys.prefix)"], cwd=project, env=plain,
                           capture_output=True, text=True, check=True)
    assert Path(found.stdout.strip()).resolve() == Path(sys.prefix).resolve()
    # an experiment DVC runs from its queue: a temporary copy inside the project that queued it
    queued = project / ".dvc" / "tmp" / "exps" / "tmpabc"
    (queued / "scripts").mkdir(parents=True)
    (queued / "scripts" / "python").write_bytes((ROOT / "scripts" / "python").read_bytes())
    found = subprocess.run(["sh", "scripts/python", "-c", "import sys; print(sys.prefix)"], cwd=queued, env=plain,
                           capture_output=True, text=True, check=True)
    assert Path(found.stdout.strip()).resolve() == Path(sys.prefix).resolve()
