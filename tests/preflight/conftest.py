"""One torch thread for the preflight tests: tiny models gain nothing from more, and on a
shared 2-core machine extra threads only contend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
