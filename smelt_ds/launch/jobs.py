"""Cluster jobs from a recipe: the deepspeed launcher (hostfile), Slurm and Kubernetes.

:func:`plan_job` resolves a recipe for a cluster layout (its ``cluster`` section, or ``--nodes`` /
``--gpus-per-node``), checks that the run can use that many GPUs (expert-parallel size divides the
world size, the global batch splits over the data-parallel ranks, a node has that many GPUs) and
estimates memory per GPU; :func:`render` fills one of the templates in ``launchers/``:

* ``deepspeed``: ``launchers/deepspeed/run.sh``, the deepspeed launcher over a hostfile;
* ``slurm``: ``launchers/slurm/smelt.sbatch``, one ``srun`` task per node running torchrun,
  rendezvous at the first host of ``SLURM_JOB_NODELIST``, ``--requeue`` + ``--resume auto``; a
  job whose ranks fail requeues itself while ``SLURM_RESTART_COUNT`` is below ``--max-requeues``
  (default 3), one at its time limit while it is below ``--max-time-requeues`` (default 50); a
  rank's exit 2 (bad configuration) or 3 is read from ``RUN_DIR/exit_status/`` and never requeued
  (:mod:`smelt_ds.train.exit_status`); ``--time`` below :func:`slurm_min_time` is refused;
* ``k8s``: ``launchers/k8s/pytorchjob.yaml``, a Kubeflow PyTorchJob with one pod per node,
  ``restartPolicy: ExitCode`` (:func:`k8s_pod_command`), and the scheduling options of
  :func:`k8s_scheduling` (node selector, tolerations, affinity, RDMA resources, gang scheduling).

Templates hold ``{{NAME}}`` fields; values are quoted for the file's language here (shell words
with :func:`shlex.quote`, YAML scalars as JSON strings). Nothing is launched: the rendered file is
submitted by the user (``sbatch``, ``kubectl apply``, ``bash``). ``python -m smelt_ds.launch
hostnames NODELIST`` expands a Slurm node list (``gpu[001-004,010]``), ``... hostfile NODELIST
--slots 8`` writes a DeepSpeed hostfile from it.

Every job sets the NCCL fault-handling variables of :data:`NCCL_FAULT_ENV` (defaults the user's
environment or ``--env`` overrides) and knows the run directory (``train.run_dir`` or
``--run-dir``, as the job sees it): the flight-recorder dumps go to ``<run_dir>/nccl_trace/``, and
the deepspeed script stops its ranks on SIGTERM / SIGINT / SIGHUP by creating ``<run_dir>/STOP``.

Units: counts of nodes, GPUs (ranks) and tokens; seconds; memory in bytes (GiB = 2**30).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.numa.binding import AffinityMode

from smelt_ds.config.cluster import ClusterLayout
from smelt_ds.config.loading import dump_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.launch.k8s_mounts import K8S_RECIPE, K8S_RECIPE_DIR, pod_mounts, unseen_paths
from smelt_ds.launch.placement import MIN_HEADROOM, memory_report, place, zero3_decision
from smelt_ds.resources import DATA_ROOT

__all__ = ["SCHEDULERS", "LAUNCHERS_DIR", "TEMPLATES", "NCCL_FAULT_ENV", "Host", "parse_hostfile", "expand_nodelist",
           "JobOptions", "JobPlan", "plan_job", "render", "fill_template", "per_node_command", "k8s_pod_command",
           "summary", "main", "GLOO_FROM_NCCL", "gloo_ifname", "slurm_min_time", "k8s_scheduling", "NUMA_MODES",
           "GANG_SCHEDULERS", "K8S_RESTART_POLICIES", "slurm_log_dir"]

SCHEDULERS = ("deepspeed", "slurm", "k8s")
LAUNCHERS_DIR = DATA_ROOT / "launchers"
TEMPLATES = {"deepspeed": LAUNCHERS_DIR / "deepspeed" / "run.sh",
             "slurm": LAUNCHERS_DIR / "slurm" / "smelt.sbatch",
             "k8s": LAUNCHERS_DIR / "k8s" / "pytorchjob.yaml"}
#: where the repository lives in the image of launchers/k8s/Dockerfile
K8S_WORKDIR = "/workspace/smelt-ds"
#: ``--gang``: the gang scheduler -> the pods' schedulerName (Volcano's; scheduler-plugins' as a second scheduler)
GANG_SCHEDULERS = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}
#: ``--restart-policy``: the PyTorchJob replicas' restart policies render-job writes (k8s_pod_command)
K8S_RESTART_POLICIES = ("ExitCode", "OnFailure")
#: torchrun's --numa-binding modes (torch.numa.binding.AffinityMode)
NUMA_MODES = tuple(m.value for m in AffinityMode)
_FIELD = re.compile(r"\{\{([A-Z0-9_]+)\}\}")
#: NCCL fault handling in every rendered job (docs/cluster.md, "Faults and hangs on a cluster";
#: docs/faults.md, the NCCL exit statuses): error handling 3 (SkipCleanUp, torch's default, as torchtitan
#: sets it): a failed or timed-out collective does not abort the rank, so the flight-recorder dump is
#: written and the hang watchdog ends the rank with its stacks and exit status 124;
#: name -> default; ``{run_dir}`` is the run directory as the job sees it. The bash scripts export
#: them unless already set, the Kubernetes pods list them; ``--env NAME=VALUE`` overrides any.
NCCL_FAULT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                  "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "{run_dir}/nccl_trace/rank_",
                  "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}

#: the shell line of every job (Slurm script, deepspeed script, Kubernetes pod command) that gives
#: gloo the interface NCCL was given: when ``GLOO_SOCKET_IFNAME`` is unset and
#: ``NCCL_SOCKET_IFNAME`` names interfaces (NCCL's ``=`` prefix dropped; not an ``^`` exclusion)
#: that this node has (``/sys/class/net``), it exports ``GLOO_SOCKET_IFNAME`` to the same ones: the
#: gloo groups (the control group, the in-loop harness) otherwise bind the address the host name
#: resolves to, which on a multi-NIC node may be an interface the peers cannot reach
#: (:func:`gloo_ifname` is the same rule in Python)
GLOO_FROM_NCCL = ('if [[ -z "${GLOO_SOCKET_IFNAME:-}" && -n "${NCCL_SOCKET_IFNAME:-}" '
                  '&& "${NCCL_SOCKET_IFNAME}" != ^* ]] '
                  '&& (IFS=,; for i in ${NCCL_SOCKET_IFNAME#=}; do [[ -e "/sys/class/net/$i" ]] || exit 1; done); '
                  'then export GLOO_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME#=}"; fi')


def gloo_ifname(nccl: str, have: Iterable[str]) -> str | None:
    """The ``GLOO_SOCKET_IFNAME`` a job derives from ``NCCL_SOCKET_IFNAME`` = ``nccl`` on a node
    whose interfaces are ``have`` (:data:`GLOO_FROM_NCCL`): ``nccl`` without NCCL's exact-match
    ``=`` prefix when every comma-separated name is in ``have``; None for an empty value, an ``^``
    exclusion list, or a name (or NCCL prefix such as ``ib``) that is no interface of the node."""
    if not nccl or nccl.startswith("^"):
        return None
    names = nccl.removeprefix("=")
    return names if all(n in set(have) for n in names.split(",")) else None


# ---------------------------------------------------------------------------------------------
# hosts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """One hostfile line: a host name (short or fully qualified) and its GPU slots."""

    name: str
    slots: int


#: a deepspeed hostfile entry exactly as ``deepspeed.launcher.runner._parse_hostfile`` matches it:
#: at the start of the stripped line, the host, whitespace, then ``slots=`` and digits with nothing
#: in between; whatever follows the digits is ignored (by the launcher, hence here too)
_HOSTFILE_ENTRY = re.compile(r"(\S+)\s+slots=(\d+)")


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse a DeepSpeed hostfile, accepting exactly the files the deepspeed launcher accepts
    (``deepspeed.launcher.runner.fetch_hostfile`` / ``_parse_hostfile``) and reading the same hosts
    and slots from them.

    Per line, after stripping surrounding whitespace: blank lines and lines *starting* with ``#``
    are skipped (a ``#`` later in a line is not a comment); every other line must start with
    ``HOSTNAME``, whitespace, then ``slots=N`` (no spaces around ``=``; ``N`` digits: GPU slots,
    ``0`` included, as the launcher takes it); anything after the digits is ignored, as by the
    launcher (e.g. an MPI ``max_slots=8`` or ``# comment``). Lines end at LF, CRLF or CR (Python's
    universal newlines, as the launcher reads the file). ``source`` names the file in
    errors. Whether a host has the slots a job needs is :func:`plan_job`'s check, not this one.

    Returns:
        the hosts in file order.

    Raises:
        ConfigError: a line the launcher refuses (e.g. ``host slots = 8``, ``host 8``), a host on
            two lines, or no host at all; the message names ``source``, the line number, the line
            and the fix.
    """
    hosts: list[Host] = []
    first_line: dict[str, int] = {}
    for n, raw in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOSTFILE_ENTRY.match(line)
        if m is None:
            raise ConfigError(f"{source} line {n}: {line!r} is not a deepspeed hostfile entry `HOSTNAME slots=N` "
                              f"(the deepspeed launcher refuses it): {_hostfile_fix(line)}")
        name, slots = m.group(1), int(m.group(2))
        if name in first_line:
            raise ConfigError(f"{source} line {n}: {line!r}: host {name!r} is listed twice (first on line "
                              f"{first_line[name]}), which the deepspeed launcher refuses: keep one line per host")
        first_line[name] = n
        hosts.append(Host(name, slots))
    if not hosts:
        raise ConfigError(f"{source} lists no hosts (only blank lines and `#` comments): add one `HOSTNAME slots=N` "
                          "line per node, e.g. `gpu-node-001.example.org slots=8`")
    return hosts


def _hostfile_fix(line: str) -> str:
    """How to write a hostfile line the launcher refuses (for the error message)."""
    m = re.match(r"(\S+)\s+slots\s*[=:]?\s*(\d+)", line, re.IGNORECASE)
    if m is not None:
        return f"write `{m.group(1)} slots={m.group(2)}` (lower-case `slots=`, no spaces around `=`)"
    m = re.fullmatch(r"(\S+)\s+(\d+)", line)
    if m is not None:
        return f"write `{m.group(1)} slots={m.group(2)}`"
    return ("write one host per line as `HOSTNAME slots=N` (the host, a space, then `slots=` and its GPU count), "
            "e.g. `gpu-node-001.example.org slots=8`; start a comment line with `#`")


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [s.strip() for s in out if s.strip()]


def _expand_item(item: str, nodelist: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"node list {nodelist!r}: unbalanced brackets in {item!r}")
        return [item]
    names = []
    for part in m.group(1).split(","):
        r = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if r is None or (r.group(2) is not None and int(r.group(2)) < int(r.group(1))):
            raise ConfigError(f"node list {nodelist!r}: range {part!r} is not N or N-M with N <= M")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        width = len(lo) if lo.startswith("0") else 0
        for i in range(int(lo), int(hi) + 1):
            names.append(str(i).zfill(width))
    head, tail = item[:m.start()], item[m.end():]
    return [x for n in names for x in _expand_item(head + n + tail, nodelist)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``SLURM_JOB_NODELIST``) like ``scontrol show hostnames``:
    ``gpu[001-003,007],login-1`` -> ``gpu001 gpu002 gpu003 gpu007 login-1``; several bracket
    groups multiply (``r[1-2]n[1-2]``). Raises ConfigError for an empty or malformed list."""
    items = _split_top(nodelist or "")
    if not items:
        raise ConfigError(f"node list {nodelist!r} is empty: pass SLURM_JOB_NODELIST, e.g. gpu[001-004]")
    return [h for item in items for h in _expand_item(item, nodelist)]


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@dataclass
class JobOptions:
    """What ``smelt-ds render-job`` takes besides the recipe. ``None`` = from the recipe's layout /
    a default. Times in seconds unless named otherwise; ``time`` is Slurm's ``D-HH:MM:SS``."""

    scheduler: str
    nodes: int | None = None
    gpus_per_node: int | None = None
    layout: str | None = None
    overrides: list[str] = field(default_factory=list)
    hostfile: str | None = None
    master_port: int | None = None  # deepspeed: 29500 when None; Slurm: 10000 + job id % 20000 when None
    workdir: str | None = None
    job_name: str | None = None
    env: list[str] = field(default_factory=list)
    time: str = "2-00:00:00"
    partition: str | None = None
    account: str | None = None
    sbatch: list[str] = field(default_factory=list)
    log_dir: str | None = None
    signal_lead_s: int = 600
    shutdown_s: int = 300
    startup_s: int = 600  # Slurm: what one start spends before its first step (the --time floor, slurm_min_time)
    cpu_bind: str = "none"  # Slurm: srun --cpu-bind of the one task per node
    numa_binding: str | None = None  # torchrun --numa-binding (node, socket, exclusive, core-complex)
    run_dir: str | None = None
    max_requeues: int = 3
    max_time_requeues: int = 50  # Slurm: requeues at the time limit (a job that makes progress); 50 x --time at most
    image: str = "smelt-ds:latest"
    namespace: str = "default"
    runs_pvc: str = "smelt-runs"
    data_pvc: str = "smelt-corpora"
    backoff_limit: int = 3
    restart_policy: str = "ExitCode"  # k8s: ExitCode (2, 3 never restart) or OnFailure (every failure restarts)
    shm_size: str = "64Gi"
    cpu_per_gpu: int = 8
    memory_per_gpu_gib: int = 64
    node_selector: list[str] = field(default_factory=list)  # k8s: KEY=VALUE
    tolerations: list[str] = field(default_factory=list)  # k8s: KEY[=VALUE][:EFFECT], as kubectl taint writes it
    affinity: str | None = None  # k8s: a YAML/JSON file holding a pod's `affinity`
    rdma_resources: list[str] = field(default_factory=list)  # k8s: NAME=COUNT per pod, e.g. rdma/hca=1
    ipc_lock: bool = False  # k8s: the IPC_LOCK capability (also with any rdma resource)
    gang: str | None = None  # k8s: volcano or scheduler-plugins
    gang_queue: str | None = None  # k8s: the Volcano queue


@dataclass
class JobPlan:
    """A recipe resolved for a cluster: sizes, parallel layout, memory verdict, and what the job
    passes to ``smelt_ds.train`` (``train_args``: the layout's and the user's ``--set``, then
    ``--run-dir`` when given). ``run_dir``: the run directory as the job sees it (absolute when
    the working directory is, else relative to it)."""

    options: JobOptions
    recipe_path: Path
    recipe_arg: str
    workdir: str
    config: RunConfig
    layout_name: str
    layout: ClusterLayout
    nodes: int
    gpus_per_node: int
    train_args: list[str]
    accumulation: int
    global_batch_tokens: int
    hosts: list[Host]
    master_addr: str
    env: dict[str, str]
    job_name: str
    memory: Any
    zero3: Any
    notes: list[str]
    run_dir: str = ""
    #: the layout's and the user's recipe overrides (``--set``), in the order they apply
    config_overrides: list[str] = field(default_factory=list)
    #: this rendering's id (12 hex digits, random): a Kubernetes job counts its pods' failures under it
    render_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ep_size(self) -> int:
        return self.config.moe_runtime.ep_size if self.config.moe_runtime.backend != "reference" else 1


def slurm_log_dir(plan: JobPlan) -> tuple[str, str]:
    """``(what, directory)``: the Slurm job's log directory, absolute (``--log-dir``, relative
    to the working directory, else ``WORKDIR/runs/slurm-logs``), and how the user set it."""
    given = plan.options.log_dir
    if given is None:
        return "the log directory (default WORKDIR/runs/slurm-logs)", os.path.join(plan.workdir, "runs", "slurm-logs")
    return "--log-dir", os.path.normpath(os.path.join(plan.workdir, os.path.expanduser(given)))


def _positive(name: str, value: Any, example: int, unit: str = "") -> None:
    """Raise ConfigError unless ``value`` is an integer >= 1; the message offers ``name example``
    (a sensible value of the option: its default where it has one), in ``unit`` when given."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"`{name}` ({value!r}) must be a positive integer{f' ({unit})' if unit else ''}, e.g. "
                          f"{name} {example}")


def _recipe_arg(path: Path, workdir: str, scheduler: str) -> str:
    """The recipe as the job names it. Kubernetes: the ConfigMap's copy of the resolved recipe
    (:data:`smelt_ds.launch.k8s_mounts.K8S_RECIPE`), so any recipe runs with the stock image.
    Otherwise relative to ``workdir`` (where the job runs) when it lies inside, else absolute."""
    if scheduler == "k8s":
        return K8S_RECIPE
    p = path.resolve()
    try:
        return str(p.relative_to(Path(workdir).resolve()))
    except ValueError:
        return str(p)


def _parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE with a shell variable name, "
                              "e.g. --env NCCL_SOCKET_IFNAME=ib0")
        out[key] = value
    return out


def _job_name(cfg: RunConfig, given: str | None) -> str:
    """The job name: ``--job-name``, checked as a Kubernetes name (lowercase letters, digits and
    ``-``, at most 52 characters, which every scheduler accepts), or derived from the recipe's
    ``name`` made into one (``M_Smelt_Pile.v2`` -> ``smelt-m-smelt-pile-v2``). Raises ConfigError
    for a ``--job-name`` that is not such a name."""
    pattern = r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?"
    if given is None:
        derived = re.sub(r"[^a-z0-9]+", "-", f"smelt-{cfg.name}".lower()).strip("-")[:52].rstrip("-")
        if re.fullmatch(pattern, derived):
            return derived
        raise ConfigError(f"`name` ({cfg.name!r}) gives no usable job name ({derived!r}): pass --job-name, "
                          "e.g. --job-name smelt-xl-smelt")
    if not re.fullmatch(pattern, given):
        raise ConfigError(f"--job-name {given!r}: use lowercase letters, digits and '-' (at most 52 characters, "
                          "a Kubernetes name), e.g. smelt-xl-smelt")
    return given


def plan_job(recipe: str | Path, options: JobOptions) -> JobPlan:
    """Resolve ``recipe`` for ``options`` and check it (see the module docstring).

    Raises ConfigError for an unknown scheduler or layout, non-positive sizes, more GPUs per node
    than the layout's nodes have, an ``ep_size`` that does not divide the world size, a world size
    the global batch cannot be split over, a bad hostfile or one with too few hosts or slots.
    """
    o = options
    if o.scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler {o.scheduler!r} is unknown: use one of {', '.join(SCHEDULERS)}")
    hosts: list[Host] = []
    if o.hostfile is not None:
        hp = Path(o.hostfile)
        if not hp.is_file():
            raise ConfigError(f"--hostfile {o.hostfile!r} does not exist: see launchers/deepspeed/hostfile.example")
        hosts = parse_hostfile(hp.read_text(), str(hp))

    def check_hosts(nodes: int, gpus: int) -> None:
        if o.scheduler != "deepspeed":
            return
        if hosts:
            if len(hosts) < nodes:
                raise ConfigError(f"--hostfile {o.hostfile} lists {len(hosts)} host(s) but the job needs --nodes "
                                  f"{nodes}: add hosts or lower --nodes")
            short = [h for h in hosts[:nodes] if h.slots < gpus]
            if short:
                slots = ", ".join(f"{h.name} has {h.slots} slots" for h in short)
                raise ConfigError(f"--hostfile {o.hostfile}: {slots}"
                                  f", fewer than --gpus-per-node {gpus}: fix the slots or lower --gpus-per-node")
        elif nodes > 1:
            raise ConfigError(f"--nodes {nodes} with --scheduler deepspeed needs --hostfile (the hosts to start ranks "
                              "on): see launchers/deepspeed/hostfile.example")

    pl = place(recipe, o.layout, o.overrides, o.nodes, o.gpus_per_node, default_nodes=len(hosts),
               before_check=check_hosts)
    res, cfg, layout, nodes, gpus = pl.resolved, pl.config, pl.layout, pl.nodes, pl.gpus_per_node
    notes: list[str] = []
    if hosts and o.scheduler != "deepspeed":
        notes.append(f"--hostfile is only used by --scheduler deepspeed; {o.scheduler} finds its hosts itself")
    ep = cfg.moe_runtime.ep_size if cfg.moe_runtime.backend != "reference" else 1
    if ep > 1 and gpus % ep:
        notes.append(f"expert-parallel groups of {ep} GPUs span nodes ({gpus} GPUs per node): the expert "
                     "all-to-all crosses the network")
    mem = memory_report(cfg, layout, nodes, gpus)
    if not mem.fits(MIN_HEADROOM):
        row = mem.configured
        notes.append(f"memory: {row.total / 2**30:.1f} GiB of {layout.device_memory_gib:g} GiB per GPU leaves "
                     f"{row.headroom:.0%} free, under the {MIN_HEADROOM:.0%} headroom: see `smelt-ds memory` for a "
                     "ZeRO stage / checkpointing policy that fits")
    workdir = o.workdir or (K8S_WORKDIR if o.scheduler == "k8s" else str(Path.cwd().resolve()))
    if o.workdir and o.scheduler == "k8s" and not o.workdir.startswith("/"):
        raise ConfigError(f"--workdir {o.workdir!r}: a pod's working directory is an absolute path in its image "
                          f"(default {K8S_WORKDIR}, where launchers/k8s/Dockerfile puts the checkout)")
    if o.workdir and o.scheduler != "k8s":  # a pod's workdir is a path in its image, not here
        wd = Path(o.workdir).expanduser()
        workdir = str(wd if wd.is_absolute() else (Path.cwd() / wd).resolve())
        if not Path(workdir).is_dir():
            raise ConfigError(f"--workdir {o.workdir!r} ({workdir}) is not a directory here: the job changes into it "
                              "on every node; create it on a filesystem every node sees, or fix the path")
    if o.master_port is not None and not 1024 <= o.master_port <= 65535:
        raise ConfigError(f"--master-port ({o.master_port}) must be a port number from 1024 to 65535, e.g. 29500")
    if o.master_port is not None and o.scheduler == "k8s":
        notes.append("--master-port is not used by a Kubernetes job: the operator sets MASTER_PORT")
    # a Kubernetes job carries the recipe resolved with these overrides in its ConfigMap
    train_args = [] if o.scheduler == "k8s" else [x for s in res.overrides for x in ("--set", s)]
    if o.run_dir is not None:
        if not o.run_dir.strip():
            raise ConfigError("--run-dir '' is empty: name the run directory, e.g. --run-dir runs/m-smelt-pile")
        train_args += ["--run-dir", o.run_dir]
    master = hosts[0].name if hosts else ("127.0.0.1" if nodes == 1 else "")
    return JobPlan(o, res.path, _recipe_arg(res.path, workdir, o.scheduler), workdir, cfg, res.layout_name, layout,
                   nodes, gpus, train_args, pl.accumulation, pl.global_batch_tokens, hosts, master, _parse_env(o.env),
                   _job_name(cfg, o.job_name), mem, zero3_decision(cfg, layout, nodes * gpus), notes,
                   _run_dir_in_job(cfg, o.run_dir, workdir), list(res.overrides))


def _run_dir_in_job(cfg: RunConfig, given: str | None, workdir: str) -> str:
    """The run directory as the job's ranks resolve it (``--run-dir`` as given, else
    ``train.run_dir`` with ``{name}``; relative paths are relative to the working directory), made
    absolute with ``workdir`` when that is absolute."""
    run_dir = given if given is not None else cfg.train.run_dir.format(name=cfg.name)
    return os.path.join(workdir, run_dir) if os.path.isabs(workdir) else run_dir


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def fill_template(template: str, values: dict[str, str], name: str, by: str = "render-job") -> str:
    """``template`` with every ``{{FIELD}}`` replaced by ``values[FIELD]`` (the templates under
    ``launchers/``). Raises ConfigError naming the template ``name`` and ``by`` (what renders it)
    when a field has no value."""
    missing = sorted({m for m in _FIELD.findall(template) if m not in values})
    if missing:
        raise ConfigError(f"template {name} has fields {missing} that {by} does not fill")
    return _FIELD.sub(lambda m: values[m.group(1)], template)


def _shell_common(plan: JobPlan) -> dict[str, str]:
    q = shlex.quote
    return {"WORKDIR": q(plan.workdir), "RECIPE": q(plan.recipe_arg), "NODES": str(plan.nodes),
            "GPUS_PER_NODE": str(plan.gpus_per_node), "TRAIN_ARGS": q(shlex.join(plan.train_args)),
            "ENV_EXPORTS": "\n".join(f"export {k}={q(v)}" for k, v in plan.env.items()),
            "GLOO_FROM_NCCL": GLOO_FROM_NCCL,
            "SHUTDOWN_S": str(plan.options.shutdown_s), "RUN_DIR": q(plan.run_dir)}


def per_node_command(plan: JobPlan) -> str:
    """The command every node (pod) runs, with the node rank and master as shell variables."""
    rank = {"slurm": '"$SLURM_NODEID"', "k8s": '"${PET_NODE_RANK:-$RANK}"'}.get(plan.options.scheduler, "0")
    master = '"$MASTER_ADDR"' if plan.options.scheduler != "deepspeed" else shlex.quote(plan.master_addr)
    port = '"$MASTER_PORT"' if plan.options.scheduler != "deepspeed" else str(_deepspeed_port(plan.options))
    # a pod reads the ConfigMap's recipe; SMELT_RECIPE names another copy (a local test of the command)
    recipe = f'"${{SMELT_RECIPE:-{plan.recipe_arg}}}"' if plan.options.scheduler == "k8s" else \
        shlex.quote(plan.recipe_arg)
    numa = f"--numa-binding={plan.options.numa_binding} " if plan.options.numa_binding else ""
    return (f"python -m torch.distributed.run --nnodes={plan.nodes} --nproc-per-node={plan.gpus_per_node} {numa}"
            f"--node-rank={rank} --master-addr={master} --master-port={port} "
            f"-m smelt_ds.train {recipe} {shlex.join(['--resume', 'auto', *plan.train_args])}")


def k8s_pod_command(plan: JobPlan) -> str:
    """What a Kubernetes pod runs (``bash -c``, the container's first process): creates the flight
    recorder's dump directory (it writes into an existing directory only), gives gloo NCCL's
    interface (:data:`GLOO_FROM_NCCL`), then runs torchrun
    (:func:`per_node_command`) and waits for it.

    On the first SIGTERM (the kubelet's, on deletion, eviction or preemption), SIGINT or SIGHUP it
    passes SIGTERM to torchrun once (a second one would cut torchrun's wait for the ranks short),
    which passes it to the ranks: each finishes its step, they save a checkpoint together and exit
    143; the pod then exits 143 as well (torchrun itself reports the signal as a failure, exit 1
    with a ``SignalException`` traceback, which a restart policy could take for a crash).

    Otherwise, as torchrun reports any failed rank as 1, the ranks write their own statuses to a
    directory of the pod (:mod:`smelt_ds.train.exit_status`): when one wrote 2 (bad configuration) or
    3 (non-finite steps) the pod exits with it, which the ``ExitCode`` restart policy
    (``--restart-policy``, the default) never restarts (1-127: permanent). Any other failure is
    retryable there: the pod exits 128 + torchrun's status (129 for a failed rank) while it has failed
    at most ``--backoff-limit`` times, counted in ``<run_dir>/exit_status/k8s-<render id>/<pod>.failures``
    on the shared volume (the training operator does not apply ``runPolicy.backoffLimit`` to this
    policy's restarts, kubeflow/trainer#2045), then 1 (permanent: the job fails). Under ``OnFailure``
    the pod exits with 2, 3 or torchrun's status and ``runPolicy.backoffLimit`` caps the restarts."""
    o = plan.options
    on_stop = ('on_stop() { [[ -z "$stop" ]] || return 0; stop=143; '
               'echo "smelt-ds: $1: passing SIGTERM to torchrun: the ranks finish their step, save a checkpoint '
               'and exit" >&2; [[ -z "$pid" ]] || kill -TERM "$pid" 2>/dev/null || true; }; ')
    # a rank's own 2 or 3 (in that order) wins over torchrun's 1
    no_restart = ('[[ -z "$stop" ]] || exit "$stop"; [[ "$rc" != 0 ]] || exit 0; for s in 2 3; do '
                  'if grep -qsx "$s" "$SMELT_EXIT_STATUS_DIR"/rank*; then echo "smelt-ds: torchrun exited $rc; a rank '
                  'exited $s (2: bad configuration, 3: non-finite steps): not restarting" >&2; exit "$s"; fi; done; ')
    if o.restart_policy == "OnFailure":
        retry = 'exit "$rc"'
    else:
        count = shlex.quote(f"{plan.run_dir}/exit_status/k8s-{plan.render_id}")
        retry = (f'f={count}/"$(hostname)".failures; mkdir -p {count}; n=$(( $(cat "$f" 2>/dev/null || echo 0) + 1 )); '
                 f'echo "$n" > "$f"; if (( n > {o.backoff_limit} )); then echo "smelt-ds: torchrun exited $rc, failure '
                 f'$n of this pod: not restarting: limit reached ({o.backoff_limit}; render-job --backoff-limit)" >&2; '
                 'exit 1; fi; r=$(( rc < 128 ? 128 + rc : rc )); echo "smelt-ds: torchrun exited $rc (a rank failed, '
                 f'hung or lost a peer), failure $n of this pod: exiting $r, restarted (at most {o.backoff_limit} '
                 'times)" >&2; exit "$r"')
    return ('[[ -z "${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}" ]] || '
            'mkdir -p "$(dirname "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE")"; stop=; pid=; ' + on_stop
            + "trap 'on_stop SIGTERM' TERM; trap 'on_stop SIGINT' INT; trap 'on_stop SIGHUP' HUP; "
            + GLOO_FROM_NCCL + '; '
            'export SMELT_EXIT_STATUS_DIR="${TMPDIR:-/tmp}/smelt-exit-status"; rm -rf "$SMELT_EXIT_STATUS_DIR"; '
            + per_node_command(plan) + ' & pid=$!; '
            '[[ -z "$stop" ]] || kill -TERM "$pid"; '  # a signal while it started
            # a trapped signal ends `wait` early (status > 128): wait again until torchrun has exited
            'until wait "$pid"; rc=$?; ! kill -0 "$pid" 2>/dev/null; do :; done; ' + no_restart + retry)


def _deepspeed_port(o: JobOptions) -> int:
    return o.master_port if o.master_port is not None else 29500


def slurm_seconds(limit: str) -> int:
    """Seconds of a Slurm time limit (sbatch --time): ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``
    or ``D-H:M:S``; ``UNLIMITED``, ``infinite`` and ``0`` (no limit) give 10^12. Raises ConfigError
    for another form."""
    if limit.lower() in ("unlimited", "infinite", "0"):  # no time limit: the job is never signalled for it
        return 10 ** 12
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d\d))?(?::(\d\d))?", limit)
    if not m:
        raise ConfigError(f"--time {limit!r} is not a Slurm time limit: write D-HH:MM:SS or HH:MM:SS, e.g. 2-00:00:00")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        return ((int(days) * 24 + int(a)) * 60 + int(b or 0)) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return (int(a) * 60 + int(b)) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # M or M:S


def slurm_min_time(o: JobOptions) -> int:
    """The shortest Slurm ``--time`` (seconds) a job of options ``o`` accepts: ``startup_s`` (what a
    start spends before its first step: allocation, imports, DeepSpeed initialisation, loading the
    checkpoint) + ``shutdown_s`` (the time the ranks get to save a checkpoint, taken as the least
    training a start must do: no start trains for less time than its save takes) + ``signal_lead_s``
    (the script checkpoints and requeues that long before the limit). With the defaults, 600 + 300 +
    600 s = 25 min."""
    return o.startup_s + o.shutdown_s + o.signal_lead_s


def _slurm_time(seconds: int) -> str:
    """``seconds`` as a Slurm time limit ``H:MM:SS`` rounded up to whole minutes."""
    minutes = -(-seconds // 60)
    return f"{minutes // 60}:{minutes % 60:02d}:00"


def _render_slurm(plan: JobPlan) -> dict[str, str]:
    o = plan.options
    extra = [f"#SBATCH --partition={o.partition}"] if o.partition else []
    extra += [f"#SBATCH --account={o.account}"] if o.account else []
    for opt in o.sbatch:
        if not opt.startswith("--") or "\n" in opt:
            raise ConfigError(f"--sbatch {opt!r}: pass one sbatch option such as --sbatch=--qos=high")
        extra.append(f"#SBATCH {opt}")
    limit = slurm_seconds(o.time)
    _positive("--signal-lead", o.signal_lead_s, JobOptions.signal_lead_s, "seconds")
    _positive("--startup-time", o.startup_s, JobOptions.startup_s, "seconds")
    if limit <= o.signal_lead_s:
        raise ConfigError(f"--time {o.time!r} ({limit} s) must be longer than --signal-lead ({o.signal_lead_s} s): the "
                          "job checkpoints and requeues that many seconds before its time limit; give a longer --time "
                          "or a shorter --signal-lead")
    if o.shutdown_s >= o.signal_lead_s:
        raise ConfigError(f"--shutdown-timeout ({o.shutdown_s} s) must be shorter than --signal-lead "
                          f"({o.signal_lead_s} s): the ranks must have saved before the time limit")
    floor = slurm_min_time(o)
    if limit < floor:
        raise ConfigError(f"--time {o.time!r} ({limit} s) is shorter than one start needs, {floor} s = --startup-time "
                          f"({o.startup_s} s: allocation, imports, DeepSpeed and checkpoint load) + --shutdown-timeout "
                          f"({o.shutdown_s} s: one checkpoint save's worth of training) + --signal-lead "
                          f"({o.signal_lead_s} s: the checkpoint and requeue before the limit); a start would requeue "
                          f"having trained little or nothing: give --time {_slurm_time(floor)} or more")
    if not re.fullmatch(r"[A-Za-z0-9_.:,\-]+", o.cpu_bind or ""):
        raise ConfigError(f"--cpu-bind {o.cpu_bind!r} is not an srun --cpu-bind value: write e.g. none, cores, "
                          "sockets, ldoms or map_ldom:0,1 (man srun)")
    log_dir = slurm_log_dir(plan)[1]  # absolute: sbatch resolves #SBATCH --output in its own directory
    if re.search(r"\s", log_dir):
        what = f"--log-dir {log_dir!r}" if o.log_dir else \
            f"the default log directory ({log_dir!r}, under --workdir {plan.workdir!r})"
        raise ConfigError(f"{what}: #SBATCH --output cannot hold spaces; pass --log-dir DIR without spaces")
    for name, n, what, example in (("--max-requeues", o.max_requeues, "a failed job", 3),
                                   ("--max-time-requeues", o.max_time_requeues, "a job at its time limit", 50)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"`{name}` ({n!r}) must be 0 (never requeue {what}) or a positive integer, e.g. "
                              f"{name} {example}")
    port = str(o.master_port) if o.master_port is not None else "$((10000 + SLURM_JOB_ID % 20000))"
    return {**_shell_common(plan), "JOB_NAME": plan.job_name, "TIME": o.time, "SIGNAL_LEAD_S": str(o.signal_lead_s),
            "MASTER_PORT": port, "CPU_BIND": o.cpu_bind,
            "NUMA_ARGS": f" --numa-binding={o.numa_binding}" if o.numa_binding else "",
            "LOG_DIR": log_dir, "EXTRA_SBATCH": "\n".join(extra), "MAX_REQUEUES": str(o.max_requeues),
            "MAX_TIME_REQUEUES": str(o.max_time_requeues),
            "PYTHON": shlex.quote(sys.executable)}  # the interpreter that has smelt-ds: the one rendering the job


def _render_deepspeed(plan: JobPlan) -> dict[str, str]:
    o = plan.options
    hostfile = str(Path(o.hostfile).resolve()) if o.hostfile else ""
    return {**_shell_common(plan), "HOSTFILE": shlex.quote(hostfile), "MASTER_ADDR": shlex.quote(plan.master_addr),
            "MASTER_PORT": str(_deepspeed_port(o)), "ENV_NAMES": " ".join(plan.env)}


def _render_k8s(plan: JobPlan) -> dict[str, str]:
    o = plan.options
    j = json.dumps
    for name, v in (("--image", o.image), ("--namespace", o.namespace), ("--runs-pvc", o.runs_pvc),
                    ("--data-pvc", o.data_pvc)):
        if not v or re.search(r"\s", v):
            raise ConfigError(f"`{name}` ({v!r}) must be a non-empty name without spaces")
    _positive("--cpus-per-gpu", o.cpu_per_gpu, JobOptions.cpu_per_gpu, "CPU cores")
    _positive("--memory-per-gpu", o.memory_per_gpu_gib, JobOptions.memory_per_gpu_gib, "GiB")
    if not isinstance(o.backoff_limit, int) or isinstance(o.backoff_limit, bool) or o.backoff_limit < 0:
        raise ConfigError(f"`--backoff-limit` ({o.backoff_limit!r}) must be 0 (never restart a failed pod) or a "
                          "positive integer, e.g. --backoff-limit 3")
    if o.restart_policy not in K8S_RESTART_POLICIES:
        raise ConfigError(f"--restart-policy {o.restart_policy!r}: use ExitCode (a bad configuration never restarts) "
                          "or OnFailure (every failure restarts, up to --backoff-limit)")
    mounts = pod_mounts(plan.workdir, o.runs_pvc, o.data_pvc)
    unseen = unseen_paths(plan.config, plan.workdir, plan.run_dir, mounts, plan.env)
    if unseen:
        where = "; ".join(f"{m.path} ({m.what})" for m in mounts)
        raise ConfigError("a pod of this job cannot use these recipe paths:\n  " + "\n  ".join(unseen)
                          + f"\nthe pod sees: {where}; and the image's checkout {plan.workdir} (read-only)")
    cmd = k8s_pod_command(plan)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", plan.recipe_path.name)[-63:].strip("_.-") or "recipe"
    env = {**{k: v.format(run_dir=plan.run_dir) for k, v in NCCL_FAULT_ENV.items()}, **plan.env}  # --env wins
    items = [f"                - {{name: {k}, value: {j(v)}}}" for k, v in env.items()]
    return {**k8s_scheduling(plan), "RESTART_POLICY": o.restart_policy,
            "JOB_NAME": j(plan.job_name), "NAMESPACE": j(o.namespace), "RECIPE_LABEL": j(label),
            "BACKOFF_LIMIT": str(o.backoff_limit), "GRACE_S": str(o.shutdown_s + 60), "IMAGE": j(o.image),
            "WORKDIR": j(plan.workdir), "NODE_CMD": j(cmd), "NODES": str(plan.nodes),
            "GPUS_PER_NODE": str(plan.gpus_per_node), "SHUTDOWN_S": str(o.shutdown_s),
            "CACHE_DIR": j(f"{plan.workdir}/runs/.cache/smelt-ds"), "ENV_ITEMS": "\n".join(items),
            "CPU_REQUEST": str(o.cpu_per_gpu * plan.gpus_per_node),
            "MEMORY_REQUEST": j(f"{o.memory_per_gpu_gib * plan.gpus_per_node}Gi"),
            "RUNS_MOUNT": j(f"{plan.workdir}/runs"), "CORPORA_MOUNT": j(f"{plan.workdir}/corpora"),
            "SHM_SIZE": j(o.shm_size), "RUNS_PVC": j(o.runs_pvc), "DATA_PVC": j(o.data_pvc),
            "WORKERS": str(plan.nodes - 1), "RECIPE_CONFIGMAP": j(f"{plan.job_name}-recipe"),
            "RECIPE_DIR": j(K8S_RECIPE_DIR), "RECIPE_FILE": j(K8S_RECIPE.rsplit("/", 1)[1]),
            "RECIPE_YAML": j(f"# {plan.recipe_path.name}, resolved by smelt-ds render-job "
                             f"(overrides: {' '.join(plan.config_overrides) or 'none'})\n"
                             + dump_config(plan.config))}


#: Kubernetes' rule for a label value, a taint value and the name part of a key (``IsQualifiedName``,
#: ``IsValidLabelValue``; apimachinery's ``validation``), for messages
K8S_NAME_RULE = "at most 63 characters: alphanumerics, '-', '_', '.', starting and ending with an alphanumeric"
_K8S_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _k8s_name_problem(text: str) -> str | None:
    """Why ``text`` is not a Kubernetes label value / key name (:data:`K8S_NAME_RULE`; not empty), or None."""
    bad = sorted({c for c in text if not (c.isascii() and (c.isalnum() or c in "-_."))})
    if bad:
        return "may not contain " + " or ".join("a space" if c == " " else repr(c) for c in bad)
    if len(text) > 63:
        return f"has {len(text)} characters, more than 63"
    if not _K8S_NAME.fullmatch(text):
        return "is empty" if not text else "must start and end with a letter or digit"
    return None


def _k8s_key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label key ``[PREFIX/]NAME`` (the key of a label, a taint or
    a resource: NAME per :data:`K8S_NAME_RULE`, PREFIX a DNS subdomain of at most 253 characters),
    or None."""
    prefix, slash, name = key.rpartition("/")
    if "/" in prefix:
        return "has more than one '/'"
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"its prefix {prefix!r} is not a DNS subdomain: lower-case alphanumerics, '-' and '.'"
    problem = _k8s_name_problem(name)
    return None if problem is None else f"its name {name!r} {problem}"


def _k8s_key_error(option: str, item: str, key: str, problem: str, example: str) -> ConfigError:
    return ConfigError(f"{option} {item!r}: the key {key!r} is not a Kubernetes label key: {problem} (a key is "
                       f"[PREFIX/]NAME, NAME {K8S_NAME_RULE}; PREFIX a DNS subdomain such as nvidia.com), "
                       f"e.g. {option} {example}")


def _k8s_pairs(option: str, items: list[str], what: str, check: Callable[[str], str | None],
               example: str) -> dict[str, str]:
    """``KEY=VALUE`` options (``--node-selector``, ``--rdma-resource``) as a mapping; a key is a
    Kubernetes label key (``[PREFIX/]NAME``, :func:`_k8s_key_problem`), ``check(value)`` says what is
    wrong with a value (None: nothing), ``what`` names the values in messages. Raises ConfigError for
    an item without ``=``, a bad key or value (naming the rule broken), and for a key given twice (a
    mapping holds one value per key: the second would silently replace the first)."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq:
            raise ConfigError(f"{option} {item!r}: write KEY=VALUE, e.g. {option} {example}")
        problem = _k8s_key_problem(key)
        if problem is not None:
            raise _k8s_key_error(option, item, key, problem, example)
        problem = check(val)
        if problem is not None:
            raise ConfigError(f"{option} {item!r}: {what} {val!r} {problem}, e.g. {option} {example}")
        if key in out:
            raise ConfigError(f"{option} {key} is given twice ({key}={out[key]} and {item}): give each key once")
        out[key] = val
    return out


def _label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a Kubernetes label value (empty, or :data:`K8S_NAME_RULE`), or None."""
    problem = _k8s_name_problem(value) if value else None
    return None if problem is None else f"{problem} (a Kubernetes label value: {K8S_NAME_RULE}, or empty)"


def _count_problem(value: str) -> str | None:
    """Why ``value`` is not a positive device count, or None."""
    return None if re.fullmatch(r"[1-9][0-9]*", value) else "must be a positive integer (devices per pod)"


_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _tolerations(items: list[str]) -> list[dict[str, str]]:
    """``--toleration KEY[=VALUE][:EFFECT]`` (a taint as ``kubectl taint`` writes it) as pod tolerations:
    operator Equal with a value, Exists without; every effect when none is given. Raises ConfigError
    naming what is wrong: the effect, the key (:func:`_k8s_key_problem`), the value (a label value),
    or an empty value after ``=`` (write ``KEY:EFFECT`` for any value, or give the value)."""
    out = []
    example = "e.g. --toleration nvidia.com/gpu:NoSchedule"
    for item in items:
        taint, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
        if colon and effect not in _TAINT_EFFECTS:
            raise ConfigError(f"--toleration {item!r}: write KEY[=VALUE][:EFFECT] with EFFECT "
                              f"{', '.join(_TAINT_EFFECTS[:-1])} or {_TAINT_EFFECTS[-1]} (not {effect!r}), {example}")
        key, eq, value = taint.partition("=")
        problem = _k8s_key_problem(key)
        if problem is not None:
            raise _k8s_key_error("--toleration", item, key, problem, "nvidia.com/gpu:NoSchedule")
        if eq and not value:
            raise ConfigError(f"--toleration {item!r}: the value after '=' is empty: write {key}{colon}{effect} "
                              f"to tolerate the taint whatever its value (operator Exists), or give the value, "
                              f"{key}=VALUE{colon}{effect}")
        problem = _k8s_name_problem(value) if eq else None
        if problem is not None:
            raise ConfigError(f"--toleration {item!r}: the value {value!r} {problem} (a taint value: "
                              f"{K8S_NAME_RULE}), {example}")
        t = {"key": key, "operator": "Equal" if eq else "Exists"}
        t.update({"value": value} if eq else {})
        t.update({"effect": effect} if effect else {})
        out.append(t)
    return out


def _affinity(path: str | None) -> dict[str, Any] | None:
    """The pod ``affinity`` in the YAML/JSON file ``path`` (the object itself, or a mapping with an
    ``affinity`` key), checked for its three keys; Kubernetes checks the rest at ``kubectl apply``."""
    if path is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--affinity {path!r}: cannot read it as YAML ({e}): name a file holding a pod's "
                          "affinity, e.g. {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: ...}}") from e
    if isinstance(data, dict) and set(data) == {"affinity"}:
        data = data["affinity"]
    keys = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    if not isinstance(data, dict) or not data or not set(data) <= keys:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--affinity {path!r} holds {got}: a pod's affinity has only the keys {sorted(keys)}")
    return data


def k8s_scheduling(plan: JobPlan) -> dict[str, str]:
    """The Kubernetes template's scheduling fields (YAML lines, JSON flow values, empty when unused):
    ``SCHEDULING_POLICY`` (``runPolicy.schedulingPolicy`` for ``--gang``: ``minAvailable`` = the pods,
    ``queue``), ``POD_PLACEMENT`` (``schedulerName``, ``nodeSelector``, ``tolerations``,
    ``affinity``), ``SECURITY_CONTEXT`` (``IPC_LOCK`` with ``--ipc-lock`` or any ``--rdma-resource``)
    and ``DEVICE_RESOURCES`` (``--rdma-resource NAME=COUNT``, in limits and requests). Raises
    ConfigError naming the option, the value and the form it takes."""
    o, j = plan.options, json.dumps
    if o.gang not in (None, *GANG_SCHEDULERS):
        raise ConfigError(f"--gang {o.gang!r}: use one of {', '.join(GANG_SCHEDULERS)} (the training operator's "
                          "--gang-scheduler-name)")
    if o.gang_queue is not None and o.gang != "volcano":
        raise ConfigError(f"--gang-queue {o.gang_queue!r} names a Volcano queue: add --gang volcano")
    policy = {"minAvailable": plan.nodes, **({"queue": o.gang_queue} if o.gang_queue else {})}
    pod: dict[str, Any] = {"schedulerName": GANG_SCHEDULERS[o.gang]} if o.gang else {}
    selector = _k8s_pairs("--node-selector", o.node_selector, "the label value", _label_value_problem,
                          "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
    pod.update({"nodeSelector": selector} if selector else {})
    tolerations = _tolerations(o.tolerations)
    pod.update({"tolerations": tolerations} if tolerations else {})
    affinity = _affinity(o.affinity)
    pod.update({"affinity": affinity} if affinity else {})
    rdma = _k8s_pairs("--rdma-resource", o.rdma_resources, "the COUNT", _count_problem, "rdma/hca=1")
    for name in rdma:
        if "/" not in name or name == "nvidia.com/gpu" or name.split("/")[0].endswith("kubernetes.io"):
            raise ConfigError(f"--rdma-resource {name}=...: name a device plugin's resource DOMAIN/NAME other than "
                              "the GPUs (requested already), e.g. rdma/hca, rdma/rdma_shared_device_a or "
                              "nvidia.com/hostdev")
    caps = {"capabilities": {"add": ["IPC_LOCK"]}} if o.ipc_lock or rdma else None
    return {"SCHEDULING_POLICY": f"    schedulingPolicy: {j(policy)}" if o.gang else "",
            "POD_PLACEMENT": "\n".join(f"          {k}: {j(v)}" for k, v in pod.items()),
            "SECURITY_CONTEXT": f"              securityContext: {j(caps)}  # RDMA pins memory" if caps else "",
            "DEVICE_RESOURCES": "\n".join(f"                  {k}: {v}" for k, v in rdma.items())}


def render(plan: JobPlan) -> str:
    """The filled template of ``plan.options.scheduler``. Raises ConfigError for bad scheduler
    options (time limit, sbatch lines, image name, ...)."""
    s, numa = plan.options.scheduler, plan.options.numa_binding
    if numa is not None and (s == "deepspeed" or numa not in NUMA_MODES):
        raise ConfigError(f"--numa-binding {numa!r}: " + (
            "the deepspeed launcher binds with its own --bind_cores_to_rank; use --scheduler slurm or k8s"
            if s == "deepspeed" else f"torchrun's modes are {', '.join(NUMA_MODES)} (node: the CPUs of the NUMA node "
                                     "of the rank's GPU)"))
    template = TEMPLATES[s].read_text()
    values = {"slurm": _render_slurm, "deepspeed": _render_deepspeed, "k8s": _render_k8s}[s](plan)
    if s == "k8s" and plan.nodes == 1:  # a single pod: the Master alone
        template = re.sub(r"\n    Worker:.*?template: \*pod\n", "\n", template, flags=re.S)
    if s == "k8s":  # --env replaces a variable the template sets (a container lists each name once)
        for k in plan.env:
            template = re.sub(rf"\n *- \{{name: {re.escape(k)}, value: [^\n]*", "", template)
        for k in ("SCHEDULING_POLICY", "POD_PLACEMENT", "SECURITY_CONTEXT", "DEVICE_RESOURCES"):
            if not values[k]:  # an option not given: no line
                template = template.replace(f"\n{{{{{k}}}}}", "")
    return fill_template(template, values, str(TEMPLATES[s].relative_to(DATA_ROOT)))


def submit_command(plan: JobPlan, output: str | None) -> str:
    """How to submit the rendered file (without ``-o``: render it to a file first)."""
    s = plan.options.scheduler
    f = shlex.quote(output) if output else {"slurm": "job.sbatch", "k8s": "job.yaml", "deepspeed": "run.sh"}[s]
    run = {"slurm": f"sbatch {f}", "k8s": f"kubectl apply -f {f}", "deepspeed": f"bash {f}"}[s]
    return run if output else f"render it with -o {f}, then {run}"


def _launch_lines(plan: JobPlan, output: str | None) -> list[str]:
    o = plan.options
    if o.scheduler == "deepspeed":
        hostfile = f" --hostfile {shlex.quote(str(Path(o.hostfile).resolve()))}" if o.hostfile else ""
        train = shlex.join([plan.recipe_arg, "--resume", "auto", *plan.train_args])
        lines = [f"master        {plan.master_addr}:{_deepspeed_port(o)}"
                 + (f" (first host of {o.hostfile})" if plan.hosts else " (this machine)"),
                 f"launch        deepspeed --num_nodes {plan.nodes} --num_gpus {plan.gpus_per_node} --master_addr "
                 f"{plan.master_addr} --master_port {_deepspeed_port(o)}{hostfile} --module smelt_ds.train {train}"]
    else:
        port = f"port {o.master_port}" if o.master_port else "port 10000 + $SLURM_JOB_ID % 20000"
        where = {"slurm": f"first host of $SLURM_JOB_NODELIST, {port}",
                 "k8s": f"the Master pod's Service ({plan.job_name}-master-0), port set by the operator"}[o.scheduler]
        lines = [f"master        {where}", f"per node      {per_node_command(plan)}"]
    return lines + [f"submit        {submit_command(plan, output)}"]


def _parallel_lines(plan: JobPlan) -> list[str]:
    c, t, ep, world = plan.config, plan.config.train, plan.ep_size, plan.world_size
    lines = [f"data parallel {world} ranks x micro-batch {t.micro_batch_size} x {t.seq_len} tokens x "
             f"accumulation {plan.accumulation} = {plan.global_batch_tokens:,} tokens per step"]
    if ep > 1:
        intra = "inside a node" if plan.gpus_per_node % ep == 0 else "spanning nodes"
        lines.append(f"expert par.   {c.moe_runtime.backend}, ep_size {ep}: {world // ep} group(s) of {ep} "
                     "consecutive ranks "
                     f"({intra}), {c.moe.num_experts // ep} of {c.moe.num_experts} experts per GPU; each expert "
                     f"replicated on {world // ep} ranks (expert-data-parallel)")
    else:
        lines.append(f"expert par.   none ({c.moe_runtime.backend} backend): all {c.moe.num_experts} experts "
                     "on every GPU")
    ds = c.deepspeed
    offload = "".join(f", offload {what} {dev}" for what, dev in (("optimizer", ds.offload_optimizer),
                                                                  ("params", ds.offload_param)) if dev != "none")
    lines.append(f"ZeRO          stage {ds.zero_stage}{offload}; activation checkpointing "
                 f"'{t.activation_checkpointing.policy}'; precision {plan.memory.precision}")
    if plan.zero3 is not None:
        lines.append(f"ZeRO-3 loops  {plan.zero3.reason}")
    return lines


def _memory_line(plan: JobPlan) -> str:
    row, lay = plan.memory.configured, plan.layout
    verdict = "fits" if plan.memory.fits(MIN_HEADROOM) else "DOES NOT FIT"
    return (f"memory/GPU    {row.total / 2**30:.1f} GiB of {lay.device_memory_gib:g} GiB (model states "
            f"{row.model_states / 2**30:.1f}, activations {row.activations_peak / 2**30:.1f}, buffers "
            f"{row.temporary / 2**30:.1f}): {verdict}, {row.headroom:.0%} headroom "
            f"(needs {MIN_HEADROOM:.0%}; smelt-ds memory)")


def summary(plan: JobPlan, output: str | None = None) -> str:
    """What ``--dry-run`` prints: commands, world size, data / expert-parallel layout, memory verdict."""
    c, lay = plan.config, plan.layout
    recipe = plan.recipe_arg if plan.options.scheduler != "k8s" else f"{plan.recipe_path} (ConfigMap {plan.recipe_arg})"
    lines = [f"recipe        {recipe} ({c.name}), layout '{plan.layout_name}': {lay.gpu}, "
             f"{lay.device_memory_gib:g} GiB per GPU",
             f"scheduler     {plan.options.scheduler}",
             f"world size    {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s) = {plan.world_size} ranks"]
    lines += _launch_lines(plan, output) + [f"run dir       {plan.run_dir}"] + _parallel_lines(plan)
    lines.append(_memory_line(plan))
    if plan.config_overrides:
        where = " (in the ConfigMap's recipe)" if plan.options.scheduler == "k8s" else ""
        lines.append(f"overrides     {' '.join(plan.config_overrides)}{where}")
    return "\n".join(lines + [f"note          {n}" for n in plan.notes])


# ---------------------------------------------------------------------------------------------
# python -m smelt_ds.launch hostnames | hostfile
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m smelt_ds.launch hostnames NODELIST`` / ``hostfile NODELIST --slots N``."""
    p = argparse.ArgumentParser(prog="python -m smelt_ds.launch", description="Slurm node-list helpers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hostnames", help="one host name per line, like `scontrol show hostnames`")
    h.add_argument("nodelist")
    f = sub.add_parser("hostfile", help="a DeepSpeed hostfile (HOST slots=N) for a node list")
    f.add_argument("nodelist")
    f.add_argument("--slots", type=int, required=True, help="GPUs per node")
    args = p.parse_args(argv)
    try:
        hosts = expand_nodelist(args.nodelist)
        if args.cmd == "hostfile":
            _positive("--slots", args.slots, 8, "GPUs per node")
            print("\n".join(f"{h} slots={args.slots}" for h in hosts))
        else:
            print("\n".join(hosts))
    except ConfigError as e:
        print(f"smelt_ds.launch: error: {e}", file=sys.stderr)
        return 2
    return 0
