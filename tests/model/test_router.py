"""The MoE router (smelt_ds/model/router.py): the aux-loss-free bias steers selection only, token
counting is explicit, exact ties go to the lowest expert index (so an activation-checkpoint recompute
routes as its forward)."""

from __future__ import annotations

import pytest
import torch

from smelt_ds.model.router import TopKRouter
from smelt_ds.train.objective import total_loss
from tests.model.moe_helpers import BY_HAND_RTOL, constructed_moe


def test_aux_loss_free_bias_steers_selection_not_weights():
    moe, x = constructed_moe()
    moe.gate.use_bias = True
    with torch.no_grad():
        moe.gate.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0]))  # expert 0 always selected
    moe(x)
    idx = moe.last_route.topk_idx_TK.tolist()
    assert all(row[0] == 0 for row in idx)
    # token 0: expert 0 (p=1/6) and expert 2 (p=3/6) -> weights 1/4, 3/4 from the unbiased scores
    assert moe.last_route.topk_weight_TK[0].tolist() == pytest.approx([1 / 4, 3 / 4], rel=BY_HAND_RTOL)
    assert moe.gate.tokens_per_expert.tolist() == [4, sum(r[1] == 1 for r in idx), sum(r[1] == 2 for r in idx)]
    moe.gate.update_bias(0.5)  # load [4, a, b], mean 8/3: expert 0 overloaded -> bias down
    assert moe.gate.expert_bias[0].item() == pytest.approx(9.5)
    assert moe.gate.tokens_per_expert.sum().item() == 0


def test_count_tokens_is_explicit():
    """``count_tokens`` None counts when grad is enabled; True / False override it (the looping
    manager passes False for a checkpoint recompute, True for a reentrant checkpoint's forward)."""
    moe, x = constructed_moe()
    moe.gate.use_bias = True
    moe(x, count_tokens=False)
    with torch.no_grad():
        moe(x)
    assert moe.gate.tokens_per_expert.sum().item() == 0
    moe(x)
    with torch.no_grad():
        moe(x, count_tokens=True)
    assert moe.gate.tokens_per_expert.sum().item() == 2 * 8  # 4 tokens x top-2, twice


# --------------------------------------------------------------------------------------------
# exact ties: lowest expert index first, so an activation-checkpoint recompute routes as its forward
# --------------------------------------------------------------------------------------------


def test_topk_lowest_index_by_hand_and_equal_to_topk_without_ties():
    from smelt_ds.model.router import topk_lowest_index

    s = torch.tensor([[0.3, 0.5, 0.5, 0.1, 0.5],   # a three-way tie at the top
                      [0.2, 0.2, 0.2, 0.2, 0.2],   # everything ties
                      [0.1, 0.4, 0.3, 0.2, 0.0]])  # no tie
    assert topk_lowest_index(s, 2).tolist() == [[1, 2], [0, 1], [1, 2]]
    assert topk_lowest_index(s, 4).tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [1, 2, 3, 0]]
    assert topk_lowest_index(s, 2).dtype == torch.int64
    g = torch.Generator().manual_seed(3)
    r = torch.randn(500, 22, generator=g)  # continuous scores: no ties
    assert torch.equal(topk_lowest_index(r, 4), r.topk(4, dim=-1).indices)  # same experts, same order
    # torch.topk's order among equal values is not the index order (on this CPU build a row of 4 equal
    # scores gives [2, 3]): the reason the router does not use it
    assert topk_lowest_index(torch.zeros(3, 4), 2).tolist() == [[0, 1]] * 3
    for k in (0, 6):
        with pytest.raises(ValueError, match=f"k={k} for 5 experts"):
            topk_lowest_index(s, k)


def test_topk_lowest_index_keys_rank_negative_scores_and_signed_zero_like_a_stable_sort():
    """The integer keys behind the tie-break order negative scores, -0.0 vs +0.0 (equal: lowest
    index first) and fp16 input exactly as a stable descending sort of the scores does."""
    from smelt_ds.model.router import topk_lowest_index

    s = torch.tensor([[-0.5, 0.0, -0.0, -2.0, 1e-30, -1e-30, 0.0],
                      [-1.0, -1.0, -3.0, -0.25, -0.25, -7.0, -1.0]])
    stable = s.sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(topk_lowest_index(s, 7), stable)
    assert topk_lowest_index(s, 3).tolist() == [[4, 1, 2], [3, 4, 0]]
    h = torch.tensor([[0.5, 0.25, 0.5, 0.75]], dtype=torch.float16)
    assert topk_lowest_index(h, 3).tolist() == [[3, 0, 2]]
    r = torch.randn(300, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(topk_lowest_index(r, 3), r.topk(3, dim=-1).indices)


def _tied_raw(policy: str, score_func: str) -> dict:
    return {"name": "ties", "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                      "num_kv_heads": 2, "max_seq_len": 32, "dropout": 0.1},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16, "score_func": score_func},
            "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2,
                      "activation_checkpointing": {"policy": policy, "impl": "torch"}}}


def _tied_step(policy: str, score_func: str = "softmax"):
    """One forward + backward of a 4-layer model (plan 0 1 2 1 2 3) whose routers are all zero, so
    every token's scores tie exactly (softmax 1/E, sigmoid 1/2). Returns the loss, all gradients
    and the experts chosen by every router call (forward visits, then recomputes)."""
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.model import SmeltLM
    from smelt_ds.model.router import TopKRouter
    from smelt_ds.parallel.engine import configure_activation_checkpointing

    cfg = config_from_dict(_tied_raw(policy, score_func))
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).train()
    configure_activation_checkpointing(model, cfg)
    chosen: list[torch.Tensor] = []
    for name, m in model.named_modules():
        if isinstance(m, TopKRouter) and name.startswith("layers."):
            with torch.no_grad():
                m.weight.zero_()
            m.register_forward_hook(lambda mod, inp, out: chosen.append(out[2].clone()))
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # dropout stream
    out = model(ids[:, :-1], labels=ids[:, 1:])
    loss = total_loss(out, cfg.train)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "chosen": chosen}


def _tie_mismatches(got, ref, top_k: int = 2) -> list[str]:
    """What differs between a checkpointed run and the run without recompute: loss and gradients
    (bitwise), and router calls that did not choose experts 0..K-1 (the documented tie-break)."""
    bad = [] if torch.equal(got["loss"], ref["loss"]) else ["loss"]
    bad += [n for n, g in ref["grads"].items() if not torch.equal(got["grads"][n], g)]
    want = list(range(top_k))
    bad += [f"router call {i}" for i, c in enumerate(got["chosen"]) if any(row != want for row in c.tolist())]
    return bad


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("policy", ["full", "looped"])
def test_tied_router_scores_checkpointed_equals_no_recompute(policy, score_func):
    ref = _tied_step("none", score_func)
    got = _tied_step(policy, score_func)
    n_recompute = {"full": 6, "looped": 4}[policy]  # visits recomputed in backward
    assert len(ref["chosen"]) == 6 and len(got["chosen"]) == 6 + n_recompute
    assert _tie_mismatches(ref, ref) == []  # the reference itself routes every token to experts 0, 1
    assert _tie_mismatches(got, ref) == []
    # the router gradient is not trivially zero (the aux / z losses and the combine weights reach it)
    assert got["grads"]["layers.1.mlp.gate.weight"].abs().max() > 0


def test_tied_router_check_fails_when_recompute_breaks_ties_differently(monkeypatch):
    """Negative control: a tie-break that still ranks non-tied scores correctly but orders tied
    experts differently on every router call (as a kernel without a guaranteed tie order may, and
    unaffected by the RNG state that checkpointing restores) leaves the forward unchanged, but the
    recompute routes the tokens to other experts: the gradients differ and the check above fails
    (or torch's checkpoint metadata check raises first, on the per-expert loop path)."""
    from torch.utils.checkpoint import CheckpointError

    from smelt_ds.model import router as router_mod

    lowest_index = router_mod.topk_lowest_index

    def rotating_tie_break():
        calls = iter(range(10 ** 6))

        def topk(scores_TE, k):
            order_E = torch.roll(torch.arange(scores_TE.shape[-1]), -next(calls))  # preferred order of ties
            return order_E[lowest_index(scores_TE[:, order_E], k)]

        return topk

    monkeypatch.setattr(router_mod, "topk_lowest_index", rotating_tie_break())
    ref = _tied_step("none")
    monkeypatch.setattr(router_mod, "topk_lowest_index", rotating_tie_break())  # same forward choices as ref
    try:
        got = _tied_step("full")
    except CheckpointError:
        return
    assert torch.equal(got["loss"], ref["loss"])  # the forward is the reference's
    bad = _tie_mismatches(got, ref)
    assert any(b.startswith("layers.") for b in bad), bad  # gradients changed


def test_router_jitter_applies_in_training_only():
    """``moe.router_jitter`` multiplies the router's input by U(1 - j, 1 + j) noise in training
    (Switch Transformer) and never in evaluation: in eval mode the router's output equals a
    jitter-free router's exactly (validation, eval and export numbers must not be random), while
    in training mode it differs from it."""
    torch.manual_seed(0)
    plain, jittered = TopKRouter(16, 8, 2), TopKRouter(16, 8, 2, jitter=0.5)
    torch.nn.init.normal_(plain.weight)
    jittered.load_state_dict(plain.state_dict())
    x = torch.randn(32, 16)
    jittered.eval()
    for got, want in zip(jittered(x), plain.eval()(x), strict=True):
        assert torch.equal(got, want)
    jittered.train()
    assert not torch.equal(jittered(x)[0], plain(x)[0])  # logits: the noise changed them
