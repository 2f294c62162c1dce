r"""GSC+ (dual-network geometrical structure consistency) on the embedded synthetic data.

  python train.py --config=configs/gsc_synthetic.py --workdir=runs/gsc_synthetic
  python train.py --config=configs/gsc_synthetic.py:quick    # smoke run, seconds
  python train.py --config=configs/gsc_synthetic.py --config.method_kwargs.num_networks=1

20,000 pairs with 40% per-caption correspondence noise. Region features through a linear
region encoder, tokens through a Bi-GRU, cosine similarity (the SGR head is the paper's
backbone, see ``gsc_f30k.py``; on 2 CPU cores it is too slow for a two-minute run, so the
intra-modal structures here are embedding cosines, the port the spec names for plain
embedding backbones). GSC's hyperparameters are the paper's (tau_1 0.07, tau_2 1,
gamma 0.01, momenta 0.7, no warm-up); only the optimiser and sizes are the synthetic
presets of the baselines, so ``vse_synthetic.py`` is trained the same way.

Reference: Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure
Consistency Learning", CVPR 2024.
"""

from ncljax.train.config import base_config, gsc_kwargs


def get_config(arg: str = ""):
    config = base_config()
    config.method = "gsc"
    config.method_kwargs = gsc_kwargs()
    config.noise.kind = "per_caption"
    config.noise.rate = 0.4
    config.model.embed_dim = 128
    config.model.word_dim = 64
    config.optim.learning_rate = 1e-3
    config.train.epochs = 12
    config.train.batch_size = 128
    if arg == "quick":
        quick(config)
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; use '' or 'quick'.")
    return config


def quick(config):
    """A smoke run of a few seconds: tiny splits, two epochs (one label update)."""
    config.data.num_train = 256
    config.data.num_val = 32
    config.data.num_test = 64
    config.train.epochs = 2
    config.train.batch_size = 64
    config.train.log_every_steps = 10
    config.eval.batch_size = 64
