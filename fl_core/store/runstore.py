"""The durable state of one experiment on disk: writer lock, attempt folder, completion records, staged outputs.

An experiment is identified by its name and the fingerprint of the config that determines its
numbers (seeds excluded); a seed by (name, fingerprint, seed). On disk (``R`` = ``results_dir``,
``C`` = ``engine.checkpoint_dir``)::

    C/<name>/<fingerprint>/           the attempt: exists from the first start until the outputs are in place
        seed_<s>.pt (+ .prev)         round checkpoint of a seed in training (fl_core.store.durable)
        seed_<s>.done.pt              completion record: the seed's history, summary, final model or failure
    R/<name>/                         the published outputs, always one attempt's complete set
    R/.<name>.staging/                outputs being assembled (rebuilt by every start)
    R/.locks/<name>.lock, C/.locks/<name>.lock    one writer per experiment (filelock; + ``.holder``)

Order of a seed: checkpoints -> completion record (durable) -> checkpoint removed. Order of the end:
outputs staged -> swapped into ``R/<name>`` -> MLflow parent ended -> attempt folder removed (renamed
away first, so its removal is all or nothing). A start after a kill at any point therefore finds
either the attempt folder (and continues it: finished seeds are read from their records, the seed in
training resumes from its checkpoint) or the published outputs of a finished attempt.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from . import durable, faults, owned, procs

RECORD_VERSION = 1

METRICS_FILE = "metrics.json"        # numbers a researcher compares (git-tracked, small)
EXPERIMENT_FILE = "experiment.json"  # what ran: names, fingerprint, seeds, failures, per-seed summaries

#: every file the train stage writes into ``results/<name>/`` (:mod:`fl_core.store.owned` patterns); a results folder holding
#: anything else was not written by this project and is never replaced (tests/test_owned.py checks that a run's
#: outputs all match)
OUTPUT_PATTERNS = (METRICS_FILE, EXPERIMENT_FILE, "rounds.csv", "runs.csv", "config.yaml", "curves.png", "curves.pdf",
                   ".gitignore", "partition/stats.json", "partition/labels_per_client.png",
                   "partition/labels_per_client.pdf", "models/seed_*.pt", "models/README.txt", "details/seed_*.csv",
                   "details/seed_*.png", "details/seed_*.pdf", "details/schedule.csv", "details/schedule.png",
                   "details/schedule.pdf", "details/round_times.csv")
#: what an attempt folder ``C/<name>/<fingerprint>/`` holds: checkpoints, records, their ``.prev`` / ``.corrupt`` /
#: temporary files, a disk client-state store's folder
ATTEMPT_PATTERNS = ("seed_*", "seed_*.states/*")

_INFO_KEYS = ("experiment", "algorithm", "stack", "dataset", "partition", "model", "fingerprint", "seeds_run",
              "failures", "per_seed")


def split_summary(summary: Dict[str, Any]) -> "tuple[Dict[str, Any], Dict[str, Any]]":
    """An experiment summary as (``metrics.json``, ``experiment.json``) contents.

    ``metrics.json`` keeps the numbers (``*_mean`` / ``*_std``, counts, floats of communication), the
    ``status`` (``ok`` | ``partial`` | ``failed``) and the ``seeds`` / ``failed_seeds`` lists;
    ``experiment.json`` the descriptive fields (:data:`_INFO_KEYS`). :func:`read_results` merges them back.
    """
    info = {k: summary[k] for k in _INFO_KEYS if k in summary}
    metrics = {k: v for k, v in summary.items() if k not in info}
    return metrics, info


def read_results(out: Path) -> Optional[Dict[str, Any]]:
    """The merged ``metrics.json`` + ``experiment.json`` of a published ``results/<name>`` folder, or None
    if either is missing or unreadable."""
    merged: Dict[str, Any] = {}
    for name in (EXPERIMENT_FILE, METRICS_FILE):
        try:
            part = json.loads((Path(out) / name).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(part, dict):
            return None
        merged.update(part)
    return merged


class ExperimentBusy(RuntimeError):
    """Another live process writes this experiment; the message names it (one line)."""


class ExperimentStore:
    """Paths and durable steps of experiment ``name`` with config fingerprint ``fingerprint``.

    Args:
        name: experiment name (``results/<name>``).
        fingerprint: hash of the result-determining config, seeds excluded.
        results_dir, checkpoint_dir: ``results_dir`` and ``engine.checkpoint_dir`` of the config.
    """

    def __init__(self, name: str, fingerprint: str, results_dir: Path, checkpoint_dir: Path):
        self.name, self.fingerprint = name, fingerprint
        self.results_dir, self.checkpoint_dir = Path(results_dir), Path(checkpoint_dir)
        self.out = self.results_dir / name
        self.staging = self.results_dir / f".{name}.staging"
        self.old = self.results_dir / f".{name}.old"
        self.attempt = self.checkpoint_dir / name / fingerprint

    # ------------------------------------------------------------------ ownership
    def check_owned(self) -> None:
        """Refuse (before anything is created, and again under the lock) when a folder this experiment would write,
        replace or delete is not the project's (:mod:`fl_core.store.owned`): ``results/<name>/`` (it must hold
        ``experiment.json`` and only the files a run writes), its ``.staging`` / ``.old`` siblings, the attempt
        folder.

        Raises:
            fl_core.store.owned.ForeignFolder: one line naming the folder and a file in it.
        """
        hint = "move it away, or choose another name=... or results_dir=..."
        outputs = owned.with_temporaries(OUTPUT_PATTERNS)
        owned.check(self.out, outputs, "results folder", hint, marker=EXPERIMENT_FILE)
        owned.check(self.old, outputs, "results folder", hint, marker=EXPERIMENT_FILE)
        owned.check(self.staging, outputs, "staging folder", hint)
        owned.check(self.attempt, ATTEMPT_PATTERNS, "checkpoint folder",
                    "move it away, or choose another name=... or engine.checkpoint_dir=...")

    # ------------------------------------------------------------------ lock
    def _lock_paths(self) -> List[Path]:
        paths = [self.results_dir / ".locks" / f"{self.name}.lock"]
        ck = self.checkpoint_dir / ".locks" / f"{self.name}.lock"
        if ck.resolve() != paths[0].resolve():
            paths.append(ck)
        return paths

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the experiment's writer locks (results and checkpoint folders) for the block.

        Raises:
            ExperimentBusy: another process holds one; the message names its pid, host and command.
        """
        from filelock import FileLock, Timeout

        held = []
        try:
            for path in self._lock_paths():
                path.parent.mkdir(parents=True, exist_ok=True)
                lk = FileLock(str(path), timeout=0)
                try:
                    lk.acquire()
                except Timeout:
                    raise ExperimentBusy(f"experiment {self.name!r} is being written by another process "
                                         f"({_holder(path)}); wait for it to end or stop it") from None
                held.append((lk, path))
                _write_holder(path)
            yield
        finally:
            for lk, path in reversed(held):
                holder = Path(str(path) + ".holder")
                if holder.exists():
                    holder.unlink()
                lk.release()

    # ------------------------------------------------------------------ recovery
    def recover(self) -> None:
        """Undo what a killed process left half done (call while holding :meth:`lock`): stray
        temporary files of the attempt, a half-finished swap of the outputs, a stale staging folder,
        a removed attempt folder that was not yet deleted. Only what this project wrote is removed
        (:meth:`check_owned` ran first; a leftover ``*.removed`` folder that holds anything else stays)."""
        durable.remove_temporaries(self.attempt)
        if self.old.exists():
            if self.out.exists():  # the swap completed: the old outputs are garbage
                shutil.rmtree(self.old)
            else:  # killed between the two renames: put the previous outputs back until new ones exist
                os.replace(self.old, self.out)
        if self.staging.exists():
            shutil.rmtree(self.staging)
        for trash in (self.checkpoint_dir / self.name).glob("*.*.removed"):
            if trash.is_dir() and not trash.is_symlink() and not owned.foreign_entries(trash, ATTEMPT_PATTERNS):
                shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ attempt
    def in_progress(self) -> bool:
        """Whether an attempt of this fingerprint was started and not completed."""
        return self.attempt.is_dir()

    def begin(self) -> bool:
        """Create the attempt folder; returns whether it already existed (an attempt to continue)."""
        existed = self.in_progress()
        self.attempt.mkdir(parents=True, exist_ok=True)
        return existed

    def checkpoint_path(self, seed: int) -> Path:
        return self.attempt / f"seed_{seed}.pt"

    def record_path(self, seed: int) -> Path:
        return self.attempt / f"seed_{seed}.done.pt"

    def save_record(self, seed: int, record: Dict[str, Any]) -> None:
        """Write the completion record of ``seed`` durably (then its checkpoint may go)."""
        durable.save({"version": RECORD_VERSION, "seed": int(seed), **record}, self.record_path(seed),
                     keep_previous=False)

    def load_record(self, seed: int) -> Optional[Dict[str, Any]]:
        """The completion record of ``seed``, or None (none yet, or unreadable: moved aside with a warning)."""

        def problem(rec: Any) -> Optional[str]:
            if not isinstance(rec, dict) or rec.get("version") != RECORD_VERSION:
                return "not a completion record of this version"
            if rec.get("seed") != int(seed) or rec.get("status") not in ("ok", "failed"):
                return "not this seed's completion record"
            return None

        return durable.load(self.record_path(seed), problem)

    def completed(self, seeds: List[int]) -> Optional[Dict[str, Any]]:
        """The published summary (:func:`read_results`) if ``results/<name>`` holds a finished attempt of
        this fingerprint and these seeds, with every file it published (:meth:`missing_outputs`), and no attempt is in
        progress; else None."""
        if self.in_progress():
            return None
        m = read_results(self.out)
        if (m is not None and m.get("fingerprint") == self.fingerprint
                and sorted(m.get("seeds_run") or []) == sorted(int(s) for s in seeds)
                and not self.missing_outputs(m)):
            return m
        return None

    def missing_outputs(self, summary: Dict[str, Any]) -> List[str]:
        """The files of a finished attempt that ``results/<name>`` lacks (relative paths): a clone of the project
        holds the ones git tracks, not the models and details DVC keeps in its cache, and must train again."""
        seeds_run = [int(s) for s in summary.get("seeds_run") or []]
        ok = [int(s) for s in summary.get("seeds") or []]
        need = [METRICS_FILE, EXPERIMENT_FILE, "runs.csv", "rounds.csv", "config.yaml", "partition/stats.json",
                *(f"details/seed_{s}.csv" for s in seeds_run),
                *((f"models/seed_{s}.pt" for s in ok) if ok else ["models/README.txt"])]
        return [rel for rel in need if not (self.out / rel).is_file()]

    # ------------------------------------------------------------------ outputs
    def begin_staging(self) -> Path:
        """An empty staging folder for this start's outputs."""
        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        return self.staging

    def publish(self) -> None:
        """Move the staged outputs into ``results/<name>`` (the previous set is removed only once
        the new one is in place). Fault point ``outputs_swap`` sits between the two renames."""
        if self.out.exists():
            os.replace(self.out, self.old)
            faults.point("outputs_swap")
        os.replace(self.staging, self.out)
        durable.fsync_dir(self.results_dir)
        if self.old.exists():
            shutil.rmtree(self.old)

    def finish(self) -> None:
        """Remove the attempt folder (records and checkpoints): renamed away first, then deleted."""
        if not self.attempt.exists():
            return
        trash = self.attempt.with_name(f"{self.fingerprint}.{os.getpid()}.removed")
        os.replace(self.attempt, trash)
        durable.fsync_dir(trash.parent)
        shutil.rmtree(trash, ignore_errors=True)
        try:
            trash.parent.rmdir()  # C/<name>/ if nothing else (another fingerprint's attempt) is there
        except OSError:
            pass


def _write_holder(lock_path: Path) -> None:
    info = {**procs.identity(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    Path(str(lock_path) + ".holder").write_text(json.dumps(info))


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(Path(str(lock_path) + ".holder").read_text())
        return (f"pid {info['fl.pid']} on {info['fl.host']}, started {info['started']}: "
                f"{info['command'][:200]}")
    except (OSError, ValueError, KeyError):
        return f"lock {lock_path}"
