"""Attention sink, routing and logit lens on constructed models whose answers are known, and
against hand computations on a random model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.model.looping import Visit, VisitContext
from tests.numerics import chain_tol


def _batches(V: int, n: int = 2, B: int = 2, S: int = 16, seed: int = 0) -> list[dict]:
    """Random windows whose first token is id 0 and whose other tokens are never 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, V, (B, S + 1), generator=g)
        ids[:, 0] = 0
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def _zero_block_outputs(model) -> None:
    for layer in model.layers:
        layer.self_attn.o_proj.weight.zero_()
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts.down_proj.zero_()
        else:
            mlp.down_proj.weight.zero_()


@torch.no_grad()
def _first_token_model(tiny_cfg):
    """Every head of every visit puts (numerically) all its mass on token 0 at position 0: token 0
    embeds as e_0, other tokens as e_1 + noise with no e_0 part; each head's query reads e_1 and its
    key reads e_0 in the lowest-frequency RoPE pair (theta 1e9: no rotation), so only key 0 scores
    ~90, the others 0. Attention and MoE outputs are zero: the residual stream never changes, so a
    looped layer's second visit sees exactly the input of its first."""
    from smelt_ds.model import SmeltLM

    cfg = tiny_cfg({"loop": {"position": "middle"}, "model": {"rope_theta": 1e9}})
    m = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    H = cfg.model.hidden_size
    emb = torch.randn(cfg.model.vocab_size, H) * 0.1
    emb[:, 0] = 0.0
    emb[:, 1] = 1.0
    emb[0] = 0.0
    emb[0, 0] = 1.0
    m.embed_tokens.weight.copy_(emb)
    for layer in m.layers:
        a = layer.self_attn
        D = a.head_dim
        a.q_proj.weight.zero_()
        a.k_proj.weight.zero_()
        for h in range(a.num_heads):
            a.q_proj.weight[h * D + D // 2 - 1, 1] = 3.0
        for g in range(a.num_kv_heads):
            a.k_proj.weight[g * D + D // 2 - 1, 0] = 3.0
    _zero_block_outputs(m)
    return m


def test_head_forced_on_first_token_reads_one_and_identical_visits_do_not_diverge(tiny_cfg):
    from smelt_ds.eval.analysis import analyze_model

    m = _first_token_model(tiny_cfg)
    res = analyze_model(m, _batches(m.model_cfg.vocab_size))
    attn = res["attention"]
    assert list(attn) == [f"L{v.layer}V{v.visit}" for v in m.schedule.plan]
    for rec in attn.values():
        assert rec["first_mass"] == pytest.approx([1.0] * 4, abs=1e-6)
        assert rec["top_mass"] == pytest.approx([1.0] * 4, abs=1e-6)
        assert rec["content_mass"] == pytest.approx([0.0] * 4, abs=1e-6)
        assert rec["entropy"] == pytest.approx([0.0] * 4, abs=1e-4)
        assert all(pos[0] == [0, pytest.approx(1.0, abs=1e-6)] for pos in rec["top_positions"])
    div = res["routing"]["divergence"]
    assert [(d["layer"], d["visits"]) for d in div] == [(1, [0, 1]), (2, [0, 1])]
    assert all(d["divergence"] == 0.0 and d["overlap"] == 1.0 for d in div)
    cmp = {c["layer"]: c for c in res["attention_visits"]}
    assert set(cmp) == {1, 2} and cmp[1]["delta_first_mass"] == pytest.approx(0.0, abs=1e-6)
    losses = [r["loss"] for r in res["logit_lens"]["depths"]]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-6)  # the stream never changes


def test_uniform_attention_has_the_closed_form_values(tiny_cfg):
    from smelt_ds.eval.analysis import analyze_model
    from smelt_ds.model import SmeltLM

    cfg = tiny_cfg({"loop": {"position": "middle"}})
    m = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    with torch.no_grad():
        for layer in m.layers:
            layer.self_attn.q_proj.weight.zero_()  # all scores 0: query i attends 1/(i+1) to each key
    S = 16
    res = analyze_model(m, _batches(m.model_cfg.vocab_size, S=S))
    rows = range(1, S)
    first = sum(1 / (i + 1) for i in rows) / (S - 1)
    ent = sum(math.log(i + 1) for i in rows) / (S - 1)
    content = sum((i - 1) / (i + 1) for i in rows) / (S - 1)
    for rec in res["attention"].values():
        assert rec["first_mass"] == pytest.approx([first] * 4, rel=1e-5)
        assert rec["self_mass"] == pytest.approx([first] * 4, rel=1e-5)
        assert rec["entropy"] == pytest.approx([ent] * 4, rel=1e-5)
        assert rec["content_mass"] == pytest.approx([content] * 4, rel=1e-5)


def test_random_model_statistics_equal_hand_computations(tiny_cfg):
    from smelt_ds.eval.analysis import analyze_model
    from smelt_ds.model import SmeltLM

    cfg = tiny_cfg({"loop": {"position": "middle"}})
    m = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    batches = _batches(m.model_cfg.vocab_size, n=2, B=3, S=20, seed=1)
    res = analyze_model(m, batches)
    # by hand: attention probabilities and router inputs of every visit, in plan order
    probs: dict[Visit, list[torch.Tensor]] = {}
    router_in: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    hooks = [layer.mlp.gate.register_forward_pre_hook(lambda mod, args, i=i: router_in[i].append(args[0]))
             for i, layer in enumerate(m.layers)]
    nats = toks = 0.0
    final_argmax = []
    with torch.no_grad():
        for b in batches:
            out = m(b["input_ids"], labels=b["labels"], probs_hook=lambda v, p: probs.setdefault(v, []).append(p))
            final_argmax.append(out.logits.argmax(-1))
            nats, toks = nats + float(out.lm_loss) * b["labels"].numel(), toks + b["labels"].numel()
    for h in hooks:
        h.remove()
    for v, ps in probs.items():
        p = torch.cat(ps)  # (batches * B, Nq, S, S)
        rec = res["attention"][f"L{v.layer}V{v.visit}"]
        # the same probabilities averaged in another order over 2 batches x 3 rows x 19 queries (and
        # over <= 20 keys): 2 n u (tests/numerics.py), 1.6e-5; the entropy's log adds 2u a term (1e-4 is 6x)
        attn_rtol = chain_tol(2 * 3 * 19 + 20)
        assert rec["first_mass"] == pytest.approx(p[:, :, 1:, 0].mean(dim=(0, 2)).tolist(), rel=attn_rtol)
        ent = -(p[:, :, 1:] * p[:, :, 1:].clamp_min(1e-30).log()).sum(-1).mean(dim=(0, 2))
        assert rec["entropy"] == pytest.approx(ent.tolist(), rel=1e-4)
        top3 = p[:, :, 1:].sort(-1, descending=True).values[..., :3].sum(-1).mean(dim=(0, 2))
        assert rec["top_mass"] == pytest.approx(top3.tolist(), rel=attn_rtol)
    # the second visit's sink vs the first's, paired over the 6 windows (2 batches x 3 rows)
    for c in res["attention_visits"]:
        first_v, last_v = (torch.cat(probs[Visit(c["layer"], v)])[:, :, 1:, 0].double().mean(dim=(1, 2))
                           for v in (c["visits"][0], c["visits"][-1]))
        iv = c["delta_first_mass_interval"]
        assert iv["n"] == 6 and iv["difference"] == pytest.approx(float((last_v - first_v).mean()), abs=1e-6)
        assert iv["low"] <= iv["difference"] <= iv["high"]
        assert iv["difference"] == pytest.approx(c["delta_first_mass"], abs=1e-6)
    # routing: expert load and divergence from the router's own inputs
    K, E = m.moe_cfg.top_k, m.moe_cfg.num_experts
    for layer, xs in router_in.items():
        visits = m.schedule.visits_of(layer)
        per_visit = [torch.cat(xs[v::visits]) for v in range(visits)]  # calls alternate per batch
        tops = [F.linear(x, m.layers[layer].mlp.gate.weight).softmax(-1).topk(K, -1).indices for x in per_visit]
        for v, t in enumerate(tops):
            load = torch.bincount(t.reshape(-1), minlength=E).double()
            rec = res["routing"]["visits"][f"L{layer}V{v}"]
            assert rec["load"] == pytest.approx((load / load.sum()).tolist())
            assert rec["load_max_over_mean"] == pytest.approx(float(load.max() / load.mean()))
        if visits == 2:
            a, b = (t.sort(-1).values for t in tops)
            want = (a != b).any(-1).double().mean().item()
            kept = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True)) / (K * a.shape[0])
            got = next(d for d in res["routing"]["divergence"] if d["layer"] == layer)
            assert got["divergence"] == pytest.approx(want) and 0 < want <= 1
            assert got["overlap"] == pytest.approx(kept)
            # per window (rows of 20 tokens in batch order), the mean's bootstrap interval
            from smelt_ds.eval.stratified import paired_difference

            per_window = (a != b).any(-1).double().view(6, -1).mean(-1).tolist()
            assert got["divergence_interval"] == paired_difference(per_window, [0.0] * 6)
            assert got["divergence_interval"]["difference"] == pytest.approx(want)
    # logit lens: the last depth is the model's own loss; depth d runs the first d visits by hand
    lens = res["logit_lens"]["depths"]
    assert len(lens) == m.schedule.effective_depth + 1
    # fp32 means and sums over <= 60 tokens against doubles: 61u = 3.6e-6 < 1e-5
    assert lens[-1]["loss"] == pytest.approx(nats / toks, rel=1e-5) == res["lm_loss"]
    assert lens[-1]["agree_final"] == 1.0
    for d in (0, 3):
        num = agree = 0.0
        with torch.no_grad():
            for b, final in zip(batches, final_argmax, strict=True):
                x = m.embed_tokens(b["input_ids"])
                cos, sin = m.rotary(torch.arange(b["input_ids"].shape[1]))
                for v in m.schedule.plan[:d]:
                    x = m.layers[v.layer](x, VisitContext(v, cos, sin))
                logits = m.lm_head(m.norm(x))
                num += float(F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="sum"))
                agree += float((logits.argmax(-1) == final).sum())
        assert lens[d]["loss"] == pytest.approx(num / toks, rel=1e-5)
        assert lens[d]["agree_final"] == pytest.approx(agree / toks)


def test_loop_boundaries(tiny_cfg):
    from smelt_ds.eval.analysis import loop_boundaries
    from smelt_ds.model.looping import LoopSchedule, LoopSpan

    block = LoopSchedule(8, [LoopSpan(2, 6, 2)], "block")  # 0 1 | 2 3 4 5 | 2 3 4 5 | 6 7
    assert [b["depth"] for b in loop_boundaries(block)] == [2, 6, 10]
    layer = LoopSchedule(8, [LoopSpan(2, 6, 2)], "layer")  # 0 1 2 2 3 3 4 4 5 5 6 7
    assert [b["depth"] for b in loop_boundaries(layer)] == [2, 10]
    assert loop_boundaries(LoopSchedule(4, [])) == []
