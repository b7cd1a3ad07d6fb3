"""Hangs and dead peers: a watchdog that ends a rank that makes no progress, the process group's
collective timeouts, and what a rank can tell about its peers when a collective fails.

A multi-rank job whose rank hangs (a collective that never returns, a stalled filesystem read, a
stopped process) otherwise waits for the backends' defaults (gloo 30 min, NCCL 10 min, DeepSpeed's
``init_distributed`` 30 min) with every GPU idle. :class:`HangWatchdog` is a thread armed before
each step, validation and save with a timeout (``train.watchdog``, :meth:`HangWatchdog.step_timeout`);
when it expires it writes every thread's Python stack (:func:`faulthandler.dump_traceback`) to
``<run_dir>/hangs/rank<RRRRR>.txt`` (zero-padded), asks the other ranks of its host to write theirs (SIGCONT, then
SIGUSR2, on which every rank has :func:`faulthandler.register`-ed a dump: it runs in C, without the
GIL or the main thread), writes its flight-recorder traces (its last collectives, torch's format:
:func:`dump_flight_recorder`), prints what it knows of its peers and exits with status
:data:`HANG_EXIT` (124), so that the launcher ends the job and a scheduler requeues it. Under NCCL
this is the path a hung or dead peer takes too: the rendered jobs keep NCCL's error handling at
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default: no abort, so the dumps are not cut short),
and a rank blocked on a collective that never completes is ended here (docs/faults.md).

A rank whose collective fails (a peer died: gloo and NCCL report the closed connection; or the
collective timed out) raises :class:`CollectiveFailure` with :func:`describe_peers`' diagnosis
(each peer on this host: running, sleeping, stopped, in uninterruptible I/O, a zombie, or gone),
and exits with status :data:`PEER_EXIT` (75).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

from smelt_ds.config.train import Watchdog
from smelt_ds.parallel import control

__all__ = ["HANG_EXIT", "PEER_EXIT", "HANGS_DIR", "DUMP_SIGNAL", "FLIGHT_RECORDER_ENTRIES", "FR_PREFIXES",
           "CollectiveFailure", "HangWatchdog", "Peer", "enable_flight_recorder", "dump_flight_recorder",
           "describe_peers", "gather_peers", "is_collective_failure", "set_collective_timeout"]

#: exit status of a rank whose watchdog fired (as coreutils' ``timeout``)
HANG_EXIT = 124
#: exit status of a rank whose collective failed: a peer died or timed out (sysexits' EX_TEMPFAIL)
PEER_EXIT = 75
#: directory of the stack dumps, under the run directory
HANGS_DIR = "hangs"
#: the signal on which every rank writes its stacks to its hangs file
DUMP_SIGNAL = signal.SIGUSR2


class CollectiveFailure(RuntimeError):
    """A collective failed on this rank (a peer died, or it did not answer within the timeout);
    the message says at which step, the backend's error and what is known of the peers."""


Peer = tuple[str, int]  # (host name, pid)


def gather_peers() -> list[Peer]:
    """``(host, pid)`` of every rank, indexed by rank (collective: one all_gather_object)."""
    return control.gather_objects((socket.gethostname(), os.getpid()))


def _status(pid: int) -> str:
    import psutil

    try:
        st = psutil.Process(pid).status()
    except psutil.Error:
        return "gone (no longer running: it exited, crashed or was killed, e.g. SIGKILL or the OOM killer)"
    words = {psutil.STATUS_STOPPED: "stopped (SIGSTOP, a debugger or job control)",
             psutil.STATUS_TRACING_STOP: "stopped by a tracer",
             psutil.STATUS_DISK_SLEEP: "in uninterruptible I/O (a stalled filesystem or device)",
             psutil.STATUS_ZOMBIE: "exited (a zombie not yet reaped by its launcher)",
             psutil.STATUS_DEAD: "dead"}
    return words.get(st, f"alive ({st})")


def describe_peers(peers: list[Peer], rank: int) -> str:
    """One clause per other rank: its state when on this host (:func:`_status`), else its host."""
    host = socket.gethostname()
    parts = []
    for r, (h, pid) in enumerate(peers):
        if r == rank:
            continue
        parts.append(f"rank {r} (pid {pid}) {_status(pid)}" if h == host else f"rank {r} on {h} (not checked here)")
    return "; ".join(parts) or "no other ranks"


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a torch.distributed backend's report of a failed or timed-out collective
    (``DistError`` and its subclasses, or gloo's RuntimeError: a closed or reset connection, a
    timeout)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "[gloo", "gloo/",
        "NCCL", "Broken pipe", "Socket"))


def set_collective_timeout(seconds: float) -> int:
    """Set the collective timeout of every process group of this process: the default group,
    DeepSpeed's data-parallel, expert-parallel and expert-data-parallel groups, the control group
    (:func:`smelt_ds.parallel.control.all_groups`), every backend of each (torch.distributed's
    private ``_set_pg_timeout``, as torchtitan does for its default group after its first step;
    gloo and NCCL read it for every later collective). Returns the number of groups set; 0 without
    an initialised process group of several ranks.

    Groups made later keep their own timeout: call this again after making one (``new_group``
    without ``timeout=`` takes the backend's default, NCCL 10 min, gloo 30 min)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return 0
    groups = control.all_groups()
    for group in groups:
        _set_pg_timeout(timedelta(seconds=seconds), group)
    return len(groups)


#: entries the flight recorder keeps per rank when the environment sets no size (torch's default is 0: off)
FLIGHT_RECORDER_ENTRIES = 2000
#: file-name prefixes of this rank's flight-recorder dumps in ``<run_dir>/hangs/`` (``<prefix><rank>``, the
#: layout torch's analyser reads: ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX``):
#: the CPU backends' recorder (gloo, the control group) and, on a CUDA build, NCCL's
FR_PREFIXES = {"_dump_fr_trace": "fr_trace_rank_", "_dump_nccl_trace": "nccl_trace_rank_"}


def enable_flight_recorder(environ=None) -> None:
    """Turn torch's flight recorder on for the process groups made after this call: a ring buffer of
    each rank's last :data:`FLIGHT_RECORDER_ENTRIES` collectives (operation, group, sequence number,
    sizes, state, timeout, Python stack), which :func:`dump_flight_recorder` writes when a rank hangs
    or a collective fails. Sets ``TORCH_FR_BUFFER_SIZE`` only when neither it nor its older spelling
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set (the user's value, or the rendered job's, wins; 0 turns
    the recorder off)."""
    env = os.environ if environ is None else environ
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def dump_flight_recorder(directory: Path, rank: int) -> list[Path]:
    """Write this rank's flight-recorder traces (torch's pickled format, the one NCCL's dump on
    timeout writes and ``torch.distributed.flight_recorder.fr_trace`` reads) to
    ``directory/<prefix><rank>`` for each recorder this torch has (:data:`FR_PREFIXES`) that holds an
    entry. Safe from the watchdog thread while the main thread is blocked in a collective. Returns
    the files written (none when the recorder is off or torch has none)."""
    import pickle

    import torch

    written = []
    c10d = getattr(torch._C, "_distributed_c10d", None)
    for fn_name, prefix in FR_PREFIXES.items():
        dump = getattr(c10d, fn_name, None)
        if dump is None:
            continue
        try:
            raw = dump()
            if not pickle.loads(raw).get("entries"):
                continue
            path = Path(directory) / f"{prefix}{rank}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(raw)
            written.append(path)
        except Exception as e:  # noqa: BLE001 - a failed dump must not stop the stacks and the exit
            print(f"rank {rank}: could not write the flight recorder ({fn_name}: {type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
    return written


class HangWatchdog:
    """The hang watchdog of one rank (see the module doc). Use as a context manager around the
    training loop; :meth:`arm` before each phase with its timeout in seconds, :meth:`step_done`
    after each step with its duration."""

    def __init__(self, cfg: Watchdog, run_dir: Path, rank: int, peers: list[Peer]) -> None:
        self.cfg, self.rank, self.peers = cfg, rank, peers
        self.dir = Path(run_dir) / HANGS_DIR
        self.path = self.dir / f"rank{rank:05d}.txt"
        self.steps_done, self.slowest = 0, 0.0
        self._deadline: float | None = None
        self._what, self._armed_s = "", 0.0
        self._cond = threading.Condition()
        self._closed = False
        self._file: IO[str] | None = None
        self._thread: threading.Thread | None = None

    # ---- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> HangWatchdog:
        if not self.cfg.enabled:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open: faulthandler writes to its descriptor
        with contextlib.suppress(ValueError, RuntimeError, OSError):  # not the main thread: no dump on request
            faulthandler.register(DUMP_SIGNAL, file=self._file, all_threads=True, chain=False)
        self._thread = threading.Thread(target=self._run, name="smelt-ds hang watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._file is None:
            return
        with contextlib.suppress(ValueError, RuntimeError, OSError):
            faulthandler.unregister(DUMP_SIGNAL)
        self._file.close()
        with contextlib.suppress(OSError):  # no hang, no file
            if self.path.stat().st_size == 0:
                self.path.unlink()
                self.dir.rmdir()  # fails while another rank's file is there

    # ---- timeouts ------------------------------------------------------------------------------
    def step_timeout(self) -> float:
        """Seconds the next step may take: ``startup_timeout_s`` for the first ``startup_steps``
        steps of this process; then ``timeout_s`` if set, else max(``min_timeout_s``,
        ``step_time_factor`` x the slowest step so far)."""
        c = self.cfg
        if self.steps_done < c.startup_steps:
            return c.startup_timeout_s
        if c.timeout_s is not None:
            return c.timeout_s
        return max(c.min_timeout_s, c.step_time_factor * self.slowest)

    def arm(self, seconds: float, what: str) -> None:
        """Fire unless :meth:`arm` or :meth:`disarm` is called again within ``seconds``."""
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._what, self._armed_s = what, seconds
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify_all()

    def step_done(self, seconds: float) -> bool:
        """Record a step's duration; True when this step ends the startup (the caller then
        switches the collective timeout to its steady value)."""
        self.steps_done += 1
        self.slowest = max(self.slowest, seconds)
        return self.steps_done == self.cfg.startup_steps

    # ---- firing --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
            self.fire()
            return

    def fire(self) -> None:
        """Dump this rank's stacks and ask the local peers for theirs, report, exit :data:`HANG_EXIT`."""
        assert self._file is not None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        head = (f"=== {stamp} rank {self.rank} (pid {os.getpid()}): no progress for {self._armed_s:.0f} s in "
                f"{self._what} (train.watchdog); every thread's Python stack:\n")
        self._file.write(head)
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        traces = dump_flight_recorder(self.dir, self.rank)
        asked = self._ask_local_peers(stamp)
        peers = describe_peers(self.peers, self.rank)
        print(f"\nrank {self.rank}: hang watchdog: no progress for {self._armed_s:.0f} s in {self._what}; "
              f"every thread's stack written to {self.path}"
              + (f" ({'rank' if len(asked) == 1 else 'ranks'} {', '.join(map(str, asked))} of this host "
                 f"asked to write theirs to {self.dir}/rank<RRRRR>.txt)" if asked else "")
              + (f"; its last collectives (the flight recorder) in {', '.join(map(str, traces))}" if traces else "")
              + f". Peers: {peers}. Exiting with status {HANG_EXIT} so that the job ends (a scheduler may "
              "requeue it); --resume auto continues from the newest complete checkpoint. "
              "Timeouts: train.watchdog (docs/faults.md)", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)

    def _ask_local_peers(self, stamp: str) -> list[int]:
        """SIGCONT (a stopped rank can dump nothing) and :data:`DUMP_SIGNAL` to every other rank on
        this host, after a header line in its hangs file; waits up to 2 s for their dumps."""
        host, asked = socket.gethostname(), []
        for r, (h, pid) in enumerate(self.peers):
            if r == self.rank or h != host:
                continue
            try:
                with open(self.dir / f"rank{r:05d}.txt", "a") as f:
                    f.write(f"=== {stamp} rank {r} (pid {pid}): stacks requested by rank {self.rank}'s hang "
                            f"watchdog ({self._what}):\n")
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, DUMP_SIGNAL)
                asked.append(r)
            except OSError:
                continue
        if asked:
            time.sleep(2.0)
        return asked

    def dump_on_failure(self, why: str) -> None:
        """A collective failed: write this rank's stacks and ask the local peers for theirs (as a
        hang does), without exiting."""
        if self._file is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._file.write(f"=== {stamp} rank {self.rank} (pid {os.getpid()}): {why}; every thread's stack:\n")
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        dump_flight_recorder(self.dir, self.rank)
        self._what = why
        self._ask_local_peers(stamp)
