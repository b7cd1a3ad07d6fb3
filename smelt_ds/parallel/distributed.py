"""Process-group setup and rank-0 helpers for every multi-rank path (training, profiling, tests).

torch.distributed through DeepSpeed (``deepspeed.init_distributed``: gloo on CPU, NCCL on CUDA), or a
world of one when nothing launched several ranks.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.parallel import control

__all__ = ["BACKEND_ENV", "check_backend", "find_free_port", "init_distributed", "on_rank0", "sync_flag"]


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: environment variable naming the backend string given to ``init_process_group`` instead of the
#: accelerator's (e.g. ``cuda:gloo``: CUDA tensors through gloo, no CPU backend, NCCL's device map;
#: ``cpu:gloo,cuda:nccl``): for emulations and the one-GPU check, not for production runs
BACKEND_ENV = "SMELT_DIST_BACKEND"


_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def check_backend(text: str) -> str:
    """``$SMELT_DIST_BACKEND``'s value checked before any process group: one backend name
    (:data:`_BACKENDS`) or ``device:backend`` pairs separated by commas (devices ``cpu``, ``cuda``),
    each usable on this machine (NCCL and the ``cuda`` device need CUDA). Returns ``text``; raises
    ConfigError naming the variable, the value and the fix."""
    import torch.distributed as dist

    fix = f"unset {BACKEND_ENV}, or set e.g. cuda:gloo (NCCL's device map through gloo) on a CUDA machine"
    pairs = [p.strip().split(":", 1) if ":" in p else ["", p.strip()] for p in text.split(",")]
    if any(backend not in _BACKENDS or device not in ("", "cpu", "cuda") or (device == "" and len(pairs) > 1)
           for device, backend in pairs):
        raise ConfigError(f"`{BACKEND_ENV}` ({text!r}) is not a torch.distributed backend: use one of "
                          f"{', '.join(_BACKENDS)} or device:backend pairs such as cpu:gloo,cuda:nccl; or {fix}")
    for device, backend in pairs:
        if (backend == "nccl" or device == "cuda") and not torch.cuda.is_available():
            raise ConfigError(f"`{BACKEND_ENV}` ({text!r}) needs CUDA, which this machine lacks "
                              f"(torch.cuda.is_available() is False): {fix}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise ConfigError(f"`{BACKEND_ENV}` ({text!r}): this torch has no NCCL: {fix}")
    return text


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, int]:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on CUDA, or the backend
    string of ``$SMELT_DIST_BACKEND``) when launched with several ranks, or as a world of one,
    then the control group (:func:`smelt_ds.parallel.control.init_control_group`: a gloo group
    for host values when the default group has no CPU backend). ``timeout_s``: every group's
    collective timeout in seconds (None: DeepSpeed's default, 30 minutes). Raises ConfigError for
    a bad ``$SMELT_DIST_BACKEND`` (:func:`check_backend`).

    The CUDA device of a rank is ``LOCAL_RANK`` modulo the visible devices: a scheduler that binds
    one GPU per task (Slurm's ``--gpus-per-task``) shows each task only ``cuda:0``.
    Returns ``(rank, local_rank, world_size)``."""
    from datetime import timedelta

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    if os.environ.get(BACKEND_ENV):  # an emulation's or the one-GPU check's backend, checked first
        backend = check_backend(os.environ[BACKEND_ENV])
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if timeout is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if backend == "gloo":
        release_cpu_allreduce_buffer()
    control.init_control_group(timeout)
    return dist.get_rank(), local_rank, dist.get_world_size()


def cpu_allreduce_buffer() -> Path:
    """This rank's shared-memory file of DeepSpeed's CPU collectives: ``deepspeed_allreduce_buffer_
    <uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` in ``/dev/shm`` (``csrc/cpu/comm/shm.cpp``, 66 MB),
    created by ``deepspeed.init_distributed`` on the CPU accelerator when every rank is on one host
    (``LOCAL_SIZE`` equals the world size, as the deepspeed launcher sets it)."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")


def release_cpu_allreduce_buffer() -> None:
    """Remove the name of this rank's :func:`cpu_allreduce_buffer` once every rank has mapped every
    peer's (collective: a barrier; DeepSpeed maps them inside ``init_distributed``, and never again).

    DeepSpeed never unlinks these files (``shared_close`` is not called), so each CPU run on one
    host left 66 MB per rank in ``/dev/shm``, a tmpfs that counts against memory, until a machine
    running tests ran out of it. The mappings stay valid; the memory is freed when the last rank
    exits. Nothing to do (and no barrier) on one rank or when the file does not exist."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    path = cpu_allreduce_buffer()
    exists = path.exists()
    control.barrier()  # every rank's init_distributed returned: each has opened all the peers' buffers
    if exists:
        path.unlink(missing_ok=True)


def on_rank0(rank: int, fn):
    """``fn()`` on global rank 0 (its result there, None elsewhere); a ConfigError it raises is
    raised on every rank, so no rank waits in a collective for a rank that gave up."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = str(e)
    error = control.broadcast_object(error, src=0)
    if error:
        raise ConfigError(error)
    return result


def sync_flag(flag: bool) -> bool:
    """True on every rank when any rank's ``flag`` is (one all-reduce MAX on the control group)."""
    return control.all_reduce_max([1.0 if flag else 0.0])[0] > 0
