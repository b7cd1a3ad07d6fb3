"""``smelt-ds <command>``: the command-line entry point, one table of the packages' commands.

Each package owns its commands in its ``cli.py``, which exposes ``add_parser(subparsers)``: it
registers the package's sub-commands and sets ``func`` on each (called with the parsed namespace,
returns an exit code). Bad configuration (:class:`ConfigError`) is printed as one clear line and
exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from smelt_ds import __version__
from smelt_ds.cost import cli as cost_cli
from smelt_ds.data import cli as data_cli
from smelt_ds.errors import ConfigError
from smelt_ds.eval import cli as eval_cli
from smelt_ds.eval import curves as curves_cli
from smelt_ds.interop import cli as interop_cli
from smelt_ds.launch import cli as launch_cli
from smelt_ds.study import cli as study_cli
from smelt_ds.train import cli as train_cli

#: package -> the module that registers its commands, in the order ``smelt-ds --help`` lists them
#: (cost: budget, match; data: data; train: train, export; eval: eval, analyze, generate, lm-eval;
#: curves: plot; interop: import-hf; study: memory, recipes, sweep, scaling; launch: render-job)
COMMANDS = {
    "cost": cost_cli,
    "data": data_cli,
    "train": train_cli,
    "eval": eval_cli,
    "curves": curves_cli,  # smelt_ds.eval.curves: `plot` (training curves of run directories)
    "interop": interop_cli,
    "study": study_cli,
    "launch": launch_cli,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smelt-ds",
        description="Train and analyse SMELT (Sparse MoE Transformer, middle layers Loop Twice) "
                    "and its matched Baselines with DeepSpeed.")
    parser.add_argument("--version", action="version", version=f"smelt-ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"smelt-ds {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
