"""``smelt-ds <command>``: the command-line entry point, one table of the packages' commands.

Each package owns its commands in a module exposing ``add_parser(subparsers)`` (its ``cli.py``, or
the module a command wraps): it registers the module's sub-commands and sets ``func`` on each
(called with the parsed namespace, returns an exit code). :data:`COMMANDS` maps every command to
that module and to the one-line help ``smelt-ds --help`` lists; only the chosen command's module
is imported, so ``smelt-ds --help`` imports no package and ``smelt-ds budget`` no torch
(``bench/cli_startup.py`` prints the start-up times; tests/test_layering.py reads the table as
imports of this module). Bad configuration (:class:`ConfigError`) is printed as one clear line and
exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from smelt_ds import __version__
from smelt_ds.arguments import bare_overrides, override_hint
from smelt_ds.errors import ConfigError

#: command -> (module whose ``add_parser`` registers it, the help line `smelt-ds --help` shows),
#: in the order `smelt-ds --help` lists them. tests/test_cli.py holds each module's own help equal.
COMMANDS: dict[str, tuple[str, str]] = {
    "budget": ("smelt_ds.cost.cli", "per-token FLOPs, non-embedding parameters and KV cache of recipes"),
    "match": ("smelt_ds.cost.cli", "write the looped recipe matched to a Baseline on all three budgets"),
    "config": ("smelt_ds.config.cli", "the resolved recipe (what `smelt-ds train` runs); validate recipes"),
    "data": ("smelt_ds.data.cli", "build the built-in corpus, train a tokenizer, prepare shards"),
    "train": ("smelt_ds.train.cli", "train a recipe (one process, or N local ranks via the deepspeed launcher)"),
    "export": ("smelt_ds.interop.cli", "consolidate a checkpoint into fp32 weights + the resolved recipe, or a "
                                       "Hugging Face model (--format hf)"),
    "checkpoint": ("smelt_ds.runs.cli", "what a checkpoint holds (step, layout, files, completeness) and the layouts "
                                        "it can resume at"),
    "eval": ("smelt_ds.eval.cli", "validation loss, in-context curves, harness tasks, HumanEval, loop counts"),
    "analyze": ("smelt_ds.eval.cli", "attention sink, routing and logit lens per (layer, visit)"),
    "generate": ("smelt_ds.eval.cli", "decode text with the per-visit KV cache and print tokens/s"),
    "lm-eval": ("smelt_ds.eval.cli", "lm-evaluation-harness's own command line with the smelt-ds model registered"),
    "plot": ("smelt_ds.eval.curves", "training curves of runs side by side (PNG + CSV)"),
    "import-hf": ("smelt_ds.interop.cli", "import a transformers MoE checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral, or a "
                                          "smelt-ds HF export) as a recipe + weights"),
    "memory": ("smelt_ds.study.cli", "memory per GPU for each ZeRO option and activation-checkpointing policy"),
    "recipes": ("smelt_ds.study.cli", "table of the shipped recipes; derive ablations from a Baseline"),
    "sweep": ("smelt_ds.study.sweep", "run (locally, one after another) or render (Slurm / Kubernetes) a scaling "
                                      "sweep"),
    "scaling": ("smelt_ds.study.cli", "scaling-law analysis of finished runs (smelt-ds scaling fit)"),
    "preflight": ("smelt_ds.launch.preflight", "every check training makes before its first step, before the queue"),
    "render-job": ("smelt_ds.launch.cli", "render a deepspeed / Slurm / Kubernetes job for a recipe (nothing is "
                                          "launched)"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``smelt-ds`` parser. ``commands``: the commands whose modules are imported and registered
    in full (the others get a placeholder with their help line, enough for ``smelt-ds --help`` and
    for argparse's choice of command); None: every module (the whole tree, e.g. for tests)."""
    parser = argparse.ArgumentParser(
        prog="smelt-ds",
        description="Train and analyse SMELT (Sparse MoE Transformer, middle layers Loop Twice) "
                    "and its matched Baselines with DeepSpeed.")
    parser.add_argument("--version", action="version", version=f"smelt-ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = {COMMANDS[c][0] for c in (COMMANDS if commands is None else commands) if c in COMMANDS}
    for name, (module, help_line) in COMMANDS.items():
        if module in wanted:
            importlib.import_module(module).add_parser(sub)  # registers all of the module's commands
            wanted.discard(module)
        elif name not in sub.choices:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named in ``argv``: its first argument that is not an option (the top-level
    options, ``-h`` and ``--version``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    parser = build_parser([command] if command else [])
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"smelt-ds {args.command}: error: {e}", file=sys.stderr)
        return 2


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Exit 2 for arguments the command does not take, as argparse does; a bare ``KEY=VALUE``
    for a command that has ``--set`` is named as a forgotten ``--set`` (:func:`override_hint`)."""
    bare = bare_overrides(extra)
    if bare and hasattr(args, "set"):
        print(f"smelt-ds {args.command}: error: " + "; ".join(override_hint(b) for b in bare), file=sys.stderr)
        sys.exit(2)
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


if __name__ == "__main__":
    sys.exit(main())
