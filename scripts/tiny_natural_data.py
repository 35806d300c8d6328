"""Write tiny FEMNIST and Shakespeare files in the published formats (LEAF's JSON, TensorFlow Federated's h5), to try
``dataset=femnist`` / ``dataset=shakespeare`` without the real data (README.md, Naturally federated data); the tests use
the same writers.

    python scripts/tiny_natural_data.py DIR             # LEAF JSON under DIR/femnist/data, DIR/shakespeare/data
    python scripts/tiny_natural_data.py DIR --format tff  # DIR/fed_emnist_{train,test}.h5, shakespeare_{train,test}.h5

The images are random pixels with random labels and the text is random characters of LEAF's vocabulary: the files
have the real layouts, not the real content. Nothing already under DIR is overwritten: an existing target file stops
the script with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np

# LEAF's vocabulary (also fl_core.data.leaf.VOCAB; repeated so that this script runs without the project installed)
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SPEAKERS = ("ALL_S_WELL_THAT_ENDS_WELL_BERTRAM", "HAMLET_HAMLET", "KING_LEAR_CORDELIA", "MACBETH_LADY_MACBETH",
            "OTHELLO_IAGO", "ROMEO_AND_JULIET_JULIET")


def _writer_ids(n: int) -> list:
    return [f"f{k // 100:04d}_{k % 100:02d}" for k in range(n)]  # LEAF's FEMNIST writer ids look like f0000_14


def femnist_samples(writers: int = 6, train: Sequence[int] = (), test: int = 2, seed: int = 0
                    ) -> Tuple[Dict[str, tuple], Dict[str, tuple]]:
    """writer -> (pixels float32 [n, 28, 28] of k/255 with 1 as the white background, labels int [n] in 0..61) for
    the training and the test split. ``train``: samples per writer (default 4 + writer index, so sizes differ)."""
    rng = np.random.default_rng(seed)
    ids = _writer_ids(writers)
    sizes = list(train) or [4 + k for k in range(writers)]
    out = []
    for split_sizes in (sizes, [test] * writers):
        split = {}
        for w, n in zip(ids, split_sizes):
            ink = rng.integers(0, 256, (n, 28, 28))
            split[w] = ((255 - ink) / 255.0).astype(np.float32), rng.integers(0, 62, n)
        out.append(split)
    return out[0], out[1]


def shakespeare_texts(speakers: int = 4, chars: Sequence[int] = (), seed: int = 0
                      ) -> Tuple[Dict[str, list], Dict[str, list]]:
    """speaker -> list of snippets (random characters of the vocabulary, line breaks and double spaces included) for
    the training and the test split. ``chars``: characters of a speaker's training text, in two snippets (default
    200 + 20 k)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(VOCAB))
    ids = SPEAKERS[:speakers]
    sizes = list(chars) or [200 + 20 * k for k in range(speakers)]

    def text(n: int) -> str:
        return "".join(rng.choice(letters, n))

    train = {s: [text(n // 2), text(n - n // 2)] for s, n in zip(ids, sizes)}
    test = {s: [text(84)] for s in ids}  # 4 test examples each
    return train, test


def _leaf_examples(snippets: list) -> Tuple[list, list]:
    """LEAF's examples of one speaker: the speaker's text (each snippet followed by a line break, as LEAF writes a
    speaker's passages), line breaks as spaces, runs of two or more spaces as one, every 80-character window and the
    next character (as LEAF's preprocessing writes them into its JSON)."""
    import re

    clean = re.sub(r" {2,}", " ", "".join(s + "\n" for s in snippets).replace("\n", " "))
    return [clean[i:i + 80] for i in range(len(clean) - 80)], [clean[i + 80] for i in range(len(clean) - 80)]


def _fresh(path: Path) -> Path:
    if path.exists():
        raise SystemExit(f"error: {path} exists; choose an empty folder (nothing is overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_leaf_femnist(root: Path, train: Dict[str, tuple], test: Dict[str, tuple], files: int = 2) -> None:
    """LEAF's layout: root/femnist/data/{train,test}/all_data_<i>_niid_0_keep_0_{train,test}_9.json, the writers
    spread over ``files`` files; x rows of 784 floats, y labels."""
    for split, data in (("train", train), ("test", test)):
        writers = sorted(data)
        for i in range(files):
            mine = writers[i::files]
            blob = {"users": mine, "num_samples": [len(data[w][1]) for w in mine],
                    "user_data": {w: {"x": data[w][0].reshape(len(data[w][1]), -1).tolist(),
                                      "y": [int(v) for v in data[w][1]]} for w in mine}}
            name = f"all_data_{i}_niid_0_keep_0_{split}_9.json"
            _fresh(Path(root) / "femnist" / "data" / split / name).write_text(json.dumps(blob))


def write_tff_femnist(root: Path, train: Dict[str, tuple], test: Dict[str, tuple]) -> None:
    """TFF's layout: root/fed_emnist_{train,test}.h5 with examples/<writer>/pixels [n, 28, 28] float32 and label [n]
    int32."""
    import h5py

    for split, data in (("train", train), ("test", test)):
        with h5py.File(_fresh(Path(root) / f"fed_emnist_{split}.h5"), "w") as f:
            for w in sorted(data):
                g = f.create_group(f"examples/{w}")
                g.create_dataset("pixels", data=data[w][0].astype(np.float32))
                g.create_dataset("label", data=np.asarray(data[w][1], dtype=np.int32))


def write_leaf_shakespeare(root: Path, train: Dict[str, list], test: Dict[str, list]) -> None:
    """LEAF's layout: root/shakespeare/data/{train,test}/all_data_niid_0_keep_0_{train,test}_9.json; x 80-character
    strings, y the next character."""
    for split, data in (("train", train), ("test", test)):
        users = sorted(data)
        blob = {"users": users, "num_samples": [], "user_data": {}}
        for u in users:
            x, y = _leaf_examples(data[u])
            blob["num_samples"].append(len(y))
            blob["user_data"][u] = {"x": x, "y": y}
        name = f"all_data_niid_0_keep_0_{split}_9.json"
        _fresh(Path(root) / "shakespeare" / "data" / split / name).write_text(json.dumps(blob))


def write_tff_shakespeare(root: Path, train: Dict[str, list], test: Dict[str, list]) -> None:
    """TFF's layout: root/shakespeare_{train,test}.h5 with examples/<speaker>/snippets, UTF-8 byte strings."""
    import h5py

    for split, data in (("train", train), ("test", test)):
        with h5py.File(_fresh(Path(root) / f"shakespeare_{split}.h5"), "w") as f:
            for s in sorted(data):
                f.create_dataset(f"examples/{s}/snippets", data=np.array([t.encode("utf-8") for t in data[s]],
                                                                        dtype=object), dtype=h5py.string_dtype())


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="the folder to write into (dataset.root)")
    parser.add_argument("--format", choices=("leaf", "tff"), default="leaf", help="LEAF JSON (default) or TFF h5")
    parser.add_argument("--writers", type=int, default=6, help="FEMNIST writers (default 6)")
    parser.add_argument("--speakers", type=int, default=4, help="Shakespeare speakers (default 4, at most 6)")
    args = parser.parse_args(argv)
    if not 1 <= args.speakers <= len(SPEAKERS) or args.writers < 1:
        parser.error(f"--writers must be >= 1 and --speakers in 1..{len(SPEAKERS)}")
    femnist = femnist_samples(args.writers)
    text = shakespeare_texts(args.speakers)
    if args.format == "leaf":
        write_leaf_femnist(args.root, *femnist)
        write_leaf_shakespeare(args.root, *text)
    else:
        write_tff_femnist(args.root, *femnist)
        write_tff_shakespeare(args.root, *text)
    print(f"wrote tiny FEMNIST ({args.writers} writers) and Shakespeare ({args.speakers} speakers) files in the "
          f"{args.format.upper()} layout under {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
