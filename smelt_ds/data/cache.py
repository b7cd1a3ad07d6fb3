"""Cache directory, content hashes and write-once directories.

Everything the data pipeline builds (built-in corpus, tokenizers, prepared shards) is a directory
written under a temporary name and renamed into place when complete (``os.replace`` of a
directory is atomic on POSIX file systems), so a reader never takes a partial output for a
complete one: a directory is complete when its ``_COMPLETE`` marker exists.

The temporary name ``.NAME.tmp-<host>-<pid>-<random>`` records who writes it. A process that is
killed (SIGKILL, out of memory, a node failure) cannot remove it; the next build in the same
parent directory on the same host removes every such leftover whose process no longer runs.
Leftovers of other hosts are left alone (their process may still run there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smelt_ds.errors import ConfigError

__all__ = ["COMPLETE_MARKER", "cache_root", "sha256_bytes", "sha256_file", "sha256_sample", "sha256_json",
           "is_complete", "build_dir_atomically", "host_tag", "remove_stale_temporaries", "write_json"]

COMPLETE_MARKER = "_COMPLETE"
_CHUNK_BYTES = 1 << 24


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$SMELT_DS_CACHE``, else ``~/.cache/smelt-ds``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SMELT_DS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "smelt-ds"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def sha256_sample(path: str | os.PathLike, blocks: int = 16, block_bytes: int = 1 << 16) -> str:
    """Hex sha256 of a bounded sample of a file: its size and ``blocks`` blocks of ``block_bytes``
    at evenly spaced offsets, the first and the last block included (the whole file when it is
    at most ``blocks * block_bytes`` bytes). Reads at most 1 MiB by default, whatever the size."""
    size = os.stat(path).st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= blocks * block_bytes:
            h.update(f.read())
            return h.hexdigest()
        for k in range(blocks):
            f.seek(k * (size - block_bytes) // (blocks - 1))
            h.update(f.read(block_bytes))
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON of ``obj`` (sorted keys, no spaces)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory built by :func:`build_dir_atomically` to the end."""
    return (Path(path) / COMPLETE_MARKER).is_file()


_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{12}$")


def host_tag() -> str:
    """This host's name as it appears in temporary names (characters outside [A-Za-z0-9._-] -> _)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_stale_temporaries(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary build directories in ``parent`` left by killed processes of this host.

    A directory counts as stale when its name is ``.NAME.tmp-<this host>-<pid>-<random>`` and no
    process ``pid`` runs. Returns the removed paths (each is also reported on stderr).
    """
    parent, host = Path(parent), host_tag()
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        m = _TMP_NAME.match(entry.name)
        if not m or m["host"] != host or not entry.is_dir() or _pid_alive(int(m["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
            print(f"smelt-ds data: removed {str(entry)!r}, left by process {m['pid']} of this host that no "
                  "longer runs (a killed build)", file=sys.stderr)
    return removed


def _clear_target(out: Path) -> None:
    """Remove an empty ``out``; refuse to replace a non-empty directory that is not complete."""
    if not out.exists() or is_complete(out):
        return
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        return
    raise ConfigError(f"output directory {str(out)!r} exists and is not a complete smelt-ds output "
                      f"(no {COMPLETE_MARKER} marker): delete it or choose another directory")


def build_dir_atomically(out_dir: str | os.PathLike, build: Callable[[Path], object]) -> bool:
    """Run ``build(tmp_dir)`` and rename ``tmp_dir`` to ``out_dir``; a no-op if ``out_dir`` is complete.

    Raises ConfigError if ``out_dir`` exists, is not empty and is not complete (never deleted).
    Returns True when this call built the directory, False when a complete one was already there
    (or another process finished first: the rename loses the race and the loser's copy is removed).
    The temporary directory is a sibling ``.NAME.tmp-<host>-<pid>-<random>``, removed on failure;
    one left by a killed process of this host is removed by the next call in the same parent
    directory (:func:`remove_stale_temporaries`).
    """
    out = Path(out_dir)
    if is_complete(out):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        build(tmp)
        (tmp / COMPLETE_MARKER).write_text("complete\n")
        _clear_target(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if is_complete(out):
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            raise
        return True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
