"""Parameter roles: the agent's when sent, else guessed from names by convention."""

from __future__ import annotations

import pytest

from gradwatch.rules.roles import guess_role, roles_of


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("transformer.h.0.ln_1.weight", "norm"),
        ("transformer.ln_f.weight", "norm"),
        ("model.layers.3.input_layernorm.weight", "norm"),
        ("bert.embeddings.LayerNorm.bias", "norm"),
        ("layer1.0.bn1.weight", "norm"),
        ("blocks.2.norm1.weight", "norm"),
        ("0.bias", "bias"),
        ("transformer.h.0.attn.c_attn.bias", "bias"),
        ("transformer.wte.weight", "embedding"),  # tied to lm_head: names cannot tell
        ("model.embed_tokens.weight", "embedding"),
        ("bert.embeddings.word_embeddings.weight", "embedding"),
        ("transformer.h.0.attn.c_attn.weight", "weight"),
        ("layers.0.linear.weight", "weight"),
        ("lm_head.weight", "weight"),
        ("conv1.weight", "weight"),
    ],
)
def test_guess_role_by_convention(name: str, role: str) -> None:
    assert guess_role(name) == role


def test_sent_roles_win_when_aligned() -> None:
    layers = ("transformer.wte.weight", "transformer.ln_f.weight")
    assert roles_of(layers, ("tied", "norm")) == ("tied", "norm")
    assert roles_of(layers, ("tied",)) == ("embedding", "norm")  # misaligned: guessed
    assert roles_of(layers, ("tied", "mystery")) == ("tied", "other")
