r"""UOT-RCL on Wikipedia with noisy category labels.

Wikipedia: 10 classes, 2,173 training pairs.

  python train.py --config=configs/uot_wiki.py --workdir=runs/uot_wiki
  python train.py --config=configs/uot_wiki.py --config.noise.rate=0.8

Partial-OT label correction and OT relation alignment over the MRL backbone (two MLPs
d -> 4096 -> 4096 -> 512 over the released features, unit prototypes); 40% symmetric
label noise shared by both modalities (the paper evaluates 0.2, 0.4, 0.6, 0.8). The paper's
hyperparameters: 100 epochs, 2 warm-up epochs of cross-entropy, Adam 1e-4 (MRL's betas
0.5, 0.999, cosine annealing), batch 100, kappa = 10 neighbours, 5 confident pairs per
class, momentum 0.99, lambda 0.4, mass 0.2 -> 0.8. The released file goes in
``data.manual_dir`` (see ``ncljax/data/labelled.py``); without it the run stops with
one message saying which file to put where.

The partial OT's cost is vote-normalised, not Eq. 8 as printed (why: ``uot_rcl``'s
``vote_normalise``; figures: ``benchmarks/uot_vote_normalise.py``); ``=False`` is the paper's.

Reference: Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval
with Noisy Labels", arXiv 2403.13480, 2024.
"""

from ncljax.data import labelled
from ncljax.train import config as config_lib


def get_config(arg: str = ""):
    config = config_lib.base_config()
    config_lib.set_data(config, labelled.default_config("wiki"))
    config_lib.use_mrl(config)
    config.method = "uot_rcl"
    config.method_kwargs = config_lib.uot_rcl_kwargs(neighbours=10)
    config.noise.kind = "symmetric"
    config.noise.rate = 0.4
    config.train.epochs = 100
    config.train.batch_size = 100
    config.eval.batch_size = 100
    if arg == "quick":
        config_lib.quick(config)
        config.method_kwargs.warmup_epochs = 0
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; use '' or 'quick'.")
    return config
