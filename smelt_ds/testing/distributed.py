"""Run a function on several real processes with a CPU process group (OLMo-core's
``testing/distributed.py`` in spirit).

:func:`run_distributed` spawns ``world_size`` processes with :mod:`torch.multiprocessing`, gives
them ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, initialises ``torch.distributed``
(through ``deepspeed.init_distributed`` when ``init_deepspeed`` is true, so that
``deepspeed.comm`` is ready as under the deepspeed launcher), runs ``fn(rank, world_size, *args)``
and returns the per-rank results. A failure on any rank is re-raised in the parent as
:class:`DistributedTestError` carrying every failing rank's traceback; the call never hangs: a
wall-clock ``timeout`` kills all children, and collectives inside the children time out as well.

``fn`` and ``args`` must be picklable (a module-level function), since children are spawned:
the child imports ``fn``'s module by name, with the parent's ``sys.path``. A function defined in
a test module works under pytest's default ``prepend`` import mode (test basenames must then be
unique); with ``--import-mode=importlib`` put workers in an importable module instead.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]


class DistributedTestError(RuntimeError):
    """One or more ranks of :func:`run_distributed` failed, exited abnormally or timed out."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, backend: str, init_deepspeed: bool, num_threads: int,
           pg_timeout_s: float, fn: Callable[..., Any], args: Sequence[Any], results) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    if num_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
    try:
        import torch
        import torch.distributed as dist

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        if init_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                       verbose=False)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # pickled here by value: torch's queue reducers would pass tensors as shared-memory file
        # descriptors, which die with this process before the parent reads them
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_distributed(fn: Callable[..., Any], world_size: int = 2, backend: str = "gloo", timeout: float = 180.0,
                    args: Sequence[Any] = (), init_deepspeed: bool = True, num_threads: int = 1,
                    start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable too.
        world_size: number of processes (ranks).
        backend: ``torch.distributed`` backend (``gloo`` on CPU).
        timeout: wall-clock limit in seconds for the whole run (start-up included); collectives
            inside the children time out after the same number of seconds.
        args: extra positional arguments passed to ``fn``.
        init_deepspeed: initialise through ``deepspeed.init_distributed`` (needed before
            ``deepspeed.initialize``); otherwise plain ``torch.distributed.init_process_group``.
        num_threads: ``torch.set_num_threads`` in each child (1 avoids oversubscribing small CPUs;
            0 leaves torch's default).
        start_method: multiprocessing start method (``spawn`` is the safe default with torch).

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``.

    Raises:
        DistributedTestError: a rank raised (message holds each failing rank's traceback), exited
            without a result (e.g. killed by a signal), or the run exceeded ``timeout`` (all
            children are killed first, so nothing is left running).
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, init_deepspeed, num_threads,
                                              timeout, fn, tuple(args), results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
                outcomes[rank] = (status, payload)
                if status == "error":
                    _drain(results, outcomes, seconds=2.0)  # let the peers report their own errors
                    break
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                _drain(results, outcomes, seconds=1.0)
                for r in dead:
                    if r not in outcomes:
                        outcomes[r] = ("error", f"process exited with code {procs[r].exitcode} without a result")
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outcomes]
                _kill(procs)
                raise DistributedTestError(f"run_distributed({getattr(fn, '__name__', fn)!r}) timed out after "
                                           f"{timeout:.0f} s; ranks without a result: {missing}")
    finally:
        _kill(procs)
    # dicts keep arrival order: the first rank to fail (usually the root cause) is listed first
    errors = {r: msg for r, (status, msg) in outcomes.items() if status == "error"}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors.items())
        raise DistributedTestError(f"run_distributed({getattr(fn, '__name__', fn)!r}) failed on ranks "
                                   f"{sorted(errors)} (first failure first):\n{text}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _drain(results, outcomes: dict, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.1)
            outcomes.setdefault(rank, (status, payload))
        except queue_mod.Empty:
            continue


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
