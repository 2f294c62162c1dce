"""Tests for ncljax.data.vectors: a folder of your own image and caption vectors.

Oracle: folders written here with ``np.save`` and plain text files in the documented
layout; every vector read back must equal the written row (float16 rows widen to float32
exactly), labels and texts the written ones. Every malformed file is refused with one
line naming that file (and nothing else is needed to find it).
"""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config import presets, validation
from ncljax.data import noise, sources, synthetic, vectors, worlds
from ncljax.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"train": 12, "val": 11, "test": 11}  # images per split (Recall@10 needs 11)
# The config files that take ':vectors' (every method's), and whether they train on labels.
VECTORS_CONFIGS = {name: methods.family(name) == "labels" for name in methods.REGISTRY}


def make_arrays(*, cpi=1, dtype=np.float32, d_img=6, d_txt=4, labels=False, texts=False, seed=0):
    """Random vectors (no zero rows) of every split, with optional labels and text lines."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in SIZES.items():
        arrays = {
            "images": rng.normal(size=(n, d_img)).astype(dtype),
            "texts": rng.normal(size=(n * cpi, d_txt)).astype(dtype),
        }
        if labels:
            arrays["labels"] = rng.integers(0, 3, size=n).astype(np.int32)
            arrays["labels"][0] = 3  # the largest class: num_classes = 4
        if texts:
            arrays["captions"] = [f"{split} caption {k} é" for k in range(n * cpi)]
            arrays["image_ids"] = [f"{split}/img{i}.jpg" for i in range(n)]
        out[split] = arrays
    return out


def write(folder, splits):
    """The layout written by hand (not by ``vectors.write_folder``)."""
    os.makedirs(folder, exist_ok=True)
    for split, arrays in splits.items():
        for kind in ("images", "texts", "labels"):
            if kind in arrays:
                np.save(os.path.join(folder, f"{split}_{kind}.npy"), arrays[kind])
        for kind in ("captions", "image_ids"):
            if kind in arrays:
                with open(os.path.join(folder, f"{split}_{kind}.txt"), "w", encoding="utf-8") as f:
                    f.write("".join(line + "\n" for line in arrays[kind]))
    return str(folder)


def data_config(folder, **fields):
    cfg = sources.default_config("vectors")
    cfg.folder = str(folder)
    cfg.update(fields)
    return cfg


def load(folder, **fields):
    return sources.load_dataset(data_config(folder, **fields))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("cpi", [1, 5])
@pytest.mark.parametrize("extras", [False, True])
def test_the_folder_reads_back_what_was_written(tmp_path, dtype, cpi, extras):
    arrays = make_arrays(cpi=cpi, dtype=dtype, labels=extras, texts=extras)
    dataset = load(write(tmp_path, arrays))
    info = dataset.info
    assert (info.name, info.captions_per_image, info.image_dim, info.text_dim) == (
        "vectors",
        cpi,
        6,
        4,
    )
    assert info.num_classes == (4 if extras else 0)
    assert info.split_sizes == {s: (n, n * cpi) for s, n in SIZES.items()}
    for split, written in arrays.items():
        source = dataset.split(split)
        assert isinstance(source.images, np.memmap) and isinstance(source.texts, np.memmap)
        assert source.images.dtype == dtype and source.texts.dtype == dtype
        np.testing.assert_array_equal(source.images, written["images"])
        np.testing.assert_array_equal(source.texts, written["texts"])
        labels = written["labels"] if extras else np.full(SIZES[split], -1)
        np.testing.assert_array_equal(source.image_labels(), labels)
        for i in range(source.num_images):
            image = source.image(i)
            assert image["global_image"].dtype == np.float32
            np.testing.assert_array_equal(image["global_image"], written["images"][i])
            assert image["label"] == labels[i]
        for k in range(source.num_captions):
            caption = source.caption(k)
            np.testing.assert_array_equal(caption["global_text"], written["texts"][k])
            assert caption["label"] == labels[k // cpi]
        ids, captions = vectors.display_texts(data_config(tmp_path), split)
        assert (ids and list(ids)) == (written["image_ids"] if extras else None)
        assert (captions and list(captions)) == (written["captions"] if extras else None)


def test_the_training_pairs_are_the_folders_rows(tmp_path):
    """Through the pipeline: pair k is image k // cpi with text k (the folder's own pairs)."""
    from ncljax.data import pipeline

    arrays = make_arrays(cpi=5, dtype=np.float16, labels=True)
    split = load(write(tmp_path, arrays)).split("train")
    cfg = config_lib.base_config().noise  # kind 'none'
    pairs = pipeline.training_pairs(
        split, cfg, num_classes=4, image_fields=("global_image",), text_fields=("global_text",)
    )
    for k in (0, 7, 59):
        record = pairs.record_fn(k)
        np.testing.assert_array_equal(record["global_image"], arrays["train"]["images"][k // 5])
        np.testing.assert_array_equal(record["global_text"], arrays["train"]["texts"][k])
        assert record["label_image"] == arrays["train"]["labels"][k // 5]


def test_write_folder_writes_the_layout(tmp_path):
    arrays = make_arrays(cpi=5, labels=True, texts=True)
    vectors.write_folder(str(tmp_path / "a"), arrays, dtype=np.float16)
    write(
        tmp_path / "b",
        {
            s: {
                **a,
                "images": a["images"].astype(np.float16),
                "texts": a["texts"].astype(np.float16),
            }
            for s, a in arrays.items()
        },
    )
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b")) and len(names) == 15
    for name in names:
        with open(tmp_path / "a" / name, "rb") as a, open(tmp_path / "b" / name, "rb") as b:
            assert a.read() == b.read(), name
    with pytest.raises(ValueError, match=r"train captions \[1\] hold a line break"):
        vectors.write_folder(
            str(tmp_path / "c"), {"train": {**arrays["train"], "captions": ["a", "b\nc"]}}
        )


# ----------------------------------------------------------------------------- refusals


def _refused(tmp_path, splits, error=ValueError, **fields):
    """The one-line message of the refusal of folder ``splits``."""
    folder = write(tmp_path, splits)
    with pytest.raises(error) as caught:
        load(folder, **fields)
    message = str(caught.value)
    assert "\n" not in message
    return message


def _with(split, **changes):
    arrays = make_arrays(labels="labels" in changes, texts=True)
    arrays[split].update(changes)
    return arrays


def test_a_missing_file_names_it_and_the_layout(tmp_path):
    arrays = make_arrays()
    del arrays["val"]["texts"]
    message = _refused(tmp_path, arrays, FileNotFoundError)
    assert "lacks val_texts.npy:" in message and "{split}_images.npy" in message
    message = _refused(tmp_path / "b", make_arrays(), FileNotFoundError, require_labels=True)
    assert "lacks train_labels.npy, val_labels.npy, test_labels.npy" in message


def test_labels_in_some_splits_only_are_refused(tmp_path):
    arrays = make_arrays(labels=True)
    del arrays["test"]["labels"]
    message = _refused(tmp_path, arrays, FileNotFoundError)
    assert "lacks test_labels.npy" in message and "every split or in none" in message


def test_an_unset_or_absent_folder_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^data.folder is empty: pass .*--config.data.folder="):
        load("")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("split", "kind", "value", "expected"),
    [
        ("train", "images", np.ones(12, np.float32), r"shape \(12,\); expected a 2-D array"),
        ("val", "texts", np.ones((11, 2, 2), np.float32), r"shape \(11, 2, 2\); expected a 2-D"),
        ("test", "images", np.ones((0, 6), np.float32), r"empty array of shape \(0, 6\)"),
        ("train", "texts", np.ones((12, 4)), "has dtype float64; expected float16 or float32"),
        ("val", "images", np.ones((11, 6), np.int32), "has dtype int32; expected float16"),
        ("test", "texts", np.ones((11, 4), ">f4"), "has dtype >f4; expected float16"),
        ("val", "texts", np.asfortranarray(np.ones((11, 4), np.float32)), "column-major"),
    ],
)
def test_a_malformed_array_is_named(tmp_path, split, kind, value, expected):
    message = _refused(tmp_path, _with(split, **{kind: value}))
    assert message.startswith(os.path.join(str(tmp_path), f"{split}_{kind}.npy") + " ")
    assert re.search(expected, message), message


def test_a_file_that_is_not_npy_or_is_truncated_is_named(tmp_path):
    folder = write(tmp_path, make_arrays())
    path = os.path.join(folder, "val_images.npy")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(ValueError, match=rf"^{path} is truncated: .*\(11, 6\) float32"):
        load(folder)
    with open(path, "wb") as f:
        f.write(b"a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match=rf"^{path} is not a .npy array file"):
        load(folder)


def _replace_with(path, what):
    os.remove(path)
    if what == "folder":
        os.mkdir(path)
    elif what == "dangling link":
        os.symlink(path + ".gone", path)
    else:  # a pipe: opening it would wait for a writer
        os.mkfifo(path)


@pytest.mark.parametrize("what", ["folder", "dangling link", "pipe"])
@pytest.mark.parametrize("name", ["train_images.npy", "val_labels.npy", "test_captions.txt"])
def test_a_file_name_held_by_something_else_is_named(tmp_path, what, name):
    # A folder named train_captions.txt was read as no captions, and the run trained
    # without them; a folder, link or pipe named train_images.npy was "missing".
    folder = write(tmp_path, make_arrays(labels=True, texts=True))
    _replace_with(os.path.join(folder, name), what)
    with pytest.raises(ValueError, match=rf"^{re.escape(os.path.join(folder, name))} is (a|not)"):
        load(folder)
    if name.startswith("test"):  # display_texts reads the test split's texts too
        with pytest.raises(ValueError, match="put the file itself there, or remove it"):
            vectors.display_texts(folder, "test")


def test_dimensions_that_differ_between_splits_name_the_files(tmp_path):
    message = _refused(tmp_path, _with("test", images=np.ones((11, 5), np.float32)))
    assert "different dimensions" in message
    assert "train_images.npy (12, 6)" in message and "test_images.npy (11, 5)" in message


@pytest.mark.parametrize(("split", "rows", "ratio"), [("val", 23, "2.09091"), ("train", 24, "2")])
def test_captions_per_image_must_be_one_whole_number(tmp_path, split, rows, ratio):
    """23 texts for 11 images is no whole number; 24 for 12 is 2, where the others hold 1."""
    message = _refused(tmp_path, _with(split, texts=np.ones((rows, 4), np.float32)))
    assert message.startswith("captions_per_image (text rows / image rows) must be the same")
    assert f"{split}_texts.npy ({rows}, 4) / {split}_images.npy ({SIZES[split]}, 6) = {ratio}" in (
        message
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_nan_and_inf_rows_are_counted_and_named(tmp_path, bad, dtype):
    texts = make_arrays()["val"]["texts"].astype(dtype)
    texts[[3, 7], 1] = bad
    message = _refused(tmp_path, _with("val", texts=texts))
    path = os.path.join(str(tmp_path), "val_texts.npy")
    assert message.startswith(f"{path} holds NaN or infinite values in 2 of its 11 rows")
    assert "(first: 3, 7)" in message


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_all_zero_rows_are_counted_and_named(tmp_path, dtype):
    images = make_arrays()["train"]["images"].astype(dtype)
    images[[0, 4]] = 0.0
    images[9] = -0.0  # a negative zero is zero
    images[10] = np.finfo(dtype).smallest_subnormal  # tiny but not zero
    message = _refused(tmp_path, _with("train", images=images))
    path = os.path.join(str(tmp_path), "train_images.npy")
    assert message.startswith(f"{path} has 3 all-zero rows of 12 (first: 0, 4, 9)")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_value_scan_in_small_chunks_finds_the_rows_numpy_finds(tmp_path, monkeypatch, dtype):
    """Chunks of a few rows (boundaries everywhere); oracle: numpy over the whole array."""
    rng = np.random.default_rng(1)
    array = rng.normal(size=(103, 9)).astype(dtype)
    array[rng.choice(103, 30, replace=False), rng.integers(9, size=30)] = np.nan
    array[[5, 40, 41, 102]] = 0.0
    path = str(tmp_path / "a.npy")
    np.save(path, array)
    header = vectors.read_header(path)
    bad = np.flatnonzero(~np.isfinite(array.astype(np.float64)).all(1))
    zero = np.flatnonzero(~array.astype(np.float64).any(1))
    for chunk_rows in (1, 4, 7, 103, 1000):
        monkeypatch.setattr(vectors, "CHUNK_BYTES", chunk_rows * 9 * array.itemsize)
        with pytest.raises(ValueError, match=f"in {bad.size} of its 103 rows") as caught:
            vectors.check_values(header)
        first = ", ".join(map(str, bad[:5]))
        assert f"(first: {first}, ...)" in str(caught.value)
        finite = np.where(np.isfinite(array), array, 1).astype(dtype)
        np.save(path, finite)
        with pytest.raises(ValueError, match=f"has {zero.size} all-zero rows of 103 "):
            vectors.check_values(header)
        np.save(path, array)


def test_line_counts_that_disagree_name_the_text_file(tmp_path):
    arrays = _with("val", captions=[f"c{k}" for k in range(10)])
    message = _refused(tmp_path, arrays)
    path = os.path.join(str(tmp_path), "val_captions.txt")
    assert message.startswith(f"{path} has 10 lines but val_texts.npy has 11 rows")
    arrays = _with("test", image_ids=[f"i{k}" for k in range(12)])
    message = _refused(tmp_path / "b", arrays)
    path = os.path.join(str(tmp_path / "b"), "test_image_ids.txt")
    assert message.startswith(f"{path} has 12 lines but test_images.npy has 11 rows")


def test_text_files_that_are_not_utf8_are_named(tmp_path):
    folder = write(tmp_path, make_arrays(texts=True))
    path = os.path.join(folder, "train_captions.txt")
    with open(path, "r+b") as f:
        f.seek(0, 2)
        f.write(b"\xff\n")
    with pytest.raises(ValueError, match=rf"^{path} is not UTF-8 \(line 13\)"):
        load(folder)


def test_lines_are_counted_as_they_are_read(tmp_path):
    """A last line without a newline counts; a CRLF file reads without the CRs."""
    for content, lines in [
        (b"", []),
        (b"a", ["a"]),
        (b"a\n", ["a"]),
        (b"a\nb", ["a", "b"]),
        (b"a\r\n\r\nc\r\n", ["a", "", "c"]),
        (b"\n", [""]),
        ("é\u2028x\n".encode(), ["é\u2028x"]),  # a Unicode line separator is no newline
    ]:
        path = tmp_path / "t.txt"
        path.write_bytes(content)
        assert vectors.count_lines(str(path)) == len(lines), content
        assert vectors.read_lines(str(path)) == lines, content


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (np.zeros((12, 1), np.int64), r"shape \(12, 1\); expected \(12,\)"),
        (np.zeros(11, np.int64), r"shape \(11,\); expected \(12,\)"),
        (np.zeros(12, np.float32), "has dtype float32; expected integer class ids"),
        (np.array([0] * 10 + [-1, -2]), r"2 negative labels \(first at rows 10, 11\)"),
    ],
)
def test_malformed_labels_are_named(tmp_path, labels, expected):
    arrays = make_arrays(labels=True)
    arrays["train"]["labels"] = labels
    message = _refused(tmp_path, arrays)
    assert message.startswith(os.path.join(str(tmp_path), "train_labels.npy") + " ")
    assert re.search(expected, message), message


def test_display_texts_checks_the_counts_against_the_headers(tmp_path):
    folder = write(tmp_path, make_arrays(texts=True))
    with open(os.path.join(folder, "test_captions.txt"), "a", encoding="utf-8") as f:
        f.write("one too many\n")
    ids, captions = vectors.display_texts(folder, "val")  # the folder's path works too
    assert ids[0] == "val/img0.jpg" and captions[-1] == "val caption 10 é"
    with pytest.raises(ValueError, match=r"has 12 lines but test_texts\.npy has 11 rows"):
        vectors.display_texts(data_config(folder), "test")
    with pytest.raises(ValueError, match="Unknown split 'dev'"):
        vectors.display_texts(folder, "dev")


# ----------------------------------------------------------------------------- hostile input


def _write_npy(path, descr, shape, data=b""):
    """A ``.npy`` file whose header says ``descr`` and ``shape``, followed by ``data``."""
    with open(path, "wb") as f:
        header = {"descr": descr, "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(f, header)
        f.write(data)


@pytest.mark.parametrize(
    ("dtype", "label", "largest"),
    [(np.int64, 10**9, "1000000000"), (np.uint64, 2**63 + 5, "9223372036854775813")],
)
def test_class_ids_beyond_the_number_of_images_are_refused(tmp_path, dtype, label, largest):
    """34 images hold at most 34 classes: one id of 10**9 would make 10**9 + 1 of them, and
    a uint64 id above 2**63 is too large, not negative."""
    arrays = make_arrays(labels=True)
    arrays["train"]["labels"] = arrays["train"]["labels"].astype(dtype)
    arrays["train"]["labels"][[3, 7]] = label
    message = _refused(tmp_path, arrays)
    path = os.path.join(str(tmp_path), "train_labels.npy")
    assert message.startswith(f"{path} holds 2 class ids of 34 or more (first at rows 3, 7; ")
    assert f"the largest is {largest})" in message and "np.unique" in message
    assert "negative" not in message
    arrays["train"]["labels"][[3, 7]] = 33  # the largest id 34 images can number
    assert load(write(tmp_path / "b", arrays)).info.num_classes == 34


@pytest.mark.parametrize("kind", ["images", "labels"])
def test_a_pickled_array_is_refused_unread(tmp_path, kind):
    arrays = make_arrays(labels=True)
    arrays["val"][kind] = arrays["val"][kind].astype(object)  # np.save pickles it
    message = _refused(tmp_path, arrays)
    path = os.path.join(str(tmp_path), f"val_{kind}.npy")
    assert message.startswith(f"{path} holds a pickled array of Python objects"), message
    save_as = {"images": "float32", "labels": "int64"}[kind]
    assert f"np.asarray(array, np.{save_as}), allow_pickle=False)" in message


@pytest.mark.parametrize("descr", [("<f4", (2,)), [("a", "<f4")]])
def test_a_subarray_or_structured_dtype_is_named(tmp_path, descr):
    folder = write(tmp_path, make_arrays())
    path = os.path.join(folder, "train_images.npy")
    _write_npy(path, descr, (12, 6), b"\x00\x00\x80\x3f" * 12 * 6 * np.dtype(descr).itemsize)
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} has the structured dtype "):
        load(folder)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((2**32, 2**32), "is truncated: "),  # 2**64 rows x dim: 0 in int64
        ((2**62, 2**40), "is truncated: "),
        ((-12, 6), r"has a damaged header: its shape \(-12, 6\) has a negative dimension"),
    ],
)
def test_an_impossible_header_is_refused_before_the_data_is_read(tmp_path, shape, expected):
    """A 128-byte header cannot promise more data than its file holds, nor a negative size."""
    folder = write(tmp_path, make_arrays())
    path = os.path.join(folder, "train_images.npy")
    _write_npy(path, "<f4", shape, b"\x00" * 64)
    with pytest.raises(ValueError, match=f"^{re.escape(path)} {expected}"):
        vectors.read_header(path)
    with pytest.raises(ValueError, match=f"^{re.escape(path)} {expected}"):
        load(folder)


def test_a_header_numpy_cannot_read_says_how_to_write_the_file(tmp_path):
    # "... is not a .npy array file: descr is not a valid dtype descriptor: '<zz'." said
    # nothing of what to do.
    path = str(tmp_path / "train_images.npy")
    _write_npy(path, "<zz", (3, 2))
    with pytest.raises(ValueError, match=r"descriptor: '<zz'; write the array with np\.save"):
        vectors.read_header(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_folder_or_file_is_named(tmp_path):
    folder = write(tmp_path / "folder", make_arrays(texts=True))
    path = os.path.join(folder, "val_texts.npy")
    for denied, expected in [(folder, f"The folder {folder}"), (path, path)]:
        os.chmod(denied, 0)
        try:
            with pytest.raises(PermissionError, match=rf"^{re.escape(expected)} cannot be read"):
                load(folder)
        finally:
            os.chmod(denied, 0o755)


@pytest.mark.parametrize("name", ["", "val_texts.npy", "test_labels.npy", "train_captions.txt"])
def test_a_path_without_read_permission_is_named(tmp_path, monkeypatch, name):
    """The permission check, as root too: ``os.access`` denies one path."""
    folder = write(tmp_path / "folder", make_arrays(labels=True, texts=True))
    denied = os.path.join(folder, name) if name else folder
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: os.fspath(p) != denied and access(p, mode))
    expected = f"{denied} cannot be read (permission denied)"
    with pytest.raises(PermissionError, match=re.escape(expected)) as caught:
        load(folder)
    assert "\n" not in str(caught.value)
    if name != "test_labels.npy":
        with pytest.raises(PermissionError, match=re.escape(expected)):
            vectors.display_texts(folder, name.split("_")[0] if name else "val")


def test_cr_line_ends_and_a_byte_order_mark_read_as_lines(tmp_path, monkeypatch):
    r"""``\r``, ``\n`` and ``\r\n`` each end a line, also where a chunk ends between the
    ``\r`` and the ``\n``; a leading UTF-8 byte-order mark is no part of the first line."""
    bom = b"\xef\xbb\xbf"
    path = tmp_path / "t.txt"
    for content, lines in [
        (b"a\rb\r", ["a", "b"]),
        (b"a\rb", ["a", "b"]),
        (b"a\r\rc", ["a", "", "c"]),
        (b"a\r\nb\rc\n\r\n", ["a", "b", "c", ""]),
        (b"\r", [""]),
        (bom + "é\r\n2".encode(), ["é", "2"]),
        (bom, []),
        (bom + b"\r", [""]),
    ]:
        path.write_bytes(content)
        for chunk in (1, 2, 3, 1 << 20):
            monkeypatch.setattr(vectors, "CHUNK_BYTES", chunk)
            assert vectors.count_lines(str(path)) == len(lines), (content, chunk)
            assert list(vectors.TextLines(str(path))) == lines, (content, chunk)
        assert vectors.read_lines(str(path)) == lines, content
    rng = np.random.default_rng(0)  # oracle: Python's universal newlines (read_lines)
    for _ in range(200):
        path.write_bytes(b"".join(rng.choice([b"a", b"\r", b"\n", "é".encode()], size=9)))
        expected = vectors.read_lines(str(path))
        for chunk in (1, 2, 3):
            monkeypatch.setattr(vectors, "CHUNK_BYTES", chunk)
            assert vectors.count_lines(str(path)) == len(expected)
            read = vectors.TextLines(str(path))
            assert list(read) == expected
            assert read.take(np.arange(len(expected))[::-1]) == expected[::-1]
    path.write_bytes(b"a\r\nb\rc\n\xc3\xa9\r\xff\n")
    for chunk in (1, 2, 3, 4, 1 << 20):
        monkeypatch.setattr(vectors, "CHUNK_BYTES", chunk)
        with pytest.raises(ValueError, match=r"is not UTF-8 \(line 5\)"):
            vectors.count_lines(str(path))


def test_text_lines_index_like_a_list(tmp_path, monkeypatch):
    """``TextLines`` answers integers, negative ones and slices as the list of
    ``read_lines`` does, and refuses an index out of range; an empty file has no line."""
    path = tmp_path / "t.txt"
    path.write_bytes("x\r\ny é\rz\n\nlast".encode())
    lines, oracle = vectors.TextLines(str(path)), ["x", "y é", "z", "", "last"]
    assert len(lines) == 5 and lines[1] == "y é" and lines[-1] == "last"
    assert lines[1:4] == oracle[1:4] and lines[::-2] == oracle[::-2]
    assert lines.take([4, 0, -4, 3, 0]) == [oracle[k] for k in (4, 0, -4, 3, 0)]
    assert lines.take([]) == []
    assert lines.index("z") == 2 and "last" in lines and "y" not in lines
    assert lines.index("", 1, 4) == 3 and lines.index("x", -5) == 0
    with pytest.raises(ValueError, match="'x' is not a line of"):
        lines.index("x", 1)
    monkeypatch.setattr(vectors, "_LINES_AT_ONCE", 2)
    assert list(lines) == oracle and lines.index("last") == 4
    for bad in (5, -6):
        with pytest.raises(IndexError):
            lines[bad]
    path.write_bytes(b"")
    assert len(vectors.TextLines(str(path))) == 0 and list(vectors.TextLines(str(path))) == []


def test_a_folder_of_cr_text_files_with_byte_order_marks_reads_back(tmp_path):
    """As a Windows editor may save them: the first id is found, with no mark in it."""
    arrays = make_arrays(texts=True)
    folder = write(tmp_path, arrays)
    for kind in ("captions", "image_ids"):
        lines = arrays["train"][kind]
        with open(os.path.join(folder, f"train_{kind}.txt"), "wb") as f:
            f.write(b"\xef\xbb\xbf" + "\r".join(lines).encode())
    load(folder)
    ids, captions = vectors.display_texts(folder, "train")
    assert list(ids) == arrays["train"]["image_ids"] and ids.index("train/img0.jpg") == 0
    assert list(captions) == arrays["train"]["captions"]


# ----------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("cpi", [1, 3])
def test_mismatch_texts_permutes_the_chosen_rows_to_other_images(cpi):
    n, rate = 60 * cpi, 0.4
    source, mismatched = vectors.mismatch_texts(n, cpi, rate=rate, seed=3)
    made = noise.correspondence_noise(n, cpi, rate=rate, seed=3, protocol="per_caption")
    assert sorted(source) == list(range(n))  # no text lost or repeated
    own = np.arange(n) // cpi
    np.testing.assert_array_equal(source // cpi, made.image_index)  # the noise's image
    np.testing.assert_array_equal(mismatched, source // cpi != own)
    assert mismatched.sum() == math.floor(rate * n)
    np.testing.assert_array_equal(source[~mismatched], np.flatnonzero(~mismatched))


def test_from_synthetic_writes_the_worlds_vectors_with_the_mismatches(tmp_path):
    mismatched = vectors.from_synthetic(
        str(tmp_path), num_train=40, num_val=11, num_test=11, noise_rate=0.25, seed=2, labels=True
    )
    dataset = load(tmp_path)
    assert dataset.info.captions_per_image == 1 and dataset.info.image_dim == 64
    # Oracle: the generator itself, read caption by caption.
    cfg = synthetic.default_config()
    cfg.update(dict(worlds.get("small_global").data))
    cfg.update(dict(seed=2, num_train=40, num_val=11, num_test=11))
    clean = synthetic.SyntheticDataset(cfg).split("train")
    texts = np.stack([clean.caption(k, ("global_text",))["global_text"] for k in range(40)])
    folder = dataset.split("train")
    same = np.array([(folder.texts[k] == texts).all(1) for k in range(40)])  # [row, caption]
    assert (same.sum(1) == 1).all()  # each row holds one caption's text
    holds = same.argmax(1)
    np.testing.assert_array_equal(mismatched, holds != np.arange(40))
    assert mismatched.sum() == 10
    for i in (0, 39):
        np.testing.assert_array_equal(
            folder.images[i], clean.image(i, ("global_image",))["global_image"]
        )
    np.testing.assert_array_equal(folder.image_labels(), clean.image_labels())
    ids, captions = vectors.display_texts(str(tmp_path), "train")
    assert ids[5] == "train/000005" and len(captions) == 40
    moved = np.flatnonzero(mismatched)[0]
    assert captions[moved] == _caption_words(clean, holds[moved], cfg)


def _caption_words(split, k, cfg):
    world = synthetic._World(cfg)
    record = split.caption(k, ("tokens", "length"))
    return vectors._render(record["tokens"], record["length"], world, cfg)


# ----------------------------------------------------------------------------- configs


def _config(name, arg):
    return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)


@pytest.mark.parametrize(("name", "labels"), VECTORS_CONFIGS.items())
def test_every_vectors_config_resolves(name, labels):
    full, quick = _config(name, "vectors"), _config(name, "vectors,quick")
    for config in (full, quick):
        validation.check(config)
        assert config.data.name == "vectors" and config.data.folder == ""
        assert config.data.require_labels == labels
        assert config.eval.kind == ("map" if labels else "recall")
        m = config.model
        assert (m.head, m.image_input, m.text_input) == ("cosine", "global", "global")
        assert config.noise.kind == "none"  # the folder's own pairs and labels
    assert quick.train.epochs < full.train.epochs


def test_the_config_files_that_take_vectors_are_these():
    assert presets.config_files_taking("vectors", os.path.join(ROOT, "configs")) == [
        os.path.join(ROOT, "configs", f"{name}.py:vectors") for name in sorted(VECTORS_CONFIGS)
    ]


def test_a_quick_train_on_a_tiny_folder(tmp_path):
    """GSC end to end on 12 x 5 pairs of float16 vectors with their texts."""
    folder = write(tmp_path / "folder", make_arrays(cpi=5, dtype=np.float16, texts=True))
    config = _config("gsc", "vectors,quick")
    config.data.folder = folder
    config.model.cosine.image_hidden = config.model.text_mlp.hidden = (16,)
    config.model.embed_dim = 16
    config.train.batch_size = config.eval.batch_size = 8
    config.train.num_devices, config.train.progress_bar = 1, False
    results = train_and_evaluate(config, str(tmp_path / "run"))
    assert all(math.isfinite(results[k]) for k in ("i2t_r1", "t2i_r1", "rsum")), results


def test_train_py_without_a_folder_is_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config=configs/ncr.py:vectors,quick",
            f"--workdir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("ValueError: data.folder is empty: pass the folder")
    assert not os.path.exists(tmp_path / "run")
