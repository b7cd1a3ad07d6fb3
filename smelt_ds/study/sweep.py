"""Scaling-law sweeps: a grid of sizes x token (or FLOPs) budgets x architectures, run locally one
after another or rendered as Slurm job arrays / Kubernetes jobs.

A sweep file (``recipes/sweeps/*.yaml``; keys equal the fields of :class:`SweepConfig`)::

    name: micro
    output_dir: runs/sweeps/{name}        # run directories: <output_dir>/<architecture>/<size>-<budget>
    base: ../tiny/baseline.yaml           # Baseline recipe (loop.position: none), relative to this file
    overrides: {train: {eval_every: 100000}}   # deep-merged into every size's Baseline
    sizes:                                # each: a Baseline, from `base` + overrides or its own `recipe`
      - {name: h64, overrides: {model: {hidden_size: 64}, moe: {expert_ffn_size: 48}}}
    budgets:                              # each: training tokens, training FLOPs (IsoFLOP grids) or
      - {name: d1, tokens: 131072}        # tokens per non-embedding parameter of the Baseline
      - {name: c1, flops: 1.0e+13}
      - {name: t20, tokens_per_param: 20}
    architectures:                        # position none = the Baseline itself; the others are
      - {name: baseline, position: none}  # generated from each size's Baseline by the matcher
      - {name: smelt, position: middle, repeats: 2}

Every looped recipe is :func:`smelt_ds.cost.budget.match_baseline` of its size's Baseline (same
per-token FLOPs, non-embedding parameters and KV cache; ``match_tolerance`` bounds the
deviation). Steps per run: ``round(tokens / global batch tokens)`` where a FLOPs budget becomes
tokens through the *Baseline's* training FLOPs per token (a tokens-per-parameter budget through
its non-embedding parameters), so that all architectures of one size and budget train on the same
tokens; each run's own compute (its budget's FLOPs/token x tokens)
is what the fit uses.

``smelt-ds sweep`` (``--dry-run`` too) estimates each run's training time from tokens/s:
measured where the sweep's output holds it (a run's ``summary.json``, else its ``metrics.jsonl``;
a run without either takes those of a run of the same architecture and size, which is the same
recipe with another step count), else analytic (:func:`estimate_runs`).

Local runs skip finished runs (``summary.json`` with the planned steps) and resume interrupted
ones from their newest ``COMPLETE`` checkpoint (``--resume auto``). Cluster rendering reuses
:mod:`smelt_ds.launch`: one job script per run, and per node layout one Slurm array whose task
id picks the run; for Kubernetes one PyTorchJob manifest per unfinished run.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import LAUNCHERS_DIR, JobOptions, JobPlan, fill_template, k8s_pod_command, plan_job, render
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.study.recipes import REPO_ROOT
from smelt_ds.study.sweep_estimates import (
    ASSUMED_MFU,
    CPU_FLOPS_PER_CORE,
    RunEstimate,
    check_data_passes,
    estimate_runs,
    estimate_summary,
    format_duration,
    measured_tokens_per_s,
    plan_table,
)
from smelt_ds.study.sweep_plan import (
    PlannedRun,
    SweepArchitecture,
    SweepBudget,
    SweepConfig,
    SweepLaunch,
    SweepPlan,
    SweepSize,
    load_sweep,
    materialize,
    plan_sweep,
    run_status,
)
from smelt_ds.train.loop import launcher_command, train

__all__ = ["SweepConfig", "SweepSize", "SweepBudget", "SweepArchitecture", "SweepLaunch", "load_sweep",
           "PlannedRun", "SweepPlan", "plan_sweep", "materialize", "run_status", "select_runs", "run_local",
           "render_slurm", "render_k8s", "plan_table", "RunEstimate", "measured_tokens_per_s", "estimate_runs",
           "estimate_summary", "format_duration", "ASSUMED_MFU", "CPU_FLOPS_PER_CORE"]


# ---------------------------------------------------------------------------------------------
# local execution
# ---------------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    run: PlannedRun
    status: str  # done | skipped | failed | interrupted
    seconds: float = 0.0
    message: str = ""


def _train_subprocess(r: PlannedRun, resume: str, nproc: int) -> tuple[int, bool]:

    if nproc > 1:
        cmd = launcher_command(argparse.Namespace(nproc=nproc, recipe=str(r.recipe_path), resume=resume, set=[],
                                                  run_dir=None))
    else:
        cmd = [sys.executable, "-m", "smelt_ds.train", str(r.recipe_path), "--resume", resume]
    with (r.run_dir / "train.log").open("a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait(), False
        except KeyboardInterrupt:  # the child got SIGINT too: it saves a checkpoint and exits
            return proc.wait(), True


def _train_inprocess(r: PlannedRun, resume: str) -> tuple[int, bool]:

    res = train(r.config, resume=resume, run_dir=str(r.run_dir))
    return 0, res.stopped_early


def select_runs(plan: SweepPlan, only: list[str] | None) -> SweepPlan:
    """The plan with only the runs whose name matches one of the shell patterns ``only`` (all runs
    for None or []), in plan order. Raises ConfigError naming a pattern that matches no run."""
    if not only:
        return plan
    names = [r.name for r in plan.runs]
    for pattern in only:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"--only {pattern!r} matches no run of sweep {plan.sweep.name}: the runs are "
                              f"named <architecture>-<size>-<budget>[-s<seed>], e.g. {names[0]!r} "
                              "(`--dry-run` lists them)")
    return dataclasses.replace(plan, runs=[r for r in plan.runs if any(fnmatch.fnmatchcase(r.name, p) for p in only)],
                               all_runs=plan.all_runs or plan.runs)


def run_local(plan: SweepPlan, limit: int | None = None, executor: str = "subprocess", nproc: int = 1,
              log: Callable[[str], None] = print, only: list[str] | None = None) -> list[RunOutcome]:
    """Train the plan's runs one after another: finished runs are skipped, interrupted ones resume
    from their newest complete checkpoint. ``limit``: train at most this many runs now. ``only``:
    shell patterns of run names (e.g. ``*-h80-c3.2e13``); the runs matching none are left for later
    (not trained, not listed as outcomes); ConfigError when a pattern matches no run.
    ``executor``: ``subprocess`` (``python -m smelt_ds.train`` per run, output to
    ``<run_dir>/train.log``; ``deepspeed`` launcher with ``nproc`` > 1) or ``inprocess``
    (:func:`smelt_ds.train.loop.train` in this process). Stops at the first interrupted run (Ctrl-C /
    SIGTERM: the run saved a checkpoint; rerun to continue). Returns one outcome per run."""

    if executor not in ("subprocess", "inprocess"):
        raise ConfigError(f"--executor {executor!r} is unknown: use 'subprocess' or 'inprocess'")
    runs = select_runs(plan, only).runs
    materialize(plan)
    check_data_passes(plan, prepare=True)
    outcomes: list[RunOutcome] = []
    todo = []
    for r in runs:
        (outcomes.append(RunOutcome(r, "skipped", message="finished earlier")) if run_status(r) == "done"
         else todo.append(r))
    if outcomes:
        log(f"sweep {plan.sweep.name}: {len(outcomes)} of {len(runs)} runs finished earlier")
    if limit is not None:
        todo = todo[:max(0, limit)]
    t_all = time.perf_counter()
    for k, r in enumerate(todo, 1):
        # auto also for a run without a checkpoint: materialize wrote its config.yaml, and a run that crashed
        # before its first save left files that a new run (--resume none) is refused over
        resume = "auto"
        resuming = ckpt.latest_complete(r.run_dir) is not None
        log(f"[{k}/{len(todo)}] {r.name}: {r.steps} steps x {r.tokens_per_step} tokens"
            + (" (resuming)" if resuming else "") + f" -> {r.run_dir}")
        t0 = time.perf_counter()
        try:
            rc, interrupted = (_train_inprocess(r, resume) if executor == "inprocess"
                               else _train_subprocess(r, resume, nproc))
        except ConfigError as e:
            rc, interrupted = 2, False
            outcomes.append(RunOutcome(r, "failed", time.perf_counter() - t0, str(e)))
            log(f"    failed: {e}")
            continue
        dt = time.perf_counter() - t0
        if run_status(r) == "done":
            loss = json.loads((r.run_dir / "summary.json").read_text())["validation_loss"].get("all")
            outcomes.append(RunOutcome(r, "done", dt))
            log(f"    done in {dt:.0f} s, validation loss {loss:.4f} nats/token")
        elif interrupted or rc in (0, 143):  # 143: the run got SIGTERM and saved a checkpoint
            outcomes.append(RunOutcome(r, "interrupted", dt, "stopped before the end; rerun to resume"))
            log(f"    interrupted after {dt:.0f} s: rerun the same command to resume")
            break
        else:
            outcomes.append(RunOutcome(r, "failed", dt, f"exit code {rc}; see {r.run_dir / 'train.log'}"))
            log(f"    failed (exit code {rc}) after {dt:.0f} s: see {r.run_dir / 'train.log'}")
    log(f"sweep {plan.sweep.name}: {sum(o.status == 'done' for o in outcomes)} trained, "
        f"{sum(o.status == 'skipped' for o in outcomes)} skipped, {sum(o.status == 'failed' for o in outcomes)} "
        f"failed in {time.perf_counter() - t_all:.0f} s")
    return outcomes


# ---------------------------------------------------------------------------------------------
# cluster rendering (reuses smelt_ds.launch)
# ---------------------------------------------------------------------------------------------


def _job_name(sweep: str, r: PlannedRun) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", f"{sweep}-{r.index:03d}-{r.name}".lower())
    return re.sub(r"-+", "-", name)[:52].strip("-")


def _job_options(plan: SweepPlan, r: PlannedRun, scheduler: str, log_dir: str | None = None):

    L = plan.sweep.launch
    return JobOptions(scheduler=scheduler, layout=L.layout, time=L.time, partition=L.partition, account=L.account,
                      sbatch=list(L.sbatch), env=list(L.env), image=L.image, namespace=L.namespace,
                      runs_pvc=L.runs_pvc, data_pvc=L.data_pvc, job_name=_job_name(plan.sweep.name, r),
                      log_dir=log_dir)


#: the job-array script of ``--render slurm``, filled by :func:`smelt_ds.launch.jobs.fill_template`
ARRAY_TEMPLATE = LAUNCHERS_DIR / "slurm" / "sweep_array.sbatch"


def render_slurm(plan: SweepPlan) -> list[Path]:
    """Write ``<output_dir>/launch/slurm/runs/<NNN>-<run>.sbatch`` (one job script per run, from
    :func:`smelt_ds.launch.jobs.render`) and one array script per node layout,
    ``<output_dir>/launch/slurm/array-<nodes>x<gpus>.sbatch`` (``launchers/slurm/sweep_array.sbatch``
    filled). Returns the array scripts."""

    materialize(plan)
    root = plan.output_dir / "launch" / "slurm"
    (root / "runs").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    log_dir = str((root / "logs").resolve())
    groups: dict[tuple[int, int], list[tuple[PlannedRun, Path, JobPlan]]] = {}
    for r in plan.runs:
        job = plan_job(r.recipe_path, _job_options(plan, r, "slurm", log_dir))
        script = root / "runs" / f"{r.index:03d}-{r.name}.sbatch"
        script.write_text(render(job))
        groups.setdefault((job.nodes, job.gpus_per_node), []).append((r, script, job))
    L = plan.sweep.launch
    out = []
    for (nodes, gpus), items in groups.items():
        workdir, lead = items[0][2].workdir, items[0][2].options.signal_lead_s
        entries = [os.path.relpath(s.resolve(), workdir) + "|" + os.path.relpath(r.run_dir.resolve(), workdir)
                   for r, s, _ in items]
        rel = [f"  {shlex.quote(e)}" for e in entries]
        extra = [f"#SBATCH --partition={L.partition}"] if L.partition else []
        extra += [f"#SBATCH --account={L.account}"] if L.account else []
        extra += [f"#SBATCH {o}" for o in L.sbatch]
        path = root / f"array-{nodes}x{gpus}.sbatch"
        values = {"SWEEP": plan.sweep.name, "SOURCE": str(plan.source), "NODES": str(nodes), "GPUS_PER_NODE": str(gpus),
                  "ARRAY_SCRIPT": str(path), "JOB_NAME": f"sweep-{plan.sweep.name}", "LAST_TASK": str(len(items) - 1),
                  "ARRAY_LIMIT": f"%{L.max_parallel}" if L.max_parallel else "", "TIME": L.time,
                  "SIGNAL_LEAD_S": str(lead), "LOG_DIR": log_dir, "EXTRA_SBATCH": "\n".join(extra),
                  "WORKDIR": shlex.quote(workdir), "RUNS": "\n".join(rel)}
        path.write_text(fill_template(ARRAY_TEMPLATE.read_text(), values, os.path.relpath(ARRAY_TEMPLATE, REPO_ROOT),
                                      by="smelt-ds sweep --render slurm"))
        out.append(path)
    return out


def render_k8s(plan: SweepPlan) -> list[Path]:
    """Write one Kubeflow PyTorchJob manifest per unfinished run (:func:`smelt_ds.launch.jobs.render`)
    to ``<output_dir>/launch/k8s/<NNN>-<run>.yaml``; each exits at once if its run has finished.
    The output_dir must lie on the runs volume (under ``runs/``). Returns the manifests."""

    where = os.path.normpath(plan.output_dir)
    if os.path.isabs(where) or where.split(os.sep)[0] != "runs":
        raise ConfigError(f"`output_dir` ({where!r}) of a sweep rendered for Kubernetes must lie under runs/, relative "
                          "to the working directory (the default runs/sweeps/{name}): the pods write their run "
                          "directories to the runs volume, which they mount at <workdir>/runs")
    materialize(plan)
    root = plan.output_dir / "launch" / "k8s"
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for r in plan.runs:
        if run_status(r) == "done":
            continue
        job = plan_job(r.recipe_path, _job_options(plan, r, "k8s"))
        text = render(job)
        run_dir = job.run_dir  # as the pod sees it (on the runs volume: render refuses another place)
        cmd = k8s_pod_command(job)
        guarded = f"test -f {shlex.quote(run_dir + '/summary.json')} && exit 0; {cmd}"
        if json.dumps(cmd) not in text:  # the template changed: never write a job that retrains a finished run
            raise RuntimeError(f"render_k8s: the pod command of {r.name} is not in the rendered manifest")
        text = text.replace(json.dumps(cmd), json.dumps(guarded))
        path = root / f"{r.index:03d}-{r.name}.yaml"
        path.write_text(text)
        out.append(path)
    return out


# ---------------------------------------------------------------------------------------------
# the command: smelt-ds sweep SWEEP [--dry-run | --render slurm]
# ---------------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``smelt-ds sweep``."""
    s = sub.add_parser("sweep", help="run (locally, one after another) or render (Slurm / Kubernetes) a scaling sweep",
                       description="Expand a sweep file (sizes x token budgets x architectures; looped recipes "
                                   "matched to each size's Baseline) and train its runs one after another, skipping "
                                   "finished runs and resuming interrupted ones; or render cluster jobs.")
    s.add_argument("sweep", help="sweep YAML, e.g. recipes/sweeps/micro.yaml")
    s.add_argument("--dry-run", action="store_true",
                   help="print the planned runs with each run's estimated training time (from tokens/s measured in "
                        "the sweep's run directories, else analytic) and write nothing")
    s.add_argument("--render", choices=["slurm", "k8s", "all"], default=None,
                   help="write cluster job files under <output_dir>/launch/ instead of training (default: none, "
                        "train here)")
    s.add_argument("--limit", type=int, default=None,
                   help="train at most this many unfinished runs now (default: all)")
    s.add_argument("--only", action="append", default=None, metavar="PATTERN",
                   help="only the runs whose name matches this shell pattern (repeatable), e.g. --only 'smelt-h80-*': "
                        "trained, listed by --dry-run, rendered by --render; the others stay for a later call "
                        "(default: every run)")
    s.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every run's steps and warmup (quick checks; writes to <output_dir>-x<F> "
                        "unless --output-dir is given; default 1)")
    s.add_argument("--output-dir", default=None, help="override the sweep's output_dir (default: the sweep file's)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field of every size's Baseline, e.g. --set data.builtin_max_bytes=150000")
    s.add_argument("--executor", choices=["subprocess", "inprocess"], default="subprocess",
                   help="subprocess: one `python -m smelt_ds.train` per run (log in <run_dir>/train.log); "
                        "inprocess: train in this process (default subprocess)")
    s.add_argument("--nproc", type=int, default=1,
                   help="local ranks per run (deepspeed launcher when > 1; default 1)")
    s.add_argument("--mfu", type=_mfu, default=ASSUMED_MFU,
                   help="model FLOPs utilisation assumed for analytic GPU estimates: a share of the GPUs' dense bf16 "
                        f"peak, in (0, 1] (default {ASSUMED_MFU:g}); measured tokens/s are used where they exist")
    s.set_defaults(func=run_sweep)


def _mfu(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a share of the peak, e.g. 0.4") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 1]: give a share of the peak, e.g. 0.4 for 40%")
    return value


def _plan(args: argparse.Namespace):

    sweep = load_sweep(args.sweep)
    out = args.output_dir
    if out is None and args.steps_scale != 1.0:
        out = sweep.output_dir.format(name=sweep.name).rstrip("/") + f"-x{args.steps_scale:g}"
    return plan_sweep(sweep, args.sweep, output_dir=out, overrides=args.set, steps_scale=args.steps_scale)


def run_sweep(args: argparse.Namespace) -> int:

    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit ({args.limit}) must be >= 0")
    plan = _plan(args)
    shown = select_runs(plan, args.only)  # --only: the table, the estimate and the rendered jobs of those runs
    print(plan_table(shown, estimate_runs(shown, nproc=args.nproc, mfu=args.mfu), args.mfu))
    if args.dry_run or args.render:
        for note in check_data_passes(shown):
            print(f"note: {note}")
    if args.dry_run:
        return 0
    if args.render:
        written = []
        if args.render in ("slurm", "all"):
            written += render_slurm(shown)
        if args.render in ("k8s", "all"):
            written += render_k8s(shown)
        for p in written:
            print(f"wrote {p}")
        if args.render in ("slurm", "all"):
            print("submit: " + "; ".join(f"sbatch {p}" for p in written if p.suffix == ".sbatch"))
        if args.render in ("k8s", "all"):
            print(f"submit: kubectl apply -f {plan.output_dir / 'launch' / 'k8s'}  "
                  "(output_dir must be on the runs volume)")
        return 0
    outcomes = run_local(plan, limit=args.limit, executor=args.executor, nproc=args.nproc, only=args.only)
    print(f"fit: smelt-ds scaling fit {plan.output_dir}")
    if any(o.status == "interrupted" for o in outcomes):
        return 130
    return 1 if any(o.status == "failed" for o in outcomes) else 0
