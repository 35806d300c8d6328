#!/usr/bin/env python
"""Client-state scale benchmark: SCAFFOLD on the standard CNN with N = 100, 1,000 and 10,000 clients.

Every client holds a control variate c_i of d = 797,962 floats (3.2 MB), as after a long run in which every client
has trained once (``--fill 1``: the store starts with all N states; SCAFFOLD's c_i, written with small random
values). Each row runs in a process of its own (so its peak RSS is its own): 10 clients per round (fixed sampler),
E = 1, B = 10 on CIFAR-shaped random data (each client holds 10 samples drawn from a shared pool of 2,000), a
checkpoint every 2 rounds, on the CPU. Columns:

- ``ms/round``: median ``round_time_s`` (sampling, local training, aggregation) over the rounds after the first;
- ``checkpoint s`` / ``checkpoint MB``: the slowest checkpoint write and the checkpoint file's size (the disk
  store's key files are counted separately, ``states GB``: allocated blocks);
- ``peak RSS GB``: the process's peak resident set (``ru_maxrss``), data, model and states included.

``memory`` rows whose states would not fit in this machine's RAM are skipped with the size they would need.

``--repeats R`` runs every row R times, interleaved (all rows once, then all rows again, ...), each in a fresh process:
``ms/round`` and ``checkpoint s`` are then the median [min, max] over the repeats, and the per-round time of each N
relative to the smallest N of the same store is taken repeat by repeat (the rows of one repeat run minutes apart, so
a change in the machine's load between repeats cancels) and given as median [min, max]. The output names the command,
the machine (processor, cores, RAM, torch and its threads) and the load average at the start and the end.

    python benchmarks/scale.py                      # N = 100, 1000, 10000; memory and disk stores
    python benchmarks/scale.py --clients 100,1000 --rounds 4
    python benchmarks/scale.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

POOL = 2000  # shared CIFAR-shaped samples
PER_CLIENT = 10
PER_ROUND = 10
D_STD_CNN = 797_962


def _one(store: str, n: int, rounds: int, fill: float, folder: Path) -> dict:
    import numpy as np
    import torch

    from fl_core.config import compose
    from fl_core.data.partition import Partition
    from fl_core.data.sources import FLDataset
    from fl_core.engine import diskstate
    from fl_core.engine.factory import build_simulator
    from fl_core.engine.state import ClientStateStore

    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    x = torch.randint(0, 256, (POOL, 32, 32, 3), dtype=torch.uint8).numpy()
    y = torch.randint(0, 10, (POOL,)).numpy()
    ds = FLDataset(name="cifar10", x_train=torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(),
                   y_train=torch.from_numpy(y).long(), x_test=torch.from_numpy(x[:50]).permute(0, 3, 1, 2).contiguous(),
                   y_test=torch.from_numpy(y[:50]).long(), num_classes=10, scale=255.0,
                   mean=(0.491, 0.482, 0.447), std=(0.247, 0.243, 0.262))
    indices = [gen.choice(POOL, PER_CLIENT, replace=False) for _ in range(n)]
    part = Partition.from_indices(indices, y, 10)
    cfg = compose(["dataset=cifar10", "model=std_cnn", "algorithm=scaffold", f"partition.num_clients={n}",
                   f"train.participation={PER_ROUND / n}", "train.sampler=fixed", f"train.rounds={rounds}",
                   "train.local_epochs=1", "train.batch_size=10", f"train.eval_every={rounds}",
                   "engine.progress=false", "engine.checkpoint_every=2", f"engine.client_state={store}",
                   "tracking.enabled=false"])
    sim = build_simulator(cfg, ds, part, checkpoint_path=folder / "ck.pt")
    sim.restore()
    d = sim.spec.d
    held = int(round(fill * n))
    if store == "disk":
        prefill = diskstate.DiskClientStateStore(n, sim._states_folder())
    else:
        prefill = ClientStateStore("cpu")
    for cid in range(held):
        prefill.put(cid, {"c": torch.from_numpy(gen.standard_normal(d, dtype=np.float32) * 1e-3)})
    sim._restored["clients"] = prefill.state_dict()
    if store == "disk":
        prefill.close()
    else:
        del prefill
    writes = []
    save = sim._save

    def timed_save(st, s):
        t0 = time.perf_counter()
        save(st, s)
        writes.append(time.perf_counter() - t0)

    sim._save = timed_save
    res = sim.run()
    times = sorted(r["round_time_s"] for r in res.history[1:])
    states = folder / "ck.pt.states"
    return {"store": store, "clients": n, "d": d, "held": held, "rounds": rounds,
            "ms_round": 1000 * times[len(times) // 2], "checkpoint_s": max(writes) if writes else 0.0,
            "checkpoint_mb": (folder / "ck.pt").stat().st_size / 1e6 if (folder / "ck.pt").exists() else 0.0,
            "states_gb": (sum(os.stat(p).st_blocks * 512 for p in states.glob("*.bin")) / 1e9
                          if states.exists() else 0.0),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def spread(xs: Sequence[float], fmt: str = "{:.0f}") -> str:
    """``median [min, max]`` of ``xs`` (just the value for one)."""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def machine() -> str:
    """Processor, cores, RAM, torch version and threads of this machine (the rows' processes inherit the threads):
    round_speed's description of the CPU."""
    import torch

    from benchmarks.round_speed import machine as described

    return described(torch.device("cpu"))


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="100,1000,10000", help="N values, comma-separated")
    p.add_argument("--stores", default="memory,disk", help="engine.client_state values, comma-separated")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--fill", type=float, default=1.0, help="share of the N clients that hold a state at the start")
    p.add_argument("--repeats", type=int, default=1, help="run every row this many times, interleaved (default 1)")
    p.add_argument("--one", nargs=2, metavar=("STORE", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory(dir=os.environ.get("FL_SCALE_DIR")) as tmp:
            print(json.dumps(_one(args.one[0], int(args.one[1]), args.rounds, args.fill, Path(tmp))))
        return 0
    if args.repeats < 1 or args.rounds < 2:
        p.error("--repeats must be >= 1 and --rounds >= 2 (the first round is not timed)")
    clients = [int(v) for v in args.clients.split(",")]
    stores = args.stores.split(",")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    runs = {(s, n): [] for n in clients for s in stores}  # (store, N) -> one result per repeat
    skipped = {}
    for rep in range(args.repeats):
        for n in clients:
            for store in stores:
                need = n * args.fill * D_STD_CNN * 4
                if store == "memory" and need > 0.8 * ram:
                    skipped[(store, n)] = f"states need {need / 2 ** 30:.1f} GiB, RAM {ram / 2 ** 30:.1f} GiB"
                    continue
                proc = subprocess.run([sys.executable, __file__, "--one", store, str(n), "--rounds", str(args.rounds),
                                       "--fill", str(args.fill)], capture_output=True, text=True,
                                      check=False)
                if proc.returncode != 0:
                    skipped[(store, n)] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                else:
                    runs[(store, n)].append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), repeat=rep))
                print(f"  {store} N={n}: repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    env = "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS", "FL_SCALE_DIR") if k in os.environ)
    args_given = argv if argv is not None else sys.argv[1:]
    command = env + "python benchmarks/scale.py" + "".join(f" {a}" for a in args_given)
    print(f"`{command}`\n")
    print(f"{machine()}; {args.repeats} repeat(s) of {args.rounds} rounds per row, {time.perf_counter() - t0:.0f} s "
          f"wall; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    many = args.repeats > 1
    head = "median [min, max] over the repeats" if many else "one run"
    print(f"| store | N | ms/round ({head}) | checkpoint s ({head}) | checkpoint MB | states GB (disk) | peak RSS GB | "
          f"ms/round / smallest N's, per repeat ({head}) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n in clients:
        for store in stores:
            rs: List[dict] = runs[(store, n)]
            if (store, n) in skipped and not rs:
                print(f"| {store} | {n:,} | skipped: {skipped[(store, n)]} | | | | | |")
                continue
            base = {b["repeat"]: b["ms_round"] for b in runs[(store, clients[0])]}
            ratios = [r["ms_round"] / base[r["repeat"]] for r in rs if r["repeat"] in base]
            last = rs[-1]
            print(f"| {store} | {n:,} | {spread([r['ms_round'] for r in rs])} | "
                  f"{spread([r['checkpoint_s'] for r in rs], '{:.2f}')} | {last['checkpoint_mb']:,.1f} | "
                  f"{last['states_gb']:.2f} | {max(r['peak_rss_gb'] for r in rs):.2f} | "
                  f"{spread(ratios, '{:.2f}') if ratios else 'n/a'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
