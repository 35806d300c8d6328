"""Sweeps and MLflow tracking on PostgreSQL, as on several machines (docs/scaling.md).

A throwaway PostgreSQL server (:mod:`pg`, one per module) holds the Optuna study and, through an ``mlflow server``
on 127.0.0.1, the MLflow runs; 4 worker processes stand in for 4 machines: each runs the same ``sweeps.tune``
command at the same moment on a new database. The tested tree is the one imported: workers run
``python -m sweeps.tune`` from this repository with it on PYTHONPATH.

Skipped only where no PostgreSQL server binaries exist; with the environment variable CI set, that fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Dict, List

import optuna
import pytest

from pg import PostgresServer, find_bin_dir, free_port
from sweeps import tune
from sweeps.storage import StorageError, open_storage, setup_lock

ROOT = Path(__file__).resolve().parents[1]
MACHINES, TRIALS_EACH = 4, 10
STUDY = "lr-4x"
# the trials are tiny: an MLP on 3 clients, 2 rounds of 2 local steps (a fraction of a second each)
SPACE = """\
description: local learning rate on a tiny digits run (tests)
base: [model=mlp, partition=iid, partition.num_clients=3, train.rounds=2, train.local_steps=2, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-3, high: 0.5, log: true}
"""
SERVER_READY_S = 120  # mlflow server: start-up on a loaded 2-core machine takes 5-15 s
WORKERS_DONE_S = 300  # the 4 workers together: about 25 s on 2 cores


@pytest.fixture(scope="module")
def postgres():
    """A started :class:`pg.PostgresServer`, stopped (and its folder removed) after the module's tests."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        reason = "no PostgreSQL server binaries (no /usr/lib/postgresql/*/bin/pg_ctl, no pg_ctl on PATH)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, and CI machines must have them", pytrace=False)
        pytest.skip(reason)
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background GenAI job runners (docs/scaling.md)


def mlflow_server_command(backend_store_uri: str, artifacts: Path, host: str, port: int, workers: int) -> List[str]:
    """The ``mlflow server`` command of docs/scaling.md (run with :data:`SERVER_ENV`): runs in PostgreSQL, artifacts
    served from a folder, only the Host header ``host:port`` accepted on the API."""
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
            "--artifacts-destination", str(artifacts), "--host", host, "--port", str(port),
            "--allowed-hosts", f"{host}:{port}", "--workers", str(workers)]


def _stop(proc: subprocess.Popen, wait_s: float = 15) -> None:
    """Terminate ``proc``, then kill it if it is still there after ``wait_s`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=wait_s)


def _stop_group(proc: subprocess.Popen, wait_s: float = 15) -> None:
    """SIGTERM the process group that ``proc`` leads (``mlflow server`` and its uvicorn), then SIGKILL what is left
    of it after ``wait_s`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.1)
        if not _group_alive(proc):
            return


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader once it exits
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory):
    """``http://127.0.0.1:<port>`` of an ``mlflow server`` whose backend store is a database of ``postgres``,
    once its /health answers; the server's process group is stopped after the module's tests."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    with open(folder / "server.log", "w") as log:
        proc = subprocess.Popen(mlflow_server_command(postgres.create_database("mlflow"), folder / "mlartifacts",
                                                      "127.0.0.1", port, workers=1),
                                stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
                                # its lock files stay in folder
                                env={**os.environ, **SERVER_ENV, "TMPDIR": str(folder)})
        try:
            deadline = time.monotonic() + SERVER_READY_S
            while True:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as res:
                        if res.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                assert proc.poll() is None, \
                    f"mlflow server exited ({proc.returncode}): {_tail(folder / 'server.log')}"
                assert time.monotonic() < deadline, f"mlflow server not ready in {SERVER_READY_S} s: " \
                                                    f"{_tail(folder / 'server.log')}"
                time.sleep(0.2)
            yield {"uri": uri, "artifacts": folder / "mlartifacts"}
        finally:
            _stop_group(proc)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def sweep_command(space: Path, storage: str, out: Path, *options: str) -> List[str]:
    """The ``fl-tune`` command of docs/scaling.md, as ``python -m sweeps.tune`` of this tree (``--out`` added: the
    outputs stay in the test's folder)."""
    return [sys.executable, "-m", "sweeps.tune", "--space", str(space), "--storage", storage, "--study-name", STUDY,
            *options, "--out", str(out)]


def _run_all(commands: List[List[str]], env: Dict[str, str], logs: List[Path], timeout_s: float) -> List[int]:
    """Start every command at once (cwd: the repository), wait for all (at most ``timeout_s`` seconds in all;
    those still running then are killed); their exit statuses."""
    procs = []
    with contextlib.ExitStack() as files:  # the logs, closed after the processes are stopped
        try:
            for cmd, log in zip(commands, logs):
                out = files.enter_context(open(log, "w"))
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            return [p.poll() if p.poll() is not None else -1 for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)


@pytest.mark.slow
def test_four_machines_run_one_study_through_postgres_and_one_tracking_server(postgres, mlflow_server, tmp_path):
    """4 workers start the same command together on a new database (Optuna creates its tables, the study, the
    MLflow experiment and the parent run once, under setup_lock); 10 trials each: 40 trials numbered
    0..39, each exactly one MLflow run on the server, under one parent run. Then ``--n-trials 0`` on one of them
    tests the best configuration and ends the parent run."""
    from mlflow.tracking import MlflowClient

    storage = postgres.create_database("optuna")
    space, out = tmp_path / "lr.yaml", tmp_path / "out"
    space.write_text(SPACE)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server["uri"], "PYTHONPATH": str(ROOT)}
    logs = [tmp_path / f"machine-{m}.log" for m in range(1, MACHINES + 1)]
    work = sweep_command(space, storage, out, "--n-trials", str(TRIALS_EACH), "--no-test")
    t0 = time.monotonic()
    codes = _run_all([work] * MACHINES, env, logs, WORKERS_DONE_S)
    print(f"{MACHINES} workers x {TRIALS_EACH} trials: {time.monotonic() - t0:.1f} s")
    assert codes == [0] * MACHINES, "\n".join(f"{log.name}: {_tail(log)}" for log in logs)

    study = optuna.load_study(study_name=STUDY, storage=open_storage(storage))
    trials = study.get_trials(deepcopy=False)
    n = MACHINES * TRIALS_EACH
    assert len(trials) == n
    assert sorted(t.number for t in trials) == list(range(n))  # no number lost or taken twice
    states = Counter(t.state.name for t in trials)
    assert set(states) <= {"COMPLETE", "PRUNED"} and states["COMPLETE"] >= 5, states  # none FAIL or RUNNING
    per_worker = Counter(t.user_attrs["pid"] for t in trials)
    assert len(per_worker) == MACHINES and set(per_worker.values()) == {TRIALS_EACH}  # each its --n-trials

    client = MlflowClient(tracking_uri=mlflow_server["uri"])
    exp = client.get_experiment_by_name("fl-pipeline-sweeps")
    assert exp is not None and exp.artifact_location.startswith("mlflow-artifacts:")  # served by the server
    runs = client.search_runs([exp.experiment_id], f"tags.optuna_study = '{STUDY}'", max_results=1000)
    roles = Counter(r.data.tags["sweep_role"] for r in runs)
    assert roles == {"trial": n, "study": 1}, roles  # one parent run, not one per machine
    parent = next(r for r in runs if r.data.tags["sweep_role"] == "study")
    assert parent.info.run_id == study.user_attrs["mlflow_parent_run_id"]
    by_number = Counter(int(r.data.tags["optuna_trial"]) for r in runs if r.data.tags["sweep_role"] == "trial")
    assert sorted(by_number) == list(range(n)) and set(by_number.values()) == {1}  # each trial exactly one run
    trial_of = {t.number: t for t in trials}
    for r in (r for r in runs if r.data.tags["sweep_role"] == "trial"):
        t = trial_of[int(r.data.tags["optuna_trial"])]
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (r.data.tags["optuna_state"], r.info.status) == (
            t.state.name, {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}[t.state.name])
        assert r.data.tags["fl.pid"] == str(t.user_attrs["pid"])  # logged by the worker that ran the trial
        if t.state.name == "COMPLETE":
            assert r.data.metrics["objective_val_acc"] == pytest.approx(t.value, abs=1e-12)
    assert parent.info.status == "FINISHED"  # ended by the worker that finished last

    # one machine, once all are done: the same command with --n-trials 0 tests the best and ends the parent run
    final = subprocess.run(sweep_command(space, storage, out, "--n-trials", "0"), cwd=ROOT, env=env,
                           capture_output=True, check=False, text=True, timeout=WORKERS_DONE_S)
    assert final.returncode == 0, final.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["trials"], summary["running"], summary["failed"]) == (n, 0, 0)
    assert summary["storage"] == storage and summary["mlflow_parent_run_id"] == parent.info.run_id
    best_test = client.search_runs([exp.experiment_id], f"tags.optuna_study = '{STUDY}' and "
                                                        "tags.sweep_role = 'best_test'")
    assert len(best_test) == 1 and best_test[0].data.tags["optuna_trial"] == str(summary["best"]["trial"])
    parent = client.get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["best_test_acc"] == pytest.approx(summary["best_test_acc"])
    assert parent.data.tags["storage"] == storage
    assert {"summary.md", "best.yaml", "trials.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    stored = {p.name for p in mlflow_server["artifacts"].rglob("*") if p.is_file()}
    assert {"summary.md", "best.yaml", "trials.csv"} <= stored  # uploaded through the server into its folder


def test_the_setup_lock_has_one_holder_at_a_time_and_a_bounded_wait(postgres):
    url = postgres.create_database("locks")
    waits: List[str] = []
    with setup_lock(url) as how:
        assert how == "advisory"
        t0 = time.monotonic()
        with pytest.raises(StorageError) as err:
            with setup_lock(url, timeout_s=0.5, poll_s=0.05, on_wait=waits.append):
                pytest.fail("a second holder got the lock")
        assert 0.5 <= time.monotonic() - t0 < 5
        assert str(err.value) == (f"--storage {url}: another process held the study-setup lock for 0.5 s "
                                  "(a sweep stuck while it starts?)")
        assert waits == [f"another process is setting up a study in {url}: waiting for it (at most 0.5 s)"]
    with setup_lock(url, timeout_s=0.5) as how:  # released at the end of the block
        assert how == "advisory"
    assert len(waits) == 1


def test_a_killed_holder_releases_the_setup_lock(postgres):
    """The advisory lock belongs to the holder's connection: the server drops it when the process dies."""
    url = postgres.create_database("killed")
    code = ("import time; from sweeps.storage import setup_lock\n"
            f"with setup_lock({url!r}, timeout_s=30):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([holder.stdout], [], [], 60)[0], "the holder did not report in 60 s"
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StorageError, match="held the study-setup lock"):
            with setup_lock(url, timeout_s=0.3):
                pass
        holder.kill()
        holder.wait(timeout=30)
        with setup_lock(url, timeout_s=30) as how:
            assert how == "advisory"
    finally:
        _stop(holder, 5)
        holder.stdout.close()


@pytest.mark.parametrize("database,message", [
    ("nosuchdb", 'cannot open the storage (OperationalError: (psycopg.OperationalError) connection failed: '),
    (None, "cannot open the storage (OperationalError: (psycopg.OperationalError) connection failed: "),
])
def test_storage_errors_name_the_storage_in_one_line(postgres, tmp_path, capsys, database, message):
    """A database that does not exist, a port nothing listens on: exit 2, one line naming --storage."""
    url = postgres.url(database) if database else f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/optuna"
    space = tmp_path / "lr.yaml"
    space.write_text(SPACE)
    assert tune.main(["--space", str(space), "--n-trials", "1", "--storage", url, "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --storage {url}: {message}") and "\n" not in err, err
    if database:
        assert f'database "{database}" does not exist' in err
