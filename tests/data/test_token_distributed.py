"""A Megatron source on 2 real ranks (gloo): rank 0 prepares it once while rank 1 waits; the ranks
read disjoint windows whose union, step by step, is the 1-rank stream with a twice larger
micro-batch. Then the .bin changes with its size and modification time kept: `data prepare` on
both ranks prepares it again on rank 0 only, rank 1 waits and opens the new preparation."""

from __future__ import annotations

import numpy as np
import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.testing import run_distributed
from tests.data.token_test_utils import random_documents, word_tokenizer, write_megatron

pytestmark = pytest.mark.distributed
S, B = 16, 2


def _windows(batches: list[dict]) -> list:
    return [np.concatenate([b["input_ids"], b["labels"][:, -1:]], axis=1).tolist() for b in batches]


def _rank_stream(rank: int, world_size: int, cfg_json: str, bin_path: str) -> dict:
    """Runs in a spawned gloo process: prepare (rank 0) or wait (rank 1), then one epoch of batches
    (rank 0 also the 1-rank reference); then the .bin changes in place and both prepare again."""
    import os
    import time

    import torch.distributed as dist

    from smelt_ds.data.cache import sha256_sample
    from smelt_ds.data.loader import TrainLoader
    from smelt_ds.data.prepare import prepare_from_config

    cfg = DataConfig.model_validate_json(cfg_json)
    prepared = prepare_from_config(cfg)
    loader = TrainLoader(prepared, S, B, seed=4)  # rank and world size from torch.distributed
    batches = [next(loader) for _ in range(loader.steps_per_epoch)]
    out = {"created": prepared.created, "root": str(prepared.root), "rank": loader.dp_rank,
           "ids": [b["sample_ids"].tolist() for b in batches], "windows": _windows(batches)}
    dist.barrier()  # both opened the first preparation
    if rank == 0:
        one = TrainLoader(prepared, S, 2 * B, seed=4, dp_rank=0, dp_world_size=1)
        ref = [next(one) for _ in range(one.steps_per_epoch)]
        out.update(one_ids=[b["sample_ids"].tolist() for b in ref], one_windows=_windows(ref))
        kept = os.stat(bin_path)
        ids = np.fromfile(bin_path, dtype=np.uint16)
        ids[0] ^= 1
        ids.tofile(bin_path)
        os.utime(bin_path, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # touch -r
    dist.barrier()
    if rank == 0:  # rank 1 opens the old preparation first (milliseconds), finds the change, waits for rank 0
        time.sleep(1.0)
    again = prepare_from_config(cfg, reprepare_changed=True)  # what `smelt-ds data prepare` runs
    out.update(again_created=again.created, again_root=str(again.root),
               again_sha=again.meta["token_files"][0]["sample_sha256"], file_sha=sha256_sample(bin_path))
    dist.barrier()
    return out


def test_two_ranks_read_disjoint_windows_that_make_the_one_rank_stream(tmp_path):
    tok = word_tokenizer(tmp_path / "tok.json", 1000)
    write_megatron(tmp_path / "m", random_documents(150, 1000, seed=21), np.uint16)
    cfg = DataConfig(sources=[{"megatron": str(tmp_path / "m")}], tokenizer={"path": str(tok)},
                     validation_share=0.1, cache_dir=str(tmp_path / "cache"))
    r0, r1 = run_distributed(_rank_stream, world_size=2, args=(cfg.model_dump_json(), str(tmp_path / "m.bin")),
                             init_deepspeed=False, timeout=180)
    assert (r0["rank"], r1["rank"]) == (0, 1) and (r0["created"], r1["created"]) == (True, False)
    assert r0["root"] == r1["root"]
    assert len(r0["one_ids"]) == len(r0["ids"]) == len(r1["ids"])
    seen: set[int] = set()
    for t, (ids, whole) in enumerate(zip(r0["one_ids"], r0["one_windows"], strict=True)):
        assert r0["ids"][t] + r1["ids"][t] == ids
        assert r0["windows"][t] + r1["windows"][t] == whole
        assert not seen & set(ids)
        seen |= set(ids)
    assert not set(sum(r0["ids"], [])) & set(sum(r1["ids"], []))
    # the changed file: prepared again by rank 0 alone, into the same directory; both open the new one
    assert (r0["again_created"], r1["again_created"]) == (True, False)
    assert r0["again_root"] == r1["again_root"] == r0["root"]
    assert r0["again_sha"] == r1["again_sha"] == r0["file_sha"] == r1["file_sha"]
