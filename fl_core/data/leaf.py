"""Naturally federated data read from the files researchers already have: FEMNIST by writer (``dataset=femnist``)
and Shakespeare by speaker (``dataset=shakespeare``); docs/algorithms.md, Natural federated data.

Two published formats are read, from ``dataset.root``:

- LEAF's JSON files (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018), as LEAF's preprocessing
  writes them: ``<root>/femnist/data/train/*.json`` and ``<root>/femnist/data/test/*.json`` (likewise
  ``<root>/shakespeare/data/...``). Every file holds ``users`` (writer ids), ``num_samples`` (one count per user) and
  ``user_data[user] = {"x": [...], "y": [...]}``. FEMNIST: ``x`` rows of 784 floats in [0, 1] (a 28x28 image, row
  by row; LEAF writes k/255), ``y`` labels 0..61 (digits 0-9, upper-case A-Z 10-35, lower-case a-z 36-61).
  Shakespeare: ``x`` strings of 80 characters, ``y`` the next character.
- TensorFlow Federated's h5 files: ``<root>/fed_emnist_train.h5`` and ``<root>/fed_emnist_test.h5``
  (``examples/<client>/pixels`` float32 ``[n, 28, 28]`` in [0, 1], ``examples/<client>/label`` ``[n]``, labels as
  LEAF's), ``<root>/shakespeare_train.h5`` and ``<root>/shakespeare_test.h5`` (``examples/<client>/snippets``: byte
  strings, each a contiguous run of a speaker's lines). A speaker's snippets become LEAF's examples as LEAF makes
  them from a speaker's text (``preprocess_shakespeare.py`` writes each of a speaker's passages followed by a line
  break; ``shake_utils``): the snippets each followed by a line break, line breaks as spaces and runs of two or more
  spaces as one, then every window of 80 characters (step 1) with the next one as its label.
  Characters outside LEAF's vocabulary (TFF's snippets hold a few, e.g. ``$``) become a space; their count is
  recorded in the dataset's provenance.

Where both are present the LEAF JSON is read. A writer (speaker) is one device: ``FLDataset.devices`` holds it per
training sample and ``partition=natural`` makes each one a client. Writers are ordered by id; a writer without
training samples (after ``dataset.subset``) is dropped. ``dataset.max_clients`` keeps that many writers, drawn
without replacement with ``dataset.split_seed`` (:func:`fl_core.seeding.numpy_rng`), in id order.

The test set is the union of the kept writers' own test samples when the test files hold the training writers (a
split by sample, as LEAF's ``-t sample`` and TFF's); when they hold other writers (LEAF's ``-t user``), it is every
test sample. Accuracy over that union is the sample-weighted mean of the writers' accuracies, what LEAF and FedProx
report.

Stored as uint8: FEMNIST images ``[N, 1, 28, 28]`` as round(255 x) (lossless for k/255), mean/std measured on the
kept training images (:func:`~fl_core.data.reading.channel_stats`); Shakespeare sequences ``[N, 1, 1, 80]`` of
character indices with scale 1, mean 0, std 1, so :meth:`FLDataset.normalize` only casts them to float (the
``char_lstm`` model embeds them). No file is downloaded unless ``dataset.download=true``, which fetches TFF's
published archives (:data:`TFF_ARCHIVES`) where a machine has a network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from fl_core import progress
from fl_core.seeding import numpy_rng

from .dataset import DataSourceError, FLDataset
from .reading import channel_stats, one_line

__all__ = ["VOCAB", "SEQ_LEN", "TFF_FILES", "TFF_ARCHIVES", "femnist_dataset", "shakespeare_dataset", "detect_format",
           "expected_layout", "encode_text", "text_examples", "download", "files_read"]

#: LEAF's Shakespeare vocabulary (``models/utils/language_utils.py``, ``ALL_LETTERS``): 80 characters; a character's
#: index is its class
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80  # characters in, the next one out (LEAF, FedProx)
_PIXELS = 784
_FEMNIST_CLASSES = 62
# dataset.subset -> the label range kept, relabelled 0..hi-lo-1; lowercase_a_j: FedProx's FEMNIST classes ('a'-'j',
# Li et al. 2020, Appendix C.1)
_SUBSETS = {"all": (0, 62), "digits": (0, 10), "lowercase": (36, 62), "lowercase_a_j": (36, 46)}
#: TFF's h5 files and the archives they are published in (``dataset.download=true``)
TFF_FILES = {"femnist": ("fed_emnist_train.h5", "fed_emnist_test.h5"),
             "shakespeare": ("shakespeare_train.h5", "shakespeare_test.h5")}
TFF_ARCHIVES = {"femnist": "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2",
                "shakespeare": "https://storage.googleapis.com/tff-datasets-public/shakespeare.tar.bz2"}
_LEAF_URL = "https://github.com/TalwalkarLab/leaf"

_LUT = np.full(256, 255, dtype=np.uint8)  # byte -> vocabulary index; 255: not in the vocabulary
for _i, _c in enumerate(VOCAB):
    _LUT[ord(_c)] = _i
_SPACE = VOCAB.index(" ")


def expected_layout(name: str, root: Path) -> str:
    """One line saying which files to put where for ``dataset=<name>`` and where they are published."""
    train, test = TFF_FILES[name]
    return (f"put LEAF's JSON files in {root / name / 'data' / 'train'}/*.json and {root / name / 'data' / 'test'}/"
            f"*.json (LEAF's preprocessing, {_LEAF_URL}, data/{name}/preprocess.sh) or TensorFlow Federated's "
            f"{root / train} and {root / test} (from {TFF_ARCHIVES[name]}; or set dataset.download=true)")


def detect_format(name: str, root: Path) -> Optional[str]:
    """``"leaf"`` when ``<root>/<name>/data/train`` is a folder, else ``"tff"`` when TFF's training h5 file exists,
    else None."""
    root = Path(root)
    if (root / name / "data" / "train").is_dir():
        return "leaf"
    if (root / TFF_FILES[name][0]).exists():
        return "tff"
    return None


def files_read(name: str, root: Path) -> Optional[dict]:
    """What a prepared copy of ``name`` depends on besides the config: the format read and, for every file it reads,
    its path relative to ``root``, size and modification time (ns); None when there are no files. The prepared
    file's signature holds it (with ``root``), so new or replaced files (LEAF's preprocessing run again with other
    flags, another ``dataset.root``) are read again instead of a stale copy being used."""
    root = Path(root)
    fmt = detect_format(name, root)
    if fmt is None:
        return None
    if fmt == "leaf":
        paths = [p for split in ("train", "test") for p in sorted((root / name / "data" / split).glob("*.json"))]
    else:
        paths = [root / f for f in TFF_FILES[name] if (root / f).exists()]
    listing = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:  # unreadable: the reader names it
            continue
        listing.append([str(p.relative_to(root)), int(st.st_size), int(st.st_mtime_ns)])
    return {"format": fmt, "files": listing}


# --------------------------------------------------------------------------- reading the files


def _one_line(err: BaseException) -> str:
    """The first line of ``err``'s message, printable, at most 200 characters (the other sources' messages)."""
    return one_line(err, with_type=False)


def _leaf_files(folder: Path, name: str, root: Path) -> List[Path]:
    if not folder.is_dir():
        raise DataSourceError(f"dataset.root: {folder} is missing; {expected_layout(name, root)}")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DataSourceError(f"dataset.root: {folder} holds no .json file; {expected_layout(name, root)}")
    return files


def _leaf_users(path: Path, name: str) -> Iterator[Tuple[str, list, list]]:
    """(user, x, y) of every user of one LEAF JSON file, checked against its ``users`` and ``num_samples``."""
    try:
        with open(path, "rb") as f:
            blob = json.loads(f.read())
    except OSError as err:
        raise DataSourceError(f"dataset.root: cannot read {path} ({type(err).__name__}: {err.strerror})") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise DataSourceError(f"dataset.root: {path} is not a LEAF JSON file (truncated or corrupt: "
                              f"{_one_line(err)}); replace it with the file LEAF's preprocessing writes") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("users"), list) or not isinstance(blob.get("user_data"),
                                                                                                 dict):
        raise DataSourceError(f"dataset.root: {path} is not a LEAF {name} file (it needs 'users' and 'user_data')")
    counts = blob.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(blob["users"])):
        raise DataSourceError(f"dataset.root: {path}: 'num_samples' must hold one count per user "
                              f"({len(blob['users'])})")
    for k, user in enumerate(blob["users"]):
        data = blob["user_data"].get(user)
        if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
            raise DataSourceError(f"dataset.root: {path}: user {user!r} has no 'x' and 'y' lists in 'user_data'")
        x, y = data["x"], data["y"]
        if len(x) != len(y) or (counts is not None and counts[k] != len(y)):
            shown = "" if counts is None else f", num_samples {counts[k]}"
            raise DataSourceError(f"dataset.root: {path}: user {user!r} has {len(x)} x and {len(y)} y{shown}; "
                                  f"the file is truncated or corrupt")
        yield str(user), x, y


def _read_leaf(name: str, root: Path, split: str, convert: Callable[[list, list, str], Tuple[np.ndarray, np.ndarray]]
               ) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """user -> (x, y) arrays over the LEAF JSON files of one split: each file's users are converted by
    ``convert(x, y, where)`` as the file is read (so only one file's Python lists are held at a time), and a user
    found in several files gets its arrays concatenated in file order."""
    folder = root / name / "data" / split
    parts: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {}
    files = _leaf_files(folder, name, root)
    bar = progress.bar(total=len(files), desc=f"LEAF {name} {split}", unit="file", leave=False,
                       enabled=len(files) > 1)
    for path in files:
        for user, x, y in _leaf_users(path, name):
            parts.setdefault(user, []).append(convert(x, y, f"{path} (user {user!r})"))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return {u: (np.concatenate([a for a, _ in p]), np.concatenate([b for _, b in p])) for u, p in parts.items()}


def _h5(path: Path, name: str, root: Path):
    """An open h5py file of TFF's layout (``examples/<client>/...``).

    Raises:
        DataSourceError: missing (naming the layout expected under ``root``), unreadable, truncated or not an HDF5
            file, or without the ``examples`` group.
    """
    import h5py

    if not path.is_file():
        raise DataSourceError(f"dataset.root: {path} is missing; {expected_layout(name, root)}")
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise DataSourceError(f"dataset.root: {path} is not a readable HDF5 file (truncated or corrupt: "
                              f"{_one_line(err)}); replace it with TensorFlow Federated's file") from None
    if "examples" not in f:
        f.close()
        raise DataSourceError(f"dataset.root: {path} has no 'examples' group (expected TensorFlow Federated's "
                              f"layout examples/<client>/...)")
    return f


def _read_tff(name: str, root: Path, split: int, fields: Tuple[str, ...], convert: Callable[..., Any]
              ) -> Dict[str, Any]:
    """client -> ``convert(*arrays of fields, where)`` for every client of TFF's h5 file of one split (0: train,
    1: test), converted as it is read (one client's float arrays held at a time)."""
    path = root / TFF_FILES[name][split]
    f = _h5(path, name, root)
    out: Dict[str, Any] = {}
    with f:
        clients = sorted(f["examples"].keys())
        bar = progress.bar(total=len(clients), desc=f"TFF {name} {'train' if split == 0 else 'test'}",
                           unit="client", leave=False, enabled=len(clients) > 100)
        for client in clients:
            group = f["examples"][client]
            try:
                arrays = tuple(np.asarray(group[k][()]) for k in fields)
            except KeyError as err:
                raise DataSourceError(f"dataset.root: {path}: client {client!r} lacks {_one_line(err)} (expected "
                                      f"examples/<client>/{' and '.join(fields)})") from None
            except OSError as err:  # a truncated dataset inside a readable file
                raise DataSourceError(f"dataset.root: {path}: client {client!r} cannot be read (truncated or corrupt:"
                                      f" {_one_line(err)})") from None
            out[client] = convert(*arrays, f"{path} (client {client!r})")
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
    return out


# --------------------------------------------------------------------------- writers and splits


def _split_files(name: str, root: Path, fmt: str) -> Tuple[Path, Path]:
    """The training and the test files (LEAF: folders) of ``name`` in format ``fmt``, for messages."""
    if fmt == "leaf":
        return root / name / "data" / "train", root / name / "data" / "test"
    return root / TFF_FILES[name][0], root / TFF_FILES[name][1]


def _keep(users: List[str], cfg: Any, name: str, where: Path) -> List[str]:
    """The writers kept: all, or ``dataset.max_clients`` of them drawn with ``dataset.split_seed``, in id order."""
    m = getattr(cfg, "max_clients", None)
    if m is None:
        return users
    if int(m) > len(users):
        who = "writers" if name == "femnist" else "speakers"
        raise DataSourceError(f"dataset.max_clients={int(m)} exceeds the {len(users)} {who} with training samples "
                              f"in {where}")
    pick = numpy_rng("natural-clients", name, int(cfg.split_seed)).choice(len(users), size=int(m), replace=False)
    return [users[i] for i in sorted(pick.tolist())]


def _assemble(name: str, cfg: Any, train: Dict[str, Tuple[np.ndarray, np.ndarray]],
              test: Dict[str, Tuple[np.ndarray, np.ndarray]], where: Tuple[Path, Path]) -> Tuple[np.ndarray, ...]:
    """(x_train, y_train, devices, x_test, y_test) from per-writer arrays: writers in id order, empty ones dropped,
    ``dataset.max_clients`` applied, the test set as the module docstring says (a split by sample when any training
    writer is among the test files' writers, decided before the writers are drawn). ``where``: the training and the
    test files, for the messages."""
    users = sorted(u for u, (_, y) in train.items() if len(y))
    subset = f" of dataset.subset={cfg.subset}" if name == "femnist" and cfg.subset != "all" else ""
    if not users:
        raise DataSourceError(f"dataset.root: {where[0]} holds no training sample{subset}")
    by_sample = any(u in test for u in users)
    users = _keep(users, cfg, name, where[0])
    test_users = [u for u in users if u in test] if by_sample else sorted(test)
    xs = [train[u][0] for u in users]
    ys = [train[u][1] for u in users]
    devices = np.repeat(np.arange(len(users), dtype=np.int64), [len(y) for y in ys])
    tx = [test[u][0] for u in test_users if len(test[u][1])]
    ty = [test[u][1] for u in test_users if len(test[u][1])]
    if not ty:
        whose = "of the kept writers" if by_sample else ""
        raise DataSourceError(f"dataset.root: {where[1]} holds no test sample{subset} {whose}".rstrip())
    return np.concatenate(xs), np.concatenate(ys), devices, np.concatenate(tx), np.concatenate(ty)


# --------------------------------------------------------------------------- FEMNIST


def _femnist_arrays(x: Any, y: Any, where: str, subset: str) -> Tuple[np.ndarray, np.ndarray]:
    """uint8 [n, 1, 28, 28] images and int64 labels of one writer, ``subset``'s classes only (relabelled 0..)."""
    try:
        xa = np.asarray(x, dtype=np.float32)
        ya = np.asarray(y)
    except (ValueError, TypeError):
        raise DataSourceError(f"dataset.root: {where}: x is not rows of {_PIXELS} numbers") from None
    n = len(ya)
    if n == 0 and xa.size == 0:  # a user without samples (dropped later)
        return np.zeros((0, 1, 28, 28), np.uint8), np.zeros(0, np.int64)
    if xa.shape not in ((n, _PIXELS), (n, 28, 28)) or ya.ndim != 1:
        raise DataSourceError(f"dataset.root: {where}: x has shape {list(xa.shape)} for {n} labels, expected "
                              f"[{n}, {_PIXELS}] or [{n}, 28, 28]")
    if n and not (np.isfinite(xa).all() and xa.min() >= 0 and xa.max() <= 1):
        raise DataSourceError(f"dataset.root: {where}: pixel values must lie in [0, 1]")
    if n and (not np.issubdtype(ya.dtype, np.integer) and not np.all(np.mod(ya, 1) == 0)):
        raise DataSourceError(f"dataset.root: {where}: labels must be integers")
    ya = ya.astype(np.int64)
    if n and (ya.min() < 0 or ya.max() >= _FEMNIST_CLASSES):
        raise DataSourceError(f"dataset.root: {where}: labels must lie in 0..61, got {int(ya.min())}..{int(ya.max())}")
    lo, hi = _SUBSETS[subset]
    keep = (ya >= lo) & (ya < hi)
    images = np.rint(xa[keep].reshape(-1, 1, 28, 28) * 255.0).astype(np.uint8)
    return images, ya[keep] - lo


def femnist_dataset(cfg: Any, root: Path) -> FLDataset:
    """FEMNIST by writer from LEAF's JSON or TFF's h5 files under ``root`` (the module docstring).

    Returns:
        uint8 ``[N, 1, 28, 28]`` images, int64 labels in ``[0, C)`` (C = 62, or 10 for ``dataset.subset=digits``, 26
        for ``lowercase``, 10 for ``lowercase_a_j``), ``devices`` int64 ``[N]`` (the writer of every training image), mean/std of the training
        images; ``provenance`` names the format and the writer count.

    Raises:
        DataSourceError: no files in either layout (one line naming what to put where), a file missing, unreadable,
            truncated or of the wrong shape (names the file and, where one is to blame, the writer), labels outside
            0..61, ``dataset.max_clients`` above the writers there are.
    """
    root = Path(root)
    fmt = detect_format("femnist", root)
    if fmt is None:
        raise DataSourceError(f"dataset.root: no FEMNIST files under {root}; {expected_layout('femnist', root)}")
    subset = str(cfg.subset)
    splits = []
    for split, index in (("train", 0), ("test", 1)):
        convert = lambda x, y, where: _femnist_arrays(x, y, where, subset)  # noqa: E731
        splits.append(_read_leaf("femnist", root, split, convert) if fmt == "leaf"
                      else _read_tff("femnist", root, index, ("pixels", "label"), convert))
    x_tr, y_tr, devices, x_te, y_te = _assemble("femnist", cfg, *splits, _split_files("femnist", root, fmt))
    lo, hi = _SUBSETS[subset]
    x_train = torch.from_numpy(np.ascontiguousarray(x_tr))
    mean, std = channel_stats(x_train, 255.0)
    return FLDataset(name="femnist", x_train=x_train, y_train=torch.from_numpy(y_tr),
                     x_test=torch.from_numpy(np.ascontiguousarray(x_te)), y_test=torch.from_numpy(y_te),
                     num_classes=hi - lo, scale=255.0, mean=mean, std=std, devices=torch.from_numpy(devices),
                     provenance={"format": fmt, "writers": int(devices.max()) + 1})


# --------------------------------------------------------------------------- Shakespeare


def encode_text(text: str) -> Tuple[np.ndarray, int]:
    """uint8 vocabulary indices of ``text`` and how many of its characters are not in :data:`VOCAB` (each of those
    becomes a space; a character beyond one byte counts once)."""
    codes = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if codes.size and codes.max() >= 0x80:  # multi-byte characters: one index each
        idx = np.array([_LUT[ord(c)] if ord(c) < 256 else 255 for c in text], dtype=np.uint8)
    else:
        idx = _LUT[codes]
    bad = idx == 255
    out = idx.copy()
    out[bad] = _SPACE
    return out, int(bad.sum())


def text_examples(text: str) -> Tuple[np.ndarray, np.ndarray, int]:
    """LEAF's examples of one speaker's text (LEAF ``data/shakespeare/preprocess/shake_utils.py``): line breaks
    become spaces and runs of two or more spaces one space (after characters outside the vocabulary became spaces),
    then every window of :data:`SEQ_LEN` characters (step 1) with the next character as its label.

    Returns:
        (uint8 ``[n, 80]`` indices, int64 ``[n]`` labels, characters not in the vocabulary replaced by a space);
        n = max(0, len - 80).
    """
    codes, bad = encode_text(text.replace("\n", " "))  # characters outside the vocabulary -> spaces, then:
    space = codes == _SPACE
    codes = codes[~(space & np.concatenate(([False], space[:-1])))]  # runs of two or more spaces -> one
    if codes.size <= SEQ_LEN:
        return np.zeros((0, SEQ_LEN), np.uint8), np.zeros(0, np.int64), bad
    windows = np.lib.stride_tricks.sliding_window_view(codes, SEQ_LEN + 1)
    return np.ascontiguousarray(windows[:, :SEQ_LEN]), windows[:, SEQ_LEN].astype(np.int64), bad


def _leaf_text_arrays(x: list, y: list, where: str) -> Tuple[np.ndarray, np.ndarray]:
    """LEAF's Shakespeare x (80-character strings) and y (one character each) as indices; a character outside the
    vocabulary, or a string of another length, is refused (LEAF's files hold none)."""
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in x):
        bad = next(s for s in x if not (isinstance(s, str) and len(s) == SEQ_LEN))
        shown = f"a string of {len(bad)} characters" if isinstance(bad, str) else type(bad).__name__
        raise DataSourceError(f"dataset.root: {where}: x must hold strings of {SEQ_LEN} characters, found {shown}")
    if not all(isinstance(s, str) and len(s) == 1 for s in y):
        raise DataSourceError(f"dataset.root: {where}: y must hold single characters")
    codes, bad = encode_text("".join(x) + "".join(y))
    if bad:
        text = "".join(x) + "".join(y)
        c = next(ch for ch in text if ord(ch) >= 256 or _LUT[ord(ch)] == 255)
        raise DataSourceError(f"dataset.root: {where}: the character {c!r} is not in LEAF's 80-character vocabulary")
    n = len(y)
    return codes[: n * SEQ_LEN].reshape(n, SEQ_LEN), codes[n * SEQ_LEN:].astype(np.int64)


def shakespeare_dataset(cfg: Any, root: Path) -> FLDataset:
    """Shakespeare by speaker from LEAF's JSON or TFF's h5 files under ``root`` (the module docstring).

    Returns:
        uint8 ``[N, 1, 1, 80]`` character indices, int64 next-character labels in ``[0, 80)``, 80 classes,
        ``devices`` (the speaker of every training example), scale 1, mean 0, std 1; ``provenance`` names the format,
        the speaker count and (TFF) how many characters outside the vocabulary became spaces.

    Raises:
        DataSourceError: as :func:`femnist_dataset`; a LEAF string that is not 80 characters or holds a character
            outside the vocabulary (names the file and the speaker).
    """
    root = Path(root)
    fmt = detect_format("shakespeare", root)
    if fmt is None:
        raise DataSourceError(f"dataset.root: no Shakespeare files under {root}; "
                              f"{expected_layout('shakespeare', root)}")
    replaced = [0]

    def snippets_examples(snippets: np.ndarray, where: str) -> Tuple[np.ndarray, np.ndarray]:
        try:
            texts = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in np.asarray(snippets).reshape(-1)]
        except UnicodeDecodeError:
            raise DataSourceError(f"dataset.root: {where}: a snippet is not UTF-8 text") from None
        x, y, bad = text_examples("".join(t + "\n" for t in texts))  # as LEAF writes a speaker's lines
        replaced[0] += bad
        return x, y

    splits = []
    for split, index in (("train", 0), ("test", 1)):
        splits.append(_read_leaf("shakespeare", root, split, _leaf_text_arrays) if fmt == "leaf"
                      else _read_tff("shakespeare", root, index, ("snippets",), snippets_examples))
    x_tr, y_tr, devices, x_te, y_te = _assemble("shakespeare", cfg, *splits, _split_files("shakespeare", root, fmt))
    prov = {"format": fmt, "speakers": int(devices.max()) + 1}
    if fmt == "tff":
        prov["replaced_characters"] = replaced[0]
    seq = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(-1, 1, 1, SEQ_LEN)))  # noqa: E731
    return FLDataset(name="shakespeare", x_train=seq(x_tr), y_train=torch.from_numpy(y_tr), x_test=seq(x_te),
                     y_test=torch.from_numpy(y_te), num_classes=len(VOCAB), scale=1.0, mean=(0.0,), std=(1.0,),
                     devices=torch.from_numpy(devices), provenance=prov)


def download(name: str, root: Path) -> None:
    """Fetch and unpack TFF's archive of ``name`` into ``root`` (``dataset.download=true``; torchvision's
    downloader). Does nothing when files of either format are there (LEAF's folder, or both TFF files)."""
    from fl_core.compat import torchvision

    if detect_format(name, root) == "leaf" or all((Path(root) / f).is_file() for f in TFF_FILES[name]):
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    torchvision().datasets.utils.download_and_extract_archive(TFF_ARCHIVES[name], download_root=str(root))

