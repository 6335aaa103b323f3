"""``Multi30k``: a synthetic German-English parallel corpus in Multi30k's shape (see multi30k)."""

from torchtext.datasets import multi30k
from torchtext.datasets.multi30k import Multi30k

__all__ = ["Multi30k", "multi30k"]
