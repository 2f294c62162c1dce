r"""Prototype cross-entropy on the observed labels: the "CE" baseline of the noisy-label papers.

  python train.py --config=configs/ce.py:synthetic --workdir=runs/ce_synthetic
  python train.py --config=configs/ce.py:synthetic,quick
  python train.py --config=configs/ce.py:xmedianet --config.data.manual_dir=/path/to/file
  python train.py --config=configs/ce.py:wiki --config.noise.rate=0.8   # also :nuswide, :inria
  python train.py --config=configs/ce.py:vectors --config.data.folder=DIR   # your vectors

The MRL architecture (two MLPs over the released image and text features, unit class
prototypes, ``ncljax.config.presets.use_mrl``) trained with cross-entropy on the
observed labels, 100 epochs, the MRL batch of each dataset (Wikipedia 100, NUS-WIDE
500, XMediaNet 100, INRIA-Websearch 200), 40% symmetric label noise shared by both
modalities (the papers: 0.2 to 0.8). The released file goes in ``data.manual_dir``
(layouts in ``ncljax/data``). ``:synthetic``: 10,000 pairs over 10 classes, the MRL
backbone scaled to the 64-d features, 20 epochs: the setting of ``configs/uot_rcl.py``.
``:vectors``: a folder of your own vectors with ``{split}_labels.npy`` (``ncljax.data.vectors``;
its labels are the observed ones, no simulated noise): MLPs ``D -> 1024 -> 1024 -> 256``,
unit prototypes, Adam 3e-4 (betas 0.5/0.999, cosine annealing), batch 100, 50 epochs.

References: Hu et al., "Learning Cross-Modal Retrieval with Noisy Labels" (MRL), CVPR
2021; Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval with
Noisy Labels", 2024.
"""

from ncljax import config as config_lib
from ncljax.config import presets

DATASETS = ("synthetic", *presets.LABELLED, "vectors")


def get_config(arg: str = "synthetic"):
    dataset, options = config_lib.parse_arg(arg, DATASETS)
    config = presets.start(dataset, labels=True, world=config_lib.world_of(options))
    config.method = "ce"
    config.method_kwargs = config_lib.method_kwargs("ce")
    return presets.quick(config) if "quick" in options else config
