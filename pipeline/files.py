"""Atomic file writes (torch-free, so light stages such as the report import it cheaply)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from fl_core.store import envfail, faults


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    A crash midway leaves the previous ``path`` intact (no half-written outputs). The file gets the
    permissions a plain ``open(path, "w")`` would give (0666 minus the umask). Fault point ``outputs_write``
    (:mod:`fl_core.store.faults`) sits after the write, before the rename.

    Raises:
        OSError: the write failed (a full disk, ...), naming the temporary file, which is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        with envfail.writing(tmp):  # a full disk: an OSError naming the file (torch.save wraps it otherwise)
            write(Path(tmp))
        faults.point("outputs_write", path=tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
