"""The ``deepspeed`` section of a recipe: ZeRO stage, offload, the ``ds_configs/`` template and
raw DeepSpeed keys, and the checks between its own fields (:func:`check_offload`) and of its raw
keys (:func:`check_passthrough`, :func:`check_deepspeed_keys`: DeepSpeed's own validation). The
rules against the MoE backend and compilation need other sections and run with ``RunConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from smelt_ds.config.deepspeed_validation import validate_deepspeed_config
from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import fail

__all__ = ["DeepSpeedSection", "OWNED_KEYS", "check_deepspeed_keys", "check_offload", "check_passthrough"]


class DeepSpeedSection(StrictModel):
    """DeepSpeed settings. ``config`` is merged last into the DeepSpeed JSON, unchanged, except
    that the keys a field owns (:data:`OWNED_KEYS`) are refused when the recipe is loaded: each
    DeepSpeed setting has one value, which every reader (the engine, ``smelt-ds memory``,
    ``render-job``, the checkpoint layout) takes from the field. DeepSpeed's own config classes
    validate ``config`` when the recipe is loaded (:func:`check_deepspeed_keys`), and a number
    written ``5e8`` (a string to YAML 1.1) is read as the number DeepSpeed's field takes."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage: 0 (nothing partitioned), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO offload of optimizer states")
    offload_param: Literal["none", "cpu"] = Field("none", description="ZeRO-3 offload of parameters")
    template: str | None = Field(None, description="ds_configs/ template name; default from zero_stage/offload")
    zero3_loop_tuning: Literal["auto", "off"] = Field(
        "auto", description="derive ZeRO-3 reuse distance / live parameters from the visit plan")
    comms_logger: bool = Field(False, description="enable DeepSpeed's comms logger")
    config: dict[str, Any] = Field(default_factory=dict, description="raw DeepSpeed keys, merged last into the "
                                   "DeepSpeed JSON and validated by DeepSpeed's own config classes when the recipe "
                                   "is loaded; keys a recipe field owns are refused, naming the field; 5e8 is read "
                                   "as the number 500000000")


def check_offload(ds: DeepSpeedSection) -> None:
    """Offloading parameters needs ZeRO-3, offloading the optimizer ZeRO 1-3. Raises ConfigError
    naming the field, its value and the fix."""
    if ds.offload_param != "none" and ds.zero_stage != 3:
        fail("deepspeed.offload_param", ds.offload_param, "needs `deepspeed.zero_stage` 3",
              "set zero_stage: 3 or offload_param: none")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        fail("deepspeed.offload_optimizer", ds.offload_optimizer, "needs ZeRO stage 1-3",
              "set deepspeed.zero_stage >= 1 or offload_optimizer: none")


#: DeepSpeed JSON keys (paths) that a recipe field owns, and the field to set instead. A key of the
#: ``deepspeed.config`` pass-through at one of these paths (or inside one) is refused at load time
#: (:func:`check_passthrough`), so no reader can see one value while DeepSpeed runs another.
OWNED_KEYS: dict[tuple[str, ...], str] = {
    ("zero_optimization", "stage"): "deepspeed.zero_stage",
    ("zero_optimization", "offload_optimizer", "device"): "deepspeed.offload_optimizer",
    ("zero_optimization", "offload_param", "device"): "deepspeed.offload_param",
    ("zero_optimization", "cpu_offload"): "deepspeed.offload_optimizer (DeepSpeed's old name for its cpu device)",
    ("zero_optimization", "cpu_offload_param"): "deepspeed.offload_param (DeepSpeed's old name for its cpu device)",
    ("train_micro_batch_size_per_gpu",): "train.micro_batch_size",
    ("gradient_accumulation_steps",): "train.gradient_accumulation_steps (or train.global_batch_tokens)",
    ("train_batch_size",): "train.global_batch_tokens (or train.gradient_accumulation_steps)",
    ("gradient_clipping",): "train.grad_clip",
    ("bf16",): "train.precision",
    ("bfloat16",): "train.precision (DeepSpeed's other name for bf16)",
    ("torch_autocast",): "train.precision (smelt-ds sets the dtype of the whole model, not autocast regions)",
    ("fp16",): "train.precision (fp32 or bf16; smelt-ds does not train in fp16)",
    ("expert_parallel",): "moe_runtime.backend: autoep with moe_runtime.ep_size",
    ("comms_logger", "enabled"): "deepspeed.comms_logger",
    ("optimizer",): "train.lr, train.betas, train.eps and train.weight_decay (AdamW; deepspeed.offload_optimizer "
                    "selects DeepSpeed's CPU Adam)",
    ("scheduler",): "train.schedule, train.warmup_steps (the LR schedule smelt-ds steps)",
}


def check_passthrough(ds: DeepSpeedSection) -> None:
    """Refuse the keys of ``deepspeed.config`` that a recipe field owns (:data:`OWNED_KEYS`).
    Raises ConfigError naming the key, its value and the field to set instead."""
    for path, field in OWNED_KEYS.items():
        node: Any = ds.config
        for key in path:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            dotted = ".".join(path)
            fail(f"deepspeed.config.{dotted}", node, f"is set by the recipe field {field}, not passed through",
                 f"remove it from deepspeed.config and set {field.split(' (')[0].split(',')[0]} instead")


def check_deepspeed_keys(ds: DeepSpeedSection, micro_batch_size: int) -> dict[str, Any]:
    """``ds.config`` parsed by DeepSpeed's ``DeepSpeedConfig``
    (:func:`smelt_ds.config.deepspeed_validation.validate_deepspeed_config`) beside the keys the
    recipe's fields own (:data:`OWNED_KEYS`: the ZeRO stage, the offload devices, a micro-batch of
    ``micro_batch_size`` samples), as ``deepspeed.initialize`` will parse it: an unknown key of
    DeepSpeed's models, a value of the wrong type or a clash DeepSpeed asserts against is refused
    when the recipe is loaded, before any process starts. The whole DeepSpeed config, at the
    job's world size, is checked again by ``smelt-ds preflight`` and ``render-job``.

    Returns ``ds.config`` with numbers written in scientific notation (``5e8``) read as numbers.
    Raises ConfigError naming the field path under ``deepspeed.config``, its value, DeepSpeed's
    message and the fix. An empty ``config`` is returned as it is (DeepSpeed is not imported)."""
    if not ds.config:
        return ds.config
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    for name in ("offload_optimizer", "offload_param"):
        if getattr(ds, name) != "none":
            zero[name] = {"device": getattr(ds, name)}
    base = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": 1,
            "zero_optimization": zero}
    return validate_deepspeed_config(ds.config, base, owned=OWNED_KEYS)
