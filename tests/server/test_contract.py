"""The collection contract (retriever/collection/contract.py, #69): every class that reaches the routes declares it
and implements all it requires with the contract's parameters, and the service uses of a collection and of its
catalog only what the contract declares: no sniffing of which class it holds (hasattr, getattr with a default,
isinstance), no member outside the contract. Read from the source (ast) for the service's side; from the classes
themselves for theirs. The routes' behaviour on each backend is test_api_backends' (a collection, a sharded one in
the service's process, a sharded one in the data directory) and test_sharded_ray's (the Ray service)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from fusionrag.retriever.collection.api import Collection
from fusionrag.retriever.collection.catalog import Catalog
from fusionrag.retriever.collection.contract import CatalogContract, CollectionContract
from fusionrag.retriever.sharded.catalog import ShardedCatalog
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.follow import FollowerCollection
from fusionrag.retriever.sharded.hosted import HostedSharded

ROOT = Path(__file__).resolve().parents[2]
COLLECTIONS = [Collection, ShardedCollection, FollowerCollection, HostedSharded]
CATALOGS = [Catalog, ShardedCatalog]


def _members(contract: type) -> set[str]:
    """What the contract declares: its methods and properties, and the attributes it annotates."""
    names = {n for n in dir(contract) if not n.startswith("_") or n == "__len__"}
    for klass in contract.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(list(inspect.signature(fn).parameters.items())[1:])  # without self


@pytest.mark.parametrize("cls,contract", [(c, CollectionContract) for c in COLLECTIONS] +
                         [(c, CatalogContract) for c in CATALOGS], ids=lambda c: c.__name__)
def test_each_class_declares_the_contract_and_takes_its_arguments(cls, contract):
    assert issubclass(cls, contract)
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"
    for name in sorted(contract.__abstractmethods__ | {"snapshot", "import_files", "crossover", "release_files"} &
                       set(dir(contract))):
        mine, theirs = _params(getattr(cls, name)), _params(getattr(contract, name))
        if any(p.kind is p.VAR_POSITIONAL for p in mine.values()) and any(
                p.kind is p.VAR_KEYWORD for p in mine.values()):
            continue  # (*args, **kwargs): passes them on whole
        takes_any = any(p.kind is p.VAR_KEYWORD for p in mine.values())
        for pname, p in theirs.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            assert pname in mine or takes_any, f"{cls.__name__}.{name} lacks the contract's parameter {pname!r}"
            if pname in mine and p.default is not p.empty:
                assert mine[pname].default is not inspect.Parameter.empty, (
                    f"{cls.__name__}.{name}: {pname!r} has a default in the contract, none here")


def _service_sources():
    for folder in ("server", "integrations"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _annotated(fn: ast.FunctionDef | ast.AsyncFunctionDef, type_name: str) -> set[str]:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return {a.arg for a in args if a.annotation is not None and type_name in ast.unparse(a.annotation)}


def _uses(tree: ast.AST, type_name: str):
    """(function, parameter, attribute, line) for each attribute read of a parameter annotated type_name."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = _annotated(fn, type_name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in params:
                yield fn.name, node.value.id, node.attr, node.lineno


def test_the_service_uses_only_the_contract_of_a_collection():
    allowed = _members(CollectionContract)
    seen, outside = 0, []
    for path, tree in _service_sources():
        for fn, param, attr, line in _uses(tree, "CollectionContract"):
            seen += 1
            if attr not in allowed:
                outside.append(f"{path.relative_to(ROOT)}:{line} {fn}: {param}.{attr}")
    assert seen >= 30, "the routes' collections are no longer annotated CollectionContract: this test sees nothing"
    assert not outside, "members outside the collection contract:\n" + "\n".join(outside)


def _catalog_uses(tree: ast.AST):
    """(attribute, line) for each state.catalog.X, the one way the routes reach the catalog."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "catalog":
            yield node.attr, node.lineno


SNIFFED = {c.__name__ for c in COLLECTIONS + CATALOGS} | {"CollectionSearch"}


def _sniffs(tree: ast.AST):
    """(line, call) for each hasattr, or getattr with a default, on a collection, a catalog or a search's answer,
    and each isinstance against a class that holds one."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or not node.args:
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            if any(c in ast.unparse(node.args[1]) for c in SNIFFED):
                yield node.lineno, ast.unparse(node)
        elif node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
            target = ast.unparse(node.args[0])
            if any(w in target.split(".")[-1] for w in ("coll", "catalog", "res")) or target in ("c", "res"):
                yield node.lineno, ast.unparse(node)


def test_the_service_uses_only_the_contract_of_its_catalog():
    allowed = _members(CatalogContract)
    seen, outside = 0, []
    for path, tree in _service_sources():
        for attr, line in _catalog_uses(tree):
            seen += 1
            if attr not in allowed:
                outside.append(f"{path.relative_to(ROOT)}:{line}: catalog.{attr}")
    assert seen >= 10
    assert not outside, "members outside the catalog contract:\n" + "\n".join(outside)


def test_the_service_never_asks_which_class_it_holds():
    """No hasattr/getattr-with-default on a collection, a catalog or a search's answer, and no isinstance against
    the classes that hold one: what differs between them is the contract's to say."""
    found = [f"{path.relative_to(ROOT)}:{line}: {call}" for path, tree in _service_sources()
             for line, call in _sniffs(tree)]
    assert not found, "the service sniffs the class it holds:\n" + "\n".join(found)


def test_the_checks_see_a_member_outside_the_contract_and_a_sniff():
    """The three source checks above fail where they should, on the code the service had before the contract (a
    route reading coll.index, getattr on the catalog and on a collection, hasattr on an answer, isinstance), and
    pass what it does now (a dispatch by name, getattr without a default)."""
    src = ("async def route(coll: CollectionContract):\n    return coll.index, coll.name\n"
           "def other(state):\n    return getattr(state.catalog, 'aliases', None), state.catalog.names()\n"
           "def batch(self, res):\n"
           "    c = getattr(self._pending[0].collection, 'crossover', None)\n"
           "    return hasattr(res, 'missing_lists'), isinstance(res, ShardedCollection)\n"
           "def leader(self, method):\n    return getattr(self.coll, method)\n")
    tree = ast.parse(src)
    assert [(a, line) for _, _, a, line in _uses(tree, "CollectionContract")] == [("index", 2), ("name", 2)]
    assert "index" not in _members(CollectionContract) and "name" in _members(CollectionContract)
    assert list(_catalog_uses(tree)) == [("names", 4)]
    assert "names" in _members(CatalogContract) and "limits" in _members(CatalogContract)
    assert sorted(line for line, _ in _sniffs(tree)) == [4, 6, 7, 7]


def test_optional_features_are_refused_with_405_by_default():
    """A class that does not override an optional feature refuses it (UnsupportedError -> 405) or answers the
    neutral value; measured on a minimal implementation of the required members."""
    from fusionrag.retriever.errors import UnsupportedError
    from fusionrag.server.errors import http_status

    required = {n: (lambda self, *a, **k: None) for n in CollectionContract.__abstractmethods__}
    Minimal = type("Minimal", (CollectionContract,), required)
    m = Minimal()
    m.name = "m"
    for call in (lambda: m.snapshot("x"), m.claim_import, m.release_import, m.import_files, m.merge):
        with pytest.raises(UnsupportedError) as e:
            call()
        assert http_status(e.value) == 405 and "'m'" in str(e.value)
    assert m.crossover() is None and m.dormant is False and m.release_files() is False
    cat = type("MinimalCatalog", (CatalogContract,), {n: (lambda self, *a, **k: None)
                                                      for n in CatalogContract.__abstractmethods__})()
    assert cat.resolve("x") == "x" and cat.aliases() == {} and cat.readiness() is None
    with pytest.raises(UnsupportedError):
        cat.update_aliases([("delete", "a")])
