"""The base configuration every config file starts from, and the helpers that build one.

Every field a run can read exists here, so ``lock_config=True`` turns a mistyped
``--config.x.y=...`` override into an error. Config files (``configs/<method>.py``) take
the dataset as their argument (``parse_arg``), start from ``base_config()`` and the shared
presets of ``ncljax.config.presets``, and fill ``method_kwargs`` from the method factory's
signature (``method_kwargs``). The data section belongs to ``data.name``
(``switch_dataset`` rebuilds it for another dataset); each kind's section (the head's, the
schedule's, the noise's...) to the kind that reads it (``ncljax.config.kinds``).

Each field's range, and when a run reads it, are in ``ncljax.config.fields``;
``ncljax.config.validation.check`` refuses a config that breaks them (honest flags: a
non-default field the run would not read is refused).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import typing
from collections.abc import Collection, Sequence

import ml_collections

from ncljax.config import kinds
from ncljax.data import sources, worlds

# Fields of the data section that every dataset has (the pipeline's, added by set_data).
PIPELINE_FIELDS = ("num_threads", "prefetch", "device_prefetch", "length_buckets")


def base_config() -> ml_collections.ConfigDict:
    """Defaults for every field; the synthetic dataset with the VSE baseline.

    The fields every run reads are listed here; each kind's section (``model.sgraf``,
    ``optim.step``, ``eval.recall``, ``noise.file``...) comes from the kind that reads
    it (``kinds.CHOICES``) with the defaults it declares.
    """
    c = ml_collections.ConfigDict()
    c.method = "vse"
    c.method_kwargs = ml_collections.ConfigDict()
    c.seed = 0
    c.distributed = False  # several processes in one run (ncljax.cluster; reads cluster)

    set_data(c, sources.default_config("synthetic"))

    c.noise = ml_collections.ConfigDict()
    c.noise.kind = "none"  # ncljax.data.noise.KIND
    c.noise.rate = 0.0  # read by every kind but 'none'
    c.noise.seed = 0  # read by the kinds made from a rate

    c.model = ml_collections.ConfigDict()
    c.model.head = "cosine"  # 'cosine', or the SGRAF heads 'sgr' / 'saf'
    c.model.image_input = "regions"  # 'regions' [R, D] or 'global' feature vectors
    c.model.text_input = "tokens"  # 'tokens' (Bi-GRU) or 'global' feature vectors
    c.model.embed_dim = 256
    c.model.classifier = False  # unit class prototypes on the embeddings (cosine head)
    # Image views (UGNCL): W independent image projections, shared text encoder and head.
    c.model.views = 1

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adam"  # ncljax.optim.NAME
    c.optim.learning_rate = 2e-4
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip = 2.0  # global-norm clipping; 0 disables it
    c.optim.schedule = "constant"  # ncljax.optim.SCHEDULE

    c.train = ml_collections.ConfigDict()
    c.train.epochs = 10
    c.train.batch_size = 128
    c.train.num_devices = 0  # 0: all visible devices
    c.train.log_every_steps = 50
    c.train.checkpoint_every_steps = 0  # 0: at the end of every epoch only
    c.train.progress_bar = True
    # Every epoch may be selected as best on validation, warm-up included, and no method
    # restarts the selection (the user path); False: each method's protocol (EpochPlan).
    c.train.select_every_epoch = False
    # After each epoch's validation, write each training pair's similarity under the
    # epoch's model (ncljax.train.trajectory); the audit ranks by its mean up to the best
    # epoch. One pass over the training pairs per epoch; on in the :vectors settings.
    c.train.pair_trajectory = False
    # A method's division (ncljax.train.arms): 'on' (as the method divides; its own switch,
    # where it has one, turns it off for an epoch), 'off' (every refresh trains every pair
    # as clean) or 'race' (both, the undivided run in <workdir>/undivided; the run whose
    # best model scores higher on validation is the run's). 'off' and 'race' need a method
    # whose division has a switch (noise_share='partner'); 'race' is on in the :vectors
    # settings of the methods that divide.
    c.train.division = "on"
    # The race's paired test (ncljax.train.arms.decide): the division is kept where its
    # best model validates higher than the undivided run's at a one-sided p-value under
    # this level, over the validation images' shares of the rSum; else the undivided run
    # is the run's (0.5: the higher rSum wins). Read with 'race'.
    c.train.race_alpha = 0.05

    c.eval = ml_collections.ConfigDict()
    c.eval.kind = "recall"  # 'recall' (Recall@K, rSum) or 'map' (mAP@all)
    c.eval.batch_size = 256  # encoding batch size
    c.eval.test_last_epoch = False  # also test the final parameters (results as last_*)

    for choice in kinds.CHOICES:
        for path, section in choice.sections().items():
            parent, _, name = path.rpartition(".")
            holder = c[parent] if parent else c
            holder[name] = ml_collections.ConfigDict(
                {field: setting.default for field, setting in section.items()}
            )
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

    ``world=<name>`` (the synthetic dataset only) picks a world of ``ncljax.data.worlds``;
    ``world_of(options)`` reads it back.

    Returns:
      The dataset (the first of ``datasets`` when ``arg`` names none) and the options.

    Raises:
      ValueError: for an unknown word, an unknown world or more than one dataset, listing
        what is allowed.
    """
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
    params = methods.hyperparameters(name)
    values = {**defaults, **overrides}
    return ml_collections.ConfigDict(
        {k: _typed_none(params[k].annotation) if v is None else v for k, v in values.items()}
    )


def _typed_none(annotation):
    """``None`` for a setting annotated ``T | None`` (``T`` a number, string or bool), as a
    placeholder of type ``T``: ``--config.method_kwargs.<name>=...`` can then set it (a
    plain ``None`` field takes no command-line value)."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(kinds) == 1 and kinds[0] in (int, float, str, bool):
        return ml_collections.config_dict.placeholder(kinds[0])
    return None
