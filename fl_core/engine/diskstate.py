"""Client state on disk: per-client vectors (control variates, gradient memories, previous models, residuals) in
fixed-size files, so that only the round's clients are in memory and a checkpoint writes no client's vector.

``engine.client_state=disk`` (``auto``: when the states of all N clients would exceed
:data:`AUTO_DISK_BYTES`). One file per state key, ``<checkpoint>.states/<key>.bin``, holds for every client
``SLOTS`` rows of the key's shape and dtype; a row is read and written with ``os.pread`` / ``os.pwrite`` (the
page cache holds what is hot, not the process). Which slot holds a client's current value is a table of N
small integers:

- ``put`` writes into a slot that neither of the last two checkpoints references, so the rows a checkpoint
  (or its ``.prev``, which the loader falls back to when the newest file is unreadable) points at are never
  overwritten;
- ``state_dict`` (called by the checkpoint) flushes the files to disk (fsync) and returns only the table and
  the keys' layouts: a consistent version of every client's state, in N bytes, whatever N and d are;
- ``load_state_dict`` takes that table back, so a resumed run reads exactly the states of the checkpointed
  round, whatever was written after it.

A store without a folder of its own (no checkpoint) uses a temporary one, removed with the store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import torch

SLOTS = 3  # the current value plus the two that the last checkpoint and its .prev may reference
AUTO_DISK_BYTES = 4 * 1024 ** 3  # engine.client_state=auto: disk when N clients' states would exceed 4 GiB
DISK_KEY = "__disk_store__"  # marks a checkpoint's client section written by this store

_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.float16: np.float16,
       torch.int32: np.int32, torch.bool: np.bool_}


def choose(setting: str, num_clients: int, bytes_per_client: int) -> Tuple[str, str]:
    """Resolve ``engine.client_state`` (``memory``, ``disk`` or ``auto``) to a store and the reason for it.

    ``auto`` picks ``disk`` when ``num_clients * bytes_per_client`` (the states of every client once each has
    trained) exceeds :data:`AUTO_DISK_BYTES`, else ``memory``."""
    if setting != "auto":
        return setting, f"engine.client_state={setting}"
    total = num_clients * bytes_per_client
    kind = "disk" if total > AUTO_DISK_BYTES else "memory"
    return kind, (f"auto: {num_clients} clients x {bytes_per_client / 2 ** 20:.1f} MiB of state = "
                  f"{total / 2 ** 30:.2f} GiB {'>' if kind == 'disk' else '<='} {AUTO_DISK_BYTES / 2 ** 30:g} GiB")


def client_state_bytes(algo, d: int, dtype: torch.dtype) -> int:
    """Bytes of one client's state as the rule declares it: the tensors of ``algo.init_client_state`` on a [d]
    vector of ``dtype`` (0 for a rule that keeps none).

    It runs on PyTorch's meta device, so nothing of size d is allocated (a vector of a model with 86 M parameters
    is 344 MB); a rule whose ``init_client_state`` cannot run on meta tensors gets a zero vector on the CPU."""
    try:
        init = algo.init_client_state(torch.empty(int(d), dtype=dtype, device="meta"))
    except (NotImplementedError, RuntimeError):
        init = algo.init_client_state(torch.zeros(int(d), dtype=dtype))
    return int(sum(v.numel() * v.element_size() for v in (init or {}).values()))


class DiskClientStateStore:
    """The :class:`~.state.ClientStateStore` interface (``get``, ``put``, ``items``, ``state_dict``,
    ``load_state_dict``) over files in ``folder`` (module docstring).

    Args:
        num_clients: N; client ids are 0..N-1.
        folder: where the key files live (created); None: a temporary folder removed by :meth:`close`.
    """

    def __init__(self, num_clients: int, folder: Optional[Path] = None):
        self.num_clients = int(num_clients)
        self._own = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="fl-states-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.slot = np.full(self.num_clients, -1, dtype=np.int8)  # current slot per client (-1: no state)
        self._committed = [self.slot.copy(), self.slot.copy()]  # tables of the last checkpoint and its .prev
        self._layout: Dict[str, Tuple[Tuple[int, ...], str]] = {}  # key -> (shape, numpy dtype name)
        self._fds: Dict[str, int] = {}

    # ------------------------------------------------------------------ files
    def _row_bytes(self, key: str) -> int:
        shape, dtype = self._layout[key]
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

    def _fd(self, key: str) -> int:
        if key not in self._fds:
            self._fds[key] = os.open(self.folder / f"{key}.bin", os.O_RDWR | os.O_CREAT, 0o644)
        return self._fds[key]

    def _offset(self, key: str, client_id: int, slot: int) -> int:
        return (client_id * SLOTS + slot) * self._row_bytes(key)

    # ------------------------------------------------------------------ the store interface
    def get(self, client_id: int, default_factory) -> Optional[Dict[str, torch.Tensor]]:
        """Client ``client_id``'s state (CPU tensors, a fresh copy), or ``default_factory()`` stored first when it
        has none; None when it has none and the factory gives None."""
        s = int(self.slot[client_id])
        if s < 0:
            init = default_factory()
            if init is None:
                return None
            self.put(client_id, init)
            s = int(self.slot[client_id])
        out = {}
        for key, (shape, dtype) in self._layout.items():
            raw = os.pread(self._fd(key), self._row_bytes(key), self._offset(key, client_id, s))
            out[key] = torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(shape).copy())
        return out

    def put(self, client_id: int, state: Optional[Dict[str, torch.Tensor]]) -> None:
        """Write ``state`` into a slot no recent checkpoint references and make it the client's current one.

        Raises:
            ValueError: a key whose shape or dtype differs from its first state, or a set of keys other than the
                first state's (a rule's client state has a fixed layout).
        """
        if state is None:
            return
        arrays = {k: v.detach().cpu().numpy() for k, v in state.items()}
        if not self._layout:
            self._layout = {k: (tuple(a.shape), a.dtype.name) for k, a in arrays.items()}
        if set(arrays) != set(self._layout):
            raise ValueError(f"client {client_id}: state keys {sorted(arrays)} differ from {sorted(self._layout)}")
        busy = {int(self._committed[0][client_id]), int(self._committed[1][client_id])}
        s = next(i for i in range(SLOTS) if i not in busy)
        for key, a in arrays.items():
            if (tuple(a.shape), a.dtype.name) != self._layout[key]:
                raise ValueError(f"client {client_id}: state {key!r} is {tuple(a.shape)} {a.dtype.name}, expected "
                                 f"{self._layout[key][0]} {self._layout[key][1]}")
            os.pwrite(self._fd(key), np.ascontiguousarray(a).tobytes(), self._offset(key, client_id, s))
        self.slot[client_id] = s

    def items(self) -> Iterable[Tuple[int, Dict[str, torch.Tensor]]]:
        """(client id, state) of every client that holds one (read from disk one at a time)."""
        for cid in np.flatnonzero(self.slot >= 0):
            yield int(cid), self.get(int(cid), lambda: None)

    def __len__(self) -> int:
        return int((self.slot >= 0).sum())

    def state_dict(self) -> dict:
        """For a checkpoint: flush the files (fsync) and return the slot table and the layouts (N bytes + keys);
        from now on the slots it references are kept. Only a tensor [N] int8, str, int and tuples: the weights-only
        loader of :func:`fl_core.store.durable.load` reads it back."""
        for fd in self._fds.values():
            os.fsync(fd)
        self._committed = [self.slot.copy(), self._committed[0]]
        return {DISK_KEY: {"slot": torch.from_numpy(self.slot.copy()), "layout": dict(self._layout),
                           "folder": str(self.folder)}}

    def load_state_dict(self, sd: dict) -> None:
        """Take a checkpoint's table back ({} for a fresh start: every client without a state).

        Raises:
            ValueError: ``sd`` holds in-memory states (a checkpoint of ``engine.client_state=memory``) or a table
                for another number of clients.
        """
        if not sd:
            self.slot[:] = -1
            self._layout = {}
        elif DISK_KEY not in sd:
            raise ValueError("the checkpoint holds client states in memory; resume with engine.client_state=memory")
        else:
            table = sd[DISK_KEY]["slot"].numpy().astype(np.int8)
            if table.shape != (self.num_clients,):
                raise ValueError(f"the checkpoint's client-state table has {table.shape[0]} clients, "
                                 f"this run {self.num_clients}")
            self.slot = table.copy()
            self._layout = {k: (tuple(s), d) for k, (s, d) in sd[DISK_KEY]["layout"].items()}
        self._committed = [self.slot.copy(), self.slot.copy()]

    def close(self) -> None:
        """Close the files (and remove a temporary folder)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)

    def disk_bytes(self) -> int:
        """Bytes the key files occupy on disk (allocated blocks; the files are sparse)."""
        return sum(os.stat(p).st_blocks * 512 for p in self.folder.glob("*.bin"))
