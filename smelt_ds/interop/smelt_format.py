"""The ``model_type: smelt`` Hugging Face format: config.json content, state-dict adapter, directory writer.

A looped SMELT model (or a Baseline no transformers architecture can express) is exported as
``config.json`` + ``model.safetensors`` + the two standalone files :data:`MODELING_FILES`
(``configuration_smelt.py``, ``modeling_smelt.py``, which import only torch and transformers) and
loads with ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``.

Weight names are ``SmeltLM``'s with a ``model.`` prefix, the output head stays ``lm_head.weight``::

    embed_tokens.weight            <-> model.embed_tokens.weight
    layers.{i}.<...>               <-> model.layers.{i}.<...>     (attention, norms, router, experts)
    norm.weight                    <-> model.norm.weight
    lm_head.weight                 <-> lm_head.weight            (dropped when tied to the embedding)

The KV cache of the transformers model has one layer slot per visit of the visit plan.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.config.schedule import build_schedule
from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM

__all__ = ["MODELING_FILES", "AUTO_MAP", "smelt_hf_config", "to_hf_state_dict", "from_hf_state_dict",
           "modeling_files", "load_modeling_module", "write_hf_dir"]

#: The standalone remote-code files copied into every ``model_type: smelt`` directory.
MODELING_FILES = ("configuration_smelt.py", "modeling_smelt.py")

#: ``config.json`` ``auto_map``: which class of the copied files each Auto class loads.
AUTO_MAP = {"AutoConfig": "configuration_smelt.SmeltConfig", "AutoModelForCausalLM": "modeling_smelt.SmeltForCausalLM"}

_SMELT_ROOTS = ("embed_tokens", "layers", "norm")


def smelt_hf_config(cfg: RunConfig, eot_id: int, pad_id: int) -> dict[str, Any]:
    """``config.json`` content (``model_type: smelt``) of a recipe's architecture.

    ``cfg``: the run config (its ``model``, ``moe`` and ``loop`` sections); ``eot_id`` / ``pad_id``:
    token ids of the end-of-text token (also used as bos and eos) and of padding. The loop is written
    as ``loop_ranges`` ``[[start, end, repeats], ...]`` + ``loop_order`` + ``input_injection``, and the
    visit plan ``[[layer, visit], ...]`` it yields (:func:`smelt_ds.config.schedule.build_schedule`).
    Dropout and the initialisation std are training settings; only ``initializer_range`` is kept.
    Raises ConfigError for an invalid loop section.
    """
    m, moe, loop = cfg.model, cfg.moe, cfg.loop
    schedule = build_schedule(loop, m.num_layers)
    return {
        "architectures": ["SmeltForCausalLM"],
        "model_type": "smelt",
        "auto_map": dict(AUTO_MAP),
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.resolved_head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "qk_norm": m.qk_norm,
        "hidden_act": "silu",
        "initializer_range": m.init_std,
        "first_k_dense_replace": m.first_k_dense,
        "intermediate_size": m.dense_ffn_size,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_ffn_size,
        "shared_expert_intermediate_size": moe.shared_expert_ffn_size,
        "scoring_func": moe.score_func,
        "norm_topk_prob": moe.norm_topk_prob,
        "aux_loss_free_bias": moe.aux_loss_free_bias,
        "loop_ranges": [[s.start, s.end, s.repeats] for s in schedule.spans],
        "loop_order": loop.order,
        "input_injection": loop.input_injection,
        "visit_plan": [[v.layer, v.visit] for v in schedule.plan],
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "dtype": "float32",
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], tie: bool) -> dict[str, torch.Tensor]:
    """``SmeltLM`` state dict -> transformers ``SmeltForCausalLM`` names (same tensors, no copies).

    ``tie``: ``model.tie_embeddings``; a tied ``lm_head.weight`` is dropped (transformers re-ties it
    to ``model.embed_tokens.weight``). Raises ConfigError for a key outside SmeltLM's layout, an
    untied state without ``lm_head.weight``, or a tied one whose head differs from the embedding.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            if not tie:
                out[key] = value
            elif "embed_tokens.weight" in state and not torch.equal(value, state["embed_tokens.weight"]):
                raise ConfigError("state dict `lm_head.weight` differs from `embed_tokens.weight` but "
                                  "`model.tie_embeddings` is true: export with tie_embeddings false, "
                                  "or tie the weights")
        elif key.split(".", 1)[0] in _SMELT_ROOTS:
            out["model." + key] = value
        else:
            raise ConfigError(f"state dict key `{key}` is not in SmeltLM's layout (embed_tokens, layers.*, norm, "
                              "lm_head): export a reference-layout state dict (smelt_ds.runs.export)")
    if not tie and "lm_head.weight" not in state:
        raise ConfigError("state dict has no `lm_head.weight` but `model.tie_embeddings` is false: export the "
                          "output head too, or set model.tie_embeddings true if it is the embedding")
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], tie: bool) -> dict[str, torch.Tensor]:
    """transformers ``SmeltForCausalLM`` state dict -> ``SmeltLM`` names; inverse of :func:`to_hf_state_dict`.

    ``tie``: ``tie_word_embeddings``; ``lm_head.weight`` is then the embedding tensor itself (added
    when missing). Raises ConfigError naming a key outside the layout, or a tied head that differs
    from the embedding.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key.startswith("model.") and key.split(".", 2)[1] in _SMELT_ROOTS:
            out[key.removeprefix("model.")] = value
        elif key != "lm_head.weight":
            raise ConfigError(f"weights key `{key}` is not in the smelt transformers layout (model.embed_tokens, "
                              "model.layers.*, model.norm, lm_head): is this a model_type smelt checkpoint?")
    head = hf_state.get("lm_head.weight")
    if tie:
        embed = out.get("embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ConfigError("weights `lm_head.weight` differs from `model.embed_tokens.weight` but "
                              "`tie_word_embeddings` is true in config.json: set it false")
        head = embed if embed is not None else head
    if head is not None:
        out["lm_head.weight"] = head
    return out


def modeling_files() -> list[Path]:
    """Paths of the two standalone remote-code files (:data:`MODELING_FILES`) to copy into an export."""
    here = Path(__file__).resolve().parent
    return [here / name for name in MODELING_FILES]


def load_modeling_module(directory: str | Path) -> ModuleType:
    """Import ``modeling_smelt.py`` (and its sibling ``configuration_smelt.py``) from ``directory``
    without ``trust_remote_code``: returns the module (``.SmeltForCausalLM``, ``.SmeltConfig``).

    The files are imported as a package named after a hash of their contents, so two directories
    with different files never share classes, and importing the same files twice returns the
    first module. Raises ConfigError naming a missing file.
    """
    directory = Path(directory)
    digest = hashlib.sha256()
    for name in MODELING_FILES:
        path = directory / name
        if not path.is_file():
            raise ConfigError(f"{path}: missing; a model_type smelt directory needs {' and '.join(MODELING_FILES)} "
                              "(write it with smelt_ds.interop.smelt_format.write_hf_dir)")
        digest.update(path.read_bytes())
    package = f"_smelt_hf_{digest.hexdigest()[:16]}"
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(directory.resolve())]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{package}.modeling_smelt")


def write_hf_dir(model: SmeltLM, cfg: RunConfig, out: str | Path, *, eot_id: int = 0, pad_id: int = 1,
                 max_shard_size: int | str = "5GB") -> Path:
    """Write ``model`` as a ``model_type: smelt`` transformers directory ``out`` (no tokenizer files).

    ``out`` gets the two standalone files, ``config.json`` (:func:`smelt_hf_config` of ``cfg``),
    ``generation_config.json`` and the weights as safetensors (sharded with an index above
    ``max_shard_size``), written by ``SmeltForCausalLM.save_pretrained`` of the copied files, so
    the directory loads with ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)``.
    ``eot_id`` / ``pad_id``: special token ids (the built-in tokenizer's are 0 and 1). Existing files
    of those names are overwritten; the caller decides whether ``out`` may be written. Raises
    ConfigError when ``model``'s visit plan or weights do not match ``cfg``.
    """
    out = Path(out)
    plan = [tuple(v) for v in build_schedule(cfg.loop, cfg.model.num_layers).plan]
    if [tuple(v) for v in model.schedule.plan] != plan:
        raise ConfigError(f"the model runs the visit plan {model.schedule.layers()} but the recipe's `loop` gives "
                          f"{[layer for layer, _ in plan]}: export with the loop the model was built with")
    out.mkdir(parents=True, exist_ok=True)
    for src in modeling_files():
        shutil.copyfile(src, out / src.name)
    module = load_modeling_module(out)
    hf_config = smelt_hf_config(cfg, eot_id, pad_id)
    hf_config.pop("model_type")
    config = module.SmeltConfig(**hf_config)
    tie = cfg.model.tie_embeddings
    hf_state = to_hf_state_dict(model.state_dict(), tie)
    if tie:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    with torch.device("meta"):
        hf_model = module.SmeltForCausalLM(config)
    try:
        hf_model.load_state_dict(hf_state, strict=True, assign=True)
    except RuntimeError as e:
        raise ConfigError(f"the model's weights do not fit the transformers SmeltForCausalLM of its recipe: "
                          f"{e}") from None
    if tie:
        hf_model.tie_weights()
    hf_model.save_pretrained(out, max_shard_size=max_shard_size)
    return out
