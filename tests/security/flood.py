"""A hostile sender: floods a collector's ingest socket with forged-but-valid messages.

Run as its own process (``python -m tests.security.flood ENDPOINT SECONDS``), so
its CPU is not the collector's: loopback only, and it stops by itself after
SECONDS. It sends, round-robin over several connections, as fast as it can:

* a job-name bomb (heartbeats of ever new jobs),
* NaN batches of ``max_rows_per_batch`` rows for a few hundred forged jobs
  (forged critical alerts), and batches far over the row cap,
* schemas of ~16,000 layer names, each one new (a layer-name bomb),
* checkpoint reports for forged jobs (a checkpoint-table bomb).

It prints how many messages it sent and how many ZeroMQ refused (queue full).
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import zmq

from tests.security.forge import batch, checkpoint, heartbeat

CONNECTIONS = 4


def messages() -> list[list[bytes]]:
    """A pool of encoded messages, built once: the sender's CPU goes into sending."""
    pool: list[list[bytes]] = []
    for i in range(1200):
        pool.append(heartbeat(f"bomb-{i}"))
        pool.append(checkpoint(f"flood-{i % 300}", i, f"/tmp/attacker-{i}.pt"))
        if i % 4 == 0:  # forged NaN alerts, at the row cap and over it
            pool.append(batch(f"flood-{i % 300}", rows=256, nan=True, first_step=1 + i))
            pool.append(batch(f"flood-{i % 300}", rows=1024, nan=True, first_step=1 + i))
        if i % 60 == 0:  # new schemas of ~16k layer names: under the cap, and over it
            pool.append(
                batch(
                    f"layers-{i % 50}",
                    layers=16_000 + 500 * (i % 120 == 0),
                    schema_id=i,
                    prefix=f"x{i}-",
                )
            )
    return pool


def flood(endpoint: str, seconds: float) -> tuple[int, int]:
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    for _ in range(CONNECTIONS):
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.sndhwm = 100
        sock.connect(endpoint)
        socks.append(sock)
    pool = messages()
    sent = full = 0
    deadline = time.monotonic() + seconds
    try:
        for frames, sock in zip(itertools.cycle(pool), itertools.cycle(socks)):
            if time.monotonic() > deadline:
                break
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                full += 1
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    return sent, full


if __name__ == "__main__":
    sent, full = flood(sys.argv[1], float(sys.argv[2]))
    print(f"sent {sent} refused-by-hwm {full}", flush=True)
