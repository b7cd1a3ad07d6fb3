"""The analytic side of a run's DeepSpeed settings: templates, precision, checkpointed visits.

Pure functions of the recipe (no DeepSpeed import, no engine), shared by the engine
(:func:`smelt_ds.parallel.engine.build_ds_config`) and the cost models (:mod:`smelt_ds.cost.memory`,
:mod:`smelt_ds.cost.zero3_tuning`), so each fact is computed in one place. The templates are
``ds_configs/<name>.json`` (:mod:`smelt_ds.resources`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from smelt_ds.config.run import RunConfig, deep_merge
from smelt_ds.errors import ConfigError
from smelt_ds.resources import DS_CONFIG_DIR

__all__ = ["DS_CONFIG_DIR", "template_name", "load_template", "deep_merge", "resolve_precision", "checkpointed_visits"]


def template_name(cfg: RunConfig) -> str:
    """Template file stem for the recipe: ``zero{0,1,2,3}`` or a ZeRO-3 offload variant."""
    ds = cfg.deepspeed
    if ds.template:
        return ds.template
    if ds.zero_stage == 3 and ds.offload_param != "none":
        return "zero3_offload_param"
    if ds.zero_stage == 3 and ds.offload_optimizer != "none":
        return "zero3_offload_optimizer"
    return f"zero{ds.zero_stage}"


def load_template(name: str) -> dict[str, Any]:
    """Read ``ds_configs/<name>.json``. Raises ConfigError naming the file and the choices."""
    path = DS_CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        choices = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))
        raise ConfigError(f"`deepspeed.template` ({name!r}): no file {path}; choose one of {choices}")
    return json.loads(path.read_text())


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


def checkpointed_visits(cfg: RunConfig, schedule) -> set:
    """Visits whose activations are recomputed in backward under
    ``train.activation_checkpointing.policy``: ``full`` every visit, ``looped`` the visits of
    looped layers, ``every_n`` every n-th visit of the plan (positions 0, n, 2n, ...), ``none``
    no visit."""
    ac = cfg.train.activation_checkpointing
    plan = schedule.plan
    if ac.policy == "none":
        return set()
    if ac.policy == "full":
        return set(plan)
    if ac.policy == "looped":
        return {v for v in plan if schedule.is_looped(v.layer)}
    return {v for i, v in enumerate(plan) if i % ac.every_n == 0}
