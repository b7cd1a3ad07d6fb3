"""Checkpoints: DeepSpeed's own save/load plus client state, made crash-safe.

Layout under ``<run_dir>/checkpoints/``::

    step00000050/            DeepSpeed's files (model, optimizer, scheduler state per rank)
    step00000050/client_rank{r}.pt   step, tokens seen, data-loader state and RNG states of rank r
    step00000050/COMPLETE    written by rank 0 after every rank finished: the only mark of a
                             usable checkpoint

A run killed during a save (SIGKILL, node loss) leaves a directory without ``COMPLETE``, which
``--resume auto`` ignores: it continues from the newest complete checkpoint. Only the newest
``keep_last`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from smelt_ds.errors import ConfigError

__all__ = ["checkpoint_dir", "save", "load", "latest_complete", "rng_state", "restore_rng", "MARKER"]

MARKER = "COMPLETE"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch CPU and (when present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(engine, run_dir: str | Path, step: int, tokens_seen: int, loader_state: dict[str, Any],
         keep_last: int) -> Path:
    """Save a checkpoint on every rank (collective). Returns the checkpoint directory."""
    import torch.distributed as dist

    root = checkpoint_dir(run_dir)
    tag = _tag(step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step, "tokens_seen": tokens_seen})
    client = {"step": step, "tokens_seen": tokens_seen, "loader": loader_state, "rng": rng_state()}
    _atomic_torch_save(client, root / tag / f"client_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        marker = root / tag / MARKER
        tmp = marker.with_name(MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "tokens_seen": tokens_seen,
                                   "world_size": dist.get_world_size() if dist.is_initialized() else 1}))
        os.replace(tmp, marker)
        _prune(root, keep_last)
    if dist.is_initialized():
        dist.barrier()
    return root / tag


def _complete_tags(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step*") if (p / MARKER).is_file()), key=lambda p: p.name)


def _prune(root: Path, keep_last: int) -> None:
    complete = _complete_tags(root)
    keep = set(complete[-keep_last:])
    newest = complete[-1].name if complete else ""
    for p in root.glob("step*"):
        if p in keep:
            continue
        if (p / MARKER).is_file() or p.name < newest:  # old complete, or an abandoned partial save
            shutil.rmtree(p, ignore_errors=True)
    latest = root / "latest"  # DeepSpeed's pointer; keep it on a complete tag
    if complete:
        latest.write_text(complete[-1].name)


def latest_complete(run_dir: str | Path) -> Path | None:
    """Newest checkpoint directory carrying the COMPLETE marker, or None."""
    tags = _complete_tags(checkpoint_dir(run_dir))
    return tags[-1] if tags else None


def load(engine, run_dir: str | Path, resume: str) -> dict[str, Any] | None:
    """Load a checkpoint into ``engine`` and return this rank's client state.

    ``resume``: ``auto`` (newest complete checkpoint of ``run_dir``; None when there is none) or a
    checkpoint directory. Raises ConfigError for a directory that is not a complete checkpoint
    or that was written by a different number of ranks.
    """
    import torch.distributed as dist

    if resume == "auto":
        path = latest_complete(run_dir)
        if path is None:
            return None
    else:
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise ConfigError(f"--resume {resume!r} is not a complete checkpoint (no {MARKER} marker): pass "
                              "a checkpoints/stepNNNNNNNN directory written to the end, or --resume auto")
    rank = dist.get_rank() if dist.is_initialized() else 0
    client_file = path / f"client_rank{rank}.pt"
    if not client_file.is_file():
        meta = json.loads((path / MARKER).read_text())
        raise ConfigError(f"checkpoint {path} has no state for rank {rank}: it was written by "
                          f"{meta.get('world_size')} rank(s); resume with that many ranks")
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}: is it complete and from this recipe?")
    return torch.load(client_file, weights_only=False)
