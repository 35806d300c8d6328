"""DVC stage ``prepare``: read every dataset the grid uses once and cache it as tensors.

``python -m pipeline.prepare [--params params.yaml]`` writes ``data/prepared/<dataset>.pt``
(uint8 images, int64 labels, normalisation constants); later stages and single runs read the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from fl_core.config import ConfigError

from .common import dataset_for, fail
from .grid import load_grid


def grid_configs(params: Path) -> list:
    """First-seed config of every experiment (datasets and partitions do not depend on the seed)."""
    grid = load_grid(params)
    return [grid.compose_all(name)[0] for name in grid.experiments]


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
        key = (cfg.dataset.name, cfg.data_dir)
        if key in seen:
            continue
        seen.add(key)
        try:
            ds = dataset_for(cfg, write_cache=True)
        except (RuntimeError, ValueError) as err:
            fail(str(err))
        print(f"prepared {ds.name}: {len(ds.y_train)} train / {len(ds.y_test)} test, "
              f"input {tuple(ds.input_shape)}, {ds.num_classes} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
