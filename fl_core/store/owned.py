"""Folders a command may write into, replace or delete: only its own.

A command of this project writes its outputs into a folder named by the user (``results_dir`` and ``name``,
``engine.checkpoint_dir``, a report's or a sweep's ``--out``). Before it writes, replaces or deletes anything
there it checks that the folder is its own: it does not exist yet, it is empty, or every entry in it is a file
this command writes (a name matching one of the command's patterns), and, where the command asks for one, its
marker file is there (a results folder's ``experiment.json``). Anything else is a folder the project did not
write, e.g. ``fl-train results_dir=. name=docs`` pointing at the project's ``docs/``, or a results folder
holding a file the user put there: the command refuses in one line naming the path and the first foreign entry
(:class:`ForeignFolder`, exit status 2) before it creates, writes or deletes anything.

Patterns are ``fnmatch`` patterns of paths relative to the folder, with ``/`` separators (``models/seed_*.pt``);
a folder entry is allowed when a pattern names a file under it.
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import List, Optional, Sequence


class ForeignFolder(ValueError):
    """A folder the command would write into, replace or delete holds what the project did not write (one line)."""


def foreign_entries(folder: Path, patterns: Sequence[str], limit: int = 1) -> List[str]:
    """Up to ``limit`` paths (relative to ``folder``, ``/``-separated) under ``folder`` that match none of
    ``patterns``: files, symbolic links and anything else that is not a folder; a folder counts as foreign only
    when no pattern can name a file under it. [] when ``folder`` does not exist or holds only matching entries."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return [] if not os.path.lexists(folder) else ["."]
    found: List[str] = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder).as_posix()
        prefix = "" if rel_root == "." else rel_root + "/"
        bad_dirs = [d for d in sorted(dirs)
                    if os.path.islink(os.path.join(root, d)) or not _may_hold(prefix + d, patterns)]
        found += [prefix + d for d in bad_dirs]
        dirs[:] = sorted(d for d in dirs if d not in bad_dirs)
        found += [prefix + f for f in sorted(files) if not any(fnmatchcase(prefix + f, p) for p in patterns)]
        if len(found) >= limit:
            break
    return found[:limit]


def _may_hold(rel: str, patterns: Sequence[str]) -> bool:
    """Whether a pattern names a file under folder ``rel`` (its leading components match ``rel``'s)."""
    depth = rel.count("/") + 1
    return any(fnmatchcase(f"{rel}/\0", p)  # a ``*`` that spans folders (``*/*``)
               or (p.count("/") >= depth and fnmatchcase(rel, "/".join(p.split("/")[:depth]))) for p in patterns)


def with_temporaries(patterns: Sequence[str]) -> List[str]:
    """``patterns`` and the temporary files an interrupted atomic write of each leaves beside it
    (``dir/.name.*``: :func:`pipeline.files.atomic_write`)."""
    out = list(patterns)
    for p in patterns:
        head, _, base = p.rpartition("/")
        out.append(f"{head}/.{base}.*" if head else f".{base}.*")
    return out


def check(folder: Path, patterns: Sequence[str], label: str, hint: str, marker: Optional[str] = None) -> None:
    """Refuse ``folder`` unless it is this command's to write into, replace or delete (module docstring).

    Args:
        folder: the folder the command writes into, replaces or deletes.
        patterns: what the command writes there (module docstring).
        label: what the folder is, for the message (``results folder``).
        hint: what to do instead, for the message (``choose another name=... or results_dir=...``).
        marker: a file that a non-empty folder of this command always holds (``experiment.json``), or None.

    Raises:
        ForeignFolder: one line, e.g. ``results folder ./docs holds files this project did not write (e.g.
            ./docs/cli.md); choose another name=... or results_dir=...; nothing was changed``.
    """
    folder = Path(folder)
    if not os.path.lexists(folder):
        return
    shown = os.fspath(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise ForeignFolder(f"{label} {shown} exists and is not a folder this project wrote; {hint}; "
                            "nothing was changed")
    if not any(folder.iterdir()):
        return
    bad = foreign_entries(folder, patterns)
    if bad:
        raise ForeignFolder(f"{label} {shown} holds files this project did not write (e.g. "
                            f"{os.path.join(shown, bad[0])}); {hint}; nothing was changed")
    if marker is not None and not (folder / marker).is_file():
        raise ForeignFolder(f"{label} {shown} has no {marker}, so this project did not write it; {hint}; "
                            "nothing was changed")
