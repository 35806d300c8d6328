"""``make check-repro`` (pipeline/check_repro.py): fresh metrics against the committed ones, within a tolerance."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline import check_repro

METRICS = {"status": "ok", "seeds": [1, 2], "final_acc_mean": 0.8, "best_acc_mean": 0.85,
           "final_client_acc_mean_mean": 0.82, "rounds_to_target_mean": 12.0}


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    """A git repository with a two-experiment grid whose metrics are committed."""
    (tmp_path / "params.yaml").write_text("seeds: [1, 2]\nexperiments:\n  a: {algorithm: fedavg}\n"
                                          "  b: {algorithm: fedprox}\n")
    for name in ("a", "b"):
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "metrics.json").write_text(json.dumps(METRICS))
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "committed numbers")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write(repo: Path, name: str, **changes) -> None:
    (repo / "results" / name / "metrics.json").write_text(json.dumps({**METRICS, **changes}))


def test_unchanged_metrics_are_reproduced(repo, capsys):
    assert check_repro.main([]) == 0
    assert "reproduced: 2 experiments within 0.5 pp" in capsys.readouterr().out


def test_a_difference_within_the_tolerance_passes_and_one_beyond_names_experiment_and_metric(repo, capsys):
    _write(repo, "a", final_acc_mean=0.8049)  # +0.49 pp
    assert check_repro.main([]) == 0
    _write(repo, "b", best_acc_mean=0.8440)  # -0.60 pp
    assert check_repro.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["b: best_acc_mean differs by -0.60 pp (fresh 84.40, committed 85.00; tolerance 0.5 pp)"]
    assert check_repro.main(["--tolerance", "0.7"]) == 0


def test_rounds_to_target_status_and_seeds(repo, capsys):
    _write(repo, "a", rounds_to_target_mean=15.0, status="failed", seeds=[1])
    assert check_repro.main([]) == 1
    err = capsys.readouterr().err
    assert "a: status is 'failed', committed 'ok'" in err and "a: seeds is [1], committed [1, 2]" in err
    assert "a: rounds_to_target_mean differs by +3.00 rounds" in err


def test_a_missing_fresh_or_committed_file_exits_2(repo, capsys):
    (repo / "results" / "b" / "metrics.json").unlink()
    assert check_repro.main([]) == 2
    assert "b: no fresh results/b/metrics.json (run make repro first)" in capsys.readouterr().err
    (repo / "params.yaml").write_text("seeds: [1]\nexperiments:\n  c: {algorithm: fedavg}\n")
    (repo / "results" / "c").mkdir()
    (repo / "results" / "c" / "metrics.json").write_text(json.dumps(METRICS))
    assert check_repro.main([]) == 2
    assert "c: results/c/metrics.json is not committed at HEAD" in capsys.readouterr().err
