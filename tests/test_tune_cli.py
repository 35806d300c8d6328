"""sweeps/tune.py's command line (issue 32): a bad value of an option ends in one line, ``error: ...`` naming the
option and what it takes, exit status 2 (no usage block); ``--help`` as ever. Its progress bar is drawn on a
terminal only (:func:`fl_core.progress.bar`): elsewhere the trial lines alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sweeps import tune

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--space", "lr", "--n-trials", "1", "--no-mlflow"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "usage:" not in err
    return lines[0]


@pytest.mark.parametrize("argv,expected", [
    (["--sampler", "bogus"], "error: --sampler must be one of tpe, cmaes, gp, random, nsga2, got 'bogus'"),
    (["--pruner", "bogus"], "error: --pruner must be median, hyperband, none or threshold:X"),
    (["--objectives", "acc,bogus"], "error: --objectives must be acc or acc,uplink, got 'acc,bogus'"),
    (["--n-trials", "x"], "error: --n-trials must be an integer, got 'x'"),
    (["--seeds", "1.5"], "error: --seeds must be an integer, got '1.5'"),
    (["--workers", "two"], "error: --workers must be an integer, got 'two'"),
    (["--timeout", "soon"], "error: --timeout must be a number, got 'soon'"),
    (["--seeds", "0"], "error: --seeds must be >= 1, got 0"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
    (["--storage"], "error: --storage: expected one argument"),
])
def test_a_bad_option_value_is_one_line_and_exit_2(capsys, argv, expected):
    assert tune.main(BASE + argv) == 2
    assert _one_line(capsys).startswith(expected)


def test_a_bad_space_names_the_spaces(capsys):
    assert tune.main(["--space", "bogus", "--n-trials", "1", "--no-mlflow"]) == 2
    line = _one_line(capsys)
    assert "bogus" in line and "lr" in line and "cross" in line


def test_missing_options_are_one_line(capsys):
    assert tune.main([]) == 2
    assert _one_line(capsys) == "error: the following arguments are required: --space, --n-trials (see --help)"


def test_the_command_itself_says_one_line_and_help_still_works():
    res = subprocess.run([sys.executable, str(ROOT / "sweeps" / "tune.py"), "--space", "lr", "--n-trials", "1",
                          "--sampler", "bogus"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == "error: --sampler must be one of tpe, cmaes, gp, random, nsga2, got 'bogus'\n"
    res = subprocess.run([sys.executable, str(ROOT / "sweeps" / "tune.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, check=False)
    assert res.returncode == 0 and res.stdout.startswith("usage: python sweeps/tune.py") and "--sampler" in res.stdout


# --------------------------------------------------------------------------- the progress bar


def _runner(quiet: bool = False):
    return SimpleNamespace(settings=SimpleNamespace(quiet=quiet, study_name="s"))


def test_off_a_terminal_the_trials_run_without_a_bar(monkeypatch):
    calls = []
    monkeypatch.setattr(tune.progress, "on_terminal", lambda stream=None: False)
    monkeypatch.setattr(tune, "optimize", lambda study, runner, n, on_trial=None: calls.append(on_trial) or False)
    assert tune._run_in_process(None, _runner(), 3) is False
    assert calls == [None]  # optimize prints the trial lines itself (unless --quiet)


def test_on_a_terminal_the_trial_lines_go_above_the_bar(monkeypatch):
    made = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.lines, self.n, self.closed = kwargs, [], 0, False
            made.append(self)

        def write(self, line, file=None):
            self.lines.append(line)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    def bar(**kwargs):
        return Bar(**kwargs) if kwargs.get("enabled", True) else None

    def optimize(study, runner, n, on_trial=None):
        for i in range(n):
            on_trial(f"trial {i}")
        return False

    monkeypatch.setattr(tune.progress, "bar", bar)
    monkeypatch.setattr(tune, "optimize", optimize)
    assert tune._run_in_process(None, _runner(), 2) is False
    (b,) = made
    assert b.lines == ["trial 0", "trial 1"] and b.n == 2 and b.closed
    assert b.kwargs["total"] == 2 and b.kwargs["unit"] == "trial" and b.kwargs["desc"] == "s"
    made.clear()
    monkeypatch.setattr(tune, "optimize", lambda study, runner, n, on_trial=None: on_trial is None or 1 / 0)
    assert tune._run_in_process(None, _runner(quiet=True), 2) is True and made == []  # --quiet: no bar


def test_an_output_folder_of_the_users_is_refused_before_the_study_starts(tmp_path, capsys):
    """``--out`` at a folder holding what a sweep does not write (fl_core.store.owned): one line, exit 2, the folder as it
    was and no study journal created."""
    out, journal = tmp_path / "mine", tmp_path / "study.log"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    (out / "summary.json").write_text("{\"mine\": 1}")
    assert tune.main(BASE + ["--out", str(out), "--storage", str(journal)]) == 2
    line = _one_line(capsys)
    assert "sweep output folder" in line and "notes.md" in line and "nothing was changed" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "summary.json"]
    assert (out / "summary.json").read_text() == "{\"mine\": 1}" and not journal.exists()
