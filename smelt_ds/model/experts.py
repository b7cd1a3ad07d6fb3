"""The MoE experts: E SwiGLU experts in two 3-D weights, run on token copies sorted by expert
(``torch._grouped_mm`` where available, else a per-expert loop); and the dense SwiGLU FFN (dense
layers, the shared expert).

Layout (the Qwen3-MoE / Mixtral layout of transformers 5)::

    mlp.experts.gate_up_proj        [E, 2F, H]   gate and up projections of every expert
    mlp.experts.down_proj           [E, H, F]

Shape legend (suffix letters, as in torchtitan's moe.py): B batch, S sequence, T = B*S tokens,
H hidden, E experts, K top-k, F expert intermediate size, N = T*K routed token copies, R rows of
the row-block layout (:data:`CPU_BF16_ROW_BLOCK`).

Device branches: on CUDA (any device but the CPU) the groups always run as they are, through
``torch._grouped_mm``; on the CPU bf16 groups run in row blocks (:func:`_uses_row_blocks`). The
decision reads :func:`smelt_ds.model.grouped_gemm.branch_device_type`, so tests run the CUDA
branch on CPU tensors (``device_branches({"cpu": "cuda"})``).

Host reads of device tensors (a synchronisation on CUDA): the grouped path has none (its group
offsets are ``torch.cumsum`` of the counts on the device, and ``torch._grouped_mm`` takes them
there). The per-expert loop path reads ``counts_E`` once (``tolist``: ``torch.split`` takes Python
sizes), and the CPU row-block layout reads two sums (the sizes of its index and zero-padded
tensors); on the CPU a host read waits for nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smelt_ds.model.grouped_gemm import branch_device_type, grouped_linear

__all__ = ["CPU_BF16_ROW_BLOCK", "GroupedExperts", "SwiGLU", "has_grouped_mm", "row_block_layout"]

#: Rows to which each expert's group of token copies is rounded up (with zero rows) in bf16 on
#: CPU. torch's CPU matmul in bf16 is oneDNN's, which builds (JIT-compiles) a kernel for each new
#: matrix shape and caches 1024 of them (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``); in fp32 it is MKL's
#: sgemm, which builds nothing. An expert's row count follows the routing, so the per-expert
#: matmuls met new shapes at every step, about 0.45 ms each to build, ten times the 300 x 128 x 192
#: product itself: bf16 trained the tiny recipe at 0.43x the fp32 tokens/s (``bench/bf16_step.py``,
#: ``docs/results/benchmarks.md``). With whole blocks of 32 rows each of a layer's six expert
#: matmuls (gate/up and down: forward, input and weight gradients) has at most N/32 + 1 shapes,
#: which stay cached; the zero rows cost at most 31 rows per expert.
CPU_BF16_ROW_BLOCK = 32


def has_grouped_mm() -> bool:
    """Whether the installed torch has ``torch._grouped_mm`` (torch >= 2.8)."""
    return hasattr(torch, "_grouped_mm")


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN ``down(silu(gate(x)) * up(x))``; x: ``(..., H)`` -> ``(..., H)``."""

    def __init__(self, hidden_size: int, ffn_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward rejects expanded (stride 0) gradients, e.g. from .sum().
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class _SwiGLUActivation(torch.autograd.Function):
    """``silu(gate) * up`` of the fused projection ``h_N2F = [gate | up]`` -> ``(N, F)``.

    Saves only ``h_N2F`` (autograd would also keep ``silu(gate)``, ``N F`` more) and recomputes
    ``silu`` in backward (on a contiguous copy of the gate half there: torch's CPU silu runs about
    3x faster on contiguous rows). The ``(N, 2F)`` gradient is contiguous, as
    ``torch._grouped_mm``'s backward needs:
    ``d gate = g * up * silu'(gate)`` (``aten.silu_backward``), ``d up = g * silu(gate)``.
    """

    @staticmethod
    def forward(ctx, h_N2F: torch.Tensor) -> torch.Tensor:
        F_ = h_N2F.shape[-1] // 2
        # silu of the strided gate half, as autograd's path and the standalone modeling_smelt.py
        # compute it (a contiguous copy would run torch's vectorised silu, about 3x faster on
        # CPU, but its exp differs in the last bit and the logits parity tests are at 1e-6)
        a_NF = F.silu(h_N2F[:, :F_])
        ctx.save_for_backward(h_N2F)
        return a_NF.mul_(h_N2F[:, F_:])

    @staticmethod
    def backward(ctx, g_NF: torch.Tensor) -> torch.Tensor:
        (h_N2F,) = ctx.saved_tensors
        F_ = h_N2F.shape[-1] // 2
        gate_NF, up_NF = h_N2F[:, :F_].contiguous(), h_N2F[:, F_:]
        d_gate = torch.ops.aten.silu_backward(g_NF * up_NF, gate_NF)
        d_up = F.silu(gate_NF).mul_(g_NF)
        return torch.cat([d_gate, d_up], dim=-1)


def _uses_row_blocks(x_NH: torch.Tensor) -> bool:
    """bf16 copies on CPU, eagerly: where torch's matmul builds a kernel per shape
    (:data:`CPU_BF16_ROW_BLOCK`). fp32 and other devices run the groups as they are; so does a
    compiled model (torch.compile lowers ``torch._grouped_mm`` itself). "On CPU" is
    :func:`~smelt_ds.model.grouped_gemm.branch_device_type` (tests run the CUDA branch on CPU)."""
    return (not torch.compiler.is_compiling() and x_NH.dtype == torch.bfloat16
            and branch_device_type(x_NH) == "cpu")


def row_block_layout(counts_E: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each expert's rows rounded up to a multiple of ``block``: ``(rows_N, blocked_counts_E, R)``.

    ``rows_N[i]`` is the row of sorted copy ``i`` in the blocked layout (its expert's rows first,
    in order, then zero rows up to the next multiple of ``block``), ``blocked_counts_E`` the rows
    per expert there (an empty expert stays empty), ``R`` their sum (reads the counts on the host).
    """
    blocked_E = (counts_E + (block - 1)) // block * block
    shift_E = (torch.cumsum(blocked_E, 0) - blocked_E) - (torch.cumsum(counts_E, 0) - counts_E)
    N = int(counts_E.sum())
    expert_N = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E,
                                       output_size=N)
    rows_N = torch.arange(N, device=counts_E.device) + shift_E[expert_N]
    return rows_N, blocked_E, int(blocked_E.sum())


class _ToRowBlocks(torch.autograd.Function):
    """``x_NH`` -> ``(R, H)``: row ``i`` to row ``rows_N[i]``, every other row zero. Backward: the
    gradient's rows ``rows_N`` (a gather). A zero row and its zero gradient row
    (:class:`_FromRowBlocks`) each keep the weight gradients exactly those of the rows alone."""

    @staticmethod
    def forward(ctx, x_NH: torch.Tensor, rows_N: torch.Tensor, R: int) -> torch.Tensor:
        ctx.save_for_backward(rows_N)
        return x_NH.new_zeros(R, x_NH.shape[1]).index_copy_(0, rows_N, x_NH)

    @staticmethod
    def backward(ctx, g_RH: torch.Tensor):
        (rows_N,) = ctx.saved_tensors
        return g_RH.index_select(0, rows_N), None, None


class _FromRowBlocks(torch.autograd.Function):
    """``(R, H)`` -> ``y_NH``: the rows ``rows_N`` (a gather). Backward: the gradient back to rows
    ``rows_N`` with zeros elsewhere (a copy, not autograd's ``index_add`` scatter), so that the
    zero rows' gradient is exactly zero."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows_N)
        ctx.R = y_RH.shape[0]
        return y_RH.index_select(0, rows_N)

    @staticmethod
    def backward(ctx, g_NH: torch.Tensor):
        (rows_N,) = ctx.saved_tensors
        return g_NH.new_zeros(ctx.R, g_NH.shape[1]).index_copy_(0, rows_N, g_NH), None


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as two 3-D tensors; computes sorted token copies group by group.

    ``forward(x_NH, counts_E)``: ``x_NH`` rows sorted by expert, ``counts_E`` rows per expert
    (int64, sums to N); returns ``(N, H)``. The grouped path has no data-dependent Python (it
    compiles into one graph); the loop path reads ``counts_E`` on the host. In bf16 on CPU (eager)
    either path runs each expert's rows padded with zero rows to whole :data:`CPU_BF16_ROW_BLOCK`
    blocks (the layout reads ``counts_E`` on the host); the zero rows are dropped from the result.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.auto = impl == "auto"
        if impl == "auto":
            impl = "grouped_mm" if has_grouped_mm() else "loop"
        if impl == "grouped_mm" and not has_grouped_mm():
            raise RuntimeError("moe.expert_impl 'grouped_mm' needs torch._grouped_mm (torch >= 2.8); "
                               "use expert_impl 'loop' or 'auto'")
        self.impl = impl

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if _uses_row_blocks(x_NH):  # bf16 on CPU: groups rounded up to CPU_BF16_ROW_BLOCK rows
            rows_N, blocked_E, R = row_block_layout(counts_E, CPU_BF16_ROW_BLOCK)
            out_RH = self._forward_groups(_ToRowBlocks.apply(x_NH, rows_N, R), blocked_E)
            return _FromRowBlocks.apply(out_RH, rows_N)
        return self._forward_groups(x_NH, counts_E)

    def _forward_groups(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self.impl == "grouped_mm" and self._grouped_mm_fits(x_NH):
            return self._forward_grouped(x_NH, counts_E)
        return self._forward_loop(x_NH, counts_E)

    def _grouped_mm_fits(self, x_NH: torch.Tensor) -> bool:
        """torch._grouped_mm needs row strides that are multiples of 16 bytes (H and F); 'auto'
        falls back to the loop otherwise, an explicit 'grouped_mm' says why it cannot run."""
        size = x_NH.element_size()
        if (self.hidden_dim * size) % 16 == 0 and (self.intermediate_dim * size) % 16 == 0:
            return True
        if self.auto:
            return False
        raise RuntimeError(f"moe.expert_impl 'grouped_mm' needs hidden_size ({self.hidden_dim}) and "
                           f"expert_ffn_size ({self.intermediate_dim}) times {size} bytes to be multiples of "
                           "16 bytes; use expert_impl 'auto' or 'loop', or round the sizes")

    def _forward_grouped(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Both projections as ``torch._grouped_mm`` calls over the groups ``counts_E`` (E,):
        ``x_NH`` (N, H) -> (N, H). No host read: the int32 offsets ``offs_E`` (E,) are computed
        and passed on the device."""
        offs_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
        h_N2F = grouped_linear(x_NH, self.gate_up_proj, offs_E)
        a_NF = _SwiGLUActivation.apply(h_N2F)
        out_NH = grouped_linear(a_NF, self.down_proj, offs_E)
        return _contiguous_grad(out_NH)

    def _forward_loop(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """One ``F.linear`` pair per expert: ``x_NH`` (N, H) -> (N, H); reads ``counts_E`` on the
        host (``torch.split`` takes Python sizes)."""
        # unbind, not self.gate_up_proj[e]: indexing a parameter E times makes backward allocate
        # and fill E full-size [E, 2F, H] gradients; unbind's backward stacks once.
        outs = []
        for x_nH, w_2FH, w_HF in zip(torch.split(x_NH, counts_E.tolist(), dim=0),
                                     self.gate_up_proj.unbind(0), self.down_proj.unbind(0), strict=True):
            gate_nF, up_nF = F.linear(x_nH, w_2FH).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_nF) * up_nF, w_HF))
        return torch.cat(outs, dim=0)
