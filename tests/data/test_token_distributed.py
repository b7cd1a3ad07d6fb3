"""A Megatron source on 2 real ranks (gloo): rank 0 prepares it once while rank 1 waits; the ranks
read disjoint windows whose union, step by step, is the 1-rank stream with a twice larger
micro-batch."""

from __future__ import annotations

import numpy as np
import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.data.loader import TrainLoader
from smelt_ds.data.prepare import PreparedData
from smelt_ds.testing import run_distributed
from tests.data.token_test_utils import random_documents, word_tokenizer, write_megatron

pytestmark = pytest.mark.distributed
S, B = 16, 2


def _rank_stream(rank: int, world_size: int, cfg_json: str) -> dict:
    """Runs in a spawned gloo process: prepare (rank 0) or wait (rank 1), then one epoch of batches."""
    import torch.distributed as dist

    from smelt_ds.data.prepare import prepare_from_config

    prepared = prepare_from_config(DataConfig.model_validate_json(cfg_json))
    loader = TrainLoader(prepared, S, B, seed=4)  # rank and world size from torch.distributed
    batches = [next(loader) for _ in range(loader.steps_per_epoch)]
    dist.barrier()
    return {"created": prepared.created, "root": str(prepared.root), "rank": loader.dp_rank,
            "ids": [b["sample_ids"].tolist() for b in batches],
            "windows": [np.concatenate([b["input_ids"], b["labels"][:, -1:]], axis=1).tolist() for b in batches]}


def test_two_ranks_read_disjoint_windows_that_make_the_one_rank_stream(tmp_path):
    tok = word_tokenizer(tmp_path / "tok.json", 1000)
    write_megatron(tmp_path / "m", random_documents(150, 1000, seed=21), np.uint16)
    cfg = DataConfig(sources=[{"megatron": str(tmp_path / "m")}], tokenizer={"path": str(tok)},
                     validation_share=0.1, cache_dir=str(tmp_path / "cache"))
    r0, r1 = run_distributed(_rank_stream, world_size=2, args=(cfg.model_dump_json(),), init_deepspeed=False,
                             timeout=180)
    assert (r0["rank"], r1["rank"]) == (0, 1) and (r0["created"], r1["created"]) == (True, False)
    assert r0["root"] == r1["root"]
    one = TrainLoader(PreparedData.load(r0["root"]), S, 2 * B, seed=4, dp_rank=0, dp_world_size=1)
    assert one.steps_per_epoch == len(r0["ids"]) == len(r1["ids"])
    seen: set[int] = set()
    for t in range(one.steps_per_epoch):
        batch = next(one)
        assert r0["ids"][t] + r1["ids"][t] == batch["sample_ids"].tolist()
        whole = np.concatenate([batch["input_ids"], batch["labels"][:, -1:]], axis=1).tolist()
        assert r0["windows"][t] + r1["windows"][t] == whole
        assert not seen & set(r0["ids"][t] + r1["ids"][t])
        seen |= set(r0["ids"][t] + r1["ids"][t])
    assert not set(sum(r0["ids"], [])) & set(sum(r1["ids"], []))
