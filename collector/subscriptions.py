"""The collector's ZeroMQ endpoints: binding, who sent a frame, and the command channel.

Agents subscribe to rollback commands on an XPUB socket (only when a command
key is configured). XPUB, not PUB: it reports subscriptions, so a rollback for
a job with no agent listening is refused and logged instead of silently
dropped. :class:`CommandChannel` keeps which jobs are listening; the ingest
thread feeds it the (un)subscription messages, and dispatch (on the ingest
thread and on ``Server.tick()`` callers) sends through it, one user at a time.

Example::

    import zmq

    context = zmq.Context()
    channel = CommandChannel.bind(context, "tcp://127.0.0.1:*", secure=None)
    print(channel.endpoint, channel.listening("run-42"))   # tcp://127.0.0.1:PORT False
    channel.close()
    context.term()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zmq

from gradwatch.collector.config import CollectorError

SUBSCRIBE = b"\x01"  # XPUB's first byte of a subscription message
UNSUBSCRIBE = b"\x00"  # ... and of an unsubscription


def bind_socket(sock: zmq.Socket[Any], endpoint: str, option: str) -> str:
    """Bind ``sock`` to ``endpoint``; the endpoint actually bound (a ``*`` port resolved)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise CollectorError(
            f"cannot listen on {endpoint}: {exc}; another collector may be using it: stop it "
            f"or choose another {option}"
        ) from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def sender_of(frame: zmq.Frame) -> str:
    """The ZAP User-Id (the agent's CurveZMQ public key) of a received frame."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


class CommandChannel:
    """The XPUB socket commands go out on, and the jobs with an agent subscribed to it."""

    def __init__(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        self._sock: zmq.Socket[Any] | None = sock  # used under _lock; None once closed
        self.endpoint = endpoint
        self._lock = threading.Condition()
        self._listening: set[str] = set()

    @classmethod
    def bind(
        cls,
        context: zmq.Context[Any],
        endpoint: str,
        secure: Callable[[zmq.Socket[Any]], None] | None,
    ) -> CommandChannel:
        """Bind an XPUB socket on ``endpoint``; ``secure`` applies CURVE to it when on.

        Raises ``CollectorError`` when the endpoint cannot be bound.
        """
        sock = context.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if secure is not None:
                secure(sock)  # encrypted, and only allow-listed agents subscribe
            bound = bind_socket(sock, endpoint, "command_listen")
        except BaseException:
            sock.close(linger=0)
            raise
        return cls(sock, bound)

    @property
    def socket(self) -> zmq.Socket[Any] | None:
        """The socket, for the ingest thread's poller; None once closed."""
        return self._sock

    def send(self, frames: list[bytes]) -> None:
        """Publish one command; dropped (never blocking) when no peer can take it."""
        with self._lock:
            if self._sock is not None:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def read_subscriptions(self) -> None:
        """Take in every (un)subscription that has arrived, without blocking."""
        with self._lock:
            while self._sock is not None:
                try:
                    message = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message[:1] == SUBSCRIBE:
                    self._listening.add(message[1:].decode("utf-8", "replace"))
                elif message[:1] == UNSUBSCRIBE:
                    self._listening.discard(message[1:].decode("utf-8", "replace"))
            self._lock.notify_all()

    def listening(self, job: str) -> bool:
        """Whether an agent of ``job`` is subscribed to commands now."""
        with self._lock:
            return job in self._listening

    def wait_for_listener(self, job: str, timeout: float) -> bool:
        """Block until an agent of ``job`` subscribes, at most ``timeout`` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: job in self._listening, timeout)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
