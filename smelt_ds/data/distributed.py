"""One process prepares, the others wait: rank discovery and the completion-marker protocol.

The preparing rank is global rank 0 (``shared_filesystem: true``) or local rank 0 of each node.
Ranks come from ``torch.distributed`` when it is initialised, else from the launcher's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), else a single process (rank 0). The rank
on its host is ``LOCAL_RANK`` (torchrun and the deepspeed launcher set it; a training exports it
before making its process group, :func:`smelt_ds.parallel.distributed.init_distributed`, from an
MPI launcher's variables too), or the global rank when every rank runs on this host
(``WORLD_SIZE`` 1, or ``LOCAL_WORLD_SIZE`` equal to it). Otherwise it cannot be told from the
global rank (rank 8 of 16 is local rank 0 under a block placement, local rank 4 under Slurm's
cyclic one), and :func:`is_preparing_rank` with ``shared_filesystem: false`` raises ConfigError
rather than leave a host with no preparing rank and its ranks waiting until the timeout.

The preparing rank builds the output in a temporary sibling directory and renames it into place
(:func:`smelt_ds.data.cache.build_dir_atomically`); the others poll for the ``_COMPLETE`` marker.
If preparation fails, the preparing rank writes ``<out>.failed`` (JSON: the error, a random
nonce, its host, pid and rank) and the waiting ranks raise its error instead of waiting until the
timeout.

A marker may be an earlier attempt's: the preparing rank removes it when it starts, and a waiting
rank may look before that. Whether a marker is this attempt's is decided without clocks (the
file's time on a shared file system comes from another host's clock, or the file server's):

* with a process group (every training): the preparing rank registers the marker's nonce in the
  group's key-value store (torch.distributed's default store: the rendezvous ``TCPStore`` that
  every rank of this launch shares, new for each launch and per torchrun restart) before it writes
  the marker; a waiting rank raises the marker's error only when that nonce is registered (a
  non-blocking ``check``, no collective: a rank that finds the data complete takes no part). An id
  from the launch environment would not do: the rendered deepspeed job uses one port for every
  run, a requeued Slurm job keeps its job id. When the store no longer answers (it lived in rank
  0, which has exited), the rule below applies;
* without one (ranks known from the environment only): a waiting rank notes the marker there when
  it starts waiting and raises on a marker with another nonce, which the preparing rank wrote
  since. A failure that came before the waiting rank started is then not seen: that rank waits
  until the timeout, or until its launcher ends it (launchers end the other ranks when one fails).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smelt_ds.data.cache import build_dir_atomically, is_complete
from smelt_ds.errors import ConfigError
from smelt_ds.files import write_json_atomic

__all__ = ["RankInfo", "rank_info", "is_preparing_rank", "run_once"]

_POLL_S = 0.2
#: the store key under which the preparing rank registers a failure marker's nonce
_STORE_KEY = "smelt-ds/data-prepare-failed/{nonce}"


@dataclass(frozen=True)
class RankInfo:
    """This process's global rank, its rank on its host (None when it cannot be told, see the
    module's docstring) and the world size (ranks)."""

    rank: int
    local_rank: int | None
    world_size: int


def _local_rank(rank: int, world: int, env: Mapping[str, str]) -> int | None:
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    if world == 1 or env.get("LOCAL_WORLD_SIZE", "").strip() == str(world):
        return rank
    return None


def _initialised_dist() -> Any:
    """``torch.distributed`` when a process group is initialised, else None (without importing
    torch: not imported means not initialised, and importing it costs seconds)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank_info() -> RankInfo:
    """This process's global rank, local rank and world size (torch.distributed, else env, else 0/0/1)."""
    dist = _initialised_dist()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
        world = int(os.environ.get("WORLD_SIZE", 1))
    return RankInfo(rank, _local_rank(rank, world, os.environ), world)


def is_preparing_rank(shared_filesystem: bool = True) -> bool:
    """Global rank 0 with a shared file system, else local rank 0 of each node. Raises
    ConfigError naming ``LOCAL_RANK`` when ``shared_filesystem`` is false and the local rank
    cannot be told (see the module's docstring)."""
    info = rank_info()
    if shared_filesystem:
        return info.rank == 0
    if info.local_rank is None:
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        raise ConfigError(f"`LOCAL_RANK` is not set for rank {info.rank} of a world of {info.world_size} ranks "
                          f"spread over several hosts (LOCAL_WORLD_SIZE {lws if lws is not None else 'unset'}): with "
                          "`data.shared_filesystem: false` local rank 0 of each host prepares the data, and which rank "
                          "that is cannot be told from the global rank: start the ranks with torchrun or the deepspeed "
                          "launcher (they set it), export LOCAL_RANK (the rank's index on its host, e.g. "
                          "$SLURM_LOCALID), or set data.shared_filesystem: true")
    return info.local_rank == 0


def _failed_marker(out: Path) -> Path:
    return out.parent / f"{out.name}.failed"


def _group_store() -> Any:
    """The key-value store every rank of this launch shares (None without a process group of
    several ranks)."""
    dist = _initialised_dist()
    if dist is None or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def _read_marker(marker: Path) -> dict[str, Any] | None:
    """The failure marker's record; None when there is none, or it is not one this version wrote."""
    try:
        raw = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and isinstance(raw.get("nonce"), str) else None


def _build(out: Path, build: Callable[[Path], None]) -> bool:
    marker = _failed_marker(out)
    marker.unlink(missing_ok=True)
    try:
        return build_dir_atomically(out, build)
    except BaseException as e:
        nonce = uuid.uuid4().hex
        store = _group_store()
        if store is not None:
            try:  # registered before the marker exists: a waiting rank never sees it unregistered
                store.set(_STORE_KEY.format(nonce=nonce), str(out))
            except Exception:  # noqa: BLE001 (the store is gone: the launch is ending)
                pass
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(marker, {"nonce": nonce, "error": f"{type(e).__name__}: {e}", "host": socket.gethostname(),
                                   "pid": os.getpid(), "rank": rank_info().rank})
        raise


def _this_attempt(found: dict[str, Any], before: dict[str, Any] | None, store: Any) -> bool:
    """Whether the failure marker ``found`` was written by this attempt's preparing rank (see the
    module's docstring): its nonce registered in ``store``, or, without one (or when the store no
    longer answers: its host, rank 0, has exited), another nonce than the marker's ``before`` the
    wait began."""
    if store is not None:
        try:
            return bool(store.check([_STORE_KEY.format(nonce=found["nonce"])]))
        except Exception:  # noqa: BLE001 (any store error: DistStoreError, a reset connection)
            pass
    return before is None or found["nonce"] != before["nonce"]


def _wait(out: Path, timeout_s: float, rank: int) -> None:
    start, marker, store = time.monotonic(), _failed_marker(out), _group_store()
    before = _read_marker(marker)
    print(f"smelt-ds data: rank {rank} waits for the preparing rank to finish {out}", file=sys.stderr)
    while not is_complete(out):
        found = _read_marker(marker)
        if found is not None and _this_attempt(found, before, store):
            raise ConfigError(f"data preparation of {str(out)!r} failed on the preparing rank (rank "
                              f"{found.get('rank')} on {found.get('host')}): {str(found.get('error', '')).strip()}: "
                              "fix that error (see the preparing rank's log)")
        if time.monotonic() - start > timeout_s:
            raise ConfigError(f"rank {rank} waited {timeout_s:.0f} s for {str(out)!r} to be prepared: raise "
                              "data.prepare_timeout_s, check that rank 0 runs, or prepare the data "
                              "beforehand with `smelt-ds data prepare`")
        time.sleep(_POLL_S)


def run_once(out: str | Path, build: Callable[[Path], None], *, shared_filesystem: bool = True,
             timeout_s: float = 7200.0) -> bool:
    """Make sure ``out`` is complete, building it with ``build(tmp_dir)`` on the preparing rank only.

    Returns True when this process built it. Other ranks wait (polling every 0.2 s) for the
    completion marker; raises ConfigError if the preparing rank failed in this attempt (see the
    module's docstring), after ``timeout_s`` s, or when the preparing rank cannot be told
    (:func:`is_preparing_rank`).
    """
    out = Path(out)
    if is_complete(out):
        return False
    if is_preparing_rank(shared_filesystem):
        return _build(out, build)
    _wait(out, timeout_s, rank_info().rank)
    return False
