"""Memory per GPU of a SMELT / Baseline run, before launch (estimates) and measured (profiling runs).

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
  ``torch.autograd.graph.saved_tensors_hooks`` by tests/test_memory.py), in the spirit of
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
  (:func:`smelt_ds.budget.kv_cache_bytes_per_token`).

Units: bytes everywhere unless a name says otherwise; parameters and elements are counts;
lengths are tokens. ``1 GiB = 2**30`` bytes, ``1 GB = 10**9`` bytes.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from smelt_ds.budget import kv_cache_bytes_per_token, layer_params
from smelt_ds.config import RunConfig, config_from_dict, config_to_dict
from smelt_ds.errors import ConfigError
from smelt_ds.model.looping import LoopSchedule

__all__ = ["GiB", "parse_bytes", "format_bytes", "ParamCounts", "param_counts", "ModelStates", "model_states",
           "ZERO_OPTIONS", "POLICIES", "visit_activation_terms", "outside_activation_terms", "ActivationEstimate",
           "activation_bytes", "temporary_bytes", "MemoryRow", "MemoryReport", "estimate", "format_table"]

GiB = 2 ** 30
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}

#: ZeRO stage / offload options of the table: (label, stage, offload_optimizer, offload_param).
ZERO_OPTIONS = [("zero0", 0, False, False), ("zero1", 1, False, False), ("zero2", 2, False, False),
                ("zero2+opt_off", 2, True, False), ("zero3", 3, False, False),
                ("zero3+opt_off", 3, True, False), ("zero3+param_off", 3, True, True)]
POLICIES = ("none", "full", "looped", "every_n")

SOURCES = {
    "model_states": "DeepSpeed estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs "
                    "(bf16: 2 B params + 18 B/param sharded); ZeRO-0/1 and fp32 by the same decomposition; "
                    "experts sharded over moe.ep_size, dense params over all ranks",
    "activations": "per-visit saved-tensor formula of smelt_ds.memory.visit_activation_terms, after Korthikanti "
                   "et al. 2022 (arXiv 2205.05198) adapted to RMSNorm in fp32, GQA repeated K/V, SDPA "
                   "flash kernels, SwiGLU experts on T*K routed copies; checkpointed visits keep their input",
    "kv_cache": "visits * 2 * num_kv_heads * head_dim * bytes per token (smelt_ds.budget)",
}


# ---------------------------------------------------------------------------------------------
# units
# ---------------------------------------------------------------------------------------------


def parse_bytes(text: str | int | float, what: str = "--device-memory") -> int:
    """``"80GiB"``, ``"141 GB"``, ``"8e10"``, ``80 * 2**30`` -> bytes. GB = 1e9, GiB = 2**30.

    Raises ConfigError naming ``what`` for an unknown unit or a non-positive size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"`{what}` ({text!r}) is not a memory size: write a number with a unit among "
                              f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, e.g. 80GiB or 141GB")
        value, unit = float(m.group(1)), m.group(2).lower()
    out = int(value * _UNITS[unit])
    if out <= 0:
        raise ConfigError(f"`{what}` ({text!r}) must be a positive memory size, e.g. 80GiB")
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
    ``moe.ep_size`` expert parallelism.
    """

    total: int
    dense: int
    expert: int
    largest_module: int


def _local_experts(cfg: RunConfig) -> int:
    return cfg.moe.num_experts // cfg.moe.ep_size if cfg.moe.backend != "reference" else cfg.moe.num_experts


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
        modules.append(H * moe.expert_ffn_size if moe.backend == "deepspeed" else _local_experts(cfg) * per_expert)
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


def _bf16_part(P: float, gpus_per_node: float, nodes: int, stage: int, off_opt: bool, off_param: bool,
               largest: int) -> tuple[float, float, float, float, float, float]:
    """(params, grads, optimizer, gathered, cpu, gpu) bytes of ``P`` parameters on
    ``gpus_per_node * nodes`` GPUs. ``gpu`` and ``cpu`` are DeepSpeed's estimates where one exists
    (ZeRO-2/3); the first four split ``gpu`` the way DeepSpeed's comment counts its 18 bytes
    (16-bit params 2, 16-bit grads 2, fp32 grads 4, fp32 master params 4, Adam moments 8; the
    master params count as optimizer state, as in the ZeRO paper)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    N = gpus_per_node * nodes
    if stage == 3:
        cpu, gpu, gathered = estimate_zero3_model_states_mem_needs(
            int(P), largest, gpus_per_node, nodes, cpu_offload=off_opt, cpu_offload_params=off_param)
        if off_param:
            return 0.0, 0.0, 0.0, gathered, cpu, gpu
        if off_opt:
            return 2 * P / N, 0.0, 0.0, gathered, cpu, gpu
        return 2 * P / N, 4 * P / N, 12 * P / N, gathered, cpu, gpu  # 2 + 4 + 12 = 18 B / N
    if stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(int(P), gpus_per_node, nodes, cpu_offload=off_opt)
        if off_opt:
            return 2 * P, 0.0, 0.0, 0.0, cpu, gpu
        return 2 * P, 6 * P / N, 12 * P / N, 0.0, cpu, gpu  # 2 + (2 + 4 + 12) / N
    cpu, _ = estimate_zero2_model_states_mem_needs(int(P), gpus_per_node, nodes, cpu_offload=False)
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
    """
    part = _bf16_part if precision == "bf16" else _fp32_part
    splits = [(counts.total, gpus_per_node)] if ep_size == 1 else \
        [(counts.dense, gpus_per_node), (counts.expert / ep_size, gpus_per_node / ep_size)]
    sums = [0.0] * 6
    for i, (P, g) in enumerate(splits):
        vals = part(P, g, nodes, stage, offload_optimizer, offload_param, counts.largest_module if i == 0 else 0)
        sums = [x + y for x, y in zip(sums, vals)]
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
    * ``dropout`` (``model.dropout`` > 0): the two residual-branch dropout masks: 1 byte per
      element on CUDA (bool mask), ``a`` on CPU (scaled noise tensor).
    * MoE layers: ``router`` fp32 logits and scores ``8 T E`` (+ ``4 T`` for the sigmoid scores'
      sum), top-k indices ``8 T K``,
      top-k weights and their sum ``4 T K + 4 T``, z-loss ``4 T``, jitter noise and jittered
      input ``2 a T H``; ``dispatch`` sorted-copy order and source token ``16 N`` (int64);
      ``experts`` (SwiGLU on N copies) input ``a N H``, gate/up ``2 a N F``, silu ``a N F``,
      product ``a N F``, group offsets ``4 E`` (grouped GEMM); ``combine`` expert output and
      weighted output ``2 a N H``, per-copy weight ``a N``; ``shared_expert`` ``a T (4 Fs + H + 1)``.
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
    out["experts"] = a * N * (H + 4 * F) + (4 * E if _grouped_mm_used(cfg, a) else 0)
    out["combine"] = 2 * a * N * H + a * N
    if moe.shared_expert_ffn_size:
        out["shared_expert"] = a * T * (4 * moe.shared_expert_ffn_size + H + 1)
    return out


def outside_activation_terms(cfg: RunConfig, micro_batch: int, seq_len: int, act_bytes: int) -> dict[str, int]:
    """Bytes saved outside the visits: token ids and labels ``16 T`` (int64), the final RMSNorm
    and its output, the fp32 log-softmax of the cross-entropy ``4 T V`` (logits are cast to fp32),
    and in fp32 runs the RoPE tables ``8 S D`` shared by all visits."""
    m = cfg.model
    T, H, a = micro_batch * seq_len, m.hidden_size, act_bytes
    return {"ids_labels": 16 * T, "final_norm": _norm_internal(T, H, a) + a * T * H,
            "log_softmax": 4 * T * m.vocab_size, "rope": 8 * seq_len * m.resolved_head_dim if a == 4 else 0}


@dataclass
class ActivationEstimate:
    """Activation bytes per micro-batch under one checkpointing policy.

    ``stored``: saved for backward at the end of the forward pass (what
    :class:`smelt_ds.memory_profile.SavedTensorCounter` measures); ``peak``: ``stored`` plus the largest checkpointed
    visit recomputed in backward; ``per_visit``: bytes a non-checkpointed visit saves, by visit
    of the plan; ``checkpointed``: how many visits are checkpointed.
    """

    policy: str
    stored: int
    peak: int
    per_visit: list[int]
    checkpointed: int


def _policy_visits(cfg: RunConfig, schedule: LoopSchedule, policy: str) -> set:
    from smelt_ds.ds_template import checkpointed_visits

    return checkpointed_visits(_with_policy_copy(cfg, policy), schedule)


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
    stored = sum(kept if v in ckpt else f for v, f in zip(schedule.plan, full))
    outside = outside_activation_terms(cfg, micro_batch, seq_len, act_bytes)
    if len(ckpt) == len(schedule.plan):
        outside["rope"] = 0  # only checkpoints use the tables; they hold them outside autograd
    stored += sum(outside.values())
    recompute = max((f for v, f in zip(schedule.plan, full) if v in ckpt), default=0)
    return ActivationEstimate(policy, stored, stored + recompute, full, len(ckpt))


# ---------------------------------------------------------------------------------------------
# temporary buffers
# ---------------------------------------------------------------------------------------------


def temporary_bytes(cfg: RunConfig, counts: ParamCounts, stage: int, micro_batch: int, seq_len: int,
                    act_bytes: int, ds_zero: dict[str, Any] | None = None) -> dict[str, int]:
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

    ``ds_zero`` is the ``zero_optimization`` section of the DeepSpeed config (default:
    :func:`_zero_section`: the stage's template, loop tuning, the recipe's own keys).
    """
    T, V, a = micro_batch * seq_len, cfg.model.vocab_size, act_bytes
    out = {"logits": 2 * a * T * V + 4 * T * V}
    zero = ds_zero if ds_zero is not None else _zero_section(cfg, stage)
    bucket = int(zero.get("reduce_bucket_size", 5e8))
    if stage in (1, 2, 3) and zero.get("contiguous_gradients", True):
        if stage == 1:
            out["zero_buckets"] = 4 * bucket
        else:
            copies = 2 if stage == 2 and zero.get("overlap_comm", False) else 1
            out["zero_buckets"] = copies * a * bucket
    if stage == 3:
        local = counts.dense + counts.expert // max(cfg.moe.ep_size, 1)
        window = int(zero.get("stage3_max_reuse_distance", 1e9)) + int(zero.get("stage3_prefetch_bucket_size", 5e7))
        out["zero3_window"] = a * max(0, min(window, local) - counts.largest_module)
    return out


def _zero_section(cfg: RunConfig, stage: int, offload_optimizer: bool = False, offload_param: bool = False,
                  world_size: int = 1, device_memory_bytes: int | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` section a run of ``cfg`` at ``stage`` would get: the template of
    that stage / offload option, under ZeRO-3 with ``deepspeed.zero3_loop_tuning`` applied for
    ``world_size`` GPUs of ``device_memory_bytes``, then the recipe's own
    ``deepspeed.config.zero_optimization`` keys (they win, as in
    :func:`smelt_ds.engine.build_ds_config`)."""
    from smelt_ds.ds_template import load_template

    name = f"zero{stage}"
    if stage == 3 and offload_param:
        name = "zero3_offload_param"
    elif stage == 3 and offload_optimizer:
        name = "zero3_offload_optimizer"
    zero = dict(load_template(name).get("zero_optimization", {}))
    if stage == 3 and cfg.deepspeed.zero3_loop_tuning == "auto":
        from smelt_ds.zero3_tuning import plan_zero3

        ds = cfg.deepspeed.model_copy(update={
            "zero_stage": 3, "offload_optimizer": "cpu" if offload_optimizer else "none",
            "offload_param": "cpu" if offload_param else "none",
            "config": {**cfg.deepspeed.config, "zero_optimization": {
                **(cfg.deepspeed.config.get("zero_optimization") or {}), "stage": 3}}})
        decision = plan_zero3(cfg.model_copy(update={"deepspeed": ds}), zero, world_size, device_memory_bytes)
        if decision.applied:
            zero.update(decision.values)
    zero.update(cfg.deepspeed.config.get("zero_optimization") or {})
    return zero


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryRow:
    """One ZeRO option x checkpointing policy. Bytes per GPU unless named ``*_per_node``;
    ``headroom`` is ``(device - total) / device`` (negative when it does not fit)."""

    option: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    policy: str
    params: int
    grads: int
    optimizer: int
    zero3_gathered: int
    model_states: int
    cpu_per_node: int
    activations: int
    activations_peak: int
    temporary: int
    total: int
    fits: bool
    headroom: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MemoryReport:
    """Estimated memory of a recipe on ``nodes x gpus_per_node`` GPUs of ``device_memory`` bytes.

    ``rows``: every ZeRO option x checkpointing policy; ``configured``: the row of the recipe's
    own ``deepspeed`` and ``train.activation_checkpointing`` settings (None when that combination
    is not in the table); ``kv_cache_bytes``: inference KV cache of one sequence of
    ``context_len`` tokens in ``kv_dtype``.
    """

    recipe: str
    nodes: int
    gpus_per_node: int
    device_memory: int
    precision: str
    seq_len: int
    micro_batch: int
    ep_size: int
    params: ParamCounts
    rows: list[MemoryRow]
    configured: MemoryRow | None
    context_len: int
    kv_dtype: str
    kv_cache_bytes: int
    activation_terms: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=lambda: dict(SOURCES))
    measured: list[dict[str, Any]] = field(default_factory=list)

    def fits(self, headroom: float = 0.1) -> bool:
        """Whether the recipe's configured row fits with at least ``headroom`` (fraction of device
        memory) to spare."""
        return self.configured is not None and self.configured.headroom >= headroom

    def row(self, option: str, policy: str) -> MemoryRow:
        """The row of ``option`` (e.g. ``zero3``) and ``policy``; KeyError if absent."""
        for r in self.rows:
            if r.option == option and r.policy == policy:
                return r
        raise KeyError((option, policy))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _with_batch(cfg: RunConfig, seq_len: int | None, micro_batch: int | None) -> RunConfig:
    if seq_len is None and micro_batch is None:
        return cfg
    raw = config_to_dict(cfg)
    if seq_len is not None:
        raw["train"]["seq_len"] = seq_len
    if micro_batch is not None:
        raw["train"]["micro_batch_size"] = micro_batch
    raw["train"]["global_batch_tokens"] = None
    return config_from_dict(raw, source=f"recipe {cfg.name!r} with --seq-len/--micro-batch")


def _with_policy_copy(cfg: RunConfig, policy: str) -> RunConfig:
    ac = cfg.train.activation_checkpointing.model_copy(update={"policy": policy})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing": ac})})


def _check_cluster(cfg: RunConfig, nodes: int, gpus_per_node: int) -> None:
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"`{name}` ({v!r}) must be a positive integer: e.g. {name} 1")
    world = nodes * gpus_per_node
    ep = cfg.moe.ep_size
    if world % ep:
        raise ConfigError(f"`--nodes` x `--gpus-per-node` ({nodes} x {gpus_per_node} = {world} GPUs) must be "
                          f"divisible by `moe.ep_size` ({ep}): expert parallelism shards the experts over groups "
                          f"of {ep} GPUs; use a multiple of {ep} GPUs or lower moe.ep_size")


def estimate(cfg: RunConfig, nodes: int = 1, gpus_per_node: int = 1, device_memory_bytes: int | str = 80 * GiB,
             seq_len: int | None = None, micro_batch: int | None = None, precision: str | None = None,
             context_len: int | None = None, kv_dtype: str = "bf16", device: str = "cuda",
             options: Iterable[str] | None = None, policies: Iterable[str] | None = None) -> MemoryReport:
    """Memory per GPU of ``cfg`` for every ZeRO option (:data:`ZERO_OPTIONS`) and checkpointing
    policy (:data:`POLICIES`) on ``nodes x gpus_per_node`` GPUs of ``device_memory_bytes`` each.

    Args:
        cfg: the recipe.
        nodes, gpus_per_node: the cluster (N = nodes * gpus_per_node ranks).
        device_memory_bytes: bytes per GPU (int or a string such as ``"80GiB"``).
        seq_len, micro_batch: override ``train.seq_len`` (tokens) / ``train.micro_batch_size``
            (samples per GPU).
        precision: ``bf16`` | ``fp32``; default the recipe's (``auto`` -> bf16, a GPU target).
        context_len: KV-cache context (tokens), default ``model.max_seq_len``.
        kv_dtype: KV-cache element type.
        device: ``cuda`` (estimates for GPUs) or ``cpu`` (to compare with a CPU measurement:
            CPU dropout saves the scaled noise, CPU SDPA with dropout uses the math kernel).
        options, policies: restrict the table (labels of :data:`ZERO_OPTIONS`, :data:`POLICIES`).

    Returns:
        a :class:`MemoryReport`; ``report.fits(0.1)`` checks the recipe's own setting.

    Raises:
        ConfigError: bad cluster sizes (N not divisible by ``moe.ep_size``), memory size, batch
            or precision.
    """
    cfg = _with_batch(cfg, seq_len, micro_batch)
    _check_cluster(cfg, nodes, gpus_per_node)
    dev_mem = parse_bytes(device_memory_bytes)
    from smelt_ds.ds_template import resolve_precision

    prec = resolve_precision(cfg, precision, target="gpu")  # a GPU target: `auto` is bf16
    a = 2 if prec == "bf16" else 4
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    counts = param_counts(cfg)
    option_set = set(options) if options is not None else {o[0] for o in ZERO_OPTIONS}
    policy_list = list(policies) if policies is not None else list(POLICIES)
    bad = sorted(option_set - {o[0] for o in ZERO_OPTIONS}) + [p for p in policy_list if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown memory table entries {bad}: options are {[o[0] for o in ZERO_OPTIONS]}, "
                          f"policies {list(POLICIES)}")
    notes = []
    acts = {p: activation_bytes(cfg, p, B, S, a, device) for p in policy_list}
    rows = []
    for label, stage, off_opt, off_param in ZERO_OPTIONS:
        if label not in option_set:
            continue
        if stage == 3 and cfg.moe.backend == "deepspeed":
            notes.append(f"{label}: skipped, moe.backend 'deepspeed' does not support ZeRO-3 (use 'autoep')")
            continue
        ms = model_states(counts, nodes, gpus_per_node, stage, off_opt, off_param, prec, cfg.moe.ep_size)
        for p in policy_list:
            # the ZeRO-3 loop tuning depends on the policy (recomputes lengthen backward reuse gaps)
            zero = _zero_section(_with_policy_copy(cfg, p), stage, off_opt, off_param, nodes * gpus_per_node, dev_mem)
            tmp = sum(temporary_bytes(cfg, counts, stage, B, S, a, ds_zero=zero).values())
            total = ms.gpu + acts[p].peak + tmp
            rows.append(MemoryRow(label, stage, off_opt, off_param, p, ms.params, ms.grads, ms.optimizer,
                                  ms.zero3_gathered, ms.gpu, ms.cpu_per_node, acts[p].stored, acts[p].peak, tmp,
                                  total, total <= dev_mem, (dev_mem - total) / dev_mem))
    ds = cfg.deepspeed
    # ZeRO-3 parameter offload uses the zero3_offload_param template, which offloads the optimizer too
    off_opt = ds.offload_optimizer != "none" or ds.offload_param != "none"
    own = next((o[0] for o in ZERO_OPTIONS if o[1] == ds.zero_stage and o[2] == off_opt
                and o[3] == (ds.offload_param != "none")), None)
    policy = cfg.train.activation_checkpointing.policy
    configured = next((r for r in rows if r.option == own and r.policy == policy), None)
    if configured is None:
        notes.append(f"the recipe's own setting (ZeRO-{ds.zero_stage}, offload_optimizer {ds.offload_optimizer}, "
                     f"policy {policy}) is not among the rows shown: fits() is False")
    ctx = context_len or cfg.model.max_seq_len
    terms: dict[str, int] = {}
    for v in cfg.schedule.plan:
        for k, val in visit_activation_terms(cfg, v.layer, B, S, a, device).items():
            terms[k] = terms.get(k, 0) + val
    for k, val in outside_activation_terms(cfg, B, S, a).items():
        terms[f"outside/{k}"] = val
    return MemoryReport(cfg.name, nodes, gpus_per_node, dev_mem, prec, S, B, cfg.moe.ep_size, counts, rows,
                        configured, ctx, kv_dtype, kv_cache_bytes_per_token(cfg, kv_dtype) * ctx, terms, notes)


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


def _unit(report: MemoryReport) -> tuple[str, int]:
    """GiB for real runs, MiB when every total is below 10 GiB (small recipes)."""
    return ("GiB", GiB) if max((r.total for r in report.rows), default=0) >= 10 * GiB else ("MiB", 2 ** 20)


def format_table(report: MemoryReport) -> str:
    """The report as a markdown table (GiB or MiB per GPU) with the verdicts and notes."""
    r = report
    unit, div = _unit(r)
    num = lambda n: f"{n / div:.2f}"  # noqa: E731
    head = ["option", "policy", "params", "grads", "optim", "z3 layer", "states", "activations", "act. peak",
            "temporary", "total", "host/node", "verdict", "headroom"]
    rows = []
    for x in r.rows:
        mark = " *" if x is r.configured else ""
        rows.append([x.option + mark, x.policy, num(x.params), num(x.grads), num(x.optimizer), num(x.zero3_gathered),
                     num(x.model_states), num(x.activations), num(x.activations_peak), num(x.temporary),
                     num(x.total), num(x.cpu_per_node), "fits" if x.fits else "DOES NOT FIT", f"{x.headroom:+.1%}"])
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    out = [f"{r.recipe}: {r.nodes} node(s) x {r.gpus_per_node} GPU(s) of {format_bytes(r.device_memory)}, "
           f"{r.precision}, micro-batch {r.micro_batch} x seq_len {r.seq_len} tokens, moe.ep_size {r.ep_size}; "
           f"{r.params.total:,} parameters ({r.params.expert:,} in experts; embedding and head included)",
           "", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(row) for row in rows]
    out.append("")
    out.append(f"{unit} per GPU (host/node: {unit} of CPU memory per node). activations = saved for backward per "
               "micro-batch at the end of the forward pass; act. peak adds one recomputed visit; total = states + "
               "act. peak + temporary (logits, ZeRO buckets, ZeRO-3 gathered window); headroom = free share of "
               "device memory. * = the recipe's own setting.")
    out.append(f"inference KV cache: {format_bytes(r.kv_cache_bytes)} per sequence of {r.context_len} tokens "
               f"({r.kv_dtype}, every visit keeps its own K and V)")
    for m in r.measured:
        if m.get("saved_activations") is not None:
            out.append(f"measured ({m['device']}, policy {m['policy']}): saved activations "
                       f"{format_bytes(m['saved_activations'])} vs predicted {format_bytes(m['predicted_activations'])}"
                       f"; params+grads+optimizer {format_bytes(m['params'] + m['grads'] + m['optimizer'])} vs "
                       f"predicted {format_bytes(m['predicted_model_states'])} (fp32, ZeRO-0, 1 process)")
        else:
            out.append(f"measured ({m['device']}, policy {m['policy']}): allocator peak "
                       f"{format_bytes(m['peak_allocated'])} vs predicted total "
                       f"{format_bytes(m['predicted_total'] or 0)} (1 GPU)")
    out += [f"note: {n}" for n in r.notes]
    out += [f"source ({k}): {v}" for k, v in r.sources.items()]
    return "\n".join(out)
