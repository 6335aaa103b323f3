"""Statistics that leave the device raw and are finished on the shipper thread.

A cadence sample's update ratios and activation statistics are a few dozen
small tensor operations each (differences, per-layer norms, masked sums, a
comparison per family). On the training thread, after a backward pass has
emptied the caches, each of those costs 10-70 us: together more than the
sample's gathers. So the training thread only *copies* what the sample
gathered (one copy per statistic, queued without a sync: pinned host memory
and an event under CUDA, a clone on CPU), and the shipper thread, which may
wait, does the arithmetic on the host when it ships the sample
(``HostPart.values``). The arithmetic is the same; only the thread changes.

Example::

    >>> import torch
    >>> from gradwatch.agent.hostpart import MissingPart, host_copy
    >>> from gradwatch.agent.layout import MISSING_I32
    >>> copy = host_copy(torch.arange(3.0))
    >>> copy.wait().tolist()
    [0.0, 1.0, 2.0]
    >>> MissingPart(2).values().view(torch.int32).tolist() == [MISSING_I32] * 2
    True
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gradwatch.agent.layout import fill_missing


class HostPart(Protocol):
    """``width`` cells of a sample's statistics, computed on the shipper thread."""

    width: int

    def values(self) -> torch.Tensor:
        """The cells as a float32 host vector; may wait for the device (shipper only)."""
        ...


class HostCopy:
    """A host copy of a device tensor, queued without waiting; ``wait()`` returns it."""

    def __init__(self, host: torch.Tensor, ready: Any = None) -> None:
        self._host, self._ready = host, ready

    def wait(self) -> torch.Tensor:
        """The copy, once the device has written it (the shipper thread may wait)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host


def pinned_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Any]:
    """Queue a copy of CUDA ``t`` into pinned host memory (as ``dtype``, its own by
    default), without waiting; return it and the event to wait on before reading it."""
    host = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def host_copy(t: torch.Tensor) -> HostCopy:
    """Copy ``t`` to the host without a sync: a clone on CPU (the buffer is reused by
    the next sample), pinned memory and an event under CUDA."""
    if t.device.type != "cuda":
        return HostCopy(t.clone())
    return HostCopy(*pinned_copy(t))


class MissingPart:
    """``width`` cells that were not measured (a statistic switched off mid-sample)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def values(self) -> torch.Tensor:
        out = torch.empty(self.width, dtype=torch.float32)
        fill_missing(out)
        return out


class DevicePart:
    """A vector worked out on the device, shipped beside host parts (queued, no sync)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._copy, self.width = host_copy(t), t.numel()

    def values(self) -> torch.Tensor:
        return self._copy.wait()
