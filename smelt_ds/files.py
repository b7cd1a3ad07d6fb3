"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one.

Each writer writes ``.<name>.tmp-<pid>`` beside the target and renames it into place with
``os.replace`` (atomic on POSIX within one file system); the temporary file is removed on error.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

__all__ = ["write_atomic", "write_text_atomic", "write_json_atomic", "json_safe"]


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
