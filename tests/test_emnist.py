"""dataset=emnist (fl_core.data.sources._emnist): torchvision's EMNIST reader on tiny idx files written in the
official format under <root>/EMNIST/raw/, one split at a time (docs/algorithms.md, EMNIST)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_core.config import ConfigError, DatasetConfig, compose
from fl_core.data import sources
from test_sources import _one_line_error
from fl_core.data.sources import DataSourceError, get_dataset, load_source, prepared_path

# split -> (classes, first and last label in the official files)
SPLITS = {"byclass": (62, 0, 61), "bymerge": (47, 0, 46), "balanced": (47, 0, 46), "letters": (26, 1, 26),
          "digits": (10, 0, 9), "mnist": (10, 0, 9)}


def _idx_images(x: np.ndarray) -> bytes:
    return struct.pack(">iiii", 2051, len(x), 28, 28) + x.tobytes()


def _idx_labels(y: np.ndarray) -> bytes:
    return struct.pack(">ii", 2049, len(y)) + y.astype(np.uint8).tobytes()


def emnist_arrays(split: str, n_train: int = 8, n_test: int = 4, seed: int = 3) -> dict:
    """Random stored images ``[n, 28, 28]`` (as in the files: transposed) and labels in the split's stored range,
    every class of the range present in the training set where n_train allows."""
    rng = np.random.default_rng(seed)
    _, lo, hi = SPLITS[split]
    out = {}
    for part, n in (("train", n_train), ("test", n_test)):
        y = (lo + np.arange(n) % (hi - lo + 1)).astype(np.uint8)
        out[part] = (rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.permutation(y))
    return out


def write_emnist(root: Path, split: str = "byclass", arrays: dict | None = None, packed: bool = False) -> dict:
    """The four files torchvision's EMNIST reads for ``split``:
    ``root/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` (``packed``: gzip'd, with
    ``.gz``, as in the official ``gzip.zip``). Returns the stored arrays ``{part: (images, labels)}``."""
    arrays = arrays or emnist_arrays(split)
    raw = root / "EMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for part, (x, y) in arrays.items():
        for kind, data in (("images-idx3-ubyte", _idx_images(x)), ("labels-idx1-ubyte", _idx_labels(y))):
            name = f"emnist-{split}-{part}-{kind}"
            if packed:
                (raw / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (raw / name).write_bytes(data)
    return arrays


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("split", list(SPLITS))
def test_each_split_reads_with_its_classes_and_label_range(tmp_path, split):
    stored = write_emnist(tmp_path, split)
    d = load_source(DatasetConfig(name="emnist", split=split), tmp_path)
    classes, lo, hi = SPLITS[split]
    assert d.name == "emnist" and d.num_classes == classes and d.scale == 255.0 and d.input_shape == (1, 28, 28)
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (8, 1, 28, 28) and d.x_test.shape == (4, 1, 28, 28)
    assert d.y_train.dtype == torch.int64 and d.y_test.dtype == torch.int64
    # labels as stored, letters 1..26 shifted to 0..25
    assert d.y_train.tolist() == (stored["train"][1].astype(np.int64) - lo).tolist()
    assert d.y_test.tolist() == (stored["test"][1].astype(np.int64) - lo).tolist()
    assert 0 <= int(d.y_train.min()) and int(d.y_train.max()) <= classes - 1
    assert len(d.mean) == len(d.std) == 1 and 0.17 < d.mean[0] < 0.18 and 0.33 < d.std[0] < 0.34


def test_letters_use_every_label_0_to_25(tmp_path):
    arrays = emnist_arrays("letters", n_train=26, n_test=26)
    write_emnist(tmp_path, "letters", arrays)
    d = load_source(DatasetConfig(name="emnist", split="letters"), tmp_path)
    assert sorted(d.y_train.tolist()) == list(range(26)) and sorted(d.y_test.tolist()) == list(range(26))
    # torchvision's classes for letters start with "N/A" (label 0, no image): the shift keeps a..z in order
    from fl_core.compat import torchvision

    classes = torchvision().datasets.EMNIST.classes_split_dict["letters"]
    assert classes[0] == "N/A" and classes[1:] == [chr(ord("a") + i) for i in range(26)]


def test_images_are_turned_upright(tmp_path):
    # an upright "L": a vertical stroke in column 6 (rows 4..22) and a horizontal stroke in row 22 (columns 6..20)
    upright = np.zeros((28, 28), np.uint8)
    upright[4:23, 6] = 255
    upright[22, 6:21] = 200
    arrays = emnist_arrays("balanced")
    arrays["train"][0][0] = upright.T  # the official files store the transpose
    write_emnist(tmp_path, "balanced", arrays)
    d = load_source(DatasetConfig(name="emnist", split="balanced"), tmp_path)
    assert torch.equal(d.x_train[0, 0], torch.from_numpy(upright))
    assert int(d.x_train[0, 0, 22, 20]) == 200 and int(d.x_train[0, 0, 20, 22]) == 0
    # every image: x[n, 0, i, j] = stored[n, j, i]
    for part, x in (("train", d.x_train), ("test", d.x_test)):
        assert torch.equal(x[:, 0], torch.from_numpy(arrays[part][0]).transpose(1, 2))
    assert d.x_train.is_contiguous()


def test_only_the_chosen_split_is_read(tmp_path):
    write_emnist(tmp_path, "letters")
    assert load_source(DatasetConfig(name="emnist", split="letters"), tmp_path).num_classes == 26
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="digits"), tmp_path)
    assert _one_line_error(err) == (
        f"dataset.root: EMNIST not found under {tmp_path} (expected EMNIST/raw/ with "
        "emnist-digits-train-images-idx3-ubyte, emnist-digits-train-labels-idx1-ubyte, "
        "emnist-digits-test-images-idx3-ubyte, emnist-digits-test-labels-idx1-ubyte; missing "
        "emnist-digits-train-images-idx3-ubyte, emnist-digits-train-labels-idx1-ubyte, "
        "emnist-digits-test-images-idx3-ubyte, emnist-digits-test-labels-idx1-ubyte; or set dataset.download=true)")


# --------------------------------------------------------------------------- the config key


def test_split_is_a_key_of_emnist_only():
    assert compose(["dataset=emnist"]).dataset.split == "byclass"  # FedBCGD's split
    assert compose(["dataset=emnist", "dataset.split=letters"]).dataset.split == "letters"
    with pytest.raises(ConfigError) as err:
        compose(["dataset=mnist", "dataset.split=letters"])
    assert str(err.value) == ("dataset.split has no effect with dataset.name=mnist: it is used only with "
                              "dataset.name=emnist; remove it")
    with pytest.raises(ConfigError) as err:
        compose(["dataset=emnist", "dataset.split=bytes"])
    assert str(err.value) == "dataset.split must be one of byclass, bymerge, balanced, letters, digits, mnist, got 'bytes'"
    with pytest.raises(DataSourceError, match=r"^dataset\.split must be one of byclass, .*, got 'bytes'$"):
        load_source(DatasetConfig(name="emnist", split="bytes"), Path("."))
    from fl_core.models import resolve_model_name

    assert resolve_model_name("auto", "emnist") == "mcmahan_cnn"


def test_the_split_is_part_of_the_cache_and_the_partition_key(tmp_path, monkeypatch):
    from fl_core.data import dataset_tag, partition_key

    write_emnist(tmp_path / "raw", "byclass")
    write_emnist(tmp_path / "raw", "letters")
    data = tmp_path / "data"
    cfgs = {s: compose(["dataset=emnist", f"dataset.split={s}", f"dataset.root={tmp_path / 'raw'}"]) for s in
            ("byclass", "letters")}
    assert [dataset_tag(c.dataset) for c in cfgs.values()] == ["emnist-byclass", "emnist-letters"]
    assert len({partition_key(c.partition, dataset_tag(c.dataset)) for c in cfgs.values()}) == 2
    assert sources._signature(cfgs["byclass"].dataset) != sources._signature(cfgs["letters"].dataset)
    assert sources.describe_source(cfgs["letters"].dataset) == f"dataset=emnist split=letters root={tmp_path / 'raw'}"

    byclass = get_dataset(cfgs["byclass"].dataset, data, tmp_path)
    letters = get_dataset(cfgs["letters"].dataset, data, tmp_path)
    assert (byclass.num_classes, letters.num_classes) == (62, 26)
    assert sorted(p.name for p in (data / "prepared").iterdir()) == ["emnist-byclass.pt", "emnist-letters.pt"]
    assert prepared_path(cfgs["letters"].dataset, data) == data / "prepared" / "emnist-letters.pt"

    def boom(*a, **k):
        raise AssertionError("load_source called although the prepared file exists")

    monkeypatch.setattr(sources, "load_source", boom)
    cached = get_dataset(cfgs["byclass"].dataset, data, tmp_path)
    assert torch.equal(cached.x_train, byclass.x_train) and cached.y_train.tolist() == byclass.y_train.tolist()
    assert cached.num_classes == 62 and cached.mean == byclass.mean
    # a cache file built from another split is not served under this split's name
    (data / "prepared" / "emnist-letters.pt").write_bytes((data / "prepared" / "emnist-byclass.pt").read_bytes())
    monkeypatch.undo()
    again = get_dataset(cfgs["letters"].dataset, data, tmp_path)
    assert again.num_classes == 26 and again.y_train.tolist() == letters.y_train.tolist()


# --------------------------------------------------------------------------- one-line errors


def test_missing_root_and_missing_file_are_named(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist"), root)
    msg = _one_line_error(err)
    assert msg.startswith(f"dataset.root: EMNIST not found under {root} (expected EMNIST/raw/ with "
                          "emnist-byclass-train-images-idx3-ubyte, ")
    assert msg.endswith("; or set dataset.download=true)") and "; missing " not in msg

    write_emnist(tmp_path, "byclass")
    (tmp_path / "EMNIST" / "raw" / "emnist-byclass-test-labels-idx1-ubyte").unlink()
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist"), tmp_path)
    assert _one_line_error(err).endswith("; missing emnist-byclass-test-labels-idx1-ubyte; or set "
                                         "dataset.download=true)")

    (tmp_path / "root-file").write_text("not a folder")
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist"), tmp_path / "root-file")
    assert _one_line_error(err) == (f"dataset.root: {tmp_path / 'root-file'} is not a folder; set dataset.root to "
                                    f"the folder that holds EMNIST/raw/")


def test_a_packed_file_is_named_with_how_to_unpack_it(tmp_path):
    write_emnist(tmp_path, "mnist", packed=True)  # the official .gz files, not unpacked
    raw = tmp_path / "EMNIST" / "raw"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="mnist"), tmp_path)
    f = raw / "emnist-mnist-train-images-idx3-ubyte"
    assert _one_line_error(err) == (f"dataset.root: {f} is missing but {f}.gz holds it packed; unpack it there "
                                    f"(gunzip -c {f}.gz > {f})")
    # a .gz content under the unpacked name
    write_emnist(tmp_path, "mnist")
    labels = raw / "emnist-mnist-test-labels-idx1-ubyte"
    labels.write_bytes(gzip.compress(labels.read_bytes()))
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="mnist"), tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {labels} is not a readable EMNIST idx file (truncated or corrupt: "
                                    f"it is a gzip archive, unpack it); replace it with the official file")


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
@pytest.mark.parametrize("kind", ["train-images-idx3-ubyte", "test-labels-idx1-ubyte"])
def test_a_corrupt_file_is_named_in_one_line(tmp_path, how, kind):
    write_emnist(tmp_path, "balanced")
    path = tmp_path / "EMNIST" / "raw" / f"emnist-balanced-{kind}"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "garbage": np.random.default_rng(7).integers(0, 256, len(data), dtype=np.uint8).tobytes()}[how])
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="balanced"), tmp_path)
    msg = _one_line_error(err)
    assert msg.startswith(f"dataset.root: {path} is not a readable EMNIST idx file (truncated or corrupt: ")
    assert msg.endswith("); replace it with the official file")


def test_labels_outside_the_split_and_counts_that_differ_are_named(tmp_path):
    arrays = emnist_arrays("letters")
    arrays["train"][1][3] = 0  # torchvision's "N/A" class: no official image has it
    write_emnist(tmp_path, "letters", arrays)
    raw = tmp_path / "EMNIST" / "raw"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="letters"), tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {raw / 'emnist-letters-train-labels-idx1-ubyte'} is not a "
                                    f"readable EMNIST idx file (not in the official format: label 0 outside 1..26); "
                                    f"replace it with the official file")
    arrays = emnist_arrays("digits")
    arrays["test"] = (arrays["test"][0], np.array([0, 1, 10, 2], np.uint8))
    write_emnist(tmp_path, "digits", arrays)
    with pytest.raises(DataSourceError, match=r"emnist-digits-test-labels-idx1-ubyte .*label 10 outside 0\.\.9\)"):
        load_source(DatasetConfig(name="emnist", split="digits"), tmp_path)
    write_emnist(tmp_path, "digits")
    labels = raw / "emnist-digits-train-labels-idx1-ubyte"
    labels.write_bytes(_idx_labels(np.arange(7) % 10))  # 7 labels for 8 images
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="digits"), tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {raw / 'emnist-digits-train-images-idx3-ubyte'} holds 8 images "
                                    f"but {labels} 7 labels; replace them with the official files")


def test_a_broken_legacy_cache_of_the_split_is_named(tmp_path):
    write_emnist(tmp_path, "bymerge")
    processed = tmp_path / "EMNIST" / "processed"
    processed.mkdir()
    (processed / "training_bymerge.pt").write_bytes(b"\x00" * 10)  # torchvision reads these when both exist
    (processed / "test_bymerge.pt").write_bytes(b"")
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="bymerge"), tmp_path)
    msg = _one_line_error(err)
    assert msg.startswith(f"dataset.root: {processed / 'training_bymerge.pt'} is not a readable EMNIST file of "
                          f"torchvision's legacy cache (truncated or corrupt: ")
    assert msg.endswith(f"delete {processed} so that the idx files in {tmp_path / 'EMNIST' / 'raw'} are read")
    # another split's legacy files are not this split's: they are not read
    for f in ("training_bymerge.pt", "test_bymerge.pt"):
        (processed / f).rename(processed / f.replace("bymerge", "byclass"))
    assert load_source(DatasetConfig(name="emnist", split="bymerge"), tmp_path).num_classes == 47


# --------------------------------------------------------------------------- download


@pytest.mark.parametrize("verify", [True, False])
def test_download_unpacks_the_official_archive_with_the_md5_check_following_verify(tmp_path, monkeypatch, verify):
    from fl_core.compat import torchvision

    tv = torchvision().datasets
    arrays = emnist_arrays("digits")
    calls = []

    def fake_download(url, download_root, md5=None, **kw):  # what gzip.zip unpacks to: gzip/*.gz
        calls.append((url, md5))
        write_emnist(Path(download_root) / "unpacked", "digits", arrays, packed=True)
        (Path(download_root) / "unpacked" / "EMNIST" / "raw").rename(Path(download_root) / "gzip")

    monkeypatch.setattr(tv.utils, "download_and_extract_archive", fake_download)
    d = load_source(DatasetConfig(name="emnist", split="digits", download=True, verify=verify), tmp_path)
    assert calls == [(tv.EMNIST.url, tv.EMNIST.md5 if verify else None)]
    assert torch.equal(d.x_train[:, 0], torch.from_numpy(arrays["train"][0]).transpose(1, 2))
    raw = tmp_path / "EMNIST" / "raw"
    assert not (raw / "gzip").exists() and (raw / "emnist-digits-test-labels-idx1-ubyte").is_file()
    load_source(DatasetConfig(name="emnist", split="digits", download=True, verify=verify), tmp_path)
    assert len(calls) == 1  # the files are there: nothing is fetched again

    def offline(*a, **k):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(tv.utils, "download_and_extract_archive", offline)
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="emnist", split="letters", download=True), tmp_path)
    assert str(err.value) == (f"dataset.download: could not download EMNIST into {tmp_path} (OSError: Network is "
                              f"unreachable); place the official files there and set dataset.download=false")


# --------------------------------------------------------------------------- fl-train


def _train_main(args, tmp_path, monkeypatch):
    from pipeline import train

    monkeypatch.chdir(tmp_path)
    return train.main(args + ["tracking.enabled=false", "engine.progress=false", "engine.checkpoint_every=0",
                              f"results_dir={tmp_path / 'results'}", f"data_dir={tmp_path / 'data'}"])


def test_fl_train_prints_one_line_for_a_corrupt_file_and_exits_2(tmp_path, monkeypatch, capsys):
    write_emnist(tmp_path / "raw", "byclass")
    images = tmp_path / "raw" / "EMNIST" / "raw" / "emnist-byclass-test-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:100])
    with pytest.raises(SystemExit) as done:
        _train_main(["dataset=emnist", f"dataset.root={tmp_path / 'raw'}"], tmp_path, monkeypatch)
    assert done.value.code == 2
    assert capsys.readouterr().err == (f"error: dataset.root: {images} is not a readable EMNIST idx file (truncated "
                                       f"or corrupt: 100 bytes where the header announces 3152); replace it with the "
                                       f"official file\n")
    assert not (tmp_path / "results").exists()


def test_fl_train_runs_two_rounds_on_emnist(tmp_path, monkeypatch):
    arrays = emnist_arrays("byclass", n_train=64, n_test=16)
    write_emnist(tmp_path / "raw", "byclass", arrays)
    code = _train_main(["dataset=emnist", f"dataset.root={tmp_path / 'raw'}", "partition=iid",
                        "partition.num_clients=2", "train.participation=1", "train.rounds=2", "train.local_epochs=1",
                        "train.batch_size=32", "seed=1", "name=emnist_smoke"], tmp_path, monkeypatch)
    assert code == 0
    out = tmp_path / "results" / "emnist_smoke"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["seeds"] == [1] and metrics["rounds"] == 2
    assert metrics["status"] == "ok" and np.isfinite(metrics["final_test_loss_mean"])
    # mcmahan_cnn (model=auto) on 1x28x28 with byclass's 62 classes: 832 + 51,264 + 524,800 + 31,806 parameters
    assert metrics["model_d"] == 608702
    info = json.loads((out / "experiment.json").read_text())
    assert (info["dataset"], info["model"], info["partition"]) == ("emnist", "mcmahan_cnn",
                                                                   "emnist-byclass-iid-n2-sgm0-s0")
    assert not (tmp_path / "data").exists()  # a single run reads the raw files and writes no cache
