"""``ncljax COMMAND [flags]``: the commands of an installed ncljax.

  ncljax train --config=gsc:vectors --config.data.folder=DIR --workdir=runs/mine
  ncljax audit --workdir=runs/mine
  ncljax retrieve --workdir=runs/mine --image=0
  ncljax report --out=reports/real --worlds=digits --rates=0.4
  ncljax ensemble --workdir=runs/sgr --workdir=runs/saf
  ncljax embed --pairs=pairs.tsv --images=photos/ --out=my_pairs

Each command is also ``python -m ncljax.<module>`` (``ncljax.train``, ``ncljax.audit``,
``ncljax.retrieve``, ``ncljax.report``, ``ncljax.train.ensemble``, ``ncljax.embed``) and
takes ``--help``.
"""

from __future__ import annotations

import runpy
import sys

import ncljax

# command -> (module, what it does)
COMMANDS = {
    "train": ("ncljax.train", "train a method on a dataset or a folder of vectors"),
    "audit": ("ncljax.audit", "rank a trained run's training pairs by how suspicious they are"),
    "retrieve": ("ncljax.retrieve", "rank images or captions with a trained run, export vectors"),
    "report": ("ncljax.report", "the robustness report: methods x worlds x noise rates x seeds"),
    "ensemble": ("ncljax.train.ensemble", "evaluate the pooled similarity of finished runs"),
    "embed": ("ncljax.embed", "turn a folder of images and a captions file into a vectors folder"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return (
        "usage: ncljax COMMAND [flags]   (ncljax COMMAND --help: its flags)\n\ncommands:\n"
        + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> None:
    """Runs ``ncljax COMMAND`` as ``python -m <its module>`` would, with the rest of the
    command line as its flags."""
    ncljax._quiet_until_started()  # Ctrl-C while the command imports: one line
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    command = argv[0]
    if command not in COMMANDS:
        sys.exit(f"Unknown command {command!r}: use one of {', '.join(COMMANDS)} (ncljax --help).")
    sys.argv = [f"ncljax {command}", *argv[1:]]
    runpy.run_module(COMMANDS[command][0], run_name="__main__")


if __name__ == "__main__":
    main()
