r"""The README's main job: GSC on the embedded synthetic data with 40% noise.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python train.py --config=configs/quickstart.py:quick --workdir=runs/quickstart_quick

20,000 image-caption pairs (4,000 images x 5 captions), 40% of the captions paired with
a wrong image (per-caption NCR protocol). Region features through a linear region
encoder, tokens through a Bi-GRU, cosine similarity, trained with GSC (geometrical
structure consistency; the single-network variant, to stay within about two minutes on
2 CPU cores: add ``--config.method_kwargs.num_networks=2`` for GSC+, twice the cost).
Prints every epoch the validation rSum and the noise-detection quality of GSC's labels
(AUC, precision and recall of ``label > 0.5`` against the true mask, which only the logs
read), then the test Recall@K/rSum of the best-on-validation epoch beside the detection
quality of the final labels. ``configs/vse_synthetic.py`` trains the non-robust VSE++
baseline the same way.

Reference: Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure
Consistency Learning", CVPR 2024.
"""

from ncljax.train.config import base_config, gsc_kwargs


def get_config(arg: str = ""):
    config = base_config()
    config.method = "gsc"
    config.method_kwargs = gsc_kwargs(num_networks=1)
    config.noise.kind = "per_caption"
    config.noise.rate = 0.4
    config.model.embed_dim = 128
    config.model.word_dim = 64
    config.optim.learning_rate = 1e-3
    config.train.epochs = 12
    config.train.batch_size = 128
    if arg == "quick":
        config.data.num_train = 1000
        config.data.num_val = 100
        config.data.num_test = 100
        config.train.epochs = 5
        config.train.log_every_steps = 10
    elif arg:
        raise ValueError(f"Unknown config argument {arg!r}; use '' or 'quick'.")
    return config
