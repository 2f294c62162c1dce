"""The evaluation's configurable kinds (``eval.kind``) and the config section each reads
(``ncljax.rules``): ``'recall'`` (Recall@K and rSum; ``eval.recall``: the block sizes and
COCO's five folds) or ``'map'`` (mAP@all over class labels). The trainer's evaluator
(``ncljax.train.evaluator.EVAL_KINDS``) implements each."""

from __future__ import annotations

from ncljax import rules
from ncljax.rules import Setting

_POSITIVE_INT = rules.int_at_least(1, "a positive integer")

RECALL = {
    "image_chunk": Setting(1000, _POSITIVE_INT, "images per block of the similarity sweep"),
    "text_chunk": Setting(5000, _POSITIVE_INT, "captions per block of the similarity sweep"),
    "coco_5fold": Setting(
        False, rules.BOOLEAN, "test metrics averaged over 5 folds of 1K images (COCO)"
    ),
}
KIND = rules.Choice(
    "eval.kind",
    "recall",
    (
        rules.Kind("recall", {"eval.recall": RECALL}, doc="Recall@K and rSum of image-text pairs"),
        rules.Kind("map", doc="mAP@all over class labels"),
    ),
)
CHOICES = (KIND,)
