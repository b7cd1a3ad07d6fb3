"""Several real hosts on one Linux machine, for multi-node tests: a test bed of namespaces.

A cluster's nodes differ in ways that processes of one host never do: each node has its own host
name, its own IP address, its own ``/dev/shm`` and its own clock, and a job reaches the others by
name through ``srun``, ``ssh`` or ``pdsh``. :func:`multi_host_bed` gives a test ``n`` such hosts:

- **network**: each host is a network namespace with one interface, ``eth0``, on a private
  subnet (10.77.0.0/24), attached to a bridge that lives in a namespace of its own (the
  "switch"), so the machine's own interfaces are never touched and nothing is left behind when the
  bed closes (a namespace ends with its last process; the processes holding them die with the
  process that built the bed, even when it is killed, though its temporary directory then stays).
  ``lo`` is up in every host.
- **UTS**: each host has its own host name (``host0``, ``host1``, ...), and every host's
  ``/etc/hosts`` (a bind mount in its mount namespace) names all the bed's hosts, so a job
  resolves ``host0`` to an address on the bed, as a cluster's DNS would.
- **mount**: each host has its own ``/dev/shm`` (a tmpfs). The rest of the file system is shared,
  as a cluster's shared file system is.
- **clock** (optional): a host's wall clock can run ahead or behind by a number of seconds. A
  preload library the bed compiles with the system C compiler (``cc``, the one DeepSpeed's ops
  build with) adds the offset to ``CLOCK_REALTIME`` as ``clock_gettime``, ``gettimeofday`` and
  ``time`` return it, in every process started on that host (``LD_PRELOAD``). The monotonic clock,
  sleeps and timed waits are untouched, as on a real host whose clock is off. Files' times come from
  the kernel, as a shared file system's come from its server, so a skewed host sees other hosts'
  files at the wrong age, which is the hazard. (libfaketime, the usual tool, was tried: Debian 12's
  0.9.10 makes Python 3.11's ``time.sleep`` fail with EINVAL when the monotonic clock is left alone,
  and stretches ``threading.Event.wait`` by the offset when it is not.)

What is NOT separated: process ids (one pid namespace: a pid names the same process on every
host), the user database, the CPU and its features, and the file system beyond ``/dev/shm``.

Commands enter a host through ``nsenter`` (:meth:`Host.argv`, :meth:`Host.popen`). The bed's
``bin/`` directory (:attr:`Bed.bin_dir`, put it first on ``PATH``) holds stand-ins for the
tools a job uses to reach other nodes, each entering the named host and running the command there
with the caller's environment (real ``ssh`` starts a login shell instead; the jobs here export
what they need):

- ``srun`` (options ignored; one task per host of ``SLURM_JOB_NODELIST`` with ``SLURM_NODEID``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURMD_NODENAME`` set; SIGTERM/SIGINT forwarded to every
  task, exit status the largest of the tasks', as ``srun --kill-on-bad-exit`` reports);
- ``scontrol`` (``requeue JOBID`` appends a line to ``<bed>/scontrol.log``; ``show hostnames``
  expands like Slurm's);
- ``ssh [-o OPT]... [-p PORT] HOST COMMAND...``;
- ``pdsh -S -f N -w HOST,HOST COMMAND...`` (``%n`` becomes the host's index in the list, ``%h``
  its name, as pdsh's exec module does; output lines are prefixed ``HOST: ``).

:func:`bed_unavailable` says why a bed cannot be built here (not root, no namespaces, no ``ip``),
for a test to skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from smelt_ds.launch.jobs import expand_nodelist

__all__ = ["BED_ENV", "CLOCK_OFFSET_ENV", "Bed", "Host", "bed_unavailable", "multi_host_bed"]

#: environment variable naming a bed's state file (``bed.json``), read by the stand-in tools
BED_ENV = "SMELT_TEST_BED"
#: environment variable the clock-skew preload reads: nanoseconds added to the wall clock
CLOCK_OFFSET_ENV = "SMELT_BED_CLOCK_OFFSET_NS"
_SKEW_LIB = "libsmelt_clock_skew.so"
_SKEW_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

int clock_gettime(clockid_t id, struct timespec *ts) {
    static clock_gettime_fn real;
    static long long offset_ns;
    static int ready;
    if (!real) real = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    if (!ready) {
        const char *s = getenv("SMELT_BED_CLOCK_OFFSET_NS");
        offset_ns = s ? atoll(s) : 0;
        ready = 1;
    }
    int rc = real(id, ts);
    if (rc == 0 && offset_ns != 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
        if (ts->tv_nsec < 0) { ts->tv_nsec += 1000000000LL; ts->tv_sec -= 1; }
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return rc;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""


def _ns_probe() -> str | None:
    try:
        r = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode != 0:
        return f"network/UTS/mount namespaces are not permitted here (unshare: {r.stderr.strip()})"
    return None


def bed_unavailable(clock: bool = False) -> str | None:
    """Why :func:`multi_host_bed` cannot run on this machine (``None`` when it can): not root, no
    ``unshare``/``nsenter``/``ip``, namespaces refused (a container without ``CAP_SYS_ADMIN``), or,
    with ``clock``, no C compiler for the clock-skew preload."""
    if os.geteuid() != 0:
        return "a multi-host bed needs root (network, UTS and mount namespaces)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"a multi-host bed needs `{tool}` (util-linux / iproute2)"
    if (why := _ns_probe()) is not None:
        return why
    if clock and shutil.which("cc") is None:
        return "a skewed clock needs a C compiler (`cc`) to build its preload library"
    return None


@dataclass
class Host:
    """One host of a :class:`Bed`: ``name`` (its host name), ``ip`` (of its ``eth0``), ``pid`` (a
    process holding its namespaces), ``index`` (0-based), ``clock_offset_s`` (seconds its wall clock
    is ahead, negative behind; ``None``: the machine's clock)."""

    name: str
    ip: str
    pid: int
    index: int
    clock_offset_s: float | None = None
    bed_file: Path | None = None
    skew_lib: Path | None = None

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) as a process on this host gets it: this
        host's clock (the skew preload and its offset set, or removed when the host's clock is the
        machine's),
        and :data:`BED_ENV` naming the bed for the stand-in tools."""
        env = dict(os.environ if base is None else base)
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and _SKEW_LIB not in p]
        env.pop(CLOCK_OFFSET_ENV, None)
        if self.clock_offset_s is not None:
            if self.skew_lib is None:
                raise RuntimeError(f"multi-host bed: {self.name} has a clock offset but no skew library")
            preload.append(str(self.skew_lib))
            env[CLOCK_OFFSET_ENV] = str(round(self.clock_offset_s * 1e9))
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        else:
            env.pop("LD_PRELOAD", None)
        if self.bed_file is not None:
            env[BED_ENV] = str(self.bed_file)
        return env

    def argv(self, cmd: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``cmd`` run inside this host's network, UTS and mount namespaces (``nsenter``), in
        ``cwd`` (default: the caller's working directory)."""
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", f"--target={self.pid}", "--net", "--uts", "--mount", f"--wd={wd}", "--", *cmd]

    def popen(self, cmd: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` on this host (``nsenter`` execs it: the returned process is ``cmd``
        itself, so a signal sent to it reaches the command). ``env`` is passed through :meth:`env`."""
        return subprocess.Popen(self.argv(cmd, cwd), env=self.env(env), **kw)

    def run(self, cmd: Sequence[str], env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` on this host to its end (:func:`subprocess.run`'s keywords)."""
        return subprocess.run(self.argv(cmd, cwd), env=self.env(env), **kw)


@dataclass
class Bed:
    """A set of :class:`Host` s, built by :func:`multi_host_bed`; ``root`` holds its state
    (``bed.json``, ``hosts``, the stand-ins in ``bin/``, ``scontrol.log``)."""

    hosts: list[Host]
    root: Path
    _anchors: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def bin_dir(self) -> Path:
        """Directory of the stand-in ``srun``, ``scontrol``, ``ssh`` and ``pdsh``."""
        return self.root / "bin"

    @property
    def nodelist(self) -> str:
        """The hosts as a Slurm node list (``host[0-1]``)."""
        return f"host[0-{len(self.hosts) - 1}]" if len(self.hosts) > 1 else self.hosts[0].name

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` with the stand-ins first on ``PATH`` and :data:`BED_ENV` set."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        env[BED_ENV] = str(self.root / "bed.json")
        return env

    def requeues(self) -> list[str]:
        """The job ids ``scontrol requeue`` was called with, in order."""
        log = self.root / "scontrol.log"
        return log.read_text().split() if log.exists() else []

    def close(self) -> None:
        """End every host (its namespaces end with their last process)."""
        for proc in self._anchors:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _sh(cmd: Sequence[str]) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"multi-host bed: `{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``, kept across exec), so a bed whose owner is killed leaves no host behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _anchor(args: Sequence[str], script: str) -> subprocess.Popen:
    """A process in new namespaces (``unshare ARGS``) that runs ``script``, prints ``ready`` and
    then sleeps until killed, or until the process that built the bed dies: it holds the
    namespaces."""
    proc = subprocess.Popen(["unshare", *args, "sh", "-ec", f"{script}\necho ready\nexec sleep infinity"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_die_with_parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"multi-host bed: a namespace did not start: {err.strip() or line!r}")
    return proc


def _build_skew_lib(root: Path) -> Path:
    """Compile the clock-skew preload (:data:`CLOCK_OFFSET_ENV`) into ``root``."""
    src, lib = root / "clock_skew.c", root / _SKEW_LIB
    src.write_text(_SKEW_C)
    _sh(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"])
    return lib


_STANDIN = """#!/bin/sh
exec {python} -m smelt_ds.testing.hosts {tool} "$@"
"""


@contextlib.contextmanager
def multi_host_bed(n: int = 2, clock_offsets_s: Mapping[int, float] | None = None,
                   root: str | os.PathLike[str] | None = None) -> Iterator[Bed]:
    """Build ``n`` hosts (``host0`` ... with addresses 10.77.0.11, .12, ...), yield the
    :class:`Bed`, and end every host on exit.

    ``clock_offsets_s`` maps a host's index to the seconds its wall clock is ahead (negative:
    behind). ``root`` is the directory for the bed's state (default: a new temporary one, removed on
    exit). Raises :class:`RuntimeError` naming the step that failed (call :func:`bed_unavailable`
    first to skip instead) and :class:`ValueError` for ``n`` < 1 or an offset for no host."""
    if n < 1:
        raise ValueError(f"multi_host_bed: n={n}: a bed has at least one host")
    offsets = dict(clock_offsets_s or {})
    if bad := sorted(set(offsets) - set(range(n))):
        raise ValueError(f"multi_host_bed: clock offsets for hosts {bad}, but the hosts are 0..{n - 1}")
    own_root = root is None
    base = Path(tempfile.mkdtemp(prefix="smelt-bed-")) if root is None else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    (base / "bin").mkdir(exist_ok=True)
    for tool in ("srun", "scontrol", "ssh", "pdsh"):
        (base / "bin" / tool).write_text(_STANDIN.format(python=shlex.quote(sys.executable), tool=tool))
        (base / "bin" / tool).chmod(0o755)
    names = [f"host{i}" for i in range(n)]
    ips = [f"10.77.0.{11 + i}" for i in range(n)]
    hosts_file = base / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for ip, name in zip(ips, names,
                                                                                                 strict=True)))
    skew_lib = _build_skew_lib(base) if offsets else None
    bed = Bed(hosts=[], root=base)
    try:
        switch = _anchor(["--net"], "ip link add br0 type bridge\nip link set br0 up")
        bed._anchors.append(switch)
        for i, (name, ip) in enumerate(zip(names, ips, strict=True)):
            script = "\n".join([
                f"hostname {name}",
                "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm",
                f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts",
                "ip link set lo up",
            ])
            proc = _anchor(["--net", "--uts", "--mount", "--propagation", "private"], script)
            bed._anchors.append(proc)
            sw = ["nsenter", f"--target={switch.pid}", "--net"]
            _sh([*sw, "ip", "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid)])
            _sh([*sw, "ip", "link", "set", f"v{i}", "master", "br0", "up"])
            inside = ["nsenter", f"--target={proc.pid}", "--net"]
            _sh([*inside, "ip", "addr", "add", f"{ip}/24", "dev", "eth0"])
            _sh([*inside, "ip", "link", "set", "eth0", "up"])
            bed.hosts.append(Host(name=name, ip=ip, pid=proc.pid, index=i, clock_offset_s=offsets.get(i),
                                  bed_file=base / "bed.json", skew_lib=skew_lib))
        (base / "bed.json").write_text(json.dumps({"root": str(base), "hosts": [
            {"name": h.name, "ip": h.ip, "pid": h.pid, "index": h.index, "clock_offset_s": h.clock_offset_s}
            for h in bed.hosts], "skew_lib": str(skew_lib) if skew_lib else None}))
        yield bed
    finally:
        bed.close()
        if own_root:
            shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the stand-in tools (python -m smelt_ds.testing.hosts TOOL ARGS...)
# ---------------------------------------------------------------------------------------------


def _load_bed() -> Bed:
    path = os.environ.get(BED_ENV)
    if not path:
        sys.exit(f"smelt-ds bed: {BED_ENV} is not set: run the stand-ins through a bed's environment")
    if not Path(path).is_file():
        sys.exit(f"smelt-ds bed: {BED_ENV}={path}: no such bed state file (the bed has closed, or the path is wrong)")
    state = json.loads(Path(path).read_text())
    lib = Path(state["skew_lib"]) if state.get("skew_lib") else None
    hosts = [Host(name=h["name"], ip=h["ip"], pid=h["pid"], index=h["index"], clock_offset_s=h["clock_offset_s"],
                  bed_file=Path(path), skew_lib=lib) for h in state["hosts"]]
    return Bed(hosts=hosts, root=Path(state["root"]))


def _host(bed: Bed, name: str) -> Host:
    for h in bed.hosts:
        if name in (h.name, h.ip):
            return h
    sys.exit(f"smelt-ds bed: no host {name!r} (the bed's hosts: {', '.join(h.name for h in bed.hosts)})")


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """Wait for every process, forwarding SIGTERM/SIGINT/SIGUSR1 to each; the largest exit status
    (a signal's death counts as 128 + its number)."""
    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]  # a handled signal does not interrupt the wait (PEP 475)
    return max((128 - rc if rc < 0 else rc for rc in codes), default=0)


def _srun(bed: Bed, argv: list[str]) -> int:
    while argv and argv[0].startswith("-"):
        argv.pop(0)
    if not argv:
        sys.exit("srun (bed stand-in): no command")
    names = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", bed.nodelist))
    procs = []
    for node_id, name in enumerate(names):
        host = _host(bed, name)
        env = {**os.environ, "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0",
               "SLURMD_NODENAME": host.name, "SLURM_NNODES": str(len(names)), "SLURM_NTASKS": str(len(names))}
        procs.append(host.popen(argv, env=env))
    return _wait_all(procs)


def _scontrol(bed: Bed, argv: list[str]) -> int:
    if argv[:1] == ["requeue"] and len(argv) == 2:
        with (bed.root / "scontrol.log").open("a") as f:
            f.write(argv[1] + "\n")
        return 0
    if argv[:2] == ["show", "hostnames"] and len(argv) == 3:
        print("\n".join(expand_nodelist(argv[2])))
        return 0
    sys.exit(f"scontrol (bed stand-in): unsupported: {shlex.join(argv)}")


def _ssh(bed: Bed, argv: list[str]) -> int:
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt in ("-o", "-p", "-l", "-i") and argv:
            argv.pop(0)
    if len(argv) < 1:
        sys.exit("ssh (bed stand-in): no host")
    host = _host(bed, argv[0].split("@")[-1])
    return host.run(["bash", "-c", " ".join(argv[1:]) or "bash"]).returncode


def _prefix(stream, name: str, out) -> None:
    for line in stream:
        out.write(f"{name}: {line}")
        out.flush()


def _pdsh(bed: Bed, argv: list[str]) -> int:
    hosts: list[str] = []
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt == "-w":
            hosts = [h for h in argv.pop(0).split(",") if h]
        elif opt in ("-f", "-R", "-l", "-u", "-t"):
            argv.pop(0)
    if not hosts or not argv:
        sys.exit("pdsh (bed stand-in): usage: pdsh [-S] [-f N] -w HOST[,HOST...] COMMAND...")
    command = " ".join(argv)
    procs, threads = [], []
    for n, name in enumerate(hosts):
        host = _host(bed, name)
        cmd = command.replace("%n", str(n)).replace("%h", host.name)
        p = host.popen(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        t = threading.Thread(target=_prefix, args=(p.stdout, name, sys.stdout), daemon=True)
        t.start()
        threads.append(t)
    rc = _wait_all(procs)
    for t in threads:
        t.join(timeout=5)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    """The stand-in tools: ``python -m smelt_ds.testing.hosts srun|scontrol|ssh|pdsh ARGS...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    tools = {"srun": _srun, "scontrol": _scontrol, "ssh": _ssh, "pdsh": _pdsh}
    if not args or args[0] not in tools:
        sys.exit(f"usage: python -m smelt_ds.testing.hosts {{{','.join(tools)}}} ARGS...")
    return tools[args[0]](_load_bed(), args[1:])


if __name__ == "__main__":
    sys.exit(main())
