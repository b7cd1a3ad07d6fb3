"""Test utilities shipped with the package (multi-process CPU tests, like OLMo-core's ``testing``).

``SMELT_TEST_TIMEOUT_SCALE`` (a finite number > 0, default 1) multiplies the wall-clock limits of
:func:`run_distributed`; :func:`scaled_timeout` applies it to a test's own limits.
"""

from smelt_ds.testing.distributed import (
                                          TIMEOUT_SCALE_ENV,
                                          DistributedTestError,
                                          run_distributed,
                                          scaled_timeout,
                                          timeout_scale,
)

__all__ = ["TIMEOUT_SCALE_ENV", "DistributedTestError", "run_distributed", "scaled_timeout", "timeout_scale"]
