"""Shipped recipes: every one validates, every looped one is `smelt-ds match` of its Baseline,
layouts fit in memory, docs/recipes.md is current, and every DeepSpeed template as filled for
every recipe passes DeepSpeed's own config parser."""

from __future__ import annotations

import copy
import re

import deepspeed.runtime.config as ds_runtime_config
import pytest
import yaml
from deepspeed.runtime.config import DeepSpeedConfig

from smelt_ds.config.loading import load_config
from smelt_ds.cost.budget import compute_budget, match_baseline
from smelt_ds.cost.cli import parse_ranges
from smelt_ds.errors import ConfigError
from smelt_ds.launch.placement import MIN_HEADROOM, load_raw, resolve
from smelt_ds.parallel.ds_config import build_ds_config
from smelt_ds.parallel.memory import GiB, estimate
from smelt_ds.parallel.zero_section import template_name
from smelt_ds.study.recipes import (
    DOCS_TABLE,
    SIZES,
    VARIANTS,
    derive_variants,
    recipe_rows,
    recipes_table,
    shipped_recipes,
    write_variants,
)

ENTRIES = shipped_recipes()
CLUSTER_SIZES = ("s", "m", "l", "xl")
#: Baseline non-embedding parameters asked for (paper's largest model: 54B)
TARGET_PARAMS = {"s": 1.5e9, "m": 5e9, "l": 16e9, "xl": 54e9}
#: the `smelt-ds match` arguments the tiny ablations were written with
TINY_RANGES = {"asymmetric": "0:1:2,1:2:3"}


def _id(e):
    return f"{e.size}/{e.variant}"


@pytest.fixture(scope="module")
def rows():
    return recipe_rows()


def test_all_thirty_recipes_are_shipped():
    assert [(e.size, e.variant) for e in ENTRIES] == [(s, v) for s in SIZES for v in VARIANTS]


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_recipe_loads_and_validates_on_every_layout(entry):
    cfg = load_config(entry.path)
    assert cfg.name == f"{entry.size}-{entry.variant}"
    assert (cfg.loop.position == "none") == (entry.variant == "baseline")
    if entry.size == "tiny":
        assert not cfg.cluster.layouts
        return
    assert set(cfg.cluster.layouts) == {"h100", "h200"} and cfg.cluster.default == "h100"
    assert cfg.train.precision == "bf16" and cfg.train.seq_len == cfg.model.max_seq_len == 4096
    assert cfg.model.vocab_size == cfg.data.tokenizer.vocab_size
    assert all(s.path for s in cfg.data.sources)  # user corpora, documented in the file
    for name, lay in cfg.cluster.layouts.items():
        r = resolve(entry.path, name)
        assert r.layout.device_memory_gib == {"h100": 79.1, "h200": 139.7}[name]
        world = lay.nodes * lay.gpus_per_node
        assert world % r.config.moe_runtime.ep_size == 0
        assert r.config.train.global_batch_tokens % (r.config.train.micro_batch_size * 4096 * world) == 0


@pytest.mark.parametrize("size", CLUSTER_SIZES)
def test_baseline_parameter_budget(size):
    b = compute_budget(load_config(f"recipes/{size}/baseline.yaml"))
    assert abs(b.non_embedding_params / TARGET_PARAMS[size] - 1) < 0.10, b.non_embedding_params


LOOPED = [e for e in ENTRIES if e.variant != "baseline"]


@pytest.mark.parametrize("entry", LOOPED, ids=_id)
def test_looped_recipe_is_smelt_ds_match_of_its_baseline(entry):
    """The file equals what `smelt-ds match BASELINE --position P --ep-size EP --tolerance 0.01`
    writes, and all three budgets are within 1% of the Baseline's."""
    base_raw = load_raw(entry.baseline_path)
    position = {"smelt": "middle"}.get(entry.variant, entry.variant)
    ep = 2 if entry.size == "tiny" else base_raw["moe_runtime"]["ep_size"]
    ranges = parse_ranges(TINY_RANGES[entry.variant]) if entry.size == "tiny" and entry.variant in TINY_RANGES \
        else None
    res = match_baseline(base_raw, position, ep_size=ep, ranges=ranges, tolerance=0.01,
                         name=f"{entry.size}-{entry.variant}")
    assert load_raw(entry.path) == yaml.safe_load(yaml.safe_dump(res.raw))
    assert max(abs(v) for v in res.deviations.values()) <= 0.01
    assert res.matched.visits == res.baseline.visits  # exact depth: KV cache identical
    assert res.config.moe.num_experts % ep == 0


@pytest.mark.parametrize("size", CLUSTER_SIZES)
def test_size_variants_are_their_derivation_and_differ_only_in_loop_and_experts(size):
    assert write_variants(f"recipes/{size}/baseline.yaml", check=True) == []
    base = load_raw(f"recipes/{size}/baseline.yaml")

    def strip(raw):
        raw = copy.deepcopy(raw)
        for k in ("name", "loop"):
            raw.pop(k)
        raw["model"].pop("num_layers")
        raw["moe"].pop("num_experts")
        return raw

    for variant in VARIANTS[1:]:
        assert strip(load_raw(f"recipes/{size}/{variant}.yaml")) == strip(base), variant
        text = open(f"recipes/{size}/{variant}.yaml").read()
        assert "# Sources:" in text and f"--position {'middle' if variant == 'smelt' else variant}" in text


def test_derive_refuses_a_baseline_whose_loop_section_would_reach_the_variants(tmp_path):
    text = open("recipes/s/baseline.yaml").read().replace("loop:\n  position: none\n",
                                                          "loop: {position: none, order: layer}\n")
    p = tmp_path / "s" / "baseline.yaml"
    p.parent.mkdir()
    p.write_text(text)
    with pytest.raises(ConfigError, match="loop section"):
        derive_variants(p)


def test_every_layout_fits_with_ten_percent_headroom(rows):
    budget_rows, layout_rows = rows
    assert len(budget_rows) == 30 and len(layout_rows) == 6 + 24 * 2
    bad = [(r["size"], r["variant"], r["layout"], r["headroom"]) for r in layout_rows if not r["fits"]]
    assert not bad
    assert all(r["headroom"] >= MIN_HEADROOM for r in layout_rows)
    # `smelt-ds memory` (plain estimate, template ZeRO-3 values) agrees on every cluster layout
    for e in ENTRIES:
        if e.size == "tiny":
            continue
        for name in ("h100", "h200"):
            r = resolve(e.path, name)
            c, lay = r.config, r.layout
            rep = estimate(c, lay.nodes, lay.gpus_per_node, int(lay.device_memory_gib * GiB))
            row = rep.row(f"zero{c.deepspeed.zero_stage}", c.train.activation_checkpointing.policy)
            assert row.headroom >= MIN_HEADROOM, (e.path, name, row.headroom)


def test_table_rows_match_the_recipes(rows):
    budget_rows, layout_rows = rows
    xl = {r["variant"]: r for r in budget_rows if r["size"] == "xl"}
    assert xl["baseline"]["visits"] == xl["smelt"]["visits"] == 24
    assert xl["smelt"]["unique_layers"] == 16 and xl["smelt"]["loop"] == "middle: layers [4,12) x2"
    for r in budget_rows:
        assert all(abs(v) <= 0.01 for v in r["deviation"].values()), r["path"]
    h200 = next(r for r in layout_rows if (r["size"], r["variant"], r["layout"]) == ("xl", "smelt", "h200"))
    assert (h200["nodes"], h200["gpus_per_node"], h200["micro_batch"], h200["accumulation"]) == (32, 8, 2, 4)
    assert h200["zero"] == "zero3" and h200["ep_size"] == 8 and h200["precision"] == "bf16"


def test_docs_table_is_up_to_date():
    assert DOCS_TABLE.is_file(), "run `smelt-ds recipes table`"
    assert DOCS_TABLE.read_text() == recipes_table(), "docs/recipes.md is out of date: run `smelt-ds recipes table`"


TEMPLATE_SETTINGS = {
    "zero0": ["deepspeed.zero_stage=0"], "zero1": ["deepspeed.zero_stage=1"], "zero2": ["deepspeed.zero_stage=2"],
    "zero3": ["deepspeed.zero_stage=3"],
    "zero3_offload_optimizer": ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu"],
    "zero3_offload_param": ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"],
}



class _DataParallel:
    """DeepSpeed reads the data-parallel size from an mpu object."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_every_template_as_filled_for_the_recipe_parses_in_deepspeed(entry, monkeypatch):
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda: 0)
    layouts = list(load_config(entry.path).cluster.layouts) or ["cpu"]
    for layout in layouts:
        for template, sets in TEMPLATE_SETTINGS.items():
            r = resolve(entry.path, layout, sets)
            cfg, world = r.config, r.layout.nodes * r.layout.gpus_per_node
            assert template_name(cfg) == template
            d = build_ds_config(cfg, world)
            parsed = DeepSpeedConfig(d, mpu=_DataParallel(world))
            t = cfg.train
            accum = (t.global_batch_tokens or t.micro_batch_size * t.seq_len * world) // (
                t.micro_batch_size * t.seq_len * world)
            assert parsed.zero_optimization_stage == cfg.deepspeed.zero_stage
            assert parsed.train_micro_batch_size_per_gpu == t.micro_batch_size
            assert parsed.gradient_accumulation_steps == accum
            assert parsed.train_batch_size == t.micro_batch_size * accum * world
            assert parsed.bfloat16_config.enabled == (entry.size != "tiny")
            if "offload" in template:
                assert parsed.zero_config.offload_optimizer.device == "cpu"
            if template == "zero3_offload_param":
                assert parsed.zero_config.offload_param.device == "cpu"
            if cfg.moe_runtime.backend == "autoep":
                assert d["expert_parallel"]["autoep_size"] == cfg.moe_runtime.ep_size


def test_tiny_ablation_headers_name_their_match_command():
    for variant in ("uniform", "bottom", "top", "asymmetric"):
        first = open(f"recipes/tiny/{variant}.yaml").readline()
        assert re.match(rf"# Written by: smelt-ds match recipes/tiny/baseline.yaml --position {variant}"
                        rf"( --ranges {TINY_RANGES.get(variant, '')})? --ep-size 2 --name tiny-{variant} "
                        rf"--tolerance 0.01 -o recipes/tiny/{variant}.yaml", first), first
