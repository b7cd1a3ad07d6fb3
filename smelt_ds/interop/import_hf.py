"""``smelt-ds import-hf PATH -o RECIPE.yaml``: continue pretraining a transformers MoE checkpoint.

Reads a local transformers checkpoint directory (Qwen3-MoE or Mixtral; what maps is decided by
:func:`smelt_ds.interop.known_archs.import_hf_model`, which loads it with transformers itself, so
any on-disk expert layout transformers reads is accepted), or a ``model_type: smelt`` directory of
``smelt-ds export --format hf`` (read from its safetensors files; its modeling code is not run),
and writes:

* a **weights directory** (default ``<RECIPE stem>-weights/`` beside the recipe): ``model.pt`` (the
  state dict in smelt-ds's reference layout), ``config.yaml`` (the resolved recipe),
  ``tokenizer.json`` (the checkpoint's tokenizer) and ``SOURCE`` (the checkpoint path). It is an
  export directory: ``train.init_from``, ``smelt-ds eval`` and ``generate`` take it, on any MoE backend;
* the **recipe** ``RECIPE.yaml``: the model, MoE and loop sections of the checkpoint (a Baseline:
  loop position ``none``), the tokenizer, ``train.init_from`` pointing at the weights directory,
  and the default data sources for the user to replace.

Both are written atomically; neither replaces anything but an earlier import.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from smelt_ds.config.loading import config_from_dict, dump_config
from smelt_ds.errors import ConfigError
from smelt_ds.files import staged_directory, write_text_atomic
from smelt_ds.interop import known_archs, smelt_format
from smelt_ds.interop.configuration_smelt import SmeltConfig
from smelt_ds.model import SmeltLM
from smelt_ds.runs.export import EXPORT_FILES, HF_MARKER, save_weights
from smelt_ds.runs.provenance import RUN_TOKENIZER
from smelt_ds.runs.tokenizer_file import load_tokenizer

__all__ = ["RECIPE_HEADER", "import_hf", "hf_special_tokens"]

#: first line of every recipe import-hf writes (an existing file starting with it may be replaced)
RECIPE_HEADER = "# written by smelt-ds import-hf"


def hf_special_tokens(path: Path) -> tuple[str, str]:
    """``(eot_token, pad_token)`` for smelt-ds from a checkpoint's ``tokenizer_config.json``:
    end-of-text is its EOS token; padding is its pad token when that differs from EOS, else the
    first other special (added) token of ``tokenizer.json``. Raises ConfigError naming the file
    when there is no EOS token or no second special token."""
    tc_path, tj_path = path / "tokenizer_config.json", path / "tokenizer.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}

    def content(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    eos, pad = content(tc.get("eos_token")), content(tc.get("pad_token"))
    added = [t["content"] for t in json.loads(tj_path.read_text()).get("added_tokens", []) if t.get("special")]
    if eos is None:
        if not added:
            raise ConfigError(f"{tc_path}: no `eos_token` and {tj_path} has no special tokens: set eos_token in "
                              "tokenizer_config.json to the end-of-text token")
        eos = added[0]
    if pad is None or pad == eos:
        others = [t for t in added if t != eos]
        if not others:
            raise ConfigError(f"{tc_path}: `pad_token` ({pad!r}) is missing or equals `eos_token` ({eos!r}) and "
                              f"{tj_path} has no other special token: smelt-ds pads with its own token; add one")
        pad = others[0]
    return eos, pad


def _smelt_recipe(c: dict[str, Any], source: str) -> dict[str, Any]:
    """model / moe / loop sections of a ``model_type: smelt`` config.json (the keys
    :func:`smelt_ds.interop.smelt_format.smelt_hf_config` writes)."""
    try:
        rope = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
        model = {"vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "num_layers": c["num_hidden_layers"],
                 "num_heads": c["num_attention_heads"], "num_kv_heads": c["num_key_value_heads"],
                 "head_dim": c["head_dim"], "max_seq_len": c["max_position_embeddings"], "rope_theta": rope,
                 "norm_eps": c["rms_norm_eps"], "tie_embeddings": c["tie_word_embeddings"],
                 "qk_norm": c.get("qk_norm", False), "first_k_dense": c["first_k_dense_replace"],
                 "dense_ffn_size": c["intermediate_size"]}
        moe = {"num_experts": c["num_experts"], "top_k": c["num_experts_per_tok"],
               "expert_ffn_size": c["moe_intermediate_size"],
               "shared_expert_ffn_size": c["shared_expert_intermediate_size"], "score_func": c["scoring_func"],
               "norm_topk_prob": c["norm_topk_prob"], "aux_loss_free_bias": c["aux_loss_free_bias"]}
        ranges = [{"start": a, "end": b, "repeats": r} for a, b, r in (c.get("loop_ranges") or [])]
    except KeyError as e:
        raise ConfigError(f"{source}: key {e} is missing: a model_type smelt config.json written by "
                          "`smelt-ds export --format hf` has it") from None
    loop: dict[str, Any] = ({"position": "custom", "ranges": ranges, "order": c.get("loop_order", "block"),
                             "input_injection": c.get("input_injection", "none")} if ranges
                            else {"position": "none"})
    return {"model": model, "moe": moe, "loop": loop}


def _check_smelt_config(config: dict[str, Any], path: Path) -> None:
    """The rules the modeling code's SmeltConfig applies (visit plan, ranges, sizes), plus what the
    recipe cannot express (another activation or RoPE type). Raises ConfigError naming the key."""
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: `hidden_act` ({config['hidden_act']!r}) is not supported: "
                          "smelt-ds experts use silu")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ConfigError(f"{path}: `rope_parameters` ({rope or config.get('rope_scaling')}) is not supported: "
                          "smelt-ds uses plain RoPE (rope_type default)")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "auto_map", "architectures",
                                                           "transformers_version")}
    try:
        SmeltConfig(**fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not (path.parent / HF_MARKER).is_file():
        print(f"warning: {path.parent} has no {HF_MARKER}: it was not written completely by `smelt-ds export "
              "--format hf` (or the file was dropped); the weights are checked against config.json, not by parity",
              file=sys.stderr)


def _import_smelt(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Recipe sections and state dict of a ``model_type: smelt`` directory, read from its
    safetensors files (its modeling code is not run). Raises ConfigError naming the file."""
    from safetensors.torch import load_file

    config = _read_json(src / "config.json")
    _check_smelt_config(config, src / "config.json")
    raw = _smelt_recipe(config, str(src / "config.json"))
    index = src / "model.safetensors.index.json"
    files = (sorted(set(_read_json(index).get("weight_map", {}).values())) if index.is_file()
             else ["model.safetensors"])
    hf_state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (src / name).is_file():
            raise ConfigError(f"{src / name} is missing (listed by {index.name if index.is_file() else 'default'}): "
                              "the checkpoint is partial; copy it again")
        try:
            hf_state.update(load_file(str(src / name)))
        except Exception as e:  # safetensors raises its own error type for a damaged header
            raise ConfigError(f"{src / name} is not a readable safetensors file ({type(e).__name__}: {e}): "
                              "it may be truncated; copy it again") from None
    state = smelt_format.from_hf_state_dict(hf_state, bool(raw["model"]["tie_embeddings"]))
    cfg = config_from_dict({**raw, "train": {"seq_len": min(128, int(raw["model"]["max_seq_len"]))}})
    own = SmeltLM(cfg.model, cfg.moe, cfg.loop).state_dict()
    wrong = [f"{k} {tuple(v.shape)} (expected {tuple(own[k].shape)})" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    missing = sorted(k for k in own if k not in state and not (k.endswith("expert_bias")
                                                              and not cfg.moe.aux_loss_free_bias))
    unexpected = sorted(k for k in state if k not in own)
    if wrong or missing or unexpected:
        raise ConfigError(f"{src}: the weights do not fit config.json (wrong shape: {wrong[:3]}; missing: "
                          f"{missing[:3]}; unexpected: {unexpected[:3]}): the files belong to another model or "
                          "config.json was edited; export the model again")
    return raw, state


def _check_target(weights: Path, recipe: Path) -> None:
    if recipe.exists() and (recipe.is_dir() or not recipe.read_text(errors="replace").startswith(RECIPE_HEADER)):
        raise ConfigError(f"`-o` ({recipe}) exists and was not written by import-hf: refusing to replace it; "
                          "pass a new file name")
    if weights.is_file():
        raise ConfigError(f"`--weights-dir` ({weights}) is a file: pass a directory path")
    if weights.is_dir():
        names = {p.name for p in weights.iterdir()}
        if names and not (names <= EXPORT_FILES and "model.pt" in names):
            raise ConfigError(f"`--weights-dir` ({weights}) exists and holds other files "
                              f"({', '.join(sorted(names)[:4])}): refusing to replace it; pass a new or empty "
                              "directory, or an earlier import to overwrite")


def _recipe(raw_model: dict, name: str, tokenizer: Path, eot: str, pad: str, weights: Path) -> dict:
    seq = min(2048, int(raw_model["model"]["max_seq_len"]))
    return {"name": name, **raw_model,
            "data": {"tokenizer": {"path": str(tokenizer), "eot_token": eot, "pad_token": pad}},
            "train": {"init_from": str(weights), "seq_len": seq}}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not readable JSON ({type(e).__name__}: {e}): restore the file from the "
                          "checkpoint's source") from None


def _check_tokenizer(src: Path) -> None:
    """Before any weight is read: the checkpoint has a tokenizer.json that fits its vocabulary."""
    if not (src / "tokenizer.json").is_file():
        raise ConfigError(f"{src} has no tokenizer.json (a fast tokenizer): save one with "
                          "AutoTokenizer.from_pretrained(...).save_pretrained(PATH) and import again")
    tok = load_tokenizer(src / "tokenizer.json", str(src / "tokenizer.json"))
    config = _read_json(src / "config.json") if (src / "config.json").is_file() else {}
    rows = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if isinstance(rows, int) and top > rows:
        raise ConfigError(f"{src / 'tokenizer.json'} has token ids up to {top - 1} but config.json `vocab_size` is "
                          f"{rows}: the tokenizer belongs to another model; use the checkpoint's own tokenizer")


def import_hf(path: str | Path, recipe_path: str | Path, weights_dir: str | Path | None = None,
              name: str | None = None) -> tuple[Path, Path]:
    """Import the transformers checkpoint at ``path``; returns ``(recipe_path, weights_dir)``.

    ``name``: the recipe name (default: the recipe file's stem, so the run directory
    ``runs/<name>`` is new). Raises ConfigError for a missing directory or ``config.json``, an
    architecture or option that does not map (named with its config.json key), missing or
    mismatched weights, a checkpoint without ``tokenizer.json`` or with one that does not fit its
    vocabulary (checked before any weight is read), and targets holding anything but an earlier
    import."""
    src = Path(path)
    recipe = Path(recipe_path).resolve()
    weights = (Path(weights_dir) if weights_dir is not None else recipe.with_name(recipe.stem + "-weights")).resolve()
    _check_target(weights, recipe)
    if src.is_dir():
        _check_tokenizer(src)
    if (src / "config.json").is_file() and _read_json(src / "config.json").get("model_type") == "smelt":
        raw_model, state = _import_smelt(src)
    else:
        raw_model, state = known_archs.import_hf_model(src)
    eot, pad = hf_special_tokens(src)
    raw = _recipe(raw_model, name or recipe.stem, weights / RUN_TOKENIZER, eot, pad, weights)
    cfg = config_from_dict(raw)  # validates the whole recipe before anything is written
    with staged_directory(weights) as tmp:
        save_weights(state, tmp)
        shutil.copyfile(src / "tokenizer.json", tmp / RUN_TOKENIZER)
        dump_config(cfg, tmp / "config.yaml")
        (tmp / "SOURCE").write_text(str(src.resolve()) + "\n")
    text = (f"{RECIPE_HEADER} from {src.resolve()}\n# weights: {weights} (train.init_from); replace "
            "data.sources with your corpus (default: the built-in corpus)\n"
            + yaml.safe_dump(raw, sort_keys=False))
    write_text_atomic(recipe, text)
    return recipe, weights
