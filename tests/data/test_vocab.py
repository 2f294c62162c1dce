"""Tests for ncljax.data.vocab.

Oracles: token lists written by hand from the rules of NLTK's ``word_tokenize`` and of its
Punkt sentence splitter (the outputs NLTK 3.10.2+ gives for these texts; the lower-cased
captions were checked once against ``nltk.word_tokenize`` with the tables of Punkt's
English model, which no test needs), hand-written SCAN/NCR vocabulary files, and word
counts done by hand for ``build_vocab``.

The tokenizer runs in one of two modes: ``nltk.word_tokenize`` itself when Punkt's English
model is installed, otherwise NLTK's word tokenizer after an untrained Punkt. The
``tokenizer`` fixture runs a test in each mode; the model mode is skipped where the model
is not installed (it is never downloaded).
"""

import json
import re
import socket
import subprocess
import sys
import warnings

import nltk
import pytest

from ncljax.data import vocab as vocab_lib

MODEL, FALLBACK = "punkt_model", "untrained_punkt"


@pytest.fixture(params=[MODEL, FALLBACK])
def tokenizer(request, monkeypatch):
    """Selects the tokenizer mode for one test; yields its name."""
    if request.param == MODEL:
        if not vocab_lib._punkt_model_installed():
            pytest.skip("Punkt's English model (nltk punkt_tab) is not installed")
    else:
        monkeypatch.setattr(vocab_lib, "_punkt_model_installed", lambda: False)
    vocab_lib._tokenizer.cache_clear()  # the mode is chosen once per process
    yield request.param
    vocab_lib._tokenizer.cache_clear()


# (text, what nltk.word_tokenize returns for it)
NLTK_CASES = [
    (
        "Two young guys with shaggy hair look at their hands while hanging out in the yard.",
        "Two young guys with shaggy hair look at their hands while hanging out in the yard .",
    ),
    (
        "A man's dog doesn't bark; it's \"quiet\" (mostly)!",
        "A man 's dog does n't bark ; it 's `` quiet '' ( mostly ) !",
    ),
    (
        "We're here, they've 3,000 dogs at 10:30... ok",
        "We 're here , they 've 3,000 dogs at 10:30 ... ok",
    ),
    ("I cannot go. You gonna come?", "I can not go . You gon na come ?"),
    ("the dogs' toys", "the dogs ' toys"),
    ("'hello' she said", "' hello ' she said"),
    ("i'm sure he'd say i'll go", "i 'm sure he 'd say i 'll go"),
    ("a dog. a cat.", "a dog . a cat ."),
    ("a man -- tall [or short]: {x} <y>", "a man -- tall [ or short ] : { x } < y >"),
    ("cost $5 & 50% off #1 @home *wow*", "cost $ 5 & 50 % off # 1 @ home * wow *"),
    ('he said "hi" and left', "he said `` hi '' and left"),
    ("wanna gimme that, lemme see; gotta go", "wan na gim me that , lem me see ; got ta go"),
    ("a   man\tin\nred", "a man in red"),
    ("IT'S WHAT WE'VE SEEN, DON'T YOU THINK", "IT 'S WHAT WE 'VE SEEN , DO N'T YOU THINK"),
    ("Cannot go", "Can not go"),
    ("", ""),
]


@pytest.mark.parametrize(("text", "expected"), NLTK_CASES)
def test_word_tokenize_follows_nltk(tokenizer, text, expected):
    assert vocab_lib.word_tokenize(text) == expected.split()


# (raw caption, what nltk.word_tokenize returns for it lower-cased, as SCAN builds its
# vocabularies); the sentence split agrees with and without Punkt's English model.
TRICKY_CAPTIONS = [
    # Two sentences: the first one's period is split off too.
    (
        "A man in a blue shirt is standing on a ladder. He is cleaning windows.",
        "a man in a blue shirt is standing on a ladder . he is cleaning windows .",
    ),
    (
        "A woman wearing a hat.\nA man wearing a coat.",
        "a woman wearing a hat . a man wearing a coat .",
    ),
    ("What is the man doing? He is jumping!", "what is the man doing ? he is jumping !"),
    # No space after the period: no sentence break, the period stays inside the word.
    ("A dog runs on the beach.The sun sets.", "a dog runs on the beach.the sun sets ."),
    # Ellipses are one token and end no sentence.
    ("A man... sitting on a bench", "a man ... sitting on a bench"),
    ("A cat sleeping on a couch...", "a cat sleeping on a couch ..."),
    # Numbers keep their inner punctuation; currency, percent, hash, at are split.
    (
        "The clock shows 10:30, the sign says $3.50; 3,000 people watch.",
        "the clock shows 10:30 , the sign says $ 3.50 ; 3,000 people watch .",
    ),
    (
        "A 3.5 inch disk, 50% off #1 @home *wow* & more",
        "a 3.5 inch disk , 50 % off # 1 @ home * wow * & more",
    ),
    # NLTK's quirk: a number before a period and a lower-case word ends no sentence.
    ("A photo taken in 2010. A family poses.", "a photo taken in 2010. a family poses ."),
    # Contractions and possessives.
    (
        "A boy doesn't want it: it's his sister's, they're sure we'll see and I'd go.",
        "a boy does n't want it : it 's his sister 's , they 're sure we 'll see and i 'd go .",
    ),
    ("The dogs' toys are on the floor", "the dogs ' toys are on the floor"),
    ("Gonna go there, wanna come? I cannot.", "gon na go there , wan na come ? i can not ."),
    # Quotes: double quotes become `` and '', single quotes are split off.
    ('A woman says "cheese" to the camera.', "a woman says `` cheese '' to the camera ."),
    (
        'The man said, "I\'m going home." Then he left.',
        "the man said , `` i 'm going home . '' then he left .",
    ),
    ("A sign reading 'no parking' on a pole.", "a sign reading ' no parking ' on a pole ."),
    ("A girl with a sign: 'Will work for food.'", "a girl with a sign : ' will work for food . '"),
    ("A \u201cno smoking\u201d sign", "a \u201c no smoking \u201d sign"),
    # Hyphens stay inside words; double hyphens, dashes and brackets are split.
    (
        "A man in a t-shirt -- tall and thin -- (wearing pink) [sic] {x} <y>",
        "a man in a t-shirt -- tall and thin -- ( wearing pink ) [ sic ] { x } < y >",
    ),
    ("A dog\u2014a big one\u2014running", "a dog \u2014 a big one \u2014 running"),
    ("A boy (age 5.) is playing", "a boy ( age 5 . ) is playing"),
    # Abbreviations: at the end of a caption the period is split off; words that Punkt's
    # English model does not know as abbreviations end a sentence anywhere.
    ("A soldier in the U.S.", "a soldier in the u.s ."),
    ("A street sign for Main St.", "a street sign for main st ."),
    ("Two planes, i.e. jets, fly overhead.", "two planes , i.e . jets , fly overhead ."),
    (
        "A box labeled etc. on a shelf, no. 5 on the left.",
        "a box labeled etc . on a shelf , no . 5 on the left .",
    ),
]


@pytest.mark.parametrize(("caption", "expected"), TRICKY_CAPTIONS)
def test_tokenizer_matches_nltk_on_tricky_captions(tokenizer, caption, expected):
    assert vocab_lib.tokenize_caption(caption) == expected.split()


# (raw caption, nltk.word_tokenize with Punkt's English model, the untrained fallback):
# the differences listed in the module docstring.
WHERE_THE_FALLBACK_DIFFERS = [
    ("In the U.S. today", "in the u.s. today", "in the u.s . today"),
    (
        "Mr. Smith is giving a speech.",
        "mr. smith is giving a speech .",
        "mr . smith is giving a speech .",
    ),
    (
        "A parade on St. Patrick's Day",
        "a parade on st. patrick 's day",
        "a parade on st . patrick 's day",
    ),
    (
        "Players from the U.S. vs. Canada game at 9 p.m. shake hands.",
        "players from the u.s. vs. canada game at 9 p.m. shake hands .",
        "players from the u.s . vs . canada game at 9 p.m . shake hands .",
    ),
    ("The letter t. 5 times", "the letter t. 5 times", "the letter t . 5 times"),
    ("In 1990. administrators met", "in 1990 . administrators met", "in 1990. administrators met"),
]


@pytest.mark.parametrize(("caption", "with_model", "fallback"), WHERE_THE_FALLBACK_DIFFERS)
def test_where_the_fallback_differs_from_the_punkt_model(tokenizer, caption, with_model, fallback):
    expected = with_model if tokenizer == MODEL else fallback
    assert vocab_lib.tokenize_caption(caption) == expected.split()


def test_the_punkt_model_is_looked_up_on_nltks_data_path(tmp_path, monkeypatch):
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    vocab_lib._tokenizer.cache_clear()
    try:
        assert not vocab_lib._punkt_model_installed()
        assert "untrained Punkt" in vocab_lib._tokenizer()[1]
        # An installed model (only its folder is looked for) makes it nltk's own function.
        (tmp_path / "tokenizers" / "punkt_tab" / "english").mkdir(parents=True)
        assert vocab_lib._punkt_model_installed()
        vocab_lib._tokenizer.cache_clear()
        assert vocab_lib._tokenizer()[0] is nltk.tokenize.word_tokenize
    finally:
        vocab_lib._tokenizer.cache_clear()


def test_tokenizing_never_downloads_nor_warns(tokenizer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenizing tried to download or to connect")

    monkeypatch.setattr(nltk, "download", refuse)
    monkeypatch.setattr(nltk.downloader.Downloader, "download", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert vocab_lib.tokenize_caption("A dog. Mr. Smith's cat!") == (
            ["a", "dog", ".", "mr.", "smith", "'s", "cat", "!"]
            if tokenizer == MODEL
            else ["a", "dog", ".", "mr", ".", "smith", "'s", "cat", "!"]
        )


def test_importing_the_module_loads_no_nltk_and_prints_nothing():
    code = "import sys, ncljax.data.vocab; print('nltk' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "False\n", "")


def test_tokenize_caption_lower_cases(tokenizer):
    assert vocab_lib.tokenize_caption("A Dog RUNS.") == ["a", "dog", "runs", "."]


def scan_vocab(words, idx=None):
    word2idx = {w: i for i, w in enumerate(["<pad>", "<start>", "<end>", "<unk>", *words])}
    return {
        "word2idx": word2idx,
        "idx2word": {str(i): w for w, i in word2idx.items()},
        "idx": len(word2idx) if idx is None else idx,
    }


def test_load_reads_the_scan_layout_and_size_from_idx(tmp_path):
    path = tmp_path / "f30k_precomp_vocab.json"
    path.write_text(json.dumps(scan_vocab(["a", "dog", "."], idx=10)))
    vocab = vocab_lib.load(path)
    assert vocab.size == 10  # the idx field, not len(word2idx) == 7
    assert vocab.word2idx["dog"] == 5
    assert (vocab.start, vocab.end) == (1, 2)
    assert vocab.source == "f30k_precomp_vocab.json"
    # <start> a dog . <end>, then an unknown word maps to <unk> = 3
    assert vocab.encode("A dog.") == [1, 4, 5, 6, 2]
    assert vocab.encode("A cat.") == [1, 4, 3, 6, 2]
    assert vocab.encode("") == [1, 2]


def test_save_load_round_trip_in_scan_format(tmp_path):
    vocab = vocab_lib.build_vocab(["a dog", "a cat", "a dog ."], threshold=1)
    path = tmp_path / "v.json"
    vocab_lib.save(vocab, path)
    data = json.loads(path.read_text())
    assert data == scan_vocab(["a", "dog", "cat", "."])
    loaded = vocab_lib.load(path)
    assert dict(loaded.word2idx) == dict(vocab.word2idx)
    assert loaded.size == vocab.size == 8


def test_build_vocab_keeps_words_seen_threshold_times_in_first_seen_order():
    captions = ["A dog runs.", "a cat sits", "a dog sits", "The dog runs", "a dog", "cat!"]
    # counts: a 4, dog 4, runs 2, . 1, cat 2, sits 2, the 1, ! 1
    vocab = vocab_lib.build_vocab(captions, threshold=4)
    assert dict(vocab.word2idx) == {
        "<pad>": 0,
        "<start>": 1,
        "<end>": 2,
        "<unk>": 3,
        "a": 4,
        "dog": 5,
    }
    assert vocab.size == 6
    assert "4 times" in vocab.source
    assert "tokenised by nltk.word_tokenize" in vocab.source
    vocab2 = vocab_lib.build_vocab(captions, threshold=2)
    assert list(vocab2.word2idx)[4:] == ["a", "dog", "runs", "cat", "sits"]
    assert vocab2.encode("the cat runs") == [1, 3, 7, 6, 2]
    assert dict(vocab_lib.build_vocab(reversed(captions), 2).word2idx) != dict(vocab2.word2idx)
    assert vocab_lib.build_vocab(captions, 2) == vocab2  # deterministic
    with pytest.raises(ValueError, match="at least 1"):
        vocab_lib.build_vocab(captions, threshold=0)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"word2idx": {"<pad>": 0}}, "word2idx and idx"),
        ([1, 2], "word2idx and idx"),
        ({**scan_vocab([]), "idx": 0}, "positive integer"),
        ({**scan_vocab(["a"]), "idx": 4}, "outside [0, idx=4)"),
        ({"word2idx": {"<pad>": 1, "<start>": 0, "<end>": 2}, "idx": 3}, "padding uses id 0"),
        ({"word2idx": {"<pad>": 0, "<end>": 2}, "idx": 3}, "lacks ['<start>']"),
        ({"word2idx": {"<pad>": "0"}, "idx": 3}, "integer ids"),
    ],
)
def test_malformed_vocabulary_files_are_refused(tmp_path, data, expected):
    path = tmp_path / "coco_precomp_vocab.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        vocab_lib.load(path)
    message = str(info.value)
    assert str(path) in message or path.name in message
    assert expected in message
    assert "word2idx" in message  # states the expected layout


def test_missing_and_non_json_vocabulary_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("nowhere.json")):
        vocab_lib.load(tmp_path / "nowhere.json")
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        vocab_lib.load(path)


def test_unknown_word_without_unk_entry_is_an_error():
    vocab = vocab_lib.Vocabulary({"<pad>": 0, "<start>": 1, "<end>": 2}, 3, "now vocab")
    with pytest.raises(ValueError, match="no <unk>"):
        vocab.encode("hello")
