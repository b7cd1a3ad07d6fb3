"""The reference MoE layer (smelt_ds/model/moe.py): naive per-token parity, transformers parity, one
compiled graph."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.model.experts import has_grouped_mm
from smelt_ds.model.moe import MoE
from tests.model.moe_helpers import FF, N_BWD, N_FWD, E, H, K, make_moe
from tests.numerics import assert_close_chain


def naive_moe(moe: MoE, x_TH: torch.Tensor, score_func: str, norm: bool) -> torch.Tensor:
    """Token by token, expert by expert, with the weights read straight from the layout."""
    Wg = moe.gate.weight
    gu, down = moe.experts.gate_up_proj, moe.experts.down_proj
    Fi = down.shape[-1]
    rows = []
    for x in x_TH:
        logits = [float(Wg[e] @ x) for e in range(Wg.shape[0])]
        if score_func == "softmax":
            z = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / z for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        chosen = sorted(range(len(scores)), key=lambda e: -scores[e])[:moe.num_experts_per_tok]
        w = [scores[e] for e in chosen]
        if norm:
            w = [v / sum(w) for v in w]
        y = torch.zeros_like(x)
        for e, we in zip(chosen, w, strict=True):
            g, u = gu[e, :Fi] @ x, gu[e, Fi:] @ x
            y = y + we * (down[e] @ (g * torch.sigmoid(g) * u))
        if moe.shared_expert is not None:
            s = moe.shared_expert
            h = s.down_proj.weight @ (F.silu(s.gate_proj.weight @ x) * (s.up_proj.weight @ x))
            y = y + torch.sigmoid(moe.shared_expert_gate.weight[0] @ x) * h
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shared", [0, 12])
def test_moe_equals_naive_per_token_loop(impl, score_func, norm, shared):
    if impl == "grouped_mm" and not has_grouped_mm():
        pytest.skip("torch._grouped_mm not available in this torch")
    moe = make_moe(impl, score_func, norm, shared)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        got = moe(x)
        want = naive_moe(moe, x.reshape(-1, H), score_func, norm).reshape(2, 5, H)
    assert_close_chain(got, want, N_FWD)
    assert got.abs().max() > 0.1  # not a trivially small output


# --------------------------------------------------------------------------------------------
# transformers parity (test-only dependency)
# --------------------------------------------------------------------------------------------


def _hf_impls():
    return ["eager", "batched_mm", "grouped_mm"]


@pytest.mark.parametrize("hf_impl", _hf_impls())
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_moe_equals_transformers_qwen3_moe_block(hf_impl, norm, impl):
    tr = pytest.importorskip("transformers", minversion="5.0",
                             reason="transformers >= 5 (test-only dependency) provides the Qwen3-MoE reference")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if impl == "grouped_mm" and not has_grouped_mm():
        pytest.skip("torch._grouped_mm not available in this torch")
    cfg = tr.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=norm, hidden_act="silu", experts_implementation=hf_impl)
    ref = Qwen3MoeSparseMoeBlock(cfg)
    ours = make_moe(impl, "softmax", norm)
    # Qwen3-MoE in transformers 5 has no shared expert; the state dicts have identical keys.
    assert set(ref.state_dict()) == set(ours.state_dict()) == {"gate.weight", "experts.gate_up_proj",
                                                               "experts.down_proj"}
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), ours(xb)
    assert_close_chain(yb, ya, N_FWD)
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert_close_chain(xb.grad, xa.grad, N_BWD)
    for n, p in ref.named_parameters():
        assert_close_chain(dict(ours.named_parameters())[n].grad, p.grad, N_BWD, msg=n)


def test_moe_with_shared_expert_equals_transformers_qwen2_moe_block():
    tr = pytest.importorskip("transformers", minversion="5.0",
                             reason="transformers >= 5 (test-only dependency) provides the Qwen2-MoE reference")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tr.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K,
                            shared_expert_intermediate_size=12, norm_topk_prob=True, hidden_act="silu",
                            experts_implementation="eager")
    ref = Qwen2MoeSparseMoeBlock(cfg)
    ours = make_moe("auto", "softmax", True, shared=12)
    ref.load_state_dict(ours.state_dict())  # strict: same names, same shapes
    x = torch.randn(3, 4, H)
    with torch.no_grad():
        assert_close_chain(ours(x), ref(x), N_FWD)


# --------------------------------------------------------------------------------------------
# torch.compile: one graph, no recompilation for new inputs of the same shape
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not has_grouped_mm(), reason="needs torch._grouped_mm")
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_compiled_moe_fullgraph_equals_eager_and_compiles_once(score_func):
    import torch._dynamo

    torch._dynamo.reset()
    eager = make_moe("grouped_mm", score_func=score_func, shared=12)
    compiled_twin = make_moe("grouped_mm", score_func=score_func, shared=12)
    compiled_twin.load_state_dict(eager.state_dict())
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(compiled_twin, fullgraph=True, backend=counting_backend)
    g = torch.Generator().manual_seed(4)
    for call in range(3):  # new inputs of the same shape each call
        x = torch.randn(2, 7, H, generator=g)
        w = torch.randn(2, 7, H, generator=g)
        outs = {}
        for name, m, mod in (("eager", eager, eager), ("compiled", compiled, compiled_twin)):
            mod.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_()
            y = m(xg)
            ((y * w).sum() + mod.last_losses["aux"] + mod.last_losses["z"]).backward()
            outs[name] = (y.detach(), xg.grad, {n: p.grad for n, p in mod.named_parameters()})
        (ye, gxe, gpe), (yc, gxc, gpc) = outs["eager"], outs["compiled"]
        assert_close_chain(yc, ye, N_FWD)
        assert_close_chain(gxc, gxe, N_BWD)
        assert gpc.keys() == gpe.keys() and all(v is not None for v in gpc.values())
        for n in gpe:
            assert_close_chain(gpc[n], gpe[n], N_BWD, msg=lambda m, n=n: f"{n}: {m}")
        assert len(graphs) == 1, f"call {call}: {len(graphs)} graphs compiled (a graph break or recompile)"
    torch._dynamo.reset()
