"""The trainer's evaluator: runs a ``TrainState``'s networks over a split (encode in batches,
then score in chunks) with the metrics of ``ncljax.evaluate``, which defines them all.

Each ``config.eval.kind`` is an :class:`EvalKind` of ``EVAL_KINDS`` (``eval_kind(config)``):
its scorer, the validation metric that selects the best epoch, its one-line log summary and
its check that a split is large enough for its metrics."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ncljax import backend, evaluate, models
from ncljax.data import pipeline, sources
from ncljax.evaluate import blocks as blocks_lib
from ncljax.labels import share as labels_share
from ncljax.train import mesh as mesh_lib
from ncljax.train import step as step_lib
from ncljax.train.state import TrainState


def _image_repr(model, batch):
    return {k: v for k, v in model.encode_image(batch).items() if k in model.image_keys}


def _text_repr(model, batch):
    return {k: v for k, v in model.encode_text(batch).items() if k in model.text_keys}


def _with_labels(forward):
    """``forward`` per network, plus the batch labels (global arrays, in batch order)."""
    return lambda params, model_state, batch: (forward(params, model_state, batch), batch["label"])


# Items whose total variance is below this fraction of their mean square are (nearly) all the
# same: the spread of their similarities is ~1e-3 of their scale or less.
COLLAPSE_RATIO = 1e-6


@jax.jit
def _relative_variance(tree: Any) -> Any:
    """Per leaf ``[n, K, ...]``: ``[K]`` variance over items (summed over features) / mean square.

    ``sum_f Var_n(x[:, k, f]) / sum_f mean_n(x[:, k, f]^2)``, 0 for all-zero items.
    """

    def ratio(x):
        x = x.reshape(x.shape[0], x.shape[1], -1).astype(jnp.float32)
        variance = jnp.sum(jnp.var(x, axis=0), axis=-1)
        mean_square = jnp.sum(jnp.mean(jnp.square(x), axis=0), axis=-1)
        return jnp.where(mean_square > 0, variance / jnp.where(mean_square > 0, mean_square, 1), 0)

    return jax.tree.map(ratio, tree)


def warn_if_collapsed(representations: dict[str, dict], split_name: str) -> None:
    """Logs a warning per modality whose representations are (nearly) the same for every item.

    A floating leaf ``[n, K, ...]`` (``n > 1`` items, ``K`` networks) is collapsed when its
    variance over items, summed over features, is at most ``COLLAPSE_RATIO`` times its mean
    square for some network: a collapsed encoder or constant inputs, which tie every
    similarity of a query.
    One jitted reduction and one host transfer for all modalities; never raises on odd leaves
    (integer or boolean ones, e.g. masks, are skipped).

    Args:
      representations: modality name (``'image'``, ``'text'``) -> dict of ``[n, K, ...]``
        arrays, as :meth:`Evaluator.encode` produces them.
      split_name: named in the warning.
    """
    leaves = {
        modality: {
            key: x
            for key, x in tree.items()
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 and x.shape[0] > 1
        }
        for modality, tree in representations.items()
    }
    ratios = jax.device_get(_relative_variance(leaves))
    for modality, tree in ratios.items():
        collapsed = {
            key: float(np.min(r)) for key, r in tree.items() if np.min(r) <= COLLAPSE_RATIO
        }
        if collapsed:
            logging.warning(
                "evaluation: the %s representations of split %r are (nearly) the same for every "
                "item (variance / mean square across items: %s; threshold %g); the model has "
                "probably collapsed and its retrieval metrics are near chance level.",
                modality,
                split_name,
                ", ".join(f"{key} {value:.3g}" for key, value in collapsed.items()),
                COLLAPSE_RATIO,
            )


def _recall_problem(split_name: str, num_images: int, cpi: int, hint) -> str | None:
    needed = evaluate.recall_min_images(cpi)
    if num_images >= needed:
        return None
    k = max(evaluate.RECALL_KS)
    return (
        f"the {split_name} split holds {_count(num_images, 'image')} "
        f"({_count(num_images * cpi, 'caption')}), too few for Recall@{k} "
        "(eval.kind='recall'): each text->image query ranks the split's images and each "
        f"image->text query its captions, and with fewer than {k} wrong candidates R@{k} is "
        f"100 by construction; that takes at least {needed} images: {hint(needed)}"
    )


def _map_problem(split_name: str, labels: np.ndarray, hint) -> str | None:
    classes = np.unique(labels)
    if labels.size >= 2 and classes.size >= 2:
        return None
    held = _count(labels.size, "item")
    if labels.size:
        held += f" of the single class {int(classes[0])}"
    return (
        f"the {split_name} split holds {held}, too few for mAP@all (eval.kind='map'): with "
        "one class every candidate is relevant to every query and mAP is 1 by construction; "
        f"it needs items of at least 2 classes, e.g. a larger split: "
        f"{hint(max(2, labels.size + 1))}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _recall_split_problem(dataset, config, split_name: str, hint) -> str | None:
    """Recall@K: too few images, or (``eval.recall.coco_5fold``) a test split of partial folds."""
    num_images = dataset.info.split_sizes[split_name][0]
    fold = evaluate.COCO_FOLD_IMAGES
    if config.eval.recall.coco_5fold and split_name == "test" and num_images % fold:
        raise ValueError(
            f"Invalid config: eval.recall.coco_5fold=True scores the test split in folds of "
            f"{fold} images, but it holds {num_images}; set eval.recall.coco_5fold=False."
        )
    return _recall_problem(split_name, num_images, dataset.info.captions_per_image, hint)


def _map_split_problem(dataset, config, split_name: str, hint) -> str | None:
    """mAP@all: fewer than two classes (or items)."""
    del config
    return _map_problem(split_name, np.asarray(dataset.split(split_name).image_labels()), hint)


def check_splits(dataset, config, split_names: Sequence[str] = ("val", "test")) -> None:
    """Refuses a split on which the ``config.eval.kind`` metrics do not depend on the model.

    Recall@K: fewer images than ``evaluate.recall_min_images`` (11 for R@10) makes some
    R@K 100 by construction, and a validation rSum constant across epochs selects the
    first. mAP@all: a split of fewer than two classes (or items) scores 1 by construction.
    ``eval.recall.coco_5fold`` needs a test split of whole 1,000-image folds (each fold then holds
    enough images). Each kind's check is its ``EvalKind.split_problem``.

    Raises:
      ValueError: one line naming the split, its size, the metric, the size it needs and
        the config field to change (``sources.size_hint``).
    """
    kind = eval_kind(config)
    for name in split_names:
        if name not in dataset.info.split_sizes:
            continue
        hint = functools.partial(sources.size_hint, config.data, name)
        problem = kind.split_problem(dataset, config, name, hint)
        if problem:
            raise ValueError(f"Invalid config: {problem}.")


def _mean(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.mean(x, axis)


def _log_mean_exp(x: jax.Array, axis: int = 0) -> jax.Array:
    return jax.nn.logsumexp(x, axis) - jnp.log(x.shape[axis])


# ``Method.eval_pool`` -> ``pool(x, axis=0)``: how the (transformed) similarities of views,
# networks and runs are combined.
POOLS: dict[str, Callable[..., jax.Array]] = {"mean": _mean, "logmeanexp": _log_mean_exp}


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise ValueError(f"Unknown evaluation pool {pool!r}; known: {sorted(POOLS)}.")


def _network_similarity(graphdef, transform, pool, params, image_block, text_block):
    """``pool`` of ``transform(sim)`` over every view of every network; blocks are
    ``[n, K, ...]``."""
    params, model_state = params
    # The word mask follows the tokens, the same in every network: passed unbatched, so
    # the SGRAF head's length grouping stays one branch per chunk under vmap (a batched
    # branch index would run every branch).
    shared = {k: v[:, 0] for k, v in text_block.items() if k == "mask"}
    text_block = {k: v for k, v in text_block.items() if k not in shared}

    def one(p, s, image, text, shared):
        model = nnx.merge(graphdef, p, s)
        sim = model.similarity(image, {**text, **shared})
        views = sim if getattr(model, "num_views", 1) > 1 else sim[None]  # [W, n, m]
        return jnp.stack([transform(view) for view in views])

    sims = jax.vmap(one, in_axes=(0, 0, 1, 1, None))(
        params, model_state, image_block, text_block, shared
    )
    return POOLS[pool](sims.reshape(-1, *sims.shape[2:]), axis=0)


@functools.partial(jax.jit, static_argnames=("sim_fn", "block"))
def _own_pair_similarity(sim_fn, params, images, texts, *, block: int) -> jax.Array:
    """``sim(image k, caption k)`` for each row ``k`` of ``images`` / ``texts`` (``[n, K,
    ...]``, ``n`` a multiple of ``block``): the diagonal of ``sim_fn``'s ``[block, block]``
    blocks, one block at a time, so any head (SGR/SAF, views, pools) scores its own
    pairs exactly as it scores a retrieval."""

    def by_block(x):
        return x.reshape(-1, block, *x.shape[1:])

    def one(pair):
        return jnp.diagonal(sim_fn(params, *pair))

    out = jax.lax.map(one, (jax.tree.map(by_block, images), jax.tree.map(by_block, texts)))
    return out.reshape(-1)


class Evaluator:
    """Scores a ``TrainState`` on the splits of a dataset (Recall@K/rSum or mAP@all).

    The similarities of every image view of every network are ``transform``-ed and
    combined by ``pool`` (a name in ``POOLS``; mAP, which needs ``'mean'``: the cosine of
    the concatenated unit embeddings, i.e. the mean cosine over networks).

    Built before training: a validation or test split too small for the metrics is refused
    then (``check_splits``), not scored.
    """

    def __init__(
        self,
        graphdef,
        dataset,
        config,
        mesh,
        *,
        transform: Callable,
        fields,
        pool: str = "mean",
    ):
        _check_pool(pool)
        check_splits(dataset, config)
        self._pool = pool
        self._dataset = dataset
        self._config = config
        self._mesh = mesh
        self._image_fields, self._text_fields = fields
        self._sharding = mesh_lib.batch_sharding(mesh)
        options = backend.compiler_options()
        self._encode_image = jax.jit(
            _with_labels(step_lib.make_forward(graphdef, _image_repr)), compiler_options=options
        )
        self._encode_text = jax.jit(
            _with_labels(step_lib.make_forward(graphdef, _text_repr)), compiler_options=options
        )
        # One function object for the run, so evaluation compiles once.
        self._sim_fn = functools.partial(_network_similarity, graphdef, transform, pool)

    @property
    def dataset(self):
        """The dataset whose splits this evaluator scores."""
        return self._dataset

    @classmethod
    def of_method(cls, graphdef, dataset, config, mesh, method) -> Evaluator:
        """The evaluator of a run of ``method`` (its ``eval_transform`` and ``eval_pool``)
        over the batch fields its ``config.model`` reads: the trainer's and a finished
        run's (``ensemble.load_run``) are the same."""
        return cls(
            graphdef,
            dataset,
            config,
            mesh,
            transform=method.eval_transform,
            fields=models.input_fields(config.model),
            pool=method.eval_pool,
        )

    def _encode(self, encode, state, record_fn, n, batch_size=None):
        cfg = self._config
        outputs, labels = [], []
        dataset = pipeline.batches(
            record_fn,
            n,
            batch_size=batch_size or cfg.eval.batch_size,
            num_threads=cfg.data.num_threads,
        )
        with pipeline.reading(dataset) as batches:
            for batch in batches:
                device_batch = pipeline.to_device(batch, self._sharding)
                out, label = encode(state.params, state.model_state, device_batch)
                outputs.append(out)
                labels.append(label)
        # [K, n, ...] -> [n, K, ...]: the evaluator's blocks take rows along the leading axis.
        out = jax.tree.map(lambda *xs: jnp.moveaxis(jnp.concatenate(xs, 1)[:, :n], 0, 1), *outputs)
        labels = jnp.concatenate(labels)[:n]
        if jax.process_count() > 1:  # every process scores the whole split
            out, labels = multihost_utils.process_allgather((out, labels), tiled=True)
        return out, np.asarray(labels)

    def encode(self, state: TrainState, split_name: str) -> Encoded:
        """Every image and caption of a split, encoded by every network of ``state``.

        Logs a warning (:func:`warn_if_collapsed`) when a modality's representations do not
        vary across the split's items.
        """
        split = self._dataset.split(split_name)
        images, image_labels = self._encode(
            self._encode_image,
            state,
            pipeline.image_records(split, self._image_fields),
            split.num_images,
        )
        texts, text_labels = self._encode(
            self._encode_text,
            state,
            pipeline.caption_records(split, self._text_fields),
            split.num_captions,
        )
        warn_if_collapsed({"image": images, "text": texts}, split_name)
        return Encoded(
            images,
            texts,
            image_labels,
            text_labels,
            split.captions_per_image,
            self._sim_fn,
            (state.params, state.model_state),
            self._pool,
        )

    def encode_items(self, state: TrainState, side: str, items: dict[str, np.ndarray]) -> Any:
        """New images or captions, not a split's, encoded by every network of ``state``.

        Args:
          state: the run's state (its best model).
          side: ``'image'`` or ``'text'``.
          items: the model's input fields of that side (``global_image`` ``[n, D]``,
            ``regions`` ``[n, R, D]``, ``global_text`` ``[n, D]``, or ``tokens`` and
            ``length``), each with the items along the leading axis.

        Returns:
          The representations ``[n, K, ...]`` (a dict; ``emb`` for the cosine head).
        """
        fields = self._image_fields if side == "image" else self._text_fields
        encode = self._encode_image if side == "image" else self._encode_text
        n = len(next(iter(items.values())))

        def record(i: int) -> dict:
            out = {f: np.asarray(items[f][int(i)]) for f in fields}
            out.update(label=np.int32(0), index=np.int32(i), mask=np.bool_(True))
            return out

        return self._encode(encode, state, record, n)[0]

    def pair_similarity(
        self,
        state: TrainState,
        split_name: str,
        image_index: np.ndarray,
        *,
        batch_size: int | None = None,
        chunk: int | None = None,
        block: int = 128,
    ) -> np.ndarray:
        """The run's similarity of caption ``k`` with image ``image_index[k]``, for every
        caption of the split: the entry of the evaluation's similarity matrix (every
        network, view and ``transform``, pooled) at each given pair.

        The captions are encoded ``chunk`` at a time (default ``8 batch_size``) with their
        images, in batches of ``batch_size`` (default ``eval.batch_size``), so memory grows
        with the chunk, not with the split; the similarity is read off ``[block, block]``
        blocks.

        Returns:
          float64 ``[num_captions]``.
        """
        split = self._dataset.split(split_name)
        image_index = np.asarray(image_index, np.int64)
        if image_index.shape != (split.num_captions,):
            raise ValueError(
                f"image_index has shape {image_index.shape}; the {split_name} split has "
                f"{split.num_captions} captions."
            )
        batch_size = batch_size or self._config.eval.batch_size
        chunk = chunk or 8 * batch_size
        params = (state.params, state.model_state)
        out = []
        for start in range(0, image_index.size, chunk):
            rows = np.arange(start, min(start + chunk, image_index.size))
            records = pipeline.image_records(split, self._image_fields, image_index[rows])
            images, _ = self._encode(self._encode_image, state, records, rows.size, batch_size)
            records = pipeline.caption_records(split, self._text_fields, rows)
            texts, _ = self._encode(self._encode_text, state, records, rows.size, batch_size)
            padded = blocks_lib.round_up(rows.size, block)
            images, texts = (blocks_lib.take_rows(x, 0, padded) for x in (images, texts))
            sim = _own_pair_similarity(self._sim_fn, params, images, texts, block=block)
            out.append(np.asarray(blocks_lib.to_host(sim), np.float64)[: rows.size])
        return np.concatenate(out) if out else np.zeros(0, np.float64)

    def training_pair_similarity(self, state: TrainState) -> np.ndarray:
        """:meth:`pair_similarity` of every training pair as the run trains it (caption
        ``k`` with the image ``pipeline.paired_images`` gives it): float64 ``[N]``. A
        feature-vector model's encoders are small, so its pairs are encoded in batches of
        about ``PAIR_BATCH`` (a multiple of the evaluation batch, which the mesh divides):
        the per-batch cost is paid once per ~4,096 pairs (1,000,000 pairs of a 256-64-32
        MLP: 3.4 s against 9.1 s at 256)."""
        config = self._config
        split = self._dataset.split("train")
        batch_size = None
        if models.input_fields(config.model) == (("global_image",), ("global_text",)):
            eval_batch = config.eval.batch_size
            batch_size = eval_batch * -(-PAIR_BATCH // eval_batch)
        image_index = pipeline.paired_images(split, config.noise)
        return self.pair_similarity(state, "train", image_index, batch_size=batch_size)

    def __call__(self, state: TrainState, split_name: str) -> dict[str, float]:
        return score([self.encode(state, split_name)], self._config, self._mesh, split_name)

    def rsum_by_image(self, state: TrainState, split_name: str) -> np.ndarray:
        """``[n_img]`` each image's share of the split's rSum under ``state``'s model
        (``ncljax.evaluate.rsum_by_image``; they sum to the rSum that ``__call__``
        reports outside the COCO 5-fold test). Recall evaluation only."""
        if self._config.eval.kind != "recall":
            raise ValueError(f"rSum shares need eval.kind='recall', not {self._config.eval.kind!r}")
        run = self.encode(state, split_name)
        sim_fn, images, texts, kwargs = _recall_arguments([run], self._config, self._mesh)
        ranks = evaluate.retrieval_ranks(sim_fn, images, texts, **kwargs)
        return evaluate.rsum_by_image(*ranks, run.captions_per_image)


# Pairs encoded at a time by :meth:`Evaluator.training_pair_similarity` for feature vectors.
PAIR_BATCH = 4096


class Encoded(NamedTuple):
    """A split encoded by one run: representations ``[n, K, ...]`` and how to score them
    (``pool``: the name in ``POOLS`` that combines its views and networks)."""

    images: Any
    texts: Any
    image_labels: np.ndarray
    text_labels: np.ndarray
    captions_per_image: int
    sim_fn: Callable
    params: Any
    pool: str = "mean"


def _ensemble_similarity(sim_fns, pool, params, images, texts):
    """``pool`` over runs of each run's (pooled) similarity of the blocks."""
    sims = [f(p, i, t) for f, p, i, t in zip(sim_fns, params, images, texts, strict=True)]
    return POOLS[pool](jnp.stack(sims), axis=0)


def _score_map(runs: Sequence[Encoded], config, mesh, split_name: str) -> dict[str, float]:
    """mAP@all over the mean cosine of every network of every run (needs ``pool='mean'``
    and one embedding per image: no image views)."""
    del split_name
    if runs[0].pool != "mean" or any(r.images["emb"].ndim != r.texts["emb"].ndim for r in runs):
        raise ValueError(
            "eval.kind='map' scores the mean cosine of embeddings: it needs a method whose "
            f"eval_pool is 'mean' (not {runs[0].pool!r}) and models without image views."
        )
    emb_image = jnp.concatenate([flatten_networks(r.images["emb"]) for r in runs], 1)
    emb_text = jnp.concatenate([flatten_networks(r.texts["emb"]) for r in runs], 1)
    scale = 1.0 / np.sqrt(len(runs))
    return evaluate.category_retrieval_metrics(
        emb_image * scale,
        runs[0].image_labels,
        emb_text * scale,
        runs[0].text_labels,
        mesh=mesh,
    )


def _recall_arguments(runs: Sequence[Encoded], config, mesh):
    """``(sim_fn, images, texts, keyword arguments)`` of the recall sweeps
    (``evaluate.retrieval_ranks`` and the others) over the pooled runs' similarities."""
    if len(runs) == 1:  # the run's own sim_fn object: its compilation is reused every epoch
        sim_fn, images, texts, params = (
            runs[0].sim_fn,
            runs[0].images,
            runs[0].texts,
            runs[0].params,
        )
    else:
        sim_fn = functools.partial(
            _ensemble_similarity, tuple(r.sim_fn for r in runs), runs[0].pool
        )
        images, texts = tuple(r.images for r in runs), tuple(r.texts for r in runs)
        params = tuple(r.params for r in runs)
    kwargs = dict(
        captions_per_image=runs[0].captions_per_image,
        image_chunk=config.eval.recall.image_chunk,
        text_chunk=config.eval.recall.text_chunk,
        params=params,
        mesh=mesh,
    )
    return sim_fn, images, texts, kwargs


def _score_recall(runs: Sequence[Encoded], config, mesh, split_name: str) -> dict[str, float]:
    """Recall@K/rSum of the pooled runs' similarities (COCO: 5-fold 1K on test)."""
    sim_fn, images, texts, kwargs = _recall_arguments(runs, config, mesh)
    if config.eval.recall.coco_5fold and split_name == "test":
        folds = evaluate.coco_5fold_metrics(sim_fn, images, texts, **kwargs)
        full = evaluate.retrieval_metrics(sim_fn, images, texts, **kwargs)
        return {**folds, **{f"full_{k}": v for k, v in full.items()}}
    ranks = evaluate.retrieval_ranks(sim_fn, images, texts, **kwargs)
    held_out = {"noise_share_estimate": held_out_share(ranks), "pair_auc": pair_auc(ranks)}
    return evaluate.rank_metrics(*ranks) | held_out


def held_out_share(ranks: evaluate.RetrievalRanks) -> float:
    """Storey's share of the split's captions whose image ranks no better than a random
    one's (``ncljax.labels.noise_share`` of the text-to-image p-values ``(1 + g + t) /
    n_img``, ties against the partner): on pairs the model never trained on, an estimate
    of the share of mismatched pairs (and hard matched ones) that memorisation does not
    bias. The noise-share switch of the ``:vectors`` settings reads it from the validation
    split (``base.RefreshContext.held_out``)."""
    greater, tied = np.asarray(ranks.t2i.greater), np.asarray(ranks.t2i.tied)
    p = (1.0 + greater + tied) / max(np.asarray(ranks.i2t.greater).size, 1)
    return float(labels_share.noise_share(p).estimate)


def pair_auc(ranks: evaluate.RetrievalRanks) -> float:
    r"""How well the model tells a caption's own image from the split's other images: the
    area under the ROC curve of the partner's similarity against the other images',
    averaged over captions, :math:`1 - E[r_q] / (n_{img} - 1)` with :math:`E[r_q]` the
    caption's expected 0-based text-to-image rank (fair ties: a tie counts one half). A
    mismatched pair's caption is one more caption its image has nothing to do with, so on
    pairs the model never trained on this is the AUC the model's own similarity can reach
    in telling matched pairs from mismatched ones (a clean split; a split with a share
    :math:`\pi` of mismatched pairs reads about :math:`(1 - \pi) A + \pi / 2`). The audit
    reports the validation split's (``ncljax.audit``): a method's verdict on its training
    pairs, which the model has fitted, is rarely better. NaN with fewer than two images."""
    n_img = np.asarray(ranks.i2t.greater).size
    if n_img < 2:
        return float("nan")
    expected = np.asarray(ranks.t2i.expected_rank(), np.float64)
    return float(np.mean(1.0 - expected / (n_img - 1)))


# Noise-detection quality, logged after a kind's own metrics when a method estimates it.
NOISE_SUMMARY_KEYS = ("noise_auc", "clean_precision", "clean_recall")


class EvalKind(NamedTuple):
    """One ``config.eval.kind``: its metrics, how it selects the best epoch and what it needs.

    Attributes:
      name: the ``config.eval.kind`` value.
      selection: the validation metric whose maximum selects the best epoch.
      summary_keys: the metrics of the one-line log summary, in order.
      split_problem: ``(dataset, config, split_name, hint) -> message or None``; the reason
        a split is too small for these metrics (``hint(n)``: the config field to change, as
        ``sources.size_hint``). It may raise ``ValueError`` itself.
      score: ``(runs, config, mesh, split_name) -> metrics`` of :class:`Encoded` runs.
    """

    name: str
    selection: str
    summary_keys: tuple[str, ...]
    split_problem: Callable[..., str | None]
    score: Callable[..., dict[str, float]]

    def summary(self, metrics: dict) -> str:
        """``key=value`` of the summary keys (then the noise-detection ones) in ``metrics``."""
        keys = self.summary_keys + tuple(k for k in NOISE_SUMMARY_KEYS if k in metrics)
        return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


# ``eval.kind`` -> its :class:`EvalKind`.
EVAL_KINDS: dict[str, EvalKind] = {  # one per kind of ``ncljax.evaluate.kinds.KIND``
    "recall": EvalKind(
        name="recall",
        selection="rsum",
        summary_keys=("rsum", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"),
        split_problem=_recall_split_problem,
        score=_score_recall,
    ),
    "map": EvalKind(
        name="map",
        selection="map_avg",
        summary_keys=("map_avg", "map_i2t", "map_t2i"),
        split_problem=_map_split_problem,
        score=_score_map,
    ),
}


def eval_kind(config) -> EvalKind:
    """The :class:`EvalKind` of ``config.eval.kind``.

    Raises:
      ValueError: an unknown kind.
    """
    kind = config.eval.kind
    if kind not in EVAL_KINDS:
        raise ValueError(f"eval.kind must be one of {tuple(EVAL_KINDS)}, got {kind!r}.")
    return EVAL_KINDS[kind]


def score(runs: Sequence[Encoded], config, mesh, split_name: str) -> dict[str, float]:
    """The ``config.eval.kind`` metrics of one run's encodings, or of an ensemble of runs.

    An ensemble scores the runs' similarities combined by their shared pool (the mean for
    SGRAF's SGR and SAF models); mAP uses the mean cosine over every network of every run.

    Raises:
      ValueError: for runs whose pools differ, or mAP with a pool other than the mean.
    """
    pools = list(dict.fromkeys(r.pool for r in runs))  # in the order of the runs
    if len(pools) > 1:
        raise ValueError(
            f"The runs combine similarities differently ({' vs '.join(pools)}); an ensemble "
            "needs one rule (Method.eval_pool)."
        )
    return eval_kind(config).score(runs, config, mesh, split_name)


def flatten_networks(emb: jax.Array) -> jax.Array:
    r"""``[n, K, D]`` unit embeddings -> ``[n, K * D]`` whose cosine is the mean over networks.

    Each network's embedding is scaled by :math:`1 / \sqrt K`, so the rows stay unit vectors
    and their dot product is :math:`\frac1K \sum_k u_k^\top v_k` (the mAP embeddings, and
    those that ``ncljax.retrieve`` exports).
    """
    return emb.reshape(emb.shape[0], -1) / np.sqrt(emb.shape[1])
