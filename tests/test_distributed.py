"""engine.executor=distributed (fl_core/engine/distributed.py): a round's clients over the ranks of a torchrun start,
with 2 gloo processes on the CPU.

- FedAvg, SCAFFOLD and FedBug(FedDyn) (client states travelling with their clients, partial participation, unequal
  clients) end with the sequential executor's model, bit for bit (same process, same thread count);
- a kill of a worker rank or of rank 0 stops the run, and the same command resumes it from rank 0's checkpoint to
  the uninterrupted run's numbers, with one MLflow run per seed;
- without torchrun it is one process; a half-set torchrun environment is one line naming what is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_sim

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args, cwd: Path, env_extra=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "FL_FAULT"}
    env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "PYTHONPATH": str(ROOT), **(env_extra or {})})
    torchrun = Path(sys.executable).with_name("torchrun")  # the console script docs/scaling.md uses
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, check=False, text=True, timeout=timeout)


def test_two_ranks_reproduce_the_sequential_executor(tmp_path):
    out = tmp_path / "report.json"
    proc = _torchrun([str(ROOT / "tests" / "distributed_check.py"), str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    for name in ("fedavg", "scaffold", "fedbug_feddyn"):
        r = report[name]
        assert r["bitwise"], f"{name}: distributed differs from sequential by {r['max_abs_diff']:.3g}"
        assert r["acc"] == r["ref_acc"]
        assert max(r["clients_per_round"]) >= 2  # both ranks trained clients


TRAIN = ["algorithm=fedbug", "algorithm.name=scaffold", "train.rounds=4", "train.local_epochs=1", "seed=1",
         "name=dist", "engine.progress=false", "engine.checkpoint_every=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """rounds.csv of the same experiment in one process with the sequential executor (1 thread, as torchrun
    sets OMP_NUM_THREADS=1 for its ranks)."""
    cwd = tmp_path_factory.mktemp("single")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    env.pop("FL_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", *TRAIN], cwd=cwd, env=env, capture_output=True,
                          check=False, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return (cwd / "results" / "dist" / "rounds.csv").read_text()


@pytest.mark.parametrize("fault", ["worker_task@3", "checkpoint_write@2"], ids=["worker_killed", "rank0_killed"])
def test_a_killed_rank_stops_the_run_and_the_same_command_resumes_it(tmp_path, uninterrupted, fault):
    cmd = ["-m", "pipeline.train", *TRAIN, "engine.executor=distributed"]
    killed = _torchrun(cmd, tmp_path, {"FL_FAULT": fault})
    assert killed.returncode != 0
    assert not (tmp_path / "results" / "dist").exists()  # nothing published by the killed run
    assert list((tmp_path / "checkpoints" / "dist").rglob("seed_1.pt"))  # rank 0's last checkpoint
    resumed = _torchrun(cmd, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dist seed 1: resumed from round" in resumed.stderr
    assert (tmp_path / "results" / "dist" / "rounds.csv").read_text() == uninterrupted

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fl-pipeline").experiment_id])
    assert sorted((r.data.tags.get("fl.role") or "child", r.info.status) for r in runs) == [
        ("child", "FINISHED"), ("parent", "FINISHED")]


def test_without_torchrun_it_is_one_process(digits, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    sim, dist_res = run_sim(digits, "algorithm=scaffold", "engine.executor=distributed")
    _, seq_res = run_sim(digits, "algorithm=scaffold", "engine.executor=sequential")
    assert sim.executor.name == "distributed" and sim.executor.size == 1
    assert torch.equal(dist_res.final_flat, seq_res.final_flat)


def test_a_half_set_torchrun_environment_is_one_line(monkeypatch):
    from fl_core.engine import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"^engine.executor=distributed with WORLD_SIZE=2 needs MASTER_ADDR, "
                                         r"MASTER_PORT: start with torchrun --nproc_per_node K -m pipeline.train"):
        distributed.init(torch.device("cpu"))
