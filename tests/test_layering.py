"""The package's import layering (DESIGN §2, docs/architecture.md), read from the source with ``ast``.

Layers, bottom to top: ``base`` (errors, package data, argparse conventions) -> ``config`` -> ``model`` ->
``cost`` -> ``parallel`` -> ``run`` (data, train, eval) -> ``study`` (study, launch) -> ``cli`` -> ``testing``
(the test helpers, which may import any production module). An
import may point down or sideways, never up. The tests fail on any upward import, on an import
cycle at module level, on DeepSpeed under ``model/`` or ``cost/``, and on any import of the
package's own modules inside a function (own modules are imported at module level, where the
layering keeps them acyclic; heavy optional third-party imports such as ``deepspeed`` may stay
lazy). The one import by name, ``smelt_ds/cli.py``'s command table (``COMMANDS``: command ->
(module, help), imported only when its command runs), is read as module-level imports of
``smelt_ds.cli``. A test of the test plants each violation in a scratch package and checks it is caught.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smelt_ds"

LAYERS = {
    "base": ["errors", "files", "resources", "arguments"],
    "config": ["config"],
    "model": ["model"],
    "cost": ["cost"],
    "parallel": ["parallel"],
    "runs": ["runs"],  # the run directory and its artifacts: written by train, read by eval, interop, study
    "run": ["data", "train", "eval", "interop"],
    "study": ["study", "launch"],
    "cli": ["cli"],
    "testing": ["testing"],  # test helpers: may import any production module, none may import them
}
ORDER = list(LAYERS)

# imports that point up: (importer, imported)
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: keep it so


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


def module_level_cycles(graph) -> list[list[str]]:
    """Strongly connected components (size > 1) of the module-level import graph (Tarjan)."""
    edges = {m: sorted({t for t, top in imps if top and t in graph and t != m}) for m, imps in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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


def test_every_module_has_a_layer():
    missing = [m for m in _graph() if m != "smelt_ds" and _layer(m) is None]
    assert not missing, f"modules without a layer in tests/test_layering.py LAYERS: {missing}"


def test_no_new_upward_import():
    new = upward_imports(_graph()) - KNOWN_UPWARD
    assert not new, f"imports pointing up the layers (DESIGN §2): {sorted(new)}"


def test_known_upward_imports_still_exist_or_are_removed_from_the_list():
    gone = KNOWN_UPWARD - upward_imports(_graph())
    assert not gone, f"these known upward imports are gone: remove them from KNOWN_UPWARD: {sorted(gone)}"


def test_no_import_cycle_at_module_level():
    assert module_level_cycles(_graph()) == []


def deepspeed_imports(graph, packages=("smelt_ds.model", "smelt_ds.cost")) -> list[tuple[str, str]]:
    """``(module, deepspeed target)`` for every DeepSpeed import under ``packages``, lazy ones too."""
    return [(m, t) for m, imps in graph.items() if any(m == p or m.startswith(p + ".") for p in packages)
            for t, _ in imps if t.split(".")[0] == "deepspeed"]


def test_model_and_cost_never_import_deepspeed():
    bad = deepspeed_imports(_graph())
    assert not bad, f"DeepSpeed imported under model/ or cost/ (pure PyTorch / analytic layers): {bad}"


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
