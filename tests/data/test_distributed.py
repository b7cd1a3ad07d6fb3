"""Only one process tokenises: rank 0 prepares, the other rank waits and reuses (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.data.prepare import PreparedData
from smelt_ds.testing import run_distributed, scaled_timeout
from tests.data.data_test_utils import prose, write_jsonl

pytestmark = pytest.mark.distributed


def _prepare_on_rank(rank: int, world_size: int, cfg_json: str) -> dict:
    """Runs in a spawned gloo process: prepare, counting calls of the tokenising step."""
    import torch.distributed as dist

    import smelt_ds.data.prepare as prep

    calls = []
    real = prep.tokenise
    prep.tokenise = lambda *a, **k: calls.append(1) or real(*a, **k)
    if rank == 1:
        time.sleep(0.5)  # let rank 0 start; rank 1 must wait, not prepare
    prepared = prep.prepare_from_config(DataConfig.model_validate_json(cfg_json))
    dist.barrier()
    return {"created": prepared.created, "tokenised": len(calls), "root": str(prepared.root), "pid": os.getpid(),
            "meta_pid": prepared.meta["created"]["pid"], "dist_rank": dist.get_rank()}


def test_gloo_rank0_prepares_rank1_waits(tmp_path):
    sources = [{"path": str(write_jsonl(tmp_path / f"{d}.jsonl", prose(300, seed=i))), "domain": d}
               for i, d in enumerate(["a", "b"])]
    cfg = DataConfig(sources=sources, tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    r0, r1 = run_distributed(_prepare_on_rank, world_size=2, args=(cfg.model_dump_json(),), init_deepspeed=False,
                             timeout=180)
    assert (r0["dist_rank"], r1["dist_rank"]) == (0, 1)
    assert (r0["created"], r0["tokenised"]) == (True, 2)  # one tokenising pass per source, on rank 0 only
    assert (r1["created"], r1["tokenised"]) == (False, 0)
    assert r0["root"] == r1["root"] and r1["meta_pid"] == r0["pid"]


_SCRIPT = textwrap.dedent("""
    import json, sys
    import smelt_ds.data.prepare as prep
    from smelt_ds.config.data import DataConfig
    calls = []
    real = prep.tokenise
    prep.tokenise = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        p = prep.prepare_from_config(DataConfig.model_validate_json(sys.argv[1]))
        print(json.dumps({"created": p.created, "tokenised": len(calls), "root": str(p.root)}))
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "tokenised": len(calls)}))
""")


def _launch(rank: int, cfg: DataConfig) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, cfg.model_dump_json()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=scaled_timeout(120))
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_env_ranks_rank1_started_first_still_waits(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", prose(400))
    cfg = DataConfig(sources=[{"path": str(src)}], tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    waiter = _launch(1, cfg)
    time.sleep(2.0)
    preparer = _launch(0, cfg)
    r0, r1 = _result(preparer), _result(waiter)
    assert (r0["created"], r0["tokenised"]) == (True, 1)
    assert (r1["created"], r1["tokenised"]) == (False, 0)
    assert r0["root"] == r1["root"]
    PreparedData.load(r0["root"])
    leftovers = [p.name for p in (tmp_path / "c" / "prepared").iterdir() if p.name.startswith(".")]
    assert leftovers == [], "temporary directories must be renamed or removed"


def test_failure_on_rank0_reaches_the_waiting_rank(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    cfg = DataConfig(sources=[{"path": str(bad)}], tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"),
                     prepare_timeout_s=100)
    waiter = _launch(1, cfg)
    preparer = _launch(0, cfg)
    start = time.monotonic()
    r0, r1 = _result(preparer), _result(waiter)
    assert "bad.jsonl' line 2: not valid JSON" in r0["error"]
    assert "failed on the preparing rank" in r1["error"] and "line 2" in r1["error"] and r1["tokenised"] == 0
    assert time.monotonic() - start < 60  # told at once, not after prepare_timeout_s
