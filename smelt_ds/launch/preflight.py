"""``smelt-ds preflight RECIPE``: every check training makes before its first step, run before the
queue, with the layout, paths and environment the job will have. ``render-job`` runs the same
checks and refuses a job that fails one unless ``--force``.

    smelt-ds preflight RECIPE [--scheduler {deepspeed,slurm,k8s}] [--layout NAME] [--nodes N]
        [--gpus-per-node G] [--set KEY=VALUE ...] [--workdir DIR] [--env NAME=VALUE ...]

The checks, in order (:data:`CHECKS`), and the training code each one runs:

- ``config``: the recipe resolved as training resolves it (layout overrides, ``--set``), its
  world size and global batch (:func:`smelt_ds.config.train.resolve_batch`, naming the nearest
  values that work) and the whole DeepSpeed config
  (:func:`smelt_ds.parallel.ds_config.build_ds_config`). A failure here stops the others.
- ``data``: every ``megatron`` / ``tokens`` / ``path`` source exists, relative paths in the job's
  working directory (:func:`smelt_ds.data.token_sources.resolve_token_paths`), so does
  ``train.init_from`` (:func:`smelt_ds.runs.export.check_init_from`), and data already prepared for
  the recipe fit ``model.vocab_size``
  (:func:`smelt_ds.data.prepared.check_compatible`). Built-in, ladder and Hub sources are not
  built or downloaded here.
- ``tokenizer``: ``data.tokenizer.path`` (or ``train.init_from``'s) loads
  (:func:`smelt_ds.runs.tokenizer_file.load_tokenizer`), holds the end-of-text and padding tokens
  (:func:`smelt_ds.data.tokenizer.special_ids`) and fits ``model.vocab_size``; or the tokenizer to
  be trained does. A warning when ``data.tokenizer.vocab_size`` asks for another size, which the
  loaded tokenizer ignores (:func:`smelt_ds.data.tokenizer.unused_vocab_size`).
- ``token ids``: the largest id of every ``megatron`` / ``tokens`` file is one of the tokenizer's
  and below ``model.vocab_size``, read as ``smelt-ds data inspect`` reads it (every id up to
  :data:`smelt_ds.data.token_sources.PREFLIGHT_SCAN_TOKENS` in all, a sample of each file beyond:
  :func:`smelt_ds.data.token_sources.check_source_ids`); what preparing refuses after the queue.
- ``paths``: every path the job uses, as it uses them (:mod:`smelt_ds.launch.paths`): the run
  directory, data cache, ``data.output_dir`` and Slurm log directory can be created and written
  (a directory is created there, then removed), the inputs (recipe, data, tokenizer,
  ``train.init_from``, the working directory, the job's Python) can be read; for a job on several
  nodes, a warning naming each path on a node-local file system (``/tmp``, memory, a local disk:
  :func:`smelt_ds.launch.paths.file_system`), an error with ``--require-shared``.
- ``memory``: the memory verdict for the ZeRO stage and checkpointing policy that will run
  (:func:`smelt_ds.launch.placement.memory_report`, at least :data:`MIN_HEADROOM` free).
- ``trackers``: every tracker's package imports and its server answers within a short timeout
  (:func:`smelt_ds.train.trackers.check_trackers`), with the job's ``--env`` applied.
- ``interpreter``: the Python the job runs (the one running this command for Slurm and the
  deepspeed launcher) is 3.11 or newer and has the packages the recipe needs (tutel with
  ``moe_runtime.use_tutel``: :func:`smelt_ds.parallel.moe_backends.apply.check_backend_runtime`;
  lm-eval with ``eval.harness_tasks``).
- ``ds config``: the DeepSpeed config of the ``config`` check parsed by DeepSpeed's own config
  classes at the job's world size, as ``deepspeed.initialize`` parses it on every rank
  (:func:`smelt_ds.config.deepspeed_validation.validate_deepspeed_config`; the recipe's
  ``deepspeed.config`` keys were parsed so when it was loaded); a top-level key DeepSpeed's
  parser never reads, which DeepSpeed ignores, fails when it is a misspelling of a key it reads
  (``zero_optimiztion``) and is a warning otherwise (``data_parallel_size``).
- ``deepspeed ops``: the DeepSpeed ops the run builds at start (CPU Adam with an optimizer
  offload; the CPU communication op with several CPU ranks) can be built: DeepSpeed's own
  ``is_compatible`` and a C++ compiler.
- ``network``: the interfaces of NCCL (``NCCL_SOCKET_IFNAME``) and of the gloo groups
  (``GLOO_SOCKET_IFNAME``, which the job sets to NCCL's interfaces when unset:
  :data:`smelt_ds.launch.jobs.GLOO_FROM_NCCL`), named; a warning when one is not an interface of
  this host (``psutil.net_if_addrs()``) or NCCL's value gives gloo none.

A Kubernetes pod sees its image and its mounts, not this machine: there the data check is that
every recipe path lies in a volume of the pod or in its image (:mod:`smelt_ds.launch.k8s_mounts`,
what ``render-job`` refuses), and the interpreter and tracker checks are warnings (``warn``); the
others are the same. The token ids are checked on the files this machine sees at the recipe's paths
(relative ones in this directory), and skipped, saying so, when it sees none.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.config.data import TOKEN_KINDS
from smelt_ds.config.deepspeed_validation import unread_keys, validate_deepspeed_config
from smelt_ds.config.run import RunConfig
from smelt_ds.data.cache import is_complete
from smelt_ds.data.prepare import prepared_path
from smelt_ds.data.prepared import PreparedData, check_compatible
from smelt_ds.data.sources import resolve_files
from smelt_ds.data.token_sources import TokenFilesNotFound, check_source_ids, resolve_token_paths
from smelt_ds.data.tokenizer import special_ids, unused_vocab_size
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import MIN_HEADROOM, SCHEDULERS, JobOptions, JobPlan, gloo_ifname, plan_job
from smelt_ds.launch.k8s_mounts import pod_mounts, unseen_paths
from smelt_ds.launch.paths import job_paths, node_local, unreadable, unwritable
from smelt_ds.mappings import updated_environ
from smelt_ds.parallel.ds_config import build_ds_config
from smelt_ds.parallel.moe_backends.apply import check_backend_runtime
from smelt_ds.runs.export import check_init_from
from smelt_ds.runs.provenance import init_from_tokenizer
from smelt_ds.runs.tokenizer_file import load_tokenizer
from smelt_ds.train.trackers import FALLBACKS, check_trackers

__all__ = ["CHECKS", "CheckResult", "run_checks", "format_results", "verdict", "failures", "relative_reading",
           "add_parser"]

#: the checks, in the order they run and print
CHECKS = ("config", "data", "tokenizer", "token ids", "paths", "memory", "trackers", "interpreter",
          "ds config", "deepspeed ops", "network")
#: the oldest Python the suite runs on
MIN_PYTHON = (3, 11)


@dataclass
class CheckResult:
    """One check: ``name`` (:data:`CHECKS`), ``status`` (``ok``, ``fail``, ``warn``: the job may
    still start, ``skip``: not run because an earlier check failed) and what it found or the fix."""

    name: str
    status: str
    detail: str


@contextlib.contextmanager
def _job_environment(plan: JobPlan) -> Iterator[None]:
    """The job's working directory and ``--env`` variables, for the length of the checks."""
    workdir = Path(plan.workdir)
    with updated_environ(plan.env), contextlib.chdir(workdir if workdir.is_dir() else Path.cwd()):
        yield


def check_config(plan: JobPlan) -> str:
    """The DeepSpeed config training builds at this world size. Raises ConfigError as training would."""
    world = plan.nodes * plan.gpus_per_node
    ds = build_ds_config(plan.config, world)
    return (f"ZeRO-{plan.config.deepspeed.zero_stage}, {plan.config.moe_runtime.backend} MoE backend; DeepSpeed "
            f"config built for {world} ranks: train_batch_size {ds['train_batch_size']} = micro-batch "
            f"{ds['train_micro_batch_size_per_gpu']} x accumulation {ds['gradient_accumulation_steps']} x {world}")


def check_deepspeed_config(plan: JobPlan) -> str:
    """The whole DeepSpeed config of the job parsed by DeepSpeed's own config classes on its
    ``nodes x gpus_per_node`` ranks (:func:`smelt_ds.config.deepspeed_validation.validate_deepspeed_config`).
    Raises ConfigError naming the field path, its value, DeepSpeed's message and the fix (also
    for a top-level key DeepSpeed's parser never reads that is a misspelling of one it reads);
    CheckWarning naming the other top-level keys its parser never reads, with the closest one it
    reads (:func:`smelt_ds.config.deepspeed_validation.unread_keys`: DeepSpeed ignores them);
    CheckSkipped when the config check could not build the config."""
    world = plan.nodes * plan.gpus_per_node
    try:
        ds = build_ds_config(plan.config, world)
    except ConfigError:
        raise CheckSkipped("no DeepSpeed config was built: see the config check") from None
    validate_deepspeed_config({}, ds, world)
    ok = f"DeepSpeed {importlib.metadata.version('deepspeed')}'s config classes accept it on {world} ranks"
    unread = unread_keys(ds, world)
    if unread:
        raise CheckWarning(f"{ok}; its parser never reads (DeepSpeed ignores them): " + "; ".join(
            f"`deepspeed.config.{key}`: " + (f"did you mean `deepspeed.config.{close}`?" if close else
                                             "remove it unless deepspeed.initialize reads it itself")
            for key, close in unread.items()))
    return f"{ok} ({', '.join(ds)})"


def check_data(cfg: RunConfig, workdir: str) -> str:
    """Every file source exists (relative paths in ``workdir``) and the data prepared for ``cfg``,
    if any, fit ``model.vocab_size``. Raises ConfigError naming every source (and
    ``train.init_from``) not found, each with its field and value, the working directory relative
    paths were read in with ``--workdir`` to name another, and the fix."""
    bad, relative = [], False
    sources = [(f"data.sources[{i}]", src) for i, src in enumerate(cfg.data.sources)]
    for where, src in [*sources, ("train.init_from", None)]:
        value = str(getattr(src, src.kind())) if src is not None else str(cfg.train.init_from or "")
        try:
            if src is None:
                if value:
                    check_init_from(value)
            elif src.kind() in TOKEN_KINDS:
                resolve_token_paths(src, where)
            elif src.kind() == "path" and not glob.has_magic(value) and not Path(value).expanduser().exists():
                resolve_files(src, where)  # training's message: the field, the value, where it was read, the fix
        except ConfigError as e:
            bad.append(str(e))
            relative |= not Path(str(value)).expanduser().is_absolute()
    if bad:  # each message gives its own fix and how its path was read; --workdir is said once, here
        hint = f"; pass --workdir DIR when the job runs in another directory than {workdir!r}" if relative else ""
        raise ConfigError("; ".join(bad) + hint)
    files = [s for s in cfg.data.sources if s.kind() in (*TOKEN_KINDS, "path")]
    if len(files) < len(cfg.data.sources):
        return (f"{len(files)} file source(s) found; built-in, ladder and Hub sources are built or downloaded by "
                "training (not here)")
    prepared = prepared_path(cfg.data)
    if not is_complete(prepared):
        return f"{len(files)} source(s) found; not prepared yet (training prepares them, or `smelt-ds data prepare`)"
    check_compatible(PreparedData.load(prepared, verify="size"), cfg.model.vocab_size)
    return f"{len(files)} source(s) found; prepared data in {prepared} fit model.vocab_size {cfg.model.vocab_size}"


def check_tokenizer(cfg: RunConfig) -> str:
    """``data.tokenizer.path`` loads and fits ``model.vocab_size``, or the tokenizer training will
    train does. Raises ConfigError naming the field, both sizes and the fix."""
    tok_cfg, vocab = cfg.data.tokenizer, cfg.model.vocab_size
    if tok_cfg.path is None:
        if tok_cfg.vocab_size > vocab:
            raise ConfigError(f"`data.tokenizer.vocab_size` ({tok_cfg.vocab_size}) is larger than `model.vocab_size` "
                              f"({vocab}): set one to the other")
        return f"trained from the sources at start: {tok_cfg.vocab_size} tokens <= model.vocab_size {vocab}"
    tok = load_tokenizer(tok_cfg.path, "data.tokenizer.path")
    special_ids(tok, tok_cfg)  # the end-of-text and padding tokens, as preparation looks them up
    size = tok.get_vocab_size()
    if size > vocab:
        padded = -(-size // 128) * 128
        raise ConfigError(f"`model.vocab_size` ({vocab}) is smaller than the tokenizer of `data.tokenizer.path` "
                          f"({tok_cfg.path!r}, {size} tokens): set model.vocab_size to at least {size} (e.g. "
                          f"{padded}, padded to a multiple of 128)")
    ok = (f"{tok_cfg.path}: {size} tokens <= model.vocab_size {vocab}; {tok_cfg.eot_token!r} and "
          f"{tok_cfg.pad_token!r} are in it")
    unused = unused_vocab_size(tok_cfg, size, vocab)
    if unused:
        raise CheckWarning(f"{ok}; but {unused}")
    return ok


def relative_reading(workdir: str, here: Path) -> str:
    """Where the checks read relative recipe paths, for a message: the job's working directory
    ``workdir`` when it is a directory on this machine (the checks change into it), else this
    directory. Names ``--workdir`` when that is not ``here``, the directory the command was
    started in (where a user's relative paths usually point)."""
    wd = Path(workdir)
    if not wd.is_dir():
        return (f"relative paths read in this directory, {here}: the job's working directory {workdir} is not on "
                "this machine (--workdir DIR names it)")
    if wd.resolve() != here.resolve():
        return (f"relative paths read in the job's working directory {workdir}, not in this directory {here}: pass "
                "--workdir DIR when the job runs elsewhere")
    return f"relative paths read in {workdir}"


def check_token_ids(cfg: RunConfig, pod: bool, read: bool, reading: str | None = None) -> str:
    """The largest id of every ``megatron`` / ``tokens`` file against the tokenizer's ids and
    ``model.vocab_size`` (:func:`smelt_ds.data.token_sources.check_source_ids`, the reading of
    ``smelt-ds data inspect``), for a pod (``pod``) the files this machine sees at the recipe's
    paths. ``reading``: where relative paths are read (:func:`relative_reading`; default: the
    current directory). Raises CheckSkipped when ``read`` is false (--no-data-check) or a source
    has no files here, ConfigError naming the file, its largest id, the size it exceeds and the fix."""
    if not read:
        raise CheckSkipped("--no-data-check (data files are not read here)")
    try:
        return check_source_ids(cfg.data, cfg.model.vocab_size) + (" (the files here at render time)" if pod else "")
    except TokenFilesNotFound as e:
        where = reading or f"relative paths read in {Path.cwd()}"
        raise CheckSkipped(f"`{e.where}` has no files on this machine ({where}): " + (
            "the pod reads them from its volumes; to check their ids before the queue, run `smelt-ds data inspect "
            "FILE --tokenizer T --recipe R` where they are" if pod else "see the data check")) from None


def check_memory(plan: JobPlan) -> str:
    """The memory verdict of the configured ZeRO option and checkpointing policy. Raises
    ConfigError when less than :data:`MIN_HEADROOM` of the device memory stays free."""
    row, layout = plan.memory.configured, plan.layout
    where = f"{plan.nodes} x {plan.gpus_per_node} GPUs of {layout.device_memory_gib:g} GiB"
    if row is None:
        raise ConfigError(f"no memory estimate for the recipe's own ZeRO option on {where}: see `smelt-ds memory`")
    text = f"{row.option} + checkpointing {row.policy}: {row.total / 2**30:.1f} GiB per GPU on {where}, " \
           f"{row.headroom:.0%} free"
    if not plan.memory.fits(MIN_HEADROOM):
        raise ConfigError(f"{text}, needs {MIN_HEADROOM:.0%}: use more nodes, or a ZeRO stage / checkpointing "
                          "policy that fits (`smelt-ds memory RECIPE` lists them)")
    return text


class CheckWarning(Exception):
    """A check that found something the job survives (e.g. a tracker it will fall back for)."""


class CheckSkipped(Exception):
    """A check that cannot run here (the files are not on this machine); the message says why."""


def check_tracking(cfg: RunConfig) -> str:
    """Each tracker's package imports and its server answers (training's own check). Raises
    CheckWarning naming the trackers ``tracking.on_unreachable: fallback`` will fall back for."""
    unreachable = check_trackers(cfg)
    if unreachable:
        raise CheckWarning("; ".join(f"{name} did not answer: {FALLBACKS[name]}" for name in unreachable)
                           + " (tracking.on_unreachable: fallback)")
    return ", ".join(["tensorboard", *cfg.tracking.trackers]) + ": usable here"


def check_interpreter(cfg: RunConfig) -> str:
    """This Python: version and the extras the recipe needs. Raises ConfigError naming the install."""
    version = sys.version_info[:2]
    if version < MIN_PYTHON:
        raise ConfigError(f"Python {version[0]}.{version[1]} at {sys.executable}: smelt-ds needs Python >= 3.11 "
                          "(scripts/install_gpu.sh sets one up)")
    check_backend_runtime(cfg)  # training's own check: tutel for moe_runtime.use_tutel
    needs = ["tutel"] if cfg.moe_runtime.use_tutel else []
    if cfg.eval.harness_tasks and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"`eval.harness_tasks` ({cfg.eval.harness_tasks}) needs lm-evaluation-harness, which "
                          f"{sys.executable} cannot import: reinstall smelt-ds with its dependencies "
                          "(scripts/install_gpu.sh)")
    needs += ["lm_eval"] if cfg.eval.harness_tasks else []
    extras = ", ".join(needs) or "none needed"
    return f"{sys.executable} (Python {version[0]}.{version[1]}); extras: {extras}"


def _ops_needed(plan: JobPlan) -> list[tuple[str, str]]:
    """``(op builder class, why)`` of the DeepSpeed ops the run JIT-builds at start."""
    ops = []
    if plan.config.deepspeed.offload_optimizer != "none":
        ops.append(("CPUAdamBuilder", "deepspeed.offload_optimizer (DeepSpeed's CPU Adam)"))
    if plan.layout.gpu == "cpu" and plan.nodes * plan.gpus_per_node > 1:
        ops.append(("ShareMemCommBuilder", "several CPU ranks (DeepSpeed's CPU communication op)"))
    return ops


def check_deepspeed_ops(plan: JobPlan) -> str:
    """DeepSpeed's ``is_compatible`` for each op the run builds at start, and a C++ compiler.
    Raises ConfigError naming the op and why it is needed."""
    ops = _ops_needed(plan)
    if not ops:
        return "none built at start"
    from deepspeed.ops import op_builder  # seconds to import: only when an op is needed

    cxx = os.environ.get("CXX", "c++")
    words = shlex.split(cxx) or ["c++"]  # "ccache g++": the compiler is the word after ccache
    compiler = shutil.which(words[-1] if words[0] == "ccache" else words[0])
    for name, why in ops:
        builder = getattr(op_builder, name)()
        if not builder.is_compatible(verbose=False):
            raise ConfigError(f"DeepSpeed op {builder.name} ({why}) cannot be built with this installation: "
                              "reinstall DeepSpeed (scripts/install_gpu.sh), or change the setting that needs it")
        if compiler is None:
            raise ConfigError(f"DeepSpeed op {builder.name} ({why}) is compiled at start and the C++ compiler "
                              f"{cxx!r} ({'$CXX' if 'CXX' in os.environ else 'default'}) is not on PATH: install one "
                              "(e.g. apt-get install g++), fix $CXX, or change the setting")
    return "; ".join(f"{name} for {why}" for name, why in ops) + f": buildable (compiler {compiler})"


def check_network(plan: JobPlan) -> str:
    """The interfaces of the job's NCCL and gloo traffic (``NCCL_SOCKET_IFNAME``,
    ``GLOO_SOCKET_IFNAME`` from ``--env`` or this environment) and gloo's as the job sets it
    (:func:`smelt_ds.launch.jobs.gloo_ifname`: NCCL's interfaces when gloo's is unset). Raises
    CheckWarning (the job starts; its gloo groups may bind an interface the peers cannot reach)
    naming the interface and this host's interfaces (``psutil.net_if_addrs()``) when one named is
    not on this host (Slurm and the deepspeed launcher: this host is the first node or looks like
    one), or when NCCL's value gives gloo no interface (an ``^`` exclusion list, an NCCL prefix)."""
    import psutil

    nccl, gloo = os.environ.get("NCCL_SOCKET_IFNAME", ""), os.environ.get("GLOO_SOCKET_IFNAME", "")
    here = sorted(psutil.net_if_addrs())
    host = f"{socket.gethostname()} has {', '.join(here)}"
    if not nccl and not gloo:
        return "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME unset: NCCL picks its interface, gloo the host name's address"
    pod = plan.options.scheduler == "k8s"  # a pod's interfaces are not this machine's
    if gloo:
        missing = [] if pod else [n for n in gloo.split(",") if n not in here]
        if missing:
            raise CheckWarning(f"GLOO_SOCKET_IFNAME={gloo!r}: no interface {', '.join(missing)} on this host ({host}): "
                               "set it to an interface of the compute nodes (--env GLOO_SOCKET_IFNAME=<interface>)")
        return f"gloo on {gloo} (GLOO_SOCKET_IFNAME); NCCL on {nccl or 'its own choice'} (NCCL_SOCKET_IFNAME)"
    derived = gloo_ifname(nccl, here) if not pod else gloo_ifname(nccl, nccl.removeprefix("=").split(","))
    if derived is None:
        absent = [] if pod else [n for n in nccl.split(",") if n and n[0] not in "^=" and n not in here]
        which = (f"names {', '.join(absent)}, not an interface of this host," if absent
                 else "names no interface of this host")
        raise CheckWarning(f"NCCL_SOCKET_IFNAME={nccl!r} {which} ({host}) that gloo can "
                           "use (gloo takes interface names: no ^ exclusion, no prefix), so the job leaves "
                           "GLOO_SOCKET_IFNAME unset and gloo binds the host name's address: on a multi-NIC node set "
                           "--env GLOO_SOCKET_IFNAME=<interface> (and an interface of the compute nodes in "
                           "NCCL_SOCKET_IFNAME)")
    return (f"gloo on {derived} (the job sets GLOO_SOCKET_IFNAME to NCCL_SOCKET_IFNAME's interface"
            f"{' where the pod has it' if pod else ''}); NCCL on {nccl}")


def check_paths(plan: JobPlan, data: bool = True, require_shared: bool = False) -> str:
    """Every path of the job (:func:`smelt_ds.launch.paths.job_paths`) as the job uses it: the
    directories it writes can be created and written, its inputs can be read; with several nodes,
    the paths on a node-local file system (:func:`smelt_ds.launch.paths.node_local`). Raises
    ConfigError naming each path's field or option, its value, what is wrong and the fix (node-local
    paths too with ``require_shared``), else CheckWarning naming the node-local ones. A Kubernetes
    pod's paths are judged against its volumes by the data check."""
    if plan.options.scheduler == "k8s":
        return "a pod's paths are judged against its volumes (the data check): the run directory and cache on " \
               "the shared read-write volume, inputs on a volume or in the image"
    paths = job_paths(plan, data)
    bad = []
    for p in paths:
        why = unwritable(p) if p.writes else unreadable(p)
        if why:
            shown = repr(p.value) if p.value == p.path else f"{p.value!r}, {p.path}"
            bad.append(f"{p.what} ({shown}): {why}: {p.fix}" + (", a directory this user can create and write"
                       if p.writes else "" if p.executable else ", or let this user read it (chmod)"))
    groups = node_local(paths) if plan.nodes > 1 else {}
    local = (f"node-local paths for a job on {plan.nodes} nodes: "
             + "; ".join(f"{why}: {', '.join(which)}" for why, which in groups.items())
             + ": put the run directory, cache and logs on a file system every node mounts (NFS, Lustre, GPFS, "
               "BeeGFS, CephFS, ...), and the inputs there too or at the same path on every node")
    if bad or (groups and require_shared):
        raise ConfigError("; ".join(bad + ([f"{local} (--require-shared)"] if groups and require_shared else [])))
    written = [p.what for p in paths if p.writes]
    read = sum(1 for p in paths if not p.writes and os.path.exists(p.path))
    ok = f"writable: {', '.join(written)}; {read} input(s) readable"
    if groups:
        raise CheckWarning(f"{ok}; {local} (--require-shared makes this an error)")
    return ok + ("; none on a node-local file system" if plan.nodes > 1 else "")


def _pod_paths(plan: JobPlan) -> CheckResult:
    """A Kubernetes job's data check: every path the run reads or writes lies in a volume of the
    pod or in its image (:func:`smelt_ds.launch.k8s_mounts.unseen_paths`, what render-job refuses)."""
    mounts = pod_mounts(plan.workdir, plan.options.runs_pvc, plan.options.data_pvc)
    unseen = unseen_paths(plan.config, plan.workdir, plan.run_dir, mounts, plan.env)
    if unseen:
        return CheckResult("data", "fail", "a pod cannot use: " + "; ".join(unseen))
    return CheckResult("data", "ok", "every path is in a volume of the pod or in its image (files are read there)")


def run_checks(plan: JobPlan, data: bool = True, require_shared: bool = False) -> list[CheckResult]:
    """Every check of :data:`CHECKS` after ``config`` for a planned job (``plan_job`` did the rest of
    ``config``), in the job's working directory and environment. ``data=False`` skips the data
    check and the reading of ``data.tokenizer.path`` (render-job --no-data-check: files only the
    compute nodes see). ``require_shared``: a path of a job on several nodes on a node-local file
    system fails the ``paths`` check instead of a warning. Never raises ConfigError: a failure is a
    result."""
    k8s = plan.options.scheduler == "k8s"
    cfg = plan.config
    reading = relative_reading(plan.workdir, Path.cwd())  # before the checks change into the working directory
    steps: list[tuple[str, Callable[[], str], bool]] = [
        ("config", lambda: check_config(plan), False),
        ("data", lambda: check_data(cfg, plan.workdir), k8s),
        ("tokenizer", lambda: check_tokenizer(init_from_tokenizer(cfg)), k8s),  # as training resolves it
        ("token ids", lambda: check_token_ids(cfg, k8s, data, reading), False),  # a pod's too, when its files are here
        ("paths", lambda: check_paths(plan, data, require_shared), False),
        ("memory", lambda: check_memory(plan), False),
        ("trackers", lambda: check_tracking(cfg), k8s),
        ("interpreter", lambda: check_interpreter(cfg), k8s),
        ("ds config", lambda: check_deepspeed_config(plan), False),
        ("deepspeed ops", lambda: check_deepspeed_ops(plan), False),
        ("network", lambda: check_network(plan), False),
    ]
    out = []
    with _job_environment(plan):
        for name, check, soft in steps:
            reads_files = name == "data" or (name == "tokenizer" and cfg.data.tokenizer.path is not None)
            if reads_files and k8s:
                out.append(_pod_paths(plan) if name == "data" else
                           CheckResult(name, "skip", "read in the pod from its volumes (see the data check)"))
                continue
            if reads_files and not data:
                out.append(CheckResult(name, "skip", "--no-data-check (data files are not read here)"))
                continue
            try:
                out.append(CheckResult(name, "ok", check()))
            except CheckWarning as e:
                out.append(CheckResult(name, "warn", str(e)))
            except CheckSkipped as e:
                out.append(CheckResult(name, "skip", str(e)))
            except ConfigError as e:
                note = " (checked here; a Kubernetes pod sees its own image and mounts)" if soft else ""
                out.append(CheckResult(name, "warn" if soft else "fail", f"{e}{note}"))
    return out


def failures(results: list[CheckResult]) -> list[CheckResult]:
    """The results whose status is ``fail``."""
    return [r for r in results if r.status == "fail"]


def format_results(results: list[CheckResult]) -> str:
    """One line per check: ``name  STATUS  detail``."""
    return "\n".join(f"  {r.name:<14}{r.status.upper():<6}{r.detail}" for r in results)


def verdict(results: list[CheckResult]) -> str:
    """The verdict line under the checks: the failed checks, else the warnings and the skipped
    checks by name (a SKIP is no pass: its line says why it was not run); "every check passed"
    only when every check is OK."""
    bad = failures(results)
    if bad:
        return f"{len(bad)} check(s) failed: fix them before submitting"
    warned = [r.name for r in results if r.status == "warn"]
    skipped = [r.name for r in results if r.status == "skip"]
    parts = ([f"{len(warned)} warning(s) ({', '.join(warned)}): read them before submitting"] if warned else []) + (
        [f"{len(skipped)} skipped: {', '.join(skipped)} (see above)"] if skipped else [])
    return "no check failed; " + "; ".join(parts) if parts else "every check passed"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preflight", help="every check training makes before its first step, before the queue",
        description="Resolve a recipe for a cluster layout as training will, then check its DeepSpeed config, data, "
                    "tokenizer, paths, memory, trackers, interpreter and DeepSpeed ops in the job's working directory "
                    "and environment. Exit status 2 when a check fails (render-job runs the same checks).")
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/m/smelt.yaml")
    p.add_argument("--scheduler", default="slurm", choices=SCHEDULERS,
                   help="where the job runs (default slurm); k8s: data, interpreter and tracker checks warn only")
    p.add_argument("--layout", default=None, help="the recipe's cluster layout (default cluster.default)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the layout's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (ranks) per node (default: the layout's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    p.add_argument("--workdir", default=None, help="the job's working directory (default: this directory)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable the job sets (e.g. MLFLOW_TRACKING_URI=...), repeatable")
    p.add_argument("--hostfile", default=None, help="hostfile of a multi-node deepspeed-launcher job")
    p.add_argument("--no-data-check", action="store_true", help="skip the data check")
    p.add_argument("--require-shared", action="store_true",
                   help="several nodes: a path on a node-local file system (/tmp, memory, a local disk) fails the "
                        "paths check instead of a warning")
    p.set_defaults(func=run_preflight)


def run_preflight(args: argparse.Namespace) -> int:
    options = JobOptions(scheduler=args.scheduler, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         layout=args.layout, overrides=list(args.set), workdir=args.workdir, env=list(args.env),
                         hostfile=args.hostfile)
    head = f"smelt-ds preflight: {args.recipe}"
    try:
        plan = plan_job(args.recipe, options)
    except ConfigError as e:
        print(f"{head}\n  {'config':<14}FAIL  {e}\n  (the other checks need a recipe that resolves)")
        return 2
    results = run_checks(plan, data=not args.no_data_check, require_shared=args.require_shared)
    print(f"{head} on {plan.nodes} x {plan.gpus_per_node} ranks (layout {plan.layout_name}), "
          f"{args.scheduler}, working directory {plan.workdir}")
    print(format_results(results))
    print(verdict(results))
    return 2 if failures(results) else 0
