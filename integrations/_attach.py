"""What every framework callback shares: one monitor, attached once, that never raises.

A framework calls its callbacks inside the training loop, so an exception
there would stop training. :class:`Attachment` runs each callback body
through :meth:`Attachment.run`, which on the first error logs it once,
closes the monitor and ignores every later call, as the agent itself does.

Example::

    >>> import torch
    >>> from gradwatch.integrations._attach import Attachment
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> att = Attachment("doc", {"endpoint": "tcp://127.0.0.1:1"}, "example")
    >>> att.attach(model, opt, job="doc")
    >>> att.run("a step that fails", lambda mon: 1 / 0)
    >>> att.monitor is None, att.disabled.startswith("a step that fails")
    (True, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, overload

import torch

from gradwatch.agent import Monitor, watch
from gradwatch.agent.hooks import Detached

logger = logging.getLogger(__name__)

# Wrappers seen in practice nest at most twice (Lightning around Accelerate);
# the bound only guards against an object that returns itself.
_MAX_WRAPPERS = 8


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` whose ``step()`` really runs.

    Accelerate's ``AcceleratedOptimizer`` (``.optimizer``) and Lightning's
    ``LightningOptimizer`` (``._optimizer``) forward ``step()`` to the inner
    optimizer but never run torch's step hooks themselves, so the monitor's
    pre-hook must sit on the inner one.
    """
    for _ in range(_MAX_WRAPPERS):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


class StepProbe(torch.optim.Optimizer):
    """What the monitor watches in place of ``real``: its parameters, and a ``step()``
    that only copies its parameter groups.

    Stepping the probe runs the monitor's step pre-hook (torch runs hooks around
    any Optimizer subclass's ``step``), so a callback decides when the gradients
    are read; and the copy, taken as the probe steps, holds the learning rates
    this step used for the monitor's pre-hook to read.
    """

    # The monitor hooks this optimizer alone (not every optimizer holding the model's
    # parameters, as in a plain loop): the callback decides when gradients are read.
    gradwatch_stand_in = True

    def __init__(self, real: torch.optim.Optimizer) -> None:
        super().__init__([{"params": group["params"]} for group in real.param_groups], {})
        self.real = real
        self.refresh()  # a step recorded before the first real one (AMP-skipped) has rates too
        # Registered before the monitor's own pre-hook, so it runs first: the monitor
        # reads this step's rates from the probe in its pre-hook.
        self.register_step_pre_hook(lambda probe, args, kwargs: self.refresh())

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Nothing to update: stepping exists to run the pre-hooks (see the class docstring)."""
        return None

    def refresh(self) -> None:
        """Copy the real optimizer's groups (and so the rates it will step with) now."""
        # Shallow copies: a few dicts a step; the parameter lists are shared.
        self.param_groups = [dict(group) for group in self.real.param_groups]


class Attachment:
    """The monitor a callback owns; ``None`` until attached, and again once off.

    ``job`` and ``watch_kwargs`` are what the user gave the callback;
    ``framework`` names it in log messages.
    """

    def __init__(self, job: str | None, watch_kwargs: dict[str, Any], framework: str) -> None:
        self.job = job
        self.watch_kwargs = watch_kwargs
        self.framework = framework
        self.monitor: Monitor | None = None
        self.probe: StepProbe | None = None
        self.disabled: str | None = None
        self._hook: Any = None  # the real optimizer's pre-hook that steps the probe
        self._in_hook = False
        # The callback read this step's gradients already (read_now): the real
        # optimizer's step must not read them again (post-clip).
        self.gradients_read = False

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        job: str,
        scaler: Any = None,
        follow_real_steps: bool = True,
        start_step: int = 1,
    ) -> None:
        """Close any earlier monitor and watch ``model`` through a probe of ``optimizer``.

        ``follow_real_steps``: step the probe from the real (unwrapped)
        optimizer's step pre-hook, i.e. read the gradients where the agent
        reads them in a plain loop; otherwise the callback calls :meth:`read_gradients`.
        """
        self.close()
        if self.disabled is not None:
            return
        kwargs = dict(self.watch_kwargs)
        if scaler is not None:
            kwargs.setdefault("scaler", scaler)
        kwargs.setdefault("start_step", start_step)  # the framework's global step goes on
        self.gradients_read = False
        try:
            probe = StepProbe(unwrap_optimizer(optimizer))
            self.monitor = watch(model, probe, job=job, **kwargs)
            self.probe = probe
            if follow_real_steps:
                # Detached: the optimizer still pickles and deep-copies (agent/hooks.py).
                self._hook = probe.real.register_step_pre_hook(Detached(self._on_real_step))
        except Exception as exc:
            self._switch_off(
                f"attaching gradwatch.watch to the {self.framework} model and "
                "optimizer (check the callback's keyword arguments)",
                exc,
            )

    def _on_real_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.gradients_read:
            return  # read before clipping (read_now); these are the clipped ones
        self._in_hook = True
        try:
            self.read_gradients()
        finally:
            self._in_hook = False

    def read_now(self, unscale: torch.Tensor | None = None) -> None:
        """Read the gradient norms now (e.g. at the end of backward, before clipping);
        ``unscale``: a GradScaler's scale while the gradients are still scaled."""
        probe = self.probe
        if probe is None:
            return

        def read(mon: Monitor) -> None:
            probe.refresh()
            mon.read_gradients(unscale)
            self.gradients_read = True

        self.run("reading gradient norms", read)

    def read_gradients(self) -> None:
        """Read this step's per-layer gradient norms now (steps the probe)."""
        probe = self.probe
        if probe is not None:
            self.run("reading gradient norms", lambda mon: probe.step())

    def run(self, what: str, body: Callable[[Monitor], object]) -> None:
        """Call ``body(monitor)`` if attached; on an error, log once and switch off."""
        monitor = self.monitor
        if monitor is None:
            return
        try:
            body(monitor)
        except Exception as exc:
            self._switch_off(what, exc)

    def refuse(self, reason: str) -> None:
        """Switch off without an exception: the framework gave nothing to watch."""
        self.close()
        if self.disabled is None:
            self.disabled = reason
            logger.warning(
                "gradwatch: the %s callback is off for this run: %s", self.framework, reason
            )

    def close(self) -> None:
        """Close the monitor (flushing what it holds) and unhook; never raises."""
        self.probe = None  # the hook, if it stays a while, does nothing from now on
        if self._hook is not None and not self._in_hook:
            # Not from inside the hook: torch would be iterating the optimizer's
            # hooks, and removing one then raises if another follows it.
            self._hook.remove()
            self._hook = None
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        try:
            monitor.close()
        except Exception as exc:
            self._switch_off("closing the monitor", exc)

    def _switch_off(self, what: str, exc: BaseException) -> None:
        if self.disabled is None:
            self.disabled = f"{what}: {type(exc).__name__}: {exc}"
            logger.error(
                "gradwatch: the %s callback failed while %s (%s: %s). Monitoring is switched "
                "off for this run; training continues. Please report this with the traceback "
                "below; remove the callback to silence gradwatch.",
                self.framework,
                what,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        self.close()
