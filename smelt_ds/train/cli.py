"""``smelt-ds train`` and ``smelt-ds export``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from smelt_ds.errors import ConfigError
from smelt_ds.interop.cli import add_export_arguments, run_export_hf
from smelt_ds.train.export import export_checkpoint
from smelt_ds.train.loop import add_train_arguments, launcher_command, run_and_report


def add_parser(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser("train", help="train a recipe (one process, or N local ranks via the deepspeed launcher)",
                       description="Train a SMELT or Baseline recipe. With --nproc N > 1 the deepspeed launcher "
                                   "starts N local ranks (gloo on CPU, NCCL on GPUs).")
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=1, help="local ranks (default 1: this process)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_train)

    e = sub.add_parser("export", help="consolidate a checkpoint into fp32 weights + the resolved recipe, or a "
                                      "Hugging Face model (--format hf)",
                       description="Write model.pt (fp32 state dict in the reference layout) and config.yaml, "
                                   "loadable by SmeltLM on one CPU process (smelt_ds.train.export.load_exported); "
                                   "with --format hf a transformers model directory (config.json, safetensors, "
                                   "tokenizer, model card), checked by parity with the source model.",
                       epilog="examples:\n  smelt-ds export runs/tiny-smelt -o exports/tiny-smelt\n"
                              "  smelt-ds export runs/tiny-smelt --format hf -o hf/tiny-smelt",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("run_dir", help="run directory, a checkpoints/stepNNNNNNNN directory, or (--format hf) an "
                                   "export directory")
    e.add_argument("-o", "--output", required=True, help="output directory")
    add_export_arguments(e)
    e.set_defaults(func=run_export)


def run_train(args: argparse.Namespace) -> int:
    if args.nproc > 1:

        cmd = launcher_command(args)
        print("launching: " + " ".join(cmd), file=sys.stderr)
        return subprocess.call(cmd, env=os.environ.copy())

    return run_and_report(args, "smelt-ds train")


def run_export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return run_export_hf(args)
    hf_only = [flag for flag, on in (("--hf-arch", args.hf_arch != "auto"), ("--no-check", args.no_check),
                                     ("--max-shard-size", args.max_shard_size != "5GB")) if on]
    if hf_only:
        raise ConfigError(f"{', '.join(hf_only)} {'applies' if len(hf_only) == 1 else 'apply'} to --format hf only: "
                          "add --format hf, or drop it")
    out = export_checkpoint(args.run_dir, args.output)
    print(f"wrote {out}")
    return 0
