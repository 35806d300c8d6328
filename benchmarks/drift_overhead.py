"""What the drift measures cost: ms per round with ``tracking.drift=1`` (every round, the default) against
``tracking.drift=0`` (never), for the sequential and the vectorised executor, on round_speed's workloads (random data
of their shape, MLflow logging on as a user's run logs), rows interleaved over the repeats.

    python benchmarks/drift_overhead.py [--workloads W1,W0-200] [--rounds 10] [--repeats 3] [--device cpu]

Prints a markdown table: per workload and executor, the median ms per round (``round_time_s``: sampling, training,
aggregation, the diagnostics and the evaluation rounds' evaluation; the last, evaluating round untimed), the median
wall ms between round ends (with MLflow's logging) and the ratio on / off of each, measured in the same run.
docs/benchmarks.md, Drift measures, holds a run of it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import round_speed as rs  # noqa: E402

EXECUTORS = ("sequential", "vectorized")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="W1,W0-200", help="comma-separated round_speed workloads (default W1,W0-200)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per row (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds per row (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every row, interleaved (default 3)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in rs.WORKLOADS]
    if unknown:
        p.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(rs.WORKLOADS)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = rs.resolve_device(args.device)
    tracking = rs._Tracking()
    peak = rs.PeakMemory(device)
    t0 = time.perf_counter()
    lines: List[str] = [
        f"`python benchmarks/drift_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`"),
        "", f"{rs.device_name(device)}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.warmup} warm-up + {args.rounds} timed rounds x {args.repeats} repeats per row", "",
        "| workload | executor | ms/round, drift off | drift on | on / off | wall ms, off | on | on / off |",
        "|---|---|---:|---:|---:|---:|---:|---:|"]
    try:
        for name in args.workloads.split(","):
            w = rs.WORKLOADS[name]
            rs.log(f"{w.name}: {w.describe()}")
            ds = rs.make_dataset(w, args.seed)
            part = rs.make_partition(w, ds, args.seed)
            data = rs.make_client_data(ds, part, device)
            specs = [(f"{e} {s}", e, [f"tracking.drift={1 if s == 'on' else 0}"])
                     for e in EXECUTORS for s in ("off", "on")]
            reps = rs.time_rows(w, ds, part, data, device, specs, args.repeats, args.warmup, args.rounds, args.seed,
                                tracking, peak)
            for e in EXECUTORS:
                off, on = rs.merge(reps[f"{e} off"]), rs.merge(reps[f"{e} on"])
                if off.note or on.note:
                    lines.append(f"| {w.name} | {e} | {off.note or on.note} | | | | | |")
                    continue
                lines.append(f"| {w.name} | {e} | {off.ms:.2f} | {on.ms:.2f} | {on.ms / off.ms:.3f} | "
                             f"{off.wall_ms:.2f} | {on.wall_ms:.2f} | {on.wall_ms / off.wall_ms:.3f} |")
            del ds, part, data
            gc.collect()
    finally:
        tracking.close()
    lines += ["", f"{time.perf_counter() - t0:.0f} s in all."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
