r"""VSE++ (hinge triplet, hardest negatives): the non-robust baseline of every method here.

  python train.py --config=configs/vse.py:synthetic --workdir=runs/vse_synthetic
  python train.py --config=configs/vse.py:synthetic,quick      # seconds, a smoke run
  python train.py --config=configs/vse.py:f30k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/vse.py:coco --config.data.manual_dir=/path/to/files
  python train.py --config=configs/vse.py:cc152k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/vse.py:now --config.data.manual_dir=/path/to/files
  python train.py --config=configs/vse.py:f30k --config.model.head=saf   # the SAF half
  python train.py --config=configs/vse.py:vectors --config.data.folder=DIR  # your own vectors

Margin 0.2, hardest negatives, one network. Real benchmarks: the SGR head with the
NCR/SGRAF settings (``ncljax.config.presets.use_sgraf``: Adam 2e-4, x0.1 after 30 epochs,
40 epochs; 60 on NoW), per-caption noise at 0.2 on F30K and COCO, none on the web data
(CC152K, NoW), COCO tested on 5 folds of 1K. The released files go in
``data.manual_dir`` (layouts in ``ncljax/data``). ``:synthetic``: 20,000 pairs with 40%
per-caption noise, region encoder, Bi-GRU and cosine head, 12 epochs (the quickstart's
setting, so GSC and VSE++ compare like for like). ``:vectors``: a folder of your own
image and caption vectors (``ncljax.data.vectors``), its own pairs, MLP encoders and the
cosine head (``ncljax.config.presets``: 1024 hidden, 256-d embeddings, Adam 5e-4, batch
128, 20 epochs).

References: Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard
Negatives", BMVC 2018; Diao et al., "Similarity Reasoning and Filtration for Image-Text
Matching" (SGRAF), AAAI 2021.
"""

from ncljax import config as config_lib
from ncljax.config import presets

EPOCHS = {"now": 60}  # others: the preset's (12 synthetic, 40 SGRAF)
DATASETS = ("synthetic", "f30k", "coco", "cc152k", "now", "vectors")


def get_config(arg: str = "synthetic"):
    dataset, options = config_lib.parse_arg(arg, DATASETS)
    config = presets.start(dataset, world=config_lib.world_of(options))
    config.method = "vse"
    config.method_kwargs = config_lib.method_kwargs("vse", margin=0.2, negatives="hardest")
    config.train.epochs = EPOCHS.get(dataset, config.train.epochs)
    return presets.quick(config) if "quick" in options else config
