"""What each parameter is, so rules compare like with like (CONTRACTS C1).

The agent sends ``layer_roles`` aligned with ``layers``: ``"weight"`` (a
matrix of a linear, convolution or attention projection), ``"embedding"`` (an
``nn.Embedding`` weight used once), ``"tied"`` (one tensor used by several
modules, e.g. a token embedding tied to the LM head), ``"norm"`` (gain or bias
of a normalisation layer), ``"bias"`` and ``"other"``. Older agents and
imported logs send none; then the role is guessed from the name, which can
tell biases, normalisation layers and embeddings by convention but cannot see
a tie: a tied ``transformer.wte.weight`` reads as an embedding.

Why it matters: a normalisation gain's gradient and a tied embedding's (the
sum of two uses) do not scale with depth, so a first/last-layer ratio or a
per-layer comparison that includes them drifts in healthy training (nanoGPT
with tied embeddings: first = token embedding, last = final LayerNorm gain,
the ratio drifts from 17 to over 100 while the run is fine).

Example::

    roles_of(("embed.weight", "blocks.0.ln_1.weight", "blocks.0.attn.weight"), ())
    # ("embedding", "norm", "weight")
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gradwatch.wire.census import ROLES

# Module-name conventions of torch, timm, Hugging Face and nanoGPT-style code.
_NORM = re.compile(r"(norm|^ln(_?\w+|\d*)$|^bn\d*$|^gn\d*$|^layer_?norm|^rms)", re.IGNORECASE)
_EMBED = re.compile(r"(embed|^wte$|^wpe$|^tok_?emb|^pos_?emb|^shared$)", re.IGNORECASE)


def guess_role(name: str) -> str:
    """A parameter's role from its name alone (see the module docstring for the limits)."""
    parts = name.split(".")
    leaf, modules = parts[-1], parts[:-1]
    if any(_NORM.search(part) for part in modules):
        return "norm"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "bias"
    if any(_EMBED.search(part) for part in modules) or _EMBED.search(leaf):
        return "embedding"
    return "weight"


def roles_of(layers: Sequence[str], sent: Sequence[str]) -> tuple[str, ...]:
    """The roles the agent sent when they match ``layers``, else guessed from the names."""
    if len(sent) == len(layers) and sent:
        return tuple(role if role in ROLES else "other" for role in sent)
    return tuple(guess_role(name) for name in layers)
