"""The collector's disk fills up mid-run: one clear error per store, a metric, and alerting on.

How the disk is made full: ``prlimit(RLIMIT_FSIZE, 0)`` on the running collector
process. From then on the kernel refuses every write that would grow a file of
that process (``EFBIG``, which SQLite reports as a disk I/O error) exactly as a
full disk refuses it, and nothing else on the machine is affected. Why not the
alternatives: ``chmod 0500`` does not stop root (these tests may run as root,
in containers they usually do) and does not affect files already open; a
loop-mounted or size-capped tmpfs needs ``mount`` privileges CI rarely has;
monkeypatching ``sqlite3`` would only test the patch. RLIMIT_FSIZE works for
any user, mid-run, on the real process with its real files.

Where ``mount`` is permitted (root, a privileged container), the same test also
runs against a real full filesystem: the collector's directories on a 2 MiB
tmpfs that a filler file then fills (``ENOSPC``, "database or disk is full").
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gradwatch.collector.receiver import WebhookReceiver
from tests.faults.support import (
    CollectorProcess,
    Loop,
    free_port,
    scrape,
    value,
)

JOB = "diskfull"


def disk_full(pid: int) -> None:
    """Every write growing a file of ``pid`` fails from now on (its open files included)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))


FullDisk = tuple[Path, Callable[[int], None], str]


@pytest.fixture(params=["rlimit-fsize", "tmpfs-enospc"])
def full_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FullDisk]:
    """A directory for the collector's files, and ``fill(pid)``: from then on it is full."""
    if not sys.platform.startswith("linux"):
        pytest.skip("prlimit(2) and tmpfs are Linux")
    if request.param == "rlimit-fsize":
        yield tmp_path / "disk", disk_full, request.param
        return
    root = tmp_path / "tmpfs"
    root.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the rlimit-fsize case covers this fault")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"mount is not permitted here ({mounted.stderr.strip()}); "
            "the rlimit-fsize case covers this fault"
        )
    try:
        yield root, lambda pid: fill(root / "filler"), request.param
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem has no room left."""
    with path.open("wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def step_reached(url: str, step: int) -> bool:
    return (value(scrape(url), "gradwatch_job_step", training_job=JOB) or 0) >= step


def test_a_full_disk_mid_run_is_logged_once_counted_and_alerting_goes_on(
    tmp_path: Path, full_disk: FullDisk
) -> None:
    disk, make_full, how = full_disk
    data_dir, trace_dir = disk / "state", disk / "traces"
    with (
        WebhookReceiver() as receiver,
        CollectorProcess(
            tmp_path,
            "full",
            free_port(),
            ["--webhook", receiver.url, "--data-dir", str(data_dir), "--record", str(trace_dir)],
        ) as collector,
    ):
        loop = Loop(JOB, collector.endpoint, flush_every=5, stats_every=0)
        try:
            loop.run_until(lambda: step_reached(collector.metrics_url, 3))
            assert collector.proc is not None
            recorded = (trace_dir / f"{JOB}.jsonl").stat().st_size
            assert recorded > 0 and (data_dir / "actions.sqlite3").exists()

            make_full(collector.proc.pid)
            loop.mon.checkpoint_saved(loop.mon.step, "ckpt/full-1.pt")
            loop.step(nan_loss=True)
            nan_step = loop.mon.step
            # Alerting goes on: the alert leaves through the outbox, now in memory.
            loop.run_until(
                lambda: any(
                    b["step"] == nan_step and b["state"] == "firing" for b in receiver.bodies
                )
            )
            # More of the same failures are counted, not logged again.
            loop.mon.checkpoint_saved(loop.mon.step, "ckpt/full-2.pt")
            loop.run_until(
                lambda: any(
                    b["step"] == nan_step and b["state"] == "resolved" for b in receiver.bodies
                )
            )
            # Ingest goes on: steps still reach /metrics.
            last = loop.mon.step
            loop.run_until(lambda: step_reached(collector.metrics_url, last))
            samples = scrape(collector.metrics_url)
            loop.mon.close()
            assert loop.mon.stats.events_dropped == 0
            assert collector.terminate() == 0, collector.stderr
        finally:
            loop.mon.close()

    def errors(store: str) -> float | None:
        return value(samples, "gradwatch_store_errors_total", store=store)

    assert errors("outbox") == 1  # the first failed write moved the outbox to memory
    assert errors("trace") == 1  # recording switched itself off
    assert errors("actions") == 2  # each checkpoint it could not store
    assert value(samples, "gradwatch_ingest_rejected_total", reason="internal") == 0
    # The trace keeps whole lines only: a full tmpfs still takes what fits its last page,
    # maybe half a line, and the recorder cuts that off again.
    trace = (trace_dir / f"{JOB}.jsonl").read_text(encoding="utf-8")
    assert trace.endswith("\n") and all(json.loads(line) for line in trace.splitlines())
    if how == "rlimit-fsize":
        assert len(trace) == recorded  # not one byte more
    log = collector.stderr
    for line in (
        "cannot write the alert outbox",
        "trace recording switched off",
        "in the actions store",
    ):
        assert log.count(line) == 1, f"{line!r} logged {log.count(line)} times:\n{log}"
    assert "restart the collector" in log
    assert "Traceback" not in log
