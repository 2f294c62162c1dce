r"""The README's main job: GSC on the embedded synthetic data with 40% noise.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python train.py --config=configs/quickstart.py:quick --workdir=runs/quickstart_quick

20,000 image-caption pairs (4,000 images x 5 captions), 40% of the captions paired with
a wrong image (per-caption NCR protocol). Region features through a linear region
encoder, tokens through a Bi-GRU, cosine similarity, trained with GSC (geometrical
structure consistency; the single-network variant, to stay within about two minutes on
2 CPU cores: ``configs/gsc.py:synthetic`` is GSC+, twice the cost). Prints every epoch
the validation rSum and the noise-detection quality of GSC's labels (AUC, precision and
recall of ``label > 0.5`` against the true mask, which only the logs read), then the test
Recall@K/rSum of the best-on-validation epoch beside the detection quality of the final
labels. ``configs/vse.py:synthetic`` trains the non-robust VSE++ baseline the same way.

Reference: Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure
Consistency Learning", CVPR 2024.
"""

from ncljax import config as config_lib
from ncljax.config import presets

DATASETS = ("synthetic",)


def get_config(arg: str = ""):
    _, options = config_lib.parse_arg(arg, DATASETS)
    config = presets.start("synthetic", world=config_lib.world_of(options))
    config.method = "gsc"
    config.method_kwargs = config_lib.method_kwargs("gsc", num_networks=1)
    if "quick" in options:  # a larger smoke run than presets.quick: GSC's labels must settle
        config.data.num_train, config.data.num_val, config.data.num_test = 1000, 100, 100
        config.train.epochs, config.train.log_every_steps = 5, 10
    return config
