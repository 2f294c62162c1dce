r"""Trains a method on a benchmark, resumably, and evaluates the best model on the test split.

  ncljax train --config=quickstart --workdir=runs/quickstart
  ncljax train --config=gsc:vectors --config.data.folder=DIR      # your own vectors
  python -m ncljax.train --config=vse:synthetic,quick --config.train.epochs=3
  python train.py --config=configs/gsc.py:f30k --config.data.manual_dir=/path/to/files

``--config`` takes a shipped config file by name (``gsc``, ``ncr``, ``quickstart``, ...:
``ncljax.configs``) or the path of any config file, then ``:`` and the file's argument
(the dataset and options, e.g. ``vectors`` or ``synthetic,quick``); ``--config.<section>.
<field>=value`` overrides a field (``ncljax/config/base.py``). The workdir (default
``runs/<config name>``) receives config.json, metrics.jsonl, results.json and
checkpoints/; rerunning the same command resumes from the latest checkpoint (after
Ctrl-C, which exits with code 130, too). A bad setting, file or fault is reported in one
line; ``-v 1`` shows the whole traceback.
"""

import os
import shlex
import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser as _ConfigFileParser

from ncljax import cli, methods
from ncljax import config as config_lib
from ncljax.config import files, presets, renames
from ncljax.train import checkpoint, train_and_evaluate
from ncljax.train.checkpoint import CheckpointError
from ncljax.train.rundir import WorkdirLocked

try:  # ml_collections reads the command line's --flagfile here, before absl parses it
    _CONFIG = config_flags.DEFINE_config_file(
        "config",
        None,
        "A shipped config by name or a config file's path, then ':' and its argument, e.g. "
        "gsc:vectors, quickstart or configs/vse.py:synthetic,quick.",
        lock_config=True,
    )
except flags.CantOpenFlagFileError as e:
    sys.exit(f"{str(e).removeprefix('ERROR:: ')}: pass an existing --flagfile.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
flags.mark_flag_as_required("config")


def parse_flags(argv):
    """absl flag parsing, each refusal in one line (``-v 1``: absl's report, or the
    traceback of a config file that fails to load): a config override naming no field or
    of the wrong type, a config file that refuses its argument (``configs/vse.py:synthetci``)
    or cannot be loaded (not Python, no ``get_config``, an error inside it), a missing
    ``--config``, an unknown flag, an argument that is not a flag and a config field under
    its old name (``ncljax.config.renames``)."""
    old = renames.refuse_old_flags(argv)
    if old is not None:
        sys.exit(old)
    argv = _shipped_config(argv)
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:  # parsing again would define the override flags twice
        refusal = _config_file_refusal(e)
        if refusal is None:
            refusal = _load_failure(e, argv)
        if _verbose(argv):  # absl's report: the whole message
            refusal = (
                f"FATAL Flags parsing error: {e}\n"
                "Pass --helpshort or --helpfull to see help on flags."
            )
        elif refusal is None:
            refusal = _flag_refusal(e)
        sys.exit(refusal)
    except (AttributeError, KeyError) as e:  # raised by ml_collections for unknown fields
        if _loading_config_file(e):  # the file has no get_config
            if _verbose(argv):
                raise
            sys.exit(_load_failure(e, argv))
        hint = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        overrides = [a for a in argv[1:] if a.startswith("--config.")]
        names = [a.split("=", 1)[-1] for a in overrides if a.startswith("--config.data.name=")]
        if names and any(a.startswith("--config.data.") for a in overrides if "name=" not in a):
            sys.exit(
                f"Unknown config field in {overrides}: {hint}. The data fields of the config "
                f"file's dataset apply before data.name={names[-1]} is switched; "
                f"{_dataset_hint(argv, names[-1])} (its fields are then known)."
            )
        sys.exit(
            f"Unknown config field in {overrides}: {hint}. All fields and their defaults "
            "are listed in ncljax/config/base.py."
        )
    except Exception as e:
        if not _loading_config_file(e) or _verbose(argv):
            raise
        sys.exit(_load_failure(e, argv))
    if len(rest) > 1:
        sys.exit(cli.unexpected_arguments(rest[1:], _program()))
    return rest


def _flag_refusal(error: flags.Error) -> str:
    """One line for a flag error: a missing ``--config`` names a config file to pass."""
    line = cli.describe_flag_error(error, _program())
    if line.startswith("--config is required"):
        return (
            "--config is required: pass a config file and its argument, e.g. "
            f"--config=gsc:vectors ({_program()} --helpshort lists the flags)."
        )
    return line


def _program() -> str:
    """How this command was started, for its messages: ``python train.py`` (a checkout),
    ``ncljax train`` or ``python -m ncljax.train``."""
    started = sys.argv[0] if sys.argv else ""
    if started.startswith("ncljax "):
        return started
    if os.path.basename(started) == "train.py":
        return "python train.py"
    return "python -m ncljax.train"


def _shipped_config(argv: list[str]) -> list[str]:
    """``argv`` with a ``--config`` that names a shipped config file (``gsc:vectors``)
    replaced by the file's path (``ncljax.config.files.resolve``)."""
    argv = list(argv)
    for i, a in enumerate(argv[1:], 1):
        if a.startswith(("--config=", "-config=")):
            flag, value = a.split("=", 1)
            argv[i] = f"{flag}={files.resolve(value)}"
        elif a in ("--config", "-config") and i + 1 < len(argv):
            argv[i + 1] = files.resolve(argv[i + 1])
    return argv


def _config_path(argv) -> str:
    """The config file named by ``--config=`` (or ``--config FILE``) in ``argv``."""
    path = ""
    for i, a in enumerate(argv[1:], 1):
        if a.startswith(("--config=", "-config=")):
            path = a.split("=", 1)[1]
        elif a in ("--config", "-config") and i + 1 < len(argv):
            path = argv[i + 1]
    if not os.path.isfile(path) and ":" in os.path.basename(path):  # 'file.py:arg'
        path = path[: path.rindex(":")]
    return path


def _loading_config_file(error: BaseException) -> bool:
    """Whether ``error`` (or an error it wraps) was raised while ml_collections loaded the
    ``--config`` file and ran its ``get_config`` (not while it applied an override)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if isinstance(tb.tb_frame.f_locals.get("self"), _ConfigFileParser):
                return True
            tb = tb.tb_next
        error = error.__context__
    return False


def _load_failure(error: BaseException, argv) -> str | None:
    """One line for a ``--config`` file that cannot be loaded, or None when ``error`` did
    not come from loading it: the file, the error and the line it points at."""
    original = error
    # absl wraps what the parser raised; ml_collections re-raises a TypeError or
    # ValueError as a new one holding the traceback text: the original is further down.
    while isinstance(original, flags.Error) or "Error whilst parsing config file" in str(original):
        if original.__context__ is None:
            break
        original = original.__context__
    if isinstance(error, flags.Error) and not _loading_config_file(error):
        return None
    path = _config_path(argv)
    if isinstance(original, SyntaxError) and original.lineno:
        where = f" (line {original.lineno})"
    else:
        tb, line = original.__traceback__, None
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f" (line {line})" if line else ""
    text = original.msg if isinstance(original, SyntaxError) else str(original)
    message = " ".join(str(text).split()) or "no message"
    if isinstance(original, AttributeError) and "get_config" in message:
        message = "it defines no get_config()"
    return (
        f"Config file {path} cannot be loaded: {type(original).__name__}: {message}{where}. "
        "Fix the file (a Python file whose get_config(arg) returns an "
        "ml_collections.ConfigDict, as configs/gsc.py), or pass another; -v 1 shows the "
        "traceback."
    )


def _config_file_refusal(error: flags.Error) -> str | None:
    """The message of the ``ValueError`` a config file's ``get_config`` raised while
    ``--config`` was parsed (an unknown dataset or option), or None for another error.

    ml_collections puts that error's whole traceback into a new ``ValueError``, which
    absl wraps in its own error: the original is two links down the chain.
    """
    wrapped = error.__context__
    original = getattr(wrapped, "__context__", None)
    if not str(error).startswith("flag --config=") or not isinstance(wrapped, ValueError):
        return None
    return f"{type(original).__name__}: {original}" if isinstance(original, ValueError) else None


def _verbose(argv) -> bool:
    """``-v``/``--verbosity`` on the command line (read before the flags are parsed)."""
    return any(
        a == "-v" or a.startswith(("-v=", "--v=", "--verbosity", "-verbosity")) for a in argv
    )


def main(argv):
    cli.started()  # Ctrl-C from here on: KeyboardInterrupt, caught below
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    path, arg = config_flags.get_config_filename(flags.FLAGS["config"]), ""
    if not os.path.isfile(path) and ":" in os.path.basename(path):  # 'file.py:arg'
        path, arg = path[: path.rindex(":")], path[path.rindex(":") + 1 :]
    if not os.path.isfile(path):
        sys.exit(
            f"Config file {path} not found; pass an existing file or a shipped config by "
            f"name ({', '.join(files.names())}), e.g. --config=quickstart."
        )
    workdir = _WORKDIR.value
    if workdir is not None and not workdir.strip():
        sys.exit(
            "--workdir is empty: pass the run's directory (e.g. --workdir=runs/mine), or leave "
            "the flag out for runs/<config name>."
        )
    if workdir is None:
        name = os.path.splitext(os.path.basename(path))[0]
        workdir = os.path.join("runs", "_".join(filter(None, [name, *arg.split(",")])))
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    config = _CONFIG.value
    if not isinstance(config, ml_collections.ConfigDict):
        sys.exit(
            f"Config file {path}: get_config({arg!r}) returned {type(config).__name__}, not an "
            "ml_collections.ConfigDict; return the config (as configs/gsc.py does)."
        )
    try:
        if "data.name" in overrides:
            _switch_dataset(config, path, arg, overrides)
        train_and_evaluate(config, workdir, overridden=set(overrides))
        print(_closing_line(config, workdir))
    except KeyboardInterrupt:  # Ctrl-C: the checkpoints are closed, the resume is exact
        if flags.FLAGS.verbosity > 0:
            raise
        checkpoint.mute_background_errors()  # an interrupted save's threads end quietly
        print("Interrupted; run the same command to resume.", file=sys.stderr)
        sys.exit(130)
    except (
        OSError,  # an unwritable or full workdir, a missing dataset file
        ValueError,  # a bad config field, malformed data
        FloatingPointError,  # a non-finite loss
        CheckpointError,  # no checkpoint can be restored or written
        WorkdirLocked,  # another run uses the workdir
    ) as e:
        if flags.FLAGS.verbosity > 0:  # -v 1: the whole traceback
            raise
        sys.exit(f"{type(e).__name__}: {e}")


def _closing_line(config, workdir: str) -> str:
    """Where the results are and what to run next: the run's last line."""
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    command = "ncljax " if _program().startswith("ncljax") else "python -m ncljax."
    quoted = shlex.quote(workdir)
    audits = method.clean_score_fn is not None or method.label_estimate_fn is not None
    audit = f"{command}audit --workdir={quoted} ranks its training pairs; " if audits else ""
    return (
        f"Done: {os.path.join(workdir, 'results.json')} (per-epoch metrics in metrics.jsonl). "
        f"Next: {audit}{command}retrieve --workdir={quoted} --query=image:0 retrieves with it."
    )


def _dataset_hint(argv: list[str], dataset: str) -> str:
    """How to train on ``dataset`` with the ``--config=`` file of ``argv``, suggesting only
    arguments that work (``presets.dataset_hint``)."""
    paths = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")]
    path = paths[-1].split(":", 1)[0] if paths else ""
    try:
        return presets.dataset_hint(path, dataset)
    except (OSError, ValueError):  # no such file, or one without DATASETS
        return f"pass the dataset as a config file's argument: --config=<file>.py:{dataset}"


def _switch_dataset(config, path: str, arg: str, overrides: dict) -> None:
    """``--config.data.name=X`` on a file built for another dataset: the data section is
    rebuilt from X's defaults (then the command line's other data fields); the rest stays
    the file's, which a warning says."""
    file_dataset = config_lib.load_file(path, arg).data.name
    if config.data.name == file_dataset:
        return
    keep = [k.split(".", 1)[1] for k in overrides if k.startswith("data.")]
    config_lib.switch_dataset(config, config.data.name, keep=keep)
    logging.warning(
        "data.name=%s replaces the config file's dataset %s: the data section now holds "
        "%s's defaults, every other setting (model, optimiser, noise, method) is the file's "
        "for %s. To use a config file's own settings for %s: %s.",
        config.data.name,
        file_dataset,
        config.data.name,
        file_dataset,
        config.data.name,
        _dataset_hint(["", f"--config={path}"], config.data.name),
    )


def help_text() -> str:
    """``--help``'s text: this module's doc, then the methods, the shipped config files and
    the datasets each takes, and every ``--config.<field>`` with its default (the sections
    of a kind: read only when the run chose that kind)."""
    from ncljax.config import kinds

    lines = [__doc__.strip(), "", "Flags:"]
    lines += [
        f"  --{name}: {flags.FLAGS[name].help}"
        for name in ("config", "workdir")
        if name in flags.FLAGS
    ]
    lines += ["  -v 1: the whole traceback of an error; --helpfull: every flag."]
    lines += ["", "Methods: " + ", ".join(methods.REGISTRY) + "."]
    lines += ["", "Shipped config files (--config=<name>:<dataset>[,quick]):"]
    for name in files.names():
        try:
            takes = ", ".join(presets.datasets_of(os.path.join(files.CONFIG_DIR, f"{name}.py")))
        except (OSError, ValueError):
            takes = "see the file"
        lines.append(f"  {name}: {takes}")
    owners = {}
    for choice in kinds.CHOICES:
        for kind in choice.kinds:
            for path in kind.sections:
                owners.setdefault(path, []).append(f"{choice.field}={kind.name!r}")
    lines += ["", "Config fields (--config.<field>=value; default):"]
    flat = _flatten(config_lib.base_config().to_dict())
    for field, default in flat.items():
        section = field.rsplit(".", 1)[0]
        note = f"  [read with {' or '.join(owners[section])}]" if section in owners else ""
        lines.append(f"  {field}={default!r}{note}")
    lines.append("  method_kwargs.<name>: the method's hyperparameters (its config file's).")
    lines.append("  data.*: above, the synthetic dataset's; each dataset has its own (data.name).")
    return "\n".join(lines).replace("%", "%%")  # absl formats the text with %


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run() -> None:
    """The command: ``ncljax train``, ``python -m ncljax.train`` and a checkout's
    ``train.py``."""
    sys.modules["__main__"].__doc__ = help_text()  # what --help prints first
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
