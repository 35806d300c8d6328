"""sweeps/tune.py when processes die hard or inputs are broken: workers die with a SIGKILLed parent,
MLflow runs left RUNNING by a dead process are ended by the next invocation, a broken space file
gives one line, and the pruning warm-up is what docs/sweeps.md says.

No sleeps as synchronisation: waits are bounded polls for a condition, with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from fl_core.store.tracking import ORPHAN_REASON
from sweeps import tune
from sweeps.settings import HOST
from sweeps.storage import end_orphaned_runs, open_storage, owner_tags
from sweeps.study import make_pruner
from sweeps.workers import EXIT_PARENT_GONE

ROOT = Path(__file__).resolve().parent.parent
LR_SPACE = """\
base: [model=mlp, partition.num_clients=4, train.rounds=2, train.local_epochs=1, train.batch_size=16,
       train.participation=1.0]
params:
  train.lr: {type: float, low: 1.0e-2, high: 0.2, log: true}
"""


def _gone(pid: int) -> bool:
    """Process ``pid`` no longer runs: no such process, or a zombie (dead; this container's PID 1 does
    not reap the orphans it inherits)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # polling interval of a bounded wait, not a synchronisation point
    return True


# --------------------------------------------------------------------------- workers die with their parent

# a stand-in for tune.py: a spawn-context child (as run_workers starts its workers) calls die_with_parent,
# reports how it watches the parent, then blocks; the parent prints the child's pid and blocks too
PARENT = textwrap.dedent("""\
    import multiprocessing as mp, os, sys, threading
    sys.path.insert(0, {root!r})
    from sweeps.workers import die_with_parent

    def child(parent_pid, use_prctl, conn):
        conn.send(die_with_parent(parent_pid, poll_s=0.05, use_prctl=use_prctl))
        threading.Event().wait()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=child, args=(os.getpid(), sys.argv[1] == "prctl", send))
        p.start()
        how = recv.recv() if recv.poll(30) else "no-report"
        print(p.pid, how, flush=True)
        threading.Event().wait()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")
@pytest.mark.parametrize("mode", ["prctl", "poll"])
def test_a_worker_dies_when_its_parent_is_killed(tmp_path, mode):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=str(ROOT)))
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        pid, how = parent.stdout.readline().split()  # the parent gives up waiting for the child after 30 s
        child = int(pid)
        assert how == mode  # Linux arms prctl; the fallback thread when prctl is not used
        assert not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_for(lambda: _gone(child), timeout=8), f"worker {child} outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_worker_whose_parent_is_already_gone_exits_at_once():
    # the parent id given is not this process's parent: as if the parent died before the signal was armed
    code = ("import os, sys; sys.path.insert(0, %r); from sweeps.workers import die_with_parent; "
            "die_with_parent(os.getppid() + 1); print('still running')" % str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True, timeout=60)
    assert res.returncode == EXIT_PARENT_GONE and "still running" not in res.stdout


# --------------------------------------------------------------------------- orphaned MLflow runs


@pytest.fixture
def mlflow_store(mlflow_uri, monkeypatch, request):
    """(client, a new experiment of the module's SQLite store) with MLFLOW_TRACKING_URI pointing at it."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    client = MlflowClient(mlflow_uri)
    return client, client.create_experiment(request.node.name[:200])


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_runs_of_dead_processes_of_this_host_are_ended_as_orphans(mlflow_store):
    client, exp = mlflow_store
    dead, me = _dead_pid(), owner_tags()
    assert me["fl.host"] == HOST and me["fl.pid"] == str(os.getpid()) and float(me["fl.proc_start"]) > 0
    owners = {
        "dead": {"fl.host": HOST, "fl.pid": str(dead), "fl.proc_start": ""},  # start unknown: run start
        "reused": {**me, "fl.proc_start": f"{float(me['fl.proc_start']) - 600:.2f}"},  # pid now a newer process
        "live": me,
        "other_host": {"fl.host": "another-machine", "fl.pid": str(dead), "fl.proc_start": ""},
        "untagged": {},  # an older sweep's run: cannot tell
    }
    ids = {name: client.create_run(exp, run_name=name, tags=tags).info.run_id for name, tags in owners.items()}
    finished = client.create_run(exp, run_name="finished", tags=owners["dead"]).info.run_id
    client.set_terminated(finished, status="FINISHED")

    ended = end_orphaned_runs(client, exp)

    assert sorted(ended) == sorted([ids["dead"], ids["reused"]])
    runs = {name: client.get_run(run_id) for name, run_id in {**ids, "finished": finished}.items()}
    for name in ("dead", "reused"):
        assert runs[name].info.status == "KILLED"
        assert runs[name].data.tags["fl.end_reason"] == "orphaned: the process that ran it is gone"
    for name in ("live", "other_host", "untagged"):
        assert runs[name].info.status == "RUNNING" and "fl.end_reason" not in runs[name].data.tags
    assert runs["finished"].info.status == "FINISHED" and "fl.end_reason" not in runs["finished"].data.tags
    assert end_orphaned_runs(client, exp) == []  # nothing left to end


def test_the_next_invocation_ends_orphans_and_reuses_the_study_parent_run(tmp_path, mlflow_store, monkeypatch,
                                                                          capsys):
    """A tune.py SIGKILLed mid-study left its parent run and a trial run RUNNING: the next invocation
    ends both as orphans, then reopens the parent as its own; every run it creates records it."""
    client, exp = mlflow_store
    monkeypatch.chdir(tmp_path)
    space, storage = tmp_path / "lr.yaml", tmp_path / "o.log"
    space.write_text(LR_SPACE)
    args = ["--space", str(space), "--storage", str(storage), "--study-name", "o", "--out", str(tmp_path / "out"),
            "--quiet", "--pruner", "none", "--sampler-seed", "0", "--experiment", client.get_experiment(exp).name]
    assert tune.main(args + ["--n-trials", "1"]) == 0
    study = optuna.load_study(study_name="o", storage=open_storage(str(storage)))
    parent = study.user_attrs["mlflow_parent_run_id"]
    killed = {"fl.host": HOST, "fl.pid": str(_dead_pid()), "fl.proc_start": ""}
    client.update_run(parent, status="RUNNING")  # as a SIGKILL leaves it
    for k, v in killed.items():
        client.set_tag(parent, k, v)
    lost = client.create_run(exp, run_name="o/trial-9", tags={**killed, "optuna_study": "o", "sweep_role": "trial",
                                                              "mlflow.parentRunId": parent}).info.run_id
    capsys.readouterr()

    assert tune.main(args + ["--n-trials", "1", "--no-test"]) == 0

    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("note: ended")] == [
        "note: ended 2 MLflow run(s) left RUNNING on this machine by a process that is gone "
        "(status KILLED, tag fl.end_reason)"]
    lost_run = client.get_run(lost)
    assert lost_run.info.status == "KILLED" and lost_run.data.tags["fl.end_reason"] == ORPHAN_REASON
    reused = client.get_run(parent)  # the same parent, reopened by this process and ended normally
    assert reused.info.status == "FINISHED" and "fl.end_reason" not in reused.data.tags
    runs = client.search_runs([exp], "tags.optuna_study = 'o'")
    assert sorted(r.data.tags["sweep_role"] for r in runs) == ["best_test", "study", "trial", "trial", "trial"]
    mine = [r for r in runs if r.info.run_id != lost]
    assert all(r.data.tags["fl.host"] == HOST and r.data.tags["fl.pid"] == str(os.getpid())
               and r.data.tags["fl.proc_start"] == owner_tags()["fl.proc_start"] for r in mine)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["mlflow_parent_run_id"] == parent


# --------------------------------------------------------------------------- broken space files


def test_a_yaml_syntax_error_in_the_space_file_is_one_line_with_its_position(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  train.lr: {type: float, low: 0.1\n  x: 1\n")
    res = subprocess.run([sys.executable, str(ROOT / "sweeps" / "tune.py"), "--space", str(bad), "--n-trials", "1",
                          "--storage", str(tmp_path / "s.log")], capture_output=True, text=True, cwd=tmp_path,
                         check=False, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: bad.yaml: YAML syntax error at line 3, column 4: "
                                  "expected ',' or '}', but got ':'"), res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "s.log").exists()


@pytest.mark.parametrize("case,message", [
    ("missing", "missing.yaml: no such search space"),
    ("directory", "dir.yaml: is a directory, not a search space file"),
    ("unreadable", "locked.yaml: cannot read the search space (Permission denied)"),
    ("binary", "binary.yaml: not UTF-8 text (byte 8: invalid start byte)"),
    ("control_char", "ctl.yaml: YAML syntax error at line 2, column 6: special characters are not allowed"),
])
def test_an_unusable_space_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys, case, message):
    monkeypatch.chdir(tmp_path)
    name = message.split(":")[0]
    path = tmp_path / name
    if case == "directory":
        path.mkdir()
    elif case == "unreadable":  # chmod does not stop root: refuse the read itself
        path.write_text("params: {}\n")
        real = Path.read_text

        def read_text(self, *a, **kw):
            if self.name == name:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *a, **kw)

        monkeypatch.setattr(Path, "read_text", read_text)
    elif case == "binary":
        path.write_bytes(b"params: \xff\xfe\n")
    elif case == "control_char":
        path.write_text("params:\n  a: \x01\n")
    assert tune.main(["--space", name, "--n-trials", "1", "--storage", str(tmp_path / "s.log")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


# --------------------------------------------------------------------------- pruning warm-up (docs/sweeps.md)


@pytest.mark.parametrize("kind", ["median", "threshold:0.5"])
def test_the_pruning_warm_up_covers_seed_1_rounds_below_a_third_only(kind):
    """R = 12 rounds, 2 seeds: steps 1..12 (seed 1), 13..24 (seed 2). Warm-up: steps < R // 3 = 4,
    i.e. seed 1's rounds 1-3; a hopeless trial is pruned at step 4 at the latest, seed 2 has no warm-up."""
    rounds, seeds = 12, 2
    study = optuna.create_study(direction="maximize", pruner=make_pruner(kind, rounds, seeds, False))
    for _ in range(5):  # median: 5 COMPLETE trials first
        t = study.ask()
        for step in range(1, rounds * seeds + 1):
            t.report(0.9, step)
        study.tell(t, 0.9)

    def first_pruned_step(steps):
        t = study.ask()
        for step in steps:
            t.report(0.0, step)
            if t.should_prune():
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                return step
        study.tell(t, 0.0)
        return None

    assert first_pruned_step(range(1, rounds * seeds + 1)) == rounds // 3  # rounds 1-3 of seed 1 are safe
    assert first_pruned_step(range(rounds + 1, rounds * seeds + 1)) == rounds + 1  # seed 2: from its round 1
