"""The image-text retrieval model: two encoders, a similarity head, an optional classifier."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ncljax.models import encoders, heads


class RetrievalModel(nnx.Module):
    """Encodes images and captions and scores every image against every caption.

    The model reads the batch fields of its inputs: ``regions`` ``[B, R, D]`` or
    ``global_image`` ``[B, D_img]`` for images, ``tokens`` ``[B, L]`` with ``length``
    ``[B]`` or ``global_text`` ``[B, D_txt]`` for captions.

    ``encode_image``/``encode_text`` return dicts of per-item representations; the keys in
    ``image_keys``/``text_keys`` are what ``similarity`` needs, so evaluation keeps only
    those. ``__call__`` returns ``image``, ``text``, ``sim`` ``[B, B]`` (rows images,
    columns captions) and, with a classifier, ``image_logits``/``text_logits`` ``[B, K]``.

    Image views (UGNCL): with ``views = W > 1`` the image side has ``W`` independently
    initialised encoders of one kind (view 0 is ``image_encoder``, views ``1..W-1`` are
    ``image_views``), sharing the text encoder. ``encode_image`` then returns ``emb``
    ``[B, W, D]`` (and ``regions`` ``[B, W, R, D]``), the view axis after the item axis;
    ``similarity`` and ``sim`` are ``[W, n_img, n_txt]``, view ``w``'s cosine first.
    """

    image_keys = ("emb",)
    text_keys = ("emb",)

    def __init__(
        self,
        image_encoder: nnx.Module,
        text_encoder: nnx.Module,
        *,
        image_input: str,
        text_input: str,
        classifier: heads.Prototypes | None = None,
        views: int = 1,
        image_encoder_fn: Callable[[], nnx.Module] | None = None,
    ):
        """Builds the model.

        Args:
          image_encoder: the image encoder (of view 0).
          text_encoder: the caption encoder.
          image_input: ``'regions'`` or ``'global'``.
          text_input: ``'tokens'`` or ``'global'``.
          classifier: class prototypes on the embeddings, or ``None``.
          views: number of image views ``W``.
          image_encoder_fn: builds one more, independently initialised image encoder of
            ``image_encoder``'s kind; called ``W - 1`` times (needed when ``W > 1``).

        Raises:
          ValueError: for ``views < 1``, or ``views > 1`` with a classifier or without
            ``image_encoder_fn``.
        """
        if views < 1:
            raise ValueError(f"views must be at least 1, got {views}.")
        if views > 1 and classifier is not None:
            raise ValueError("A classifier is not available with image views (views > 1).")
        if views > 1 and image_encoder_fn is None:
            raise ValueError("views > 1 needs image_encoder_fn to build the extra views.")
        self.image_encoder = image_encoder
        self.text_encoder = text_encoder
        self.image_input = image_input
        self.text_input = text_input
        self.classifier = classifier
        self.num_views = views
        self.image_views = nnx.List([image_encoder_fn() for _ in range(views - 1)])

    def _encode_view(self, encoder: nnx.Module, batch: dict) -> dict:
        if self.image_input == "regions":
            regions, emb = encoder(batch["regions"])
            return {"emb": emb, "regions": regions}
        return {"emb": encoder(batch["global_image"])}

    def encode_image(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        """``emb`` (and ``regions`` for region input); with views, stacked on axis 1."""
        del train, rngs  # no dropout in the image encoders
        if self.num_views == 1:
            return self._encode_view(self.image_encoder, batch)
        views = [self._encode_view(e, batch) for e in (self.image_encoder, *self.image_views)]
        return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *views)

    def encode_text(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        if self.text_input == "tokens":
            words, mask, emb = self.text_encoder(
                batch["tokens"], batch["length"], train=train, rngs=rngs
            )
            return {"emb": emb, "words": words, "mask": mask}
        return {"emb": self.text_encoder(batch["global_text"])}

    def similarity(self, image: dict, text: dict, *, train: bool = False) -> jax.Array:
        """``[n_img, n_txt]`` similarity of encoded images and captions (with views:
        ``[W, n_img, n_txt]``). ``train`` is accepted for the SGRAF model's signature; the
        cosine head has nothing that trains differently."""
        del train
        if self.num_views == 1:
            return heads.cosine_similarity(image["emb"], text["emb"])
        return jnp.stack(
            [
                heads.cosine_similarity(image["emb"][:, w], text["emb"])
                for w in range(self.num_views)
            ]
        )

    def __call__(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        image = self.encode_image(batch, train=train, rngs=rngs)
        text = self.encode_text(batch, train=train, rngs=rngs)
        out = {"image": image, "text": text, "sim": self.similarity(image, text)}
        if self.classifier is not None:
            out["image_logits"] = self.classifier(image["emb"])
            out["text_logits"] = self.classifier(text["emb"])
        return out


def input_fields(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The image and caption batch fields a model built from ``cfg`` reads."""
    image = ("regions",) if cfg.image_input == "regions" else ("global_image",)
    text = ("tokens", "length") if cfg.text_input == "tokens" else ("global_text",)
    return image, text


def build_model(cfg, info, rngs: nnx.Rngs, heads_fn=None) -> nnx.Module:
    """Builds the model described by the ``model`` config section for dataset ``info``.

    ``model.head``: ``'cosine'`` (encoders of ``image_input``/``text_input`` and a cosine
    head) or ``'sgr'``/``'saf'`` (the SGRAF model over region features and tokens), with
    ``model.views`` image views. ``heads_fn(info, rngs) -> {name: module}`` (a method's
    ``heads_fn``) adds the method's own heads as ``model.method_heads``, built after the
    backbone so that the backbone's initialisation does not depend on them.

    Raises:
      ValueError: for an input the dataset does not provide, or an unknown option.
    """
    model = _build_backbone(cfg, info, rngs)
    if heads_fn is not None:
        model.method_heads = nnx.Dict(heads_fn(info, rngs))
    return model


def _build_backbone(cfg, info, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.head in ("sgr", "saf"):
        return _build_sgraf(cfg, info, rngs)
    if cfg.head != "cosine":
        raise ValueError(f"model.head must be 'cosine', 'sgr' or 'saf', got {cfg.head!r}.")
    if cfg.image_input == "regions":
        _require(info.num_regions, "region features", "model.image_input='global'")
        image_encoder_fn = functools.partial(
            encoders.RegionEncoder,
            info.region_dim,
            cfg.embed_dim,
            tuple(cfg.cosine.image_hidden),
            rngs=rngs,
        )
    elif cfg.image_input == "global":
        _require(info.image_dim, "global image features", "model.image_input='regions'")
        image_encoder_fn = functools.partial(
            encoders.MLPEncoder,
            info.image_dim,
            cfg.embed_dim,
            tuple(cfg.cosine.image_hidden),
            rngs=rngs,
        )
    else:
        raise ValueError(
            f"model.image_input must be 'regions' or 'global', got {cfg.image_input!r}"
        )
    image_encoder = image_encoder_fn()
    if cfg.text_input == "tokens":
        _require(info.vocab_size, "token ids", "model.text_input='global'")
        text_encoder = encoders.GRUTextEncoder(
            info.vocab_size,
            cfg.tokens.word_dim,
            cfg.embed_dim,
            dropout=cfg.tokens.dropout,
            bidirectional=cfg.tokens.bidirectional,
            rngs=rngs,
        )
    elif cfg.text_input == "global":
        _require(info.text_dim, "global text features", "model.text_input='tokens'")
        text_encoder = encoders.MLPEncoder(
            info.text_dim, cfg.embed_dim, tuple(cfg.text_mlp.hidden), rngs=rngs
        )
    else:
        raise ValueError(f"model.text_input must be 'tokens' or 'global', got {cfg.text_input!r}")
    classifier = None
    views = cfg.get("views", 1)  # configs saved before image views have no model.views
    if cfg.classifier:
        if views > 1:
            raise ValueError(
                "model.classifier is not available with image views (model.views > 1)."
            )
        if info.num_classes < 1:
            raise ValueError(f"model.classifier needs class labels; {info.name} has none.")
        classifier = heads.Prototypes(
            info.num_classes, cfg.embed_dim, temperature=cfg.prototypes.temperature, rngs=rngs
        )
    return RetrievalModel(
        image_encoder,
        text_encoder,
        image_input=cfg.image_input,
        text_input=cfg.text_input,
        classifier=classifier,
        views=views,
        image_encoder_fn=image_encoder_fn,
    )


def _build_sgraf(cfg, info, rngs: nnx.Rngs) -> nnx.Module:
    from ncljax.models import sgraf

    if (cfg.image_input, cfg.text_input) != ("regions", "tokens"):
        raise ValueError(
            f"model.head={cfg.head!r} reads region features and tokens: set "
            "model.image_input='regions' and model.text_input='tokens'."
        )
    _require(info.num_regions, "region features", "model.head='cosine'")
    _require(info.vocab_size, "token ids", "model.head='cosine'")
    if cfg.classifier:
        raise ValueError("model.classifier is not available with the SGRAF heads.")
    sgraf_cfg = cfg.sgraf
    return sgraf.SGRAFModel(
        info.region_dim,
        info.vocab_size,
        embed_dim=cfg.embed_dim,
        word_dim=cfg.tokens.word_dim,
        sim_dim=sgraf_cfg.sim_dim,
        num_regions=info.num_regions,
        kind=cfg.head,
        steps=cfg.sgr.steps if cfg.head == "sgr" else 0,
        smooth=sgraf_cfg.smooth,
        dropout=cfg.tokens.dropout,
        bidirectional=cfg.tokens.bidirectional,
        sigmoid=sgraf_cfg.sim_output == "sigmoid",
        chunk=sgraf_cfg.pair_chunk,
        remat=resolve_remat(sgraf_cfg.remat),
        length_groups=sgraf_cfg.length_groups,
        compute_dtype=sgraf_cfg.compute_dtype,
        views=cfg.get("views", 1),
        rngs=rngs,
    )


def resolve_remat(choice: str):
    """``model.sgraf.remat`` as the SGRAF head's ``remat`` argument (``'auto'``: per backend)."""
    if choice == "auto":
        choice = "full" if jax.default_backend() == "cpu" else "projections"
    return {"full": True, "none": False}.get(choice, choice)


def _require(size: int, what: str, alternative: str) -> None:
    if not size:
        raise ValueError(f"The dataset has no {what}; set {alternative} instead.")
