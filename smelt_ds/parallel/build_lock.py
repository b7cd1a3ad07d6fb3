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
the verdict "not stale". A builder on another machine sharing the directory (a network home)
cannot be seen from here, so the lock is never removed: :func:`check_build_lock` refuses to start
and names the file to remove.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from smelt_ds.errors import ConfigError

__all__ = ["LOCK_NAME", "lock_holders", "stale_lock", "check_build_lock"]

#: the file torch.utils.cpp_extension's FileBaton creates in an extension's build directory
LOCK_NAME = "lock"


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


def check_build_lock(build_dir: str | Path, op: str, recheck_s: float = 0.5) -> None:
    """Raise ConfigError naming the file to remove when ``build_dir`` (the torch extension build
    directory of DeepSpeed op ``op``) holds a stale lock (:func:`stale_lock`)."""
    lock = stale_lock(build_dir, recheck_s)
    when = _identity(lock) if lock is not None else None
    if lock is None or when is None:
        return
    age_min = max(0.0, time.time() - when[1] / 1e9) / 60
    raise ConfigError(f"deepspeed op {op}: the build lock {lock} was left by an interrupted build {age_min:.0f} min "
                      f"ago (no process has it open), and torch would wait for it forever: remove it "
                      f"(rm {lock}) and start again")
