"""Helpers of the evaluation tests: tiny recipes on a test cache, exports built straight from a
SmeltLM state dict, a training worker for ``run_distributed``, PNG checks."""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import torch

VOCAB = 512


def tiny_raw(cache: Path, run_dir: Path | None = None, **sections) -> dict:
    """A 4-layer (middle loop: 6 visits) 32-wide MoE recipe on the built-in corpus (150 kB per
    domain, 512-token tokenizer) cached in ``cache``."""
    raw = {"name": "tiny-smelt",
           "model": {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "max_seq_len": 64},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
           "loop": {"position": "middle"},
           "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": VOCAB}, "cache_dir": str(cache)},
           "train": {"seq_len": 32, "micro_batch_size": 4, "max_steps": 20, "warmup_steps": 2, "log_every": 10,
                     "eval_every": 20, "save_every": 20, "lr": 1e-2,
                     "run_dir": str(run_dir or cache / "run")},
           "eval": {"eval_batches": 2}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return copy.deepcopy(raw)


def baseline_raw(cache: Path, **sections) -> dict:
    """The unlooped counterpart: 6 unique layers (6 visits), as the tiny recipes pair them."""
    raw = tiny_raw(cache, **sections)
    raw["name"] = "tiny-baseline"
    raw["model"]["num_layers"] = 6
    raw["loop"] = {"position": "none"}
    return raw


def export_model(model, cfg, out: Path) -> Path:
    """Write ``model.pt`` + ``config.yaml`` (of the RunConfig ``cfg`` the model was built from) like
    ``smelt-ds export`` (no training, no DeepSpeed)."""
    from smelt_ds.config.loading import dump_config

    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "model.pt")
    dump_config(cfg, out / "config.yaml")
    return out


def train_worker(rank: int, world: int, raw: dict) -> str:
    from smelt_ds.config.loading import config_from_dict
    from smelt_ds.train.loop import train

    return str(train(config_from_dict(raw)).run_dir)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG header."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def png_not_blank(path: Path) -> bool:
    """Whether the image holds more than one colour (something was drawn)."""
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    return float(img[..., :3].std()) > 0.01
