"""Every path a job uses, checked as the job will use it: directories it writes can be written,
inputs can be read, and, for a job on several nodes, which paths lie on a node-local file system.

:func:`job_paths` lists the paths of a planned job (:class:`smelt_ds.launch.jobs.JobPlan`), each
with the recipe field or option that sets it; :func:`unwritable` and :func:`unreadable` try them;
:func:`file_system` judges where one lies. ``smelt-ds preflight`` and ``render-job`` run them as
the ``paths`` check (:func:`smelt_ds.launch.preflight.check_paths`), in the job's working directory
and environment, so relative paths resolve as the job resolves them.

**Writable** (run directory, data cache, ``data.output_dir``, ``data.ladder_packages_dir``, the
Slurm log directory): a uniquely named directory is created, then removed, in the directory, or,
when the directory is absent, in its nearest existing parent (where training would create it).
Nothing is left behind and the directory itself is never created, so a job starting at the same
time cannot lose it.

**Node-local** (:func:`file_system`), the rule, first match wins:

1. a path under a node's temporary directories (:data:`NODE_TEMP_DIRS`: ``/tmp``, ``/var/tmp``,
   ``/dev/shm``, ``/run``), as written or once symbolic links are resolved: node-local whatever
   file system holds it (each node has its own);
2. else the file system holding the path (symbolic links of its existing part resolved):
   the mount with the longest mount point that contains it, from the kernel's mount table
   (``psutil.disk_partitions(all=True)``: ``/proc/self/mounts``), the last one mounted on a
   mount point winning; its type is
   - node-local when it is in :data:`NODE_LOCAL_TYPES`: memory (``tmpfs``, ``ramfs``), a
     container's layered root (``overlay``) or a disk file system (``ext4``, ``xfs``, ``btrfs``,
     ``zfs``, ...), which one node mounts at a time;
   - shared when it is in :data:`SHARED_TYPES` or starts with one of them and a dot (``nfs``,
     ``lustre``, ``gpfs``, ``beegfs``, ``ceph``, ``cifs``, ``glusterfs``, ``wekafs``, FUSE clients
     of these, ...);
   - unknown otherwise (no warning: the user knows).

A Kubernetes pod's paths are judged against its volumes instead
(:func:`smelt_ds.launch.k8s_mounts.unseen_paths`): a path on no shared volume is refused there.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.data.cache import cache_root
from smelt_ds.launch.jobs import JobPlan, slurm_log_dir

__all__ = ["NODE_TEMP_DIRS", "NODE_LOCAL_TYPES", "SHARED_TYPES", "JobPath", "FileSystem", "mount_table",
           "file_system", "job_paths", "unwritable", "unreadable", "node_local"]

#: directories every node has its own of (temporary files, memory): node-local by name
NODE_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
#: file system types a single node holds (memory, a container's root, a local disk)
NODE_LOCAL_TYPES = frozenset({"tmpfs", "ramfs", "devtmpfs", "overlay", "aufs", "ext2", "ext3", "ext4", "xfs",
                              "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "vfat", "exfat", "ntfs", "ntfs3"})
#: file system types every node of a cluster can mount (network and parallel file systems); a type
#: that starts with one of these and a dot (``fuse.glusterfs``, ``nfs.vast``) is shared as well
SHARED_TYPES = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "fuse.ceph-fuse", "cifs",
                          "smb3", "smbfs", "glusterfs", "fuse.glusterfs", "wekafs", "panfs", "pvfs2", "orangefs",
                          "gfs2", "ocfs2", "afs", "fuse.dfuse", "fuse.juicefs", "fuse.gcsfuse", "fuse.sshfs",
                          "fuse.mfs", "fuse.lizardfs", "fuse.weka", "virtiofs"})


@dataclass(frozen=True)
class JobPath:
    """One path a job uses: ``what`` names the recipe field or option that sets it (for messages),
    ``value`` is as given, ``path`` as the job resolves it (absolute); ``writes``: the job creates
    and writes it (a directory); ``per_node``: it may be node-local by design
    (``data.shared_filesystem: false`` for the cache); ``executable``: the interpreter (judged by
    its directory: a virtual environment's ``python`` links to the base interpreter); ``fix``: how
    to name another."""

    what: str
    value: str
    path: str
    writes: bool = False
    per_node: bool = False
    executable: bool = False
    fix: str = ""


@dataclass(frozen=True)
class FileSystem:
    """Where a path lies: the mount (point, type, device) holding it and ``locality``:
    ``"node-local"``, ``"shared"`` or ``"unknown"``; ``why`` says which rule decided."""

    mountpoint: str
    fstype: str
    device: str
    locality: str
    why: str


def mount_table() -> list[tuple[str, str, str]]:
    """``(mount point, type, device)`` of every mount this process sees, in mount order (the
    kernel's table through ``psutil.disk_partitions(all=True)``)."""
    import psutil

    return [(p.mountpoint, p.fstype, p.device) for p in psutil.disk_partitions(all=True)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def file_system(path: str, table: list[tuple[str, str, str]] | None = None) -> FileSystem:
    """Where the absolute ``path`` lies and whether that is node-local (the rule of the module
    docstring). ``table``: the mount table (:func:`mount_table` when None)."""
    real = os.path.realpath(path)  # symbolic links of its existing part resolved
    temp = next((d for d in NODE_TEMP_DIRS if _under(os.path.normpath(path), d) or _under(real, d)), None)
    mounts = mount_table() if table is None else table
    best: tuple[str, str, str] = ("/", "unknown", "")
    for mount in mounts:  # the longest mount point holding it; of equal ones, the last mounted
        if _under(real, mount[0]) and len(mount[0]) >= len(best[0]):
            best = mount
    point, fstype, device = best
    on = f"{fstype} on {device or 'no device'} mounted at {point}"
    if temp is not None:
        return FileSystem(point, fstype, device, "node-local", f"under {temp}, a node's own temporary directory")
    if fstype in NODE_LOCAL_TYPES:
        kind = {"tmpfs": "memory", "ramfs": "memory", "devtmpfs": "memory",
                "overlay": "a container's own root", "aufs": "a container's own root"}.get(fstype, "a local disk")
        return FileSystem(point, fstype, device, "node-local", f"{on} ({kind})")
    if fstype in SHARED_TYPES or any(fstype.startswith(t + ".") for t in SHARED_TYPES):
        return FileSystem(point, fstype, device, "shared", f"{on} (a shared file system)")
    return FileSystem(point, fstype, device, "unknown", f"{on} (not known as node-local)")


def _interpreter(plan: JobPlan) -> tuple[str, str]:
    """``(what, path)`` of the Python every node runs (Slurm: ``$SMELT_PYTHON``, else the one
    rendering the job; the deepspeed launcher: the one rendering the job)."""
    if plan.options.scheduler == "slurm" and os.environ.get("SMELT_PYTHON"):
        return "SMELT_PYTHON", os.environ["SMELT_PYTHON"]
    return "the job's Python (this one)", sys.executable


def job_paths(plan: JobPlan, data: bool = True) -> list[JobPath]:
    """Every path the job (Slurm or the deepspeed launcher) reads or writes, resolved in the
    current directory (call it in the job's working directory) and environment. ``data=False``
    leaves out the data inputs (sources, tokenizer, ``train.init_from``) and the data cache and
    output directories (``--no-data-check``: data only the compute nodes see)."""
    cfg, wd = plan.config, plan.workdir

    def at(value: str) -> str:
        return os.path.normpath(os.path.join(wd, os.path.expanduser(value)))

    out = [JobPath("--workdir", wd, wd, fix="pass --workdir DIR"),
           JobPath("the recipe", str(plan.recipe_path), at(str(plan.recipe_path)), fix="copy the recipe there")]
    what, python = _interpreter(plan)
    if "/" not in python:  # a command name: the one on PATH
        python = shutil.which(python) or python
    out.append(JobPath(what, python, at(python), executable=True,
                       fix="export SMELT_PYTHON=<the Python of an environment with smelt-ds> before sbatch"))
    if data:
        for i, src in enumerate(cfg.data.sources):
            kind = src.kind()
            if kind in ("path", "megatron", "tokens"):
                value = str(getattr(src, kind))
                where = f"data.sources[{i}].{kind}"
                out.append(JobPath(where, value, at(value), fix=f"change {where}"))
        for field, given_path in (("data.tokenizer.path", cfg.data.tokenizer.path),
                                  ("train.init_from", cfg.train.init_from)):
            if given_path:
                out.append(JobPath(field, given_path, at(given_path), fix=f"--set {field}=PATH"))
    given = plan.options.run_dir is not None
    out.append(JobPath("--run-dir" if given else "train.run_dir", plan.run_dir, at(plan.run_dir), writes=True,
                       fix="--run-dir DIR" if given else "--set train.run_dir=DIR (or --run-dir DIR)"))
    if data:
        per_node = not cfg.data.shared_filesystem  # each node's local rank 0 prepares its own copy
        cache_what = ("data.cache_dir" if cfg.data.cache_dir is not None else
                      "SMELT_DS_CACHE" if os.environ.get("SMELT_DS_CACHE") else "the data cache (default)")
        cache = str(cache_root(cfg.data.cache_dir))
        out.append(JobPath(cache_what, cfg.data.cache_dir or cache, at(cache), writes=True, per_node=per_node,
                           fix="--set data.cache_dir=DIR (or --env SMELT_DS_CACHE=DIR)"))
        for field, written in (("data.output_dir", cfg.data.output_dir),
                               ("data.ladder_packages_dir", cfg.data.ladder_packages_dir)):
            if written:
                out.append(JobPath(field, written, at(written), writes=True, per_node=per_node,
                                   fix=f"--set {field}=DIR"))
    if plan.options.scheduler == "slurm":
        what, log_dir = slurm_log_dir(plan)
        out.append(JobPath(what, plan.options.log_dir or log_dir, log_dir, writes=True, fix="--log-dir DIR"))
    return out


def unwritable(p: JobPath) -> str | None:
    """Why the job could not create and write the directory ``p`` (None when it can): a uniquely
    named directory is created in it, or in its nearest existing parent when it is absent, then
    removed (nothing is left behind; ``p`` itself is never created)."""
    target = Path(p.path)
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a directory" + ("" if parent == target else f" (a parent of {target})")
    try:
        probe = tempfile.mkdtemp(prefix=".smelt-preflight-", dir=parent)
    except OSError as e:
        where = "in it" if parent == target else f"in {parent}, its nearest existing parent"
        return f"cannot create a directory {where}: {e.strerror or e}"
    os.rmdir(probe)
    return None


def unreadable(p: JobPath) -> str | None:
    """Why the job could not read the input ``p`` (None when it can, or when it is absent: the
    data and tokenizer checks name what is missing; an absent interpreter is named here): a file
    must be readable (the interpreter also executable), a directory readable and searchable; a
    glob pattern is not tried."""
    import glob

    if p.executable and not os.path.exists(p.path):
        return "no such file"
    if glob.has_magic(p.path) or not os.path.exists(p.path):
        return None
    python = p.executable
    if os.path.isdir(p.path):
        if python:
            return "is a directory, not a Python interpreter"
        ok, need = os.access(p.path, os.R_OK | os.X_OK, effective_ids=True), "readable and searchable"
    else:
        mode = os.R_OK | (os.X_OK if python else 0)
        ok, need = os.access(p.path, mode, effective_ids=True), "executable" if python else "readable"
    return None if ok else f"not {need} by this user (uid {os.geteuid()})"


def node_local(paths: list[JobPath], table: list[tuple[str, str, str]] | None = None) -> dict[str, list[str]]:
    """The paths of ``paths`` on a node-local file system (:func:`file_system`), except those
    node-local by design (``per_node``), grouped by why: ``{why: ["what (path)", ...]}``."""
    table = mount_table() if table is None else table
    out: dict[str, list[str]] = {}
    for p in paths:
        fs = file_system(os.path.dirname(p.path) if p.executable else p.path, table)
        if fs.locality == "node-local" and not p.per_node:
            out.setdefault(fs.why, []).append(f"{p.what} ({p.path})")
    return out
