"""A torch extension build lock left by an interrupted build is named before DeepSpeed starts; a
lock some process holds (a rank building right now) is not.

The builder here is torch's own ``FileBaton`` (what ``torch.utils.cpp_extension`` builds under) in
a child process: killed with SIGKILL while holding the baton it leaves the same file an
interrupted DeepSpeed op build leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.parallel.build_lock import check_build_lock, lock_holders, stale_lock

#: a builder: takes torch's FileBaton on the lock, says so, then waits (killed or told to release);
#: torch/utils/file_baton.py is loaded by path (it needs only os and time), sparing the child torch's import
BUILDER = """
import importlib.util, os, sys
root = os.path.dirname(importlib.util.find_spec("torch").origin)
spec = importlib.util.spec_from_file_location("file_baton", os.path.join(root, "utils", "file_baton.py"))
file_baton = importlib.util.module_from_spec(spec)
spec.loader.exec_module(file_baton)
assert "torch" not in sys.modules
baton = file_baton.FileBaton(sys.argv[1])
assert baton.try_acquire()
print("acquired", flush=True)
if sys.stdin.readline().strip() == "release":
    baton.release()
"""


def _builder(lock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "acquired"
    return proc


def test_lock_of_a_killed_builder_is_stale_and_named_with_the_command_to_remove_it(tmp_path):
    lock = tmp_path / "lock"
    proc = _builder(lock)
    assert lock_holders(lock) == [proc.pid]
    assert stale_lock(tmp_path, recheck_s=0.05) is None  # building: the other rank waits, as torch does
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock.exists() and lock_holders(lock) == []
    assert stale_lock(tmp_path, recheck_s=0.05) == lock
    with pytest.raises(ConfigError, match=rf"deepspeed op cpu_adam: the build lock {lock} was left by an interrupted "
                                          rf"build .*\(rm {lock}\)"):
        check_build_lock(tmp_path, "cpu_adam", recheck_s=0.05)
    assert lock.exists()  # never removed here: a builder on another machine sharing the directory is invisible


def test_a_builder_that_finishes_leaves_nothing_to_report(tmp_path):
    proc = _builder(tmp_path / "lock")
    proc.communicate("release\n")
    assert not (tmp_path / "lock").exists()
    assert stale_lock(tmp_path, recheck_s=0.05) is None
    check_build_lock(tmp_path, "cpu_adam", recheck_s=0.05)


def test_a_lock_held_open_by_this_process_is_not_stale(tmp_path):
    lock = tmp_path / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # what FileBaton.try_acquire does
    try:
        assert lock_holders(lock) == [os.getpid()]
        assert stale_lock(tmp_path, recheck_s=0.05) is None
    finally:
        os.close(fd)
    assert stale_lock(tmp_path, recheck_s=0.05) == lock


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_lock_that_changes_during_the_recheck_is_not_stale(tmp_path, change):
    """The builder closes its descriptor a moment before deleting the file (and a new build may
    create a new one): a lock that is gone or another file after the recheck is not reported."""
    lock = tmp_path / "lock"
    lock.write_text("")

    def act():
        lock.unlink()
        if change == "replaced":
            (tmp_path / "new").write_text("")
            os.utime(tmp_path / "new", ns=(1, 1))
            (tmp_path / "new").rename(lock)

    timer = threading.Timer(0.05, act)
    timer.start()
    try:
        assert stale_lock(tmp_path, recheck_s=0.5) is None
    finally:
        timer.join()


def test_training_start_refuses_a_stale_deepspeed_op_lock(tmp_path, monkeypatch):
    """The place a run prints 'reusing the build cached in ...' checks the op's lock first."""
    from torch.utils.cpp_extension import _get_build_directory

    from smelt_ds.train.loop import _deepspeed_op_notices

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if not _deepspeed_op_notices(("ShareMemCommBuilder",)):
        pytest.skip("this DeepSpeed ships the shared-memory op prebuilt or does not use it here")
    where = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    assert where.is_relative_to(tmp_path)
    (where / "lock").write_text("")
    with pytest.raises(ConfigError, match=rf"deepspeed op deepspeed_shm_comm: the build lock {where / 'lock'} "):
        _deepspeed_op_notices(("ShareMemCommBuilder",))
