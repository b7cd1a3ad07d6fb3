"""Model tests run tiny tensors: one intra-op thread avoids OpenMP spin-wait stalls when the
cores are shared (a 2-thread pool on a busy 2-core machine was 10-100x slower)."""

import pytest

from tests.threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread_seeded():
    with one_thread(seed=0):
        yield
