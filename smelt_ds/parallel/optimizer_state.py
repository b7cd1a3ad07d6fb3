"""A live DeepSpeed engine's training state per parameter, whatever its ZeRO stage: the fp32
master weights, AdamW's two moments and its step count, read as full tensors and written back
from full tensors into an engine of another layout.

DeepSpeed keeps this state in a different place at each stage (DeepSpeed 0.19.8, torch AdamW
underneath; the base optimizer's ``state[X]`` holds ``step`` (a 0-dim tensor; an int for
DeepSpeedCPUAdam), ``exp_avg`` and ``exp_avg_sq``):

* ZeRO-0, fp32: ``engine.optimizer`` is the AdamW itself; X is the parameter.
* ZeRO-0, bf16: ``FP16_UnfusedOptimizer`` keeps an fp32 copy of each parameter
  (``fp32_groups``, paired with ``fp16_groups``); X is that copy. Its constructor takes one
  optimizer step with zero gradients to create the state, so its step count is one ahead of the
  updates taken (:data:`_INIT_STEPS`).
* ZeRO-1/2: ``DeepSpeedZeroOptimizer``; X is the flat fp32 partition of the parameter's group on
  this rank. ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
  all-reduce a parameter's fragments over its data-parallel group (the expert-data-parallel group
  for expert parameters): collective, every rank in the same parameter order.
* ZeRO-3: ``DeepSpeedZeroOptimizer_Stage3``; X is the flat fp32 partition of the parameter's
  sub-group. The same getters all-gather over ``ds_process_group``.

Three DeepSpeed behaviours this module works around, each checked on 2 gloo ranks:

* ZeRO-1/2 links the optimizer-state views of each parameter once, after the first parameter
  group's first step, so groups stepped later have none (``exp_avg not found in optimizer state
  fragment``); :func:`full_state` relinks first (local, cheap).
* ZeRO-3's ``safe_set_full_*`` fail for a parameter whose size the partition does not divide
  (``start + length exceeds dimension size``): :func:`set_full_state` writes this rank's padded
  slice with ``safe_set_local_*``.
* No setter updates the low-precision (model) copy: :func:`finish_set` copies the fp32 master
  into it (ZeRO-3: the repartition ``step()`` performs; collective).

A fresh engine has no optimizer state until its first step: :func:`prepare_state` creates it.
"""

from __future__ import annotations

from typing import Any

import torch

from smelt_ds.errors import ConfigError

__all__ = ["MOMENTS", "optimizer_kind", "full_state", "prepare_state", "set_full_state", "finish_set", "adam_step"]

#: AdamW's per-parameter moments, by their key in the optimizer state
MOMENTS = ("exp_avg", "exp_avg_sq")

_ZERO12, _ZERO3, _UNFUSED = "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_UnfusedOptimizer"
#: optimizer steps a freshly built engine has already counted (FP16_UnfusedOptimizer's state-creating step)
_INIT_STEPS = {_UNFUSED: 1}


def optimizer_kind(engine) -> str:
    """The class name of ``engine.optimizer``. Raises ConfigError for one this module cannot read
    (e.g. ``BF16_Optimizer``, chosen only by a raw ``data_types.grad_accum_dtype`` setting)."""
    kind = type(engine.optimizer).__name__
    if kind in (_ZERO12, _ZERO3, _UNFUSED) or isinstance(engine.optimizer, torch.optim.Optimizer):
        return kind
    raise ConfigError(f"the layout-free training state cannot be read from DeepSpeed's {kind}: remove the "
                      "deepspeed.config setting that selects it (e.g. data_types.grad_accum_dtype), or resume at "
                      "the layout that wrote the checkpoint")


def _base(engine):
    o = engine.optimizer
    return o.optimizer if type(o).__name__ in (_ZERO12, _ZERO3, _UNFUSED) else o


def _master_and_key(engine, p: torch.nn.Parameter) -> tuple[torch.Tensor, Any]:
    """ZeRO-0: ``(the fp32 master of p, its key in the base optimizer's state)``; ZeRO 1-3: the
    flat partition keyed in the state (the master is read through DeepSpeed's getters)."""
    o, kind = engine.optimizer, type(engine.optimizer).__name__
    if kind == _ZERO12:
        i = next(i for i, g in enumerate(o.bit16_groups) if any(q is p for q in g))
        flat = o.single_partition_of_fp32_groups[i]
        return flat, flat
    if kind == _ZERO3:
        flat = o.fp32_partitioned_groups_flat[o.grad_position[o.get_param_id(p)][0]]
        return flat, flat
    if kind == _UNFUSED:
        for lp_group, hp_group in zip(o.fp16_groups, o.fp32_groups, strict=True):
            for lp, hp in zip(lp_group, hp_group, strict=True):
                if lp is p:
                    return hp, hp
        raise KeyError("parameter not in the optimizer")
    return p, p


def _relink(engine) -> None:
    o = engine.optimizer
    if type(o).__name__ == _ZERO12:
        o._hp_optimizer_states_linked = False
        o._lazy_init_hp_params_optimizer_state()


def _step_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item() if torch.is_tensor(value) else value)


def adam_step(engine, p: torch.nn.Parameter) -> int:
    """The optimizer updates ``p`` has taken (AdamW's bias-correction step; skipped steps do not
    count), 0 before the first."""
    _, key = _master_and_key(engine, p)
    n = _step_int(_base(engine).state.get(key, {}).get("step")) or 0
    return max(0, n - _INIT_STEPS.get(type(engine.optimizer).__name__, 0))


def full_state(engine, p: torch.nn.Parameter, relink: bool = True) -> dict[str, torch.Tensor | None]:
    """``{"weight": fp32 master, "exp_avg", "exp_avg_sq"}`` of parameter ``p`` as full fp32 CPU
    tensors of the parameter's whole (unpartitioned) shape; a moment is None before the first step.

    Collective at ZeRO 1-3: every rank calls it for every parameter in the same order.
    ``relink``: redo ZeRO-1/2's state links first (once per pass over the parameters is enough).
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    kind = optimizer_kind(engine)
    if kind in (_ZERO12, _ZERO3):
        if relink:
            _relink(engine)
        out: dict[str, torch.Tensor | None] = {"weight": safe_get_full_fp32_param(p)}
        # no moments before the first update (the ranks update together: the same answer on every rank)
        stepped = any(MOMENTS[0] in st for st in _base(engine).state.values())
        for m in MOMENTS:
            out[m] = safe_get_full_optimizer_state(p, m) if stepped else None
        return {k: None if v is None else v.detach().float().cpu().clone() for k, v in out.items()}
    master, key = _master_and_key(engine, p)
    st = _base(engine).state.get(key, {})
    return {"weight": master.detach().float().cpu().clone(),
            **{m: st[m].detach().float().cpu().clone() if m in st else None for m in MOMENTS}}


def prepare_state(engine, step: int) -> None:
    """Give every parameter of a freshly built engine AdamW state: zero moments and ``step``
    updates taken (as DeepSpeed's universal-checkpoint loader does). Local; call before
    :func:`set_full_state`."""
    o, kind = engine.optimizer, optimizer_kind(engine)
    if kind == _ZERO12:
        keys = list(o.single_partition_of_fp32_groups)
    elif kind == _ZERO3:
        keys = list(o.fp32_partitioned_groups_flat)
    elif kind == _UNFUSED:
        keys = [hp for g in o.fp32_groups for hp in g]
    else:
        keys = [q for g in o.param_groups for q in g["params"]]
    base = _base(engine)
    n = step + _INIT_STEPS.get(kind, 0)
    int_step = type(base).__name__ == "DeepSpeedCPUAdam"
    for key in keys:
        st = base.state[key]
        for m in MOMENTS:
            if m not in st:
                st[m] = torch.zeros_like(key)
        st["step"] = n if int_step else torch.tensor(float(n))
    _relink(engine)


def set_full_state(engine, p: torch.nn.Parameter, values: dict[str, torch.Tensor]) -> None:
    """Write ``values`` (``{"weight", "exp_avg", "exp_avg_sq"}``, full tensors of ``p``'s whole
    shape) into ``p``'s fp32 master and moments on this rank. Local (each rank writes its own
    partition); :func:`finish_set` then updates the model's copy."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    kind = optimizer_kind(engine)
    if kind == _ZERO12:
        safe_set_full_fp32_param(p, values["weight"])
        for m in MOMENTS:
            safe_set_full_optimizer_state(p, values[m], m)
        p.data.copy_(values["weight"].to(p.dtype).view_as(p))  # whole on every rank at ZeRO-1/2
        return
    if kind == _ZERO3:
        import torch.distributed as dist

        part, group = p.ds_tensor.numel(), p.ds_process_group  # type: ignore[attr-defined]
        r, w = dist.get_rank(group=group), dist.get_world_size(group=group)

        def mine(v: torch.Tensor) -> torch.Tensor:
            flat = torch.nn.functional.pad(v.reshape(-1).float(), (0, part * w - v.numel()))
            return flat[r * part:(r + 1) * part].clone()

        safe_set_local_fp32_param(p, mine(values["weight"]))
        for m in MOMENTS:
            safe_set_local_optimizer_state(p, mine(values[m]), m)
        return
    master, key = _master_and_key(engine, p)
    st = _base(engine).state[key]
    with torch.no_grad():
        master.copy_(values["weight"].view_as(master))
        for m in MOMENTS:
            st[m].copy_(values[m].view_as(master))
        if master is not p:
            p.data.copy_(values["weight"].to(p.dtype).view_as(p))


def finish_set(engine) -> None:
    """After :func:`set_full_state` on every parameter: at ZeRO-3, copy the fp32 partitions into
    the model's partitions and refresh the persistent (never partitioned) parameters, as DeepSpeed's
    ``step()`` does (collective); elsewhere nothing is left to do."""
    o = engine.optimizer
    if type(o).__name__ != _ZERO3:
        return
    o._partition_all_parameters()
    for i in range(len(o.fp16_groups)):
        o._reassign_or_swap_out_partitioned_parameters(i)
    if o.persistent_parameters:
        o.persistent_parameters[0].all_gather(o.persistent_parameters)
    o.invalidate_secondary_tensor()
