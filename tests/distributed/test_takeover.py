"""Takeover in parts: the signed command, the collector's decision, the agent's switch.

The command is checked like a rollback (signature, freshness, replay, job)
plus its own order (a takeover issued before the newest one taken is
superseded). The collector (collector/takeover.py) publishes one when a rank
that sent layers goes silent while a rank that sends none still reports, again
when the silent set changes, now and then while in force, and once more (no
rank named) when it ends. The agent switches between sending layers and not at
a step boundary; every step goes out, each batch under its own schema.
test_takeover_e2e.py runs the whole loop with real processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

import gradwatch
from gradwatch.agent.commands import CommandReceiver, CommandRefused, verify_command
from gradwatch.agent.takeover_command import Takeover
from gradwatch.collector.state import StateStore
from gradwatch.collector.takeover import DEFAULT_SILENT_S, Takeovers, silent_threshold
from gradwatch.rules import load_default_rules
from gradwatch.rules.step import Step
from gradwatch.wire import Batch, Heartbeat
from gradwatch.wire.columns import STATS_SCHEMA_ID
from gradwatch.wire.commands import (
    MAX_SILENT_RANKS,
    encode_command,
    rank_runs,
    ranks_of_runs,
    signature_ok,
)
from tests.distributed.harness import Receiver

KEY = b"t" * 32
T0 = 1_700_000_000.0
WAIT_S = 15.0
LAYERS = ("0.weight", "0.bias", "1.weight", "1.bias")


def takeover(silent: list[list[int]], issued_at: float = T0, job: str = "run-1") -> dict[str, Any]:
    return {
        "v": 1,
        "job": job,
        "action": "takeover",
        "silent": silent,
        "issued_at": issued_at,
        "nonce": f"n{issued_at}{silent}{job}",
    }


# ------------------------------------------------------------------ the command


def test_a_signed_takeover_names_the_silent_ranks() -> None:
    frames = encode_command(takeover([[0, 0], [8, 15]]), KEY)
    got = verify_command(frames, KEY, "run-1", now=T0 + 5, seen={})
    assert got == Takeover(frozenset({0, *range(8, 16)}), T0)


@pytest.mark.parametrize(
    ("frames", "now", "reason"),
    [
        (encode_command(takeover([[0, 0]]), b"x" * 32), T0, "bad_signature"),  # wrong key
        (encode_command(takeover([[0, 0]]), KEY)[:2], T0, "unsigned"),
        (encode_command(takeover([[0, 0]]), KEY), T0 + 61, "stale"),  # older than 60 s
        (encode_command(takeover([[0, 0]]), KEY), T0 - 61, "stale"),  # from the future
        (encode_command(takeover([[3, 1]]), KEY), T0, "malformed"),  # not a run
        (encode_command(takeover([[0, MAX_SILENT_RANKS]]), KEY), T0, "malformed"),  # too many
        (encode_command({**takeover([[0, 0]]), "action": "reboot"}, KEY), T0, "malformed"),
    ],
)
def test_a_takeover_is_refused(frames: list[bytes], now: float, reason: str) -> None:
    with pytest.raises(CommandRefused) as refused:
        verify_command(frames, KEY, "run-1", now=now, seen={})
    assert refused.value.reason == reason


def test_a_takeover_is_not_taken_twice_nor_by_another_job() -> None:
    frames = encode_command(takeover([[0, 0]]), KEY)
    seen: dict[str, float] = {}
    assert verify_command(frames, KEY, "run-1", now=T0, seen=seen) is not None
    with pytest.raises(CommandRefused, match="replayed"):
        verify_command(frames, KEY, "run-1", now=T0 + 1, seen=seen)
    # "run-10" subscribes to the topic prefix "run-1" and hears it: ignored, not refused.
    assert verify_command(frames, KEY, "run-10", now=T0, seen={}) is None


def test_silent_ranks_travel_as_runs() -> None:
    ranks = {0, 1, 2, 3, 8, 9, 10, 11, 40}
    assert rank_runs(ranks) == [[0, 3], [8, 11], [40, 40]]
    assert ranks_of_runs(rank_runs(ranks)) == ranks
    assert rank_runs(()) == [] and ranks_of_runs([]) == frozenset()
    for bad in ([[0]], [["0", 1]], [[True, 1]], {"0": 1}, [[-1, 2]]):
        with pytest.raises(ValueError, match="silent"):
            ranks_of_runs(bad)


def test_the_receiver_counts_superseded_and_refused_takeovers() -> None:
    """A real SUB socket: accepted ones reach the monitor, out-of-order ones are refused."""
    taken: list[Takeover] = []
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.linger = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    now = time.time()
    receiver = CommandReceiver(
        ctx,
        f"tcp://127.0.0.1:{port}",
        "run-1",
        KEY,
        on_command=lambda rollback: None,
        on_takeover=taken.append,
        root=Path("."),
    )
    try:
        assert pub.poll(int(WAIT_S * 1000)) and pub.recv() == b"\x01run-1"  # subscribed
        sends = [
            encode_command(takeover([[0, 0]], now), KEY),
            encode_command(takeover([], now - 1.0), KEY),  # issued before the one taken
            encode_command(takeover([[0, 0]], now), b"w" * 32),  # wrong key
            encode_command(takeover([], now + 1.0), KEY),
        ]
        for frames in sends:
            pub.send_multipart(frames)
        deadline = time.monotonic() + WAIT_S
        while len(taken) + sum(receiver.refused.values()) < len(sends):
            assert time.monotonic() < deadline, (taken, receiver.refused)
            receiver.poll()
            time.sleep(0.01)  # the frames cross a loopback socket
    finally:
        receiver.close()
        pub.close()
        ctx.term()
    assert [t.silent for t in taken] == [frozenset({0}), frozenset()]
    assert receiver.accepted == 2
    assert receiver.refused == {"superseded": 1, "bad_signature": 1}


# ------------------------------------------------------------------ the collector


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def step(rank: int, n: int, layers: tuple[str, ...]) -> Step:
    return Step(
        job="run-1",
        step=n,
        time=T0 + n,
        rank=rank,
        loss=1.0,
        layers=layers,
        layer_norms=np.ones(len(layers)),
        world=3,
        shards=1,
    )


def beat(rank: int, n: int) -> Heartbeat:
    return Heartbeat("run-1", rank, 3, "inc", T0, n, 0)


def three_ranks(clock: Clock) -> StateStore:
    """``dp=3``: rank 0 reports, ranks 1 and 2 do not."""
    state = StateStore(job_ttl_seconds=3600.0, clock=clock)
    for rank in range(3):
        state.observe_step(step(rank, 1, LAYERS if rank == 0 else ()))
    return state


def commands(sent: list[list[bytes]]) -> list[dict[str, Any]]:
    assert all(signature_ok(KEY, frames[1], frames[2]) for frames in sent)
    return [json.loads(frames[1]) for frames in sent]


def test_the_collector_starts_repeats_and_ends_a_takeover() -> None:
    clock, sent = Clock(), []
    state = three_ranks(clock)
    takeovers = Takeovers(KEY, sent.append, clock, silent_seconds=60.0, repeat_s=20.0)
    clock.now += 59.0
    for rank in (1, 2):
        state.observe_heartbeat(beat(rank, 59))
    assert takeovers.tick(state) == []  # not yet silent
    clock.now += 2.0
    state.observe_heartbeat(beat(1, 61))
    state.observe_heartbeat(beat(2, 61))
    start = takeovers.tick(state)
    assert [c["silent"] for c in start] == [[[0, 0]]] and start[0]["action"] == "takeover"
    assert takeovers.in_force() == {"run-1": frozenset({0})}
    assert takeovers.tick(state) == []  # unchanged, not yet due again
    clock.now += 20.0
    state.observe_heartbeat(beat(1, 81))
    state.observe_heartbeat(beat(2, 81))
    assert [c["silent"] for c in takeovers.tick(state)] == [[[0, 0]]]  # repeated
    # Rank 1 took over; rank 2 goes silent too: the set changes.
    clock.now += 61.0
    state.observe_step(step(1, 142, LAYERS))
    assert [c["silent"] for c in takeovers.tick(state)] == [[[0, 0], [2, 2]]]
    # Both come back: the takeover ends with an empty set, then nothing more is sent.
    state.observe_step(step(0, 142, LAYERS))
    state.observe_step(step(2, 142, ()))
    assert [c["silent"] for c in takeovers.tick(state)] == [[]]
    assert takeovers.in_force() == {} and takeovers.tick(state) == []
    assert takeovers.counts() == {"start": 1, "change": 1, "repeat": 1, "end": 1, "correct": 0}
    assert len(commands(sent)) == 4 and len({c["nonce"] for c in commands(sent)}) == 4


def test_a_restarted_collector_stops_a_replica_that_still_takes_over() -> None:
    """Rank 1 took over before this collector started; rank 0 is back: both send layers."""
    clock, sent = Clock(), []
    state = three_ranks(clock)
    state.observe_step(step(1, 2, LAYERS))
    takeovers = Takeovers(KEY, sent.append, clock, silent_seconds=60.0, repeat_s=20.0)
    assert [c["silent"] for c in takeovers.tick(state)] == [[]]  # nobody silent: stop
    assert takeovers.in_force() == {} and takeovers.tick(state) == []  # once per 20 s
    state.observe_step(step(1, 3, ()))  # rank 1 stopped
    clock.now += 20.0
    assert takeovers.tick(state) == []
    assert takeovers.counts()["correct"] == 1 and len(commands(sent)) == 1


def test_no_takeover_without_need_or_without_a_key() -> None:
    clock, sent = Clock(), []
    state = three_ranks(clock)
    takeovers = Takeovers(KEY, sent.append, clock, silent_seconds=60.0)
    clock.now += 61.0
    state.observe_step(step(2, 61, ()))
    state.observe_step(step(0, 61, LAYERS))
    assert takeovers.tick(state) == []  # rank 1 is silent but sent no layers
    clock.now += 61.0
    assert takeovers.tick(state) == []  # every rank silent: a finished job
    # Every live rank already sends layers (no layout): nobody to take over.
    everyone = StateStore(job_ttl_seconds=3600.0, clock=clock)
    for rank in range(3):
        everyone.observe_step(step(rank, 1, LAYERS))
    clock.now += 61.0
    everyone.observe_step(step(1, 2, LAYERS))
    assert takeovers.tick(everyone) == []
    # Needed, but no command key: nothing is sent, the need is still tracked.
    state = three_ranks(clock)
    off = Takeovers(None, None, clock, silent_seconds=60.0)
    clock.now += 61.0
    state.observe_step(step(1, 62, ()))
    assert off.tick(state) == [] and off.in_force() == {"run-1": frozenset({0, 2})}
    assert sent == [] and off.counts()["start"] == 0


def test_the_threshold_is_the_silent_rank_rule() -> None:
    assert silent_threshold(load_default_rules()) == 60.0
    assert silent_threshold(()) == DEFAULT_SILENT_S


# ------------------------------------------------------------------ the agent


def run_steps(mon: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=torch.tensor(1.0))
        opt.zero_grad()


def batches(rx: Receiver) -> list[Batch]:
    return [m for m in rx.messages() if isinstance(m, Batch)]


def watched(rx: Receiver, rank: int, **options: Any) -> tuple[Any, torch.nn.Module, Any]:
    """A monitor of a small model on ``rank`` of two, its model and optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"flush_every": 1, "stats_every": 0, **options}
    mon = gradwatch.watch(model, opt, job="t", endpoint=rx.endpoint, rank=rank, world=2, **options)
    return mon, model, opt


def test_a_replica_sends_layers_while_its_reporter_is_silent() -> None:
    with Receiver() as rx:
        mon, model, opt = watched(
            rx, 1, layout="dp=2", flush_every=2, stats_every=2, early_stats=False
        )
        assert rx.wait_for(lambda ms: any(isinstance(m, Heartbeat) for m in ms), WAIT_S)

        def sent(n: int) -> bool:  # as in the failed-switch test below: no drop under load
            return rx.wait_for(lambda ms: sum(len(b.steps) for b in batches(rx)) >= n, WAIT_S)

        run_steps(mon, model, opt, 3)
        assert sent(2)  # flushed at step 2; step 3 waits in the buffer
        mon._on_takeover(Takeover(frozenset({0}), time.time()))  # as the shipper thread does
        run_steps(mon, model, opt, 4)
        assert sent(6)
        mon._on_takeover(Takeover(frozenset({7}), time.time()))  # rank 0 is back
        run_steps(mon, model, opt, 3)
        mon.close()
        assert rx.wait_for(lambda ms: sum(len(b.steps) for b in batches(rx)) >= 10, WAIT_S)
    schemas = {b.schema_id: b.schema for b in batches(rx) if b.schema is not None}
    steps = [b for b in batches(rx) if b.schema_id != STATS_SCHEMA_ID]
    sent = [(step, schemas[b.schema_id].layers) for b in steps for step in b.steps]
    # Taken at the next log() (step 4, already read without layers): from step 5 on.
    assert sent == [(n, LAYERS if 5 <= n <= 8 else ()) for n in range(1, 11)]
    assert len({b.schema_id for b in steps}) == 2  # each mode its own schema id
    quiet = next(s for s in schemas.values() if not s.layers)
    assert "s/grad_nonfinite" in quiet.columns  # the flag of a rank without layers
    # Weight norms too, only while it reports (cadence steps 6 and 8 of every 2).
    stats = [b.steps[0] for b in batches(rx) if b.schema_id == STATS_SCHEMA_ID]
    assert stats and set(stats) <= {6, 8}, stats
    assert mon.stats.steps_dropped == 0 and mon.stats.stats_dropped == 0


def test_a_reporter_told_it_is_silent_stops_and_no_layout_ignores_takeovers() -> None:
    with Receiver() as rx:
        reporter, _, _ = watched(rx, 0, layout="dp=2")
        reporter._on_takeover(Takeover(frozenset({0}), time.time()))
        assert reporter._want_layers is False  # rank 1 reports for it now
        reporter._on_takeover(Takeover(frozenset({0, 1}), time.time()))
        assert reporter._want_layers is True  # every replica silent: report anyway
        reporter.close()
        plain, _, _ = watched(rx, 1)
        plain._on_takeover(Takeover(frozenset({0}), time.time()))
        assert plain._want_layers is True  # no layout: every rank reports anyway
        plain.close()


def test_a_switch_that_fails_leaves_the_rank_as_it_was() -> None:
    with Receiver() as rx:
        mon, model, opt = watched(rx, 1, layout="dp=2")

        def no_memory(reports: bool, pool_size: int) -> None:
            raise RuntimeError("out of memory")

        mon._layer_mode = no_memory
        assert rx.wait_for(lambda ms: any(isinstance(m, Heartbeat) for m in ms), WAIT_S)

        def sent(n: int) -> bool:
            # Each pair of steps arrives before the next: flushing every step in a tight
            # loop could outrun the shipper's pool of host buffers on a loaded machine,
            # and the agent drops a batch rather than wait (a drop is not what this tests).
            return rx.wait_for(lambda ms: sum(len(b.steps) for b in batches(rx)) >= n, WAIT_S)

        run_steps(mon, model, opt, 2)
        assert sent(2)
        mon._on_takeover(Takeover(frozenset({0}), time.time()))
        run_steps(mon, model, opt, 2)
        assert sent(4)
        mon._on_takeover(Takeover(frozenset({0}), time.time() + 1))  # repeated: ignored now
        run_steps(mon, model, opt, 2)
        mon.close()
        assert sent(6)
        assert rx.wait_for(lambda ms: any(getattr(m, "kind", "") == "degraded" for m in ms), WAIT_S)
    schemas = {b.schema_id: b.schema for b in batches(rx) if b.schema is not None}
    assert [schemas[b.schema_id].layers for b in batches(rx)] == [()] * 6
    assert mon.stats.disabled is None and mon._want_layers is False
