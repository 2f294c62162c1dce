"""Every config file in ``configs/`` resolves for every dataset it lists, passes the field
checks, takes its method's defaults from the factory, and trains on that dataset (the
synthetic data, or tiny files in the released layouts, with the models shrunk)."""

import glob
import importlib.util
import math
import os

import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config import validation
from ncljax.data import vectors
from ncljax.train import train_and_evaluate
from tests.data.test_labelled import write_inria, write_mrl
from tests.data.test_precomp import TRAINABLE_SIZES, write_release
from tests.data.test_vectors import make_arrays

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not os.path.basename(p).startswith("_")
)


def _module(path):
    spec = importlib.util.spec_from_file_location("_cfg_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAIRS = [(os.path.basename(f)[:-3], d) for f in FILES for d in _module(f).DATASETS]


def load(name, arg):
    return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)


def test_every_method_has_one_config_file():
    names = {os.path.basename(f)[:-3] for f in FILES}
    assert set(methods.REGISTRY) <= names
    assert names - set(methods.REGISTRY) == {"quickstart", "uot_xmedianet"}


@pytest.mark.parametrize(("name", "dataset"), PAIRS)
def test_config_resolves_for_each_listed_dataset(name, dataset):
    for arg in (dataset, f"{dataset},quick"):
        config = load(name, arg)
        validation.check(config)  # honest: every non-default field is read
        assert config.data.name == dataset
        defaults = {
            k for k, p in methods.hyperparameters(config.method).items() if p.default is not p.empty
        }
        assert set(config.method_kwargs) == defaults  # the factory's signature, no more
        methods.build_method(config.method, config.method_kwargs, config.model)
    full, quick = load(name, dataset), load(name, f"{dataset},quick")
    assert quick.train.epochs < full.train.epochs


def test_config_arguments_are_checked():
    with pytest.raises(ValueError, match=r"one dataset of \('synthetic', 'f30k'"):
        load("vse", "flickr")
    with pytest.raises(ValueError, match="optionally with options"):
        load("vse", "f30k,coco")
    with pytest.raises(ValueError, match="'code', 'single' with a real dataset"):
        load("gsc", "synthetic,code")
    assert load("uot_xmedianet", "quick").to_dict() == load("uot_rcl", "xmedianet,quick").to_dict()


def _write_fixture(tmp_path, dataset):
    if dataset in ("f30k", "coco", "cc152k", "now"):
        write_release(str(tmp_path / "manual"), dataset, sizes=TRAINABLE_SIZES)
    elif dataset == "vectors":
        vectors.write_folder(str(tmp_path / "manual"), make_arrays(labels=True))
    elif dataset == "inria":
        write_inria(tmp_path)
    elif dataset != "synthetic":
        write_mrl(tmp_path, dataset, sizes=(("train", 24), ("test", 16)), d_img=12, d_txt=8)


def _shrink(config, tmp_path):
    """The config's own choices at toy sizes: one epoch, small models and splits."""
    d, m = config.data, config.model
    if d.name == "synthetic":
        d.num_train, d.num_val, d.num_test = 16, 11, 11
    elif d.name == "vectors":
        d.folder = str(tmp_path / "manual")
    else:
        d.manual_dir, d.data_dir = str(tmp_path / "manual"), str(tmp_path / "prepared")
    if "val_images" in d:
        d.val_images = 0  # the fixture's dev split is smaller than the release's
    if d.get("split_rule") in ("test_head", "train_tail"):
        d.valid_len = 4  # validation rows carved from the fixture's splits
    if config.eval.kind == "recall":
        config.eval.recall.coco_5fold = False  # the fixture holds no 1K fold
    m.embed_dim = 16
    if m.text_input == "tokens":
        m.tokens.word_dim = 8
    else:
        m.text_mlp.hidden = (16,)
    if m.head == "cosine" and m.image_input == "global":
        m.cosine.image_hidden = (16,)
    if m.head != "cosine":
        m.sgraf.sim_dim, m.sgraf.remat = 8, "none"
        m.sgraf.length_groups = 1  # one branch per chunk compiles faster; grouping: tests/models
    if m.head == "sgr":
        m.sgr.steps = 1
    kwargs = config.method_kwargs
    if "warmup_epochs" in kwargs:
        kwargs.warmup_epochs = 0  # the epoch reaches the method's own loss
    if "noisy_start_epoch" in kwargs:
        kwargs.noisy_start_epoch = 0
    if "pseudo_start_epoch" in kwargs:  # PC2: both updates in the one epoch
        kwargs.pseudo_start_epoch = kwargs.classification_start_epoch = 0
    if "neighbours" in kwargs:
        kwargs.neighbours = 3
    config.train.epochs, config.train.num_devices, config.train.progress_bar = 1, 1, False
    config.train.batch_size = config.eval.batch_size = 4


# In the default run: CE on each labelled benchmark (MLPs, seconds each: every builder
# through a config), UOT-RCL on one of them and the InfoNCE config. Slow: UOT-RCL on the
# other three (the same model and method, 11-13 s each); the SGR head on precomp files
# compiles for half a minute or more on 2 cores (that path is in the default run through
# NCR's F30K config, tests/train/test_real_configs.py), and the other synthetic configs
# train in the default run elsewhere (tests/train/test_loop.py, tests/methods/,
# tests/notebooks/).
DEFAULT = {
    ("infonce", "synthetic"),
    ("gsc", "vectors"),
    ("ce", "vectors"),
    ("uot_rcl", "xmedianet"),
} | {("ce", d) for d in ("wiki", "nuswide", "xmedianet", "inria")}
TRAIN = [
    (n, d) if (n, d) in DEFAULT else pytest.param(n, d, marks=pytest.mark.slow)
    for n, d in PAIRS
    if n != "uot_xmedianet"  # configs/uot_rcl.py:xmedianet (tests/train/test_real_configs.py)
]


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "dataset"), TRAIN)
def test_config_trains_on_its_datasets(tmp_path, name, dataset):
    _write_fixture(tmp_path, dataset)
    config = load(name, dataset)
    _shrink(config, tmp_path)
    results = train_and_evaluate(config, str(tmp_path / "run"))
    keys = ("map_i2t", "map_t2i") if config.eval.kind == "map" else ("i2t_r1", "t2i_r1", "rsum")
    assert all(math.isfinite(results[k]) for k in keys), results


def test_pc2_keeps_eight_classes_per_pair_only_on_your_own_vectors():
    """PC2's banks on the user's path keep each pair's 8 most probable classes (208 bytes
    per pair for both networks); the paper's configs keep every class."""
    assert load("pc2", "vectors").method_kwargs.bank_classes == 8
    built = methods.build_method("pc2", load("pc2", "vectors").method_kwargs)
    assert built.settings.bank_classes == 8
    for arg in ("synthetic", "f30k", "coco", "cc152k"):
        assert load("pc2", arg).method_kwargs.get("bank_classes") is None
