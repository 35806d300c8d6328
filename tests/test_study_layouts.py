"""A study's own report tables: ``report.layouts`` of its params file (pipeline/grid.py, pipeline/report.py), and
FedBug's paper layout (studies/fedbug/layout.py) read from each run's stored rule stack."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fl_core.algorithms import registry
from fl_core.algorithms.base import Description as D
from fl_core.config import ConfigError
from pipeline.grid import load_grid
from pipeline.results import Experiment

ROOT = Path(__file__).resolve().parents[1]
GRID = "seeds: [1]\nexperiments:\n  a: {algorithm: fedavg}\n"


def _fedbug_layout():
    spec = importlib.util.spec_from_file_location("fedbug_layout_under_test", ROOT / "studies" / "fedbug" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_and_columns_come_from_the_stack():
    split = _fedbug_layout().split
    s = registry.described
    assert split(s(D("fedbug", [("P", 0.1)], D("feddyn", [("alpha", 0.01)])))) == ("FedBug 10%", "FedDyn", 0.1)
    assert split(s(D("fedexp", [("", "official")]))) == ("Vanilla", "FedExP", None)
    assert split(s(D("fedbug", [("", "top_down"), ("P", 0.2)], D("fedavg")))) == ("FedBug top-down 20%", "FedAvg", 0.2)
    assert split(s(D("fedbug", [("", "fixed_last")], D("fedprox")))) == ("FedBug fixed-last", "FedProx", None)
    assert split(s(D("fednlr", [], D("fedavg")))) == ("Vanilla", "FedNLR", None)  # another wrapper: its own column


def _exp(name, desc, acc, col="IID"):
    m = {"final_acc_mean": acc, "final_acc_std": 0.0, "algorithm": str(desc)}
    if isinstance(desc, D):
        m["stack"] = registry.described(desc)
    return Experiment(name, [], metrics=m, col_label=col)


def test_the_fedbug_layout_orders_rows_and_names_runs_without_a_stack():
    layout = _fedbug_layout().layout
    assert layout([_exp("a", D("fedavg"), 0.8)]) == []  # no FedBug run: no section
    exps = [_exp("b40", D("fedbug", [("P", 0.4)], D("fedavg")), 0.83), _exp("a", D("fedavg"), 0.8),
            _exp("b10", D("fedbug", [("P", 0.1)], D("fedavg")), 0.85), _exp("p", D("fedprox"), 0.79),
            _exp("old", "fedbug[P=0.2](fedavg)", 0.9)]
    md = "\n".join(layout(exps))
    assert md.startswith("## FedBug layout")
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert table[0] == "|  | FedAvg | FedProx |"
    assert [ln.split("|")[1].strip() for ln in table[2:]] == ["Vanilla", "FedBug 10%", "FedBug 40%"]
    assert "| FedBug 10% | **85.00 \u00b1 0.00** | \u2014 |" in table
    assert "stored their rule stack" in md and "`old`" in md


def test_the_grid_resolves_layouts_beside_the_params_file(tmp_path):
    (tmp_path / "mine.py").write_text("def layout(experiments):\n    return ['## Mine', '']\n")
    params = tmp_path / "params.yaml"
    params.write_text(GRID + "report: {layouts: [mine.py]}\n")
    assert load_grid(params).layouts == [tmp_path / "mine.py"]
    assert load_grid(_write(tmp_path, GRID)).layouts == []


def _write(tmp_path, text, name="p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("report,message", [
    ("report: {layouts: [nope.py]}", r"report.layouts\[0\]=nope.py: file not found"),
    ("report: {layouts: [notes.txt]}", r"report.layouts\[0\]=notes.txt is not a Python file"),
    ("report: {layouts: layout.py}", r"report.layouts must be a list of Python files"),
    ("report: [layout.py]", r"report must be a mapping"),
])
def test_a_bad_layout_entry_is_one_line(tmp_path, report, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_grid(_write(tmp_path, GRID + report + "\n"))
    assert "\n" not in str(err.value)


def test_a_layout_file_without_its_function_stops_the_report_with_one_line(tmp_path, capsys):
    from pipeline.report import main

    (tmp_path / "empty.py").write_text("X = 1\n")
    params = _write(tmp_path, GRID + "report: {layouts: [empty.py]}\n", "params.yaml")
    assert main(["--params", str(params), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "empty.py: a report layout must define layout(experiments)" in err
    assert "\n" not in err
