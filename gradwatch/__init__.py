"""gradwatch: a real-time training-health monitor for PyTorch.

The root package stays import-light: ``gradwatch.watch`` is resolved lazily so
that importing ``gradwatch`` (or the collector) never imports torch.

Example::

    import gradwatch
    mon = gradwatch.watch(model, optimizer, job="run-42", endpoint="tcp://127.0.0.1:5555")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradwatch.agent import Monitor, watch

__all__ = ["Monitor", "__version__", "watch"]


def __getattr__(name: str) -> Any:
    if name in ("watch", "Monitor"):
        import gradwatch.agent as agent

        return getattr(agent, name)
    raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
