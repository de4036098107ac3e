"""The package's structure (docs/design.md, "Code map"): retriever/ in three layers, engine/ below collection/
below sharded/, and above them only the modules that tell a single index directory from a sharded one; no
import cycle among module-level imports, nor among the engine's modules counting imports inside functions; no
module importing another's private name or reaching another's private attributes; and package faces light
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
    for target, names, level, _ in scoped_imports(name, path):
        yield target, names, level


def scoped_imports(name: str, path: Path):
    """imports(), each with the qualified name of the function it is in ("Index.build"; "" at module level)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node, level, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                yield from walk(child, level and isinstance(child, ast.ClassDef), inner)
            elif isinstance(child, ast.Lambda):
                yield from walk(child, False, scope)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, False, scope)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("fusionrag"):
                        yield a.name, None, level, scope
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                if base.startswith("fusionrag"):
                    yield base, [a.name for a in child.names], level, scope
            else:
                yield from walk(child, level, scope)

    yield from walk(ast.parse(path.read_text(), str(path)), True, "")


def edges(within: str | None = None, allowed=()):
    """name -> the fusionrag modules it imports at module level (a name imported from a package that is itself a
    module counts as that module). within: a package; then its modules only, and every import among them, inside
    functions too, but those allowed ((module, function, target module) triples)."""
    graph = {}
    for name, path in MODULES.items():
        if within and not name.startswith(within + "."):
            continue
        out = set()
        for target, names, level, scope in scoped_imports(name, path):
            if not level and not within:
                continue
            for n in names or [None]:
                sub = f"{target}.{n}" if n else None
                module = sub if sub in MODULES else target
                if (name, scope, module) not in allowed:
                    out.add(module)
        graph[name] = out & set(MODULES)
    if within:
        graph = {name: out & set(graph) for name, out in graph.items()}
    return graph


def cycles_in(graph: dict) -> list[list[str]]:
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
    return cycles


def test_no_import_cycle_among_module_level_imports():
    cycles = cycles_in(edges())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


ENGINE = "fusionrag.retriever.engine"
# The one import among the engine's modules that goes up, allowed by name: Index.build (public API: the README,
# the docs and the tests build an index by it) calls build.build_index, imported inside that method so that opening
# an index for search never loads the build; the build imports calibrate, which opens an Index, below it.
ALLOWED_UPWARD = {(f"{ENGINE}.index", "Index.build", f"{ENGINE}.build")}


def test_no_import_cycle_among_the_engines_modules_even_inside_functions():
    """A module-level import cycle fails test_no_import_cycle_among_module_level_imports; one that an import
    inside a function hides (calibrate opening an Index that imports calibrate) fails here: among the engine's
    modules every import counts, but ALLOWED_UPWARD's."""
    cycles = cycles_in(edges(ENGINE, ALLOWED_UPWARD))
    assert not cycles, "import cycles (imports inside functions counted):\n" + "\n".join(" -> ".join(c) for c in cycles)


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


# Private attributes reached from outside the module that defines them, allowed by file and expression.
REACHES_ALLOWED = {
    # Triton's compiled kernel (what kernel.warmup returns: a third-party object, not a module imported by name):
    # Variant.load builds its launcher ahead of the first launch, which Triton has no public call for.
    ("kernels/variants.py", "compiled._init_handles"),
}


def private_reaches(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of each `X._name` (one leading underscore, not a dunder) in the file whose _name the
    file does not define (as a def, a class, or an assignment to `_name` or `something._name`): an attribute
    private to another module's code. X = self or cls is the class's own; a chain rooted at a name imported from
    outside fusionrag (np._x) is the third party's."""
    tree = ast.parse(path.read_text(), str(path))
    defined, foreign = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("fusionrag")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("fusionrag"):
            foreign |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in foreign or node.attr in defined:
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reaches_another_modules_private_attributes():
    """A class's private attributes are its module's: no other module reads, writes or calls them (what it
    needs of them is public, named in that class's API)."""
    wrong = []
    for path in sorted(set(MODULES.values())):
        where = str(path.relative_to(ROOT))
        wrong += [f"{where}:{line}: {expr}" for line, expr in private_reaches(path)
                  if (where, expr) not in REACHES_ALLOWED]
    assert not wrong, "private attributes reached from another module:\n" + "\n".join(wrong)


def test_the_check_sees_a_private_attribute_reached(tmp_path):
    """On made-up modules: reaching another module's _secret is caught; the module's own private attributes,
    self's, and a third party's (np._x) are not."""
    (tmp_path / "b.py").write_text("_secret = 1\n")
    (tmp_path / "a.py").write_text(
        "import numpy as np\nfrom fusionrag.retriever import b\n\n\nclass A:\n    def __init__(self):\n"
        "        self._state = 0\n\n    def _own(self):\n        return self._state\n\n\n"
        "def f(x: A, y):\n    x._state = x._own()\n    return b._secret, y._hidden, np._x, np.linalg._umath\n")
    assert private_reaches(tmp_path / "a.py") == [(15, "b._secret"), (15, "y._hidden")]
    assert private_reaches(tmp_path / "b.py") == []


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


def test_the_check_sees_a_cycle_an_import_inside_a_function_hides(tmp_path):
    """On a made-up engine: a cycle closed by an import inside a function passes the module-level check and fails
    the engine's; Index.build's import of the build is allowed, the same import in any other function is not."""
    global MODULES
    engine = tmp_path / "retriever" / "engine"
    engine.mkdir(parents=True)
    (engine / "a.py").write_text("def f():\n    from fusionrag.retriever.engine import b\n")
    (engine / "b.py").write_text("from fusionrag.retriever.engine.a import f\n")
    (engine / "index.py").write_text("class Index:\n    @staticmethod\n    def build():\n"
                                     "        from fusionrag.retriever.engine.build import build_index\n")
    (engine / "build.py").write_text("from fusionrag.retriever.engine.index import Index\n")
    saved, PACKAGES["fusionrag.retriever"] = PACKAGES["fusionrag.retriever"], tmp_path / "retriever"
    saved_modules, MODULES = MODULES, modules()
    try:
        test_no_import_cycle_among_module_level_imports()
        try:
            test_no_import_cycle_among_the_engines_modules_even_inside_functions()
        except AssertionError as e:
            assert f"{ENGINE}.a -> {ENGINE}.b -> {ENGINE}.a" in str(e) and "index" not in str(e), str(e)
        else:
            raise AssertionError("a cycle through an import inside a function passed")
        (engine / "index.py").write_text((engine / "index.py").read_text() + "\n\ndef rebuild():\n"
                                         "    from fusionrag.retriever.engine import build\n")
        assert [f"{ENGINE}.build", f"{ENGINE}.index", f"{ENGINE}.build"] in \
            cycles_in(edges(ENGINE, ALLOWED_UPWARD)), "the allowance is Index.build's alone"
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
