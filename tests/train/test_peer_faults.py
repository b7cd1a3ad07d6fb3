"""Exit 75 (a peer's collective failure, retryable) only when a peer is lost, decided from the
error's type and the peers' state, never from the message; signals only to a process whose
identity (pid and start time) is checked; and the soak's ledger check.

The backend's errors are the ones 2 real gloo ranks raise (torch 2.13): a peer that dies, a peer
that is stopped past the collective timeout, a peer that ended with an error of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest

from smelt_ds.testing import scaled_timeout
from smelt_ds.testing.distributed import FORKSERVER_PRELOAD
from smelt_ds.testing.faults import LedgerError, check_ledger
from smelt_ds.train.watchdog import Peer, is_collective_failure, peer_fault, signal_peer, this_process

# ---------------------------------------------------------------------------------------------
# what gloo raises, and how it is classified
# ---------------------------------------------------------------------------------------------


def _pair_worker(rank: int, port: int, case: str, out) -> None:
    import torch
    import torch.distributed as dist

    from smelt_ds.train.watchdog import gather_peers, report_own_error

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    peers = gather_peers()  # over the control group, as the training does
    dist.barrier()
    if rank == 1:
        if case == "dies":
            os._exit(137)
        if case == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        if case == "own_error":
            report_own_error(1, ValueError("labels out of range"))
            os._exit(1)
        time.sleep(60)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(4))
        out.put(("no error",))
    except BaseException as e:  # noqa: BLE001 - what the backend raised is the point
        out.put((type(e).__name__, type(e) is RuntimeError, is_collective_failure(e), peer_fault(e, peers, 0)))
    out.close()
    out.join_thread()  # the queue's feeder thread has written the result before the process ends
    os._exit(0)


def _pair(case: str) -> tuple:
    ctx = mp.get_context("forkserver")  # ranks forked from a server that has imported torch (as run_distributed)
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_pair_worker, args=(r, port, case, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=scaled_timeout(40))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


@pytest.mark.distributed
def test_gloo_failures_are_a_peers_fault_only_when_the_peer_is_lost():
    """Rank 1 dies (os._exit), is stopped (SIGSTOP) past the 3 s collective timeout, or ends with an
    error of its own after leaving it in the store: rank 0's all_reduce raises gloo's plain
    RuntimeError every time; only the first two are a peer's fault (exit 75), named by the peer's
    state; the third is the job's own error (exit 1)."""
    died = _pair("dies")
    assert died[:3] == ("RuntimeError", True, True), died
    assert died[3] is not None and died[3].startswith("rank 1 (pid ") and (" gone" in died[3] or " exited" in died[3])
    stopped = _pair("stopped")
    assert stopped[:3] == ("RuntimeError", True, True), stopped
    assert stopped[3] is not None and "stopped (SIGSTOP" in stopped[3], stopped
    own = _pair("own_error")
    assert own[:3] == ("RuntimeError", True, True), own
    assert own[3] is None, own  # rank 1 is gone, but it failed by itself: a requeue would fail again


def test_an_error_of_the_job_is_not_a_peers_fault_whatever_its_text():
    """No process group: every peer is a real process on this host. A RuntimeError whose message
    names NCCL, a socket and a timeout, with every peer alive, is the job's own error (the old rule
    called it a collective failure by its text); an error type no backend raises is never a
    collective failure, even with a peer gone; a backend's type with a peer gone is the peer's fault."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = Peer(socket.gethostname(), child.pid, psutil.Process(child.pid).create_time())
        peers = [this_process(), alive]
        text = RuntimeError("NCCL error in: shape mismatch [1024] vs [2048]; Socket Timed out Connection reset by peer")
        assert peer_fault(text, peers, 0) is None
        child.kill()
        child.wait()
        assert peer_fault(torch_oom(), peers, 0) is None  # a subclass of RuntimeError: not a backend's type
        assert not is_collective_failure(ValueError("NCCL"))
        cause = peer_fault(RuntimeError("anything"), peers, 0)
        assert cause is not None and cause.startswith(f"rank 1 (pid {child.pid}) gone"), cause
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def torch_oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory (NCCL)")


# ---------------------------------------------------------------------------------------------
# signals only to the process recorded
# ---------------------------------------------------------------------------------------------


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_stale_pid_record_is_never_signalled(tmp_path):
    """A rank's record (host, pid, start time) made stale: the process recorded exits and another
    process is forged into the record (its pid, the old start time), as when the kernel reuses the
    pid. Neither :func:`signal_peer` nor the hang watchdog's request for stacks (SIGCONT, then
    SIGUSR2, whose default action would end the process) signals it; the true record is signalled."""
    from smelt_ds.config.train import Watchdog
    from smelt_ds.train.watchdog import HangWatchdog

    first = _sleeper()
    started = psutil.Process(first.pid).create_time()
    first.kill()
    first.wait()
    time.sleep(0.05)  # start times count clock ticks (10 ms): the next process starts a tick later at least
    other = _sleeper()
    try:
        forged = Peer(socket.gethostname(), other.pid, started)
        assert psutil.Process(other.pid).create_time() != started
        assert signal_peer(forged, signal.SIGTERM) is False
        dog = HangWatchdog(Watchdog(), tmp_path, 0, [this_process(), forged])
        dog.dir.mkdir(parents=True)
        assert dog._ask_local_peers("now") == []
        time.sleep(0.5)
        assert other.poll() is None, f"the process holding the recorded pid got a signal (status {other.returncode})"
        true = Peer(socket.gethostname(), other.pid, psutil.Process(other.pid).create_time())
        assert HangWatchdog(Watchdog(), tmp_path, 0, [this_process(), true])._ask_local_peers("now") == [1]
        assert other.wait(timeout=10) == -signal.SIGUSR2  # the true record was signalled: the check can see it
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


# ---------------------------------------------------------------------------------------------
# the soak's ledger: each step once on the final trajectory
# ---------------------------------------------------------------------------------------------


def _attempt(pid: int, steps, skipped=(), weights=None) -> list[dict]:
    return [{"step": s, "rank": 0, "pid": pid, "skipped": "x" if s in skipped else None,
             "weights": (weights or {}).get(s, f"w{s}")} for s in steps]


def test_the_ledger_allows_only_the_steps_a_crash_lost_to_be_trained_again():
    """Attempt 1 trains 1..5 and crashes; its newest checkpoint is step 4, so attempt 2 re-trains 5
    (the one repetition allowed) and goes on to 7. Each way a resume could train a step twice or
    leave one out is refused, naming it; metrics.jsonl, which the resume trims back to step 4,
    shows each of these runs as 1..7 once."""
    good = {r: [dict(x, rank=r) for x in _attempt(10, range(1, 6)) + _attempt(20, range(5, 8))] for r in (0, 1)}
    assert check_ledger(good, 7, checkpoints=[4]) == {"attempts": [(1, 5), (5, 7)], "retrained": [5]}
    assert check_ledger({0: _attempt(10, range(1, 5)) + _attempt(20, range(5, 8))}, 7,
                        checkpoints=[4])["retrained"] == []  # a stop that saved at its last step
    cases = {
        "resumed from an older checkpoint": ({0: _attempt(10, range(1, 6)) + _attempt(20, range(3, 8))}, [4],
                                             "resumed from step 2, not from the newest complete checkpoint (step 4)"),
        "a step trained twice in one attempt": ({0: _attempt(10, [1, 2, 3, 3, 4, 5, 6, 7])}, None,
                                                "trained steps [1, 2, 3, 3"),
        "a resume past the last step trained": ({0: _attempt(10, range(1, 4)) + _attempt(20, range(6, 8))}, None,
                                                "steps 4..5 were never trained"),
        "a re-trained step with other weights": (
            {0: _attempt(10, range(1, 6)) + _attempt(20, range(5, 8), weights={5: "other"})}, [4],
            "step 5 trained again in attempt 2 gave other weights"),
        "ranks that disagree": ({0: _attempt(10, range(1, 8)),
                                 1: [dict(x, rank=1) for x in _attempt(11, range(1, 6)) + _attempt(21, range(5, 8))]},
                                None, "the ranks disagree"),
        "too few steps": ({0: _attempt(10, range(1, 7))}, None, "missed [7]"),
    }
    for what, (ledger, checkpoints, message) in cases.items():
        with pytest.raises(LedgerError, match=None) as info:
            check_ledger(ledger, 7, checkpoints=checkpoints)
        assert message in str(info.value), (what, str(info.value))
