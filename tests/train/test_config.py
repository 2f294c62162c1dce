"""``ncljax.config``: honest flags (a field the run does not read is refused), the
data section belongs to ``data.name``, and ``train.py``'s ``--config.data.name`` switch."""

import copy
import logging
import os
import re
import subprocess
import sys
import typing

import pytest

from ncljax import config as config_lib
from ncljax import optim
from ncljax.config import kinds, renames, validation
from ncljax.config.fields import reset_unread
from ncljax.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# field, a non-default value, settings under which the field is unread, and under which
# it is read (both on top of base_config(): cosine head, regions and tokens, Adam with a
# constant learning rate, Recall@K, no noise).
CASES = [
    ("model.cosine.image_hidden", (64,), {"model.head": "sgr"}, {}),
    ("model.text_mlp.hidden", (64,), {}, {"model.text_input": "global"}),
    ("model.tokens.word_dim", 32, {"model.text_input": "global"}, {}),
    ("model.tokens.dropout", 0.1, {"model.text_input": "global"}, {}),
    ("data.length_buckets", (16,), {"model.text_input": "global"}, {}),
    ("model.tokens.bidirectional", False, {"model.text_input": "global"}, {"model.head": "saf"}),
    ("model.prototypes.temperature", 0.5, {}, {"model.classifier": True}),
    ("model.sgraf.sim_dim", 64, {}, {"model.head": "saf"}),
    ("model.sgraf.smooth", 4.0, {}, {"model.head": "sgr"}),
    ("model.sgraf.sim_output", "raw", {}, {"model.head": "sgr"}),
    ("model.sgraf.pair_chunk", 8, {}, {"model.head": "sgr"}),
    ("model.sgraf.remat", "none", {}, {"model.head": "saf"}),
    ("model.sgraf.length_groups", 2, {}, {"model.head": "sgr"}),
    ("model.sgraf.compute_dtype", "bfloat16", {}, {"model.head": "saf"}),
    ("model.sgr.steps", 2, {"model.head": "saf"}, {"model.head": "sgr"}),
    ("optim.adamw.weight_decay", 1e-4, {}, {"optim.name": "adamw"}),
    ("optim.step.factor", 0.5, {"optim.schedule": "cosine"}, {"optim.schedule": "step"}),
    ("optim.step.every", 5, {}, {"optim.schedule": "step"}),
    ("eval.recall.image_chunk", 10, {"eval.kind": "map"}, {}),
    ("eval.recall.text_chunk", 10, {"eval.kind": "map"}, {}),
    ("eval.recall.coco_5fold", True, {"eval.kind": "map"}, {}),
    ("noise.file.layout", "per_image", {}, {"noise.kind": "file", "noise.file.path": "index.npy"}),
    ("noise.pairs.exact", False, {"noise.kind": "symmetric"}, {"noise.kind": "per_image"}),
    ("noise.labels.shared", False, {}, {"noise.kind": "asymmetric"}),
    (
        "noise.symmetric.exclude_true",
        True,
        {"noise.kind": "asymmetric"},
        {"noise.kind": "symmetric"},
    ),
    (
        "noise.seed",
        3,
        {"noise.kind": "file", "noise.file.path": "i.npy"},
        {"noise.kind": "per_caption"},
    ),
    ("noise.file.path", "i.npy", {}, {"noise.kind": "file"}),
    ("model.views", 2, {"method": "vse"}, {"method": "ugncl"}),
    ("cluster.coordinator_address", "host:1234", {}, {"distributed": True}),
    ("cluster.num_processes", 2, {}, {"distributed": True}),
    ("cluster.process_id", 1, {}, {"distributed": True}),
]


def _config(settings):
    config = config_lib.base_config()
    for field, value in settings.items():
        *sections, name = field.split(".")
        target = config
        for section in sections:
            target = target[section]
        target[name] = value
    return config


def _owned_fields():
    """Every field some kind reads and some other kind of its choice does not."""
    defaults = config_lib.base_config()
    found = set()
    for choice in kinds.all_choices():
        for path in choice.unread(object()):  # an unknown kind reads none of them
            node = defaults
            for part in path.split("."):
                node = node[part]
            if hasattr(node, "keys"):
                found |= {f"{path}.{name}" for name in node}
            else:
                found.add(path)
    return found


def test_every_field_a_kind_owns_has_a_case():
    assert _owned_fields() == {case[0] for case in CASES}


def test_every_kind_has_an_implementation():
    """The kinds a config may choose are those the code builds (and no more)."""
    from ncljax.models import kinds as model_kinds
    from ncljax.train import evaluator

    assert set(optim.NAME.names) == set(optim.OPTIMIZERS)
    assert set(optim.SCHEDULE.names) == set(optim.SCHEDULES)
    assert set(kinds.eval_kinds.KIND.names) == set(evaluator.EVAL_KINDS)
    assert model_kinds.HEAD.names == ("cosine", "sgr", "saf")


@pytest.mark.parametrize("old", sorted(renames.RENAMED))
def test_an_old_field_name_is_refused_naming_the_new_one(old):
    new = renames.RENAMED[old]
    line = renames.refuse_old_flags(["train.py", f"--config.{old}=3"])
    assert line.startswith(f"--config.{old} is now --config.{new}:")
    node = config_lib.base_config()  # the new name exists, the old one does not
    for part in new.split("."):
        node = node[part]
    assert old.split(".")[1] not in config_lib.base_config()[old.split(".")[0]] or (
        hasattr(config_lib.base_config()[old.split(".")[0]][old.split(".")[1]], "keys")
    )


def _old_leaf_fields():
    """The renamed fields whose old name is no section of the base config."""
    base = config_lib.base_config()
    for old in sorted(renames.RENAMED):
        section, name = old.split(".")
        if name not in base[section]:
            yield old


@pytest.mark.parametrize("old", list(_old_leaf_fields()))
def test_an_old_field_set_in_code_is_refused_naming_the_new_one(old):
    """The Python API's counterpart of the flag's refusal: a config built in code with a
    field under its old name would otherwise train with the new field's default."""
    new = renames.RENAMED[old]
    config = config_lib.base_config()
    section, name = old.split(".")
    node = config
    for part in new.split("."):
        node = node[part]
    with config.unlocked():
        config[section][name] = node
    with pytest.raises(
        ValueError, match=re.escape(f"{old} is not a config field (set {new} instead)")
    ):
        validation.check(config)


def test_an_unknown_field_is_refused_before_anything_is_written(tmp_path):
    from ncljax.train import train_and_evaluate

    config = config_lib.base_config()
    with config.unlocked():
        config.train.epoch = 3  # a typo of train.epochs
        config.model.sgraf.simdim = 8
    with pytest.raises(ValueError) as raised:
        train_and_evaluate(config, str(tmp_path / "run"))
    assert str(raised.value) == (
        "Invalid config: model.sgraf.simdim is not a config field (remove it); "
        "train.epoch is not a config field (remove it)."
    )
    assert not os.path.exists(tmp_path / "run")


def test_a_config_saved_under_the_old_names_reads_in_the_new_layout():
    new = config_lib.base_config().to_dict()
    old = copy.deepcopy(new)
    for before, after in reversed(renames.RENAMED.items()):  # back to the old layout
        node = old
        *parents, leaf = after.split(".")
        for part in parents:
            node = node[part]
        value = node.pop(leaf)
        section, name = before.split(".")
        old[section][name] = value
    for path in (
        "model.cosine",
        "model.text_mlp",
        "model.tokens",
        "model.prototypes",
        "model.sgraf",
        "model.sgr",
        "optim.adamw",
        "optim.step",
        "eval.recall",
        "noise.pairs",
        "noise.labels",
        "noise.symmetric",
    ):
        section, name = path.split(".")
        assert old[section].pop(name) == {}
    assert isinstance(old["noise"]["file"], str)
    assert renames.upgrade(old) == new
    assert renames.upgrade(new) == new


@pytest.mark.parametrize(("field", "value", "unread", "read"), CASES)
def test_a_non_default_field_the_run_does_not_read_is_refused(field, value, unread, read):
    validation.check(_config({**read, field: value}))
    validation.check(_config(unread))  # the default is always accepted
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is read only with")) as e:
        validation.check(_config({**unread, field: value}))
    assert str(e.value).count("is read only with") == 1  # one message, one field


def test_model_views_must_be_a_positive_integer():
    for views in (0, -1):
        with pytest.raises(ValueError, match=re.escape(f"model.views={views!r} must be")):
            validation.check(_config({"method": "ugncl", "model.views": views}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model.sgraf.remat", "sometimes"),
        ("model.sgraf.compute_dtype", "float16"),
        ("model.sgraf.length_groups", 0),
        ("data.device_prefetch", 0),
    ],
)
def test_speed_settings_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} must be")):
        validation.check(_config({"model.head": "sgr", field: value}))


def test_reset_unread_restores_the_defaults_of_unread_fields():
    config = _config({"model.head": "sgr", "model.sgraf.sim_dim": 8, "optim.step.every": 5})
    config.model.head = "cosine"  # switched in code: the SGRAF size is now unread
    assert reset_unread(config) == ["model.sgraf.sim_dim", "optim.step.every"]
    assert config.model.sgraf.sim_dim == 256 and config.optim.step.every == 10
    validation.check(config)


def test_a_field_left_unread_by_a_command_line_choice_is_warned_about(caplog):
    """A config file's step decay, with ``--config.optim.schedule=cosine``: the file's
    decay fields are now unread; the user chose that on the command line."""
    config = _config({"optim.schedule": "cosine", "optim.step.every": 30})
    with caplog.at_level(logging.WARNING):
        validation.check(config, overridden={"optim.schedule"})
    assert "optim.step.every=30 is read only with optim.schedule='step'" in caplog.text
    for overridden in (None, set(), {"optim.schedule", "optim.step.every"}):
        with pytest.raises(ValueError, match=r"optim\.step\.every=30 is read only"):
            validation.check(config, overridden=overridden)


def test_the_data_section_belongs_to_data_name():
    config = config_lib.base_config()
    config.data.name = "wiki"
    with pytest.raises(ValueError, match=r"does not belong to data.name='wiki'.*\.py:wiki"):
        validation.check(config)
    config.data.length_buckets = (16,)
    config_lib.switch_dataset(config, "wiki", keep=("manual_dir",))
    assert set(config.data) == set(sources.default_config("wiki")) | set(config_lib.PIPELINE_FIELDS)
    assert config.data.float16 is False and tuple(config.data.length_buckets) == (16,)
    config.data.length_buckets = ()  # unread with global text features
    config.model.text_input = config.model.image_input = "global"
    validation.check(config)
    with pytest.raises(ValueError, match=r"Unknown dataset 'flickr'.*'f30k'"):
        config_lib.switch_dataset(config, "flickr")
    with pytest.raises(ValueError, match=r"data\.seed is not a field of dataset .f30k."):
        config_lib.switch_dataset(config_lib.base_config(), "f30k", keep=("seed",))


def _train_py(*args):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_train_py_switches_the_dataset_by_name(tmp_path):
    """``--config.data.name=wiki`` on the synthetic GSC config: the data section becomes
    wiki's (here its file is missing: one line saying which file to put where)."""
    manual = tmp_path / "manual"
    out = _train_py(
        "--config=configs/gsc.py:synthetic,quick",
        "--config.data.name=wiki",
        f"--config.data.manual_dir={manual}",
        f"--workdir={tmp_path / 'run'}",
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "data.name=wiki replaces the config file's dataset synthetic" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError") and str(manual) in last, out.stderr
    # A field of the new dataset given with the name: the config file's argument instead.
    out = _train_py(
        "--config=configs/gsc.py:synthetic", "--config.data.name=wiki", "--config.data.float16=True"
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--config=configs/ce.py:wiki" in last and "configs/gsc.py:wiki" not in last


def test_a_none_setting_keeps_its_type_for_overrides():
    # Every method's setting annotated `T | None` is a typed placeholder when None, so
    # --config.method_kwargs.<name>=value can set it; other fields are unchanged.
    from ncljax import config as config_lib
    from ncljax import methods

    seen = 0
    for name in methods.REGISTRY:
        params = methods.hyperparameters(name)
        nones = {k: None for k, p in params.items() if type(None) in typing.get_args(p.annotation)}
        kwargs = config_lib.method_kwargs(name, **nones)
        for k in nones:
            assert kwargs[k] is None
            kind = kwargs.get_ref(k).get_type()
            assert kind in (int, float, str, bool), (name, k, kind)
            setattr(kwargs, k, kind(1))  # the type ml_collections checks an override against
            assert kwargs[k] == 1
            seen += 1
        defaults = {k: p.default for k, p in params.items() if k not in nones}
        assert {k: kwargs[k] for k in defaults} == defaults
    assert seen >= 2  # ncr's noisy_start_epoch, ugncl's max_log_evidence at least


@pytest.mark.parametrize(("field", "value"), [("seed", -1), ("noise.seed", -1), ("seed", 2**63)])
def test_a_seed_must_be_a_non_negative_integer(field, value):
    # numpy's generators refused -1 with "expected non-negative integer", naming no field,
    # after the workdir was made.
    settings = {"noise.kind": "per_caption", field: value}
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} must be an integer in")):
        validation.check(_config(settings))
    validation.check(_config({**settings, field: 0}))


def _info(num_images: int, num_classes: int = 0, name: str = "vectors") -> sources.DatasetInfo:
    return sources.DatasetInfo(
        name=name,
        captions_per_image=1,
        num_classes=num_classes,
        vocab_size=0,
        max_length=0,
        num_regions=0,
        region_dim=0,
        image_dim=4,
        text_dim=4,
        split_sizes={s: (num_images, num_images) for s in sources.SPLITS},
    )


def test_epochs_beyond_the_step_counter_are_refused():
    # --config.train.epochs=99999999999999999999999 was accepted, and the run trained on
    # (its int32 step and epoch counters would wrap around).
    config = _config({"train.batch_size": 128, "train.epochs": 10**23})
    with pytest.raises(ValueError, match=r"^train\.epochs=10+ makes at least 10+ training steps"):
        validation.check(config, info=_info(128))
    config.train.epochs = validation.MAX_STEPS // 2
    validation.check(config, info=_info(256))  # two steps an epoch: the counter holds them
    with pytest.raises(ValueError, match=r"lower --config\.train\.epochs"):
        validation.check(config, info=_info(384))


@pytest.mark.parametrize(("classes", "says"), [(0, "has no {split}_labels.npy"), (1, "one class")])
def test_map_on_a_folder_without_classes_says_what_to_add(classes, says):
    config = _config({"eval.kind": "map"})
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        validation.check(config, info=_info(256, classes))
    assert "--config.eval.kind=recall" in str(e.value)
