r"""NCR (noisy correspondence rectifier, co-teaching), the baseline of every method here.

  python train.py --config=configs/ncr.py:synthetic --workdir=runs/ncr_synthetic
  python train.py --config=configs/ncr.py:f30k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/ncr.py:coco --config.data.manual_dir=/path/to/files
  python train.py --config=configs/ncr.py:cc152k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/ncr.py:f30k,quick        # smoke run of a real config
  python train.py --config=configs/ncr.py:f30k,code         # the official code's switches

Real benchmarks: the official scripts' settings (``XLearning-SCU/2021-NeurIPS-NCR``
README and ``run.py``): SGR head, batch 128, Adam 2e-4 with clipping 2.0, x0.1 every
``lr_update`` co-training epochs, margin 0.2, exponential soft margins, GMM threshold
0.5, two networks; per dataset (warm-up epochs, co-training epochs, lr_update):
Flickr30K (5, 40, 30), MS-COCO (10, 20, 10), CC152K (10, 40, 30). The noisy batch's
update starts at co-training epoch ``num_epochs // 2``. Noise: per-caption (the NCR
protocol) at 0.2 on F30K/COCO (the paper reports 0.2 and 0.5; or ``noise.kind=file``
with an official index file), none on CC152K (real noise).

``:synthetic``: the embedded data with 40% per-caption noise, region encoder + Bi-GRU +
cosine head, trained like ``configs/vse_synthetic.py`` (Adam 1e-3, batch 128, 12
epochs: 2 warm-up + 10 co-training, the noisy update from co-training epoch 5).
``,code`` turns on the official code's deviations from the paper (``margin_of='image'``,
``target_prediction='first'``; see ``ncljax/methods/ncr.py``).

Reference: Huang et al., "Learning with Noisy Correspondence for Cross-modal Matching",
NeurIPS 2021.
"""

from ncljax.data import precomp
from ncljax.train import config as config_lib

# dataset: (warm-up epochs, co-training epochs, lr decay period in co-training epochs)
SCHEDULES = {"f30k": (5, 40, 30), "coco": (10, 20, 10), "cc152k": (10, 40, 30)}
DATASETS = ("synthetic", *SCHEDULES)
OPTIONS = ("quick", "code")


def get_config(arg: str = "synthetic"):
    parts = [a for a in arg.split(",") if a]
    datasets = [a for a in parts if a in DATASETS]
    unknown = set(parts) - set(DATASETS) - set(OPTIONS)
    if unknown or len(datasets) != 1:
        raise ValueError(
            f"Unknown config argument {arg!r}; use one dataset of {DATASETS}, optionally "
            f"with options {OPTIONS}, comma-separated (e.g. 'f30k,quick')."
        )
    dataset = datasets[0]
    config = config_lib.base_config()
    config.method = "ncr"
    if dataset == "synthetic":
        warmup, cotrain = 2, 10
        kwargs = dict(warmup_epochs=warmup, noisy_start_epoch=cotrain // 2)
        config.noise.kind, config.noise.rate = "per_caption", 0.4
        config.model.embed_dim, config.model.word_dim = 128, 64
        config.optim.learning_rate = 1e-3
        config.train.batch_size = 128
    else:
        warmup, cotrain, lr_update = SCHEDULES[dataset]
        kwargs = dict(warmup_epochs=warmup, noisy_start_epoch=cotrain // 2)
        config_lib.set_data(config, precomp.default_config(dataset))
        config_lib.use_sgraf(config, "sgr")
        config.optim.decay_every = lr_update  # counted in co-training epochs (the plan's)
        if dataset == "cc152k":
            config.noise.kind = "none"  # real noise: about 3-20% of the pairs are mismatched
        else:
            config.noise.kind, config.noise.rate = "per_caption", 0.2
        if dataset == "coco":
            config.eval.coco_5fold = True  # test: the 5-fold 1K protocol
    if "code" in parts:
        kwargs.update(margin_of="image", target_prediction="first")
    config.method_kwargs = config_lib.method_kwargs("ncr", **kwargs)
    config.train.epochs = warmup + cotrain
    if "quick" in parts:
        if dataset == "synthetic":
            config.data.num_train, config.data.num_val, config.data.num_test = 512, 64, 64
            config.train.batch_size, config.eval.batch_size = 64, 64
            config.method_kwargs.warmup_epochs = 1
            config.method_kwargs.noisy_start_epoch = 1
            config.train.epochs = 3
            config.train.log_every_steps = 10
        else:
            config_lib.quick(config)
            config.method_kwargs.warmup_epochs = 0
            config.method_kwargs.noisy_start_epoch = 0
    return config
