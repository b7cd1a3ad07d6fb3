"""One writer per run directory: a second training is refused naming the holder; a lock left by a
killed process is taken over; a refused run leaves no directory it created."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
from pathlib import Path

import pytest

from smelt_ds.config.run import config_from_dict
from smelt_ds.testing import run_distributed


def _hold(run_dir: str, ready, stop) -> None:
    from smelt_ds.train.run_lock import RunLock

    RunLock(run_dir).acquire()
    ready.set()
    stop.wait(60)


def test_second_holder_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    from smelt_ds.errors import ConfigError
    from smelt_ds.train.run_lock import LOCK_NAME, RunLock

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, stop))
    holder.start()
    assert ready.wait(60)
    with pytest.raises(ConfigError, match=rf"is in use by another training \(host {socket.gethostname()}, "
                                          rf"pid {holder.pid}, since .*\): wait for it"):
        RunLock(tmp_path).acquire()
    os.kill(holder.pid, signal.SIGKILL)                    # dies holding it: the kernel releases the lock
    holder.join(30)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid   # stale content left behind
    with RunLock(tmp_path):
        assert f"taking over a stale lock of a process that is gone (host {socket.gethostname()}, " \
               f"pid {holder.pid}" in capsys.readouterr().err
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_NAME).read_text() == ""        # released cleanly: nothing stale


def _train(rank, world, raw, resume="none"):
    from smelt_ds.train.loop import train

    return train(config_from_dict(raw), resume=resume).step


def _raw(run_dir: Path, cache: Path) -> dict:
    return {"name": "lk",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 1, "warmup_steps": 0,
                      "run_dir": str(run_dir)}}


@pytest.mark.distributed
def test_training_into_a_locked_run_directory_is_refused_before_writing(tmp_path):
    from smelt_ds.testing import DistributedTestError
    from smelt_ds.train.run_lock import RunLock

    run_dir = tmp_path / "run"
    raw = _raw(run_dir, tmp_path / "cache")
    with RunLock(run_dir):                                 # another training holds it (this process)
        with pytest.raises(DistributedTestError, match=rf"run directory {run_dir} is in use by another training "
                                                       rf"\(host .*, pid {os.getpid()},"):
            run_distributed(_train, 2, args=(raw,), timeout=300)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]    # nothing written by the refused run
    # a run refused for another reason leaves no directory it created
    fresh = tmp_path / "fresh"
    with pytest.raises(DistributedTestError, match=r"--resume '.*nowhere' does not exist"):
        run_distributed(_train, 1, args=(_raw(fresh, tmp_path / "cache"), str(tmp_path / "nowhere")), timeout=300)
    assert not fresh.exists()
    # ... also when the engine refuses it after the data were prepared (ep_size 2 on one rank)
    ep2 = _raw(fresh, tmp_path / "cache")
    ep2["moe_runtime"] = {"backend": "autoep", "ep_size": 2}
    with pytest.raises(DistributedTestError, match=r"`moe_runtime.ep_size` \(2\) must divide the number of ranks \(1\)"):
        run_distributed(_train, 1, args=(ep2,), timeout=300)
    assert not fresh.exists()
