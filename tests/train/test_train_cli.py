"""`smelt-ds train --nproc N`: Ctrl-C and SIGTERM reach the ranks, which save and exit 143 (no
traceback); what every rank would refuse is printed once, before the launcher starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from smelt_ds.testing import scaled_timeout

ROOT = Path(__file__).resolve().parents[2]


def _raw(run_dir: Path, cache: Path) -> dict:
    return {"name": "cli",
            "model": {"vocab_size": 512, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 64},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
            "data": {"builtin_max_bytes": 150_000, "tokenizer": {"vocab_size": 512}, "cache_dir": str(cache)},
            "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 6, "warmup_steps": 2,
                      "run_dir": str(run_dir)},
            "eval": {"eval_batches": 2}}


@pytest.fixture()
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_raw(tmp_path / "run", tmp_path / "cache")))
    return path


@pytest.fixture()
def no_launch(monkeypatch):
    """Starting the launcher fails the test at once (the checks must refuse before it)."""
    import smelt_ds.train.cli as train_cli

    def launched(cmd):
        raise AssertionError(f"the launcher was started: {cmd}")

    monkeypatch.setattr(train_cli, "run_launcher", launched)


def _main(*argv: str) -> int:
    from smelt_ds.cli import main

    return main(list(argv))


def test_bad_set_with_nproc_2_is_reported_once_before_the_launcher(recipe, no_launch, capsys):
    assert _main("train", str(recipe), "--nproc", "2", "--set", "train.max_steps=abc") == 2
    err = capsys.readouterr().err
    assert err.count("--set train.max_steps=abc: `train.max_steps` ('abc'): Input should be a valid integer") == 1
    assert err.startswith("smelt-ds train: error: --set train.max_steps=abc:") and "launching:" not in err


def test_missing_tutel_is_refused_before_the_launcher_and_leaves_no_run_directory(recipe, no_launch, capsys):
    from smelt_ds.parallel.moe_backends import TUTEL_INSTALL_HINT, tutel_available

    if tutel_available():
        pytest.skip("tutel is installed here")
    assert _main("train", str(recipe), "--nproc", "2", "--set", "moe_runtime.backend=deepspeed",
                 "--set", "moe_runtime.use_tutel=true") == 2
    err = capsys.readouterr().err
    assert err.count("`moe_runtime.use_tutel` (True) needs the optional package `tutel`, which is not installed") == 1
    assert TUTEL_INSTALL_HINT in err and "set moe_runtime.use_tutel to false" in err
    assert not (recipe.parent / "run").exists()


def test_run_directory_refusals_are_reported_once_before_the_launcher(recipe, no_launch, capsys):
    from smelt_ds.runs.run_lock import RunLock

    run_dir = recipe.parent / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n')
    assert _main("train", str(recipe), "--nproc", "2") == 2
    err = capsys.readouterr().err
    assert err.count(f"run directory {run_dir} holds files of an earlier run that saved no checkpoint "
                     "(metrics.jsonl (1 rows, last step 1))") == 1
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 6.2}\n'     # only checked
    with RunLock(run_dir):                              # another training holds the directory
        assert _main("train", str(recipe), "--nproc", "2", "--resume", "auto") == 2
    assert capsys.readouterr().err.count(f"run directory {run_dir} is in use by another training (host ") == 1


def test_launcher_status_maps_the_outcome_of_a_stop(capsys):
    from smelt_ds.train.cli import launcher_status

    assert launcher_status(143, signal.SIGINT) == 143          # the ranks saved and stopped
    assert launcher_status(0, signal.SIGTERM) == 0             # they had finished
    assert launcher_status(2, None) == 2 and launcher_status(1, None) == 1
    assert launcher_status(-signal.SIGTERM, None) == 143       # the launcher itself was killed
    # launch.py exits -N when a rank was killed by signal N: 256 - N to the OS, 128 + N to a shell
    assert launcher_status(256 - signal.SIGKILL, None) == 137 and launcher_status(256 - signal.SIGABRT, None) == 134
    assert launcher_status(75, None) == 75 and launcher_status(124, None) == 124  # a rank's own statuses
    assert capsys.readouterr().err == ""
    assert launcher_status(241, signal.SIGINT) == 130          # a rank died of SIGTERM before training
    assert "stopped without saving a checkpoint for this SIGINT (launcher exit status 143" in capsys.readouterr().err
    assert launcher_status(-signal.SIGTERM, signal.SIGTERM) == 143  # stopped before the ranks existed ...
    assert "stopped without saving a checkpoint for this SIGTERM (launcher exit status 143" in capsys.readouterr().err


FAKE = """\
import pathlib, signal, subprocess, sys, time
role, d = sys.argv[1], pathlib.Path(sys.argv[2])
def note(signum, frame):
    (d / f"{role}.signal").write_text(signal.Signals(signum).name)
    if role.startswith("rank"):
        sys.exit(143)                     # as a rank does after saving
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, note)
if role == "runner":                      # deepspeed.launcher.runner -> launch.py
    p = subprocess.Popen([sys.executable, __file__, "launch", str(d)])
    sys.exit(p.wait())
if role == "launch":                      # deepspeed.launcher.launch -> the ranks; the first failure
    ps = [subprocess.Popen([sys.executable, __file__, f"rank{i}", str(d)]) for i in range(2)]
    rcs = [p.wait() for p in ps]
    sys.exit(next((rc for rc in rcs if rc), 0))
(d / f"{role}.ready").write_text("")
time.sleep(60)
"""


def test_sigterm_to_the_wrapper_reaches_the_ranks_only(tmp_path):
    """A batch scheduler's SIGTERM to `smelt-ds train`: forwarded to the launcher's ranks (not to
    the launcher processes, whose own handling would lose the exit status), whose 143 comes back."""
    from smelt_ds.train.cli import run_launcher

    script = tmp_path / "fake.py"
    script.write_text(FAKE)

    def kill_when_ready() -> None:
        deadline = time.monotonic() + scaled_timeout(30)
        while time.monotonic() < deadline:
            if all((tmp_path / f"rank{i}.ready").exists() for i in range(2)):
                os.kill(os.getpid(), signal.SIGTERM)          # this process runs the wrapper
                return
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    rc = run_launcher([sys.executable, str(script), "runner", str(tmp_path)])
    killer.join()
    assert rc == 143
    assert sorted(p.name for p in tmp_path.glob("*.signal")) == ["rank0.signal", "rank1.signal"]
    assert (tmp_path / "rank0.signal").read_text() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before          # the wrapper's handler is gone again


def _logged_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]


def _cpu_allreduce_buffers(port: int) -> set[str]:
    """The names DeepSpeed's CPU collectives create in /dev/shm for the ranks of the run whose
    MASTER_PORT is ``port`` (smelt_ds.parallel.distributed.cpu_allreduce_buffer): not another run's,
    which tests running beside this one (pytest -n 2) may be starting."""
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")}


@pytest.mark.distributed
def test_ctrl_c_under_nproc_2_saves_a_checkpoint_and_exits_143(tmp_path, recipe):
    """Ctrl-C sends SIGINT to the terminal's foreground process group: the wrapper forwards it,
    both ranks save one checkpoint together, and the wrapper exits 143 without a traceback."""
    from smelt_ds.runs import checkpoint as ckpt

    run_dir = recipe.parent / "run"
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.txt").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "smelt_ds.cli", "train", str(recipe), "--nproc", "2",
                                 "--set", "train.max_steps=100000", "--set", "train.log_every=1",
                                 "--set", "train.save_every=100000", "--set", "train.eval_every=100000"],
                                cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + scaled_timeout(300)
        while not _logged_steps(run_dir / "metrics.jsonl"):
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("no training step logged in time")
            time.sleep(0.2)
        # DeepSpeed's CPU collectives' shared-memory files (66 MB a rank) lose their names once mapped
        port = re.search(r"--master_port (\d+)", (tmp_path / "err.txt").read_text())
        assert port, (tmp_path / "err.txt").read_text()[-3000:]
        assert _cpu_allreduce_buffers(int(port[1])) == set()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(scaled_timeout(120))
    stderr = (tmp_path / "err.txt").read_text()
    assert rc == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    saved = ckpt.latest_complete(run_dir)
    assert saved is not None
    assert sorted(p.name for p in saved.glob("client_rank*.pt")) == ["client_rank0.pt", "client_rank1.pt"]
    step = json.loads((saved / ckpt.MARKER).read_text())["step"]
    assert step == _logged_steps(run_dir / "metrics.jsonl")[-1]    # the step it stopped at, saved
    assert f"checkpoint step{step:08d} saved" in stderr
