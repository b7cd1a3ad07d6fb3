"""``smelt-ds export RUN --format hf -o OUT``: a run in the Hugging Face transformers format.

OUT holds ``config.json``, ``model.safetensors`` (sharded with ``model.safetensors.index.json``
above ``max_shard_size``), ``generation_config.json``, the tokenizer (``tokenizer.json`` +
``tokenizer_config.json``, a fast tokenizer that loads with ``AutoTokenizer``), a model card
``README.md`` and ``smelt_ds_export.json`` (provenance and the parity check). A Baseline whose
options map onto a transformers architecture (:func:`smelt_ds.interop.known_archs.match_hf_architecture`)
is written as that architecture and loads with no custom code; every other model, every looped one
among them, is ``model_type: smelt`` with the standalone ``configuration_smelt.py`` and
``modeling_smelt.py`` beside the weights (``trust_remote_code=True``).

Every export is proven by parity before it is complete: the written directory is loaded with
``AutoModelForCausalLM.from_pretrained`` and its logits on a fixed batch must equal the source
model's (fp32). Files are written to a new staging directory beside OUT
(:func:`smelt_ds.files.staged_directory`) and renamed into place after the check, so a partial or
unchecked export is never taken for a complete one; OUT may only be empty or an earlier Hugging Face
export (not a smelt-ds export: that is refused, naming it).

The tokenizer adds the end-of-text token in front of a text by default (its BOS token): a request
then reads as a document start, as in training (documents are separated by end-of-text), in
``smelt-ds generate`` and in the ``smelt-ds`` harness model. ``add_special_tokens=False`` gives the
ids of smelt-ds's own tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.loading import load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.cost.budget import compute_budget
from smelt_ds.data.tokenizer import special_ids
from smelt_ds.errors import ConfigError
from smelt_ds.files import staged_directory, write_json_atomic, write_text_atomic
from smelt_ds.interop import known_archs, smelt_format
from smelt_ds.parallel.device import device_of, to_device
from smelt_ds.runs.export import EXPORT_FILES, HF_MARKER, REFERENCE_OVERRIDES, load_exported
from smelt_ds.runs.load import resolve_export
from smelt_ds.runs.provenance import RUN_TOKENIZER
from smelt_ds.runs.tokenizer_file import load_tokenizer

__all__ = ["HF_MARKER", "HFExport", "export_hf", "hf_tokenizer", "PARITY_ATOL", "PARITY_RTOL"]

#: files an HF export may hold (besides weight shards); an output directory holding anything else
#: is refused
_HF_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "README.md", "configuration_smelt.py", "modeling_smelt.py",
             "model.safetensors.index.json", HF_MARKER}
#: parity of the written directory's logits with the source model's (fp32, same batch)
PARITY_ATOL, PARITY_RTOL = 1e-4, 1e-4


@dataclass
class HFExport:
    """Result of :func:`export_hf`: ``out`` directory, ``model_type`` written (``smelt`` or a
    transformers architecture), ``reasons`` it is not a known architecture (empty when it is),
    ``max_abs_diff`` of the parity check (logits), ``source`` smelt-ds export directory."""

    out: Path
    model_type: str
    reasons: list[str]
    max_abs_diff: float
    source: Path


def _is_own_output(names: set[str]) -> bool:
    """Whether a directory's entries are those of an earlier Hugging Face export."""
    rest = {n for n in names if not (n.startswith("model") and n.endswith(".safetensors"))}
    return rest <= _HF_FILES


def _check_output(out: Path) -> None:
    if out.is_file() or out.is_symlink():
        raise ConfigError(f"export output {str(out)!r} is a file: pass a directory path (-o DIR)")
    if out.is_dir():
        names = {p.name for p in out.iterdir()}
        if "model.pt" in names and HF_MARKER not in names and names <= EXPORT_FILES:
            raise ConfigError(f"export output {str(out)!r} holds a smelt-ds export (model.pt + config.yaml, "
                              "`smelt-ds export` without --format hf): refusing to replace it with a Hugging Face "
                              "export; pass another -o DIR, or remove that directory first to replace it")
        if names and not (_is_own_output(names) and HF_MARKER in names):
            raise ConfigError(f"export output {str(out)!r} exists and holds other files "
                              f"({', '.join(sorted(names)[:4])}): refusing to replace it; pass a new or empty "
                              "directory, or an earlier export to overwrite")


def hf_tokenizer(tokenizer_file: Path, cfg: RunConfig):
    """A ``transformers`` fast tokenizer of the run's ``tokenizer.json``: end-of-text is BOS and EOS,
    padding is the recipe's pad token, BOS is added in front of every text (a template
    post-processor) unless ``add_special_tokens=False``. Raises ConfigError naming the file when
    the recipe's special tokens are not in it."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(tokenizer_file, str(tokenizer_file))
    eot_id, pad_id = special_ids(tok, cfg.data.tokenizer, f"{tokenizer_file}: data.tokenizer")
    eot, pad = cfg.data.tokenizer.eot_token, cfg.data.tokenizer.pad_token
    tok.post_processor = processors.TemplateProcessing(single=f"{eot} $A", pair=f"{eot} $A {eot} $B",
                                                       special_tokens=[(eot, eot_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=pad,
                                   model_max_length=cfg.model.max_seq_len, clean_up_tokenization_spaces=False)
    return fast, eot_id, pad_id


def _parity_batch(cfg: RunConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    S = min(24, cfg.model.max_seq_len)
    return torch.randint(0, cfg.model.vocab_size, (2, S), generator=g)


def _check_parity(out: Path, model, cfg: RunConfig, remote_code: bool) -> float:
    """Load ``out`` with ``AutoModelForCausalLM`` and compare its logits with ``model``'s. Returns
    the max |difference|; raises ConfigError when it exceeds the tolerance or a weight is missing.

    Each model reads the batch on its own device (:func:`~smelt_ds.parallel.device.to_device` with
    its :func:`~smelt_ds.parallel.device.device_of`); the logits are compared on the CPU."""
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote_code, dtype=torch.float32,
                                                       output_loading_info=True)
    hf, info = loaded
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise ConfigError(f"export check: {out} does not load completely ({bad}): the conversion is wrong; "
                          "please report it")
    ids = _parity_batch(cfg)
    with torch.no_grad():
        want = model(*to_device(device_of(model), ids)).logits.float().cpu()
        got = hf(input_ids=to_device(device_of(hf), ids)[0]).logits.float().cpu()
    diff = float((got - want).abs().max())
    if not torch.allclose(got, want, atol=PARITY_ATOL, rtol=PARITY_RTOL):
        raise ConfigError(f"export check: the logits of the written directory differ from the source model's by up "
                          f"to {diff:.3g} (tolerance atol {PARITY_ATOL}, rtol {PARITY_RTOL}): the conversion is wrong "
                          "and nothing was exported; please report it")
    return diff


def _fmt_int(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{int(n):,}"


def model_card(cfg: RunConfig, model_type: str, reasons: list[str], source: dict[str, Any]) -> str:
    """The README.md of an HF export: architecture, visit plan, the three budgets (per-token
    FLOPs, non-embedding parameters, KV cache per token), training data and how to load it."""
    b = compute_budget(cfg)
    m, moe, sched = cfg.model, cfg.moe, cfg.schedule
    looped = any(s.repeats > 1 for s in sched.spans)
    remote = model_type == "smelt"
    load = ("AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)" if remote
            else "AutoModelForCausalLM.from_pretrained(path)")
    sources = ", ".join(s.label() for s in cfg.data.sources)
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        f"tags: [smelt-ds, mixture-of-experts, {'looped-transformer' if looped else 'baseline'}]", "---", "",
        f"# {cfg.name}", "",
        f"A {'SMELT (looped sparse MoE)' if looped else 'Baseline (unlooped sparse MoE)'} decoder trained with "
        f"smelt-ds, exported as `model_type: {model_type}`"
        + (" with its modeling code (`configuration_smelt.py`, `modeling_smelt.py`; needs `trust_remote_code=True`)."
           if remote else ", loadable by transformers with no custom code."), "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| unique layers | {m.num_layers} |", f"| visits per forward (effective depth) | {len(sched.plan)} |",
        f"| visit plan (unique layer per visit) | {' '.join(str(v.layer) for v in sched.plan)} |",
        f"| loop ranges [start, end) x repeats | "
        f"{', '.join(f'[{s.start}, {s.end}) x{s.repeats}' for s in sched.spans) or 'none'} |",
        f"| hidden size / heads / KV heads / head dim | {m.hidden_size} / {m.num_heads} / {m.num_kv_heads} / "
        f"{m.resolved_head_dim} |",
        f"| experts / top-k / expert FFN size | {moe.num_experts} / {moe.top_k} / {moe.expert_ffn_size} |",
        f"| router | {moe.score_func}, norm_topk_prob {moe.norm_topk_prob}, aux-loss-free bias "
        f"{moe.aux_loss_free_bias} |",
        f"| shared expert FFN size / first dense layers | {moe.shared_expert_ffn_size} / {m.first_k_dense} |",
        f"| vocabulary / max sequence length (tokens) | {m.vocab_size} / {m.max_seq_len} |", "",
        "## Budgets (smelt-ds `budget`, per token)", "",
        "| | |", "|---|---|",
        f"| forward FLOPs per token (seq_len {b.seq_len}, {b.attention_convention} attention) | "
        f"{b.forward_flops_per_token:.4g} |",
        f"| non-embedding parameters (all experts) | {_fmt_int(b.non_embedding_params)} |",
        f"| active non-embedding parameters (top-k experts; a looped layer's weights counted once) | "
        f"{_fmt_int(b.active_non_embedding_params)} |",
        f"| KV cache bytes per token ({b.kv_dtype}; one slot per visit) | {b.kv_cache_bytes_per_token:,} |", "",
        "## Training data", "",
        f"Sources: {sources}. Tokenizer: byte-level BPE, {m.vocab_size} tokens; end-of-text separates documents "
        "and is added in front of every text as BOS (`add_special_tokens=False` leaves it out).",
        f"Checkpoint: step {source.get('step', '?')}, {source.get('tokens_seen', '?'):,} training tokens."
        if isinstance(source.get("tokens_seen"), int) else "Checkpoint: see `smelt_ds_export.json`.", "",
        "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f"tok = AutoTokenizer.from_pretrained(path{', trust_remote_code=True' if remote else ''})",
        f"model = {load}",
        "ids = tok(\"def add(a, b):\", return_tensors=\"pt\")",
        "print(tok.decode(model.generate(**ids, max_new_tokens=32, do_sample=False)[0], skip_special_tokens=True))",
        "```", "",
        "lm-evaluation-harness: `lm_eval --model hf --model_args pretrained=PATH"
        + (",trust_remote_code=True" if remote else "") + ",add_bos_token=True --tasks ...`"
        " (`add_bos_token=True` scores every loglikelihood, multiple-choice and generation request as a document "
        "start, as smelt-ds's own harness model does; for rolling perplexity tasks pass `add_bos_token=False`: lm-eval "
        "then starts each document's first window with the BOS token, while `True`, or leaving it out, also scores "
        "the BOS itself).",
    ]
    if reasons:
        lines += ["", "Not exported as a transformers architecture because: " + "; ".join(reasons) + "."]
    return "\n".join(lines) + "\n"


def _source_facts(export_dir: Path) -> dict[str, Any]:
    src = export_dir / "SOURCE"
    facts: dict[str, Any] = {"export": str(export_dir.resolve())}
    if src.is_file():
        ckpt_dir = Path(src.read_text().strip())
        facts["checkpoint"] = str(ckpt_dir)
        marker = ckpt_dir / "COMPLETE"
        if marker.is_file():
            meta = json.loads(marker.read_text())
            facts.update({k: meta[k] for k in ("step", "tokens_seen", "world_size", "zero_stage", "moe_backend",
                                               "ep_size") if k in meta})
    return facts


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(value: str | int) -> int:
    """``--max-shard-size`` in bytes: an int, or a number with a unit (KB/MB/GB/TB = 10^3.., KiB/MiB/
    GiB/TiB = 2^10..). Raises ConfigError naming the flag for anything else or a size below 1 KB."""
    text = str(value).strip()
    num = text.rstrip("KMGTBikmgtb")
    unit = text[len(num):].upper()
    try:
        size = int(float(num) * _SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise ConfigError(f"`--max-shard-size` ({value!r}) is not a size: give bytes or a number with KB, MB, GB, "
                          "KiB, MiB or GiB, e.g. 5GB") from None
    if size < 10**3:
        raise ConfigError(f"`--max-shard-size` ({value!r}) is {size} bytes: give at least 1KB (each tensor goes "
                          "into one shard whatever the limit; 5GB is usual)")
    return size


def _check_not_a_source(out: Path, export_dir: Path) -> None:
    """The output must not be the export it reads, nor a run's export cache (``RUN/exports/<tag>``,
    which ``eval`` and ``generate`` reuse as smelt-ds exports)."""
    if out.resolve() == export_dir.resolve():
        raise ConfigError(f"export output {str(out)!r} is the export being read: pass another directory")
    if out.resolve().parent.name == "exports" and (out.resolve().parent.parent / "checkpoints").is_dir():
        raise ConfigError(f"export output {str(out)!r} is inside a run's export cache ({out.resolve().parent}), "
                          "which eval and generate reuse: pass a directory outside the run")


def export_hf(path: str | Path, out_dir: str | Path, arch: str = "auto", max_shard_size: str | int = "5GB",
              check: bool = True) -> HFExport:
    """Write run, checkpoint or smelt-ds export ``path`` as a Hugging Face model directory ``out_dir``.

    ``arch``: ``auto`` (a transformers architecture when the options map onto one, else ``smelt``)
    or ``smelt`` (always the standalone modeling code). ``max_shard_size``: safetensors shard size
    (:func:`parse_shard_size`: bytes, or e.g. ``"5GB"``). ``check``: the parity check of the
    written directory (leave on; off only to save the time and memory of loading a large model
    twice). A run or checkpoint directory is first exported to ``RUN/exports/<step>/`` (the
    smelt-ds export that eval and generate reuse).

    Raises ConfigError for a path with no checkpoint or export, an export without its tokenizer,
    an output that is a file, the source itself, a smelt-ds export (``smelt-ds export`` without
    ``--format hf``), or a directory holding anything but an earlier Hugging Face export, a bad
    shard size, and a failed parity check (nothing is then written to ``out_dir``)."""
    if arch not in ("auto", "smelt"):
        raise ConfigError(f"`--hf-arch` ({arch!r}) is unknown: use 'auto' or 'smelt'")
    shard_bytes = parse_shard_size(max_shard_size)
    out = Path(out_dir).resolve()
    _check_not_a_source(out, Path(path))  # before _check_output, which would call the source a smelt-ds export
    _check_output(out)
    export_dir = resolve_export(path)
    _check_not_a_source(out, export_dir)
    if not (export_dir / RUN_TOKENIZER).is_file():
        raise ConfigError(f"{export_dir} has no {RUN_TOKENIZER} (the tokenizer the run was trained with): export "
                          "the run again with this smelt-ds (`smelt-ds export RUN -o DIR`), which records it")
    model = load_exported(export_dir)
    cfg = load_config(export_dir / "config.yaml", REFERENCE_OVERRIDES)
    tokenizer, eot_id, pad_id = hf_tokenizer(export_dir / RUN_TOKENIZER, cfg)
    model_type, reasons = known_archs.match_hf_architecture(cfg)
    if arch == "smelt":
        model_type, reasons = None, []
    with staged_directory(out) as tmp:
        if model_type is None:
            smelt_format.write_hf_dir(model, cfg, tmp, eot_id=eot_id, pad_id=pad_id, max_shard_size=shard_bytes)
            written = "smelt"
        else:
            known_archs.build_known_hf(model, cfg, eot_id, pad_id).save_pretrained(tmp, max_shard_size=shard_bytes)
            written = model_type
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp / "tokenizer_config.json")
        _write_generation_config(tmp, eot_id, pad_id)
        source = _source_facts(export_dir)
        write_text_atomic(tmp / "README.md", model_card(cfg, written, reasons, source))
        diff = _check_parity(tmp, model, cfg, written == "smelt") if check else float("nan")
        write_json_atomic(tmp / HF_MARKER, {"format": "hf", "model_type": written, "source": source,
                                            "not_a_known_architecture_because": reasons,
                                            "parity": {"checked": check, "max_abs_diff_logits": diff,
                                                       "atol": PARITY_ATOL, "rtol": PARITY_RTOL}})
        _readable_as_umask_allows(tmp)
    return HFExport(out, written, reasons, diff, export_dir)


def _readable_as_umask_allows(directory: Path) -> None:
    """Give every file the mode a plain ``open`` would (``0o666 & ~umask``): safetensors shards
    come out of transformers' writer as 0600, unreadable to the group on a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast`` (transformers 5 writes its new
    ``TokenizersBackend``, which transformers 4 and the tools pinned to it cannot resolve; 5 reads
    both as the same class)."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json_atomic(path, config, indent=2)


def _write_generation_config(out: Path, eot_id: int, pad_id: int) -> None:
    from transformers import GenerationConfig

    generation = GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=pad_id, do_sample=False)
    generation.save_pretrained(out)
