"""Baselines exported as transformers' Qwen3-MoE / Qwen2-MoE / Mixtral, and imported back.

Parity is against SmeltLM on the same batch (fp32 logits within the bound of another summation
order, ``tests/numerics.py``: 2 n u of the largest logit, n the forward's reduction lengths) and
token for token in greedy decoding (up to a tie within that bound); the round trip is compared tensor
by tensor (torch.equal) and by per-expert SHA-256 checksums. Tiny models: vocab 128, hidden 32,
4 layers, 4 experts, top-2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.interop.known_archs import (
    build_known_hf,
    import_hf_model,
    known_hf_config,
    match_hf_architecture,
    recipe_from_hf_config,
    to_known_state_dict,
)
from smelt_ds.model.lm import SmeltLM
from tests.numerics import assert_close_chain, greedy_tie_point, lm_chain_length
from tests.threads import one_thread

EOT, PAD = 0, 1
SEQ = 40  # the longest sequence run here (prompt 8 + 32 new tokens)
CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_MOE_KEYS = {"num_experts", "top_k", "expert_ffn_size", "shared_expert_ffn_size", "score_func", "norm_topk_prob",
             "aux_loss_free_bias"}


@pytest.fixture(autouse=True)
def _one_thread_seeded():
    with one_thread(seed=0):
        yield


def _cfg(loop: dict | None = None, **kw: Any) -> RunConfig:
    model: dict[str, Any] = dict(vocab_size=128, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                 max_seq_len=128, dense_ffn_size=48, init_std=0.1, rope_theta=5000.0, norm_eps=1e-5)
    moe: dict[str, Any] = dict(num_experts=4, top_k=2, expert_ffn_size=16)
    for k, v in kw.items():
        (moe if k in _MOE_KEYS else model)[k] = v
    return config_from_dict({"model": model, "moe": moe, "loop": loop or {"position": "none"}})


def _model(cfg: RunConfig) -> SmeltLM:
    """SmeltLM with every 1-D weight (the RMSNorms, QK-norm included) off 1, so that a swapped norm
    shows in the logits."""
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _expert_checksums(state: dict[str, torch.Tensor], cfg: RunConfig) -> dict[tuple[int, int, str], str]:
    """SHA-256 of the gate, up and down matrix of expert e of MoE layer l (SmeltLM names)."""
    F, out = cfg.moe.expert_ffn_size, {}
    for layer in range(cfg.model.first_k_dense, cfg.model.num_layers):
        gate_up = state[f"layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"layers.{layer}.mlp.experts.down_proj"]
        for e in range(cfg.moe.num_experts):
            for name, t in (("gate", gate_up[e, :F]), ("up", gate_up[e, F:]), ("down", down[e])):
                out[(layer, e, name)] = _sha(t)
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _assert_same_greedy(ours: torch.Tensor, theirs: torch.Tensor, prompt_len: int, model: SmeltLM, n: int) -> None:
    """Token for token; after a row's first end-of-text SmeltLM.generate repeats EOT, transformers
    writes the pad token (both stop once every row has ended). Other kernels may break a tie within
    the forward's rounding (tests/numerics.py) the other way: a row is compared up to such a tie."""
    assert ours.shape == theirs.shape
    for b in range(ours.shape[0]):
        row_ours, row_theirs = ours[b, prompt_len:].tolist(), theirs[b, prompt_len:].tolist()
        end = row_ours.index(EOT) + 1 if EOT in row_ours else len(row_ours)
        with torch.no_grad():
            tie = greedy_tie_point(ours[b, :prompt_len + end], theirs[b, :prompt_len + end],
                                   lambda prefix: model(prefix[None]).logits[0, -1], n)
        if tie is not None:
            assert tie >= prompt_len
            continue
        assert row_theirs[:end] == row_ours[:end]
        assert row_ours[end:] == [EOT] * (len(row_ours) - end)
        assert row_theirs[end:] == [PAD] * (len(row_theirs) - end)


PARITY = [
    ("qwen3_moe", dict(qk_norm=True)),  # GQA 4/2, untied, renormalised top-k
    ("qwen3_moe", dict(qk_norm=True, first_k_dense=1, norm_topk_prob=False, tie_embeddings=True)),
    ("qwen3_moe", dict(qk_norm=True, first_k_dense=2, num_kv_heads=1, head_dim=16)),  # MQA, head_dim != H/Nq
    ("qwen3_moe", dict(qk_norm=True, num_kv_heads=4, norm_topk_prob=False, tie_embeddings=True)),  # MHA
    ("mixtral", dict()),
    ("mixtral", dict(num_kv_heads=4, tie_embeddings=True, top_k=1)),
    ("qwen2_moe", dict(shared_expert_ffn_size=24, first_k_dense=1, norm_topk_prob=False)),
    ("qwen2_moe", dict(shared_expert_ffn_size=24, num_kv_heads=1, tie_embeddings=True)),
]


@pytest.mark.parametrize("model_type,kw", PARITY, ids=[f"{t}-{'-'.join(map(str, kw.items()))}" for t, kw in PARITY])
def test_export_loads_without_custom_code_with_our_logits_and_greedy_tokens(tmp_path, model_type, kw):
    cfg = _cfg(**kw)
    model = _model(cfg)
    assert match_hf_architecture(cfg) == (model_type, [])
    build_known_hf(model, cfg, EOT, PAD).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == model_type and "auto_map" not in written
    assert not list(tmp_path.glob("*.py"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code
    assert type(hf).__name__ == CLASS[model_type]
    assert type(hf).__module__.startswith(f"transformers.models.{model_type}.")
    ids = torch.randint(2, cfg.model.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    n = lm_chain_length(cfg, 0, backward=False, seq=SEQ)  # transformers' kernels, ours: tests/numerics.py
    assert_close_chain(theirs, ours, n)
    prompt = ids[:, :8]
    _assert_same_greedy(model.generate(prompt, 32, eos_token_id=EOT),
                        hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                    do_sample=False), prompt.shape[1], model, n)


def test_written_config_carries_the_math_fields(tmp_path):
    cfg = _cfg(qk_norm=True, first_k_dense=1, head_dim=16, norm_topk_prob=False)
    build_known_hf(_model(cfg), cfg, EOT, PAD).save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert (c["head_dim"], c["rms_norm_eps"], c["max_position_embeddings"]) == (16, 1e-5, 128)
    assert (c["mlp_only_layers"], c["intermediate_size"], c["moe_intermediate_size"]) == ([0], 48, 16)
    assert (c["norm_topk_prob"], c["attention_bias"], c["sliding_window"], c["use_sliding_window"]) == (
        False, False, None, False)
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"], c["dtype"]) == (EOT, EOT, PAD, "float32")
    assert c["output_router_logits"] is False and c["tie_word_embeddings"] is False


# ---------------------------------------------------------------------------------------------
# what does not map, and why
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,loop,reason", [
    (dict(qk_norm=True), {"position": "middle"}, "`loop.position` ('middle'): looped models need the smelt modeling "
                                                 "code"),
    (dict(), {"position": "custom", "ranges": [{"start": 0, "end": 2, "repeats": 3}]}, "`loop.position` ('custom')"),
    (dict(qk_norm=True, shared_expert_ffn_size=24), None,
     "`moe.shared_expert_ffn_size` (24): qwen3_moe has no shared expert"),
    (dict(score_func="sigmoid"), None, "`moe.score_func` ('sigmoid'): mixtral's router is a softmax"),
    (dict(qk_norm=True, score_func="sigmoid"), None, "`moe.score_func` ('sigmoid'): qwen3_moe's router"),
    (dict(aux_loss_free_bias=True), None, "`moe.aux_loss_free_bias` (True): mixtral's router has no expert bias"),
    (dict(first_k_dense=1), None, "`model.first_k_dense` (1): mixtral has no dense layers"),
    (dict(norm_topk_prob=False), None, "`moe.norm_topk_prob` (False): mixtral always renormalises"),
])
def test_match_names_each_option_that_does_not_map(kw, loop, reason):
    cfg = _cfg(loop, **kw)
    model_type, reasons = match_hf_architecture(cfg)
    assert model_type is None
    assert any(r.startswith(reason) for r in reasons), reasons
    with pytest.raises(ConfigError, match="export it as model_type smelt"):
        build_known_hf(_model(cfg), cfg, EOT, PAD)


def test_match_lists_every_reason_and_a_plan_without_repeats_still_maps():
    _, reasons = match_hf_architecture(_cfg({"position": "middle"}, score_func="sigmoid", first_k_dense=1))
    assert [r.split(" ")[0] for r in reasons] == ["`loop.position`", "`moe.score_func`", "`model.first_k_dense`"]
    once = _cfg({"position": "custom", "ranges": [{"start": 1, "end": 3, "repeats": 1}]}, qk_norm=True)
    assert match_hf_architecture(once) == ("qwen3_moe", [])
    with pytest.raises(ConfigError, match=r"`model.qk_norm` \(False\): qwen3_moe always"):
        known_hf_config(_cfg(), "qwen3_moe", EOT, PAD)


def test_state_dict_adapter_refuses_a_state_that_is_not_the_recipes():
    cfg = _cfg(qk_norm=True)
    state = _model(cfg).state_dict()
    hf_state = to_known_state_dict(state, cfg, "qwen3_moe")
    assert hf_state["model.layers.2.mlp.experts.gate_up_proj"] is state["layers.2.mlp.experts.gate_up_proj"]
    assert hf_state["lm_head.weight"] is state["lm_head.weight"]
    state.pop("layers.1.self_attn.k_norm.weight")
    with pytest.raises(ConfigError, match=r"missing \['layers.1.self_attn.k_norm.weight'\]"):
        to_known_state_dict(state, cfg, "qwen3_moe")


# ---------------------------------------------------------------------------------------------
# on-disk expert layouts and the import round trip
# ---------------------------------------------------------------------------------------------


HUB_NAMES = {  # transformers 5.24 save_pretrained: (layer, expert) -> file keys of gate, up, down
    "qwen3_moe": "model.layers.{l}.mlp.experts.{e}.{w}_proj.weight",
    "qwen2_moe": "model.layers.{l}.mlp.experts.{e}.{w}_proj.weight",
    "mixtral": "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight",
}
MIXTRAL_W = {"gate": "w1", "up": "w3", "down": "w2"}
ROUND_TRIP = [("qwen3_moe", dict(qk_norm=True, first_k_dense=1, tie_embeddings=True)),
              ("mixtral", dict(num_kv_heads=1)),
              ("qwen2_moe", dict(shared_expert_ffn_size=24, first_k_dense=2, norm_topk_prob=False))]


def _arch(cfg: RunConfig) -> tuple[dict, dict]:
    """The architecture fields of a recipe, head_dim resolved (dense_ffn_size only with dense layers)."""
    model = cfg.model.model_dump() | {"head_dim": cfg.model.resolved_head_dim}
    if not cfg.model.first_k_dense:
        model.pop("dense_ffn_size")
    return model, cfg.moe.model_dump()


@pytest.mark.parametrize("model_type,kw", ROUND_TRIP, ids=[t for t, _ in ROUND_TRIP])
def test_save_pretrained_writes_the_hubs_per_expert_layout_holding_our_experts(tmp_path, model_type, kw):
    cfg = _cfg(**kw)
    model = _model(cfg)
    build_known_hf(model, cfg, EOT, PAD).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert not [k for k in keys if k.endswith(("gate_up_proj", "experts.down_proj"))]  # no fused tensor
        on_disk = {}
        for (layer, e, w) in _expert_checksums(model.state_dict(), cfg):
            name = HUB_NAMES[model_type].format(l=layer, e=e, w=MIXTRAL_W[w] if model_type == "mixtral" else w)
            on_disk[(layer, e, w)] = _sha(f.get_tensor(name))
    assert on_disk == _expert_checksums(model.state_dict(), cfg)


@pytest.mark.parametrize("model_type,kw", ROUND_TRIP, ids=[t for t, _ in ROUND_TRIP])
def test_import_round_trip_is_the_identity(tmp_path, model_type, kw):
    cfg = _cfg(**kw)
    model = _model(cfg)
    build_known_hf(model, cfg, EOT, PAD).save_pretrained(tmp_path)
    recipe, state = import_hf_model(tmp_path)
    assert set(recipe) == {"model", "moe", "loop"} and recipe["loop"] == {"position": "none"}
    new_cfg = config_from_dict(recipe)
    assert _arch(new_cfg) == _arch(cfg)
    new = SmeltLM(new_cfg.model, new_cfg.moe, new_cfg.loop)
    new.load_state_dict(state, strict=True)
    original, back = model.state_dict(), new.state_dict()
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert _expert_checksums(back, cfg) == _expert_checksums(original, cfg)
    assert (new.lm_head.weight is new.embed_tokens.weight) == cfg.model.tie_embeddings


def test_import_reads_the_fused_layout_too(tmp_path):
    """A safetensors file in transformers' in-memory (fused) layout also loads: the per-expert
    conversion applies only to keys that match it."""
    cfg = _cfg(qk_norm=True, first_k_dense=1)
    model = _model(cfg)
    hf = build_known_hf(model, cfg, EOT, PAD)
    hf.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    _, state = import_hf_model(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_import_a_hub_style_bf16_checkpoint(tmp_path):
    """config.json as the hub's Qwen3-MoE files write it (top-level rope_theta, torch_dtype,
    num_experts) over bf16 weights in the per-expert layout: the recipe reads the RoPE base, the
    weights come back upcast to fp32 exactly."""
    cfg = _cfg(qk_norm=True, first_k_dense=1)
    hf = build_known_hf(_model(cfg), cfg, EOT, PAD).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c |= {"rope_theta": rope["rope_theta"], "rope_scaling": None, "torch_dtype": "bfloat16",
          "num_experts": c.pop("num_local_experts"), "max_window_layers": 4}
    c.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(c))
    recipe, state = import_hf_model(tmp_path)
    assert (recipe["model"]["rope_theta"], recipe["moe"]["num_experts"], recipe["model"]["first_k_dense"]) == (
        5000.0, 4, 1)
    for name, tensor in _smelt_names(hf.state_dict()).items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor.float()), name


def _smelt_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k if k == "lm_head.weight" else k.removeprefix("model."): v for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def _export(tmp_path: Path, **kw: Any) -> Path:
    cfg = _cfg(**kw)
    out = tmp_path / "ckpt"
    build_known_hf(_model(cfg), cfg, EOT, PAD).save_pretrained(out)
    return out


def _edit_config(path: Path, **changes: Any) -> None:
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(c | changes))


def test_missing_directory_and_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"'.*nowhere' does not exist"):
        import_hf_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty/config.json: no config.json"):
        import_hf_model(tmp_path / "empty")


@pytest.mark.parametrize("model_type,why", [("llama", "smelt-ds imports only"), ("olmoe", "not per head|per head"),
                                            ("no_such_arch", "supported: ")])
def test_unknown_model_type(tmp_path, model_type, why):
    out = _export(tmp_path)
    _edit_config(out, model_type=model_type)
    with pytest.raises(ConfigError, match=rf"config.json: key `model_type` \('{model_type}'\).*({why})"):
        import_hf_model(out)


def test_sliding_window_in_config_json(tmp_path):
    out = _export(tmp_path)
    _edit_config(out, sliding_window=64)
    with pytest.raises(ConfigError, match=r"ckpt/config.json: key `sliding_window` \(64\).*fully causal"):
        import_hf_model(out)


@pytest.mark.parametrize("key,shape", [
    ("model.layers.0.self_attn.q_proj.weight", (16, 32)),
    ("model.layers.2.block_sparse_moe.experts.3.w1.weight", (12, 32)),  # one expert of the hub layout
    ("model.layers.1.block_sparse_moe.experts.0.w2.weight", (16, 32)),  # down [H, F] stored transposed
])
def test_weights_file_with_a_tensor_of_the_wrong_shape(tmp_path, key, shape):
    out = _export(tmp_path)
    weights = load_file(str(out / "model.safetensors"))
    want = tuple(weights[key].shape)
    weights[key] = torch.zeros(shape)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        import_hf_model(out)
    assert str(err.value).startswith(f"{out / 'model.safetensors'}: tensor `{key}` has shape {shape}, "
                                     f"{out / 'config.json'} needs {want}")


def test_sharded_checkpoint_round_trip_and_a_bad_shard(tmp_path):
    cfg = _cfg(first_k_dense=0)
    model = _model(cfg)
    out = tmp_path / "ckpt"
    build_known_hf(model, cfg, EOT, PAD).save_pretrained(out, max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    _, state = import_hf_model(out)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    key = "model.layers.3.block_sparse_moe.experts.1.w3.weight"
    shard = out / index[key]
    weights = load_file(str(shard))
    weights[key] = torch.zeros(16, 31)
    save_file(weights, str(shard), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"^{shard}: tensor `{key}` has shape \(16, 31\)"):
        import_hf_model(out)


def test_weights_file_with_a_tensor_missing(tmp_path):
    out = _export(tmp_path)
    weights = load_file(str(out / "model.safetensors"))
    del weights["model.layers.3.self_attn.k_proj.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model.layers.3.self_attn.k_proj.weight: missing from the weight files "
                                          r"\['model.safetensors'\]"):
        import_hf_model(out)


@pytest.mark.parametrize("model_type,fields,key", [
    ("qwen3_moe", dict(attention_bias=True), "`attention_bias` (True)"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), "`use_sliding_window` (True)"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "`decoder_sparse_step` (2)"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "`mlp_only_layers` ([1])"),
    ("qwen3_moe", dict(hidden_act="gelu"), "`hidden_act` ('gelu')"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "`rope_parameters.rope_type` ('linear')"),
    ("qwen2_moe", dict(), "`qkv_bias` (True)"),  # transformers' default; Qwen1.5-MoE has q/k/v biases
    ("mixtral", dict(router_jitter_noise=0.1), "`router_jitter_noise` (0.1)"),
    ("mixtral", dict(attention_dropout=0.1), "`attention_dropout` (0.1)"),
])
def test_config_values_smelt_ds_cannot_represent(model_type, fields, key):
    hf_config = AutoConfig.for_model(model_type, **fields)
    with pytest.raises(ConfigError) as err:
        recipe_from_hf_config(hf_config, source="ckpt/config.json")
    assert str(err.value).startswith(f"ckpt/config.json: key {key} cannot be represented in smelt-ds: ")
