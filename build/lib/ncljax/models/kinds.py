"""The model's configurable kinds: the head, the inputs and the classifier, each with the
config section it reads (``ncljax.rules``; ``ncljax.config`` builds and checks them).

``model.head`` picks the cosine head (``model.cosine``: the image encoder's hidden widths)
or an SGRAF head, SGR (``model.sgraf`` and ``model.sgr``) or SAF (``model.sgraf``).
``model.text_input='tokens'`` reads ``model.tokens`` (the Bi-GRU) and the pipeline's
``data.length_buckets``; ``'global'`` reads ``model.text_mlp``. ``model.classifier=True``
reads ``model.prototypes``.
"""

from __future__ import annotations

from ncljax import rules
from ncljax.rules import Setting

_POSITIVE_INT = rules.int_at_least(1, "a positive integer")
REMAT_CHOICES = ("auto", "full", "projections", "none")

COSINE = {
    "image_hidden": Setting(
        (), rules.widths(), "hidden widths of the image MLP or region projection"
    ),
}
SGRAF = {
    "sim_dim": Setting(256, _POSITIVE_INT, "width of the similarity vectors"),
    "smooth": Setting(9.0, rules.FINITE, "SCAN attention smoothing"),
    "sim_output": Setting(
        "sigmoid", rules.one_of("sigmoid", "raw"), "the head's logit through a sigmoid, or raw"
    ),
    "pair_chunk": Setting(16, _POSITIVE_INT, "captions per chunk of the pairwise computation"),
    # What the backward pass recomputes of each chunk of pairs: 'full' (everything: least
    # memory), 'projections' (stores the attention weights, similarity vectors and
    # reasoning projections; recomputes the 1024-wide tensors), 'none', or 'auto': 'full'
    # on CPU (where 'projections' saved 5% of a step for twice the memory), 'projections'
    # on accelerators.
    "remat": Setting(
        "auto",
        rules.Rule(
            lambda v: v in REMAT_CHOICES,
            f"one of {REMAT_CHOICES} (what the SGRAF backward pass recomputes)",
        ),
        "what the backward pass recomputes",
    ),
    # Captions sorted by length, each chunk computed at the shortest of this many static
    # lengths that holds it (1: every chunk at the batch's padded length).
    "length_groups": Setting(4, rules.int_at_least(1), "static caption lengths per batch"),
    "compute_dtype": Setting(
        "float32",
        rules.Rule(
            lambda v: v in ("float32", "bfloat16"),
            "'float32' or 'bfloat16' (bfloat16 matrix products for accelerators)",
        ),
        "dtype of the head's matrix products",
    ),
}
SGR = {"steps": Setting(3, _POSITIVE_INT, "graph-reasoning steps")}
TOKENS = {
    "word_dim": Setting(128, _POSITIVE_INT, "word embedding width"),
    "dropout": Setting(0.0, rules.FRACTION, "dropout on the word embeddings"),
    "bidirectional": Setting(True, rules.BOOLEAN, "a bidirectional GRU (directions averaged)"),
}
TEXT_MLP = {"hidden": Setting((), rules.widths(), "hidden widths of the text MLP")}
PROTOTYPES = {
    "temperature": Setting(
        1.0,
        rules.Rule(lambda v: rules.is_number(v) and v > 0, "a positive number"),
        "prototype softmax temperature",
    )
}

HEAD = rules.Choice(
    "model.head",
    "cosine",
    (
        rules.Kind("cosine", {"model.cosine": COSINE}, doc="encoders and a cosine head"),
        rules.Kind(
            "sgr", {"model.sgraf": SGRAF, "model.sgr": SGR}, doc="SGRAF's graph reasoning head"
        ),
        rules.Kind("saf", {"model.sgraf": SGRAF}, doc="SGRAF's attention filtration head"),
    ),
)
IMAGE_INPUT = rules.Choice(
    "model.image_input",
    "regions",
    (rules.Kind("regions", doc="[R, D] region features"), rules.Kind("global", doc="vectors")),
)
TEXT_INPUT = rules.Choice(
    "model.text_input",
    "tokens",
    (
        rules.Kind(
            "tokens", {"model.tokens": TOKENS}, reads=("data.length_buckets",), doc="Bi-GRU"
        ),
        rules.Kind("global", {"model.text_mlp": TEXT_MLP}, doc="an MLP over text vectors"),
    ),
)
CLASSIFIER = rules.Choice(
    "model.classifier",
    False,
    (
        rules.Kind(False, doc="no classifier"),
        rules.Kind(True, {"model.prototypes": PROTOTYPES}, doc="unit class prototypes"),
    ),
)
CHOICES = (HEAD, IMAGE_INPUT, TEXT_INPUT, CLASSIFIER)
