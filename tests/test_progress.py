"""Logs stay readable: progress bars only on a terminal, and an error line never glued onto a bar's line."""

from __future__ import annotations

import io
import sys

import pytest

from fl_core import progress
from fl_core.store import envfail


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress.bar(total=5, desc="x", unit="round") is None
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert progress.bar(total=5, desc="x", unit="round", enabled=False) is None
    bar = progress.bar(total=5, desc="x", unit="round")
    assert bar is not None
    bar.close()


@pytest.mark.parametrize("how", ["fail", "environment failure"])
def test_the_error_line_starts_a_line_of_its_own(monkeypatch, how):
    monkeypatch.delenv(envfail.DEBUG_ENV, raising=False)  # a --debug test before may have set it: then it re-raises
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = progress.bar(total=10, desc="exp", unit="round")
    bar.update(3)
    bar.refresh()
    assert not term.getvalue().endswith("\n")  # the bar's line is open
    if how == "fail":
        from pipeline.common import fail

        with pytest.raises(SystemExit):
            fail("something went wrong")
    else:
        def main(argv):
            raise envfail.EnvironmentFailure("results folder out", "is full", "free space")

        assert envfail.run_cli(main, []) == envfail.EXIT_STATUS
    out = term.getvalue()
    assert "\nerror: " in out and out.endswith("\n")
    assert out.split("\n")[-2].startswith("error: ")  # the last line is the error alone


def test_end_line_without_tqdm_loaded_or_without_bars_does_nothing(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    progress.end_line()
    assert sys.stderr.getvalue() == ""
