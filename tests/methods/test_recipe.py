"""The "Adding a method" recipe of ``ncljax.methods.base``, followed with a toy method
(trimmed InfoNCE: each batch's highest-loss share is dropped): its module, one registry
line and its config file are all it takes for the registry, the report, the config
checks, the trainer and the audit to know it."""

import json
import os
import sys
import textwrap
import types
from typing import NamedTuple

import jax.numpy as jnp
import pytest

from ncljax import audit, losses, methods, report
from ncljax import config as config_lib
from ncljax.methods import base, settings
from ncljax.train import train_and_evaluate

# Step 1: ncljax/methods/trimmed.py (here a module object).
trimmed = types.ModuleType("trimmed_recipe")


class Settings(NamedTuple):
    """Trimmed InfoNCE.

    Attributes:
      temperature: InfoNCE's temperature.
      drop: the share of each batch's highest losses left out.
    """

    temperature: float = 0.07
    drop: float = 0.25


def init_memory(s, ctx):
    del s
    return base.Memory(samples={"loss": jnp.zeros(ctx.num_samples, jnp.float32)}, state={})


def loss(s, outputs, batch, rows, peer_rows, ctx):
    del rows, peer_rows, ctx
    mask = batch["mask"]
    per_pair = losses.symmetric_info_nce(outputs["sim"], temperature=s.temperature, where=mask)
    cut = jnp.quantile(jnp.where(mask, per_pair, -jnp.inf), 1.0 - s.drop)
    keep = mask & (per_pair <= cut)
    return jnp.where(keep, per_pair, 0.0), base.Aux(
        memory={"loss": per_pair}, clean_estimate=keep.astype(jnp.float32)
    )


def clean_score(memory):
    return -memory.samples["loss"]


def bind(s):
    return base.bind_module(
        trimmed,
        s,
        clean_score_fn=clean_score,
        verdict=base.Verdict("minus the pair's last InfoNCE loss", None, "no cut"),
    )


for _f in (init_memory, loss, clean_score, bind):
    _f.__module__ = trimmed.__name__
    setattr(trimmed, _f.__name__, _f)
trimmed.Settings = Settings
trimmed.CHECKS = {
    "temperature": settings.POSITIVE,
    "drop": settings.interval(0, 1, high_open=True),
}
trimmed.trimmed = settings.factory("trimmed", Settings, trimmed.CHECKS, bind)

# Step 3: configs/trimmed.py.
CONFIG = textwrap.dedent(
    """
    from ncljax import config as config_lib
    from ncljax.config import presets

    DATASETS = ("synthetic", "vectors")


    def get_config(arg: str = "synthetic"):
        dataset, options = config_lib.parse_arg(arg, DATASETS, options=("quick",))
        config = presets.start(dataset, world=config_lib.world_of(options))
        config.method = "trimmed"
        config.method_kwargs = config_lib.method_kwargs("trimmed", drop=0.2)
        return presets.quick(config) if "quick" in options else config
    """
)


@pytest.fixture
def registered(monkeypatch, tmp_path):
    """Step 2: the registry line."""
    monkeypatch.setitem(methods.REGISTRY, "trimmed", trimmed.trimmed)
    monkeypatch.setitem(sys.modules, trimmed.__name__, trimmed)
    path = tmp_path / "trimmed.py"
    path.write_text(CONFIG)
    return str(path)


def test_the_tools_know_the_new_method(registered):
    assert methods.family("trimmed") == "pairs" and "trimmed" in methods.of_family("pairs")
    assert "trimmed" in report.FAMILIES["pairs"].methods
    runs = report.plan("pairs", None, ("default",))
    assert any(r.method == "trimmed" for r in runs)
    method = methods.build_method("trimmed", {"drop": 0.1})
    assert method.name == "trimmed" and method.settings.drop == 0.1
    assert set(methods.hyperparameters("trimmed")) == {"temperature", "drop"}
    with pytest.raises(ValueError, match="drop"):
        methods.build_method("trimmed", {"drop": 1.5})


@pytest.mark.heavy
def test_the_new_method_trains_and_is_audited(registered, tmp_path):
    config = config_lib.load_file(registered, "synthetic,quick")
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    audit.audit(workdir)
    with open(os.path.join(workdir, "audit", "audit.json")) as f:
        record = json.load(f)
    assert record["method"] == "trimmed"
    # The ranking is the best model's similarity; the method's own score is named beside it.
    assert record["ranked_by"] == "model"
    assert (
        record["score"] == f"{audit.MODEL_SCORE}; method_score: minus the pair's last InfoNCE loss"
    )
    assert record["threshold"] is None


def test_a_misnamed_method_function_is_refused():
    module = types.ModuleType("misnamed")

    def refrsh(s, memory, stats, ctx):
        return memory, {}

    def loss(s, outputs, batch, rows, peer_rows, ctx):
        return outputs["sim"].diagonal(), base.Aux()

    for f in (loss, refrsh):
        f.__module__ = module.__name__
        setattr(module, f.__name__, f)
    with pytest.raises(TypeError, match=r"misnamed\.refrsh looks like 'refresh'"):
        base.bind_module(module, Settings())
    with pytest.raises(TypeError, match="no loss function"):
        base.bind_module(types.ModuleType("empty"), Settings())
