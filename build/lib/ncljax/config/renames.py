"""Config fields that moved into the section of the kind that reads them.

Old names are refused where a user types them (``--config.<old>=...``, the report's
``--set``), in one line naming the new one; a run saved before the move (its
``config.json``) is read in the new layout (``upgrade``), so it still resumes, audits and
retrieves. The README's "Renamed" table lists the same moves.
"""

from __future__ import annotations

import copy

# old field -> new field
RENAMED = {
    "model.image_hidden": "model.cosine.image_hidden",
    "model.text_hidden": "model.text_mlp.hidden",
    "model.word_dim": "model.tokens.word_dim",
    "model.text_dropout": "model.tokens.dropout",
    "model.bidirectional": "model.tokens.bidirectional",
    "model.temperature": "model.prototypes.temperature",
    "model.sim_dim": "model.sgraf.sim_dim",
    "model.smooth": "model.sgraf.smooth",
    "model.sim_output": "model.sgraf.sim_output",
    "model.pair_chunk": "model.sgraf.pair_chunk",
    "model.remat": "model.sgraf.remat",
    "model.length_groups": "model.sgraf.length_groups",
    "model.compute_dtype": "model.sgraf.compute_dtype",
    "model.sgr_steps": "model.sgr.steps",
    "optim.weight_decay": "optim.adamw.weight_decay",
    "optim.decay_factor": "optim.step.factor",
    "optim.decay_every": "optim.step.every",
    "eval.image_chunk": "eval.recall.image_chunk",
    "eval.text_chunk": "eval.recall.text_chunk",
    "eval.coco_5fold": "eval.recall.coco_5fold",
    "noise.file": "noise.file.path",
    "noise.file_kind": "noise.file.layout",
    "noise.exact": "noise.pairs.exact",
    "noise.shared_label": "noise.labels.shared",
    "noise.exclude_true": "noise.symmetric.exclude_true",
}


def renamed(field: str) -> str | None:
    """The new name of the old config field ``field`` (None: not renamed)."""
    return RENAMED.get(field)


def refusal(field: str, flag: str = "--config.") -> str | None:
    """One line refusing the old field ``field`` as it was typed (``flag`` + field)."""
    new = renamed(field)
    if new is None:
        return None
    return (
        f"{flag}{field} is now {flag}{new}: config fields moved into the section of the "
        "kind that reads them (README, 'Renamed')."
    )


def refuse_old_flags(argv) -> str | None:
    """The refusal of the first ``--config.<old field>=...`` in ``argv``, or None."""
    for arg in argv[1:]:
        if arg.startswith("--config."):
            message = refusal(arg.removeprefix("--config.").split("=", 1)[0])
            if message is not None:
                return message
    return None


def upgrade(resolved: dict) -> dict:
    """A saved config (``config.json``'s dict) in the current layout: each old field moved
    to its new place (a config already in the new layout comes back unchanged)."""
    new = copy.deepcopy(resolved)
    for old, moved in RENAMED.items():
        section, name = old.split(".")
        holder = new.get(section)
        if not isinstance(holder, dict) or name not in holder:
            continue
        if isinstance(holder[name], dict):  # already a section: the new layout
            continue
        value = holder.pop(name)
        target = new
        *parents, leaf = moved.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return new
