"""Step numbers users recognise, and ``watch()``'s argument checks.

By default the agent counts steps itself, from 1: the first ``log()`` is step 1.
A loop with a counter of its own says so, and the wire then carries the
loop's numbers, so alerts, checkpoints and rollbacks name the steps the user
sees in their own logs:

* ``watch(..., start_step=N)``: the first logged step is N (a resumed run:
  the iteration the script continues at; nanoGPT: ``start_step=iter_num``).
* ``mon.log(step=N, loss=...)``: this step is N; later ``log()`` calls without
  ``step`` count on from it. A number at or below the last one (the loop
  rewound: a resume or a rollback done by hand) starts a new incarnation, so
  the collector sees a restart rather than a stall.

``step`` must be a Python int: a tensor would have to be read on the host.

Example::

    >>> import torch
    >>> from gradwatch.agent.steps import check_watch_args
    >>> check_watch_args(torch.nn.Linear(1, 1), None, job=42)
    Traceback (most recent call last):
    ...
    TypeError: watch(job=42): job must be a str (the job's name, e.g. 'run-42'), not int
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

# What each watch() argument must be: (accepted types, how to say it, may be None).
_EXPECTED: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "job": ((str,), "a str (the job's name, e.g. 'run-42')", False),
    "endpoint": ((str,), "a str ZeroMQ address like 'tcp://127.0.0.1:5555'", False),
    "rank": ((int,), "an int or None", True),
    "world": ((int,), "an int or None", True),
    "shards": ((int,), "an int or None", True),
    "flush_every": ((int,), "an int (steps per batch)", False),
    "stats_every": ((int,), "an int (steps; 0: no cadence statistics)", False),
    "start_step": ((int,), "an int (the number of the first logged step)", False),
    "heartbeat_every": ((int, float), "a number of seconds or None", True),
    "enabled": ((bool,), "True or False", False),
    "activation_stats": ((bool,), "True or False", False),
    "update_ratios": ((bool,), "True or False", False),
    "supervised_loss": ((bool,), "True or False", False),
    "phase_clock": ((bool,), "True, False or None (on for a job of several ranks)", True),
    "command_endpoint": ((str,), "a str ZeroMQ address or None", True),
    "command_key": ((str, bytes), "a str or bytes key, or None", True),
    "on_rollback": ((str,), "'return' or 'exit'", False),
    "resume_file": ((str,), "a str path or None", True),
    "curve_server_public_key_file": ((str,), "a str path or None", True),
    "curve_secret_key_file": ((str,), "a str path or None", True),
}


def check_watch_args(model: Any, optimizer: Any, **named: Any) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first ``watch()`` argument of the wrong kind.

    Run before anything else in ``watch()``, so a wrong argument never
    surfaces as an internal ``AttributeError`` from deep inside the agent.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"watch(model=...): model must be a torch.nn.Module (the model being "
            f"trained), not {_kind(model)}"
        )
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(
            f"watch(optimizer=...): optimizer must be a torch.optim.Optimizer (or "
            f"None for a loop that updates the parameters by hand), not "
            f"{_kind(optimizer)}"
        )
    for name, value in named.items():
        types, what, nullable = _EXPECTED[name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) and bool not in types:
            ok = False
        else:
            ok = isinstance(value, types) or (
                float in types and isinstance(value, numbers.Real) and not isinstance(value, bool)
            )
        if not ok:
            raise TypeError(
                f"watch({name}={_short(value)}): {name} must be {what}, not {_kind(value)}"
            )
    start = named.get("start_step")
    if start is not None and start < 0:
        raise ValueError(f"watch(start_step={start}): start_step must be >= 0")


def user_step(value: Any) -> int | None:
    """``value`` as a step number, or None when it is not a non-negative Python int."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, numbers.Integral) and int(value) >= 0:
        return int(value)
    return None


def _kind(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _short(value: Any) -> str:
    # Never the repr of a tensor (a device tensor's repr syncs) nor of a large object.
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return "<" + type(value).__name__ + ">"
