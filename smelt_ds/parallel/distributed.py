"""Process-group setup and rank-0 helpers for every multi-rank path (training, profiling, tests).

torch.distributed through DeepSpeed (``deepspeed.init_distributed``: gloo on CPU, NCCL on CUDA), or a
world of one when nothing launched several ranks.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.parallel import control
from smelt_ds.parallel.extension_cache import use_host_extension_dir
from smelt_ds.parallel.threads import LOCAL_SIZE_ENVS

__all__ = ["BACKEND_ENV", "MPI_ENVS", "check_backend", "cuda_device_index", "deepspeed_args", "find_free_port",
           "init_distributed", "on_rank0", "set_rank_device", "sync_flag", "world_env"]


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


#: where each MPI launcher puts (rank, world size, local rank, local world size): Open MPI's
#: ``mpirun`` (and ``deepspeed --launcher openmpi``, which runs it), MVAPICH2's ``mpirun_rsh``, and
#: MPICH's Hydra / Intel MPI (PMI rank and size, Hydra's node-local ids)
MPI_ENVS = {"Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE"),
            "MVAPICH2": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                         "MV2_COMM_WORLD_LOCAL_SIZE"),
            "MPICH/Intel MPI (PMI)": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}

#: DeepSpeed's rendezvous port when an MPI launcher names none (``deepspeed.constants``:
#: ``TORCH_DISTRIBUTED_DEFAULT_PORT``, what its MPI discovery uses)
DEFAULT_MPI_PORT = 29500


def _whole(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env[name].strip()
    if not raw.isdigit() or int(raw) < minimum:
        raise ConfigError(f"`{name}` ({env[name]!r}) must be a whole number >= {minimum}: the launcher's "
                          "environment is broken; start the ranks with torchrun, the deepspeed launcher or mpirun")
    return int(raw)


def world_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) that describe this process's world,
    from ``env`` (default ``os.environ``); what :func:`init_distributed` exports.

    Sources, first match wins:

    1. torch's (torchrun, the deepspeed launcher, the rendered jobs): ``RANK`` and ``WORLD_SIZE``.
       A missing ``LOCAL_RANK`` comes from an MPI launcher's local rank, or is ``RANK`` when the
       whole world is on this host (``LOCAL_WORLD_SIZE``/``LOCAL_SIZE`` equals ``WORLD_SIZE``).
    2. an MPI launcher's (:data:`MPI_ENVS`: Open MPI's ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` /
       ``_LOCAL_RANK`` / ``_LOCAL_SIZE``, MVAPICH2's ``MV2_COMM_WORLD_*``, MPICH Hydra's and Intel
       MPI's ``PMI_RANK`` / ``PMI_SIZE`` / ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS``), as
       DeepSpeed's own discovery reads Open MPI's (``patch_aml_env_for_torch_nccl_backend``). With
       several ranks ``MASTER_ADDR`` (rank 0's host) must be given (``mpirun -x MASTER_ADDR=...``, or a
       ``.deepspeed_env`` line for ``deepspeed --launcher openmpi``), unless every rank is on this
       host (then 127.0.0.1), or mpi4py is installed (then DeepSpeed's MPI discovery,
       ``deepspeed.comm.comm.mpi_discovery``, finds rank 0's address and port 29500 and the result
       has no ``MASTER_*``); ``MASTER_PORT`` defaults to DeepSpeed's 29500.
    3. none of these: a world of one (rank 0, port: a free one).

    Raises ConfigError naming the variables when the world is partly described: ``RANK`` without
    ``WORLD_SIZE`` or the reverse, a rank outside the world, ``LOCAL_RANK`` missing in a world
    spread over several hosts, no ``MASTER_ADDR`` for several hosts."""
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    launcher = "torch"
    if "RANK" in env or "WORLD_SIZE" in env:
        if not ("RANK" in env and "WORLD_SIZE" in env):
            given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise ConfigError(f"`{given}` is set ({env[given]!r}) but `{missing}` is not: a launcher sets both "
                              f"(torchrun, the deepspeed launcher); set {missing} too, or unset {given} for a "
                              "single process")
        rank, world = _whole(env, "RANK", 0), _whole(env, "WORLD_SIZE", 1)
        mpi = next((names for names in MPI_ENVS.values() if names[2] in env), None)
        if "LOCAL_RANK" in env:
            local = _whole(env, "LOCAL_RANK", 0)
        elif mpi is not None:
            local = _whole(env, mpi[2], 0)
        elif world == 1 or _local_world(env) == world:
            local = rank
        else:
            raise ConfigError(f"`LOCAL_RANK` is not set for rank {rank} of a world of {world} spread over several "
                              "hosts, and it cannot be told from the global rank: start the ranks with torchrun or "
                              "the deepspeed launcher (they set it), or export LOCAL_RANK (the rank's index on its "
                              "host, e.g. $SLURM_LOCALID)")
        local_world = _local_world(env) or (1 if world == 1 else 0)
    else:
        found = [(name, names) for name, names in MPI_ENVS.items() if names[0] in env or names[1] in env]
        if not found:
            rank = local = 0
            world = local_world = 1
        else:
            launcher, names = found[0]
            absent = [n for n in names[:3] if n not in env]
            if absent == [names[2]] and names[1] in env and env[names[1]].strip() == "1":
                absent = []  # a world of one (e.g. `srun -n1` under Slurm's pmi2, which sets no local rank)
                env = {**env, names[2]: "0"}
            if absent:
                raise ConfigError(f"{launcher}'s environment is incomplete: {', '.join(absent)} not set (beside "
                                  f"{', '.join(n for n in names if n in env)}): start the ranks with that launcher's "
                                  "mpirun, or set RANK, WORLD_SIZE and LOCAL_RANK")
            rank, world, local = _whole(env, names[0], 0), _whole(env, names[1], 1), _whole(env, names[2], 0)
            local_world = _whole(env, names[3], 1) if names[3] in env else 0
    if rank >= world:
        raise ConfigError(f"rank {rank} is outside a world of {world} ({launcher} launcher's environment): the "
                          "launcher's RANK/WORLD_SIZE disagree")
    if local_world and local >= local_world:
        raise ConfigError(f"local rank {local} is outside the {local_world} ranks of this host (LOCAL_RANK / "
                          "LOCAL_WORLD_SIZE, or the MPI launcher's): the launcher's environment disagrees with "
                          "itself; start the ranks with torchrun, the deepspeed launcher or mpirun")
    out.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    if local_world:
        out["LOCAL_WORLD_SIZE"] = str(local_world)
    one_host = world == 1 or local_world == world
    if env.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = env["MASTER_ADDR"]
    elif one_host:
        out["MASTER_ADDR"] = "127.0.0.1"
    elif launcher != "torch" and importlib.util.find_spec("mpi4py") is not None:
        return out  # DeepSpeed's MPI discovery (mpi4py) finds rank 0's address: init_distributed calls it
    else:
        raise ConfigError(f"`MASTER_ADDR` is not set for a world of {world} ranks over several hosts ({launcher} "
                          "launcher): export rank 0's host name or address to every rank (mpirun -x "
                          "MASTER_ADDR=<host> -x MASTER_PORT=29500; for deepspeed --launcher openmpi, the lines "
                          "MASTER_ADDR=<host> and MASTER_PORT=29500 in ./.deepspeed_env)")
    if env.get("MASTER_PORT"):
        if _whole(env, "MASTER_PORT", 1) > 65535:
            raise ConfigError(f"`MASTER_PORT` ({env['MASTER_PORT']!r}) is no TCP port: export a port of 1-65535 "
                              "free on rank 0's host, the same on every rank (e.g. 29500)")
        out["MASTER_PORT"] = env["MASTER_PORT"].strip()
    else:
        out["MASTER_PORT"] = str(find_free_port() if world == 1 else DEFAULT_MPI_PORT)
    return out


def _local_world(env: Mapping[str, str]) -> int:
    """Ranks on this host as the launcher says (the first of threads' local-size variables set),
    0 when unsaid."""
    name = next((n for n in LOCAL_SIZE_ENVS if env.get(n, "").strip()), None)
    return 0 if name is None else _whole(env, name, 1)




def cuda_device_index(env: Mapping[str, str] | None = None, visible: int | None = None) -> int:
    """The CUDA device index of this rank among the devices it can see (``visible``, default
    ``torch.cuda.device_count()``, which ``CUDA_VISIBLE_DEVICES`` restricts):

    - one visible device: ``cuda:0`` (a scheduler binding one GPU per task, as Slurm's
      ``--gpus-per-task=1`` or ``--gpu-bind=single:1``, shows each task only its own);
    - at least as many visible devices as ranks on this host (``LOCAL_WORLD_SIZE``, else
      ``LOCAL_SIZE``, else the MPI launcher's local size; 1 when none is set) and ``LOCAL_RANK``
      below their count: ``cuda:LOCAL_RANK``;
    - otherwise ConfigError naming ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
      (two ranks on one GPU is not a layout NCCL runs).

    ``env`` defaults to ``os.environ`` (``LOCAL_RANK`` defaults to 0)."""
    env = os.environ if env is None else env
    visible = torch.cuda.device_count() if visible is None else visible
    local = int(env.get("LOCAL_RANK", "0"))
    local_world = max(_local_world(env), 1)
    if visible == 1:
        return 0
    if visible >= local_world and local < visible:
        return local
    raise ConfigError(f"rank with LOCAL_RANK={local} of LOCAL_WORLD_SIZE={local_world} ranks on this host sees "
                      f"{visible} CUDA devices (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): "
                      "give each task one GPU (Slurm --gpus-per-task=1) or every rank of the host all of them "
                      "(as many visible devices as LOCAL_WORLD_SIZE)")


def set_rank_device() -> int | None:
    """Make :func:`cuda_device_index` the current CUDA device (``torch.cuda.set_device``) and
    return it; None (nothing set) without CUDA. Called by :func:`init_distributed`, and by
    training when something else created the process group."""
    if not torch.cuda.is_available():
        return None
    index = cuda_device_index()
    torch.cuda.set_device(index)
    return index


def deepspeed_args(zero_stage: int = 0):
    """The ``args`` to give ``deepspeed.initialize`` so that its engine computes on this rank's
    current CUDA device (``args.device_rank``, which DeepSpeed's engine prefers to
    ``LOCAL_RANK``), or None without CUDA (the engine's own CPU device).

    ZeRO stage 3 places parameters on ``cuda:LOCAL_RANK`` whatever the engine's device
    (``deepspeed.zero.Init`` and ``zero/utils.py`` read ``LOCAL_RANK``), so ``zero_stage`` 3 on a
    rank whose device is another (one GPU per task, LOCAL_RANK > 0) raises ConfigError naming
    ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES`` and the fix."""
    from types import SimpleNamespace

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if zero_stage == 3 and index != local:
        raise ConfigError(f"ZeRO stage 3 (deepspeed.zero_stage: 3) puts parameters on cuda:LOCAL_RANK (cuda:{local}), "
                          f"but this rank sees only its own GPU as cuda:{index} (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, one GPU per task): give every rank "
                          "of a host all its GPUs (Slurm --gpus-per-node without --gpus-per-task), or use ZeRO stage "
                          "0-2")
    return SimpleNamespace(device_rank=index)


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, int]:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on CUDA, or the backend
    string of ``$SMELT_DIST_BACKEND``) when launched with several ranks, or as a world of one,
    then the control group (:func:`smelt_ds.parallel.control.init_control_group`: a gloo group
    for host values when the default group has no CPU backend). ``timeout_s``: every group's
    collective timeout in seconds (None: DeepSpeed's default, 30 minutes).

    The world comes from the launcher's environment (:func:`world_env`: torch's variables, else an
    MPI launcher's, else a world of one), exported as torch's variables before DeepSpeed reads them.
    The CUDA device of a rank is :func:`cuda_device_index` (one visible device: ``cuda:0``), set
    before the process group is made; when it is not ``cuda:LOCAL_RANK`` the default group is
    created bound to it (``device_id``), since DeepSpeed would bind ``cuda:LOCAL_RANK``.
    DeepSpeed's JIT ops build into this host's own cache unless ``TORCH_EXTENSIONS_DIR`` is set
    (:func:`smelt_ds.parallel.extension_cache.use_host_extension_dir`).
    Raises ConfigError for a bad ``$SMELT_DIST_BACKEND`` (:func:`check_backend`), a partly described
    world (:func:`world_env`) or devices that do not fit the local ranks.
    Returns ``(rank, local_rank, world_size)``."""
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    os.environ.update(world_env())
    use_host_extension_dir()  # DeepSpeed's CPU collectives op is built (or loaded) by init_distributed
    if "MASTER_ADDR" not in os.environ:  # an MPI world over several hosts, with mpi4py: DeepSpeed's discovery
        from deepspeed.comm.comm import mpi_discovery

        mpi_discovery(distributed_port=DEFAULT_MPI_PORT, verbose=False)
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    if os.environ.get(BACKEND_ENV):  # an emulation's or the one-GPU check's backend, checked first
        backend = check_backend(os.environ[BACKEND_ENV])
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    local_rank = int(os.environ["LOCAL_RANK"])
    index = set_rank_device()
    if index is not None and index != local_rank and int(os.environ["WORLD_SIZE"]) > 1:
        # DeepSpeed would bind the group to cuda:LOCAL_RANK (comm/torch.py, device_id)
        dist.init_process_group(backend, device_id=torch.device("cuda", index), timeout=timeout)
    if timeout is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
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
