"""The zoo of synthetic worlds: every world resolves in every config file of its family,
changes only the data, the inputs and the batch size, and trains."""

import math
import os

import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config import validation
from ncljax.data import sources, worlds
from ncljax.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR_FILES = (*methods.of_family("pairs"), "quickstart")
LABEL_FILES = methods.of_family("labels")


def load(name, arg):
    return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)


def _synthetic(name):
    return "" if name == "quickstart" else "synthetic"


def _arg(name, world):
    return ",".join(filter(None, (_synthetic(name), f"world={world}")))


def test_there_are_six_worlds_or_more_each_documented_in_one_line():
    assert len(worlds.names(worlds.PAIRS)) >= 6
    assert len(worlds.names(worlds.LABELS)) >= 3
    lines = worlds.describe().splitlines()
    assert len(lines) == len(worlds.WORLDS)
    for name, line in zip(worlds.names(), lines, strict=True):
        assert line.startswith(f"{name}: ") and len(line) > len(name) + 20


@pytest.mark.parametrize(
    ("name", "world"),
    [(n, w) for n in PAIR_FILES for w in worlds.names(worlds.PAIRS)]
    + [(n, w) for n in LABEL_FILES for w in worlds.names(worlds.LABELS)],
)
def test_a_world_changes_only_the_data_inputs_and_batch(name, world):
    base, config = load(name, _synthetic(name)), load(name, _arg(name, world))
    validation.check(config)  # honest: every non-default field is read
    spec = worlds.get(world)
    assert config.train.batch_size == spec.batch_size
    for field, value in spec.data.items():
        assert config.data[field] == value
    # The method, its hyperparameters, the schedule and the optimiser are the file's.
    assert config.method == base.method
    assert config.method_kwargs.to_dict() == base.method_kwargs.to_dict()
    assert config.optim.to_dict() == base.optim.to_dict()
    assert config.train.epochs == base.train.epochs
    assert config.noise.to_dict() == base.noise.to_dict()
    expected = "global" if spec.inputs == "global" else base.model.image_input
    assert config.model.image_input == config.model.text_input or spec.inputs != "global"
    assert config.model.image_input == expected
    # The generator accepts the world's data section.
    info = sources.load_dataset(config.data).info
    assert info.split_sizes["train"][0] == config.data.num_train


def test_the_default_world_is_the_preset():
    for name in PAIR_FILES:
        assert load(name, _arg(name, "default")).to_dict() == load(name, _synthetic(name)).to_dict()
    for name in LABEL_FILES:
        world = load(name, "synthetic,world=labels_default")
        assert world.to_dict() == load(name, "synthetic").to_dict()


def test_quick_shrinks_a_world():
    config = load("ncr", "synthetic,world=small_global,quick")
    assert config.model.image_input == "global"
    assert config.data.num_train < worlds.get("small_global").data["num_train"]


def test_world_arguments_are_checked():
    with pytest.raises(ValueError, match=r"(?s)Unknown world 'nope'.*small_global: "):
        load("vse", "synthetic,world=nope")
    with pytest.raises(ValueError, match="labels world; this config trains on noisy corr"):
        load("vse", "synthetic,world=labels_small")
    with pytest.raises(ValueError, match="pairs world; this config trains on noisy labels"):
        load("ce", "synthetic,world=small_global")
    with pytest.raises(ValueError, match="use it with the synthetic dataset"):
        load("vse", "f30k,world=small_global")
    with pytest.raises(ValueError, match="and world=<name> with synthetic"):
        load("vse", "synthetic,world=default,world=blurred")
    assert config_lib.world_of({"quick", "world=blurred"}) == "blurred"
    assert config_lib.world_of({"quick"}) is None


def test_global_worlds_carry_the_instance_in_their_vectors():
    """A global world's vectors identify their image: a caption's nearest image by a fixed
    linear map fitted on half the pairs (least squares, numpy) is its own far above chance
    (the MLP path can learn the world at all)."""
    config = load("infonce", "synthetic,world=small_global")
    config.data.num_train = 600
    split = sources.load_dataset(config.data).split("train")
    images = np.stack([split.image(i, ("global_image",))["global_image"] for i in range(600)])
    texts = np.stack([split.caption(i, ("global_text",))["global_text"] for i in range(600)])
    fit, held = slice(0, 400), slice(400, 600)
    w, *_ = np.linalg.lstsq(texts[fit], images[fit], rcond=None)
    pred = texts[held] @ w
    pred /= np.linalg.norm(pred, axis=1, keepdims=True)
    target = images[held] / np.linalg.norm(images[held], axis=1, keepdims=True)
    top1 = np.mean(np.argmax(pred @ target.T, axis=1) == np.arange(200))
    assert top1 > 0.05  # chance: 1/200


def test_a_global_world_trains(tmp_path):
    config = load("infonce", "synthetic,world=small_global")
    config.data.num_train, config.data.num_val, config.data.num_test = 200, 50, 50
    config.train.epochs, config.train.progress_bar = 2, False
    config.train.num_devices = 1  # batch 100: not a multiple of the 8 test devices
    results = train_and_evaluate(config, str(tmp_path / "run"))
    assert math.isfinite(results["rsum"]) and results["rsum"] > 0
