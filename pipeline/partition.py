"""DVC stage ``partition``: split each dataset across clients for every partition the grid uses.

``python -m pipeline.partition [--params params.yaml]`` writes ``data/partitions/<key>/`` with the
client index arrays (``partition.npz``), statistics (``stats.json``: sizes, label histogram per
client) and ``labels_per_client.png``. The same partition seed gives the same partition.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from fl_core.config import ConfigError
from fl_core.data.partition import partition_key

from .common import dataset_for, fail, partition_for
from .prepare import grid_configs


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    params = Path(argv[argv.index("--params") + 1]) if "--params" in argv else Path("params.yaml")
    try:
        cfgs = grid_configs(params)
    except ConfigError as err:
        fail(str(err))
    seen = set()
    for cfg in cfgs:
        key = partition_key(cfg.partition, cfg.dataset.name)
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
