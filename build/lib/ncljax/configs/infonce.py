r"""Symmetric InfoNCE: the contrastive baseline.

  python train.py --config=configs/infonce.py:synthetic --workdir=runs/infonce_synthetic
  python train.py --config=configs/infonce.py:synthetic,quick
  python train.py --config=configs/infonce.py:f30k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/infonce.py:vectors --config.data.folder=DIR

Temperature 0.07, one network, trained like ``configs/vse.py`` on each dataset (same
backbone, optimiser, schedule and noise), so the two baselines compare like for like.
Also ``:coco``, ``:cc152k`` and ``:vectors`` (a folder of your own vectors: MLP encoders
and the cosine head, 20 epochs; see ``configs/vse.py``).

Reference: van den Oord et al., "Representation Learning with Contrastive Predictive
Coding", 2018; Radford et al., "Learning Transferable Visual Models From Natural
Language Supervision" (CLIP), ICML 2021.
"""

from ncljax import config as config_lib
from ncljax.config import presets

DATASETS = ("synthetic", "f30k", "coco", "cc152k", "vectors")


def get_config(arg: str = "synthetic"):
    dataset, options = config_lib.parse_arg(arg, DATASETS)
    config = presets.start(dataset, world=config_lib.world_of(options))
    config.method = "infonce"
    config.method_kwargs = config_lib.method_kwargs("infonce", temperature=0.07)
    return presets.quick(config) if "quick" in options else config
