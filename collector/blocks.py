"""Group per-parameter gradient norms into blocks, a bounded unit for metrics.

A 70B model has ~700 parameter tensors but ~80 transformer blocks; one series
per block stays small enough for Prometheus at any scale, and a block's norm
(root of the sum of squares of its tensors' norms) is the norm of all its
gradients taken together, so nothing is averaged away. A non-finite tensor
makes its block non-finite (NaN beats Inf, as in the sum), so an offender is
never hidden by the aggregation.

Example::

    import numpy as np
    from gradwatch.collector.blocks import block_norms

    names, values = block_norms(
        ("model.layers.0.q.weight", "model.layers.0.k.weight", "lm_head.weight"),
        np.array([3.0, 4.0, 1.0]))
    assert names == ("model.layers.0", "lm_head") and values.tolist() == [5.0, 1.0]
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from gradwatch.rules.ratio import group_layers, group_norms, module_of


def block_of(layer: str) -> str:
    """The block a parameter belongs to: its name cut after the first numeric component.

    A name with no numeric component (embeddings, final norm, head) groups by
    its module: the name without its last component, so ``model.embed_tokens``
    and ``model.norm`` stay apart; a bare parameter name is its own block.

    Example::

        >>> block_of("model.layers.12.mlp.up_proj.weight")
        'model.layers.12'
        >>> block_of("transformer.h.3.attn.c_attn.weight")
        'transformer.h.3'
        >>> block_of("embed_tokens.weight")
        'embed_tokens'
        >>> block_of("lm_head.weight")
        'lm_head'
        >>> block_of("model.norm.weight")
        'model.norm'
    """
    parts = layer.split(".")
    for i, part in enumerate(parts):
        # isascii: str.isdigit also accepts characters like "²", never a module index.
        if part.isascii() and part.isdigit():
            return ".".join(parts[: i + 1])
    return module_of(layer) or layer


@lru_cache(maxsize=64)
def group_blocks(layers: tuple[str, ...]) -> tuple[np.ndarray, tuple[str, ...]]:
    """Each layer's block index, and the block names in model order (first appearance).

    Cached: a job's layer names are the same tuple scrape after scrape, and
    splitting hundreds of names on every scrape would be wasted work.
    """
    inverse, names, _ = group_layers(layers, key=block_of)
    inverse.setflags(write=False)  # shared between scrapes through the cache
    return inverse, tuple(names)


def block_norms(layers: tuple[str, ...], norms: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """Block names in model order and each block's L2 norm, sqrt(sum of squared layer norms).

    ``norms`` must be aligned with ``layers``; a ``ValueError`` says so when not.
    """
    if len(layers) != norms.size:
        raise ValueError(
            f"{len(layers)} layer names but {norms.size} norms; "
            "pass the norms of the same step as the names"
        )
    inverse, names = group_blocks(layers)
    return names, group_norms(inverse, norms, len(names))
