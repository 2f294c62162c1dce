"""Settings shared by the config files: each dataset's protocol and the papers' backbones.

A config file (``configs/<method>.py``) starts from ``start(dataset)``: the base config
with the dataset's section, its noise and evaluation protocol and the backbone its
papers train on it (SGRAF on the precomp benchmarks, MRL's MLPs on the labelled ones,
small encoders on the synthetic data, MLPs on a folder of your own vectors); then it sets
its method and the values of its own per-dataset table, and ends with ``quick(config)``
when asked for a smoke run. ``dataset_hint`` says which config files take a dataset
(their ``DATASETS``).
"""

from __future__ import annotations

import glob
import importlib.util
import os

import ml_collections

from ncljax.config import base as config_lib
from ncljax.config import fields, files
from ncljax.data import sources, worlds

CONFIG_DIR = files.CONFIG_DIR  # the shipped config files
PRECOMP = ("f30k", "coco", "cc152k", "now")
LABELLED = ("wiki", "nuswide", "xmedianet", "inria")

# Correspondence noise of the precomp benchmarks: NCR's per-caption protocol at 0.2 on
# F30K and COCO (the papers also report 0.4-0.8; or noise.kind='file' with an official
# index file); none on the web datasets, whose pairs are noisy already (CC152K: about
# 3-20% mismatched).
PRECOMP_NOISE = {"f30k": 0.2, "coco": 0.2, "cc152k": None, "now": None}
# MRL/UOT-RCL batch sizes of the labelled benchmarks (also the encoding batch).
LABELLED_BATCH = {"wiki": 100, "nuswide": 500, "xmedianet": 100, "inria": 200}


def use_sgraf(config, head: str = "sgr") -> ml_collections.ConfigDict:
    """The SGRAF backbone with the official sizes (region features and tokens, 1024-d, 300-d
    words, dropout 0.4, 256-d similarity vectors, 3 SGR steps, smoothing 9, sigmoid output)
    and the NCR/SGRAF optimiser: Adam 2e-4, clipping 2.0, x0.1 after 30 epochs, batch 128,
    40 epochs."""
    m = config.model
    m.head, m.image_input, m.text_input = head, "regions", "tokens"
    m.embed_dim, m.tokens.word_dim, m.sgraf.sim_dim, m.tokens.dropout = 1024, 300, 256, 0.4
    m.sgr.steps, m.sgraf.smooth, m.sgraf.sim_output = 3, 9.0, "sigmoid"
    config.optim.learning_rate, config.optim.grad_clip = 2e-4, 2.0
    config.optim.schedule, config.optim.step.factor, config.optim.step.every = "step", 0.1, 30
    config.train.batch_size, config.train.epochs = 128, 40
    # The pairwise head costs ~ tokens per caption: pay for each batch's longest caption.
    config.data.length_buckets = (16, 24, 32, 40, 48, 64, 80, 96, 128)
    return config


def use_mrl(config, *, hidden=(4096, 4096), out_dim: int = 512) -> ml_collections.ConfigDict:
    """The MRL/UOT-RCL backbone: two MLPs ``d -> 4096 -> 4096 -> 512`` over global features,
    unit class prototypes (temperature 1), Adam 1e-4 with betas (0.5, 0.999), cosine
    annealing, no clipping, mAP@all evaluation (test mAP of the best-validation and of the
    last epoch)."""
    m = config.model
    m.head, m.image_input, m.text_input = "cosine", "global", "global"
    m.cosine.image_hidden, m.text_mlp.hidden, m.embed_dim = tuple(hidden), tuple(hidden), out_dim
    m.classifier, m.prototypes.temperature = True, 1.0
    o = config.optim
    o.learning_rate, o.b1, o.schedule, o.grad_clip = 1e-4, 0.5, "cosine", 0.0
    config.eval.kind = "map"
    config.eval.test_last_epoch = True  # UOT-RCL reports best-validation and last-epoch test mAP
    return config


def _synthetic_pairs(config) -> None:
    """Image-caption retrieval on the embedded data: 20,000 pairs with 40% per-caption
    noise; region encoder, Bi-GRU and cosine head, small enough for 2 CPU cores (Adam 1e-3,
    batch 128, 12 epochs)."""
    config.noise.kind, config.noise.rate = "per_caption", 0.4
    config.model.embed_dim, config.model.tokens.word_dim = 128, 64
    config.optim.learning_rate = 1e-3
    config.train.epochs, config.train.batch_size = 12, 128


def _synthetic_labels(config) -> None:
    """Category retrieval under label noise on the embedded data: one caption per image,
    10,000 training pairs, 40% symmetric label noise, MRL's backbone scaled to the 64-d
    features (512-wide MLPs, 128-d embeddings, Adam 1e-3: MRL's 1e-4 is for 4096-d
    features), 20 epochs of batch 100."""
    d = config.data
    d.captions_per_image, d.class_purity = 1, 0.9
    d.num_train, d.num_val, d.num_test = 10000, 1000, 2000
    config.noise.kind, config.noise.rate = "symmetric", 0.4
    use_mrl(config, hidden=(512, 512), out_dim=128)
    config.optim.learning_rate = 1e-3
    config.train.epochs, config.train.batch_size, config.eval.batch_size = 20, 100, 200


def _vectors_pairs(config) -> None:
    """Image-caption retrieval on a folder of your own vectors (``data.folder``): the
    folder's own pairs (no simulated noise: a crawl's mismatched pairs are in the folder),
    MLP encoders ``D -> 1024 -> 256`` over the global vectors (``D`` read from the files)
    and the cosine head, Adam 5e-4 with clipping 2.0, constant rate, batch 128, 20 epochs,
    Recall@K on the folder's val and test splits; the best validation epoch is chosen among
    every epoch, warm-up included (``train.select_every_epoch``: a warm-up model is a model
    you can use)."""
    config_lib.set_data(config, sources.default_config("vectors"))
    m = config.model
    m.head, m.image_input, m.text_input = "cosine", "global", "global"
    m.cosine.image_hidden = m.text_mlp.hidden = (1024,)
    m.embed_dim = 256
    config.noise.kind, config.noise.rate = "none", 0.0
    config.optim.learning_rate = 5e-4
    config.train.batch_size, config.train.epochs = 128, 20
    config.train.select_every_epoch = True  # a warm-up model is a model a user can use
    config.train.pair_trajectory = True  # the audit ranks by the model's history


def race_division(config, dataset: str) -> ml_collections.ConfigDict:
    """On a folder of your own vectors (``dataset='vectors'``), a method that divides its
    pairs races its division against none (``train.division='race'``,
    ``ncljax.train.arms``): it trains twice, divided and undivided, and the run whose best
    model validates higher is the run's. Whether the pairs a model places worst lie or are
    merely hard cannot be read from the model's scores; which model retrieves better,
    the validation split tells. Other datasets keep the method's protocol."""
    if dataset == "vectors":
        config.train.division = "race"
    return config


def _vectors_labels(config) -> None:
    """Category retrieval on a folder of your own vectors with ``{split}_labels.npy`` (the
    observed, possibly noisy labels; required): MRL's backbone scaled to off-the-shelf
    embeddings (MLPs ``D -> 1024 -> 1024 -> 256``, unit class prototypes, Adam 3e-4 with
    betas 0.5/0.999, cosine annealing), batch 100, 50 epochs, mAP@all."""
    config_lib.set_data(config, sources.default_config("vectors"))
    config.data.require_labels = True
    use_mrl(config, hidden=(1024, 1024), out_dim=256)
    config.noise.kind, config.noise.rate = "none", 0.0
    config.optim.learning_rate = 3e-4
    config.train.epochs = 50
    config.train.batch_size = config.eval.batch_size = 100


def start(
    dataset: str, *, labels: bool = False, world: str | None = None
) -> ml_collections.ConfigDict:
    """The base config for ``dataset`` with its protocol and its papers' backbone.

    Args:
      dataset: ``'synthetic'``, a precomp benchmark (``PRECOMP``), a labelled one
        (``LABELLED``) or ``'vectors'`` (a folder of your own vectors).
      labels: on the synthetic data and on vectors, the noisy-label setting (category
        retrieval, mAP) instead of noisy correspondence (Recall@K).
      world: on the synthetic data, a world of ``ncljax.data.worlds`` (None: the preset).
    """
    config = config_lib.base_config()
    if dataset == "synthetic":
        (_synthetic_labels if labels else _synthetic_pairs)(config)
        if world is not None:
            apply_world(config, world)
        return config
    if dataset == "vectors":
        (_vectors_labels if labels else _vectors_pairs)(config)
        return config
    config_lib.set_data(config, sources.default_config(dataset))
    if dataset in PRECOMP:
        use_sgraf(config, "sgr")
        rate = PRECOMP_NOISE[dataset]
        config.noise.kind, config.noise.rate = ("per_caption", rate) if rate else ("none", 0.0)
        config.eval.recall.coco_5fold = dataset == "coco"  # test: 5 folds of 1K (5K as full_*)
    elif dataset in LABELLED:
        use_mrl(config)
        config.noise.kind, config.noise.rate = "symmetric", 0.4  # the papers: 0.2-0.8
        config.train.epochs = 100
        config.train.batch_size = config.eval.batch_size = LABELLED_BATCH[dataset]
    else:
        raise ValueError(f"No preset for dataset {dataset!r}.")
    return config


def datasets_of(path: str) -> tuple[str, ...]:
    """The datasets config file ``path`` takes as its argument (its ``DATASETS``).

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file defines no ``DATASETS``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Config file {path} not found.")
    name = "_ncljax_datasets_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    datasets = getattr(module, "DATASETS", None)
    if datasets is None:
        raise ValueError(f"Config file {path} defines no DATASETS (the datasets it takes).")
    return tuple(datasets)


def config_files_taking(dataset: str, folder: str = CONFIG_DIR) -> list[str]:
    """``'<folder>/<file>.py:<dataset>'`` for each config file in ``folder`` that takes
    ``dataset`` (sorted; empty when ``folder`` does not exist)."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "[!_]*.py"))):
        try:
            if dataset in datasets_of(path):
                found.append(f"{path}:{dataset}")
        except Exception:  # a file that does not import is not one to suggest
            continue
    return found


def dataset_hint(path: str, dataset: str) -> str:
    """How to train on ``dataset`` with config file ``path``, suggesting only arguments
    that work: ``--config=path:dataset`` when the file takes ``dataset``; otherwise what it
    takes and the config files beside it that take ``dataset``."""
    if dataset in datasets_of(path):
        return f"pass the dataset as the config file's argument: --config={path}:{dataset}"
    folder = os.path.dirname(path)
    others = [f"--config={other}" for other in config_files_taking(dataset, folder or ".")]
    where = (
        f"the config files that take it: {', '.join(others)}"
        if others
        else f"no config file in {folder or '.'} takes it"
    )
    return f"{path} takes only {', '.join(datasets_of(path))}, not {dataset}; {where}"


def schedule(
    config, warmup: int, main: int, decay_every: int | None, *, decay_factor: float | None = None
) -> ml_collections.ConfigDict:
    """Sets the epochs of a method with a warm-up: ``warmup + main`` epochs in all, and the
    step decay of the learning rate every ``decay_every`` main epochs (the plan's
    ``lr_epoch`` counts from the end of the warm-up; ``None``: no decay set here)."""
    config.train.epochs = warmup + main
    if decay_every:
        config.optim.step.every = decay_every
        if decay_factor is not None:
            config.optim.step.factor = decay_factor
    return config


def quick(config) -> ml_collections.ConfigDict:
    """A smoke run: one epoch of a real dataset; on the synthetic data, small splits and
    two epochs (three for the noisy-label setting)."""
    if config.data.name != "synthetic":
        config.train.epochs, config.train.log_every_steps = 1, 10
    elif config.eval.kind == "map":
        d = config.data
        d.num_train, d.num_val, d.num_test = 1000, 200, 200
        config.train.epochs, config.train.log_every_steps = 3, 5
    else:
        d = config.data
        d.num_train, d.num_val, d.num_test = 256, 32, 64
        config.train.epochs, config.train.log_every_steps = 2, 10
        config.train.batch_size = config.eval.batch_size = 64
    return config


def quick_coteaching(config, dataset: str, second_start: str) -> ml_collections.ConfigDict:
    """:func:`quick` for a co-teaching method (NCR, PC2): on the synthetic data a warm-up
    epoch, then two co-training epochs with both updates (the method argument
    ``second_start`` names the second update's first epoch) on 512 training pairs; on
    real data its one epoch skips the warm-up and makes both updates."""
    quick(config)
    kwargs = config.method_kwargs
    kwargs.warmup_epochs = kwargs[second_start] = int(dataset == "synthetic")
    if dataset == "synthetic":
        config.data.num_train, config.data.num_val = 512, 64
        config.train.epochs = 3
    return config


def schedule_warmup(
    config, dataset: str, options, epochs: tuple[int, int, int | None]
) -> ml_collections.ConfigDict:
    """The epochs of a method whose warm-up is ``method_kwargs.warmup_epochs`` (SREM,
    UGNCL), from its row ``epochs = (warm-up, main, lr decay period in main epochs or
    None)`` of a per-dataset table: the warm-up, :func:`schedule` with x0.1 decays and,
    with the option ``quick``, a smoke run (:func:`quick`): on the synthetic data a
    warm-up epoch, then a main one; on real data its one epoch skips the warm-up."""
    warmup, main, decay_every = epochs
    config.method_kwargs.warmup_epochs = warmup
    schedule(config, warmup, main, decay_every, decay_factor=0.1)
    if "quick" in options:
        quick(config)
        config.method_kwargs.warmup_epochs = int(dataset == "synthetic")
    return config


def apply_world(config, name: str):
    """Puts world ``name`` into a synthetic config (in place) and returns it.

    Raises:
      ValueError: an unknown world, a world of the other family, or a config that does
        not train on the synthetic data.
    """
    world = worlds.get(name)
    if config.data.name != "synthetic":
        raise ValueError(
            f"world={name} is a synthetic world; data.name={config.data.name!r} is not "
            "the synthetic dataset."
        )
    family = worlds.LABELS if config.eval.kind == "map" else worlds.PAIRS
    if world.family != family:
        raise ValueError(
            f"world={name} is a {world.family} world; this config trains on noisy "
            f"{'labels' if family == worlds.LABELS else 'correspondence'}. Use one of "
            f"{worlds.names(family)}."
        )
    for field, value in world.data.items():
        config.data[field] = value
    m = config.model
    if world.inputs == "global" and m.head == "cosine":
        m.image_input = m.text_input = "global"
        if family == worlds.PAIRS:  # the labels preset has its own MLPs already
            m.cosine.image_hidden, m.text_mlp.hidden, m.embed_dim = (512,), (512,), 128
    config.train.batch_size = world.batch_size
    fields.reset_unread(config)
    return config
