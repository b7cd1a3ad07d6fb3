"""DeepSpeed side of a run: optimizer parameter groups, LR schedule, activation-checkpointing
wiring, and ``deepspeed.initialize``.

The model never imports DeepSpeed; this module does (docs/architecture.md). The engine consumes the
DeepSpeed config as :func:`smelt_ds.parallel.ds_config.build_ds_config` assembles it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.cost.activation_checkpointing import checkpointed_visits
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.distributed import deepspeed_args
from smelt_ds.parallel.ds_config import build_ds_config
from smelt_ds.parallel.moe_backends import moe_optimizer, optimizer_param_groups

if TYPE_CHECKING:
    from smelt_ds.model.looping import LoopingBlockManager

__all__ = ["param_groups", "lr_multiplier", "initialize", "check_activation_checkpointing",
           "configure_activation_checkpointing"]


# ---------------------------------------------------------------------------------------------
# optimizer groups and schedule
# ---------------------------------------------------------------------------------------------


def _no_decay(name: str, p: torch.nn.Parameter) -> bool:
    """Norm weights, biases and embeddings get no weight decay (1-D tensors or embeddings)."""
    return p.ndim < 2 or "embed_tokens" in name or name.endswith(".bias") or "norm" in name


def param_groups(model: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """AdamW groups: {decay, no decay} x {unlooped, looped}. Looped (shared) parameters get
    ``lr_scale = loop.shared_lr_scale`` (applied by :func:`lr_multiplier`'s LambdaLR per group).

    Each group carries ``name`` for logging. Empty groups are dropped.
    """
    looped: set[str] = (cast(Any, model).looped_parameter_names() if hasattr(model, "looped_parameter_names")
                        else set())
    scale = cfg.loop.shared_lr_scale
    buckets: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        buckets.setdefault((_no_decay(name, p), name in looped), []).append(p)
    groups = []
    for (no_decay, is_looped), params in sorted(buckets.items()):
        groups.append({"params": params, "weight_decay": 0.0 if no_decay else cfg.train.weight_decay,
                       "lr_scale": scale if is_looped else 1.0,
                       "name": f"{'no_decay' if no_decay else 'decay'}{'_looped' if is_looped else ''}"})
    return groups


def lr_multiplier(cfg: RunConfig) -> Callable[[int], float]:
    """LR as a fraction of ``train.lr`` at optimizer step ``s`` (0-based).

    Linear warmup over ``warmup_steps``; then ``cosine``: min_ratio + (1 - min_ratio) *
    0.5 * (1 + cos(pi * progress)) (Loshchilov & Hutter 2017); ``wsd``: constant, then a linear
    decay to min_ratio over the last ``decay_fraction`` of steps (Hu et al. 2024, MiniCPM);
    ``constant``: 1.
    """
    t = cfg.train
    W, N, r = t.warmup_steps, t.max_steps, t.min_lr_ratio

    def multiplier(step: int) -> float:
        if W and step < W:
            return (step + 1) / W
        if t.schedule == "constant":
            return 1.0
        if t.schedule == "cosine":
            progress = min(1.0, (step - W) / max(1, N - W))
            return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = N - max(1, int(round(t.decay_fraction * N)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, N - decay_start))
        return 1.0 - (1 - r) * progress

    return multiplier


def initialize(cfg: RunConfig, model: torch.nn.Module, world_size: int):
    """Wrap a (backend-converted) model with ``deepspeed.initialize``.

    The optimizer is torch's AdamW over :func:`param_groups` (split for expert parallelism by the
    MoE backend), built by DeepSpeed from a factory, unless an optimizer offload asks DeepSpeed
    for its CPU Adam via the config. The
    LR schedule is a ``LambdaLR`` of :func:`lr_multiplier` times each group's ``lr_scale``,
    stepped by DeepSpeed once per optimizer step. The engine computes on this rank's current CUDA
    device (:func:`smelt_ds.parallel.distributed.deepspeed_args`, which raises ConfigError for ZeRO
    stage 3 under one GPU per task). Returns ``(engine, optimizer, scheduler,
    ds_config)``.
    """
    import deepspeed

    multiplier = lr_multiplier(cfg)
    groups = param_groups(model, cfg)
    if cfg.moe_runtime.backend != "reference":
        groups = optimizer_param_groups(model, groups, cfg)
    t = cfg.train
    # a factory, called by DeepSpeed after AutoEP replaced the MoE layers, so that the groups it
    # sees are the converted ones (split into expert / non-expert groups)
    adamw = moe_optimizer(torch.optim.AdamW, lr=t.lr, betas=t.betas, eps=t.eps)
    ds_config = build_ds_config(cfg, world_size)
    optimizer = None if "optimizer" in ds_config else adamw  # an optimizer offload: DeepSpeed's CPU Adam

    def scaled_multiplier(scale: float) -> Callable[[int], float]:
        return lambda step: scale * multiplier(step)

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(
            opt, [scaled_multiplier(g.get("lr_scale", 1.0)) for g in opt.param_groups])

    args = deepspeed_args(ds_config.get("zero_optimization", {}).get("stage", 0))  # the rank's device
    try:
        engine, opt, _, sched = deepspeed.initialize(
            args=args, model=model, optimizer=optimizer, model_parameters=groups, config=ds_config,
            lr_scheduler=scheduler)
    except AssertionError as e:  # DeepSpeed validates its config with asserts
        raise ConfigError(f"DeepSpeed refused the DeepSpeed config built from this recipe: {e or 'AssertionError'} "
                          "(keys under `deepspeed.config` pass through unchanged and win: fix or remove them; "
                          "batch sizes come from train.micro_batch_size, gradient_accumulation_steps and the "
                          "world size)") from e
    return engine, opt, sched, ds_config


def check_activation_checkpointing(cfg: RunConfig) -> None:
    """Raise ConfigError for DeepSpeed-only options under ``impl: torch`` (they would be ignored)
    and for ``contiguous_memory_optimization`` without ``partition_activations`` (DeepSpeed
    asserts: its contiguous buffers hold activation partitions)."""
    ac = cfg.train.activation_checkpointing
    path = "train.activation_checkpointing"
    if ac.impl == "torch":
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if getattr(ac, name):
                raise ConfigError(f"`{path}.{name}` (True) only applies to `{path}.impl` 'deepspeed' "
                                  f"(deepspeed.checkpointing), not 'torch': set impl: deepspeed or {name}: false")
    if ac.contiguous_memory_optimization and not ac.partition_activations:
        raise ConfigError(f"`{path}.contiguous_memory_optimization` (True) needs `{path}.partition_activations` "
                          "(DeepSpeed's contiguous buffers hold activation partitions): set "
                          "partition_activations: true or contiguous_memory_optimization: false")


_CPU_CHECKPOINTING_WARNED = False


def _warn_cpu_checkpointing_dropped() -> None:
    """Warn once per process that ``cpu_checkpointing`` is not passed to DeepSpeed here."""
    global _CPU_CHECKPOINTING_WARNED
    if _CPU_CHECKPOINTING_WARNED:
        return
    _CPU_CHECKPOINTING_WARNED = True
    warnings.warn("`train.activation_checkpointing.cpu_checkpointing` (True) is ignored on a CPU accelerator: "
                  "the checkpoints are in host memory already, and DeepSpeed 0.19.8's CPU-checkpoint path loses "
                  "the input there; the run checkpoints as without the option (it applies on CUDA)",
                  UserWarning, stacklevel=3)


def _torch_checkpoint(fn: Callable, x: torch.Tensor):
    import torch.utils.checkpoint as tuc

    return tuc.checkpoint(fn, x, use_reentrant=False)


def configure_activation_checkpointing(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Give the model's looping block manager its checkpointed visits and checkpoint function
    (:meth:`smelt_ds.model.looping.LoopingBlockManager.configure_checkpointing`).

    ``impl: torch`` uses non-reentrant ``torch.utils.checkpoint``; ``impl: deepspeed`` uses
    ``deepspeed.checkpointing`` configured with ``partition_activations``, ``cpu_checkpointing``
    (``checkpoint_in_cpu``; on a CPU accelerator it is not passed on, with a one-time UserWarning)
    and ``contiguous_memory_optimization`` (``contiguous_checkpointing``,
    ``num_checkpoints`` = visits of the plan), through its *non-reentrant* variant
    ``deepspeed.checkpointing.non_reentrant_checkpoint`` (the reentrant one breaks looped layers
    under ZeRO-2/3: ``docs/deepspeed_notes.md``). The MoE losses are outputs of the checkpointed
    function (see :class:`smelt_ds.model.looping.LoopingBlockManager`), so they get their gradient
    under either variant. Both restore the RNG state on recompute: same dropout masks and router
    jitter, hence the same experts. ``deepspeed.checkpointing`` needs ``torch.distributed``
    initialised (a world of one is enough). Raises ConfigError for inconsistent options
    (:func:`check_activation_checkpointing`)."""
    check_activation_checkpointing(cfg)
    ac = cfg.train.activation_checkpointing
    manager = cast("LoopingBlockManager", model.blocks)
    visits = checkpointed_visits(cfg, manager.schedule)
    if not visits:
        manager.disable_checkpointing()
        return
    if ac.impl == "torch":
        manager.configure_checkpointing(visits, _torch_checkpoint, frees_inputs=False)
        return
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    # cpu_checkpointing is only passed on for device accelerators (on a CPU accelerator DeepSpeed
    # loses the checkpoint's input: docs/deepspeed_notes.md)
    in_cpu = ac.cpu_checkpointing and get_accelerator().device_name() != "cpu"
    if ac.cpu_checkpointing and not in_cpu:
        _warn_cpu_checkpointing_dropped()
    deepspeed.checkpointing.configure(None, partition_activations=ac.partition_activations,
                                      checkpoint_in_cpu=in_cpu,
                                      contiguous_checkpointing=ac.contiguous_memory_optimization,
                                      num_checkpoints=len(manager.schedule.plan))
    # partition / CPU checkpointing replace the input's .data in place (kept for backward)
    manager.configure_checkpointing(visits, ds_ckpt.non_reentrant_checkpoint,
                                    frees_inputs=ac.partition_activations or in_cpu)
