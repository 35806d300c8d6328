"""Run under torchrun by tests/test_distributed.py: each stack with ``engine.executor=distributed`` over the ranks,
then (rank 0) the same config with the sequential executor in the same process, and write what differs.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_check.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fl_core.config import compose  # noqa: E402
from fl_core.data import load_source, make_partition  # noqa: E402
from fl_core.engine import distributed  # noqa: E402
from fl_core.engine.factory import build_simulator, job_key  # noqa: E402

SETTING = ["model=mlp", "model.hidden=16", "partition=dirichlet", "partition.variant=per_class",
           "partition.alpha=0.5", "partition.min_size=5", "partition.num_clients=7", "train.participation=0.8",
           "train.rounds=3", "train.local_epochs=1", "train.batch_size=32", "engine.progress=false",
           "engine.checkpoint_every=0", "tracking.enabled=false"]
STACKS = {
    "fedavg": ["algorithm=fedavg"],
    "scaffold": ["algorithm=scaffold"],
    "fedbug_feddyn": ["algorithm=fedbug", "algorithm.name=feddyn", "algorithm.feddyn.alpha=0.1"],
}


def main(out: str) -> None:
    rank, size = distributed.init(torch.device("cpu"))
    cfgs = {name: compose(SETTING + ov + ["engine.executor=distributed"]) for name, ov in STACKS.items()}
    ds = load_source(cfgs["fedavg"].dataset, ROOT / "data" / "raw")
    part = make_partition(cfgs["fedavg"].partition, ds.y_train.numpy(), ds.num_classes)
    if rank > 0:
        by_job = {job_key(c): c for c in cfgs.values()}
        distributed.serve(lambda job: build_simulator(by_job[job], ds, part).executor)
        distributed.shutdown()
        return
    report = {"world_size": size}
    for name, cfg in cfgs.items():
        dist_res = build_simulator(cfg, ds, part).run()
        ref = compose(SETTING + STACKS[name] + ["engine.executor=sequential"])
        seq_res = build_simulator(ref, ds, part).run()
        report[name] = {"max_abs_diff": float((dist_res.final_flat - seq_res.final_flat).abs().max()),
                        "bitwise": bool(torch.equal(dist_res.final_flat, seq_res.final_flat)),
                        "clients_per_round": [int(h["num_clients"]) for h in dist_res.history],
                        "acc": [h["test_acc"] for h in dist_res.history],
                        "ref_acc": [h["test_acc"] for h in seq_res.history]}
    distributed.stop_workers()
    distributed.shutdown()
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
