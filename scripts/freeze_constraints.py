#!/usr/bin/env python
"""Write ``constraints.txt``: the exact versions of smelt-ds's tested environment.

Walks the requirements of the installed ``smelt-ds`` distribution with the extras CI installs
(``dev``, which pulls in the optional integrations' test dependencies) through their installed
dependencies, transitively (``importlib.metadata``; environment markers evaluated for this
interpreter), and pins each distribution reached at the version installed here:

    python scripts/freeze_constraints.py            # rewrite constraints.txt from this environment
    python scripts/freeze_constraints.py --check    # exit 1 when constraints.txt differs

Run it in the environment the full suite passed in (``.ci/run`` installs with ``-c constraints.txt``).
torch is pinned too, as the CPU build (``2.13.0`` matches ``2.13.0+cpu``).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev",)
HEADER = """\
# The exact versions smelt-ds was tested with (Python {py}, CPU torch); `.ci/run` installs with
# `pip install -e '.[dev]' -c constraints.txt`. Written by scripts/freeze_constraints.py from the
# environment the full suite passed in; the ranges users may install are in setup.cfg.
"""


def _requirements(dist: metadata.Distribution, extras: tuple[str, ...]) -> list[Requirement]:
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        envs = [{**default_environment(), "extra": e} for e in ("", *extras)]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def closure(root: str = "smelt-ds", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """``{canonical name: installed version}`` of every distribution ``root[extras]`` needs here.

    Raises LookupError naming a requirement that is not installed."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...], str]] = [(root, extras, root)]
    while todo:
        name, want_extras, why = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise LookupError(f"{name} (needed by {why}) is not installed: install smelt-ds[dev] first") from None
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen and not want_extras:
            continue
        seen[key] = dist.version
        for req in _requirements(dist, want_extras):
            todo.append((req.name, tuple(sorted(req.extras)), key))
    seen.pop(canonicalize_name(root), None)
    return dict(sorted(seen.items()))


def render(pins: dict[str, str]) -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [f"{name}=={version.split('+')[0]}" for name, version in pins.items()]
    return HEADER.format(py=py) + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with constraints.txt, write nothing")
    p.add_argument("-o", "--output", default=str(ROOT / "constraints.txt"))
    args = p.parse_args(argv)
    text = render(closure())
    out = Path(args.output)
    if args.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'differs from this environment'}")
        return 0 if same else 1
    out.write_text(text)
    print(f"wrote {out} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
