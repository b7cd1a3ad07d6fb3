"""A stop under each launcher a user starts training with, with real ranks on loopback, followed by
``--resume auto`` under the next launcher: every rank finishes its step, they save one checkpoint
together, no rank is left running, and the run goes on on the uninterrupted run's trajectory:
every logged loss equals, bit for bit, the loss of the shared reference run
(:mod:`tests.two_ranks`) at the same step.

- bare ``deepspeed --module smelt_ds.train``: SIGTERM to the runner alone (it dies; its ranks see
  their launcher gone, save and exit);
- the rendered deepspeed-launcher script on a single host: SIGTERM to ``bash run.sh`` (it creates
  RUN_DIR/STOP and waits; the ranks save and exit 143, which the launcher and the script pass on).

The jobs of several hosts (Slurm, the deepspeed launcher with a hostfile, the Kubernetes pods) stop
and resume on two hosts in tests/launch/test_hosts.py.

``smelt-ds train --nproc`` is the reference's launcher (and tests/train/test_train_cli.py's)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from smelt_ds.launch.jobs import JobOptions, plan_job, render
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.testing import scaled_timeout
from tests.two_ranks import REFERENCE_STEPS, ROOT, losses, train_env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_after(cmd: list[str], run: Path, steps: int, log: Path, **env: str) -> tuple[int, int]:
    """Start ``cmd`` in its own session, SIGTERM its first process once step ``steps`` is logged,
    wait for it and for every rank of the session to be gone; (its exit status, the step of the
    newest complete checkpoint, which must verify)."""
    with log.open("a") as out:
        out.write(f"\n==== {cmd[:3]} (stop at step {steps} or later)\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=train_env(**env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + scaled_timeout(300)
        while max(losses(run), default=0) < steps:
            assert proc.poll() is None, f"exited {proc.returncode} before step {steps}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"step {steps} not reached in time:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(scaled_timeout(120))
        _wait_ranks_gone(proc.pid, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for q in _ranks(proc.pid):
            q.kill()
    latest = ckpt.latest_complete(run)
    assert latest is not None and not ckpt.verify(latest), log.read_text()[-3000:]
    assert not (run / "STOP").exists()  # a stop file is removed once the stop is saved
    return rc, json.loads((latest / ckpt.MARKER).read_text())["step"]


def _ranks(session: int) -> list[psutil.Process]:
    found = []
    for q in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(q.pid) == session and "smelt_ds.train" in " ".join(q.info["cmdline"] or []):
                found.append(q)
        except OSError:
            continue
    return found


def _wait_ranks_gone(session: int, log: Path) -> None:
    deadline = time.monotonic() + scaled_timeout(60)
    while left := _ranks(session):
        assert time.monotonic() < deadline, f"ranks still running after the stop: {left}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _check_trajectory(run: Path, reference: dict[int, float], stops: list[int]) -> None:
    """Steps 1..last stop are each logged once, and equal the reference's losses bit for bit (all
    of them up to REFERENCE_STEPS, which must include a step after the first resume)."""
    got = losses(run)
    assert sorted(got) == list(range(1, stops[-1] + 1))
    compared = sorted(s for s in got if s in reference)
    assert compared[-1] > stops[0], f"no resumed step within the reference's {REFERENCE_STEPS}: raise it"
    assert {s: got[s] for s in compared} == {s: reference[s] for s in compared}


def _plan(recipe: Path, scheduler: str, run: Path, **kw):
    return plan_job(recipe, JobOptions(scheduler=scheduler, nodes=1, gpus_per_node=2, workdir=str(ROOT),
                                       run_dir=str(run), **kw))


def test_the_reference_run_through_the_deepspeed_launcher_wrote_its_run_directory(two_rank_reference):
    """`smelt-ds train --nproc 2` goes through the deepspeed launcher (`--module smelt_ds.train`,
    which passes --local_rank): both ranks trained, rank 0 wrote the run directory."""
    run = two_rank_reference.run_dir
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == REFERENCE_STEPS
    assert last["tokens"] == REFERENCE_STEPS * 2 * 2 * 32  # steps x ranks x micro-batch x seq_len
    assert not (run / "summary.json").exists()  # stopped by train.exit_after_steps: not finished
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 4 and ds["zero_optimization"]["stage"] == 1
    final = ckpt.latest_complete(run)
    assert final.name == f"step{REFERENCE_STEPS:08d}"
    assert sorted(p.name for p in final.glob("client_rank*.pt")) == ["client_rank0.pt", "client_rank1.pt"]


def test_deepspeed_bare_then_rendered_single_host_stop_and_resume_on_the_trajectory(
        two_rank_reference, tmp_path):
    ref = two_rank_reference
    run = tmp_path / "run"
    log = tmp_path / "log.txt"
    bare = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
            "--module", "smelt_ds.train", str(ref.recipe), "--set", f"train.run_dir={run}"]
    rc, first = _stop_after(bare, run, 3, log)
    assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), log.read_text()[-3000:]  # the runner died of it
    assert "by the death of its launcher" in log.read_text(), log.read_text()[-3000:]
    assert first == max(losses(run))  # the step the ranks stopped at, saved

    single = tmp_path / "run.sh"
    single.write_text(render(_plan(ref.recipe, "deepspeed", run, master_port=_free_port())))
    rc, second = _stop_after(["bash", str(single)], run, first + 3, log)
    assert rc == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert f"smelt-ds: SIGTERM: created {run}/STOP" in log.read_text()
    assert second == max(losses(run))

    _check_trajectory(run, ref.losses, [first, second])
