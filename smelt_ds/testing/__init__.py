"""Test utilities shipped with the package (multi-process CPU tests, like OLMo-core's ``testing``)."""

from smelt_ds.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
