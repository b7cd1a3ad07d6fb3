"""Loop-aware ZeRO-3 settings: keep a looped block's parameters gathered between its visits.

How DeepSpeed 0.19.8 decides to release a gathered parameter
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``): after the first two steps it has a
*trace* of the modules run in one forward + backward pass (``record_module`` in both the forward
and the backward pre-hooks, so activation-checkpoint recomputes appear in the backward part).
When module ``m`` finishes, ``__params_to_release`` walks the trace forward from the current
step and sums ``ds_numel`` (full, unpartitioned element counts) of the direct parameters of
every module it passes; a parameter of ``m`` is kept gathered if it is met again before the sum
reaches ``stage3_max_reuse_distance``. So a parameter stays gathered between two uses exactly
when the parameters used in between (in elements, counted per use) are fewer than the reuse
distance. ``stage3_max_live_parameters`` only caps prefetching (a prefetch is issued while the
gathered elements are below it); ``stage3_prefetch_bucket_size`` is how many elements are
prefetched ahead along the trace.

For a looped block in ``order: block`` the uses of a layer's module on consecutive visits are
separated by every other module of the loop range once, so the needed reuse distance is the
looped block's parameter count (docs/memory.md). In the backward pass, a checkpointed visit runs its
recompute and its backward back to back, so between the backward of visit 2 and visit 1 of a
layer the other layers of a checkpointed block appear twice: about twice the block. This module
simulates the trace at visit granularity (:func:`reuse_distance_needed`) instead of assuming.

``deepspeed.zero3_loop_tuning: auto`` raises the three values to what the visit plan needs when
the extra gathered parameters fit the memory left on the GPU after model states, activations and
buffers (:mod:`smelt_ds.cost.memory_terms`, keeping 10% headroom); it never lowers the template's values
(DeepSpeed's generic defaults), so it costs no more all-gather traffic than ``off``. Values the
user set in ``deepspeed.config.zero_optimization`` win. Element counts are per GPU (experts
divided by ``moe_runtime.ep_size``).

When it matters: the shipped ``ds_configs/zero3.json`` sets the reuse distance and the live
parameters to 1e9 elements and the prefetch bucket to 5e7. ``auto`` changes the reuse distance,
and so the all-gather volume, only when :func:`reuse_distance_needed` exceeds 1e9 (of the shipped
recipes the looped variants of m, l and xl; only xl runs ZeRO-3); it raises the live cap when the
need plus two of the largest visit exceeds 1e9, and the prefetch bucket when a visit exceeds 5e7
elements (prefetching only, not the volume). Below the threshold ``off`` and ``auto`` build the
same config and gather the same bytes (``tests/cost/test_zero3_tuning_template.py``, comms logger); the
saving is measured against a template with the three values at 0 (``tests/cost/test_zero3_tuning.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from smelt_ds.config.run import RunConfig
from smelt_ds.config.schedule import LoopSchedule
from smelt_ds.cost import memory_terms
from smelt_ds.cost.activation_checkpointing import checkpointed_visits
from smelt_ds.cost.budget import layer_params
from smelt_ds.model.looping import Visit

__all__ = ["KEYS", "Zero3Tuning", "visit_numel", "trace", "reuse_distance_needed", "plan_zero3", "HEADROOM"]

#: The ZeRO-3 keys this module sets.
KEYS = ("stage3_max_reuse_distance", "stage3_max_live_parameters", "stage3_prefetch_bucket_size")
#: DeepSpeed's defaults (``deepspeed/runtime/zero/config.py``) when neither template nor user sets them.
DEEPSPEED_DEFAULTS = {"stage3_max_reuse_distance": 1_000_000_000, "stage3_max_live_parameters": 1_000_000_000,
                      "stage3_prefetch_bucket_size": 50_000_000}
#: Share of device memory kept free when deciding whether the gathered block fits.
HEADROOM = 0.10


@dataclass
class Zero3Tuning:
    """What ``deepspeed.zero3_loop_tuning`` chose and why. Counts are parameter elements per GPU,
    bytes are bytes per GPU.

    ``values``: the three keys as they end up in the DeepSpeed config; ``base``: template /
    DeepSpeed defaults; ``needed``: what the visit plan needs (``reuse_distance`` from
    :func:`reuse_distance_needed`, ``prefetch`` = the largest visit, ``live`` = reuse + prefetch +
    largest visit); ``user``: keys set in ``deepspeed.config.zero_optimization`` (they win).
    """

    mode: str
    zero_stage: int
    applied: bool
    reason: str
    values: dict[str, int] = field(default_factory=dict)
    base: dict[str, int] = field(default_factory=dict)
    needed: dict[str, int] = field(default_factory=dict)
    user: dict[str, Any] = field(default_factory=dict)
    looped_block_numel: int = 0
    visit_numel: list[int] = field(default_factory=list)
    extra_gathered_bytes: int = 0
    free_bytes: int | None = None
    device_memory_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def visit_numel(cfg: RunConfig, layer: int) -> int:
    """Parameter elements one visit of unique layer ``layer`` gathers on a GPU: attention, norms,
    router, the local experts (``num_experts / ep_size`` with an expert-parallel backend), shared
    expert or dense FFN (:func:`smelt_ds.cost.budget.layer_params`)."""
    return _gathered_numel(cfg, layer_params(cfg, layer))


def _gathered_numel(cfg: RunConfig, p: dict[str, int]) -> int:
    """:func:`visit_numel` from the layer's parameter counts ``p`` (:func:`layer_params`)."""
    experts = p["experts"] // cfg.moe_runtime.ep_size if cfg.moe_runtime.backend != "reference" else p["experts"]
    return p["attention"] + p["norms"] + p["router"] + experts + p["shared"] + p["dense"]


def trace(cfg: RunConfig, checkpointed: set | None = None) -> list[tuple[str, Visit]]:
    """The visit-level trace of one forward + backward pass: ``("fwd", v)`` for every visit of
    the plan, then for every visit in reverse ``("recompute", v)`` when it is checkpointed,
    followed by ``("bwd", v)``."""
    schedule = cfg.schedule
    return _trace(schedule.plan, checkpointed_visits(cfg, schedule) if checkpointed is None else checkpointed)


def _trace(plan: list[Visit], checkpointed: set) -> list[tuple[str, Visit]]:
    """:func:`trace` of the visit plan ``plan`` with the ``checkpointed`` visits."""
    out = [("fwd", v) for v in plan]
    for v in reversed(plan):
        if v in checkpointed:
            out.append(("recompute", v))
        out.append(("bwd", v))
    return out


def reuse_distance_needed(cfg: RunConfig, checkpointed: set | None = None) -> int:
    """Smallest ``stage3_max_reuse_distance`` (elements) that keeps every looped layer gathered
    between its consecutive uses within the forward pass and within the backward pass.

    For consecutive uses ``i < j`` of layer ``l`` in :func:`trace` (not across the forward /
    backward boundary), DeepSpeed's walk from a module of use ``i`` passes the rest of layer
    ``l``, every visit in between and the start of layer ``l`` again, i.e. fewer than
    ``sum(visit_numel of the uses between) + visit_numel(l)`` elements; that bound is the
    distance needed. 0 for an unlooped model.
    """
    numel = [visit_numel(cfg, layer) for layer in range(cfg.model.num_layers)]
    return _reuse_distance(cfg.schedule, trace(cfg, checkpointed), numel)


def _reuse_distance(schedule: LoopSchedule, t: list[tuple[str, Visit]], numel: list[int]) -> int:
    """:func:`reuse_distance_needed` from the trace ``t`` and the elements per visit of each unique
    layer, ``numel[layer]``."""
    need = 0
    for layer in range(len(numel)):
        if layer not in schedule.looped_layers:
            continue
        uses = [i for i, (_, v) in enumerate(t) if v.layer == layer]
        for i, j in itertools.pairwise(uses):
            if (t[i][0] == "fwd") != (t[j][0] == "fwd"):
                continue  # forward -> backward: not a loop reuse
            need = max(need, sum(numel[v.layer] for _, v in t[i + 1:j]) + numel[layer])
    return need


def _base_values(zero: dict[str, Any]) -> dict[str, int]:
    return {k: int(zero.get(k, DEEPSPEED_DEFAULTS[k])) for k in KEYS}


def _room_to_gather(cfg: RunConfig, world_size: int, zero: dict[str, Any], device_memory_bytes: int,
                    precision: str) -> tuple[int, int, int]:
    """``(bytes per parameter element, free bytes, device bytes)`` per GPU for ZeRO-3: the
    device memory (``device_memory_bytes``) minus model states,
    activation peak and buffers (without the ZeRO-3 window) of the recipe's own setting
    (:mod:`smelt_ds.cost.memory_terms`), keeping :data:`HEADROOM` free."""
    pbytes = 2 if precision == "bf16" else 4
    mem = device_memory_bytes
    counts = memory_terms.param_counts(cfg)
    ds = cfg.deepspeed
    ep = cfg.moe_runtime.ep_size if world_size % cfg.moe_runtime.ep_size == 0 else 1
    ms = memory_terms.model_states(counts, 1, world_size, 3, ds.offload_optimizer != "none",
                                   ds.offload_param != "none", "bf16" if pbytes == 2 else "fp32", ep)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    act = memory_terms.activation_bytes(cfg, cfg.train.activation_checkpointing.policy, B, S, pbytes).peak
    tmp = memory_terms.temporary_bytes(cfg, counts, 3, B, S, pbytes, ds_zero=zero)
    tmp.pop("zero3_window", None)
    return pbytes, int(mem * (1 - HEADROOM)) - ms.gpu - act - sum(tmp.values()), mem


def plan_zero3(cfg: RunConfig, zero: dict[str, Any], world_size: int, device_memory_bytes: int,
               precision: str) -> Zero3Tuning:
    """Decide the three ZeRO-3 values for ``cfg`` given the ``zero_optimization`` section built so
    far (template values = base), on ``world_size`` ranks of ``device_memory_bytes`` bytes each,
    training in ``precision`` (``bf16`` or ``fp32``: bytes per gathered element). See the module
    docstring for the rules. Analytic: the caller measures the device
    (:mod:`smelt_ds.parallel.hardware`) or names the target GPU.

    The facts come first (checkpointed visits, parameters per layer), then the decision; the
    memory check (:func:`_room_to_gather`) runs only where tuning applies."""
    schedule = cfg.schedule
    checkpointed = checkpointed_visits(cfg, schedule)
    params = [layer_params(cfg, layer) for layer in range(cfg.model.num_layers)]
    numel = [_gathered_numel(cfg, p) for p in params]
    stage = cfg.deepspeed.zero_stage
    user = {k: v for k, v in (cfg.deepspeed.config.get("zero_optimization", {}) or {}).items() if k in KEYS}
    base = _base_values(zero)
    sizes = [numel[v.layer] for v in schedule.plan]
    block = sum(n for layer, n in enumerate(numel) if layer in schedule.looped_layers)
    out = Zero3Tuning(cfg.deepspeed.zero3_loop_tuning, stage, False, "", dict(base), base, {}, user, block, sizes)
    if cfg.deepspeed.zero3_loop_tuning == "off":
        out.reason = "deepspeed.zero3_loop_tuning is 'off': template / DeepSpeed values"
        return _finish(out)
    if stage != 3:
        out.reason = f"ZeRO stage {stage}: parameters are not partitioned, nothing to tune"
        return _finish(out)
    if block == 0:
        out.reason = "no looped layers: template / DeepSpeed values"
        return _finish(out)
    reuse = _reuse_distance(schedule, _trace(schedule.plan, checkpointed), numel)
    prefetch = max(sizes)
    out.needed = {"stage3_max_reuse_distance": reuse, "stage3_prefetch_bucket_size": prefetch,
                  "stage3_max_live_parameters": reuse + 2 * prefetch}
    wanted = {k: max(base[k], out.needed[k]) for k in KEYS}
    pbytes, free, mem = _room_to_gather(cfg, world_size, zero, device_memory_bytes, precision)
    extra = pbytes * max(0, wanted["stage3_max_reuse_distance"] + wanted["stage3_prefetch_bucket_size"]
                         - base["stage3_max_reuse_distance"] - base["stage3_prefetch_bucket_size"])
    out.extra_gathered_bytes, out.free_bytes, out.device_memory_bytes = extra, free, mem
    if extra > free:
        out.reason = (f"the looped block ({block:,} elements) would need {extra:,} more bytes gathered but only "
                      f"{max(free, 0):,} are free after model states, activations and buffers with "
                      f"{HEADROOM:.0%} headroom: looped parameters are re-gathered on every visit")
        return _finish(out)
    out.values, out.applied = wanted, True
    if wanted == base:
        out.reason = (f"the template's values already cover the visit plan (reuse distance needed {reuse:,} "
                      f"elements <= {base['stage3_max_reuse_distance']:,}): unchanged")
    else:
        out.reason = (f"reuse distance {reuse:,} elements (looped block {block:,} elements; visit-level trace of "
                      f"forward and backward) keeps looped layers gathered between visits; prefetch one visit "
                      f"({prefetch:,}); live = reuse + 2 x prefetch; {extra:,} extra bytes fit in {free:,} free")
    return _finish(out)


def _finish(out: Zero3Tuning) -> Zero3Tuning:
    for k, v in out.user.items():
        out.values[k] = v
    if out.user:
        out.reason += f"; user-set values win: {sorted(out.user)}"
    return out
