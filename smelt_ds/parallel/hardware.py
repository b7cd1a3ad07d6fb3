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

__all__ = ["BF16_MIN_CAPABILITY", "cuda_bf16_native", "training_precision", "device_memory_bytes"]

#: The oldest CUDA compute capability with bf16 in hardware (Ampere, sm80: bf16 tensor cores and
#: arithmetic). Volta (sm70, V100) and Turing (sm75, T4) have none: torch runs bf16 there in
#: emulation, so ``torch.cuda.is_bf16_supported()`` (``including_emulation=True`` by default) is
#: True on them although bf16 is slower than fp32.
BF16_MIN_CAPABILITY = (8, 0)


def cuda_bf16_native(device: torch.device | int | None = None) -> bool:
    """Whether CUDA ``device`` (None: the current one) computes in bf16 natively: its compute
    capability (``torch.cuda.get_device_capability``) is at least :data:`BF16_MIN_CAPABILITY`.
    False without CUDA. A ROCm build (``torch.version.hip``), whose capabilities are not CUDA's,
    answers with ``torch.cuda.is_bf16_supported()``. The one test of bf16 support for training
    (:func:`training_precision`) and evaluation (:func:`smelt_ds.eval.device.resolve_dtype`)."""
    if not torch.cuda.is_available():
        return False
    if torch.version.hip:
        return bool(torch.cuda.is_bf16_supported())
    return tuple(torch.cuda.get_device_capability(device)) >= BF16_MIN_CAPABILITY


def _capability_words() -> str:
    major, minor = torch.cuda.get_device_capability()
    return (f"this GPU has compute capability {major}.{minor}; bf16 needs "
            f"{BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} or newer (A100, H100 and later)")


def training_precision(cfg: RunConfig) -> str:
    """``bf16`` or ``fp32``: ``train.precision`` resolved for a run on this machine.

    ``auto`` is bf16 on a CUDA device with native bf16 (:func:`cuda_bf16_native`: compute
    capability 8.0 or newer) and fp32 otherwise (CPU runs fp32; so do V100 and T4, whose bf16 is
    emulated). Raises ConfigError for ``bf16`` on a GPU without native bf16. A plan for a GPU
    elsewhere uses :func:`smelt_ds.cost.precision.resolve_precision` instead.
    """
    p = cfg.train.precision  # auto | bf16 | fp32, validated when the recipe was loaded
    cuda_bf16 = cuda_bf16_native()
    if p == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if p == "bf16" and not cuda_bf16 and torch.cuda.is_available():
        raise ConfigError(f"`train.precision` ('bf16') is not supported by this GPU ({_capability_words()}): "
                          "use 'fp32' or 'auto'")
    return p


def device_memory_bytes(world_size: int) -> int:
    """Bytes of memory per rank here: the current CUDA device's total memory, or on CPU the host's
    memory divided among the ranks on it (``world_size``, at most 8 per host)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(psutil.virtual_memory().total // max(1, min(world_size, 8)))
