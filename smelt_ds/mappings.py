"""Nested mappings: :func:`deep_merge`, the one merge of recipe trees (``base:`` and ``--set``),
DeepSpeed JSON sections (the ``deepspeed.config`` pass-through) and sweep overrides."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["deep_merge"]


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
