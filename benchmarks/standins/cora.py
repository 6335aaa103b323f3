"""A Cora-shaped citation graph for pytorch/examples' gcn, which downloads the real one.

2,708 papers with 1,433 binary word features in 7 classes and 5,429 citations, as
Cora has; written as ``cora/cora.content`` (id, words, class) and ``cora/cora.cites``
(citing id, cited id), the files gcn's ``load_cora`` reads. A stochastic block model:
80% of citations within a class, and each class uses 120 of the words at 0.06 against
0.008 for the rest. **Not Cora**: the script reaches ~88% test accuracy on it (Cora:
~81%).

    python benchmarks/standins/cora.py FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

PAPERS, WORDS, CLASSES, CITATIONS = 2708, 1433, 7, 5429


def write_cora(folder: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, PAPERS)
    rates = np.full((CLASSES, WORDS), 0.008)
    for c in range(CLASSES):
        rates[c, rng.choice(WORDS, 120, replace=False)] = 0.06
    words = (rng.random((PAPERS, WORDS)) < rates[labels]).astype(int)
    ids = rng.choice(10**6, PAPERS, replace=False)
    out = folder / "cora"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cora.content", "w") as f:
        for i in range(PAPERS):
            f.write(f"{ids[i]}\t" + "\t".join(map(str, words[i])) + f"\tclass_{labels[i]}\n")
    edges: set[tuple[int, int]] = set()
    while len(edges) < CITATIONS:
        a = int(rng.integers(PAPERS))
        within = rng.random() < 0.8
        pool = np.flatnonzero((labels == labels[a]) == within)
        b = int(rng.choice(pool))
        if a != b:
            edges.add((a, b))
    with open(out / "cora.cites", "w") as f:
        for a, b in sorted(edges):
            f.write(f"{ids[a]}\t{ids[b]}\n")


if __name__ == "__main__":
    write_cora(Path(sys.argv[1]))
