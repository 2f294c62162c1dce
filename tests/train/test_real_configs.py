"""The shipped real-benchmark configs of GSC, NCR and UOT-RCL train on files in the released
layouts (tiny fixtures written by the data tests' helpers), model sizes shrunk."""

import math
import os

import pytest

from ncljax import config as config_lib
from ncljax.train import train_and_evaluate
from tests.data.test_labelled import write_mrl
from tests.data.test_precomp import TRAINABLE_SIZES, write_release

pytestmark = pytest.mark.heavy  # out of the default run; CI runs it (see pyproject.toml)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_config(name, arg=""):
    return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)


def _small_run(config, tmp_path, *, batch):
    config.data.manual_dir = str(tmp_path / "manual")
    config.data.data_dir = str(tmp_path / "prepared")
    config.train.batch_size = config.eval.batch_size = batch
    config.train.epochs = 1
    config.train.num_devices = 1
    config.train.progress_bar = False
    return train_and_evaluate(config, str(tmp_path / "run"))


SLOW = pytest.mark.slow  # 35-50 s each on 2 cores (SGR compiles); NCR f30k stays in the default run


@pytest.mark.parametrize(
    "dataset",
    # All slow: GSC's SGR passes are tested in tests/methods/test_gsc.py, the precomp
    # path with SGR end to end by the NCR config below.
    [pytest.param(d, marks=SLOW) for d in ("f30k", "coco", "cc152k")],
)
def test_gsc_configs_train_on_precomp_files(tmp_path, dataset):
    write_release(str(tmp_path / "manual"), dataset, sizes=TRAINABLE_SIZES)
    config = load_config("gsc", f"{dataset},quick")
    config.data.val_images = 0  # the fixture's dev split is smaller than NCR's 1000 images
    config.eval.recall.coco_5fold = False  # its 3 test images hold no 1K fold
    m = config.model
    m.embed_dim, m.tokens.word_dim, m.sgraf.sim_dim, m.sgr.steps = 16, 8, 8, 1
    m.sgraf.remat = "none"  # compiles in about half the time; remat is tested in tests/models
    m.sgraf.length_groups = 1  # one branch per chunk compiles faster; grouping: tests/models
    if dataset == "cc152k":
        config.method_kwargs.warmup_epochs = 0  # one epoch: reach the GSC phase at once
    results = _small_run(config, tmp_path, batch=4)
    assert config.method == "gsc" and config.model.head == "sgr"
    assert all(math.isfinite(results[k]) for k in ("i2t_r1", "t2i_r1", "rsum"))


@pytest.mark.parametrize("dataset", ["f30k", "coco", "cc152k"])
def test_gsc_presets_name_their_text_structure(dataset):
    """The official GSC+ scripts' preset uses that code's word-aligned intra-text structure;
    the paper's and the single-network presets the attention form."""
    forms = {}
    for preset in ("", "code", "single"):
        config = load_config("gsc", ",".join(filter(None, [dataset, preset])))
        forms[preset] = (config.method_kwargs.text_structure, config.method_kwargs.num_networks)
    assert forms == {"": ("attention", 2), "code": ("aligned", 2), "single": ("attention", 1)}


@pytest.mark.parametrize(
    ("name", "dataset"),
    [
        ("uot_xmedianet", "xmedianet"),  # the design card's name: configs/uot_rcl.py:xmedianet
        pytest.param("uot_rcl", "wiki", marks=SLOW),
        pytest.param("uot_rcl", "nuswide", marks=SLOW),
    ],
)
def test_uot_configs_train_on_mrl_files(tmp_path, name, dataset):
    write_mrl(tmp_path, dataset, sizes=(("train", 48), ("test", 24)), d_img=12, d_txt=8)
    config = load_config(name, "" if name == "uot_xmedianet" else dataset)
    config.data.valid_len = 12
    config.model.cosine.image_hidden = config.model.text_mlp.hidden = (16,)
    config.model.embed_dim = 8
    config.method_kwargs.warmup_epochs = 0  # one epoch: refresh, partial OT and L_BHG at once
    config.method_kwargs.neighbours = 5
    results = _small_run(config, tmp_path, batch=12)
    assert config.method == "uot_rcl"
    assert 0 < results["map_i2t"] <= 1 and 0 < results["map_t2i"] <= 1


@pytest.mark.parametrize(
    "dataset", ["f30k", pytest.param("coco", marks=SLOW), pytest.param("cc152k", marks=SLOW)]
)
def test_ncr_configs_train_on_precomp_files(tmp_path, dataset):
    """One co-training epoch at once (the quick preset): co-divide, both networks in turn
    on their peer's division, the clean and the noisy update, through the SGR head."""
    write_release(str(tmp_path / "manual"), dataset, sizes=TRAINABLE_SIZES)
    config = load_config("ncr", f"{dataset},quick")
    config.data.val_images = 0
    config.eval.recall.coco_5fold = False
    m = config.model
    m.embed_dim, m.tokens.word_dim, m.sgraf.sim_dim, m.sgr.steps = 16, 8, 8, 1
    m.sgraf.remat = "none"  # compiles in about half the time; remat is tested in tests/models
    m.sgraf.length_groups = 1  # one branch per chunk compiles faster; grouping: tests/models
    results = _small_run(config, tmp_path, batch=4)
    assert config.method == "ncr" and config.model.head == "sgr"
    assert config.method_kwargs.num_networks == 2
    assert all(math.isfinite(results[k]) for k in ("i2t_r1", "t2i_r1", "rsum"))
