"""The agent's checkpoint ledger: a rollback only to a checkpoint this process saved, unchanged."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gradwatch.agent.checkpoints import CheckpointLedger, digest_of

WAIT_S = 10.0


class Outcomes:
    """What the ledger decided, per command, from its own thread."""

    def __init__(self) -> None:
        self.accepted: list[Any] = []
        self.refused: list[tuple[Any, str, str]] = []
        self.done = threading.Semaphore(0)

    def accept(self, item: Any) -> None:
        self.accepted.append(item)
        self.done.release()

    def refuse(self, item: Any, reason: str, detail: str) -> None:
        self.refused.append((item, reason, detail))
        self.done.release()

    def next_reason(self, ledger: CheckpointLedger, item: Any, path: str, step: int) -> str:
        """Check one command and return 'accepted' or the refusal's reason (bounded wait)."""
        ledger.check(item, path, step)
        assert self.done.acquire(timeout=WAIT_S), "the ledger never decided"
        if self.accepted and self.accepted[-1] is item:
            return "accepted"
        return self.refused[-1][1]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    return Path(os.path.realpath(tmp_path / "ckpt"))


def ledger_of(root: Path, out: Outcomes, full_max: int = 1 << 20) -> CheckpointLedger:
    return CheckpointLedger(root, out.accept, out.refuse, full_max)


def test_only_what_this_process_saved_and_only_unchanged(root: Path, tmp_path: Path) -> None:
    out = Outcomes()
    ledger = ledger_of(root, out)
    good = root / "100.pt"
    good.write_bytes(b"weights at 100")
    ledger.record(100, str(good))
    assert ledger.wait_idle(WAIT_S)
    assert [e.step for e in ledger.entries()] == [100]
    assert out.next_reason(ledger, "cmd-1", str(good), 100) == "accepted"
    # A path the job never reported (finding 1's forged /tmp/attacker-controlled.pt).
    forged = tmp_path / "attacker-controlled.pt"
    forged.write_bytes(b"pickle bomb")
    assert out.next_reason(ledger, "cmd-2", str(forged), 100) == "unvouched"
    # The right path at another step: the command does not describe this save.
    assert out.next_reason(ledger, "cmd-3", str(good), 200) == "unvouched"
    # Replaced after the save (same size, different bytes).
    good.write_bytes(b"WEIGHTS AT 100")
    assert out.next_reason(ledger, "cmd-4", str(good), 100) == "changed"
    good.unlink()
    assert out.next_reason(ledger, "cmd-5", str(good), 100) == "unreadable"
    ledger.close()


def test_confined_to_the_root_symlinks_included(root: Path, tmp_path: Path) -> None:
    out = Outcomes()
    ledger = ledger_of(root, out)
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"x")
    ledger.record(1, str(outside))  # the job itself saved outside the root: not a target
    link = root / "2.pt"
    link.symlink_to(outside)  # a link inside the root that leaves it
    ledger.record(2, str(link))
    assert ledger.wait_idle(WAIT_S) and ledger.entries() == []
    assert out.next_reason(ledger, "a", str(outside), 1) == "unvouched"
    # Vouched while a plain file, then swapped for a link that leaves the root.
    swapped = root / "3.pt"
    swapped.write_bytes(b"y")
    ledger.record(3, str(swapped))
    assert ledger.wait_idle(WAIT_S)
    swapped.unlink()
    swapped.symlink_to(outside)
    assert out.next_reason(ledger, "b", str(swapped), 3) == "outside_root"
    ledger.close()


def test_large_files_get_a_bounded_sampled_digest(root: Path) -> None:
    big = root / "big.pt"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB without writing them
    sampled = digest_of(big, full_max=1 << 20)
    with open(big, "r+b") as f:  # rewriting a header byte changes the digest...
        f.write(b"\x01")
    assert digest_of(big, full_max=1 << 20) != sampled
    before = digest_of(big, full_max=1 << 20)
    stat = big.stat()
    os.truncate(big, stat.st_size - 1)  # ...and so does truncation
    assert digest_of(big, full_max=1 << 20) != before


def test_directories_hash_every_file(root: Path) -> None:
    shard = root / "step-10"
    shard.mkdir()
    (shard / "a.distcp").write_bytes(b"a")
    (shard / "b.distcp").write_bytes(b"b")
    first = digest_of(shard, root=root)
    (shard / "b.distcp").write_bytes(b"B")
    assert digest_of(shard, root=root) != first


def test_hashing_never_runs_on_the_callers_thread(root: Path) -> None:
    """record() only queues: a checkpoint whose read would block forever (a FIFO with no
    writer) returns at once, and the ledger's own thread is the one that waits."""
    fifo = root / "blocking.pt"
    os.mkfifo(fifo)
    out = Outcomes()
    ledger = ledger_of(root, out)
    ledger.record(5, str(fifo))  # returns: the caller (the shipper thread) never reads
    assert not ledger.wait_idle(0.2)  # the ledger's thread is blocked opening the FIFO
    with open(fifo, "wb") as writer:  # unblock it with a writer, then an empty content
        writer.write(b"")
    assert ledger.wait_idle(WAIT_S)
    ledger.close()
