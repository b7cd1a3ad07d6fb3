"""``smelt-ds import-hf`` (the ``--format hf`` of ``smelt-ds export`` is registered with ``export``)."""

from __future__ import annotations

import argparse

from smelt_ds.interop.export import export_hf
from smelt_ds.interop.import_hf import import_hf

__all__ = ["add_parser", "add_export_arguments", "run_export_hf"]


def add_parser(sub: argparse._SubParsersAction) -> None:
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


def add_export_arguments(e: argparse.ArgumentParser) -> None:
    """The ``--format hf`` options of ``smelt-ds export``."""
    e.add_argument("--format", choices=["smelt", "hf"], default="smelt",
                   help="smelt: model.pt + config.yaml (default); hf: a Hugging Face transformers model directory")
    e.add_argument("--hf-arch", choices=["auto", "smelt"], default="auto",
                   help="hf format: auto = a transformers architecture (qwen3_moe, qwen2_moe, mixtral) when the model maps "
                        "onto one, else model_type smelt with its modeling code; smelt = always the modeling code")
    e.add_argument("--max-shard-size", default="5GB",
                   help="hf format: largest safetensors shard (e.g. 5GB, 500MB; default 5GB)")
    e.add_argument("--no-check", action="store_true",
                   help="hf format: skip the parity check of the written directory (it loads the model a "
                        "second time)")


def run_export_hf(args: argparse.Namespace) -> int:
    res = export_hf(args.run_dir, args.output, arch=args.hf_arch, max_shard_size=args.max_shard_size,
                    check=not args.no_check)
    check = (f"logits equal the source model's (max |diff| {res.max_abs_diff:.2g})" if res.max_abs_diff == res.max_abs_diff
             else "parity not checked (--no-check)")
    print(f"wrote {res.out} (model_type {res.model_type}; {check})")
    for r in res.reasons:
        print(f"  not a transformers architecture: {r}")
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    recipe, weights = import_hf(args.path, args.output, args.weights_dir, args.name)
    print(f"wrote {recipe} and {weights}\n  train it: smelt-ds train {recipe}")
    return 0
