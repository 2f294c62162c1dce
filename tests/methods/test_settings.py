"""The shared hyperparameter check (``ncljax.methods.settings``), and every factory's use
of it: out-of-range values are refused with one line naming the argument, and a warm-up
that fills the whole run is refused before anything is read."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config import validation
from ncljax.data import sources
from ncljax.methods import settings
from ncljax.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAN, INF = float("nan"), float("inf")


def _accepts(rule, values):
    return [v for v in values if not rule.accepts(v)]


def _refuses(rule, values):
    return [v for v in values if rule.accepts(v)]


# --- each kind of rule: its boundaries, NaN, and the kinds it does not take ------------


def test_numbers_are_finite_and_never_bool():
    assert _accepts(settings.FINITE, [0, -3, 2.5, np.float32(1.5), np.int64(4)]) == []
    assert _refuses(settings.FINITE, [NAN, INF, -INF, True, False, "1", None, [1.0]]) == []


def test_positive_and_non_negative_boundaries():
    assert _accepts(settings.POSITIVE, [1e-12, 0.07, 3]) == []
    assert _refuses(settings.POSITIVE, [0, 0.0, -0.0, -1e-12, -1, NAN, INF, True]) == []
    assert _accepts(settings.NON_NEGATIVE, [0, 0.0, -0.0, 1e-12, 5]) == []
    assert _refuses(settings.NON_NEGATIVE, [-1e-12, -1, NAN, INF, False]) == []
    assert _accepts(settings.greater_than(1), [1.0000001, 10]) == []
    assert _refuses(settings.greater_than(1), [1, 1.0, 0.5, NAN]) == []


def test_intervals_include_and_exclude_their_ends():
    assert _accepts(settings.UNIT_INTERVAL, [0, 0.0, 0.5, 1, 1.0]) == []
    assert _refuses(settings.UNIT_INTERVAL, [-1e-9, 1 + 1e-9, 1.5, -0.5, NAN, True]) == []
    half_open = settings.DIVISION_MIN_WEIGHT  # [0, 0.5)
    assert _accepts(half_open, [0.0, 0.01, 0.4999]) == []
    assert _refuses(half_open, [0.5, 0.6, -0.01, NAN]) == []
    open_closed = settings.interval(0, 1, low_open=True)  # (0, 1]
    assert _accepts(open_closed, [1e-9, 1.0]) == []
    assert _refuses(open_closed, [0.0, 1.5]) == []
    assert settings.UNIT_INTERVAL.phrase == "in [0, 1]"
    assert half_open.phrase == "in [0, 0.5)"
    assert open_closed.phrase == "in (0, 1]"


def test_integers_refuse_bools_and_floats():
    rule = settings.int_at_least(1)
    assert _accepts(rule, [1, 2, 10**9, np.int64(3)]) == []
    assert _refuses(rule, [0, -1, True, 1.0, 2.0, 1.5, NAN, "1", None]) == []
    assert _accepts(settings.NON_NEGATIVE_INT, [0, 7]) == []
    assert _refuses(settings.NON_NEGATIVE_INT, [-1, False, 0.0]) == []
    assert rule.phrase == "an integer >= 1"


def test_one_of_compares_like_with_like():
    words = settings.one_of("sum", "mean")
    assert _accepts(words, ["sum", "mean"]) == []
    assert _refuses(words, ["SUM", "", None, 1, ("sum",)]) == []
    assert _accepts(settings.NUM_NETWORKS, [1, 2, np.int64(2)]) == []
    assert _refuses(settings.NUM_NETWORKS, [0, 3, -1, True, 1.0, 2.0]) == []
    signs = settings.one_of(1.0, -1.0)  # an integer may stand in for a float choice
    assert _accepts(signs, [1.0, -1.0, 1, -1]) == []
    assert _refuses(signs, [0.5, True, NAN]) == []
    assert words.phrase == "one of ('sum', 'mean')"


def test_booleans_and_optional_values():
    assert _accepts(settings.BOOLEAN, [True, False]) == []
    assert _refuses(settings.BOOLEAN, [1, 0, "True", None, np.bool_(True)]) == []
    rule = settings.optional(settings.POSITIVE, "no clip")
    assert _accepts(rule, [None, 0.5]) == []
    assert _refuses(rule, [0, -1.0, NAN]) == []
    assert rule.phrase == "None (no clip) or a number > 0"


def test_check_names_every_bad_argument_on_one_line():
    spec = {"margin": settings.NON_NEGATIVE, "steps": settings.POSITIVE_INT}
    settings.check("toy", {"margin": 0.0, "steps": 1}, spec)
    with pytest.raises(ValueError) as error:
        settings.check("toy", {"margin": -1.0, "steps": 0}, spec)
    message = str(error.value)
    assert message == (
        "toy margin must be a number >= 0, got -1.0 (--config.method_kwargs.margin=...); "
        "toy steps must be an integer >= 1, got 0 (--config.method_kwargs.steps=...)."
    )
    assert "\n" not in message


def test_check_needs_a_rule_for_every_argument_and_no_other():
    with pytest.raises(TypeError, match=r"no rule for \['steps'\]"):
        settings.check("toy", {"margin": 0.0, "steps": 1}, {"margin": settings.FINITE})
    with pytest.raises(TypeError, match=r"rules for unknown \['steps'\]"):
        settings.check("toy", {}, {"steps": settings.POSITIVE_INT})


def test_require_words_a_relation_like_check():
    settings.require(True, "toy", "low", "<= high=1", 0)
    with pytest.raises(ValueError, match=r"^toy low must be <= high=1, got 2 \(--config"):
        settings.require(False, "toy", "low", "<= high=1", 2)


# --- every factory checks every argument -----------------------------------------------


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_every_factory_builds_with_its_defaults_and_checks_every_argument(name, monkeypatch):
    """The defaults pass, and the factory hands ``settings.check`` exactly its arguments
    (``check`` refuses a spec that misses one)."""
    seen = []
    original = settings.check

    def spy(method, kwargs, spec):
        seen.append((method, set(kwargs), set(spec)))
        return original(method, kwargs, spec)

    monkeypatch.setattr(settings, "check", spy)
    methods.build_method(name)
    params = set(methods.hyperparameters(name))
    assert seen[0] == (name, params, params)  # UOT-RCL then builds its CE warm-up


# Every case the stress test of issue 30 (item 3.2) found accepted.
STRESS = [
    ("vse", "margin", -1.0),
    ("infonce", "temperature", 0.0),
    ("infonce", "temperature", -1.0),
    ("ncr", "threshold", 1.5),
    ("ncr", "margin", NAN),
    ("ncr", "gmm_max_iter", 0),
    ("gsc", "cross_temperature", 0.0),
    ("gsc", "cross_momentum", 1.5),
    ("pc2", "threshold", -0.5),
    ("uot_rcl", "neighbours", 0),
    ("uot_rcl", "per_class", 0),
    ("uot_rcl", "momentum", 2.0),
    ("uot_rcl", "mass_start", 1.5),
    # The traceback cases of item 3.3 that a factory now refuses first.
    ("vse", "num_networks", 0),
    ("ce", "num_networks", -1),
]


@pytest.mark.parametrize(("name", "argument", "value"), STRESS)
def test_stress_cases_are_refused_naming_the_argument(name, argument, value):
    with pytest.raises(ValueError) as error:
        methods.build_method(name, {argument: value})
    message = str(error.value)
    assert message.startswith(f"{name} {argument} must be ")
    assert f"got {value!r}" in message
    assert f"--config.method_kwargs.{argument}=" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("vse", {"margin": 0.0}),
        ("infonce", {"temperature": 1e-3}),
        ("ncr", {"threshold": 1.0, "gmm_max_iter": 1, "margin": 0.0}),
        ("gsc", {"cross_momentum": 1.0, "intra_momentum": 1.0, "warmup_epochs": 5}),
        ("gsc", {"cross_momentum": 0.0, "intra_weight": 0.0}),
        ("pc2", {"threshold": 0.0, "noisy_margin_cutoff": None, "noisy_weight": 0.0}),
        ("uot_rcl", {"momentum": 1.0, "mass_start": 1.0, "mass_end": 1.0, "label_corner": 0.0}),
        ("uot_rcl", {"momentum": 0.0, "relation_sign": -1.0, "neighbours": 1, "per_class": 1}),
    ],
)
def test_values_the_papers_and_codes_use_are_accepted(name, kwargs):
    # The "w/o temporal ensembling" ablation of GSC (momenta 1, a 5-epoch warm-up); PC2's
    # Table 7 variant (lambda_n = 0) and the paper's uncut Eq. 5; UOT-RCL's momentum sweep
    # (Fig. 4: 0 to 1), plain balanced OT (mass 1), the paper's corner (0), the literal sign.
    assert methods.build_method(name, kwargs).name == name


# --- a warm-up as long as the run ------------------------------------------------------


def _config(name, epochs, warmup):
    config = config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), "synthetic")
    config.train.epochs = epochs
    config.method_kwargs.warmup_epochs = warmup
    return config


# The methods with a warm-up: those of the registry that take warmup_epochs.
WARMUP_METHODS = [n for n in methods.REGISTRY if "warmup_epochs" in methods.hyperparameters(n)]


@pytest.mark.parametrize("name", WARMUP_METHODS)
@pytest.mark.parametrize(("epochs", "warmup"), [(3, 3), (1, 5)])
def test_warmup_as_long_as_the_run_is_refused_before_anything_is_read(
    tmp_path, monkeypatch, name, epochs, warmup
):
    config = _config(name, epochs, warmup)
    workdir = tmp_path / "run"

    def read(data):
        raise AssertionError(f"the dataset {data.name} was read: the config was accepted")

    monkeypatch.setattr(sources, "load_dataset", read)
    with pytest.raises(ValueError) as error:
        train_and_evaluate(config, str(workdir))
    message = str(error.value)
    assert f"method_kwargs.warmup_epochs={warmup} must be less than train.epochs={epochs}" in (
        message
    )
    assert "--config.method_kwargs.warmup_epochs" in message
    assert "--config.train.epochs" in message
    assert not workdir.exists()


@pytest.mark.parametrize("name", WARMUP_METHODS)
def test_warmup_shorter_than_the_run_passes_the_check(name):
    validation.check(_config(name, 3, 2))


def test_methods_without_a_warmup_are_not_checked_for_one():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "vse.py"), "synthetic")
    config.train.epochs = 1
    validation.check(config)


def test_warmup_signature_is_shared():
    """The config check reads ``warmup_epochs``: every method with a warm-up calls it that."""
    assert {"ncr", "gsc", "srem", "uot_rcl", "ugncl", "pc2"} <= set(WARMUP_METHODS)
    for name in sorted(set(methods.REGISTRY) - set(WARMUP_METHODS)):
        params = methods.hyperparameters(name)
        assert not any("warm" in p for p in params), name


# --- from the command line: one line, no traceback -------------------------------------


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        (
            "--config.method_kwargs.margin=-1",
            "ValueError: vse margin must be a number >= 0, got -1.0 "
            "(--config.method_kwargs.margin=...).",
        ),
        ("--config.method_kwargs.temperature=0", "ValueError: infonce temperature must be"),
    ],
)
def test_cli_prints_one_line(tmp_path, argument, expected):
    config = "vse" if "margin" in argument else "infonce"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        f"--config={os.path.join(ROOT, 'configs', config + '.py')}:synthetic",
        argument,
        "--config.train.epochs=1",
        f"--workdir={tmp_path / 'run'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(expected), out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
