"""engine.client_state=disk (fl_core/engine/diskstate.py): client states in files, checkpoints that hold only the
slot table, and resumes that read exactly the checkpointed round's states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_core.engine.diskstate import AUTO_DISK_BYTES, DISK_KEY, SLOTS, DiskClientStateStore, choose, client_state_bytes

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
    saved = torch.load(ck, weights_only=True)["clients"]  # the table, not 8 clients x d floats of control variates
    assert set(saved) == {DISK_KEY} and saved[DISK_KEY]["slot"].shape == (8,)
    sim.discard_checkpoint()
    assert not states.exists()


@pytest.mark.parametrize("first,then", [("memory", "disk"), ("disk", "memory")])
def test_a_checkpoint_of_one_store_resumes_in_the_other(digits, tmp_path, first, then):
    _, full = run_sim(digits, *STATEFUL, "engine.client_state=memory")
    _checkpointed(digits, tmp_path, f"engine.client_state={first}", "engine.checkpoint_every=2", stop_after=3)
    _, res = _checkpointed(digits, tmp_path, f"engine.client_state={then}", "engine.checkpoint_every=2")
    assert res.resumed_from == 2 and torch.equal(res.final_flat, full.final_flat)


# --------------------------------------------------------------------------- a large model: ViT-B's d, vit_tiny runs

VIT_B_D = 85_875_556  # ViT-B/16 with a 100-way head (docs/algorithms.md, Model catalogue)


@pytest.mark.parametrize("rule, vectors", [("scaffold", 1), ("feddc", 2), ("fedavg", 0)])
def test_vit_b_client_states_of_100_clients_go_to_disk(rule, vectors):
    """engine.client_state=auto for the FedBCGD ViT-B setting (100 clients): the rule's declared state (its
    init_client_state, on the meta device: nothing of size d is allocated) decides."""
    from fl_core.algorithms import build_algorithm
    from fl_core.config import compose
    from fl_core.models import build_model
    from fl_core.params import ParamSpec

    cfg = compose(["+experiment=fedbcgd_vit_cifar100", f"algorithm={rule}"])
    with torch.device("meta"):
        model = build_model(cfg.model, "cifar100", (3, 32, 32), 100)
    spec = ParamSpec.from_model(model)
    algo = build_algorithm(cfg.algorithm, spec, model)
    per_client = client_state_bytes(algo, spec.d, torch.float32)
    assert (spec.d, per_client) == (VIT_B_D, vectors * 4 * VIT_B_D)
    kind, reason = choose(cfg.engine.client_state, cfg.partition.num_clients, per_client)
    if vectors == 0:
        assert (kind, reason) == ("memory", "auto: 100 clients x 0.0 MiB of state = 0.00 GiB <= 4 GiB")
    else:  # SCAFFOLD: 100 x 85.9 M x 4 B = 34.4 GB
        total = 100 * per_client
        assert kind == "disk" and reason == (f"auto: 100 clients x {per_client / 2 ** 20:.1f} MiB of state = "
                                             f"{total / 2 ** 30:.2f} GiB > 4 GiB")
    assert cfg.engine.client_state == "auto"


def test_client_state_bytes_of_a_rule_that_cannot_run_on_meta_tensors():
    class ReadsValues:
        def init_client_state(self, global_flat):
            return {"c": torch.zeros_like(global_flat) + float(global_flat.sum())}  # .item() has no meta kernel

    class Keeps:
        def init_client_state(self, global_flat):
            return None

    assert client_state_bytes(ReadsValues(), 10, torch.float64) == 80
    assert client_state_bytes(Keeps(), 10 ** 12, torch.float32) == 0  # a d no machine holds: never allocated


VIT_SCAFFOLD = ["algorithm=scaffold", "model=vit_tiny", "partition.num_clients=20", "train.participation=0.5",
                "train.sampler=fixed", "train.rounds=3", "train.local_steps=2", "engine.checkpoint_every=2"]


def test_vit_tiny_scaffold_on_disk_checkpoints_below_twice_the_server_side_state(digits, tmp_path):
    """SCAFFOLD on vit_tiny with 20 clients: with the disk store the checkpoint holds the global model, the server's
    state and the slot table, below 2 x (global model + server state) bytes; the memory store's checkpoint holds the
    trained clients' control variates as well (above the bound); both runs train the same model."""
    runs = {}
    for store in ("disk", "memory"):
        ck = tmp_path / store / "ck.pt"
        sim, res = run_sim(digits, *VIT_SCAFFOLD, f"engine.client_state={store}", checkpoint_path=ck)
        saved = torch.load(ck, weights_only=True)
        assert sim.client_state == store and saved["round"] == 2
        server = saved["global"].nbytes + sum(v.nbytes for v in saved["server"].values())
        runs[store] = (res, ck.stat().st_size, server, saved)
    res, size, server, saved = runs["disk"]
    d = res.final_flat.numel()
    assert server == 2 * 4 * d  # the model and the server's control variate c
    assert size < 2 * server
    assert set(saved["clients"]) == {DISK_KEY} and saved["clients"][DISK_KEY]["slot"].shape == (20,)
    assert int((saved["clients"][DISK_KEY]["slot"] >= 0).sum()) > 10  # rounds 1-2 trained 11+ distinct clients
    assert (tmp_path / "disk" / "ck.pt.states" / "c.bin").exists()
    mem, mem_size, _, mem_saved = runs["memory"]
    assert len(mem_saved["clients"]) > 10 and mem_size > 2 * server
    assert torch.equal(res.final_flat, mem.final_flat)


def test_auto_puts_the_states_on_disk_above_the_threshold(digits, monkeypatch):
    """The factory resolves engine.client_state=auto from N and the rule's declared state: vit_tiny SCAFFOLD's 20
    clients x 2.4 MB go to disk once the threshold is below their 47 MB."""
    from fl_core.data import make_partition
    from fl_core.engine import diskstate
    from fl_core.engine.factory import build_simulator

    from conftest import tiny_cfg

    cfg = tiny_cfg(*VIT_SCAFFOLD, "engine.client_state=auto")
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    assert build_simulator(cfg, digits, part).client_state == "memory"
    monkeypatch.setattr(diskstate, "AUTO_DISK_BYTES", 40 * 2 ** 20)
    sim = build_simulator(cfg, digits, part)
    d = sim.spec.d
    assert sim.client_state == "disk"
    assert sim.client_state_reason == (f"auto: 20 clients x {4 * d / 2 ** 20:.1f} MiB of state = "
                                       f"{20 * 4 * d / 2 ** 30:.2f} GiB > 0.0390625 GiB")
