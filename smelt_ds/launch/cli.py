"""``smelt-ds render-job``: fill a launcher template (deepspeed, Slurm, Kubernetes) from a recipe,
after the checks of ``smelt-ds preflight`` (:mod:`smelt_ds.launch.preflight`) pass.

    smelt-ds render-job RECIPE --scheduler {deepspeed,slurm,k8s} [--layout NAME] [--nodes N]
        [--gpus-per-node G] [--set KEY=VALUE ...] [-o FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import (
    GANG_SCHEDULERS,
    K8S_RESTART_POLICIES,
    NUMA_MODES,
    SCHEDULERS,
    JobOptions,
    plan_job,
    render,
    slurm_log_dir,
    summary,
)
from smelt_ds.launch.preflight import failures, format_results, run_checks, verdict

#: the scheduler behind each ``--scheduler`` value, as messages name it
SCHEDULER_NAMES = {"deepspeed": "deepspeed launcher", "slurm": "Slurm", "k8s": "Kubernetes"}
#: the options that only some schedulers use -> those schedulers; every option not listed applies to
#: all three. An option given for a scheduler that does not use it is refused (:func:`unused_options`),
#: never silently ignored. These options default to None ("not given"; :func:`options_from_args` then
#: leaves :class:`~smelt_ds.launch.jobs.JobOptions`' default), so one left at its default is never refused.
SCHEDULER_OPTIONS: dict[str, tuple[str, ...]] = {
    "--hostfile": ("deepspeed",),
    "--master-port": ("deepspeed", "slurm"),  # Kubernetes: the training operator sets MASTER_PORT
    "--job-name": ("slurm", "k8s"),  # the deepspeed script has no job name
    "--shutdown-timeout": ("slurm", "k8s"),  # the deepspeed script stops its ranks through RUN_DIR/STOP
    "--numa-binding": ("slurm", "k8s"),  # torchrun's; the deepspeed launcher has --bind_cores_to_rank
    **dict.fromkeys(("--time", "--partition", "--account", "--sbatch", "--log-dir", "--signal-lead", "--max-requeues",
                     "--max-time-requeues", "--startup-time", "--cpu-bind"), ("slurm",)),
    **dict.fromkeys(("--image", "--namespace", "--runs-pvc", "--data-pvc", "--backoff-limit", "--restart-policy",
                     "--node-selector", "--toleration", "--affinity", "--rdma-resource", "--ipc-lock", "--gang",
                     "--gang-queue", "--shm-size", "--cpus-per-gpu", "--memory-per-gpu"), ("k8s",)),
}


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
                   help="do not check the recipe's data here (for data only the compute nodes see)")
    p.add_argument("--require-shared", action="store_true",
                   help="several nodes: refuse a job with a path on a node-local file system (/tmp, memory, a local "
                        "disk) instead of warning")
    p.add_argument("--force", action="store_true",
                   help="write the job even when a check of `smelt-ds preflight` fails (memory, data, trackers, ...)")
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
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: deepspeed 29500; Slurm 10000 + job id mod 20000, below the "
                        "ephemeral ports; Kubernetes: the operator's)")
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
    g.add_argument("--max-time-requeues", type=int, default=d.max_time_requeues,
                   help=f"times a job requeues itself at its time limit (after a checkpoint), counted by "
                        f"SLURM_RESTART_COUNT (every requeue); 0 = never (default {d.max_time_requeues})")
    g.add_argument("--startup-time", type=int, default=d.startup_s, dest="startup_s",
                   help=f"seconds one start spends before its first step (allocation, imports, DeepSpeed, checkpoint "
                        f"load); --time must be at least this + --shutdown-timeout + --signal-lead (default "
                        f"{d.startup_s})")
    g.add_argument("--cpu-bind", default=d.cpu_bind,
                   help=f"srun --cpu-bind of the one task per node that runs torchrun (default {d.cpu_bind}: every CPU "
                        "of the node; per-rank affinity: --numa-binding)")
    p.add_argument("--numa-binding", default=None, choices=NUMA_MODES,
                   help="Slurm, Kubernetes: torchrun --numa-binding, binding each rank to the CPUs near its GPU (node: "
                        "its NUMA node; needs numactl on the nodes; default: no binding)")
    g = p.add_argument_group("Kubernetes")
    g.add_argument("--image", default=d.image, help=f"container image with smelt-ds (default {d.image}; "
                                                    "launchers/k8s/Dockerfile)")
    g.add_argument("--namespace", default=d.namespace, help=f"namespace (default {d.namespace})")
    g.add_argument("--runs-pvc", default=d.runs_pvc, help=f"ReadWriteMany PVC for runs/ (default {d.runs_pvc})")
    g.add_argument("--data-pvc", default=d.data_pvc, help=f"PVC with the corpora (default {d.data_pvc})")
    g.add_argument("--backoff-limit", type=int, default=d.backoff_limit,
                   help=f"restarts of a failed pod before the job fails; 0 = never (default {d.backoff_limit})")
    g.add_argument("--restart-policy", default=d.restart_policy, choices=K8S_RESTART_POLICIES,
                   help=f"ExitCode: a bad configuration (a rank's exit 2) or non-finite steps (3) fail the job at "
                        f"once, other failures restart; OnFailure: every failure restarts (default {d.restart_policy})")
    g.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="pod nodeSelector label, e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 (repeatable)")
    g.add_argument("--toleration", action="append", default=[], dest="tolerations", metavar="KEY[=VALUE][:EFFECT]",
                   help="tolerate a node taint as `kubectl taint` writes it, e.g. nvidia.com/gpu:NoSchedule "
                        "(repeatable)")
    g.add_argument("--affinity", default=None, metavar="FILE",
                   help="YAML/JSON file with the pods' affinity (nodeAffinity, podAffinity, podAntiAffinity; "
                        "default: none)")
    g.add_argument("--rdma-resource", action="append", default=[], dest="rdma_resources", metavar="NAME=COUNT",
                   help="device plugin resource per pod for RDMA (InfiniBand/RoCE), e.g. rdma/hca=1; adds the "
                        "IPC_LOCK capability (repeatable)")
    g.add_argument("--ipc-lock", action="store_true", help="add the IPC_LOCK capability (RDMA pins memory)")
    g.add_argument("--gang", default=None, choices=tuple(GANG_SCHEDULERS),
                   help="gang scheduling: all pods start together or none (runPolicy.schedulingPolicy; the training "
                        "operator runs with the same --gang-scheduler-name; default: none, each pod is scheduled "
                        "on its own)")
    g.add_argument("--gang-queue", default=None,
                   help="the Volcano queue of the job (with --gang volcano; default: none, Volcano's default queue)")
    g.add_argument("--shm-size", default=d.shm_size, help=f"/dev/shm size (default {d.shm_size})")
    g.add_argument("--cpus-per-gpu", type=int, default=d.cpu_per_gpu, dest="cpu_per_gpu",
                   help=f"CPU cores requested per GPU (default {d.cpu_per_gpu})")
    g.add_argument("--memory-per-gpu", type=int, default=d.memory_per_gpu_gib, dest="memory_per_gpu_gib",
                   help=f"host memory requested per GPU, GiB (default {d.memory_per_gpu_gib})")
    only = {}
    for flag, schedulers in SCHEDULER_OPTIONS.items():
        action = p._option_string_actions[flag]
        action.default = None  # "not given": told apart from a value given equal to the default
        only[action.dest] = (flag, schedulers)
    p.set_defaults(func=run_render_job, scheduler_options=only)


def options_from_args(args: argparse.Namespace) -> JobOptions:
    """A :class:`smelt_ds.launch.jobs.JobOptions` from parsed arguments: each option given (not None),
    under its field's name (``--set`` -> ``overrides``); JobOptions' default for the others."""
    fields = {f.name for f in dataclasses.fields(JobOptions)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return JobOptions(**given, overrides=list(args.set))


def unused_options(args: argparse.Namespace) -> list[str]:
    """The options given (not None) that ``--scheduler`` does not use (:data:`SCHEDULER_OPTIONS`),
    each as a line naming the option, the scheduler(s) it belongs to and the fix."""
    out = []
    for dest, (flag, schedulers) in args.scheduler_options.items():
        if getattr(args, dest) is not None and args.scheduler not in schedulers:
            names = " and ".join(SCHEDULER_NAMES[s] for s in schedulers)
            out.append(f"{flag}: a {names} option (--scheduler {' or '.join(schedulers)}): drop it, or pass "
                       f"--scheduler {' or '.join(schedulers)}")
    return out


def run_render_job(args: argparse.Namespace) -> int:
    unused = unused_options(args)
    if unused:  # an option the job would silently ignore
        raise ConfigError(f"--scheduler {args.scheduler} ({SCHEDULER_NAMES[args.scheduler]}) does not use "
                          f"{len(unused)} option(s) given; nothing written:\n  " + "\n  ".join(unused))
    plan = plan_job(args.recipe, options_from_args(args))
    text = render(plan)  # also on --dry-run: bad scheduler options fail here, not at submission
    results = run_checks(plan, data=not args.no_data_check, require_shared=args.require_shared)  # preflight's
    for r in results:
        if r.status == "warn":
            print(f"smelt-ds render-job: warning: {r.name}: {r.detail}", file=sys.stderr)
    bad = failures(results)
    if args.dry_run:
        print(summary(plan, args.output))
        print("checks (smelt-ds preflight)\n" + format_results(results) + "\n" + verdict(results))
    if bad and args.force:
        for r in bad:
            print(f"smelt-ds render-job: warning (--force): {r.name}: {r.detail}", file=sys.stderr)
    if bad and not args.force:
        lines = "\n".join(f"  {r.name}: {r.detail}" for r in bad)
        raise ConfigError(f"{args.recipe}: {len(bad)} check(s) that training makes at start fail for this job"
                          f"{'' if args.dry_run else '; nothing written'}:\n{lines}\nfix them, or pass --force to "
                          "render it anyway (--no-data-check skips the data check: data only the compute nodes see)")
    if args.dry_run:
        return 0
    if args.output is None:
        print(text, end="")
        print(summary(plan), file=sys.stderr)
        if args.scheduler == "slurm":  # -o creates it; Slurm does not, and a job without it fails with no log
            log_dir = slurm_log_dir(plan)[1]
            print(f"smelt-ds render-job: create the log directory before sbatch (Slurm does not): mkdir -p "
                  f"{shlex.quote(log_dir)}", file=sys.stderr)
        return 0
    out = Path(args.output)
    if out.is_dir():
        raise ConfigError(f"-o {args.output!r} is a directory: name the job file, e.g. -o job.sbatch")
    if args.scheduler == "slurm":  # Slurm does not create the log directory: before the job is written
        what, log_dir = slurm_log_dir(plan)
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            given = plan.options.log_dir or log_dir
            shown = repr(given) if given == log_dir else f"{given!r}, {log_dir}"
            raise ConfigError(f"{what} ({shown}): cannot create it "
                              f"({e.strerror or e}); nothing written: pass --log-dir DIR, a directory you can "
                              "create and write on a file system the first node of the job sees") from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise ConfigError(f"-o {args.output!r}: cannot write the job file ({e.strerror or e}): name a file in a "
                          "directory you can write, e.g. -o jobs/job.sbatch") from None
    if args.scheduler != "k8s":
        out.chmod(0o755)
    print(summary(plan, args.output))
    print(f"wrote {out}")
    return 0
