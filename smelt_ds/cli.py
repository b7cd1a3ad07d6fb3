"""``smelt-ds <command>``: the command-line entry point.

Each command lives in its own module, which exposes ``add_parser(subparsers)`` that registers the
sub-command and sets ``func`` (called with the parsed namespace, returns an exit code).
Bad configuration (:class:`ConfigError`) is printed as one clear line and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from smelt_ds.errors import ConfigError

# module path of each command group, in the order `smelt-ds --help` lists them
COMMAND_MODULES = [
    "smelt_ds.budget_cli",
    "smelt_ds.data.cli",
    "smelt_ds.train_cli",
    "smelt_ds.eval_cli",
    "smelt_ds.memory_cli",
    "smelt_ds.recipes_cli",
    "smelt_ds.launch_cli",
    "smelt_ds.scaling_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smelt-ds",
        description="Train and analyse SMELT (Sparse MoE Transformer, middle layers Loop Twice) "
                    "and its matched Baselines with DeepSpeed.")
    from smelt_ds import __version__

    parser.add_argument("--version", action="version", version=f"smelt-ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command not built yet
                continue
            raise
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
