"""The pipeline (pipeline/) and the sweeps (sweeps/) name no rule, as the engine does not
(tests/test_registry.py): what a rule is called, its label and its table layout come from the registry and from
the structured description a run stores, and a study brings its own layouts (studies/<study>/).

The check reads every ``pipeline/*.py`` and ``sweeps/*.py`` with :mod:`ast`: string literals and identifiers count,
docstrings and comments do not. The words are every registered rule's name and paper label and every preset's name
(``conf/algorithm/<preset>.yaml``); the server optimisers' own names (sgd, momentum, adam) are the optimisers', words
of the local step as well, and are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Tuple

from fl_core.algorithms import registry

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pipeline", "sweeps")


def rule_words() -> List[str]:
    """Every rule's name and label and every preset's name, lower case (the check ignores case)."""
    words = ({r.name for r in registry.rules() if r.kind != "server"} | {r.label for r in registry.rules()}
             | {r.preset for r in registry.rules() if r.preset}
             | {p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml")})
    return sorted({w.lower() for w in words})


def _docstrings(tree: ast.AST) -> set:
    """The ids of string constants that are docstrings or other bare string statements (comments in effect)."""
    out = set()
    for node in ast.walk(tree):
        for stmt in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                out.add(id(stmt.value))
    return out


def _texts(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, text) of every string literal that is not a docstring, and of every identifier."""
    docs = _docstrings(tree)
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string's parts carry its first line: count the lines before
            line = node.lineno
            for v in node.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    for i, text in enumerate(v.value.split("\n")):
                        yield line + i, text
                    line += v.value.count("\n")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | parts:
            for i, text in enumerate(node.value.split("\n")):
                yield node.lineno + i, text
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.asname or node.name


def found_names(path: Path, words: List[str]) -> List[str]:
    """``file:line: word`` for each rule word in the code of ``path`` (sorted by line)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for line, text in _texts(tree):
        for w in words:
            # a word of its own: letters and digits around it end it (fedbug_layout and fedavg_iid name a rule,
            # fedavgm is not fedavg)
            if re.search(rf"(?<![a-z0-9]){re.escape(w)}(?![a-z0-9+])", text.lower()):
                out.add((line, w))
    return [f"{path.relative_to(ROOT).as_posix()}:{line}: {w}" for line, w in sorted(out)]


def test_the_words_are_the_registry():
    words = rule_words()
    assert {"fedavg", "fedbcgd+", "top-k", "fedavgm", "fedpaq"} <= set(words) and "sgd" not in words


def test_the_check_sees_strings_and_identifiers_not_docstrings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""fedavg in a docstring."""\n# fedavg in a comment\n\ndef fedbug_layout(x):\n'
                 '    """FedBug here is fine."""\n    return "compare with fedprox"\n')
    words = rule_words()
    old, globals()["ROOT"] = ROOT, tmp_path
    try:
        got = found_names(f, words)
    finally:
        globals()["ROOT"] = old
    assert got == ["m.py:4: fedbug", "m.py:6: fedprox"]


def test_the_pipeline_and_the_sweeps_name_no_rule():
    words = rule_words()
    found = [hit for folder in FOLDERS for path in sorted((ROOT / folder).glob("*.py"))
             for hit in found_names(path, words)]
    assert not found, ("rule names in the pipeline or the sweeps (use the registry or the run's stack): "
                       + "; ".join(found))
