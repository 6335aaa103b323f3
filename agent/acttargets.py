"""Which modules of a model the activation hooks measure, and as which family.

:func:`find_targets` walks ``named_modules()`` once, at attach: nonlinearity modules by
class (torch's, and Hugging Face's by class name), the modules named in
``watch(activation_modules=...)`` (their input, or with ``pre:`` their output, passed
through the activation), and the functional ReLU or GELU inside torch's own
``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``, which no module holds.
Kept apart from agent/activations.py, which hooks what this finds and owns the buffer
the statistics land in.

Example::

    >>> import torch
    >>> from gradwatch.agent.acttargets import find_targets
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16)  # a functional ReLU
    >>> [t.name for t in find_targets(torch.nn.Sequential(layer))]
    ['0.linear1:pre']
"""

from __future__ import annotations

import fnmatch
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from gradwatch.agent.actsample import PRE, PRE_KINDS
from gradwatch.wire import columns as wc

logger = logging.getLogger(__name__)

# The families a name in ``activation_modules`` may give (ActStats.kind).
KINDS = ("relu", "relu6", "tanh", "sigmoid", "gelu", "silu", "softmax")
INPUT_SUFFIX = ":input"
PRE_SUFFIX = ":pre"

_COMPILED_PREFIX = "_orig_mod."
# Hugging Face and other libraries write their own activation classes (GELUActivation,
# NewGELUActivation, PytorchGELUTanh, SiLUActivation...): recognised by class name.
# The names of gated blocks (SwiGLU, GeGLU) do not match: their output is a product.
_GELU_CLASS = re.compile(r"gelu(activation|tanh)?$", re.IGNORECASE)
_SILU_CLASS = re.compile(r"(silu|swish)(activation)?$", re.IGNORECASE)


def kind_of(module: nn.Module) -> str | None:
    """The nonlinearity family ``ActStats.kind`` names, or None when not measured."""
    if isinstance(module, nn.ReLU6):  # a Hardtanh, not a ReLU, in torch
        return "relu6"
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.Tanh):
        return "tanh"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.Softmax):
        return "softmax"
    if isinstance(module, nn.LeakyReLU):
        return "other"  # few exact zeros by design: mean and std only
    name = type(module).__name__
    if isinstance(module, nn.GELU) or _GELU_CLASS.search(name):
        return "gelu"
    if isinstance(module, nn.SiLU) or _SILU_CLASS.search(name):
        return "silu"
    return None


def frac_stat(kind: str) -> str | None:
    if kind in ("relu", "relu6", "gelu", "silu"):
        return wc.ACT_ZERO_FRAC
    if kind in ("tanh", "sigmoid", "softmax"):
        return wc.ACT_SAT_FRAC
    return None


def check_activation_modules(spec: object) -> tuple[tuple[str, str], ...]:
    """``watch(activation_modules=...)`` as (pattern, kind) pairs; ValueError for a bad kind.

    ``spec`` is typed ``Mapping[str, str] | None`` in ``watch()``; checked here whatever it is.
    """
    if not spec:
        return ()
    if not isinstance(spec, Mapping):
        raise ValueError(
            "activation_modules must map module names (fnmatch patterns) to an "
            f"activation kind, e.g. {{'*.mlp.c_proj': 'gelu'}}; got {type(spec).__name__}"
        )
    out = []
    for pattern, kind in spec.items():
        if not isinstance(pattern, str) or not pattern or kind not in KINDS + PRE_KINDS:
            raise ValueError(
                f"activation_modules[{pattern!r}] = {kind!r}: the key must be a "
                f"module name or pattern and the value one of {', '.join(KINDS)} (its input "
                f"is that activation's output), or {', '.join(PRE_KINDS)} (its output is "
                "what that activation takes, e.g. the gate of a SwiGLU)"
            )
        out.append((pattern, kind))
    return tuple(out)


def is_compiled(model: nn.Module) -> bool:
    """True for a ``torch.compile`` result or a module compiled in place (``.compile()``).

    Looked up in ``sys.modules``: a model can only be an ``OptimizedModule``
    once torch.compile has imported it, and importing dynamo here would cost
    a second at every ``watch()``.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_type = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(compiled_type, type) and isinstance(model, compiled_type):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@dataclass(frozen=True, slots=True)
class Target:
    """One measured tensor: a module's output, or (``on_input``) its first input."""

    name: str
    kind: str
    module: nn.Module
    on_input: bool = False
    pre: bool = False  # its output is the activation's input (actsample.PRE)


# What squashes a model's output into a range: probabilities, pixels in [-1, 1].
_OUTPUT_KINDS = frozenset({"sigmoid", "tanh", "softmax"})


def builtin_block_activation(module: nn.Module) -> tuple[nn.Module, str] | None:
    """torch's own ``nn.TransformerEncoderLayer``/``DecoderLayer`` with a functional ReLU or
    GELU (their default, and ``activation="gelu"``): the ``linear1`` whose output it takes,
    and its kind. No module holds that activation, and ``linear2`` takes it only after
    dropout, so the pre-activation is measured (``pre:``); an activation given as a module
    is a child the scan finds by itself."""
    if not isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return None
    act = getattr(module, "activation", None)
    linear1 = getattr(module, "linear1", None)
    if not isinstance(linear1, nn.Module):
        return None
    if act is F.relu:
        return linear1, "relu"
    if act is F.gelu:
        return linear1, "gelu"
    return None


def find_targets(model: nn.Module, inputs: Mapping[str, str] | None = None) -> list[Target]:
    """The modules to hook, in model order: nonlinearity modules, then the named inputs.

    The functional ReLU or GELU inside torch's own Transformer layers is measured without
    being named, as ``<layer>.linear1:pre`` (:func:`builtin_block_activation`); a pattern
    in ``inputs`` that matches that ``linear1`` takes its place.

    A sigmoid, tanh or softmax registered after every module that holds parameters is
    the model's output activation (``nn.Sequential(..., nn.Linear(64, 1), nn.Sigmoid())``,
    DCGAN's generator ending in ``nn.Tanh``): not measured. Its outputs near their bounds
    are a confident model, not units that pass no gradient (BCELoss undoes the sigmoid's
    slope); healthy ones paged ``ActivationsSaturated`` (benchmarks/healthy_patterns.py:
    a binary classifier at step 63, an autoencoder at 285). A
    ReLU registered last stays: ``self.relu = nn.ReLU()`` after the layers is usually
    the hidden activation, reused.
    """
    patterns = check_activation_modules(inputs)
    found: list[Target] = []
    matched: set[str] = set()
    # Squashing nonlinearities since the last module with parameters (None: none yet).
    output_side: list[Target] | None = None
    # The linear1 of each built-in Transformer layer with a functional activation, by id:
    # a parent comes before its children in named_modules(), so it is met next.
    builtin: dict[int, str] = {}
    for name, module in model.named_modules():
        clean = name.removeprefix(_COMPILED_PREFIX)
        kind = kind_of(module)
        if any(True for _ in module.parameters(recurse=False)):
            output_side = []
        if kind is not None:
            found.append(Target(clean or type(module).__name__, kind, module))
            if kind in _OUTPUT_KINDS and output_side is not None:
                output_side.append(found[-1])
        block = builtin_block_activation(module)
        if block is not None:
            builtin[id(block[0])] = block[1]
        for pattern, given in patterns:
            if clean and fnmatch.fnmatchcase(clean, pattern):
                if given.startswith(PRE):
                    found.append(Target(clean + PRE_SUFFIX, given[len(PRE) :], module, pre=True))
                else:
                    found.append(Target(clean + INPUT_SUFFIX, given, module, on_input=True))
                matched.add(pattern)
                break
        else:
            if id(module) in builtin and clean:
                found.append(Target(clean + PRE_SUFFIX, builtin[id(module)], module, pre=True))
    for pattern, _ in patterns:
        if pattern not in matched:
            logger.warning(
                "gradwatch: activation_modules pattern %r matches no module of the "
                "model; check the names with [n for n, _ in model.named_modules()]",
                pattern,
            )
    if output_side:
        logger.info(
            "gradwatch: %s after the model's last layer read as its output activation: "
            "not measured (a confident output is no saturation)",
            ", ".join(t.name for t in output_side),
        )
        skipped = {id(t) for t in output_side}
        found = [t for t in found if id(t) not in skipped]
    return found


def stacked_linear_maps(model: nn.Module) -> bool:
    """Whether ``model`` holds two Linear or convolution layers or more."""
    maps = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return sum(1 for m in model.modules() if isinstance(m, maps)) >= 2
