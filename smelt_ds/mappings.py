"""Mappings: :func:`deep_merge`, the one merge of recipe trees (``base:`` and ``--set``),
DeepSpeed JSON sections (the ``deepspeed.config`` pass-through) and sweep overrides; and
:func:`updated_environ`, the process environment with a job's or tracker's variables for a block."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["deep_merge", "updated_environ"]


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``override`` merged in recursively. Where both hold a dict under
    a key, the dicts merge; any other value of ``override`` (lists included) replaces ``base``'s.
    Neither input is modified (values are deep-copied)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


@contextlib.contextmanager
def updated_environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, each variable restored (or removed)
    after it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
