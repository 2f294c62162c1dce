r"""UOT-RCL: partial-OT label correction and OT relation alignment, for noisy category labels.

  python train.py --config=configs/uot_rcl.py:synthetic --workdir=runs/uot_synthetic
  python train.py --config=configs/uot_rcl.py:synthetic,quick
  python train.py --config=configs/uot_rcl.py:xmedianet --config.data.manual_dir=/path/to/file
  python train.py --config=configs/uot_rcl.py:wiki --config.noise.rate=0.8
  python train.py --config=configs/uot_rcl.py:nuswide        # also :inria
  python train.py --config=configs/uot_rcl.py:vectors --config.data.folder=DIR   # your vectors

Real benchmarks (the paper's settings): the MRL backbone (two MLPs d -> 4096 -> 4096 ->
512 over the released features, unit prototypes, Adam 1e-4 with betas 0.5/0.999, cosine
annealing; ``ncljax.config.presets.use_mrl``), 100 epochs, 2 warm-up epochs of
cross-entropy, 5 confident pairs per class, momentum 0.99, lambda 0.4, mass 0.2 -> 0.8,
40% symmetric label noise shared by both modalities (the paper: 0.2 to 0.8); per dataset
the batch (``presets.LABELLED_BATCH``) and kappa, the neighbours of the confident-set
vote (``NEIGHBOURS``). The released file goes in ``data.manual_dir`` (layouts in
``ncljax/data``); without it the run stops with one message saying which file to put
where. ``configs/uot_xmedianet.py`` is this file's ``:xmedianet``.

``:synthetic``: the setting of ``configs/ce.py:synthetic`` (10,000 pairs, 10 classes,
20 epochs) with two values chosen on validation mAP at 40% noise: 4 warm-up epochs
instead of 2 (0.488 against 0.447: with 20 epochs the warm-up ends where CE's
validation mAP peaks, before it memorises the noise) and ``relation_weight`` 0 among
{0, 0.1, 0.4} (0.447, 0.422, 0.382 with 2 warm-up epochs): on this data the relation OT
plan puts only ~29% of its mass on same-class pairs (11% by chance), so L_BHG pulls
mismatched classes together; ``--config.method_kwargs.relation_weight=0.4`` runs the
full objective.

``:vectors``: a folder of your own vectors with ``{split}_labels.npy``
(``ncljax.data.vectors``; its labels are the observed ones, no simulated noise): the
setting of ``configs/ce.py:vectors`` (MLPs ``D -> 1024 -> 1024 -> 256``, Adam 3e-4, batch
100, 50 epochs) with the paper's method values and kappa 50. Its neighbour search is exact,
``N^2`` work before each epoch (about a minute at 10^5 pairs on 2 CPU cores); on a larger
folder ``--config.method_kwargs.knn=blocks`` searches nearby pairs only (a minute at 10^6,
about 97% of the exact neighbours; ``ncljax.labels.knn_cosine_blocks``), and
``--config.method_kwargs.embeddings=disk`` keeps the refresh's embeddings in files in the
workdir, read in chunks, so that its memory does not grow with the pairs times the
embedding's 256 dimensions (the same labels; ``ncljax.labels.correct_labels_on_disk``).

The partial OT's cost is vote-normalised, not Eq. 8 as printed (why: ``uot_rcl``'s
``vote_normalise``; figures: ``benchmarks/uot_vote_normalise.py``); ``=False`` is the
paper's.

Reference: Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval
with Noisy Labels", arXiv 2403.13480, 2024.
"""

from ncljax import config as config_lib
from ncljax.config import presets

NEIGHBOURS = {
    "synthetic": 50,
    "wiki": 10,
    "nuswide": 200,
    "xmedianet": 150,
    "inria": 45,
    "vectors": 50,
}
DATASETS = tuple(NEIGHBOURS)
SYNTHETIC = dict(relation_weight=0.0, warmup_epochs=4)  # chosen on validation, see above


def get_config(arg: str = "synthetic"):
    dataset, options = config_lib.parse_arg(arg, DATASETS)
    config = presets.start(dataset, labels=True, world=config_lib.world_of(options))
    config.method = "uot_rcl"
    extra = SYNTHETIC if dataset == "synthetic" else {}
    kwargs = config_lib.method_kwargs("uot_rcl", neighbours=NEIGHBOURS[dataset], **extra)
    config.method_kwargs = kwargs
    if "quick" in options:
        presets.quick(config)
        # Real data: one epoch that reaches the correction at once; synthetic: 2 + 2.
        kwargs.warmup_epochs = 2 if dataset == "synthetic" else 0
        if dataset == "synthetic":
            kwargs.neighbours = 10
            presets.schedule(config, kwargs.warmup_epochs, 2, None)
    return config
