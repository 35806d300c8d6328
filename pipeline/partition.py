"""DVC stage ``partition``: split each dataset across clients for every partition the grid uses.

``python -m pipeline.partition [--params params.yaml] [--debug]`` writes ``data/partitions/<key>/`` with the
client index arrays (``partition.npz``), statistics (``stats.json``: sizes, label histogram per
client) and ``labels_per_client.png``. The same partition seed gives the same partition.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from fl_core.store import envfail

from .common import fail
from .prepare import check_data_dirs, stage_configs


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status: 0, 2 bad input (one line), 3 the environment failed (a
    ``data_dir`` not writable, a full disk: one line; ``--debug`` or ``FL_DEBUG=1``: the traceback)."""
    return envfail.run_cli(_main, argv)


def _main(argv: List[str]) -> int:
    cfgs = stage_configs(argv, __doc__)
    if cfgs is None:
        return 0
    from fl_core.data import dataset_tag, partition_key  # loads torch: not for --help
    from fl_core.data.access import dataset_for, partition_for

    check_data_dirs(cfgs)
    seen = set()
    for cfg in cfgs:
        key = partition_key(cfg.partition, dataset_tag(cfg.dataset))
        if key in seen:
            continue
        seen.add(key)
        try:
            ds = dataset_for(cfg, write_cache=False)
            part = partition_for(cfg, ds, write_cache=True)
        except (RuntimeError, ValueError) as err:
            fail(str(err))
        sizes = part.sizes
        print(f"partition {key}: {part.num_clients} clients, sizes {int(sizes.min())}..{int(sizes.max())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
