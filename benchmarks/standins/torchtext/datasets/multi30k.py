"""A synthetic parallel corpus in Multi30k's shape: **not Multi30k**.

Multi30k (29,000 training pairs of image captions, ~12 words each) cannot be downloaded
here. These pairs are drawn from a small grammar with Zipf-distributed words, seeded:
a German-like source puts its verb at the end of the clause ("der alte hund im park
läuft" shape: determiner, adjective, noun, an optional prepositional phrase, the verb,
an optional second clause after "und"), and the English-like target is its word-by-word
translation in subject-verb-object order, so a model must learn a dictionary and move
the verb: what attention over the source is for. Vocabularies: ~260 words a side.
"""

from __future__ import annotations

import random

# The script overwrites these with mirrors of the real files; nothing is downloaded here.
URL = {"train": "", "valid": "", "test": ""}
SIZES = {"train": 8_000, "valid": 500, "test": 500}
SEED = 0

_DETS = (("der", "the"), ("die", "the"), ("das", "the"), ("ein", "a"), ("eine", "a"))
_CLASSES = {"adj": 40, "noun": 150, "verb": 50, "prep": 8}


def _lexicon() -> dict[str, list[tuple[str, str]]]:
    """Per word class, (source, target) word pairs: a fixed bijective dictionary."""
    return {c: [(f"{c[0]}{i}x", f"{c[0]}{i}") for i in range(n)] for c, n in _CLASSES.items()}


def _zipf(rng: random.Random, words: list[tuple[str, str]]) -> tuple[str, str]:
    # Word frequencies as in text: the k-th word is drawn in proportion to 1 / (k + 1).
    return rng.choices(words, weights=[1.0 / (k + 1) for k in range(len(words))])[0]


def _phrase(rng: random.Random, lex: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    words = [rng.choice(_DETS)]
    if rng.random() < 0.5:
        words.append(_zipf(rng, lex["adj"]))
    words.append(_zipf(rng, lex["noun"]))
    return words


def _clause(rng: random.Random, lex: dict[str, list[tuple[str, str]]]) -> tuple[str, str]:
    subject = _phrase(rng, lex)
    extra = [_zipf(rng, lex["prep"]), *_phrase(rng, lex)] if rng.random() < 0.6 else []
    verb = _zipf(rng, lex["verb"])
    source = [w for w, _ in subject + extra] + [verb[0]]
    target = [t for _, t in subject] + [verb[1]] + [t for _, t in extra]
    return " ".join(source), " ".join(target)


def _pairs(split: str) -> list[tuple[str, str]]:
    rng = random.Random(f"{SEED}-{split}")
    lex = _lexicon()
    pairs = []
    for _ in range(SIZES[split]):
        source, target = _clause(rng, lex)
        if rng.random() < 0.3:
            more = _clause(rng, lex)
            source, target = f"{source} und {more[0]}", f"{target} and {more[1]}"
        pairs.append((f"{source} .\n", f"{target} .\n"))
    return pairs


# torchtext's name, as the script imports it.
def Multi30k(
    root: str = ".data", split: str = "train", language_pair: tuple[str, str] = ("de", "en")
) -> list[tuple[str, str]]:
    """The split's (source, target) sentence pairs, each ending in a newline as the files do."""
    del root
    pairs = _pairs(split)
    if tuple(language_pair) == ("en", "de"):
        pairs = [(t, s) for s, t in pairs]
    return pairs
