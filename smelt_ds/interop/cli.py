"""``smelt-ds export`` (the reference-layout export, :mod:`smelt_ds.runs.export`, or ``--format hf``) and
``smelt-ds import-hf``."""

from __future__ import annotations

import argparse

from smelt_ds.errors import ConfigError
from smelt_ds.interop.hf_export import export_hf
from smelt_ds.interop.import_hf import import_hf
from smelt_ds.runs.export import export_checkpoint

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export`` and ``import-hf``."""
    e = sub.add_parser("export", help="consolidate a checkpoint into fp32 weights + the resolved recipe, or a "
                                      "Hugging Face model (--format hf)",
                       description="Write model.pt (fp32 state dict in the reference layout) and config.yaml, "
                                   "loadable by SmeltLM on one CPU process (smelt_ds.runs.export.load_exported); "
                                   "with --format hf a transformers model directory (config.json, safetensors, "
                                   "tokenizer, model card), checked by parity with the source model.",
                       epilog="examples:\n  smelt-ds export runs/tiny-smelt -o exports/tiny-smelt\n"
                              "  smelt-ds export runs/tiny-smelt --format hf -o hf/tiny-smelt",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("run_dir", help="run directory, a checkpoints/stepNNNNNNNN directory, or (--format hf) an "
                                   "export directory")
    e.add_argument("-o", "--output", required=True, help="output directory")
    _add_hf_export_arguments(e)
    e.set_defaults(func=run_export)

    p = sub.add_parser(
        "import-hf", help="import a transformers MoE checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral, or a smelt-ds HF "
                          "export) as a recipe + weights",
        description="Read a local transformers checkpoint directory (config.json, safetensors, tokenizer.json) "
                    "and write a recipe whose train.init_from is a weights directory in smelt-ds's reference "
                    "layout, to continue pretraining it on any MoE backend.",
        epilog="example: smelt-ds import-hf ./Qwen3-30B-A3B -o recipes/qwen3-30b-a3b.yaml")
    p.add_argument("path", help="transformers checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="recipe file to write (YAML)")
    p.add_argument("--weights-dir", default=None,
                   help="weights directory to write (default: <recipe stem>-weights beside the recipe)")
    p.add_argument("--name", default=None, help="recipe name (default: the recipe file's stem, e.g. qwen3-30b-a3b)")
    p.set_defaults(func=run_import_hf)


def _add_hf_export_arguments(e: argparse.ArgumentParser) -> None:
    """The ``--format hf`` options of ``smelt-ds export``."""
    e.add_argument("--format", choices=["smelt", "hf"], default="smelt",
                   help="smelt: model.pt + config.yaml (default); hf: a Hugging Face transformers model directory")
    e.add_argument("--hf-arch", choices=["auto", "smelt"], default="auto",
                   help="hf format: auto = a transformers architecture (qwen3_moe, qwen2_moe, mixtral) when "
                        "the model maps onto one, else model_type smelt with its modeling code; smelt = always "
                        "the modeling code")
    e.add_argument("--max-shard-size", default="5GB",
                   help="hf format: largest safetensors shard (e.g. 5GB, 500MB; default 5GB)")
    e.add_argument("--no-check", action="store_true",
                   help="hf format: skip the parity check of the written directory (it loads the model a "
                        "second time)")


def run_export(args: argparse.Namespace) -> int:
    """``smelt-ds export``: the reference-layout export (:func:`smelt_ds.runs.export.export_checkpoint`),
    or with ``--format hf`` a Hugging Face directory (:func:`smelt_ds.interop.hf_export.export_hf`).
    Raises ConfigError for an ``hf``-format option without ``--format hf``."""
    if args.format == "hf":
        return _run_export_hf(args)
    hf_only = [flag for flag, on in (("--hf-arch", args.hf_arch != "auto"), ("--no-check", args.no_check),
                                     ("--max-shard-size", args.max_shard_size != "5GB")) if on]
    if hf_only:
        raise ConfigError(f"{', '.join(hf_only)} {'applies' if len(hf_only) == 1 else 'apply'} to --format hf only: "
                          "add --format hf, or drop it")
    out = export_checkpoint(args.run_dir, args.output)
    print(f"wrote {out}")
    return 0


def _run_export_hf(args: argparse.Namespace) -> int:
    res = export_hf(args.run_dir, args.output, arch=args.hf_arch, max_shard_size=args.max_shard_size,
                    check=not args.no_check)
    check = (f"logits equal the source model's (max |diff| {res.max_abs_diff:.2g})"
             if res.max_abs_diff == res.max_abs_diff else "parity not checked (--no-check)")
    print(f"wrote {res.out} (model_type {res.model_type}; {check})")
    for r in res.reasons:
        print(f"  not a transformers architecture: {r}")
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    recipe, weights = import_hf(args.path, args.output, args.weights_dir, args.name)
    print(f"wrote {recipe} and {weights}\n  train it: smelt-ds train {recipe}")
    return 0
