"""A torch C++-extension build lock left behind by an interrupted build (DeepSpeed's JIT ops).

DeepSpeed compiles some ops on first use (its CPU shared-memory collectives at
``deepspeed.init_distributed``, CPU Adam for optimizer offload) with
``torch.utils.cpp_extension``, which guards each build directory
(``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions/<python>_<device>/<op>``) with a file
``lock`` (``torch.utils.file_baton.FileBaton``): the builder creates it with ``O_CREAT | O_EXCL``,
keeps that file descriptor open while it builds, then closes it and deletes the file; every
other process, the cached op included, waits while the file exists. A builder killed mid-build
(Ctrl-C, a preempted job) leaves the file behind, and every later start waits forever, silently.

Rule (:func:`stale_lock`): the lock is stale when it exists, no process of the lock file's owner on
this machine has it open, and the same file (inode and modification time) is still there and still
not open ``recheck_s`` later (the builder closes its descriptor a moment before it deletes the
file; the recheck outlasts that gap). Only the owner's processes are looked at: the builder
created the file, so it runs as its owner. This is safe with several local ranks starting at
once: the rank that builds holds the lock open from the instant the file exists until it is gone,
so no other rank judges it stale; a process of the owner whose open files cannot be read makes
the verdict "not stale". Nothing here reads a clock: the identity compared after ``recheck_s`` is
the file's own (inode, modification time), so hosts whose clocks disagree judge it alike.

A builder on another host sharing the directory cannot be seen from here, so a lock is judged
only where every builder is on this host (:func:`builders_visible`): this host's own cache
directory (:mod:`smelt_ds.parallel.extension_cache`, the default), or a directory on a local file
system. In a user's ``TORCH_EXTENSIONS_DIR`` on a network file system a lock nobody here holds
may be another host's live build: :func:`check_build_lock` then says so and lets torch wait. The
lock is never removed here: a stale one is refused with the file to remove.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.extension_cache import host_extension_dir

__all__ = ["LOCK_NAME", "NETWORK_FILE_SYSTEMS", "builders_visible", "check_build_lock", "lock_holders", "stale_lock"]

#: the file torch.utils.cpp_extension's FileBaton creates in an extension's build directory
LOCK_NAME = "lock"


#: file system types (``/proc/mounts``) that several hosts may mount at once
NETWORK_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
                                  "glusterfs", "9p", "afs", "panfs", "wekafs", "orangefs", "virtiofs"})


def file_system_type(path: Path) -> str:
    """The type of the file system holding ``path`` (the mount with the longest mount point that
    contains it, from ``psutil.disk_partitions(all=True)``); "" when unknown."""
    import psutil

    target = os.path.realpath(path)
    best, kind = "", ""
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, part.fstype
    return kind


def builders_visible(build_dir: str | Path) -> bool:
    """Whether every process that may build into ``build_dir`` runs on this host: it is under this
    host's own extension directory (:func:`smelt_ds.parallel.extension_cache.host_extension_dir`),
    or on a file system that is not a network one (:data:`NETWORK_FILE_SYSTEMS`, or ``fuse.*``)."""
    if Path(os.path.realpath(build_dir)).is_relative_to(os.path.realpath(host_extension_dir())):
        return True
    kind = file_system_type(Path(build_dir))
    return not (kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse"))


def lock_holders(path: Path, proc: Path = Path("/proc")) -> list[int] | None:
    """PIDs of processes of ``path``'s owner on this machine that have ``path`` open (read from
    ``/proc/<pid>/fd``); None when that cannot be known (no ``/proc``, or an open-file table of
    such a process that cannot be read)."""
    try:
        target, owner = os.path.realpath(path), path.stat().st_uid
        pids = [d for d in proc.iterdir() if d.name.isdigit()]
    except OSError:
        return None
    held, unknown = [], False
    for d in pids:
        try:
            if d.stat().st_uid != owner:
                continue
            fds = list((d / "fd").iterdir())
        except FileNotFoundError:  # exited meanwhile
            continue
        except OSError:
            unknown = True
            continue
        if any(_points_to(fd, target) for fd in fds):
            held.append(int(d.name))
    return held if held or not unknown else None


def _points_to(fd: Path, target: str) -> bool:
    try:
        return os.readlink(fd) == target
    except OSError:  # closed meanwhile
        return False


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def stale_lock(build_dir: str | Path, recheck_s: float = 0.5) -> Path | None:
    """The ``lock`` file of ``build_dir`` when it is stale by the module's rule, else None (no
    lock, a builder holds it, or its holders cannot be known). Waits ``recheck_s`` seconds only
    when a lock exists and nobody holds it."""
    lock = Path(build_dir) / LOCK_NAME
    first = _identity(lock)
    if first is None or lock_holders(lock) != []:
        return None
    time.sleep(recheck_s)
    if _identity(lock) != first or lock_holders(lock) != []:
        return None
    return lock


def check_build_lock(build_dir: str | Path, op: str, recheck_s: float = 0.5) -> str | None:
    """Raise ConfigError naming the file to remove when ``build_dir`` (the torch extension build
    directory of DeepSpeed op ``op``) holds a stale lock (:func:`stale_lock`) and every builder
    would run on this host (:func:`builders_visible`). Where another host may build (a user's
    ``TORCH_EXTENSIONS_DIR`` on a network file system), returns a line saying that a lock nobody
    here holds is there and torch waits for it; None otherwise."""
    lock = stale_lock(build_dir, recheck_s)
    if lock is None:
        return None
    if not builders_visible(build_dir):
        return (f"deepspeed op {op}: the build lock {lock} is held by no process of this host; another host sharing "
                f"this directory may be building it, and torch waits until it is gone. If no host is building, "
                f"remove it (rm {lock})")
    raise ConfigError(f"deepspeed op {op}: the build lock {lock} was left by an interrupted build (no process of "
                      f"this host has it open, and only this host builds there), and torch would wait for it forever: "
                      f"remove it (rm {lock}) and start again")
