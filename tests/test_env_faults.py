"""When the environment fails (fl_core/store/envfail.py, docs/reliability.md): one line, exit status 3, no run left RUNNING,
nothing lost.

Faults are real where that is cheap and portable (a file where a folder is needed) and injected at named points
otherwise (``FL_FAULT=POINT:ENOSPC`` / ``:EROFS`` raise the OSError the failed write would; root ignores permission
bits, so a read-only folder is a read-only mount where ``unshare`` allows one, else ``path_check:EROFS``). A run that
fails is then run again and must end with exactly the runs and metrics of an uninterrupted run. The torchrun cases
(a worker killed, a worker frozen) are marked slow, as in tests/test_distributed.py.

The tracking store and the databases (fl_core/store/storefail.py, fl_core/store/storewait.py) fail for real: a second process
holds the SQLite lock, a port nothing listens on, a folder that does not exist; a throwaway PostgreSQL server
(tests/pg.py) stopped, frozen with SIGSTOP or restarted under a sweep (those marked slow).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fl_core.store import envfail, faults
from pg import trial_states
from test_faults import GRID, SEEDS, _env, _fork, _forked, _in_process, _mlflow_state, _project, _wait

ROOT = Path(__file__).resolve().parent.parent
SINGLE = ["train.rounds=2", "seed=1", "engine.progress=false", "partition.num_clients=4", "train.local_epochs=1"]


def _lines(text: str) -> list:
    return [ln for ln in text.strip().splitlines() if ln.strip()]


def _files(tmp: Path) -> set:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """In-process runs count fault hits from zero; FL_DEBUG unset unless a test sets it."""
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.delenv(envfail.DEBUG_ENV, raising=False)
    monkeypatch.delenv(faults.ENV, raising=False)


# --------------------------------------------------------------------------- the classifier


def test_os_errors_map_to_one_line_naming_the_place_and_the_key(tmp_path):
    envfail.name_place(tmp_path / "ck", "checkpoint folder", "engine.checkpoint_dir")
    full = envfail.classify(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck" / "e" / "s.pt.tmp")))
    assert str(full) == (f"checkpoint folder {tmp_path / 'ck'} is out of space (no space left on device writing "
                         "e/s.pt.tmp); free space there or choose another engine.checkpoint_dir=..., then run the same "
                         "command again")
    ro = envfail.classify(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ck")))
    assert ro.cause == "is not writable (read-only file system)" and "engine.checkpoint_dir=" in ro.action
    (tmp_path / "f").write_text("x")
    assert envfail.classify(FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "f"))).cause == \
        "is a file, not a folder"
    assert envfail.classify(FileExistsError(errno.EEXIST, "File exists", str(tmp_path))) is None  # a folder: a bug
    assert envfail.classify(OSError(errno.ENOENT, "No such file", "x")) is None  # missing input: not the machine


def test_the_chain_is_searched_but_not_through_from_none():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            # torch.save: an implicit chain (__context__, not __cause__), the path this test covers
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as err:
        wrapped = err
    assert envfail.classify(wrapped).cause == "is out of space (no space left on device)"
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise ValueError("bad input") from None
    except ValueError as err:
        assert envfail.classify(err) is None
    assert envfail.classify(KeyboardInterrupt()) is None and envfail.classify(ValueError("x")) is None


def test_torch_distributed_errors_and_registered_classifiers():
    import torch.distributed as dist

    got = envfail.classify(dist.DistStoreError("Timed out after 901 seconds waiting for clients. 1/2 clients joined."))
    assert got.resource == "the torch.distributed process group" and "1/2 clients joined" in got.cause

    class LockedStore(Exception):
        pass

    def locked(err):
        return envfail.EnvironmentFailure("tracking store x.db", "is locked", "wait") if isinstance(err, LockedStore) \
            else None

    envfail.register(locked)
    try:
        assert str(envfail.classify(LockedStore())) == "tracking store x.db is locked; wait"
    finally:
        envfail._CLASSIFIERS.remove(locked)


def test_writing_names_the_file_of_a_wrapped_os_error(tmp_path):
    with pytest.raises(OSError) as err, envfail.writing(tmp_path / "a.tmp"):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")  # noqa: B904 (an implicit chain, as torch.save's)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "a.tmp")
    with pytest.raises(ValueError), envfail.writing(tmp_path / "a.tmp"):
        raise ValueError("not the environment")


# --------------------------------------------------------------------------- folders checked before anything is written


def test_check_folder_refuses_a_file_and_a_file_in_the_path_and_creates_nothing(tmp_path):
    (tmp_path / "f").write_text("x")
    before = _files(tmp_path)
    with pytest.raises(envfail.EnvironmentFailure, match=r"^results folder .*/f is a file, not a folder; choose "
                                                         r"another results_dir=\.\.\."):
        envfail.check_folder(tmp_path / "f", "results folder", "results_dir")
    with pytest.raises(envfail.EnvironmentFailure, match=r"/f/sub is not a folder \(.*/f is a file\)"):
        envfail.check_folder(tmp_path / "f" / "sub", "results folder", "results_dir")
    envfail.check_folder(tmp_path / "new" / "deeper", "results folder", "results_dir")  # to be created: fine
    assert _files(tmp_path) == before


@pytest.mark.parametrize("code,cause", [("EROFS", "read-only file system"), ("EACCES", "permission denied")])
def test_check_folder_reports_a_folder_it_cannot_write(tmp_path, monkeypatch, code, cause):
    monkeypatch.setenv(faults.ENV, f"path_check:{code}")
    with pytest.raises(envfail.EnvironmentFailure) as err:
        envfail.check_folder(tmp_path / "results", "results folder", "results_dir")
    assert str(err.value) == (f"results folder {tmp_path / 'results'} cannot be created: {tmp_path} is not writable "
                              f"({cause}); choose another results_dir=..., then run the same command again")
    assert _files(tmp_path) == set()


# --------------------------------------------------------------------------- fl-train: wrong folders


@pytest.mark.parametrize("key,label", [("results_dir", "results folder"),
                                       ("engine.checkpoint_dir", "checkpoint folder")])
def test_a_file_where_a_folder_is_needed_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, key, label):
    (tmp_path / "taken").write_text("a file")
    before = _files(tmp_path)
    capsys.readouterr()
    assert _in_process(tmp_path, [*SINGLE, f"{key}=taken"], monkeypatch) == envfail.EXIT_STATUS
    err = capsys.readouterr().err
    assert _lines(err) == [f"error: {label} taken is a file, not a folder; choose another {key}=... (or move the "
                           "file away), then run the same command again"]
    assert _files(tmp_path) == before  # no lock file, no results/, no checkpoints/, no MLflow store


def test_debug_and_fl_debug_show_the_traceback(tmp_path, monkeypatch):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(envfail.EnvironmentFailure):
        _in_process(tmp_path, [*SINGLE, "results_dir=taken", "--debug"], monkeypatch)
    monkeypatch.setenv(envfail.DEBUG_ENV, "1")
    with pytest.raises(envfail.EnvironmentFailure):
        _in_process(tmp_path, [*SINGLE, "results_dir=taken"], monkeypatch)


def test_a_read_only_results_folder_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENV, "path_check:EROFS")  # the first folder probed: results_dir's parent
    capsys.readouterr()
    from pipeline.train import main

    monkeypatch.chdir(tmp_path)
    assert main([*SINGLE, "results_dir=out/results"]) == envfail.EXIT_STATUS
    assert _lines(capsys.readouterr().err) == [
        "error: results folder out/results cannot be created: " f"{tmp_path} is not writable (read-only file system); "
        "choose another results_dir=..., then run the same command again"]
    assert _files(tmp_path) == set()


def _unshare_mount_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"], capture_output=True,
                           check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_mount_works(), reason="no private mount namespace (unshare -rm) here")
def test_a_real_read_only_mount_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    env.pop(faults.ENV, None)
    cmd = (f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m pipeline.train {' '.join(SINGLE)} "
           f"results_dir={ro}/results")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode == envfail.EXIT_STATUS, proc.stderr[-2000:]
    assert _lines(proc.stderr) == [f"error: results folder {ro}/results cannot be created: {ro} is not writable "
                                   "(read-only file system); choose another results_dir=..., then run the same "
                                   "command again"]


# --------------------------------------------------------------------------- a full disk during a run


def _histories(tmp: Path) -> dict:
    """{(seed, metric): [(step, value), ...]} of every child run (wall-clock timings left out)."""
    client, runs = _mlflow_state(tmp)
    out = {}
    for r in runs:
        if "fl.seed" not in r.data.tags or "mlflow.parentRunId" not in r.data.tags:
            continue
        for key in r.data.metrics:
            if key not in ("round/time_s", "round_time_s"):  # wall-clock round times differ on every run
                out[(r.data.tags["fl.seed"], key)] = sorted((m.step, m.value)
                                                            for m in client.get_metric_history(r.info.run_id, key))
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, empty_store):
    """An uninterrupted run of the grid: its final models and every child run's metric history."""
    tmp = _project(tmp_path_factory.mktemp("uninterrupted"), store=empty_store)
    assert _forked(tmp, ["--grid", "exp"]) == 0
    models = {s: torch.load(tmp / "results" / "exp" / "models" / f"seed_{s}.pt") for s in SEEDS}
    return tmp, models, _histories(tmp)


def _assert_as_uninterrupted(tmp: Path, uninterrupted) -> None:
    """After the rerun: the uninterrupted run's final models and every metric of it, once; one parent and one child
    per seed, all FINISHED."""
    _ref_dir, ref_models, ref_hist = uninterrupted
    for s in SEEDS:
        got = torch.load(tmp / "results" / "exp" / "models" / f"seed_{s}.pt")
        assert all(torch.equal(got[k], ref_models[s][k]) for k in ref_models[s])
    assert _histories(tmp) == ref_hist
    _client, runs = _mlflow_state(tmp)
    assert len(runs) == 1 + len(SEEDS) and {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.parametrize("fault,where", [
    ("checkpoint_write@3:ENOSPC", "checkpoint folder checkpoints is out of space (no space left on device writing "
                                  "exp/"),  # seed 1, round 3: seed_1.pt holds round 2
    pytest.param("outputs_write@6:ENOSPC", "results folder results is out of space (no space left on device writing "
                 ".exp.staging/models/", marks=pytest.mark.slow),  # seed 1's model, after its completion record
    pytest.param("outputs_write@16:ENOSPC", "results folder results is out of space (no space left on device writing "
                 ".exp.staging/.metrics.json", marks=pytest.mark.slow),  # both seeds done, the outputs being staged
])
def test_disk_full_is_one_line_and_the_rerun_loses_nothing(tmp_path, monkeypatch, capsys, empty_store,
                                                            uninterrupted, fault, where):
    tmp = _project(tmp_path / "p", store=empty_store)
    log = tmp_path / "stderr"
    assert _forked(tmp, ["--grid", "exp"], fault, stderr=log) == envfail.EXIT_STATUS
    lines = _lines(log.read_text())
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}"), lines
    assert lines[0].endswith("then run the same command again")
    # nothing half-written, the last checkpoint valid, no MLflow run left RUNNING
    assert [p for p in tmp.rglob("*") if p.name.endswith(".tmp") or ".staging" in p.name] == []
    if fault.startswith("checkpoint_write"):
        attempt = next((tmp / "checkpoints" / "exp").iterdir())
        assert torch.load(attempt / "seed_1.pt", weights_only=True)["round"] == 2
        assert torch.load(attempt / "seed_1.pt.prev", weights_only=True)["round"] == 1
    _client, runs = _mlflow_state(tmp)
    assert runs and {r.info.status for r in runs} <= {"FINISHED", "FAILED"}  # none RUNNING; KILLED is for signals
    failed = [r for r in runs if r.info.status == "FAILED"]
    assert any(r.data.tags.get("fl.role") == "parent" for r in failed)
    assert all(r.data.tags["fl.end_reason"] == f"environment failure: {lines[0][len('error: '):]}" for r in failed)
    # the same command again: one clean run per seed, every metric of the uninterrupted run, once
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    _assert_as_uninterrupted(tmp, uninterrupted)
    assert not (tmp / "checkpoints" / "exp").exists()


def test_the_report_on_a_full_disk_is_one_line(uninterrupted, monkeypatch, capsys):
    from pipeline.report import main as report

    tmp = uninterrupted[0]
    monkeypatch.chdir(tmp)
    monkeypatch.setenv(faults.ENV, "outputs_write:ENOSPC")
    capsys.readouterr()
    assert report([]) == envfail.EXIT_STATUS
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: report folder results is out of space (no space left on "
                                                   "device writing .curves.png.")
    assert [p for p in (tmp / "results").glob(".*") if p.is_file()] == []  # the temporary file is gone


# --------------------------------------------------------------------------- the data stages


def test_data_stages_on_a_full_disk_or_a_file_as_data_dir(tmp_path, monkeypatch, capsys):
    from pipeline import partition, prepare

    _project(tmp_path, {**GRID, "seeds": [1]})
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    monkeypatch.setenv(faults.ENV, "prepare_write:ENOSPC")
    assert prepare.main([]) == envfail.EXIT_STATUS
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: data folder data is out of space (no space left on device "
                                                   "writing prepared/.digits.pt.")
    monkeypatch.setenv(faults.ENV, "partition_write:ENOSPC")
    assert prepare.main([]) == 0
    assert partition.main([]) == envfail.EXIT_STATUS
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and "error: data folder data is out of space (no space left on device writing partitions/" \
        in lines[0]
    assert [p for p in (tmp_path / "data").rglob(".*") if p.is_file()] == []  # no temporary file left
    monkeypatch.delenv(faults.ENV)
    assert partition.main([]) == 0
    shutil.rmtree(tmp_path / "data")
    (tmp_path / "data").write_text("a file")
    capsys.readouterr()
    assert prepare.main([]) == envfail.EXIT_STATUS
    assert _lines(capsys.readouterr().err) == ["error: data folder data is a file, not a folder; choose another "
                                               "data_dir=... (or move the file away), then run the same command again"]


# --------------------------------------------------------------------------- the tracking store and the databases


def _hold_sqlite_lock(db: Path) -> subprocess.Popen:
    """A second process holding an exclusive lock on the SQLite file ``db`` (``BEGIN EXCLUSIVE``: no other process
    reads or writes it) until it is killed; returns once the lock is held."""
    code = ("import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)\n"
            "c.execute('BEGIN EXCLUSIVE')\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held", "the lock holder did not report"
    return holder


def _release(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait(timeout=30)
    holder.stdout.close()


def _fork_train(tmp: Path, args, env: dict, stderr: Path) -> int:
    """``pipeline.train``'s main(args) in a forked copy of this process with ``env`` added (the project's store
    unless ``env`` names another); its pid (see :func:`_wait`)."""
    return _fork(tmp, args, {**_env(tmp), **env}, stderr)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_a_tracking_store_locked_during_a_run_is_one_line_and_the_rerun_loses_nothing(
        tmp_path, monkeypatch, capsys, empty_store, uninterrupted):
    """The SQLite store locked by a second process in the middle of seed 1 (the run stops itself at its 3rd
    checkpoint write, the lock is taken, the run continues): its next write waits FL_SQLITE_BUSY_TIMEOUT_S, then
    one line and exit 3; the runs, which only the locked store could end, are left to the rerun, which ends them as
    orphans, continues them and loses nothing."""
    from fl_core.store import storewait

    tmp = _project(tmp_path / "p", store=empty_store)
    log, stamp = tmp_path / "stderr", tmp_path / "stamp"
    pid = _fork_train(tmp, ["--grid", "exp"], {faults.ENV: "checkpoint_write@3:STOP", faults.STAMP_ENV: str(stamp),
                                               storewait.SQLITE_BUSY_ENV: "2"}, log)
    try:
        deadline = time.monotonic() + 240
        while not (stamp.exists() and _stopped(pid)):
            assert time.monotonic() < deadline, "the run did not reach its 3rd checkpoint write"
            time.sleep(0.05)
        holder = _hold_sqlite_lock(tmp / "mlflow.db")
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert _wait(pid) == envfail.EXIT_STATUS
    finally:
        _release(holder)
    assert _lines(log.read_text()) == [
        f"error: tracking store sqlite:///{tmp / 'mlflow.db'} is locked by another process for 2 s; retry, or set "
        "MLFLOW_TRACKING_URI to a tracking server, then run the same command again"]
    attempt = next((tmp / "checkpoints" / "exp").iterdir())
    assert torch.load(attempt / "seed_1.pt", weights_only=True)["round"] == 3  # the last checkpoint is valid
    _client, runs = _mlflow_state(tmp)
    assert sorted(r.info.status for r in runs) == ["RUNNING", "RUNNING"]  # parent, seed 1: only the store can end them
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    assert "exp: ended 2 MLflow run(s) left RUNNING by a process that is gone" in capsys.readouterr().err
    _assert_as_uninterrupted(tmp, uninterrupted)


def test_a_tracking_server_port_nothing_listens_on_is_one_line(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI at a dead port: MLflow's own retries (here 1, backoff factor 1), then one line and exit
    3; the project's defaults (10 retries, factor 1, 15 s per request) apply only where the variables are unset. The
    line names the settings of the retry window: the deadline FL_HTTP_RETRY_S and the count (issue 32)."""
    from fl_core.store import storewait
    from test_distributed import _free_port

    for key in storewait.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    assert storewait.http_defaults() == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                                         "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
    assert storewait.http_retry_window_s() == (1, 0.0, 15.0)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    assert storewait.http_retry_window_s() == (5, 30.0, 15.0)  # pauses 0, 2, 4, 8, 16 s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    (tmp_path / "p").mkdir()
    uri = f"http://user:secret@127.0.0.1:{_free_port()}"
    log = tmp_path / "stderr"
    assert _wait(_fork_train(tmp_path / "p", SINGLE, {"MLFLOW_TRACKING_URI": uri}, log)) == envfail.EXIT_STATUS
    shown = uri.replace(":secret@", ":***@")
    assert _lines(log.read_text()) == [
        f"error: tracking server {shown} does not answer (connection refused; MLflow retried 1 time over about 0 s, "
        "FL_HTTP_RETRY_S / MLFLOW_HTTP_REQUEST_MAX_RETRIES); start it or set MLFLOW_TRACKING_URI to one that "
        "answers, then run the same command again"]


def _mlflow_session():
    """MLflow's HTTP session as its client makes it for a request (retries from the MLFLOW_HTTP_REQUEST_* settings)."""
    from mlflow.utils import request_utils

    return request_utils._get_request_session(int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]),
                                              int(os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]), 0.0,
                                              request_utils._TRANSIENT_FAILURE_RESPONSE_CODES, True, True)


def test_mlflow_http_retries_end_at_a_wall_clock_deadline(monkeypatch):
    """Issue 32: the retries of one request end FL_HTTP_RETRY_S after its first failure, whatever the retry count
    (10 retries with backoff factor 1 are 6 minutes of pauses by urllib3's exponential schedule alone), and the
    pauses are spread over the deadline (no 16 s gap at its end: the window's arithmetic with the defaults)."""
    import requests

    from fl_core.store import storewait
    from test_distributed import _free_port

    for key in storewait.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(storewait.HTTP_RETRY_ENV, raising=False)
    assert storewait.http_defaults()["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "10"
    assert storewait._DEADLINE_RETRY[0] is not None
    assert storewait.http_retry_window_s() == (10, 30.0, 15.0)
    pauses = [0.0] + [storewait.spread_pause(min(120.0, 2.0 ** (n - 1)), 30.0 - sum_, 10 - n + 1)
                      for n, sum_ in ((2, 0.0), (3, 2.0))]
    assert pauses == [0.0, 2.0, 3.5]  # then 3.5 s each: a restarted server is reached within 3.5 s
    monkeypatch.setenv(storewait.HTTP_RETRY_ENV, "2")
    t0 = time.monotonic()
    with pytest.raises(requests.exceptions.ConnectionError):
        _mlflow_session().get(f"http://127.0.0.1:{_free_port()}/health", timeout=1)
    assert 1.5 < time.monotonic() - t0 < 3.5


def test_mlflow_http_retries_reach_a_server_soon_after_it_answers_again(monkeypatch):
    """A tracking server that answers again 3 s after the first failure (a restart) is reached within about one
    spread pause (here FL_HTTP_RETRY_S=10: about 1.1 s apart), not at the next exponential step (6 s, then 14 s)."""
    import http.server
    import socket
    import threading

    from fl_core.store import storewait

    for key in storewait.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(storewait.HTTP_RETRY_ENV, "10")
    storewait.http_defaults()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *_args):
            pass

    servers = []

    def serve_later() -> None:
        time.sleep(3.0)
        servers.append(http.server.HTTPServer(("127.0.0.1", port), Ok))
        servers[0].serve_forever(poll_interval=0.1)

    threading.Thread(target=serve_later, daemon=True).start()
    t0 = time.monotonic()
    try:
        assert _mlflow_session().get(f"http://127.0.0.1:{port}/health", timeout=2).text == "OK"
        assert time.monotonic() - t0 < 3.0 + 1.5
    finally:
        if servers:
            servers[0].shutdown()


def test_the_campaigns_busy_processes_run_in_sessions_of_their_own_and_end_with_it():
    """benchmarks/env_faults.py --busy N: N CPU-bound processes, each in its own session (the kernel's autogroups
    share the CPU between sessions, so only then do they load the commands under test), killed by stop(); one whose
    campaign died ends by itself."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.env_faults import BUSY_CODE, Busy

    busy = Busy(2)
    try:
        assert [p.poll() for p in busy.procs] == [None, None]
        assert all(os.getsid(p.pid) == p.pid != os.getsid(0) for p in busy.procs)
    finally:
        busy.stop()
    assert all(p.returncode is not None for p in busy.procs)
    orphan = subprocess.Popen([sys.executable, "-c", BUSY_CODE, "1"])  # its "campaign" (pid 1) is not its parent
    assert orphan.wait(timeout=30) == 0


def test_waits_for_a_database_share_one_deadline_per_outage(monkeypatch):
    """wait_until_back counts FL_DB_RETRY_S from the outage's first failure: a second wait of the same outage does
    not start a new one (a server that seemed back and failed again), a call that succeeds ends the outage, and a
    server that answers "the database system is starting up" (57P03) is not back."""
    from fl_core.store import storewait
    from test_distributed import _free_port

    url = f"postgresql+psycopg://postgres@127.0.0.1:{_free_port()}/optuna"  # nothing listens: refused at once
    storewait.answered(url)
    t0 = time.monotonic()
    assert storewait.wait_until_back(url, within_s=1.5)[0] is False
    first = time.monotonic() - t0
    assert 1.4 < first < 2.5
    t1 = time.monotonic()
    back, since = storewait.wait_until_back(url, within_s=1.5)
    assert back is False and time.monotonic() - t1 < 0.3 and since >= 1.5  # the same outage: its deadline passed
    storewait.answered(url)  # a call succeeded: the next failure is a new outage
    t2 = time.monotonic()
    assert storewait.wait_until_back(url, within_s=0.5)[0] is False
    assert 0.4 < time.monotonic() - t2 < 1.5
    storewait.answered(url)

    class StartingUp(Exception):
        sqlstate = "57P03"

    class Engine:
        def connect(self):
            raise StartingUp("FATAL:  the database system is starting up")

        def dispose(self):
            pass

    import sqlalchemy

    monkeypatch.setattr(sqlalchemy, "create_engine", lambda *a, **k: Engine())
    assert storewait.probe(url) == (True, "")  # alive: the stall watch leaves a slow server alone
    assert storewait.probe(url, ready=True) == (False, "FATAL:  the database system is starting up")


def test_the_trial_heartbeat_starts_the_outage_clock():
    """A heartbeat that fails tells on_error at once (sweeps.runner.optimize: the outage begins then, even while the
    trial computes and has not used the storage itself)."""
    from types import SimpleNamespace

    from sweeps.storage import heartbeat

    errors = []

    class Storage:
        def get_heartbeat_interval(self):
            return 10

        def record_heartbeat(self, _trial_id):
            raise ConnectionError("server closed the connection")

    study = SimpleNamespace(_storage=Storage())
    with heartbeat(study, SimpleNamespace(_trial_id=1, number=0), errors.append):
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    assert errors and isinstance(errors[0], ConnectionError)


def test_a_sqlite_store_in_a_missing_folder_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys):
    from pipeline.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/typo/mlflow.db")
    capsys.readouterr()
    assert main(SINGLE) == envfail.EXIT_STATUS
    assert _lines(capsys.readouterr().err) == [
        f"error: tracking store sqlite:///{tmp_path}/typo/mlflow.db is in a folder that does not exist "
        f"({tmp_path}/typo); create the folder or set MLFLOW_TRACKING_URI to a store in an existing one, then run the "
        "same command again"]
    assert _files(tmp_path) == set()  # no folder, no lock file, no results


def test_database_errors_name_the_database_with_the_password_masked():
    """Real driver errors through SQLAlchemy: a PostgreSQL port nothing listens on (psycopg's "connection refused"),
    a SQLite file locked by another process; the role given with storefail.name_store names them."""
    import sqlalchemy

    from fl_core.store import storefail, storewait
    from test_distributed import _free_port

    url = f"postgresql+psycopg://fl:s3cret@127.0.0.1:{_free_port()}/optuna"
    engine = sqlalchemy.create_engine(url, **storewait.engine_kwargs(url))
    with pytest.raises(sqlalchemy.exc.OperationalError) as err:
        engine.connect()
    got = envfail.classify(err.value)
    shown = url.replace(":s3cret@", ":***@")
    assert str(got) == (f"database {shown} refused the connection (connection refused: is the server running?); "
                        "check that the PostgreSQL server runs and answers, then run the same command again")
    assert got.store == shown and "s3cret" not in str(got)
    storefail.name_store(url.replace("+psycopg", ""), "Optuna storage")  # another spelling of the same database
    assert str(envfail.classify(err.value)).startswith(f"Optuna storage {shown} refused the connection")
    assert storewait.pg_connect_args(url)["connect_timeout"] == 10
    assert "connect_timeout" not in storewait.pg_connect_args(url + "?connect_timeout=3")  # the URL's own


def test_a_storage_that_refuses_mid_sweep_reads_as_lost_whatever_the_timing(monkeypatch):
    """A sweep's storage answered before wait_for_storage is called: whether the failing call held a pooled
    connection (server closed it) or opened a new one (refused) is timing, so both read as a lost connection."""
    from fl_core.store import storefail, storewait
    from sweeps.storage import wait_for_storage

    url = "postgresql+psycopg://fl:s3cret@127.0.0.1:1/optuna"
    monkeypatch.setattr(storewait, "wait_until_back", lambda u: (False, 3.0))
    settings = type("S", (), {"storage": url})()
    for cause in (storefail.REFUSED, "lost its connection (server closed the connection unexpectedly)"):
        failure = envfail.EnvironmentFailure("Optuna storage x", cause, "check it", store=url)
        with pytest.raises(envfail.EnvironmentFailure) as got:
            wait_for_storage(settings, failure)
        assert got.value.cause.startswith("lost its connection (") and "did not answer again within" in got.value.cause
    assert storefail.after_answering("does not answer (timeout expired)") == "does not answer (timeout expired)"


def test_sqlite_busy_timeout_replaces_mlflows_and_bounds_a_lock(tmp_path, monkeypatch):
    import sqlalchemy

    from fl_core.store import storewait

    storewait.install()
    monkeypatch.setenv(storewait.SQLITE_BUSY_ENV, "0.5")
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        conn.commit()
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 500
        conn.exec_driver_sql("PRAGMA busy_timeout = 20000;")  # what MLflow's sessions run
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 500
    holder = _hold_sqlite_lock(tmp_path / "x.db")
    try:
        with pytest.raises(sqlalchemy.exc.OperationalError) as err, engine.connect() as conn:
            conn.exec_driver_sql("SELECT * FROM t").all()
    finally:
        _release(holder)
    assert str(envfail.classify(err.value)).startswith(
        f"database sqlite:///{tmp_path / 'x.db'} is locked by another process for 0.5 s; retry, or raise "
        "FL_SQLITE_BUSY_TIMEOUT_S")


# --------------------------------------------------------------------------- engine.dist_timeout_s


def test_dist_timeout_is_checked_and_only_for_the_distributed_executor():
    from fl_core.config import ConfigError, compose

    assert compose(["engine.executor=distributed", "engine.dist_timeout_s=20"]).engine.dist_timeout_s == 20.0
    for value, msg in (("0", "must be > 0, got 0"), ("-5", "must be > 0, got -5"), ("inf", "must be a finite number")):
        with pytest.raises(ConfigError, match=f"^engine.dist_timeout_s {msg}"):
            compose(["engine.executor=distributed", f"engine.dist_timeout_s={value}"])
    with pytest.raises(ConfigError, match="used only with engine.executor=distributed"):
        compose(["engine.dist_timeout_s=20"])


# --------------------------------------------------------------------------- torchrun: a lost or frozen rank (slow)

DIST = ["algorithm=fedavg", "train.rounds=6", "train.local_epochs=1", "seed=1", "name=dist", "engine.progress=false",
        "engine.checkpoint_every=1", "engine.executor=distributed"]


def _launch(launcher, args, cwd: Path, fault: str, timeout=300):
    from test_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, envfail.DEBUG_ENV)}
    env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "PYTHONPATH": str(ROOT)})
    if fault:
        env[faults.ENV] = fault
    cmd = [*launcher, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "pipeline.train", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, check=False, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _resumes_to_one_run(cwd: Path, launcher) -> None:
    proc, _ = _launch(launcher, DIST, cwd, "")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dist seed 1: resumed from round" in proc.stderr
    _client, runs = _mlflow_state(cwd)
    assert sorted((r.data.tags.get("fl.role") or "child", r.info.status) for r in runs) == [
        ("child", "FINISHED"), ("parent", "FINISHED")]


@pytest.mark.slow
def test_a_killed_worker_is_one_line_from_rank_0(tmp_path):
    launcher = [sys.executable, "-m", "pipeline.torchrun"]
    proc, _ = _launch(launcher, DIST, tmp_path, "worker_task@3")
    assert proc.returncode == envfail.EXIT_STATUS, proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert len(lines) == 2 and "Traceback" not in proc.stderr, lines
    assert lines[0].startswith("error: rank 1 of this torchrun start (pid ") and "is gone: its process ended" in lines[0]
    assert lines[1].startswith("torchrun: rank 1 ended first (signal SIGKILL)")
    _client, runs = _mlflow_state(tmp_path)
    assert "RUNNING" not in {r.info.status for r in runs}
    _resumes_to_one_run(tmp_path, launcher)


@pytest.mark.slow
def test_a_frozen_worker_ends_the_run_within_dist_timeout(tmp_path):
    """A worker that stops itself (SIGSTOP) in round 3: rank 0 names it within engine.dist_timeout_s, plain torchrun
    (whose own report follows; no rank prints a traceback), then torchrun ends the frozen rank after its
    --shutdown-timeout."""
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--shutdown-timeout", "3"]
    proc, wall = _launch(torchrun, [*DIST, "engine.dist_timeout_s=10"], tmp_path, "worker_task@3:STOP")
    assert proc.returncode != 0
    errors = [ln for ln in _lines(proc.stderr) if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 of this torchrun start (pid ")
    assert "stopped responding: its process is stopped (state T" in errors[0]
    assert not any(ln.startswith("[rank") for ln in _lines(proc.stderr))  # no rank's traceback
    assert wall < 120
    _client, runs = _mlflow_state(tmp_path)
    assert "RUNNING" not in {r.info.status for r in runs}
    _resumes_to_one_run(tmp_path, torchrun)


# --------------------------------------------------------------------------- PostgreSQL under a sweep

SWEEP_SPACE = """\
description: the learning rate on a small digits run (tests)
base: [model=mlp, partition=iid, partition.num_clients=3, train.rounds=30, train.local_steps=2, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-3, high: 0.5, log: true}
"""


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server (tests/pg.py), as in tests/test_postgres.py (skipped without the binaries)."""
    from test_postgres import postgres as server_fixture

    yield from server_fixture.__wrapped__()


def _sweep(tmp: Path, url: str, n: int, *options: str, env=None, log: str = "sweep.err") -> subprocess.Popen:
    """``python -m sweeps.tune`` of this tree on ``url`` (MLflow in the folder's SQLite store), stderr to ``log``."""
    (tmp / "space.yaml").write_text(SWEEP_SPACE)
    cmd = [sys.executable, "-m", "sweeps.tune", "--space", str(tmp / "space.yaml"), "--storage", url, "--study-name",
           "s", "--n-trials", str(n), "--no-test", "--quiet", "--out", str(tmp / "out"), *options]
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", **(env or {})}
    full.pop(envfail.DEBUG_ENV, None)
    return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=subprocess.DEVNULL, stderr=open(tmp / log, "w"))


def _once_trials_run(url: str, proc: subprocess.Popen, ended: int = 1) -> None:
    """Poll until ``ended`` trials have ended and one is RUNNING (the moment of the fault)."""
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, "the sweep ended before the fault"
        assert time.monotonic() < deadline, "no trial ran within 240 s"
        try:
            states = trial_states(url)
        except Exception:  # Optuna's tables do not exist yet
            states = {}
        if sum(n for s, n in states.items() if s != "RUNNING") >= ended and states.get("RUNNING"):
            return
        time.sleep(0.05)


def _sweep_runs(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fl-pipeline-sweeps")
    return client.search_runs([exp.experiment_id], max_results=1000)


def test_a_trial_whose_heartbeat_stopped_is_marked_fail_by_any_process(postgres):
    """Optuna's heartbeat of the RDB storage: a trial whose last beat is older than the grace period (here aged a
    minute in the database, as if its worker had died then) is marked FAIL with a reason; a beating one is not."""
    import optuna
    import psycopg

    from sweeps.storage import HEARTBEAT_REASON, fail_silent_trials, open_storage
    from sweeps.study import quiet_optuna

    url = postgres.create_database("beats")
    quiet_optuna()  # (Optuna warns that heartbeats are meant for Study.optimize: the sweep beats them itself)
    study = optuna.create_study(study_name="b", storage=open_storage(url))
    lost, alive = study.ask(), study.ask()
    for trial in (lost, alive):
        study._storage.record_heartbeat(trial._trial_id)
    with psycopg.connect(host="127.0.0.1", port=postgres.port, user="postgres", dbname="beats", autocommit=True) as c:
        c.execute("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '60 seconds' WHERE trial_id = %s",
                  (lost._trial_id,))
    assert fail_silent_trials(study) == [lost.number]
    states = {t.number: (t.state.name, t.user_attrs.get("reason")) for t in study.get_trials()}
    assert states == {lost.number: ("FAIL", HEARTBEAT_REASON), alive.number: ("RUNNING", None)}


def test_a_commit_that_failed_on_a_stopped_server_leaves_no_stall_mark(postgres):
    """Issue 32: Optuna's commit fails on a stopped server and its session rolls back a connection SQLAlchemy has
    already invalidated (nothing is sent). That rollback left this thread marked as waiting, so 15 s later the stall
    watch ended a sweep's worker as if the server were frozen ("no answer for 16 s ... Connection refused"), beside
    the wait for the storage that owns this case."""
    import threading

    import optuna

    from fl_core.store import storewait
    from sweeps.storage import open_storage
    from sweeps.study import quiet_optuna

    url = postgres.create_database("commit_fails")
    storewait.install()
    quiet_optuna()
    study = optuna.create_study(study_name="c", storage=open_storage(url))
    trial = study.ask()
    postgres.halt()
    try:
        with pytest.raises(optuna.exceptions.StorageInternalError):
            trial.report(0.5, 1)  # the commit fails: the server ended the session
        assert threading.get_ident() not in storewait._INFLIGHT
    finally:
        postgres.resume()


@pytest.mark.slow
def test_a_postgres_restart_during_a_sweep_costs_the_running_trial_and_the_sweep_goes_on(postgres, tmp_path):
    url = postgres.create_database("restarted")
    proc = _sweep(tmp_path, url, 8)
    try:
        _once_trials_run(url, proc)
        postgres.halt()
        postgres.resume()
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    err = (tmp_path / "sweep.err").read_text()
    assert "Traceback" not in err
    states = trial_states(url)
    notes = [ln for ln in _lines(err) if ln.startswith("note:")]
    assert sum(states.values()) == 8 and "RUNNING" not in states and states.get("FAIL", 0) == len(notes) <= 1
    for note in notes:
        assert "ended FAIL: the Optuna storage lost its connection (" in note and "the sweep goes on" in note
    runs = _sweep_runs(tmp_path)
    assert {r.info.status for r in runs if r.data.tags.get("sweep_role") == "study"} == {"FINISHED"}
    assert "RUNNING" not in {r.info.status for r in runs}


@pytest.mark.slow
def test_a_stopped_postgres_ends_each_worker_in_one_line_and_the_rerun_leaves_nothing_running(postgres, tmp_path):
    url = postgres.create_database("stopped")
    proc = _sweep(tmp_path, url, 12, "--workers", "2", env={"FL_DB_RETRY_S": "3"})
    try:
        _once_trials_run(url, proc, ended=2)
        postgres.halt()
        assert proc.wait(timeout=300) == envfail.EXIT_STATUS
    finally:
        proc.kill()
        postgres.resume()
    lines = _lines((tmp_path / "sweep.err").read_text())
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(lines) <= 3 and sorted(ln[:len("error: worker 1: ")] for ln in errors) == [
        "error: worker 1: ", "error: worker 2: "]
    for line in errors:
        assert f"Optuna storage {url} lost its connection (" in line
        assert line.endswith("and it did not answer again within 3 s (FL_DB_RETRY_S); check that the database server "
                             "runs and answers, then run the same command again")
    parent = [r for r in _sweep_runs(tmp_path) if r.data.tags.get("sweep_role") == "study"]
    assert [r.info.status for r in parent] == ["FAILED"]
    assert parent[0].data.tags["fl.end_reason"].startswith("environment failure: ")
    rerun = _sweep(tmp_path, url, 1, "--fail-stale", log="rerun.err")  # the same machine: its dead trials now
    assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.err").read_text()[-2000:]
    assert "RUNNING" not in trial_states(url)
    runs = _sweep_runs(tmp_path)
    assert "RUNNING" not in {r.info.status for r in runs}
    assert [r.info.status for r in runs if r.data.tags.get("sweep_role") == "study"] == ["FINISHED"]


@pytest.mark.slow
def test_a_frozen_postgres_ends_the_sweep_in_one_line_within_the_stall_bound(postgres, tmp_path):
    """SIGSTOP to every server process: the kernel still accepts and acknowledges, so only the stall watch ends the
    wait (FL_DB_STALL_S=3, libpq's PGCONNECT_TIMEOUT=2 for the probe); the trial's and the study's MLflow runs end
    FAILED first."""
    url = postgres.create_database("frozen")
    proc = _sweep(tmp_path, url, 8, env={"FL_DB_STALL_S": "3", "PGCONNECT_TIMEOUT": "2"})
    frozen = []
    try:
        _once_trials_run(url, proc)
        frozen = postgres.freeze()
        t0 = time.monotonic()
        assert proc.wait(timeout=120) == envfail.EXIT_STATUS
        assert time.monotonic() - t0 < 60
    finally:
        proc.kill()
        postgres.thaw(frozen)
    errors = [ln for ln in _lines((tmp_path / "sweep.err").read_text()) if not ln.startswith("study ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: Optuna storage {url} does not answer (no answer for ")
    assert "FL_DB_STALL_S; a new connection: connection timeout expired" in errors[0]
    runs = _sweep_runs(tmp_path)
    assert "RUNNING" not in {r.info.status for r in runs}  # ended FAILED before the process ended
    assert [r.info.status for r in runs if r.data.tags.get("sweep_role") == "study"] == ["FAILED"]
    # the frozen database could not be told: the trials in progress (one, or a batch's) stay RUNNING in it, each
    # with its MLflow run ended FAILED, and at most one more whose ask the freeze cut short (no MLflow run yet)
    live = [r for r in runs if r.data.tags.get("sweep_role") == "trial" and r.info.status == "FAILED"]
    running = trial_states(url).get("RUNNING", 0)
    assert running >= 1 and len(live) <= running <= len(live) + 1, (running, len(live))
    assert all(r.data.tags["fl.end_reason"].startswith("environment failure: ") for r in live)
    rerun = _sweep(tmp_path, url, 1, "--fail-stale", log="rerun.err")
    assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.err").read_text()[-2000:]
    assert "RUNNING" not in trial_states(url)
    assert "RUNNING" not in {r.info.status for r in _sweep_runs(tmp_path)}
