"""What the cadence-statistics detector tests share: a ``Stats`` record builder and layer names.

``stats`` builds one sample of a two-layer model (``LAYERS``); ``DEEP`` names the
parameters of a six-block transformer-like stack for the tests that need depth.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradwatch.rules.step import ActStats, Stats

LAYERS = ("0.weight", "0.bias", "1.weight", "1.bias")


def stats(
    t: int,
    *,
    act: Sequence[ActStats] = (),
    weights: Sequence[float] | None = None,
    ratios: Sequence[float] | None = None,
) -> Stats:
    return Stats(
        job="j",
        step=t,
        time=float(t),
        layers=LAYERS,
        act=tuple(act),
        weight_norms=None if weights is None else np.asarray(weights, dtype=float),
        update_ratios=None if ratios is None else np.asarray(ratios, dtype=float),
    )


DEEP = tuple(f"h.{i}.{kind}" for i in range(6) for kind in ("weight", "bias")) + ("ln_f.weight",)
