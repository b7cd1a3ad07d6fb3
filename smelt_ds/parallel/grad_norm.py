"""The true global gradient norm with expert parallelism, and gradient clipping that uses it.

With data parallelism (DP) over ``W`` ranks and expert parallelism (EP) of size ``ep``, a rank
holds three kinds of gradient elements:

* replicated parameters (attention, norms, embeddings, routers, shared experts): the same
  averaged gradient on every rank (ZeRO-0), or a 1/W partition of it (ZeRO-1/2/3);
* expert parameters (``param.allreduce is False``, ``param.group_name == "ep_size_{ep}"``):
  this rank's ``E / ep`` experts, identical on the ``W / ep`` ranks of its expert-data-parallel
  group (ZeRO-0), or partitioned over that group (ZeRO-1/2/3).

The global L2 norm (the norm of one single-process model's gradient on the same global batch) is

    ||g|| = sqrt( sum_r sum_{shards s on rank r} ||s||^2 / copies(s) )

where ``copies(s)`` is the number of ranks holding an identical copy of shard ``s``: ``W`` for a
replicated ZeRO-0 gradient, ``W / ep`` (the expert-data-parallel size) for a ZeRO-0 expert
gradient, 1 for a ZeRO partition (partitions are disjoint). One fp64 all-reduce over the
data-parallel group computes it, and every rank gets the same value (so every rank clips by the
same factor). Clipping follows ``torch.nn.utils.clip_grad_norm_`` (and DeepSpeed):
``g *= min(1, max_norm / (||g|| + 1e-6))``.

What DeepSpeed 0.19.8 does (read in its source, measured in ``tests/parallel/test_grad_norm.py``; details
and numbers in ``docs/deepspeed_notes.md``):

* ZeRO-0, fp32 (``DeepSpeedEngine.clip_fp32_gradients`` -> ``runtime.utils.clip_grad_norm_``):
  each rank takes the norm of its *local* gradients (replicated + its own experts), then the ranks
  **average** these norms: ``mean_r sqrt(D + E_r)`` instead of ``sqrt(D + sum_r E_r)``, too small
  whenever ``ep > 1`` (by up to ``1 - 1/sqrt(ep)`` when experts dominate); the clipped update is
  too large by the inverse factor. ``engine.get_global_grad_norm()`` stays ``None``.
* ZeRO-0, bf16 (``FP16_UnfusedOptimizer`` for a torch client optimizer): the norm **leaves out
  every expert parameter** (``split_params_grads_into_shared_and_expert_params``; the expert norms
  only feed the overflow check), at any ``ep`` including 1.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer.scaled_global_norm``) and ZeRO-3
  (``DeepSpeedZeroOptimizer_Stage3._get_norm_groups``): correct: partition norms are summed over
  the whole DP group (ZeRO-1/2; ``_average_expert_grad_norms`` then averages equal values) or over
  the partition group and the AutoEP expert-parallel group (ZeRO-3).

So the DeepSpeed config turns DeepSpeed's clipping off for an EP backend at ZeRO-0
(:func:`smelt_ds.parallel.ds_config.gradient_clipping`) and :func:`clip_before_step` clips there
instead, between the accumulation boundary's ``engine.backward`` (which all-reduces the ZeRO-0
gradients) and ``engine.step()``; at ZeRO-1/2/3 DeepSpeed clips, and :func:`clip_before_step` only
computes the norm (from the optimizer's gradient partitions) for logging, which
:func:`logged_grad_norm` checks against DeepSpeed's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from smelt_ds.errors import ConfigError

__all__ = ["GradShard", "global_grad_norm", "param_grad_shards", "zero_grad_shards", "engine_grad_norm",
           "clip_grads_", "clip_before_step", "logged_grad_norm",
           "NORM_MISMATCH_RTOL", "EP_BACKENDS"]

#: Backends whose expert parameters DeepSpeed treats as MoE parameters (``allreduce = False``).
EP_BACKENDS = ("deepspeed", "autoep")

#: Relative difference between DeepSpeed's clipping norm and :func:`engine_grad_norm` above which
#: :func:`logged_grad_norm` raises (both sum the same fp32 squares; observed differences <= 1e-7).
NORM_MISMATCH_RTOL = 1e-3

#: DeepSpeed's and torch's clipping epsilon: ``coef = max_norm / (norm + 1e-6)``.
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class GradShard:
    """Gradient elements held by this rank.

    Attributes:
        grad: any shape and float dtype (its squared L2 norm is taken in fp32, summed in fp64).
        copies: how many ranks of the reduction group hold an identical copy of these elements
            (>= 1): the shard's squared norm is divided by it before the sum over ranks.
    """

    grad: torch.Tensor
    copies: int = 1


def _dp_group():
    """The data-parallel group (DeepSpeed's; the world when no model parallelism is set up)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def global_grad_norm(shards: Iterable[GradShard], group=None) -> float:
    """The global L2 norm ``sqrt(sum_ranks sum_shards ||grad||^2 / copies)`` (see the module doc).

    Collective: every rank of ``group`` must call it (once per call on every rank; the shards may
    differ). ``group`` defaults to DeepSpeed's data-parallel group; without torch.distributed it
    is the local ``sqrt(sum ||grad||^2 / copies)``. Returns a Python float (nan/inf propagate:
    a non-finite gradient gives a non-finite norm on every rank). Raises ValueError for
    ``copies < 1``.
    """
    total = None
    for s in shards:
        if s.copies < 1:
            raise ValueError(f"GradShard.copies must be >= 1, got {s.copies}")
        sq = torch.linalg.vector_norm(s.grad.detach(), 2, dtype=torch.float32).double().square() / s.copies
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        from deepspeed.accelerator import get_accelerator

        total = torch.zeros((), dtype=torch.float64, device=get_accelerator().current_device_name())
    total = total.reshape(1)
    if _dist_ready():
        torch.distributed.all_reduce(total, group=_dp_group() if group is None else group)
    value = float(total)  # the one host read (a device sync on a GPU)
    return math.sqrt(value) if value >= 0 else float("nan")


def param_grad_shards(params: Iterable[torch.nn.Parameter]) -> list[GradShard]:
    """Shards of unpartitioned gradients (``param.grad``, ZeRO-0 after the boundary backward).

    A replicated parameter's gradient is on every data-parallel rank (``copies`` = DP size); an
    expert parameter's (``allreduce is False``) on the ranks of its expert-data-parallel group
    ``param.group_name`` (``copies`` = that group's size). Parameters without a gradient are
    skipped; a parameter listed twice counts once.
    """
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    dp = torch.distributed.get_world_size(group=_dp_group()) if _dist_ready() else 1
    out, seen = [], set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        copies = dp
        if is_moe_param(p) and _dist_ready():
            copies = groups._get_expert_data_parallel_world_size(p.group_name)  # type: ignore[attr-defined]
        out.append(GradShard(p.grad, copies))
    return out


def zero_grad_shards(optimizer) -> list[GradShard] | None:
    """Shards of a ZeRO-1/2/3 optimizer's gradient partitions, after the boundary backward and
    before ``step()``, or None where they are not kept in ``optimizer.averaged_gradients``
    (optimizer offload, BF16_Optimizer, or no partitions yet).

    DeepSpeed 0.19.8 keeps, per parameter group ``i``, this rank's partition as a list of tensors
    (zero padding included) in ``averaged_gradients[i]``: ZeRO-1/2 partition a group over its
    ``real_dp_process_group[i]`` (the expert-data-parallel group for an expert group), ZeRO-3 a
    parameter over its ``ds_process_group``; partitions are disjoint over the DP world, so
    ``copies`` = 1.
    """
    avg = getattr(optimizer, "averaged_gradients", None)
    if not isinstance(avg, dict) or not avg:
        return None
    if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
        return None
    n_groups = len(getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "fp16_groups", None) or [])
    if set(avg) != set(range(n_groups)) or any(v is None for v in avg.values()):
        return None
    return [GradShard(g, 1) for i in sorted(avg) for g in avg[i] if g is not None]


def engine_grad_norm(engine) -> float | None:
    """True global gradient norm (before clipping) of a DeepSpeed engine, between the
    accumulation boundary's ``engine.backward`` and ``engine.step()``.

    ZeRO-0: from ``param.grad`` (:func:`param_grad_shards`); ZeRO-1/2/3: from the optimizer's
    partitions (:func:`zero_grad_shards`), None where those are not accessible (offload): use
    ``engine.get_global_grad_norm()`` after the step there. Collective over the DP group.
    """
    if engine.zero_optimization_stage() == 0:
        return global_grad_norm(param_grad_shards(engine.module.parameters()))
    shards = zero_grad_shards(engine.optimizer)
    return None if shards is None else global_grad_norm(shards)


@torch.no_grad()
def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> float:
    """Scale every ``param.grad`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (the
    coefficient of ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed); returns the coefficient.
    ``max_norm <= 0`` or a non-finite norm leaves the gradients unchanged (returns 1.0)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = min(1.0, max_norm / (total_norm + CLIP_EPS))
    if coef < 1.0:
        seen = set()
        for p in params:
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                p.grad.mul_(coef)
    return coef


def clip_before_step(engine, max_norm: float) -> float | None:
    """Between the boundary ``engine.backward`` and ``engine.step()``: the true global gradient
    norm before clipping (:func:`engine_grad_norm`), and at ZeRO-0 the clipping itself.

    ZeRO-0 with DeepSpeed's clipping off (``engine.gradient_clipping() == 0``, what
    :func:`smelt_ds.parallel.ds_config.gradient_clipping` writes for EP backends) clips
    ``param.grad`` to ``max_norm`` here; with DeepSpeed's clipping on and no expert parameters,
    DeepSpeed clips (correctly) and this only measures. ZeRO-1/2/3: DeepSpeed clips with its own norm (correct,
    see the module doc); this returns the norm of the partitions, or None under offload.

    Raises:
        ConfigError: ZeRO-0, DeepSpeed's clipping on and the model has expert parameters
            (``allreduce is False``): DeepSpeed's ZeRO-0 norm is wrong there.
    """
    from deepspeed.moe.utils import is_moe_param

    norm = engine_grad_norm(engine)
    if engine.zero_optimization_stage() != 0:
        return norm
    params = list(engine.module.parameters())
    if engine.gradient_clipping() > 0:
        if any(is_moe_param(p) for p in params):
            raise ConfigError(f"DeepSpeed config `gradient_clipping` ({engine.gradient_clipping()}) at ZeRO stage 0 "
                              "with expert parameters: DeepSpeed 0.19.8 clips with a wrong norm there (the mean of "
                              "per-rank norms in fp32, experts left out in bf16): set `gradient_clipping` to 0 in "
                              "the DeepSpeed config and clip with smelt_ds.parallel.grad_norm.clip_before_step "
                              "(the recipe field is train.grad_clip; do not set deepspeed.config.gradient_clipping)")
        return norm
    assert norm is not None  # engine_grad_norm always has the norm at ZeRO-0
    clip_grads_(params, max_norm, norm)
    return norm


def logged_grad_norm(engine, norm: float | None) -> float:
    """The gradient norm to log after ``engine.step()``: ``norm`` from :func:`clip_before_step`,
    else DeepSpeed's ``engine.get_global_grad_norm()`` (nan when neither exists).

    Where both exist (ZeRO-1/2/3), they must agree within :data:`NORM_MISMATCH_RTOL`; raises
    RuntimeError otherwise (DeepSpeed clipped with a wrong norm, so the update was wrong).
    """
    ds = engine.get_global_grad_norm()
    ds = None if ds is None else float(ds)
    if norm is None:
        return ds if ds is not None else float("nan")
    if (ds is not None and engine.zero_optimization_stage() > 0 and math.isfinite(norm) and math.isfinite(ds)
            and abs(ds - norm) > NORM_MISMATCH_RTOL * max(norm, 1e-12)):
        raise RuntimeError(f"DeepSpeed clipped with gradient norm {ds:.6g} at ZeRO stage "
                           f"{engine.zero_optimization_stage()}, but the true global norm is {norm:.6g}: the "
                           "update is wrong (see smelt_ds/parallel/grad_norm.py and docs/deepspeed_notes.md); "
                           "report the configuration, or use ZeRO stage 0, where smelt clips itself")
    return norm
