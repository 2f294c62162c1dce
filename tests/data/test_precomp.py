"""Tests for ncljax.data.precomp: tiny releases in the real layouts, prepared and read back.

Each fixture writes the released file names, dtypes and formats (``{prefix}_ims.npy``,
``{prefix}_caps.txt`` / ``.tsv`` / ``_caps_{tokenizer}.txt``, the SCAN vocabulary JSON)
into ``tmp_path``; the oracle is the fixture itself: every image must read back
bit-exactly and every caption as the ids worked out from the hand-written vocabulary.
"""

import json
import os
import re
import shutil

import numpy as np
import pytest

from ncljax.data import pipeline, precomp, sources
from ncljax.data import vocab as vocab_lib

WORDS = ["a", "dog", "runs", "man", "on", "the", "grass", "."]
CAPTIONS = ["A dog runs.", "a man on the grass", "The dog", "A cat runs!", "man . dog"]
# The ids of CAPTIONS under the vocabulary of WORDS (<unk> = 3 for 'cat' and '!').
CAPTION_IDS = [
    [1, 4, 5, 6, 11, 2],
    [1, 4, 7, 8, 9, 10, 2],
    [1, 9, 5, 2],
    [1, 4, 3, 6, 3, 2],
    [1, 7, 11, 5, 2],
]
SIZES = {"train": 4, "dev": 3, "test": 2}
# Images per file of a fixture that trains and evaluates: Recall@10 needs 11 images in each
# evaluated split (ncljax.evaluate.recall_min_images).
TRAINABLE_SIZES = {"train": 4, "dev": 11, "test": 11}
# Images per file in the default fixtures (COCO: testall has one more than test).
SIZES_OF = {
    "f30k": SIZES,
    "now": SIZES,
    "coco": {"train": 4, "dev": 3, "testall": 3, "test": 1},
}


def scan_vocab(words, idx=None):
    word2idx = {w: i for i, w in enumerate(["<pad>", "<start>", "<end>", "<unk>", *words])}
    return {
        "word2idx": word2idx,
        "idx2word": {str(i): w for w, i in word2idx.items()},
        "idx": len(word2idx) if idx is None else idx,
    }


def features(prefix, n, dim, seed):
    rng = np.random.default_rng([seed, len(prefix), n])
    return rng.normal(size=(n, 36, dim)).astype(np.float32)


def caption_of(prefix, k):
    return CAPTIONS[(k + len(prefix)) % len(CAPTIONS)]


def write_release(root, name, *, sizes=SIZES, vocab=True, tokenizer="jieba"):
    """Writes a tiny release of benchmark ``name`` under ``root`` in its real layout."""
    release = precomp.RELEASES[name]
    folder = os.path.join(root, release.folder)
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.join(root, "vocab"), exist_ok=True)
    cpi = release.captions_per_image
    sizes = dict(sizes)
    if name == "coco":
        sizes["testall"] = sizes.pop("test") + 1
        sizes["test"] = 1  # the 1K test split of the release, which must not be used
    for prefix, n in sizes.items():
        np.save(
            os.path.join(folder, f"{prefix}_ims.npy"), features(prefix, n, release.region_dim, 0)
        )
        if release.captions == "txt":
            lines = [caption_of(prefix, k) for k in range(cpi * n)]
            text = "\n".join(lines) + "\n"
            path = os.path.join(folder, f"{prefix}_caps.txt")
        elif release.captions == "tsv":
            text = "".join(f"{1000 + k}\t{caption_of(prefix, k)}\n" for k in range(n))
            path = os.path.join(folder, f"{prefix}_caps.tsv")
        else:
            # Token ids; empty fields (a trailing comma, ",,") are ignored.
            text = "".join(f"{now_ids(prefix, k)[0]},,{now_ids(prefix, k)[1]},\n" for k in range(n))
            path = os.path.join(folder, f"{prefix}_caps_{tokenizer}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    vocab_file = release.vocab_file.format(tokenizer=tokenizer)
    if vocab and release.captions == "ids":
        data = scan_vocab(["的", "网", "页"], idx=50)  # NoW: idx, not len(word2idx)
        write_json(os.path.join(root, "vocab", vocab_file), data)
    elif vocab:
        write_json(os.path.join(root, "vocab", vocab_file), scan_vocab(WORDS))
    return folder


def now_ids(prefix, k):
    return [4 + (k + len(prefix)) % 3, 10 + k]  # 10 + k is not a word, but within idx=50


def write_json(path, data):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def config(name, tmp_path, **overrides):
    cfg = precomp.default_config(name)
    cfg.manual_dir = str(tmp_path / "manual")
    cfg.data_dir = str(tmp_path / "prepared")
    cfg.val_images = 0  # the fixtures' dev splits are smaller than NCR's 1000 images
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def expected_ids(name, prefix, k):
    """The fixture's caption ``k`` of file ``prefix`` as token ids."""
    if name == "now":
        return [1, *now_ids(prefix, k), 2]
    return CAPTION_IDS[(k + len(prefix)) % len(CAPTIONS)]


def check_split(dataset, split, prefix, num_images, dtype=np.float32):
    """Every image and caption of ``split`` equals the fixture's (file ``prefix``)."""
    name = dataset.info.name
    release = precomp.RELEASES[name]
    cpi = release.captions_per_image
    source = dataset.split(split)
    assert (source.num_images, source.num_captions) == (num_images, cpi * num_images)
    assert source.captions_per_image == cpi
    ims = features(prefix, SIZES_OF[name][prefix], release.region_dim, 0)
    for i in range(num_images):
        image = source.image(i, ("regions",))
        assert image["regions"].dtype == np.float32
        assert image["regions"].shape == (36, release.region_dim)
        np.testing.assert_array_equal(image["regions"], ims[i].astype(dtype).astype(np.float32))
        assert image["label"] == -1 and image["label"].dtype == np.int64
    max_length = dataset.info.max_length
    for k in range(cpi * num_images):
        caption = source.caption(k, ("tokens", "length"))
        ids = expected_ids(name, prefix, k)
        padded = np.zeros(max_length, np.int32)
        padded[: len(ids)] = ids
        np.testing.assert_array_equal(caption["tokens"], padded)
        assert caption["tokens"].dtype == np.int32
        assert caption["length"] == len(ids) and caption["length"].dtype == np.int32
        assert caption["label"] == -1
    np.testing.assert_array_equal(source.image_labels(), np.full(num_images, -1))
    with pytest.raises(IndexError, match="out of range"):
        source.image(num_images, ("regions",))
    with pytest.raises(IndexError, match="out of range"):
        source.caption(cpi * num_images, ("tokens",))


def load(cfg):
    return sources.load_dataset(cfg)


# ---------------------------------------------------------------- every builder


def test_f30k_reads_back_exact_values(tmp_path):
    write_release(tmp_path / "manual", "f30k")
    dataset = load(config("f30k", tmp_path, val_images=2))
    info = dataset.info
    assert info.name == "f30k" and info.captions_per_image == 5
    assert (info.num_classes, info.image_dim, info.text_dim) == (0, 0, 0)
    assert (info.num_regions, info.region_dim) == (36, 2048)
    assert info.vocab_size == 4 + len(WORDS)
    assert info.max_length == max(len(c) for c in CAPTION_IDS)  # 0: the longest caption
    assert info.split_sizes == {"train": (4, 20), "val": (2, 10), "test": (2, 10)}
    check_split(dataset, "train", "train", 4)
    check_split(dataset, "val", "dev", 2)  # the first val_images dev images
    check_split(dataset, "test", "test", 2)
    vocab = dataset.vocabulary()
    assert dict(vocab.word2idx) == scan_vocab(WORDS)["word2idx"]
    assert vocab.source == "f30k_precomp_vocab.json"
    with pytest.raises(ValueError, match="Unknown split 'dev'"):
        dataset.split("dev")
    with pytest.raises(ValueError, match="image_input='regions'"):
        dataset.split("train").image(0, ("global_image",))
    # Prepared once: a second load reads the prepared data without the released files.
    shutil.rmtree(tmp_path / "manual")
    again = load(config("f30k", tmp_path, val_images=0))
    assert again.info.split_sizes["val"] == (3, 15)
    np.testing.assert_array_equal(
        again.split("val").image(2, ("regions",))["regions"],
        features("dev", 3, 2048, 0)[2],
    )


def test_float16_option_stores_half_precision(tmp_path):
    write_release(tmp_path / "manual", "f30k")
    dataset = load(config("f30k", tmp_path, float16=True))
    check_split(dataset, "train", "train", 4, dtype=np.float16)
    ims = features("train", 4, 2048, 0)
    assert not np.array_equal(dataset.split("train").image(0, ("regions",))["regions"], ims[0])
    prepared = tmp_path / "prepared" / "f30k_precomp"
    assert sorted(os.listdir(prepared)) == [".config", "captions", "images_float16"]
    meta = json.loads((prepared / "images_float16" / "1.0.0" / "metadata.json").read_text())
    assert meta["float16"] is True and meta["source_dtype"]["train"] == "float32"
    # float32 data is a separate TFDS config and coexists with the float16 one.
    check_split(load(config("f30k", tmp_path)), "train", "train", 4)


def test_coco_test_split_is_testall(tmp_path):
    write_release(tmp_path / "manual", "coco")
    dataset = load(config("coco", tmp_path, val_images=0))
    assert dataset.info.split_sizes == {"train": (4, 20), "val": (3, 15), "test": (3, 15)}
    check_split(dataset, "test", "testall", 3)
    check_split(dataset, "val", "dev", 3)


def test_cc152k_tsv_with_a_vocabulary_built_from_the_training_captions(tmp_path):
    write_release(
        tmp_path / "manual", "cc152k", sizes={"train": 10, "dev": 2, "test": 3}, vocab=False
    )
    dataset = load(config("cc152k", tmp_path, vocab_threshold=2))
    assert dataset.info.captions_per_image == 1
    train = [caption_of("train", k) for k in range(10)]
    built = vocab_lib.build_vocab(train, threshold=2)
    vocab = dataset.vocabulary()
    assert dict(vocab.word2idx) == dict(built.word2idx)
    assert "at least 2 times" in vocab.source
    assert dataset.info.vocab_size == built.size
    for split, prefix, n in (("train", "train", 10), ("val", "dev", 2), ("test", "test", 3)):
        source = dataset.split(split)
        assert (source.num_images, source.num_captions) == (n, n)
        for k in range(n):
            caption = source.caption(k, ("tokens", "length"))
            ids = built.encode(caption_of(prefix, k))
            assert caption["tokens"][: caption["length"]].tolist() == ids
            assert not caption["tokens"][caption["length"] :].any()
        np.testing.assert_array_equal(
            source.image(n - 1, ("regions",))["regions"], features(prefix, n, 2048, 0)[n - 1]
        )
    meta_path = tmp_path / "prepared" / "cc152k_precomp" / "captions" / "1.0.0" / "metadata.json"
    assert json.loads(meta_path.read_text())["vocab_threshold"] == 2
    with pytest.raises(ValueError, match=re.escape("data.vocab_threshold=2")):
        load(config("cc152k", tmp_path, vocab_threshold=4))


def test_max_length(tmp_path):
    write_release(tmp_path / "manual", "f30k")
    longest = max(len(c) for c in CAPTION_IDS)
    dataset = load(config("f30k", tmp_path, max_length=longest + 3))
    assert dataset.info.max_length == longest + 3
    check_split(dataset, "test", "test", 2)
    with pytest.raises(ValueError, match=f"set data.max_length={longest} or 0") as info:
        load(config("f30k", tmp_path, max_length=longest - 1))
    assert "never truncated" in str(info.value)


def test_epoch_through_the_pipeline(tmp_path):
    write_release(tmp_path / "manual", "f30k")
    dataset = load(config("f30k", tmp_path))
    split = dataset.split("train")
    record_fn = pipeline.pair_records(
        split, image_fields=("regions",), text_fields=("tokens", "length")
    )
    ims = features("train", 4, 2048, 0)
    seen = []
    for batch in pipeline.batches(record_fn, split.num_captions, batch_size=8, seed=0):
        for j in np.flatnonzero(batch["mask"]):
            k = int(batch["index"][j])
            seen.append(k)
            np.testing.assert_array_equal(batch["regions"][j], ims[k // 5])
            ids = expected_ids("f30k", "train", k)
            assert batch["tokens"][j, : len(ids)].tolist() == ids
    assert sorted(seen) == list(range(20))


# ---------------------------------------------------------------- documented errors


def corrupt_shape(folder):
    np.save(os.path.join(folder, "dev_ims.npy"), np.zeros((3, 36, 1024), np.float32))


def corrupt_dtype(folder):
    np.save(os.path.join(folder, "test_ims.npy"), np.zeros((2, 36, 2048), np.int32))


def corrupt_ndim(folder):
    np.save(os.path.join(folder, "test_ims.npy"), np.zeros((2, 2048), np.float32))


def corrupt_npy(folder):
    with open(os.path.join(folder, "train_ims.npy"), "wb") as f:
        f.write(b"not an npy file")


def truncate_captions(folder):
    path = os.path.join(folder, "dev_caps.txt")
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:-1])


def remove_captions(folder):
    os.remove(os.path.join(folder, "dev_caps.txt"))


def corrupt_vocab(folder):
    write_json(os.path.join(folder, "..", "vocab", "f30k_precomp_vocab.json"), {"idx": 3})


def nan_image(folder):
    ims = features("train", 4, 2048, 0)
    ims[2, 5, 7] = np.nan
    np.save(os.path.join(folder, "train_ims.npy"), ims)


@pytest.mark.parametrize(
    ("corrupt", "error", "file", "parts"),
    [
        (corrupt_shape, ValueError, "dev_ims.npy", ["shape [3, 36, 1024]", "[n_img, 36, 2048]"]),
        (corrupt_dtype, ValueError, "test_ims.npy", ["int32", "float32 [n_img, 36, 2048]"]),
        (corrupt_ndim, ValueError, "test_ims.npy", ["shape [2, 2048]", "[n_img, 36, 2048]"]),
        (corrupt_npy, ValueError, "train_ims.npy", ["cannot be read as a .npy"]),
        (
            truncate_captions,
            ValueError,
            "dev_caps.txt",
            ["14 captions", "5 x 3 images of dev_ims.npy = 15", "k // 5", "truncated"],
        ),
        (remove_captions, FileNotFoundError, "dev_caps.txt", ["kuanghuei/SCAN", "layout"]),
        (corrupt_vocab, ValueError, "f30k_precomp_vocab.json", ["word2idx and idx"]),
        (nan_image, ValueError, "train_ims.npy", ["image 2", "NaN or Inf"]),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_malformed_releases_give_one_clear_error(tmp_path, corrupt, error, file, parts):
    folder = write_release(tmp_path / "manual", "f30k")
    corrupt(folder)
    with pytest.raises(error) as info:
        load(config("f30k", tmp_path))
    message = str(info.value)
    assert file in message
    for part in parts:
        assert part in message
    if error is ValueError and "vocab" not in file and "NaN" not in parts[-1]:
        assert "Expected layout" in message and "f30k_precomp/" in message


def test_a_split_of_all_zero_features_is_refused_but_zero_images_are_kept(tmp_path):
    """A placeholder features file would let a collapsed model score a perfect rSum."""
    folder = write_release(tmp_path / "manual", "f30k")
    ims = features("train", 4, 2048, 0)
    ims[1] = 0  # one all-zero image (e.g. padding) is legitimate
    np.save(os.path.join(folder, "train_ims.npy"), ims)
    np.save(os.path.join(folder, "test_ims.npy"), np.zeros((2, 36, 2048), np.float32))
    cfg = config("f30k", tmp_path)
    with pytest.raises(ValueError) as info:
        load(cfg)
    path = os.path.join(folder, "test_ims.npy")
    assert str(info.value) == (
        f"f30k: the region features of split 'test' in {path} are all zero; the file is "
        "probably a placeholder or was not written completely: download or re-extract the "
        "features."
    )
    np.save(path, features("test", 2, 2048, 0))
    train = load(cfg).split("train")
    assert not train.image(1, ("regions",))["regions"].any()
    np.testing.assert_array_equal(train.image(2, ("regions",))["regions"], ims[2])


def test_a_damaged_prepared_file_is_named_when_loading(tmp_path):
    write_release(tmp_path / "manual", "f30k")
    load(config("f30k", tmp_path))
    directory = str(tmp_path / "prepared" / "f30k_precomp" / "captions" / "1.0.0")
    (path,) = [n for n in os.listdir(directory) if n.startswith("f30k_precomp-val.array_record")]
    with open(os.path.join(directory, path), "r+b") as f:
        f.write(np.random.default_rng(0).bytes(os.path.getsize(f.name)))
    with pytest.raises(ValueError) as info:
        load(config("f30k", tmp_path))
    message = str(info.value)
    assert f"The prepared split 'val' in {directory} cannot be used" in message
    assert "Corrupted Riegeli" in message and f"Delete {directory} and run again" in message


def test_missing_release_names_the_file_and_where_it_is_published(tmp_path):
    os.makedirs(tmp_path / "manual")
    with pytest.raises(FileNotFoundError) as info:
        load(config("f30k", tmp_path))
    message = str(info.value)
    manual = str(tmp_path / "manual")
    assert os.path.join(manual, "f30k_precomp", "train_ims.npy") in message
    assert "f30k_precomp_vocab.json" in message and "kuanghuei/SCAN" in message
    with pytest.raises(FileNotFoundError, match="NJUyued/NoW"):
        load(config("now", tmp_path))


def test_default_manual_dir_is_under_the_data_dir(tmp_path):
    write_release(tmp_path / "prepared" / "downloads" / "manual" / "f30k", "f30k")
    dataset = load(config("f30k", tmp_path, manual_dir=""))
    assert dataset.info.split_sizes["train"] == (4, 20)


def test_malformed_cc152k_and_now_files(tmp_path):
    folder = write_release(tmp_path / "a", "cc152k", vocab=False)
    with open(os.path.join(folder, "test_caps.tsv"), "a") as f:
        f.write("no-tab-here\n")
    with pytest.raises(ValueError, match="row 3 has 1 column") as info:
        load(config("cc152k", tmp_path, manual_dir=str(tmp_path / "a")))
    assert "test_caps.tsv" in str(info.value)

    folder = write_release(tmp_path / "b", "now")
    with open(os.path.join(folder, "dev_caps_jieba.txt"), "a") as f:
        f.write("4,50\n")  # a fourth caption whose id 50 is outside idx=50
    cfg = config("now", tmp_path, manual_dir=str(tmp_path / "b"))
    with pytest.raises(
        ValueError, match=r"line 4 holds token id 50 outside the vocabulary \[0, 50\)"
    ):
        load(cfg)
    with open(os.path.join(folder, "dev_caps_jieba.txt"), "w") as f:
        f.write("4,5\n4,x\n4\n")
    with pytest.raises(ValueError, match="line 2 is not comma-separated integers"):
        load(cfg)
    os.remove(os.path.join(tmp_path / "b", "vocab", "now100k_precomp_vocab_jieba.json"))
    with pytest.raises(FileNotFoundError, match=re.escape("now100k_precomp_vocab_jieba.json")):
        load(cfg)


def test_config_errors(tmp_path):
    write_release(tmp_path / "manual", "now")
    with pytest.raises(ValueError, match=re.escape("data.tokenizer must be one of")):
        load(config("now", tmp_path, tokenizer="wordpiece"))
    with pytest.raises(ValueError, match=re.escape("data.val_images=4 exceeds the 3 images")):
        load(config("now", tmp_path, val_images=4))
    with pytest.raises(ValueError, match="Unknown precomp dataset"):
        precomp.default_config("flickr")


def test_manual_download_instructions_name_every_file_and_the_source():
    for builder, source in [
        (precomp.F30kPrecomp, "kuanghuei/SCAN"),
        (precomp.CocoPrecomp, "kuanghuei/SCAN"),
        (precomp.Cc152kPrecomp, "2021-NeurIPS-NCR"),
        (precomp.Now100kPrecomp, "NJUyued/NoW"),
    ]:
        text = builder.MANUAL_DOWNLOAD_INSTRUCTIONS
        assert source in text and builder.RELEASE.folder in text
        for prefix in builder.RELEASE.prefixes.values():
            assert f"{prefix}_ims.npy" in text
    assert "testall_caps.txt" in precomp.CocoPrecomp.MANUAL_DOWNLOAD_INSTRUCTIONS
    assert "train_caps.tsv" in precomp.Cc152kPrecomp.MANUAL_DOWNLOAD_INSTRUCTIONS
    assert "[n_img, 36, 768]" in precomp.Now100kPrecomp.MANUAL_DOWNLOAD_INSTRUCTIONS


def test_splits_larger_than_the_tfds_sort_buffer_need_no_tensorflow(tmp_path, monkeypatch):
    """Past its memory buffer TFDS spills to bucket files via tf.io.gfile (absent here)."""
    from tensorflow_datasets.core import shuffle

    original = shuffle.tf
    monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 600_000)  # about two images
    write_release(tmp_path / "manual", "f30k", sizes={"train": 12, "dev": 3, "test": 2})
    dataset = load(config("f30k", tmp_path))
    assert shuffle.tf is original
    source = dataset.split("train")
    ims = features("train", 12, 2048, 0)
    for i in range(12):
        np.testing.assert_array_equal(source.image(i, ("regions",))["regions"], ims[i])
    assert [source.caption(k, ("tokens",))["tokens"][1] for k in range(60)] == [
        expected_ids("f30k", "train", k)[1] for k in range(60)
    ]


# ---------------------------------------------------------------- NoW (PC2's Noise of Web)

NOW_SIZES = {"train": 4, "dev": 3, "test": 2}
# Per tokenizer: its vocabulary's <start> and <end> ids and its size (the JSON idx, which
# differs from len(word2idx), as in the release), and the first id of its captions.
NOW_VOCABS = {"bpe": (1, 2, 60, 10), "bert": (5, 7, 90, 30), "jieba": (2, 1, 120, 50)}


def now_caption(tokenizer, prefix, k):
    """The token ids of line ``k`` of ``{prefix}_caps_{tokenizer}.txt``."""
    *_, size, base = NOW_VOCABS[tokenizer]
    if prefix == "dev" and k == 1:
        return []  # an empty line: a caption of no tokens
    if prefix == "train" and k == 3:
        return [size - 1, 0]  # the largest id of the vocabulary, and <pad>'s, as given
    return [base + k, 4, base + len(prefix) + k]


def now_line(ids, k):
    """``ids`` in the formats of the release: plain, with empty fields (leading, doubled,
    trailing), or with spaces and a Windows line end."""
    text = [str(i) for i in ids]
    if k % 3 == 1:
        return "," + ",,".join(text) + ",\n"
    if k % 3 == 2:
        return ", ".join(text) + ", \r\n"
    return ",".join(text) + "\n"


def write_now(root, folder="now100k_precomp"):
    """Writes a tiny NoW release in its real layout (README: ``h5100k_precomp/``): for
    each split ``{prefix}_ims.npy`` ``[n, 36, 768]``, ``{prefix}_ids.txt`` and
    ``{prefix}_caps_{bpe,bert,jieba}.txt``, and ``vocab/now100k_precomp_vocab_{tok}.json``.
    Returns the folder."""
    folder = os.path.join(root, folder)
    os.makedirs(folder)
    os.makedirs(os.path.join(root, "vocab"))
    for prefix, n in NOW_SIZES.items():
        np.save(os.path.join(folder, f"{prefix}_ims.npy"), features(prefix, n, 768, 1))
        with open(os.path.join(folder, f"{prefix}_ids.txt"), "w") as f:
            f.writelines(f"{400_000 + 7 * k}\n" for k in range(n))
        for tokenizer in NOW_VOCABS:
            lines = [now_line(now_caption(tokenizer, prefix, k), k) for k in range(n)]
            if prefix == "dev":
                lines[1] = "\n"
            with open(os.path.join(folder, f"{prefix}_caps_{tokenizer}.txt"), "w") as f:
                f.writelines(lines)
    for tokenizer, (start, end, size, _) in NOW_VOCABS.items():
        word2idx = {"<pad>": 0, "<start>": start, "<end>": end, "<unk>": 3, "网页": 4}
        data = {
            "word2idx": word2idx,
            "idx2word": {str(i): w for w, i in word2idx.items()},
            "idx": size,
        }
        write_json(os.path.join(root, "vocab", f"now100k_precomp_vocab_{tokenizer}.json"), data)
    return folder


def now_config(tmp_path, **overrides):
    """NoW's default ``data`` section (``data.val_images`` included) on ``tmp_path``."""
    cfg = precomp.default_config("now")
    cfg.manual_dir = str(tmp_path / "manual")
    cfg.data_dir = str(tmp_path / "prepared")
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def test_now_defaults():
    """Jieba tokens (the main table); the dev split validated whole, unlike F30K/COCO's
    first 1000 images; no synthetic noise, as on CC152K (the pairs are noisy already)."""
    from ncljax.config import presets

    cfg = precomp.default_config("now")
    assert (cfg.tokenizer, cfg.val_images) == ("jieba", 0)
    assert precomp.default_config("f30k").val_images == 1000
    assert precomp.default_config("coco").val_images == 1000
    assert presets.PRECOMP_NOISE["now"] is presets.PRECOMP_NOISE["cc152k"] is None
    for dataset in ("now", "cc152k"):
        preset = presets.start(dataset)
        assert (preset.noise.kind, preset.noise.rate) == ("none", 0.0)
    data = presets.start("now").data
    assert (data.name, data.tokenizer, data.val_images) == ("now", "jieba", 0)


@pytest.mark.parametrize("folder", ["now100k_precomp", "h5100k_precomp", "data/h5100k_precomp"])
def test_now_release_in_either_folder_with_each_tokenizer(tmp_path, folder):
    write_now(tmp_path / "manual", folder)
    for tokenizer in ("jieba", "bpe", "bert"):
        # jieba by default; the images are prepared once for all three.
        cfg = (
            now_config(tmp_path)
            if tokenizer == "jieba"
            else now_config(tmp_path, tokenizer=tokenizer)
        )
        dataset = load(cfg)
        start, end, size, _ = NOW_VOCABS[tokenizer]
        info = dataset.info
        assert (info.name, info.num_regions, info.region_dim) == ("now", 36, 768)
        assert info.captions_per_image == 1
        assert info.vocab_size == size  # the JSON idx, not len(word2idx) = 5
        vocab = dataset.vocabulary()
        assert (vocab.size, vocab.start, vocab.end) == (size, start, end)
        assert vocab.source == f"now100k_precomp_vocab_{tokenizer}.json"
        # The whole dev split (val_images 0 by default): 3 images.
        assert info.split_sizes == {"train": (4, 4), "val": (3, 3), "test": (2, 2)}
        assert info.max_length == 5  # <start>, 3 ids, <end>
        for split, prefix in (("train", "train"), ("val", "dev"), ("test", "test")):
            source = dataset.split(split)
            ims = features(prefix, NOW_SIZES[prefix], 768, 1)
            for k in range(NOW_SIZES[prefix]):
                np.testing.assert_array_equal(source.image(k, ("regions",))["regions"], ims[k])
                caption = source.caption(k, ("tokens", "length"))
                ids = [start, *now_caption(tokenizer, prefix, k), end]
                assert caption["length"] == len(ids)
                assert caption["tokens"].tolist() == ids + [0] * (5 - len(ids))
    prepared = sorted(os.listdir(tmp_path / "prepared" / "now100k_precomp"))
    assert prepared == [".config", "captions_bert", "captions_bpe", "captions_jieba", "images"]


def test_now_without_its_folder_names_both_names(tmp_path):
    os.makedirs(tmp_path / "manual" / "NoW")  # extracted under another name
    with pytest.raises(FileNotFoundError) as info:
        load(now_config(tmp_path))
    message = str(info.value)
    manual = str(tmp_path / "manual")
    for folder in ("now100k_precomp", "h5100k_precomp"):
        assert os.path.join(manual, folder, "train_ims.npy") in message
        assert os.path.join(manual, "data", folder, "train_ims.npy") in message
    assert "train_ims.npy (in now100k_precomp/ or h5100k_precomp/) not found" in message
    assert "<manual_dir>/now100k_precomp/ (or h5100k_precomp/)" in message
    assert "train_caps_jieba.txt" in message and "[n_img, 36, 768]" in message
    assert "huggingface.co/datasets/NJUyued/NoW" in message


def remove_bert_captions(folder):
    os.remove(os.path.join(folder, "test_caps_bert.txt"))


def remove_bert_vocab(folder):
    os.remove(os.path.join(folder, "..", "vocab", "now100k_precomp_vocab_bert.json"))


@pytest.mark.parametrize(
    ("corrupt", "file", "parts"),
    [
        (remove_bert_captions, "test_caps_bert.txt", ["not found", "test_caps_bert.txt"]),
        (
            remove_bert_vocab,
            "now100k_precomp_vocab_bert.json",
            ["not found", "<manual_dir>/vocab/now100k_precomp_vocab_bert.json (required)"],
        ),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_now_missing_files_of_the_tokenizer(tmp_path, corrupt, file, parts):
    corrupt(write_now(tmp_path / "manual", "h5100k_precomp"))
    with pytest.raises(FileNotFoundError) as info:
        load(now_config(tmp_path, tokenizer="bert"))
    message = str(info.value)
    assert file in message and "NJUyued/NoW" in message
    for part in parts:
        assert part in message


def rewrite(folder, name, text):
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)


def non_integer_field(folder):
    rewrite(folder, "dev_caps_jieba.txt", "50,4\n51,4x,52\n53\n")


def id_outside_the_vocabulary(folder):
    rewrite(folder, "test_caps_jieba.txt", "50\n51,,120\n")


def region_features_of_another_benchmark(folder):
    np.save(os.path.join(folder, "test_ims.npy"), features("test", 2, 2048, 1))


def one_caption_too_many(folder):
    with open(os.path.join(folder, "train_caps_jieba.txt"), "a") as f:
        f.write("50,51\n")


@pytest.mark.parametrize(
    ("corrupt", "file", "parts"),
    [
        (non_integer_field, "dev_caps_jieba.txt", ["line 2", "field '4x' is not an integer"]),
        (
            id_outside_the_vocabulary,
            "test_caps_jieba.txt",
            ["line 2 holds token id 120 outside the vocabulary [0, 120)", "same tokenizer"],
        ),
        (
            region_features_of_another_benchmark,
            "test_ims.npy",
            ["shape [2, 36, 2048], expected [n_img, 36, 768]"],
        ),
        (one_caption_too_many, "train_caps_jieba.txt", ["5 captions", "1 x 4 images"]),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_malformed_now_files_fail_before_the_images_are_prepared(tmp_path, corrupt, file, parts):
    corrupt(write_now(tmp_path / "manual"))
    with pytest.raises(ValueError) as info:
        load(now_config(tmp_path))
    message = str(info.value)
    assert os.path.join("now100k_precomp", file) in message and "is malformed" in message
    for part in parts:
        assert part in message
    assert "Expected layout" in message
    assert "download the NoW dataset on HuggingFace" in message and "again" in message
    images = precomp.Now100kPrecomp(config="images", data_dir=str(tmp_path / "prepared"))
    assert not images.is_prepared()
