"""The run's configuration: the base config, the kinds and their sections, the checks.

- ``get``: a config by name or path with overrides, as ``ncljax train`` builds it
  (``get('gsc:vectors', {'data.folder': 'my_pairs'})``; ``files.load``);
- ``files``: the shipped config files, found by name;
- ``base``: ``base_config()`` and the helpers config files use (``parse_arg``,
  ``method_kwargs``, ``set_data``, ``switch_dataset``, ``load_file``);
- ``kinds``: every configurable kind (head, inputs, optimiser, schedule, evaluation,
  noise, method) and the sections each reads;
- ``fields``: each field's check and the one read rule;
- ``presets``: each dataset's protocol and the papers' backbones;
- ``validation``: ``check``, at each stage of a run;
- ``renames``: the fields that moved, refused under their old names.
"""

from ncljax.config.base import (
    PIPELINE_FIELDS,
    base_config,
    load_file,
    method_kwargs,
    parse_arg,
    set_data,
    switch_dataset,
    world_of,
)
from ncljax.config.files import load as get

__all__ = [
    "PIPELINE_FIELDS",
    "base_config",
    "get",
    "load_file",
    "method_kwargs",
    "parse_arg",
    "set_data",
    "switch_dataset",
    "world_of",
]
