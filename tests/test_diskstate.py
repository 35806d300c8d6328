"""engine.client_state=disk (fl_core/engine/diskstate.py): client states in files, checkpoints that hold only the
slot table, and resumes that read exactly the checkpointed round's states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_core.engine.diskstate import AUTO_DISK_BYTES, DISK_KEY, SLOTS, DiskClientStateStore, choose

from conftest import run_sim


def _state(v: float, d: int = 5):
    return {"c": torch.full((d,), v), "n": torch.tensor([int(v)], dtype=torch.int64)}


def test_put_get_round_trip_and_a_client_without_state(tmp_path):
    store = DiskClientStateStore(4, tmp_path / "s")
    assert store.get(2, lambda: None) is None and len(store) == 0
    store.put(2, _state(3.0))
    got = store.get(2, lambda: None)
    assert torch.equal(got["c"], torch.full((5,), 3.0)) and got["n"].dtype == torch.int64
    got["c"] += 1  # a copy: the store keeps its value
    assert torch.equal(store.get(2, lambda: None)["c"], torch.full((5,), 3.0))
    assert torch.equal(store.get(1, lambda: _state(7.0))["c"], torch.full((5,), 7.0))  # initialised on first use
    assert sorted(c for c, _ in store.items()) == [1, 2]
    with pytest.raises(ValueError, match=r"^client 0: state 'c' is \(6,\) float32, expected \(5,\) float32$"):
        store.put(0, _state(1.0, d=6))
    store.close()


def test_a_checkpoint_table_survives_later_writes_and_its_prev_too(tmp_path):
    store = DiskClientStateStore(3, tmp_path / "s")
    store.put(0, _state(1.0))
    first = store.state_dict()  # checkpoint A: client 0 = 1
    store.put(0, _state(2.0))
    second = store.state_dict()  # checkpoint B: client 0 = 2
    for v in (3.0, 4.0, 5.0):  # later rounds, never checkpointed
        store.put(0, _state(v))
    a, b = int(first[DISK_KEY]["slot"][0]), int(second[DISK_KEY]["slot"][0])
    assert a != b and {a, b} <= set(range(SLOTS)) and int(first[DISK_KEY]["slot"][1]) == -1
    for table, want in ((second, 2.0), (first, 1.0)):  # the newest checkpoint, and its .prev
        fresh = DiskClientStateStore(3, tmp_path / "s")
        fresh.load_state_dict(table)
        assert torch.equal(fresh.get(0, lambda: None)["c"], torch.full((5,), want))
        assert fresh.get(1, lambda: None) is None
        fresh.close()
    assert first[DISK_KEY]["slot"].numel() == 3  # a checkpoint holds N small integers, no vector
    store.close()


def test_auto_picks_disk_above_the_threshold():
    assert choose("auto", 10, 1000)[0] == "memory"
    kind, reason = choose("auto", 10_000, 3_191_848)  # SCAFFOLD on the standard CNN: d = 797,962 floats
    assert kind == "disk" and "29.73 GiB > 4 GiB" in reason
    assert choose("memory", 10 ** 9, AUTO_DISK_BYTES)[0] == "memory"
    assert choose("disk", 1, 0) == ("disk", "engine.client_state=disk")


STATEFUL = ["algorithm=scaffold", "model=mlp", "partition.num_clients=8", "train.participation=0.5",
            "train.rounds=4", "engine.dtype=float64"]


def _checkpointed(digits, tmp_path, *extra, stop_after=None):
    class Stop(Exception):
        pass

    def stop(r, row):
        if r == stop_after:
            raise Stop

    ck = tmp_path / "ck.pt"
    if stop_after is None:
        return run_sim(digits, *STATEFUL, *extra, checkpoint_path=ck)
    with pytest.raises(Stop):
        run_sim(digits, *STATEFUL, *extra, checkpoint_path=ck, callbacks=[stop])
    return None


def test_disk_store_runs_equal_memory_store_runs(digits, tmp_path):
    sim, disk = run_sim(digits, *STATEFUL, "engine.client_state=disk")
    _, mem = run_sim(digits, *STATEFUL, "engine.client_state=memory")
    assert sim.client_state == "disk"
    assert torch.equal(disk.final_flat, mem.final_flat)


@pytest.mark.parametrize("corrupt_newest", [False, True], ids=["newest", "prev"])
def test_resumed_from_a_disk_checkpoint_equals_the_uninterrupted_run(digits, tmp_path, corrupt_newest):
    _, full = run_sim(digits, *STATEFUL, "engine.client_state=memory")
    extra = ("engine.client_state=disk", "engine.checkpoint_every=1")
    # killed after round 3: rounds 2 and 3 are checkpointed, round 3's states are written after the last table
    _checkpointed(digits, tmp_path, *extra, stop_after=3)
    ck = tmp_path / "ck.pt"
    states = Path(str(ck) + ".states")
    assert (states / "c.bin").exists()
    if corrupt_newest:  # the loader falls back to ck.pt.prev (round 2): its slots must be intact too
        ck.write_bytes(b"not a checkpoint")
    sim, res = _checkpointed(digits, tmp_path, *extra)
    assert res.resumed_from == (2 if corrupt_newest else 3)
    assert torch.equal(res.final_flat, full.final_flat)
    saved = torch.load(ck, weights_only=False)["clients"]  # the table, not 8 clients x d floats of control variates
    assert set(saved) == {DISK_KEY} and saved[DISK_KEY]["slot"].shape == (8,)
    sim.discard_checkpoint()
    assert not states.exists()


@pytest.mark.parametrize("first,then", [("memory", "disk"), ("disk", "memory")])
def test_a_checkpoint_of_one_store_resumes_in_the_other(digits, tmp_path, first, then):
    _, full = run_sim(digits, *STATEFUL, "engine.client_state=memory")
    _checkpointed(digits, tmp_path, f"engine.client_state={first}", "engine.checkpoint_every=2", stop_after=3)
    _, res = _checkpointed(digits, tmp_path, f"engine.client_state={then}", "engine.checkpoint_every=2")
    assert res.resumed_from == 2 and torch.equal(res.final_flat, full.final_flat)
