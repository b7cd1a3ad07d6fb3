"""The DeepSpeed config of a run, assembled in one place: :func:`build_ds_config`.

Every consumer takes the config from here: the engine
(:func:`smelt_ds.parallel.engine.initialize`), ``ds_config.json`` and ``zero3_tuning.json`` in a
run directory, the tests and benchmarks. The assembler writes the sections that follow from the
recipe alone itself (:func:`gradient_clipping`, :func:`expert_parallel_section`,
:func:`comms_logger_section`, :func:`optimizer_section`) and asks the modules beside and below it
for facts: :mod:`smelt_ds.parallel.hardware` for the precision and the device memory, the
``ds_configs/`` template and the ``zero_optimization`` section with the loop-aware ZeRO-3 values
(:func:`smelt_ds.parallel.zero_section.zero_section`, the same section the memory table estimates),
:mod:`smelt_ds.config` for the batch. Nothing below calls back up. What each key means and where
its value comes from: ``ds_configs/README.md``.
"""

from __future__ import annotations

from typing import Any

from smelt_ds.config.run import RunConfig
from smelt_ds.config.train import resolve_batch
from smelt_ds.mappings import deep_merge
from smelt_ds.parallel.grad_norm import EP_BACKENDS
from smelt_ds.parallel.hardware import device_memory_bytes, training_precision
from smelt_ds.parallel.zero_section import load_template, template_name, zero_section

__all__ = ["AUTOEP_LAYER_PATTERN", "build_ds_config", "gradient_clipping", "expert_parallel_section",
           "comms_logger_section", "optimizer_section"]

#: Module-name regex AutoEP matches against ``named_modules()`` of the model given to
#: ``deepspeed.initialize`` (``re.fullmatch``): our MoE FFNs are ``layers.{i}.mlp``.
AUTOEP_LAYER_PATTERN = r"layers\.\d+\.mlp"


def build_ds_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The complete DeepSpeed config (JSON-ready dict) of ``cfg`` on ``world_size`` ranks.

    In key order: the template's keys (``ds_configs/<template_name(cfg)>.json``); the batch in
    samples (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``train_batch_size`` = micro-batch x accumulation x ``world_size``); ``gradient_clipping``;
    ``bf16``; ``zero_optimization`` (template, stage, offload devices, loop-aware ZeRO-3 values on
    this machine's device memory, the recipe's ``deepspeed.config.zero_optimization``); the
    optional ``expert_parallel``, ``comms_logger`` and ``optimizer`` sections; then every key of
    ``deepspeed.config`` merged last, unchanged (it wins).

    Raises:
        ConfigError: an unknown template, an inconsistent global batch
            (:func:`smelt_ds.config.train.resolve_batch`) or bf16 on a GPU without it. Keys of
            ``deepspeed.config`` that a recipe field owns were refused when the recipe was loaded.
    """
    clipping = gradient_clipping(cfg)
    optional = {"expert_parallel": expert_parallel_section(cfg), "comms_logger": comms_logger_section(cfg),
                "optimizer": optimizer_section(cfg)}
    precision = training_precision(cfg)
    template = load_template(template_name(cfg))
    zero = zero_section(cfg, world_size, device_memory_bytes(world_size), precision)
    accum, _ = resolve_batch(cfg.train, world_size)
    micro = cfg.train.micro_batch_size
    out = {**template, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
           "train_batch_size": micro * accum * world_size, "gradient_clipping": clipping,
           "bf16": {"enabled": precision == "bf16"}, "zero_optimization": zero,
           **{name: section for name, section in optional.items() if section is not None}}
    return deep_merge(out, cfg.deepspeed.config)


def gradient_clipping(cfg: RunConfig) -> float:
    """The ``gradient_clipping`` value: ``train.grad_clip``, except 0.0 (off) for an EP backend at
    ZeRO stage 0, where :func:`smelt_ds.parallel.grad_norm.clip_before_step` clips with the true
    global norm instead (DeepSpeed's ZeRO-0 norm is wrong with expert parameters: the module
    docstring of :mod:`smelt_ds.parallel.grad_norm`). ``deepspeed.config.gradient_clipping`` is
    refused when the recipe is loaded (:func:`smelt_ds.config.deepspeed_section.check_passthrough`)."""
    if cfg.moe_runtime.backend in EP_BACKENDS and cfg.deepspeed.zero_stage == 0:
        return 0.0
    return cfg.train.grad_clip


def _fits_grouped_mm(cfg: RunConfig) -> bool:
    """torch._grouped_mm (CPU and CUDA) needs 16-byte-aligned row strides of H and F in fp32/bf16."""
    return all((n * 2) % 16 == 0 for n in (cfg.model.hidden_size, cfg.moe.expert_ffn_size))


def expert_parallel_section(cfg: RunConfig, module_prefix: str = "") -> dict[str, Any] | None:
    """The ``expert_parallel`` section for ``moe_runtime.backend: autoep`` (None for the others).

    A custom AutoEP layer pattern (no ``preset_model``): our MoE FFNs are the modules named
    ``{module_prefix}layers.{i}.mlp`` (dense FFN layers have no ``experts`` child and are
    skipped by AutoEP) with children ``gate`` (``[E, H]`` Linear) and ``experts`` holding the
    fused ``gate_up_proj [E, 2F, H]`` (``expert_w3: null`` = gate and up fused, gate first) and
    ``down_proj [E, H, F]``, optional ``shared_expert`` + ``shared_expert_gate`` (sigmoid).
    ``top_k`` is set explicitly: AutoEP reads ``num_experts_per_tok`` only from ``model.config``,
    which SmeltLM does not have (E is read from the router weight shape). ``autoep_size`` is
    ``moe_runtime.ep_size``; ``use_grouped_mm`` is off where ``torch._grouped_mm`` cannot take
    H and F (``docs/deepspeed_notes.md``).

    ``module_prefix`` is prepended when the model given to ``deepspeed.initialize`` wraps SmeltLM
    (e.g. ``"model."``). What AutoEP cannot run (``aux_loss_free_bias``, ``router_jitter``) was
    refused when the recipe was loaded (:func:`smelt_ds.config.moe.check_moe_backend`).
    """
    if cfg.moe_runtime.backend != "autoep":
        return None
    moe = cfg.moe
    section: dict[str, Any] = {
        "enabled": True,
        "autoep_size": cfg.moe_runtime.ep_size,
        "moe_layer_pattern": module_prefix.replace(".", r"\.") + AUTOEP_LAYER_PATTERN,
        "router_pattern": "gate",
        "expert_pattern": "experts",
        "expert_w1": "gate_up_proj",
        "expert_w2": "down_proj",
        "expert_w3": None,
        "top_k": moe.top_k,
        "score_func": moe.score_func,
        "score_apply": "post",
        "route_norm": moe.norm_topk_prob,
        "route_scale": 1.0,
        "expert_activation": "swiglu",
        "use_grouped_mm": _fits_grouped_mm(cfg),
        "has_shared_experts": bool(moe.shared_expert_ffn_size),
    }
    if moe.shared_expert_ffn_size:
        section["shared_experts_pattern"] = "shared_expert"
        section["shared_experts_gate_pattern"] = "shared_expert_gate"
    return section


def comms_logger_section(cfg: RunConfig) -> dict[str, Any] | None:
    """The ``comms_logger`` section with ``deepspeed.comms_logger: true`` (every collective's
    count and message sizes, read by DeepSpeed's ``comms_logger``); None otherwise."""
    if not cfg.deepspeed.comms_logger:
        return None
    return {"enabled": True, "verbose": False, "prof_all": True, "debug": False}


def optimizer_section(cfg: RunConfig) -> dict[str, Any] | None:
    """The ``optimizer`` section (AdamW with ``train.lr``, ``betas``, ``eps``, ``weight_decay``)
    with an optimizer offload, so that DeepSpeed runs its CPU Adam; None otherwise (the engine
    passes torch's AdamW over smelt-ds's parameter groups)."""
    if cfg.deepspeed.offload_optimizer == "none":
        return None
    t = cfg.train
    return {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas), "eps": t.eps,
                                        "weight_decay": t.weight_decay}}
