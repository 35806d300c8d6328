"""Where the project lives on disk.

Every relative output path resolves against the working directory: the config's ``data_dir``,
``results_dir``, ``engine.checkpoint_dir`` and ``dataset.root``, and the default MLflow store
``mlflow.db`` (:func:`store_root`). ``make``, ``dvc repro`` and the README commands run in the project
root; a paper study (``studies/<name>/``, a DVC project of its own) runs in its folder. The one exception
is an experiment DVC runs from its queue in a temporary copy of the project: its results come back
through git, while its MLflow runs go straight to the store of the project that queued it.
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
    """Folder of the default MLflow store ``mlflow.db``: ``DVC_ROOT`` when DVC runs the stage (the folder
    of its ``dvc.yaml`` project; for a queued experiment the project that queued it, not the temporary
    copy it runs in), else the working directory, like every other relative output path."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    return Path.cwd().resolve()


def cache_dir() -> Path:
    """Folder of caches that any command may rebuild, shared by every project and working directory of this user
    (the digits split as arrays: :mod:`fl_core.data.sources`): ``$XDG_CACHE_HOME/fl-pipeline``, by default
    ``~/.cache/fl-pipeline``. Deleting it costs only the time to rebuild what it held."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    if not base.is_absolute():  # the XDG specification: a relative path is invalid and ignored
        base = Path.home() / ".cache"
    return base / "fl-pipeline"


def conf_dir() -> Path:
    """The Hydra config folder shipped with the project."""
    return Path(__file__).resolve().parent.parent / "conf"
