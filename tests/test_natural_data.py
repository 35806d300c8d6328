"""FEMNIST by writer and Shakespeare by speaker from tiny files written in each published format (LEAF's JSON, TFF's
h5): shapes, labels, writers, the natural partition, the subsets, the errors; the char_lstm model on both executors;
partition.balance_cap."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_core.config import ConfigError, compose
from fl_core.data import DataSourceError, get_dataset, load_source, make_partition, partition_key
from fl_core.data import leaf
from fl_core.data.partition import _dirichlet_per_class
from fl_core.experiment import fingerprint
from fl_core.models import build_model
from fl_core.models.char_lstm import LSTMLayer
from fl_core.schema import PartitionConfig
from fl_core.seeding import numpy_rng

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import tiny_natural_data as tiny  # noqa: E402

WRITE = {("femnist", "leaf"): tiny.write_leaf_femnist, ("femnist", "tff"): tiny.write_tff_femnist,
         ("shakespeare", "leaf"): tiny.write_leaf_shakespeare, ("shakespeare", "tff"): tiny.write_tff_shakespeare}


def write(root: Path, name: str, fmt: str, **kw) -> tuple:
    data = tiny.femnist_samples(**kw) if name == "femnist" else tiny.shakespeare_texts(**kw)
    WRITE[name, fmt](root, *data)
    return data


def load(root: Path, *overrides: str):
    cfg = compose([*overrides, f"dataset.root={root}"])
    return load_source(cfg.dataset, root), cfg


# --------------------------------------------------------------------------- FEMNIST


@pytest.mark.parametrize("fmt", ["leaf", "tff"])
def test_femnist_shapes_labels_writers_and_test_split(tmp_path, fmt):
    train, test = write(tmp_path, "femnist", fmt)
    ds, _ = load(tmp_path, "dataset=femnist")
    writers = sorted(train)
    sizes = [len(train[w][1]) for w in writers]
    assert ds.x_train.dtype == torch.uint8 and ds.x_train.shape == (sum(sizes), 1, 28, 28)
    assert ds.x_test.shape == (2 * len(writers), 1, 28, 28) and ds.num_classes == 62
    assert ds.num_devices == len(writers) and torch.bincount(ds.devices).tolist() == sizes
    # writer k's images and labels, in order, exactly (k/255 stored as k)
    first = ds.devices == 0
    assert torch.equal(ds.x_train[first, 0], torch.from_numpy(np.rint(train[writers[0]][0] * 255).astype(np.uint8)))
    assert ds.y_train[first].tolist() == [int(v) for v in train[writers[0]][1]]
    assert ds.y_test.tolist() == [int(v) for w in writers for v in test[w][1]]
    assert 0 <= int(ds.y_train.min()) and int(ds.y_train.max()) < 62
    assert ds.provenance == {"format": fmt, "writers": len(writers)}
    mean = ds.x_train.double().div(255).mean().item()
    assert ds.mean[0] == pytest.approx(mean, abs=1e-12)


def test_both_formats_give_the_same_dataset(tmp_path):
    write(tmp_path / "a", "femnist", "leaf")
    write(tmp_path / "b", "femnist", "tff")
    a, _ = load(tmp_path / "a", "dataset=femnist")
    b, _ = load(tmp_path / "b", "dataset=femnist")
    for key in ("x_train", "y_train", "x_test", "y_test", "devices"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


@pytest.mark.parametrize("subset, lo, classes", [("digits", 0, 10), ("lowercase", 36, 26), ("lowercase_a_j", 36, 10)])
def test_femnist_subsets_keep_and_relabel_their_classes(tmp_path, subset, lo, classes):
    train, _ = write(tmp_path, "femnist", "leaf", writers=8, train=[30] * 8)
    ds, _ = load(tmp_path, "dataset=femnist", f"dataset.subset={subset}")
    labels = np.concatenate([train[w][1] for w in sorted(train)])
    kept = labels[(labels >= lo) & (labels < lo + classes)] - lo
    assert ds.num_classes == classes and ds.y_train.tolist() == kept.tolist()
    assert int(ds.y_train.max()) < classes and int(ds.y_test.numpy().max(initial=0)) < classes


def test_max_clients_is_a_seeded_subset_of_writers(tmp_path):
    train, _ = write(tmp_path, "femnist", "leaf", writers=10)
    a, _ = load(tmp_path, "dataset=femnist", "dataset.max_clients=4")
    b, _ = load(tmp_path, "dataset=femnist", "dataset.max_clients=4")
    c, _ = load(tmp_path, "dataset=femnist", "dataset.max_clients=4", "dataset.split_seed=1")
    assert a.num_devices == 4 and torch.equal(a.x_train, b.x_train)
    pick = sorted(numpy_rng("natural-clients", "femnist", 0).choice(10, size=4, replace=False).tolist())
    other = sorted(numpy_rng("natural-clients", "femnist", 1).choice(10, size=4, replace=False).tolist())
    assert pick != other  # split_seed draws other writers
    writers = sorted(train)
    assert torch.bincount(a.devices).tolist() == [len(train[writers[k]][1]) for k in pick]
    assert torch.bincount(c.devices).tolist() == [len(train[writers[k]][1]) for k in other]
    first = torch.from_numpy(np.rint(train[writers[pick[0]]][0] * 255).astype(np.uint8))
    assert torch.equal(a.x_train[a.devices == 0, 0], first)
    assert a.x_test.shape[0] == 4 * 2  # the kept writers' own test samples
    with pytest.raises(DataSourceError, match=r"dataset.max_clients=11 exceeds the 10 writers"):
        load(tmp_path, "dataset=femnist", "dataset.max_clients=11")


def test_a_split_by_writer_evaluates_on_every_test_writer(tmp_path):
    train, test = tiny.femnist_samples(writers=6)
    tiny.write_leaf_femnist(tmp_path, {w: train[w] for w in sorted(train)[:4]}, {w: test[w] for w in sorted(test)[4:]})
    ds, _ = load(tmp_path, "dataset=femnist")
    assert ds.num_devices == 4 and ds.x_test.shape[0] == 2 * 2


def test_a_split_by_sample_stays_one_when_the_kept_writers_lack_test_samples(tmp_path):
    """The kind of split is decided over all training writers: kept writers without test samples give an error, not
    silently other writers' test samples."""
    train, test = tiny.femnist_samples(writers=6)
    tiny.write_leaf_femnist(tmp_path, train, {w: test[w] for w in sorted(test)[:1]})  # by sample: writer 0 only
    pick = sorted(numpy_rng("natural-clients", "femnist", 0).choice(6, size=2, replace=False).tolist())
    assert 0 not in pick
    with pytest.raises(DataSourceError, match=r"femnist/data/test holds no test sample of the kept writers$"):
        load(tmp_path, "dataset=femnist", "dataset.max_clients=2")


def test_natural_partition_is_one_client_per_writer(tmp_path):
    train, _ = write(tmp_path, "femnist", "tff")
    ds, cfg = load(tmp_path, "dataset=femnist", "partition=natural")
    assert cfg.partition.num_clients is None
    part = make_partition(cfg.partition, ds.y_train.numpy(), ds.num_classes, ds.devices.numpy())
    assert part.num_clients == len(train)
    assert [len(ix) for ix in part.client_indices] == [len(train[w][1]) for w in sorted(train)]
    assert partition_key(cfg.partition, "femnist") == "femnist-natural-all"
    cfg4 = compose(["dataset=femnist", "partition=natural", "dataset.max_clients=4", f"dataset.root={tmp_path}"])
    assert cfg4.partition.num_clients == 4 and partition_key(cfg4.partition, "femnist-c4-s0") == "femnist-c4-s0-natural-n4"


# --------------------------------------------------------------------------- Shakespeare


def test_text_examples_by_hand():
    text = "ab\n  c" + "x" * 80
    x, y, bad = leaf.text_examples(text)
    clean = "ab c" + "x" * 80  # line break -> space, runs of spaces -> one
    assert len(y) == len(clean) - 80 == 4
    assert "".join(leaf.VOCAB[i] for i in x[0]) == clean[:80] and leaf.VOCAB[y[0]] == clean[80]
    assert "".join(leaf.VOCAB[i] for i in x[3]) == clean[3:83] and bad == 0
    assert leaf.text_examples("short")[0].shape == (0, 80)
    codes, bad = leaf.encode_text("a$é}")
    assert bad == 2 and codes.tolist() == [leaf.VOCAB.index(c) for c in "a  }"]
    assert len(leaf.VOCAB) == 80 and len(set(leaf.VOCAB)) == 80


def _speaker_text(snippets):
    """A speaker's text as LEAF writes it: every passage followed by a line break."""
    return "".join(s + "\n" for s in snippets)


def test_leaf_json_by_hand(tmp_path):
    """A LEAF file written here by hand (not by the tiny-file writer): indices, labels, writers, the test split."""
    folder = tmp_path / "shakespeare" / "data"
    (folder / "train").mkdir(parents=True)
    (folder / "test").mkdir()
    x1 = "ab" + " " * 77 + "}"
    (folder / "train" / "a.json").write_text(json.dumps(
        {"users": ["B", "A"], "num_samples": [1, 2],
         "user_data": {"B": {"x": [x1], "y": ["\n"]}, "A": {"x": ["z" * 80, "Z" * 80], "y": ["!", "a"]}}}))
    (folder / "test" / "a.json").write_text(json.dumps(
        {"users": ["A"], "num_samples": [1], "user_data": {"A": {"x": ["0" * 80], "y": ["9"]}}}))
    ds, _ = load(tmp_path, "dataset=shakespeare")
    v = leaf.VOCAB.index
    assert ds.devices.tolist() == [0, 0, 1]  # writers in id order: A, then B
    assert ds.x_train[:, 0, 0, 0].tolist() == [v("z"), v("Z"), v("a")]
    assert ds.x_train[2, 0, 0].tolist() == [v("a"), v("b")] + [v(" ")] * 77 + [79]
    assert ds.y_train.tolist() == [v("!"), v("a"), 0] and v("\n") == 0 and v("}") == 79
    assert ds.x_test[:, 0, 0].tolist() == [[v("0")] * 80] and ds.y_test.tolist() == [v("9")]


def test_tff_snippets_become_leafs_windows_by_hand():
    """Two passages, "x"*79 + "a" and "b": LEAF's text is x..xa b (each passage and a line break, as spaces), 83
    characters, so 3 windows with the labels ' ', 'b', ' '."""
    x, y, bad = leaf.text_examples(_speaker_text(["x" * 79 + "a", "b"]))
    v = leaf.VOCAB.index
    assert [leaf.VOCAB[i] for i in y] == [" ", "b", " "] and bad == 0
    assert x[1].tolist() == [v("x")] * 78 + [v("a"), v(" ")]
    # characters outside the vocabulary become spaces before runs of spaces are collapsed
    x, y, bad = leaf.text_examples("a $ " + "c" * 80)
    assert bad == 1 and "".join(leaf.VOCAB[i] for i in x[0]) == "a " + "c" * 78 and len(y) == 2


@pytest.mark.parametrize("fmt", ["leaf", "tff"])
def test_shakespeare_examples_speakers_and_labels(tmp_path, fmt):
    train, test = write(tmp_path, "shakespeare", fmt)
    ds, _ = load(tmp_path, "dataset=shakespeare")
    speakers = sorted(train)
    sizes = [len(leaf.text_examples(_speaker_text(train[u]))[1]) for u in speakers]
    assert sum(sizes) == ds.x_train.shape[0]
    assert ds.x_train.shape[1:] == (1, 1, 80) and ds.x_train.dtype == torch.uint8 and ds.num_classes == 80
    assert torch.bincount(ds.devices).tolist() == sizes and ds.num_devices == len(speakers)
    # every example is a window of the speaker's cleaned text and its label the next character
    x0, y0, _ = leaf.text_examples(_speaker_text(train[speakers[0]]))
    assert torch.equal(ds.x_train[: len(y0), 0, 0], torch.from_numpy(x0)) and ds.y_train[: len(y0)].tolist() == y0.tolist()
    assert ds.x_test.shape[0] == sum(len(leaf.text_examples(_speaker_text(test[u]))[1]) for u in speakers)
    assert (ds.scale, ds.mean, ds.std) == (1.0, (0.0,), (1.0,))
    assert torch.equal(ds.normalize(ds.x_train[:2]), ds.x_train[:2].float())  # indices as floats, unchanged


def test_leaf_shakespeare_refuses_a_character_outside_the_vocabulary(tmp_path):
    write(tmp_path, "shakespeare", "leaf")
    path = next((tmp_path / "shakespeare" / "data" / "train").glob("*.json"))
    blob = json.loads(path.read_text())
    user = blob["users"][0]
    blob["user_data"][user]["x"][0] = "$" + blob["user_data"][user]["x"][0][1:]
    path.write_text(json.dumps(blob))
    with pytest.raises(DataSourceError) as err:
        load(tmp_path, "dataset=shakespeare")
    assert str(err.value) == (f"dataset.root: {path} (user {user!r}): the character '$' is not in LEAF's "
                              f"80-character vocabulary")


# --------------------------------------------------------------------------- errors: one line naming the file


def test_missing_files_name_what_to_put_where(tmp_path):
    for name in ("femnist", "shakespeare"):
        with pytest.raises(DataSourceError) as err:
            load(tmp_path, f"dataset={name}")
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"dataset.root: no {'FEMNIST' if name == 'femnist' else 'Shakespeare'} files under {tmp_path}")
        assert f"{tmp_path / name / 'data' / 'train'}/*.json" in text and leaf.TFF_FILES[name][0] in text
        assert leaf.TFF_ARCHIVES[name] in text


def test_a_missing_test_split_is_named(tmp_path):
    write(tmp_path, "femnist", "tff")
    (tmp_path / "fed_emnist_test.h5").unlink()
    with pytest.raises(DataSourceError, match=r"fed_emnist_test.h5 is missing; put LEAF"):
        load(tmp_path, "dataset=femnist")


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "is not a LEAF JSON file (truncated or corrupt"),
    (lambda p: p.write_text(json.dumps({"users": ["u"]})), "is not a LEAF femnist file (it needs 'users' and 'user_data')"),
    (lambda p: p.write_text(json.dumps({"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}})),
     "user 'u' has 1 x and 1 y, num_samples 2; the file is truncated or corrupt"),
    (lambda p: p.write_text(json.dumps({"users": ["u"], "user_data": {"u": {"x": [[0.5] * 700], "y": [1]}}})),
     "(user 'u'): x has shape [1, 700] for 1 labels, expected [1, 784] or [1, 28, 28]"),
    (lambda p: p.write_text(json.dumps({"users": ["u"], "user_data": {"u": {"x": [[0.5] * 784], "y": [62]}}})),
     "(user 'u'): labels must lie in 0..61, got 62..62"),
])
def test_a_broken_leaf_file_is_named_in_one_line(tmp_path, damage, message):
    write(tmp_path, "femnist", "leaf")
    path = sorted((tmp_path / "femnist" / "data" / "train").glob("*.json"))[0]
    damage(path)
    with pytest.raises(DataSourceError) as err:
        load(tmp_path, "dataset=femnist")
    assert "\n" not in str(err.value) and str(path) in str(err.value) and message in str(err.value)


def test_a_broken_h5_file_is_named_in_one_line(tmp_path):
    import h5py

    write(tmp_path, "femnist", "tff")
    path = tmp_path / "fed_emnist_train.h5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(DataSourceError, match=r"fed_emnist_train.h5 is not a readable HDF5 file \(truncated or corrupt"):
        load(tmp_path, "dataset=femnist")
    path.unlink()
    with h5py.File(path, "w") as f:
        f.create_dataset("pixels", data=np.zeros((2, 28, 28), np.float32))
    with pytest.raises(DataSourceError, match=r"fed_emnist_train.h5 has no 'examples' group"):
        load(tmp_path, "dataset=femnist")
    path.unlink()
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/w1/pixels", data=np.zeros((2, 28, 28), np.float32))
    with pytest.raises(DataSourceError, match=r"client 'w1' lacks .*label"):
        load(tmp_path, "dataset=femnist")
    path.unlink()
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/w1/pixels", data=np.zeros((2, 28, 27), np.float32))
        f.create_dataset("examples/w1/label", data=np.zeros(2, np.int32))
    with pytest.raises(DataSourceError, match=r"\(client 'w1'\): x has shape \[2, 28, 27\] for 2 labels"):
        load(tmp_path, "dataset=femnist")


def test_download_failure_is_one_line(tmp_path, monkeypatch):
    def offline(name, root):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(leaf, "download", offline)
    with pytest.raises(DataSourceError) as err:
        load(tmp_path, "dataset=shakespeare", "dataset.download=true")
    assert str(err.value) == (f"dataset.download: could not download shakespeare into {tmp_path} (OSError: [Errno -3] "
                              f"Temporary failure in name resolution); place the official files there and set "
                              f"dataset.download=false")


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, message", [
    (["dataset=femnist", "partition=natural", "partition.num_clients=5"],
     "partition.num_clients=5 must equal dataset.max_clients=null with partition=natural (one client per writer; set "
     "dataset.max_clients, null for all of them)"),
    (["dataset=shakespeare", "dataset.subset=digits"],
     "dataset.subset has no effect with dataset.name=shakespeare: it is used only with dataset.name=femnist; remove it"),
    (["dataset=shakespeare", "train.augmentation=crop_flip"],
     "train.augmentation=crop_flip flips and crops images; dataset=shakespeare holds character sequences (use "
     "train.augmentation=none)"),
    (["partition=iid", "partition.num_clients=null"],
     "partition.num_clients=null counts the devices of partition=natural; partition=iid needs a number of clients"),
    (["dataset=femnist", "dataset.verify=false"],
     "dataset.verify has no effect with dataset.name=femnist: it is used only with dataset.name!=digits|synthetic|"
     "mnist1d|quadratic|femnist|shakespeare; remove it"),
    (["dataset=shakespeare", "dataset.validation_fraction=0.1"],
     "dataset.validation_fraction=0.1: dataset=shakespeare's examples are overlapping windows of the same text, so a "
     "held-out share is not unseen; tune on the test split of other speakers instead (set it to 0)"),
    (["dataset=femnist", "partition=natural", "dataset.validation_fraction=0.1"],
     "dataset.validation_fraction=0.1 does not compose with partition=natural on dataset=femnist: the held-out share "
     "is drawn over all writers and may take a writer's every sample (set it to 0)"),
    (["dataset=synthetic", "partition=natural", "partition.num_clients=null"],
     "partition.num_clients=null must equal dataset.num_devices=30 with partition=natural (one client per device; "
     "set dataset.num_devices)"),
    (["partition=iid", "partition.balance_cap=false"],
     "partition.balance_cap has no effect with partition.name=iid: it is used only with partition.name=dirichlet; "
     "remove it"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value) == message


def test_labels_of_the_new_partition_keys():
    from pipeline.labels import partition_label

    assert partition_label("femnist-natural-all") == "FEMNIST, natural"
    assert partition_label("shakespeare-c143-s0-natural-n143", verbose=True) == (
        "Shakespeare (143 speakers), natural (143 devices)")
    capped = "digits-dirichlet-per_class-a0.1-n100-min1-s0"
    assert partition_label(capped) == "Dirichlet \u03b1=0.1 (per class)"
    assert partition_label(capped.replace("-s0", "-nocap-s0")) == "Dirichlet \u03b1=0.1 (per class, no cap)"


def test_new_keys_leave_earlier_fingerprints_alone():
    """Keys added for these datasets count only where they apply (the pinned fingerprints of tests/test_experiment.py
    hold the rest); balance_cap only when false."""
    base = compose(["partition=dirichlet", "partition.variant=per_class"])
    uncapped = compose(["partition=dirichlet", "partition.variant=per_class", "partition.balance_cap=false"])
    assert fingerprint(base) != fingerprint(uncapped)
    a = compose(["dataset=femnist", "partition=natural"])
    b = compose(["dataset=femnist", "partition=natural", "dataset.subset=digits"])
    c = compose(["dataset=femnist", "partition=natural", "dataset.max_clients=3"])
    assert len({fingerprint(a), fingerprint(b), fingerprint(c)}) == 3


def test_prepared_cache_follows_subset_writers_root_and_files(tmp_path, monkeypatch):
    from fl_core.data import sources

    write(tmp_path / "raw", "femnist", "leaf", writers=8, test=30)
    data = tmp_path / "data"
    cfgs = [compose(["dataset=femnist", f"dataset.root={tmp_path / 'raw'}", *o]).dataset
            for o in ([], ["dataset.subset=digits"], ["dataset.max_clients=3"])]
    sets = [get_dataset(c, data, ROOT) for c in cfgs]
    assert sorted(p.name for p in (data / "prepared").iterdir()) == ["femnist-c3-s0.pt", "femnist-digits.pt",
                                                                      "femnist.pt"]
    reads = []
    real = sources.load_source
    monkeypatch.setattr(sources, "load_source", lambda cfg, root: reads.append(root) or real(cfg, root))
    again = get_dataset(cfgs[2], data, ROOT)  # the same files: the prepared copy
    assert reads == [] and torch.equal(again.devices, sets[2].devices) and sets[2].num_devices == 3
    # another root with other files of the same names: read afresh, not the stale copy
    write(tmp_path / "other", "femnist", "leaf", writers=8, test=30, seed=1)
    moved = get_dataset(compose(["dataset=femnist", f"dataset.root={tmp_path / 'other'}"]).dataset, data, ROOT)
    assert reads == [(tmp_path / "other").resolve()] and not torch.equal(moved.x_train, sets[0].x_train)
    # the files made again in place (LEAF's preprocessing with other flags): read afresh
    import shutil

    shutil.rmtree(tmp_path / "raw" / "femnist")
    write(tmp_path / "raw", "femnist", "leaf", writers=5, test=30)
    fresh = get_dataset(cfgs[0], data, ROOT)
    assert len(reads) == 2 and fresh.num_devices == 5


# --------------------------------------------------------------------------- char_lstm


def test_lstm_layer_is_torch_lstm():
    torch.manual_seed(0)
    ref = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True)
    first, second = LSTMLayer(8, 16), LSTMLayer(16, 16)
    state = ref.state_dict()
    first.load_state_dict({k: v for k, v in state.items() if k.endswith("_l0")})
    second.load_state_dict({k.replace("_l1", "_l0"): v for k, v in state.items() if k.endswith("_l1")})
    x = torch.randn(5, 12, 8)
    assert torch.allclose(ref(x)[0], second(first(x)), atol=1e-6)


def test_char_lstm_has_the_papers_size_and_units():
    model = build_model(compose(["dataset=shakespeare"]).model, "shakespeare", (1, 1, 80), 80)
    assert sum(p.numel() for p in model.parameters()) == 819_920
    assert [u[0].split(".")[0] for u in model.units()] == ["embed", "lstm1", "lstm2", "fc"]
    logits, feats = model.forward_features(torch.randint(0, 80, (3, 1, 1, 80)).float())
    assert logits.shape == (3, 80) and feats.shape == (3, 256)
    with pytest.raises(ValueError, match=r"model.name=char_lstm reads character sequences \[1, 1, L\]"):
        build_model(compose(["dataset=femnist", "model=char_lstm"]).model, "femnist", (1, 28, 28), 62)


def _run(root, data_dir, overrides, executor):
    from pipeline.api import run

    base = ["train.batch_size=10", "engine.progress=false", "tracking.enabled=false",
            "engine.checkpoint_every=0", "engine.dtype=float64", f"engine.executor={executor}", f"data_dir={data_dir}",
            f"dataset.root={root}", "partition=natural", "train.participation=1.0"]
    return run(list(overrides) + base, seeds=(1,))


# the LSTM's runs take 13 s each on 2 cores: they run with the slow tests
@pytest.mark.parametrize("name, rounds, steps", [("femnist", 2, 2),
                                                 pytest.param("shakespeare", 1, 1, marks=pytest.mark.slow),
                                                 pytest.param("shakespeare", 2, 2, marks=pytest.mark.slow)])
def test_both_executors_agree(tmp_path, name, rounds, steps):
    write(tmp_path / "raw", name, "leaf", **({"speakers": 2} if name == "shakespeare" else {"writers": 4}))
    over = [f"dataset={name}", f"train.local_steps={steps}", f"train.rounds={rounds}"]
    seq = _run(tmp_path / "raw", tmp_path / "data", over, "sequential")
    vec = _run(tmp_path / "raw", tmp_path / "data", over, "vectorized")
    assert list(seq.history["round"]) == list(range(1, rounds + 1)) and np.isfinite(seq.history["test_loss"]).all()
    for key, p in seq.models[1].items():
        assert torch.allclose(p, vec.models[1][key], atol=1e-9), key
    classes = 62 if name == "femnist" else 80
    assert not np.isclose(seq.history["test_loss"].iloc[-1], np.log(classes), atol=1e-6)


# --------------------------------------------------------------------------- partition.balance_cap


def _plain_per_class(labels, num_classes, n, alpha, min_size, rng):
    """The plain per-class Dirichlet split, written out: per class, proportions p ~ Dir(alpha 1_N) and the class's
    shuffled indices cut at floor(cumsum(p) * n_c); drawn again until every client holds min_size samples."""
    while True:
        counts = np.zeros((n, num_classes), np.int64)
        for c in range(num_classes):
            members = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(n, alpha))
            cuts = (np.cumsum(p / p.sum()) * len(members)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(members, cuts)):
                counts[j, c] = len(piece)
        if counts.sum(axis=1).min() >= min_size:
            return counts


def test_balance_cap_false_is_the_plain_per_class_split():
    labels = np.repeat(np.arange(4), 25)  # 4 classes x 25 samples, 5 clients: |D|/N = 20
    alpha = 0.1
    cfg = PartitionConfig(name="dirichlet", variant="per_class", num_clients=5, alpha=alpha, min_size=1,
                          balance_cap=False)
    part = make_partition(cfg, labels, 4)
    expected = _plain_per_class(labels, 4, 5, alpha, 1, numpy_rng("partition", 0))
    assert np.asarray(part.label_hist).tolist() == expected.tolist()
    # the capped split of the same draws: a client already at |D|/N gets none of the later classes
    capped = make_partition(PartitionConfig(name="dirichlet", variant="per_class", num_clients=5, alpha=alpha,
                                            min_size=1), labels, 4)
    hist = np.asarray(capped.label_hist)
    for c in range(1, 4):
        full = hist[:, :c].sum(axis=1) >= 20
        assert (hist[full, c] == 0).all()
    assert hist.tolist() != expected.tolist()  # at alpha 0.1 the cap binds on this draw
    assert sorted(np.concatenate(part.client_indices).tolist()) == list(range(100))


def test_balance_cap_in_the_partition_key_only_when_off():
    on = PartitionConfig(name="dirichlet", variant="per_class", num_clients=5, alpha=0.5)
    off = PartitionConfig(name="dirichlet", variant="per_class", num_clients=5, alpha=0.5, balance_cap=False)
    assert partition_key(on, "digits") == "digits-dirichlet-per_class-a0.5-n5-min10-s0"
    assert partition_key(off, "digits") == "digits-dirichlet-per_class-a0.5-n5-min10-nocap-s0"


def test_the_uncapped_split_can_be_asked_for_directly():
    labels = np.repeat(np.arange(3), 10)
    rng = numpy_rng("partition", 3)
    idx = _dirichlet_per_class(labels, 3, 4, 0.2, 1, rng, balance_cap=False)
    assert sorted(np.concatenate(idx).tolist()) == list(range(30)) and min(map(len, idx)) >= 1


# --------------------------------------------------------------------------- studies/natural without the files


@pytest.mark.slow  # the study's dvc repro in a subprocess (about 13 s)
def test_the_natural_study_stops_in_one_line_naming_what_to_put_where(tmp_path, monkeypatch, capsys):
    """What `cd studies/natural && dvc repro` runs first (its prepare stage), with the study's params and a data/raw
    that holds nothing: exit status 2 and one line on stderr naming the files and where they are published."""
    import yaml

    from pipeline import prepare

    params = yaml.safe_load((ROOT / "studies" / "natural" / "params.yaml").read_text())
    assert params["dataset"] == {"root": "../../data/raw"}
    raw = tmp_path / "raw"
    raw.mkdir()
    params["dataset"]["root"] = str(raw)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        prepare.main(["--params", "params.yaml"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: dataset.root: no FEMNIST files under {raw}; put LEAF's JSON")
    assert f"{raw}/fed_emnist_train.h5" in err and leaf.TFF_ARCHIVES["femnist"] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "raw"]  # no data folder was made
    assert list(raw.iterdir()) == []  # nothing written where the user's files go


# --------------------------------------------------------------------------- the acceptance commands, as printed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["femnist", "shakespeare"])
@pytest.mark.parametrize("fmt", ["leaf", "tff"])
def test_fl_train_runs_two_rounds_on_tiny_files(tmp_path, name, fmt):
    """`fl-train dataset=<name> dataset.root=DIR partition=natural train.rounds=2` on tiny files of each format."""
    import os
    import subprocess

    root = tmp_path / "tiny"
    write(root, name, fmt)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", f"dataset={name}", f"dataset.root={root}",
                           "partition=natural", "train.rounds=2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = (tmp_path / "results" / f"fedavg_natural_{name}" / "runs.csv").read_text().splitlines()
    assert len(runs) == 1 + 2  # a header and the two rounds of the one seed
    assert f"fedavg_natural_{name}: final test accuracy" in proc.stdout
