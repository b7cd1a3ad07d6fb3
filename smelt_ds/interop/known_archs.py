"""Baselines as transformers' own MoE architectures, and transformers MoE checkpoints as recipes.

**Export.** A Baseline (no loop) whose options one of transformers' MoE classes computes exactly is
written as that architecture: ``AutoModelForCausalLM.from_pretrained`` loads it with no custom
code, and every tool that knows the architecture takes it. What each target needs (checked in
transformers 5.24's ``models/{qwen3_moe,qwen2_moe,mixtral}``):

=============  =================================================================================
model_type     the smelt-ds Baseline
=============  =================================================================================
qwen3_moe      ``model.qk_norm: true`` (``Qwen3MoeAttention`` always RMS-normalises q and k per
               head before RoPE), no shared expert; dense first layers (``mlp_only_layers``);
               ``moe.norm_topk_prob`` true or false
qwen2_moe      ``model.qk_norm: false`` and a shared expert (``Qwen2MoeSparseMoeBlock`` always has
               one, sigmoid-gated like ours; ``qkv_bias: false``); dense first layers;
               ``moe.norm_topk_prob`` true or false
mixtral        ``model.qk_norm: false``, no shared expert, no dense layers, ``moe.norm_topk_prob:
               true`` (``MixtralTopKRouter`` always renormalises the top-k weights)
=============  =================================================================================

All three need a softmax router without expert bias and ``loop.position: none``: a looped model
needs the smelt modeling code (``model_type: smelt``). OLMoE does not map: ``OlmoeAttention``
normalises q and k over the whole projection (``RMSNorm(num_heads * head_dim)``), not per head.
Training-only options are not part of the exported math: ``moe.router_jitter`` (transformers
exports get ``router_jitter_noise: 0``) and ``model.dropout``.

**State dict.** transformers 5 keeps the fused expert layout in memory (``mlp.experts.gate_up_proj``
``[E, 2F, H]``, ``mlp.experts.down_proj`` ``[E, H, F]``, ``mlp.gate.weight`` ``[E, H]``), so its names
are ours with a ``model.`` prefix (``lm_head.weight`` unchanged). ``save_pretrained`` writes the
hub's per-expert layout (``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral:
``block_sparse_moe.experts.{e}.w{1,3,2}.weight``) through its conversion mapping and
``from_pretrained`` fuses it again; both on-disk layouts load.

**Import.** :func:`import_hf_model` reads a local checkpoint directory of one of these
architectures with transformers itself and returns the ``model``/``moe``/``loop`` sections of a
recipe plus the weights in smelt-ds names. Anything the recipe cannot express raises
:class:`~smelt_ds.errors.ConfigError` naming ``config.json``, the key, the value and what smelt-ds
supports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.loading import config_from_dict
from smelt_ds.config.run import RunConfig
from smelt_ds.config.train import TrainConfig
from smelt_ds.errors import ConfigError
from smelt_ds.model.lm import SmeltLM

__all__ = ["KNOWN_MODEL_TYPES", "match_hf_architecture", "architecture_mismatches", "known_hf_config",
           "to_known_state_dict", "from_known_state_dict", "build_known_hf", "recipe_from_hf_config",
           "import_hf_model"]

#: transformers ``model_type`` values a Baseline is exported as / imported from
KNOWN_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")

_NOT_SUPPORTED = {
    "olmoe": "OLMoE normalises q and k over the whole projection (RMSNorm(num_heads * head_dim)), "
             "smelt-ds per head (`model.qk_norm`, Qwen3's)",
    "smelt": "a smelt-ds looped export: it is read back by smelt-ds from its own export directory "
             "(model.pt + config.yaml), not imported",
}
_HF_PREFIX = "model."
_HEAD = "lm_head.weight"
#: one expert's matrix in the hub's per-expert layout (qwen: gate/up/down_proj; mixtral: w1/w3/w2)
_HUB_EXPERT = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


# ---------------------------------------------------------------------------------------------
# which architecture a recipe maps onto
# ---------------------------------------------------------------------------------------------


def _target(cfg: RunConfig) -> str:
    if cfg.model.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if cfg.moe.shared_expert_ffn_size else "mixtral"


def match_hf_architecture(cfg: RunConfig) -> tuple[str | None, list[str]]:
    """The transformers ``model_type`` that computes this recipe's model exactly, or why none does.

    Returns ``(model_type, [])`` (``"qwen3_moe"`` with ``model.qk_norm``, else ``"qwen2_moe"`` with a
    shared expert, else ``"mixtral"``), or ``(None, reasons)``: one reason per option the candidate
    architecture lacks, each naming the recipe field and its value, e.g.
    ``"`moe.score_func` ('sigmoid'): mixtral's router is a softmax over the experts"``.
    Looped models never map.
    """
    target = _target(cfg)
    reasons = architecture_mismatches(cfg, target)
    return (None, reasons) if reasons else (target, [])


def architecture_mismatches(cfg: RunConfig, model_type: str) -> list[str]:
    """Reasons why transformers' ``model_type`` cannot compute this recipe's model exactly (empty
    when it can), each naming the recipe field and value. Raises ConfigError for a ``model_type``
    outside :data:`KNOWN_MODEL_TYPES`."""
    if model_type not in KNOWN_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one smelt-ds exports to: use one of "
                          f"{list(KNOWN_MODEL_TYPES)}")
    m, moe, mt = cfg.model, cfg.moe, model_type
    out: list[str] = []
    if any(v.visit > 0 for v in cfg.schedule.plan):
        out.append(f"`loop.position` ({cfg.loop.position!r}): looped models need the smelt modeling code "
                   f"(visit plan {cfg.schedule.layers()}); {mt} runs every layer once")
    if moe.score_func != "softmax":
        out.append(f"`moe.score_func` ({moe.score_func!r}): {mt}'s router is a softmax over the experts")
    if moe.aux_loss_free_bias:
        out.append(f"`moe.aux_loss_free_bias` (True): {mt}'s router has no expert bias")
    if mt == "qwen3_moe":
        if not m.qk_norm:
            out.append("`model.qk_norm` (False): qwen3_moe always RMS-normalises q and k per head")
        if moe.shared_expert_ffn_size:
            out.append(f"`moe.shared_expert_ffn_size` ({moe.shared_expert_ffn_size}): qwen3_moe has no shared "
                       "expert (qwen2_moe has one, but no q/k norm, and `model.qk_norm` is true)")
        return out
    if m.qk_norm:
        out.append(f"`model.qk_norm` (True): {mt} has no q/k norm (qwen3_moe has it)")
    if mt == "qwen2_moe":
        if not moe.shared_expert_ffn_size:
            out.append("`moe.shared_expert_ffn_size` (0): qwen2_moe always has a shared expert")
        return out
    if moe.shared_expert_ffn_size:
        out.append(f"`moe.shared_expert_ffn_size` ({moe.shared_expert_ffn_size}): mixtral has no shared expert")
    hint = "qwen3_moe has it, with `model.qk_norm: true`; qwen2_moe, with a shared expert"
    if m.first_k_dense:
        out.append(f"`model.first_k_dense` ({m.first_k_dense}): mixtral has no dense layers ({hint})")
    if not moe.norm_topk_prob:
        out.append(f"`moe.norm_topk_prob` (False): mixtral always renormalises the top-k weights to sum to 1 "
                   f"(weights without renormalisation: {hint})")
    return out


def _require(cfg: RunConfig, model_type: str) -> None:
    reasons = architecture_mismatches(cfg, model_type)
    if reasons:
        raise ConfigError(f"the recipe does not map onto transformers' {model_type}: " + "; ".join(reasons)
                          + ": export it as model_type smelt (custom modeling code), or change those fields")


# ---------------------------------------------------------------------------------------------
# export: config, state dict, model
# ---------------------------------------------------------------------------------------------


def known_hf_config(cfg: RunConfig, model_type: str, eot_id: int, pad_id: int | None) -> Any:
    """The transformers config (``Qwen3MoeConfig`` / ``Qwen2MoeConfig`` / ``MixtralConfig``) whose
    model computes exactly what ``SmeltLM`` of ``cfg`` computes at inference.

    Every field that changes the math is set: sizes, ``head_dim``, RoPE as transformers 5's
    ``rope_parameters`` (``rope_type: default``, ``rope_theta``), ``rms_norm_eps``,
    ``max_position_embeddings`` (= ``model.max_seq_len``, tokens), ``tie_word_embeddings``, the router
    (``num_experts_per_tok``, ``norm_topk_prob``), dense first layers (``mlp_only_layers``), no
    sliding window, no router jitter, no attention bias or dropout, ``output_router_logits: false``,
    ``dtype`` float32; ``bos_token_id`` = ``eos_token_id`` = ``eot_id`` (documents start after and end
    with end-of-text), ``pad_token_id`` = ``pad_id``. Raises ConfigError listing the reasons when
    ``cfg`` does not map onto ``model_type``.
    """
    from transformers import AutoConfig

    _require(cfg, model_type)
    m, moe = cfg.model, cfg.moe
    common: dict[str, Any] = dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.resolved_head_dim,
        hidden_act="silu", max_position_embeddings=m.max_seq_len, initializer_range=m.init_std,
        rms_norm_eps=m.norm_eps, use_cache=True, tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)}, attention_dropout=0.0,
        num_experts_per_tok=moe.top_k, output_router_logits=False, router_aux_loss_coef=cfg.train.aux_loss_coef,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=pad_id, dtype=torch.float32)
    if model_type == "mixtral":
        extra: dict[str, Any] = dict(intermediate_size=moe.expert_ffn_size, num_local_experts=moe.num_experts,
                                     sliding_window=None, router_jitter_noise=0.0)
    else:
        extra = dict(intermediate_size=m.dense_ffn_size, moe_intermediate_size=moe.expert_ffn_size,
                     num_experts=moe.num_experts, norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                     mlp_only_layers=list(range(m.first_k_dense)), use_sliding_window=False, sliding_window=None)
        if model_type == "qwen3_moe":
            extra["attention_bias"] = False
        else:
            extra.update(qkv_bias=False, shared_expert_intermediate_size=moe.shared_expert_ffn_size)
    return AutoConfig.for_model(model_type, **common, **extra)


def _reference_shapes(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of ``SmeltLM(cfg)``'s state dict, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_names(names: set[str], cfg: RunConfig, what: str) -> None:
    expected = set(_reference_shapes(cfg))
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:
        raise ConfigError(f"{what} does not match the recipe's model: missing {missing[:8]}"
                          f"{' ...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
                          f"{' ...' if len(extra) > 8 else ''}: pass the state dict of SmeltLM(cfg.model, "
                          "cfg.moe, cfg.loop) of this recipe")


def to_known_state_dict(state: dict[str, torch.Tensor], cfg: RunConfig, model_type: str
                        ) -> dict[str, torch.Tensor]:
    """Our state dict (SmeltLM names, e.g. ``layers.3.mlp.experts.gate_up_proj`` ``[E, 2F, H]``) in
    transformers' in-memory names for ``model_type`` (``model.layers.3.mlp.experts.gate_up_proj``;
    ``lm_head.weight`` unchanged). Tensors are the same objects, not copies. Raises ConfigError
    when ``cfg`` does not map onto ``model_type`` or a key is missing or unexpected for ``cfg``."""
    _require(cfg, model_type)
    _check_names(set(state), cfg, "the state dict")
    return {(k if k == _HEAD else _HF_PREFIX + k): v for k, v in state.items()}


def from_known_state_dict(state: dict[str, torch.Tensor], source: str = "the checkpoint"
                          ) -> dict[str, torch.Tensor]:
    """transformers' in-memory names (``model.``-prefixed, fused experts) back to SmeltLM names.
    Raises ConfigError naming ``source`` for a key outside ``model.*`` and ``lm_head.weight``."""
    bad = sorted(k for k in state if k != _HEAD and not k.startswith(_HF_PREFIX))
    if bad:
        raise ConfigError(f"{source}: keys {bad[:8]} are neither `model.*` nor `{_HEAD}`: not a "
                          f"{'/'.join(KNOWN_MODEL_TYPES)} causal-LM state dict")
    return {(k if k == _HEAD else k[len(_HF_PREFIX):]): v for k, v in state.items()}


def build_known_hf(model: SmeltLM, cfg: RunConfig, eot_id: int, pad_id: int | None) -> Any:
    """A transformers ``PreTrainedModel`` (``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` or
    ``MixtralForCausalLM``, in eval mode, fp32) holding exactly ``model``'s weights (copies).

    ``cfg``: the recipe ``model`` was built from; ``eot_id`` / ``pad_id``: token ids written as
    BOS/EOS and padding (see :func:`known_hf_config`). ``.save_pretrained(OUT)`` then writes a
    directory ``AutoModelForCausalLM`` loads without custom code. Raises ConfigError when ``cfg``
    does not map (the reasons of :func:`match_hf_architecture`), when ``model`` was not built from
    ``cfg``'s ``model``/``moe`` sections and visit plan, or when any weight is missing,
    unexpected or of another shape than transformers' model expects."""
    from transformers import AutoModelForCausalLM

    model_type, reasons = match_hf_architecture(cfg)
    if model_type is None:
        raise ConfigError("the recipe maps onto no transformers architecture: " + "; ".join(reasons)
                          + ": export it as model_type smelt (custom modeling code)")
    if model.model_cfg != cfg.model or model.moe_cfg != cfg.moe or model.schedule.plan != cfg.schedule.plan:
        raise ConfigError("build_known_hf: the model was not built from this recipe's `model`/`moe` sections "
                          "and visit plan: pass the recipe of the model being exported")
    state = to_known_state_dict(model.state_dict(), cfg, model_type)
    hf = AutoModelForCausalLM.from_config(known_hf_config(cfg, model_type, eot_id, pad_id), dtype=torch.float32)
    target = hf.state_dict()
    missing, extra = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    wrong = sorted(f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in target.items()
                   if k in state and state[k].shape != v.shape)
    if missing or extra or wrong:
        raise ConfigError(f"transformers' {type(hf).__name__} does not take these weights: missing {missing}, "
                          f"unexpected {extra}, shape (ours != transformers') {wrong}")
    hf.load_state_dict(state, strict=True)
    return hf.eval()


# ---------------------------------------------------------------------------------------------
# import: config.json -> recipe sections, weights -> our names
# ---------------------------------------------------------------------------------------------


def _bad(source: str, key: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(f"{source}: key `{key}` ({value!r}) cannot be represented in smelt-ds: {supported}")


def _check_model_type(model_type: Any, source: str) -> str:
    if model_type in KNOWN_MODEL_TYPES:
        return str(model_type)
    why = _NOT_SUPPORTED.get(str(model_type), "smelt-ds imports only these transformers MoE architectures")
    raise _bad(source, "model_type", model_type, f"{why}; supported: {list(KNOWN_MODEL_TYPES)} (qwen2_moe without "
               "qkv bias)")


def _dense_prefix(hf: Any, source: str) -> int:
    """``model.first_k_dense`` from ``mlp_only_layers`` / ``decoder_sparse_step`` (qwen models)."""
    if hf.decoder_sparse_step != 1:
        raise _bad(source, "decoder_sparse_step", hf.decoder_sparse_step,
                   "smelt-ds has MoE in every layer but the first `model.first_k_dense`: 1 is supported")
    dense = sorted(hf.mlp_only_layers or [])
    if dense != list(range(len(dense))):
        raise _bad(source, "mlp_only_layers", hf.mlp_only_layers,
                   "smelt-ds's dense layers are the first k (`model.first_k_dense`): [0, 1, ..., k-1] is supported")
    if hf.num_experts < 1:
        raise _bad(source, "num_experts", hf.num_experts, "smelt-ds MoE layers need >= 1 expert")
    return len(dense)


def _check_common(hf: Any, source: str) -> float:
    """Checks shared by every known architecture; returns the RoPE base."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise _bad(source, "hidden_act", hf.hidden_act, "smelt-ds experts are SwiGLU: 'silu' is supported")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise _bad(source, "rope_parameters.rope_type", rope.get("rope_type"),
                   "smelt-ds has plain RoPE without scaling: 'default' is supported")
    if getattr(hf, "attention_dropout", 0.0):
        raise _bad(source, "attention_dropout", hf.attention_dropout,
                   "smelt-ds's `model.dropout` also drops residual branches: 0.0 is supported")
    if getattr(hf, "quantization_config", None):
        raise _bad(source, "quantization_config", "...", "smelt-ds imports unquantised weights only")
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _check_specific(hf: Any, mt: str, source: str) -> None:
    """The options of one architecture that smelt-ds cannot express."""
    if mt == "qwen3_moe" and hf.attention_bias:
        raise _bad(source, "attention_bias", hf.attention_bias, "smelt-ds projections have no bias: false")
    if mt == "qwen2_moe" and hf.qkv_bias:
        raise _bad(source, "qkv_bias", hf.qkv_bias, "smelt-ds projections have no bias: false (note: "
                   "qwen2_moe's default is true)")
    if mt == "qwen2_moe" and hf.shared_expert_intermediate_size < 1:
        raise _bad(source, "shared_expert_intermediate_size", hf.shared_expert_intermediate_size,
                   "a qwen2_moe shared expert maps onto `moe.shared_expert_ffn_size` >= 1")
    if mt != "mixtral" and getattr(hf, "use_sliding_window", False):
        raise _bad(source, "use_sliding_window", True, "smelt-ds attention is fully causal: false")
    if mt == "mixtral" and hf.sliding_window is not None:
        raise _bad(source, "sliding_window", hf.sliding_window, "smelt-ds attention is fully causal: null")
    if mt == "mixtral" and hf.router_jitter_noise:
        raise _bad(source, "router_jitter_noise", hf.router_jitter_noise,
                   "mixtral jitters the expert input too, smelt-ds's `moe.router_jitter` only the router's: 0.0")


def recipe_from_hf_config(hf_config: Any, source: str = "config.json") -> dict[str, Any]:
    """The ``model``, ``moe`` and ``loop`` sections (a raw recipe dict, loop position ``none``) of
    a transformers ``Qwen3MoeConfig`` / ``Qwen2MoeConfig`` / ``MixtralConfig``.

    Sizes map one to one (``num_hidden_layers`` -> ``model.num_layers``, ``moe_intermediate_size``
    (mixtral: ``intermediate_size``) -> ``moe.expert_ffn_size``, ``intermediate_size`` of qwen models
    -> ``model.dense_ffn_size``, ``mlp_only_layers`` [0..k-1] -> ``model.first_k_dense`` k,
    ``max_position_embeddings`` -> ``model.max_seq_len`` (tokens)); qwen3_moe sets ``model.qk_norm``.
    Raises ConfigError naming ``source``, the key, the value and what smelt-ds supports for an
    unknown ``model_type`` (OLMoE included), ``hidden_act`` other than silu, RoPE scaling, attention
    dropout or bias, a sliding window, Mixtral's ``router_jitter_noise``, ``decoder_sparse_step`` != 1
    or dense layers other than the first k.
    """
    mt = _check_model_type(getattr(hf_config, "model_type", None), source)
    hf = hf_config
    theta = _check_common(hf, source)
    _check_specific(hf, mt, source)
    heads = hf.num_attention_heads
    model: dict[str, Any] = {
        "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers,
        "num_heads": heads, "num_kv_heads": hf.num_key_value_heads or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "max_seq_len": hf.max_position_embeddings, "rope_theta": theta, "norm_eps": hf.rms_norm_eps,
        "tie_embeddings": bool(hf.tie_word_embeddings), "qk_norm": mt == "qwen3_moe",
        "init_std": hf.initializer_range}
    moe: dict[str, Any] = {"num_experts": hf.num_local_experts if mt == "mixtral" else hf.num_experts,
                           "top_k": hf.num_experts_per_tok, "score_func": "softmax", "aux_loss_free_bias": False,
                           "router_jitter": 0.0}
    if mt == "mixtral":
        moe.update(expert_ffn_size=hf.intermediate_size, norm_topk_prob=True, shared_expert_ffn_size=0)
    else:
        model.update(first_k_dense=_dense_prefix(hf, source), dense_ffn_size=hf.intermediate_size)
        moe.update(expert_ffn_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                   shared_expert_ffn_size=hf.shared_expert_intermediate_size if mt == "qwen2_moe" else 0)
    return {"model": model, "moe": moe, "loop": {"position": "none"}}


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ConfigError(f"transformers checkpoint directory {str(path)!r} {what}: pass a local directory "
                          "holding config.json and the weights (e.g. one written by save_pretrained)")
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file}: no config.json in the checkpoint directory {str(path)!r}: a transformers "
                          "checkpoint holds config.json beside its weights (save_pretrained writes both)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e}): restore the file written by save_pretrained") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: a JSON object is expected, got {type(raw).__name__}")
    return raw


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (the shards its index names, else ``*.safetensors``)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: not a safetensors index with a `weight_map` ({e!r}): restore the file "
                              "written by save_pretrained") from None
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def _expected_on_disk(key: str, shapes: dict[str, tuple[int, ...]], cfg: RunConfig) -> tuple[int, ...] | None:
    """The shape the recipe's model needs for file key ``key`` (transformers' in-memory name, or one
    expert's matrix in the hub layout); None for a key the recipe does not know."""
    name = key if key == _HEAD else key.removeprefix(_HF_PREFIX).replace(".block_sparse_moe.", ".mlp.")
    if name in shapes:
        return shapes[name]
    hub = _HUB_EXPERT.fullmatch(key)
    if hub is None:
        return None
    H, F = cfg.model.hidden_size, cfg.moe.expert_ffn_size
    return (H, F) if hub.group(1) in ("down_proj", "w2") else (F, H)


def _check_file_shapes(path: Path, cfg: RunConfig, source: str) -> None:
    """Every tensor of the checkpoint's safetensors files against the shape ``cfg`` needs (read
    from the file headers, no tensor is loaded). Raises ConfigError naming the file and the key."""
    from safetensors import safe_open

    shapes = _reference_shapes(cfg)
    for file in _weight_files(path):
        if not file.is_file():
            raise ConfigError(f"{file}: weight file named by {path / 'model.safetensors.index.json'} is missing: "
                              "copy every shard of the checkpoint")
        try:
            with safe_open(str(file), "pt") as f:
                found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # safetensors raises its own SafetensorError for a corrupt header
            raise ConfigError(f"{file}: not a readable safetensors file ({e}): restore it") from None
        for key, shape in sorted(found.items()):
            want = _expected_on_disk(key, shapes, cfg)
            if want is not None and shape != want:
                raise ConfigError(f"{file}: tensor `{key}` has shape {shape}, {source} needs {want}: the weights "
                                  "do not belong to this config.json; rewrite them with save_pretrained")


def _files_holding(path: Path, key: str) -> list[str]:
    """The weight files of ``path`` that hold ``key`` (a transformers in-memory name) or the
    per-expert tensors it is fused from; all weight files when there is no index."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    stem = key.rsplit(".", 1)[0] if ".experts." in key else key
    prefixes = {stem, stem.replace(".mlp.", ".block_sparse_moe.")}
    return sorted({f for k, f in weight_map.items() if any(k.startswith(p) for p in prefixes)}) or [index.name]


def _loading_problems(path: Path, info: dict[str, Any]) -> list[str]:
    out = [f"{k}: shape {tuple(ckpt)} in {_files_holding(path, k)}, the config needs {tuple(want)}"
           for k, ckpt, want in sorted(info.get("mismatched_keys") or [])]
    out += [f"{k}: missing from the weight files {_files_holding(path, '')}"
            for k in sorted(info.get("missing_keys") or [])]
    out += [f"{k}: unexpected (the config has no such weight)" for k in sorted(info.get("unexpected_keys") or [])]
    out += [str(e) for e in info.get("error_msgs") or []]
    return out


def import_hf_model(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Load the LOCAL transformers checkpoint directory ``path`` (qwen3_moe, qwen2_moe or mixtral).

    Returns ``(recipe, state)``: ``recipe`` holds the ``model``, ``moe`` and ``loop`` sections
    (:func:`recipe_from_hf_config`), ``state`` the weights in SmeltLM names, fp32 (a bf16 checkpoint
    is upcast exactly), e.g. ``layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2F, H]``: what
    ``SmeltLM(config_from_dict(recipe)...)`` loads with ``load_state_dict(strict=True)``.
    transformers reads the weights (``AutoModelForCausalLM.from_pretrained``, no remote code, local
    files only), so every on-disk expert layout it converts loads: the hub's per-expert tensors or
    the fused ones. Raises ConfigError naming the directory or file and the key for: a missing
    directory or ``config.json``, an architecture or option smelt-ds cannot represent, a weight
    missing, unexpected or of the wrong shape, or no readable weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    raw = _read_config_json(path)
    source = str(path / "config.json")
    _check_model_type(raw.get("model_type"), source)
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise ConfigError(f"{source}: transformers cannot read this config ({e}): fix the named key") from None
    recipe = recipe_from_hf_config(hf_config, source)
    seq = min(TrainConfig().seq_len, int(recipe["model"]["max_seq_len"]))  # validation only
    cfg = config_from_dict({**recipe, "train": {"seq_len": seq}}, source=f"the recipe of {source}")
    _check_file_shapes(path, cfg, source)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=torch.float32,
                                                           local_files_only=True, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)  # (model, info)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{path}: transformers could not load the weights ({e}): the directory needs "
                          "model.safetensors (or an index with its shards) as save_pretrained writes them") from None
    hf, info = loaded
    problems = _loading_problems(path, info)
    if problems:
        raise ConfigError(f"{path}: the weights do not match {source} ({type(hf).__name__}):\n  "
                          + "\n  ".join(problems) + "\nrewrite the weight files with save_pretrained from a model "
                          "of this config, or fix config.json")
    state = from_known_state_dict(hf.state_dict(), str(path))
    shapes = _reference_shapes(cfg)
    _check_names(set(state), cfg, f"{path}: the loaded state dict")
    wrong = [f"{k} {tuple(v.shape)} != {shapes[k]}" for k, v in state.items() if tuple(v.shape) != shapes[k]]
    if wrong:
        raise ConfigError(f"{path}: weights of another shape than the recipe's model: {wrong}")
    return recipe, state
