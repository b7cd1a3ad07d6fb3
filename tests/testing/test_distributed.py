"""SMELT_TEST_TIMEOUT_SCALE: the wall-clock limits of smelt_ds.testing scale with the machine."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from smelt_ds.testing import TIMEOUT_SCALE_ENV, DistributedTestError, run_distributed, scaled_timeout, timeout_scale


def _sleep_5_s_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(5)
    return rank


def _pg_timeout_s(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


@pytest.mark.parametrize("value,scale", [(None, 1.0), ("", 1.0), ("  ", 1.0), ("3", 3.0), ("0.5", 0.5),
                                         (" 2.5 ", 2.5), ("1e-2", 0.01)])
def test_scale_multiplies_the_limit(monkeypatch, value, scale):
    if value is None:
        monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    else:
        monkeypatch.setenv(TIMEOUT_SCALE_ENV, value)
    assert timeout_scale() == scale
    assert scaled_timeout(240) == pytest.approx(240 * scale)
    assert scaled_timeout(0.5) == pytest.approx(0.5 * scale)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "-inf", "3s", "1,5"])
def test_bad_scale_names_the_variable_the_value_and_what_is_accepted(monkeypatch, value):
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, value)
    expected = rf"SMELT_TEST_TIMEOUT_SCALE={value!r} is not a valid timeout scale: set a finite number > 0"
    with pytest.raises(ValueError, match=expected):
        scaled_timeout(60)
    # run_distributed refuses before it starts any process (it never asks for a start method's context)
    import smelt_ds.testing.distributed as helper

    def no_processes(*args, **kwargs):
        raise AssertionError("run_distributed started processes for a bad scale")

    monkeypatch.setattr(helper.mp, "get_context", no_processes)
    with pytest.raises(ValueError, match=expected):
        run_distributed(_sleep_5_s_on_rank_0, world_size=2, timeout=60, init_deepspeed=False)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("seconds", [0, -5, float("nan"), float("inf"), True, "60"])
def test_bad_seconds_are_refused(monkeypatch, seconds):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"scaled_timeout\(seconds=.*\): seconds must be a finite number > 0"):
        scaled_timeout(seconds)


@pytest.mark.distributed
def test_run_distributed_times_out_at_the_scaled_limit(monkeypatch):
    # unscaled, this run succeeds after rank 0's 5 s sleep (no error); scaled by 0.01 the limit is 1 s,
    # so it must fail, and say so. (Not timed here: a loaded machine may take seconds to start the ranks.)
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "0.01")
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_5_s_on_rank_0, world_size=2, timeout=100, init_deepspeed=False)
    msg = str(info.value)
    assert "timed out after 1 s (timeout=100 s x SMELT_TEST_TIMEOUT_SCALE=0.01); ranks without a result: [0" in msg
    assert multiprocessing.active_children() == []  # every child killed and reaped


@pytest.mark.distributed
def test_process_group_timeout_is_scaled(monkeypatch):
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "0.5")
    assert run_distributed(_pg_timeout_s, world_size=1, timeout=120, init_deepspeed=False) == [60.0]


def _raise_on_every_rank(rank: int, world: int) -> int:
    raise ValueError(f"boom on rank {rank}")


@pytest.mark.distributed
def test_a_failed_run_returns_once_every_rank_has_reported(monkeypatch):
    """After a rank's error, run_distributed waits up to 2 s x scale for the peers' own errors (60 s
    here), but no longer than until every rank has reported: when all ranks failed at once, the
    error is back in about the start-up time (1-2 s), with every rank's traceback."""
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "30")
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)failed on ranks \[0, 1\].*boom on rank .*boom on rank "):
        run_distributed(_raise_on_every_rank, world_size=2, init_deepspeed=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 30.0, f"took {elapsed:.1f} s: it waited out the 60 s for peers that had all reported"
    assert multiprocessing.active_children() == []


def _raise_on_rank_1(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that died: must not hang the test
    return rank


def _sleep_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


@pytest.mark.distributed
def test_run_distributed_propagates_errors_and_times_out(monkeypatch):
    monkeypatch.setenv("SMELT_TEST_TIMEOUT_SCALE", "1")  # this test waits the whole limit: keep it 10 s in CI

    with pytest.raises(DistributedTestError, match=r"(?s)failed on ranks.*--- rank 1 ---.*ValueError: boom on rank 1"):
        run_distributed(_raise_on_rank_1, world_size=2, timeout=60, init_deepspeed=False)
    # 10 s leaves a loaded machine time to start rank 1 (it imports torch, about 1-2 s, and returns at
    # once); rank 0 sleeps 600 s, so it must be the only rank reported
    with pytest.raises(DistributedTestError, match=rf"timed out after {scaled_timeout(10):g} s \(timeout=10 s x "
                       r"SMELT_TEST_TIMEOUT_SCALE=[0-9.e+-]+\); ranks without a result: \[0\]"):
        run_distributed(_sleep_on_rank_0, world_size=2, timeout=10, init_deepspeed=False)


def _what_the_rank_sees(rank: int, world: int, name: str, speak: bool = True) -> dict:
    import os
    import sys

    if speak:
        print(f"rank {rank} says hello on stdout", flush=True)
        print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    return {"value": os.environ.get(name), "ppid": os.getppid(), "cwd": os.getcwd(),
            "gone": "SMELT_TEST_GONE" in os.environ}


def test_ranks_are_forked_from_one_server_with_the_callers_environment_output_and_directory(
        monkeypatch, capfd, tmp_path):
    """The default start method forks every rank from one server that imported torch and DeepSpeed
    when it started; what a test sets after that (environment, working directory) and pytest's
    capture of this test's output must still reach the ranks."""
    import os

    monkeypatch.setenv("SMELT_TEST_GONE", "1")
    with capfd.disabled():  # a server started here holds the descriptors of pytest's outer capture
        first = run_distributed(_what_the_rank_sees, 2, args=("SMELT_TEST_SEEN", False), init_deepspeed=False,
                                timeout=60)  # quiet: nothing captures this launch's output
    monkeypatch.delenv("SMELT_TEST_GONE")
    monkeypatch.setenv("SMELT_TEST_SEEN", "set after the server started")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    second = run_distributed(_what_the_rank_sees, 2, args=("SMELT_TEST_SEEN",), init_deepspeed=False, timeout=60)
    out, err = capfd.readouterr()
    servers = {r["ppid"] for r in first + second}
    assert len(servers) == 1 and servers != {os.getpid()}  # one fork server, not this process
    assert [r["value"] for r in first] == [None, None] and [r["gone"] for r in first] == [True, True]
    assert [r["value"] for r in second] == ["set after the server started"] * 2
    assert [r["gone"] for r in second] == [False, False]
    assert {r["cwd"] for r in second} == {str(tmp_path)}
    for rank in (0, 1):
        assert f"rank {rank} says hello on stdout" in out and f"rank {rank} says hello on stderr" in err
