"""The MoE experts (smelt_ds/model/experts.py): grouped_mm equals the per-expert loop (experts without
tokens, one token, unaligned sizes), SwiGLU by hand."""

from __future__ import annotations

import pytest
import torch

from smelt_ds.model.experts import SwiGLU, has_grouped_mm
from tests.model.moe_helpers import N_BWD, N_FWD, E, H, K, make_moe
from tests.numerics import assert_close_chain


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
