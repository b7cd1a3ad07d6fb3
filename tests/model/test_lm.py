"""SmeltLM: per-visit losses, KV cache, generation, routing divergence, attention probabilities."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from smelt_ds.model import KVCache, SmeltLM, Visit, VisitRecorder, routing_divergence
from smelt_ds.model.experts import SwiGLU
from smelt_ds.model.moe import MoE
from smelt_ds.model.router import RouterOutput
from smelt_ds.train.objective import total_loss
from tests.numerics import assert_close_chain, chain_tol, lm_chain_length


def build_lm(cfg) -> SmeltLM:
    """``SmeltLM`` of a recipe's architecture sections (``model``, ``moe``, ``loop``)."""
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


V = 61  # tiny vocabulary (tests/conftest.py)
# fp32 model vs Python doubles (tests/numerics.py): router logits over H = 32 (the model's and the
# test's fp32 matmuls), then softmax over 4 experts, means over 12 tokens and 5 visits, x2 for the
# z-loss's square: 8.8e-6; the LM loss: log-softmax over V, mean over <= 12 tokens: 8.7e-6.
AUX_Z_RTOL = 2 * chain_tol(4 + 12 + 5) + chain_tol(32)
LM_RTOL = chain_tol(V + 12)


def capture_moe_inputs(model: SmeltLM) -> list[tuple[int, torch.Tensor]]:
    """Forward hooks on every MoE: ``(layer, input)`` in call order."""
    calls: list[tuple[int, torch.Tensor]] = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_forward_hook(lambda m, args, out, i=i: calls.append((i, args[0].detach())))
    return calls


def aux_z_by_hand(W: torch.Tensor, x_BSH: torch.Tensor, k: int) -> tuple[float, float]:
    """Switch aux (E * sum f_e P_e over T*K copies) and z-loss with python arithmetic."""
    logits = (x_BSH.reshape(-1, x_BSH.shape[-1]) @ W.T).tolist()
    E = len(logits[0])
    counts, psum, z = [0] * E, [0.0] * E, 0.0
    for row in logits:
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        probs = [v / sum(ex) for v in ex]
        for e in sorted(range(E), key=lambda e: -probs[e])[:k]:
            counts[e] += 1
        psum = [a + b for a, b in zip(psum, probs, strict=True)]
        z += (m + math.log(sum(ex))) ** 2
    T = len(logits)
    return E * sum(c / (T * k) * p / T for c, p in zip(counts, psum, strict=True)), z / T


@pytest.mark.parametrize("order", ["block", "layer"])
def test_aux_loss_is_mean_over_moe_visits_and_total_loss(tiny_cfg, order):
    cfg = tiny_cfg({"loop": {"order": order}, "model": {"first_k_dense": 1},
                    "train": {"aux_loss_coef": 0.3, "z_loss_coef": 0.05}})
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    calls = capture_moe_inputs(model)
    ids, labels = torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6))
    out = model(ids, labels=labels)

    moe_visits = [v for v in model.schedule.plan if v.layer >= 1]
    assert len(moe_visits) == 5  # 6 visits, layer 0 is dense; looped layers 1 and 2 count twice
    assert [layer for layer, _ in calls] == [v.layer for v in moe_visits]
    assert list(model.recorder.losses) == moe_visits  # recorded in plan order, keyed by (layer, visit)
    hand = [aux_z_by_hand(model.layers[layer].mlp.gate.weight, x, 2) for layer, x in calls]
    for v, (aux, z) in zip(moe_visits, hand, strict=True):
        assert model.recorder.losses[v]["aux"].item() == pytest.approx(aux, rel=AUX_Z_RTOL)
        assert model.recorder.losses[v]["z"].item() == pytest.approx(z, rel=AUX_Z_RTOL)
    aux_mean, z_mean = sum(a for a, _ in hand) / 5, sum(z for _, z in hand) / 5
    assert out.aux_loss.item() == pytest.approx(aux_mean, rel=AUX_Z_RTOL)
    assert out.z_loss.item() == pytest.approx(z_mean, rel=AUX_Z_RTOL)
    # not the mean over unique layers (visits of a layer averaged first)
    per_layer = [sum(a for (layer, _), (a, _z) in zip(calls, hand, strict=True) if layer == i)
                 / (2 if i in (1, 2) else 1) for i in (1, 2, 3)]
    assert abs(sum(per_layer) / 3 - aux_mean) > 1e-7

    logp = out.logits.reshape(-1, V).log_softmax(-1)
    lm = -logp[torch.arange(12), labels.reshape(-1)].mean().item()
    assert out.lm_loss.item() == pytest.approx(lm, rel=LM_RTOL)
    assert not hasattr(out, "loss")  # the model returns unweighted losses; training weights them
    assert total_loss(out, cfg.train).item() == pytest.approx(lm + 0.3 * aux_mean + 0.05 * z_mean, rel=AUX_Z_RTOL)


def test_lm_loss_ignores_minus_100_and_dense_model_has_no_aux(tiny_cfg):
    cfg = tiny_cfg({"model": {"first_k_dense": 4}})
    model = build_lm(cfg)
    ids = torch.randint(0, V, (1, 5))
    labels = torch.tensor([[3, -100, 7, -100, 1]])
    out = model(ids, labels=labels)
    logp = out.logits[0].log_softmax(-1)
    assert out.lm_loss.item() == pytest.approx(-(logp[0, 3] + logp[2, 7] + logp[4, 1]).item() / 3, rel=LM_RTOL)
    assert out.aux_loss is None and out.z_loss is None and total_loss(out, cfg.train) is out.lm_loss
    assert model.recorder.losses == {} and model.recorder.routes == {}


# --------------------------------------------------------------------------------------------
# KV cache and generation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position,order,inject", [("none", "block", "none"), ("middle", "block", "none"),
                                                   ("middle", "layer", "none"), ("middle", "block", "add"),
                                                   ("asymmetric", "block", "none")])
def test_incremental_decoding_equals_full_forward(tiny_cfg, position, order, inject):
    n_layers = 6 if position == "asymmetric" else 4
    cfg = tiny_cfg({"loop": {"position": position, "order": order, "input_injection": inject},
                    "model": {"num_layers": n_layers}})
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    assert cfg.model.num_kv_heads < cfg.model.num_heads  # GQA
    B, S, prefill = 2, 9, 4
    ids = torch.randint(0, V, (B, S))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache()
        steps = [model(ids[:, :prefill], kv_cache=cache).logits]
        for t in range(prefill, S):
            assert cache.past_length() == t
            steps.append(model(ids[:, t:t + 1], kv_cache=cache).logits)
    assert_close_chain(torch.cat(steps, dim=1), full, lm_chain_length(cfg, 0, backward=False))

    depth = {"none": 4, "middle": 6, "asymmetric": 3 + 3 + 2 * 1 + 2}[position]
    assert model.schedule.effective_depth == depth
    assert len(cache.slots) == depth and set(cache.slots) == set(model.schedule.plan)
    Nkv, D = cfg.model.num_kv_heads, cfg.model.hidden_size // cfg.model.num_heads
    assert cache.slots[model.schedule.plan[-1]][0].shape == (B, Nkv, S, D)
    assert cache.num_bytes() == 2 * depth * B * S * Nkv * D * 4


def test_kv_cache_slots_of_two_visits_differ(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, V, (1, 5)), kv_cache=cache)
    k0, k1 = cache.slots[Visit(1, 0)][0], cache.slots[Visit(1, 1)][0]
    assert (k0 - k1).abs().max() > 1e-3  # the second visit sees a different residual stream


def test_generate_greedy_equals_argmax_of_full_forward(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    prompt = torch.randint(0, V, (2, 4))
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], prompt)
    with torch.no_grad():
        for t in range(4, 10):
            # the KV-cache path rounds differently: the token's logit in the full forward is its
            # maximum within the forward's error bound (tests/numerics.py), i.e. the argmax unless
            # two logits tie within rounding
            logits = model(out[:, :t]).logits[:, -1]
            slack = chain_tol(lm_chain_length(tiny_cfg(), 0, backward=False)) * float(logits.abs().max())
            chosen = logits.gather(1, out[:, t:t + 1])[:, 0]
            assert (chosen >= logits.max(-1).values - slack).all(), t


def test_generate_sampling_seeded_and_top_p(tiny_cfg):
    model = build_lm(tiny_cfg({"model": {"init_std": 0.5}})).eval()
    prompt = torch.randint(0, V, (3, 3))
    a = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(prompt, 8)
    tiny_p = model.generate(prompt, 8, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(tiny_p, greedy) and not torch.equal(a, greedy)

    top_p = 0.4
    nucleus_sizes = []
    for seed in range(3):
        s = model.generate(prompt, 6, temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for t in range(3, 9):
                probs = model(s[:, :t]).logits[:, -1].softmax(-1).tolist()
                for row, tok in zip(probs, s[:, t].tolist(), strict=True):
                    ranked = sorted(range(V), key=lambda v: -row[v])
                    nucleus, mass = [], 0.0
                    for v in ranked:  # smallest set with cumulative probability >= top_p
                        nucleus.append(v)
                        mass += row[v]
                        if mass >= top_p:
                            break
                    nucleus_sizes.append(len(nucleus))
                    assert tok in nucleus
    assert max(nucleus_sizes) > 1  # the check is not just greedy


def test_generate_stop_callback_ends_early_with_the_same_tokens(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    ids = torch.randint(0, V, (2, 5))
    full = model.generate(ids, 12)
    seen = []

    def stop(new):
        seen.append(new.shape[1])
        return new.shape[1] == 4  # e.g. every row now holds a stop string

    short = model.generate(ids, 12, stop=stop)
    assert seen == [1, 2, 3, 4] and short.shape == (2, 5 + 4)
    assert torch.equal(short, full[:, :9])  # stopping changes no token before it


def test_generate_eos_and_length_limit(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    prompt = torch.randint(0, V, (2, 3))
    greedy = model.generate(prompt, 6)
    eos = int(greedy[0, 5])  # row 0 emits it at step 3 (maybe earlier too)
    out = model.generate(prompt, 6, eos_token_id=eos)
    first = (greedy[0, 3:] == eos).nonzero()[0, 0].item() + 3
    assert torch.equal(out[0, :first + 1], greedy[0, :first + 1])
    assert (out[0, first:] == eos).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(prompt, 30)  # 3 + 30 > 32


# --------------------------------------------------------------------------------------------
# routing divergence
# --------------------------------------------------------------------------------------------


def test_routing_divergence_constructed():
    a = torch.tensor([[0, 1], [2, 3], [1, 0], [4, 5], [0, 2], [3, 1], [5, 4], [2, 1]])
    b = torch.tensor([[1, 0], [2, 4], [0, 1], [5, 4], [2, 0], [3, 0], [4, 5], [1, 3]])
    # differing sets: token 1 ({2,3} vs {2,4}), token 5 ({1,3} vs {0,3}), token 7 ({1,2} vs {1,3})
    assert routing_divergence(a, b) == pytest.approx(3 / 8)
    assert routing_divergence(a, a.flip(-1)) == 0.0


def _route(idx):
    idx = torch.tensor(idx)
    T, E = idx.shape[0], 4
    return RouterOutput(torch.zeros(T, E), torch.full((T, E), 0.25), idx, torch.full(idx.shape, 0.5))


def test_recorder_divergence_and_router_stats():
    rec = VisitRecorder()
    rec.record(Visit(2, 0), _route([[0, 1], [2, 3], [0, 2], [1, 3]]), {})
    rec.record(Visit(2, 1), _route([[1, 0], [2, 3], [0, 1], [1, 3]]), {})
    rec.record(Visit(2, 2), _route([[0, 3], [0, 3], [0, 3], [0, 3]]), {})
    rec.record(Visit(3, 0), _route([[0, 1], [0, 1], [0, 1], [0, 1]]), {})
    assert rec.divergence() == {(2, 0, 1): pytest.approx(1 / 4), (2, 1, 2): pytest.approx(4 / 4)}
    stats = rec.router_stats()
    assert stats[Visit(2, 0)]["tokens_per_expert"] == [2, 2, 2, 2]
    assert stats[Visit(2, 0)]["load_max_over_mean"] == pytest.approx(1.0)
    assert stats[Visit(3, 0)]["tokens_per_expert"] == [4, 4, 0, 0]
    assert stats[Visit(3, 0)]["load_max_over_mean"] == pytest.approx(2.0)
    assert stats[Visit(2, 2)]["dropped_share"] == 0.0


def test_model_divergence_zero_when_visits_see_same_input(tiny_cfg):
    model = build_lm(tiny_cfg())
    with torch.no_grad():  # every layer is the identity on the residual stream
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
    model(torch.randint(0, V, (2, 8)))
    assert model.recorder.divergence() == {(1, 0, 1): 0.0, (2, 0, 1): 0.0}


def test_model_divergence_matches_hand_count(tiny_cfg):
    model = build_lm(tiny_cfg({"model": {"init_std": 0.5}}))
    calls = capture_moe_inputs(model)
    model(torch.randint(0, V, (2, 8)))
    div = model.recorder.divergence()
    assert set(div) == {(1, 0, 1), (2, 0, 1)}
    for layer in (1, 2):
        W = model.layers[layer].mlp.gate.weight
        sets = []
        for i, x in calls:
            if i == layer:
                logits = (x.reshape(-1, 32) @ W.T).tolist()
                sets.append([set(sorted(range(4), key=lambda e: -row[e])[:2]) for row in logits])
        share = sum(s0 != s1 for s0, s1 in zip(*sets, strict=True)) / 16
        assert div[(layer, 0, 1)] == pytest.approx(share)
    assert max(div.values()) > 0  # with random weights the second visit routes differently somewhere


# --------------------------------------------------------------------------------------------
# attention probabilities hook
# --------------------------------------------------------------------------------------------


def test_probs_hook_explicit_equals_sdpa_and_probs_are_causal(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    ids = torch.randint(0, V, (2, 7))
    seen: dict[Visit, torch.Tensor] = {}
    with torch.no_grad():
        sdpa = model(ids).logits
        explicit = model(ids, probs_hook=lambda v, p: seen.__setitem__(v, p)).logits
    assert_close_chain(explicit, sdpa, lm_chain_length(tiny_cfg(), 0, backward=False))
    assert list(seen) == model.schedule.plan
    for p in seen.values():
        assert p.shape == (2, 4, 7, 7)
        # a softmax row sums to 1 within ~10u (exp, divide, <= 7 additions): the fp32 defaults cover it
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 7))
        assert torch.count_nonzero(p.triu(diagonal=1)) == 0
        assert (p[..., torch.ones(7, 7, dtype=torch.bool).tril()] > 0).all()
    # first row attends only to itself
    assert torch.equal(seen[Visit(0, 0)][:, :, 0, 0], torch.ones(2, 4))

    # layer 0's probabilities recomputed from its projections: softmax(q k^T / sqrt(D)) with RoPE
    attn = model.layers[0].self_attn
    h = model.layers[0].input_layernorm(model.embed_tokens(ids))
    cos, sin = model.rotary(torch.arange(7))
    from smelt_ds.model.attention import apply_rotary
    q = apply_rotary(attn.q_proj(h).view(2, 7, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.k_proj(h).view(2, 7, 2, 8).transpose(1, 2), cos, sin)
    k = k[:, [0, 0, 1, 1]]  # query heads 0,1 share kv head 0; 2,3 share kv head 1
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.full((7, 7), float("-inf")).triu(1)
    # RMSNorm and q/k projections over H = 32, RoPE, q.k over 8, softmax over 7
    assert_close_chain(seen[Visit(0, 0)], scores.softmax(-1), 2 * 32 + 2 + 8 + 7)


def test_probs_hook_with_kv_cache(tiny_cfg):
    model = build_lm(tiny_cfg()).eval()
    ids = torch.randint(0, V, (1, 6))
    seen = {}
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache()
        model(ids[:, :5], kv_cache=cache)
        last = model(ids[:, 5:], kv_cache=cache, probs_hook=lambda v, p: seen.__setitem__(v, p)).logits
    assert_close_chain(last[:, -1], full[:, -1], lm_chain_length(tiny_cfg(), 0, backward=False))
    for p in seen.values():
        assert p.shape == (1, 4, 1, 6)
        torch.testing.assert_close(p.sum(-1), torch.ones(1, 4, 1))


# --------------------------------------------------------------------------------------------
# structure
# --------------------------------------------------------------------------------------------


def test_dense_first_k_layers(tiny_cfg):
    model = build_lm(tiny_cfg({"model": {"first_k_dense": 2}}))
    assert [type(layer.mlp) for layer in model.layers] == [SwiGLU, SwiGLU, MoE, MoE]
    mlp = model.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (48, 32) and mlp.down_proj.weight.shape == (32, 48)
    model(torch.randint(0, V, (1, 4)))
    # plan 0 1 2 1 2 3: MoE visits are (2,0), (2,1), (3,0); dense visits leave no record
    assert list(model.recorder.losses) == [Visit(2, 0), Visit(2, 1), Visit(3, 0)]
    assert set(model.recorder.routes) == {Visit(2, 0), Visit(2, 1), Visit(3, 0)}


def test_tied_embeddings_share_the_weight(tiny_cfg):
    cfg = tiny_cfg({"model": {"tie_embeddings": True}})
    tied = build_lm(cfg)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    ids = torch.randint(0, V, (1, 4))
    total_loss(tied(ids, labels=ids), cfg.train).backward()
    with torch.no_grad():
        tied.embed_tokens.weight[5, 0] = 123.0
    assert tied.lm_head.weight[5, 0].item() == 123.0
    untied = build_lm(tiny_cfg())
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == V * 32
    assert tied.num_non_embedding_params() == untied.num_non_embedding_params() == n_untied - 2 * V * 32


def test_looped_parameter_names(tiny_cfg):
    model = build_lm(tiny_cfg())
    names = model.looped_parameter_names()
    assert {n.split(".")[1] for n in names} == {"1", "2"}
    assert "layers.1.mlp.experts.gate_up_proj" in names and "layers.0.mlp.gate.weight" not in names


def test_model_import_does_not_import_deepspeed():
    code = "import smelt_ds.model, sys; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_state_dict_holds_each_layer_once():
    """The looping block manager must not register the layers a second time: a duplicate
    (blocks.layers.*) would be saved twice and, on an expert-parallel load, overwrite each rank's
    own experts with rank 0's."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM

    cfg = config_from_dict({"model": {"num_layers": 4, "hidden_size": 32, "max_seq_len": 64},
                            "train": {"seq_len": 32}})
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    keys = list(model.state_dict())
    assert not [k for k in keys if k.startswith("blocks.")]
    assert sum(1 for k in keys if k.endswith("mlp.experts.gate_up_proj")) == 4
    assert len(model.blocks.layers) == 4 and model.blocks.layers is model.layers
