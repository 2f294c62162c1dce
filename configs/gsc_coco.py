r"""GSC+ (geometrical structure consistency, dual networks) on the SGR backbone, MS-COCO.

  python train.py --config=configs/gsc_coco.py --config.data.manual_dir=/path/to/files
  python train.py --config=configs/gsc_coco.py:code      # the GSC+ script's values, intra-text form
  python train.py --config=configs/gsc_coco.py:single    # the single-network GSC script
  python train.py --config=configs/gsc_coco.py:quick     # smoke run (combine: code,quick)

Defaults (``gsc.md`` Sec. 5.4, the paper's values): SGR head, batch 128, Adam 2e-4
x0.2 every 15 epochs, 60 epochs, clipping 2.0, tau_1 0.07, tau_2 1, gamma 0.01, momenta
0.7, no warm-up, two networks exchanging labels. The presets and their per-dataset
values are ``ncljax.train.config.GSC_PRESETS`` (intra-text structure:
``GSC_TEXT_STRUCTURE``; see ``ncljax.methods.gsc``). The released precomp files go in
``data.manual_dir`` (layout in ``ncljax/data/precomp.py``).

Reference: Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure
Consistency Learning", CVPR 2024.
"""

from ncljax.data import precomp
from ncljax.train import config as config_lib


def get_config(arg: str = ""):
    options = [a for a in arg.split(",") if a]
    presets = [a for a in options if a in config_lib.GSC_PRESETS]
    unknown = set(options) - set(config_lib.GSC_PRESETS) - {"quick"}
    if unknown or len(presets) > 1:
        raise ValueError(
            f"Unknown config argument {arg!r}; use one of {sorted(config_lib.GSC_PRESETS)} "
            "and/or 'quick', comma-separated."
        )
    config = config_lib.base_config()
    config_lib.set_data(config, precomp.default_config("coco"))
    config_lib.use_gsc(config, "coco", presets[0] if presets else "paper")
    config.noise.kind = "per_caption"  # as NCR (the paper); or kind="file" with an index file
    config.noise.rate = 0.2  # the paper reports 0.2, 0.4, 0.6
    config.eval.coco_5fold = True  # test: the 5-fold 1K protocol (full 5K metrics as full_*)
    if "quick" in options:
        config_lib.quick(config)
    return config
