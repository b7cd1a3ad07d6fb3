"""The ``deepspeed`` section of a recipe: ZeRO stage, offload, the ``ds_configs/`` template and
raw DeepSpeed keys, and the checks between its own fields (:func:`check_offload`). The rules
against the MoE backend and compilation need other sections and run with ``RunConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["DeepSpeedSection", "check_offload"]


class DeepSpeedSection(StrictModel):
    """DeepSpeed settings. ``config`` is merged last into the DeepSpeed JSON, unchanged."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage: 0 (nothing partitioned), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters); "
                       "deepspeed.config.zero_optimization.stage wins when set")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO offload of optimizer states")
    offload_param: Literal["none", "cpu"] = Field("none", description="ZeRO-3 offload of parameters")
    template: str | None = Field(None, description="ds_configs/ template name; default from zero_stage/offload")
    zero3_loop_tuning: Literal["auto", "off"] = Field(
        "auto", description="derive ZeRO-3 reuse distance / live parameters from the visit plan")
    comms_logger: bool = Field(False, description="enable DeepSpeed's comms logger")
    config: dict[str, Any] = Field(default_factory=dict, description="raw DeepSpeed keys, passed through")

    @property
    def effective_zero_stage(self) -> int:
        """The ZeRO stage DeepSpeed will see: ``config.zero_optimization.stage`` (merged last into
        the DeepSpeed JSON) wins over ``zero_stage``."""
        raw = self.config.get("zero_optimization", {}) or {}
        return int(raw.get("stage", self.zero_stage))


def check_offload(ds: DeepSpeedSection) -> None:
    """Offloading parameters needs ZeRO-3, offloading the optimizer ZeRO 1-3. Raises ConfigError
    naming the field, its value and the fix."""
    if ds.offload_param != "none" and ds.zero_stage != 3:
        fail("deepspeed.offload_param", ds.offload_param, "needs `deepspeed.zero_stage` 3",
              "set zero_stage: 3 or offload_param: none")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        fail("deepspeed.offload_optimizer", ds.offload_optimizer, "needs ZeRO stage 1-3",
              "set deepspeed.zero_stage >= 1 or offload_optimizer: none")
