"""The floating-point precision a run is planned in: ``bf16`` or ``fp32`` (analytic: no device).

Read by the cost models for bytes per element (:mod:`smelt_ds.parallel.memory`,
:mod:`smelt_ds.cost.zero3_tuning` through its caller). A run on this machine resolves ``auto``
against its device instead: :func:`smelt_ds.parallel.hardware.training_precision`.
"""

from __future__ import annotations

from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError

__all__ = ["resolve_precision"]


def resolve_precision(cfg: RunConfig, precision: str | None = None) -> str:
    """``bf16`` or ``fp32``: ``precision`` (default ``train.precision``) for a bf16-capable GPU, the
    target of memory planning: ``auto`` is bf16. Raises ConfigError for an unknown precision."""
    p = precision or cfg.train.precision
    if p not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"`precision` ({p!r}) is unknown: use bf16, fp32 or auto")
    return "bf16" if p == "auto" else p
