"""No code runs from a file: checkpoints and completion records are read with torch's weights-only loader.

A pickle planted in a checkpoint folder (a shared or copied project) whose ``__reduce__`` would run a command is
refused before anything of it runs, moved aside as ``*.corrupt`` with one warning line, and the run goes on
from the last good checkpoint (``.prev``) or from scratch, with the results of an uninterrupted run. Every
file the project itself writes there (a round checkpoint of every kind of state, a completion record) reads
back under the same loader.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import signal
from pathlib import Path

import pytest
import torch

from fl_core.store import durable, faults

from conftest import run_sim
from test_faults import _forked, _in_process, _project


class Touch:
    """Unpickling it (anything but the weights-only loader) creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class Shell:
    """Unpickling it (anything but the weights-only loader) runs ``touch marker`` in a shell."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


PAYLOADS = {"touch": Touch, "shell": Shell}


def plant(path: Path, marker: Path, payload: str = "shell", fmt: str = "zip") -> None:
    """Write a file at ``path`` that looks like a checkpoint and creates ``marker`` when unpickled."""
    obj = {"version": 1, "round": 99, "history": [], "x": PAYLOADS[payload](marker)}
    if fmt == "zip":
        torch.save(obj, path)
    elif fmt == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:  # a bare pickle, no torch container
        path.write_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _warnings(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("warning:")]


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """In-process runs count fault hits from zero, with no ``FL_FAULT`` set."""
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.delenv(faults.ENV, raising=False)


# --------------------------------------------------------------------------- the loader


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_the_payload_is_live(tmp_path, payload):
    """The control: plain unpickling runs it (so the tests below would see it run)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(PAYLOADS[payload](marker)))
    assert marker.exists()


@pytest.mark.parametrize("fmt", ["zip", "legacy", "raw"])
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_planted_file_is_refused_moved_aside_and_the_previous_one_read(tmp_path, capsys, payload, fmt):
    path, marker = tmp_path / "seed_1.pt", tmp_path / "ran"
    durable.save({"version": 1, "round": 1}, path)
    durable.save({"version": 1, "round": 2}, path)  # round 1 is now seed_1.pt.prev
    plant(path, marker, payload, fmt)
    capsys.readouterr()
    assert durable.load(path) == {"version": 1, "round": 1}
    assert not marker.exists()
    assert not path.exists() and (tmp_path / "seed_1.pt.corrupt").exists()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines  # torch's own warnings (e.g. on a protocol-5 pickle) are not printed
    assert lines[0].startswith(f"warning: {path} is unreadable (refused by the weights-only loader: ")
    assert lines[0].endswith("); moved it to seed_1.pt.corrupt")


def test_the_warning_names_what_was_refused(tmp_path, capsys):
    path = tmp_path / "seed_1.pt"
    plant(path, tmp_path / "ran", "shell")
    assert durable.load(path) is None
    assert capsys.readouterr().err == (f"warning: {path} is unreadable (refused by the weights-only loader: it "
                                       f"references {os.system.__module__}.system); moved it to seed_1.pt.corrupt\n")


def test_nothing_readable_means_none_and_every_file_is_moved_aside(tmp_path, capsys):
    path, marker = tmp_path / "seed_1.done.pt", tmp_path / "ran"
    plant(path, marker, "touch")
    plant(durable.previous(path), marker, "shell", "legacy")
    assert durable.load(path) is None
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed_1.done.pt.corrupt", "seed_1.done.pt.prev.corrupt"]
    assert len(_warnings(capsys.readouterr().err)) == 2


# --------------------------------------------------------------------------- the round loop

STATEFUL = ["algorithm=scaffold", "train.rounds=4", "engine.checkpoint_every=1"]


class Killed(Exception):
    pass


def _kill_after(n):
    def cb(r, row):
        if r == n:
            raise Killed(f"killed after round {r}")
    return cb


@pytest.mark.parametrize("planted,resumed", [(["ck.pt"], 2), (["ck.pt", "ck.pt.prev"], 0)],
                         ids=["newest", "both"])
def test_a_resuming_run_refuses_a_planted_checkpoint(digits, tmp_path, capsys, planted, resumed):
    _, full = run_sim(digits, *STATEFUL)
    ck, marker = tmp_path / "ck.pt", tmp_path / "ran"
    with pytest.raises(Killed):  # checkpoints of rounds 2 (ck.pt.prev) and 3 (ck.pt)
        run_sim(digits, *STATEFUL, checkpoint_path=ck, callbacks=[_kill_after(3)])
    for name in planted:
        plant(tmp_path / name, marker)
    capsys.readouterr()
    _, res = run_sim(digits, *STATEFUL, checkpoint_path=ck)
    assert not marker.exists()
    warnings = _warnings(capsys.readouterr().err)
    assert [w.split(" is unreadable (refused by the weights-only loader: ")[0] for w in warnings] == [
        f"warning: {tmp_path / name}" for name in planted]  # one line per planted file
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == sorted(f"{n}.corrupt" for n in planted)
    assert res.resumed_from == resumed
    assert torch.equal(res.final_flat, full.final_flat)
    assert [r["test_acc"] for r in res.history] == [r["test_acc"] for r in full.history]


@pytest.mark.parametrize("overrides", [
    ["algorithm=scaffold", "engine.client_state=memory"],
    ["algorithm=scaffold", "engine.client_state=disk"],
    ["algorithm=fedadam"],
    ["algorithm=fedprox", "algorithm.wrappers=[fednlr,fedbug]", "algorithm.transforms=[topk,qsgd]"],
    ["algorithm=fedbcgd_plus", "tracking.layer_cosine=true", "tracking.client_loss_trace=2"],
    ["model=logreg_binary", "algorithm=fedbcgd"],
], ids=["scaffold", "scaffold-disk", "fedadam", "fednlr-fedbug-topk-qsgd", "fedbcgd-plus-diagnostics", "logreg"])
def test_every_checkpoint_reads_back_with_the_weights_only_loader(digits, tmp_path, capsys, overrides):
    """Client states (in memory, on disk), server states, the step's and the diagnostics' metrics in the history."""
    ck = tmp_path / "ck.pt"
    common = [*overrides, "train.rounds=3", "engine.checkpoint_every=1"]
    with pytest.raises(Killed):
        run_sim(digits, *common, checkpoint_path=ck, callbacks=[_kill_after(2)])
    assert torch.load(ck, map_location="cpu", weights_only=True)["round"] == 2
    _, res = run_sim(digits, *common, checkpoint_path=ck)
    assert res.resumed_from == 2
    assert "warning:" not in capsys.readouterr().err


# --------------------------------------------------------------------------- the pipeline: checkpoints and records

GRID = {
    "seeds": [1],
    "partition": {"num_clients": 4},
    "train": {"rounds": 4, "participation": 1.0, "local_epochs": 1, "batch_size": 64, "lr": 0.05},
    "engine": {"checkpoint_every": 1, "progress": False},
    "tracking": {"enabled": False},
    "experiments": {"exp": {"algorithm": "scaffold", "partition": "dirichlet"}},
}


def _outputs(tmp: Path):
    out = tmp / "results" / "exp"
    return torch.load(out / "models" / "seed_1.pt", map_location="cpu", weights_only=True), (out / "metrics.json")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The model and metrics of an uninterrupted run."""
    tmp = _project(tmp_path_factory.mktemp("reference"), GRID)
    assert _forked(tmp, ["--grid", "exp"]) == 0
    model, metrics = _outputs(tmp)
    return model, metrics.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("fault,planted,resumed", [
    # killed inside the 3rd checkpoint write: seed_1.pt holds round 2, seed_1.pt.prev round 1
    ("checkpoint_write@3", ["seed_1.pt"], 1),
    # killed after the completion record: seed_1.pt holds round 3 (the last checkpoint), .prev round 2
    ("after_record", ["seed_1.done.pt"], 3),
    ("after_record", ["seed_1.done.pt", "seed_1.pt", "seed_1.pt.prev"], 0),
], ids=["checkpoint", "record", "record-and-checkpoints"])
def test_a_rerun_refuses_planted_files_and_ends_with_the_uninterrupted_results(tmp_path, monkeypatch, capsys,
                                                                              reference, fault, planted, resumed):
    tmp = _project(tmp_path, GRID)
    assert _forked(tmp, ["--grid", "exp"], fault) == -signal.SIGKILL
    attempt = next((tmp / "checkpoints" / "exp").iterdir())
    marker = tmp_path / "ran"
    for name in planted:
        assert (attempt / name).exists(), name
        plant(attempt / name, marker, "touch" if name.endswith(".done.pt") else "shell")
    capsys.readouterr()
    assert _in_process(tmp, ["--grid", "exp"], monkeypatch) == 0
    err = capsys.readouterr().err
    assert not marker.exists()
    warnings = _warnings(err)
    assert len(warnings) == len(planted), warnings
    for name, line in zip(planted, warnings):
        assert line.startswith(f"warning: {(attempt / name).relative_to(tmp)} is unreadable (refused by the "
                               "weights-only loader: ") and line.endswith(f"; moved it to {name}.corrupt"), line
    if resumed:
        assert f"exp seed 1: resumed from round {resumed}" in err
    else:
        assert "resumed" not in err and "done earlier" not in err
    model, metrics = _outputs(tmp)
    assert model.keys() == reference[0].keys()
    assert all(torch.equal(model[k], reference[0][k]) for k in model)
    assert metrics.read_text() == reference[1]
    assert not (tmp / "checkpoints" / "exp").exists()  # the attempt folder (and the *.corrupt files) are gone
