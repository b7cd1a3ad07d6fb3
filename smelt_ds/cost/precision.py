"""The floating-point precision a run trains in: ``bf16`` or ``fp32``.

Read by the DeepSpeed config (``bf16.enabled``, :func:`smelt_ds.parallel.ds_config.build_ds_config`),
the training loop, and the cost models for bytes per element (:mod:`smelt_ds.cost.memory`,
:mod:`smelt_ds.cost.zero3_tuning`).
"""

from __future__ import annotations

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError

__all__ = ["resolve_precision"]


def resolve_precision(cfg: RunConfig, precision: str | None = None, target: str = "here") -> str:
    """``bf16`` or ``fp32``: ``precision`` (default ``train.precision``) resolved for ``target``.

    ``target="here"`` (training): ``auto`` picks bf16 only on CUDA with bf16 support (CPU runs
    fp32). ``target="gpu"`` (memory planning for a bf16-capable GPU): ``auto`` is bf16.
    Raises ConfigError for an unknown precision, or bf16 requested here on a GPU without it.
    """
    p = precision or cfg.train.precision
    if p not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"`precision` ({p!r}) is unknown: use bf16, fp32 or auto")
    if target == "gpu":
        return "bf16" if p == "auto" else p
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if p == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if p == "bf16" and not cuda_bf16 and torch.cuda.is_available():
        raise ConfigError("`train.precision` ('bf16') is not supported by this GPU: use 'fp32' or 'auto'")
    return p
