"""Run directories with checkpoints written straight from a model's state dict (no training, no
DeepSpeed): what export, eval and generate read of a one-rank, ZeRO-0, reference-backend run
(``mp_rank_00_model_states.pt`` and a ``COMPLETE`` marker with its digest)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_checkpoint(run_dir: Path, cfg, step: int, state: dict[str, torch.Tensor]) -> Path:
    """Write ``run_dir/checkpoints/stepNNNNNNNN`` holding ``state`` (and ``run_dir/config.yaml`` of
    the RunConfig ``cfg`` the first time); returns the checkpoint directory."""
    from smelt_ds.config.loading import dump_config
    from smelt_ds.runs import checkpoint as ckpt

    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").is_file():
        dump_config(cfg, run_dir / "config.yaml")
    path = ckpt.checkpoint_dir(run_dir) / f"step{step:08d}"
    path.mkdir(parents=True)
    torch.save({"module": state}, path / "mp_rank_00_model_states.pt")
    files = {"mp_rank_00_model_states.pt": {**ckpt.file_digest(path / "mp_rank_00_model_states.pt"), "rank": 0}}
    (path / ckpt.MARKER).write_text(json.dumps({"step": step, "tokens_seen": 0, "world_size": 1, "zero_stage": 0,
                                                "moe_backend": "reference", "ep_size": 1, "files": files}))
    return path


def fake_run(run_dir: Path, cfg, steps: tuple[int, ...] = (2, 4)) -> dict[int, dict[str, torch.Tensor]]:
    """A run directory with one checkpoint per step, each of a randomly initialised model of
    ``cfg`` (seed = the step); returns ``{step: state dict}``."""
    from smelt_ds.model import SmeltLM

    states = {}
    for step in steps:
        torch.manual_seed(step)
        states[step] = SmeltLM(cfg.model, cfg.moe, cfg.loop).state_dict()
        write_checkpoint(run_dir, cfg, step, states[step])
    return states
