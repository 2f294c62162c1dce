"""The caption vocabulary of the SCAN/NCR "precomp" releases, and their word tokenizer.

The vocabulary is a JSON object with three fields (SCAN's ``serialize_vocab`` format,
reused by NCR, DECL, BiCro, GSC, PC2 and NoW):

* ``word2idx``: ``{word: id}``; the specials are ``<pad>=0``, ``<start>=1``, ``<end>=2``
  and ``<unk>=3``, then the words in the order they were first seen;
* ``idx2word``: the inverse map, with the ids written as strings (JSON keys);
* ``idx``: the number of ids, which is the embedding-table size. It is read from this
  field, never from ``len(word2idx)`` (the two need not agree, e.g. for NoW).

A caption is encoded as ``[<start>, ids of its words..., <end>]`` after lower-casing
and word tokenisation; a word outside the vocabulary becomes ``<unk>``. A vocabulary
can be built from training captions by keeping the words seen at least ``threshold``
times (SCAN/NCR use 4).

Tokenisation is NLTK's own. SCAN's ``vocab.py`` built the released Flickr30K, COCO and
CC152K vocabularies with ``nltk.tokenize.word_tokenize(caption.lower())`` and NCR's
``data.py`` tokenises raw captions the same way, so any other tokenizer maps some words to
wrong ids or to ``<unk>``. ``nltk.word_tokenize`` splits the text into sentences with
Punkt's English model, then each sentence into words with ``NLTKWordTokenizer`` (which
splits off a period only at the end of its input). This library never downloads data:

* when the Punkt English model (``tokenizers/punkt_tab/english/``, installed by
  ``nltk.download("punkt_tab")``) is on NLTK's data path, ``word_tokenize`` below *is*
  ``nltk.word_tokenize``;
* otherwise the sentences are split by an untrained
  ``nltk.tokenize.punkt.PunktSentenceTokenizer``, which needs no data, and the words by
  the same ``NLTKWordTokenizer``.

The choice is made once per process, on first use, and recorded in the ``source`` of a
vocabulary built by ``build_vocab``. The released vocabularies hold words that only the
English model produces (``mr.``, ``st.``, ``u.s.`` in the middle of a caption), so install
it once (``nltk.download("punkt_tab")``) before encoding raw captions with them. The
untrained Punkt is the closer of the two model-free choices on captions: without any
sentence split, every period ending a sentence inside a caption stays glued to its word
(``a dog. a cat.`` -> ``dog.``, in no released vocabulary). It can still differ from
``nltk.word_tokenize`` with the English model, on lower-cased captions, in these ways:

* An abbreviation that the English model knows (about 150, e.g. ``mr.``, ``mrs.``,
  ``dr.``, ``st.``, ``u.s.``, ``vs.``, ``jr.``, ``a.m.``, ``p.m.``, ``ave.``, ``co.``,
  ``l.a.``, ``d.c.``, ``ph.d.``) in the middle of a text: NLTK keeps it one token, the
  fallback ends a sentence after it and splits off its period (``mr. smith runs`` ->
  ``mr. smith runs`` in NLTK, ``mr . smith runs`` here). At the end of a text both give
  ``mr .``. Periods after words the model does not know as abbreviations (``etc.``,
  ``i.e.``, ``no.``, ``fig.``) end a sentence in both.
* A single letter that the model lists as an abbreviation, followed by a number, bracket
  or quote: ``letter t. 5 dogs`` -> ``t.`` in NLTK, ``t .`` here.
* A number or a single letter with a period, followed by one of the few words that the
  model saw lower-case at the start of a sentence and never capitalised
  (``in 1990. administrators met``): NLTK ends the sentence there (``1990 .``), the
  fallback does not (``1990.``).
* Cased text (``word_tokenize`` called directly; ``tokenize_caption`` lower-cases first):
  the model also weighs how often the next word is capitalised and which words often
  start sentences, so periods before a capitalised word can differ further.

Both keep NLTK's own quirks, which the released vocabularies carry: a number or a single
letter followed by a period and a lower-case word does not end a sentence
(``in 2010. a family`` -> ``2010.``), nor does an ellipsis (``...``). The word rules are
those of the installed NLTK (3.10.2 or later), which have changed since SCAN built its
vocabularies with the NLTK of 2018. The released COCO vocabulary shows two changes: that
NLTK kept an opening single quote on its word (``'no``, ``'stop``; now ``' no``) and two
periods on theirs (``street..``; now ``street ..``).

References:
  Lee et al., "Stacked Cross Attention for Image-Text Matching", ECCV 2018 (SCAN,
  ``vocab.py``). Huang et al., "Learning with Noisy Correspondence for Cross-modal
  Matching", NeurIPS 2021 (NCR, ``data.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)

# Where nltk.word_tokenize finds Punkt's English model (what nltk.download("punkt_tab")
# installs).
_PUNKT_ENGLISH = "tokenizers/punkt_tab/english/"


def _punkt_model_installed() -> bool:
    """Whether Punkt's English model is on NLTK's data path (looked up, never downloaded)."""
    import nltk

    try:
        nltk.data.find(_PUNKT_ENGLISH)
    except LookupError:
        return False
    return True


@functools.cache
def _tokenizer() -> tuple[Callable[[str], list[str]], str]:
    """The word tokenizer in use and a description of it, chosen once per process."""
    # Imported here rather than at the top: importing nltk takes seconds, and importing
    # this module (e.g. only to read a vocabulary file) must stay cheap.
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize import word_tokenize as nltk_word_tokenize
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    if _punkt_model_installed():
        return nltk_word_tokenize, "nltk.word_tokenize with the Punkt English model"
    # nltk.word_tokenize with the untrained Punkt in place of the model it cannot load
    # (see the module docstring for where the two differ).
    logging.warning(
        "NLTK's Punkt English model is not installed: captions are split into sentences by "
        "an untrained Punkt, so abbreviations inside a caption (mr., st., u.s.) lose their "
        "period and map to <unk> with the released vocabularies. Run "
        "python -c \"import nltk; nltk.download('punkt_tab')\" once to match them exactly."
    )
    sentences, words = PunktSentenceTokenizer(), NLTKWordTokenizer()

    def tokenize(text: str) -> list[str]:
        return [
            token for sentence in sentences.tokenize(text) for token in words.tokenize(sentence)
        ]

    return tokenize, "nltk.word_tokenize with an untrained Punkt (no English model installed)"


def word_tokenize(text: str) -> list[str]:
    """Splits ``text`` into words and punctuation as ``nltk.word_tokenize`` does.

    Punctuation becomes tokens of its own (commas and colons inside numbers such as
    ``3,000`` and ``10:30`` stay), double quotes become ````/``''``, and contractions are
    split as in the Penn Treebank: ``don't -> do n't``, ``it's -> it 's``,
    ``cannot -> can not``. Case is kept. Without Punkt's English model installed the
    sentence split differs in the rare cases listed in the module docstring.

    Args:
      text: one caption (one or more sentences).

    Returns:
      The tokens, in order.
    """
    return _tokenizer()[0](text)


def tokenize_caption(caption: str) -> list[str]:
    """The words of a caption as SCAN/NCR see them: ``word_tokenize(caption.lower())``."""
    return word_tokenize(caption.lower())


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A word-to-id map in the SCAN/NCR format.

    Attributes:
      word2idx: ``{word: id}``, with ``<pad>=0`` and ``<start>``, ``<end>`` present.
      size: number of ids (the JSON ``idx`` field): ids lie in ``[0, size)``.
      source: where it came from (a file name, or how it was built).
    """

    word2idx: Mapping[str, int]
    size: int
    source: str = ""

    @property
    def start(self) -> int:
        return self.word2idx[START]

    @property
    def end(self) -> int:
        return self.word2idx[END]

    def __call__(self, word: str) -> int:
        """The id of ``word``; ``<unk>``'s for a word outside the vocabulary."""
        found = self.word2idx.get(word)
        if found is not None:
            return found
        if UNK not in self.word2idx:
            raise ValueError(
                f"Word {word!r} is not in the vocabulary ({self.source or 'no source'}) and "
                "it has no <unk> entry to map unknown words to."
            )
        return self.word2idx[UNK]

    def encode(self, caption: str) -> list[int]:
        """``[<start>, ids of tokenize_caption(caption)..., <end>]``."""
        return [self.start, *(self(w) for w in tokenize_caption(caption)), self.end]

    def to_json(self) -> dict:
        """The SCAN/NCR JSON object (``word2idx``, ``idx2word``, ``idx``)."""
        word2idx = dict(self.word2idx)
        idx2word = {str(i): w for w, i in sorted(word2idx.items(), key=lambda item: item[1])}
        return {"word2idx": word2idx, "idx2word": idx2word, "idx": self.size}


# A split whose caption words are more than this fraction <unk> was probably encoded with a
# vocabulary that does not belong to it (another dataset's, another tokenizer's): a warning
# says so. Captions read with their own release's vocabulary lose only their rare words.
UNK_WARNING_FRACTION = 0.05


def count_unknown(captions: Iterable[Sequence[int]], vocab: Vocabulary) -> tuple[int, int]:
    """``(<unk> tokens, word tokens)`` of encoded captions (``<start>``/``<end>`` not counted).

    Args:
      captions: token ids of each caption, with ``<start>`` and ``<end>``.
      vocab: the vocabulary they were encoded with (no ``<unk>`` entry: nothing is unknown).
    """
    unk = vocab.word2idx.get(UNK)
    specials = {vocab.start, vocab.end}
    unknown = words = 0
    for ids in captions:
        for i in ids:
            if i not in specials:
                words += 1
                unknown += i == unk
    return unknown, words


def check_unknown(counts: Mapping[str, Sequence[int]], source: str, *, warn: bool = True) -> None:
    """Refuses a split whose every word is ``<unk>``; warns about one where more than
    ``UNK_WARNING_FRACTION`` of them are.

    Args:
      counts: ``{split: (<unk> tokens, word tokens)}`` (``count_unknown``).
      source: the vocabulary file (or how the vocabulary was built), named in the messages.
      warn: log the warnings (``False``: only refuse).

    Raises:
      ValueError: a split with words, all of them ``<unk>``.
    """
    for split, (unknown, words) in counts.items():
        if words and unknown == words:
            raise ValueError(
                f"Every one of the {words} words of the {split} captions is <unk> under the "
                f"vocabulary {source}: the captions and the vocabulary do not belong together "
                "(another dataset's or tokenizer's vocabulary file?). Put the release's own "
                "vocabulary file in data.manual_dir."
            )
        if warn and words and unknown > UNK_WARNING_FRACTION * words:
            logging.warning(
                "%d of the %d words (%.1f%%) of the %s captions are <unk> under the vocabulary "
                "%s (more than %g%%): check that it is the release's own vocabulary file.",
                unknown,
                words,
                100.0 * unknown / words,
                split,
                source,
                100 * UNK_WARNING_FRACTION,
            )


def _malformed(path: str, problem: str) -> ValueError:
    return ValueError(
        f"Vocabulary file {path} is malformed: {problem}. Expected the SCAN/NCR JSON layout "
        '{"word2idx": {word: id}, "idx2word": {"id": word}, "idx": number of ids} with '
        '"<pad>": 0, "<start>", "<end>" (and "<unk>" to encode text) in word2idx and every '
        "id in [0, idx)."
    )


def from_json(data, source: str) -> Vocabulary:
    """Checks a decoded SCAN/NCR vocabulary object; ``source`` names it in errors."""
    if not isinstance(data, dict) or "word2idx" not in data or "idx" not in data:
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise _malformed(source, f"it needs the fields word2idx and idx, found {found}")
    word2idx, size = data["word2idx"], data["idx"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise _malformed(source, f"idx must be a positive integer, got {size!r}")
    if not isinstance(word2idx, dict) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in word2idx.values()
    ):
        raise _malformed(source, "word2idx must map words to integer ids")
    bad = [(w, i) for w, i in word2idx.items() if not 0 <= i < size]
    if bad:
        raise _malformed(source, f"{len(bad)} ids lie outside [0, idx={size}), e.g. {bad[0]}")
    missing = [s for s in (PAD, START, END) if s not in word2idx]
    if missing:
        raise _malformed(source, f"word2idx lacks {missing}")
    if word2idx[PAD] != 0:
        raise _malformed(source, f"<pad> has id {word2idx[PAD]}; padding uses id 0")
    return Vocabulary(dict(word2idx), size, source)


def load(path: str | os.PathLike) -> Vocabulary:
    """Reads a SCAN/NCR vocabulary JSON file.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not JSON, or not the layout described in the module docstring.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Vocabulary file {path} does not exist.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _malformed(path, f"it is not valid JSON ({err})") from err
    return from_json(data, os.path.basename(path))


def save(vocab: Vocabulary, path: str | os.PathLike) -> None:
    """Writes ``vocab`` as SCAN/NCR JSON (readable by the original PyTorch code)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(vocab.to_json(), f, ensure_ascii=False)


def build_vocab(captions: Iterable[str], threshold: int = 4) -> Vocabulary:
    """Builds a vocabulary from captions: the words seen at least ``threshold`` times.

    The specials take ids 0-3; the kept words follow in the order they were first seen
    (SCAN's ``build_vocab``, whose counter keeps insertion order), so equal captions give
    an equal vocabulary.

    Args:
      captions: raw captions (lower-cased and tokenised by ``tokenize_caption``).
      threshold: minimum number of occurrences of a kept word (SCAN/NCR: 4).

    Returns:
      The vocabulary, with ``source`` recording the threshold.
    """
    if threshold < 1:
        raise ValueError(f"The vocabulary threshold must be at least 1, got {threshold}.")
    counts = collections.Counter()
    for caption in captions:
        counts.update(tokenize_caption(caption))
    word2idx = {word: i for i, word in enumerate(SPECIALS)}
    for word, count in counts.items():
        if count >= threshold and word not in word2idx:
            word2idx[word] = len(word2idx)
    source = (
        f"built from the training captions, words seen at least {threshold} times, "
        f"tokenised by {_tokenizer()[1]}"
    )
    return Vocabulary(word2idx, len(word2idx), source)
