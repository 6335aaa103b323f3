"""What an activation hook allocates is bounded by its sample, never by the output's size.

The hooks measure outputs of any layout: a GELU of a transposed input keeps the
transposed strides, a channels-last convolution's output is permuted, a module's input
(``activation_modules``) may be a slice, and a softmax may run along any dim. A
``reshape`` of such an output copied all of it on every hooked module of a cadence
step; the bound is ``activations.hook_transient_bytes()`` (docs/agent-cost.md).
Allocations are read with the torch profiler (CPU tensors), as in test_agent_memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_agent_memory import allocated  # tests/agent is on sys.path (rootdir-less import)
from torch import nn

from gradwatch.agent import activations
from gradwatch.agent.activations import ActHooks, hook_transient_bytes

B, T, C = 8, 128, 4096  # a 16 MiB float32 output: a copy of it exceeds the bound


def _transposed() -> torch.Tensor:
    return torch.randn(B, C, T).transpose(1, 2)


def _sliced(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(B, T, 2 * C, dtype=dtype)[:, :, :C]


def _channels_last() -> torch.Tensor:
    return torch.randn(B, C // 8, T, 8).to(memory_format=torch.channels_last)


OUTPUTS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "contiguous": (nn.GELU, lambda: torch.randn(B, T, C)),
    "transposed": (nn.Tanh, _transposed),
    "sliced": (nn.GELU, _sliced),
    "sliced bf16": (nn.SiLU, lambda: _sliced(torch.bfloat16)),
    "channels-last": (nn.ReLU, _channels_last),
    "softmax, dim 1 of 4": (lambda: nn.Softmax(dim=1), lambda: torch.randn(B, 32, T, T)),
    "softmax, a sliced last dim": (lambda: nn.Softmax(dim=-1), lambda: _sliced()),
}


def hook_of(module: nn.Module) -> tuple[ActHooks, Callable[..., None]]:
    hooks = ActHooks.attach(nn.Sequential(module), torch.device("cpu"), on_error=None)
    assert hooks is not None
    hooks.arm()
    (hook,) = module._forward_hooks.values()
    return hooks, hook


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_a_hook_allocates_at_most_its_bound_and_keeps_nothing(name: str) -> None:
    make_module, make_output = OUTPUTS[name]
    module, y = make_module(), make_output()
    hooks, hook = hook_of(module)
    width = y.shape[module.dim] if isinstance(module, nn.Softmax) else 0
    bound = hook_transient_bytes(width)
    rows = y.movedim(module.dim, -1) if isinstance(module, nn.Softmax) else y
    assert rows.is_contiguous() == (name == "contiguous")  # the other paths are exercised
    assert y.numel() * y.element_size() > 3 * bound  # a copy of the output cannot pass
    _, peak, live = allocated(lambda: hook(module, (y,), y))
    assert peak <= bound, f"{name}: the hook allocated {peak} bytes, bound {bound}"
    assert live == 0  # nothing outlives the hook (the values vector existed before)
    assert not hooks.export().values().isnan().any()  # measured, not skipped
    hooks.disarm()


def measured(module: nn.Module, y: torch.Tensor) -> list[float]:
    hooks, hook = hook_of(module)
    hook(module, (y,), y)
    values = hooks.export().values().tolist()
    hooks.disarm()
    return values


def test_a_pre_activation_hook_stays_within_the_bound() -> None:
    # activation_modules={"*.w1": "pre:silu"}: the sample goes through the SiLU first.
    gate = nn.Linear(4, 4)
    hooks = ActHooks.attach(
        nn.Sequential(gate), torch.device("cpu"), on_error=None, inputs={"0": "pre:silu"}
    )
    assert hooks is not None
    hooks.arm()
    (hook,) = gate._forward_hooks.values()
    y = _sliced(torch.bfloat16)  # the gathered path, and a cast
    _, peak, live = allocated(lambda: hook(gate, (y,), y))
    assert peak <= hook_transient_bytes() and live == 0, peak
    hooks.disarm()


@pytest.mark.parametrize("name", ["sliced", "softmax, dim 1 of 4"])
def test_a_gathered_sample_is_the_contiguous_copys_sample(name: str) -> None:
    make_module, make_output = OUTPUTS[name]
    module, y = make_module(), make_output()
    if isinstance(module, nn.Softmax):  # the same rows, laid out with dim last
        dense, dense_module = y.movedim(module.dim, -1).contiguous(), nn.Softmax(dim=-1)
    else:
        dense, dense_module = y.contiguous(), make_module()
    expected = measured(dense_module, dense)
    assert measured(module, y) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_the_bound_is_the_sample_not_the_output() -> None:
    per = activations.HOOK_BYTES_PER_SAMPLED
    assert hook_transient_bytes() == per * (activations.SAMPLE + 1)  # elementwise
    assert hook_transient_bytes(128) == per * (activations.ROW_SAMPLE + 1 + 128)  # softmax rows
    assert hook_transient_bytes() < 400 << 10 and hook_transient_bytes(4096) < 3 << 20
