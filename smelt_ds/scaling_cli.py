"""``smelt-ds sweep`` (run or render a scaling-law sweep) and ``smelt-ds scaling fit`` (per-architecture
Chinchilla fits, compute-optimal frontiers and training-FLOPs savings from finished runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from smelt_ds.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sweep", help="run (locally, one after another) or render (Slurm / Kubernetes) a scaling sweep",
                       description="Expand a sweep file (sizes x token budgets x architectures; looped recipes "
                                   "matched to each size's Baseline) and train its runs one after another, skipping "
                                   "finished runs and resuming interrupted ones; or render cluster jobs.")
    s.add_argument("sweep", help="sweep YAML, e.g. recipes/sweeps/micro.yaml")
    s.add_argument("--dry-run", action="store_true", help="print the planned runs and write nothing")
    s.add_argument("--render", choices=["slurm", "k8s", "all"], default=None,
                   help="write cluster job files under <output_dir>/launch/ instead of training")
    s.add_argument("--limit", type=int, default=None, help="train at most this many unfinished runs now")
    s.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every run's steps and warmup (quick checks; writes to <output_dir>-x<F> "
                        "unless --output-dir is given)")
    s.add_argument("--output-dir", default=None, help="override the sweep's output_dir")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field of every size's Baseline, e.g. --set data.builtin_max_bytes=150000")
    s.add_argument("--executor", choices=["subprocess", "inprocess"], default="subprocess",
                   help="subprocess: one `python -m smelt_ds.train` per run (log in <run_dir>/train.log); "
                        "inprocess: train in this process")
    s.add_argument("--nproc", type=int, default=1, help="local ranks per run (deepspeed launcher when > 1)")
    s.set_defaults(func=run_sweep)

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
    f.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the 95%% CIs (0: none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    f.add_argument("--c-range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="training FLOPs range of the frontier and savings tables (default: measured range to 100x)")
    f.set_defaults(func=run_fit)


def _plan(args: argparse.Namespace):
    from smelt_ds.sweep import load_sweep, plan_sweep

    sweep = load_sweep(args.sweep)
    out = args.output_dir
    if out is None and args.steps_scale != 1.0:
        out = sweep.output_dir.format(name=sweep.name).rstrip("/") + f"-x{args.steps_scale:g}"
    return plan_sweep(sweep, args.sweep, output_dir=out, overrides=args.set, steps_scale=args.steps_scale)


def run_sweep(args: argparse.Namespace) -> int:
    from smelt_ds.sweep import plan_table, render_k8s, render_slurm, run_local

    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit ({args.limit}) must be >= 0")
    plan = _plan(args)
    print(plan_table(plan))
    if args.dry_run:
        return 0
    if args.render:
        written = []
        if args.render in ("slurm", "all"):
            written += render_slurm(plan)
        if args.render in ("k8s", "all"):
            written += render_k8s(plan)
        for p in written:
            print(f"wrote {p}")
        if args.render in ("slurm", "all"):
            print("submit: " + "; ".join(f"sbatch {p}" for p in written if p.suffix == ".sbatch"))
        if args.render in ("k8s", "all"):
            print(f"submit: kubectl apply -f {plan.output_dir / 'launch' / 'k8s'}  "
                  "(output_dir must be on the runs volume)")
        return 0
    outcomes = run_local(plan, limit=args.limit, executor=args.executor, nproc=args.nproc)
    print(f"fit: smelt-ds scaling fit {plan.output_dir}")
    if any(o.status == "interrupted" for o in outcomes):
        return 130
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def run_fit(args: argparse.Namespace) -> int:
    from smelt_ds.scaling import analyse, collect_runs, measured_savings, summarize_exclusions, write_report

    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap ({args.bootstrap}) must be >= 0")
    points, excluded = collect_runs(args.run_dirs, loss_key=args.loss_key)
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
        print(line)
    for kind, path in written.items():
        print(f"wrote {path}")
    return 0
