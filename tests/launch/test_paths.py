"""Every path a job uses, checked as the job will use it (``smelt-ds preflight``'s ``paths`` check,
``render-job``): directories it writes can be created and written (and nothing is left behind),
inputs can be read, the Slurm log directory is absolute in the script and never a traceback, and
paths on a node-local file system are named for a job on several nodes (an error with
``--require-shared``); a Kubernetes pod's paths are judged against its volumes; every source not
found is named, with the working directory and ``--workdir``."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from smelt_ds.cli import main as cli_main
from tests.data.token_test_utils import word_tokenizer
from tests.launch.test_preflight import _rows

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "smelt.yaml")
ONE = ["--nodes", "1", "--gpus-per-node", "1"]


def _entries(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def test_unwritable_directories_are_refused_naming_the_field_value_and_fix(tmp_path, capsys, monkeypatch):
    """The issue's cases: a run directory or cache under /proc (no directory can be created there,
    not even by root) passed preflight and render-job; a parent that is a file; an absent
    directory that can be created passes and is not left behind."""
    monkeypatch.chdir(tmp_path)
    for sets, field, value, fix in (
            (["train.run_dir=/proc/smelt-runs"], "train.run_dir", "/proc/smelt-runs", "--set train.run_dir=DIR"),
            (["data.cache_dir=/proc/cache"], "data.cache_dir", "/proc/cache", "--set data.cache_dir=DIR"),
            ([f"data.output_dir={tmp_path / 'afile' / 'shards'}"], "data.output_dir", str(tmp_path / "afile/shards"),
             "--set data.output_dir=DIR")):
        (tmp_path / "afile").write_text("a file, not a directory")
        assert cli_main(["preflight", TINY, *ONE, *[x for s in sets for x in ("--set", s)]]) == 2
        status, detail = _rows(capsys.readouterr().out)["paths"]
        assert status == "FAIL" and detail.startswith(f"{field} ({value!r}): ") and fix in detail, detail
        why = "is a file, not a directory" if "afile" in value else "cannot create a directory in /proc"
        assert why in detail, detail

    before = _entries(tmp_path)
    run = tmp_path / "new" / "deeper" / "run"  # absent: training creates it; the check must not leave it
    cache = tmp_path / "cache"
    cache.mkdir()
    assert cli_main(["preflight", TINY, *ONE, "--set", f"train.run_dir={run}", "--set", f"data.cache_dir={cache}"]) == 0
    status, detail = _rows(capsys.readouterr().out)["paths"]
    assert status == "OK" and detail.startswith("writable: train.run_dir, data.cache_dir, the log directory"), detail
    assert _entries(tmp_path) == before | {cache}  # nothing created, nothing left behind
    assert not (tmp_path / "new").exists() and list(cache.iterdir()) == []

    jobs = tmp_path / "jobs"
    for extra, flag in ((["--run-dir", "/proc/smelt-runs"], "--run-dir"),
                        (["--set", "data.cache_dir=/proc/cache"], "data.cache_dir")):
        assert cli_main(["render-job", TINY, "--scheduler", "slurm", *ONE, *extra, "-o", str(jobs / "a.sbatch")]) == 2
        err = capsys.readouterr().err
        assert f"paths: {flag} ('/proc/" in err and "nothing written" in err, err
    assert not jobs.exists()


def test_slurm_log_directory_is_absolute_and_an_unwritable_one_is_an_error_not_a_traceback(tmp_path, capsys,
                                                                                         monkeypatch):
    """`--log-dir /proc/slurm-logs -o jobs/x.sbatch` wrote the job, then ended in a
    FileNotFoundError traceback; a relative --log-dir was created in render-job's own directory
    and left relative in the script (sbatch resolves it in the directory it is called from)."""
    wd, elsewhere = tmp_path / "wd", tmp_path / "elsewhere"
    wd.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = ["render-job", TINY, "--scheduler", "slurm", *ONE, "--workdir", str(wd)]
    for force in ([], ["--force"]):  # --force overrides failed checks, never the log directory
        assert cli_main([*job, "--log-dir", "/proc/slurm-logs", "-o", "jobs/x.sbatch", *force]) == 2
        err = capsys.readouterr().err
        assert "--log-dir ('/proc/slurm-logs'): " in err and "--log-dir DIR" in err, err
        assert "nothing written" in err and "Traceback" not in err
        assert not (elsewhere / "jobs").exists()

    assert cli_main([*job, "--log-dir", "logs", "-o", "jobs/y.sbatch"]) == 0
    capsys.readouterr()
    script = (elsewhere / "jobs" / "y.sbatch").read_text()
    assert f"#SBATCH --output={wd}/logs/%x-%j.out\n" in script  # absolute: where the job runs
    assert (wd / "logs").is_dir() and not (elsewhere / "logs").exists()


def test_an_unreadable_input_and_a_missing_interpreter_are_named(tmp_path, capsys, monkeypatch):
    """An input the job cannot read (mode 000; as root, the check runs as user nobody, since root
    reads anything) and an interpreter (SMELT_PYTHON) that does not exist."""
    from smelt_ds.launch.paths import JobPath, unreadable

    top = Path(tempfile.mkdtemp(dir="/tmp"))  # searchable by any user, unlike pytest's tmp_path
    try:
        top.chmod(0o755)
        secret = top / "corpus.txt"
        secret.write_text("text\n")
        secret.chmod(0)
        p = JobPath("data.sources[0].path", str(secret), str(secret))
        euid = os.geteuid()
        if euid == 0:
            os.seteuid(65534)
        try:
            why = unreadable(p)
            readable_dir = unreadable(JobPath("--workdir", str(top), str(top)))
        finally:
            if euid == 0:
                os.seteuid(0)
        assert why == f"not readable by this user (uid {65534 if euid == 0 else euid})" and readable_dir is None
        secret.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        assert unreadable(p) is None
    finally:
        secret.unlink()
        top.rmdir()

    monkeypatch.setenv("SMELT_PYTHON", str(tmp_path / "venv" / "bin" / "python"))
    assert cli_main(["preflight", TINY, *ONE]) == 2
    status, detail = _rows(capsys.readouterr().out)["paths"]
    assert status == "FAIL" and detail.startswith(f"SMELT_PYTHON ('{tmp_path}/venv/bin/python'): no such file: "
                                                  "export SMELT_PYTHON="), detail
    monkeypatch.setenv("SMELT_PYTHON", "python3")  # a command name: the one on PATH
    assert cli_main(["preflight", TINY, *ONE]) == 0
    capsys.readouterr()


# (mount point, type, device) as psutil.disk_partitions(all=True) lists them, in mount order
TABLE = [("/", "ext4", "/dev/nvme0n1p2"), ("/shared", "nfs4", "filer:/export"),
         ("/lustre", "lustre", "10.0.0.1@o2ib:/fs"), ("/local", "xfs", "/dev/nvme1n1"),
         ("/mnt/a", "nfs", "filer:/a"), ("/mnt/a", "tmpfs", "tmpfs"), ("/gluster", "fuse.glusterfs", "gl:/vol"),
         ("/img", "squashfs", "/dev/loop0"), ("/tmp", "nfs", "filer:/tmp"), ("/ctr", "overlay", "overlay")]


@pytest.mark.parametrize("path,mountpoint,fstype,locality", [
    ("/shared/proj/data/corpus.bin", "/shared", "nfs4", "shared"),
    ("/lustre/u/runs/m", "/lustre", "lustre", "shared"),
    ("/gluster/cache", "/gluster", "fuse.glusterfs", "shared"),
    ("/local/nvme/cache", "/local", "xfs", "node-local"),       # a local disk
    ("/opt/venv-that-is-not-here/bin", "/", "ext4", "node-local"),  # the root disk
    ("/mnt/a/x", "/mnt/a", "tmpfs", "node-local"),              # two mounts on one point: the last one
    ("/mnt/ab/x", "/", "ext4", "node-local"),                   # /mnt/ab is not under /mnt/a
    ("/tmp/run", "/tmp", "nfs", "node-local"),                  # /tmp is each node's own, whatever holds it
    ("/ctr/workspace", "/ctr", "overlay", "node-local"),        # a container's root
    ("/img/data", "/img", "squashfs", "unknown"),               # not listed either way: no warning
])
def test_file_system_judges_a_fabricated_mount_table(path, mountpoint, fstype, locality):
    from smelt_ds.launch.paths import file_system

    fs = file_system(path, TABLE)
    assert (fs.mountpoint, fs.fstype, fs.locality) == (mountpoint, fstype, locality)


def test_file_system_on_this_machines_mount_table():
    """/tmp and the checkout, judged by the real mount table (psutil's view of /proc/self/mounts),
    against the longest mount point holding them in /proc/self/mountinfo, read here directly."""
    from smelt_ds.launch.paths import NODE_LOCAL_TYPES, SHARED_TYPES, file_system

    mountinfo = Path("/proc/self/mountinfo")
    if not mountinfo.exists():
        pytest.skip("no /proc/self/mountinfo (not Linux)")
    mounts = []  # (mount point, type): field 5, and the first field after " - "; octal escapes (\040) decoded
    for line in mountinfo.read_text().splitlines():
        left, right = line.split(" - ", 1)
        point = left.split()[4].encode().decode("unicode_escape")
        mounts.append((point, right.split()[0]))
    for path in ("/tmp", str(ROOT)):
        real = os.path.realpath(path)
        held = [(p, t) for p, t in mounts if real == p or real.startswith(p.rstrip("/") + "/")]
        point, fstype = max(reversed(held), key=lambda m: len(m[0]))  # longest; of equal ones the last mounted
        fs = file_system(path)
        assert (fs.mountpoint, fs.fstype) == (point, fstype), (path, fs)
        expected = ("node-local" if path == "/tmp" or fstype in NODE_LOCAL_TYPES else
                    "shared" if fstype in SHARED_TYPES or fstype.split(".")[0] in SHARED_TYPES else "unknown")
        assert fs.locality == expected, (path, fs)


def _token_recipe(base: Path) -> list[str]:
    """--set overrides of a recipe whose data, tokenizer, cache and run directory lie under ``base``."""
    word_tokenizer(base / "tok.json", 1000)
    np.save(base / "toks.npy", (np.arange(4000) % 900).astype(np.uint16))
    sets = [f"data.sources=[{{tokens: {base / 'toks.npy'}, eot_id: 0}}]", f"data.tokenizer.path={base / 'tok.json'}",
            f"data.cache_dir={base / 'cache'}", f"train.run_dir={base / 'run'}", "model.vocab_size=1024"]
    return [x for s in sets for x in ("--set", s)]


def test_node_local_paths_of_a_multi_node_job_warn_and_fail_with_require_shared(tmp_path, capsys, monkeypatch):
    """The issue's case: data, tokenizer, cache, run directory and SMELT_PYTHON all under /tmp
    passed for a 4-node job with no warning. Each is named; --require-shared refuses the job at
    preflight and render-job; one node is not judged."""
    sets = _token_recipe(tmp_path)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # a virtual environment's python: a link to the base one
    monkeypatch.setenv("SMELT_PYTHON", str(venv / "python"))
    monkeypatch.chdir(tmp_path)
    four = ["--nodes", "4", "--gpus-per-node", "1", "--workdir", str(ROOT)]
    assert cli_main(["preflight", TINY, *four, *sets]) == 0
    status, detail = _rows(capsys.readouterr().out)["paths"]
    assert status == "WARN" and "node-local paths for a job on 4 nodes: " in detail, detail
    assert "under /tmp, a node's own temporary directory: " in detail and \
        detail.endswith("(--require-shared makes this an error)"), detail  # the checkout's disk depends on the host
    for what in (f"SMELT_PYTHON ({venv / 'python'})", f"data.sources[0].tokens ({tmp_path / 'toks.npy'})",
                 f"data.tokenizer.path ({tmp_path / 'tok.json'})", f"train.run_dir ({tmp_path / 'run'})",
                 f"data.cache_dir ({tmp_path / 'cache'})"):
        assert what in detail, (what, detail)

    assert cli_main(["preflight", TINY, *four, *sets, "--require-shared"]) == 2
    status, detail = _rows(capsys.readouterr().out)["paths"]
    assert status == "FAIL" and detail.startswith("node-local paths for a job on 4 nodes") and \
        detail.endswith("(--require-shared)"), detail
    out = tmp_path / "job.sbatch"
    assert cli_main(["render-job", TINY, "--scheduler", "slurm", *four, *sets, "--require-shared", "-o", str(out)]) == 2
    assert "paths: node-local paths for a job on 4 nodes" in capsys.readouterr().err and not out.exists()
    assert cli_main(["render-job", TINY, "--scheduler", "slurm", *four, *sets, "-o", str(out)]) == 0
    assert "smelt-ds render-job: warning: paths: " in capsys.readouterr().err and out.is_file()

    assert cli_main(["preflight", TINY, *ONE, *sets, "--require-shared"]) == 0  # one node: its own paths are fine
    assert _rows(capsys.readouterr().out)["paths"][0] == "OK"


def test_require_shared_follows_the_mount_table(tmp_path, capsys, monkeypatch):
    """The same job with the mount table fabricated (and no temporary-directory names): on NFS it
    passes, with its run directory on a local xfs disk it warns, naming that mount, and fails with
    --require-shared."""
    import smelt_ds.launch.paths as paths

    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.setattr(paths, "NODE_TEMP_DIRS", ())
    table = [("/", "nfs4", "filer:/export")]
    monkeypatch.setattr(paths, "mount_table", lambda: table)
    two = ["--nodes", "2", "--gpus-per-node", "1", "--set", f"train.run_dir={local / 'run'}"]
    assert cli_main(["preflight", TINY, *two, "--require-shared"]) == 0
    assert _rows(capsys.readouterr().out)["paths"] == ("OK", "writable: train.run_dir, the data cache (default), the "
                                                       "log directory (default WORKDIR/runs/slurm-logs); 3 input(s) "
                                                       "readable; none on a node-local file system")
    table.append((str(local), "xfs", "/dev/nvme1n1"))
    assert cli_main(["preflight", TINY, *two]) == 0
    status, detail = _rows(capsys.readouterr().out)["paths"]
    assert status == "WARN" and f"node-local paths for a job on 2 nodes: xfs on /dev/nvme1n1 mounted at {local} (a " \
        f"local disk): train.run_dir ({local / 'run'}): put the run directory" in detail, detail
    assert cli_main(["preflight", TINY, *two, "--require-shared"]) == 2
    assert _rows(capsys.readouterr().out)["paths"][0] == "FAIL"
    assert cli_main(["preflight", TINY, *two, "--set", "data.shared_filesystem=false",
                     "--set", f"data.cache_dir={local / 'cache'}"]) == 0  # a cache per node, by design: not named
    assert f"data.cache_dir ({local / 'cache'})" not in _rows(capsys.readouterr().out)["paths"][1]


def test_kubernetes_paths_are_judged_against_the_pods_volumes(capsys):
    """--env SMELT_DS_CACHE replaces the manifest's cache on the shared volume: a cache in the
    pod's own /tmp rendered; a file on the pod's /dev/shm (an emptyDir, empty at start) was
    said to be in no volume."""
    k8s = ["render-job", TINY, "--scheduler", "k8s", "--nodes", "2", "--gpus-per-node", "1", "--dry-run"]
    assert cli_main([*k8s, "--env", "SMELT_DS_CACHE=/tmp/cache"]) == 2
    err = capsys.readouterr().err
    assert "`--env SMELT_DS_CACHE` ('/tmp/cache', /tmp/cache in the pod) is not on the shared read-write volume " \
        "(/workspace/smelt-ds/runs): leave --env SMELT_DS_CACHE unset" in err, err
    assert cli_main([*k8s, "--env", "SMELT_DS_CACHE=runs/.cache/mine"]) == 0
    capsys.readouterr()
    assert cli_main([*k8s, "--set", "data.tokenizer.path=/dev/shm/tok.json"]) == 2
    assert "`data.tokenizer.path` ('/dev/shm/tok.json', /dev/shm/tok.json in the pod) is on /dev/shm (emptyDir in " \
        "memory: this pod's own, empty at start): put it on the corpora volume" in capsys.readouterr().err


def test_every_missing_source_is_named_with_the_working_directory_and_workdir(tmp_path, capsys, monkeypatch):
    """Relative paths from the wrong directory: the message named only data.sources[0] and said
    "fix the path" without naming --workdir."""
    wd = tmp_path / "wd"
    (wd / "corpora").mkdir(parents=True)
    for name in ("web.txt", "code.txt"):
        (wd / "corpora" / name).write_text("some text\n" * 50)
    monkeypatch.chdir(tmp_path)
    data = ["--set", "data.sources=[{path: corpora/web.txt}, {path: corpora/code.txt}]", *ONE]
    assert cli_main(["preflight", TINY, *data]) == 2
    status, detail = _rows(capsys.readouterr().out)["data"]
    rule = f"(relative paths are read from the working directory {str(tmp_path)!r}, not from the recipe's directory)"
    assert status == "FAIL" and detail == (
        f"`data.sources[0].path` ('corpora/web.txt'): no such file or directory {rule}: fix the path or remove the "
        f"source; `data.sources[1].path` ('corpora/code.txt'): no such file or directory {rule}: fix the path or "
        f"remove the source; pass --workdir DIR when the job runs in another directory than {str(tmp_path)!r}"), detail
    # one source: where relative paths are read, the fix and --workdir, each said once (they were said twice)
    assert cli_main(["preflight", TINY, *ONE, "--set", "data.sources=[{path: corpora/web.txt}]"]) == 2
    detail = _rows(capsys.readouterr().out)["data"][1]
    assert detail.count("relative paths are read") == 1 and detail.count("fix the path") == 1, detail
    assert detail.count("--workdir DIR") == 1, detail
    assert cli_main(["preflight", TINY, *data, "--workdir", str(wd)]) == 0
    assert _rows(capsys.readouterr().out)["data"][0] == "OK"
