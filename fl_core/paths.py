"""Where the project lives on disk.

Relative paths of the config (``data_dir``, ``results_dir``, ``engine.checkpoint_dir``,
``dataset.root``) resolve against the working directory, which is the project root for
``make``, ``dvc repro`` and the README commands. The MLflow store is shared: see :func:`store_root`.
"""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """``FL_PROJECT_ROOT`` if set, else the folder holding ``conf/`` above this package, else the cwd."""
    if os.environ.get("FL_PROJECT_ROOT"):
        return Path(os.environ["FL_PROJECT_ROOT"]).resolve()
    here = Path(__file__).resolve().parent.parent
    return here if (here / "conf").is_dir() else Path.cwd().resolve()


def store_root() -> Path:
    """Folder of the default MLflow store: ``DVC_ROOT`` (set by DVC, also for queued experiments that
    run in a temporary clone) so every run lands in one store, else :func:`project_root`."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    return project_root()


def conf_dir() -> Path:
    """The Hydra config folder shipped with the project."""
    return Path(__file__).resolve().parent.parent / "conf"
