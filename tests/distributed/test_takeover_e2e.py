"""Takeover end to end: a real collector, four real agent processes, loopback, no GPU.

Layout ``dp=2,tp=2``: ranks 0 and 1 report the layers of TP shards 0 and 1;
ranks 2 and 3 (the second replica) send none. Rank 0 is killed (SIGKILL: no
goodbye). After the ``RankSilent`` threshold (3 s here, from the rule file, as
an operator would set it) the collector publishes a signed takeover naming
rank 0; rank 2 (shard 0's next replica) starts sending layers at a step
boundary, rank 3 does not change, and the job-wide step has every layer again.
Rank 0 restarts: the takeover ends, rank 0 reports, rank 2 stops.

Every wait is a condition polled against a deadline; the delays are printed
(``pytest -s``) and asserted only against generous bounds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from tests.distributed.harness import REPO_ROOT, Launch
from tests.distributed.takeover_worker import LAYERS

pytestmark = pytest.mark.slow

JOB = "takeover"
LAYOUT = "dp=2,tp=2"
WORLD = 4
KEY = "takeover-test-key-0123456789abcdef"
SILENT_S = 3.0
STEP_S = 0.1
HEARTBEAT_S = 0.25  # takeover_worker.py's heartbeat_every
START_S = 90.0  # four fresh processes importing torch on a loaded 2-core machine
WAIT_S = 30.0
POLL_S = 0.05
RULES = f"""
groups:
  - name: liveness
    rules:
      - alert: RankSilent
        detector: silent_rank
        params:
          silent_seconds: {SILENT_S}
        for: 1
        severity: critical
        category: stalled
        actions: [notify]
"""


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> float:
    """Poll ``check`` until it holds; when it held (monotonic). Fails the test at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_S)  # polling the collector's state from outside its thread
    return time.monotonic()


class Job:
    """The ranks' processes; a rank can be killed and started again."""

    def __init__(self, server: Server, out: Path, t0: float) -> None:
        self.server, self.out, self.t0 = server, out, t0
        self.stop_file = out / "stop"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.launch = Launch([], out)  # kills every process it holds when the test ends
        self.started = 0

    def start(self, rank: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "tests.distributed.takeover_worker",
            "--endpoint",
            self.server.bound_endpoint,
            "--command-endpoint",
            str(self.server.command_endpoint),
            "--job",
            JOB,
            "--layout",
            LAYOUT,
            "--t0",
            str(self.t0),
            "--step-s",
            str(STEP_S),
            "--until",
            str(time.time() + 3 * START_S),
            "--stop-file",
            str(self.stop_file),
        ]
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
            "GRADWATCH_COMMAND_KEY": KEY,
        }
        index = self.started  # stderr of the n-th process started: rank{n}.stderr
        self.started += 1
        with (
            open(self.out / f"rank{index}.stdout", "wb") as out,
            open(self.out / f"rank{index}.stderr", "wb") as err,
        ):
            proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, start_new_session=True
            )
        self.procs[rank] = proc
        self.launch.procs.append(proc)

    def kill(self, rank: int) -> None:
        proc = self.procs.pop(rank)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def layers_of(self, rank: int) -> tuple[str, ...] | None:
        """The layers of ``rank``'s newest step at the collector (None: no step yet)."""
        job = self.server.state.job(JOB)
        state = job.ranks.get(rank) if job is not None else None
        latest = state.latest if state is not None else None
        return None if latest is None else latest.layers

    def whole(self) -> tuple[int, tuple[str, ...]] | None:
        """The newest assembled step: its number and layers."""
        job = self.server.state.job(JOB)
        step = job.whole if job is not None else None
        return None if step is None else (step.step, step.layers)

    def reporters(self) -> set[int]:
        return {r for r in range(WORLD) if self.layers_of(r)}


def test_silent_reporter_taken_over_and_back(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        rules=rules,
        command_listen="tcp://127.0.0.1:*",
        command_key=KEY,
        assembly_deadline_seconds=1.0,
    )
    server = Server(config, registry=CollectorRegistry())
    server.start()
    job = Job(server, tmp_path, t0=time.time())
    try:
        assert server.takeovers.silent_seconds == SILENT_S  # the rule's threshold
        for rank in range(WORLD):
            job.start(rank)

        def whole_after(step: int) -> bool:
            whole = job.whole()
            return whole is not None and whole[0] > step and whole[1] == LAYERS

        def step_now() -> int:
            return int((time.time() - job.t0) / STEP_S)

        # Before: one replica per shard reports, and the job-wide step has every layer.
        wait_until(
            "every rank's steps, ranks 0 and 1 reporting",
            lambda: (
                all(job.layers_of(r) is not None for r in range(WORLD))
                and job.reporters() == {0, 1}
                and whole_after(0)
            ),
            START_S,
        )
        killed = time.monotonic()
        at_kill = step_now()
        job.kill(0)
        told = wait_until(
            "the takeover command", lambda: server.takeovers.in_force() == {JOB: {0}}, WAIT_S
        )
        at_told = step_now()
        # Rank 0's newest step at the collector still has layers: it is dead, not quiet.
        taken = wait_until(
            "rank 2's layers in the job-wide step",
            lambda: job.reporters() == {0, 1, 2} and whole_after(at_told),
            WAIT_S,
        )
        assert job.layers_of(2) == LAYERS and not job.layers_of(3)  # only shard 0 changed
        counts = server.assembler.counts()[JOB]
        assert counts.inexact > 0  # steps without shard 0's layers while rank 0 was silent

        # Rank 0 comes back (a restarted process): the takeover ends.
        job.start(0)
        back = wait_until("rank 0's return", lambda: JOB not in server.takeovers.in_force(), WAIT_S)
        at_back = step_now()
        wait_until(
            "rank 0 reporting again and rank 2 quiet",
            lambda: job.reporters() == {0, 1} and whole_after(at_back),
            WAIT_S,
        )
        ended = time.monotonic()
        sent = server.takeovers.counts()
        assert sent["start"] == 1 and sent["end"] == 1
        print(
            f"\ntakeover: rank 0 killed at step {at_kill}; command after {told - killed:.2f} s "
            f"(RankSilent threshold {SILENT_S:.1f} s); every layer in the job-wide step again "
            f"after {taken - killed:.2f} s; after rank 0's return, takeover ended "
            f"{back - taken:.2f} s later and rank 2 quiet {ended - back:.2f} s after that; "
            f"commands sent {sent}"
        )
        # Never before the threshold. Silence counts from rank 0's last message, which may
        # precede the kill by one heartbeat (0.25 s) or one flush (2 steps of 0.1 s).
        assert told - killed >= SILENT_S - max(HEARTBEAT_S, 2 * STEP_S)
    finally:
        job.stop_file.touch()
        for proc in job.procs.values():
            try:
                proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # killed below, with its stderr kept in tmp_path
        job.launch.kill()
        assert server.stop(), "the collector did not stop cleanly"
