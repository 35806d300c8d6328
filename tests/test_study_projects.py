"""Each paper study is a DVC project of its own (``studies/<s>/.dvc``): the root project's DVC views (``dvc exp show``,
``dvc metrics show``, ``dvc params diff``, ``dvc plots show``) list the default grid only, and a study's stages depend
on the project's code through the links in ``studies/<s>/code/`` (inside the study, so its ``.dvcignore`` keeps
bytecode out of the code's hash; a path outside the study would be hashed with every ``__pycache__`` in it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import studies_status

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parent for p in (ROOT / "studies").glob("*/dvc.yaml"))
CODE = ("fl_core", "pipeline", "conf")
DVC = Path(sys.executable).parent / "dvc"


def _deps(dvc_yaml: Path):
    for name, entry in yaml.safe_load(dvc_yaml.read_text())["stages"].items():
        for dep in entry.get("do", entry).get("deps", []):
            yield name, dep if isinstance(dep, str) else next(iter(dep))


@pytest.mark.parametrize("study", STUDIES, ids=[s.name for s in STUDIES])
def test_every_study_is_a_dvc_project_whose_code_deps_lie_inside_it(study):
    assert (study / ".dvc" / "config").is_file() and (study / ".dvcignore").is_file()
    if (ROOT / ".git").exists():
        held = studies_status.git_files(study)
        assert held(".dvc/config") and held(".dvcignore")
    ignored = (study / ".dvcignore").read_text().splitlines()
    assert "__pycache__/" in ignored and "*.pyc" in ignored
    for name in CODE:
        link = study / "code" / name
        assert link.is_symlink() and link.resolve() == ROOT / name, link
    for dvc_yaml in sorted(study.rglob("dvc.yaml")):
        for stage, dep in _deps(dvc_yaml):
            target = (dvc_yaml.parent / dep).resolve()
            inside = os.path.normpath(dvc_yaml.parent / dep).startswith(str(study))
            assert inside, f"{dvc_yaml.relative_to(ROOT)}: stage {stage} depends on {dep}, outside the study"
            if target.is_relative_to(ROOT) and target.relative_to(ROOT).parts[:1] in [(c,) for c in CODE]:
                assert Path(os.path.normpath(dvc_yaml.parent / dep)).relative_to(study).parts[0] == "code", dep


@pytest.mark.skipif(not DVC.exists(), reason="dvc is not installed beside this python")
def test_the_root_projects_dvc_lists_the_default_grid_only():
    res = subprocess.run([str(DVC), "stage", "list", "--name-only"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    root = {name for name in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]}
    listed = {line.split("@")[0] for line in res.stdout.split()}
    assert listed == root, res.stdout


@pytest.mark.slow  # ~10 s of DVC commands
@pytest.mark.skipif(not DVC.exists() or shutil.which("git") is None, reason="needs dvc and git")
def test_bytecode_beside_the_code_leaves_a_study_up_to_date_through_its_code_links(tmp_path):
    """A project with a study as a DVC subproject: a stage depending on ``code/pkg`` (a link to the project's ``pkg``)
    stays up to date when ``pkg/__pycache__`` appears and runs again when a source file changes; the same dependency
    written ``../pkg`` (outside the study) is what the links avoid: it counts the bytecode."""
    def run(*cmd, cwd=tmp_path):
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True).stdout

    run("git", "init", "-q")
    run(str(DVC), "init", "-q")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("X = 1\n")
    study = tmp_path / "study"
    study.mkdir()
    run(str(DVC), "init", "--subdir", "-q", cwd=study)
    (study / ".dvcignore").write_text("__pycache__/\n*.pyc\n")
    (study / "code").mkdir()
    os.symlink("../../pkg", study / "code" / "pkg")
    (study / "dvc.yaml").write_text(
        "stages:\n"
        "  linked:\n    cmd: echo linked > linked.txt\n    deps: [code/pkg]\n    outs: [linked.txt]\n"
        "  outside:\n    cmd: echo outside > outside.txt\n    deps: [../pkg]\n    outs: [outside.txt]\n")
    run(str(DVC), "repro", "-q", cwd=study)

    def stale():
        out = run(str(DVC), "status", "--json", cwd=study)
        return sorted(yaml.safe_load(out) or {})

    assert stale() == []
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "mod.cpython-310.pyc").write_bytes(b"\0" * 16)
    assert stale() == ["outside"]
    (tmp_path / "pkg" / "mod.py").write_text("X = 2\n")
    assert stale() == ["linked", "outside"]
