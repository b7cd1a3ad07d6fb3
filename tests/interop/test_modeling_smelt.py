"""Parity of the standalone transformers SmeltForCausalLM (``model_type: smelt``) with SmeltLM.

Every case writes a directory with :func:`write_hf_dir`, loads it with
``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` and compares with the source
SmeltLM on the same batch (fp32). Tolerances (``tests/numerics.py``): logits within ``2 n u`` of
the largest logit, n the forward's reduction lengths (the two implementations mean to run the same
kernels in the same order, but nothing forces another machine to dispatch them alike; left-padded
rows use a boolean-mask SDPA instead of the causal one); the loss within Higham & Mary's
probabilistic bound over that chain; greedy generation token for token up to a tie within the
logits' bound; state dicts exactly (copies). Prompts avoid the pad id, which ``generate`` would
read as padding when no attention mask is given.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.schedule import build_schedule
from smelt_ds.errors import ConfigError
from smelt_ds.interop.configuration_smelt import SmeltConfig, derive_visit_plan
from smelt_ds.interop.modeling_smelt import SmeltForCausalLM
from smelt_ds.interop.smelt_format import (
    MODELING_FILES,
    from_hf_state_dict,
    load_modeling_module,
    modeling_files,
    smelt_hf_config,
    to_hf_state_dict,
    write_hf_dir,
)
from smelt_ds.mappings import deep_merge
from smelt_ds.model import SmeltLM
from tests.numerics import assert_close_chain, greedy_tie_point, lm_chain_length, prob_tol
from tests.threads import one_thread

V, PROMPT, NEW = 96, 8, 32
SEQ = PROMPT + NEW  # the longest sequence attended over
EOT, PAD = 0, 1
BASE = {
    "model": {"vocab_size": V, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
              "max_seq_len": 64, "dense_ffn_size": 48, "init_std": 0.2},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 24},
    "loop": {"position": "none"},
    "train": {"seq_len": 16},
}

# name -> overrides of BASE (loop position, order, injection, router, heads, tying, shared expert, dense layers)
CASES = {
    "none-untied-gqa": {},
    "uniform-tied-qknorm": {"loop": {"position": "uniform"}, "model": {"tie_embeddings": True, "qk_norm": True}},
    "bottom-layer-order-loop-experts": {"loop": {"position": "bottom", "order": "layer"},
                                        "moe": {"norm_topk_prob": False, "expert_ffn_size": 18}},
    "middle-inject-tied-shared": {"loop": {"position": "middle", "input_injection": "add"},
                                  "model": {"tie_embeddings": True}, "moe": {"shared_expert_ffn_size": 16}},
    "top-sigmoid-bias-dense1": {"loop": {"position": "top"}, "model": {"first_k_dense": 1},
                                "moe": {"score_func": "sigmoid", "aux_loss_free_bias": True}},
    "asymmetric-shared-dense1-mha": {"loop": {"position": "asymmetric"},
                                     "model": {"num_layers": 6, "num_kv_heads": 4, "first_k_dense": 1,
                                               "qk_norm": True},
                                     "moe": {"shared_expert_ffn_size": 16}},
    "custom-layer-sigmoid": {"loop": {"position": "custom", "order": "layer",
                                      "ranges": [{"start": 0, "end": 2, "repeats": 2},
                                                 {"start": 3, "end": 5, "repeats": 3}]},
                             "model": {"num_layers": 6},
                             "moe": {"score_func": "sigmoid", "norm_topk_prob": False, "aux_loss_free_bias": True}},
    "custom-block-inject-softmax-bias": {"loop": {"position": "custom", "input_injection": "add",
                                                  "ranges": [{"start": 1, "end": 4, "repeats": 3}]},
                                         "model": {"num_layers": 5}, "moe": {"aux_loss_free_bias": True}},
}


def make_cfg(overrides: dict):
    return config_from_dict(deep_merge(BASE, overrides))


@torch.no_grad()
def random_smelt(cfg, seed: int) -> SmeltLM:
    """SmeltLM with random weights, norms away from 1 and a nonzero aux-loss-free expert bias, so that a
    swapped norm or an ignored bias changes the logits."""
    torch.manual_seed(seed)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
    for layer in model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and gate.use_bias:
            gate.expert_bias.copy_(0.3 * torch.randn_like(gate.expert_bias))
    return model


def prompts(n: int, length: int, seed: int) -> torch.Tensor:
    """Token ids in [2, V): no end-of-text or pad id."""
    return torch.randint(2, V, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kw):
    return hf.generate(ids, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False, **kw)


def n_fwd(case) -> int:
    """Reduction lengths of one forward pass of ``case``'s model (tests/numerics.py)."""
    return lm_chain_length(case.cfg, 0, backward=False, seq=SEQ)


def assert_greedy_rows(ours: torch.Tensor, theirs: torch.Tensor, smelt: SmeltLM, n: int) -> None:
    """Rows (prompt + continuation) equal token for token, up to a tie within the logits' bound."""
    assert ours.shape == theirs.shape
    for a, b in zip(ours, theirs, strict=True):
        with torch.no_grad():
            greedy_tie_point(a, b, lambda prefix: smelt(prefix[None]).logits[0, -1], n)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(name)`` -> ``(smelt, hf, cfg, out, plan)`` of case ``name``: the source SmeltLM and its
    exported, reloaded model; built once per module."""
    built: dict[str, SimpleNamespace] = {}

    def get(name: str) -> SimpleNamespace:
        if name not in built:
            cfg = make_cfg(CASES[name])
            smelt = random_smelt(cfg, seed=list(CASES).index(name))
            out = write_hf_dir(smelt, cfg, tmp_path_factory.mktemp("hf") / name, eot_id=EOT, pad_id=PAD)
            hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
            hf.generation_config.eos_token_id = None  # SmeltLM.generate below runs all NEW tokens
            built[name] = SimpleNamespace(name=name, smelt=smelt, hf=hf, cfg=cfg, out=out, plan=smelt.schedule.plan)
        return built[name]

    return get


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request, exported):
    return exported(request.param)


# ---------------------------------------------------------------------------------------------
# parity with SmeltLM
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_equal_smeltlm(case):
    ids = prompts(3, 12, seed=1)
    ref = case.smelt(ids).logits
    out = case.hf(ids)
    assert_close_chain(out.logits, ref, n_fwd(case))
    last = case.hf(ids, logits_to_keep=1).logits
    assert_close_chain(last, ref[:, -1:], n_fwd(case))
    as_tuple = case.hf(ids, return_dict=False, use_cache=False)
    assert_close_chain(as_tuple[0], ref, n_fwd(case))


@torch.no_grad()
def test_greedy_generate_equals_smeltlm_generate(case):
    ids = prompts(2, PROMPT, seed=2)
    ref = case.smelt.generate(ids, max_new_tokens=NEW)
    out = hf_greedy(case.hf, ids, return_dict_in_generate=True)
    assert_greedy_rows(ref, out.sequences, case.smelt, n_fwd(case))
    assert len(out.cache) == len(case.plan)  # one KV-cache slot per visit, not per unique layer
    assert all(layer.keys.shape[-2] == PROMPT + NEW - 1 for layer in out.cache.layers)


@torch.no_grad()
def test_left_padded_batch_gives_the_unpadded_rows(case):
    long_row, short_row = prompts(1, PROMPT, seed=3), prompts(1, 5, seed=4)
    pad = PROMPT - short_row.shape[1]
    ids = torch.cat([long_row, torch.cat([torch.full((1, pad), PAD), short_row], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # what generate passes
    logits = case.hf(ids, attention_mask=mask, position_ids=position_ids).logits
    assert_close_chain(logits[0], case.smelt(long_row).logits[0], n_fwd(case))
    assert_close_chain(logits[1, pad:], case.smelt(short_row).logits[0], n_fwd(case))
    generated = hf_greedy(case.hf, ids, attention_mask=mask)[:, PROMPT:]
    for row, new in ((long_row, generated[0]), (short_row, generated[1])):
        assert_greedy_rows(case.smelt.generate(row, NEW), torch.cat([row[0], new])[None], case.smelt, n_fwd(case))


@torch.no_grad()
def test_cache_after_forward_has_one_slot_per_visit_holding_the_prompt(case):
    ids = prompts(2, PROMPT, seed=5)
    cache = case.hf(ids, use_cache=True).cache
    assert len(cache) == len(case.plan) == case.hf.config.num_visits
    assert [layer.keys.shape[-2] for layer in cache.layers] == [PROMPT] * len(case.plan)
    assert [layer.values.shape[-2] for layer in cache.layers] == [PROMPT] * len(case.plan)


@torch.no_grad()
def test_labels_loss_equals_smeltlm_lm_loss(case):
    ids = prompts(2, 12, seed=6)
    labels = ids.clone()
    labels[0, 3] = -100
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)  # SmeltLM takes the next tokens
    ref = case.smelt(ids, labels=shifted).lm_loss
    torch.testing.assert_close(case.hf(ids, labels=labels).loss, ref, rtol=prob_tol(n_fwd(case) + 24), atol=0.0)


def test_loaded_state_dict_equals_the_source(case):
    ref = case.smelt.state_dict()
    got = from_hf_state_dict(case.hf.state_dict(), case.cfg.model.tie_embeddings)
    assert list(got) == list(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    if case.cfg.model.tie_embeddings:
        assert case.hf.lm_head.weight is case.hf.model.embed_tokens.weight
    else:
        assert case.hf.lm_head.weight.data_ptr() != case.hf.model.embed_tokens.weight.data_ptr()


def test_state_dict_round_trip_is_the_identity(case):
    state = case.smelt.state_dict()
    tie = case.cfg.model.tie_embeddings
    hf_state = to_hf_state_dict(state, tie)
    assert all(k == "lm_head.weight" or k.startswith("model.") for k in hf_state)
    assert ("lm_head.weight" in hf_state) == (not tie)
    back = from_hf_state_dict(hf_state, tie)
    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert all(back[k] is state[k] for k in state if k != "lm_head.weight" or not tie)  # no copies


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.get("moe", {}).get("aux_loss_free_bias")])
@torch.no_grad()
def test_aux_loss_free_bias_changes_the_selection(exported, name):
    """The parity above could not see an ignored expert bias if the bias chose the same experts: it does not."""
    case = exported(name)
    routers = [layer.mlp.gate for layer in case.hf.model.layers if hasattr(layer.mlp, "gate")]
    assert routers and all(r.use_bias for r in routers)
    ids = prompts(2, 12, seed=7)
    before = case.hf(ids).logits
    saved = [r.expert_bias.clone() for r in routers]
    for r in routers:
        r.expert_bias.zero_()
    try:
        assert not torch.allclose(case.hf(ids).logits, before, atol=1e-3)
    finally:
        for r, b in zip(routers, saved, strict=True):
            r.expert_bias.copy_(b)


def test_state_dict_adapter_refuses_bad_input(exported, tmp_path):
    case = exported("uniform-tied-qknorm")  # tied embeddings
    state = case.smelt.state_dict()
    with pytest.raises(ConfigError, match="blocks.layers.0.self_attn.q_proj.weight"):
        to_hf_state_dict({**state, "blocks.layers.0.self_attn.q_proj.weight": state["norm.weight"]}, True)
    with pytest.raises(ConfigError, match="lm_head.weight"):
        to_hf_state_dict({**state, "lm_head.weight": state["embed_tokens.weight"] + 1}, True)
    with pytest.raises(ConfigError, match="lm_head.weight"):
        to_hf_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, False)
    with pytest.raises(ConfigError, match="decoder.norm.weight"):
        from_hf_state_dict({"decoder.norm.weight": state["norm.weight"]}, True)
    other = make_cfg({"loop": {"position": "middle"}, "model": {"tie_embeddings": True}})
    with pytest.raises(ConfigError, match="visit plan"):
        write_hf_dir(case.smelt, other, tmp_path / "x")


# ---------------------------------------------------------------------------------------------
# the KV cache transformers creates
# ---------------------------------------------------------------------------------------------


def test_generation_cache_has_one_slot_per_visit_before_any_forward(tmp_path):
    cfg = make_cfg({"loop": {"position": "middle"}})  # 4 unique layers, 6 visits
    out = write_hf_dir(random_smelt(cfg, 0), cfg, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    kwargs: dict = {}
    hf._prepare_cache_for_generation(transformers.GenerationConfig(), kwargs, None, 2, 40)
    assert len(kwargs["cache"]) == 6 != hf.config.num_hidden_layers
    # a cache built the documented transformers way (DynamicCache(config=...)) gets one slot per visit
    user_cache = transformers.DynamicCache(config=hf.config)
    assert len(user_cache) == 4
    with torch.no_grad():
        hf(prompts(1, 5, 0), cache=user_cache, use_cache=True)
    assert len(user_cache) == 6 and user_cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="cache_implementation"):
        hf.generate(prompts(1, 5, 0), max_new_tokens=2, cache_implementation="static")


# ---------------------------------------------------------------------------------------------
# config validation and the visit plan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", [
    {"position": "none"}, {"position": "uniform"}, {"position": "bottom", "order": "layer"},
    {"position": "middle"}, {"position": "top", "repeats": 3}, {"position": "asymmetric"},
    {"position": "custom", "order": "layer", "ranges": [{"start": 4, "end": 6, "repeats": 2},
                                                        {"start": 0, "end": 1, "repeats": 4}]},
])
def test_derived_visit_plan_equals_smelt_schedule(loop):
    cfg = make_cfg({"loop": loop, "model": {"num_layers": 8}})
    d = smelt_hf_config(cfg, EOT, PAD)
    d.pop("visit_plan")
    config = SmeltConfig(**{k: v for k, v in d.items() if k != "model_type"})
    expected = [list(v) for v in build_schedule(cfg.loop, 8).plan]
    assert config.visit_plan == expected
    assert derive_visit_plan(8, d["loop_ranges"], d["loop_order"]) == expected


@pytest.mark.parametrize("bad, key", [
    ({"loop_ranges": [[2, 9, 2]]}, "loop_ranges[0]"),
    ({"loop_ranges": [[-1, 2, 2]]}, "loop_ranges[0]"),
    ({"loop_ranges": [[0, 3, 2], [2, 4, 2]]}, "loop_ranges"),
    ({"loop_ranges": [[1, 3, 0]]}, "loop_ranges[0]"),
    ({"loop_ranges": [[1, 3]]}, "loop_ranges[0]"),
    ({"loop_ranges": [[1, 3, 2]], "visit_plan": [[0, 0], [1, 0], [2, 0], [3, 0]]}, "visit_plan"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"loop_order": "zigzag"}, "loop_order"),
    ({"loop_ranges": [[1, 3, 2]], "loop_order": "layer", "input_injection": "add"}, "input_injection"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"first_k_dense_replace": 5}, "first_k_dense_replace"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
])
def test_bad_config_raises_naming_the_key(bad, key):
    with pytest.raises(ValueError, match=re.escape(f"`{key}` (")):
        SmeltConfig(num_hidden_layers=4, num_attention_heads=4, hidden_size=32, **bad)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 5), ("num_experts", 6), ("aux_loss_free_bias", True)])
def test_config_json_that_does_not_fit_the_weights_raises(exported, tmp_path, key, value):
    """transformers itself only warns about missing weights and initialises them at random."""
    case = exported("middle-inject-tied-shared")
    bad = tmp_path / "bad"
    shutil.copytree(case.out, bad)
    config = json.loads((bad / "config.json").read_text())
    config.pop("visit_plan")
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    # a shape mismatch is transformers' own RuntimeError (its report above the error names the tensors)
    with pytest.raises((ValueError, RuntimeError), match="do not fit config.json|ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(bad, trust_remote_code=True)


def test_config_json_whose_visit_plan_does_not_match_loop_ranges_raises(exported, tmp_path):
    case = exported("middle-inject-tied-shared")
    bad = tmp_path / "bad"
    shutil.copytree(case.out, bad)
    config = json.loads((bad / "config.json").read_text())
    config["visit_plan"] = [[v.layer, 0] for v in case.plan]  # the Ouro pitfall: one visit per slot
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="visit_plan"):
        transformers.AutoModelForCausalLM.from_pretrained(bad, trust_remote_code=True)


# ---------------------------------------------------------------------------------------------
# the standalone files and transformers' own Qwen3-MoE
# ---------------------------------------------------------------------------------------------


def test_modeling_files_import_only_torch_transformers_and_the_standard_library():
    for path in modeling_files():
        assert path.name in MODELING_FILES
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module == "configuration_smelt", path.name
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in ("torch", "transformers", "__future__") or top in sys.stdlib_module_names, (path, name)


@torch.no_grad()
def test_load_modeling_module_without_remote_code_gives_the_same_model(exported):
    case = exported("custom-layer-sigmoid")
    module = load_modeling_module(case.out)
    model = module.SmeltForCausalLM.from_pretrained(case.out).eval()
    ids = prompts(2, 6, seed=8)
    assert torch.equal(model(ids).logits, case.hf(ids).logits)


@torch.no_grad()
def test_qk_norm_baseline_equals_transformers_qwen3_moe():
    """qk_norm of the standalone model against transformers' own Qwen3MoeForCausalLM: a Baseline
    with softmax top-k, norm_topk_prob and a dense first layer has Qwen3-MoE's architecture and names."""
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, intermediate_size=48,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(mlp_only_layers=[0], **common)).eval()
    state = {k: (1.0 + 0.3 * torch.randn_like(v)) if k.endswith("norm.weight") else 0.2 * torch.randn_like(v)
             for k, v in qwen.state_dict().items()}
    qwen.load_state_dict(state)
    smelt = SmeltForCausalLM(SmeltConfig(qk_norm=True, first_k_dense_replace=1, **common)).eval()
    smelt.load_state_dict(state, strict=True)
    ids = prompts(2, 10, seed=9)
    # 3 layers (QK-norm, seq 10; MoE or the 48-wide dense FFN), the head: tests/numerics.py
    n = 3 * ((3 * 32 + 8 + 2 * 10 + 2 * 8) + (3 * 32 + 4 + 48 + 2)) + 2 * 32 + V
    assert_close_chain(smelt(ids).logits, qwen(ids).logits, n)
