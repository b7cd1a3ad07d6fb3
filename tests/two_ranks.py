"""One uninterrupted 2-rank training shared by the tests that stop, break and resume training
(tests/launch/test_launcher_stops.py, tests/runs/test_checkpoint_faults.py): each compares its
stopped-and-resumed run with this one, step by step, instead of training its own reference.

The recipe is the tiny model at ZeRO-1 (each rank writes its own optimizer partition) with a
schedule far longer than any run here (``train.max_steps`` 100000): every run follows the same
learning rates whatever step it stops at, and ends by ``train.exit_after_steps``. The reference
trains :data:`REFERENCE_STEPS` steps through ``smelt-ds train --nproc 2`` (the deepspeed launcher).
Every process gets ``OMP_NUM_THREADS=1``: the deepspeed-launcher script's default is 8 and
torchrun's 1, and the order of a step's float sums, so its loss bits, must not depend on the
launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from smelt_ds.testing import scaled_timeout

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 24


def recipe_raw(run_dir: Path, cache: Path) -> dict:
    """The shared recipe: saves every 2 steps, keeps 2, logs every step."""
    return {"name": "two-ranks",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32}, "loop": {"position": "middle"},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "deepspeed": {"zero_stage": 1},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 100_000, "warmup_steps": 2,
                      "log_every": 1, "eval_every": 100_000, "save_every": 2, "keep_last": 2,
                      "run_dir": str(run_dir)},
            "eval": {"eval_batches": 1}}


def write_recipe(path: Path, run_dir: Path, cache: Path) -> Path:
    path.write_text(yaml.safe_dump(recipe_raw(run_dir, cache)))
    return path


def train_env(**extra: str) -> dict[str, str]:
    """The environment of every launch: one thread per rank, no launcher variables of an outer job."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in ("SMELT_LAUNCHER_PID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return {**env, **extra}


def cli_train(recipe: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``smelt-ds train RECIPE --nproc 2 EXTRA...`` to the end (about 15-20 s on 2 cores)."""
    return subprocess.run([sys.executable, "-m", "smelt_ds.cli", "train", str(recipe), "--nproc", "2", *extra],
                          cwd=ROOT, env=train_env(**(env or {})), capture_output=True, text=True,
                          timeout=scaled_timeout(300))


def losses(run_dir: Path) -> dict[int, float]:
    """``metrics.jsonl``'s training loss by optimizer step (rows past a resume's start are dropped
    by the resumed run, so a step appears once)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@dataclass(frozen=True)
class Reference:
    recipe: Path       # the recipe (its run_dir is the reference's; pass --set train.run_dir=... or render --run-dir)
    cache: Path        # the data cache the reference filled (tokenizer and shards: later runs reuse it)
    run_dir: Path
    losses: dict[int, float]


def train_reference(tmp: Path) -> Reference:
    """Train the reference in ``tmp`` (its recipe, data cache and run directory)."""
    recipe = write_recipe(tmp / "recipe.yaml", tmp / "reference", tmp / "cache")
    r = cli_train(recipe, "--set", f"train.exit_after_steps={REFERENCE_STEPS}")
    assert r.returncode == 0, r.stderr[-3000:]
    return load_reference(tmp)


def load_reference(tmp: Path) -> Reference:
    """The reference :func:`train_reference` trained in ``tmp``, read from its files."""
    run_dir = tmp / "reference"
    got = losses(run_dir)
    assert sorted(got) == list(range(1, REFERENCE_STEPS + 1)), sorted(got)
    return Reference(tmp / "recipe.yaml", tmp / "cache", run_dir, got)
