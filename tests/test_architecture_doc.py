"""docs/architecture.md's tree is the package as built: every package and every module under
``smelt_ds/`` has its line, and every line names one that exists.

The notation is regular, so it is read by a small grammar rather than guessed at: inside the first
fenced block after ``## Tree`` each line is one entry, ``<indent><name>  <phrase>``, where the
indent is two spaces per level below the entry's package, the name is ``pkg/`` (a package) or
``module.py`` (a module) and the phrase (what the entry holds, after two or more spaces) may be
left out only on a top-level line (``smelt_ds/``, ``tests/``). A line that breaks the grammar is a
failure of its own, naming the line. Only the ``smelt_ds/`` subtree is compared with the package.

What counts as built: every ``*.py`` file under ``smelt_ds/`` except ``__init__.py`` (``__main__.py``
included) and every directory that holds one (``__pycache__`` skipped). ``__init__.py`` files are
not listed (the package line stands for them); a directory without Python files, such as the wheel's
``smelt_ds/_data`` (copies of ds_configs/, launchers/, recipes/; absent from a checkout), is data, not
a package, and is neither listed nor required.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "smelt_ds"

_ENTRY = re.compile(r"^(?P<indent>(?:  )*)(?P<name>[A-Za-z_]\w*(?:/|\.py))(?: {2,}(?P<phrase>\S.*))?$")


def tree_lines(text: str) -> list[tuple[int, str]]:
    """The lines (1-based number, text) of the first fenced block after the ``## Tree`` heading."""
    lines = text.splitlines()
    start = lines.index("## Tree")
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return [(i + 1, lines[i]) for i in range(fence + 1, end)]


def parse_tree(lines: list[tuple[int, str]]) -> tuple[dict[str, str], list[str]]:
    """The entries of a tree block as ``{path: phrase}`` (``smelt_ds/config/run.py``,
    ``smelt_ds/config/``) and the lines that break the notation, each with its number and why."""
    entries: dict[str, str] = {}
    problems: list[str] = []
    parents: list[str] = []  # the package path at each level above the current line
    for number, line in lines:
        if not line.strip():
            continue
        m = _ENTRY.match(line)
        if m is None:
            problems.append(f"line {number}: {line.strip()!r} is not '<name>/' or '<name>.py', two spaces, a phrase")
            continue
        level, name, phrase = len(m["indent"]) // 2, m["name"], m["phrase"] or ""
        if level > len(parents):
            problems.append(f"line {number}: {name} is indented below a line that is not its package")
            continue
        del parents[level:]
        path = (parents[-1] if parents else "") + name
        if path in entries:
            problems.append(f"line {number}: {path} is listed twice")
        if level and not phrase:
            problems.append(f"line {number}: {path} has no phrase saying what it holds")
        entries[path] = phrase
        if name.endswith("/"):
            parents.append(path)
    return entries, problems


def built_entries(package: Path) -> set[str]:
    """Every module (``__init__.py`` aside) and every directory holding a ``*.py`` file under
    ``package``, as paths from its parent (``smelt_ds/config/run.py``, ``smelt_ds/config/``)."""
    out: set[str] = set()
    for file in package.rglob("*.py"):
        parts = file.relative_to(package.parent).parts
        if "__pycache__" in parts:
            continue
        out.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
        if file.name != "__init__.py":
            out.add("/".join(parts))
    return out


def compare(text: str, package: Path) -> tuple[list[str], list[str], list[str]]:
    """(missing from the tree, named by the tree but gone, notation problems) for a page's text."""
    entries, problems = parse_tree(tree_lines(text))
    root = package.name + "/"
    documented = {path for path in entries if path.startswith(root)}
    built = built_entries(package)
    return sorted(built - documented), sorted(documented - built), problems


def test_tree_notation_is_regular():
    _, _, problems = compare(DOC.read_text(), PACKAGE)
    assert problems == [], "docs/architecture.md's tree breaks its notation:\n" + "\n".join(problems)


def test_every_package_and_module_is_in_the_tree():
    missing, _, _ = compare(DOC.read_text(), PACKAGE)
    assert missing == [], "docs/architecture.md's tree lacks (add a line with what each holds):\n" + "\n".join(missing)


def test_the_tree_names_no_module_that_is_gone():
    _, stale, _ = compare(DOC.read_text(), PACKAGE)
    assert stale == [], "docs/architecture.md's tree names what smelt_ds/ no longer has:\n" + "\n".join(stale)


def test_check_catches_a_missing_module_a_stale_line_and_a_broken_line(tmp_path):
    pkg = tmp_path / "pkg"
    for rel in ["__init__.py", "top.py", "sub/__init__.py", "sub/inner/__init__.py", "sub/inner/deep.py",
                "sub/__pycache__/top.cpython-311.py", "_data/recipe.yaml"]:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    page = "\n".join([
        "## Tree", "", "```",
        "pkg/",
        "  top.py            a module",
        "  sub/              a package",
        "    inner/            a nested package, its deep.py missing",
        "    gone.py           a module that was removed",
        "  stray text without a name",
        "      far.py        indented two levels below its package",
        "  top.py            twice",
        "  bare.py",
        "tests/              another root, not compared",
        "```", "", "## Layer order",
    ])
    missing, stale, problems = compare(page, pkg)
    assert missing == ["pkg/sub/inner/deep.py"]
    assert stale == ["pkg/bare.py", "pkg/sub/gone.py"]
    assert [p.split(":")[0] for p in problems] == ["line 9", "line 10", "line 11", "line 12"], problems
    assert "twice" in problems[2] and "no phrase" in problems[3], problems
