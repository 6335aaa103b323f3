"""Forward-activation statistics, measured only on cadence steps.

:class:`ActHooks` finds the model's nonlinearity modules once (the first
``MAX_ACT_MODULES`` in model order) and registers forward hooks on them only
for the forward pass of a cadence step (``arm``), removing them at the next
``Monitor.log`` (``disarm``): every other step pays nothing. Each hook copies,
on the device and without a sync, a strided sample of the output into its row
of one buffer; when the sample ships, the shipper thread works out from a host
copy (agent/actstats.py) the output's mean and (population) std, plus one share
per family (``ActStats.kind``):

========  ==========================================  ===========================================
kind      modules                                     share
========  ==========================================  ===========================================
relu      ReLU                                        ``zero_frac``: exact zeros
relu6     ReLU6                                       ``zero_frac``: exact zeros
tanh      Tanh                                        ``sat_frac``: ``|y| > 0.99``
sigmoid   Sigmoid                                     ``sat_frac``: ``y < 0.01`` or ``y > 0.99``
gelu      GELU (either approximation); classes        ``zero_frac``: *dead*, in the flat negative
          named ``*GELU``, ``*GELUActivation``,       tail: ``GELU(-3) < y <= 0``, i.e. input
          ``*GELUTanh`` (Hugging Face's)              below -3 (see below)
silu      SiLU; classes named ``*SiLU(Activation)``,  ``zero_frac``: *dead*, ``SiLU(-6) < y <= 0``,
          ``*Swish`` (the gate of LLaMA's SwiGLU)     i.e. input below -6
softmax   Softmax (rows along its ``dim``)            ``sat_frac``: rows whose largest
                                                      probability exceeds 0.99
other     LeakyReLU                                   none (mean and std only)
========  ==========================================  ===========================================

*Dead* generalises ReLU's exact zero to GELU and SiLU (Hendrycks & Gimpel
2016; Elfwing et al. 2018; Shazeer 2020 for SwiGLU): a unit is dead where it
passes almost no gradient, and both have a flat negative tail. The cut-offs
are where the local slope falls to ~1.2% of the linear regime's: GELU'(-3) =
-0.012 and SiLU'(-6) = -0.012. Both are read from the output alone, so the
same test works where only the output exists (an in-place SiLU, or the input
of the layer after a functional ``F.gelu``); it also counts a sliver of inputs
just below zero (GELU: (-0.008, 0), SiLU: (-0.03, 0)), under 1.5% of units for
unit-scale pre-activations, against a healthy tail share of 0.1% (GELU) and
~0% (SiLU). *Saturated* attention is the one-hot regime of attention-entropy
collapse (Zhai et al., ICML 2023): a row with max probability above 0.99
attends to one position. Under a causal mask, row i has i + 1 positions, so
the first row is always one-hot: a healthy floor of 1/T of the rows.

Functional activations (``F.gelu`` or ``F.silu`` inside a module's forward)
have no module to hook: ``watch(..., activation_modules={"*.mlp.c_proj":
"gelu"})`` names modules (``fnmatch`` patterns on ``named_modules()`` names)
whose *input* is the output of an activation of that kind, typically the
Linear that follows it; those statistics are reported as ``<module>:input``.
Where no layer takes the activation's output (a SwiGLU gate,
``w2(F.silu(w1(x)) * w3(x))``), ``{"*.w1": "pre:silu"}`` names the layer whose
*output* the activation takes: its sample goes through the activation first
(``<module>:pre``). torch's own ``nn.TransformerEncoderLayer``/``DecoderLayer`` call
theirs as a function too; they are measured without a name, at ``linear1:pre``
(agent/acttargets.py finds what to hook).

An output of more than ``SAMPLE`` elements is measured on an evenly strided
sample of about ``SAMPLE`` elements (a softmax: whole rows, about ``ROW_SAMPLE``
elements of them). The stride is odd,
so with the usual power-of-two widths the sample cycles through every hidden
unit (every query position, for attention rows) instead of a fixed subset. If the module
runs more than once in that window (gradient accumulation, an eval forward),
the last call wins.

Memory: the buffer holds a row of ``SAMPLE`` float32 values (32 KiB) per
hooked module other than a softmax. A hook holds no reference to the output
after it returns, and what it allocates while it runs is bounded by the
sample, never the output's size: at most ``HOOK_BYTES_PER_SAMPLED`` bytes per
sampled element (for an output that is neither contiguous nor a permutation of
a dense tensor the index vectors that gather it; a softmax's float32 copy and
masks), i.e. ``hook_transient_bytes()``: 328 KB for an elementwise activation;
a softmax, sampled by whole rows, 2.5 MiB plus 40 bytes per element of one row.
Released before the next hooked module runs.

Hooks would make ``torch.compile`` recompile, so a compiled model gets no
activation statistics (one warning at attach); other signals are unaffected.

Example::

    >>> import torch
    >>> from gradwatch.agent.activations import ActHooks
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    >>> hooks = ActHooks.attach(model, torch.device("cpu"), on_error=None,
    ...                         inputs={"2": "gelu"})
    >>> hooks.columns[:3]
    ('act/1/gelu/mean', 'act/1/gelu/std', 'act/1/gelu/zero_frac')
    >>> hooks.columns[3]
    'act/2:input/gelu/mean'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gradwatch.agent.actsample import (
    ROW_SAMPLE,
    SAMPLE,
    Cells,
    Row,
    measure,
    measure_rows,
)
from gradwatch.agent.actstats import ActCopy, ActLayout, missing_buffer
from gradwatch.agent.acttargets import (
    Target,
    find_targets,
    frac_stat,
    is_compiled,
    stacked_linear_maps,
)
from gradwatch.agent.hooks import Detached, hook_module
from gradwatch.agent.hostpart import host_copy
from gradwatch.wire import columns as wc

logger = logging.getLogger(__name__)

# Hooked modules at most (the first in model order); the rest are not measured.
MAX_ACT_MODULES = 256
# A sample spread over steps hooks the modules in at most this many groups, one per
# step (agent/spreadplan.py): a model of 100 modules pays ~7 hooks on each of 16 steps.
MAX_HOOK_GROUPS = 16
# What a hook allocates while it runs, per sampled element at most: the gather's three
# int64 index vectors (24), the sample in its own dtype (8 for float64), its float32
# copy (4) and two bool masks (2); 38, rounded up. Checked in tests/agent/test_agent_act.py.
HOOK_BYTES_PER_SAMPLED = 40


class ActHooks:
    """The hookable modules of one model and the device vector their statistics land in."""

    def __init__(
        self,
        targets: list[Target],
        device: torch.device,
        on_error: Callable[[str, BaseException], None] | None,
    ) -> None:
        self._on_error = on_error
        columns: list[str] = []
        # (target, first slot, whether a share is measured)
        plan: list[tuple[Target, int, bool]] = []
        for target in targets:
            first = len(columns)
            columns += [
                wc.act(target.name, target.kind, wc.ACT_MEAN),
                wc.act(target.name, target.kind, wc.ACT_STD),
            ]
            frac = frac_stat(target.kind)
            if frac is not None:
                columns.append(wc.act(target.name, target.kind, frac))
            plan.append((target, first, frac is not None))
        self.columns = tuple(columns)
        # One device buffer (agent/actstats.py): the statistic cells (a softmax's,
        # written by its hook), then a length and a row per sampled module, which its
        # hook copies its sample into. The arithmetic is done on the host when the
        # sample ships: each tensor operation in a forward pass costs microseconds.
        sampled = [(t, first, frac) for t, first, frac in plan if t.kind != "softmax"]
        self._layout = ActLayout(
            len(columns),
            [(first, first + 2 if frac else None, t.kind) for t, first, frac in sampled],
            [first for t, first, _ in plan if t.kind == "softmax"],
            SAMPLE,
            device,
        )
        self._host_layout = self._layout.on_host()
        self._buf = torch.empty(self._layout.size, dtype=torch.float32, device=device)
        missing_buffer(self._buf, self._layout)
        self.values = self._buf[: len(columns)]
        lengths = self._buf[len(columns) : len(columns) + len(sampled)]
        rows = self._buf[len(columns) + len(sampled) :].view(len(sampled), SAMPLE)
        row_of = {id(t): r for r, (t, _, _) in enumerate(sampled)}
        # Each module's hook, made once (arm() only registers them), writing into views
        # made once; registered by hook_module, so a model saved or copied while armed leaves
        # them out (agent/hooks.py).
        self._hooks = [
            (
                target,
                Detached(
                    self._hook(
                        target,
                        (
                            self.values[first : first + (3 if frac else 2)],
                            self.values[first],
                            self.values[first + 1],
                            self.values[first + 2] if frac else None,
                        )
                        if target.kind == "softmax"
                        else (rows[row_of[id(target)]], lengths[row_of[id(target)]]),
                    )
                ),
            )
            for target, first, frac in plan
        ]
        self._handles: list[Any] = []
        # Whether the hooks are registered: read by the monitor on every step.
        self.armed = False

    @property
    def groups(self) -> int:
        """How many groups ``arm`` cuts the modules into for a spread sample."""
        return min(MAX_HOOK_GROUPS, len(self._hooks))

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        device: torch.device,
        on_error: Callable[[str, BaseException], None] | None,
        max_modules: int = MAX_ACT_MODULES,
        inputs: Mapping[str, str] | None = None,
    ) -> ActHooks | None:
        """Find the modules to measure; None for a compiled model (warned) or none found.

        ``inputs``: ``watch(activation_modules=...)``, module name patterns
        whose input is measured as the output of the given activation kind.
        """
        if is_compiled(model):
            logger.warning(
                "gradwatch: the model is compiled with torch.compile; activation statistics "
                "are off for compiled models (forward hooks would force recompiles). Gradient, "
                "weight and loss signals are unaffected."
            )
            return None
        found = find_targets(model, inputs)
        if len(found) > max_modules:
            logger.warning(
                "gradwatch: activation statistics cover the first %d of %d "
                "nonlinearity modules (model order); the other %d are not measured",
                max_modules,
                len(found),
                len(found) - max_modules,
            )
            found = found[:max_modules]
        if not found and stacked_linear_maps(model):
            # Two linear maps or more have nonlinearities between them; none is a module,
            # so they are functional (llama2.c's SwiGLU calls F.silu). Silence would read
            # as "no dead units": say the checks are off, and how to turn them on.
            logger.warning(
                "gradwatch: no activation module found in the model (ReLU, GELU, SiLU, "
                "Tanh, Sigmoid, Softmax, ...), so the saturation and dead-unit checks are "
                "off. Activations called as functions (F.gelu, F.silu) have no module to "
                "hook: name the layer that takes one's output as its input "
                "(activation_modules={'*.mlp.c_proj': 'gelu'}), or whose output one takes "
                "(a SwiGLU gate: {'*.feed_forward.w1': 'pre:silu'})"
            )
        return cls(found, device, on_error) if found else None

    def arm(self, groups: tuple[int, int] | None = None, of: int = 1, start: bool = True) -> None:
        """Register the hooks of some modules for the next forward pass.

        A cadence sample spread over several steps (agent/spreadplan.py) hooks
        each module on one of them: the modules are cut into ``of`` groups
        (module ``i`` of ``n`` in group ``i * of // n``) and this step hooks
        groups [a, b) = ``groups`` (None: every module), so no forward pays every
        hook. ``start``: the step starts a sample, whose modules that do not run
        stay MISSING.
        """
        if self._handles:
            return
        if start:
            missing_buffer(self._buf, self._layout)
        self.armed = True  # before registering: a failure halfway still gets disarmed
        n = len(self._hooks)
        first, stop = groups if groups is not None else (0, of)
        for i, (target, hook) in enumerate(self._hooks):
            if not first <= i * of // n < stop:
                continue
            self._handles.append(hook_module(target.module, hook, after=not target.on_input))

    def reset(self) -> None:
        """Start a sample whose first step hooks nothing: every module MISSING until it runs."""
        missing_buffer(self._buf, self._layout)

    def disarm(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self.armed = False

    def stats(self) -> torch.Tensor:
        """The statistics [mean, std(, share)] per module measured since the sample
        began, worked out here on the device (no sync): a sample measured whole."""
        return self._layout.finish(self._buf)

    def export(self) -> ActCopy:
        """A host copy of what the hooks measured since the sample began (queued, no
        sync); the shipper thread works the statistics out (``ActCopy.values``)."""
        return ActCopy(self._host_layout, host_copy(self._buf))

    def _hook(self, target: Target, cells: Cells | Row) -> Callable[..., None]:
        kind, on_input = target.kind, target.on_input
        dim = getattr(target.module, "dim", None) if kind == "softmax" and not on_input else -1
        pre = kind if target.pre else None

        def hook(module: nn.Module, args: Any, output: Any = None) -> None:
            try:
                y = (args[0] if args else None) if on_input else output
                if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.numel() == 0:
                    return
                with torch.no_grad():
                    y = y.detach()
                    if len(cells) == 4:  # a softmax: measured by whole rows here
                        measure_rows(y, dim, cells)
                    else:
                        measure(y, cells, pre)
            except Exception as exc:  # never raise into the user's forward pass
                self.disarm()
                if self._on_error is not None:
                    self._on_error("measuring activation statistics in a forward hook", exc)

        return hook


def hook_transient_bytes(row_width: int = 0) -> int:
    """The most one activation hook allocates while it runs (released when it returns),
    whatever the size of the output, at ``HOOK_BYTES_PER_SAMPLED`` bytes per sampled
    element: ``SAMPLE`` elements for an elementwise activation (``row_width`` 0), or a
    softmax's whole rows, ``ROW_SAMPLE`` elements plus one row of ``row_width``."""
    if not row_width:
        return HOOK_BYTES_PER_SAMPLED * (SAMPLE + 1)
    return HOOK_BYTES_PER_SAMPLED * (ROW_SAMPLE + 1 + row_width)
