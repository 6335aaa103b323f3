"""Launch a real multi-process gloo job of :mod:`tests.distributed.worker`, and receive its wire.

:func:`launch` starts one worker subprocess per rank (the env:// rendezvous on
loopback, one thread each) and returns a :class:`Launch` that kills them all
when its ``with`` block ends, whatever happened inside. :class:`Receiver`
stands in for the collector: a PULL socket on a random loopback port whose
background thread decodes everything that arrives, bounded in count and time.

Example::

    with Receiver() as rx, launch(2, "ddp", rx.endpoint, "job", 4, tmp_path) as job:
        job.wait(timeout=60)
        assert rx.wait_for(lambda msgs: len(msgs) > 0, timeout=5)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import zmq

from gradwatch.wire import Message, WireError, decode

REPO_ROOT = Path(__file__).resolve().parents[2]
STDERR_TAIL_CHARS = 3000
POLL_S = 0.05


class LaunchError(AssertionError):
    """A rank failed or did not finish in time; the message carries every rank's stderr tail."""


def free_port() -> int:
    """A loopback TCP port free right now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launch:
    """The running ranks of one job; use as a context manager so they never outlive a test."""

    procs: list[subprocess.Popen[bytes]]
    out_dir: Path

    def wait(self, timeout: float, check: bool = True) -> list[int]:
        """Wait for every rank and return the exit codes, in rank order.

        Raises :class:`LaunchError` (after killing the ranks) when one is still
        running at ``timeout``, or, with ``check``, when any exits non-zero.
        """
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() >= deadline:
                self.kill()
                raise LaunchError(
                    f"ranks still running after {timeout:.0f} s; they were "
                    f"killed. Look for a hung collective:\n{self.stderr_tails()}"
                )
            time.sleep(POLL_S)  # polling child processes; no portable wait-for-any
        codes = [p.returncode for p in self.procs]
        if check and any(codes):
            raise LaunchError(
                f"ranks exited with codes {codes}; see each rank's stderr:\n{self.stderr_tails()}"
            )
        return codes

    def stderr_tails(self) -> str:
        parts = []
        for rank in range(len(self.procs)):
            path = self.out_dir / f"rank{rank}.stderr"
            text = path.read_text(errors="replace") if path.exists() else "(no stderr file)"
            # A worker writes rank{r}.done after destroy_process_group: with it, a crash came
            # at interpreter exit, after the job's work (gloo's threads at teardown have been
            # seen to abort there: "terminate called without an active exception").
            done = (self.out_dir / f"rank{rank}.done").exists()
            parts.append(
                f"--- rank {rank} stderr (last {STDERR_TAIL_CHARS} chars; "
                f"{'finished its work: rank.done written' if done else 'no rank.done'}) ---\n"
                f"{text[-STDERR_TAIL_CHARS:]}"
            )
        return "\n".join(parts)

    def kill(self) -> None:
        """Kill every rank still running, with the processes it started, and reap them."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and its children
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


def launch(
    world: int,
    mode: str,
    endpoint: str,
    job: str,
    steps: int,
    out_dir: Path,
    worker: str = "tests.distributed.worker",
    **options: float | str,
) -> Launch:
    """Start ``world`` ranks of the worker (module ``worker``), each in its own session.

    ``options`` become the worker's flags (``stall_at=3`` -> ``--stall-at 3``).
    Each rank's stdout and stderr go to ``out_dir/rank{r}.stdout|stderr``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        # Two cores shared by up to three ranks: more threads only contend.
        "OMP_NUM_THREADS": "1",
        # gloo picks its interface from the hostname otherwise; keep it on loopback.
        "GLOO_SOCKET_IFNAME": "lo",
    }
    argv = [
        sys.executable,
        "-m",
        worker,
        "--mode",
        mode,
        "--steps",
        str(steps),
        "--endpoint",
        endpoint,
        "--job",
        job,
        "--out",
        str(out_dir),
    ]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            with (
                open(out_dir / f"rank{rank}.stdout", "wb") as out,
                open(out_dir / f"rank{rank}.stderr", "wb") as err,
            ):
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=REPO_ROOT,
                        env={**env, "RANK": str(rank)},
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
    except BaseException:
        Launch(procs, out_dir).kill()
        raise
    return Launch(procs, out_dir)


@dataclass(frozen=True, slots=True)
class Received:
    """One decoded message and when it arrived (``time.monotonic()``)."""

    at: float
    message: Message


class Receiver:
    """A collector stand-in: decodes what arrives on a loopback PULL socket, in a thread.

    The thread stops by itself after ``max_messages`` or ``max_seconds``, so a
    forgotten receiver cannot outlive its test for long.
    """

    def __init__(self, max_messages: int = 50_000, max_seconds: float = 120.0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.linger = 0
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.wire_errors = 0
        self._max_messages = max_messages
        self._deadline = time.monotonic() + max_seconds
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self._stop = threading.Event()
        # The socket is used by this thread only from here on (zmq sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name="gw-test-receiver", daemon=True)
        self._thread.start()

    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def messages(self) -> list[Message]:
        return [r.message for r in self.received()]

    def wait_for(self, done: Callable[[list[Message]], bool], timeout: float) -> bool:
        """Poll ``done(messages so far)`` until it holds (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while True:
            if done(self.messages()):
                return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return done(self.messages())
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                if not self._sock.poll(int(POLL_S * 1000)):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                try:
                    message = decode(frames)
                except WireError:
                    self.wire_errors += 1
                    continue
                with self._lock:
                    self._received.append(Received(time.monotonic(), message))
                    if len(self._received) >= self._max_messages:
                        return
        finally:
            self._sock.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
