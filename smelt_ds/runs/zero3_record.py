"""``zero3_tuning.json`` in a run directory: what the loop-aware ZeRO-3 plan decided
(:func:`smelt_ds.parallel.zero_section.zero3_plan`, analytic) beside the values DeepSpeed got."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from smelt_ds.config.run import RunConfig
from smelt_ds.cost.zero3_tuning import KEYS
from smelt_ds.parallel.hardware import device_memory_bytes, training_precision
from smelt_ds.parallel.zero_section import zero3_plan

__all__ = ["write_zero3_tuning"]


def write_zero3_tuning(run_dir: str | Path, cfg: RunConfig, world_size: int, ds_config: dict[str, Any]) -> Path:
    """Write ``zero3_tuning.json`` into ``run_dir``: the decision and its reason
    (:func:`smelt_ds.parallel.zero_section.zero3_plan` on this machine's device memory and training precision:
    :mod:`smelt_ds.parallel.hardware`), and ``final``,
    the three values in ``ds_config`` (the config DeepSpeed got:
    :func:`smelt_ds.parallel.ds_config.build_ds_config`). Returns the path."""
    data = zero3_plan(cfg, world_size, device_memory_bytes(world_size), training_precision(cfg)).as_dict()
    zero = ds_config.get("zero_optimization", {})
    data["final"] = {k: zero.get(k) for k in KEYS}
    path = Path(run_dir) / "zero3_tuning.json"
    path.write_text(json.dumps(data, indent=2))
    return path
