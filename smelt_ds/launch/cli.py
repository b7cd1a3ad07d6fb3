"""``smelt-ds render-job``: fill a launcher template (deepspeed, Slurm, Kubernetes) from a recipe.

    smelt-ds render-job RECIPE --scheduler {deepspeed,slurm,k8s} [--layout NAME] [--nodes N]
        [--gpus-per-node G] [--set KEY=VALUE ...] [-o FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import sys
from pathlib import Path

from smelt_ds.config.data import TOKEN_KINDS
from smelt_ds.data.cache import is_complete
from smelt_ds.data.prepare import prepared_path
from smelt_ds.data.prepared import PreparedData, check_compatible
from smelt_ds.data.token_sources import resolve_token_paths
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import MIN_HEADROOM, SCHEDULERS, JobOptions, JobPlan, plan_job, render, summary
from smelt_ds.train.trackers import check_trackers


def add_parser(sub: argparse._SubParsersAction) -> None:

    d = JobOptions(scheduler="slurm")
    p = sub.add_parser(
        "render-job", help="render a deepspeed / Slurm / Kubernetes job for a recipe (nothing is launched)",
        description="Resolve a recipe for a cluster layout (its `cluster.layouts`, or --nodes/--gpus-per-node), check "
                    "that it can use that many GPUs and fits in memory, and fill the template in launchers/. "
                    "--dry-run prints the commands, world size, data/expert-parallel layout and memory verdict.")
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/xl/smelt.yaml")
    p.add_argument("--scheduler", required=True, choices=SCHEDULERS,
                   help="deepspeed: a bash script calling the deepspeed launcher over a hostfile; slurm: an sbatch "
                        "script (torchrun per node, requeue near the time limit); k8s: a Kubeflow PyTorchJob manifest")
    p.add_argument("--layout", default=None,
                   help="the recipe's cluster layout (e.g. h100, h200; default cluster.default)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the layout's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (ranks) per node (default: the layout's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, passed on to smelt_ds.train (wins over the layout's overrides)")
    p.add_argument("-o", "--output", default=None, help="write the job file here (default: print it)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved plan only; write nothing")
    p.add_argument("--no-data-check", action="store_true",
                   help="do not check the recipe's data here (sources missing here only warn; prepared data that "
                        "do not fit model.vocab_size are refused)")
    p.add_argument("--force", action="store_true",
                   help="write the job even when the memory verdict says it does not fit")
    p.add_argument("--workdir", default=None,
                   help="repository checkout the job runs in (default: this directory; k8s: /workspace/smelt-ds)")
    p.add_argument("--job-name", default=None, help="job name (default smelt-<recipe name>)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for every rank, e.g. --env NCCL_SOCKET_IFNAME=ib0 (repeatable)")
    p.add_argument("--shutdown-timeout", type=int, default=d.shutdown_s, dest="shutdown_s",
                   help=f"seconds the ranks get to save a checkpoint after SIGTERM (default {d.shutdown_s})")
    p.add_argument("--run-dir", default=None,
                   help="run directory, passed on to smelt_ds.train (default: the recipe's train.run_dir; relative to "
                        "--workdir); the job writes NCCL flight-recorder dumps to RUN_DIR/nccl_trace/ and the "
                        "deepspeed script stops its ranks through RUN_DIR/STOP")
    g = p.add_argument_group("deepspeed launcher")
    g.add_argument("--hostfile", default=None,
                   help="hostfile (HOST slots=N lines); required for several nodes "
                        "(default: none, one node: this host)")
    g.add_argument("--master-port", type=int, default=d.master_port, help=f"rendezvous port (default {d.master_port})")
    g = p.add_argument_group("Slurm")
    g.add_argument("--time", default=d.time, help=f"time limit per start, D-HH:MM:SS (default {d.time}); the job "
                                                  "requeues itself and resumes")
    g.add_argument("--partition", default=None, help="#SBATCH --partition (default: none, the cluster's default)")
    g.add_argument("--account", default=None, help="#SBATCH --account (default: none, the user's default)")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="extra #SBATCH line, e.g. --sbatch=--qos=high (repeatable)")
    g.add_argument("--log-dir", default=None, help="directory of the job logs (default WORKDIR/runs/slurm-logs)")
    g.add_argument("--signal-lead", type=int, default=d.signal_lead_s, dest="signal_lead_s",
                   help=f"seconds before the time limit at which the job checkpoints and requeues (default "
                        f"{d.signal_lead_s})")
    g.add_argument("--max-requeues", type=int, default=d.max_requeues,
                   help=f"times a job whose ranks failed (srun exit status other than 0, 2, 3) requeues itself, "
                        f"counted by SLURM_RESTART_COUNT; 0 = never (default {d.max_requeues})")
    g = p.add_argument_group("Kubernetes")
    g.add_argument("--image", default=d.image, help=f"container image with smelt-ds (default {d.image}; "
                                                    "launchers/k8s/Dockerfile)")
    g.add_argument("--namespace", default=d.namespace, help=f"namespace (default {d.namespace})")
    g.add_argument("--runs-pvc", default=d.runs_pvc, help=f"ReadWriteMany PVC for runs/ (default {d.runs_pvc})")
    g.add_argument("--data-pvc", default=d.data_pvc, help=f"PVC with the corpora (default {d.data_pvc})")
    g.add_argument("--backoff-limit", type=int, default=d.backoff_limit,
                   help=f"pod restarts before the job fails (default {d.backoff_limit})")
    g.add_argument("--shm-size", default=d.shm_size, help=f"/dev/shm size (default {d.shm_size})")
    g.add_argument("--cpus-per-gpu", type=int, default=d.cpu_per_gpu, dest="cpu_per_gpu",
                   help=f"CPU cores requested per GPU (default {d.cpu_per_gpu})")
    g.add_argument("--memory-per-gpu", type=int, default=d.memory_per_gpu_gib, dest="memory_per_gpu_gib",
                   help=f"host memory requested per GPU, GiB (default {d.memory_per_gpu_gib})")
    p.set_defaults(func=run_render_job)


def options_from_args(args: argparse.Namespace):
    """A :class:`smelt_ds.launch.jobs.JobOptions` from parsed arguments."""

    return JobOptions(scheduler=args.scheduler, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                      layout=args.layout, overrides=list(args.set), hostfile=args.hostfile,
                      master_port=args.master_port, workdir=args.workdir, job_name=args.job_name, env=list(args.env),
                      time=args.time, partition=args.partition, account=args.account, sbatch=list(args.sbatch),
                      log_dir=args.log_dir, signal_lead_s=args.signal_lead_s, shutdown_s=args.shutdown_s,
                      run_dir=args.run_dir, max_requeues=args.max_requeues,
                      image=args.image, namespace=args.namespace, runs_pvc=args.runs_pvc, data_pvc=args.data_pvc,
                      backoff_limit=args.backoff_limit, shm_size=args.shm_size, cpu_per_gpu=args.cpu_per_gpu,
                      memory_per_gpu_gib=args.memory_per_gpu_gib)


def warn_missing_trackers(plan: JobPlan) -> None:
    """Print a warning (stderr) when a tracker of ``tracking.trackers`` cannot be used in this
    environment (:func:`smelt_ds.train.trackers.check_trackers`): a Slurm or deepspeed job runs
    the Python it is submitted from, so its training would be refused only after it was queued. A
    warning, not a refusal: a Kubernetes job runs its image's environment, and a job script may
    activate another one."""
    try:
        check_trackers(plan.config)
    except ConfigError as e:
        where = "the image" if plan.options.scheduler == "k8s" else "the job's environment"
        print(f"smelt-ds render-job: warning: {e} (checked here; {where} must have it, or training refuses "
              "at start)", file=sys.stderr)


def check_data_here(plan: JobPlan) -> None:
    """What training checks at start about its data, checked before the queue for a Slurm or
    deepspeed job (whose nodes usually see the filesystem this command sees; a Kubernetes pod
    sees its own mounts, so nothing is checked for it).

    - A ``megatron``, ``tokens`` or ``path`` source that does not exist here (relative paths in
      the job's working directory) is a warning on stderr naming the field: the data may exist
      only on the compute nodes (node-local disks), which this command cannot know.
    - Prepared data (``smelt-ds data prepare --recipe``) of file and token sources whose tokenizer
      or largest token id does not fit ``model.vocab_size``
      (:func:`smelt_ds.data.prepared.check_compatible`) is refused: ConfigError naming both values
      and the fix. (Built-in, ladder and Hub sources are not looked up: that would build or
      download them here.)
    """
    if plan.options.scheduler == "k8s":
        return
    cfg = plan.config
    workdir = Path(plan.workdir)
    missing = False
    with contextlib.chdir(workdir if workdir.is_dir() else Path.cwd()):
        for i, src in enumerate(cfg.data.sources):
            kind = src.kind()
            problem = None
            if kind in TOKEN_KINDS:
                try:
                    resolve_token_paths(src, f"data.sources[{i}]")
                except ConfigError as e:
                    problem = str(e)
            elif kind == "path" and not glob.has_magic(str(src.path)) and not Path(str(src.path)).expanduser().exists():
                problem = (f"`data.sources[{i}].path` ({src.path!r}): no such file or directory (working directory "
                           f"{str(workdir)!r}): fix the path")
            if problem:
                missing = True
                print(f"smelt-ds render-job: warning: {problem} (checked here; if the data exist only on the compute "
                      "nodes, training finds them there; --no-data-check silences this)", file=sys.stderr)
        # the preparation key reads the sources: with one missing there is nothing prepared to check,
        # and built-in, ladder or Hub sources would be built or downloaded here (render-job writes nothing)
        if missing or any(src.kind() not in (*TOKEN_KINDS, "path") for src in cfg.data.sources):
            return
        prepared = prepared_path(cfg.data)
        if is_complete(prepared):
            try:
                check_compatible(PreparedData.load(prepared, verify="size"), cfg.model.vocab_size)
            except ConfigError as e:
                raise ConfigError(f"{e} (the data prepared for this recipe, checked before the queue)") from None


def run_render_job(args: argparse.Namespace) -> int:
    plan = plan_job(args.recipe, options_from_args(args))
    text = render(plan)  # also on --dry-run: bad scheduler options fail here, not at submission
    warn_missing_trackers(plan)
    if not args.no_data_check:
        check_data_here(plan)
    if args.dry_run:
        print(summary(plan, args.output))
        return 0
    if not plan.memory.fits(MIN_HEADROOM) and not args.force:
        row = plan.memory.configured
        raise ConfigError(f"{args.recipe} does not fit on {plan.nodes} x {plan.gpus_per_node} GPUs of "
                          f"{plan.layout.device_memory_gib:g} GiB: {row.total / 2**30:.1f} GiB per GPU, "
                          f"{row.headroom:.0%} headroom (needs {MIN_HEADROOM:.0%}); nothing written. Use more "
                          "nodes, see `smelt-ds memory` for a ZeRO stage / checkpointing policy that fits, or "
                          "pass --force")
    if args.output is None:
        print(text, end="")
        print(summary(plan), file=sys.stderr)
        return 0
    out = Path(args.output)
    if out.is_dir():
        raise ConfigError(f"-o {args.output!r} is a directory: name the job file, e.g. -o job.sbatch")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if args.scheduler != "k8s":
        out.chmod(0o755)
    if args.scheduler == "slurm":  # Slurm does not create the log directory
        Path(plan.options.log_dir or Path(plan.workdir) / "runs" / "slurm-logs").mkdir(parents=True, exist_ok=True)
    print(summary(plan, args.output))
    print(f"wrote {out}")
    return 0
