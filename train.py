"""A checkout's entry point: ``python train.py --config=...`` is ``ncljax train`` (the
command lives in ``ncljax/train/__main__.py``, which ships with the package)."""

# ruff: noqa: E402 (Ctrl-C during the imports below, which take seconds, ends the command
# in one line)
import ncljax

ncljax._quiet_until_started()

from ncljax.train.__main__ import run

if __name__ == "__main__":
    run()
