"""Tolerances for tests that compare two floating-point computations of the same values.

Two computations of the same sums in other orders (another kernel or BLAS, thread count,
instruction set, a grouped vs a per-expert matmul, compiled vs eager, one process vs two) each
differ from exact arithmetic by their own rounding errors. First-order bound (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., 2002, section 3.1): a chain of reductions of
lengths ``k_i`` (dot products, sums, norms, softmax denominators) computed with unit roundoff
``u`` is within ``n * u`` of the exact value, ``n = sum k_i``, relative to the value's magnitude
(its sum of |terms|); two computations differ by at most twice that. The magnitude is taken as
the tensor's largest reference value, so an element near zero (cancellation, an embedding row hit
by one token) gets the tensor's error rather than its own relative one; the deterministic ``n``
also covers Higham & Mary's probabilistic bound ``lambda * sqrt(n) * u`` (SIAM J. Sci. Comput.
41(5), 2019) at lambda = 10 for a sum of |terms| up to ``sqrt(n) / 10`` times that largest value.

Only bit-identical paths may compare exactly: a copy, the same kernel on the same shapes and
threads (a rerun in one process), or integer/exactly representable arithmetic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from smelt_ds.config.schedule import build_schedule

#: unit roundoff: fp32 (24-bit significand), bf16 (8-bit)
FP32_U = 2.0**-24
BF16_U = 2.0**-8


def chain_tol(n: int, u: float = FP32_U) -> float:
    """``2 * n * u``: how far apart (relative to the magnitude) two computations of a chain of
    reductions of total length ``n`` can be."""
    return 2 * n * u


def prob_tol(n: int, u: float = FP32_U, lam: float = 10.0) -> float:
    """``2 * lam * sqrt(n) * u``: Higham & Mary's probabilistic bound (2019, Thm 3.1: a computed sum
    or dot product of ``n`` terms is within ``lam * sqrt(n) * u * sum|terms|`` with probability at
    least ``1 - 2 n exp(-lam^2 (1 - u)^2 / 2)``, about ``1 - 4e-22 n`` at lam = 10, for independent
    mean-zero rounding errors and ``n u << 1``), for two computations. For values without
    cancellation, whose sum of |terms| is the value itself: a loss (a mean of positive per-token
    cross-entropies; at initialisation the logits, whose errors enter it, are smaller than it), a
    squared norm."""
    return 2 * lam * math.sqrt(n) * u


def lm_chain_length(cfg, tokens: int, backward: bool = True, seq: int | None = None) -> int:
    """Sum of the reduction lengths on the longest path through a SmeltLM of run config ``cfg``
    (the ``n`` of :func:`chain_tol`): per visit, attention forward (RMSNorm, Q/K/V, QK^T over the
    head dim, softmax and PV over ``cfg.train.seq_len``, output projection) and MoE forward
    (RMSNorm, router, softmax over experts, gate/up, down over the largest of the expert, shared
    expert and dense FFN sizes, top-k combine; a QK-norm adds its head dim twice); the head (final
    RMSNorm, logits, log-softmax over the vocabulary). With ``backward``, also every transposed
    reduction on the way back (output projection, dP, softmax, dQ, the Q/K/V rows, RMSNorm; combine,
    down, gate/up, router) and a weight gradient's sum over ``tokens`` (tokens per micro-batch x
    visits of a layer x micro-batches or ranks summed).
    ``seq``: the sequence length attended over, if not ``cfg.train.seq_len``."""
    m, moe = cfg.model, cfg.moe
    h, dh, kv, s, v = m.hidden_size, m.resolved_head_dim, m.num_kv_heads, seq or cfg.train.seq_len, m.vocab_size
    e, k = moe.num_experts, moe.top_k
    f = max(moe.expert_ffn_size, moe.shared_expert_ffn_size or 0, m.dense_ffn_size if m.first_k_dense else 0)
    qk = 2 * dh if m.qk_norm else 0
    visits = build_schedule(cfg.loop, m.num_layers).effective_depth
    forward = visits * ((3 * h + dh + 2 * s + qk) + (3 * h + e + f + k)) + 2 * h + v
    if not backward:
        return forward
    back = visits * ((2 * h + dh + 2 * s + h + 2 * kv * dh) + (2 * h + 2 * f + 2 * e + k)) + h + v
    return forward + back + tokens


def model_chain_length(model, seq: int) -> int:
    """:func:`lm_chain_length` of one forward pass of a SmeltLM over ``seq`` tokens."""
    cfg = SimpleNamespace(model=model.model_cfg, moe=model.moe_cfg, loop=model.loop_cfg, train=None)
    return lm_chain_length(cfg, 0, backward=False, seq=seq)


def greedy_tie_point(ours: torch.Tensor, theirs: torch.Tensor, logits_of, n: int, u: float = FP32_U) -> int | None:
    """Two greedy continuations (1-D token tensors, the same prompt) from implementations that round
    differently: the first position ``t`` where they differ (None if nowhere), where the two chosen
    tokens must tie within ``chain_tol(n, u) * max|logits|`` of the next-token logits
    ``logits_of(ours[:t]) -> (V,)`` (else AssertionError); after a tie the rows may differ."""
    diff = (ours != theirs).nonzero()
    if len(diff) == 0:
        return None
    t = int(diff[0])
    logits = logits_of(ours[:t])
    slack = chain_tol(n, u) * float(logits.abs().max())
    gap = abs(float(logits[ours[t]] - logits[theirs[t]]))
    assert gap <= slack, (f"position {t}: tokens {int(ours[t])} and {int(theirs[t])}, "
                          f"logits {gap:.3g} apart > {slack:.3g}")
    return t


def assert_close_chain(got: torch.Tensor, want: torch.Tensor, n: int, u: float = FP32_U, msg=None) -> None:
    """``got`` within ``chain_tol(n, u) * max|want|`` of ``want``, element-wise (shapes and dtypes
    must match, as in :func:`torch.testing.assert_close`)."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=0.0, atol=chain_tol(n, u) * scale, msg=msg)
