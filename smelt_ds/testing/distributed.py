"""Run a function on several real processes with a CPU process group (OLMo-core's
``testing/distributed.py`` in spirit).

:func:`run_distributed` starts ``world_size`` processes with :mod:`torch.multiprocessing`, gives
them ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, initialises ``torch.distributed``
(through ``deepspeed.init_distributed`` when ``init_deepspeed`` is true, so that
``deepspeed.comm`` is ready as under the deepspeed launcher), runs ``fn(rank, world_size, *args)``
and returns the per-rank results. A failure on any rank is re-raised in the parent as
:class:`DistributedTestError` carrying every failing rank's traceback; the call never hangs: a
wall-clock ``timeout`` kills all children, and collectives inside the children time out as well.

Timeouts scale with the machine: every wall-clock limit of :func:`run_distributed` (the run's
``timeout``, the process-group timeout of the children, and its short internal waits for peers'
errors and for children to exit) is multiplied by the environment variable
``SMELT_TEST_TIMEOUT_SCALE`` (a finite number > 0; unset or empty means 1), read at each call.
A shared or small CI machine sets e.g. ``SMELT_TEST_TIMEOUT_SCALE=3`` (``.ci/run`` does) rather
than every test raising its own limit; the protection against hangs stays, only later.
:func:`scaled_timeout` applies the same factor to a test's own limits (``subprocess.run(...,
timeout=scaled_timeout(300))``, ``proc.communicate(timeout=scaled_timeout(120))``). A bad value
raises :class:`ValueError` naming the variable, the value and what is accepted.

Ranks are forked from a fork server that has imported torch and DeepSpeed once (``start_method``
``forkserver``, the default), with the caller's environment, standard output/error, ``sys.path``
and working directory at the call. ``fn`` and ``args`` must be picklable (a module-level function):
the child imports ``fn``'s module by name, with the parent's ``sys.path``. A function defined in
a test module works under pytest's default ``prepend`` import mode (test basenames must then be
unique); with ``--import-mode=importlib`` put workers in an importable module instead.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch.multiprocessing as mp

from smelt_ds.parallel.distributed import find_free_port

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

__all__ = ["TIMEOUT_SCALE_ENV", "DistributedTestError", "run_distributed", "scaled_timeout", "timeout_scale"]

#: environment variable multiplying the wall-clock limits of the multi-process test helpers
TIMEOUT_SCALE_ENV = "SMELT_TEST_TIMEOUT_SCALE"


class DistributedTestError(RuntimeError):
    """One or more ranks of :func:`run_distributed` failed, exited abnormally or timed out."""


def timeout_scale() -> float:
    """The factor ``SMELT_TEST_TIMEOUT_SCALE`` sets for test timeouts (dimensionless), read now.

    Unset, empty or blank means 1.0.

    Raises:
        ValueError: the variable is not a finite number > 0 (the message names the variable, its
            value and what is accepted).
    """
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "")
    if not raw.strip():
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r} is not a valid timeout scale: set a finite number > 0 "
                         f"(e.g. {TIMEOUT_SCALE_ENV}=3 on a loaded machine, 0.5 to fail faster), or unset it "
                         "for 1")
    return scale


def scaled_timeout(seconds: float) -> float:
    """``seconds`` (a wall-clock limit in seconds) times :func:`timeout_scale`, in seconds.

    Use it for a test's own limits on long work (a training subprocess, several processes), e.g.
    ``proc.communicate(timeout=scaled_timeout(240))``, so that ``SMELT_TEST_TIMEOUT_SCALE``
    stretches them on a loaded machine as it does :func:`run_distributed`'s.

    Raises:
        ValueError: ``seconds`` is not a finite number > 0, or ``SMELT_TEST_TIMEOUT_SCALE`` is bad
            (see :func:`timeout_scale`).
    """
    number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    if not (number and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"scaled_timeout(seconds={seconds!r}): seconds must be a finite number > 0 (a wall-clock "
                         "limit in seconds, before scaling)")
    return float(seconds) * timeout_scale()


#: modules the fork server imports once, so that each rank starts as a fork of a process that has
#: them (``smelt_ds`` first: it installs the import hook that spares DeepSpeed's optional MLflow
#: import; ``torch._dynamo``: torch's optimizers import it on construction, 1.4 s of a rank's first
#: training on 2 cores; ``torch.utils.tensorboard``: the metrics writer). Nothing here may read, at
#: import, an environment variable a test sets: the server's environment is the one it started with
#: (the children get the caller's, see _ParentState).
FORKSERVER_PRELOAD = ("smelt_ds", "torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard",
                      "deepspeed", "smelt_ds.train.loop", "smelt_ds.testing.distributed")


def _detach_fd(dup: Any) -> int:
    return dup.detach()


class _InheritedFd:
    """One of the caller's file descriptors, received by the child as a descriptor of its own
    (multiprocessing passes it over the fork server's socket while pickling the process)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach_fd, (reduction.DupFd(self.fd),))


class _ParentState:
    """What a child forked from the fork server must take from the caller rather than from the
    server: the environment and the standard output and error descriptors as they are at the call
    (a test's ``monkeypatch.setenv``, pytest's per-test output capture). ``sys.path`` and the
    working directory already travel with multiprocessing's preparation data."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        # an _InheritedFd here; the descriptor number (int) once unpickled in the child
        self.stdout: Any = _InheritedFd(1)
        self.stderr: Any = _InheritedFd(2)

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, target in ((self.stdout, 1), (self.stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)


def _child(rank: int, world_size: int, port: int, backend: str, init_deepspeed: bool, num_threads: int,
           pg_timeout_s: float, fn: Callable[..., Any], args: Sequence[Any], results,
           parent: _ParentState | None = None) -> None:
    if parent is not None:
        parent.apply()
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
                    start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by rank.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable too.
        world_size: number of processes (ranks).
        backend: ``torch.distributed`` backend (``gloo`` on CPU).
        timeout: wall-clock limit in seconds for the whole run (start-up included), before
            scaling: the limit applied is ``timeout * SMELT_TEST_TIMEOUT_SCALE`` (see
            :func:`scaled_timeout`); collectives inside the children time out after that many
            seconds as well.
        args: extra positional arguments passed to ``fn``.
        init_deepspeed: initialise through ``deepspeed.init_distributed`` (needed before
            ``deepspeed.initialize``); otherwise plain ``torch.distributed.init_process_group``.
        num_threads: ``torch.set_num_threads`` in each child (1 avoids oversubscribing small CPUs;
            0 leaves torch's default).
        start_method: multiprocessing start method. The default, ``forkserver``, forks each rank
            from a server process started once per calling process that has imported
            :data:`FORKSERVER_PRELOAD` (torch, DeepSpeed) without running anything, so a rank starts
            in a fraction of a second instead of paying those imports (about 1.5 s a launch on 2
            cores); each rank gets the caller's environment and standard output/error as they are
            at the call. ``spawn`` starts fresh interpreters.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``.

    Raises:
        DistributedTestError: a rank raised (message holds each failing rank's traceback), exited
            without a result (e.g. killed by a signal), or the run exceeded the scaled ``timeout``
            (all children are killed first, so nothing is left running; the message states the
            limit applied, the ``timeout`` asked for and the scale).
        ValueError: ``timeout`` is not a finite number > 0, or ``SMELT_TEST_TIMEOUT_SCALE`` is not
            a finite number > 0 (raised before any process starts).
    """
    scale = timeout_scale()
    limit = scaled_timeout(timeout)
    # A named start method gives a concrete context (typeshed types get_context(str) as BaseContext).
    ctx = cast("SpawnContext | ForkContext | ForkServerContext", mp.get_context(start_method))
    if start_method == "forkserver":
        cast("ForkServerContext", ctx).set_forkserver_preload(list(FORKSERVER_PRELOAD))
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, init_deepspeed, num_threads,
                                              limit, fn, tuple(args), results,
                                              _ParentState() if start_method == "forkserver" else None),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
                outcomes[rank] = (status, payload)
                if status == "error":
                    _drain(results, outcomes, world_size, seconds=2.0 * scale)  # the peers' own errors
                    break
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                _drain(results, outcomes, world_size, seconds=1.0 * scale)
                for r in dead:
                    if r not in outcomes:
                        outcomes[r] = ("error", f"process exited with code {procs[r].exitcode} without a result")
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outcomes]
                _kill(procs, join_s=5.0 * scale)
                raise DistributedTestError(f"run_distributed({getattr(fn, '__name__', fn)!r}) timed out after "
                                           f"{limit:g} s (timeout={timeout:g} s x {TIMEOUT_SCALE_ENV}={scale:g}); "
                                           f"ranks without a result: {missing}")
    finally:
        _kill(procs, join_s=5.0 * scale)
    # dicts keep arrival order: the first rank to fail (usually the root cause) is listed first
    errors = {r: msg for r, (status, msg) in outcomes.items() if status == "error"}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors.items())
        raise DistributedTestError(f"run_distributed({getattr(fn, '__name__', fn)!r}) failed on ranks "
                                   f"{sorted(errors)} (first failure first):\n{text}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _drain(results, outcomes: dict, world_size: int, seconds: float) -> None:
    """Collect the outcomes still queued for up to ``seconds`` (wall clock), or until every one of
    the ``world_size`` ranks has one (a failed one-rank run returns at once)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and len(outcomes) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.1)
            outcomes.setdefault(rank, (status, payload))
        except queue_mod.Empty:
            continue


def _kill(procs, join_s: float) -> None:
    """SIGTERM every live child, wait up to ``join_s`` seconds for each, then SIGKILL what is left
    (and reap it: up to 5 s, unscaled, since a SIGKILLed process exits at once)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=join_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
