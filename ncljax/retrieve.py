r"""Retrieve with a trained model: a split's captions ranked for an image, its images for a
caption, and (cosine head) the split's embeddings for a vector index.

  python -m ncljax.retrieve --workdir=RUN --query=image:12            # captions for image 12
  python -m ncljax.retrieve --workdir=RUN --query=caption:57 --k=10   # images for caption 57
  python -m ncljax.retrieve --workdir=RUN --query=id:photos/123.jpg   # an image id (vectors)
  python -m ncljax.retrieve --workdir=RUN --query=image:12 --candidates=4,90,311  # re-rank
  python -m ncljax.retrieve --workdir=RUN --export=RUN/embeddings     # cosine head: .npy files
  python -m ncljax.retrieve --workdir=RUN --query=image_vector:new.npy   # a new image

Queries (``--split``, default ``test``; indices are 0-based positions in the split):

* ``image:N``: rank the split's captions for image ``N``;
* ``caption:N``: rank the split's images for caption ``N`` (caption ``N`` describes image
  ``N // captions_per_image``);
* ``id:IMAGE_ID``: ``image:N`` for the first image whose line of ``{split}_image_ids.txt``
  is ``IMAGE_ID`` (``data.name='vectors'`` folders with that file);
* ``image_vector:FILE.npy`` / ``caption_vector:FILE.npy``: a new image's (caption's)
  vector, ``[D]`` as the folder's, embedded by the run's model (:func:`encode`) and ranked
  against the split's captions (images) (:func:`query`; cosine head).

The top ``--k`` (default 5) are printed one per line: rank, index, similarity, and for a
vectors folder the image id and caption text (characters that are not printable, such as
a terminal's escape sequences, as their escapes: :func:`printable`); ``*`` marks the query's
own pairs.

The run is the evaluator's: its ``config.json`` rebuilds the model, its best-on-validation
checkpoint (the one ``results.json``'s test figures come from) is restored, every network
encodes the split, and a query's similarities are the evaluator's ``sim_fn``: each network's
(and image view's) similarity through the method's ``eval_transform``, combined by its
``eval_pool``. So a ranking is the order of one row (image query) or column (caption query)
of the matrix the split's rSum is computed from, best first, equal similarities in index
order. (A query is scored alone, not in the evaluator's blocks of many, so its values may
differ from the evaluator's by rounding, ~1e-7; the evaluator counts similarities closer
than ``evaluate.TIE_ATOL`` as tied and scores their expected rank, so within such
near-ties any order is its order. With ``eval.recall.coco_5fold`` the test figures rank within
1K folds; this ranks the whole split, as the ``full_*`` figures. An ``eval.kind='map'`` run
ranks by the mean cosine its mAP uses.)

SGR/SAF heads score each pair through their similarity network, with no embedding of one
side alone: a query ranks the whole split when its candidates fit one evaluation block
(``eval.recall.text_chunk`` captions or ``eval.recall.image_chunk`` images, e.g.
Flickr30K's 5,000 test captions); beyond that ``--candidates`` (a shortlist, e.g. a
cosine-head run's top 100) is re-ranked. ``--candidates`` works with every head.

``--export=DIR`` (cosine head, the plain mean of the networks' cosines, one image view)
writes ``{split}_image_emb.npy`` ``[num_images, K * D]`` and ``{split}_text_emb.npy``
``[num_captions, K * D]`` (float32; each network's L2-normalised embedding, concatenated and
scaled by ``1 / sqrt(K)``, so the rows have unit norm and ``image_emb @ text_emb.T`` is the
evaluator's similarity), ``{split}_image_ids.txt`` and ``{split}_captions.txt`` where the
folder gives them, and ``{split}_export.json`` (what the files hold).

A missing or unfinished run, a bad query or an unknown id is reported in one line
(``-v 1``: the whole traceback).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from ncljax import backend, methods, models
from ncljax.data import sources
from ncljax.evaluate import blocks
from ncljax.methods.base import Method
from ncljax.train import arms, checkpoint, ensemble
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import mesh as mesh_lib

QUERY_KINDS = ("image", "caption", "id", "image_vector", "caption_vector")
_VECTOR_QUERIES = ("image_vector", "caption_vector")
PAIRWISE_HEADS = ("sgr", "saf")  # no separable embedding: every pair runs the head


class Run(NamedTuple):
    """A split of a finished run, encoded by its best model (:func:`load`).

    Attributes:
      workdir: the run directory.
      split: the split's name.
      config: the run's resolved config.
      method: the run's method (its ``eval_transform`` and ``eval_pool``).
      encoded: the evaluator's encoding of the split (``[n, K, ...]`` representations,
        ``sim_fn`` and ``params``).
      mesh: the mesh the run evaluates on.
      image_ids: ``[num_images]`` display ids, or None (only vectors folders give them;
        ``vectors.TextLines``, each line read when indexed).
      captions: ``[num_captions]`` caption texts, or None.
      encode_items: ``(side, items) -> [n, K, ...]`` representations of new images or
        captions by the same model (:func:`encode`); None where the run was not loaded.
      info: the dataset's ``DatasetInfo`` (the input widths :func:`encode` checks).
    """

    workdir: str
    split: str
    config: ml_collections.ConfigDict
    method: Method
    encoded: evaluator_lib.Encoded
    mesh: Mesh
    image_ids: Sequence[str] | None
    captions: Sequence[str] | None
    encode_items: Callable | None = None
    info: Any = None

    @property
    def num_images(self) -> int:
        return int(jax.tree.leaves(self.encoded.images)[0].shape[0])

    @property
    def num_captions(self) -> int:
        return int(jax.tree.leaves(self.encoded.texts)[0].shape[0])

    @property
    def captions_per_image(self) -> int:
        return self.encoded.captions_per_image


class Ranking(NamedTuple):
    """Candidates of one query, most similar first.

    Attributes:
      index: ``[m]`` int64 positions in the split (caption or image indices).
      score: ``[m]`` float32 similarity of each, non-increasing.
    """

    index: np.ndarray
    score: np.ndarray


def load(workdir: str, split: str = "test") -> Run:
    """Restores ``workdir``'s best model and encodes ``split`` with every network (the
    undivided run's, ``workdir/undivided``, where the run raced its division against none
    and that run won: ``ncljax.train.arms``).

    Raises:
      ValueError: an unknown split, or a damaged ``config.json``.
      FileNotFoundError: ``workdir`` holds no finished run.
      checkpoint.CheckpointError: its best checkpoint cannot be restored.
    """
    if split not in sources.SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {sources.SPLITS}.")
    workdir = arms.model_workdir(workdir)  # a division race the undivided run won
    config = ensemble.load_config(workdir)
    if not os.path.exists(os.path.join(workdir, "results.json")):  # no test of a best model yet
        raise FileNotFoundError(
            f"{workdir} has not finished training (no results.json); run its train.py "
            "command again to finish it, then retrieve with it."
        )
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    mesh = mesh_lib.evaluation_mesh(config)
    with jax.set_mesh(mesh):
        evaluator, state = ensemble.load_run(workdir, mesh)
        encoded = evaluator.encode(state, split)

    def encode_items(side: str, items: dict) -> Any:
        with jax.set_mesh(mesh):
            return evaluator.encode_items(state, side, items)

    image_ids, captions = _display_texts(config, split)
    info = evaluator.dataset.info
    return Run(
        workdir, split, config, method, encoded, mesh, image_ids, captions, encode_items, info
    )


def _display_texts(config, split: str) -> tuple[Sequence[str] | None, Sequence[str] | None]:
    if config.data.name != "vectors":
        return None, None
    from ncljax.data import vectors  # only a vectors folder carries ids and captions

    return vectors.display_texts(config.data, split)


# ---------------------------------------------------------------------------- similarities


@backend.jit(static_argnames="sim_fn")
def _similarity_block(sim_fn, params, image_block, text_block) -> jax.Array:
    return sim_fn(params, image_block, text_block)


def _gather(tree, index: np.ndarray | None):
    return tree if index is None else jax.tree.map(lambda x: x[index], tree)


def _scores(run: Run, image_rows, text_rows, axis: int, size: int, chunk: int) -> np.ndarray:
    """The similarities of one query against ``size`` candidates, in blocks of ``chunk``.

    ``axis=1``: one image (``image_rows``) against captions; ``axis=0``: images against one
    caption. The blocks are placed as the evaluator's sweep places them (image rows over the
    mesh, caption blocks replicated) and padded to one shape, so each compiles once.
    """
    rows, columns, multiple = blocks.placements(run.mesh)
    enc = run.encoded
    parts = []
    with jax.set_mesh(run.mesh):
        if axis == 1:
            image_block = jax.device_put(blocks.take_rows(image_rows, 0, multiple), rows)
            for start in range(0, size, chunk):
                text_block = jax.device_put(blocks.take_rows(text_rows, start, chunk), columns)
                sim = _similarity_block(enc.sim_fn, enc.params, image_block, text_block)
                parts.append(sim[0])
        else:
            chunk = blocks.round_up(chunk, multiple)
            text_block = jax.device_put(blocks.take_rows(text_rows, 0, 1), columns)
            for start in range(0, size, chunk):
                image_block = jax.device_put(blocks.take_rows(image_rows, start, chunk), rows)
                sim = _similarity_block(enc.sim_fn, enc.params, image_block, text_block)
                parts.append(sim[:, 0])
        scores = np.concatenate(blocks.to_host(parts))[:size]
    if not np.all(np.isfinite(scores)):
        raise ValueError(
            f"The model gave {int(np.sum(~np.isfinite(scores)))} non-finite similarities for "
            "this query; check the features and the model."
        )
    return scores


def _order(scores: np.ndarray, index: np.ndarray) -> Ranking:
    order = np.argsort(-scores, kind="stable")  # equal similarities stay in index order
    return Ranking(index[order].astype(np.int64), scores[order].astype(np.float32))


def _candidate_index(candidates, count: int, noun: str) -> np.ndarray:
    index = np.asarray(candidates)
    if index.ndim != 1 or not index.size or not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"candidates must be a non-empty list of {noun} indices, got {index!r}.")
    bad = index[(index < 0) | (index >= count)]
    if bad.size:
        raise ValueError(
            f"candidate {noun} {int(bad[0])} is out of range: the split holds {count} {noun}s "
            f"(0..{count - 1})."
        )
    values, counts = np.unique(index, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"candidate {noun} {int(values[counts > 1][0])} is listed twice.")
    return index.astype(np.int64)


def _check_index(run: Run, index: int, noun: str, count: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise ValueError(f"A {noun} index must be an integer, got {index!r}.")
    if not 0 <= index < count:
        raise ValueError(
            f"{noun} {index} is out of range: split {run.split!r} holds {count} {noun}s "
            f"(0..{count - 1})."
        )
    return int(index)


def _check_whole_split(run: Run, count: int, noun: str, chunk_field: str) -> None:
    """SGR/SAF: a whole split beyond one evaluation block needs a shortlist."""
    head = run.config.model.head
    chunk = run.config.eval.recall[chunk_field]
    if head in PAIRWISE_HEADS and count > chunk:
        raise ValueError(
            f"The {head.upper()} head scores every pair through its similarity network, and "
            f"split {run.split!r} holds {count} {noun}s, more than one evaluation block "
            f"(eval.recall.{chunk_field}={chunk}); pass candidates (--candidates=i,j,...: a "
            f"shortlist of {noun} indices to re-rank, e.g. a cosine-head run's top 100)."
        )


def rank_captions(run: Run, image_index: int, candidates: Sequence[int] | None = None) -> Ranking:
    """The split's captions (or ``candidates``) ranked for image ``image_index``.

    The scores are row ``image_index`` of the evaluator's pooled similarity matrix of the
    split (to its tie tolerance; see the module doc). Captions ``cpi * image_index`` to
    ``cpi * (image_index + 1) - 1`` are the image's own.

    Args:
      run: from :func:`load`.
      image_index: the query image's position in the split.
      candidates: caption indices to re-rank (default: every caption of the split; needed
        for SGR/SAF beyond ``eval.recall.text_chunk`` captions).

    Returns:
      The captions, most similar first.

    Raises:
      ValueError: an index out of range, a bad candidate list, a split too large for an
        SGR/SAF head without candidates, or non-finite similarities.
    """
    image_index = _check_index(run, image_index, "image", run.num_images)
    if candidates is None:
        _check_whole_split(run, run.num_captions, "caption", "text_chunk")
        index = np.arange(run.num_captions)
    else:
        index = _candidate_index(candidates, run.num_captions, "caption")
    texts = _gather(run.encoded.texts, None if candidates is None else index)
    image = blocks.take_rows(run.encoded.images, image_index, 1)
    chunk = min(run.config.eval.recall.text_chunk, index.size)
    return _order(_scores(run, image, texts, 1, index.size, chunk), index)


def rank_images(run: Run, caption_index: int, candidates: Sequence[int] | None = None) -> Ranking:
    """The split's images (or ``candidates``) ranked for caption ``caption_index``.

    The scores are column ``caption_index`` of the evaluator's pooled similarity matrix of
    the split (to its tie tolerance); image ``caption_index // cpi`` is the caption's own.

    Args:
      run: from :func:`load`.
      caption_index: the query caption's position in the split.
      candidates: image indices to re-rank (default: every image of the split; needed for
        SGR/SAF beyond ``eval.recall.image_chunk`` images).

    Returns:
      The images, most similar first.

    Raises:
      ValueError: as :func:`rank_captions`.
    """
    caption_index = _check_index(run, caption_index, "caption", run.num_captions)
    if candidates is None:
        _check_whole_split(run, run.num_images, "image", "image_chunk")
        index = np.arange(run.num_images)
    else:
        index = _candidate_index(candidates, run.num_images, "image")
    images = _gather(run.encoded.images, None if candidates is None else index)
    text = blocks.take_rows(run.encoded.texts, caption_index, 1)
    chunk = min(run.config.eval.recall.image_chunk, index.size)
    return _order(_scores(run, images, text, 0, index.size, chunk), index)


# ------------------------------------------------------------------------------ embeddings


def check_exportable(config, workdir: str, method: Method | None = None) -> None:
    """Refuses a run whose similarity is no dot product of per-item embeddings.

    Raises:
      ValueError: an SGR/SAF head, image views, or a method that transforms the cosines
        or pools them other than by their mean.
    """
    model = config.model
    method = method or methods.build_method(config.method, config.method_kwargs, model)
    identity = Method._field_defaults["eval_transform"]
    if model.head != "cosine":
        reason = f"its {model.head.upper()} head scores each pair through a network"
    elif model.get("views", 1) > 1:
        reason = f"it pools {model.views} image views"
    elif method.eval_transform is not identity or method.eval_pool != "mean":
        reason = (
            f"method {config.method!r} transforms the cosines before pooling them "
            f"(eval_pool {method.eval_pool!r})"
        )
    else:
        return
    raise ValueError(
        f"{workdir} has no embedding export: {reason}, so its similarity is no dot product "
        "of per-item vectors. Rank with --query (and --candidates) instead."
    )


def embeddings(run: Run) -> tuple[np.ndarray, np.ndarray]:
    r"""The split's image and caption embeddings whose dot product is the run's similarity.

    With ``K`` networks of L2-normalised embeddings :math:`u_k, v_k` and the mean pool,
    :math:`\mathrm{sim}(i, c) = \frac1K \sum_k u_{k,i}^\top v_{k,c} = x_i^\top y_c`
    with :math:`x_i = [u_{1,i}; \dots; u_{K,i}] / \sqrt K` (unit norm), likewise
    :math:`y_c` (the evaluator's mAP embeddings).

    Returns:
      ``image_emb`` ``[num_images, K * D]`` and ``text_emb`` ``[num_captions, K * D]``,
      float32 numpy.

    Raises:
      ValueError: the run's similarity is not such a dot product (SGR/SAF heads, image
        views, a transform or a pool other than the plain mean).
    """
    check_exportable(run.config, run.workdir, run.method)
    flat = evaluator_lib.flatten_networks
    image = flat(run.encoded.images["emb"])
    text = flat(run.encoded.texts["emb"])
    return tuple(np.asarray(jax.device_get(x), np.float32) for x in (image, text))


def _items(run: Run, side: str, values) -> dict[str, np.ndarray]:
    """``values`` as the input fields of ``side``: an array of global vectors ``[n, D]``
    (or a region array ``[n, R, D]``), or a dict of fields; refused in one line when it
    does not fit the run's model."""
    image_fields, text_fields = models.input_fields(run.config.model)
    fields = image_fields if side == "image" else text_fields
    noun = "images" if side == "image" else "texts"
    if not isinstance(values, dict):
        if len(fields) != 1:
            raise ValueError(
                f"{run.workdir} reads {noun} as {list(fields)}: pass {noun}= a dict of them."
            )
        values = {fields[0]: values}
    missing = [f for f in fields if f not in values]
    if missing:
        raise ValueError(f"{noun}= lacks {missing}; the run's model reads {list(fields)}.")
    items = {f: np.asarray(values[f]) for f in fields}
    sizes = {len(v) if v.ndim else 0 for v in items.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"{noun}= needs one or more items along the first axis of each field.")
    dims = {"global_image": "image_dim", "global_text": "text_dim", "regions": "region_dim"}
    dataset_info = run.info or sources.load_dataset(run.config.data).info
    for field, array in items.items():
        if field in dims:
            want = getattr(dataset_info, dims[field])
            if array.shape[-1] != want or not np.issubdtype(array.dtype, np.number):
                raise ValueError(
                    f"{noun}= {field} has shape {array.shape}; the run's model reads "
                    f"{field} vectors of {want} numbers each (shape [n, {want}])."
                )
            if not np.isfinite(array).all():
                raise ValueError(f"{noun}= {field} holds NaN or infinite values.")
            items[field] = array.astype(np.float32)
    return items


def encode(run: Run | str, *, images=None, texts=None) -> tuple:
    r"""New images and captions embedded by a finished run's best model.

    The embeddings are those of :func:`embeddings` (each network's unit embedding,
    concatenated and scaled by :math:`1 / \sqrt K`): ``image_emb @ text_emb.T`` is the
    run's similarity, also against the split's own :func:`embeddings`.

    Args:
      run: a :func:`load`-ed run, or the workdir of a finished run (its test split is
        loaded).
      images: ``[n, D]`` image vectors (the folder's ``*_images.npy`` kind), ``[n, R, D]``
        regions, or a dict of the model's image fields; None: none.
      texts: ``[m, D]`` caption vectors, or a dict (``tokens`` and ``length``); None: none.

    Returns:
      ``(image_emb [n, K * D] or None, text_emb [m, K * D] or None)``, float32 numpy.

    Raises:
      ValueError: the run's similarity is no dot product of embeddings (SGR/SAF heads,
        image views, a transformed or non-mean pool), or an input that does not fit.
    """
    run = load(run) if isinstance(run, str) else run
    check_exportable(run.config, run.workdir, run.method)
    if run.encode_items is None:
        raise ValueError("This Run was not made by retrieve.load; load it to encode new items.")
    out = []
    for side, values in (("image", images), ("text", texts)):
        if values is None:
            out.append(None)
            continue
        rep = run.encode_items(side, _items(run, side, values))
        flat = evaluator_lib.flatten_networks(rep["emb"])
        out.append(np.asarray(jax.device_get(flat), np.float32))
    return tuple(out)


def query(run: Run, *, image=None, caption=None) -> Ranking:
    """The split's captions ranked for a new image vector, or its images for a new caption
    vector (exactly one of ``image``, ``caption``: one item, e.g. ``[D]``), by the run's
    similarity (:func:`encode` against :func:`embeddings`), most similar first.

    Raises:
      ValueError: not exactly one query, or as :func:`encode`.
    """
    if (image is None) == (caption is None):
        raise ValueError("query takes one new item: image=<vector> or caption=<vector>.")

    def one(v):  # a single item -> a batch of one
        if isinstance(v, dict):
            return {k: np.asarray(x)[None] for k, x in v.items()}
        return np.asarray(v)[None]

    image_emb, text_emb = embeddings(run)
    if image is not None:
        new, _ = encode(run, images=one(image))
        scores = (text_emb @ new[0]).astype(np.float32)
    else:
        _, new = encode(run, texts=one(caption))
        scores = (image_emb @ new[0]).astype(np.float32)
    return _order(scores, np.arange(len(scores)))


def embed(workdir: str, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """:func:`embeddings` of ``split`` of the finished run in ``workdir``."""
    return embeddings(load(workdir, split))


def export(run: Run, folder: str) -> list[str]:
    """Writes the split's embeddings (and ids and captions, where given) to ``folder``.

    Returns:
      The paths written.

    Raises:
      ValueError: as :func:`embeddings`.
      OSError: ``folder`` cannot be written.
    """
    check_export_folder(run.config, folder)
    image_emb, text_emb = embeddings(run)
    try:
        return _write_export(run, folder, image_emb, text_emb)
    except OSError as e:
        what = "is a file, not a folder" if os.path.isfile(folder) else "cannot be written"
        raise OSError(
            f"--export={folder} {what} ({e.strerror or e}): pass a folder you can write (it "
            "is created when missing)."
        ) from None


def _write_export(run: Run, folder: str, image_emb, text_emb) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, run.split)
    written = []
    for name, array in (("image_emb", image_emb), ("text_emb", text_emb)):
        _replace(f"{prefix}_{name}.npy", lambda f, array=array: np.save(f, array), binary=True)
        written.append(f"{prefix}_{name}.npy")
    for name, lines in (("image_ids", run.image_ids), ("captions", run.captions)):
        if lines is not None:
            _replace(
                f"{prefix}_{name}.txt", lambda f, lines=lines: f.writelines(f"{x}\n" for x in lines)
            )
            written.append(f"{prefix}_{name}.txt")
    manifest = {
        "split": run.split,
        "method": run.config.method,
        "num_networks": int(run.encoded.images["emb"].shape[1]),
        "num_images": run.num_images,
        "num_captions": run.num_captions,
        "captions_per_image": run.captions_per_image,
        "dim": int(image_emb.shape[1]),
        "similarity": "image_emb @ text_emb.T: the mean cosine over the run's networks, the "
        "similarity its evaluation ranks by (rows have unit norm)",
        "caption_of_image": "caption k describes image k // captions_per_image",
    }
    _replace(f"{prefix}_export.json", lambda f: json.dump(manifest, f, indent=2))
    written.append(f"{prefix}_export.json")
    return written


def _replace(path: str, write_fn, binary: bool = False) -> None:
    """Writes ``path`` through a temporary file and a rename: an export stopped partway
    leaves whole files (the previous export's or the new one's), never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f:
            write_fn(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_export_folder(config, folder: str) -> None:
    """Refuses to export into the run's own vectors folder: the export's
    ``{split}_image_ids.txt`` and ``{split}_captions.txt`` would replace the folder's (with
    other line ends or a byte-order mark dropped, the run's fingerprint of its files no
    longer matches, and the run can no longer be audited or retrieved with).

    Raises:
      ValueError: naming the folder and what to pass instead.
    """
    data_folder = config.data.get("folder") if config.data.name == "vectors" else None
    same = (
        data_folder
        and os.path.isdir(folder)
        and os.path.isdir(data_folder)
        and os.path.samefile(folder, data_folder)
    )
    if same:
        raise ValueError(
            f"--export={folder} is the run's data.folder: the export would replace its "
            "files; pass another folder (e.g. the run's workdir/embeddings)."
        )


# ----------------------------------------------------------------------------- the command


def parse_query(query: str) -> tuple[str, str]:
    """``'image:12'`` -> ``('image', '12')``; checks the form only (see the module doc)."""
    kind, sep, value = query.partition(":")
    if not sep or kind not in QUERY_KINDS or not value:
        raise ValueError(
            f"--query={query!r} is not a query; use image:N (rank captions for image N), "
            "caption:N (rank images for caption N), id:IMAGE_ID (a line of "
            "{split}_image_ids.txt), or image_vector:FILE.npy / caption_vector:FILE.npy (a "
            "new image's or caption's vector)."
        )
    if kind in _VECTOR_QUERIES:
        return kind, value
    if kind != "id" and not (value.isascii() and value.isdigit()):  # '²' is a digit to str
        raise ValueError(f"--query={query!r}: {kind} needs a non-negative integer index.")
    return kind, value


def image_of_id(run: Run, image_id: str) -> int:
    """The position of the first image whose id is ``image_id``.

    Raises:
      ValueError: the run's split has no ids, or none is ``image_id``.
    """
    if run.image_ids is None:
        where = (
            f"its folder has no {run.split}_image_ids.txt"
            if run.config.data.name == "vectors"
            else f"only a vectors folder has image ids (data.name={run.config.data.name!r})"
        )
        raise ValueError(f"--query=id:{image_id} needs image ids, but {where}; use image:N.")
    try:
        return run.image_ids.index(image_id)
    except ValueError:
        raise ValueError(
            f"Image id {image_id!r} is not in {run.split}_image_ids.txt ({run.num_images} ids); "
            "check it, or use --query=image:N."
        ) from None


def parse_candidates(text: str) -> list[int]:
    """``'4,90,311'`` (or a file of whitespace-separated indices) -> ``[4, 90, 311]``."""
    source = text
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as f:
                text = ",".join(f.read().split())
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
            raise ValueError(
                f"--candidates={source} cannot be read ({reason}); pass a text file of "
                "whitespace- or comma-separated indices, or the indices themselves (4,90,311)."
            ) from None
        source = f"{source}: the file ({text[:60]!r})"
    else:
        source = repr(text[:80])
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isascii() and item.isdigit() for item in items):
        raise ValueError(
            f"--candidates={source} is not a list of indices; pass comma-separated "
            "non-negative integers (4,90,311) or a file of them."
        )
    return [int(item) for item in items]


def printable(text: str) -> str:
    """``text`` as printed: every character that is not printable (control and format
    characters: a terminal's escape sequences, carriage returns, bidirectional overrides)
    written as its Python escape (``\\x1b``), so the data cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _image_text(run: Run, image: int) -> str:
    return f"image {image}" + (
        "" if run.image_ids is None else f"  {printable(run.image_ids[image])}"
    )


def _caption_text(run: Run, caption: int) -> str:
    return "" if run.captions is None else f"  {printable(run.captions[caption])}"


def format_ranking(run: Run, kind: str, index: int, ranking: Ranking, k: int) -> list[str]:
    """A header and the top ``k`` lines: rank, index (``*``: the query's own pair),
    similarity, and for captions their image; ids and caption texts where given."""
    cpi, shown, total = run.captions_per_image, min(k, ranking.index.size), ranking.index.size
    image = index if kind == "image" else index // cpi
    query = f"split {run.split!r}, image {image}"
    if run.image_ids is not None:
        query += f" ({printable(run.image_ids[image])})"
    if kind == "image":
        noun, own = "caption", range(cpi * index, cpi * (index + 1))
    else:
        noun, own = "image", (image,)
        query = query.replace(", image", f", caption {index} of image")
        if run.captions is not None:
            query += f' "{printable(run.captions[index])}"'
    header = f"{query}: top {shown} of {total} {noun}s, most similar first (* its own)"
    return [header, *_ranked_lines(run, noun, ranking, k, own)]


def _ranked_lines(run: Run, noun: str, ranking: Ranking, k: int, own=()) -> list[str]:
    """The top ``k`` lines: rank, index (``*``: in ``own``), similarity, and for captions
    their image; ids and caption texts where given."""
    width = len(str(max(run.num_images, run.num_captions) - 1))
    cpi, lines = run.captions_per_image, []
    for rank, (i, s) in enumerate(zip(ranking.index[:k], ranking.score[:k], strict=True), 1):
        line = f"{rank:>4}  {noun} {i:>{width}}{'*' if i in own else ' '} {s:>8.4f}"
        if noun == "caption":
            line += f"  {_image_text(run, i // cpi)}{_caption_text(run, i)}"
        elif run.image_ids is not None:
            line += f"  {printable(run.image_ids[i])}"
        lines.append(line)
    return lines


def run_query(
    run: Run, query: str, *, k: int = 5, candidates: Sequence[int] | None = None
) -> list[str]:
    """The printed answer to ``query`` (see the module doc)."""
    if k < 1:
        raise ValueError(f"--k={k} must be at least 1.")
    kind, value = parse_query(query)
    if kind in _VECTOR_QUERIES:
        return _run_vector_query(run, kind, value, k)
    if kind == "id":
        kind, index = "image", image_of_id(run, value)
    else:
        index = int(value)
    rank = rank_captions if kind == "image" else rank_images
    return format_ranking(run, kind, index, rank(run, index, candidates), k)


def _load_vector(path: str) -> np.ndarray:
    """The one vector of a ``.npy`` file (``[D]`` or ``[1, D]``), refused in one line."""
    try:
        vector = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"--query: {path} is not a readable .npy file ({e}).") from None
    if vector.ndim == 2 and vector.shape[0] == 1:
        vector = vector[0]
    if vector.ndim != 1:
        raise ValueError(
            f"--query: {path} holds an array of shape {vector.shape}; save one vector ([D])."
        )
    return vector


def _run_vector_query(run: Run, kind: str, path: str, k: int) -> list[str]:
    """The printed answer to a new image's or caption's vector (:func:`query`)."""
    side = "image" if kind == "image_vector" else "caption"
    ranking = query(run, **{side: _load_vector(path)})
    noun = "caption" if side == "image" else "image"
    shown, total = min(k, ranking.index.size), ranking.index.size
    header = f"a new {side} ({path}): top {shown} of {total} {noun}s of split {run.split!r}"
    return [header, *_ranked_lines(run, noun, ranking, k)]


def main(argv):
    from ncljax import cli as _cli

    _cli.started()  # Ctrl-C from here on: KeyboardInterrupt, caught below
    from absl import app, flags
    from absl import logging as absl_logging

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO
    f = flags.FLAGS
    try:
        if f.query is None and f.export is None:
            raise ValueError(
                "Nothing to do: pass --query=image:N, caption:N, id:IMAGE_ID, "
                "image_vector:FILE.npy or caption_vector:FILE.npy, or --export=DIR."
            )
        if f.query is not None:
            parse_query(f.query)  # a malformed query is refused before the run is loaded
        candidates = None if f.candidates is None else parse_candidates(f.candidates)
        if f.export is not None:  # refused before the split is encoded
            config = ensemble.load_config(f.workdir)
            check_exportable(config, f.workdir)
            check_export_folder(config, f.export)
        run = load(f.workdir, f.split)
        if f.export is not None:
            for path in export(run, f.export):
                print(f"wrote {path}")
        if f.query is not None:
            print("\n".join(run_query(run, f.query, k=f.k, candidates=candidates)))
    except (OSError, ValueError, checkpoint.CheckpointError) as e:
        if f.verbosity > 0:  # -v 1: the whole traceback
            raise
        sys.exit(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        if f.verbosity > 0:
            raise
        checkpoint.mute_background_errors()
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    from absl import app, flags

    from ncljax import cli

    flags.DEFINE_string("workdir", None, "A finished run's directory.")
    flags.DEFINE_string("split", "test", "The split to retrieve from: train, val or test.")
    flags.DEFINE_string(
        "query",
        None,
        "image:N, caption:N, id:IMAGE_ID (vectors folders), or a new item's vector: "
        "image_vector:FILE.npy, caption_vector:FILE.npy (cosine head).",
    )
    flags.DEFINE_integer("k", 5, "How many of the best candidates to print.")
    flags.DEFINE_string(
        "candidates", None, "Indices to re-rank (comma-separated, or a file of them)."
    )
    flags.DEFINE_string("export", None, "Folder for the split's embeddings (cosine head).")
    flags.mark_flag_as_required("workdir")
    app.run(main, flags_parser=cli.flags_parser("python -m ncljax.retrieve"))
