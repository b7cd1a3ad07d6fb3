"""One writer per run directory: an exclusive lock held for the whole run.

``<run_dir>/.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) by global rank 0 for
the run's lifetime, and holds the holder's host, process id, start time and command line. The
kernel releases the lock when the holder exits in any way (SIGKILL and crashes included), so a
lock file left behind by a dead process is stale and is taken over, with a message naming the
old holder. A second training in the same directory is refused with the holder named. On
network file systems ``flock`` is passed to the server where it supports it (NFSv4, Lustre with
``-o flock``); where it does not, two nodes could both take it: use one run directory per job.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from smelt_ds.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".lock"


class RunLock:
    """Exclusive lock on a run directory (a context manager; see the module docstring).

    Raises ConfigError on ``acquire`` when another live process holds the lock, naming its host,
    pid, start time and command.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise ConfigError(f"run directory {self.path.parent} is in use by another training ({holder}): wait for "
                              "it to finish or stop it, or train in another --run-dir") from None
        old = _read(fd)
        if old:
            print(f"run directory {self.path.parent}: taking over a stale lock of a process that is gone "
                  f"({_describe(old)})", file=sys.stderr)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty lock file: released cleanly, nothing stale
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    raw = os.pread(fd, 4096, 0)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"unreadable": raw[:80].decode(errors="replace")}


def _describe(info: dict) -> str:
    if not info:
        return "holder unknown"
    return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {info.get('since', '?')}, "
            f"command {info.get('command', '?')!r}")
