"""The terms of memory per GPU of a SMELT / Baseline run, before launch (analytic).

What a rank holds during training, split the way ZeRO thinks about it (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §3):

* **Model states** (bytes per GPU): parameters, gradients, optimizer states. bf16 mixed
  precision follows DeepSpeed's own estimators exactly:
  ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` (GPU
  ``2 P + 18 P / N``; with ``offload_optimizer`` ``2 P``) and
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (GPU
  ``4 * largest_layer + 18 P / N``; ``+ 2 P / N`` with the optimizer offloaded; only the
  largest layer with parameters offloaded too), with DeepSpeed's 18 bytes per parameter read as
  2 (16-bit grads) + 4 (fp32 grads) + 4 (fp32 master params) + 8 (Adam moments). ZeRO-0 and
  ZeRO-1 have no DeepSpeed estimator; we use the same decomposition (ZeRO-0: nothing sharded,
  ``20 P``; ZeRO-1: fp32 grads, master params and moments sharded, ``4 P + 16 P / N``). fp32
  runs (CPU) hold 4 (params) + 4 (grads) + 8 (Adam moments) bytes per parameter, sharded the
  same way. **Expert parallelism**: expert parameters are sharded over the expert-parallel group
  (each GPU holds ``E / ep`` experts) and ZeRO-partitioned over the expert-data-parallel group
  (``N / ep`` ranks), dense parameters over all ``N`` ranks; the estimator is applied to each
  part (``P_dense`` on ``N`` GPUs, ``P_expert / ep`` on ``N / ep`` GPUs).
* **Activations** saved for backward per micro-batch: a per-visit formula derived from what
  *our* code saves (each term is an autograd saved tensor of smelt_ds.model, checked against
  ``torch.autograd.graph.saved_tensors_hooks`` by tests/parallel/test_memory.py), in the spirit of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198, §4.1: ``s b h (34 + 5 a s / h)`` bytes per GPT layer in fp16), adapted to
  RMSNorm computed in fp32, GQA (our attention repeats K/V to all query heads before SDPA, so
  K and V are saved at ``Nq`` heads), SDPA flash/efficient kernels (no ``s^2`` term; only the
  log-sum-exp), SwiGLU experts on ``T * K`` routed token copies (dropless top-k routing) and
  the router's fp32 logits. See :func:`visit_activation_terms` for every term. A checkpointed
  visit keeps only its input ``(B, S, H)``; recomputing it in backward transiently needs one
  visit's activations again (Korthikanti et al. §4.2), which the *peak* adds.
* **Temporary buffers**: the logits and their gradient, ZeRO's gradient-reduction / all-gather
  buckets (from the DeepSpeed config), and under ZeRO-3 the parameters kept gathered by the
  reuse distance and prefetch window.
* **KV cache** for inference at a context length: ``visits * 2 * Nkv * D`` bytes per token
  (:func:`smelt_ds.cost.budget.kv_cache_bytes_per_token`).

Units: bytes everywhere unless a name says otherwise; parameters and elements are counts;
lengths are tokens. ``1 GiB = 2**30`` bytes, ``1 GB = 10**9`` bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.cost.activation_checkpointing import checkpointed_visits
from smelt_ds.cost.budget import layer_params
from smelt_ds.errors import ConfigError
from smelt_ds.model.looping import LoopSchedule

__all__ = ["GiB", "parse_bytes", "format_bytes", "ParamCounts", "param_counts", "ModelStates", "model_states",
           "POLICIES", "visit_activation_terms", "outside_activation_terms", "ActivationEstimate",
           "activation_bytes", "temporary_bytes", "with_policy"]

GiB = 2 ** 30
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
POLICIES = ("none", "full", "looped", "every_n")


# ---------------------------------------------------------------------------------------------
# units
# ---------------------------------------------------------------------------------------------


def parse_bytes(text: str | int | float, what: str = "--device-memory") -> int:
    """A memory size with its unit -> bytes: ``"80GiB"``, ``"141 GB"``, ``"1.5e3MB"``. Units (case
    ignored): B; KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12 bytes; KiB, MiB, GiB, TiB = 2**10 ... 2**40
    bytes. A Python ``int`` / ``float`` is taken as bytes (the API); a string must carry its unit.

    Raises:
        ConfigError: naming ``what`` (the flag or field), the value and the fix, for a string
            without a unit (``"80"``: 80 bytes or 80 GB?), an unknown unit, or a size that is not
            positive.
    """
    example = "e.g. 79.1GiB (an H100 80GB as torch reports it) or 139.7GiB (an H200 141GB)"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "b"
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m and not m.group(2):
            raise ConfigError(f"`{what}` ({text!r}) has no unit: write the number with one of B, KB, MB, GB, TB "
                              f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), {example}")
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"`{what}` ({text!r}) is not a memory size: write a number with a unit among "
                              f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, {example}")
        value, unit = float(m.group(1)), m.group(2).lower()
    out = int(value * _UNITS[unit])
    if out <= 0:
        raise ConfigError(f"`{what}` ({text!r}) must be a positive memory size, {example}")
    return out


def format_bytes(n: float) -> str:
    """Bytes as GiB / MiB / KiB with 2 decimals (binary units)."""
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------


@dataclass
class ParamCounts:
    """Parameter counts (elements) of a recipe, all unique parameters counted once.

    ``total`` includes the token embedding and the output head (they occupy memory);
    ``expert`` is the routed experts' weights of all MoE layers (all experts), ``dense`` the
    rest; ``largest_module`` is DeepSpeed's ``largest_layer_params`` (the most direct parameters
    of one module, ``deepspeed.runtime.zero.stage3.model_to_params``) on one GPU with
    ``moe_runtime.ep_size`` expert parallelism.
    """

    total: int
    dense: int
    expert: int
    largest_module: int


def _local_experts(cfg: RunConfig) -> int:
    rt = cfg.moe_runtime
    return cfg.moe.num_experts // rt.ep_size if rt.backend != "reference" else cfg.moe.num_experts


def param_counts(cfg: RunConfig) -> ParamCounts:
    """Count a recipe's parameters from its config (no model is built)."""
    m, moe = cfg.model, cfg.moe
    H, V = m.hidden_size, m.vocab_size
    embed = V * H * (1 if m.tie_embeddings else 2)
    per_layer = [layer_params(cfg, i) for i in range(m.num_layers)]
    expert = sum(p["experts"] for p in per_layer)
    total = sum(sum(v for k, v in p.items() if k != "active_experts") for p in per_layer) + H + embed
    D, Nq, Nkv = m.resolved_head_dim, m.num_heads, m.num_kv_heads
    modules = [V * H, H * Nq * D, H * Nkv * D]
    if any(i >= m.first_k_dense for i in range(m.num_layers)):
        per_expert = 3 * H * moe.expert_ffn_size
        modules += [moe.num_experts * H, H * moe.shared_expert_ffn_size]
        modules.append(H * moe.expert_ffn_size if cfg.moe_runtime.backend == "deepspeed"
                       else _local_experts(cfg) * per_expert)
    if m.first_k_dense:
        modules.append(H * m.dense_ffn_size)
    return ParamCounts(total=total, dense=total - expert, expert=expert, largest_module=max(modules))


# ---------------------------------------------------------------------------------------------
# model states
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelStates:
    """Model-state bytes per GPU (and host bytes per node) of one ZeRO option.

    ``params`` / ``grads`` / ``optimizer`` are on the GPU; ``zero3_gathered`` is DeepSpeed's
    ``4 * largest_layer_params`` (bf16; 8 in fp32) for the gathered largest layer under ZeRO-3;
    ``gpu`` = DeepSpeed's estimate (bf16 ZeRO-2/3; the four parts add up to it to within
    rounding), otherwise their sum; ``cpu_per_node`` is DeepSpeed's host
    estimate (offloaded states plus its loading buffer, with ``additional_buffer_factor`` 1.5).
    """

    params: int
    grads: int
    optimizer: int
    zero3_gathered: int
    gpu: int
    cpu_per_node: int


#: DeepSpeed's estimators multiply CPU memory by this safety factor (``additional_buffer_factor``)
_DS_CPU_BUFFER_FACTOR = 1.5


def _zero2_estimate(P: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """``(cpu, gpu)`` bytes of DeepSpeed 0.19's ``estimate_zero2_model_states_mem_needs`` (bf16,
    ``deepspeed/runtime/zero/stage_1_and_2.py``), written out so that ``cost/`` needs no DeepSpeed
    import: GPU ``2 P + 18 P / N`` (``2 P`` with the optimizer offloaded); CPU ``4 P`` per GPU of the
    node (``P * max(4 N, 16)`` offloaded), times 1.5. tests/parallel/test_memory.py checks equality."""
    N = gpus_per_node * nodes
    if offload:
        return int(P * max(4 * N, 16) * _DS_CPU_BUFFER_FACTOR), 2 * P
    return int(P * 4 * gpus_per_node * _DS_CPU_BUFFER_FACTOR), 2 * P + int(18 * P / N)


def _zero3_estimate(P: int, largest: int, gpus_per_node: float, nodes: int, off_opt: bool,
                    off_param: bool) -> tuple[int, int, int]:
    """``(cpu, gpu, gathered)`` bytes of DeepSpeed 0.19's ``estimate_zero3_model_states_mem_needs``
    with ``zero_init`` (``deepspeed/runtime/zero/stage3.py``): the largest layer gathered in bf16
    (``4 * largest`` with its gradient) plus ``18 P / N`` on the GPU (``2 P / N`` with the optimizer
    offloaded, nothing with the parameters offloaded too); CPU per node ``18 P / nodes``
    (``16 P / nodes`` optimizer-only offload; the largest layer per GPU without offload), times
    1.5. tests/parallel/test_memory.py checks equality with DeepSpeed's function."""
    N = gpus_per_node * nodes
    gathered = 4 * largest
    if off_opt and off_param:
        return int(P * 18 / nodes * _DS_CPU_BUFFER_FACTOR), gathered, gathered
    if off_opt:
        return int(P * 16 / nodes * _DS_CPU_BUFFER_FACTOR), gathered + int(2 * P / N), gathered
    return int(largest * 4 * gpus_per_node * _DS_CPU_BUFFER_FACTOR), gathered + int(18 * P / N), gathered


def _bf16_part(P: float, gpus_per_node: float, nodes: int, stage: int, off_opt: bool, off_param: bool,
               largest: int) -> tuple[float, float, float, float, float, float]:
    """(params, grads, optimizer, gathered, cpu, gpu) bytes of ``P`` parameters on
    ``gpus_per_node * nodes`` GPUs. ``gpu`` and ``cpu`` are DeepSpeed's estimates where one exists
    (ZeRO-2/3); the first four split ``gpu`` the way DeepSpeed's comment counts its 18 bytes
    (16-bit params 2, 16-bit grads 2, fp32 grads 4, fp32 master params 4, Adam moments 8; the
    master params count as optimizer state, as in the ZeRO paper)."""
    N = gpus_per_node * nodes
    if stage == 3:
        # gpus_per_node is fractional for an expert part whose expert-parallel groups span nodes (ep_size >
        # GPUs per node): truncating it gave 0 GPUs and a ZeroDivisionError
        cpu, gpu, gathered = _zero3_estimate(int(P), largest, gpus_per_node, nodes, off_opt, off_param)
        if off_param:
            return 0.0, 0.0, 0.0, gathered, cpu, gpu
        if off_opt:
            return 2 * P / N, 0.0, 0.0, gathered, cpu, gpu
        return 2 * P / N, 4 * P / N, 12 * P / N, gathered, cpu, gpu  # 2 + 4 + 12 = 18 B / N
    if stage == 2:
        cpu, gpu = _zero2_estimate(int(P), int(gpus_per_node), nodes, off_opt)
        if off_opt:
            return 2 * P, 0.0, 0.0, 0.0, cpu, gpu
        return 2 * P, 6 * P / N, 12 * P / N, 0.0, cpu, gpu  # 2 + (2 + 4 + 12) / N
    cpu, _ = _zero2_estimate(int(P), int(gpus_per_node), nodes, False)
    # ZeRO-1: 16-bit grads replicated, fp32 grads / master / moments sharded (4 + 16 / N);
    # ZeRO-0: nothing sharded (20)
    parts = (2 * P, 2 * P + 4 * P / N, 12 * P / N) if stage == 1 else (2 * P, 6 * P, 12 * P)
    return (*parts, 0.0, cpu, sum(parts))


def _fp32_part(P: float, gpus_per_node: float, nodes: int, stage: int, off_opt: bool, off_param: bool,
               largest: int) -> tuple[float, float, float, float, float, float]:
    """fp32 training (CPU runs): 4 B params + 4 B grads + 8 B Adam moments, no master copy, sharded
    like the bf16 case; host memory as DeepSpeed's estimators with 16 B instead of 18 B."""
    N = gpus_per_node * nodes
    load = 4 * P * gpus_per_node * 1.5  # DeepSpeed: loading the model on the host, per node
    if stage == 3:
        gathered = 8 * largest
        if off_param:
            parts, cpu = (0.0, 0.0, 0.0), P * 16 * 1.5 / nodes
        elif off_opt:
            parts, cpu = (4 * P / N, 0.0, 0.0), P * 12 * 1.5 / nodes
        else:
            parts, cpu = (4 * P / N, 4 * P / N, 8 * P / N), load
        return (*parts, gathered, cpu, sum(parts) + gathered)
    if stage == 2:
        parts = (4 * P, 0.0, 0.0) if off_opt else (4 * P, 4 * P / N, 8 * P / N)
        cpu = P * max(4 * N, 16) * 1.5 if off_opt else load
    elif stage == 1:
        parts, cpu = (4 * P, 4 * P, 8 * P / N), load
    else:
        parts, cpu = (4 * P, 4 * P, 8 * P), load
    return (*parts, 0.0, cpu, sum(parts))


def model_states(counts: ParamCounts, nodes: int, gpus_per_node: int, stage: int, offload_optimizer: bool = False,
                 offload_param: bool = False, precision: str = "bf16", ep_size: int = 1) -> ModelStates:
    """Model-state bytes per GPU for ``nodes x gpus_per_node`` GPUs (see the module docstring).

    With ``ep_size`` > 1 the dense part is estimated on all N GPUs and the expert part as a model
    of ``expert / ep_size`` parameters on ``N / ep_size`` GPUs (the expert-data-parallel group).
    Per GPU that is all; the host of a node serves the ranks of every expert-parallel shard placed
    on it (DeepSpeed groups consecutive ranks, so ``min(ep_size, gpus_per_node)`` shards per node),
    so the expert part's host bytes per node count that many shards: with the optimizer offloaded,
    every parameter's fp32 master copy and Adam moments then sit on some host, 16 bytes per
    parameter over the nodes, whatever ``ep_size`` is.
    """
    part = _bf16_part if precision == "bf16" else _fp32_part
    splits = [(counts.total, gpus_per_node, 1)] if ep_size == 1 else \
        [(counts.dense, gpus_per_node, 1),
         (counts.expert / ep_size, gpus_per_node / ep_size, min(ep_size, gpus_per_node))]
    sums = [0.0] * 6
    for i, (P, g, shards_per_node) in enumerate(splits):
        vals = list(part(P, g, nodes, stage, offload_optimizer, offload_param, counts.largest_module if i == 0 else 0))
        vals[4] *= shards_per_node  # host bytes per node
        sums = [x + y for x, y in zip(sums, vals, strict=True)]
    params, grads, optim, gathered, cpu, gpu = (int(v) for v in sums)
    return ModelStates(params, grads, optim, gathered, gpu, cpu)


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------


def _grouped_mm_used(cfg: RunConfig, act_bytes: int) -> bool:
    """Mirror of GroupedExperts: ``torch._grouped_mm`` when available and the row strides of H and
    F are multiples of 16 bytes (``expert_impl`` auto or grouped_mm), else the per-expert loop."""
    moe = cfg.moe
    if moe.expert_impl == "loop" or not hasattr(torch, "_grouped_mm"):
        return False
    return (cfg.model.hidden_size * act_bytes) % 16 == 0 and (moe.expert_ffn_size * act_bytes) % 16 == 0


def _norm_internal(T: int, H: int, a: int) -> int:
    """RMSNorm (computed in fp32): the fp32 input and ``x * rsqrt`` (``4 + 4`` bytes per element),
    the rsqrt ``(T, 1)`` in fp32, and in 16-bit runs the fp32 copy of the weight. The norm's
    output is saved by its consumer and counted there."""
    return 8 * T * H + 4 * T + (4 * H if a != 4 else 0)


def visit_activation_terms(cfg: RunConfig, layer: int, micro_batch: int, seq_len: int, act_bytes: int,
                           device: str = "cuda") -> dict[str, int]:
    """Bytes saved for backward by one visit of unique layer ``layer``, by term.

    Notation: B micro-batch, S seq_len, T = B*S tokens, H hidden, Nq query heads, D head size, E
    experts, K top-k, F expert FFN size, N = T*K routed token copies (dropless), a = bytes of
    the activation dtype (2 bf16, 4 fp32). Terms (each an autograd saved tensor of our code):

    * ``norms``: two RMSNorms (:func:`_norm_internal`) plus their outputs ``a T H`` each (the
      input of q/k/v and of the router / FFN).
    * ``attention``: SDPA flash / memory-efficient kernels save q, K, V (K, V already repeated to
      Nq heads by our GQA code) and the output ``4 a T Nq D`` (the output is also o_proj's
      input) plus the fp32 log-sum-exp ``4 T Nq``. The math kernel (CPU with attention dropout)
      saves q, K, V, the output copy and three ``B Nq S^2`` tensors (softmax, dropout mask,
      dropped probabilities) instead. 16-bit runs add the RoPE tables cast per call.
    * ``qk_norm`` (``model.qk_norm``): the RMSNorms of q and k per head, rows ``T Nq`` and ``T Nkv``
      of width D (:func:`_norm_internal`).
    * ``dropout`` (``model.dropout`` > 0): the two residual-branch dropout masks: 1 byte per
      element on CUDA (bool mask), ``a`` on CPU (scaled noise tensor).
    * MoE layers: ``router`` fp32 logits and scores ``8 T E`` (+ ``4 T`` for the sigmoid scores'
      sum), top-k indices ``8 T K``,
      top-k weights and their sum ``4 T K + 4 T``, z-loss ``4 T``, jitter noise and jittered
      input ``2 a T H``; ``dispatch`` sorted-copy order and source token ``16 N`` (int64);
      ``experts`` (SwiGLU on N copies) input ``a N H``, gate/up output ``2 a N F``, product
      ``a N F``, with the grouped GEMM group offsets ``4 E`` (its fused SwiGLU recomputes silu in
      backward), with the per-expert loop the silu output ``a N F``;
      ``combine`` expert outputs ``a N H`` and the top-k weights ``a N`` in the activation dtype;
      ``shared_expert`` ``a T (4 Fs + H + 1)``.
    * dense layers: ``ffn`` SwiGLU ``4 a T Fd``.
    """
    m, moe = cfg.model, cfg.moe
    B, S, a = micro_batch, seq_len, act_bytes
    T, H, Nq, D = B * S, m.hidden_size, m.num_heads, m.resolved_head_dim
    is_moe = layer >= m.first_k_dense
    jitter = is_moe and moe.router_jitter > 0
    norm2_out_saved = not jitter or not is_moe or moe.shared_expert_ffn_size > 0
    out = {"norms": 2 * _norm_internal(T, H, a) + a * T * H * (1 + int(norm2_out_saved))}
    math_attention = device == "cpu" and m.dropout > 0
    attn = 4 * a * T * Nq * D + (3 * a * B * Nq * S * S if math_attention else 4 * T * Nq)
    out["attention"] = attn + (4 * a * S * D if a != 4 else 0)
    if m.qk_norm:  # two RMSNorms over D per head (rows T * Nq and T * Nkv); RoPE saves only its tables
        out["qk_norm"] = _norm_internal(T * Nq, D, a) + _norm_internal(T * m.num_kv_heads, D, a)
    if m.dropout > 0:
        out["dropout"] = 2 * T * H * (a if device == "cpu" else 1)
    if not is_moe:
        out["ffn"] = 4 * a * T * m.dense_ffn_size
        return out
    E, K, F = moe.num_experts, moe.top_k, moe.expert_ffn_size
    N = T * K
    out["router"] = (8 * T * E + 8 * T * K + 4 * T * K + 8 * T + 4 * E + (2 * a * T * H if jitter else 0)
                     + (4 * T if moe.score_func == "sigmoid" else 0))
    out["dispatch"] = 16 * N
    grouped = _grouped_mm_used(cfg, a)  # its fused SwiGLU recomputes silu; the per-expert loop saves it
    out["experts"] = a * N * (H + (3 if grouped else 4) * F) + (4 * E if grouped else 0)
    out["combine"] = a * N * H + a * N
    if moe.shared_expert_ffn_size:
        out["shared_expert"] = a * T * (4 * moe.shared_expert_ffn_size + H + 1)
    return out


def outside_activation_terms(cfg: RunConfig, micro_batch: int, seq_len: int, act_bytes: int) -> dict[str, int]:
    """Bytes saved outside the visits: token ids and labels ``16 T`` (int64), the final RMSNorm
    and its output, the fp32 log-softmax of the cross-entropy ``4 T V`` (logits are cast to fp32).
    The RoPE tables are slices of a persistent buffer (nothing new is stored in fp32; 16-bit
    casts are in the ``attention`` term)."""
    m = cfg.model
    T, H, a = micro_batch * seq_len, m.hidden_size, act_bytes
    return {"ids_labels": 16 * T, "final_norm": _norm_internal(T, H, a) + a * T * H,
            "log_softmax": 4 * T * m.vocab_size}


@dataclass
class ActivationEstimate:
    """Activation bytes per micro-batch under one checkpointing policy.

    ``stored``: saved for backward at the end of the forward pass (what
    :class:`smelt_ds.study.memory_profile.SavedTensorCounter` measures); ``peak``: ``stored`` plus
    the largest checkpointed visit recomputed in backward; ``per_visit``: bytes a non-checkpointed
    visit saves, by visit of the plan; ``checkpointed``: how many visits are checkpointed.
    """

    policy: str
    stored: int
    peak: int
    per_visit: list[int]
    checkpointed: int


def with_policy(cfg: RunConfig, policy: str) -> RunConfig:
    """``cfg`` with ``train.activation_checkpointing.policy`` set to ``policy`` (not re-validated)."""
    ac = cfg.train.activation_checkpointing.model_copy(update={"policy": policy})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing": ac})})


def _policy_visits(cfg: RunConfig, schedule: LoopSchedule, policy: str) -> set:

    return checkpointed_visits(with_policy(cfg, policy), schedule)


def activation_bytes(cfg: RunConfig, policy: str, micro_batch: int, seq_len: int, act_bytes: int,
                     device: str = "cuda") -> ActivationEstimate:
    """Activation bytes of one micro-batch under ``policy`` (none | full | looped | every_n, with
    ``train.activation_checkpointing.every_n``): a checkpointed visit keeps its input
    ``a * B * S * H``, every other visit :func:`visit_activation_terms`; plus
    :func:`outside_activation_terms`."""
    schedule = cfg.schedule
    ckpt = _policy_visits(cfg, schedule, policy)
    full = [sum(visit_activation_terms(cfg, v.layer, micro_batch, seq_len, act_bytes, device).values())
            for v in schedule.plan]
    kept = act_bytes * micro_batch * seq_len * cfg.model.hidden_size
    stored = sum(kept if v in ckpt else f for v, f in zip(schedule.plan, full, strict=True))
    outside = outside_activation_terms(cfg, micro_batch, seq_len, act_bytes)
    if len(ckpt) == len(schedule.plan):
        outside["rope"] = 0  # only checkpoints use the tables; they hold them outside autograd
    stored += sum(outside.values())
    recompute = max((f for v, f in zip(schedule.plan, full, strict=True) if v in ckpt), default=0)
    return ActivationEstimate(policy, stored, stored + recompute, full, len(ckpt))


# ---------------------------------------------------------------------------------------------
# temporary buffers
# ---------------------------------------------------------------------------------------------


def temporary_bytes(cfg: RunConfig, counts: ParamCounts, stage: int, micro_batch: int, seq_len: int,
                    act_bytes: int, ds_zero: dict[str, Any]) -> dict[str, int]:
    """Short-lived buffers per GPU, by name (bytes):

    * ``logits``: the logits ``a T V`` held until backward, their fp32 gradient through the
      log-softmax ``4 T V`` and the logits' gradient ``a T V``.
    * ``zero_buckets``: the gradient-reduction buffers DeepSpeed allocates up front with
      ``contiguous_gradients`` (its default): ``reduce_bucket_size`` elements, fp32 under ZeRO-1
      (it stages the fp32 accumulator), the gradient dtype under ZeRO-2/3, twice under ZeRO-2 with
      ``overlap_comm`` (double buffering; ``stage_1_and_2.py`` ``setup_buckets``, ``stage3.py``).
    * ``zero3_window``: ZeRO-3 parameters kept gathered by ``stage3_max_reuse_distance`` plus the
      ``stage3_prefetch_bucket_size`` prefetch, at most the whole local model, beyond the largest
      layer already in the model states.

    ``ds_zero`` is the ``zero_optimization`` section of the DeepSpeed config
    (:func:`smelt_ds.parallel.zero_section.zero_section`: the stage's template, loop tuning, the
    recipe's own keys).
    """
    T, V, a = micro_batch * seq_len, cfg.model.vocab_size, act_bytes
    out = {"logits": 2 * a * T * V + 4 * T * V}
    zero = ds_zero
    bucket = int(zero.get("reduce_bucket_size", 5e8))
    if stage in (1, 2, 3) and zero.get("contiguous_gradients", True):
        if stage == 1:
            out["zero_buckets"] = 4 * bucket
        else:
            copies = 2 if stage == 2 and zero.get("overlap_comm", False) else 1
            out["zero_buckets"] = copies * a * bucket
    if stage == 3:
        local = counts.dense + counts.expert // max(cfg.moe_runtime.ep_size, 1)
        window = int(zero.get("stage3_max_reuse_distance", 1e9)) + int(zero.get("stage3_prefetch_bucket_size", 5e7))
        out["zero3_window"] = a * max(0, min(window, local) - counts.largest_module)
    return out
