"""The MoE experts (smelt_ds/model/experts.py): grouped_mm equals the per-expert loop (experts without
tokens, one token, unaligned sizes), SwiGLU by hand; in bf16 on CPU the groups run as whole row
blocks (the layout by hand, the matmul shapes, the values against an fp64 computation)."""

from __future__ import annotations

import pytest
import torch

from smelt_ds.model.experts import CPU_BF16_ROW_BLOCK, GroupedExperts, SwiGLU, has_grouped_mm, row_block_layout
from tests.model.moe_helpers import N_BWD, N_FWD, E, H, K, make_moe
from tests.numerics import BF16_U, assert_close_chain


def _zero_token_inputs():
    """Positive inputs and a router whose rows 0, 3 and E-1 are strongly negative: those experts
    never receive a token."""
    torch.manual_seed(1)
    x = torch.rand(3, 7, H) + 0.1
    return x


@pytest.mark.skipif(not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")
@pytest.mark.parametrize("score_func,norm,shared", [("softmax", True, 0), ("sigmoid", False, 10)])
def test_grouped_mm_equals_loop_forward_and_grads_with_empty_experts(score_func, norm, shared):
    loop = make_moe("loop", score_func, norm, shared)
    grouped = make_moe("grouped_mm", score_func, norm, shared)
    with torch.no_grad():
        for e in (0, 3, E - 1):
            loop.gate.weight[e] = -1.0
    grouped.load_state_dict(loop.state_dict())
    assert loop.experts.impl == "loop" and grouped.experts.impl == "grouped_mm"

    x = _zero_token_inputs()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = loop(xa), grouped(xb)
    counts = torch.bincount(grouped.last_route.topk_idx_TK.reshape(-1), minlength=E)
    assert counts[0] == counts[3] == counts[E - 1] == 0 and counts.sum() == 21 * K
    assert_close_chain(yb, ya, N_FWD)

    # a loss that touches the aux and z losses too, so the router gradient is compared as well
    w = torch.randn_like(ya)
    ((ya * w).sum() + loop.last_losses["aux"] + loop.last_losses["z"]).backward()
    ((yb * w).sum() + grouped.last_losses["aux"] + grouped.last_losses["z"]).backward()
    assert_close_chain(xb.grad, xa.grad, N_BWD)
    for (n, pa), (_, pb) in zip(loop.named_parameters(), grouped.named_parameters(), strict=True):
        assert_close_chain(pb.grad, pa.grad, N_BWD, msg=n)
    for e in (0, 3, E - 1):  # experts without tokens get exactly zero gradient on both paths
        assert torch.count_nonzero(grouped.experts.gate_up_proj.grad[e]) == 0
        assert torch.count_nonzero(grouped.experts.down_proj.grad[e]) == 0
    assert torch.count_nonzero(grouped.experts.down_proj.grad[1]) > 0


@pytest.mark.skipif(not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")
def test_grouped_mm_single_token_and_all_on_one_expert():
    loop, grouped = make_moe("loop", top_k=1), make_moe("grouped_mm", top_k=1)
    with torch.no_grad():
        loop.gate.weight.fill_(-1.0)
        loop.gate.weight[2] = 1.0
    grouped.load_state_dict(loop.state_dict())
    for shape in [(1, 1, H), (2, 4, H)]:
        x = torch.rand(*shape) + 0.1
        ya, yb = loop(x), grouped(x)
        assert set(grouped.last_route.topk_idx_TK.reshape(-1).tolist()) == {2}
        assert_close_chain(yb, ya, N_FWD)


def test_swiglu_by_hand():
    m = SwiGLU(4, 3)
    x = torch.randn(5, 4)
    g, u = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    assert_close_chain(m(x), (g / (1 + torch.exp(-g)) * u) @ m.down_proj.weight.T, 4 + 5 + 3)  # H, silu, F


@pytest.mark.skipif(not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")
def test_grouped_mm_unaligned_sizes_auto_falls_back_explicit_explains():
    # torch._grouped_mm needs 16-byte row strides: H=6 fp32 rows are 24 bytes
    auto, loop = make_moe("auto", hidden=6, ffn=8), make_moe("loop", hidden=6, ffn=8)
    loop.load_state_dict(auto.state_dict())
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(auto(x), loop(x), rtol=0, atol=0)
    explicit = make_moe("grouped_mm", hidden=8, ffn=6)
    with pytest.raises(RuntimeError, match=r"expert_ffn_size \(6\).*16 bytes"):
        explicit(torch.randn(2, 3, 8))


def test_row_block_layout_by_hand():
    # groups of 3, 0, 5, 8 and 1 rows in blocks of 4: rows 0-2 | (empty) | 4-8 | 12-19 | 20
    rows, blocked, R = row_block_layout(torch.tensor([3, 0, 5, 8, 1]), 4)
    assert rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert blocked.tolist() == [4, 0, 8, 8, 4] and R == 24


# bf16 experts on CPU: 3 experts, H = F = 8 (bf16 rows of 16 bytes, as torch._grouped_mm needs),
# 30 sorted copies in groups of 13, 0 and 17 rows (not multiples of CPU_BF16_ROW_BLOCK)
_BF16_COUNTS = (13, 0, 17)


def _bf16_experts(impl: str, seed: int = 0) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(experts, x_NH, counts_E, g_NH)`` in bf16: N(0, 0.5) weights, N(0, 1) inputs and upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(len(_BF16_COUNTS), 8, 8, impl).to(torch.bfloat16)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    N = sum(_BF16_COUNTS)
    x = torch.randn(N, 8, generator=gen).bfloat16()
    return ex, x, torch.tensor(_BF16_COUNTS), torch.randn(N, 8, generator=gen).bfloat16()


class _ExpertRows(torch.utils._python_dispatch.TorchDispatchMode):
    """The row counts of the expert matmuls: each group of ``torch._grouped_mm`` (differences of
    ``offs``) and both dimensions of every ``mm`` (the loop path's per-expert products)."""

    def __init__(self):
        super().__init__()
        self.rows: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            offs = (kwargs.get("offs") if "offs" in kwargs else args[2]).tolist()
            self.rows |= {b - a for a, b in zip([0, *offs], offs, strict=False)}
        elif func is torch.ops.aten.mm.default:
            self.rows |= {*args[0].shape, args[1].shape[1]}
        return func(*args, **kwargs)


@pytest.mark.parametrize("impl", [pytest.param("grouped_mm", marks=pytest.mark.skipif(
    not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")), "loop"])
def test_bf16_cpu_expert_matmuls_see_whole_row_blocks_fp32_its_counts(impl):
    # the speed of bf16 training on CPU: oneDNN builds a kernel per matmul shape, so the expert
    # groups' rows go in whole blocks (docstring of CPU_BF16_ROW_BLOCK); fp32 runs the counts as they are
    for dtype, want in ((torch.bfloat16, {0, 8, 16, CPU_BF16_ROW_BLOCK}), (torch.float32, {0, 8, 16, 13, 17})):
        ex, x, counts, g = _bf16_experts(impl)
        ex, x, g = ex.to(dtype), x.to(dtype).requires_grad_(), g.to(dtype)
        with _ExpertRows() as seen:
            ex(x, counts).backward(g)
        assert seen.rows <= want and {13, 17} & seen.rows == ({13, 17} if dtype == torch.float32 else set()), \
            (dtype, sorted(seen.rows))


@pytest.mark.parametrize("impl", [pytest.param("grouped_mm", marks=pytest.mark.skipif(
    not has_grouped_mm(), reason="torch._grouped_mm not available in this torch")), "loop"])
def test_bf16_cpu_row_blocks_equal_fp64_experts_and_grads(impl, monkeypatch):
    # blocks of 8 rows: the groups of 13 and 17 rows span 2 and 3 blocks
    monkeypatch.setattr("smelt_ds.model.experts.CPU_BF16_ROW_BLOCK", 8)
    ex, x, counts, g = _bf16_experts(impl, seed=1)
    x.requires_grad_()
    y = ex(x, counts)
    y.backward(g)
    # the same bf16 values in fp64, expert by expert: no rounding to speak of
    ref = GroupedExperts(len(_BF16_COUNTS), 8, 8, "loop").double()
    ref.load_state_dict({k: v.double() for k, v in ex.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    y64 = ref(x64, counts)
    y64.backward(g.double())
    # tests/numerics.py with bf16's unit roundoff, every operation counted as if done in bf16
    # (torch accumulates in fp32: fewer roundings). Forward: gate/up over H = 8, silu and the
    # product, down over F = 8: n = 18. d a over H = 8 after the forward's 10 and the SwiGLU
    # backward's 3, dx over 2F = 16: n = 37; dW down: a's 10 plus a sum over a group's <= 17
    # rows: 27; dW gate/up: d h's 21 plus 17 rows: 38 (0.14 to 0.30 of the largest value; a row
    # of another token or a zero row in place of a copy is off by about the largest value).
    assert_close_chain(y.double(), y64, 18, BF16_U)
    assert_close_chain(x.grad.double(), x64.grad, 37, BF16_U)
    assert_close_chain(ex.down_proj.grad.double(), ref.down_proj.grad, 27, BF16_U)
    assert_close_chain(ex.gate_up_proj.grad.double(), ref.gate_up_proj.grad, 38, BF16_U)
    assert torch.count_nonzero(ex.gate_up_proj.grad[1]) == 0 and torch.count_nonzero(ex.down_proj.grad[1]) == 0
