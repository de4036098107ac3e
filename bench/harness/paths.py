"""Where the benchmarks keep their data and results, and how a study starts a copy of itself.

Studies run as modules from the repository root (`python -m bench.<topic>.<study>`), so a process a study
starts runs `python -m` the same module with the repository root as its working directory: `module_argv`
and `ROOT`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
WORK = BENCH / "work"  # data sets, indexes and scratch (git-ignored)
RESULTS = BENCH / "results"  # one folder per topic


def results(topic: str) -> Path:
    """The results folder of one topic, bench/results/<topic>."""
    return RESULTS / topic


def module_argv(spec_name: str, *args: str) -> list[str]:
    """argv that runs the module `spec_name` (a study's `__spec__.name`) again in a process of its own; run it
    with cwd=ROOT so that `bench` is importable there."""
    return [sys.executable, "-m", spec_name, *args]


def tests_module(name: str):
    """A helper module of the test suite (tests/<name>.py: server_util, ray_namespace), loaded from its file,
    without putting tests/ on sys.path."""
    key = f"_fusionrag_tests_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
