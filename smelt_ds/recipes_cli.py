"""``smelt-ds recipes``: the table of shipped recipes and the ablations derived from a Baseline.

    smelt-ds recipes table [-o docs/recipes.md] [--check]
    smelt-ds recipes derive recipes/xl/baseline.yaml [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from smelt_ds.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="table of the shipped recipes; derive ablations from a Baseline",
                       description="Budgets, cluster layouts and memory per GPU of every shipped recipe, and the "
                                   "looped variants (smelt, uniform, bottom, top, asymmetric) of a Baseline.")
    rsub = p.add_subparsers(dest="recipes_command", metavar="SUBCOMMAND", required=True)
    t = rsub.add_parser("table", help="write docs/recipes.md (budgets, layout and memory per GPU of every recipe)")
    t.add_argument("-o", "--output", default=None, help="output file (default docs/recipes.md; '-' prints it)")
    t.add_argument("--check", action="store_true", help="exit 1 when the file differs from a fresh table")
    t.set_defaults(func=run_table)
    d = rsub.add_parser("derive", help="write the five looped variants next to a Baseline recipe (smelt-ds match)",
                        description="Run `smelt-ds match` for positions middle (smelt.yaml), uniform, bottom, top and "
                                    "asymmetric with --ep-size <moe.ep_size> --tolerance 0.01 and write each next to "
                                    "the Baseline, keeping the Baseline's comments.")
    d.add_argument("baseline", help="Baseline recipe, e.g. recipes/xl/baseline.yaml")
    d.add_argument("--check", action="store_true", help="exit 1 when a variant file differs from its derivation")
    d.set_defaults(func=run_derive)


def run_table(args: argparse.Namespace) -> int:
    from smelt_ds.recipes import DOCS_TABLE, recipes_table

    text = recipes_table()
    if args.output == "-":
        print(text, end="")
        return 0
    out = Path(args.output) if args.output else DOCS_TABLE
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is out of date: run `smelt-ds recipes table -o {out}`", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


def run_derive(args: argparse.Namespace) -> int:
    from smelt_ds.recipes import write_variants

    path = Path(args.baseline)
    if not path.is_file():
        raise ConfigError(f"Baseline recipe {str(path)!r} does not exist: pass e.g. recipes/xl/baseline.yaml")
    paths = write_variants(path, check=args.check)
    if args.check:
        for p in paths:
            print(f"{p} differs from its derivation: run `smelt-ds recipes derive {path}`", file=sys.stderr)
        return 1 if paths else 0
    for p in paths:
        print(f"wrote {p}")
    return 0
