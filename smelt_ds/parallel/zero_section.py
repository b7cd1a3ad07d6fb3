"""The ZeRO option of a recipe: its ``ds_configs/`` template and its ``zero_optimization`` section.

This is where the DeepSpeed settings of the ZeRO option are built (beside
:mod:`smelt_ds.parallel.ds_config`, which assembles the rest); the decisions themselves are
analytic (:mod:`smelt_ds.cost.zero3_tuning`). The section is, in order: the template's
``zero_optimization`` (``ds_configs/*.json``), the stage and offload devices, the loop-aware ZeRO-3
values (:func:`smelt_ds.cost.zero3_tuning.plan_zero3`, only with ``deepspeed.zero3_loop_tuning:
auto`` at stage 3; keys the user set are never tuned) and last the recipe's own
``deepspeed.config.zero_optimization`` keys (they win). Sizes are in elements, as DeepSpeed reads
them. One builder for every consumer: the DeepSpeed config of a run
(:func:`smelt_ds.parallel.ds_config.build_ds_config`), the memory table's rows for other ZeRO
options (:func:`smelt_ds.parallel.memory.estimate`), the job plans and recipe table
(:mod:`smelt_ds.launch.placement`) and ``zero3_tuning.json`` in a run directory
(:mod:`smelt_ds.runs.zero3_record`). The caller names the memory per rank and the precision: this machine's for a run
(:mod:`smelt_ds.parallel.hardware`), the target GPU's for a plan.
"""

from __future__ import annotations

import json
from typing import Any

from smelt_ds.config.run import RunConfig
from smelt_ds.cost.zero3_tuning import Zero3Tuning, plan_zero3
from smelt_ds.errors import ConfigError
from smelt_ds.mappings import deep_merge
from smelt_ds.resources import DS_CONFIG_DIR

__all__ = ["option_template_name", "template_name", "load_template", "zero_section",
           "zero3_plan"]


def option_template_name(stage: int, offload_optimizer: bool, offload_param: bool) -> str:
    """The ``ds_configs/`` template of a ZeRO option: ``zero{stage}``, or
    ``zero3_offload_param`` / ``zero3_offload_optimizer`` at stage 3."""
    if stage == 3 and offload_param:
        return "zero3_offload_param"
    if stage == 3 and offload_optimizer:
        return "zero3_offload_optimizer"
    return f"zero{stage}"


def template_name(cfg: RunConfig) -> str:
    """Template file stem for the recipe: ``deepspeed.template`` when set, else the template of
    its ZeRO option (:func:`option_template_name`)."""
    ds = cfg.deepspeed
    if ds.template:
        return ds.template
    return option_template_name(ds.zero_stage, ds.offload_optimizer != "none", ds.offload_param != "none")


def load_template(name: str) -> dict[str, Any]:
    """Read ``ds_configs/<name>.json`` (:data:`smelt_ds.resources.DS_CONFIG_DIR`). Raises
    ConfigError naming the file and the choices."""
    path = DS_CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        choices = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))
        raise ConfigError(f"`deepspeed.template` ({name!r}): no file {path}; choose one of {choices}")
    return json.loads(path.read_text())


def _option_cfg(cfg: RunConfig, stage: int | None, offload_optimizer: bool | None,
                offload_param: bool | None) -> tuple[RunConfig, str]:
    """``cfg`` as a run at the given ZeRO option (unchanged when all three are None), and its template."""
    if stage is None and offload_optimizer is None and offload_param is None:
        return cfg, template_name(cfg)
    ds = cfg.deepspeed
    stage = ds.zero_stage if stage is None else stage
    off_opt = (ds.offload_optimizer != "none") if offload_optimizer is None else offload_optimizer
    off_param = (ds.offload_param != "none") if offload_param is None else offload_param
    new = ds.model_copy(update={"zero_stage": stage, "offload_optimizer": "cpu" if off_opt else "none",
                                "offload_param": "cpu" if off_param else "none"})
    return cfg.model_copy(update={"deepspeed": new}), option_template_name(stage, off_opt, off_param)


def _template_zero(cfg: RunConfig, name: str) -> dict[str, Any]:
    """Template ``name``'s ``zero_optimization`` with the stage and offload devices of ``cfg``:
    the base the loop tuning starts from."""
    ds = cfg.deepspeed
    zero = dict(load_template(name).get("zero_optimization", {}))
    zero["stage"] = ds.zero_stage
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": ds.offload_optimizer}
    if ds.offload_param != "none":
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": ds.offload_param}
    return zero


def zero3_plan(cfg: RunConfig, world_size: int, device_memory_bytes: int, precision: str,
               stage: int | None = None, offload_optimizer: bool | None = None,
               offload_param: bool | None = None) -> Zero3Tuning:
    """The loop-aware ZeRO-3 decision for ``cfg`` (or the given ZeRO option) on ``world_size``
    ranks of ``device_memory_bytes`` bytes each training in ``precision`` (``bf16`` / ``fp32``):
    this machine's (:mod:`smelt_ds.parallel.hardware`) for a run, the target GPU's for a plan."""
    option_cfg, name = _option_cfg(cfg, stage, offload_optimizer, offload_param)
    return plan_zero3(option_cfg, _template_zero(option_cfg, name), world_size, device_memory_bytes, precision)


def zero_section(cfg: RunConfig, world_size: int, device_memory_bytes: int, precision: str,
                 stage: int | None = None, offload_optimizer: bool | None = None,
                 offload_param: bool | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` section a run of ``cfg`` (or of the given ZeRO option) gets on
    ``world_size`` ranks of ``device_memory_bytes`` bytes each in ``precision`` (as in
    :func:`zero3_plan`): base, loop tuning (user-set keys are not tuned), then
    ``deepspeed.config.zero_optimization`` merged last. Raises ConfigError for an unknown template
    name (:func:`load_template`)."""
    option_cfg, name = _option_cfg(cfg, stage, offload_optimizer, offload_param)
    base = _template_zero(option_cfg, name)
    decision = plan_zero3(option_cfg, base, world_size, device_memory_bytes, precision)
    tuned = {k: v for k, v in decision.values.items() if k not in decision.user} if decision.applied else {}
    return deep_merge({**base, **tuned}, option_cfg.deepspeed.config.get("zero_optimization") or {})
