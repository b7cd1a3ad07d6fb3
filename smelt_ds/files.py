"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Each writer writes ``.<name>.tmp-<pid>`` beside the target and renames it into place with
``os.replace`` (atomic on POSIX within one file system); the temporary file is removed on error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["relative_rule", "write_atomic", "write_text_atomic", "write_json_atomic", "json_safe", "staged_directory",
           "write_or_check_generated"]


def relative_rule(path: str | os.PathLike) -> str:
    """How a recipe path is read, for an error about it: relative paths (``data.sources[].path``,
    ``megatron``, ``tokens``, ``data.tokenizer.path``, ``train.init_from``, ``train.run_dir``,
    ``data.cache_dir``) are read from the working directory, never from the recipe file's
    directory (only ``base:`` is relative to the recipe). Returns the rule with the directory for
    a relative path, else ``"absolute path"``."""
    if Path(os.path.expanduser(os.fspath(path))).is_absolute():
        return "absolute path"
    return f"relative paths are read from the working directory {os.getcwd()!r}, not from the recipe's directory"


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then rename it to ``path``; returns ``path``.
    The parent directory must exist. Any exception from ``write`` leaves ``path`` untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_or_check_generated(text: str, output: str | None, default: Path, command: str, check: bool) -> int:
    """A generated page (``smelt-ds recipes table``, ``smelt-ds config reference``): print it when
    ``output`` is ``-``; else compare it with ``output`` (default ``default``) when ``check`` (exit
    status 1, naming ``command`` to rerun, when they differ) or write it atomically. Returns the
    exit status."""
    if output == "-":
        print(text, end="")
        return 0
    out = Path(output) if output else default
    if check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is out of date: run `{command} -o {out}`", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    print(f"wrote {out}")
    return 0


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as None (strict JSON has no NaN/inf) and dict keys as str."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    """``json.dumps(json_safe(obj))`` to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(json_safe(obj), indent=indent))


@contextmanager
def staged_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a new staging directory beside ``target`` and put it in place whole.

    Yields ``<parent>/<name>_partial_XXXXXXXX`` (made by ``tempfile.mkdtemp``, so it is never a
    directory of the user's); when the block finishes, an existing ``target`` is removed and the
    staging directory renamed to ``target`` (``os.replace``, one file system). When the block
    raises (an error, Ctrl-C), the staging directory is removed and ``target`` is untouched.
    Callers decide beforehand whether ``target`` may be replaced."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}_partial_", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
