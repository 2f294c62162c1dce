"""Splits too small for the metrics asked are refused before training, a validation score
that ties the best epoch is warned about, and a caption file the vocabulary does not cover
is warned about (more than 5% ``<unk>``) or refused (all ``<unk>``).

Oracles: the number of wrong candidates of each query (text->image: ``n - 1`` images,
image->text: ``(n - 1) * cpi`` captions) worked out by hand, and the ``<unk>`` count of
the precomp fixture's captions counted word by word below.
"""

import json
import logging
import os
import re

import numpy as np
import pytest

from ncljax.data import sources
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import train_and_evaluate
from tests.data import test_precomp
from tests.train.test_loop import load_config, read_metrics, tiny

# ------------------------------------------------------------------ split sizes


@pytest.mark.parametrize(
    ("field", "size", "split"),
    [("num_test", 1, "test"), ("num_val", 1, "val"), ("num_test", 10, "test")],
)
def test_a_split_too_small_for_recall_at_10_is_refused_before_training(
    tmp_path, field, size, split
):
    """With ``n <= 10`` images a caption's text->image query has ``n - 1 < 10`` wrong
    images, so its R@10 is 100 whatever the model (``num_test=1``: rSum 600)."""
    config = load_config("vse", "synthetic,quick")
    config.data[field] = size
    workdir = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        train_and_evaluate(config, str(workdir))
    message = str(err.value)
    assert "\n" not in message
    captions = f"{5 * size} captions"
    images = f"{size} image" + ("s" if size > 1 else "")
    assert message.startswith(f"Invalid config: the {split} split holds {images} ({captions})")
    assert "too few for Recall@10" in message and "at least 11 images" in message
    assert message.endswith(f"set data.{field} (now {size}) to at least 11."), message
    assert not workdir.exists()  # refused before anything is written


def test_eleven_images_are_enough_for_recall_at_10():
    """11 images: 10 wrong images per caption, 50 wrong captions per image."""
    config = load_config("vse", "synthetic,quick")
    config.data.num_val = config.data.num_test = 11
    evaluator_lib.check_splits(sources.load_dataset(config.data), config)


def test_a_split_of_one_item_is_refused_for_map(tmp_path):
    config = load_config("ce", "synthetic,quick")
    config.data.num_val = 1
    config.train.num_devices = 1  # batch 100 does not split over the 8 test devices
    with pytest.raises(ValueError, match=r"the val split holds 1 item of the single class \d+, "):
        train_and_evaluate(config, str(tmp_path / "run"))


class _Split:
    def __init__(self, labels):
        self._labels = np.asarray(labels)

    def image_labels(self):
        return self._labels


class _Dataset:
    """Splits of given image labels (one caption per image)."""

    def __init__(self, **labels):
        self._splits = {name: _Split(v) for name, v in labels.items()}
        self.info = sources.DatasetInfo(
            "synthetic", 1, 3, 0, 0, 0, 0, 4, 4, {k: (len(v), len(v)) for k, v in labels.items()}
        )

    def split(self, name):
        return self._splits[name]


def test_a_single_class_split_is_refused_for_map():
    """Every candidate relevant to every query: mAP@all is 1 for any ranking."""
    config = load_config("ce", "synthetic")
    evaluator_lib.check_splits(_Dataset(val=[0, 1], test=[2, 2, 1]), config)
    with pytest.raises(ValueError, match="the test split holds 3 items of the single class 2, "):
        evaluator_lib.check_splits(_Dataset(val=[0, 1], test=[2, 2, 2]), config)


def test_coco_5fold_needs_whole_folds():
    config = load_config("vse", "synthetic")
    config.eval.recall.coco_5fold = True
    config.data.num_test = 1500
    with pytest.raises(ValueError, match="folds of 1000 images, but it holds 1500; set eval"):
        evaluator_lib.check_splits(sources.load_dataset(config.data), config)


# ------------------------------------------------------------------ best-epoch ties


def test_a_validation_score_that_ties_the_best_is_warned_about(tmp_path, monkeypatch, caplog):
    """A constant validation rSum: every later epoch ties epoch 0, which stays selected
    (ties keep the earlier epoch), and each tie is a warning."""
    score = evaluator_lib.Evaluator.__call__

    def constant_val(self, state, split_name):
        metrics = score(self, state, split_name)
        if split_name == "val":
            metrics["rsum"] = 300.0
        return metrics

    monkeypatch.setattr(evaluator_lib.Evaluator, "__call__", constant_val)
    config = tiny(load_config("vse", "synthetic"), epochs=3)
    config.train.num_devices = 1  # the tie rule is the loop's, on any number of devices
    with caplog.at_level(logging.WARNING):
        results = train_and_evaluate(config, str(tmp_path))
    ties = [r.getMessage() for r in caplog.records if "ties the best epoch" in r.getMessage()]
    assert ties == [
        f"epoch {e}: validation rsum=300 ties the best epoch 0, which stays selected (ties keep "
        "the earlier epoch); the score does not tell these models apart: check that the "
        "validation split is large enough and the metric not saturated."
        for e in (1, 2)
    ]
    assert results["best_epoch"] == 0
    assert [r["rsum"] for r in read_metrics(tmp_path) if r["split"] == "val"] == [300.0] * 3


# ------------------------------------------------------------------ <unk> captions

# The fixture's captions cycle through test_precomp.CAPTIONS; one cycle, tokenised:
# "a dog runs ." (4 words), "a man on the grass" (5), "the dog" (2), "a cat runs !" (4),
# "man . dog" (3): 18 words. Five captions per image: one cycle per image.
WORDS_PER_IMAGE = 18
SPLIT_IMAGES = {"val" if k == "dev" else k: n for k, n in test_precomp.SIZES.items()}


def _write(tmp_path, words):
    """The F30K fixture with a vocabulary of ``words`` written in the SCAN/NCR layout."""
    root = tmp_path / "manual"
    test_precomp.write_release(str(root), "f30k", vocab=False)
    word2idx = {w: i for i, w in enumerate(["<pad>", "<start>", "<end>", "<unk>", *words])}
    path = root / "vocab" / "f30k_precomp_vocab.json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "word2idx": word2idx,
                "idx2word": {str(i): w for w, i in word2idx.items()},
                "idx": len(word2idx),
            },
            f,
        )
    return str(path)


def _unk_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "are <unk> under" in r.getMessage()]


def test_captions_mostly_unknown_to_the_vocabulary_are_warned_about(tmp_path, caplog):
    """Without 'cat' and '!', 2 of every 18 words are <unk> (11%): a warning per split,
    when prepared and each time the prepared data is opened again."""
    path = _write(tmp_path, ["a", "dog", "runs", "man", "on", "the", "grass", "."])
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            test_precomp.load(test_precomp.config("f30k", tmp_path))
        got = sorted(_unk_warnings(caplog))
        want = sorted(
            f"{2 * n} of the {WORDS_PER_IMAGE * n} words (11.1%) of the {split} captions are "
            f"<unk> under the vocabulary {path} (more than 5%): check that it is the "
            "release's own vocabulary file."
            for split, n in SPLIT_IMAGES.items()
        )
        assert got == want


def test_captions_the_vocabulary_covers_are_not_warned_about(tmp_path, caplog):
    _write(tmp_path, ["a", "dog", "runs", "man", "on", "the", "grass", ".", "cat", "!"])
    with caplog.at_level(logging.WARNING):
        test_precomp.load(test_precomp.config("f30k", tmp_path))
    assert not _unk_warnings(caplog)


def test_captions_all_unknown_to_the_vocabulary_are_refused(tmp_path):
    path = _write(tmp_path, ["zebra", "giraffe"])
    with pytest.raises(ValueError) as err:
        test_precomp.load(test_precomp.config("f30k", tmp_path))
    message = str(err.value)
    assert "\n" not in message
    split = re.match(r"Every one of the (\d+) words of the (\w+) captions", message)
    assert split, message
    words = WORDS_PER_IMAGE * SPLIT_IMAGES[split.group(2)]
    assert int(split.group(1)) == words
    assert f"is <unk> under the vocabulary {path}:" in message
    assert "Put the release's own vocabulary file in data.manual_dir." in message
    assert not os.path.isdir(tmp_path / "prepared" / "f30k_precomp" / "captions" / "1.0.0")
