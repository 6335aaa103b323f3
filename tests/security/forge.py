"""Forged-but-valid gradwatch messages, as a hostile sender on the ingest socket would build them.

Every message here decodes cleanly: the point of issue 15 is input that is
*well-formed* and still hostile. Used by the bounds tests and by the flood
probe (``flood.py``), which runs them from a separate process.
"""

from __future__ import annotations

import numpy as np

from gradwatch.wire import Batch, Event, Heartbeat, Schema, encode, encode_event, encode_heartbeat

# A rule file with only the NaN rule: what a flood must not delay (test and benchmark).
NAN_RULE = """
groups:
  - name: nan
    rules:
      - alert: NaN
        detector: nonfinite
        for: 1
        severity: critical
        category: numerical
"""


def heartbeat(job: str, rank: int = 0, world: int = 1) -> list[bytes]:
    return encode_heartbeat(Heartbeat(job, rank, max(world, rank + 1), "forged", 0.0, 1, 0))


def batch(
    job: str,
    rows: int = 1,
    layers: int = 2,
    nan: bool = False,
    first_step: int = 1,
    rank: int = 0,
    schema_id: int = 1,
    prefix: str = "l",
) -> list[bytes]:
    """One batch of ``rows`` steps of a schema of ``layers`` layers (sent along)."""
    schema = Schema(
        id=schema_id, columns=("loss",), layers=tuple(f"{prefix}{i}" for i in range(layers))
    )
    values = np.full((rows, layers + 1), 0.5, "<f4")
    if nan:
        values[:, 0] = np.nan
    steps = tuple(range(first_step, first_step + rows))
    return encode(
        Batch(
            job,
            rank,
            1,
            schema.id,
            first_step,
            "forged",
            0,
            steps,
            tuple(float(s) for s in steps),
            values.tobytes(),
            schema,
        )
    )


def checkpoint(job: str, step: int, path: str) -> list[bytes]:
    return encode_event(
        Event(
            job=job,
            rank=0,
            incarnation="forged",
            time=0.0,
            kind="checkpoint",
            step=step,
            fields={"path": path},
        )
    )
