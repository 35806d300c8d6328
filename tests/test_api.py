"""The Python API (pipeline.api.run): in-memory runs equal the CLI's, nothing is written, bad calls in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.api import run
from fl_core.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TINY = ["partition.num_clients=4", "train.rounds=3", "train.participation=1.0", "train.local_epochs=1",
        "train.batch_size=64", "engine.progress=false", "engine.checkpoint_every=0"]


def test_in_memory_run_writes_nothing_and_equals_the_cli_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mem = run(TINY + ["algorithm=scaffold"], seeds=(1, 2))
    assert list(tmp_path.iterdir()) == []  # no results, no checkpoints, no MLflow store
    assert sorted(mem.history["seed"].unique()) == [1, 2]
    assert list(mem.history[mem.history.seed == 1]["round"]) == [1, 2, 3]
    assert {"test_acc", "test_loss", "train_loss", "comm_up_floats"} <= set(mem.history.columns)
    assert mem.summary["seeds"] == [1, 2] and mem.summary["status"] == "ok"
    k = mem.config["train"]["final_window"]  # final accuracy: mean of each seed's last k evaluations
    final = mem.history.groupby("seed")["test_acc"].apply(lambda acc: acc.tail(k).mean())
    assert k == 5 and mem.summary["final_acc_mean"] == pytest.approx(final.mean())
    assert mem.config["algorithm"]["name"] == "scaffold"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    written = run(TINY + ["algorithm=scaffold", "name=api"], seeds=(1, 2), write=True)
    assert (tmp_path / "results" / "api" / "metrics.json").exists()
    for s in (1, 2):
        for k, v in mem.models[s].items():
            assert torch.equal(v, written.models[s][k]), (s, k)
    assert written.summary["final_acc_mean"] == pytest.approx(mem.summary["final_acc_mean"])
    assert list(written.history[written.history.seed == 2]["round"]) == [1, 2, 3]


@pytest.mark.parametrize("kwargs,message", [
    ({"overrides": ["seed=3"]}, "seed: pass the seeds as run(..., seeds=(1, 2, 3)), not as an override"),
    ({"seeds": ()}, "seeds: at least one seed is needed"),
    ({"track": True}, "track=True needs write=True (an in-memory run is not tracked)"),
    ({"overrides": ["partition.alpha=-1"]}, "partition.alpha must be > 0, got -1"),
])
def test_bad_calls_raise_one_line(kwargs, message):
    with pytest.raises(ConfigError) as err:
        run(**kwargs)
    assert str(err.value) == message


@pytest.mark.slow
def test_the_example_runs(tmp_path):
    out = tmp_path / "fig.png"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_rules.py"), "--rounds", "2", "--out",
                           str(out)], cwd=tmp_path, capture_output=True, check=False, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0 and "scaffold: final accuracy" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png"]


def test_the_readme_snippet_runs(tmp_path, monkeypatch, capsys):
    """The README's API example, with 1 round instead of 10, runs as printed and writes nothing."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "train.rounds=10" in block
    monkeypatch.chdir(tmp_path)
    exec(compile(block.replace("train.rounds=10", "train.rounds=1"), "README.md", "exec"), {})
    assert "test_acc" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # ~14 s: three in-memory runs and a CLI run
def test_on_round_reports_every_round_of_every_seed_and_progress_can_be_off(tmp_path, monkeypatch, capsys):
    """on_round(seed, round, row) sees each trained round once, with the row the history holds, in memory and when
    writing; progress=False prints no bar, progress=True one on stderr when it is a terminal."""
    monkeypatch.chdir(tmp_path)
    seen = []
    small = [o for o in TINY if not o.startswith("engine.progress")]
    mem = run(small, seeds=(1, 2), progress=False, on_round=lambda s, r, row: seen.append((s, r, row["test_acc"])))
    assert [(s, r) for s, r, _ in seen] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    assert [a for *_, a in seen] == list(mem.history["test_acc"])
    assert "round" not in capsys.readouterr().err  # no bar
    run(small, seeds=(1,), progress=True)
    assert "round" not in capsys.readouterr().err  # stderr is no terminal here: no bar in a log (fl_core.progress)
    with monkeypatch.context() as m:
        m.setattr("fl_core.progress.on_terminal", lambda stream=None: True)
        run(small, seeds=(1,), progress=True)
    assert "3/3" in capsys.readouterr().err  # on a terminal: tqdm's bar over the seeds' rounds
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    seen.clear()
    run(small + ["name=cb"], seeds=(1, 2), write=True, progress=False,
        on_round=lambda s, r, row: seen.append((s, r)))
    assert seen == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    import mlflow

    parent = mlflow.MlflowClient().get_run(written_id := run(small + ["name=ids"], seeds=(1,), write=True,
                                                             progress=False).summary["mlflow_run_id"])
    assert parent.info.run_id == written_id and parent.info.status == "FINISHED"
    seen.clear()
    run(small + ["name=cb"], seeds=(1, 2), write=True, progress=False, on_round=lambda s, r, row: seen.append(s))
    assert seen == []  # finished earlier: nothing trained, nothing reported


def test_runs_use_engine_threads_and_give_the_callers_count_back():
    torch.set_num_threads(2)  # conftest sets 1 again for the next test
    seen = []
    run(TINY + ["engine.threads=1"], seeds=(1,), on_round=lambda s, r, row: seen.append(torch.get_num_threads()))
    assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    run(TINY + ["engine.threads=3"], seeds=(1,), on_round=lambda s, r, row: seen.append(torch.get_num_threads()))
    assert seen[3:] == [3, 3, 3] and torch.get_num_threads() == 2
