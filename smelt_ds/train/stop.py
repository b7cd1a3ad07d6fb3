"""How a training learns that it must stop: a signal, a stop file, or the death of its launcher.

Every rank polls :meth:`StopSources.poll` once per optimizer step, at the accumulation boundary,
and the ranks agree on the answer in the step's one control all-reduce (:func:`agree`), so all of
them finish the same step, save one checkpoint together and exit with status 143
(:func:`smelt_ds.train.loop.main`). Three sources:

* **signals**: SIGTERM, SIGINT and SIGHUP delivered to the rank (a scheduler, ``kill``, Ctrl-C, a
  launcher that forwards them, torchrun's shutdown);
* **the stop file** ``<run_dir>/STOP``, read on rank 0 only (one ``stat`` per step on a shared
  filesystem). Any STOP there stops the run at its next step, one written during start-up (data
  preparation, engine build, restore) at step 1, except the one this run has already honoured:
  once the stop checkpoint is saved, rank 0 records the file's identity in
  ``<run_dir>/STOP.honoured`` (:class:`StopFileId`: inode, modification time and size as the file
  system stores them, and the SHA-256 of its content, where a writer puts a nonce) and removes the
  file; a STOP with that identity, left because it could not be removed, is ignored. No decision
  compares a file time with a clock, so a writer on a host whose clock is off (hours, either way)
  stops the run as any other. Launchers that own a run remove a leftover STOP before they start
  the ranks (:func:`clear_stop_file`: ``smelt-ds train``, the rendered deepspeed-launcher script),
  so a STOP from before the launch is not taken for a new one; under other launchers (torchrun,
  the Slurm and Kubernetes jobs) a STOP written while no rank ran stops the next run at step 1.
  The rendered deepspeed-launcher job creates it on SIGTERM, with a nonce: the DeepSpeed launcher
  does not pass a signal on to the ranks of one host, and on several hosts its ``launch.py``
  SIGKILLs the ranks 30 seconds after SIGTERM, which can cut a save short. ``touch
  <run_dir>/STOP`` stops a run from anywhere (touching a leftover STOP changes its identity);
* **the launcher's death**: the launcher processes above this rank on its host
  (``deepspeed.launcher.runner``/``launch``, ``torch.distributed.run``/``torchrun``,
  ``smelt-ds train``, and the process named by ``SMELT_LAUNCHER_PID`` when it is an ancestor,
  e.g. the rendered job script), recorded at start by pid and creation time. When one of them is
  gone the rank's launcher can no longer stop it, report its status or clean up after it: it must
  not train on as an orphan holding the GPUs, so it saves and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.files import write_json_atomic
from smelt_ds.parallel import control

__all__ = ["STOP_FILE", "HONOURED_FILE", "STOP_SIGNALS", "LAUNCHER_PID_ENV", "Ancestor", "StopFileId", "StopSources",
           "agree", "clear_stop_file", "launcher_ancestors", "stop_file_id", "REASONS"]

#: the file whose creation stops a run (relative to the run directory)
STOP_FILE = "STOP"
#: the identity of the last stop file the run honoured (JSON, relative to the run directory)
HONOURED_FILE = "STOP.honoured"
#: bytes of a stop file hashed into its identity (a writer's nonce is a line)
_HASHED_BYTES = 4096
#: signals that stop a rank (each finishes its step and saves)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: environment variable naming an outer process (a job script) whose death stops the ranks below it
LAUNCHER_PID_ENV = "SMELT_LAUNCHER_PID"

#: stop reasons by code, in increasing priority (the all-reduce keeps the largest)
REASONS = {0: None, 1: "launcher", 2: "stop_file", 3: "signal"}
_CODES = {v: k for k, v in REASONS.items()}

#: command-line fragments of the launchers whose death stops the ranks below them
_LAUNCHER_MARKS = ("deepspeed.launcher", "bin/deepspeed", "torch.distributed.run", "torchrun",
                   "smelt_ds.cli", "bin/smelt-ds")


@dataclass(frozen=True)
class Ancestor:
    """A launcher process above this rank: pid, creation time (seconds since the epoch, as psutil
    reports it) and a short description for messages."""

    pid: int
    create_time: float
    what: str

    def alive(self) -> bool:
        """Whether the process still runs (the same pid with the same creation time, not a zombie)."""
        import psutil

        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self.create_time and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def _is_launcher(cmdline: list[str]) -> bool:
    text = " ".join(cmdline)
    return any(mark in text for mark in _LAUNCHER_MARKS)


def launcher_ancestors(pid: int | None = None) -> list[Ancestor]:
    """The launcher processes above process ``pid`` (default: this one), nearest first.

    Walks up the parents while each is a launcher (:data:`_LAUNCHER_MARKS` in its command line);
    continues up to the process named by ``SMELT_LAUNCHER_PID`` when that one is an ancestor
    (another host's pid, or a process not above this one, is ignored). A plain shell, ``nohup``,
    tmux or sshd above the launcher is never watched: a run started with ``nohup`` goes on after
    its terminal closes."""
    import psutil

    try:
        me = psutil.Process(pid or os.getpid())
        parents = me.parents()
    except psutil.Error:
        return []
    marked = os.environ.get(LAUNCHER_PID_ENV, "")
    marked_pid = int(marked) if marked.isdigit() else None
    chain = [p.pid for p in parents]
    stop_at = chain.index(marked_pid) if marked_pid in chain else -1
    out: list[Ancestor] = []
    for i, p in enumerate(parents):
        try:
            cmd = p.cmdline()
            ancestor = Ancestor(p.pid, p.create_time(), " ".join(cmd)[:120] or p.name())
        except psutil.Error:
            break
        if i <= stop_at or _is_launcher(cmd):
            out.append(ancestor)
            continue
        break
    return out


@dataclass(frozen=True)
class StopFileId:
    """What tells one stop file from another without a clock: its inode number, modification time
    (nanoseconds, as the file system stores it: compared for equality only, never with a clock) and
    size, and the SHA-256 of its first 4096 bytes (the writer's nonce; the empty file's hash after
    ``touch``). A new ``touch`` changes the time, a rewrite the content, a new file the inode.
    The device number is left out: it differs between the hosts that mount one shared file system."""

    inode: int
    mtime_ns: int
    size: int
    sha256: str


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_mtime_ns, st.st_size


def stop_file_id(path: Path) -> StopFileId | None:
    """The identity of the stop file ``path`` (:class:`StopFileId`), None when there is none (or
    it cannot be read)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.sha256(f.read(_HASHED_BYTES)).hexdigest()
    except OSError:
        return None
    return StopFileId(*_stat_key(st), digest)


def _read_honoured(path: Path) -> StopFileId | None:
    """The identity recorded in ``path`` (:data:`HONOURED_FILE`); None when absent or unreadable
    (then every stop file counts as new: the safe side is a stop with a checkpoint)."""
    try:
        raw = json.loads(path.read_text())
        return StopFileId(int(raw["inode"]), int(raw["mtime_ns"]), int(raw["size"]), str(raw["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_stop_file(run_dir: Path, by: str) -> bool:
    """Remove ``<run_dir>/STOP`` left by an earlier run, before a launcher that owns the run starts
    its ranks (``by`` names it in the note printed to stderr): a STOP written from then on stops
    the new run. Returns whether a file was removed. Raises ConfigError when it cannot be removed
    (the run would stop at its first step)."""
    path = Path(run_dir) / STOP_FILE
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ConfigError(f"{by}: the stop file {path} left by an earlier run cannot be removed ({e.strerror}): "
                          "remove it, or the run stops at its first step") from None
    print(f"{by}: removed the stop file {path} left by an earlier run (a STOP written from now on stops this one)",
          file=sys.stderr)
    return True


class StopSources:
    """A context manager that installs the stop-signal handlers (main thread only) and records the
    launcher ancestors; :meth:`poll` says whether this rank saw a reason to stop.

    ``run_dir``: where the stop file lives; ``check_file``: whether this rank reads it (rank 0)."""

    def __init__(self, run_dir: Path, check_file: bool) -> None:
        self.stop_file = Path(run_dir) / STOP_FILE
        self.honoured_file = Path(run_dir) / HONOURED_FILE
        self.check_file = check_file
        self.honoured = _read_honoured(self.honoured_file) if check_file else None
        self._ignored: tuple[int, int, int] | None = None  # the stat of a STOP found to be the honoured one
        self.signal: int | None = None
        self.ancestors = launcher_ancestors()
        self.gone: Ancestor | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSources:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)

    def _stop_file_is_new(self) -> bool:
        """Whether a stop file is there and is not the one this run honoured (one ``stat``; the
        content is read only when inode, time and size are the honoured file's, once)."""
        try:
            key = _stat_key(self.stop_file.stat())
        except OSError:
            return False
        if self.honoured is None or key != _stat_key_of(self.honoured):
            return True
        if key == self._ignored:
            return False
        now = stop_file_id(self.stop_file)
        if now is not None and now == self.honoured:
            self._ignored = key
            return False
        return now is not None

    def poll(self) -> str | None:
        """This rank's reason to stop (``"signal"``, ``"stop_file"``, ``"launcher"``) or None."""
        if self.signal is not None:
            return "signal"
        if self.check_file and self._stop_file_is_new():
            return "stop_file"
        if self.gone is None:
            self.gone = next((a for a in self.ancestors if not a.alive()), None)
        return "launcher" if self.gone is not None else None

    def describe(self, reason: str) -> str:
        """Words for the console: what stopped the run."""
        if reason == "signal":
            name = signal.Signals(self.signal).name if self.signal else "SIGTERM/SIGINT"
            return f"stop signal ({name})"
        if reason == "stop_file":
            return f"the stop file {self.stop_file}"
        if reason == "launcher":
            what = f" (pid {self.gone.pid}: {self.gone.what})" if self.gone else ""
            return f"the death of its launcher{what}"
        return reason

    def consume(self, step: int | None = None) -> None:
        """Once the stop checkpoint (of ``step``) is saved, on rank 0: record the identity of the
        stop file there in :data:`HONOURED_FILE` and remove the file, so that the next ``--resume
        auto`` trains on. The saved checkpoint answers every STOP written before it, whatever
        stopped this run. A STOP that cannot be removed is ignored by the resumed run through the
        record; when neither can be written, a message says to remove it."""
        if not self.check_file:
            return
        ident = stop_file_id(self.stop_file)
        if ident is None:
            return
        try:
            write_json_atomic(self.honoured_file, {**asdict(ident), "step": step})
            self.honoured, recorded = ident, ""
        except OSError as e:
            recorded = (f"nor record it in {self.honoured_file} ({e.strerror}): remove it before resuming, or the "
                        "resumed run stops at its first step")
        try:
            self.stop_file.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            print(f"could not remove the stop file {self.stop_file} ({e.strerror}) "
                  f"{recorded or f'(recorded in {self.honoured_file}: the resumed run ignores it)'}", file=sys.stderr)


def _stat_key_of(ident: StopFileId) -> tuple[int, int, int]:
    return ident.inode, ident.mtime_ns, ident.size


def agree(reason: str | None, values: torch.Tensor | None = None) -> tuple[str | None, list[float]]:
    """The step's control exchange (collective; one all-reduce SUM on the control group,
    :mod:`smelt_ds.parallel.control`): ``values`` (this rank's vector of sums, on any device, e.g.
    :meth:`smelt_ds.train.metrics.MicroStats.local`) followed by one count per stop reason.

    Returns the stop reason every rank acts on (the highest-priority reason any rank saw, or
    None) and ``values`` summed over the ranks (host floats)."""
    flags = torch.zeros(len(REASONS) - 1, dtype=torch.float64)
    if reason is not None:
        flags[_CODES[reason] - 1] = 1.0
    local = flags if values is None else torch.cat([values.detach().to("cpu", torch.float64).reshape(-1), flags])
    totals = control.all_reduce_sum(local)
    counts, sums = totals[len(totals) - len(flags):], totals[:len(totals) - len(flags)]
    agreed = max((code for code, c in enumerate(counts, start=1) if c > 0), default=0)
    return REASONS[agreed], sums
