r"""PC2: pseudo-classification, pseudo-captions and oscillation-based rectification, on NCR.

  python train.py --config=configs/pc2.py:synthetic --workdir=runs/pc2_synthetic
  python train.py --config=configs/pc2.py:synthetic,quick       # a smoke run
  python train.py --config=configs/pc2.py:f30k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/pc2.py:coco --config.data.manual_dir=/path/to/files
  python train.py --config=configs/pc2.py:cc152k --config.data.manual_dir=/path/to/files
  python train.py --config=configs/pc2.py:now --config.data.manual_dir=/path/to/files
  python train.py --config=configs/pc2.py:now --config.data.manual_dir=/path/to/files \
      --config.data.tokenizer=bpe                                # NoW's Table 8
  python train.py --config=configs/pc2.py:f30k,code             # the official code's switches
  python train.py --config=configs/pc2.py:vectors --config.data.folder=DIR   # your vectors

Real benchmarks (the paper's Sec. 5.2 and Appendix B, and the official code's run
commands): the SGR head (sigmoid output), two co-taught networks each with its
pseudo-classifier (``K = 128``, hidden 256), batch 128, Adam 2e-4 with clipping 2.0 (a
fresh Adam at the start of co-training), x0.1 every 30 co-training epochs, margin 0.2,
``m = 10``, ``tau = 0.5``, ``lambda_ent = 10`` (the run commands); (warm-up, co-training
epochs): Flickr30K (5, 50), MS-COCO (10, 50; the paper, the README command uses 5), NoW
(10, 50), CC152K (10, 50; neither the paper nor the README gives a CC152K schedule, so
NoW's). The pseudo-caption update starts at co-training epoch 25 (the code's
``warmup_epoch_2``), where the best validation score is forgotten. Noise: per-caption at
0.2 on F30K and COCO (the paper: 0-60%; or ``noise.kind=file`` with an official index
file), none on CC152K and NoW (real noise, about 70% on NoW). COCO is tested on 5 folds of
1K. NoW: 36 x 768 region features, Jieba tokens by default (``data.tokenizer``).

``:synthetic``: the embedded data with 40% per-caption noise, region encoder + Bi-GRU +
cosine head (the pseudo-classifier reads the 128-d embeddings), trained like
``configs/ncr.py:synthetic`` (Adam 1e-3, batch 128, 2 warm-up + 10 co-training epochs,
the pseudo-caption update from co-training epoch 5); ``K = 32`` pseudo-classes for its 10
latent classes (the paper's ablation finds ``K`` a few times the semantic classes best).
With the paper's objective the classifier collapses here: a cosine head aligns each
caption's embedding with its image's, so the caption's argmax is the image's own, and from
the first steps (captions' embeddings all alike at initialisation) one class wins every
pair (measured: one class of 32 used, largest probability 0.09, pseudo-caption class
accuracy 0.12 against a chance of 0.1). The synthetic config therefore starts the
pseudo-classification after the warm-up (``classification_start_epoch``), takes the
captions' labels from batch-centred logits (``center_targets``) and uses SCAN's entropy
of the mean prediction with weight 1 (``entropy_mode='marginal'``): 10-11 classes used,
class accuracy 0.26-0.28 (benchmarks/RESULTS.md).
It also weights the pseudo-caption update by ``lambda_n = 0.01`` (the paper: 1). On this
cosine head the pseudo pairs' hardest-negative hinge is large on nearly every pair (0.64 per
pair against 0.24 for the clean pairs, margin 0.18), so at ``lambda_n`` 1 or 0.1 its
separate Adam step drags the clean fit (the clean pairs' hinge rises to 0.34-0.38) and
costs 50-200 validation rSum, even when every noisy image borrows a caption of its own true
class (``pseudo_caption_assignment='true_classes'``); at 0.01 the update stays in without
that damage (test rSum at 40% noise: 344.3 at 1, 364.8 at 0.1, 497.3 at 0.01;
PC2* without the update 493.2; benchmarks/RESULTS.md).
The precomp benchmarks set ``calibration='paper'`` (Eq. 5's cutoff is the code's
absolute 0.5 on the prediction cosine); ``:synthetic`` keeps the default ``'data'`` (the
cutoff placed between the batch's chance cosine and 1; see ``ncljax/methods/pc2.py``).
``:vectors``: a folder of your own vectors (``ncljax.data.vectors``; its own pairs, MLP
encoders ``D -> 1024 -> 256`` and the cosine head, Adam 5e-4, batch 128), 2 warm-up + 18
co-training epochs, with the synthetic data's cosine-head remedies (late classification,
centred targets, marginal entropy, ``lambda_n = 0.01``) but the paper's ``K = 128``
pseudo-classes (a crawl has many more semantic classes than the synthetic 10), and
``ranking='contrastive'`` (the targets weight a symmetric InfoNCE, as ``configs/ncr.py``'s
``:vectors``; digits halves at 60%: test rSum 289.3, InfoNCE 170.3). Its prediction banks
keep each pair's 8 most probable classes (``bank_classes=8``): 208 bytes per pair for both
networks instead of 1,112, so ten million pairs' banks take 2 GB, not 11; on the real
worlds of ``python -m ncljax.report`` (digits, MNIST and cancer halves at 0, 40 and 60%,
three seeds) the cell means moved by -5.3 to +9.6 test rSum, within the seeds' spread,
and the audits read 0.94-0.98 (benchmarks/RESULTS.md).
``,code`` turns on the official code's deviations from the paper (``bank_mode``,
``margin_indexing``, ``detach_noisy_margin``, ``rectify_indicator``; see
``ncljax/methods/pc2.py``).

Reference: Duan et al., "PC2: Pseudo-Classification Based Pseudo-Captioning for Noisy
Correspondence Learning in Cross-Modal Retrieval", ACM MM 2024.
"""

from ncljax import config as config_lib
from ncljax.config import presets

# dataset: (warm-up epochs, co-training epochs, lr decay period in co-training epochs)
SCHEDULES = {
    "synthetic": (2, 10, None),
    "f30k": (5, 50, 30),
    "coco": (10, 50, 30),
    "cc152k": (10, 50, 30),
    "now": (10, 50, 30),
    "vectors": (2, 18, None),
}
DATASETS = tuple(SCHEDULES)
PSEUDO_START = 25  # the code's warmup_epoch_2, in co-training epochs
CODE = dict(  # the official code's switches
    bank_mode="code",
    margin_indexing="code",
    detach_noisy_margin=False,
    rectify_indicator="code",
)


def get_config(arg: str = "synthetic"):
    dataset, options = config_lib.parse_arg(arg, DATASETS, ("quick", "code"))
    warmup, cotrain, lr_update = SCHEDULES[dataset]
    config = presets.start(dataset, world=config_lib.world_of(options))
    config.method = "pc2"
    kwargs = dict(warmup_epochs=warmup, pseudo_start_epoch=min(PSEUDO_START, cotrain // 2))
    if dataset in ("synthetic", "vectors"):  # see the docstring: no collapse on a cosine head
        kwargs.update(
            classification_start_epoch=warmup,
            center_targets=True,
            entropy_mode="marginal",
            entropy_weight=1.0,
            noisy_weight=0.01,
        )
    if dataset == "synthetic":
        kwargs.update(num_classes=32)
    if dataset == "vectors":  # a contrastive loss, no division on clean data: configs/ncr.py
        # bank_classes: 208 bytes per pair for both networks' banks, not 1,112 (see above)
        kwargs.update(ranking="contrastive", noise_share="partner", bank_classes=8)
    if dataset in presets.PRECOMP:  # the paper's backbone keeps the code's cutoff 0.5 exactly
        kwargs.update(calibration="paper")
    config.method_kwargs = config_lib.method_kwargs(
        "pc2", **kwargs, **(CODE if "code" in options else {})
    )
    presets.schedule(config, warmup, cotrain, lr_update)  # lr decay counted in co-training epochs
    presets.race_division(config, dataset)
    if "quick" in options:
        presets.quick_coteaching(config, dataset, "pseudo_start_epoch")
        if dataset == "synthetic":  # the classification from the first co-training epoch
            config.method_kwargs.classification_start_epoch = 1
    return config
