"""The study's commands: ``smelt-ds memory`` (what fits before launch, estimated and measured),
``smelt-ds recipes`` (the table of shipped recipes, ablations derived from a Baseline) and
``smelt-ds scaling fit`` (per-architecture Chinchilla fits, compute-optimal frontiers and
training-FLOPs savings from finished runs). ``smelt-ds sweep`` lives in :mod:`smelt_ds.study.sweep`,
so that these commands start without the training stack.

    smelt-ds memory recipes/m/smelt.yaml [--layout h200] [--nodes N] [--device-memory 79.1GiB] [--measure]
    smelt-ds recipes table [-o docs/recipes.md] [--check]
    smelt-ds recipes derive recipes/xl/baseline.yaml [--check]
    smelt-ds scaling fit RUNS_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from smelt_ds.arguments import CommaList, Once
from smelt_ds.cost.budget import DTYPE_BYTES
from smelt_ds.errors import ConfigError
from smelt_ds.files import write_or_check_generated
from smelt_ds.launch.placement import CPU_LAYOUT, MIN_HEADROOM, Placement, nodes_to_fit, place
from smelt_ds.parallel.memory import (
    POLICIES,
    ZERO_OPTIONS,
    GiB,
    _with_batch,
    estimate,
    format_bytes,
    format_table,
    format_verdict,
    parse_bytes,
    row_fits,
    verdict,
)
from smelt_ds.study.memory_profile import measure
from smelt_ds.study.recipes import DOCS_TABLE, recipes_table, write_variants
from smelt_ds.study.scaling import analyse, collect_runs, measured_savings, summarize_exclusions, write_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``memory``, ``recipes`` and ``scaling``."""
    _add_memory_parser(sub)
    _add_recipes_parser(sub)
    _add_scaling_parser(sub)


def _names(allowed: list[str], what: str):
    """An argparse ``type`` for a comma-separated list of names out of ``allowed``: a bad name
    fails at parse time, naming it and the choices."""

    def check(text: str) -> str:
        bad = [t.strip() for t in text.split(",") if t.strip() and t.strip() not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}: choose from {','.join(allowed)}")
        return text

    return check


#: exit status of ``smelt-ds memory`` when the recipe's own setting does not fit (2: bad input)
EXIT_DOES_NOT_FIT = 3


def _add_memory_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory", help="memory per GPU for each ZeRO option and activation-checkpointing policy",
        description="Estimate parameters, gradients, optimizer states, activations, temporary buffers and the "
                    "inference KV cache per GPU for every ZeRO stage / offload option and checkpointing policy on "
                    "the recipe's cluster layout (the one `smelt-ds render-job` uses: --layout, else "
                    "cluster.default; its overrides applied), then a verdict on the recipe's own setting: FITS "
                    f"when it leaves {MIN_HEADROOM:.0%} of the device memory free, as render-job requires, else "
                    "DOES NOT FIT with the terms over and the settings (ZeRO option, checkpointing policy, node "
                    "count) that fit. --measure runs a few real steps here and prints measured next to predicted.",
        epilog=f"exit status: 0 when the recipe's own setting fits, {EXIT_DOES_NOT_FIT} when it does not (gate a "
               "launch on it), 2 for bad input. Example: smelt-ds memory recipes/m/smelt.yaml --layout h200")
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/m/smelt.yaml")
    p.add_argument("--layout", default=None,
                   help="the recipe's cluster layout (e.g. h100, h200; default cluster.default, else the first); "
                        "recipes without cluster.layouts (tiny) take 1 x 1 GPU")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the layout's; 1 without layouts)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node (default: the layout's; 1 without layouts)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory per GPU with its unit: GB = 1e9 bytes, GiB = 2^30 bytes (also B, KB, MB, TB, KiB, "
                        "MiB, TiB), e.g. 79.1GiB (an H100 80GB as torch reports it), 139.7GiB (an H200); a bare "
                        "number is refused (default: "
                        "the layout's device_memory_gib; without layouts the CPU stand-in render-job uses, "
                        f"{CPU_LAYOUT.device_memory_gib:g}GiB)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: train.seq_len)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per GPU (default: train.micro_batch_size)")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="training precision (default: the recipe's train.precision; its 'auto' counts as bf16 on "
                        "a GPU layout, fp32 on the CPU stand-in)")
    p.add_argument("--context-len", type=int, default=None,
                   help="inference context (tokens) for the KV-cache line (default: model.max_seq_len)")
    p.add_argument("--kv-dtype", default="bf16", choices=list(DTYPE_BYTES),
                   help="KV-cache element type (default bf16)")
    options = [o[0] for o in ZERO_OPTIONS]
    p.add_argument("--options", default=None, action=CommaList, metavar="LIST", type=_names(options, "ZeRO option"),
                   help=f"comma-separated ZeRO options to show (default all: {','.join(options)}); the verdict "
                        "considers all")
    p.add_argument("--policies", default=None, action=CommaList, metavar="LIST",
                   type=_names(list(POLICIES), "checkpointing policy"),
                   help=f"comma-separated checkpointing policies to show (default all: {','.join(POLICIES)}); the "
                        "verdict considers all")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (after the layout's overrides), e.g. "
                        "--set train.activation_checkpointing.every_n=3")
    p.add_argument("--measure", action="store_true",
                   help="run a few real steps per policy here and report measured next to predicted "
                        "(CUDA: allocator peak; CPU: saved-tensor bytes and model-state storage)")
    p.add_argument("--steps", type=int, default=2, help="steps per policy with --measure (default 2)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of a table (the report, plus `layout` and `verdict`)")
    p.set_defaults(func=run_memory)


def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _device_memory(given: str | None, pl: Placement) -> tuple[int, str]:
    """Bytes per GPU and where they come from: ``--device-memory``, the layout, or the default."""
    if given is not None:
        return parse_bytes(given, "--device-memory"), "--device-memory"
    if pl.from_layout:
        return int(pl.layout.device_memory_gib * GiB), "the layout's device_memory_gib"
    return int(pl.layout.device_memory_gib * GiB), f"the CPU stand-in layout '{pl.layout_name}' render-job uses"


def _layout_note(args: argparse.Namespace, pl: Placement, device_memory: int, source: str) -> str:
    mem = f"{format_bytes(device_memory)} ({source})"
    if not pl.from_layout:
        return (f"{args.recipe} has no `cluster.layouts` (a CPU recipe): estimated as `smelt-ds render-job` places it, "
                f"on {pl.nodes} node(s) x {pl.gpus_per_node} CPU process(es) of {mem}, fp32 unless --precision; pass "
                "--nodes, --gpus-per-node and --device-memory for other machines")
    chosen = "--layout" if args.layout else "the recipe's default"
    sizes = ", ".join(f"{f} given" for f, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node))
                      if v is not None)
    over = f"; layout overrides {', '.join(pl.layout.overrides)}" if pl.layout.overrides else ""
    return (f"layout '{pl.layout_name}' ({chosen}, as `smelt-ds render-job` resolves it): {pl.nodes} node(s) x "
            f"{pl.gpus_per_node} {pl.layout.gpu} of {mem}{f' ({sizes})' if sizes else ''}{over}")


def run_memory(args: argparse.Namespace) -> int:
    pl = place(args.recipe, args.layout, args.set, args.nodes, args.gpus_per_node)
    cfg = _with_batch(pl.config, args.seq_len, args.micro_batch)
    device_memory, source = _device_memory(args.device_memory, pl)
    # a CPU layout (the stand-in of recipes without layouts) is estimated as render-job does: fp32 CPU processes
    cpu = pl.layout.gpu == "cpu"
    precision = args.precision or ("fp32" if cpu else None)
    device = "cpu" if cpu else "cuda"
    kw = dict(precision=precision, context_len=args.context_len, kv_dtype=args.kv_dtype, device=device)
    full = estimate(cfg, pl.nodes, pl.gpus_per_node, device_memory, **kw)
    more = None
    if full.configured is not None and not row_fits(full.configured, MIN_HEADROOM):
        more = nodes_to_fit(pl, cfg, full, MIN_HEADROOM, precision=precision, device=device)
    v = verdict(cfg, full, MIN_HEADROOM, more, nodes_searched=True)
    options, policies = _split(args.options), _split(args.policies)
    report = full if options is None and policies is None else \
        estimate(cfg, pl.nodes, pl.gpus_per_node, device_memory, options=options, policies=policies, **kw)
    report.notes.insert(0, _layout_note(args, pl, device_memory, source))
    if args.measure:
        import torch

        report.measured = [m.as_dict() for m in measure(cfg, policies, args.steps)]
        if not torch.cuda.is_available():
            report.notes.append("measured on CPU: fp32, ZeRO-0, one process; compare with `estimate(..., "
                                "precision='fp32', device='cpu')` for exact activation numbers")
    code = 0 if v.fits else EXIT_DOES_NOT_FIT
    if args.json:
        layout = {"name": pl.layout_name, "gpu": pl.layout.gpu, "from_recipe": pl.from_layout, "nodes": pl.nodes,
                  "gpus_per_node": pl.gpus_per_node, "device_memory": device_memory, "device_memory_from": source,
                  "overrides": pl.resolved.overrides}
        print(json.dumps({**report.as_dict(), "layout": layout, "verdict": v.as_dict(), "exit_status": code},
                         indent=2))
    else:
        print(format_table(report, MIN_HEADROOM) + "\n\n" + format_verdict(v)
              + (f"\nexit status {code} (the recipe's own setting does not fit)" if code else ""))
    return code


def _add_recipes_parser(sub: argparse._SubParsersAction) -> None:
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
                                    "asymmetric with --ep-size <moe_runtime.ep_size> --tolerance 0.01 and write "
                                    "each next to the Baseline, keeping the Baseline's comments.")
    d.add_argument("baseline", help="Baseline recipe, e.g. recipes/xl/baseline.yaml")
    d.add_argument("--check", action="store_true", help="exit 1 when a variant file differs from its derivation")
    d.set_defaults(func=run_derive)


def run_table(args: argparse.Namespace) -> int:
    return write_or_check_generated(recipes_table(), args.output, DOCS_TABLE, "smelt-ds recipes table", args.check)


def run_derive(args: argparse.Namespace) -> int:

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


def _add_scaling_parser(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("scaling", help="scaling-law analysis of finished runs (smelt-ds scaling fit)",
                        description="Scaling-law analysis of finished runs.")
    ssub = sc.add_subparsers(dest="scaling_command", metavar="SUBCOMMAND", required=True)
    f = ssub.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta per architecture; frontier and savings",
                        description="Fit a Chinchilla law per architecture (Hoffmann et al. 2022 Approach 3), derive "
                                    "compute-optimal frontiers and the training FLOPs each architecture saves vs the "
                                    "Baseline at equal loss; write report.md, scaling.json and PNG plots.")
    f.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories, or directories holding them (a sweep's output_dir)")
    f.add_argument("-o", "--output", default=None,
                   help="report directory (default: <first RUN_DIR>/scaling_report)")
    f.add_argument("--baseline", default=None, help="architecture the savings are measured against "
                                                    "(default: 'baseline', or the only unlooped one)")
    f.add_argument("--loss-key", default="all", help="validation domain of summary.json (default: all)")
    f.add_argument("--skip-unreadable", action="store_true",
                   help="leave out (and list as excluded) a run whose summary.json, sweep_run.json or config.yaml "
                        "cannot be read, instead of stopping with an error naming the file")
    f.add_argument("--bootstrap", type=int, default=200,
                   help="bootstrap resamples for the 95%% CIs (0: none; default 200)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    f.add_argument("--c-range", type=float, nargs=2, action=Once, default=None, metavar=("LOW", "HIGH"),
                   help="training FLOPs range of the frontier and savings tables (default: measured range to 100x)")
    f.set_defaults(func=run_fit)


def run_fit(args: argparse.Namespace) -> int:

    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap ({args.bootstrap}) must be >= 0")
    points, excluded = collect_runs(args.run_dirs, loss_key=args.loss_key, skip_unreadable=args.skip_unreadable)
    for line in summarize_exclusions(excluded):
        print(f"excluded: {line}", file=sys.stderr)
    res = analyse(points, excluded, baseline=args.baseline, n_bootstrap=args.bootstrap, seed=args.seed,
                  c_range=tuple(args.c_range) if args.c_range else None)
    out = Path(args.output) if args.output else Path(args.run_dirs[0]) / "scaling_report"
    written = write_report(res, out)
    for arch, a in res["architectures"].items():
        p = a["params"]
        line = (f"{arch}: {a['n_runs']} runs, E={p['E']:.4g} A={p['A']:.4g} alpha={p['alpha']:.3f} "
                f"B={p['B']:.4g} beta={p['beta']:.3f}")
        m = measured_savings(res, arch)
        if m:
            line += (f"; training FLOPs saved vs {res['baseline']} over the measured compute: "
                     f"{100 * m[0]:+.1f}% to {100 * m[1]:+.1f}%")
        pr = a.get("paired")
        if pr:
            ci = f" [{pr['ci95'][0]:+.4f}, {pr['ci95'][1]:+.4f}], p={pr['p_value']:.3g}" if pr["ci95"] else ""
            line += (f"; paired runs vs {res['baseline']}: mean loss delta {pr['mean_delta']:+.4f}{ci} "
                     f"over {pr['n_pairs']} pairs")
        ident = a.get("identification")
        if ident:
            line += "; identified" if ident["identified"] else "; NOT identified: " + "; ".join(ident["shortfalls"])
        print(line)
    for path in written.values():
        print(f"wrote {path}")
    return 0
