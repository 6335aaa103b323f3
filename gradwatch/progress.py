"""Progress bars on stderr for long commands, drawn only for a person at a terminal.

``progress(total, desc)`` returns a tqdm bar when the stream (stderr by
default) is a terminal and tqdm is installed (it comes with the ``collector``
and ``preflight`` extras), otherwise a bar that draws nothing. So a command
piped into a file, a CI log or a cluster log collector prints exactly what it
printed before, and a missing tqdm never stops a command.

``progress_lines(path, desc)`` reads a text file line by line with a bar that
advances by bytes: the size of a trace is known up front, its line count is not.

Example::

    from gradwatch.progress import progress

    with progress(total=len(items), desc="replay", unit="step") as bar:
        for item in items:
            work(item)
            bar.update(1)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Protocol, TextIO


class Bar(Protocol):
    """What a command uses of a progress bar (tqdm's names)."""

    def update(self, n: float = 1) -> bool | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Bar: ...

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class NoBar:
    """A bar that draws nothing: stderr is not a terminal, or tqdm is not installed."""

    def update(self, n: float = 1) -> None:
        """Ignore ``n``."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> NoBar:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def is_terminal(stream: TextIO) -> bool:
    """True when ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or already closed
        return False


def progress(
    total: float | None,
    desc: str,
    unit: str = "it",
    *,
    unit_scale: bool = False,
    stream: TextIO | None = None,
) -> Bar:
    """A tqdm bar on ``stream`` (default stderr) if it is a terminal, else a ``NoBar``."""
    out = sys.stderr if stream is None else stream
    if not is_terminal(out):
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety: the command runs the same without it
        return NoBar()
    # leave=False: the bar is gone when the work is done, so only results stay on screen.
    bar: Bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        file=out,
        leave=False,
        dynamic_ncols=True,
    )
    return bar


@contextmanager
def progress_lines(
    path: Path, desc: str, *, stream: TextIO | None = None
) -> Iterator[Iterator[str]]:
    """Open ``path`` as UTF-8 text; yield its lines while a bar counts the bytes read."""
    try:
        size: float | None = float(path.stat().st_size)
    except OSError:  # let open() below raise the error the caller already handles
        size = None
    with (
        path.open(encoding="utf-8") as lines,
        progress(size, desc, unit="B", unit_scale=True, stream=stream) as bar,
    ):

        def counted() -> Iterator[str]:
            for line in lines:
                # Characters, not bytes: close enough for a bar, and free (no re-encoding).
                bar.update(len(line))
                yield line

        yield counted()


__all__ = ["Bar", "NoBar", "is_terminal", "progress", "progress_lines"]
