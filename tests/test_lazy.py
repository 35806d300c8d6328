"""fl_core.lazy.lazy_import: a module whose code runs when one of its attributes is first read."""

from __future__ import annotations

import builtins
import sys

import pytest

from fl_core.lazy import lazy_import


def _probe(tmp_path, monkeypatch, name: str, body: str = "") -> None:
    """A module ``name`` on the path, not imported yet, that counts its runs in ``builtins.fl_lazy_runs`` (0 now)."""
    (tmp_path / f"{name}.py").write_text("import builtins\nbuiltins.fl_lazy_runs += 1\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.fl_lazy_runs", 0, raising=False)
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_module_runs_on_first_attribute_access_once(tmp_path, monkeypatch):
    _probe(tmp_path, monkeypatch, "fl_lazy_probe", "VALUE = 42\n")
    mod = lazy_import("fl_lazy_probe")
    assert builtins.fl_lazy_runs == 0 and sys.modules["fl_lazy_probe"] is mod
    assert lazy_import("fl_lazy_probe") is mod and builtins.fl_lazy_runs == 0
    assert mod.VALUE == 42 and builtins.fl_lazy_runs == 1
    assert mod.VALUE == 42 and builtins.fl_lazy_runs == 1


def test_an_import_statement_executes_a_lazy_module(tmp_path, monkeypatch):
    """``import name`` elsewhere reads the module's ``__spec__``: the module runs then, and it is the same object."""
    _probe(tmp_path, monkeypatch, "fl_lazy_probe2")
    mod = lazy_import("fl_lazy_probe2")
    assert builtins.fl_lazy_runs == 0
    import fl_lazy_probe2

    assert fl_lazy_probe2 is mod and builtins.fl_lazy_runs == 1


def test_an_imported_module_is_returned_as_it_is():
    import json

    assert lazy_import("json") is json


def test_submodules_and_missing_modules_are_refused_at_the_call():
    with pytest.raises(ValueError, match=r"^lazy_import takes a top-level module, got 'torch.nn'$"):
        lazy_import("torch.nn")
    with pytest.raises(ModuleNotFoundError, match="fl_no_such_module"):
        lazy_import("fl_no_such_module")
