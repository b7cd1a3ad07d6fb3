"""DeepSpeed's JIT ops are cached per host and CPU kind, and a build lock another host may hold is
never taken for a stale one. Hosts are emulated: a host name, a /proc/cpuinfo text, a file
system type."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smelt_ds.errors import ConfigError
from smelt_ds.parallel import build_lock

AVX512 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n"
AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2\n"


def test_cpu_features_and_compiler_make_the_key():
    from smelt_ds.parallel.extension_cache import cpu_key

    assert cpu_key(AVX512, "x86_64", "c++") == cpu_key(AVX512.replace("avx2 avx512f", "avx512f avx2"), "x86_64", "c++")
    keys = {cpu_key(AVX512, "x86_64", "c++"), cpu_key(AVX2, "x86_64", "c++"), cpu_key(AVX512, "aarch64", "c++"),
            cpu_key(AVX512, "x86_64", "g++-12")}
    assert len(keys) == 4
    assert all(len(k) == 12 and int(k, 16) >= 0 for k in keys)


def test_distinct_hosts_get_distinct_directories_and_one_host_one(tmp_path):
    from smelt_ds.parallel.extension_cache import cpu_key, host_extension_dir

    key = cpu_key(AVX512, "x86_64", "c++")
    a, b = host_extension_dir("node-a", key, tmp_path), host_extension_dir("node-b", key, tmp_path)
    assert a != b and a.parent == b.parent == tmp_path
    assert host_extension_dir("node-a", key, tmp_path) == a
    assert host_extension_dir("node-a", cpu_key(AVX2, "x86_64", "c++"), tmp_path) != a
    assert host_extension_dir("node a/1", key, tmp_path).name.startswith("node_a_1-")  # one path component


def test_the_users_directory_is_kept_and_the_default_is_this_hosts():
    from smelt_ds.parallel.extension_cache import host_extension_dir, use_host_extension_dir

    env = {"TORCH_EXTENSIONS_DIR": "/shared/envs/smelt/torch_ext"}
    assert use_host_extension_dir(env) == (Path("/shared/envs/smelt/torch_ext"), False)
    assert env["TORCH_EXTENSIONS_DIR"] == "/shared/envs/smelt/torch_ext"
    env = {}
    where, own = use_host_extension_dir(env)
    assert own and env["TORCH_EXTENSIONS_DIR"] == str(where) == str(host_extension_dir())


def test_training_builds_into_this_hosts_directory(monkeypatch):
    """What a run's start prints for DeepSpeed's CPU collectives op names this host's directory."""
    from smelt_ds.parallel import extension_cache
    from smelt_ds.parallel.extension_cache import use_host_extension_dir
    from smelt_ds.train.loop import _deepspeed_op_notices

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(extension_cache.socket, "gethostname", lambda: "node-b")
    where, own = use_host_extension_dir()
    try:
        lines = _deepspeed_op_notices(("ShareMemCommBuilder",))
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    if not lines:
        pytest.skip("this DeepSpeed ships the shared-memory op prebuilt or does not use it here")
    assert own and where.name.startswith("node-b-") and str(where) in lines[0]


def _shared_lock(tmp_path: Path, monkeypatch, fstype: str) -> Path:
    """A user's TORCH_EXTENSIONS_DIR (``tmp_path``) on a file system of type ``fstype`` with the op's
    build lock in it, held by no process of this host (another host's live builder is invisible here)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build_lock, "file_system_type", lambda path: fstype, raising=False)
    where = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    (where / "lock").write_text("")
    os.utime(where / "lock", ns=(1, 1))  # written in 1970 by a clock far behind this one: no matter
    return where / "lock"


def test_a_lock_on_a_shared_file_system_is_never_taken_for_stale(tmp_path, monkeypatch):
    from smelt_ds.train.loop import _deepspeed_op_notices

    lock = _shared_lock(tmp_path, monkeypatch, "nfs4")
    lines = _deepspeed_op_notices(("ShareMemCommBuilder",))
    if not lines:
        pytest.skip("this DeepSpeed ships the shared-memory op prebuilt or does not use it here")
    assert lines[0].startswith(f"deepspeed op deepspeed_shm_comm: the build lock {lock} is held by no process of "
                               "this host; another host sharing this directory may be building it")
    assert lock.exists()


def test_a_lock_on_a_local_file_system_nobody_holds_is_stale(tmp_path, monkeypatch):
    lock = _shared_lock(tmp_path, monkeypatch, "ext4")
    with pytest.raises(ConfigError, match=rf"the build lock {lock} was left by an interrupted build"):
        build_lock.check_build_lock(lock.parent, "deepspeed_shm_comm", recheck_s=0.05)


def test_this_hosts_directory_is_judged_whatever_its_file_system(tmp_path, monkeypatch):
    """Only this host builds into its own directory, even on a network home."""
    monkeypatch.setattr(build_lock, "file_system_type", lambda path: "nfs4")
    monkeypatch.setattr(build_lock, "host_extension_dir", lambda: tmp_path)  # the name build_lock calls
    op = tmp_path / "py311_cpu" / "cpu_adam"
    op.mkdir(parents=True)
    (op / "lock").write_text("")
    with pytest.raises(ConfigError, match="only this host builds there"):
        build_lock.check_build_lock(op, "cpu_adam", recheck_s=0.05)
