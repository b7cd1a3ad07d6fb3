"""``smelt-ds budget`` and ``smelt-ds match``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from smelt_ds.arguments import CommaList
from smelt_ds.config.loading import load_config, read_recipe
from smelt_ds.cost.budget import DTYPE_BYTES, Budget, compute_budget, deviations, match_baseline
from smelt_ds.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help="per-token FLOPs, non-embedding parameters and KV cache of recipes",
                       description="Print the three budgets of each recipe side by side, with each one's "
                                   "relative deviation from the first recipe.")
    p.add_argument("recipes", nargs="+", help="YAML recipes; the first is the reference (the Baseline)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: train.seq_len)")
    p.add_argument("--kv-dtype", default="bf16", choices=list(DTYPE_BYTES),
                   help="KV-cache element type (default bf16: 2 bytes per element)")
    p.add_argument("--attention", default="full", choices=["full", "causal"],
                   help="attention FLOPs convention (default full; see smelt_ds/cost/budget.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override applied to every recipe, e.g. --set moe.top_k=2")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_budget)

    m = sub.add_parser("match", help="write the looped recipe matched to a Baseline on all three budgets",
                       description="Derive a looped recipe from a Baseline: visits equal the Baseline's layers, "
                                   "experts per layer chosen so total non-embedding parameters match.")
    m.add_argument("baseline", help="Baseline recipe (loop.position: none)")
    m.add_argument("--position", required=True,
                   choices=["uniform", "bottom", "middle", "top", "asymmetric", "custom"], help="loop position")
    m.add_argument("--ranges", default=None, action=CommaList, metavar="START:END:REPEATS[,...]",
                   help="explicit loop ranges of the looped model (with --position custom or asymmetric), "
                        "e.g. 0:1:2,1:2:3")
    m.add_argument("--repeats", type=int, default=2, help="visits per looped layer (default 2)")
    m.add_argument("--fraction", type=float, default=0.5, help="share of unique layers looped (default 0.5)")
    m.add_argument("--ep-size", type=int, default=None, help="experts per layer must divide by this")
    m.add_argument("--seq-len", type=int, default=None, help="tokens per sequence for the FLOPs budget")
    m.add_argument("--tolerance", type=float, default=None,
                   help="fail when any budget deviates by more than this fraction (e.g. 0.01)")
    m.add_argument("--name", default=None, help="name of the matched recipe")
    m.add_argument("-o", "--output", default=None, help="write the matched recipe YAML here")
    m.set_defaults(func=run_match)


def _fmt_int(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f}{unit}"
    return f"{n:.0f}"


def budget_table(budgets: list[Budget]) -> str:
    """Markdown table of budgets with deviations from the first row."""
    ref = budgets[0]
    head = ["recipe", "unique layers", "visits", "experts/layer", "fwd FLOPs/token", "train FLOPs/token",
            "non-emb params", "active non-emb", f"KV bytes/token ({ref.kv_dtype})", "dFLOPs", "dparams", "dKV"]
    rows = []
    for b in budgets:
        d = deviations(b, ref)
        rows.append([b.name, str(b.unique_layers), str(b.visits), str(b.num_experts),
                     _fmt_int(b.forward_flops_per_token), _fmt_int(b.train_flops_per_token),
                     _fmt_int(b.non_embedding_params), _fmt_int(b.active_non_embedding_params),
                     str(b.kv_cache_bytes_per_token),
                     f"{d['flops']:+.2%}", f"{d['params']:+.2%}", f"{d['kv_cache']:+.2%}"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    out.append(f"non-emb = non-embedding parameters: all experts counted, token embedding and output head "
               f"excluded; FLOPs at seq_len {ref.seq_len}, {ref.attention_convention} attention convention; "
               "deviations relative to the first recipe.")
    return "\n".join(out)


def run_budget(args: argparse.Namespace) -> int:
    budgets = []
    for path in args.recipes:
        cfg = load_config(path, args.set)
        b = compute_budget(cfg, args.seq_len, args.kv_dtype, args.attention)
        b.name = f"{cfg.name} ({path})"
        budgets.append(b)
    if args.json:
        ref = budgets[0]
        print(json.dumps([{**b.as_dict(), "deviation": deviations(b, ref)} for b in budgets], indent=2))
    else:
        print(budget_table(budgets))
    return 0


def parse_ranges(text: str) -> list[dict[str, int]]:
    """``"0:1:2,1:2:3"`` -> ``[{start: 0, end: 1, repeats: 2}, ...]``. Raises ConfigError."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            start, end, repeats = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"--ranges item {item!r}: expected START:END:REPEATS integers, e.g. 2:6:2") from None
        out.append({"start": start, "end": end, "repeats": repeats})
    return out


PAPER_TOLERANCE = 0.01  # SMELT matches its Baseline within 1% on each budget (docs/budgets.md)


def run_match(args: argparse.Namespace) -> int:
    path = Path(args.baseline)
    if not path.is_file():
        raise ConfigError(f"Baseline recipe {str(path)!r} does not exist: pass a YAML recipe path")
    raw = read_recipe(path)[0]  # its `base:` chain merged
    ranges = parse_ranges(args.ranges) if args.ranges else None
    res = match_baseline(raw, args.position, args.repeats, args.ep_size, args.fraction, ranges=ranges,
                         seq_len=args.seq_len,
                         tolerance=args.tolerance, name=args.name)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    off = {k: v for k, v in res.deviations.items() if abs(v) > PAPER_TOLERANCE}
    if args.tolerance is None and off:
        print("warning: the match misses the paper's 1% on " + ", ".join(f"{k} ({v:+.2%})" for k, v in off.items())
              + ": pass --tolerance 0.01 to make this an error, or change --ep-size / --ranges / the Baseline",
              file=sys.stderr)
    opts = [f"--position {args.position}", f"--repeats {args.repeats}", f"--fraction {args.fraction:g}"]
    opts += [f"--{k.replace('_', '-')} {v}" for k, v in (("ranges", args.ranges),
                                                         ("ep_size", args.ep_size), ("seq_len", args.seq_len),
                                                         ("tolerance", args.tolerance), ("name", args.name))
             if v is not None]
    header = (f"# Matched to {path} by `smelt-ds match {path} {' '.join(opts)}`\n"
              f"# deviations vs Baseline: FLOPs/token {res.deviations['flops']:+.3%}, non-embedding params "
              f"{res.deviations['params']:+.3%}, KV cache {res.deviations['kv_cache']:+.3%}\n")
    text = header + yaml.safe_dump(res.raw, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    print(budget_table([res.baseline, res.matched]), file=sys.stderr if not args.output else sys.stdout)
    return 0
