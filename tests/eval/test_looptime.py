"""Test-time loop count: ``loop_with_repeats``, ``SmeltLM.set_loop`` and ``smelt-ds eval --loop-repeats``.

References: a model *built* with the test-time loop section (same weights loaded) for the logits;
the normal evaluation path for the trained repeat count; ``compute_budget`` of a hand-written
``custom`` recipe for the FLOPs."""

from __future__ import annotations

import pytest
import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.loop import LoopRange, loop_with_repeats
from smelt_ds.cost.budget import compute_budget
from smelt_ds.errors import ConfigError
from smelt_ds.eval.data import open_eval_data
from smelt_ds.eval.looptime import loop_plan, loop_repeats_markdown, loss_by_repeats, parse_repeats
from smelt_ds.eval.loss import evaluate_domain
from smelt_ds.model import SmeltLM
from smelt_ds.model.attention import KVCache
from smelt_ds.runs.load import load_run
from smelt_ds.runs.validation_loss import combine_domains
from tests.eval.eval_test_utils import tiny_raw


def test_loop_with_repeats_plans(eval_cache):
    cfg = config_from_dict(tiny_raw(eval_cache))  # L=4, middle range [1, 3) twice
    L = cfg.model.num_layers
    plan = lambda loop: config_from_dict({**tiny_raw(eval_cache), "loop": loop.model_dump()}).schedule.layers()  # noqa: E731
    assert plan(loop_with_repeats(cfg.loop, L)) == [0, 1, 2, 1, 2, 3]
    assert plan(loop_with_repeats(cfg.loop, L, repeats=1)) == [0, 1, 2, 3]
    assert plan(loop_with_repeats(cfg.loop, L, repeats=3)) == [0, 1, 2, 1, 2, 1, 2, 3]
    assert plan(loop_with_repeats(cfg.loop, L, exit_after=1)) == [0, 1, 2, 3]
    assert plan(loop_with_repeats(cfg.loop, L, repeats=3, exit_after=2)) == [0, 1, 2, 1, 2, 3]
    # asymmetric: ranges [1, 2) x3 and [2, 3) x2 ; exit_after caps each range
    asym = config_from_dict(tiny_raw(eval_cache, loop={"position": "asymmetric"}))
    assert asym.schedule.layers() == [0, 1, 1, 1, 2, 2, 3]
    assert plan(loop_with_repeats(asym.loop, L, exit_after=2)) == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ConfigError, match="--loop-repeats"):
        loop_with_repeats(cfg.loop, L, repeats=0)
    base = config_from_dict(tiny_raw(eval_cache, loop={"position": "none"}))
    with pytest.raises(ConfigError, match="no loop range"):
        loop_with_repeats(base.loop, L, repeats=2)


def test_exit_after_beyond_a_ranges_repeats_keeps_its_repeats(eval_cache, random_exports):
    """``--exit-after P`` with P above a range's repeat count: "every loop range stops after at most P
    passes" (``loop_with_repeats``, docs/evaluation.md), so such a range keeps its repeats (no error,
    no extra pass); a range with more repeats than P is cut to P. Plans written out by hand."""
    L = 4
    plan = lambda loop: config_from_dict({**tiny_raw(eval_cache), "loop": loop.model_dump()}).schedule.layers()  # noqa: E731
    middle = config_from_dict(tiny_raw(eval_cache)).loop  # [1, 3) x2
    assert plan(loop_with_repeats(middle, L, exit_after=3)) == [0, 1, 2, 1, 2, 3]
    assert plan(loop_with_repeats(middle, L, repeats=1, exit_after=5)) == [0, 1, 2, 3]
    asym = config_from_dict(tiny_raw(eval_cache, loop={"position": "asymmetric"})).loop  # [1, 2) x3, [2, 3) x2
    assert loop_with_repeats(asym, L, exit_after=3).ranges == [LoopRange(start=1, end=2, repeats=3),
                                                               LoopRange(start=2, end=3, repeats=2)]
    assert plan(loop_with_repeats(asym, L, exit_after=3)) == [0, 1, 1, 1, 2, 2, 3]  # the x2 range kept
    assert plan(loop_with_repeats(asym, L, repeats=4, exit_after=3)) == [0, 1, 1, 1, 2, 2, 2, 3]  # both cut to 3
    # the loop-count table (smelt-ds eval --loop-repeats 1 --exit-after 3): R = 1 runs once, not 3 times
    smelt = load_run(random_exports["smelt"])
    row = loss_by_repeats([smelt], [1], exit_after=3, batches=1, micro_batch_size=2, log=lambda *_: None)["rows"][0]
    assert (row["label"], row["visit_plan"], row["visits"], row["kv_cache_slots"]) == (
        "R=1, exit after 3", [0, 1, 2, 3], 4, 4)


@pytest.mark.parametrize("repeats", [1, 3])
def test_set_loop_equals_a_model_built_with_that_plan(eval_cache, repeats):
    cfg = config_from_dict(tiny_raw(eval_cache, model={"init_std": 0.2}))
    torch.manual_seed(0)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    loop = loop_with_repeats(cfg.loop, cfg.model.num_layers, repeats=repeats)
    built = SmeltLM(cfg.model, cfg.moe, loop).eval()
    built.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    trained_logits = model(ids).logits
    old = model.set_loop(loop)
    assert torch.equal(model(ids).logits, built(ids).logits)
    assert not torch.equal(model(ids).logits, trained_logits)  # the plan really changed
    cache = KVCache()
    model(ids, kv_cache=cache)
    assert sorted(cache.slots) == sorted(built.schedule.plan) and len(cache.slots) == 4 + 2 * (repeats - 1)
    model.set_loop(old)
    assert torch.equal(model(ids).logits, trained_logits)


def test_loss_by_repeats(random_exports, eval_data):
    base, smelt = load_run(random_exports["baseline"]), load_run(random_exports["smelt"])
    smelt.name, base.name = "smelt", "baseline"
    out = loss_by_repeats([base, smelt], [1, 2, 3], batches=2, micro_batch_size=2, log=lambda *_: None)
    rows = {(r["run"], r["repeats"]): r for r in out["rows"]}
    assert set(rows) == {("baseline", None), ("smelt", 1), ("smelt", 2), ("smelt", 3)}
    assert rows[("baseline", None)]["label"] == "no loop"
    # the trained repeat count equals the normal evaluation path exactly
    d = open_eval_data(smelt.cfg)
    per = {dom: evaluate_domain(smelt.model, d.batches(dom, out["seq_len"], 2, 2), d.byte_lengths) for dom in d.domains}
    per["all"] = combine_domains(list(per.values()))
    assert rows[("smelt", 2)]["loss"] == {k: v.loss for k, v in per.items()}
    for R, visits in ((1, 4), (2, 6), (3, 8)):
        row = rows[("smelt", R)]
        assert row["visits"] == visits and row["kv_cache_slots"] == visits
        custom = smelt.cfg.model_copy(update={"loop": smelt.cfg.loop.model_copy(update={
            "position": "custom", "ranges": [LoopRange(start=1, end=3, repeats=R)]})})
        assert row["flops_per_token"] == compute_budget(custom, seq_len=out["seq_len"]).forward_flops_per_token
    assert rows[("smelt", 1)]["loss"]["all"] != rows[("smelt", 2)]["loss"]["all"]
    assert smelt.model.schedule.layers() == [0, 1, 2, 1, 2, 3]  # trained plan restored
    md = loop_repeats_markdown(out)
    assert "| smelt | R=3 | 8 | 8 |" in md and "| baseline | no loop | 6 | 6 |" in md


def test_loop_plan_restores_on_error(random_exports):
    run = load_run(random_exports["smelt"])
    with pytest.raises(RuntimeError):
        with loop_plan(run, repeats=3):
            assert run.model.schedule.effective_depth == 8
            raise RuntimeError("boom")
    assert run.model.schedule.effective_depth == 6


def test_parse_repeats_and_refusals(random_exports):
    assert parse_repeats("1,2,3") == [1, 2, 3] and parse_repeats(None) is None
    for bad in ("0,1", "a", "2,2", ""):
        with pytest.raises(ConfigError, match="--loop-repeats"):
            parse_repeats(bad)
    base = load_run(random_exports["baseline"])
    with pytest.raises(ConfigError, match="no run has a loop range"):
        loss_by_repeats([base], [1, 2])
