"""Every configurable kind a run chooses, gathered from the code that implements it.

Each :class:`ncljax.rules.Choice` is a field that picks a kind, and each kind declares the
config sections it reads, with their defaults and rules, beside its implementation:

=====================  ==========================================  ======================
field                  kinds                                       declared in
=====================  ==========================================  ======================
``model.head``         cosine, sgr, saf                            ``ncljax.models.kinds``
``model.image_input``  regions, global                             ``ncljax.models.kinds``
``model.text_input``   tokens, global                              ``ncljax.models.kinds``
``model.classifier``   False, True                                 ``ncljax.models.kinds``
``optim.name``         adam, adamw                                 ``ncljax.optim``
``optim.schedule``     constant, step, cosine                      ``ncljax.optim``
``eval.kind``          recall, map                                 ``ncljax.evaluate.kinds``
``noise.kind``         none, per_caption, per_image, file, ...     ``ncljax.data.noise``
``distributed``        False, True                                 ``ncljax.cluster``
``method``             the registry's methods                      ``ncljax.methods``
=====================  ==========================================  ======================

The base config holds every section (``ncljax.config.base``); a run reads only those of
the kinds it chose, and a non-default value in another is refused
(``ncljax.config.fields``). A method's kind reads the ``model`` fields it declares
(``methods.model_fields``: UGNCL's ``model.views``) and its ``method_kwargs``.
"""

from __future__ import annotations

from ncljax import cluster, methods, optim, rules
from ncljax.data import noise
from ncljax.evaluate import kinds as eval_kinds
from ncljax.models import kinds as model_kinds

CHOICES: tuple[rules.Choice, ...] = (
    *model_kinds.CHOICES,
    *optim.CHOICES,
    *eval_kinds.CHOICES,
    *noise.CHOICES,
    *cluster.CHOICES,
)


def method_choice() -> rules.Choice:
    """``method``: one kind per registered method, reading the ``model`` fields it declares
    (built on each call: a researcher may register a method after import)."""
    return rules.Choice(
        "method",
        "vse",
        tuple(
            rules.Kind(name, reads=tuple(f"model.{f}" for f in methods.model_fields(name)))
            for name in methods.REGISTRY
        ),
    )


def all_choices() -> tuple[rules.Choice, ...]:
    """Every choice a config makes, the method's last."""
    return (*CHOICES, method_choice())
