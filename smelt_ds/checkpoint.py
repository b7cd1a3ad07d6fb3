"""Checkpoints: DeepSpeed's own save/load plus client state, made crash-safe.

Layout under ``<run_dir>/checkpoints/``::

    step00000050/            DeepSpeed's files (model, optimizer, scheduler state per rank)
    step00000050/client_rank{r}.pt   step, tokens seen, data-loader state and RNG states of rank r
    step00000050/reference/rank{r}.pt   rank r's shard of the fp32 weights in the reference
                             layout (:mod:`smelt_ds.reference_weights`), what ``smelt-ds export``
                             reads for every MoE backend and ZeRO stage
    step00000050/COMPLETE    written by rank 0 after every rank finished: the only mark of a
                             usable checkpoint; JSON with the step, tokens seen and the layout
                             that wrote it (world size, ZeRO stage, MoE backend, expert-parallel
                             size), which a resume must match

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

__all__ = ["checkpoint_dir", "save", "load", "latest_complete", "rng_state", "restore_rng", "MARKER", "run_layout",
           "check_layout"]

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
         keep_last: int, layout: dict[str, Any] | None = None) -> Path:
    """Save a checkpoint on every rank (collective). Returns the checkpoint directory.

    Writes DeepSpeed's files, this rank's client state and its shard of the reference-layout
    weights (:func:`smelt_ds.reference_weights.gather_reference_shard`), then, once every rank is
    done, the ``COMPLETE`` marker. ``layout`` (see :func:`run_layout`) goes into the marker;
    its ``moe_backend`` (default ``reference``) names the backend whose parameters are mapped.
    """
    import torch.distributed as dist

    from smelt_ds.reference_weights import gather_reference_shard, shard_path

    root = checkpoint_dir(run_dir)
    tag = _tag(step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = {"world_size": world, **(layout or {})}
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step, "tokens_seen": tokens_seen})
    client = {"step": step, "tokens_seen": tokens_seen, "loader": loader_state, "rng": rng_state()}
    _atomic_torch_save(client, root / tag / f"client_rank{rank}.pt")
    shard = gather_reference_shard(engine, layout.get("moe_backend", "reference"))
    shard_path(root / tag, rank).parent.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(shard, shard_path(root / tag, rank))
    del shard
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        marker = root / tag / MARKER
        tmp = marker.with_name(MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "tokens_seen": tokens_seen, **layout}))
        os.replace(tmp, marker)
        _prune(root, keep_last)
    if dist.is_initialized():
        dist.barrier()
    return root / tag


def run_layout(cfg, world_size: int) -> dict[str, Any]:
    """What a checkpoint's files depend on besides the model: ``world_size`` (ranks),
    ``zero_stage`` (as DeepSpeed sees it), ``moe_backend`` and ``ep_size`` (expert-parallel
    size; 1 for the reference backend). Stored in the ``COMPLETE`` marker."""
    zero = (cfg.deepspeed.config.get("zero_optimization") or {}).get("stage", cfg.deepspeed.zero_stage)
    return {"world_size": world_size, "zero_stage": int(zero), "moe_backend": cfg.moe.backend,
            "ep_size": cfg.moe.ep_size if cfg.moe.backend != "reference" else 1}


_LAYOUT_WORDS = {"world_size": "ranks (data-parallel x expert-parallel)", "zero_stage": "ZeRO stage",
                 "moe_backend": "moe.backend", "ep_size": "moe.ep_size (expert-parallel size)"}


def check_layout(path: str | Path, layout: dict[str, Any]) -> None:
    """Refuse to resume checkpoint ``path`` with another layout than the one that wrote it.

    DeepSpeed's checkpoints hold per-rank optimizer partitions and per-expert-parallel-rank
    experts; loading them into another number of ranks, ZeRO stage, backend or expert-parallel
    size either fails deep inside DeepSpeed or, worse, loads the wrong partition. Raises
    ConfigError naming each difference and the supported path (``smelt-ds export`` then
    ``train.init_from``, which starts a new run from the weights at any scale). Fields an older
    marker lacks are not compared."""
    meta = json.loads((Path(path) / MARKER).read_text())
    diffs = [f"{_LAYOUT_WORDS[k]} {meta[k]!r} in the checkpoint vs {v!r} now" for k, v in layout.items()
             if k in meta and k in _LAYOUT_WORDS and meta[k] != v]
    if diffs:
        raise ConfigError(f"checkpoint {path} was written with another layout ({'; '.join(diffs)}): resume it with "
                          "the same layout, or continue at the new scale from its weights (the optimizer state "
                          f"starts fresh): `smelt-ds export {Path(path).parent.parent} -o EXPORT_DIR`, then "
                          "train with --set train.init_from=EXPORT_DIR in a new --run-dir")


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


def load(engine, run_dir: str | Path, resume: str, layout: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load a checkpoint into ``engine`` and return this rank's client state.

    ``resume``: ``auto`` (newest complete checkpoint of ``run_dir``; None when there is none) or a
    checkpoint directory. Raises ConfigError for a directory that is not a complete checkpoint,
    or one written with another layout (:func:`check_layout` with ``layout``, or at least by a
    different number of ranks).
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
    check_layout(path, layout or {"world_size": dist.get_world_size() if dist.is_initialized() else 1})
    client_file = path / f"client_rank{rank}.pt"
    if not client_file.is_file():
        meta = json.loads((path / MARKER).read_text())
        raise ConfigError(f"checkpoint {path} has no state for rank {rank}: it was written by "
                          f"{meta.get('world_size')} rank(s); resume with that many ranks")
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if load_path is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}: is it complete and from this recipe?")
    return torch.load(client_file, weights_only=False)
