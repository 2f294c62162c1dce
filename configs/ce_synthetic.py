r"""Prototype cross-entropy baseline for noisy category labels on the embedded synthetic data.

  python train.py --config=configs/ce_synthetic.py --workdir=runs/ce_synthetic
  python train.py --config=configs/ce_synthetic.py:quick

One caption per image, global feature vectors through two MLP encoders (the UOT-RCL/MRL
architecture, narrower), unit class prototypes, 40% symmetric label noise shared by both
modalities; evaluated by mAP@all in both directions. This is the ``CE`` row of the
UOT-RCL paper's tables: the baseline that the label-correction methods must beat.

Reference: Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval
with Noisy Labels", 2024, Eq. 1-2; Hu et al., "Learning Cross-Modal Retrieval with Noisy
Labels" (MRL), CVPR 2021.
"""

from ncljax.train import config as config_lib


def get_config(arg: str = ""):
    config = config_lib.base_config()
    config.method = "ce"
    config.method_kwargs.num_networks = 1
    config.data.captions_per_image = 1
    config.data.num_train = 10000
    config.data.class_purity = 0.9
    config.data.num_val = 1000
    config.data.num_test = 2000
    config.noise.kind = "symmetric"
    config.noise.rate = 0.4
    config_lib.use_mrl(config, hidden=(512, 512), out_dim=128)
    config.optim.learning_rate = 1e-3  # MRL uses 1e-4 on 4096-d features; ours are 64-d
    config.train.epochs = 20
    config.train.batch_size = 100
    config.eval.batch_size = 200
    if arg == "quick":
        config.data.num_train = 1000
        config.data.num_val = 200
        config.data.num_test = 200
        config.train.epochs = 3
        config.train.log_every_steps = 5
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; use '' or 'quick'.")
    return config
