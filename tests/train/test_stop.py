"""What stops a training (smelt_ds.train.stop): the stop file judged by its identity, never by
comparing its time with a clock; signals; the launcher's death; the ranks' agreement.

A writer whose clock is off is a real process under libfaketime (``faketime -f '-1h' touch``), as
a node with a wrong clock writes to a shared file system. The end-to-end test writes STOP while a
real 2-rank ``smelt-ds train --nproc 2`` prepares its data and expects the stop at step 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from smelt_ds.launch.jobs import JobOptions, plan_job, render
from smelt_ds.parallel.distributed import find_free_port
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.testing import run_distributed, scaled_timeout
from smelt_ds.train import stop as stop_mod
from smelt_ds.train.stop import LAUNCHER_PID_ENV, STOP_FILE, Ancestor, StopSources, agree, launcher_ancestors

HOUR_NS = 3600 * 10**9
ROOT_DIR = Path(__file__).resolve().parents[2]
needs_faketime = pytest.mark.skipif(shutil.which("faketime") is None, reason="libfaketime's faketime is not installed")


def _skewed(cmd: str, skew: str) -> None:
    """Run ``cmd`` (shell) in a process whose clock is ``skew`` off (libfaketime, ``+1h``/``-1h``)."""
    subprocess.run(["faketime", "-f", skew, "sh", "-c", cmd], check=True, timeout=scaled_timeout(30))


def _poll(run: Path) -> str | None:
    """What a fresh rank 0 (a run starting, or resuming, in ``run``) sees at its first step."""
    with StopSources(run, check_file=True) as s:
        return s.poll()


# ---------------------------------------------------------------------------------------------
# the stop file
# ---------------------------------------------------------------------------------------------


def test_a_stop_file_older_than_the_ranks_stops_them_at_their_first_step(tmp_path):
    """A STOP written during start-up (data preparation, engine build) is older than the moment
    the ranks start polling: its modification time says nothing about it being stale. Here it is
    an hour old, as a long start-up or a writer whose clock is an hour behind leaves it."""
    stop = tmp_path / STOP_FILE
    stop.touch()
    st = stop.stat()
    os.utime(stop, ns=(st.st_atime_ns, st.st_mtime_ns - HOUR_NS))
    assert _poll(tmp_path) == "stop_file"
    assert _poll(tmp_path / "elsewhere") is None  # no file: no stop


@needs_faketime
@pytest.mark.parametrize("skew", ["+1h", "-1h"])
def test_a_writer_whose_clock_is_an_hour_off_stops_the_run_and_its_stop_is_honoured_once(tmp_path, skew):
    """``touch`` by a process whose clock runs an hour ahead or behind (libfaketime): the run
    stops; once the stop is saved the file is gone and recorded; the same file put back (a removal
    that failed) does not stop the resumed run; a new ``touch`` of it does."""
    stop = tmp_path / STOP_FILE
    _skewed(f"touch {stop}", skew)
    skew_s = stop.stat().st_mtime - time.time()
    assert abs(skew_s) > 3000 and (skew_s > 0) == (skew == "+1h")  # the writer's clock was off
    kept = tmp_path / "kept"
    with StopSources(tmp_path, check_file=True) as s:
        assert s.poll() == "stop_file"
        os.link(stop, kept)  # the same inode, time and content, to put back below
        s.consume()
    assert not stop.exists()
    os.link(kept, stop)  # left behind, as when rank 0 could not remove it
    assert _poll(tmp_path) is None
    record = json.loads((tmp_path / stop_mod.HONOURED_FILE).read_text())
    ident = stop_mod.stop_file_id(kept)
    assert ident is not None and record == {"inode": ident.inode, "mtime_ns": ident.mtime_ns, "size": 0,
                                            "sha256": ident.sha256, "step": None}
    _skewed(f"touch {stop}", "-1h" if skew == "+1h" else "+1h")  # a new request on the same file
    assert _poll(tmp_path) == "stop_file"


def test_a_stop_with_a_nonce_is_told_from_the_honoured_one_with_the_same_inode_time_and_size(tmp_path):
    """The content is part of the identity: a writer's nonce tells two stops apart even where inode,
    modification time and size match (a coarse-grained time, an inode reused)."""
    stop = tmp_path / STOP_FILE
    stop.write_text("3f1c nonce SIGTERM\n")
    with StopSources(tmp_path, check_file=True) as s:
        s.consume(3)
    stop.write_text("9a77 nonce SIGTERM\n")  # same size
    record = json.loads((tmp_path / stop_mod.HONOURED_FILE).read_text())
    st = stop.stat()
    os.utime(stop, ns=(st.st_atime_ns, record["mtime_ns"]))
    now = stop_mod.stop_file_id(stop)
    assert now is not None and (now.inode, now.mtime_ns, now.size) == (record["inode"], record["mtime_ns"], 19)
    assert now.sha256 != record["sha256"]
    assert _poll(tmp_path) == "stop_file"


def test_a_stop_file_that_cannot_be_removed_is_recorded_and_ignored_by_the_resumed_run(tmp_path, monkeypatch, capsys):
    stop = tmp_path / STOP_FILE
    stop.write_text("nonce\n")
    real_unlink = Path.unlink

    def refuse(self, missing_ok=False):
        if self == stop:
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    with StopSources(tmp_path, check_file=True) as s:
        assert s.poll() == "stop_file"
        s.consume(4)
        assert s.poll() is None  # this run honoured it too
    assert stop.exists()
    assert f"could not remove the stop file {stop} (Operation not permitted) (recorded in " in capsys.readouterr().err
    assert _poll(tmp_path) is None


def test_only_rank_0_reads_and_removes_the_stop_file(tmp_path):
    stop = tmp_path / STOP_FILE
    stop.touch()
    with StopSources(tmp_path, check_file=False) as s:
        assert s.poll() is None
        s.consume(2)
    assert stop.exists() and not (tmp_path / stop_mod.HONOURED_FILE).exists()


def test_an_unreadable_record_counts_every_stop_file_as_new(tmp_path):
    (tmp_path / STOP_FILE).touch()
    (tmp_path / stop_mod.HONOURED_FILE).write_text("{not json")
    assert _poll(tmp_path) == "stop_file"


def test_a_launcher_that_owns_the_run_removes_a_leftover_stop_file(tmp_path, capsys):
    assert stop_mod.clear_stop_file(tmp_path, "smelt-ds train") is False
    (tmp_path / STOP_FILE).touch()
    assert stop_mod.clear_stop_file(tmp_path, "smelt-ds train") is True
    assert not (tmp_path / STOP_FILE).exists()
    assert f"smelt-ds train: removed the stop file {tmp_path / STOP_FILE} left by an earlier run" in \
        capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# signals and the launcher's death
# ---------------------------------------------------------------------------------------------


def test_a_stop_signal_is_a_reason_and_the_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGHUP)
    with StopSources(tmp_path, check_file=True) as s:
        assert s.poll() is None
        signal.raise_signal(signal.SIGHUP)
        signal.raise_signal(signal.SIGTERM)  # the first signal is the one named
        assert s.poll() == "signal"
        assert s.describe("signal") == "stop signal (SIGHUP)"
    assert signal.getsignal(signal.SIGHUP) is before


def test_the_death_of_a_recorded_launcher_is_a_reason(tmp_path):
    proc = subprocess.Popen(["sleep", "600"])
    try:
        p = psutil.Process(proc.pid)
        launcher = Ancestor(proc.pid, p.create_time(), "sleep 600")
        assert launcher.alive()
        assert not Ancestor(proc.pid, p.create_time() + 1.0, "a reused pid").alive()
        with StopSources(tmp_path, check_file=True) as s:
            s.ancestors = [launcher]
            assert s.poll() is None
            proc.kill()
            while p.status() != psutil.STATUS_ZOMBIE:  # not reaped yet: a zombie is dead
                time.sleep(0.01)
            assert s.poll() == "launcher"
            assert s.describe("launcher") == f"the death of its launcher (pid {proc.pid}: sleep 600)"
    finally:
        proc.kill()
        proc.wait()


def test_launcher_ancestors_are_the_marked_launchers_and_the_named_script_above_a_rank(monkeypatch):
    """A process named like a launcher (``torchrun``) above the rank is one; a plain shell is not,
    unless ``SMELT_LAUNCHER_PID`` names it; the walk stops at the first other process."""
    script = subprocess.Popen(["bash", "-c", "exec -a torchrun bash -c 'sleep 600; :'"])
    try:
        for _ in range(500):
            children = psutil.Process(script.pid).children()
            if children:
                break
            time.sleep(0.01)
        rank = children[0].pid
        monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
        assert [a.pid for a in launcher_ancestors(rank)] == [script.pid]
        assert "torchrun" in launcher_ancestors(rank)[0].what
        monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getpid()))  # this test process: a plain python above
        assert [a.pid for a in launcher_ancestors(rank)] == [script.pid, os.getpid()]
    finally:
        for c in psutil.Process(script.pid).children():
            c.kill()
        script.kill()
        script.wait()


# ---------------------------------------------------------------------------------------------
# agreement
# ---------------------------------------------------------------------------------------------


def test_agree_on_one_process_returns_its_reason_and_values():
    reason, sums = agree("launcher", torch.tensor([1.5, 2.0]))
    assert (reason, sums) == ("launcher", [1.5, 2.0])


def _agree_worker(rank: int, world: int) -> list:
    cases = [(None, None), ("launcher", None), ("launcher", "stop_file"), ("signal", "launcher"),
             ("stop_file", "stop_file")]
    out = []
    for mine in cases:
        reason, sums = agree(mine[rank], torch.tensor([1.0 + rank, 10.0], dtype=torch.float32))
        out.append((reason, sums))
    return out


@pytest.mark.distributed
def test_agree_takes_the_highest_priority_reason_of_any_rank_and_sums_the_values():
    """Priorities signal > stop file > launcher > none, on 2 gloo ranks; the values are summed."""
    res = run_distributed(_agree_worker, 2, init_deepspeed=False, timeout=120)
    expected = [None, "launcher", "stop_file", "signal", "stop_file"]
    for r in res:
        assert [reason for reason, _ in r] == expected
        assert all(sums == [3.0, 20.0] for _, sums in r)


# ---------------------------------------------------------------------------------------------
# the rendered deepspeed-launcher script: it owns the run
# ---------------------------------------------------------------------------------------------

#: a launcher that records whether STOP was there when it started, then exits 143 once STOP appears
#: (99 after 30 s without one)
_FAKE_DEEPSPEED = """#!/bin/bash
if [[ -e "$FAKE_STOP" ]]; then echo present > "$FAKE_LOG"; else echo absent > "$FAKE_LOG"; fi
for (( i = 0; i < 1500; i++ )); do [[ -e "$FAKE_STOP" ]] && exit 143; sleep 0.02; done
exit 99
"""


def test_the_deepspeed_script_removes_a_leftover_stop_before_the_launcher_and_writes_a_nonce_on_sigterm(tmp_path):
    """A STOP left by an earlier run is gone before the launcher starts (the ranks would stop at
    their first step); SIGTERM then writes STOP whole (a rename) with a nonce, which rank 0 tells
    from any STOP it honoured before."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / STOP_FILE).write_text("left by an earlier run\n")
    plan = plan_job(ROOT_DIR / "recipes/s/smelt.yaml", JobOptions(scheduler="deepspeed", workdir=str(ROOT_DIR),
                                                                  run_dir=str(run_dir)))
    (tmp_path / "run.sh").write_text(render(plan))
    bindir, log = tmp_path / "bin", tmp_path / "at-start"
    bindir.mkdir()
    (bindir / "deepspeed").write_text(_FAKE_DEEPSPEED)
    (bindir / "deepspeed").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_STOP": str(run_dir / STOP_FILE)}
    env.pop(LAUNCHER_PID_ENV, None)
    out_file = tmp_path / "out"
    with out_file.open("w") as out:
        proc = subprocess.Popen(["bash", str(tmp_path / "run.sh")], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + scaled_timeout(30)
        while not (log.is_file() and log.read_text().endswith("\n")):
            assert proc.poll() is None and time.monotonic() < deadline, out_file.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(scaled_timeout(30))
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out_file.read_text()
    assert log.read_text() == "absent\n", text
    assert f"smelt-ds: removed {run_dir}/STOP left by an earlier run" in text
    assert rc == 143, text
    content = (run_dir / STOP_FILE).read_text()
    assert re.fullmatch(rf"[0-9a-f-]{{36}} SIGTERM to pid {proc.pid} on \S+\n", content), content
    assert not list(run_dir.glob(".STOP*"))  # no temporary left


# ---------------------------------------------------------------------------------------------
# end to end: a STOP during start-up
# ---------------------------------------------------------------------------------------------

#: a sitecustomize that, on rank 0 of a training, runs $SMELT_TEST_STOP_CMD when the rank starts
#: preparing its data (the start-up window, after the launcher has started the ranks)
_SITE = """
import os
import subprocess
import sys

if os.environ.get("RANK") == "0" and os.environ.get("SMELT_TEST_STOP_CMD"):
    from smelt_ds.testing.faults import _PatchOnImport

    def _patch(loop):
        real = loop.build_data

        def build_data(*args, **kwargs):
            subprocess.run(os.environ.pop("SMELT_TEST_STOP_CMD"), shell=True, check=True)
            return real(*args, **kwargs)

        loop.build_data = build_data

    sys.meta_path.insert(0, _PatchOnImport(_patch))
"""


@needs_faketime
@pytest.mark.slow
@pytest.mark.distributed
def test_a_stop_during_start_up_is_honoured_at_step_1_and_its_leftover_does_not_stop_the_resume(
        tmp_path, two_rank_reference):
    """``smelt-ds train --nproc 2``: while rank 0 prepares its data, STOP is touched by a process
    whose clock runs an hour behind. The ranks stop at step 1 (exit 143) with a checkpoint that
    verifies, STOP is removed and recorded. The same file put back (a removal that failed) does
    not stop a torchrun resume, which trains on the uninterrupted run's trajectory."""
    from tests.two_ranks import REFERENCE_STEPS, ROOT, cli_train, losses, train_env

    ref = two_rank_reference
    run, site, kept = tmp_path / "run", tmp_path / "site", tmp_path / "kept"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    stop = run / STOP_FILE
    cmd = f"mkdir -p {run} && faketime -f -1h touch {stop} && ln {stop} {kept}"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    r = cli_train(ref.recipe, "--set", f"train.run_dir={run}", "--set", "train.exit_after_steps=4",
                  env={"PYTHONPATH": path, "SMELT_TEST_STOP_CMD": cmd})
    log = r.stderr[-4000:]
    assert kept.exists(), log  # STOP was written during start-up
    assert r.returncode == 143, log
    assert f"stopped at step 1 of 100000 by the stop file {stop}" in r.stderr
    latest = ckpt.latest_complete(run)
    assert latest is not None and not ckpt.verify(latest), log
    assert json.loads((latest / ckpt.MARKER).read_text())["step"] == 1
    assert not stop.exists()
    assert json.loads((run / stop_mod.HONOURED_FILE).read_text())["step"] == 1
    assert losses(run) == {1: ref.losses[1]}

    os.link(kept, stop)  # the honoured STOP, left behind
    assert REFERENCE_STEPS >= 3
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={find_free_port()}",
                "-m", "smelt_ds.train", str(ref.recipe), "--resume", "auto", "--set", f"train.run_dir={run}",
                "--set", "train.exit_after_steps=2"]
    r = subprocess.run(torchrun, cwd=ROOT, env=train_env(), capture_output=True, text=True,
                       timeout=scaled_timeout(300))
    assert r.returncode == 0, r.stderr[-4000:]
    assert losses(run) == {s: ref.losses[s] for s in (1, 2, 3)}
    assert not stop.exists()  # the run's last save answered it as well

