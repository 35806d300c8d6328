"""Dataset sources of fl_core.data.sources: sklearn digits, and torchvision's CIFAR/MNIST
readers on tiny files written in the official formats."""

import io
import math
import os
import pickle
import struct
from collections import Counter
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from conftest import skip_unless_permissions_apply
import torch

from fl_core.config import DatasetConfig
from fl_core.data import sources
from fl_core.data.sources import DataSourceError, FLDataset, get_dataset, load_source, prepared_path

# --------------------------------------------------------------------------- official-format writers


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` as Python 2 ``str`` (SHORT_BINSTRING / BINSTRING), as in the official CIFAR
    pickles: torchvision reads them with ``encoding="latin1"``, so the keys b'data', b'labels'
    arrive as 'data', 'labels' and the numpy payload is restored from a latin-1 string."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_py2_str(self, obj):
        n = len(obj)
        head = pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
        self.write(head + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _dump_py2(obj, path: Path) -> None:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue())


def _images(rng, n) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)  # row = 1024 R, 1024 G, 1024 B


def write_cifar10(root: Path, per_batch=3, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    xs, ys = [], []
    for b in range(1, 6):
        x, y = _images(rng, per_batch), rng.integers(0, 10, per_batch).tolist()
        _dump_py2({b"batch_label": b"training batch %d of 5" % b, b"labels": y, b"data": x,
                   b"filenames": [b"img%d.png" % i for i in range(per_batch)]}, folder / f"data_batch_{b}")
        xs.append(x)
        ys += y
    xt, yt = _images(rng, n_test), rng.integers(0, 10, n_test).tolist()
    _dump_py2({b"batch_label": b"testing batch 1 of 1", b"labels": yt, b"data": xt}, folder / "test_batch")
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    _dump_py2({b"num_cases_per_batch": per_batch, b"label_names": names, b"num_vis": 3072}, folder / "batches.meta")
    return np.concatenate(xs), np.array(ys), xt, np.array(yt)


def write_cifar100(root: Path, n_train=7, n_test=5, seed=1):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    x, y = _images(rng, n_train), rng.integers(0, 100, n_train).tolist()
    xt, yt = _images(rng, n_test), rng.integers(0, 100, n_test).tolist()
    for name, xx, yy in (("train", x, y), ("test", xt, yt)):
        _dump_py2({b"filenames": [b"f"] * len(yy), b"batch_label": name.encode(), b"fine_labels": yy,
                   b"coarse_labels": [v // 5 for v in yy], b"data": xx}, folder / name)
    _dump_py2({b"fine_label_names": [b"c%d" % i for i in range(100)],
               b"coarse_label_names": [b"k%d" % i for i in range(20)]}, folder / "meta")
    return x, np.array(y), xt, np.array(yt)


def write_mnist(root: Path, folder="MNIST", n_train=6, n_test=3, seed=2):
    rng = np.random.default_rng(seed)
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    out = []
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, n).astype(np.uint8)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, n, 28, 28) + x.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 2049, n) + y.tobytes())
        out += [x, y.astype(np.int64)]
    return out


# --------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return load_source(DatasetConfig(name="digits"), Path("/nonexistent"))


def test_digits_shapes_and_split(digits):
    d = digits
    assert isinstance(d, FLDataset) and d.name == "digits"
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (1347, 1, 8, 8)
    assert d.x_test.dtype == torch.uint8 and d.x_test.shape == (450, 1, 8, 8)
    assert d.y_train.dtype == torch.int64 and d.y_test.dtype == torch.int64
    assert d.num_classes == 10 and d.scale == 16.0 and d.input_shape == (1, 8, 8)
    assert int(d.x_train.max()) == 16 and int(d.x_train.min()) == 0
    # stratified: every class keeps its share in both splits
    tr = np.bincount(d.y_train.numpy(), minlength=10) / 1347
    te = np.bincount(d.y_test.numpy(), minlength=10) / 450
    assert np.abs(tr - te).max() < 0.01


def test_digits_split_is_deterministic(digits):
    again = load_source(DatasetConfig(name="digits"), Path("."))
    assert torch.equal(again.x_train, digits.x_train) and torch.equal(again.y_test, digits.y_test)
    other = load_source(DatasetConfig(name="digits", split_seed=1), Path("."))
    assert not torch.equal(other.x_train, digits.x_train)
    half = load_source(DatasetConfig(name="digits", test_fraction=0.5), Path("."))
    assert len(half.y_test) in (898, 899) and len(half.y_train) + len(half.y_test) == 1797


def test_digits_normalize(digits):
    z = digits.normalize(digits.x_train)
    assert z.dtype == torch.float32 and z.shape == digits.x_train.shape
    assert abs(float(z.mean())) < 1e-4 and abs(float(z.std(unbiased=False)) - 1) < 1e-4
    assert digits.mean[0] == pytest.approx(float(digits.x_train.double().mean() / 16))
    # single image [C, H, W] and values: (x/16 - mean)/std
    one = digits.normalize(digits.x_train[0])
    expect = (digits.x_train[0].double() / 16 - digits.mean[0]) / digits.std[0]
    assert one.shape == (1, 8, 8) and torch.allclose(one.double(), expect, atol=1e-6)


def test_normalize_per_channel():
    ds = FLDataset("t", torch.full((2, 3, 1, 1), 255, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64),
                   torch.zeros((1, 3, 1, 1), dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
                   num_classes=2, scale=255.0, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 2.0))
    out = ds.normalize(ds.x_train)
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([1.0, 3.0, 0.5]))


# --------------------------------------------------------------------------- CIFAR / MNIST readers


def test_cifar10_roundtrip(tmp_path):
    x, y, xt, yt = write_cifar10(tmp_path)
    d = load_source(DatasetConfig(name="cifar10", verify=False), tmp_path)
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (15, 3, 32, 32)
    assert torch.equal(d.x_train, torch.from_numpy(x).reshape(-1, 3, 32, 32))
    assert torch.equal(d.x_test, torch.from_numpy(xt).reshape(-1, 3, 32, 32))
    assert d.y_train.dtype == torch.int64 and d.y_train.tolist() == y.tolist() and d.y_test.tolist() == yt.tolist()
    assert d.num_classes == 10 and d.scale == 255.0 and d.input_shape == (3, 32, 32)
    assert d.mean == (0.491, 0.482, 0.447) and d.std == (0.247, 0.243, 0.262)
    # the red plane of pixel (0, 1) is byte 1 of the row, the green plane starts at 1024
    assert d.x_train[0, 0, 0, 1] == x[0, 1] and d.x_train[0, 1, 0, 0] == x[0, 1024]


def test_cifar10_verify_rejects_unofficial_files(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(DataSourceError, match=r"^dataset\.root: CIFAR-10 files .* MD5 .*dataset\.verify=false"):
        load_source(DatasetConfig(name="cifar10", verify=True), tmp_path)


def test_cifar100_roundtrip(tmp_path):
    x, y, xt, yt = write_cifar100(tmp_path)
    d = load_source(DatasetConfig(name="cifar100", verify=False), tmp_path)
    assert torch.equal(d.x_train, torch.from_numpy(x).reshape(-1, 3, 32, 32))
    assert torch.equal(d.x_test, torch.from_numpy(xt).reshape(-1, 3, 32, 32))
    assert d.y_train.tolist() == y.tolist() and d.y_test.tolist() == yt.tolist()
    assert d.num_classes == 100 and d.mean == (0.5071, 0.4867, 0.4408) and d.std == (0.2675, 0.2565, 0.2761)


@pytest.mark.parametrize("name,folder,mean", [("mnist", "MNIST", 0.1307), ("fmnist", "FashionMNIST", 0.2860)])
def test_mnist_idx_roundtrip(tmp_path, name, folder, mean):
    x, y, xt, yt = write_mnist(tmp_path, folder)
    d = load_source(DatasetConfig(name=name), tmp_path)
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (6, 1, 28, 28)
    assert torch.equal(d.x_train[:, 0], torch.from_numpy(x)) and torch.equal(d.x_test[:, 0], torch.from_numpy(xt))
    assert d.y_train.dtype == torch.int64 and d.y_train.tolist() == y.tolist() and d.y_test.tolist() == yt.tolist()
    assert d.num_classes == 10 and d.mean == (mean,) and d.input_shape == (1, 28, 28)


@pytest.mark.parametrize("name,title", [("cifar10", "CIFAR-10"), ("cifar100", "CIFAR-100"), ("mnist", "MNIST"),
                                        ("fmnist", "FashionMNIST")])
def test_missing_files_name_dataset_root(tmp_path, name, title):
    root = tmp_path / "nowhere"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name=name, verify=False), root)
    msg = str(err.value)
    assert msg.startswith(f"dataset.root: {title} not found under {root} ")
    assert "dataset.download=true" in msg and "\n" not in msg


def test_unknown_source():
    with pytest.raises(DataSourceError, match=r"^dataset\.name must be one of .*'svhn'"):
        load_source(DatasetConfig(name="svhn"), Path("."))


def _same_dataset(a: FLDataset, b: FLDataset) -> bool:
    return (all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("x_train", "y_train", "x_test", "y_test"))
            and (a.mean, a.std, a.scale, a.num_classes) == (b.mean, b.std, b.scale, b.num_classes))


def test_digits_split_is_cached_as_arrays(tmp_path, monkeypatch, digits):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = load_source(DatasetConfig(name="digits"), Path("."))
    files = list((tmp_path / "cache" / "fl-pipeline" / "datasets").iterdir())
    assert [f.name for f in files] == [sources._digits_cache_path(DatasetConfig(name="digits")).name]
    assert files[0].name.startswith("digits-v2-sklearn") and files[0].name.endswith("-tf0.25-s0.npz")
    assert _same_dataset(first, digits)

    def boom(cfg):
        raise AssertionError("scikit-learn read although the split is cached")

    monkeypatch.setattr(sources, "_digits_from_sklearn", boom)
    assert _same_dataset(load_source(DatasetConfig(name="digits"), Path(".")), digits)
    with pytest.raises(AssertionError, match="scikit-learn read"):  # another split is not served from the cache
        load_source(DatasetConfig(name="digits", split_seed=1), Path("."))


def test_digits_cache_that_is_corrupt_or_unwritable_is_rebuilt_or_skipped(tmp_path, monkeypatch, digits):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = sources._digits_cache_path(DatasetConfig(name="digits"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"PK\x03\x04 not a zip archive")
    assert _same_dataset(load_source(DatasetConfig(name="digits"), Path(".")), digits)
    assert sources._read_digits_cache(path) is not None  # rewritten
    np.savez(path, x_train=np.zeros((3, 1, 8, 8), np.uint8), y_train=np.zeros(3, np.int64),
             x_test=np.zeros((1, 1, 8, 8), np.uint8), y_test=np.zeros(1, np.int64), mean=[0.0], std=[1.0])
    assert sources._read_digits_cache(path) is None  # not the 1,797 digits: not used
    assert _same_dataset(load_source(DatasetConfig(name="digits"), Path(".")), digits)

    (tmp_path / "file").write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert _same_dataset(load_source(DatasetConfig(name="digits"), Path(".")), digits)


# --------------------------------------------------------------------------- the same on every CPU and thread count


def test_digits_statistics_are_exact_and_the_same_at_every_thread_count():
    """torch's float64 std of the split was 0.37600559619114615 at one thread and 0.37600559619096297 at two, so the
    cached and the fresh split (and data/prepared, dvc.lock) differed by thread count and CPU; channel_stats sums
    exact integers."""
    got = []
    for threads in (1, 2, 3):  # tests/conftest.py pins one thread again for the next test
        torch.set_num_threads(threads)
        got.append(sources._digits_from_sklearn(DatasetConfig(name="digits")))
    assert all(_same_dataset(d, got[0]) for d in got)
    # the definition, in exact rational arithmetic over the pixel values k / 16 (17 distinct values)
    counts = Counter(Fraction(int(k), 16) for k in got[0].x_train.reshape(-1).tolist())
    n = sum(counts.values())
    mean = sum(c * v for v, c in counts.items()) / n
    var = sum(c * (v - mean) ** 2 for v, c in counts.items()) / n
    assert got[0].mean == (float(mean),) == (0.305224718123608,)
    assert got[0].std == (math.sqrt(float(var)),) == (0.37600559619100277,)


def test_channel_stats_of_float_images_agree_with_the_exact_integer_path():
    x = torch.from_numpy(np.random.default_rng(3).integers(0, 17, (50, 3, 4, 5), dtype=np.uint8))
    exact_mean, exact_std = sources.channel_stats(x, 16.0)
    mean, std = sources.channel_stats(x.to(torch.float32), 16.0)
    assert mean == exact_mean  # k / 16 and their sum are exact in float64: one rounding, in the division, on both
    # the float path rounds every (v - mean)^2 before its exactly rounded sum, the integer path is exact: a few ulps
    assert all(math.isclose(a, b, rel_tol=1e-14) for a, b in zip(std, exact_std))
    with pytest.raises(ValueError, match=r"non-empty \[N, C, H, W\]"):
        sources.channel_stats(x[:0], 16.0)


def test_prepared_digits_are_the_same_bytes_at_every_thread_count(tmp_path, monkeypatch):
    files = []
    for threads in (1, 2):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{threads}"))  # no shared array cache
        torch.set_num_threads(threads)
        get_dataset(DatasetConfig(name="digits"), tmp_path / f"data{threads}", tmp_path)
        files.append(prepared_path(DatasetConfig(name="digits"), tmp_path / f"data{threads}").read_bytes())
    assert files[0] == files[1]


def test_a_cached_digits_split_with_other_statistics_is_rebuilt(tmp_path, monkeypatch, digits):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = sources._digits_cache_path(DatasetConfig(name="digits"))
    load_source(DatasetConfig(name="digits"), Path("."))
    with np.load(path) as z:
        arrays = dict(z)
    arrays["std"] = np.asarray([0.37600559619096297])  # what torch's two-thread std wrote into a cache
    np.savez(path, **arrays)
    assert sources._read_digits_cache(path) is None  # not this code's statistics: rebuilt
    assert _same_dataset(load_source(DatasetConfig(name="digits"), Path(".")), digits)
    assert sources._read_digits_cache(path) is not None


def test_synthetic_covariance_is_correctly_rounded():
    from fl_core.data.synthetic import covariance_diagonal

    sigma = covariance_diagonal()
    # 20^-1.2 = 0x1.c1f86c09e1984p-6 (0.478 ulp away); NumPy's AVX-512 power gave 0x1.c1f86c09e1983p-6
    assert sigma[19] == float.fromhex("0x1.c1f86c09e1984p-6")
    assert all(abs(v - math.pow(j, -1.2)) <= math.ulp(v) for j, v in enumerate(sigma.tolist(), start=1))


def test_synthetic_logits_are_summed_in_one_fixed_order():
    from fl_core.data.synthetic import logits

    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(6, 60)), rng.normal(size=(60, 10)), rng.normal(size=10)
    got = logits(x, w, b)
    for i in range(6):
        for c in range(10):
            total = 0.0
            for j in range(60):  # the order the docstring states, in Python floats (IEEE double, no fused ops)
                total += x[i, j] * w[j, c]
            assert got[i, c] == total + b[c]
    # the BLAS sums in an order of its own: the same values up to rounding (60 terms of size ~1: far below 1e-12)
    assert np.allclose(got, x @ w + b, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_a_second_process_reads_the_cached_digits_without_importing_sklearn(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from fl_core.config import DatasetConfig; "
            "from fl_core.data.sources import load_source; "
            "ds = load_source(DatasetConfig(name='digits'), Path('.')); "
            "print(len(ds.y_train), len(ds.y_test), 'sklearn' in sys.modules)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}
    outs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs == ["1347 450 True\n", "1347 450 False\n"]


# --------------------------------------------------------------------------- prepared cache


def test_get_dataset_caches(tmp_path, monkeypatch):
    cfg = DatasetConfig(name="digits")
    first = get_dataset(cfg, tmp_path / "data", tmp_path)
    path = prepared_path(cfg, tmp_path / "data")
    assert path == tmp_path / "data" / "prepared" / "digits.pt" and path.is_file()
    mtime = path.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("load_source called although the prepared file exists")

    monkeypatch.setattr(sources, "load_source", boom)
    second = get_dataset(cfg, tmp_path / "data", tmp_path)
    assert path.stat().st_mtime_ns == mtime
    for f in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(first, f), getattr(second, f))
    assert (second.mean, second.std, second.scale, second.num_classes) == (first.mean, first.std, 16.0, 10)
    assert [p.name for p in path.parent.iterdir()] == ["digits.pt"]  # no temp file left behind

    # another split of digits must not be served from the cache
    monkeypatch.undo()
    calls = []
    real = sources.load_source
    monkeypatch.setattr(sources, "load_source", lambda *a: calls.append(a) or real(*a))
    third = get_dataset(replace(cfg, split_seed=3), tmp_path / "data", tmp_path)
    assert len(calls) == 1 and not torch.equal(third.x_train, first.x_train)


def test_single_runs_never_rewrite_a_prepared_file_of_other_source_settings(tmp_path):
    from fl_core.config import compose
    from fl_core.data.access import dataset_for

    cfg = compose([f"data_dir={tmp_path / 'data'}"])
    prepared = dataset_for(cfg, write_cache=True)  # the prepare stage
    path = prepared_path(cfg.dataset, tmp_path / "data")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    other = dataset_for(compose([f"data_dir={tmp_path / 'data'}", "dataset.test_fraction=0.5"]), write_cache=False)
    assert len(other.y_test) in (898, 899) and len(prepared.y_test) == 450
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert _same_dataset(dataset_for(cfg, write_cache=False), prepared)


def test_get_dataset_unwritable_data_dir_is_one_line(tmp_path):
    (tmp_path / "data").write_text("a file where the data folder should be")
    with pytest.raises(DataSourceError) as err:
        get_dataset(DatasetConfig(name="digits"), tmp_path / "data", tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"data_dir: cannot write the prepared dataset {tmp_path / 'data' / 'prepared' / 'digits.pt'} (")
    assert "\n" not in msg


def test_get_dataset_resolves_root_against_project(tmp_path, monkeypatch):
    project = tmp_path / "proj"
    write_cifar10(project / "raw")
    monkeypatch.chdir(tmp_path)
    cfg = DatasetConfig(name="cifar10", root="raw", verify=False)
    d = get_dataset(cfg, project / "data", project)
    assert d.x_train.shape == (15, 3, 32, 32)
    assert (project / "data" / "prepared" / "cifar10.pt").is_file()
    with pytest.raises(DataSourceError, match=str(tmp_path / "elsewhere" / "raw")):
        get_dataset(cfg, tmp_path / "other-data", tmp_path / "elsewhere")


# --------------------------------------------------------------------------- Tiny-ImageNet


def write_tiny_imagenet(root: Path, per_class: int = 2):
    """A 3-class tree in the official tiny-imagenet-200 layout, written with PIL as JPEG (quality 100).

    Each image is one flat colour, so JPEG decoding returns it within a few levels. Class c's train images
    are (40c + 10i, ..) and the val images are listed out of class order in val_annotations.txt; one train
    image is grayscale ("L") like a few of the official ones. Returns {file name: (label, rgb)}.
    """
    from PIL import Image

    base = root / "tiny-imagenet-200"
    wnids = ["n0300", "n0100", "n0200"]  # not sorted: the sorted ids, not the file order, give the class index
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    truth = {}
    for c, w in enumerate(wnids):
        folder = base / "train" / w / "images"
        folder.mkdir(parents=True)
        (base / "train" / w / f"{w}_boxes.txt").write_text("")
        for i in range(per_class):
            name = f"{w}_{i}.JPEG"
            if c == 2 and i == 1:
                Image.new("L", (64, 64), 200).save(folder / name, quality=100)
                truth[name] = (c, (200, 200, 200))
            else:
                rgb = (40 * c + 10 * i, 100, 250 - 40 * c)
                Image.new("RGB", (64, 64), rgb).save(folder / name, quality=100)
                truth[name] = (c, rgb)
    rows = [("val_0.JPEG", "n0200"), ("val_1.JPEG", "n0300"), ("val_2.JPEG", "n0200")]
    for k, (name, w) in enumerate(rows):
        rgb = (20 + 60 * k, 30, 90)
        Image.new("RGB", (64, 64), rgb).save(base / "val" / "images" / name, quality=100)
        truth[name] = (sorted(wnids).index(w), rgb)
    (base / "val" / "val_annotations.txt").write_text("".join(f"{n}\t{w}\t0\t0\t63\t63\n" for n, w in rows))
    return truth


def _colours(x: torch.Tensor) -> list:
    return [tuple(int(v) for v in img.float().mean(dim=(1, 2)).round()) for img in x]


def _close(a, b, tol=3):
    return len(a) == len(b) and all(abs(u - v) <= tol for p, q in zip(a, b) for u, v in zip(p, q))


def test_tiny_imagenet_reader(tmp_path):
    truth = write_tiny_imagenet(tmp_path)
    d = load_source(DatasetConfig(name="tiny_imagenet"), tmp_path)
    assert d.name == "tiny_imagenet" and d.num_classes == 3 and d.scale == 255.0
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (6, 3, 64, 64) and d.input_shape == (3, 64, 64)
    assert d.x_test.dtype == torch.uint8 and d.x_test.shape == (3, 3, 64, 64)
    assert d.mean == (0.5, 0.5, 0.5) and d.std == (0.5, 0.5, 0.5)
    # train: sorted class ids as in FedBug's ImageFolder (n0100 -> 0, n0200 -> 1, n0300 -> 2), then file name
    assert d.y_train.dtype == torch.int64 and d.y_train.tolist() == [0, 0, 1, 1, 2, 2]
    train_names = [f"{w}_{i}.JPEG" for w in ("n0100", "n0200", "n0300") for i in range(2)]
    assert _close(_colours(d.x_train), [truth[n][1] for n in train_names])
    # the grayscale JPEG comes back as three equal channels
    gray = d.x_train[3]  # n0200_1.JPEG
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    # test = official val, labelled by val_annotations.txt and re-sorted by class
    assert d.y_test.tolist() == [1, 1, 2]
    assert _close(_colours(d.x_test), [truth[n][1] for n in ("val_0.JPEG", "val_2.JPEG", "val_1.JPEG")])
    # flat images stay flat: every pixel equals the image's colour up to JPEG rounding
    assert int((d.x_test.int() - d.x_test.float().mean(dim=(2, 3), keepdim=True).round().int()).abs().max()) <= 3


def test_tiny_imagenet_missing_root(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="tiny_imagenet"), root)
    msg = str(err.value)
    assert msg.startswith(f"dataset.root: Tiny-ImageNet not found under {root} ")
    assert "tiny-imagenet-200/" in msg and "wnids.txt" in msg and "val/val_annotations.txt" in msg
    assert "\n" not in msg


def test_tiny_imagenet_bad_image_named(tmp_path):
    write_tiny_imagenet(tmp_path)
    broken = tmp_path / "tiny-imagenet-200" / "train" / "n0100" / "images" / "n0100_1.JPEG"
    broken.write_bytes(b"not a jpeg")
    with pytest.raises(DataSourceError, match=r"^dataset\.root: .*n0100_1\.JPEG is not a readable Tiny-ImageNet image "
                                              r"\(truncated or corrupt: not an image file\)"):
        load_source(DatasetConfig(name="tiny_imagenet"), tmp_path)
    broken.unlink()
    missing = tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_2.JPEG"
    missing.unlink()
    # the train listing no longer has n0100_1; the val image named in the annotations is missing
    with pytest.raises(DataSourceError, match=r"^dataset\.root: the Tiny-ImageNet image .*val_2\.JPEG does not exist"):
        load_source(DatasetConfig(name="tiny_imagenet"), tmp_path)


def test_tiny_imagenet_wrong_size_named(tmp_path):
    from PIL import Image

    write_tiny_imagenet(tmp_path)
    odd = tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_0.JPEG"
    Image.new("RGB", (32, 64)).save(odd)
    with pytest.raises(DataSourceError, match=r"val_0\.JPEG is 32x64, expected 64x64"):
        load_source(DatasetConfig(name="tiny_imagenet"), tmp_path)


# --------------------------------------------------------------------------- CINIC-10

CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cinic10(root: Path, folder: str = "cinic-10", per_class=(2, 1), classes=CINIC_CLASSES):
    """A CINIC-10 tree of flat-colour 32x32 PNGs (lossless) under ``root/folder``.

    Class folders are created in reverse order (the sorted names, not the creation order, give the
    label). Image i of the c-th name in ``classes`` has colour (20c + 5i, 7c, 200 - i) in train and
    (20c, 100, 50 + i) in test; valid/ holds one image per class that must not be read. Train image 0 of
    class 3 is a grayscale PNG named like CINIC's CIFAR-derived files ("cifar10-..." sorts before "n0...").
    Returns ``{split: [(c, rgb), ...]}`` in class-then-file-name order of ``classes``.
    """
    from PIL import Image

    base = root / folder
    truth = {"train": [], "test": [], "valid": []}
    for split, n in (("train", per_class[0]), ("test", per_class[1]), ("valid", 1)):
        for c in reversed(range(len(classes))):
            d = base / split / classes[c]
            d.mkdir(parents=True)
            for i in range(n):
                if split == "train" and c == 3 and i == 0:
                    Image.new("L", (32, 32), 90).save(d / f"cifar10-train-{i}.png")
                    rgb = (90, 90, 90)
                else:
                    rgb = (20 * c + 5 * i, 7 * c, 200 - i) if split == "train" else (20 * c, 100, 50 + i)
                    Image.new("RGB", (32, 32), rgb).save(d / f"n0{c}_{i}.png")
                truth[split].append((c, rgb))
    return {split: sorted(rows, key=lambda r: r[0]) for split, rows in truth.items()}  # stable: i stays in order


def test_cinic10_reader(tmp_path):
    truth = write_cinic10(tmp_path)
    (tmp_path / "cinic-10" / "train" / "cat" / "README.txt").write_text("not an image")  # ignored
    d = load_source(DatasetConfig(name="cinic10"), tmp_path)
    assert d.name == "cinic10" and d.num_classes == 10 and d.scale == 255.0
    assert d.x_train.dtype == torch.uint8 and d.x_train.shape == (20, 3, 32, 32) and d.input_shape == (3, 32, 32)
    assert d.x_test.dtype == torch.uint8 and d.x_test.shape == (10, 3, 32, 32)
    assert d.mean == (0.47889522, 0.47227842, 0.43047404) and d.std == (0.24205776, 0.23828046, 0.25874835)
    # labels: sorted class folder names (airplane 0 ... truck 9, the CIFAR-10 order), then file name
    assert d.y_train.dtype == torch.int64 and d.y_train.tolist() == [c for c, _ in truth["train"]]
    assert d.y_train.tolist() == [c for c in range(10) for _ in range(2)]
    assert d.y_test.tolist() == list(range(10))
    assert _colours(d.x_train) == [rgb for _, rgb in truth["train"]]  # PNG is lossless
    assert _colours(d.x_test) == [rgb for _, rgb in truth["test"]]
    gray = d.x_train[6]  # cat, grayscale PNG -> three equal channels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2]) and int(gray[0, 0, 0]) == 90
    # flat images stay flat
    assert torch.equal(d.x_train, d.x_train[:, :, :1, :1].expand_as(d.x_train))


def test_cinic10_upper_case_folder_and_any_classes(tmp_path):
    write_cinic10(tmp_path, folder="CINIC-10", per_class=(1, 1), classes=["b", "a", "c"])
    d = load_source(DatasetConfig(name="cinic10"), tmp_path)
    assert d.num_classes == 3 and d.y_train.tolist() == [0, 1, 2]
    # "b" was written as class 0: sorted folder order makes it label 1
    assert _colours(d.x_train)[1] == (0, 0, 200)


def test_cinic10_missing_root(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="cinic10"), root)
    msg = str(err.value)
    assert msg.startswith(f"dataset.root: CINIC-10 not found under {root} ")
    assert "cinic-10/" in msg and "train/<class>/*.png" in msg and "test/<class>/*.png" in msg
    assert "\n" not in msg
    (tmp_path / "only-train" / "cinic-10" / "train" / "cat").mkdir(parents=True)  # no test/: not found either
    with pytest.raises(DataSourceError, match=r"^dataset\.root: CINIC-10 not found under"):
        load_source(DatasetConfig(name="cinic10"), tmp_path / "only-train")


def test_cinic10_bad_image_named(tmp_path):
    from PIL import Image

    write_cinic10(tmp_path, per_class=(1, 1))
    broken = tmp_path / "cinic-10" / "test" / "dog" / "n05_0.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(DataSourceError, match=r"^dataset\.root: .*dog.n05_0\.png is not a readable CINIC-10 image "
                                              r"\(truncated or corrupt: not an image file\)"):
        load_source(DatasetConfig(name="cinic10"), tmp_path)
    Image.new("RGB", (32, 30)).save(broken)
    with pytest.raises(DataSourceError, match=r"n05_0\.png is 32x30, expected 32x32"):
        load_source(DatasetConfig(name="cinic10"), tmp_path)


def test_cinic10_class_folders_must_match(tmp_path):
    write_cinic10(tmp_path, per_class=(1, 1))
    for f in (tmp_path / "cinic-10" / "test" / "truck").iterdir():
        f.unlink()
    with pytest.raises(DataSourceError, match=r"class folder .*truck has no image files"):
        load_source(DatasetConfig(name="cinic10"), tmp_path)
    (tmp_path / "cinic-10" / "test" / "truck").rmdir()
    with pytest.raises(DataSourceError, match=r"class folders of .*test.* differ from those of .*train"):
        load_source(DatasetConfig(name="cinic10"), tmp_path)


def test_holdout_validation_is_a_stratified_disjoint_seeded_split(digits):
    from fl_core.data import holdout_validation

    val = holdout_validation(digits, 0.2, seed=0)
    n = digits.y_train.numel()
    assert val.y_train.numel() + val.y_test.numel() == n and val.y_test.numel() == math.ceil(0.2 * n)  # sklearn rounds the held-out share up
    # every validation image is a training image of the source, none is in the remaining training split
    src = {bytes(x.numpy().tobytes()) + bytes([int(y)]) for x, y in zip(digits.x_train, digits.y_train)}
    rest = {bytes(x.numpy().tobytes()) + bytes([int(y)]) for x, y in zip(val.x_train, val.y_train)}
    held = [bytes(x.numpy().tobytes()) + bytes([int(y)]) for x, y in zip(val.x_test, val.y_test)]
    assert all(h in src for h in held) and len(rest & set(held)) < 5  # digits holds a few duplicate images
    share = torch.bincount(val.y_test, minlength=10).float() / torch.bincount(digits.y_train, minlength=10).float()
    assert torch.all((share - 0.2).abs() < 0.02)  # stratified
    again = holdout_validation(digits, 0.2, seed=0)
    assert torch.equal(again.y_test, val.y_test) and torch.equal(again.x_test, val.x_test)
    assert not torch.equal(holdout_validation(digits, 0.2, seed=1).x_test, val.x_test)
    assert val.mean == digits.mean and torch.equal(digits.x_test, digits.x_test)
    with pytest.raises(ValueError, match="dataset.validation_fraction"):
        holdout_validation(digits, 1.0)


# --------------------------------------------------------------------------- broken files: one line naming the file


def _one_line_error(err) -> str:
    """The message of a raised DataSourceError, checked to be one line with no chained exception to print."""
    msg = str(err.value)
    assert type(err.value) is DataSourceError
    assert "\n" not in msg and msg.startswith("dataset.root: ")
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)
    return msg


def _write_tiny(root):
    write_tiny_imagenet(root)


def _write_cinic(root):
    write_cinic10(root, per_class=(1, 1))


# dataset, writer, file to break (relative to the root), what the message calls it
BREAKABLE = [
    ("cifar10", write_cifar10, "cifar-10-batches-py/data_batch_3", "CIFAR-10 batch"),
    ("cifar10", write_cifar10, "cifar-10-batches-py/test_batch", "CIFAR-10 batch"),
    ("cifar10", write_cifar10, "cifar-10-batches-py/batches.meta", "CIFAR-10 meta file"),
    ("cifar100", write_cifar100, "cifar-100-python/train", "CIFAR-100 batch"),
    ("cifar100", write_cifar100, "cifar-100-python/meta", "CIFAR-100 meta file"),
    ("mnist", write_mnist, "MNIST/raw/train-images-idx3-ubyte", "MNIST idx file"),
    ("mnist", write_mnist, "MNIST/raw/t10k-labels-idx1-ubyte", "MNIST idx file"),
    ("fmnist", lambda r: write_mnist(r, "FashionMNIST"), "FashionMNIST/raw/train-labels-idx1-ubyte",
     "FashionMNIST idx file"),
    ("tiny_imagenet", _write_tiny, "tiny-imagenet-200/train/n0200/images/n0200_0.JPEG", "Tiny-ImageNet image"),
    ("tiny_imagenet", _write_tiny, "tiny-imagenet-200/val/images/val_1.JPEG", "Tiny-ImageNet image"),
    ("cinic10", _write_cinic, "cinic-10/train/frog/n06_0.png", "CINIC-10 image"),
    ("cinic10", _write_cinic, "cinic-10/test/airplane/n00_0.png", "CINIC-10 image"),
]


def _break(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # garbage: random bytes of the same length
        path.write_bytes(np.random.default_rng(7).integers(0, 256, len(data), dtype=np.uint8).tobytes())


@pytest.mark.parametrize("verify", [False, True], ids=["verify_off", "verify_on"])
@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
@pytest.mark.parametrize("name,writer,rel,what", BREAKABLE, ids=[f"{b[0]}:{Path(b[2]).name}" for b in BREAKABLE])
def test_broken_file_is_named_in_one_line(tmp_path, name, writer, rel, what, how, verify):
    writer(tmp_path)
    _break(tmp_path / rel, how)
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name=name, verify=verify), tmp_path)
    msg = _one_line_error(err)
    # the same message whatever dataset.verify: a broken file is named even where the MD5 check runs first
    assert msg.startswith(f"dataset.root: {tmp_path / rel} is not a readable {what} (truncated or corrupt: ")
    assert msg.endswith("); replace it with the official file")
    if how == "empty":
        assert "(truncated or corrupt: the file is empty)" in msg


def test_cifar_reasons_name_what_is_wrong(tmp_path):
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    cfg = DatasetConfig(name="cifar10", verify=False)
    batch = folder / "data_batch_2"
    _dump_py2({b"labels": [0, 10, 3], b"data": np.zeros((3, 3072), np.uint8)}, batch)  # label out of range
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {batch} is not a readable CIFAR-10 batch (not in the official "
                                    f"format: label 10 outside 0..9); replace it with the official file")
    _dump_py2({b"labels": [0, 1, 2], b"data": np.zeros((3, 1024), np.float32)}, batch)
    with pytest.raises(DataSourceError, match=r"data_batch_2 .*'data' must be a uint8 array \[N, 3072\], "
                                              r"got float32 \[3, 1024\]"):
        load_source(cfg, tmp_path)
    _dump_py2({b"labels": [0, 1], b"data": np.zeros((3, 3072), np.uint8)}, batch)
    with pytest.raises(DataSourceError, match=r"data_batch_2 .*'labels' must list one integer label per image \(3\)"):
        load_source(cfg, tmp_path)
    _dump_py2([1, 2, 3], batch)
    with pytest.raises(DataSourceError, match=r"data_batch_2 .*it holds a list, not a dict"):
        load_source(cfg, tmp_path)
    batch.unlink()
    batch.mkdir()  # a folder where the file should be
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == f"dataset.root: cannot read {batch} (not a file)"
    batch.rmdir()
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err).startswith(f"dataset.root: CIFAR-10 not found under {tmp_path} (expected "
                                           f"cifar-10-batches-py/ in the official python format, missing data_batch_2;")


def _md5(path: Path) -> str:
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


def test_cifar_verify_names_the_one_file_that_fails_the_md5_check(tmp_path, monkeypatch):
    from fl_core.compat import torchvision

    base = torchvision().datasets.CIFAR100
    x, *_ = write_cifar100(tmp_path)
    folder = tmp_path / "cifar-100-python"
    # pretend our tiny files are the official ones: their MD5 sums in place of torchvision's
    monkeypatch.setattr(base, "train_list", [["train", _md5(folder / "train")]])
    monkeypatch.setattr(base, "test_list", [["test", _md5(folder / "test")]])
    monkeypatch.setattr(base, "meta", {**base.meta, "md5": _md5(folder / "meta")})
    d = load_source(DatasetConfig(name="cifar100", verify=True), tmp_path)  # the MD5 path passes
    assert torch.equal(d.x_train, torch.from_numpy(x).reshape(-1, 3, 32, 32))
    # a readable batch that is not the official file: only the MD5 check can tell
    _dump_py2({b"fine_labels": [1], b"coarse_labels": [0], b"data": np.zeros((1, 3072), np.uint8)}, folder / "test")
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="cifar100", verify=True), tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {folder / 'test'} failed torchvision's MD5 check of the CIFAR-100 "
                                    f"files; replace it with the official file or set dataset.verify=false")
    assert load_source(DatasetConfig(name="cifar100", verify=False), tmp_path).y_test.tolist() == [1]


def test_mnist_reasons_name_what_is_wrong(tmp_path):
    import gzip

    write_mnist(tmp_path)
    raw = tmp_path / "MNIST" / "raw"
    cfg = DatasetConfig(name="mnist")
    labels = raw / "train-labels-idx1-ubyte"
    good = labels.read_bytes()
    labels.write_bytes(struct.pack(">ii", 2049, 5) + bytes([1, 2, 3, 4, 5]))  # 5 labels for 6 images
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {raw / 'train-images-idx3-ubyte'} holds 6 images but {labels} "
                                    f"5 labels; replace them with the official files")
    labels.write_bytes(struct.pack(">ii", 2049, 6) + bytes([1, 2, 3, 4, 5, 12]))
    with pytest.raises(DataSourceError, match=r"train-labels-idx1-ubyte is not a readable MNIST idx file "
                                              r"\(not in the official format: label 12 outside 0\.\.9\)"):
        load_source(cfg, tmp_path)
    labels.write_bytes(gzip.compress(good))  # the .gz archive under the unpacked name
    with pytest.raises(DataSourceError, match=r"train-labels-idx1-ubyte .*it is a gzip archive, unpack it"):
        load_source(cfg, tmp_path)
    labels.write_bytes(good)
    images = raw / "t10k-images-idx3-ubyte"
    images.write_bytes(struct.pack(">iiii", 2051, 3, 32, 32) + bytes(3 * 32 * 32))
    with pytest.raises(DataSourceError, match=r"t10k-images-idx3-ubyte .*images are 32x32, expected 28x28"):
        load_source(cfg, tmp_path)
    images.write_bytes(struct.pack(">iiii", 2051, 3, 28, 28) + bytes(3 * 28 * 28 + 5))  # trailing bytes
    with pytest.raises(DataSourceError, match=r"t10k-images-idx3-ubyte .*\(truncated or corrupt: 2373 bytes where "
                                              r"the header announces 2368\)"):
        load_source(cfg, tmp_path)
    images.unlink()
    with pytest.raises(DataSourceError, match=r"^dataset\.root: MNIST not found under .*; missing t10k-images-idx3-ubyte;"):
        load_source(cfg, tmp_path)


def test_mnist_broken_legacy_cache_is_named(tmp_path):
    write_mnist(tmp_path)
    processed = tmp_path / "MNIST" / "processed"
    processed.mkdir()
    (processed / "training.pt").write_bytes(b"\x00" * 10)  # torchvision reads these instead of raw/ when both exist
    (processed / "test.pt").write_bytes(b"")
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="mnist"), tmp_path)
    msg = _one_line_error(err)
    assert msg.startswith(f"dataset.root: {processed / 'training.pt'} is not a readable MNIST file of torchvision's "
                          f"legacy cache (truncated or corrupt: ")
    assert msg.endswith(f"delete {processed} so that the idx files in {tmp_path / 'MNIST' / 'raw'} are read")


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "mnist", "fmnist", "tiny_imagenet", "cinic10"])
def test_root_that_is_a_file(tmp_path, name):
    root = tmp_path / "raw"
    root.write_text("not a folder")
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name=name, verify=False), root)
    assert _one_line_error(err).startswith(f"dataset.root: {root} is not a folder; set dataset.root to the folder "
                                           f"that holds ")


def test_unreadable_root(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    real = os.access
    monkeypatch.setattr(sources.os, "access", lambda p, mode: Path(p) != tmp_path and real(p, mode))
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="cifar10", verify=False), tmp_path)
    assert _one_line_error(err) == f"dataset.root: cannot read the folder {tmp_path} (permission denied)"


@pytest.mark.parametrize("verify", [False, True])
def test_unreadable_file_and_folder(tmp_path, verify):
    skip_unless_permissions_apply(tmp_path)
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    cfg = DatasetConfig(name="cifar10", verify=verify)
    (folder / "data_batch_4").chmod(0)
    try:
        with pytest.raises(DataSourceError) as err:
            load_source(cfg, tmp_path)
        assert _one_line_error(err) == f"dataset.root: cannot read {folder / 'data_batch_4'} (permission denied)"
    finally:
        (folder / "data_batch_4").chmod(0o644)
    folder.chmod(0)
    try:
        with pytest.raises(DataSourceError) as err:
            load_source(cfg, tmp_path)
        assert _one_line_error(err) == f"dataset.root: cannot read the folder {folder} (permission denied)"
    finally:
        folder.chmod(0o755)


def test_tiny_imagenet_broken_index_files_are_named(tmp_path):
    write_tiny_imagenet(tmp_path)
    base = tmp_path / "tiny-imagenet-200"
    cfg = DatasetConfig(name="tiny_imagenet")
    annotations = base / "val" / "val_annotations.txt"
    text = annotations.read_text()
    annotations.write_text("")
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {annotations} lists no image (truncated or corrupt); "
                                    f"replace it with the official file")
    annotations.write_text(text[: len(text) // 2 + 3])  # cut inside a line
    with pytest.raises(DataSourceError, match=r"val_annotations\.txt has a line that is not a file name, a class of "
                                              r"wnids\.txt and 4 box coordinates \(truncated or corrupt\): 'val_1\.JPEG"):
        load_source(cfg, tmp_path)
    annotations.write_text(text)
    (base / "wnids.txt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == (f"dataset.root: {base / 'wnids.txt'} is not a text file (truncated or corrupt); "
                                    f"replace it with the official file")
    (base / "wnids.txt").write_text("n0300\nn0100\nn0200\n")
    for f in (base / "train" / "n0200" / "images").iterdir():
        f.unlink()
    with pytest.raises(DataSourceError) as err:
        load_source(cfg, tmp_path)
    assert _one_line_error(err) == (f"dataset.root: the Tiny-ImageNet folder {base / 'train' / 'n0200' / 'images'} "
                                    f"has no JPEG images")


def test_cli_prints_one_line_for_a_truncated_batch(tmp_path, monkeypatch, capsys):
    from pipeline import train

    write_cifar10(tmp_path / "raw")
    batch = tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:200])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        train.main(["dataset=cifar10", f"dataset.root={tmp_path / 'raw'}", "dataset.verify=false",
                    "tracking.enabled=false", "engine.progress=false", f"results_dir={tmp_path / 'results'}",
                    f"data_dir={tmp_path / 'data'}"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"error: dataset.root: {batch} is not a readable CIFAR-10 batch (truncated or corrupt: pickle data "
                   f"was truncated); replace it with the official file\n")


class _Planted:
    """A pickle payload that would create ``marker`` when unpickled by plain pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch '{self.marker}'",))


@pytest.mark.parametrize("rel", ["cifar-10-batches-py/data_batch_3", "cifar-10-batches-py/batches.meta"])
def test_a_planted_cifar_file_runs_no_code_and_is_named(tmp_path, rel):
    """The CIFAR files are read by an unpickler that builds only arrays, lists and numbers: a file of a shared
    dataset.root holding a payload is refused in one line naming it, and the payload never runs."""
    import pickle

    write_cifar10(tmp_path)
    marker = tmp_path / "ran"
    payload = pickle.dumps({"labels": [0, 1, 2], "data": _Planted(marker)}, protocol=2)
    pickle.loads(payload)  # plain pickle runs it: the control
    assert marker.exists()
    marker.unlink()
    (tmp_path / rel).write_bytes(payload)
    with pytest.raises(DataSourceError) as err:
        load_source(DatasetConfig(name="cifar10", verify=False), tmp_path)
    msg = _one_line_error(err)
    assert msg.startswith(f"dataset.root: {tmp_path / rel} is not a readable CIFAR-10 ")
    assert "(not in the official format: refused to load posix.system" in msg and not marker.exists()
