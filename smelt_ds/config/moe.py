"""The ``moe`` and ``moe_runtime`` sections of a recipe, and their checks.

``moe`` is the Mixture-of-Experts architecture (router and experts: what the model is);
``moe_runtime`` is how the MoE layers run (backend, expert parallelism, capacity), which is not
model architecture (docs/architecture.md). :func:`check_moe_backend` holds the rules between the two and the
ZeRO stage; :func:`check_moved_keys` refuses the older layout that kept the runtime knobs and
loss coefficients in ``moe:`` (:data:`MOVED_MOE_KEYS`).
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import ConfigError, fail

__all__ = ["MoEConfig", "MoERuntimeConfig", "MOVED_MOE_KEYS", "RUNTIME_FUNCTION_KEYS", "RUNTIME_PLACEMENT_KEYS",
           "check_moe", "check_moe_backend", "check_moved_keys", "token_routing", "routing_changes"]


class MoEConfig(StrictModel):
    """Mixture-of-Experts architecture: router and experts (what the model is). How the experts
    run (backend, expert parallelism, capacity) is :class:`MoERuntimeConfig`; the loss
    coefficients are in :class:`TrainConfig`."""

    num_experts: int = Field(8, gt=0, description="routed experts per MoE layer E")
    top_k: int = Field(2, gt=0, description="experts per token")
    expert_ffn_size: int = Field(128, gt=0, description="intermediate size F of one expert")
    shared_expert_ffn_size: int = Field(0, ge=0, description="intermediate size of the shared expert; 0 = none")
    score_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="router scores: softmax over the E experts, or sigmoid per expert (DeepSeek-V3); "
                               "the top-k of the scores are chosen")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k weights to sum to 1")
    router_jitter: float = Field(0.0, ge=0, description="multiplicative uniform noise on router input in training")
    aux_loss_free_bias: bool = Field(
        False, description="DeepSeek-V3 expert bias for selection, updated outside autograd")
    bias_update_rate: float = Field(1e-3, ge=0, description="step size of the aux-loss-free bias update")
    expert_impl: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto", description="reference backend: torch._grouped_mm where available, else a per-expert loop")


class MoERuntimeConfig(StrictModel):
    """How the MoE layers run (not model architecture): the backend, expert parallelism, and the
    ``deepspeed`` backend's capacity and kernels. Cross-field rules against ``moe`` and
    ``deepspeed`` are checked when the recipe is loaded (:func:`check_moe_backend`)."""

    backend: Literal["reference", "deepspeed", "autoep"] = Field(
        "reference", description="how the MoE layers run: reference (plain PyTorch, dropless, ZeRO 0-3), deepspeed "
                                 "(DeepSpeed-MoE: capacity, token dropping, ZeRO 0-2), autoep (DeepSpeed AutoEP, "
                                 "dropless, ZeRO 0-3); docs/deepspeed_notes.md")
    ep_size: int = Field(1, gt=0, description="expert-parallel size (deepspeed backend: ep_size, autoep: autoep_size)")
    capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: training capacity factor")
    eval_capacity_factor: float = Field(1.0, gt=0, description="deepspeed backend: eval capacity factor")
    min_capacity: int = Field(4, ge=0, description="deepspeed backend: minimum tokens per expert")
    drop_tokens: bool = Field(True, description="deepspeed backend: drop tokens over capacity")
    use_tutel: bool = Field(False, description="deepspeed backend: tutel kernels (optional package)")


#: ``moe_runtime`` keys that change the function the MoE layers compute (which tokens reach their
#: experts, in training and in validation): a resume may not change it (:func:`token_routing`)
RUNTIME_FUNCTION_KEYS = ("drop_tokens", "capacity_factor", "eval_capacity_factor", "min_capacity")
#: ``moe_runtime`` keys that change only where and how fast the same function runs: a resume may
#: change them (a backend or expert-parallel size converts the checkpoint, docs/changing_scale.md)
RUNTIME_PLACEMENT_KEYS = ("backend", "ep_size", "use_tutel")


def token_routing(rt: MoERuntimeConfig) -> dict[str, Any]:
    """What ``moe_runtime`` decides of the function the MoE layers compute, keyed by
    :data:`RUNTIME_FUNCTION_KEYS`: ``{"drop_tokens": False}`` when every token reaches its top-k
    experts (the dropless ``reference`` and ``autoep`` backends, and ``deepspeed`` with
    ``drop_tokens: false``, whose gates then size the capacity to the busiest expert so that the
    capacity fields decide nothing), else ``drop_tokens`` true with ``capacity_factor``,
    ``eval_capacity_factor`` and ``min_capacity`` (DeepSpeed-MoE drops the tokens over an
    expert's capacity, ``max(min_capacity, factor x tokens x top_k / experts)``)."""
    if rt.backend != "deepspeed" or not rt.drop_tokens:
        return {"drop_tokens": False}
    return {k: getattr(rt, k) for k in RUNTIME_FUNCTION_KEYS}


def routing_changes(old: MoERuntimeConfig, new: MoERuntimeConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` for each :data:`RUNTIME_FUNCTION_KEYS` entry whose effective value
    (:func:`token_routing`) differs between the runtimes ``old`` and ``new``; ``drop_tokens``
    alone when that differs (the capacity decides nothing on the dropless side). Empty when both
    compute the same function."""
    a, b = token_routing(old), token_routing(new)
    if a["drop_tokens"] != b["drop_tokens"]:
        return {"drop_tokens": (a["drop_tokens"], b["drop_tokens"])}
    return {k: (a[k], b[k]) for k in RUNTIME_FUNCTION_KEYS if k in a and a[k] != b[k]}


#: Keys that used to be in ``moe:`` (older recipes), and the section that holds them now.
MOVED_MOE_KEYS: dict[str, str] = {
    **{k: "moe_runtime" for k in ("backend", "ep_size", "capacity_factor", "eval_capacity_factor",
                                  "min_capacity", "drop_tokens", "use_tutel")},
    "aux_loss_coef": "train", "z_loss_coef": "train",
}


def check_moe(moe: MoEConfig) -> None:
    """``moe.top_k`` is at most ``moe.num_experts``. Raises ConfigError naming the field, its value
    and the fix."""
    if moe.top_k > moe.num_experts:
        fail("moe.top_k", moe.top_k, f"must be <= `moe.num_experts` ({moe.num_experts})",
              "lower moe.top_k or raise moe.num_experts")


def check_moe_backend(moe: MoEConfig, rt: MoERuntimeConfig, zero_stage: int) -> None:
    """What ``moe_runtime.backend`` can run, given the architecture and the ZeRO stage
    (``deepspeed.zero_stage``). One ConfigError per rule, naming field, value
    and fix. Checked at load time; :func:`smelt_ds.parallel.moe_backends.apply_backend` repeats
    it for an explicit ZeRO stage and adds the runtime checks (tutel installed, world size).

    Rules: ``reference`` has no expert parallelism. ``deepspeed`` and ``autoep``: ``moe.num_experts``
    divisible by ``moe_runtime.ep_size``. ``deepspeed``: no ZeRO-3 (DeepSpeed raises ``Native
    DeepSpeed MoE is not supported with ZeRO Stage 3`` inside ``deepspeed.initialize``), softmax
    only (TopKGate), no ``aux_loss_free_bias`` (no expert bias in TopKGate), ``norm_topk_prob``
    equal to DeepSpeed's fixed choice (top-1: raw softmax weight; top-k >= 2: renormalised).
    ``autoep``: no ``aux_loss_free_bias`` (AutoEP rejects ``load_balance_coeff``), no
    ``router_jitter`` (AutoEP's router has none). ``use_tutel`` and a capacity other than the
    defaults (``capacity_factor``, ``eval_capacity_factor``, ``min_capacity``) only with ``deepspeed``.
    """
    b = rt.backend
    if b == "reference" and rt.ep_size != 1:
        fail("moe_runtime.ep_size", rt.ep_size, "needs an expert-parallel backend",
              "set moe_runtime.backend to 'deepspeed' or 'autoep', or moe_runtime.ep_size to 1")
    if rt.use_tutel and b != "deepspeed":
        fail("moe_runtime.use_tutel", True, f"only applies to moe_runtime.backend 'deepspeed' (this recipe: {b!r})",
              "set moe_runtime.backend to 'deepspeed' (tutel kernels for DeepSpeed-MoE) or moe_runtime.use_tutel "
              "to false")
    if b != "deepspeed":  # reference and AutoEP are dropless: a capacity would claim what does not run
        defaults = MoERuntimeConfig()
        for name in ("capacity_factor", "eval_capacity_factor", "min_capacity"):
            if getattr(rt, name) != getattr(defaults, name):
                fail(f"moe_runtime.{name}", getattr(rt, name), f"only applies to moe_runtime.backend 'deepspeed' "
                     f"(backend {b!r} routes every token: no capacity, nothing dropped)",
                     f"remove moe_runtime.{name} or set moe_runtime.backend to 'deepspeed'")
    if b == "reference":
        return
    if moe.num_experts % rt.ep_size:
        fail("moe.num_experts", moe.num_experts, f"must be divisible by `moe_runtime.ep_size` ({rt.ep_size})",
              "choose an expert count that is a multiple of ep_size, or another moe_runtime.ep_size")
    if moe.aux_loss_free_bias:
        why = ("TopKGate has no expert bias" if b == "deepspeed" else
               "DeepSpeed AutoEP rejects expert_parallel.load_balance_coeff")
        fail("moe.aux_loss_free_bias", True, f"is not supported by moe_runtime.backend {b!r} ({why})",
              "set moe.aux_loss_free_bias to false, or use moe_runtime.backend 'reference'")
    if b == "deepspeed":
        if zero_stage == 3:
            fail("moe_runtime.backend", b, "does not support ZeRO stage 3 (`deepspeed.zero_stage`; DeepSpeed "
                  "raises 'Native DeepSpeed MoE is not supported with ZeRO Stage 3')",
                 "use moe_runtime.backend 'autoep' (ZeRO 0-3), or ZeRO stage <= 2")
        if moe.score_func != "softmax":
            fail("moe.score_func", moe.score_func, "is not supported by moe_runtime.backend 'deepspeed' (TopKGate "
                  "is softmax-only)", "set moe.score_func to 'softmax', or use moe_runtime.backend 'autoep' or "
                  "'reference'")
        want = moe.top_k >= 2
        if moe.norm_topk_prob != want:
            how = ("renormalises the top-k weights to sum to 1" if want else
                   "weights the top-1 expert by its raw softmax probability")
            fail("moe.norm_topk_prob", moe.norm_topk_prob, f"differs from DeepSpeed's gate, which for top_k "
                  f"{moe.top_k} {how}", f"set moe.norm_topk_prob to {str(want).lower()}, or use "
                  "moe_runtime.backend 'autoep' or 'reference'")
    elif moe.router_jitter > 0:
        fail("moe.router_jitter", moe.router_jitter, "is not supported by moe_runtime.backend 'autoep' (AutoEP's "
              "TokenChoiceTopKRouter has no input jitter)", "set moe.router_jitter to 0, or use "
              "moe_runtime.backend 'deepspeed' or 'reference'")


def check_moved_keys(raw: Any) -> None:
    """Refuse a recipe in the older layout: ``moe.<key>`` for a key of
    :data:`MOVED_MOE_KEYS`. One ConfigError names every moved key, its new place and the YAML
    to write (``--set moe.ep_size=2`` overrides land here too)."""
    moe = raw.get("moe") if isinstance(raw, dict) else None
    if not isinstance(moe, dict):
        return
    moved = [k for k in MOVED_MOE_KEYS if k in moe]
    if not moved:
        return
    lines = []
    for k in moved:
        new, v = MOVED_MOE_KEYS[k], _flow_yaml(moe[k])
        lines.append(f"`moe.{k}` moved to `{new}.{k}`: write `{new}: {{{k}: {v}}}` "
                     f"(or --set {new}.{k}={v})")
    raise ConfigError("recipe uses the old `moe:` layout:\n  " + "\n  ".join(lines))


def _flow_yaml(value: Any) -> str:
    """``value`` as inline YAML (``autoep``, ``0.01``, ``true``)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()
