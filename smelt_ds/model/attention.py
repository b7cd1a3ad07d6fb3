"""Causal grouped-query self-attention with RoPE, and a KV cache with one slot per visit.

Shape legend: B batch, S query length, P cached (past) length, H hidden, Nq query heads,
Nkv key/value heads, D head size. Every visit of an attention layer keeps its own K and V (a
looped layer visited twice holds two cache slots), which is why SMELT's KV cache equals that of
a Baseline with as many layers as SMELT has visits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from smelt_ds.model.looping import Visit

__all__ = ["RMSNorm", "RotaryEmbedding", "KVCache", "CausalSelfAttention", "apply_rotary"]

AttnProbsHook = Callable[[Visit, torch.Tensor], None]


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``x / rms(x) * weight``, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables (Su et al. 2021) in the half-split convention of Llama/Qwen in transformers."""

    cos: torch.Tensor  # buffers (register_buffer)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)
        self.max_seq_len = max_seq_len

    def forward(self, positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``cos, sin`` of shape ``(S, D)`` for integer positions ``(S,)``. Raises ValueError
        for a position >= ``max_seq_len`` (reads the positions: a device sync)."""
        if int(positions_S.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions_S.max())} >= model.max_seq_len ({self.max_seq_len}); "
                             "raise model.max_seq_len")
        return self.cos[positions_S], self.sin[positions_S]

    def span(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``(length, D)`` of positions ``start .. start + length - 1``: the contiguous
        case, checked with Python ints (no device sync; traceable by torch.compile). Raises
        ValueError when the last position is >= ``max_seq_len``."""
        if start + length > self.max_seq_len:
            raise ValueError(f"position {start + length - 1} >= model.max_seq_len ({self.max_seq_len}); "
                             "raise model.max_seq_len")
        return self.cos[start:start + length], self.sin[start:start + length]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``(B, N, S, D)`` by the RoPE tables ``(S, D)``."""
    return (x_BNSD * cos_SD.to(x_BNSD.dtype)) + (_rotate_half(x_BNSD) * sin_SD.to(x_BNSD.dtype))


class KVCache:
    """Per-visit key/value cache for incremental decoding.

    ``slots[(layer, visit)] = (k, v)`` each ``(B, Nkv, P, D)``. Memory: ``2 * Nkv * D * bytes`` per
    token per visit (see :func:`smelt_ds.cost.budget.kv_cache_bytes_per_token`).
    """

    def __init__(self) -> None:
        self.slots: dict[Visit, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, visit: Visit, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if visit in self.slots:
            pk, pv = self.slots[visit]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.slots[visit] = (k, v)
        return k, v

    def past_length(self) -> int:
        if not self.slots:
            return 0
        return next(iter(self.slots.values()))[0].shape[2]

    def num_bytes(self) -> int:
        """Bytes held by all slots."""
        return sum(t.numel() * t.element_size() for kv in self.slots.values() for t in kv)


class CausalSelfAttention(nn.Module):
    """GQA causal self-attention through ``F.scaled_dot_product_attention``; with ``qk_norm`` the
    queries and keys of every head are RMS-normalised (``q_norm``, ``k_norm``: weights ``(D,)``)
    before RoPE, as in Qwen3 (arXiv 2505.09388) and transformers' ``Qwen3MoeAttention``.

    ``forward(x, cos, sin, visit, kv_cache=None, probs_hook=None)``: ``x`` ``(B, S, H)`` ->
    ``(B, S, H)``. With ``probs_hook`` the attention is computed explicitly (same math) and the
    probabilities ``(B, Nq, S, P+S)`` are handed to ``probs_hook(visit, probs)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dropout: float = 0.0, qk_norm: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # QK-norm (Qwen3): RMSNorm over each head's D features of q and k, before RoPE
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.dropout = dropout

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, visit: Visit,
                kv_cache: KVCache | None = None, probs_hook: AttnProbsHook | None = None) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos_SD, sin_SD), apply_rotary(k, cos_SD, sin_SD)
        if kv_cache is not None:
            k, v = kv_cache.update(visit, k, v)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        P = k.shape[2] - S
        dropout_p = self.dropout if self.training else 0.0
        if probs_hook is not None:
            out = self._explicit(q, k, v, P, visit, probs_hook, dropout_p)
        elif P == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(S, P, q.device),
                                                 dropout_p=dropout_p)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    @staticmethod
    def _mask(S: int, P: int, device: torch.device) -> torch.Tensor:
        """Boolean ``(S, P+S)`` mask: query i (at position P+i) sees keys 0..P+i."""
        return torch.ones(S, P + S, dtype=torch.bool, device=device).tril(diagonal=P)

    def _explicit(self, q, k, v, P, visit, probs_hook, dropout_p):
        S = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / (self.head_dim ** 0.5)
        scores = scores.masked_fill(~self._mask(S, P, q.device), float("-inf"))
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        probs_hook(visit, probs)
        return F.dropout(probs, p=dropout_p, training=dropout_p > 0) @ v
