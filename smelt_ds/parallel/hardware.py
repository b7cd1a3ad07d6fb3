"""What this machine offers a run: its training precision and its device memory.

The one place below the workflows that asks the hardware (CUDA, or the host's memory on CPU).
The analytic layer (:mod:`smelt_ds.cost`) takes both as arguments; the DeepSpeed config of a run
(:func:`smelt_ds.parallel.ds_config.build_ds_config`) and the ``zero_optimization`` section
(:mod:`smelt_ds.parallel.zero_section`) pass what this module measured.
"""

from __future__ import annotations

import psutil
import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError

__all__ = ["training_precision", "device_memory_bytes"]


def training_precision(cfg: RunConfig) -> str:
    """``bf16`` or ``fp32``: ``train.precision`` resolved for a run on this machine.

    ``auto`` is bf16 on a CUDA device that supports it and fp32 otherwise (CPU runs fp32).
    Raises ConfigError for ``bf16`` on a GPU without bf16 support. A plan for a GPU elsewhere uses
    :func:`smelt_ds.cost.precision.resolve_precision` instead.
    """
    p = cfg.train.precision  # auto | bf16 | fp32, validated when the recipe was loaded
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if p == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if p == "bf16" and not cuda_bf16 and torch.cuda.is_available():
        raise ConfigError("`train.precision` ('bf16') is not supported by this GPU: use 'fp32' or 'auto'")
    return p


def device_memory_bytes(world_size: int) -> int:
    """Bytes of memory per rank here: the current CUDA device's total memory, or on CPU the host's
    memory divided among the ranks on it (``world_size``, at most 8 per host)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(psutil.virtual_memory().total // max(1, min(world_size, 8)))
