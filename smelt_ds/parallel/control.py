"""Control collectives: the one home of every collective on host values (stop, step guard,
metric means, validation sums, object exchanges, barriers).

NCCL serves CUDA tensors only: a process group made with ``backend="nccl"`` maps ``cuda`` to
NCCL and nothing to ``cpu``, so an all-reduce of a CPU tensor on it raises "No backend type
associated with device type cpu", and object collectives and barriers move their data to the GPU
(a host sync each). Control values therefore travel on a group with a CPU backend:

* the default group itself when it has one (``gloo``, as CPU runs use, or a mixed
  ``cpu:gloo,cuda:nccl`` group);
* otherwise a gloo group over every rank (``new_group(backend="gloo")``, as Megatron-LM keeps
  gloo twins of its NCCL groups for host-side work), made once by :func:`init_control_group`
  (collective: every rank, in the same order as their other ``new_group`` calls) right after
  ``init_process_group``.

Per training step the control values travel in one all-reduce (:func:`all_reduce_sum` of one
float64 vector, ``smelt_ds.train.loop``). Gloo needs a reachable interface on multi-NIC hosts:
``GLOO_SOCKET_IFNAME`` (the rendered jobs pass it on when set). The group's timeout follows the
default group's (:func:`smelt_ds.train.watchdog.set_collective_timeout` sets every group's).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

__all__ = ["active", "init_control_group", "control_group", "serves_cpu", "all_reduce_sum",
           "all_reduce_max", "gather_objects", "broadcast_object", "barrier", "reset", "timeout_of", "all_groups"]

_GROUP: Any = None  # the control group when it is not the default one
_FOR: Any = None  # the default group _GROUP was made for (a new init_process_group makes a new one)


def active() -> bool:
    """Whether several ranks share a process group (collectives do something)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def serves_cpu(group=None) -> bool:
    """Whether ``group`` (default: the default group) has a backend for CPU tensors."""
    import torch.distributed as dist

    g = group if group is not None else dist.distributed_c10d._get_default_group()
    return torch.device("cpu") in g._device_types


def init_control_group(timeout: timedelta | None = None) -> None:
    """Make the control group now if the default group has no CPU backend (collective on every
    rank; nothing to do on one rank or when the default group serves CPU tensors). ``timeout``:
    its collective timeout (default: the default group's, else gloo's default)."""
    control_group(timeout)


def control_group(timeout: timedelta | None = None):
    """The group control collectives use: None (the default group) when it serves CPU tensors,
    else the gloo group over every rank (made on the first call: collective)."""
    global _GROUP, _FOR
    import torch.distributed as dist

    if not active() or serves_cpu():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _GROUP is None or _FOR is not default:
        _GROUP, _FOR = dist.new_group(backend="gloo", timeout=timeout or timeout_of(default)), default
    return _GROUP


def timeout_of(group) -> timedelta:
    """The collective timeout of ``group``'s backends (the longest, when they differ)."""
    backends = [group._get_backend(d) for d in group._device_types]
    return max(b.options._timeout for b in backends)


def all_groups() -> list:
    """Every process group of this process: the default group, DeepSpeed's data-parallel, expert
    and expert-data groups, ours (``torch.distributed``'s registry of groups this rank belongs to)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    return list(dist.distributed_c10d._world.pg_map)


def reset() -> None:
    """Forget the control group (after ``destroy_process_group``, which destroys it too)."""
    global _GROUP, _FOR
    _GROUP, _FOR = None, None


def _reduce(values: Sequence[float] | torch.Tensor, op) -> torch.Tensor:
    import torch.distributed as dist

    if isinstance(values, torch.Tensor):
        t = values.detach().to(torch.float64, copy=True)  # all_reduce works in place: not the caller's
        if t.device.type != "cpu":
            t = t.to("cpu")  # the one device read (a sync on a GPU)
    else:
        t = torch.tensor(list(values), dtype=torch.float64, device="cpu")
    if active():
        dist.all_reduce(t, op=op, group=control_group())
    return t


def all_reduce_sum(values: Sequence[float] | torch.Tensor) -> list[float]:
    """The element-wise sum over every rank of ``values`` (a vector of host floats, or a tensor
    on any device, read back once), in float64 on the host. Collective; one all-reduce."""
    import torch.distributed as dist

    return _reduce(values, dist.ReduceOp.SUM).tolist()


def all_reduce_max(values: Sequence[float] | torch.Tensor) -> list[float]:
    """The element-wise maximum over every rank of ``values`` (as :func:`all_reduce_sum`)."""
    import torch.distributed as dist

    return _reduce(values, dist.ReduceOp.MAX).tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by rank; ``[obj]`` on one rank. Collective."""
    import torch.distributed as dist

    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=control_group())
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Global rank ``src``'s ``obj`` on every rank (picklable). Collective."""
    import torch.distributed as dist

    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here. Collective; nothing on one rank."""
    import torch.distributed as dist

    if active():
        dist.barrier(group=control_group())
