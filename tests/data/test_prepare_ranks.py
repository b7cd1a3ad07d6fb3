"""One rank prepares the data, the others wait (smelt_ds.data.distributed): which rank prepares,
and whether a failure marker is this attempt's, decided without comparing a file's time with a
clock. Writers with a wrong clock are real processes under libfaketime; the ranks of an attempt are
real processes with a gloo process group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from smelt_ds.data import distributed as dd
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.distributed import find_free_port
from smelt_ds.testing import scaled_timeout

ROOT = Path(__file__).resolve().parents[2]
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
needs_faketime = pytest.mark.skipif(shutil.which("faketime") is None or not FAKETIME_LIB.is_file(),
                                    reason="libfaketime is not installed")

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    """A process with no launcher variables and no process group; returns a setter."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_(**values: int) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    return set_


# ---------------------------------------------------------------------------------------------
# the preparing rank
# ---------------------------------------------------------------------------------------------


def test_without_local_rank_on_several_hosts_the_preparing_rank_of_a_host_is_refused_not_guessed(env):
    """Rank 8 of 16 on 2 hosts of 8: the local rank 0 of the second host under a block placement,
    local rank 4 under a cyclic one. Without LOCAL_RANK no rank can tell: a clear error, not a host
    whose ranks all wait until the timeout."""
    env(RANK=8, WORLD_SIZE=16, LOCAL_WORLD_SIZE=8)
    with pytest.raises(ConfigError) as e:
        dd.is_preparing_rank(shared_filesystem=False)
    msg = str(e.value)
    assert "`LOCAL_RANK` is not set for rank 8 of a world of 16 ranks spread over several hosts" in msg
    assert "LOCAL_WORLD_SIZE 8" in msg and "data.shared_filesystem: true" in msg
    assert dd.is_preparing_rank(shared_filesystem=True) is False  # global rank 0 prepares: no local rank needed
    env(LOCAL_RANK=0)
    assert dd.is_preparing_rank(shared_filesystem=False) is True
    assert dd.rank_info() == dd.RankInfo(8, 0, 16)


def test_the_local_rank_is_the_global_one_only_when_every_rank_is_on_this_host(env):
    env(RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    assert dd.rank_info() == dd.RankInfo(1, 1, 2)
    assert dd.is_preparing_rank(shared_filesystem=False) is False
    env(RANK=0)
    assert dd.is_preparing_rank(shared_filesystem=False) is True
    env(RANK=3, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    assert dd.rank_info().local_rank is None


def test_a_single_process_prepares(env):
    assert dd.rank_info() == dd.RankInfo(0, 0, 1)
    assert dd.is_preparing_rank(shared_filesystem=False) is True


# ---------------------------------------------------------------------------------------------
# failure markers without a process group: the marker seen when the wait began
# ---------------------------------------------------------------------------------------------


def _earlier_failed_attempt(out: Path, skew: str) -> None:
    """A preparation of ``out`` that fails in a process whose clock is ``skew`` off: it leaves
    ``<out>.failed`` as an earlier attempt of a run does."""
    code = ("import sys\nfrom smelt_ds.data.distributed import run_once\n"
            "def build(tmp):\n    raise OSError('an earlier attempt: the volume was read-only')\n"
            "try:\n    run_once(sys.argv[1], build)\nexcept OSError:\n    pass\n"
            # the kernel of a host with this clock stamps the file so; libfaketime fakes only the process's clock
            "import os, time\nnow = time.time()\nos.utime(sys.argv[1] + '.failed', (now, now))\n")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    subprocess.run(["faketime", "-f", skew, sys.executable, "-c", code, str(out)], check=True, env=env, cwd=ROOT,
                   timeout=scaled_timeout(60))
    skew_s = (out.parent / f"{out.name}.failed").stat().st_mtime - time.time()
    assert abs(skew_s) > 3000 and (skew_s > 0) == skew.startswith("+")  # stamped by the skewed clock


def _sleep_then_tell(went_round: threading.Event) -> SimpleNamespace:
    """A stand-in for the module's ``time``: its ``sleep`` (between two polls of the waiting rank)
    sets ``went_round``: the waiting rank has looked at the marker once and kept waiting."""

    def sleep(s: float) -> None:
        went_round.set()
        time.sleep(s)

    return SimpleNamespace(monotonic=time.monotonic, time=time.time, sleep=sleep)


@needs_faketime
def test_without_a_process_group_a_waiting_rank_ignores_an_earlier_attempts_marker_and_raises_this_ones(
        env, tmp_path, monkeypatch):
    """An earlier attempt failed on a host whose clock runs an hour ahead: its marker's time is
    in the future. The waiting rank of this attempt keeps waiting past it; when this attempt's
    preparing rank fails, the waiting rank raises that error, not the earlier one."""
    out = tmp_path / "prepared" / "key"
    _earlier_failed_attempt(out, "+1h")
    env(RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    went_round, raised = threading.Event(), []
    monkeypatch.setattr(dd, "time", _sleep_then_tell(went_round))

    def waiting_rank() -> None:
        try:
            dd._wait(out, scaled_timeout(60), 1)
        except ConfigError as e:
            raised.append(str(e))

    t = threading.Thread(target=waiting_rank)
    t.start()
    deadline = time.monotonic() + scaled_timeout(60)
    while not went_round.is_set() and t.is_alive() and time.monotonic() < deadline:
        went_round.wait(0.05)
    assert went_round.is_set() and not raised, raised  # the earlier marker did not end the wait

    def build(tmp: Path) -> None:
        raise RuntimeError("this attempt: tokenizer file missing")

    with pytest.raises(RuntimeError, match="this attempt"):
        dd._build(out, build)  # the preparing rank of this attempt
    t.join(scaled_timeout(60))
    assert len(raised) == 1 and "RuntimeError: this attempt: tokenizer file missing" in raised[0], raised
    assert "earlier attempt" not in raised[0]


# ---------------------------------------------------------------------------------------------
# failure markers with a process group: nonces registered in the group's store
# ---------------------------------------------------------------------------------------------

#: one rank of an attempt: a gloo group, then run_once of argv[1]; rank 1 waits for the preparation
#: (rank 0, whose build fails with argv[5] or succeeds when it is empty). In order: rank 1 looks at
#: the marker once and pauses at its first poll (argv[2] appears); rank 0 prepares, stamps a marker
#: it wrote with its own clock, as the kernel of a host with that clock does (argv[3] appears); rank
#: 1 goes on. Rank 0 keeps the group's store (which it hosts) up until rank 1 has its answer
#: (argv[4]). Prints the outcome as JSON. No time.sleep under libfaketime: Python's sleeps to an
#: absolute deadline on the real monotonic clock, which libfaketime refuses (EINVAL).
_RANK = r"""
import json, os, sys, threading, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from smelt_ds.data import distributed as dd

out, went_round, stamped, done = (Path(a) for a in sys.argv[1:5])
error, timeout_s = sys.argv[5], float(sys.argv[6])
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s * 2))
rank, pause = dist.get_rank(), threading.Event().wait


def build(tmp):
    if error:
        raise RuntimeError(error)
    (tmp / "shard.bin").write_bytes(b"tokens")


def wait_for(*paths):
    deadline = time.monotonic() + timeout_s
    while not any(p.exists() for p in paths) and time.monotonic() < deadline:
        pause(0.05)


if rank == 1:
    def sleep(s):
        if not went_round.exists():
            went_round.touch()
            wait_for(stamped)
        pause(s)

    dd.time = type("T", (), {"sleep": staticmethod(sleep), "monotonic": staticmethod(time.monotonic),
                             "time": staticmethod(time.time)})
else:
    wait_for(went_round, done)
try:
    result = {"built": dd.run_once(out, build, timeout_s=timeout_s)}
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}"}
if rank == 1:
    done.write_text("done")
else:
    marker = out.parent / (out.name + ".failed")
    if marker.exists():
        now = time.time()
        os.utime(marker, (now, now))
    stamped.touch()
    wait_for(done)
print(json.dumps({"rank": rank, **result}), flush=True)
"""


def _attempt(tmp: Path, out: Path, error: str, skew0: str | None = None) -> list[dict]:
    """Run both ranks of one attempt (rank 0's clock ``skew0`` off under libfaketime); their outcomes."""
    port, steps = find_free_port(), [tmp / "went-round", tmp / "stamped", tmp / "done"]
    for f in steps:
        f.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                OMP_NUM_THREADS="1")
    procs = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        if rank == 0 and skew0:
            env.update(LD_PRELOAD=str(FAKETIME_LIB), FAKETIME=skew0, DONT_FAKE_MONOTONIC="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK, str(out), *map(str, steps), error,
                                       str(scaled_timeout(30))], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=scaled_timeout(180))
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


@needs_faketime
@pytest.mark.distributed
def test_an_earlier_attempts_marker_from_a_clock_ahead_does_not_fail_this_attempt(tmp_path):
    """An earlier attempt failed on a host whose clock runs an hour ahead. In this attempt the
    waiting rank looks at its marker, keeps waiting, and opens the data rank 0 prepares."""
    out = tmp_path / "prepared" / "key"
    _earlier_failed_attempt(out, "+1h")
    r0, r1 = _attempt(tmp_path, out, error="")
    assert r0 == {"rank": 0, "built": True}
    assert r1 == {"rank": 1, "built": False}
    assert (out / "shard.bin").read_bytes() == b"tokens"
    assert not (out.parent / "key.failed").exists()


@needs_faketime
@pytest.mark.distributed
def test_a_failure_on_a_preparing_rank_whose_clock_is_an_hour_behind_reaches_the_waiting_rank(tmp_path):
    """Rank 0's clock runs an hour behind: its marker looks an hour old. The waiting rank raises
    rank 0's error (its nonce is registered in the group's store) instead of waiting until the
    timeout."""
    out = tmp_path / "prepared" / "key"
    r0, r1 = _attempt(tmp_path, out, error="no space left on the cache volume", skew0="-1h")
    assert r0 == {"rank": 0, "error": "RuntimeError: no space left on the cache volume"}
    assert r1["error"].startswith(f"ConfigError: data preparation of {str(out)!r} failed on the preparing rank "
                                  "(rank 0 on "), r1
    assert r1["error"].endswith("): RuntimeError: no space left on the cache volume: fix that error (see the "
                                "preparing rank's log)"), r1
    assert (out.parent / "key.failed").stat().st_mtime - time.time() < -3000  # stamped by rank 0's clock
    marker = json.loads((out.parent / "key.failed").read_text())
    assert marker["rank"] == 0 and marker["error"] == "RuntimeError: no space left on the cache volume"
