"""A package's face imported on first use (PEP 562): `from fusionrag.retriever import Index` loads the engine only
then, so importing a package for one light name (the client's, say) loads nothing else."""

from __future__ import annotations

import importlib


def face(package: str, names: dict[str, str]):
    """(__getattr__, __dir__) for the package: names maps each public name to the module (relative to the package)
    that defines it."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(names))

    return __getattr__, __dir__
