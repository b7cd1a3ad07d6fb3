"""The package's import layering (DESIGN §2), read from the source with ``ast``.

Layers, bottom to top: ``config`` (errors, the config tree, the visit plan) -> ``model`` ->
``cost`` -> ``parallel`` -> ``run`` (data, train, eval) -> ``study`` (recipes, sweeps, scaling
fits, launch) -> ``cli``. An import may point down or sideways, never up; the model never imports
DeepSpeed. The tests fail on any upward import, on an import cycle at module level, on DeepSpeed
under ``model/``, and on a *new* function-level import of the package's own modules: the ones
made today are listed below as known debt (issue 14 moves them to module level as the modules move
into one package per layer); the list must only shrink.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smelt_ds"

LAYERS = {
    "config": ["errors", "schema", "schedule", "config", "resources", "data.config", "testing"],
    "model": ["model"],
    "cost": ["budget", "ds_template", "zero3_tuning", "memory"],
    "parallel": ["engine", "moe_backends", "grad_norm"],
    "run": ["data", "train", "train_data", "checkpoint", "reference_weights", "export", "run_lock", "provenance",
            "eval"],
    "study": ["recipes", "sweep", "scaling", "launch", "memory_profile"],
    "cli": ["cli", "budget_cli", "memory_cli", "train_cli", "eval_cli", "recipes_cli", "launch_cli", "scaling_cli",
            "data.cli"],
}
ORDER = list(LAYERS)

# imports that point up: (importer, imported)
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: keep it so
# names imported from the package's own modules inside functions, per module, as measured
# (147 in all; the redesign imports them at module level)
KNOWN_FUNCTION_LEVEL_COUNTS = {
    "smelt_ds.budget": 1, "smelt_ds.checkpoint": 2, "smelt_ds.cli": 1, "smelt_ds.data.cli": 9,
    "smelt_ds.engine": 5, "smelt_ds.eval.data": 4, "smelt_ds.eval.runs": 5, "smelt_ds.eval_cli": 21,
    "smelt_ds.export": 4, "smelt_ds.launch_cli": 7, "smelt_ds.memory": 4, "smelt_ds.memory_profile": 7, "smelt_ds.memory_cli": 1,
    "smelt_ds.provenance": 3, "smelt_ds.recipes": 9, "smelt_ds.recipes_cli": 3, "smelt_ds.reference_weights": 3,
    "smelt_ds.scaling_cli": 11, "smelt_ds.sweep": 16, "smelt_ds.train": 19, "smelt_ds.train_cli": 4,
    "smelt_ds.train_data": 3, "smelt_ds.zero3_tuning": 5,
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
    out = []
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


def test_model_never_imports_deepspeed():
    bad = [(m, t) for m, imps in _graph().items() if m.startswith("smelt_ds.model") or m == "smelt_ds.schedule"
           for t, _ in imps if t.split(".")[0] == "deepspeed"]
    assert not bad, bad


def test_function_level_imports_of_own_modules_do_not_grow():
    counts = function_level_counts(_graph())
    grown = {m: (n, KNOWN_FUNCTION_LEVEL_COUNTS.get(m, 0)) for m, n in counts.items()
             if n > KNOWN_FUNCTION_LEVEL_COUNTS.get(m, 0)}
    assert not grown, (f"new function-level imports of smelt_ds modules (module: now, allowed): {grown}; import "
                       "at module level (the layering keeps that acyclic)")


# -- the test of the test: a planted upward import, cycle and DeepSpeed import are caught ----------

def test_checks_catch_planted_violations(tmp_path):
    pkg = tmp_path / "smelt_ds"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "lm.py").write_text("import deepspeed\nfrom smelt_ds.train import train\n")
    (pkg / "train.py").write_text("from smelt_ds.checkpoint import save\n\ndef f():\n    from smelt_ds import export\n")
    (pkg / "checkpoint.py").write_text("from smelt_ds.train import train\n")
    (pkg / "export.py").write_text("")
    graph = _resolve({_module_name_in(p, tmp_path): imports_of(p.read_text(), _module_name_in(p, tmp_path))
                      for p in sorted(pkg.rglob("*.py"))})
    assert upward_imports(graph) == {("smelt_ds.model.lm", "smelt_ds.train")}
    assert module_level_cycles(graph) == [["smelt_ds.checkpoint", "smelt_ds.train"]]
    assert function_level_counts(graph) == Counter({"smelt_ds.train": 1})
    assert [t for t, _ in graph["smelt_ds.model.lm"] if t == "deepspeed"] == ["deepspeed"]


def _module_name_in(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
