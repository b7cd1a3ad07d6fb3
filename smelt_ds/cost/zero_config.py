"""The one builder of DeepSpeed's ``zero_optimization`` section for a recipe.

Every consumer gets the section from here: the DeepSpeed config of a run
(:func:`smelt_ds.parallel.engine.build_ds_config`), the memory table's rows for other ZeRO options
(:func:`smelt_ds.cost.memory.estimate`), the job plans and recipe table
(:mod:`smelt_ds.launch.placement`) and ``zero3_tuning.json`` in a run directory. The section is, in
order: the template's ``zero_optimization`` (``ds_configs/*.json``), the stage and offload devices,
the loop-aware ZeRO-3 values (:func:`smelt_ds.cost.zero3_tuning.plan_zero3`, only with
``deepspeed.zero3_loop_tuning: auto`` at stage 3; keys the user set are never tuned) and last the
recipe's own ``deepspeed.config.zero_optimization`` keys (they win). Sizes are in elements, as
DeepSpeed reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from smelt_ds.config.ds_template import deep_merge, load_template, template_name
from smelt_ds.config.run import RunConfig
from smelt_ds.cost.zero3_tuning import KEYS, Zero3Tuning, plan_zero3

__all__ = ["option_template_name", "base_zero_section", "zero_section", "zero3_plan", "write_zero3_tuning"]


def option_template_name(stage: int, offload_optimizer: bool, offload_param: bool) -> str:
    """The ``ds_configs/`` template of a ZeRO option (the memory table's rows):
    ``zero{stage}``, or ``zero3_offload_param`` / ``zero3_offload_optimizer`` at stage 3."""
    if stage == 3 and offload_param:
        return "zero3_offload_param"
    if stage == 3 and offload_optimizer:
        return "zero3_offload_optimizer"
    return f"zero{stage}"


def _option_cfg(cfg: RunConfig, stage: int | None, offload_optimizer: bool | None,
                offload_param: bool | None) -> tuple[RunConfig, str]:
    """``cfg`` as a run at the given ZeRO option (unchanged when all three are None), and its template."""
    if stage is None and offload_optimizer is None and offload_param is None:
        return cfg, template_name(cfg)
    ds = cfg.deepspeed
    stage = ds.zero_stage if stage is None else stage
    off_opt = (ds.offload_optimizer != "none") if offload_optimizer is None else offload_optimizer
    off_param = (ds.offload_param != "none") if offload_param is None else offload_param
    user_zero = {**(ds.config.get("zero_optimization") or {}), "stage": stage}
    new = ds.model_copy(update={"zero_stage": stage, "offload_optimizer": "cpu" if off_opt else "none",
                                "offload_param": "cpu" if off_param else "none",
                                "config": {**ds.config, "zero_optimization": user_zero}})
    return cfg.model_copy(update={"deepspeed": new}), option_template_name(stage, off_opt, off_param)


def base_zero_section(cfg: RunConfig, stage: int | None = None, offload_optimizer: bool | None = None,
                      offload_param: bool | None = None) -> dict[str, Any]:
    """The template's ``zero_optimization`` with the stage and offload devices set, before loop
    tuning and the recipe's own keys (what :func:`plan_zero3` calls the base). ``stage`` and the
    offload flags select another ZeRO option than the recipe's (its template as well)."""
    cfg, name = _option_cfg(cfg, stage, offload_optimizer, offload_param)
    ds = cfg.deepspeed
    zero = dict(load_template(name).get("zero_optimization", {}))
    zero["stage"] = ds.zero_stage
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": ds.offload_optimizer}
    if ds.offload_param != "none":
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": ds.offload_param}
    return zero


def zero3_plan(cfg: RunConfig, world_size: int, device_memory_bytes: int | None = None,
               stage: int | None = None, offload_optimizer: bool | None = None,
               offload_param: bool | None = None) -> Zero3Tuning:
    """The loop-aware ZeRO-3 decision for ``cfg`` (or the given ZeRO option) on ``world_size``
    ranks of ``device_memory_bytes`` each (default: this machine's device)."""
    option_cfg, _ = _option_cfg(cfg, stage, offload_optimizer, offload_param)
    base = base_zero_section(cfg, stage, offload_optimizer, offload_param)
    return plan_zero3(option_cfg, base, world_size, device_memory_bytes)


def zero_section(cfg: RunConfig, world_size: int, device_memory_bytes: int | None = None,
                 stage: int | None = None, offload_optimizer: bool | None = None,
                 offload_param: bool | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` section a run of ``cfg`` (or of the given ZeRO option) gets on
    ``world_size`` ranks of ``device_memory_bytes`` each: base, loop tuning (user-set keys are not
    tuned), then ``deepspeed.config.zero_optimization`` merged last. Raises ConfigError for an
    unknown template name (:func:`smelt_ds.config.ds_template.load_template`)."""
    option_cfg, _ = _option_cfg(cfg, stage, offload_optimizer, offload_param)
    zero = base_zero_section(cfg, stage, offload_optimizer, offload_param)
    decision = zero3_plan(cfg, world_size, device_memory_bytes, stage, offload_optimizer, offload_param)
    if decision.applied:
        zero.update({k: v for k, v in decision.values.items() if k not in decision.user})
    return deep_merge(zero, option_cfg.deepspeed.config.get("zero_optimization") or {})


def write_zero3_tuning(run_dir: str | Path, cfg: RunConfig, world_size: int,
                       ds_config: dict[str, Any] | None = None) -> Path:
    """Write ``zero3_tuning.json`` (the decision and its reason; ``final`` = the values in
    ``ds_config``, the config DeepSpeed got) into ``run_dir``. Returns the path."""
    data = zero3_plan(cfg, world_size).as_dict()
    if ds_config is not None:
        zero = ds_config.get("zero_optimization", {})
        data["final"] = {k: zero.get(k) for k in KEYS}
    path = Path(run_dir) / "zero3_tuning.json"
    path.write_text(json.dumps(data, indent=2))
    return path
