"""A sink for tests: keeps every transition the collector hands it; waits are bounded.

Example::

    sink = RecordingSink()
    server = Server(config, sinks=[sink])
    sink.wait_for(fired("RankStalled"), timeout=20.0)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gradwatch.collector.sinks import SinkStats


class RecordingSink:
    """Keeps every transition it is handed; ``wait_for`` blocks, bounded."""

    name = "recording"

    def __init__(self) -> None:
        self.transitions: list[Any] = []
        self._cond = threading.Condition()
        self._open = False

    def start(self) -> None:
        self._open = True

    def notify(self, transition: Any) -> None:
        with self._cond:
            self.transitions.append(transition)
            self._cond.notify_all()

    def close(self, timeout: float) -> None:
        self._open = False

    def alive(self) -> bool:
        return self._open

    def stats(self) -> SinkStats:
        return SinkStats()

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.transitions):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"sink got {self.transitions!r:.2000}")
                self._cond.wait(remaining)
            return list(self.transitions)


def fired(rule: str) -> Callable[[list[Any]], bool]:
    return lambda got: any(t.alert.rule == rule and t.current == "firing" for t in got)


def firing_alert(transitions: list[Any], rule: str) -> Any:
    """The first alert of ``rule`` that fired among ``transitions``."""
    return next(t.alert for t in transitions if t.alert.rule == rule and t.current == "firing")
