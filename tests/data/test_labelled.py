"""Tests for ncljax.data.labelled: the Wikipedia, NUS-WIDE, XMediaNet and INRIA builders.

Oracle: tiny files written here in the released layouts (MRL's ``.h5py`` field names and
dtypes; INRIA's MATLAB variables with ``[n, 1]`` labels), whose arrays are known; every
value read back through the prepared dataset must equal the file's value (cast to
float32, or rounded through float16), with labels shifted to start at 0 and the
validation rows taken as the split rule says.
"""

import hashlib
import os
import re

import h5py
import numpy as np
import pytest
import scipy.io
import scipy.sparse
import tensorflow_datasets as tfds
from tensorflow_datasets.core import shuffle

from ncljax import config as config_lib
from ncljax.data import labelled, sources
from ncljax.train import train_and_evaluate

FILES = {
    "wiki": "wiki_deep_doc2vec_data_corr_ae.h5py",
    "nuswide": "nus_wide_deep_doc2vec_data_42941.h5py",
    "xmedianet": "xmedianet_deep_doc2vec_data.h5py",
    "inria": "INRIA-Websearch.mat",
}


def data_config(name, tmp_path, **fields):
    cfg = labelled.default_config(name)
    cfg.manual_dir = str(tmp_path / "manual")
    cfg.data_dir = str(tmp_path / "data")
    for key, value in fields.items():
        cfg[key] = value
    return cfg


def labels_for(rng, n, num_classes, first):
    """Every class present (so the class count is known), in random order."""
    return (rng.permutation(np.arange(n) % num_classes) + first).astype(np.int64)


def write_mrl(
    tmp_path,
    name,
    *,
    sizes=(("train", 10), ("test", 8)),
    d_img=6,
    d_txt=4,
    text="text",
    first_label=0,
    num_classes=3,
    image_dtype=np.float32,
    drop=(),
    replace=None,
    seed=0,
):
    """Writes MRL's ``.h5py`` layout for ``name`` and returns its arrays."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for prefix, n in sizes:
        arrays[f"{prefix}_imgs_deep"] = rng.normal(size=(n, d_img)).astype(image_dtype)
        arrays[f"{prefix}_{text}"] = rng.normal(size=(n, d_txt)).astype(np.float32)
        arrays[f"{prefix}_imgs_labels"] = labels_for(rng, n, num_classes, first_label)
        arrays[f"{prefix}_texts_labels"] = labels_for(rng, n, num_classes, first_label)
    arrays.update(replace or {})
    for key in drop:
        del arrays[key]
    os.makedirs(tmp_path / "manual", exist_ok=True)
    with h5py.File(tmp_path / "manual" / FILES[name], "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return arrays


def write_inria(tmp_path, *, sizes=(("tr", 9), ("val", 4), ("te", 5)), sparse_text=False, drop=()):
    """Writes INRIA-Websearch.mat (MATLAB doubles, ``[n, 1]`` 1-based labels)."""
    rng = np.random.default_rng(1)
    arrays = {}
    for prefix, n in sizes:
        arrays[f"{prefix}_img"] = rng.normal(size=(n, 7))
        text = rng.random((n, 5)) * (rng.random((n, 5)) < 0.5)
        arrays[f"{prefix}_txt"] = scipy.sparse.csc_matrix(text) if sparse_text else text
        arrays[f"{prefix}_img_lab"] = labels_for(rng, n, 4, 1)[:, None].astype(np.float64)
        arrays[f"{prefix}_txt_lab"] = labels_for(rng, n, 4, 1)[:, None].astype(np.float64)
    for key in drop:
        del arrays[key]
    os.makedirs(tmp_path / "manual", exist_ok=True)
    scipy.io.savemat(tmp_path / "manual" / FILES["inria"], arrays)
    return arrays


def mrl_split(a, prefix, rows=slice(None), *, text="text", shift=0):
    """Features and 0-based labels of rows ``rows`` of the ``prefix`` arrays of a fixture."""
    return (
        a[f"{prefix}_imgs_deep"][rows],
        a[f"{prefix}_{text}"][rows],
        a[f"{prefix}_imgs_labels"][rows] - shift,
        a[f"{prefix}_texts_labels"][rows] - shift,
    )


def read_split(dataset, split):
    """All features and labels of a split, read through the ``SplitSource``."""
    source = dataset.split(split)
    images = [source.image(i, ("global_image",)) for i in range(source.num_images)]
    texts = [source.caption(i, ("global_text",)) for i in range(source.num_captions)]
    for record in images + texts:
        assert type(record["label"]) is np.int64
    for record in images:
        assert record["global_image"].dtype == np.float32
    for record in texts:
        assert record["global_text"].dtype == np.float32
    return (
        np.stack([r["global_image"] for r in images]),
        np.stack([r["global_text"] for r in texts]),
        np.array([r["label"] for r in images]),
        np.array([r["label"] for r in texts]),
    )


def assert_split(dataset, split, images, texts, labels_image, labels_text):
    got = read_split(dataset, split)
    np.testing.assert_array_equal(got[0], np.asarray(images, np.float32))
    np.testing.assert_array_equal(got[1], np.asarray(texts, np.float32))
    np.testing.assert_array_equal(got[2], labels_image)
    np.testing.assert_array_equal(got[3], labels_text)
    np.testing.assert_array_equal(dataset.split(split).image_labels(), labels_image)


# ---------------------------------------------------------------- reading back


def test_wiki_test_head_reads_back_the_file(tmp_path):
    a = write_mrl(tmp_path, "wiki", image_dtype=np.float64)
    ds = sources.load_dataset(data_config("wiki", tmp_path, valid_len=3))
    assert ds.info == sources.DatasetInfo(
        name="wiki",
        captions_per_image=1,
        num_classes=3,
        vocab_size=0,
        max_length=0,
        num_regions=0,
        region_dim=0,
        image_dim=6,
        text_dim=4,
        split_sizes={"train": (10, 10), "val": (3, 3), "test": (5, 5)},
    )
    assert_split(ds, "train", *mrl_split(a, "train"))
    assert_split(ds, "val", *mrl_split(a, "test", slice(0, 3)))
    assert_split(ds, "test", *mrl_split(a, "test", slice(3, None)))
    assert ds.metadata["split_rule"] == "test_head"
    assert ds.metadata["valid_len"] == 3
    assert ds.metadata["label_offset"] == 0
    assert ds.metadata["split_origin"]["val"]["rows"] == [0, 3]
    assert ds.metadata["split_origin"]["test"]["rows"] == [3, 8]
    assert ds.metadata["source_file"] == FILES["wiki"]
    content = (tmp_path / "manual" / FILES["wiki"]).read_bytes()
    assert ds.metadata["source_sha256"] == hashlib.sha256(content).hexdigest()


@pytest.mark.parametrize("rule", ["test_head", "train_tail"])
def test_split_rules_with_train_texts_and_one_based_labels(tmp_path, rule):
    a = write_mrl(tmp_path, "nuswide", text="texts", first_label=1, num_classes=4)
    ds = sources.load_dataset(data_config("nuswide", tmp_path, split_rule=rule, valid_len=4))
    assert a["train_imgs_labels"].min() == 1 and ds.info.num_classes == 4
    assert ds.metadata["label_offset"] == 1 and ds.metadata["split_rule"] == rule
    part = lambda prefix, rows: mrl_split(a, prefix, rows, text="texts", shift=1)
    if rule == "test_head":
        expected = {
            "train": part("train", slice(None)),
            "val": part("test", slice(0, 4)),
            "test": part("test", slice(4, None)),
        }
    else:
        expected = {
            "train": part("train", slice(0, 6)),
            "val": part("train", slice(6, None)),
            "test": part("test", slice(None)),
        }
    for split, arrays in expected.items():
        assert_split(ds, split, *arrays)
    sizes = {s: (len(v[0]), len(v[0])) for s, v in expected.items()}
    assert ds.info.split_sizes == sizes


@pytest.mark.parametrize("rule", ["test_head", "train_tail"])
def test_valid_fields_are_used_when_present(tmp_path, rule):
    sizes = (("train", 10), ("valid", 3), ("test", 6))
    a = write_mrl(tmp_path, "xmedianet", sizes=sizes, num_classes=5)
    ds = sources.load_dataset(data_config("xmedianet", tmp_path, split_rule=rule))
    for split, prefix in (("train", "train"), ("val", "valid"), ("test", "test")):
        assert_split(ds, split, *mrl_split(a, prefix))
    assert ds.metadata["split_rule"] == "valid_fields"
    assert ds.metadata["split_origin"]["val"]["image"] == "valid_imgs_deep"
    assert ds.info.num_classes == 5


@pytest.mark.parametrize("sparse_text", [False, True])
def test_inria_mat_given_splits(tmp_path, sparse_text):
    a = write_inria(tmp_path, sparse_text=sparse_text)
    ds = sources.load_dataset(data_config("inria", tmp_path))
    assert ds.info.num_classes == 4
    assert (ds.info.image_dim, ds.info.text_dim) == (7, 5)
    assert ds.info.split_sizes == {"train": (9, 9), "val": (4, 4), "test": (5, 5)}
    for split, prefix in (("train", "tr"), ("val", "val"), ("test", "te")):
        text = a[f"{prefix}_txt"]
        assert_split(
            ds,
            split,
            a[f"{prefix}_img"],
            text.toarray() if sparse_text else text,
            a[f"{prefix}_img_lab"][:, 0] - 1,
            a[f"{prefix}_txt_lab"][:, 0] - 1,
        )
    assert ds.metadata["split_rule"] == "given" and ds.metadata["label_offset"] == 1


def test_float16_option_stores_rounded_features(tmp_path):
    a = write_mrl(tmp_path, "xmedianet")
    cfg16 = data_config("xmedianet", tmp_path, float16=True, valid_len=2)
    ds = sources.load_dataset(cfg16)
    rounded = lambda x: x.astype(np.float16).astype(np.float32)
    images, texts, labels_image, labels_text = mrl_split(a, "test", slice(2, None))
    assert_split(ds, "test", rounded(images), rounded(texts), labels_image, labels_text)
    assert not np.array_equal(rounded(a["train_imgs_deep"]), a["train_imgs_deep"])
    assert ds.metadata["float16"] is True
    # The float32 version is prepared beside it, not mixed up with it.
    ds32 = sources.load_dataset(data_config("xmedianet", tmp_path, valid_len=2))
    np.testing.assert_array_equal(read_split(ds32, "train")[0], a["train_imgs_deep"])
    b16, b32 = labelled.builder(cfg16), labelled.builder(data_config("xmedianet", tmp_path))
    assert b16.data_dir != b32.data_dir


def test_float16_overflow_is_refused(tmp_path):
    big = np.full((10, 6), 1e6, np.float32)
    write_mrl(tmp_path, "xmedianet", replace={"train_imgs_deep": big})
    with pytest.raises(ValueError, match=r"train_imgs_deep row 0 .* float16 range.*float16=False"):
        sources.load_dataset(data_config("xmedianet", tmp_path, float16=True, valid_len=2))


def test_prepared_once_then_read_without_the_file(tmp_path, capsys):
    a = write_mrl(tmp_path, "wiki")
    cfg = data_config("wiki", tmp_path, valid_len=3)
    sources.load_dataset(cfg)
    assert "Preparing wiki/" in capsys.readouterr().out
    os.remove(tmp_path / "manual" / FILES["wiki"])
    ds = sources.load_dataset(cfg)
    assert "Preparing" not in capsys.readouterr().out
    np.testing.assert_array_equal(read_split(ds, "train")[0], a["train_imgs_deep"])


def test_default_manual_dir_and_builder_defaults(tmp_path):
    for name, valid_len in (("wiki", 231), ("nuswide", 5000), ("xmedianet", 4000)):
        cfg = labelled.default_config(name)
        assert (cfg.split_rule, cfg.valid_len, cfg.float16) == ("test_head", valid_len, False)
        assert FILES[name] in labelled.BUILDERS[name].MANUAL_DOWNLOAD_INSTRUCTIONS
    assert labelled.default_config("inria").split_rule == "given"
    # Without data.manual_dir the file is looked for in <data_dir>/downloads/manual/<name>.
    cfg = data_config("wiki", tmp_path, manual_dir="", valid_len=3)
    a = write_mrl(tmp_path, "wiki")
    manual = tmp_path / "data" / "downloads" / "manual" / "wiki"
    os.makedirs(manual)
    os.rename(tmp_path / "manual" / FILES["wiki"], manual / FILES["wiki"])
    ds = sources.load_dataset(cfg)
    np.testing.assert_array_equal(read_split(ds, "val")[1], a["test_text"][:3])


def test_split_source_contract(tmp_path):
    write_mrl(tmp_path, "wiki")
    ds = sources.load_dataset(data_config("wiki", tmp_path, valid_len=3))
    split = ds.split("train")
    for index in (-1, 10):
        with pytest.raises(IndexError, match="out of range"):
            split.image(index, ("global_image",))
        with pytest.raises(IndexError, match="out of range"):
            split.caption(index, ("global_text",))
    with pytest.raises(ValueError, match=r"model.image_input='global'"):
        split.image(0, ("regions",))
    with pytest.raises(ValueError, match=r"model.text_input='global'"):
        split.caption(0, ("tokens", "length"))
    labels = split.image_labels()
    assert labels.dtype == np.int64 and labels is split.image_labels()
    assert not labels.flags.writeable
    assert set(split.image(0, ())) == {"label"}
    with pytest.raises(ValueError, match="Unknown split"):
        ds.split("valid")


# ---------------------------------------------------------------- documented errors


def test_missing_file_names_the_path_and_the_source(tmp_path):
    cfg = data_config("xmedianet", tmp_path)
    expected = str(tmp_path / "manual" / FILES["xmedianet"])
    for make_dir in (False, True):  # no manual folder; a folder without the file
        if make_dir:
            os.makedirs(tmp_path / "manual" / "other")
        with pytest.raises(FileNotFoundError) as err:
            sources.load_dataset(cfg)
        message = str(err.value)
        assert expected in message and "penghu-cs/MRL" in message, message
        assert "data.manual_dir" in message and "train_imgs_deep" in message


@pytest.mark.parametrize("make_dir", [False, True])
def test_builder_alone_gives_the_missing_file_error(tmp_path, make_dir):
    manual = tmp_path / "manual"
    if make_dir:
        os.makedirs(manual / "other")
    builder = labelled.builder(data_config("wiki", tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape(str(manual / FILES["wiki"]))):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=str(manual))
        )


def _labels(n):
    return np.arange(n) % 3


MRL_ERRORS = [
    ({"drop": ["train_imgs_labels"]}, "the field train_imgs_labels is missing"),
    ({"drop": ["train_text"]}, "the field train_text or train_texts is missing"),
    ({"drop": ["test_imgs_deep"]}, "the field test_imgs_deep is missing"),
    (
        {"replace": {"train_imgs_deep": np.zeros(10, np.float32)}},
        "train_imgs_deep has shape (10,); features must be 2-D [N, d]",
    ),
    (
        {"replace": {"train_text": np.zeros((10, 2, 2), np.float32)}},
        "train_text has shape (10, 2, 2); features must be 2-D [N, d]",
    ),
    (
        {"replace": {"train_texts_labels": _labels(9)}},
        "train_texts_labels has 9 rows but train_imgs_deep has 10",
    ),
    (
        {"replace": {"test_text": np.zeros((7, 4), np.float32)}},
        "test_text has 7 rows but test_imgs_deep has 8",
    ),
    (
        {"replace": {"test_text": np.zeros((8, 5), np.float32)}},
        "test_text has 5 columns but train_text has 4; feature sizes must agree across splits",
    ),
    (
        {"replace": {"train_imgs_labels": np.zeros((10, 2), np.int64)}},
        "train_imgs_labels has shape (10, 2); labels must be 1-D [N] (or [N, 1])",
    ),
    (
        {"replace": {"train_imgs_labels": np.array([b"a"] * 10)}},
        "train_imgs_labels has dtype |S1; labels must be a dense numeric array",
    ),
    (
        {"replace": {"train_imgs_deep": np.array([[b"x"] * 6] * 10)}},
        "train_imgs_deep has dtype |S1; features must be numeric",
    ),
    (
        {"replace": {"test_texts_labels": _labels(8) + 0.5}},
        "test_texts_labels holds values that are not integer class ids",
    ),
    (
        {"replace": {"valid_imgs_deep": np.zeros((3, 6), np.float32)}},
        "the field valid_text or valid_texts is missing (the valid_ fields are optional, "
        "but all four or none)",
    ),
    (
        {"replace": {"train_imgs_deep": np.where(np.eye(10, 6)[::-1] > 0, np.nan, 1.0)}},
        "train_imgs_deep row 4 holds NaN or Inf; features must be finite",
    ),
]


@pytest.mark.parametrize(("fixture", "problem"), MRL_ERRORS)
def test_malformed_mrl_file_errors(tmp_path, fixture, problem):
    write_mrl(tmp_path, "xmedianet", **fixture)
    path = str(tmp_path / "manual" / FILES["xmedianet"])
    with pytest.raises(ValueError) as err:
        sources.load_dataset(data_config("xmedianet", tmp_path, valid_len=2))
    message = str(err.value)
    assert message.startswith(f"{path}: {problem}"), message
    assert "Expected layout: HDF5 datasets train_imgs_deep [N, d_img]" in message


def test_not_an_hdf5_file(tmp_path):
    os.makedirs(tmp_path / "manual")
    (tmp_path / "manual" / FILES["wiki"]).write_bytes(b"not hdf5" * 100)
    with pytest.raises(ValueError, match=r"cannot be read as an HDF5 file.*Expected layout"):
        sources.load_dataset(data_config("wiki", tmp_path))


@pytest.mark.parametrize(
    ("replace", "split", "where"),
    [
        ({"train_imgs_deep": np.zeros((10, 6), np.float32)}, "train", "train_imgs_deep, rows 0"),
        # Validation is test rows 0-2 (test_head): only the test split's texts are zero.
        (
            {"test_text": np.vstack([np.ones((3, 4)), np.zeros((5, 4))]).astype(np.float32)},
            "test",
            "test_text, rows 3 to 7",
        ),
    ],
    ids=["train_images", "test_texts"],
)
def test_a_split_of_all_zero_features_is_refused(tmp_path, replace, split, where):
    """A placeholder features file would let a collapsed model score perfectly."""
    write_mrl(tmp_path, "xmedianet", replace=replace)
    cfg = data_config("xmedianet", tmp_path, valid_len=3)
    with pytest.raises(ValueError) as err:
        sources.load_dataset(cfg)
    path = str(tmp_path / "manual" / FILES["xmedianet"])
    assert str(err.value).startswith(f"{path}: the features of split '{split}' ({where}"), err.value
    assert "are all zero" in str(err.value) and "re-extract the features" in str(err.value)
    assert not labelled.builder(cfg).is_prepared()


def test_all_zero_rows_are_kept(tmp_path):
    images = np.random.default_rng(3).normal(size=(10, 6)).astype(np.float32)
    images[[0, 9]] = 0
    texts = np.ones((8, 4), np.float32)
    texts[5] = 0
    write_mrl(tmp_path, "xmedianet", replace={"train_imgs_deep": images, "test_text": texts})
    ds = sources.load_dataset(data_config("xmedianet", tmp_path, valid_len=3))
    np.testing.assert_array_equal(read_split(ds, "train")[0], images)
    np.testing.assert_array_equal(read_split(ds, "test")[1], texts[3:])


def test_a_file_of_a_single_class_is_refused_by_name(tmp_path):
    """Once "Label noise needs class labels; wiki has none": the file has one class."""
    write_mrl(tmp_path, "wiki", num_classes=1, first_label=1)
    cfg = data_config("wiki", tmp_path, valid_len=3)
    path = str(tmp_path / "manual" / FILES["wiki"])
    with pytest.raises(ValueError) as err:
        sources.load_dataset(cfg)
    assert str(err.value) == (
        f"{path}: every label (test_imgs_labels, test_texts_labels, train_imgs_labels, "
        "train_texts_labels) is class 1: the file holds a single class, and category "
        "retrieval (mAP) and label noise need at least 2; check that these fields hold the "
        "class ids, or use the released file."
    )
    assert not labelled.builder(cfg).is_prepared()


@pytest.mark.parametrize("rule", ["test_head", "train_tail"])
def test_validation_size_must_fit(tmp_path, rule):
    write_mrl(tmp_path, "wiki")
    cfg = data_config("wiki", tmp_path, split_rule=rule)  # valid_len 231 > 10 or 8 rows
    with pytest.raises(ValueError, match=r"data.valid_len=231 does not fit .* between 1 and"):
        sources.load_dataset(cfg)


def test_bad_split_settings(tmp_path):
    with pytest.raises(ValueError, match=r"data\.split_rule must be one of"):
        sources.load_dataset(data_config("wiki", tmp_path, split_rule="train_head"))
    with pytest.raises(ValueError, match=r"data\.valid_len must be a positive integer"):
        sources.load_dataset(data_config("wiki", tmp_path, valid_len=0))
    with pytest.raises(ValueError, match=r"set data\.split_rule='given'"):
        sources.load_dataset(data_config("inria", tmp_path, split_rule="test_head"))


def test_malformed_inria_file_errors(tmp_path):
    path = str(tmp_path / "manual" / FILES["inria"])
    write_inria(tmp_path, drop=["val_txt_lab"])
    with pytest.raises(ValueError) as err:
        sources.load_dataset(data_config("inria", tmp_path))
    assert str(err.value).startswith(f"{path}: the field val_txt_lab is missing")
    assert "Expected layout: MATLAB v5/v7 variables tr_img [N, d_img]" in str(err.value)
    write_inria(tmp_path, sizes=(("tr", 9), ("val", 4), ("te", 5)))
    arrays = scipy.io.loadmat(path)
    arrays["te_txt_lab"] = arrays["te_txt_lab"][:4]
    scipy.io.savemat(path, {k: v for k, v in arrays.items() if not k.startswith("__")})
    with pytest.raises(ValueError, match=r"te_txt_lab has 4 rows but te_img has 5"):
        sources.load_dataset(data_config("inria", tmp_path))
    (tmp_path / "manual" / FILES["inria"]).write_bytes(b"garbage" * 100)
    with pytest.raises(ValueError, match=r"cannot be read as a MATLAB file"):
        sources.load_dataset(data_config("inria", tmp_path))


# ---------------------------------------------------------------- end to end


def test_xmedianet_fixture_trains_with_map_evaluation(tmp_path):
    sizes = (("train", 64), ("test", 32))
    write_mrl(tmp_path, "xmedianet", sizes=sizes, d_img=12, d_txt=8, num_classes=4)
    config = config_lib.base_config()
    config_lib.set_data(config, data_config("xmedianet", tmp_path, valid_len=16))
    config.method = "ce"
    config.model.image_input = config.model.text_input = "global"
    config.model.classifier = True
    config.model.cosine.image_hidden = config.model.text_mlp.hidden = (32,)
    config.model.embed_dim = 16
    config.eval.kind = "map"
    config.train.batch_size = config.eval.batch_size = 16
    config.train.epochs = 1
    config.train.num_devices = 1  # compiles twice as fast as over the 8 fake test devices
    config.train.progress_bar = False
    results = train_and_evaluate(config, str(tmp_path / "run"))
    assert np.isfinite(results["map_i2t"]) and np.isfinite(results["map_t2i"])
    assert 0 < results["map_i2t"] <= 1 and 0 < results["map_t2i"] <= 1


def test_split_larger_than_the_tfds_sort_buffer_prepares_without_tensorflow(tmp_path, monkeypatch):
    write_mrl(tmp_path, "wiki")
    # Ten training rows of 6 + 4 features: ~1,680 bytes, past a 1,600-byte buffer.
    monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1600)
    ds = sources.load_dataset(data_config("wiki", tmp_path, valid_len=3))
    assert ds.info.split_sizes["train"] == (10, 10)
    assert [int(x) for x in ds.split("train").image_labels()] == [
        int(ds.split("train").image(i, ("global_image",))["label"]) for i in range(10)
    ]
