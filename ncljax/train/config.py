"""The base configuration every config file starts from, and its validation.

Every field a run can read exists here, so ``lock_config=True`` turns a mistyped
``--config.x.y=...`` override into an error. Config files (``configs/*.py``) start from
``base_config()``, set the method, dataset and hyperparameters, and fill
``method_kwargs`` with exactly the hyperparameters their method takes.
"""

from __future__ import annotations

import logging
import math

import ml_collections

from ncljax.data import synthetic

NOISE_KINDS = ("none", "per_caption", "per_image", "file", "symmetric", "asymmetric")
EVAL_KINDS = ("recall", "map")
OPTIMIZERS = ("adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
HEADS = ("cosine", "sgr", "saf")


def base_config() -> ml_collections.ConfigDict:
    """Defaults for every field; the synthetic dataset with the VSE baseline."""
    c = ml_collections.ConfigDict()
    c.method = "vse"
    c.method_kwargs = ml_collections.ConfigDict()
    c.seed = 0
    c.distributed = False  # call jax.distributed.initialize() (multi-host runs)

    set_data(c, synthetic.default_config())

    c.noise = ml_collections.ConfigDict()
    c.noise.kind = "none"  # one of NOISE_KINDS
    c.noise.rate = 0.0
    c.noise.seed = 0
    c.noise.file = ""  # official index file for kind='file'
    c.noise.file_kind = "auto"  # 'auto', 'per_caption' or 'per_image': what the file must be
    c.noise.exact = True  # correspondence noise: no pair keeps its image by chance
    c.noise.shared_label = True  # label noise: one noisy label per pair for both modalities
    c.noise.exclude_true = False  # symmetric label noise: never redraw the true label

    c.model = ml_collections.ConfigDict()
    c.model.head = "cosine"  # 'cosine', or the SGRAF heads 'sgr' / 'saf'
    c.model.image_input = "regions"  # 'regions' [R, D] or 'global' feature vectors
    c.model.text_input = "tokens"  # 'tokens' (Bi-GRU) or 'global' feature vectors
    c.model.embed_dim = 256
    c.model.image_hidden = ()  # hidden widths of the image MLP / region projection
    c.model.text_hidden = ()  # hidden widths of the text MLP ('global' text only)
    c.model.word_dim = 128
    c.model.text_dropout = 0.0
    c.model.bidirectional = True
    c.model.classifier = False  # unit class prototypes on the embeddings
    c.model.temperature = 1.0  # prototype softmax temperature
    c.model.sim_dim = 256  # SGRAF similarity vectors
    c.model.sgr_steps = 3  # SGR graph-reasoning steps
    c.model.smooth = 9.0  # SCAN attention smoothing
    c.model.sim_output = "sigmoid"  # SGRAF: 'sigmoid' of the head's logit, or 'raw'
    c.model.pair_chunk = 16  # SGRAF: captions per chunk of the pairwise computation
    c.model.remat = True  # SGRAF: recompute each chunk in the backward pass (memory)

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adam"
    c.optim.learning_rate = 2e-4
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0  # adamw only
    c.optim.grad_clip = 2.0  # global-norm clipping; 0 disables it
    c.optim.schedule = "constant"  # 'constant', 'step' or 'cosine'
    c.optim.decay_factor = 0.1  # 'step' schedule
    c.optim.decay_every = 10  # 'step' schedule, in epochs

    c.train = ml_collections.ConfigDict()
    c.train.epochs = 10
    c.train.batch_size = 128
    c.train.num_devices = 0  # 0: all visible devices
    c.train.log_every_steps = 50
    c.train.checkpoint_every_steps = 0  # 0: at the end of every epoch only
    c.train.progress_bar = True

    c.eval = ml_collections.ConfigDict()
    c.eval.kind = "recall"  # 'recall' (Recall@K, rSum) or 'map' (mAP@all)
    c.eval.batch_size = 256  # encoding batch size
    c.eval.image_chunk = 1000
    c.eval.text_chunk = 5000
    c.eval.coco_5fold = False  # test metrics averaged over 5 folds of 1K images
    c.eval.test_last_epoch = False  # also test the final parameters (results as last_*)
    return c


def set_data(config, data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Uses the dataset section ``data`` (a dataset's ``default_config()``) in ``config``.

    Adds the pipeline fields every dataset shares.
    """
    data = data.copy_and_resolve_references()
    data.num_threads = 2  # Grain reader threads
    data.prefetch = 4  # batches read ahead
    data.length_buckets = ()  # cut each training batch's tokens to the first bucket that fits
    config.data = data
    return config


def validate(config, info) -> None:
    """Checks a config against a dataset before anything is built.

    Raises:
      ValueError: with one message that says which field to change and how.
    """
    _, train_pairs = info.split_sizes["train"]
    if config.train.batch_size > train_pairs:
        raise ValueError(
            f"train.batch_size={config.train.batch_size} is larger than the training split "
            f"({train_pairs} pairs); lower it to at most {train_pairs}."
        )
    if config.train.batch_size < 2:
        raise ValueError("train.batch_size must be at least 2 (in-batch negatives).")
    if config.noise.kind not in NOISE_KINDS:
        raise ValueError(f"noise.kind must be one of {NOISE_KINDS}, got {config.noise.kind!r}.")
    if not 0.0 <= config.noise.rate <= 1.0:
        raise ValueError(f"noise.rate must be in [0, 1], got {config.noise.rate}.")
    if config.noise.kind in ("symmetric", "asymmetric") and info.num_classes < 2:
        raise ValueError(f"Label noise needs class labels; {info.name} has none.")
    if config.eval.kind not in EVAL_KINDS:
        raise ValueError(f"eval.kind must be one of {EVAL_KINDS}, got {config.eval.kind!r}.")
    if config.eval.kind == "map" and info.num_classes < 1:
        raise ValueError(f"eval.kind='map' needs class labels; {info.name} has none.")
    if config.train.epochs < 1:
        raise ValueError(f"train.epochs must be positive, got {config.train.epochs}.")


def check_fields(config) -> None:
    """Checks every field's type and range, before a dataset is read or a file written.

    Raises:
      ValueError: one message naming the field, its value and what it must be.
    """
    problems = []

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            value = config
            for part in field.split("."):
                value = value[part]
            problems.append(f"{field}={value!r} must be {what}")

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    t, e, o, m, d = config.train, config.eval, config.optim, config.model, config.data
    need(is_int(t.epochs) and t.epochs >= 1, "train.epochs", "a positive integer")
    need(is_int(t.batch_size) and t.batch_size >= 2, "train.batch_size", "an integer >= 2")
    need(is_int(t.num_devices) and t.num_devices >= 0, "train.num_devices", "an integer >= 0")
    need(
        is_int(t.log_every_steps) and t.log_every_steps >= 1,
        "train.log_every_steps",
        "a positive integer",
    )
    need(
        is_int(t.checkpoint_every_steps) and t.checkpoint_every_steps >= 0,
        "train.checkpoint_every_steps",
        "an integer >= 0 (0: at the end of every epoch)",
    )
    need(e.kind in EVAL_KINDS, "eval.kind", f"one of {EVAL_KINDS}")
    for field in ("batch_size", "image_chunk", "text_chunk"):
        need(is_int(e[field]) and e[field] >= 1, f"eval.{field}", "a positive integer")
    need(o.name in OPTIMIZERS, "optim.name", f"one of {OPTIMIZERS}")
    need(o.schedule in SCHEDULES, "optim.schedule", f"one of {SCHEDULES}")
    need(
        is_number(o.learning_rate) and o.learning_rate > 0,
        "optim.learning_rate",
        "a positive number (a negative one would ascend the loss)",
    )
    need(is_number(o.b1) and 0 <= o.b1 < 1, "optim.b1", "in [0, 1)")
    need(is_number(o.b2) and 0 <= o.b2 < 1, "optim.b2", "in [0, 1)")
    need(is_number(o.eps) and o.eps >= 0, "optim.eps", "a number >= 0")
    need(is_number(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", "a number >= 0")
    need(
        is_number(o.grad_clip) and o.grad_clip >= 0,
        "optim.grad_clip",
        "a number >= 0 (0 disables clipping)",
    )
    need(is_number(o.decay_factor) and 0 < o.decay_factor <= 1, "optim.decay_factor", "in (0, 1]")
    need(is_int(o.decay_every) and o.decay_every >= 1, "optim.decay_every", "a positive integer")
    need(m.head in HEADS, "model.head", f"one of {HEADS}")
    need(m.image_input in ("regions", "global"), "model.image_input", "'regions' or 'global'")
    need(m.text_input in ("tokens", "global"), "model.text_input", "'tokens' or 'global'")
    for field in ("embed_dim", "word_dim", "sim_dim", "sgr_steps", "pair_chunk"):
        need(is_int(m[field]) and m[field] >= 1, f"model.{field}", "a positive integer")
    for field in ("image_hidden", "text_hidden"):
        widths = m[field]
        need(
            isinstance(widths, (tuple, list)) and all(is_int(w) and w >= 1 for w in widths),
            f"model.{field}",
            "a tuple of positive integers, e.g. '(1024,)' or '()'",
        )
    need(is_number(m.text_dropout) and 0 <= m.text_dropout < 1, "model.text_dropout", "in [0, 1)")
    need(is_number(m.temperature) and m.temperature > 0, "model.temperature", "a positive number")
    buckets = d.length_buckets
    need(
        isinstance(buckets, (tuple, list)) and all(is_int(b) and b >= 1 for b in buckets),
        "data.length_buckets",
        "a tuple of positive token counts, e.g. '(16, 32, 64)' or '()'",
    )
    need(is_int(d.num_threads) and d.num_threads >= 0, "data.num_threads", "an integer >= 0")
    need(is_int(d.prefetch) and d.prefetch >= 0, "data.prefetch", "an integer >= 0")
    need(config.noise.kind in NOISE_KINDS, "noise.kind", f"one of {NOISE_KINDS}")
    need(is_number(config.noise.rate) and 0 <= config.noise.rate <= 1, "noise.rate", "in [0, 1]")
    if config.noise.kind != "file" and config.noise.file:
        problems.append(
            f"noise.file={config.noise.file!r} is only read with noise.kind='file', not "
            f"{config.noise.kind!r}; set noise.kind='file' or noise.file=''"
        )
    if config.noise.kind == "none" and config.noise.rate:  # the usual way to switch noise off
        logging.warning(
            "noise.rate=%s has no effect with noise.kind='none': the run trains on the data's "
            "own pairs and labels.",
            config.noise.rate,
        )
    if problems:
        raise ValueError("Invalid config: " + "; ".join(problems) + ".")


# How far noise.rate may be from the rate a noise file realises (index files of the same
# nominal rate realise slightly less: a few pairs keep their own caption by chance).
NOISE_FILE_RATE_TOLERANCE = 0.05


def check_noise(noise, realised_rate: float) -> None:
    """Refuses ``noise.rate`` that contradicts the rate a noise file realises (``0`` is
    always accepted: the file decides)."""
    if (
        noise.kind == "file"
        and noise.rate
        and (abs(noise.rate - realised_rate) > NOISE_FILE_RATE_TOLERANCE)
    ):
        raise ValueError(
            f"noise.rate={noise.rate} but the noise file {noise.file} makes "
            f"{realised_rate:.3f} of the pairs noisy; with noise.kind='file' the file decides: "
            f"set noise.rate=0 (or {realised_rate:.2f}) to record what the run uses."
        )


def use_sgraf(config, head: str = "sgr") -> ml_collections.ConfigDict:
    """The SGRAF backbone with the official sizes (region features and tokens, 1024-d, 300-d
    words, dropout 0.4, 256-d similarity vectors, 3 SGR steps, smoothing 9, sigmoid output)
    and the NCR/SGRAF optimiser: Adam 2e-4, clipping 2.0, x0.1 after 30 epochs, batch 128."""
    m = config.model
    m.head, m.image_input, m.text_input = head, "regions", "tokens"
    m.embed_dim, m.word_dim, m.sim_dim, m.text_dropout = 1024, 300, 256, 0.4
    m.sgr_steps, m.smooth, m.sim_output = 3, 9.0, "sigmoid"
    config.optim.learning_rate, config.optim.grad_clip = 2e-4, 2.0
    config.optim.schedule, config.optim.decay_factor, config.optim.decay_every = "step", 0.1, 30
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
    m.image_hidden, m.text_hidden, m.embed_dim = tuple(hidden), tuple(hidden), out_dim
    m.classifier, m.temperature = True, 1.0
    o = config.optim
    o.learning_rate, o.b1, o.schedule, o.grad_clip = 1e-4, 0.5, "cosine", 0.0
    config.eval.kind = "map"
    config.eval.test_last_epoch = True  # UOT-RCL reports best-validation and last-epoch test mAP
    return config


def quick(config) -> ml_collections.ConfigDict:
    """A smoke run of a real-data config: one epoch, frequent logs."""
    config.train.epochs = 1
    config.train.log_every_steps = 10
    return config


def method_kwargs(name: str, **overrides) -> ml_collections.ConfigDict:
    """Method ``name``'s hyperparameters: the defaults of its factory's signature, then
    ``overrides`` (so a config never repeats, or drifts from, the method's defaults)."""
    import inspect

    from ncljax import methods

    factory = methods.REGISTRY[name]
    defaults = {
        k: p.default
        for k, p in inspect.signature(factory).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"Method {name!r} does not take {unknown}; it takes {sorted(defaults)}.")
    return ml_collections.ConfigDict({**defaults, **overrides})


def uot_rcl_kwargs(**overrides) -> ml_collections.ConfigDict:
    """UOT-RCL's hyperparameters: the defaults of ``ncljax.methods.uot_rcl``, then
    ``overrides``."""
    return method_kwargs("uot_rcl", **overrides)


def gsc_kwargs(**overrides) -> ml_collections.ConfigDict:
    """GSC's hyperparameters: the defaults of ``ncljax.methods.gsc`` (the spec's: paper
    values, F30K GSC+ script), then ``overrides``."""
    return method_kwargs("gsc", **overrides)


# GSC's per-dataset settings (gsc.md Sec. 5.4): (gamma, lr decay period, epochs, networks).
GSC_PRESETS = {
    "paper": {name: (0.01, 15, 60, 2) for name in ("f30k", "coco", "cc152k")},
    "code": {"f30k": (0.01, 15, 60, 2), "coco": (0.05, 15, 30, 2), "cc152k": (0.02, 20, 60, 2)},
    "single": {"f30k": (0.01, 15, 60, 1), "coco": (1.0, 20, 60, 1), "cc152k": (0.01, 15, 60, 1)},
}
# The intra-text structure of each preset: the GSC+ scripts' word-aligned form, or the
# single-network code's attention form (the paper does not say which; see methods.gsc).
GSC_TEXT_STRUCTURE = {"paper": "attention", "code": "aligned", "single": "attention"}


def use_gsc(config, dataset: str, preset: str = "paper") -> ml_collections.ConfigDict:
    """GSC on the SGR backbone with the settings of ``preset`` for ``dataset``.

    ``'paper'``: the paper's values for every dataset (gamma 0.01, lr x0.2 every 15
    epochs; 60 epochs as the F30K scripts; dual networks; the attention form of the
    intra-text structure): the spec's default. ``'code'``: the official GSC+ scripts
    (COCO gamma 0.05 and 30 epochs; CC152K gamma 0.02 and decay every 20) and the GSC+
    code's word-aligned intra-text structure. ``'single'``: the official single-network
    GSC scripts (COCO's passes no gamma and gets the argparse default 1.0, with decay
    every 20) and that code's attention form.
    """
    if preset not in GSC_PRESETS:
        raise ValueError(f"GSC preset must be one of {sorted(GSC_PRESETS)}, got {preset!r}.")
    gamma, decay_every, epochs, networks = GSC_PRESETS[preset][dataset]
    use_sgraf(config, "sgr")
    config.method = "gsc"
    config.method_kwargs = gsc_kwargs(
        intra_weight=gamma,
        num_networks=networks,
        text_structure=GSC_TEXT_STRUCTURE[preset],
    )
    config.optim.schedule, config.optim.decay_factor = "step", 0.2
    config.optim.decay_every = decay_every
    config.train.epochs, config.train.batch_size = epochs, 128
    return config
