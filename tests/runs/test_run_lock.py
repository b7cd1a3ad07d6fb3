"""One writer per run directory: a second training is refused naming the holder; a lock left by a
killed process is taken over; a refused run leaves no directory it created; another run's files
without a checkpoint are refused, and taken over (removed) only by --resume auto."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
from pathlib import Path

import pytest

from smelt_ds.config.loading import config_from_dict
from smelt_ds.testing import run_distributed


def _hold(run_dir: str, ready, stop) -> None:
    from smelt_ds.runs.run_lock import RunLock

    RunLock(run_dir).acquire()
    ready.set()
    stop.wait(60)


def test_second_holder_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    from smelt_ds.errors import ConfigError
    from smelt_ds.runs.run_lock import LOCK_NAME, RunLock

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
    from smelt_ds.runs.run_lock import RunLock
    from smelt_ds.testing import DistributedTestError

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
    with pytest.raises(DistributedTestError,
                       match=r"`moe_runtime.ep_size` \(2\) must divide the number of ranks \(1\)"):
        run_distributed(_train, 1, args=(ep2,), timeout=300)
    assert not fresh.exists()


def _crashed_before_its_first_checkpoint(run: Path, cfg) -> None:
    """What a fresh run writes before its first checkpoint (loop._fit), left by a crash; plus an
    older run's summary, a sweep's label and a partial checkpoint directory."""
    from smelt_ds.config.loading import dump_config
    from smelt_ds.runs.run_lock import LOCK_NAME

    (run / "tb").mkdir(parents=True)
    (run / LOCK_NAME).write_text("")
    (run / "tokenizer.json").write_text("{}")
    dump_config(cfg, run / "config.yaml")
    (run / "ds_config.json").write_text("{}")
    (run / "tb" / "events.out.tfevents.1.host").write_bytes(b"events")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 6.0}) + "\n" for s in (1, 2, 3)))
    (run / "summary.txt").write_text("run of another recipe\n")
    (run / "sweep_run.json").write_text("{}")                      # not written by training: kept
    partial = run / "checkpoints" / "step00000004"                  # killed in its first save
    partial.mkdir(parents=True)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"truncated")


def test_another_runs_files_without_a_checkpoint_are_refused_and_resume_auto_takes_them_over(tmp_path, capsys):
    from smelt_ds.errors import ConfigError
    from smelt_ds.train.guards import check_run_dir

    run = tmp_path / "run"
    cfg = config_from_dict(_raw(run, tmp_path / "cache"))
    _crashed_before_its_first_checkpoint(run, cfg)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as info:
        check_run_dir(run, cfg, "none")                            # the same command again
    assert str(info.value) == (
        f"run directory {run} holds files of an earlier run that saved no checkpoint (config.yaml, ds_config.json, "
        "metrics.jsonl (3 rows, last step 3), tb/ (1 event files), summary.txt): a new run here would overwrite them "
        "and mix the two runs' logs. Start this run in a new --run-dir, delete the directory, or rerun with "
        "--resume auto to start from step 0 in place (the earlier run's files are removed first)")
    check_run_dir(run, cfg, "auto", take_over=False)               # the launching process only checks
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    capsys.readouterr()
    check_run_dir(run, cfg, "auto")                                # starts from step 0 in place
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [".lock", "checkpoints", "sweep_run.json"]
    assert (f"run directory {run}: --resume auto found no checkpoint: starting from step 0 in place, removed the "
            "earlier run's config.yaml, ds_config.json, metrics.jsonl (3 rows, last step 3), tb/ (1 event files), "
            "summary.txt, incomplete checkpoints/step00000004") in capsys.readouterr().err
    # a directory holding only the lock and the tokenizer of a run refused before it trained is accepted
    (run / "tokenizer.json").write_text("{}")
    check_run_dir(run, cfg, "none")


def test_missing_tutel_is_refused_before_the_run_directory_is_touched(tmp_path):
    from smelt_ds.errors import ConfigError
    from smelt_ds.parallel.moe_backends import TUTEL_INSTALL_HINT, tutel_available
    from smelt_ds.train.guards import check_run_dir

    if tutel_available():
        pytest.skip("tutel is installed here")
    raw = _raw(tmp_path / "run", tmp_path / "cache")
    raw["moe_runtime"] = {"backend": "deepspeed", "use_tutel": True}
    with pytest.raises(ConfigError) as info:
        check_run_dir(tmp_path / "run", config_from_dict(raw), "none")
    assert str(info.value) == ("`moe_runtime.use_tutel` (True) needs the optional package `tutel`, which is not "
                               f"installed: install it ({TUTEL_INSTALL_HINT}), or set moe_runtime.use_tutel to false "
                               "(e.g. --set moe_runtime.use_tutel=false) to run DeepSpeed-MoE without tutel kernels")
    assert not (tmp_path / "run").exists()
