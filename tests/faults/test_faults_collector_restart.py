"""A collector killed with SIGKILL mid-run and restarted on the same endpoint loses nothing
it could have kept, and every step is accounted for.

A real training loop with the agent keeps running throughout. The first collector
process has an alert pending (its receiver answers 503) when it is killed; while it
is down the agent drops and counts steps; a second process on the same port and data
dir is started, the agent reconnects by itself and resends its schema, the pending
alert is delivered, a NaN logged while the collector was down is paged (the agent kept
its batch), and an alert that fires after the restart is delivered too. Both
collectors record traces (``--record``), so what arrived can be counted step by step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gradwatch.collector.receiver import WebhookReceiver
from tests.faults.support import (
    CollectorProcess,
    Loop,
    free_port,
    scrape,
    value,
    wait_metric,
)

JOB = "restart"
FLUSH = 2  # steps per batch: small, so a few seconds of training make many batches
SEND_HWM = 16  # the agent's default: batches ZeroMQ may hold for a peer
# Batches the killed collector had taken off its socket but not yet recorded: its receive
# loop takes in what arrived every RECEIVE_EVERY handled messages (collector/priority.py),
# and at this loop's rate (a batch every few ms) that is a handful at most.
RECEIVED_UNRECORDED = 4


def recorded_steps(trace_dir: Path) -> list[int]:
    steps: list[int] = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("type") == "step":
                steps.append(int(record["step"]))
    return steps


def closed_at(trace_dir: Path) -> int | None:
    """The step the agent's ``closed`` note names, once the collector has recorded it."""
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("type") == "event" and record.get("note") == "closed":
                return int(record["step"])
    return None


def wait_closed(trace_dir: Path, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (step := closed_at(trace_dir)) is None:
        assert time.monotonic() < deadline, f"no 'closed' note recorded after {timeout}s"
        time.sleep(0.05)  # polling another process's trace file; nothing to block on
    return step


def job_step(url: str) -> float:
    return value(scrape(url), "gradwatch_job_step", training_job=JOB) or 0.0


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_collector_killed_mid_run_then_restarted_loses_only_what_it_could_not_hold(
    tmp_path: Path,
) -> None:
    port = free_port()
    data_dir = tmp_path / "state"
    trace_a, trace_b = tmp_path / "trace-a", tmp_path / "trace-b"
    with WebhookReceiver() as receiver:
        receiver.fail_with(503)
        first = CollectorProcess(
            tmp_path,
            "first",
            port,
            ["--webhook", receiver.url, "--data-dir", str(data_dir), "--record", str(trace_a)],
        )
        second = CollectorProcess(
            tmp_path,
            "second",
            port,
            ["--webhook", receiver.url, "--data-dir", str(data_dir), "--record", str(trace_b)],
        )
        with first:
            loop = Loop(JOB, first.endpoint, flush_every=FLUSH, heartbeat_every=0.2, stats_every=0)
            try:
                loop.run_until(lambda: job_step(first.metrics_url) >= 10)
                loop.step(nan_loss=True)
                nan_before = loop.mon.step
                # The alert is stored, then its first delivery fails: it is pending.
                loop.run_until(lambda: len(receiver.attempts) >= 1)
                (failed,) = receiver.attempts[:1]
                first.kill9()
                killed_at = loop.mon.step
                dropped_at_kill = loop.mon.stats.steps_dropped
                # Down: the agent notices the lost peer and drops (and counts) what it logs,
                # but for a batch with a NaN: kept and sent first once a collector is back
                # (agent/holdback.py). ZeroMQ may take batches into the dead peer's pipe
                # until its disconnect is seen, so the NaN comes after a send has failed.
                failed_sends = loop.mon._counters.steps_dropped_send
                loop.run_until(lambda: loop.mon._counters.steps_dropped_send > failed_sends)
                loop.step(nan_loss=True)
                nan_down = loop.mon.step
                loop.run_until(
                    lambda: (
                        loop.mon.stats.steps_dropped >= dropped_at_kill + 40
                        and loop.mon.stats.steps_held > 0
                    )  # the shipper got to it
                )
                assert max(loop.log_seconds) < 0.25, "mon.log blocked while the collector was down"
                receiver.fail_with(None)
                with second:
                    restarted_at = loop.mon.step
                    # Same endpoint: the agent reconnects by itself; steps decode at once.
                    loop.run_until(lambda: job_step(second.metrics_url) > restarted_at + 4)
                    pending = receiver.wait_for(lambda got: len(got) >= 1, timeout=30)[0]
                    loop.step(nan_loss=True)
                    nan_after = loop.mon.step
                    loop.run_until(
                        lambda: any(
                            b["step"] == nan_after and b["state"] == "firing"
                            for b in receiver.bodies
                        )
                    )
                    loop.mon.close()
                    stats = loop.mon.stats
                    # The note is the agent's last message: once it is recorded, so is every
                    # batch that reached the collector. The loop never waits for the shipper,
                    # so when it outruns it its very last batches may be dropped (and counted):
                    # the metric is the last step recorded, the note names the last logged.
                    closed = wait_closed(trace_b)
                    wait_metric(
                        second.metrics_url,
                        "gradwatch_job_step",
                        lambda v: v == recorded_steps(trace_b)[-1],
                        training_job=JOB,
                    )
                    samples = scrape(second.metrics_url)
                    assert second.terminate() == 0, second.stderr
            finally:
                loop.mon.close()

    # The alert pending at the kill arrived after the restart, under the same id.
    delivered = {r.headers["webhook-id"]: r.body for r in receiver.requests}
    assert failed.headers["webhook-id"] in delivered
    assert (pending["rule"], pending["step"]) == ("NonFiniteGradients", nan_before)
    assert delivered[failed.headers["webhook-id"]]["step"] == nan_before
    # The alert that fired after the restart was delivered too.
    assert any(b["step"] == nan_after and b["state"] == "firing" for b in delivered.values())
    # So was the NaN logged while it was down (its batch kept by the agent).
    assert any(b["step"] == nan_down and b["state"] == "firing" for b in delivered.values())

    # The agent: every logged step was sent or dropped, and the drops cover the outage.
    assert stats.steps_logged == loop.mon.step
    assert stats.steps_sent + stats.steps_dropped == stats.steps_logged
    assert stats.steps_dropped >= 40
    assert stats.disabled is None

    # The collectors: what they recorded plus what the agent dropped is everything,
    # short of at most what was in flight when the first one died: what ZeroMQ held for
    # it and what it had received but not yet recorded.
    got_a, got_b = recorded_steps(trace_a), recorded_steps(trace_b)
    # (Not necessarily contiguous: the agent drops, and counts, whatever it cannot send.)
    assert got_a == sorted(set(got_a)) and nan_before in got_a and max(got_a) <= killed_at
    assert got_b == sorted(set(got_b)) and nan_after <= got_b[-1] <= loop.mon.step
    assert closed == loop.mon.step  # the collector heard where the run ended
    # What was logged while down was dropped, but for the batch with the NaN, which
    # arrived first.
    held = [s for s in got_b if s <= restarted_at - 2 * FLUSH]
    assert nan_down in held and len(held) <= FLUSH, (nan_down, held)
    assert got_b[: len(held)] == held
    lost_in_flight = stats.steps_sent - len(got_a) - len(got_b)
    assert 0 <= lost_in_flight <= (SEND_HWM + RECEIVED_UNRECORDED) * FLUSH
    # The restarted collector knows what the agent could not ship, and lost no batch.
    assert (
        value(samples, "gradwatch_agent_dropped_steps_total", training_job=JOB)
        == stats.steps_dropped
    )
    assert value(samples, "gradwatch_ingest_lost_batches_total", training_job=JOB) in (None, 0.0)
    # The schema was resent: the restarted collector decoded steps (got_b) from the start.
    # At most one batch may race ahead of the handshake event the agent watches (a
    # microseconds-wide window in agent/shipper.py, reported separately).
    assert (value(samples, "gradwatch_ingest_rejected_total", reason="unknown_schema") or 0) <= 1
