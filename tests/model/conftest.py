"""Model tests run tiny tensors: one intra-op thread avoids OpenMP spin-wait stalls when the
cores are shared (a 2-thread pool on a busy 2-core machine was 10-100x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_seeded():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)
