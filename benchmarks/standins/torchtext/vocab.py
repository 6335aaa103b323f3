"""``build_vocab_from_iterator`` and the ``Vocab`` it returns, as torchtext 0.17 behaves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class Vocab:
    """Token <-> index, specials first; unknown tokens map to the default index once set."""

    def __init__(self, tokens: list[str]) -> None:
        self._itos = tokens
        self._stoi = {t: i for i, t in enumerate(tokens)}
        self._default: int | None = None

    def set_default_index(self, index: int) -> None:
        self._default = index

    def __len__(self) -> int:
        return len(self._itos)

    def __getitem__(self, token: str) -> int:
        if token in self._stoi:
            return self._stoi[token]
        if self._default is None:
            raise RuntimeError(f"token {token!r} not found and no default index is set")
        return self._default

    def __call__(self, tokens: list[str]) -> list[int]:
        return [self[t] for t in tokens]

    def lookup_tokens(self, indices: list[int]) -> list[str]:
        return [self._itos[i] for i in indices]


def build_vocab_from_iterator(
    iterator: Iterable[list[str]],
    min_freq: int = 1,
    specials: list[str] | None = None,
    special_first: bool = True,
) -> Vocab:
    """Tokens by falling frequency (ties in first-seen order), those under ``min_freq`` out."""
    counts: Counter[str] = Counter()
    for tokens in iterator:
        counts.update(tokens)
    specials = list(specials or [])
    words = [t for t, c in counts.most_common() if c >= min_freq and t not in specials]
    return Vocab(specials + words if special_first else words + specials)
