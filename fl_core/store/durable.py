"""Durable torch files: checkpoints and completion records that a kill or a bad disk cannot turn into a trap.

Writing (:func:`save`): the object goes to a temporary file beside the target, which is flushed and
fsync'ed; the current file (if any) is renamed to ``<name>.prev``; the temporary file is renamed
into place and the folder fsync'ed. A kill at any moment therefore leaves the new file, or the
previous one (as ``<name>`` or ``<name>.prev``), complete on disk, plus at most one stray
``*.tmp`` that :func:`remove_temporaries` clears.

Reading (:func:`load`): the file, else its ``.prev``, with torch's weights-only loader
(``torch.load(weights_only=True)``): it rebuilds tensors, dtypes and plain containers (dict, list, tuple,
str, int, float, bool, None) and refuses any other pickled object before creating it, so a file planted in a
checkpoint folder (a shared or copied project) cannot run code when a run resumes. Everything this project
saves here (a round checkpoint of :mod:`fl_core.engine.simulator`, a completion record of
:mod:`fl_core.store.runstore`) is made of those types only. A file that cannot be read (truncated, empty, garbage,
refused by the weights-only loader, or not the expected kind) is renamed to ``<name>.corrupt`` with one
warning line on stderr naming it, and the next candidate is tried; with none left the caller starts from
scratch. Nothing is deleted here, so a user can inspect what was moved aside (an experiment's attempt
folder, and the ``*.corrupt`` files in it, are removed once the experiment completes: :mod:`fl_core.store.runstore`).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from . import envfail, faults
from ..lazy import lazy_import

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch

PREV = ".prev"
CORRUPT = ".corrupt"
TMP = ".tmp"


def fsync_dir(folder: Path) -> None:
    """fsync a folder so that a rename inside it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def previous(path: Path) -> Path:
    """Where :func:`save` keeps the file that ``path`` held before the last write."""
    return path.with_name(path.name + PREV)


def save(obj: Any, path: Path, *, keep_previous: bool = True) -> None:
    """Write ``obj`` with ``torch.save`` to ``path`` durably (fsync + rename), keeping the old file as
    ``<path>.prev`` when ``keep_previous``. Fault points ``checkpoint_write`` and ``checkpoint_swap``.

    Raises:
        OSError: the write failed (a full disk, a read-only file system, ...), naming the temporary file (also when
            torch reported it as a ``RuntimeError``); the temporary file is removed and ``path`` (and its
            ``.prev``) are left as they were.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=TMP)
    try:
        with envfail.writing(tmp), os.fdopen(fd, "wb") as f:  # a full disk: an OSError naming the file
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        faults.point("checkpoint_write", path=tmp)
        if keep_previous and path.exists():
            os.replace(path, previous(path))
            faults.point("checkpoint_swap")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def move_aside(path: Path, why: str) -> Path:
    """Rename an unreadable file to ``<path>.corrupt`` (``.corrupt.1``, ... if taken) and say so on stderr."""
    dest = path.with_name(path.name + CORRUPT)
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{CORRUPT}.{n}")
    os.replace(path, dest)
    print(f"warning: {path} is unreadable ({why}); moved it to {dest.name}", file=sys.stderr)
    return dest


def _short(err: BaseException) -> str:
    """A one-line reason for a failed read: a refusal of the weights-only loader names the object it refused."""
    if "Weights only load failed" in str(err):
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = (f"it references {found.group(1).rstrip('.')}" if found
                else "it holds more than tensors and plain containers")
        return f"refused by the weights-only loader: {what}"
    text = str(err).strip().splitlines()
    first = text[0].split(". ")[0][:160] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _read(path: Path) -> Any:
    """``torch.load`` of ``path`` on the CPU with the weights-only loader, its warnings silenced (a refused file gets
    the caller's one line, not torch's as well)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def load(path: Path, check: Optional[Callable[[Any], Optional[str]]] = None) -> Optional[Any]:
    """The object saved at ``path``, else at ``<path>.prev``; None when neither is readable.

    Read with the weights-only loader (module docstring): only tensors, dtypes and plain containers come back;
    a file holding anything else is refused without running any of it and counts as unreadable.

    Args:
        path: the file written by :func:`save`.
        check: optional validator of a loaded object; it returns None if the object is usable, or a
            short reason why not (the file is then moved aside like an unreadable one).

    Unreadable or rejected candidates are moved aside (:func:`move_aside`), never deleted.
    """
    path = Path(path)
    for cand in (path, previous(path)):
        if not cand.exists():
            continue
        try:
            obj = _read(cand)
        except Exception as err:  # a refused object, any unpickling / zip / EOF / OS error: the file is unusable
            move_aside(cand, _short(err))
            continue
        why = check(obj) if check is not None else None
        if why:
            move_aside(cand, why)
            continue
        return obj
    return None


def remove(path: Path) -> None:
    """Remove ``path`` and its ``.prev`` (not the ``.corrupt`` files)."""
    for p in (Path(path), previous(Path(path))):
        if p.exists():
            p.unlink()


def remove_temporaries(folder: Path) -> int:
    """Delete the ``*.tmp`` files that a killed :func:`save` left in ``folder``; returns how many.

    Call it only while holding the folder's writer lock (another writer's file would look the same)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    n = 0
    for p in folder.glob(f"*{TMP}"):
        if p.is_file():
            p.unlink()
            n += 1
    return n
