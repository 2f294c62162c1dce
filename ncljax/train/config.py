"""The base configuration every config file starts from, and its validation.

Every field a run can read exists here, so ``lock_config=True`` turns a mistyped
``--config.x.y=...`` override into an error. Config files (``configs/<method>.py``) take
the dataset as their argument (``parse_arg``), start from ``base_config()`` and the shared
presets of ``ncljax.train.presets``, and fill ``method_kwargs`` from the method factory's
signature (``method_kwargs``).

Honest flags: a field that the chosen head, inputs, optimiser, schedule, evaluation kind
or noise kind does not read (``unread.CONDITIONAL_FIELDS``) must keep its default;
otherwise ``check_fields`` refuses the config with one message naming the field and why,
so a sweep over a field that changes nothing cannot go unnoticed. The data section must
belong to ``data.name`` (``switch_dataset`` rebuilds it for another dataset).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
from collections.abc import Collection, Sequence

import ml_collections

from ncljax.data import sources
from ncljax.train import evaluator, optim, unread

NOISE_KINDS = ("none", "per_caption", "per_image", "file", "symmetric", "asymmetric")
EVAL_KINDS = tuple(evaluator.EVAL_KINDS)
OPTIMIZERS = tuple(optim.OPTIMIZERS)
SCHEDULES = tuple(optim.SCHEDULES)
HEADS = ("cosine", "sgr", "saf")
# Fields of the data section that every dataset has (the pipeline's, added by set_data).
REMAT_CHOICES = ("auto", "full", "projections", "none")
PIPELINE_FIELDS = ("num_threads", "prefetch", "device_prefetch", "length_buckets")


def base_config() -> ml_collections.ConfigDict:
    """Defaults for every field; the synthetic dataset with the VSE baseline."""
    c = ml_collections.ConfigDict()
    c.method = "vse"
    c.method_kwargs = ml_collections.ConfigDict()
    c.seed = 0
    c.distributed = False  # call jax.distributed.initialize() (multi-host runs)

    set_data(c, sources.default_config("synthetic"))

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
    # SGRAF training: what the backward pass recomputes of each chunk of pairs: 'full'
    # (everything: least memory), 'projections' (stores the attention weights, similarity
    # vectors and reasoning projections; recomputes the 1024-wide tensors), 'none', or
    # 'auto': 'full' on CPU (where 'projections' saved 5% of a step for twice the
    # memory), 'projections' on accelerators.
    c.model.remat = "auto"
    # SGRAF: captions sorted by length, each chunk computed at the shortest of this many
    # static lengths that holds it (1: every chunk at the batch's padded length).
    c.model.length_groups = 4
    c.model.compute_dtype = "float32"  # SGRAF head's matrix products: or 'bfloat16'
    # Image views (UGNCL): W independent image projections, shared text encoder and head.
    c.model.views = 1

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

    Adds the pipeline fields every dataset shares, keeping their values from ``config``'s
    current data section when it has them.
    """
    data = data.copy_and_resolve_references()
    old = config.get("data") or {}
    data.num_threads = old.get("num_threads", 2)  # Grain reader threads
    data.prefetch = old.get("prefetch", 4)  # batches read ahead
    data.device_prefetch = old.get("device_prefetch", 2)  # batches put on the devices ahead
    # Cut each training batch's tokens to the first bucket that fits.
    data.length_buckets = old.get("length_buckets", ())
    locked = config.is_locked  # train.py's config is locked; a new section needs a moment
    if locked:
        config.unlock()
    config.data = data
    if locked:
        config.lock()
    return config


def switch_dataset(config, name: str, *, keep: Collection[str] = ()) -> ml_collections.ConfigDict:
    """Rebuilds the data section for dataset ``name`` from that dataset's defaults.

    The pipeline fields and the fields named in ``keep`` (e.g. those given on the command
    line: ``manual_dir``, ``data_dir``) keep their values where the new dataset has them.
    Everything outside the data section stays as it is: a config file's per-dataset
    settings (model, epochs, noise) are applied by its argument (``configs/m.py:wiki``).

    Raises:
      ValueError: for an unknown dataset (listing the known ones), or a kept field the
        new dataset does not have.
    """
    kept = {field: config.data[field] for field in keep if field != "name"}
    set_data(config, sources.default_config(name))
    for field, value in kept.items():
        if field not in config.data:
            raise ValueError(
                f"data.{field} is not a field of dataset {name!r}; its fields are "
                f"{sorted(config.data.keys())}."
            )
        config.data[field] = value
    return config


def parse_arg(
    arg: str, datasets: Sequence[str], options: Sequence[str] = ("quick",)
) -> tuple[str, frozenset[str]]:
    """Splits a config file's argument ``'<dataset>[,<option>...][,world=<name>]'``.

    ``world=<name>`` (the synthetic dataset only) picks a world of ``ncljax.train.worlds``;
    ``world_of(options)`` reads it back.

    Returns:
      The dataset (the first of ``datasets`` when ``arg`` names none) and the options.

    Raises:
      ValueError: for an unknown word, an unknown world or more than one dataset, listing
        what is allowed.
    """
    from ncljax.train import worlds  # late: worlds reads unread, which imports this module

    words = [w for w in arg.split(",") if w]
    named = [w for w in words if w in datasets]
    world = [w for w in words if w.startswith("world=")]
    unknown = [w for w in words if w not in datasets and w not in options and w not in world]
    if unknown or len(named) > 1 or len(world) > 1:
        example = ",".join([datasets[-1], *options[:1]])
        with_options = f", optionally with options {tuple(options)}" if options else ""
        with_world = ", and world=<name> with synthetic" if "synthetic" in datasets else ""
        raise ValueError(
            f"Unknown config argument {arg!r}: use one dataset of {tuple(datasets)}"
            f"{with_options}{with_world}, comma-separated (e.g. '{example}')."
        )
    dataset = named[0] if named else datasets[0]
    if world:
        if dataset != "synthetic":
            raise ValueError(
                f"Config argument {arg!r}: {world[0]} picks a synthetic world; use it with "
                "the synthetic dataset (e.g. 'synthetic," + world[0] + "')."
            )
        worlds.get(world[0].removeprefix("world="))  # an unknown world: one clear message
    return dataset, frozenset(w for w in words if w in options or w in world)


def world_of(options: Collection[str]) -> str | None:
    """The world named by ``parse_arg``'s options (``world=<name>``), or None."""
    for word in options:
        if word.startswith("world="):
            return word.removeprefix("world=")
    return None


def load_file(path: str, arg: str = "") -> ml_collections.ConfigDict:
    """``get_config(arg)`` of the config file ``path`` (as ``--config=path:arg`` loads it)."""
    name = "_ncljax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"Config file {path} not found.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def method_kwargs(name: str, **overrides) -> ml_collections.ConfigDict:
    """Method ``name``'s hyperparameters: the defaults of its factory's signature, then
    ``overrides`` (so a config never repeats, or drifts from, the method's defaults)."""
    from ncljax import methods

    defaults = {
        k: p.default
        for k, p in methods.hyperparameters(name).items()
        if p.default is not inspect.Parameter.empty
    }
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"Method {name!r} does not take {unknown}; it takes {sorted(defaults)}.")
    return ml_collections.ConfigDict({**defaults, **overrides})


def check_data_section(config) -> None:
    """Refuses a data section whose fields are not those of dataset ``data.name`` (a dataset
    registered with ``sources.register`` brings its own fields and is not checked)."""
    name = config.data.name
    if name not in sources.DATASETS:  # a researcher's dataset (sources.register): its fields
        return
    expected = set(sources.default_config(name).keys()) | set(PIPELINE_FIELDS)
    found = set(config.data.keys())
    if found != expected:
        from ncljax.train import presets  # presets imports this module

        extra, missing = sorted(found - expected), sorted(expected - found)
        files = presets.config_files_taking(name)
        takers = (
            "the config files that take it: " + ", ".join(f"--config={f}" for f in files)
            if files
            else f"--config=<file>.py:{name}"
        )
        raise ValueError(
            f"Invalid config: the data section does not belong to data.name={name!r} (fields "
            f"{extra} are not {name}'s, {missing} are missing). Pass the dataset as the "
            f"config file's argument ({takers}), or rebuild the "
            "section with ncljax.train.config.switch_dataset(config, name)."
        )


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
        raise ValueError(
            f"Label noise needs at least 2 classes; {info.name} has {info.num_classes}."
        )
    if config.eval.kind not in EVAL_KINDS:
        raise ValueError(f"eval.kind must be one of {EVAL_KINDS}, got {config.eval.kind!r}.")
    if config.eval.kind == "map" and info.num_classes < 2:
        raise ValueError(
            f"eval.kind='map' needs at least 2 classes; {info.name} has {info.num_classes}."
        )
    if config.train.epochs < 1:
        raise ValueError(f"train.epochs must be positive, got {config.train.epochs}.")


def check_fields(config, overridden: Collection[str] | None = None) -> None:
    """Checks every field's type and range, and refuses fields the run would not read,
    before a dataset is read or a file written.

    Args:
      config: the run's config.
      overridden: the fields given on the command line, when known (see
        ``ignored_fields``).

    Raises:
      ValueError: one message naming the field, its value and what it must be.
    """
    check_data_section(config)
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
    # Every method with a warm-up calls its length warmup_epochs (its factory checks the
    # value itself); a warm-up as long as the run never reaches the method.
    warmup = config.method_kwargs.get("warmup_epochs")
    if is_int(warmup) and is_int(t.epochs) and warmup >= t.epochs >= 1:
        problems.append(
            f"method_kwargs.warmup_epochs={warmup} must be less than train.epochs={t.epochs} "
            f"({config.method} would never leave its warm-up): lower "
            "--config.method_kwargs.warmup_epochs or raise --config.train.epochs"
        )
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
    need(is_int(m.views) and m.views >= 1, "model.views", "an integer >= 1")
    need(is_int(m.length_groups) and m.length_groups >= 1, "model.length_groups", "an integer >= 1")
    need(
        m.remat in REMAT_CHOICES,
        "model.remat",
        f"one of {REMAT_CHOICES} (what the SGRAF backward pass recomputes)",
    )
    need(
        m.compute_dtype in ("float32", "bfloat16"),
        "model.compute_dtype",
        "'float32' or 'bfloat16' (bfloat16 matrix products for accelerators)",
    )
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
    need(
        is_int(d.device_prefetch) and d.device_prefetch >= 1,
        "data.device_prefetch",
        "an integer >= 1 (1: each batch is put on the devices when its step starts)",
    )
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
    refused, warned = unread.ignored_fields(config, base_config(), overridden)
    problems += refused
    for message in warned:
        logging.warning("%s: the field is ignored.", message)
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
