"""One intra-op torch thread for a test's duration: the shared body of the test packages'
``_one_thread`` fixtures (a 2-thread pool on a busy 2-core machine spins for seconds per op)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread(seed: int | None = None) -> Iterator[None]:
    """``torch.set_num_threads(1)`` (and ``torch.manual_seed(seed)`` unless None) inside the block;
    the previous thread count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(before)
