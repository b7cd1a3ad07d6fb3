"""The package's import layering (docs/architecture.md), read from the source with ``ast``.

Layers, bottom to top: ``base`` (errors, package data, argparse conventions) -> ``config`` -> ``model`` ->
``cost`` -> ``parallel`` -> ``runs`` (the run directory and its artifacts) -> ``run`` (data, train, eval,
interop) -> ``study`` (study, launch) -> ``cli`` -> ``testing`` (the test helpers, which may import any
production module). An import may point down, or sideways to another package of the same floor as
long as the packages of a floor import each other without a cycle. The tests fail on any upward
import; on an import cycle at module level, and on one between packages (``train`` -> ``eval`` ->
``train`` through different modules is a knot too); on DeepSpeed under ``model/`` or ``cost/``; on
any import of the package's own modules inside a function (own modules are imported at module
level, where the layering keeps them acyclic; heavy optional third-party imports such as
``deepspeed`` may stay lazy); on importing a module by name (``importlib.import_module``,
``__import__``: invisible to the other checks), except where :data:`KNOWN_DYNAMIC` says why; and on
any import of ``smelt_ds.testing`` from production code. The one import by name of our own modules,
``smelt_ds/cli.py``'s command table (``COMMANDS``: command -> (module, help), imported only when its
command runs), is read as module-level imports of ``smelt_ds.cli``. A test of the test plants each
violation in a scratch package and checks it is caught.
"""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smelt_ds"

LAYERS = {
    "base": ["errors", "files", "mappings", "resources", "arguments", "import_hooks"],
    "config": ["config"],
    "model": ["model"],
    "cost": ["cost"],
    "parallel": ["parallel"],
    "runs": ["runs"],  # the run directory and its artifacts: written by train, read by eval, interop, study
    "workflows": ["data", "train", "eval", "interop"],
    "study": ["study", "launch"],
    "cli": ["cli"],
    "testing": ["testing"],  # test helpers: may import any production module, none may import them
}
ORDER = list(LAYERS)

# imports that point up: (importer, imported)
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: keep it so

#: modules that import a module named by a computed string, and why none of them is ours (a string
#: literal naming a smelt_ds module is refused everywhere)
KNOWN_DYNAMIC = {
    "smelt_ds.cli": "the command table COMMANDS (read as imports of smelt_ds.cli)",
    "smelt_ds.train.trackers": "the optional third-party tracker packages (wandb, mlflow)",
    "smelt_ds.interop.smelt_format": "an export's copied modeling files, as a package named by their hash",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int | None:
    """Index in ORDER of the layer of ``smelt_ds.X`` (longest listed prefix wins)."""
    name = module.removeprefix("smelt_ds").lstrip(".")
    if not name:
        return None  # the package root (__version__)
    best, best_len = None, -1
    for i, layer in enumerate(ORDER):
        for prefix in LAYERS[layer]:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def imports_of(source: str, module: str) -> list[tuple[str, bool]]:
    """``(imported smelt_ds module, at module level?)`` for every import in ``source``."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    top |= {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
    out = [(m, True) for m in command_table_modules(tree)]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a submodule or a name in `base`
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            if n == "smelt_ds" or n.startswith("smelt_ds.") or n == "deepspeed" or n.startswith("deepspeed."):
                out.append((n, id(node) in top))
    return out


def command_table_modules(tree: ast.Module) -> list[str]:
    """The modules named in a module-level ``COMMANDS = {command: ("smelt_ds.x.cli", help), ...}``
    (smelt_ds/cli.py's table, imported by name when the command runs): imports of that module."""
    out = []
    for stmt in tree.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else (stmt.targets[0] if isinstance(stmt, ast.Assign)
                                                                        and len(stmt.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "COMMANDS" and isinstance(stmt.value, ast.Dict):
            for v in stmt.value.values:
                first = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else v
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    out.append(first.value)
    return out


def _resolve(graph: dict[str, list[tuple[str, bool]]]) -> dict[str, list[tuple[str, bool]]]:
    """Map ``pkg.module.name`` targets to the module that defines them (``pkg.module``)."""
    def module_of(target: str) -> str:
        while target not in graph and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    return {m: [(module_of(t), top) for t, top in imps] for m, imps in graph.items()}


@functools.cache  # read once per test run: every check below reads the same tree
def _graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, bool]]]:
    return _resolve({_module_name(p): imports_of(p.read_text(), _module_name(p)) for p in sorted(root.rglob("*.py"))})


def upward_imports(graph) -> set[tuple[str, str]]:
    bad = set()
    for mod, imps in graph.items():
        for target, _ in imps:
            if not target.startswith("smelt_ds"):
                continue
            a, b = _layer(mod), _layer(target)
            if a is not None and b is not None and b > a:
                bad.add((mod, target))
    return bad


def function_level_counts(graph) -> Counter:
    return Counter(mod for mod, imps in graph.items() for t, top in imps if not top and t.startswith("smelt_ds"))


def strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node of a directed graph (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def module_level_cycles(graph) -> list[list[str]]:
    """Import cycles between modules through module-level imports."""
    return strongly_connected({m: sorted({t for t, top in imps if top and t in graph and t != m})
                               for m, imps in graph.items()})


def package_of(module: str) -> str | None:
    """``smelt_ds.X`` for ``smelt_ds.X`` and everything under it; None for the package root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[0] == "smelt_ds" else None


def package_graph(graph) -> dict[str, list[str]]:
    """Package -> the other packages its modules import (at any level), e.g. ``smelt_ds.train`` ->
    ``smelt_ds.eval``."""
    edges: dict[str, set[str]] = {}
    for mod, imps in graph.items():
        a = package_of(mod)
        if a is None:
            continue
        edges.setdefault(a, set())
        for t, _ in imps:
            b = package_of(t)
            if b is not None and b != a:
                edges[a].add(b)
    return {a: sorted(bs) for a, bs in edges.items()}


def package_cycles(graph) -> list[list[str]]:
    """Import cycles between packages: packages of one floor that import each other, directly or
    through a third, whichever modules the imports come from."""
    return strongly_connected(package_graph(graph))


#: the functions that import a module by name (``importlib.import_module``, ``__import__``), whatever
#: they are reached through (``importlib.``, an alias, a bare name)
_DYNAMIC_CALLS = {"import_module", "__import__"}


def dynamic_imports(source: str) -> list[tuple[int, str | None]]:
    """``(line, imported name)`` for every import by name in ``source`` (``importlib.import_module``,
    ``import_module``, ``__import__``); the name is the string given, or None when it is computed."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in _DYNAMIC_CALLS:
            arg = node.args[0]
            out.append((node.lineno, arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        else None))
    return out


def own_dynamic_imports(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(module, line, what)`` for each import by name that may load one of our modules: a string
    naming ``smelt_ds`` (or a relative name) anywhere, a computed name outside :data:`KNOWN_DYNAMIC`."""
    bad = []
    for mod, source in sources.items():
        for line, name in dynamic_imports(source):
            if name is None and mod not in KNOWN_DYNAMIC:
                bad.append((mod, line, "a computed module name"))
            elif name is not None and (name.split(".")[0] == "smelt_ds" or name.startswith(".")):
                bad.append((mod, line, name))
    return bad


@functools.cache
def _sources(root: Path = PACKAGE) -> dict[str, str]:
    return {_module_name_in(p, root.parent): p.read_text() for p in sorted(root.rglob("*.py"))}


def imports_of_test_helpers(graph) -> list[tuple[str, str]]:
    """``(production module, smelt_ds.testing module)``: the test helpers imported by production code."""
    return sorted({(m, t) for m, imps in graph.items() if package_of(m) != "smelt_ds.testing"
                   for t, _ in imps if package_of(t) == "smelt_ds.testing"})


def test_every_module_has_a_layer():
    missing = [m for m in _graph() if m != "smelt_ds" and _layer(m) is None]
    assert not missing, f"modules without a layer in tests/test_layering.py LAYERS: {missing}"


def test_no_new_upward_import():
    new = upward_imports(_graph()) - KNOWN_UPWARD
    assert not new, f"imports pointing up the layers (docs/architecture.md): {sorted(new)}"


def test_known_upward_imports_still_exist_or_are_removed_from_the_list():
    gone = KNOWN_UPWARD - upward_imports(_graph())
    assert not gone, f"these known upward imports are gone: remove them from KNOWN_UPWARD: {sorted(gone)}"


def test_no_import_cycle_at_module_level():
    assert module_level_cycles(_graph()) == []


def test_no_import_cycle_between_packages():
    assert package_cycles(_graph()) == [], "packages of one floor importing each other (docs/architecture.md: no cycle)"


def test_no_import_by_name_of_own_modules():
    bad = own_dynamic_imports(_sources())
    assert not bad, (f"imports by name that may load a smelt_ds module (module, line, name): {bad}; import it at "
                     "module level, or add the module to KNOWN_DYNAMIC saying why its names are never ours")


def test_known_dynamic_imports_still_exist():
    sources = _sources()
    gone = [m for m in KNOWN_DYNAMIC if m not in sources or not dynamic_imports(sources[m])]
    assert not gone, f"these modules no longer import by name: remove them from KNOWN_DYNAMIC: {gone}"


def test_production_code_never_imports_the_test_helpers():
    bad = imports_of_test_helpers(_graph())
    assert not bad, f"production modules importing smelt_ds.testing (move what they use into production): {bad}"


def deepspeed_imports(graph, packages=("smelt_ds.model", "smelt_ds.cost")) -> list[tuple[str, str]]:
    """``(module, deepspeed target)`` for every DeepSpeed import under ``packages``, lazy ones too."""
    return [(m, t) for m, imps in graph.items() if any(m == p or m.startswith(p + ".") for p in packages)
            for t, _ in imps if t.split(".")[0] == "deepspeed"]


def test_model_and_cost_never_import_deepspeed():
    bad = deepspeed_imports(_graph())
    assert not bad, f"DeepSpeed imported under model/ or cost/ (pure PyTorch / analytic layers): {bad}"


#: what the analytic layer may not do: ask the hardware or write files (its command module,
#: ``cost/cli.py``, writes what the user names with ``-o``)
DEVICE_QUERIES = ("torch.cuda", "psutil")
FILE_WRITES = ("write_text", "write_bytes", "open", "mkdir")


def device_or_file_uses(source: str) -> list[str]:
    """Dotted names in ``source`` that query the device (:data:`DEVICE_QUERIES`) or write files
    (:data:`FILE_WRITES`, as a called name or method)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            parts, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                parts.insert(0, cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                name = ".".join([cur.id, *parts])
                if name.startswith(DEVICE_QUERIES):
                    found.append(name)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [m for m in mods if m.split(".")[0] == "psutil"]
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in FILE_WRITES:
                found.append(name + "()")
    return found


def test_cost_never_queries_the_device_or_writes_files():
    bad = {str(p.relative_to(PACKAGE)): uses for p in sorted((PACKAGE / "cost").glob("*.py"))
           if p.name != "cli.py" and (uses := device_or_file_uses(p.read_text()))}
    assert not bad, (f"cost/ is analytic: device queries or file writes {bad}; measure the device in "
                     "parallel/hardware.py and write run files under runs/")


def test_device_and_file_uses_are_caught():
    src = ("import psutil\nimport torch\n\ndef f(p):\n    torch.cuda.is_available()\n"
           "    p.write_text('x')\n    return open(p)\n")
    assert sorted(set(device_or_file_uses(src))) == ["open()", "psutil", "torch.cuda", "torch.cuda.is_available",
                                                      "write_text()"]
    assert device_or_file_uses("import torch\n\ndef f(x):\n    return torch.zeros(x).cpu()\n") == []


def test_no_function_level_import_of_own_modules():
    counts = function_level_counts(_graph())
    assert not counts, (f"imports of smelt_ds modules inside functions (module: count): {dict(counts)}; import "
                        "them at module level (the layering keeps that acyclic)")


# -- the test of the test: a planted upward import, cycle and DeepSpeed import are caught ----------

def test_checks_catch_planted_violations(tmp_path):
    pkg = tmp_path / "smelt_ds"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "lm.py").write_text("import deepspeed\nfrom smelt_ds.train import train\n")
    (pkg / "cost").mkdir()
    (pkg / "cost" / "__init__.py").write_text("")
    (pkg / "cost" / "memory.py").write_text("def f():\n    from deepspeed.runtime import zero\n")
    (pkg / "train.py").write_text("from smelt_ds.checkpoint import save\n\ndef f():\n    from smelt_ds import export\n")
    (pkg / "checkpoint.py").write_text("from smelt_ds.train import train\n")
    (pkg / "export.py").write_text("")
    graph = _resolve({_module_name_in(p, tmp_path): imports_of(p.read_text(), _module_name_in(p, tmp_path))
                      for p in sorted(pkg.rglob("*.py"))})
    assert upward_imports(graph) == {("smelt_ds.model.lm", "smelt_ds.train")}
    assert module_level_cycles(graph) == [["smelt_ds.checkpoint", "smelt_ds.train"]]
    assert function_level_counts(graph) == Counter({"smelt_ds.train": 1})
    assert deepspeed_imports(graph) == [("smelt_ds.cost.memory", "deepspeed"),
                                        ("smelt_ds.model.lm", "deepspeed")]


def _scratch(tmp_path: Path, files: dict[str, str]) -> Path:
    """A scratch ``smelt_ds`` package under ``tmp_path`` with ``files`` (path -> source) and their
    packages' ``__init__.py``; returns its root."""
    pkg = tmp_path / "smelt_ds"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in [path.parent, *path.parent.parents]:
            if d == pkg.parent:
                break
            (d / "__init__.py").touch()
        path.write_text(text)
    return pkg


def _scratch_graph(pkg: Path):
    return _resolve({_module_name_in(p, pkg.parent): imports_of(p.read_text(), _module_name_in(p, pkg.parent))
                     for p in sorted(pkg.rglob("*.py"))})


def test_a_cycle_between_packages_through_different_modules_is_caught(tmp_path):
    """train.a -> eval.b -> train.c: no module imports itself back, but the packages do (an import
    inside a function counts: it ties the packages as much)."""
    pkg = _scratch(tmp_path, {"train/a.py": "from smelt_ds.eval.b import f\n",
                              "eval/b.py": "def f():\n    from smelt_ds.train.c import g\n    return g\n",
                              "train/c.py": "def g():\n    pass\n",
                              "interop/d.py": "from smelt_ds.eval.b import f\nfrom smelt_ds.train.c import g\n"})
    graph = _scratch_graph(pkg)
    assert module_level_cycles(graph) == [] and upward_imports(graph) == set()
    assert package_cycles(graph) == [["smelt_ds.eval", "smelt_ds.train"]]  # interop -> both is no cycle
    # the cycle through a third package: eval -> interop -> train -> eval
    (pkg / "eval" / "b.py").write_text("from smelt_ds.interop.d import h\n")
    (pkg / "interop" / "d.py").write_text("from smelt_ds.train.c import g\n\ndef h():\n    pass\n")
    assert package_cycles(_scratch_graph(pkg)) == [["smelt_ds.eval", "smelt_ds.interop", "smelt_ds.train"]]


def test_imports_by_name_of_own_modules_are_caught(tmp_path):
    pkg = _scratch(tmp_path, {
        "interop/import_hf.py": "import importlib\n\ndef f():\n"
                                "    return importlib.import_module('smelt_ds.interop.configuration_smelt')\n",
        "eval/x.py": "def f():\n    return __import__('smelt_ds.model.lm')\n",
        "eval/y.py": "from importlib import import_module\n\ndef f(name):\n    return import_module(name)\n",
        "eval/z.py": "import importlib as il\n\ndef f():\n    return il.import_module('.lm', 'smelt_ds.model')\n",
        "train/trackers.py": "import importlib\n\ndef f(m):\n    importlib.import_module('wandb')\n"
                             "    return importlib.import_module(m)\n",
        "cli.py": "import importlib\n\ndef f(m):\n    return importlib.import_module(m)\n",
        "interop/smelt_format.py": "import importlib\n\ndef f():\n    return importlib.import_module('smelt_ds.x')\n"})
    assert sorted(own_dynamic_imports(_sources(pkg))) == [
        ("smelt_ds.eval.x", 2, "smelt_ds.model.lm"), ("smelt_ds.eval.y", 4, "a computed module name"),
        ("smelt_ds.eval.z", 4, ".lm"), ("smelt_ds.interop.import_hf", 4, "smelt_ds.interop.configuration_smelt"),
        ("smelt_ds.interop.smelt_format", 4, "smelt_ds.x")]  # a literal of ours even in a KNOWN_DYNAMIC module


def test_production_imports_of_the_test_helpers_are_caught(tmp_path):
    pkg = _scratch(tmp_path, {"testing/distributed.py": "from smelt_ds.parallel.distributed import find_free_port\n",
                              "parallel/distributed.py": "def find_free_port():\n    pass\n",
                              "train/loop.py": "def f():\n    from smelt_ds.testing.distributed import run\n",
                              "data/x.py": "import smelt_ds.testing\n"})
    assert imports_of_test_helpers(_scratch_graph(pkg)) == [
        ("smelt_ds.data.x", "smelt_ds.testing"), ("smelt_ds.train.loop", "smelt_ds.testing.distributed")]


def test_the_command_table_is_read_as_imports_of_the_cli():
    """smelt_ds/cli.py imports each command's module by name; the graph holds those edges, and a
    table below the top layer naming a module above it is an upward import."""
    from smelt_ds.cli import COMMANDS

    edges = {t for t, top in _graph()["smelt_ds.cli"] if top}
    assert {m for m, _ in COMMANDS.values()} <= edges
    tree = ast.parse('COMMANDS: dict = {"train": ("smelt_ds.train.cli", "train a recipe")}\n')
    graph = _resolve({"smelt_ds.model.lm": imports_of(ast.unparse(tree), "smelt_ds.model.lm"),
                      "smelt_ds.train.cli": []})
    assert upward_imports(graph) == {("smelt_ds.model.lm", "smelt_ds.train.cli")}


def _module_name_in(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
