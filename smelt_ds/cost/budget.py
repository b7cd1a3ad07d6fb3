"""The three budgets of SMELT vs Baseline, computed from a config and its visit plan, and the matcher.

Budgets (docs/budgets.md):

1. **Per-token FLOPs** of the forward pass; training = 3 x forward (backward = 2 x forward,
   Kaplan et al. 2020 §2.1). Convention: matrix multiplies only, 2 FLOPs per multiply-add.
   Element-wise work (norms, softmax, RoPE, SiLU, residual adds) is not counted. Attention
   score and value products are counted per token as ``2 * 2 * n_keys * Nq * D`` with
   ``n_keys = seq_len`` ("full", the convention of Hoffmann et al. 2022 Appendix F, and what
   ``torch.utils.flop_counter`` counts for an explicit ``q @ k^T`` and ``p @ v``), or
   ``n_keys = (seq_len + 1) / 2`` ("causal", the average number of unmasked keys).
   Per visit of a layer: q/k/v/o projections, attention core, router ``2 H E``, top-k experts
   ``K * 6 H F``, shared expert ``6 H Fs + 2 H``, or dense SwiGLU ``6 H Fd``. Plus the output
   head ``2 H V`` once per token (equal for both architectures; the embedding lookup is free).
2. **Non-embedding parameters**: every unique layer's parameters (all experts counted) plus the
   final norm (with ``model.qk_norm``, also the per-head QK-norm weights, ``2 D`` per layer); the
   token embedding and the output head are excluded (once, when tied).
   Active parameters count only the top-k experts of each MoE layer.
3. **KV cache bytes per token**: every visit of an attention layer keeps its own K and V:
   ``visits * 2 * Nkv * D * bytes_per_element``.

A looped model matches its Baseline when its number of visits equals the Baseline's depth
(same width, heads, top-k, expert size: FLOPs and KV equal) and its fewer unique layers carry
more experts each so that total parameters are equal (:func:`match_baseline`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.loop import LoopConfig
from smelt_ds.config.run import RunConfig
from smelt_ds.config.schedule import LoopSchedule
from smelt_ds.errors import ConfigError

__all__ = ["Budget", "compute_budget", "layer_params", "kv_cache_bytes_per_token", "relative_deviation",
           "MatchResult", "match_baseline", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


@dataclass
class Budget:
    """Budgets of one recipe. FLOPs are per token, bytes per token, parameters are counts."""

    name: str
    unique_layers: int
    visits: int
    num_experts: int
    seq_len: int
    forward_flops_per_token: float
    train_flops_per_token: float
    non_embedding_params: int
    active_non_embedding_params: int
    embedding_params: int
    kv_cache_bytes_per_token: int
    kv_dtype: str
    attention_convention: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _attn_dims(cfg: RunConfig) -> tuple[int, int, int, int]:
    m = cfg.model
    return m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim


def layer_params(cfg: RunConfig, layer: int) -> dict[str, int]:
    """Parameters of unique layer ``layer``: ``attention``, ``norms``, ``router``, ``experts``
    (all routed experts), ``active_experts`` (top-k of them), ``shared``, ``dense``."""
    H, Nq, Nkv, D = _attn_dims(cfg)
    moe = cfg.moe
    qk_norm = 2 * D if cfg.model.qk_norm else 0  # q_norm and k_norm weights, (D,) each
    out = {"attention": 2 * H * Nq * D + 2 * H * Nkv * D, "norms": 2 * H + qk_norm,
           "router": 0, "experts": 0, "active_experts": 0, "shared": 0, "dense": 0}
    if layer < cfg.model.first_k_dense:
        out["dense"] = 3 * H * cfg.model.dense_ffn_size
        return out
    per_expert = 3 * H * moe.expert_ffn_size
    out["router"] = moe.num_experts * H
    out["experts"] = moe.num_experts * per_expert
    out["active_experts"] = moe.top_k * per_expert
    if moe.shared_expert_ffn_size:
        out["shared"] = 3 * H * moe.shared_expert_ffn_size + H
    return out


def _visit_forward_flops(cfg: RunConfig, layer: int, n_keys: float) -> float:
    H, Nq, Nkv, D = _attn_dims(cfg)
    moe = cfg.moe
    flops: float = 2 * (2 * H * Nq * D + 2 * H * Nkv * D)  # q, o and k, v projections
    flops += 2 * 2 * n_keys * Nq * D  # q k^T and p v
    if layer < cfg.model.first_k_dense:
        return flops + 6 * H * cfg.model.dense_ffn_size
    flops += 2 * H * moe.num_experts + moe.top_k * 6 * H * moe.expert_ffn_size
    if moe.shared_expert_ffn_size:
        flops += 6 * H * moe.shared_expert_ffn_size + 2 * H
    return flops


def kv_cache_bytes_per_token(cfg: RunConfig, dtype: str = "bf16") -> int:
    """KV-cache bytes per token: ``visits * 2 * Nkv * D * bytes(dtype)``. Raises ConfigError for an
    unknown dtype."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"KV-cache dtype {dtype!r} is unknown: use one of {sorted(DTYPE_BYTES)}")
    _, _, Nkv, D = _attn_dims(cfg)
    visits = cfg.schedule.effective_depth
    return visits * 2 * Nkv * D * DTYPE_BYTES[dtype]


def compute_budget(cfg: RunConfig, seq_len: int | None = None, kv_dtype: str = "bf16",
                   attention_convention: str = "full") -> Budget:
    """All three budgets of ``cfg`` at ``seq_len`` tokens (default ``train.seq_len``).

    Raises ConfigError for an unknown ``attention_convention`` (``full`` or ``causal``).
    """
    if attention_convention not in ("full", "causal"):
        raise ConfigError(f"attention convention {attention_convention!r} is unknown: use 'full' or 'causal'")
    S = seq_len or cfg.train.seq_len
    n_keys = S if attention_convention == "full" else (S + 1) / 2
    schedule = cfg.schedule
    H, V = cfg.model.hidden_size, cfg.model.vocab_size
    fwd = sum(_visit_forward_flops(cfg, v.layer, n_keys) for v in schedule.plan) + 2 * H * V
    per_layer = [layer_params(cfg, i) for i in range(cfg.model.num_layers)]
    total = sum(p["attention"] + p["norms"] + p["router"] + p["experts"] + p["shared"] + p["dense"]
                for p in per_layer) + H
    active = sum(p["attention"] + p["norms"] + p["router"] + p["active_experts"] + p["shared"] + p["dense"]
                 for p in per_layer) + H
    embed = V * H * (1 if cfg.model.tie_embeddings else 2)
    return Budget(name=cfg.name, unique_layers=cfg.model.num_layers, visits=schedule.effective_depth,
                  num_experts=cfg.moe.num_experts, seq_len=S, forward_flops_per_token=fwd,
                  train_flops_per_token=3 * fwd, non_embedding_params=total,
                  active_non_embedding_params=active, embedding_params=embed,
                  kv_cache_bytes_per_token=kv_cache_bytes_per_token(cfg, kv_dtype), kv_dtype=kv_dtype,
                  attention_convention=attention_convention)


def relative_deviation(value: float, reference: float) -> float:
    """``(value - reference) / reference`` (0 when both are 0)."""
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return (value - reference) / reference


BUDGET_FIELDS = {"flops": "forward_flops_per_token", "params": "non_embedding_params",
                 "kv_cache": "kv_cache_bytes_per_token"}


def deviations(budget: Budget, reference: Budget) -> dict[str, float]:
    """Relative deviation of each of the three budgets from ``reference``."""
    return {k: relative_deviation(getattr(budget, f), getattr(reference, f)) for k, f in BUDGET_FIELDS.items()}


# ---------------------------------------------------------------------------------------------
# matcher
# ---------------------------------------------------------------------------------------------


@dataclass
class MatchResult:
    """A matched looped recipe (``raw`` is its YAML dict) and how well it matches."""

    raw: dict[str, Any]
    config: RunConfig
    baseline: Budget
    matched: Budget
    deviations: dict[str, float]
    depth_exact: bool
    notes: list[str]


def _with_loop(raw: dict[str, Any], num_layers: int, num_experts: int, loop: dict[str, Any],
               name: str) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    out["name"] = name
    out.setdefault("model", {})["num_layers"] = num_layers
    out.setdefault("moe", {})["num_experts"] = num_experts
    out["loop"] = {**{k: v for k, v in (raw.get("loop") or {}).items()
                      if k in ("order", "input_injection", "shared_lr_scale")}, **loop}
    return out


def _visits_for(loop_cfg_dict: dict[str, Any], num_layers: int) -> int | None:

    try:
        return LoopSchedule.from_config(LoopConfig(**loop_cfg_dict), num_layers).effective_depth
    except ConfigError:
        return None


def _candidate_loops(position: str, max_layers: int, repeats: int, fraction: float,
                     ranges: list[dict[str, int]] | None):
    """Yield ``(unique_layers, loop_dict, balance)`` candidates for the matcher.

    ``asymmetric`` without explicit ranges searches every split of the preset middle range into a
    lower part run ``repeats + 1`` times and an upper part run ``repeats`` times, and writes the
    chosen split as explicit ranges (``balance`` = distance of the split from the centre).
    """
    for L in range(1, max_layers + 1):
        if position == "asymmetric" and ranges is None:
            w = int(fraction * L)
            start = (L - w) // 2
            for w1 in range(1, w):
                rs = [{"start": start, "end": start + w1, "repeats": repeats + 1},
                      {"start": start + w1, "end": start + w, "repeats": repeats}]
                yield L, {"position": "asymmetric", "ranges": rs}, abs(w1 - w / 2)
        else:
            loop = {"position": position, "repeats": repeats, "fraction": fraction}
            if ranges is not None:
                loop["ranges"] = ranges
            yield L, loop, 0.0


def _match_experts(baseline_raw: dict[str, Any], base_cfg: RunConfig, base_budget: Budget, num_layers: int,
                   loop: dict[str, Any], ep: int, seq_len: int | None) -> int:
    """Experts per MoE layer (a multiple of ``ep``, >= top_k) bringing total non-embedding
    parameters of a ``num_layers``-deep looped model closest to the Baseline's.

    Parameters are linear in E: each expert adds ``3 H F`` weights plus one router row of ``H``.
    """
    top_k = base_cfg.moe.top_k
    lo = max(ep, math.ceil(top_k / ep) * ep)
    trial = config_from_dict(_with_loop(baseline_raw, num_layers, lo, loop, "trial"))
    moe_layers = sum(1 for i in range(num_layers) if i >= trial.model.first_k_dense)
    H, F = base_cfg.model.hidden_size, base_cfg.moe.expert_ffn_size
    per_expert = 3 * H * F + H
    fixed = compute_budget(trial, seq_len).non_embedding_params - moe_layers * lo * per_expert
    ideal = (base_budget.non_embedding_params - fixed) / max(moe_layers, 1) / per_expert
    candidates = {max(lo, int(math.floor(ideal / ep)) * ep), max(lo, int(math.ceil(ideal / ep)) * ep)}
    return min(candidates, key=lambda e: (abs(fixed + moe_layers * e * per_expert
                                              - base_budget.non_embedding_params), e))


def match_baseline(baseline_raw: dict[str, Any], position: str, repeats: int = 2, ep_size: int | None = None,
                   fraction: float = 0.5, ranges: list[dict[str, int]] | None = None,
                   seq_len: int | None = None, tolerance: float | None = None,
                   name: str | None = None) -> MatchResult:
    """Build the looped recipe matched to a Baseline recipe (raw YAML dict).

    Depth: among the numbers of unique layers whose visit count is closest to the Baseline's
    depth (exact when possible), the one whose matched budgets deviate least (ties: the deeper
    model; for ``asymmetric`` the most balanced split). Experts: the integer per-layer count,
    a multiple of ``ep_size`` (default ``moe_runtime.ep_size``), that brings total non-embedding
    parameters closest to the Baseline's. Everything else is copied from the Baseline.

    Raises ConfigError when the Baseline is itself looped, when no depth yields a valid loop, or
    when ``tolerance`` is given and any budget deviates by more than it.
    """
    base_cfg = config_from_dict(baseline_raw, source="baseline recipe")
    if base_cfg.loop.position != "none":
        raise ConfigError(f"`loop.position` ({base_cfg.loop.position!r}) of the Baseline must be 'none': "
                          "match takes an unlooped Baseline recipe")
    ep = ep_size or base_cfg.moe_runtime.ep_size
    L_B = base_cfg.model.num_layers
    scored = []
    for L, cand, balance in _candidate_loops(position, L_B, repeats, fraction, ranges):
        visits = _visits_for(cand, L)
        if visits is not None:
            scored.append((abs(visits - L_B), L, visits, cand, balance))
    if not scored:
        if ranges:
            top = max(r["end"] for r in ranges)
            if top > L_B:
                raise ConfigError(f"--ranges end at layer {top}, beyond the Baseline's {L_B} layers (a looped "
                                  f"model has at most as many unique layers): use ranges within 0..{L_B}")
            spec = ",".join(f"{r['start']}:{r['end']}:{r['repeats']}" for r in ranges)
            raise ConfigError(f"--ranges {spec} give no valid loop at any depth <= {L_B} (ranges must be "
                              "ordered, non-overlapping, start < end, repeats >= 2): fix --ranges")
        raise ConfigError(f"no depth <= {L_B} gives a valid '{position}' loop with repeats {repeats}: "
                          "check --position/--repeats")
    gap = min(s[0] for s in scored)
    base_budget = compute_budget(base_cfg, seq_len)
    best = None
    for _, L, visits, cand, balance in (s for s in scored if s[0] == gap):
        raw = _with_loop(baseline_raw, L, _match_experts(baseline_raw, base_cfg, base_budget, L, cand, ep, seq_len),
                         cand, name or f"{base_cfg.name}-{position}x{repeats}")
        if ep_size is not None and base_cfg.moe_runtime.backend != "reference":
            raw.setdefault("moe_runtime", {})["ep_size"] = ep_size
        cfg = config_from_dict(raw, source="matched recipe")
        matched = compute_budget(cfg, seq_len)
        devs = deviations(matched, base_budget)
        key = (max(abs(v) for v in devs.values()), -L, balance)
        if best is None or key < best[0]:
            best = (key, raw, cfg, matched, devs, visits)
    assert best is not None  # `scored` is non-empty, so the loop ran at least once
    _, raw, cfg, matched, devs, visits = best
    notes = []
    if visits != L_B:
        notes.append(f"no depth gives exactly {L_B} visits for position '{position}' x{repeats}; "
                     f"closest: {cfg.model.num_layers} unique layers -> {visits} visits (FLOPs and KV cache deviate)")
    result = MatchResult(raw, cfg, base_budget, matched, devs, visits == L_B, notes)
    if tolerance is not None:
        bad = {k: v for k, v in devs.items() if abs(v) > tolerance}
        if bad:
            worst = ", ".join(f"{k} {v:+.2%}" for k, v in bad.items())
            raise ConfigError(f"matched recipe deviates beyond --tolerance {tolerance:.2%}: {worst}"
                              f"{' (' + '; '.join(notes) + ')' if notes else ''}; "
                              "change the Baseline depth (for depth mismatches; e.g. middle x2 reaches no "
                              "depth of the form 3k+2) or its expert count/width (for parameters), or loosen "
                              "--tolerance")
    return result
