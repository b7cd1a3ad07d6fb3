"""CPU threads per rank: the choice (user's OMP_NUM_THREADS, the cores split over the local ranks,
at least one, one under train.deterministic), which OMP_NUM_THREADS counts as the user's, and a real
``python -m smelt_ds.train`` run with OMP_NUM_THREADS unset that prints and applies the share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.threads import (
    USER_OMP_ENV,
    ThreadChoice,
    apply_threads,
    choose_threads,
    cores_available,
    local_world_size,
    thread_choice,
    user_omp_num_threads,
)
from smelt_ds.testing import scaled_timeout

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cores, ranks, want", [(2, 2, 1), (16, 4, 4), (16, 3, 5), (2, 1, 2), (1, 8, 1), (3, 4, 1)])
def test_unset_splits_the_cores_over_the_local_ranks_at_least_one(cores, ranks, want):
    c = choose_threads(None, cores, ranks)
    assert c.threads == want == max(1, cores // ranks)
    assert "OMP_NUM_THREADS unset" in c.reason and f"{cores} core" in c.reason and f"{ranks} local rank" in c.reason


def test_the_users_value_is_kept_and_deterministic_forces_one():
    assert choose_threads("4", 2, 2) == ThreadChoice(4, "OMP_NUM_THREADS=4")  # more than the share: still the user's
    assert choose_threads("4", 2, 2).describe() == "4 per rank (OMP_NUM_THREADS=4)"
    assert choose_threads(None, 2, 2).describe() == "1 per rank (2 cores / 2 local ranks; OMP_NUM_THREADS unset)"
    assert choose_threads(None, 64, 2, deterministic=True) == ThreadChoice(1, "train.deterministic")
    det = choose_threads("8", 64, 2, deterministic=True)
    assert det.threads == 1 and "OMP_NUM_THREADS=8 not used" in det.reason
    for bad in ("0", "-2", "four", "2.5"):
        with pytest.raises(ConfigError, match=rf"`OMP_NUM_THREADS` \('{bad}'\) must be a whole number of threads >= 1"):
            choose_threads(bad, 2, 1)


def test_which_omp_num_threads_is_the_users():
    assert user_omp_num_threads({}) == (None, "OMP_NUM_THREADS unset")
    assert user_omp_num_threads({"OMP_NUM_THREADS": " "}) == (None, "OMP_NUM_THREADS unset")
    assert user_omp_num_threads({"OMP_NUM_THREADS": "3"}) == ("3", "OMP_NUM_THREADS")
    # the deepspeed launcher (LOCAL_SIZE) passes the environment through: a 1 there is the user's
    assert user_omp_num_threads({"OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2"}) == ("1", "OMP_NUM_THREADS")
    # torchrun sets 1 for nproc_per_node > 1 when unset: not a choice ...
    torchrun = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2"}
    assert user_omp_num_threads(torchrun)[0] is None
    assert "torchrun's default" in user_omp_num_threads(torchrun)[1]
    assert user_omp_num_threads({**torchrun, "OMP_NUM_THREADS": "6"}) == ("6", "OMP_NUM_THREADS")
    # ... unless the explicit variable says so
    assert user_omp_num_threads({**torchrun, USER_OMP_ENV: "1"}) == ("1", USER_OMP_ENV)
    assert local_world_size({}) == 1
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}) == 4
    assert local_world_size({"LOCAL_SIZE": "2"}) == 2 and local_world_size({"LOCAL_SIZE": "x"}) == 1
    cores = cores_available()
    assert thread_choice(env={"LOCAL_SIZE": "2"}).threads == max(1, cores // 2)


def test_apply_sets_torch_and_returns_the_previous_count():
    import torch

    before = torch.get_num_threads()
    try:
        assert apply_threads(ThreadChoice(1, "test")) == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_training_with_omp_num_threads_unset_prints_and_applies_its_share(tmp_path, tmp_path_factory):
    """``python -m smelt_ds.train`` (one process) with OMP_NUM_THREADS unset: the banner's thread
    line gives each rank ``cores // 1`` threads, torch ran with that many (recorded in
    summary.json from ``torch.get_num_threads()``), and each printed step line is the metrics row."""
    from smelt_ds.train.console import step_line

    cache = tmp_path_factory.getbasetemp() / "shared-smelt-cache"  # the data of tests/train/test_console.py
    raw = {"name": "threads",
           "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "max_seq_len": 64},
           "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
           "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
           "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 2, "warmup_steps": 1, "log_every": 1,
                     "eval_every": 2, "save_every": 2, "run_dir": str(tmp_path / "run")},
           "eval": {"eval_batches": 1}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", USER_OMP_ENV, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "smelt_ds.train", str(recipe)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=scaled_timeout(300))
    assert r.returncode == 0, r.stderr[-3000:]
    want = max(1, cores_available())
    line = next(s for s in r.stderr.splitlines() if s.strip().startswith("threads"))
    assert line.split(None, 1)[1] == (f"{want} per rank ({want} core{'s' * (want != 1)} / 1 local rank; "
                                      "OMP_NUM_THREADS unset)")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["threads"]["torch_threads"] == want
    rows = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    printed = [s.rsplit(" | eta", 1)[0] for s in r.stderr.splitlines() if s.startswith("step ")]
    import torch

    assert printed == [step_line(row["step"], 2, row, cuda=torch.cuda.is_available()) for row in rows if "loss" in row]
