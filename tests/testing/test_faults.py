"""smelt_ds.testing.faults: the specs, the environment that carries them, and what each fault does
to the loop's functions (on a stand-in for the loop module: no training here)."""

from __future__ import annotations

import builtins
import errno
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from smelt_ds.testing import faults
from smelt_ds.testing.faults import Fault, fault_env, parse_faults

ROOT = Path(__file__).resolve().parents[2]


def test_good_specs_parse():
    got = parse_faults("nan:rank=1:step=4; spike:rank=0:step=2:factor=1e3;;sleep:step=3:rank=1:seconds=2.5 ;"
                       "raise:rank=0:step=9;save_error:rank=1:step=6;save_error:rank=0:step=8:errno=eio;"
                       "exit:rank=1:step=5")
    assert [(f.kind, f.rank, f.step) for f in got] == [("nan", 1, 4), ("spike", 0, 2), ("sleep", 1, 3), ("raise", 0, 9),
                                                       ("save_error", 1, 6), ("save_error", 0, 8), ("exit", 1, 5)]
    assert got[1].factor == 1e3 and got[2].seconds == 2.5
    assert got[4].errno == errno.ENOSPC and got[5].errno == errno.EIO
    assert parse_faults(["nan:rank=0:step=1", "exit:rank=1:step=2;raise:rank=0:step=3"]) == \
        parse_faults("nan:rank=0:step=1;exit:rank=1:step=2;raise:rank=0:step=3")
    assert parse_faults(" ; ") == []


@pytest.mark.parametrize("spec, why", [
    ("boom:rank=1:step=2", "unknown kind 'boom'"),
    ("nan:rank=1", "nan needs step"),
    ("nan:rank1:step=2", "'rank1' is not key=value"),
    ("nan:rank=x:step=2", "rank='x' is not an integer"),
    ("nan:rank=-1:step=2", "rank=-1 is below 0"),
    ("nan:rank=0:step=0", "step=0 is below 1"),
    ("nan:rank=0:step=2:factor=3", "nan takes rank, step, not 'factor'"),
    ("nan:rank=0:step=2:step=3", "step given twice"),
    ("spike:rank=0:step=1", "spike needs factor"),
    ("spike:rank=0:step=1:factor=inf", "factor=inf is not a finite number"),
    ("sleep:rank=0:step=1:seconds=-1", "seconds=-1 is not a finite non-negative number"),
    ("save_error:rank=0:step=1:errno=EFOO", "errno='EFOO' is not one of"),
])
def test_a_bad_spec_is_named(spec, why):
    with pytest.raises(ValueError, match=rf"bad fault spec {spec!r}: {why}".replace("(", r"\(").replace(")", r"\)")):
        parse_faults(f"nan:rank=0:step=1;{spec}")
    with pytest.raises(ValueError, match="bad fault spec"):
        fault_env([spec])  # checked before any process starts


def test_fault_env_puts_the_site_directory_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/a" + os.pathsep + "/b")
    env = fault_env(["nan:rank=1:step=4", "sleep:rank=0:step=2:seconds=1"])
    assert env == {"PYTHONPATH": str(faults.SITE_DIR) + os.pathsep + "/a" + os.pathsep + "/b",
                   "SMELT_FAULTS": "nan:rank=1:step=4;sleep:rank=0:step=2:seconds=1"}
    monkeypatch.delenv("PYTHONPATH")
    assert fault_env("exit:rank=1:step=3")["PYTHONPATH"] == str(faults.SITE_DIR)
    assert sorted(p.name for p in faults.SITE_DIR.iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]


@pytest.mark.parametrize("environ, argv, training", [
    ({"RANK": "1"}, ["python", "-m", "deepspeed.launcher.launch"], True),
    ({"LOCAL_RANK": "0"}, ["python", "-c", "pass"], True),
    ({}, ["python", "-m", "smelt_ds.train", "r.yaml"], True),
    ({}, ["python", "-m", "smelt_ds.cli", "train", "r.yaml", "--nproc", "2"], True),
    ({}, ["/venv/bin/smelt-ds", "train", "r.yaml"], True),
    ({}, ["python", "-m", "smelt_ds.cli", "export", "run"], False),
    ({}, ["python", "-u", "-m", "deepspeed.launcher.runner", "--module", "smelt_ds.train"], False),
    ({}, ["python", "-m", "pytest"], False),
])
def test_only_training_processes_are_patched(environ, argv, training):
    assert faults.is_training_process(environ, argv) is training


def test_install_from_env_does_nothing_without_faults_or_outside_training(monkeypatch):
    hooks = list(sys.meta_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SMELT_FAULTS", " ")
    assert faults.install_from_env() is None
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SMELT_FAULTS", "nan:rank=0:step=1")
    assert faults.install_from_env() is None       # pytest is no training process
    assert sys.meta_path == hooks
    monkeypatch.setenv("SMELT_FAULTS", "nan:rank=0")
    with pytest.raises(ValueError, match="bad fault spec 'nan:rank=0'"):
        faults.install_from_env()


def _fake_loop():
    """A stand-in for smelt_ds.train.loop: ``_train_step`` calls the module's ``total_loss`` as the
    loop does, and counts the step."""
    loop = types.SimpleNamespace(calls=[])
    loop.total_loss = lambda out, cfg: out * 2.0

    def _train_step(fit):
        fit.weight = torch.tensor(1.5, requires_grad=True)
        loss = loop.total_loss(fit.weight, None)
        fit.step += 1
        return loss

    def sync_flag(flag):
        loop.calls.append(("sync_flag", flag))
        return flag

    loop._train_step, loop.sync_flag = _train_step, sync_flag
    return loop


def _patched(spec: str, rank: int):
    loop = _fake_loop()
    injector = faults._Injector(parse_faults(spec), rank)
    faults.patch_loop(loop, injector)
    return loop, injector


def test_nan_and_spike_change_the_loss_of_their_rank_and_step_only():
    loop, injector = _patched("nan:rank=1:step=3;spike:rank=1:step=4:factor=100;nan:rank=0:step=2", rank=1)
    fit = types.SimpleNamespace(step=0)
    losses = [float(loop._train_step(fit).detach()) for _ in range(5)]
    assert losses[:2] == [3.0, 3.0] and math.isnan(losses[2]) and losses[3] == 300.0 and losses[4] == 3.0
    assert fit.step == 5
    fit.step = 2                                     # step 3 again (a resume in the same process): fired once
    assert float(loop._train_step(fit).detach()) == 3.0
    assert float(loop.total_loss(torch.tensor(1.0), None)) == 2.0  # outside a step (validation): untouched
    loop, _ = _patched("nan:rank=0:step=1", rank=0)
    fit = types.SimpleNamespace(step=0)
    loop._train_step(fit).backward()
    assert math.isnan(float(fit.weight.grad))        # the NaN reaches the gradients


def test_raise_and_exit_fire_at_the_start_of_their_step(monkeypatch):
    loop, _ = _patched("raise:rank=0:step=2", rank=0)
    fit = types.SimpleNamespace(step=0)
    loop._train_step(fit)
    with pytest.raises(RuntimeError, match=r"^injected fault: rank 0 step 2$"):
        loop._train_step(fit)
    assert fit.step == 1                             # the step was not trained
    loop._train_step(fit)                            # fired once
    assert fit.step == 2

    exits = []

    class Exited(BaseException):
        pass

    def fake_exit(code):
        exits.append(code)
        raise Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    loop, _ = _patched("exit:rank=1:step=51", rank=1)
    fit = types.SimpleNamespace(step=50)             # resumed from step 50: the first step trained is 51
    with pytest.raises(Exited):
        loop._train_step(fit)
    assert exits == [137] and fit.step == 50


def test_sleep_happens_in_the_step_end_collective_of_its_step(monkeypatch):
    loop, _ = _patched("sleep:rank=0:step=2:seconds=7.5", rank=0)
    monkeypatch.setattr(faults.time, "sleep", lambda s: loop.calls.append(("sleep", s)))
    fit = types.SimpleNamespace(step=0)
    for _ in range(3):
        loop._train_step(fit)
        loop.sync_flag(False)
    assert loop.calls == [("sync_flag", False), ("sleep", 7.5), ("sync_flag", False), ("sync_flag", False)]


def test_save_error_fails_the_first_file_of_its_checkpoint_on_its_rank(tmp_path):
    step6 = tmp_path / "run" / "checkpoints" / "step00000006"
    step4 = step6.with_name("step00000004")
    step6.mkdir(parents=True)
    step4.mkdir()
    injector = faults._Injector(parse_faults("save_error:rank=1:step=6;save_error:rank=1:step=4:errno=EACCES;"
                                             "save_error:rank=0:step=6:errno=EIO"), rank=1)
    open_ = faults._failing_open(injector, builtins.open)
    with open_(tmp_path / "other.pt", "wb") as f:   # outside the checkpoint: written
        f.write(b"x")
    with open_(step6 / "a.pt", "wb") as f, pytest.raises(OSError) as e:
        f.write(b"data")                             # a full disk answers the write
    assert e.value.errno == errno.ENOSPC and (step6 / "a.pt").read_bytes() == b""
    with open_(step6 / "b.pt", "wb") as f:           # fired once
        f.write(b"ok")
    with pytest.raises(PermissionError) as e:
        open_(step4 / "c.pt", "wb")                  # a permission error answers the open
    assert e.value.errno == errno.EACCES and e.value.filename == str(step4 / "c.pt")
    with open_(step6 / "b.pt", "rb") as f:           # reading is never failed
        assert f.read() == b"ok"


@pytest.mark.slow
def test_sitecustomize_patches_the_loop_of_a_rank(tmp_path):
    """The environment of fault_env patches smelt_ds.train.loop when a rank imports it."""
    code = ("import builtins, smelt_ds.train.loop as loop; "
            "print(all(hasattr(f, '__wrapped__') for f in (loop._train_step, loop.total_loss, builtins.open)))")
    env = {**os.environ, **fault_env(["save_error:rank=1:step=2", "nan:rank=1:step=1"]), "RANK": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_faults_are_frozen_records():
    f = parse_faults("spike:rank=2:step=7:factor=-3")[0]
    assert f == Fault("spike", 2, 7, factor=-3.0, spec="spike:rank=2:step=7:factor=-3")
