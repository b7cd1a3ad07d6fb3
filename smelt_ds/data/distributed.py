"""One process prepares, the others wait: rank discovery and the completion-marker protocol.

The preparing rank is global rank 0 (``shared_filesystem: true``) or local rank 0 of each node.
Ranks come from ``torch.distributed`` when it is initialised, else from the launcher's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), else a single process (rank 0).

The preparing rank builds the output in a temporary sibling directory and renames it into place
(:func:`smelt_ds.data.cache.build_dir_atomically`); the others poll for the ``_COMPLETE`` marker.
If preparation fails, the preparing rank writes ``<out>.failed`` with the error, and the waiting
ranks raise it instead of waiting until the timeout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.data.cache import build_dir_atomically, is_complete
from smelt_ds.errors import ConfigError

__all__ = ["RankInfo", "rank_info", "is_preparing_rank", "run_once"]

_POLL_S = 0.2
_STALE_SLACK_S = 2.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int


def rank_info() -> RankInfo:
    """This process's global rank, local rank and world size (torch.distributed, else env, else 0/0/1)."""
    dist = sys.modules.get("torch.distributed")  # not imported = not initialised; importing costs seconds
    if dist is not None and dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return RankInfo(dist.get_rank(), local, dist.get_world_size())
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    local = int(os.environ.get("LOCAL_RANK", rank))
    return RankInfo(rank, local, int(os.environ.get("WORLD_SIZE", 1)))


def is_preparing_rank(shared_filesystem: bool = True) -> bool:
    """Global rank 0 with a shared file system, else local rank 0 of each node."""
    info = rank_info()
    return (info.rank if shared_filesystem else info.local_rank) == 0


def _failed_marker(out: Path) -> Path:
    return out.parent / f"{out.name}.failed"


def _build(out: Path, build: Callable[[Path], None]) -> bool:
    marker = _failed_marker(out)
    marker.unlink(missing_ok=True)
    try:
        return build_dir_atomically(out, build)
    except BaseException as e:
        out.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{type(e).__name__}: {e}\n")
        raise


def _wait(out: Path, timeout_s: float, rank: int) -> None:
    start, marker = time.time(), _failed_marker(out)
    print(f"smelt-ds data: rank {rank} waits for the preparing rank to finish {out}", file=sys.stderr)
    while not is_complete(out):
        if marker.is_file() and marker.stat().st_mtime >= start - _STALE_SLACK_S:
            raise ConfigError(f"data preparation of {str(out)!r} failed on the preparing rank: "
                              f"{marker.read_text().strip()}: fix that error (see the preparing rank's log)")
        if time.time() - start > timeout_s:
            raise ConfigError(f"rank {rank} waited {timeout_s:.0f} s for {str(out)!r} to be prepared: raise "
                              "data.prepare_timeout_s, check that rank 0 runs, or prepare the data "
                              "beforehand with `smelt-ds data prepare`")
        time.sleep(_POLL_S)


def run_once(out: str | Path, build: Callable[[Path], None], *, shared_filesystem: bool = True,
             timeout_s: float = 7200.0) -> bool:
    """Make sure ``out`` is complete, building it with ``build(tmp_dir)`` on the preparing rank only.

    Returns True when this process built it. Other ranks wait (polling every 0.2 s) for the
    completion marker; raises ConfigError if the preparing rank failed or after ``timeout_s`` s.
    """
    out = Path(out)
    if is_complete(out):
        return False
    if is_preparing_rank(shared_filesystem):
        return _build(out, build)
    _wait(out, timeout_s, rank_info().rank)
    return False
