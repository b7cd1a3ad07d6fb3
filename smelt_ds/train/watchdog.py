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

A rank whose collective fails because of a peer raises :class:`CollectiveFailure` and exits with
status :data:`PEER_EXIT` (75: retryable, a scheduler may requeue). :func:`peer_fault` decides that
from the error's type and the peers' state, never from its text: the error must come from the
backend (a ``torch.distributed.DistError``: ``DistBackendError``, NCCL's errors included,
``DistNetworkError``, ``DistStoreError``; or the plain ``RuntimeError`` gloo raises for a closed
connection or a timed-out collective, thrown from inside ``torch.distributed``), no peer may have
ended with an error of its own (:func:`report_own_error`, in the rendezvous store), and a peer must
be lost: one on this host gone, a zombie or stopped (:func:`describe_peers`, each process identified
by its pid and start time), or one on another host behind a lost connection. Any other error,
however it reads (e.g. a shape mismatch whose message names NCCL), is the rank's own: exit 1.

Every signal this module sends goes to a process whose identity is checked first
(:func:`signal_peer`: the pid and the start time recorded by :func:`gather_peers`), so a pid the
kernel gave to another process after a rank exited is never signalled.
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
from typing import IO, NamedTuple

from smelt_ds.config.train import Watchdog
from smelt_ds.parallel import control

__all__ = ["HANG_EXIT", "PEER_EXIT", "HANGS_DIR", "DUMP_SIGNAL", "FLIGHT_RECORDER_ENTRIES", "FR_PREFIXES",
           "CollectiveFailure", "HangWatchdog", "Peer", "enable_flight_recorder", "dump_flight_recorder",
           "describe_peers", "gather_peers", "is_collective_failure", "peer_fault", "report_own_error",
           "signal_peer", "this_process", "set_collective_timeout"]

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


class Peer(NamedTuple):
    """A rank's process: its host name, pid and start time (``psutil.Process.create_time()``,
    seconds since the epoch). The pid and the start time together name one process: the kernel
    reuses pids, never the pair."""

    host: str
    pid: int
    started: float


def this_process() -> Peer:
    """This process as a :class:`Peer`."""
    import psutil

    return Peer(socket.gethostname(), os.getpid(), psutil.Process().create_time())


def gather_peers() -> list[Peer]:
    """Every rank's :class:`Peer`, indexed by rank (collective: one all_gather_object)."""
    return [Peer(*p) for p in control.gather_objects(tuple(this_process()))]


def _process(peer: Peer):
    """The ``psutil.Process`` of ``peer`` on this host, or None when no process has its pid and
    start time (it exited; its pid may now be another process's)."""
    import psutil

    try:
        proc = psutil.Process(peer.pid)
        # the same kernel start tick gives the same float in every process of this host (boot time + ticks)
        same = abs(proc.create_time() - peer.started) < 1e-3
    except psutil.Error:
        return None
    return proc if same else None


def signal_peer(peer: Peer, signum: int) -> bool:
    """Send ``signum`` to ``peer``'s process on this host if it is still that process (pid and start
    time; psutil checks them again right before ``kill``). Returns whether it was sent: False for
    a process that exited, whose pid now names another process, or that may not be signalled."""
    import psutil

    proc = _process(peer)
    if proc is None:
        return False
    try:
        proc.send_signal(signum)
    except psutil.Error:
        return False
    return True


#: process states of a peer that cannot take part in a collective: it is lost to the job
_LOST = ("gone", "exited", "dead", "stopped")


def _status(peer: Peer) -> str:
    import psutil

    proc = _process(peer)
    if proc is None:
        return "gone (no longer running: it exited, crashed or was killed, e.g. SIGKILL or the OOM killer)"
    try:
        st = proc.status()
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
    for r, p in enumerate(peers):
        if r == rank:
            continue
        parts.append(f"rank {r} (pid {p.pid}) {_status(p)}" if p.host == host else
                     f"rank {r} on {p.host} (not checked here)")
    return "; ".join(parts) or "no other ranks"


#: frames of the backends' Python layer: a plain RuntimeError raised from here is the backend's (gloo's)
_BACKEND_FILES = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm{os.sep}")


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` has a type a torch.distributed backend raises for a failed collective: a
    ``DistError`` (``DistBackendError``, NCCL's errors among them; ``DistNetworkError``;
    ``DistStoreError``), or a plain ``RuntimeError``, the type gloo raises for a closed or reset
    connection and for a timed-out collective (verified with 2 gloo ranks, torch 2.13). Subclasses
    of RuntimeError (``torch.OutOfMemoryError``, ``NotImplementedError``, smelt-ds' own errors) are
    not. A plain RuntimeError may still be any error of the job's own: whether a peer caused it is
    :func:`peer_fault`'s question, answered from the peers' state."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or type(e) is RuntimeError


def _raised_by_backend(e: BaseException) -> bool:
    """Whether ``e``'s innermost Python frame is in ``torch.distributed`` or ``deepspeed.comm``: a
    C++ backend error surfacing through a collective call (gloo's RuntimeError has no type of its own)."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return any(part in tb.tb_frame.f_code.co_filename for part in _BACKEND_FILES)


#: the rendezvous store's key under which a rank leaves the error it ended with (:func:`report_own_error`)
OWN_ERROR_KEY = "smelt-ds/own-error/rank{rank}"
#: seconds a store operation of :func:`report_own_error` / :func:`peer_fault` may take (the store's host may be gone)
STORE_TIMEOUT_S = 5.0


def _store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


def report_own_error(rank: int, e: BaseException) -> None:
    """Leave ``e`` (an error of this rank's own, not a failed collective) in the rendezvous store,
    so that a peer whose collective then fails knows the job failed deterministically and exits 1,
    not :data:`PEER_EXIT`. Best effort: a store that cannot be reached is left alone."""
    try:
        store = _store()
        if store is not None:
            store.set(OWN_ERROR_KEY.format(rank=rank), f"{type(e).__name__}: {str(e).strip()[:300]}")
    except Exception:  # noqa: BLE001 - the error being reported is what matters; the store may be gone
        pass


def _own_errors(peers: list[Peer], rank: int) -> tuple[dict[int, str], str | None]:
    """``({rank: its own error}, None)`` from the store; ``({}, why)`` when the store cannot be
    reached (its host, the first rank's, is lost)."""
    import torch.distributed as dist

    try:
        store = _store()
        if store is None:
            return {}, None
        out = {}
        for r in range(len(peers)):
            key = OWN_ERROR_KEY.format(rank=r)
            if r != rank and store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        return out, None
    except (dist.DistError, RuntimeError) as e:
        return {}, f"the rendezvous store is unreachable ({type(e).__name__})"


def peer_fault(e: BaseException, peers: list[Peer], rank: int) -> str | None:
    """Why ``e`` is a collective failure caused by a peer (a clause for the message), or None when
    it is not, and the rank ends with exit 1. Never from the error's text:

    * ``e`` must have a backend's error type (:func:`is_collective_failure`);
    * no peer may have ended with an error of its own (:func:`report_own_error`, read from the
      rendezvous store): a job whose rank failed deterministically fails again after a requeue;
    * a peer must be lost: a rank on this host gone, a zombie or stopped (:func:`describe_peers`,
      each process identified by pid and start time); or the rendezvous store unreachable (its
      host is lost); or, with ranks on other hosts (their processes cannot be checked from here),
      a lost connection: ``DistNetworkError``, ``DistStoreError``, or an error thrown by the
      collective call itself (its innermost frame in ``torch.distributed`` / ``deepspeed.comm``).

    A failed collective with every peer alive here (e.g. NCCL's invalid usage, a shape mismatch
    whose message names NCCL) is the job's own error."""
    import torch.distributed as dist

    if not is_collective_failure(e):
        return None
    own, unreachable = _own_errors(peers, rank)
    if own:
        return None
    host = socket.gethostname()
    lost = [f"rank {r} (pid {p.pid}) {state}" for r, p in enumerate(peers)
            if r != rank and p.host == host and (state := _status(p)).startswith(_LOST)]
    if lost:
        return "; ".join(lost)
    if unreachable:
        return unreachable
    remote = [r for r, p in enumerate(peers) if r != rank and p.host != host]
    if remote and (isinstance(e, (dist.DistNetworkError, dist.DistStoreError)) or _raised_by_backend(e)):
        return f"the connection to the ranks on other hosts ({', '.join(map(str, remote))}) failed"
    return None


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
        self._what, self._armed_s, self._basis = "", 0.0, ""
        self.basis = ""  # how step_timeout() derived its last value (for the watchdog's message)
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
            self.basis = f"startup_timeout_s for the first {c.startup_steps} steps"
            return c.startup_timeout_s
        if c.timeout_s is not None:
            self.basis = "timeout_s"
            return c.timeout_s
        self.basis = (f"max(min_timeout_s {c.min_timeout_s:g}, step_time_factor {c.step_time_factor:g} x the slowest "
                      f"step so far {self.slowest:.6f} s)")
        return max(c.min_timeout_s, c.step_time_factor * self.slowest)

    def arm(self, seconds: float, what: str, basis: str = "") -> None:
        """Fire unless :meth:`arm` or :meth:`disarm` is called again within ``seconds``; ``basis``
        says where ``seconds`` came from (in the message when it fires)."""
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._what, self._armed_s, self._basis = what, seconds, basis
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
        timeout = f" (timeout {self._armed_s:.6f} s = {self._basis})" if self._basis else ""
        print(f"\nrank {self.rank}: hang watchdog: no progress for {self._armed_s:.0f} s in {self._what}{timeout}; "
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
        this host that is still the process recorded at start (:func:`signal_peer`), after a header
        line in its hangs file; waits up to 2 s for their dumps."""
        host, asked = socket.gethostname(), []
        for r, peer in enumerate(self.peers):
            if r == self.rank or peer.host != host or _process(peer) is None:  # gone, or its pid reused
                continue
            try:
                with open(self.dir / f"rank{r:05d}.txt", "a") as f:
                    f.write(f"=== {stamp} rank {r} (pid {peer.pid}): stacks requested by rank {self.rank}'s hang "
                            f"watchdog ({self._what}):\n")
            except OSError:
                continue
            if signal_peer(peer, signal.SIGCONT) and signal_peer(peer, DUMP_SIGNAL):
                asked.append(r)
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
