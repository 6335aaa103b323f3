"""The collectors one agent ships to: one, or both of a high-availability pair.

An HA pair is two collectors fed the same stream, so either can judge the job
and page (their alerts carry no collector identity, so an Alertmanager cluster
sends one notification for both: deploy/fleet/README.md). A ZeroMQ PUSH socket
connected to two endpoints would deal the messages out between them, each
collector seeing half the steps; so each endpoint gets its own socket here, and
every message goes to each.

``endpoint`` is one ZeroMQ address or several separated by commas
(``"tcp://collector-a:5555,tcp://collector-b:5555"``; ``GRADWATCH_ENDPOINT``
alike). Each destination keeps its own connection state: whether its peer may
not know a schema yet (a collector that restarted, or one that came up later),
and whether a refusal was logged. A destination that is down does not hold the
other back: a send never blocks on a peer that is down (one that stops taking
messages costs one wait of ``FULL_PIPE_WAIT_S``, agent/shipper.py, then none until
a send goes through), and a message counts as sent when at least one collector
took it. With CurveZMQ, every collector of the pair must
serve the same server key (``GRADWATCH_CURVE_SERVER_KEY``): the agent has one.

The addresses are split and checked (at most ``MAX_ENDPOINTS``) by
agent/config.py when ``watch()`` builds its configuration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from gradwatch.agent.config import CurveKeys

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# The most the shipper thread waits, over an agent's life, for its first connection to a
# collector (never the training thread). An absent collector costs it once.
FIRST_CONNECT_WAIT_S = 0.5


class Destination:
    """One collector's PUSH socket and what this agent knows about its peer."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, hwm: int, curve: CurveKeys | None
    ) -> None:
        self.endpoint = endpoint
        # Schema id -> when it last travelled to this peer; cleared on a (re)connection.
        self.schema_sent: dict[int, float] = {}
        self._refusal_logged = False
        # Whether the last send went through: only then may a send wait for room (below).
        self._flowing = False
        self._first_wait = FIRST_CONNECT_WAIT_S  # left of the wait for a first connection
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self._events = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
        )

    def connect(self) -> None:
        self.sock.connect(self.endpoint)

    def send(self, frames: list[bytes], wait_s: float = 0.0) -> bool:
        """Send; False when there is no peer or its pipe stayed full.

        ``wait_s``: how long a full pipe may hold this send, and only while messages
        were flowing to this peer (the last send went through). A burst of more than
        ``send_hwm`` messages fills the pipe before ZeroMQ's I/O thread drains it: a
        short loop's batches, its dense early samples and its exit note, all sent within
        a few milliseconds at close. Without a wait the last batch and the note were
        dropped that way in 4 of 20 exits of tests/agent/test_agent_exit_flush.py's
        loop on an idle 2-core machine (17 sends in 7 ms). A peer that is down or stuck
        costs one wait, then sends fail at once until one goes through. Before the
        first connection, sends wait for it, ``FIRST_CONNECT_WAIT_S`` in all.
        """
        if self._try(frames):
            return self._went()
        # Never connected yet: the rest of one wait for the first connection. A loop's
        # first steps can be logged before the connection is made (a remote collector,
        # a busy machine), and a bad init's NaN at step 1 would be dropped unseen.
        wait = wait_s if self._flowing else self._first_wait
        if wait > 0:
            began = time.monotonic()
            sent = bool(self.sock.poll(int(wait * 1000), zmq.POLLOUT)) and self._try(frames)
            if not self._flowing:
                self._first_wait = max(0.0, self._first_wait - (time.monotonic() - began))
            if sent:
                return self._went()
        # No peer, or a full pipe: the handshake event of a restarted collector may come
        # after our next send, so the next batch that goes out carries the schema.
        self._flowing = False
        self.schema_sent.clear()
        return False

    def _went(self) -> bool:
        self._flowing = True
        self._first_wait = 0.0  # connected: from now on a peer that goes away costs wait_s
        return True

    def _try(self, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def watch(self) -> None:
        """A new handshake means a (re)started peer that may not know our schema."""
        while self._events.poll(0):
            event = recv_monitor_message(self._events, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.schema_sent.clear()
            elif not self._refusal_logged:  # retried every reconnect: say it once
                self._refusal_logged = True
                logger.error(
                    "gradwatch: the collector at %s refused this agent's connection "
                    "(%s); steps are counted as dropped until it is fixed (SECURITY.md)",
                    self.endpoint,
                    _refusal_reason(event),
                )

    def close(self, linger_ms: int) -> None:
        self.sock.disable_monitor()
        self._events.close(linger=0)
        self.sock.close(linger=linger_ms)


def _refusal_reason(event: Mapping[str, Any]) -> str:
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "this agent's CurveZMQ key is not in the collector's allow-list"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "one side uses CurveZMQ and the other does not: set or unset "
            "GRADWATCH_CURVE_SERVER_KEY(_FILE) and GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE"
        )
    return (
        f"handshake error {event['value']:#x}: check GRADWATCH_CURVE_SERVER_KEY(_FILE) "
        "against the collector's public key"
    )
