"""The package's structure (docs/design.md, "Code map"): retriever/ in three layers, engine/ below collection/
below sharded/, and above them only the modules that tell a single index directory from a sharded one; no
import cycle among module-level imports; no module importing another's private name; and package faces light
enough that `import fusionrag.client` loads no engine. Read from the source (ast), not from what imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The package's module names -> their source directories (pyproject.toml's [tool.scikit-build.wheel.packages]).
PACKAGES = {"fusionrag": ROOT / "src" / "fusionrag", "fusionrag.retriever": ROOT / "retriever",
            "fusionrag.kernels": ROOT / "kernels", "fusionrag.native": ROOT / "native",
            "fusionrag.server": ROOT / "server", "fusionrag.integrations": ROOT / "integrations",
            "fusionrag.loadtests": ROOT / "loadtests"}
# Layer -> the packages it may never import, even inside a function.
BELOW = {
    "fusionrag.retriever.engine": ("fusionrag.retriever.collection", "fusionrag.retriever.sharded",
                                   "fusionrag.retriever.directory", "fusionrag.server", "fusionrag.integrations"),
    "fusionrag.retriever.collection": ("fusionrag.retriever.sharded", "fusionrag.retriever.directory",
                                       "fusionrag.server", "fusionrag.integrations"),
    "fusionrag.retriever.sharded": ("fusionrag.retriever.directory", "fusionrag.server", "fusionrag.integrations"),
    "fusionrag.kernels": ("fusionrag.retriever", "fusionrag.server"),
    "fusionrag.native": ("fusionrag.retriever", "fusionrag.server"),
}


def modules() -> dict[str, Path]:
    found = {}
    for package, where in PACKAGES.items():
        for path in where.rglob("*.py"):
            if "__pycache__" in path.parts or path.name.startswith("test_"):
                continue
            parts = list(path.relative_to(where).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports(name: str, path: Path):
    """(target module, imported names or None for `import x`, at module level?) for each import of a fusionrag
    module in the file, relative imports resolved. Module level: run when the module is imported (not inside a
    function, nor under `if TYPE_CHECKING`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node, level):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, False)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("fusionrag"):
                        yield a.name, None, level
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                if base.startswith("fusionrag"):
                    yield base, [a.name for a in child.names], level
            else:
                yield from walk(child, level)

    yield from walk(ast.parse(path.read_text(), str(path)), True)


def edges():
    """name -> the fusionrag modules it imports at module level (a name imported from a package that is itself a
    module counts as that module)."""
    graph = {}
    for name, path in MODULES.items():
        out = set()
        for target, names, level in imports(name, path):
            if not level:
                continue
            for n in names or [None]:
                sub = f"{target}.{n}" if n else None
                out.add(sub if sub in MODULES else target)
        graph[name] = out & set(MODULES)
    return graph


def test_no_import_cycle_among_module_level_imports():
    graph = edges()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_each_layer_imports_only_those_below_it():
    wrong = []
    for name, path in MODULES.items():
        for layer, forbidden in BELOW.items():
            if name == layer or name.startswith(layer + "."):
                for target, _, _ in imports(name, path):
                    if any(target == f or target.startswith(f + ".") for f in forbidden):
                        wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_name():
    wrong = []
    for root in (*PACKAGES.values(), ROOT / "bench", ROOT / "tests"):
        for path in root.rglob("*.py"):
            if "work" in path.relative_to(ROOT).parts or "__pycache__" in path.parts:
                continue
            for target, names, _ in imports(next((n for n, p in MODULES.items() if p == path), "x.y"), path):
                for n in names or []:
                    if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in MODULES \
                            and n != "_native":  # the C++ extension module
                        wrong.append(f"{path.relative_to(ROOT)}: from {target} import {n}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_cycle_a_private_name_and_a_layer_crossed(tmp_path):
    """The three checks above on a made-up package: each finds what it is there to find."""
    global MODULES
    pkg = tmp_path / "retriever"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "collection").mkdir()
    (pkg / "engine" / "a.py").write_text("from fusionrag.retriever.engine.b import _secret\n")
    (pkg / "engine" / "b.py").write_text("from fusionrag.retriever.engine import a\n_secret = 1\n")
    (pkg / "engine" / "c.py").write_text("def f():\n    from fusionrag.retriever.collection import api\n")
    (pkg / "collection" / "api.py").write_text("")
    saved, PACKAGES["fusionrag.retriever"] = PACKAGES["fusionrag.retriever"], pkg
    saved_modules, MODULES = MODULES, modules()
    try:
        for check in (test_no_import_cycle_among_module_level_imports, test_each_layer_imports_only_those_below_it):
            try:
                check()
            except AssertionError as e:
                assert "fusionrag.retriever.engine" in str(e)
            else:
                raise AssertionError(f"{check.__name__} passed over a made-up fault")
        found = [(t, n) for t, n, _ in imports("fusionrag.retriever.engine.a", pkg / "engine" / "a.py")]
        assert found == [("fusionrag.retriever.engine.b", ["_secret"])]
    finally:
        PACKAGES["fusionrag.retriever"], MODULES = saved, saved_modules


def loaded_by(imports: str) -> set[str]:
    """The fusionrag modules a fresh interpreter has loaded after `import <imports>`."""
    code = f"import sys, json, {imports}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fusionrag'))))"
    return set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         check=True).stdout))


def test_the_client_loads_no_engine():
    """`import fusionrag.client` loads the client, the types it shares with the engine (fusionrag.types) and the
    error classes, nothing else; `import fusionrag.retriever` and its collection package load the light modules
    only: no C++ extension, no index, no collection code, no Triton; measured in a fresh interpreter."""
    client = loaded_by("fusionrag.client")
    assert client == {"fusionrag", "fusionrag.client", "fusionrag.types", "fusionrag.lazy", "fusionrag.retriever",
                      "fusionrag.retriever.errors"}, f"the client alone loaded {sorted(client)}"
    loaded = loaded_by("fusionrag.client, fusionrag.retriever, fusionrag.retriever.collection")
    light = {"fusionrag", "fusionrag.client", "fusionrag.lazy", "fusionrag.retriever", "fusionrag.retriever.errors",
             "fusionrag.retriever.engine", "fusionrag.retriever.engine.config", "fusionrag.retriever.engine.queries",
             "fusionrag.retriever.engine.vectors", "fusionrag.retriever.collection",
             "fusionrag.retriever.collection.config", "fusionrag.retriever.collection.records",
             "fusionrag.retriever.collection.values", "fusionrag.types"}
    assert loaded <= light, f"the client loaded {sorted(loaded - light)}"
    assert "fusionrag.client" in loaded
