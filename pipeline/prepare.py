"""DVC stage ``prepare``: read every dataset the grid uses once and cache it as tensors.

``python -m pipeline.prepare [--params params.yaml] [--debug]`` writes ``data/prepared/<dataset>.pt`` (one file per
variant of a generated dataset, e.g. ``mnist1d-shuffled-s42.pt``)
(uint8 images, int64 labels, normalisation constants); later stages and single runs read the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from fl_core.store import envfail
from fl_core.config import ConfigError

from .common import fail
from .grid import load_grid


def grid_configs(params: Path) -> list:
    """First-seed config of every experiment (datasets and partitions do not depend on the seed)."""
    grid = load_grid(params)
    return [grid.compose_all(name)[0] for name in grid.experiments]


def stage_configs(argv: Optional[List[str]], doc: str) -> Optional[list]:
    """Parse ``[--params FILE] [--help]`` of a data stage; the grid's configs, or None after --help.

    Exits with a one-line error (status 2) on a bad grid."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(doc)
        return None
    params = Path("params.yaml")
    if "--params" in argv:
        i = argv.index("--params")
        if i + 1 >= len(argv):
            fail("--params needs a file")
        params = Path(argv[i + 1])
    try:
        return grid_configs(params)
    except ConfigError as err:
        fail(str(err))


def check_data_dirs(cfgs: list) -> None:
    """The data folders the stage writes to (``data_dir`` of every experiment), checked before any data is read.

    Raises:
        fl_core.store.envfail.EnvironmentFailure: a folder is a file or not writable (one line, exit status 3)."""
    for data_dir in dict.fromkeys(str(c.data_dir) for c in cfgs):
        envfail.check_folder(data_dir, "data folder", "data_dir")


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status: 0, 2 bad input (one line), 3 the environment failed (a
    ``data_dir`` not writable, a full disk: one line; ``--debug`` or ``FL_DEBUG=1``: the traceback)."""
    return envfail.run_cli(_main, argv)


def _main(argv: List[str]) -> int:
    cfgs = stage_configs(argv, __doc__)
    if cfgs is None:
        return 0
    from fl_core.data import dataset_tag  # loads torch: not for --help
    from fl_core.data.access import dataset_for

    check_data_dirs(cfgs)
    seen = set()
    for cfg in cfgs:
        key = (dataset_tag(cfg.dataset), cfg.data_dir)
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
