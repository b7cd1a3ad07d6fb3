"""Where DeepSpeed's JIT-compiled ops are cached: one directory per host and CPU kind.

DeepSpeed builds some C++ ops on first use (its CPU shared-memory collectives at
``deepspeed.init_distributed``, CPU Adam for optimizer offload) with ``torch.utils.cpp_extension``,
``-march=native`` included, into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). A home directory shared by the nodes of a cluster makes that one
cache for every node: an op compiled on a node with AVX-512 is loaded on one without it and dies of
SIGILL; and while one node builds, the others see its build lock held by no process of theirs.

Rule (:func:`host_extension_dir`): unless the user set ``TORCH_EXTENSIONS_DIR``, a run builds into
``<torch's default root>/<host>-<machine>-<key>``, where ``key`` is a short SHA-256 of what
``-march=native`` and the compiler depend on: the CPU's architecture (``platform.machine()``), its
feature flags (``flags`` of ``/proc/cpuinfo``, ``Features`` on Arm), and the C++ compiler torch
runs (``$CXX``, default ``c++``). Two hosts never share a build directory, so a build lock there
belongs to a process of this host, which :mod:`smelt_ds.parallel.build_lock` can see. A user's
``TORCH_EXTENSIONS_DIR`` is used as it is (one cache for every host that shares it: the user
vouches that they are alike).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["ENV", "cpu_key", "host_extension_dir", "use_host_extension_dir"]

#: the variable torch.utils.cpp_extension reads for its build root
ENV = "TORCH_EXTENSIONS_DIR"


def _cpu_flags(cpuinfo: str) -> list[str]:
    """The feature flags of the first processor listed in a ``/proc/cpuinfo`` text, sorted (x86:
    ``flags``; Arm: ``Features``); empty when there is none."""
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return sorted(set(m.group(1).split())) if m else []


def cpu_key(cpuinfo: str | None = None, machine: str | None = None, cxx: str | None = None) -> str:
    """12 hex digits of SHA-256 over the machine architecture (default ``platform.machine()``), the
    CPU feature flags of ``cpuinfo`` (default: ``/proc/cpuinfo``'s text, empty where there is
    none) and the C++ compiler (default ``$CXX``, else ``c++``, as torch.utils.cpp_extension)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    machine = platform.machine() if machine is None else machine
    cxx = os.environ.get("CXX", "c++") if cxx is None else cxx
    text = "\n".join([machine, " ".join(_cpu_flags(cpuinfo)), cxx.strip()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def host_extension_dir(host: str | None = None, key: str | None = None, root: str | Path | None = None) -> Path:
    """``root/<host>-<machine>-<key>``: this host's build root for torch extensions. ``host``:
    default ``socket.gethostname()`` (characters other than letters, digits, ``.``, ``_``, ``-``
    become ``_``); ``key``: default :func:`cpu_key`; ``root``: default torch's own
    (``torch.utils.cpp_extension.get_default_build_root()``, ``~/.cache/torch_extensions``)."""
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() if host is None else host) or "host"
    return Path(root) / f"{host}-{platform.machine() or 'cpu'}-{cpu_key() if key is None else key}"


def use_host_extension_dir(environ: MutableMapping[str, str] | None = None) -> tuple[Path, bool]:
    """Set ``TORCH_EXTENSIONS_DIR`` to :func:`host_extension_dir` unless it is set (``environ``:
    default ``os.environ``). Returns ``(the directory, whether it is this host's own)``: False when
    the user's value was kept."""
    environ = os.environ if environ is None else environ
    given = environ.get(ENV)
    own = host_extension_dir()
    if given and Path(given) != own:
        return Path(given), False
    environ[ENV] = str(own)
    return own, True
