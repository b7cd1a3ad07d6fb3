"""Command-line conventions shared by every ``smelt-ds`` command's parser.

- A list-valued option given twice keeps both uses: ``--corpus a --corpus b`` evaluates both
  (argparse's ``action="extend"`` / ``"append"``; :class:`CommaList` for options that take one
  comma-separated string, e.g. ``--tasks a,b --tasks c`` is ``"a,b,c"``). An option whose repetition
  has no meaning (a range of two numbers) refuses a second use (:class:`Once`) instead of silently
  keeping the last one. tests/test_cli.py walks every parser and fails on a list-valued option that
  does neither.
- A bare ``section.key=value`` where a file is expected is almost always a forgotten ``--set``
  (``smelt-ds budget r.yaml train.max_steps=200``): :func:`override_hint` says so.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CommaList", "Once", "looks_like_override", "override_hint", "bare_overrides"]


class _UnsetByDefault(argparse.Action):
    """An option whose default is None, so that a first use is told from a second one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.default is not None:
            raise ValueError(f"{self.option_strings}: a {type(self).__name__} option's default must be None")


class CommaList(_UnsetByDefault):
    """A comma-separated list option that accumulates over repeated uses: ``--x a,b --x c`` stores
    ``"a,b,c"`` (the string the command parses, as with one use). ``type`` checks each use."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


class Once(_UnsetByDefault):
    """An option that may be given at most once (its values belong together, e.g. ``LOW HIGH``):
    a second use is a parse error naming the option and both values, instead of argparse keeping
    the last silently."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        first = getattr(namespace, self.dest, None)
        if first is not None:
            parser.error(f"{option_string} is given twice ({_shown(first)} and {_shown(values)}): it takes one "
                         "value; give it once")
        setattr(namespace, self.dest, values)


def _shown(v: Any) -> str:
    return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


#: ``section.key=value`` (also ``name=value`` and list indices: ``loop.ranges.0.repeats=3``)
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)*=")


def looks_like_override(text: str) -> bool:
    """Whether a command-line argument reads as a recipe override ``KEY.PATH=VALUE`` rather than a
    path: a key path, ``=``, then anything; and no such file exists."""
    return bool(_OVERRIDE.match(text)) and not Path(text).exists()


def override_hint(text: str) -> str:
    """The message for a bare override where a path was expected."""
    return f"`{text}` looks like an override: write `--set {text}`"


def bare_overrides(args: Sequence[str]) -> list[str]:
    """The arguments of ``args`` that :func:`looks_like_override`."""
    return [a for a in args if looks_like_override(a)]
