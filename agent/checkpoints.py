"""The checkpoints this process vouched for: the only places a rollback may load from.

A rollback command is signed by the collector, but the collector learns of
checkpoints from whatever reaches its ingest socket, and in the dev profile
anyone can send there. So the agent keeps its own ledger: every
``mon.checkpoint_saved(step, path)`` records the path (resolved, and confined to
the checkpoint root) and a digest of its content; a rollback is accepted only
to a checkpoint this ledger recorded, at the same step, whose resolved path is
unchanged and still under the root, and whose digest still matches.

Nothing here runs on the training thread. The shipper thread hands each save
and each authenticated command to the ledger's own thread, which hashes: a
multi-GB checkpoint costs that thread a few seconds of reading (hashlib drops
the GIL while it hashes), never the loop. What is hashed:

* a file of at most :data:`FULL_HASH_MAX_BYTES` (default 512 MiB): its size,
  modification time and whole content (SHA-256);
* a larger file: its size, modification time (ns), the first and last
  :data:`EDGE_BYTES` and :data:`SAMPLES` evenly spaced blocks of
  :data:`SAMPLE_BYTES`: a bounded read (~20 MiB) whatever the size. It detects
  a replaced, truncated, rewritten or re-saved file (any write moves the
  modification time); it does not detect an in-place edit of unsampled bytes
  by someone who also resets the modification time, i.e. who can already write
  the checkpoint directory, and so could poison the job anyway. SECURITY.md
  states this trade-off;
* a directory (sharded checkpoints): every regular file under it, in name
  order, each as above, at most :data:`MAX_DIR_FILES` files; a symbolic link
  leaving the root makes the checkpoint unusable.

Example::

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> (root / "c.pt").write_bytes(b"weights")
    7
    >>> digest_of(root / "c.pt") == digest_of(root / "c.pt")
    True
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_ROOT = "GRADWATCH_CHECKPOINT_ROOT"
ENV_FULL_HASH = "GRADWATCH_CHECKPOINT_FULL_HASH_MAX_BYTES"
FULL_HASH_MAX_BYTES = 512 * 1024 * 1024  # ~0.3-0.5 s of SHA-256 on one core
EDGE_BYTES = 8 * 1024 * 1024  # headers and trailers (zip directory) change first
SAMPLE_BYTES = 64 * 1024
SAMPLES = 64
MAX_DIR_FILES = 10_000
MAX_ENTRIES = 1024  # saves remembered; the oldest are forgotten first
MAX_QUEUED = 64  # saves and commands waiting for the hashing thread
CHUNK = 1024 * 1024

# Why a rollback was refused; each is counted and reported to the collector.
REASONS = ("unvouched", "outside_root", "changed", "unreadable", "busy")


class Unusable(Exception):
    """A checkpoint that cannot be vouched for; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def checkpoint_root(env: dict[str, str] | None = None) -> Path:
    """``$GRADWATCH_CHECKPOINT_ROOT`` resolved, else the working directory."""
    raw = (os.environ if env is None else env).get(ENV_ROOT) or os.getcwd()
    return Path(os.path.realpath(raw))


def full_hash_max_bytes(env: dict[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get(ENV_FULL_HASH)
    try:
        return max(0, int(raw)) if raw else FULL_HASH_MAX_BYTES
    except ValueError:
        logger.warning(
            "gradwatch: %s=%r is not a number of bytes; using %d",
            ENV_FULL_HASH,
            raw,
            FULL_HASH_MAX_BYTES,
        )
        return FULL_HASH_MAX_BYTES


def confined(path: str, root: Path) -> Path:
    """``path`` resolved (symbolic links followed); raises :class:`Unusable` outside ``root``."""
    real = Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        raise Unusable(
            "outside_root",
            f"{path} resolves to {real}, outside the checkpoint root "
            f"{root}; save checkpoints under it or set {ENV_ROOT}",
        )
    return real


def digest_of(path: Path, full_max: int = FULL_HASH_MAX_BYTES, root: Path | None = None) -> str:
    """The content digest of a checkpoint file or directory (see the module doc)."""
    h = hashlib.sha256()
    try:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            if len(files) > MAX_DIR_FILES:
                raise Unusable(
                    "unreadable", f"{path} holds {len(files)} files, more than {MAX_DIR_FILES}"
                )
            for file in files:
                if root is not None:
                    confined(str(file), root)
                h.update(str(file.relative_to(path)).encode("utf-8", "surrogateescape") + b"\0")
                h.update(_file_digest(file, full_max))
        else:
            h.update(_file_digest(path, full_max))
    except OSError as exc:
        raise Unusable("unreadable", f"cannot read {path}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def _file_digest(path: Path, full_max: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        if st.st_size <= full_max:
            while chunk := f.read(CHUNK):
                h.update(chunk)
            return h.digest()
        h.update(b"sampled")
        h.update(f.read(EDGE_BYTES))
        for i in range(SAMPLES):
            f.seek(EDGE_BYTES + (st.st_size - 2 * EDGE_BYTES) * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
        f.seek(st.st_size - EDGE_BYTES)
        h.update(f.read(EDGE_BYTES))
    return h.digest()


@dataclass(frozen=True, slots=True)
class Vouched:
    """One save this process made: its step, path as given, resolved path and digest."""

    step: int
    path: str
    real: Path
    digest: str


@dataclass(frozen=True, slots=True)
class _Save:
    step: int
    path: str


@dataclass(frozen=True, slots=True)
class _Check:
    item: object  # the command, handed back to ``accept`` or ``refuse`` as it came
    path: str
    step: int


class CheckpointLedger:
    """Records saves and checks rollback targets on its own thread; see the module doc.

    ``accept(item)`` is called for a command whose checkpoint passed every
    check, ``refuse(item, reason, detail)`` otherwise; both from the ledger's
    thread. ``record`` and ``check`` never block and never raise.
    """

    def __init__(
        self,
        root: Path,
        accept: Callable[[object], None],
        refuse: Callable[[object, str, str], None],
        full_max: int = FULL_HASH_MAX_BYTES,
    ) -> None:
        self.root = root
        self._accept, self._refuse, self._full_max = accept, refuse, full_max
        self._entries: OrderedDict[str, Vouched] = OrderedDict()  # by path as given
        self._lock = threading.Lock()
        self._work: queue.Queue[_Save | _Check | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._closed = False

    def record(self, step: int, path: str) -> None:
        """Vouch for the checkpoint of ``step`` at ``path`` (hashed on the ledger's thread)."""
        self._put(
            _Save(step, path),
            lambda: logger.warning(
                "gradwatch: checkpoint %s (step %d) was not recorded: %d saves and commands are "
                "already waiting to be hashed; a rollback to it will be refused",
                path,
                step,
                MAX_QUEUED,
            ),
        )

    def check(self, item: object, path: str, step: int) -> None:
        """Check a command's target, then ``accept`` or ``refuse`` it."""
        self._put(
            _Check(item, path, step),
            lambda: self._refuse(
                item, "busy", f"{MAX_QUEUED} saves and commands are waiting to be hashed"
            ),
        )

    def entries(self) -> list[Vouched]:
        with self._lock:
            return list(self._entries.values())

    def wait_idle(self, timeout: float) -> bool:
        """For tests: True once everything queued so far was handled (bounded wait)."""
        done = threading.Event()
        self._put(_Check(done, "", -1), done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            try:
                self._work.put_nowait(None)
            except queue.Full:
                pass  # a daemon thread: it dies with the process
            self._thread = None

    def _put(self, item: _Save | _Check, full: Callable[[], None]) -> None:
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gradwatch-checkpoints", daemon=True
            )
            self._thread.start()
        try:
            self._work.put_nowait(item)
        except queue.Full:
            full()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            try:
                if isinstance(item, _Save):
                    self._vouch(item)
                elif isinstance(item.item, threading.Event):
                    item.item.set()
                else:
                    self._verify(item)
            except Exception as exc:  # never kill the thread: later saves still count
                logger.error(
                    "gradwatch: checking checkpoint %s failed (%s: %s); please report "
                    "this as a gradwatch bug",
                    getattr(item, "path", "?"),
                    type(exc).__name__,
                    exc,
                )

    def _vouch(self, save: _Save) -> None:
        try:
            real = confined(save.path, self.root)
            digest = digest_of(real, self._full_max, self.root)
        except Unusable as exc:
            logger.warning(
                "gradwatch: checkpoint %s (step %d) cannot be a rollback target: %s",
                save.path,
                save.step,
                exc,
            )
            return
        with self._lock:
            self._entries[save.path] = Vouched(save.step, save.path, real, digest)
            self._entries.move_to_end(save.path)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)

    def _verify(self, check: _Check) -> None:
        with self._lock:
            entry = self._entries.get(check.path)
        try:
            if entry is None or entry.step != check.step:
                raise Unusable(
                    "unvouched",
                    f"this process never saved {check.path!r} as the "
                    f"checkpoint of step {check.step} (a forged or stale report)",
                )
            if confined(check.path, self.root) != entry.real:
                raise Unusable("changed", f"{check.path} now resolves elsewhere than when saved")
            if digest_of(entry.real, self._full_max, self.root) != entry.digest:
                raise Unusable("changed", f"{check.path} changed since it was saved")
        except Unusable as exc:
            self._refuse(check.item, exc.reason, str(exc))
            return
        self._accept(check.item)
