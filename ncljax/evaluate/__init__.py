r"""Retrieval metrics (Recall@K, rSum, mAP@all) and noise-detection quality.

One module per concern; every public name is re-exported here (``evaluate.retrieval_metrics``):

- ``recall``: Recall@K, rSum, medr and meanr in both directions (SCAN / VSE++ protocol) and
  the COCO 5-fold 1K protocol, a pairwise ``sim_fn`` swept block by block on device.
- ``ranks``: the tie-aware rank counts of each query and the metrics computed from them.
- ``category``: mAP@all category retrieval (MRL / UOT-RCL protocol).
- ``noise``: how well a per-pair clean score separates clean from noisy training pairs.
- ``blocks``: the padding, placement and host transfer of blocks of rows, shared by the
  sweeps (and ``ncljax.retrieve``).

Ties favour nothing. Every metric is its expected value when tied candidates are put in a
uniformly random order: Recall@K and ranks from the counts of strictly better and of tied
negatives (exact, closed form), mAP@all from the tie groups of the sorted database (exact), the
noise AUC with average ranks. A collapsed model (every similarity equal) therefore scores chance
level, not a perfect rSum of 600, and a warning is logged when whole queries are tied.

Placement. Every block is put on device with ``jax.device_put``: on ``jax.devices()[0]`` by
default, so inputs that are already sharded (e.g. with a ``NamedSharding`` over a mesh) are
gathered block by block and give the same result as host inputs. With ``mesh=...`` the image
(query) rows of each block are sharded over all the mesh's axes and the caption (database) block
is replicated, so the similarity work is split across devices; results do not change.

References:
  Lee et al., "Stacked Cross Attention for Image-Text Matching" (SCAN), ECCV 2018: the
  ``i2t``/``t2i`` rank code (``evaluation.py``) that NCR, DECL and GSC reuse.
  Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard Negatives", BMVC 2018:
  COCO 5-fold 1K protocol.
  Hu et al., "Learning Cross-Modal Retrieval with Noisy Labels" (MRL), CVPR 2021: mAP@all.
  McSherry and Najork, "Computing Information Retrieval Performance Measures Efficiently in the
  Presence of Tied Scores", ECIR 2008: tie-aware (expected) precision and AP.
"""

from ncljax.evaluate.category import category_retrieval_metrics, mean_average_precision
from ncljax.evaluate.detection import noise_detection_metrics
from ncljax.evaluate.ranks import (
    RECALL_KS,
    RankCounts,
    RetrievalRanks,
    rank_metrics,
    recall_min_images,
    rsum_by_image,
)
from ncljax.evaluate.recall import (
    COCO_FOLD_IMAGES,
    TIE_ATOL,
    TIE_RTOL,
    SimFn,
    coco_5fold_metrics,
    retrieval_metrics,
    retrieval_ranks,
)

__all__ = [
    "COCO_FOLD_IMAGES",
    "RECALL_KS",
    "TIE_ATOL",
    "TIE_RTOL",
    "RankCounts",
    "RetrievalRanks",
    "SimFn",
    "category_retrieval_metrics",
    "coco_5fold_metrics",
    "mean_average_precision",
    "noise_detection_metrics",
    "rank_metrics",
    "recall_min_images",
    "retrieval_metrics",
    "retrieval_ranks",
    "rsum_by_image",
]
