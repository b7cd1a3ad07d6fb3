"""CPU threads per rank: torch's intra-op thread count chosen from the cores and the local ranks.

By default every process's torch (OpenMP/MKL) uses one thread per core of the machine, so N ranks
on one host run N x cores threads and oversubscribe the cores (measured on 2 shared cores: a tiny
step takes 0.25 s alone, 26-40 s when several processes share them, 1-2.5 s with one thread per
process). :func:`choose_threads` gives each rank its share instead:

* ``train.deterministic``: 1 thread (a fixed reduction order; see :mod:`smelt_ds.train.loop`);
* the user's ``OMP_NUM_THREADS``: kept as it is;
* otherwise ``max(1, cores_available // local_world_size)``, where ``cores_available`` is the
  size of this process's CPU affinity mask (``os.sched_getaffinity``; else ``os.cpu_count()``)
  and ``local_world_size`` the number of ranks on this host.

Which ``OMP_NUM_THREADS`` is the user's (:func:`user_omp_num_threads`): the deepspeed launcher
(``deepspeed``, ``smelt-ds train --nproc N``) passes the environment through unchanged; it sets
``OMP_NUM_THREADS`` itself only with ``--bind_cores_to_rank``, to the number of cores it binds each
rank to with numactl, which is that rank's share and is kept like a user's value. torchrun sets
``OMP_NUM_THREADS=1`` for every rank when it is unset and ``--nproc_per_node`` > 1 (with a
warning), so under torchrun (``TORCHELASTIC_RUN_ID`` set) with several local ranks the value ``1``
is taken as torchrun's default and replaced by the share; a user who wants exactly one thread there
sets :data:`USER_OMP_ENV` (``SMELT_DS_USER_OMP_NUM_THREADS=1``), which always wins over
``OMP_NUM_THREADS``.

Local ranks: ``LOCAL_WORLD_SIZE`` (torchrun, :func:`smelt_ds.testing.run_distributed`), else
``LOCAL_SIZE`` (the deepspeed launcher), else ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI), else
``MV2_COMM_WORLD_LOCAL_SIZE`` (MVAPICH2), else ``MPI_LOCALNRANKS`` (MPICH Hydra, Intel MPI), else 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from smelt_ds.errors import ConfigError

__all__ = ["LOCAL_SIZE_ENVS", "USER_OMP_ENV", "ThreadChoice", "choose_threads", "user_omp_num_threads",
           "cores_available", "local_world_size", "thread_choice", "apply_threads"]

#: an explicit per-rank thread count that wins over ``OMP_NUM_THREADS`` (for launchers that inject it)
USER_OMP_ENV = "SMELT_DS_USER_OMP_NUM_THREADS"

#: the launchers' variables for the ranks on this host, first set wins (see the module docstring)
LOCAL_SIZE_ENVS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class ThreadChoice:
    """torch intra-op threads of one rank and why (``reason`` names the source of the number)."""

    threads: int
    reason: str

    def describe(self) -> str:
        """``"1 per rank (2 cores / 2 local ranks; OMP_NUM_THREADS unset)"``: the banner's text."""
        return f"{self.threads} per rank ({self.reason})"


def _positive_int(value: str, where: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"`{where}` ({value!r}) must be a whole number of threads >= 1: set it to e.g. 1 or 4, "
                          f"or unset it to let training give each rank its share of the cores")
    return n


def choose_threads(user_value: str | None, cores: int, local_ranks: int, deterministic: bool = False,
                   source: str = "OMP_NUM_THREADS", unset: str = "OMP_NUM_THREADS unset") -> ThreadChoice:
    """Intra-op threads per rank (pure; see the module docstring for the rules).

    Args:
        user_value: the user's thread count as set in the environment (a string), or None when unset
            (or only a launcher's default, see :func:`user_omp_num_threads`).
        cores: CPU cores this process may run on (>= 1).
        local_ranks: ranks on this host (>= 1).
        deterministic: ``train.deterministic``: one thread, whatever else is set.
        source: the name of the variable ``user_value`` came from (for the reason and errors).
        unset: what the reason says when ``user_value`` is None.

    Raises ConfigError when ``user_value`` is not a whole number >= 1.
    """
    if deterministic:
        over = f"; {source}={user_value} not used" if user_value is not None else ""
        return ThreadChoice(1, f"train.deterministic{over}")
    if user_value is not None:
        return ThreadChoice(_positive_int(user_value, source), f"{source}={user_value.strip()}")
    cores, local_ranks = max(1, cores), max(1, local_ranks)
    share = max(1, cores // local_ranks)
    return ThreadChoice(share, f"{cores} core{'s' * (cores != 1)} / "
                               f"{local_ranks} local rank{'s' * (local_ranks != 1)}; {unset}")


def user_omp_num_threads(env: Mapping[str, str]) -> tuple[str | None, str]:
    """``(value, where)``: the thread count the user set and the variable it came from, or
    ``(None, why none)`` (``"OMP_NUM_THREADS unset"``, or torchrun's default).

    :data:`USER_OMP_ENV` wins; else ``OMP_NUM_THREADS`` unless it is torchrun's injected default
    (``1`` under torchrun with several local ranks); an empty value counts as unset."""
    explicit = env.get(USER_OMP_ENV, "").strip()
    if explicit:
        return explicit, USER_OMP_ENV
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None, "OMP_NUM_THREADS unset"
    if "TORCHELASTIC_RUN_ID" in env and value == "1" and local_world_size(env) > 1:
        return None, "OMP_NUM_THREADS=1 is torchrun's default, not used"
    return value, "OMP_NUM_THREADS"


def cores_available() -> int:
    """CPU cores this process may run on: its affinity mask (``os.sched_getaffinity``, which a
    cgroup cpuset, ``taskset`` or numactl restricts), else ``os.cpu_count()``, else 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def local_world_size(env: Mapping[str, str]) -> int:
    """Ranks on this host from the launcher's environment (see the module docstring), else 1."""
    for name in LOCAL_SIZE_ENVS:
        raw = env.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def thread_choice(deterministic: bool = False, env: Mapping[str, str] | None = None) -> ThreadChoice:
    """:func:`choose_threads` for this process (``env`` defaults to ``os.environ``). Raises
    ConfigError for a thread count that is not a whole number >= 1."""
    env = os.environ if env is None else env
    value, where = user_omp_num_threads(env)
    if value is None:
        return choose_threads(None, cores_available(), local_world_size(env), deterministic, unset=where)
    return choose_threads(value, cores_available(), local_world_size(env), deterministic, source=where)


def apply_threads(choice: ThreadChoice) -> int:
    """``torch.set_num_threads(choice.threads)``; returns the previous intra-op thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(choice.threads)
    return before
