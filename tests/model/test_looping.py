"""Visit plans (docs/configuration.md, ``loop``) and the looping block manager (docs/architecture.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from smelt_ds.config.loop import LoopConfig
from smelt_ds.errors import ConfigError
from smelt_ds.model import LoopSchedule, LoopSpan, SmeltLM, Visit
from smelt_ds.model.looping import VisitContext
from smelt_ds.train.objective import total_loss
from tests.numerics import assert_close_chain, lm_chain_length


def build_lm(cfg) -> SmeltLM:
    """``SmeltLM`` of a recipe's architecture sections (``model``, ``moe``, ``loop``)."""
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


# --------------------------------------------------------------------------------------------
# visit plans
# --------------------------------------------------------------------------------------------

# Written out by hand for L=8 (positions: docs/configuration.md, `loop`). asymmetric = the middle range
# split at its centre, lower half run 3 times, upper half twice.
PLANS_L8 = {
    ("none", "block"): [0, 1, 2, 3, 4, 5, 6, 7],
    ("none", "layer"): [0, 1, 2, 3, 4, 5, 6, 7],
    ("uniform", "block"): [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
    ("uniform", "layer"): [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7],
    ("bottom", "block"): [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7],
    ("bottom", "layer"): [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7],
    ("middle", "block"): [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7],
    ("middle", "layer"): [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 7],
    ("top", "block"): [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7],
    ("top", "layer"): [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7],
    ("asymmetric", "block"): [0, 1, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7],
    ("asymmetric", "layer"): [0, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 7],
}

# Loop ranges (start, end, repeats) per preset and depth, written out by hand.
RANGES = {
    8: {"none": [], "uniform": [(0, 8, 2)], "bottom": [(0, 4, 2)], "middle": [(2, 6, 2)], "top": [(4, 8, 2)],
        "asymmetric": [(2, 4, 3), (4, 6, 2)]},
    12: {"none": [], "uniform": [(0, 12, 2)], "bottom": [(0, 6, 2)], "middle": [(3, 9, 2)], "top": [(6, 12, 2)],
         "asymmetric": [(3, 6, 3), (6, 9, 2)]},
    16: {"none": [], "uniform": [(0, 16, 2)], "bottom": [(0, 8, 2)], "middle": [(4, 12, 2)],
         "top": [(8, 16, 2)], "asymmetric": [(4, 8, 3), (8, 12, 2)]},
    24: {"none": [], "uniform": [(0, 24, 2)], "bottom": [(0, 12, 2)], "middle": [(6, 18, 2)],
         "top": [(12, 24, 2)], "asymmetric": [(6, 12, 3), (12, 18, 2)]},
}


def expand(L: int, ranges: list[tuple[int, int, int]], order: str) -> list[int]:
    """Independent expansion: unlooped layers once, a range r times as a block or layer by layer."""
    out, i = [], 0
    for a, b, r in ranges:
        out += list(range(i, a))
        out += list(range(a, b)) * r if order == "block" else [j for j in range(a, b) for _ in range(r)]
        i = b
    return out + list(range(i, L))


def with_visit_index(layers: list[int]) -> list[tuple[int, int]]:
    return [(layer, layers[:n].count(layer)) for n, layer in enumerate(layers)]


def schedule(position: str, L: int, order: str, **kw) -> LoopSchedule:
    return LoopSchedule.from_config(LoopConfig(position=position, order=order, **kw), L)


@pytest.mark.parametrize("position,order", sorted(PLANS_L8))
def test_plan_l8_written_out(position, order):
    s = schedule(position, 8, order)
    assert s.layers() == PLANS_L8[(position, order)]
    assert s.effective_depth == len(PLANS_L8[(position, order)])


@pytest.mark.parametrize("L", [8, 12, 16, 24])
@pytest.mark.parametrize("position", ["none", "uniform", "bottom", "middle", "top", "asymmetric"])
@pytest.mark.parametrize("order", ["block", "layer"])
def test_plan_presets_every_depth(L, position, order):
    s = schedule(position, L, order)
    expected = expand(L, RANGES[L][position], order)
    assert s.layers() == expected
    assert [(v.layer, v.visit) for v in s.plan] == with_visit_index(expected)
    assert [(sp.start, sp.end, sp.repeats) for sp in s.spans] == RANGES[L][position]


def test_plan_middle_l8_visit_indices_written_out():
    block = schedule("middle", 8, "block").plan
    assert block == [Visit(0, 0), Visit(1, 0), Visit(2, 0), Visit(3, 0), Visit(4, 0), Visit(5, 0),
                     Visit(2, 1), Visit(3, 1), Visit(4, 1), Visit(5, 1), Visit(6, 0), Visit(7, 0)]
    layer = schedule("middle", 8, "layer").plan
    assert layer == [Visit(0, 0), Visit(1, 0), Visit(2, 0), Visit(2, 1), Visit(3, 0), Visit(3, 1),
                     Visit(4, 0), Visit(4, 1), Visit(5, 0), Visit(5, 1), Visit(6, 0), Visit(7, 0)]


def test_custom_ranges_and_repeats():
    cfg = LoopConfig(position="custom", ranges=[{"start": 5, "end": 7, "repeats": 3},
                                                {"start": 0, "end": 2, "repeats": 2}])
    s = LoopSchedule.from_config(cfg, 8)
    assert s.layers() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 7]
    assert s.plan[-2:] == [Visit(6, 2), Visit(7, 0)]
    cfg = cfg.model_copy(update={"order": "layer"})
    assert LoopSchedule.from_config(cfg, 8).layers() == [0, 0, 1, 1, 2, 3, 4, 5, 5, 5, 6, 6, 6, 7]
    # three ranges, one with repeats 1 (listed but not looped)
    s = LoopSchedule(12, [LoopSpan(1, 3, 2), LoopSpan(4, 5, 1), LoopSpan(9, 12, 4)], "block")
    assert s.layers() == [0, 1, 2, 1, 2, 3, 4, 5, 6, 7, 8] + [9, 10, 11] * 4
    assert [s.visits_of(i) for i in range(12)] == [1, 2, 2, 1, 1, 1, 1, 1, 1, 4, 4, 4]
    assert [s.is_looped(i) for i in (0, 1, 4, 11)] == [False, True, False, True]


def test_fraction_and_repeats_presets():
    # fraction 0.25 of 16 = 4 layers in the middle: [6, 10); repeats 3
    s = schedule("middle", 16, "block", fraction=0.25, repeats=3)
    assert s.layers() == list(range(0, 10)) + [6, 7, 8, 9] * 2 + list(range(10, 16))
    s = schedule("top", 12, "layer", fraction=0.25, repeats=2)  # floor(3) -> [9, 12)
    assert s.layers() == list(range(9)) + [9, 9, 10, 10, 11, 11]


def test_preset_empty_range_raises():
    with pytest.raises(ConfigError, match=r"loop.position.*'middle'.*model.num_layers.*\(1\)"):
        schedule("middle", 1, "block")
    with pytest.raises(ConfigError, match=r"asymmetric.*at least 2 layers"):
        schedule("asymmetric", 3, "block")


# --------------------------------------------------------------------------------------------
# the manager: looped forward == unrolled forward; gradients of a shared layer == sum of copies
# --------------------------------------------------------------------------------------------

# L=4, middle = [1, 3) twice. Written out by hand.
PLAN4 = {"block": [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (3, 0)],
         "layer": [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]}


def unrolled_logits(model: SmeltLM, ids: torch.Tensor, plan, layers=None, inject=False) -> torch.Tensor:
    """Run ``plan`` in a plain loop; ``layers[n]`` is the module of the n-th visit (default: shared)."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(torch.arange(ids.shape[1]))
    block_in = None
    for n, (layer, visit) in enumerate(plan):
        if inject and layer == 1:  # the loop range starts at layer 1
            if visit == 0:
                block_in = x
            else:
                x = x + block_in
        mod = model.layers[layer] if layers is None else layers[n]
        x = mod(x, VisitContext(Visit(layer, visit), cos, sin))
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("order,inject", [("block", "none"), ("layer", "none"), ("block", "add")])
def test_looped_forward_equals_unrolled(tiny_cfg, order, inject):
    model = build_lm(tiny_cfg({"loop": {"order": order, "input_injection": inject}}))
    assert model.schedule.plan == [Visit(*v) for v in PLAN4[order]]
    ids = torch.randint(0, 61, (2, 7))
    got = model(ids).logits
    want = unrolled_logits(model, ids, PLAN4[order], inject=inject == "add")
    assert_close_chain(got, want, lm_chain_length(tiny_cfg(), 0, backward=False))  # tests/numerics.py
    # and the loop matters: running each layer once gives something else
    once = unrolled_logits(model, ids, [(i, 0) for i in range(4)])
    assert (got - once).abs().max() > 1e-3


def test_input_injection_changes_output(tiny_cfg):
    a = build_lm(tiny_cfg({"loop": {"input_injection": "none"}}))
    b = build_lm(tiny_cfg({"loop": {"input_injection": "add"}}))
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 61, (1, 5))
    assert (a(ids).logits - b(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("order,inject", [("block", "none"), ("layer", "none"), ("block", "add")])
def test_looped_grad_equals_sum_of_unrolled_copies(tiny_cfg, order, inject):
    cfg = tiny_cfg({"loop": {"order": order, "input_injection": inject},
                    "train": {"aux_loss_coef": 0.5, "z_loss_coef": 0.1}, "model": {"first_k_dense": 1}})
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    twin = copy.deepcopy(model)  # before any forward: a module holding last_route is not deep-copyable
    ids = torch.randint(0, 61, (2, 6))
    labels = torch.randint(0, 61, (2, 6))
    total_loss(model(ids, labels=labels), cfg.train).backward()

    copies = [copy.deepcopy(twin.layers[layer]) for layer, _ in PLAN4[order]]
    logits = unrolled_logits(twin, ids, PLAN4[order], layers=copies, inject=inject == "add")
    moe_losses = [c.mlp.last_losses for c in copies if c.is_moe]
    assert len(moe_losses) == 5  # 6 visits, layer 0 is dense
    loss = (F.cross_entropy(logits.reshape(-1, 61), labels.reshape(-1))
            + 0.5 * sum(d["aux"] for d in moe_losses) / 5 + 0.1 * sum(d["z"] for d in moe_losses) / 5)
    loss.backward()

    # autograd accumulates a looped layer's two visits in another order than the sum of its copies:
    # the bound of a forward and backward chain (tests/numerics.py), 12 tokens x 2 visits
    n_chain = lm_chain_length(cfg, tokens=12 * 2)
    for i in range(4):
        mine = [c for c, (layer, _) in zip(copies, PLAN4[order], strict=True) if layer == i]
        assert len(mine) == (2 if i in (1, 2) else 1)
        for name, p in model.layers[i].named_parameters():
            summed = sum(dict(c.named_parameters())[name].grad for c in mine)
            assert_close_chain(p.grad, summed, n_chain, msg=f"layers.{i}.{name}")
    # a looped layer's gradient is not just its first copy's
    first_copy = dict(copies[1].named_parameters())["self_attn.q_proj.weight"].grad
    assert (model.layers[1].self_attn.q_proj.weight.grad - first_copy).abs().max() > 1e-6
    assert_close_chain(model.embed_tokens.weight.grad, twin.embed_tokens.weight.grad, n_chain)


def test_checkpointed_looped_visits_same_loss_and_grads(tiny_cfg):
    from torch.utils.checkpoint import checkpoint

    cfg = tiny_cfg()
    model = build_lm(cfg)
    ids = torch.randint(0, 61, (2, 6))
    out = model(ids, labels=ids)
    total_loss(out, cfg.train).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    seen = []
    model.blocks.configure_checkpointing(lambda v: seen.append(v) or model.schedule.is_looped(v.layer),
                                         lambda fn, x: checkpoint(fn, x, use_reentrant=False))
    out2 = model(ids, labels=ids)
    total_loss(out2, cfg.train).backward()
    assert seen == model.schedule.plan
    # the recompute replays the same kernels on the same shapes in this process: bit-identical
    assert torch.equal(out2.lm_loss, out.lm_loss) and torch.equal(out2.aux_loss, out.aux_loss)
    assert len(model.recorder.losses) == 6  # recompute overwrote, did not add
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n


# --------------------------------------------------------------------------------------------
# the manager's checkpointing API and visit context
# --------------------------------------------------------------------------------------------


def _model(cfg) -> SmeltLM:
    return SmeltLM(cfg.model, cfg.moe, cfg.loop)


def _loss(out) -> torch.Tensor:
    """A training objective with the MoE losses in it (their gradients go through the recorder)."""
    return out.lm_loss + 0.5 * out.aux_loss + 0.1 * out.z_loss


def _contexts(model: SmeltLM) -> list[VisitContext]:
    """Pre-hooks on every layer: the :class:`VisitContext` of each call, in call order."""
    seen: list[VisitContext] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
    return seen


def test_configure_checkpointing_with_visit_set_checkpoints_exactly_those(tiny_cfg):
    from torch.utils.checkpoint import checkpoint

    model = _model(tiny_cfg()).train()
    plan = model.schedule.plan  # 0 1 2 1 2 3
    chosen = {Visit(1, 1), Visit(3, 0)}
    calls: list[torch.Tensor] = []

    def fn(run, x):
        calls.append(x)
        return checkpoint(run, x, use_reentrant=False)

    model.blocks.configure_checkpointing(chosen, fn)
    assert model.blocks.checkpointing.visits == frozenset(chosen)
    assert not model.blocks.checkpointing.frees_inputs
    ctxs = _contexts(model)
    reports: list[Visit] = []
    ids = torch.randint(0, 61, (2, 6))
    out = model(ids, labels=ids, probs_hook=lambda v, p: reports.append(v))
    assert len(calls) == 2  # one call of fn per chosen visit
    assert [(c.visit, c.checkpointed, c.recompute) for c in ctxs] == [
        (v, v in chosen, False) for v in plan]
    assert all(c.kv_cache is None and c.cos.shape == (6, 8) for c in ctxs)
    _loss(out).backward()
    recomputed = ctxs[len(plan):]
    assert sorted(c.visit for c in recomputed) == sorted(chosen)
    assert all(c.checkpointed and c.recompute and not c.counts_tokens for c in recomputed)
    assert reports == plan  # the recompute reports no attention probs
    assert list(model.recorder.losses) == plan  # every layer is MoE: recorded once per visit, in plan order

    # reconfigure / wrap / disable
    assert model.blocks.wrap_checkpoint_fn(lambda f: (lambda run, x: calls.append(None) or f(run, x)))
    calls.clear()
    model(ids, labels=ids)
    assert len(calls) == 4  # the wrapper and the wrapped fn, per chosen visit
    model.blocks.disable_checkpointing()
    assert model.blocks.checkpointing is None
    assert not model.blocks.wrap_checkpoint_fn(lambda f: f)
    calls.clear()
    model(ids, labels=ids)
    assert calls == []
    with pytest.raises(ValueError, match=r"Visit\(layer=3, visit=1\).*not in the visit plan"):
        model.blocks.configure_checkpointing([Visit(3, 1)], fn)
    with pytest.raises(TypeError, match="callable"):
        model.blocks.configure_checkpointing(chosen, None)


def test_checkpointing_skipped_in_eval_without_grad_and_with_kv_cache(tiny_cfg):
    from smelt_ds.model import KVCache

    model = _model(tiny_cfg()).train()
    calls = []
    model.blocks.configure_checkpointing(lambda v: True, lambda run, x: calls.append(x) or run(x))
    ids = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        model(ids)
    model(ids, kv_cache=KVCache())
    model.eval()(ids)
    assert calls == []
    model.train()(ids)
    assert len(calls) == len(model.schedule.plan)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_does_not_double_count_tokens_per_expert(tiny_cfg, reentrant):
    from torch.utils.checkpoint import checkpoint

    from smelt_ds.model.router import TopKRouter

    def tokens(ckpt: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _model(tiny_cfg({"moe": {"aux_loss_free_bias": True, "router_jitter": 0.1}})).train()
        if ckpt:
            model.blocks.configure_checkpointing(
                set(model.schedule.plan), lambda run, x: checkpoint(run, x, use_reentrant=reentrant))
        ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)  # jitter stream
        _loss(model(ids, labels=ids)).backward()
        return [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, TopKRouter)]

    ref, got = tokens(False), tokens(True)
    # 4 layers, 6 visits: 2 * 6 tokens * top-2 per visit, layers 1 and 2 visited twice
    assert [int(t.sum()) for t in ref] == [24, 48, 48, 24]
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
