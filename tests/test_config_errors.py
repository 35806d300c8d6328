"""One-line errors of the config layer: non-finite ``partition.alpha`` (fl_core.config.validate) and a
broken ``params.yaml`` / ``dvc.yaml`` (pipeline.grid, library calls and the ``python -m pipeline.grid`` CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import skip_unless_permissions_apply

from fl_core.config import ConfigError, compose
from pipeline import grid
from pipeline.grid import load_grid, sync_dvc

# --------------------------------------------------------------------------- partition.alpha


@pytest.mark.parametrize("value,shown", [("inf", "inf"), ("nan", "nan"), ("1e400", "inf")])
@pytest.mark.parametrize("partition", ["dirichlet", "iid"])
def test_non_finite_alpha_is_refused(value, shown, partition):
    with pytest.raises(ConfigError) as err:
        compose([f"partition={partition}", f"partition.alpha={value}"])
    assert str(err.value) == (f"partition.alpha must be a finite number > 0, got {shown} "
                              f"(use partition=iid for an IID split)")


@pytest.mark.parametrize("value,shown", [("-1", "-1"), ("0", "0"), ("-inf", "-inf")])
def test_alpha_at_or_below_zero_keeps_its_message(value, shown):
    with pytest.raises(ConfigError) as err:
        compose(["partition=dirichlet", f"partition.alpha={value}"])
    assert str(err.value) == f"partition.alpha must be > 0, got {shown}"


def test_large_finite_alpha_is_accepted():
    assert compose(["partition=dirichlet", "partition.alpha=1e300"]).partition.alpha == 1e300


# --------------------------------------------------------------------------- params.yaml


GOOD = "seeds: [1, 2]\ntrain: {rounds: 3}\nexperiments:\n  fedavg_iid: {algorithm: fedavg, partition: iid}\n"


def _error(path) -> str:
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    msg = str(err.value)
    assert "\n" not in msg and err.value.__cause__ is None and (err.value.__context__ is None
                                                                  or err.value.__suppress_context__)
    return msg


def test_good_grid_loads(tmp_path):
    (tmp_path / "params.yaml").write_text(GOOD)
    g = load_grid(tmp_path / "params.yaml")
    assert g.seeds == [1, 2] and g.shared == ["train.rounds=3"]
    assert g.experiments == {"fedavg_iid": ["algorithm=fedavg", "partition=iid"]}


@pytest.mark.parametrize("text,line,column,problem", [
    # unclosed flow mapping: the parser stops at the ':' of the next key
    ("seeds: [1]\nexperiments:\n  a: {algorithm: fedavg\n  b: {}\n", 4, 4, "expected ',' or '}', but got ':'"),
    ("seeds: [1]\nexperiments:\n\ta: {}\n", 3, 1, "found character '\\t' that cannot start any token"),
    ("seeds: [1\nexperiments: {}\n", 2, 12, "expected ',' or ']', but got ':'"),
    ("seeds: [1]\n  experiments: {}\n", 2, 3, "expected <block end>, but found '<block mapping start>'"),
    ("seeds: [1]\nab\x07c: 1\n", 2, 3, "unacceptable character #x0007: special characters are not allowed"),
])
def test_yaml_syntax_error_names_file_line_and_column(tmp_path, monkeypatch, text, line, column, problem):
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(text)
    assert _error(Path("params.yaml")) == f"params.yaml: YAML syntax error at line {line}, column {column}: {problem}"
    # the file's name as given
    assert _error(tmp_path / "params.yaml").startswith(f"{tmp_path / 'params.yaml'}: YAML syntax error at line {line}")


def test_missing_and_unreadable_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _error(Path("params.yaml")) == "params.yaml: file not found (the experiment grid)"
    Path("folder.yaml").mkdir()
    assert _error(Path("folder.yaml")) == "folder.yaml: is a folder, not a file (the experiment grid)"
    Path("latin1.yaml").write_bytes("seeds: [1]\n# r\xe9sum\xe9\n".encode("latin-1"))
    assert _error(Path("latin1.yaml")) == "latin1.yaml: not a UTF-8 text file (line 2: invalid continuation byte)"


def test_file_without_read_permission(tmp_path):
    skip_unless_permissions_apply(tmp_path)
    path = tmp_path / "params.yaml"
    path.write_text(GOOD)
    path.chmod(0)
    try:
        assert _error(path) == f"{path}: cannot read the file (Permission denied)"
    finally:
        path.chmod(0o644)


@pytest.mark.parametrize("text,kind", [("- 1\n- 2\n", "list"), ("just text\n", "str"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    (tmp_path / "p.yaml").write_text(text)
    assert _error(tmp_path / "p.yaml") == (f"{tmp_path / 'p.yaml'}: the top level must be a mapping of keys such as "
                                           f"seeds, experiments, train; got a {kind}")


def test_malformed_entries(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("")
    assert _error(path) == f"{path}: experiments must map experiment names to overrides"
    path.write_text("1: x\nfoo: y\n" + GOOD)  # keys of mixed types are sorted as text
    assert _error(path).startswith(f"{path}: unknown top-level key '1' (allowed: seeds, experiments,")
    path.write_text(GOOD.replace("[1, 2]", "[true]"))
    assert _error(path) == f"{path}: seeds must be a non-empty list of integers, got [True]"


# --------------------------------------------------------------------------- dvc.yaml and the CLI


DVC = "stages:\n  report:\n    deps:\n      # BEGIN grid deps\n      # END grid deps\n"


def test_sync_dvc_errors_are_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text(GOOD)
    g = load_grid(tmp_path / "params.yaml")
    with pytest.raises(ConfigError) as err:
        sync_dvc(tmp_path / "dvc.yaml", g)
    assert str(err.value) == f"{tmp_path / 'dvc.yaml'}: file not found (the DVC pipeline)"
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with pytest.raises(ConfigError, match=r"dvc\.yaml: no generated block \(the '# BEGIN grid train'"):
        sync_dvc(tmp_path / "dvc.yaml", g)
    (tmp_path / "dvc.yaml").write_text(DVC)
    assert sync_dvc(tmp_path / "dvc.yaml", g) is True
    assert "      - results/fedavg_iid/metrics.json\n" in (tmp_path / "dvc.yaml").read_text()
    assert sync_dvc(tmp_path / "dvc.yaml", g) is False


@pytest.mark.parametrize("command", ["list", "sync-dvc"])
def test_cli_prints_one_line(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    Path("dvc.yaml").write_text(DVC)
    Path("params.yaml").write_text("seeds: [1]\nexperiments:\n  a: {algorithm: fedavg\n  b: {}\n")
    assert grid.main([command]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == ("error: params.yaml: YAML syntax error at line 4, column 4: "
                                         "expected ',' or '}', but got ':'\n")
    Path("params.yaml").unlink()
    assert grid.main([command]) == 2
    assert capsys.readouterr().err == "error: params.yaml: file not found (the experiment grid)\n"
    Path("params.yaml").write_text(GOOD)
    Path("dvc.yaml").unlink()
    assert grid.main([command]) == (0 if command == "list" else 2)
    out = capsys.readouterr()
    if command == "list":
        assert out.out == "fedavg_iid: algorithm=fedavg partition=iid\n" and out.err == ""
    else:
        assert out.err == "error: dvc.yaml: file not found (the DVC pipeline)\n"
