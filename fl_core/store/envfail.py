"""When the environment fails: one clear line and an exit status of its own, instead of a traceback.

An *environment failure* is a problem of the machine a command runs on, not of its config or of the code: a
folder the command must write to is a file or read-only, the disk is full, a torch.distributed rank was lost or
froze. This module is the one place that maps such errors to an end:

- :class:`EnvironmentFailure` carries what failed (``resource``), why (``cause``) and what to do (``action``);
  ``str()`` is the one line the command prints, e.g. ``results folder /mnt/ro/results is not writable (read-only
  file system); choose another results_dir=..., then run the same command again``.
- :func:`classify` turns an exception (or one in its ``__cause__`` / ``__context__`` chain) into an
  :class:`EnvironmentFailure`, or None when it is not one (a bug keeps its traceback). Built in: ``OSError`` by
  errno (:data:`OS_CAUSES`) and torch.distributed's own error types; :func:`register` adds classifiers
  (:mod:`fl_core.store.storefail` registers those of the tracking store and the databases: a locked SQLite store, an
  MLflow server or PostgreSQL that does not answer).
- :func:`check_folder` checks a folder a command will write to before anything is written (nothing is created,
  no lock or temporary file is left behind) and names it for the messages of later errors under it.
- :func:`run_cli` wraps a command's ``main``: an environment failure ends with ``error: <line>`` on stderr and exit
  status :data:`EXIT_STATUS` (3); ``--debug`` or ``FL_DEBUG=1`` lets the traceback through instead.

Exit statuses of the commands (docs/cli.md): 0 ok, 1 a seed failed, 2 bad input (config, data files, a busy
experiment), 3 the environment failed (this module), 130 interrupted. This module imports nothing of the project
but :mod:`fl_core.progress` (standard library only, as this one), so any layer may use it.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

EXIT_STATUS = 3  # the environment failed; 1 a seed failed, 2 bad input, 130 interrupted (docs/cli.md)
DEBUG_ENV = "FL_DEBUG"  # FL_DEBUG=1: show the traceback of an environment failure (as --debug)
AGAIN = "then run the same command again"


class EnvironmentFailure(Exception):
    """The environment failed: ``resource`` (what, with its path or rank), ``cause`` (why, starting with a verb:
    ``is not writable (read-only file system)``) and ``action`` (what to do). ``str()`` is the one line a command
    prints after ``error:``.

    ``quiet``: a worker rank of ``engine.executor=distributed`` whose collective failed because another rank is gone;
    rank 0 says what happened, so the worker exits with :data:`EXIT_STATUS` and prints nothing.

    ``store``: the URL (password masked) of the tracking store or database that failed (:mod:`fl_core.store.storefail`),
    None for other failures: a command does not try to write there again before it ends (that would only wait
    once more), so runs it holds there are ended by the next start instead.
    """

    def __init__(self, resource: str, cause: str, action: str, *, quiet: bool = False, store: Optional[str] = None):
        super().__init__(f"{resource} {cause}; {action}")
        self.resource, self.cause, self.action, self.quiet, self.store = resource, cause, action, quiet, store


# --------------------------------------------------------------------------- places (folders with a config key)

_PLACES: Dict[str, Tuple[str, str, str]] = {}  # absolute folder -> (label, the folder as given, config key)


def name_place(folder, label: str, key: Optional[str] = None) -> None:
    """Name ``folder`` for the messages of errors under it: ``label`` (``checkpoint folder``) and the config
    ``key`` that chooses it (``engine.checkpoint_dir``). :func:`check_folder` calls it."""
    _PLACES[os.path.abspath(os.fspath(folder))] = (label, os.fspath(folder), key or "")


def _place_of(path: str) -> Optional[Tuple[str, str, str, str]]:
    """(label, folder as given, key, path relative to the folder) of the innermost named place holding ``path``."""
    full = os.path.abspath(path)
    best = None
    for folder, (label, given, key) in _PLACES.items():
        if full == folder or full.startswith(folder.rstrip(os.sep) + os.sep):
            if best is None or len(folder) > len(best[0]):
                best = (folder, label, given, key)
    if best is None:
        return None
    folder, label, given, key = best
    return label, given, key, os.path.relpath(full, folder)


# --------------------------------------------------------------------------- classification

#: errno -> how it reads after the resource (``is ...``), for a folder or file the command writes to.
OS_CAUSES: Dict[int, str] = {
    errno.ENOSPC: "is out of space (no space left on device)",
    errno.EDQUOT: "is out of space (disk quota exceeded)",
    errno.EROFS: "is not writable (read-only file system)",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (operation not permitted)",
    errno.ENOTDIR: "is not a folder (a file stands in its path)",
    errno.EISDIR: "is a folder where a file is needed",
    errno.EIO: "gave an input/output error (a failing disk or network file system)",
    errno.EMFILE: "cannot be opened (too many open files in this process)",
    errno.ENFILE: "cannot be opened (too many open files on this machine)",
    errno.ESTALE: "is a stale network file handle",
    errno.ENAMETOOLONG: "has a name too long for the file system",
}
FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk is full: free space, then the same command again

Classifier = Callable[[BaseException], Optional[EnvironmentFailure]]
_CLASSIFIERS: List[Classifier] = []


def register(classifier: Classifier) -> Classifier:
    """Add a classifier (usable as a decorator): ``classifier(err)`` returns an :class:`EnvironmentFailure` for an
    error it recognises, else None. :func:`classify` asks every registered classifier, in order, about every
    exception of a chain."""
    _CLASSIFIERS.append(classifier)
    return classifier


def chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then its causes: ``__cause__``, else ``__context__`` unless suppressed (``raise ... from None``)."""
    seen = set()
    while err is not None and id(err) not in seen and len(seen) < 16:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def first_line(err: BaseException) -> str:
    """The first line of ``str(err)`` (stripped), or the error's type name when it says nothing: how a message
    quotes an error in one line."""
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def os_error(err: BaseException) -> Optional[OSError]:
    """The first ``OSError`` in ``err``'s chain whose errno is one of :data:`OS_CAUSES` (or EEXIST), else None.
    torch.save reports a full disk as a ``RuntimeError`` whose ``__context__`` is the ``OSError``."""
    for e in chain(err):
        if isinstance(e, OSError) and (e.errno in OS_CAUSES or e.errno == errno.EEXIST):
            return e
    return None


def classify(err: BaseException) -> Optional[EnvironmentFailure]:
    """The environment failure ``err`` stands for, or None (a bug, bad input, an interruption).

    ``err`` itself or any exception in its chain may be an :class:`EnvironmentFailure` or something a classifier
    recognises (:func:`register`). ``KeyboardInterrupt`` and ``SystemExit`` are never environment failures.
    """
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return None
    for e in chain(err):
        if isinstance(e, EnvironmentFailure):
            return e
        for c in _CLASSIFIERS:
            found = c(e)
            if found is not None:
                return found
    return None


@register
def _classify_os_error(err: BaseException) -> Optional[EnvironmentFailure]:
    if not isinstance(err, OSError) or (err.errno not in OS_CAUSES and err.errno != errno.EEXIST):
        return None
    name = os.fspath(err.filename) if err.filename is not None else None
    if err.errno == errno.EEXIST:  # mkdir(exist_ok=True) where a file stands
        if name is None or not os.path.exists(name) or os.path.isdir(name):
            return None
        cause = "is a file, not a folder"
    else:
        cause = OS_CAUSES[err.errno]
    place = _place_of(name) if name else None
    if place is None:
        resource = name or "a file or folder this command writes to"
        fix = "free space there" if err.errno in FULL else "fix it or point the command elsewhere"
        return EnvironmentFailure(resource, cause, f"{fix}, {AGAIN}")
    label, given, key, rel = place
    if rel != "." and err.errno in FULL:
        cause = cause[:-1] + f" writing {rel})"
    elif rel != ".":
        cause = f"has a problem at {rel}: it {cause}"
    other = f"choose another {key}=..." if key else "point the command elsewhere"
    fix = f"free space there or {other}" if err.errno in FULL else other
    return EnvironmentFailure(f"{label} {given}", cause, f"{fix}, {AGAIN}")


_DIST_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


@register
def _classify_distributed(err: BaseException) -> Optional[EnvironmentFailure]:
    """torch.distributed's own errors that :mod:`fl_core.engine.distributed` did not already name (a rendezvous
    that timed out, a store that went away); recognised by type, so torch need not be imported here."""
    if type(err).__name__ not in _DIST_TYPES or not type(err).__module__.startswith("torch.distributed"):
        return None
    first = first_line(err)[:200]
    return EnvironmentFailure("the torch.distributed process group", f"failed ({first})",
                              "check that every rank started and can reach MASTER_ADDR:MASTER_PORT (torchrun), "
                              "then run the same command again")


# --------------------------------------------------------------------------- checks and writes

def _probe(folder: str) -> None:
    """Create and remove a temporary file in ``folder`` (the ground truth of "writable": permissions, ACLs,
    read-only mounts); fault point ``path_check`` sits just before it."""
    from . import faults

    faults.point("path_check", path=folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fl-write-check-")
    os.close(fd)
    os.unlink(tmp)


def check_folder(path, label: str, key: Optional[str] = None) -> None:
    """Check, before anything is written, that the command can write to folder ``path``: it is a writable folder, or
    it does not exist yet and its nearest existing parent is one (the command creates it later). Nothing is
    created or left behind (the write probe is a temporary file, removed at once). ``path`` is then named
    ``label`` / ``key`` in the messages of later errors under it (:func:`name_place`).

    Raises:
        EnvironmentFailure: ``path`` (or a parent) is a file, or the folder is not writable (read-only file
            system, permission denied), e.g. ``results folder out is a file, not a folder; choose another
            results_dir=..., then run the same command again``.
    """
    given = os.fspath(path)
    name_place(given, label, key)
    resource = f"{label} {given}"
    other = f"choose another {key}=..." if key else "point the command elsewhere"
    full = Path(os.path.abspath(given))
    for cand in (full, *full.parents):
        if not os.path.lexists(cand):
            continue
        if not cand.is_dir():
            where = "" if cand == full else f" ({cand} is a file)"
            raise EnvironmentFailure(resource, f"is {'a file, ' if cand == full else ''}not a folder{where}",
                                     f"{other} (or move the file away), {AGAIN}")
        try:
            _probe(str(cand))
        except OSError as err:
            cause = OS_CAUSES.get(err.errno, f"is not writable ({err.strerror or err})")
            if cand != full:
                cause = f"cannot be created: {cand} {cause}"
            raise EnvironmentFailure(resource, cause, f"{other}, {AGAIN}") from err
        return


@contextmanager
def writing(path) -> Iterator[None]:
    """Around a write of ``path``: an ``OSError`` of the environment (:func:`os_error`) raised inside, also one that
    torch wrapped in a ``RuntimeError``, comes out as an ``OSError`` naming ``path``, so its message can say where."""
    try:
        yield
    except Exception as err:
        found = os_error(err)
        if found is None or (found is err and err.filename is not None):
            raise
        raise OSError(found.errno, found.strerror, os.fspath(path)) from err


# --------------------------------------------------------------------------- command-line entry points

def debug() -> bool:
    """Whether ``FL_DEBUG`` is set to anything but ``0`` / empty (``--debug`` sets it): show tracebacks."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def debug_requested(argv: Sequence[str]) -> Tuple[bool, List[str]]:
    """(whether ``--debug`` is among ``argv`` or :func:`debug`, ``argv`` without ``--debug``)."""
    rest = [a for a in argv if a != "--debug"]
    return len(rest) != len(argv) or debug(), rest


def run_cli(main: Callable[[List[str]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run a command's ``main(argv)`` (``argv``: ``sys.argv[1:]`` when None, without ``--debug``) and return its exit
    status; an environment failure (:func:`classify`) prints ``error: <line>`` on stderr and returns
    :data:`EXIT_STATUS` (a quiet one prints nothing). With ``--debug`` or ``FL_DEBUG=1`` it is raised instead (the
    traceback), and ``FL_DEBUG=1`` is set for the processes the command starts."""
    debug, args = debug_requested(list(sys.argv[1:] if argv is None else argv))
    if debug:
        os.environ[DEBUG_ENV] = "1"
        return main(args)
    try:
        return main(args)
    except Exception as err:
        failure = classify(err)
        if failure is None:
            raise
    if not failure.quiet:
        sys.stdout.flush()
        from ..progress import end_line

        end_line()  # the error on a line of its own, not glued to a progress bar's
        print(f"error: {failure}", file=sys.stderr, flush=True)
    return EXIT_STATUS
