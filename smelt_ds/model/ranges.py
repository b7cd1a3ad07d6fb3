"""Named profiler ranges in the model: ``layer L visit V`` per visit (the looping block manager)
and ``moe route`` / ``moe dispatch`` / ``moe experts`` / ``moe combine`` per MoE stage.

Off by default: a range then costs one flag check (no ``torch.profiler.record_function``, no
string formatting). :func:`set_ranges` turns them on while a profiler records
(:mod:`smelt_ds.train.profiler`). Inside ``torch.compile``'d code they are never entered
(``torch.compiler.is_compiling()`` is checked first, so the flag is not even read there and
compiled graphs neither break nor guard on it); a compiled region shows as its compiled frames.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["set_ranges", "ranges_on", "named_range"]

_ON = False


def set_ranges(on: bool) -> None:
    """Turn the model's named ranges on (while a profiler records) or off (the default)."""
    global _ON
    _ON = bool(on)


def ranges_on() -> bool:
    """Whether a named range is entered here: on, and not inside code ``torch.compile`` traces."""
    return not torch.compiler.is_compiling() and _ON


def named_range(fmt: str, *args: object) -> contextlib.AbstractContextManager[object]:
    """``record_function(fmt.format(*args))`` when :func:`ranges_on`, else a no-op context (the
    name is not formatted)."""
    if ranges_on():
        return record_function(fmt.format(*args))
    return contextlib.nullcontext()
