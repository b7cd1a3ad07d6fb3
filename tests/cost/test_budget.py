"""Budgets against the built module and torch's FLOP counter; the matcher on many shapes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from smelt_ds.config.loading import config_from_dict
from smelt_ds.cost.budget import compute_budget, kv_cache_bytes_per_token, match_baseline
from smelt_ds.errors import ConfigError
from smelt_ds.model import KVCache, SmeltLM

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {
    "baseline": {"model": {"num_layers": 6}, "loop": {"position": "none"}},
    "middle_gqa_qknorm": {"model": {"num_layers": 8, "num_kv_heads": 2, "qk_norm": True},
                          "loop": {"position": "middle"}},
    "dense_shared_tied": {"model": {"num_layers": 6, "first_k_dense": 2, "tie_embeddings": True},
                          "moe": {"shared_expert_ffn_size": 48}, "loop": {"position": "top"}},
    "layer_order_asym": {"model": {"num_layers": 8, "head_dim": 8},
                         "loop": {"position": "asymmetric", "order": "layer"}},
}


def _cfg(raw):
    base = {"model": {"vocab_size": 97, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 4,
                      "dense_ffn_size": 40, "max_seq_len": 64},
            "moe": {"num_experts": 6, "top_k": 2, "expert_ffn_size": 24, "expert_impl": "loop"},
            "train": {"seq_len": 32}}
    for k, v in raw.items():
        base[k] = {**base.get(k, {}), **v}
    return config_from_dict(base)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_param_counts_equal_module(name):
    cfg = _cfg(SHAPES[name])
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    b = compute_budget(cfg)
    emb = {id(p) for n, p in model.named_parameters() if n in ("embed_tokens.weight", "lm_head.weight")}
    non_emb = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    assert b.non_embedding_params == non_emb
    assert b.embedding_params == sum(p.numel() for p in model.parameters() if id(p) in emb)
    # active: remove the unused experts of every MoE layer from the module's count
    unused = sum((cfg.moe.num_experts - cfg.moe.top_k) * (layer.mlp.experts.gate_up_proj[0].numel()
                                                          + layer.mlp.experts.down_proj[0].numel())
                 for layer in model.layers if layer.is_moe)
    assert b.active_non_embedding_params == non_emb - unused


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forward_flops_equal_flop_counter(name):
    """With the explicit attention path (q @ k^T and p @ v as batched matmuls) and the per-expert
    loop, torch's FlopCounterMode counts exactly the matmuls of the 'full' convention, so the
    analytic count must agree to the FLOP."""
    cfg = _cfg(SHAPES[name])
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    B, S = 2, 16
    ids = torch.randint(0, cfg.model.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(ids, probs_hook=lambda visit, probs: None)
    analytic = compute_budget(cfg, seq_len=S).forward_flops_per_token * B * S
    assert fc.get_total_flops() == analytic


def test_causal_convention_counts_half_the_keys():
    cfg = _cfg(SHAPES["middle_gqa_qknorm"])
    S = 100
    full = compute_budget(cfg, seq_len=S, attention_convention="full")
    causal = compute_budget(cfg, seq_len=S, attention_convention="causal")
    m = cfg.model
    per_visit_core_diff = 2 * 2 * (S - (S + 1) / 2) * m.num_heads * m.resolved_head_dim
    assert full.forward_flops_per_token - causal.forward_flops_per_token == pytest.approx(
        per_visit_core_diff * full.visits)
    assert full.train_flops_per_token == 3 * full.forward_flops_per_token


def test_kv_cache_bytes_equal_measured_cache():
    cfg = _cfg(SHAPES["middle_gqa_qknorm"])
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.zeros(1, 10, dtype=torch.long), kv_cache=cache)
    assert len(cache.slots) == compute_budget(cfg).visits == 12
    assert cache.num_bytes() == kv_cache_bytes_per_token(cfg, "fp32") * 10
    assert kv_cache_bytes_per_token(cfg, "bf16") * 2 == kv_cache_bytes_per_token(cfg, "fp32")
    with pytest.raises(ConfigError, match="int3"):
        kv_cache_bytes_per_token(cfg, "int3")


def _baseline_raw(depth, hidden):
    heads = hidden // 64
    return {"name": f"b{depth}x{hidden}",
            "model": {"vocab_size": 32000, "hidden_size": hidden, "num_layers": depth, "num_heads": heads,
                      "num_kv_heads": max(1, heads // 4), "max_seq_len": 4096},
            "moe": {"num_experts": 64, "top_k": 8, "expert_ffn_size": hidden},
            "loop": {"position": "none"}, "train": {"seq_len": 2048}}


@pytest.mark.parametrize("depth", [12, 24, 48])
@pytest.mark.parametrize("hidden", [512, 1024, 2048])
@pytest.mark.parametrize("position", ["middle", "uniform", "bottom", "top", "asymmetric"])
@pytest.mark.parametrize("ep", [2, 8])
def test_matcher_within_one_percent(depth, hidden, position, ep):
    """Within 1% on all three budgets, except asymmetric at depth 12 with 8-expert steps: its one
    exact depth leaves the parameters 1-2% off, and the matcher reports that deviation (checked
    against an independent budget computation) instead of hiding it."""
    raw = _baseline_raw(depth, hidden)
    res = match_baseline(raw, position, repeats=2, ep_size=ep)
    assert res.depth_exact, res.notes
    assert res.matched.visits == depth
    if ep == 8 and position == "asymmetric" and depth == 12:
        b, base = compute_budget(config_from_dict(res.raw)), compute_budget(config_from_dict(raw))
        assert 0.01 < abs(res.deviations["params"]) < 0.02
        assert res.deviations["params"] == pytest.approx(b.non_embedding_params / base.non_embedding_params - 1,
                                                         abs=1e-12)
        return
    assert all(abs(v) <= 0.01 for v in res.deviations.values()), res.deviations
    assert res.config.moe.num_experts % ep == 0
    # only the loop, the depth and the expert count change
    assert res.raw["model"] == {**raw["model"], "num_layers": res.config.model.num_layers}
    assert {k: v for k, v in res.raw["moe"].items() if k != "num_experts"} == {
        k: v for k, v in raw["moe"].items() if k != "num_experts"}
    # independent check of the budgets on the written recipe
    b = compute_budget(config_from_dict(res.raw))
    base = compute_budget(config_from_dict(raw))
    assert abs(b.non_embedding_params / base.non_embedding_params - 1) <= 0.01


def test_middle_twice_follows_the_matching_formula():
    """Matching (docs/budgets.md), middle x2: L_S = 2 L_B / 3 and E_S ~= 1.5 E_B + 0.5 attn_params / expert_params."""
    raw = _baseline_raw(24, 1024)
    res = match_baseline(raw, "middle", ep_size=1)
    assert res.config.model.num_layers == 16
    H, heads, kv = 1024, 16, 4
    attn = 2 * H * heads * 64 + 2 * H * kv * 64 + 2 * H  # + the layer's two norms
    expert = 3 * H * 1024 + H  # + its router row
    assert abs(res.config.moe.num_experts - (1.5 * 64 + 0.5 * attn / expert)) <= 0.5


def test_matcher_reports_inexact_depth_and_tolerance_error():
    raw = _baseline_raw(11, 512)  # middle x2 visits L + floor(L/2): 10 (L=7) or 12 (L=8), never 11
    res = match_baseline(raw, "middle")
    assert not res.depth_exact and "11 visits" in res.notes[0]
    assert res.matched.visits in (10, 12)
    with pytest.raises(ConfigError, match="tolerance"):
        match_baseline(raw, "middle", tolerance=0.01)


def test_matcher_explains_bad_ranges():
    raw = _baseline_raw(6, 128)
    with pytest.raises(ConfigError, match=r"--ranges end at layer 9, beyond the Baseline's 6 layers"):
        match_baseline(raw, "asymmetric", ranges=[{"start": 0, "end": 9, "repeats": 2}])
    with pytest.raises(ConfigError, match=r"--ranges 2:1:2 give no valid loop at any depth <= 6"):
        match_baseline(raw, "asymmetric", ranges=[{"start": 2, "end": 1, "repeats": 2}])


def test_matcher_rejects_looped_baseline():
    raw = _baseline_raw(12, 512)
    raw["loop"] = {"position": "middle"}
    with pytest.raises(ConfigError, match="loop.position"):
        match_baseline(raw, "middle")


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "smelt_ds.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_shipped_tiny_recipes_match_and_cli(tmp_path):
    out = tmp_path / "smelt.yaml"
    r = _cli("match", "recipes/tiny/baseline.yaml", "--position", "middle", "--ep-size", "2",
             "--name", "tiny-smelt", "--tolerance", "0.01", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    shipped = yaml.safe_load((ROOT / "recipes/tiny/smelt.yaml").read_text())
    assert yaml.safe_load(out.read_text()) == shipped  # the shipped recipe is what the tool writes
    r = _cli("budget", "recipes/tiny/baseline.yaml", "recipes/tiny/smelt.yaml", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[1]["visits"] == rows[0]["unique_layers"] == 6
    assert all(abs(v) <= 0.01 for v in rows[1]["deviation"].values())
    r = _cli("budget", "recipes/tiny/baseline.yaml", "recipes/tiny/smelt.yaml")
    assert "non-embedding" in r.stdout and "tiny-smelt" in r.stdout


def test_match_warns_beyond_one_percent_without_tolerance(tmp_path):
    """ep_size 5 forces 20 experts (params -8%): without --tolerance a warning, with it an error."""
    r = _cli("match", "recipes/tiny/baseline.yaml", "--position", "middle", "--ep-size", "5",
             "-o", str(tmp_path / "m.yaml"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"warning: the match misses the paper's 1% on params \(-\d+\.\d+%\)", r.stderr), r.stderr
    # the header names the full command, so rerunning it gives the same recipe
    assert ("# Matched to recipes/tiny/baseline.yaml by `smelt-ds match recipes/tiny/baseline.yaml --position "
            "middle --repeats 2 --fraction 0.5 --ep-size 5`") in (tmp_path / "m.yaml").read_text()
    r = _cli("match", "recipes/tiny/baseline.yaml", "--position", "middle", "--ep-size", "5", "--tolerance", "0.01")
    assert r.returncode == 2 and "deviates beyond --tolerance 1.00%" in r.stderr


def test_cli_errors_are_one_clear_line(tmp_path):
    r = _cli("budget", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr
    r = _cli("match", "recipes/tiny/baseline.yaml", "--position", "custom", "--ranges", "1:x:2")
    assert r.returncode == 2 and "1:x:2" in r.stderr
