"""``smelt-ds config show`` (the resolved recipe: what ``smelt-ds train`` runs), ``smelt-ds config
validate`` (load and check recipes, nothing else) and ``smelt-ds config reference`` (the recipe
reference, docs/configuration.md, written from the fields' descriptions).

    smelt-ds config show recipes/s/top.yaml --set train.max_steps=200 [--json]
    smelt-ds config validate recipes/s/*.yaml
    smelt-ds config reference [-o docs/configuration.md] [--check]   (prints it without -o)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from smelt_ds.config.loading import config_to_dict, dump_config, load_config
from smelt_ds.config.reference import reference_markdown
from smelt_ds.errors import ConfigError
from smelt_ds.files import write_or_check_generated
from smelt_ds.resources import CHECKOUT

#: the page ``smelt-ds config reference --check`` compares with by default: the checkout's docs, else under the
#: working directory (writing it takes ``-o``: without it the command prints the reference)
REFERENCE_PAGE = (CHECKOUT if CHECKOUT is not None else Path()) / "docs" / "configuration.md"

SET_HELP = "override a recipe field (YAML value; repeatable), e.g. --set train.max_steps=200"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``smelt-ds config {show,validate}``."""
    p = sub.add_parser("config", help="the resolved recipe (what `smelt-ds train` runs); validate recipes",
                       description="Resolve recipes as `smelt-ds train` does: `base:` chains merged, defaults "
                                   "filled, --set overrides applied, every field validated.")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    s = csub.add_parser("show", help="print the resolved recipe as YAML (the run directory's config.yaml)",
                        description="Print the resolved recipe: the YAML `smelt-ds train` writes as the run's "
                                    "config.yaml (there `train.run_dir` also records `--run-dir`, and with "
                                    "`train.init_from` the export's tokenizer replaces `data.tokenizer`).",
                        epilog="example: smelt-ds config show recipes/tiny/smelt.yaml --set train.max_steps=200")
    s.add_argument("recipe", help="YAML recipe, e.g. recipes/s/top.yaml")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    s.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    s.set_defaults(func=run_show)
    v = csub.add_parser("validate", help="check recipes (exit 2 naming each bad one), train nothing",
                        description="Load and validate each recipe (with the --set overrides applied to each); "
                                    "print one line per recipe, the error for a bad one.",
                        epilog="example: smelt-ds config validate recipes/tiny/smelt.yaml recipes/tiny/baseline.yaml")
    v.add_argument("recipes", nargs="+", metavar="RECIPE", help="YAML recipes")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    v.set_defaults(func=run_validate)
    r = csub.add_parser("reference", help="print the recipe reference (docs/configuration.md): every recipe "
                                          "field's type, default and description",
                        description="Print the recipe reference (every section and field of the run config with\n"
                                    "its YAML type, default and description, read from the config's pydantic\n"
                                    "fields), write it with -o, or check that a file is up to date.",
                        epilog="examples:\n"
                               "  smelt-ds config reference                           # print it (pipe it to less)\n"
                               "  smelt-ds config reference -o docs/configuration.md  # rewrite the checkout's page\n"
                               "  smelt-ds config reference --check                   # exit 1 when it is stale",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("-o", "--output", default=None,
                   help="write the reference to this file (default: print it; '-' prints it too)")
    r.add_argument("--check", action="store_true",
                   help="exit 1 when the file (-o, default docs/configuration.md of the checkout) differs from a "
                        "fresh reference")
    r.set_defaults(func=run_reference)


def run_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.set)
    print(json.dumps(config_to_dict(cfg), indent=2) if args.json else dump_config(cfg), end="\n" if args.json else "")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.recipes:
        try:
            cfg = load_config(path, args.set)
        except ConfigError as e:
            bad += 1
            print(f"smelt-ds config validate: error: {e}", file=sys.stderr)
            continue
        print(f"{path}: ok ({cfg.name})")
    return 2 if bad else 0


def run_reference(args: argparse.Namespace) -> int:
    """Print the reference, write it to ``-o``, or ``--check`` a file (default :data:`REFERENCE_PAGE`):
    nothing is written without ``-o``, so an installed checkout's docs are never overwritten by a look-up."""
    output = args.output if args.output is not None or args.check else "-"
    return write_or_check_generated(reference_markdown(), output, REFERENCE_PAGE, "smelt-ds config reference",
                                    args.check)
