"""Where the sharded build (build.py) runs its two parallel steps, assigning ranges of rows and writing the shard
parts: Ray tasks (RayExecutor) or this process (LocalExecutor), chosen once (`executor_for`), as the router chooses
its kind of shard handle once (actors.py). The build calls the same methods whichever it got."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from fusionrag.retriever.engine.vectors import as_source
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.sharded.actors import ray_active, require_ray

# (key, arguments) of each call of a step, and (key, result) of each call done.
Calls = Iterable[tuple[Any, tuple]]


class LocalExecutor:
    """The steps in this process, one call after another, each with all the build's threads; what the tasks share
    is passed as it is."""

    kind = "local"  # the router manifest's placement.built_with

    def __init__(self, threads: int):
        self.threads = threads  # the threads each call runs with

    def ranges(self, bounds: list[int]) -> list[tuple[int, int]]:
        """The row ranges assigned one call each: one chunk (bounds[i]..bounds[i+1]) a call."""
        return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

    def source(self, source):
        """What the calls read the vectors from: the build's source."""
        return source

    def put(self, value):
        """A value every call takes, as they take it: itself."""
        return value

    def map(self, fn: Callable, calls: Calls) -> Iterator[tuple[Any, Any]]:
        """fn(*args) for each (key, args) of calls, in their order, each call's arguments made only when it runs;
        yields (key, result) as each returns."""
        for key, args in calls:
            yield key, fn(*args)


class RayExecutor:
    """The steps as Ray tasks of one CPU and one thread each, every call submitted at once; what the tasks share is
    put in Ray's object store once a step. The index directory must be on storage every node sees."""

    kind = "ray"
    threads = 1

    def __init__(self, ray):
        self.ray = ray

    def ranges(self, bounds: list[int]) -> list[tuple[int, int]]:
        """The row ranges assigned one task each: the chunks split into about as many ranges as the cluster has
        CPUs."""
        per = max(1, -(-(len(bounds) - 1) // max(1, int(self.ray.cluster_resources().get("CPU", 1)))))
        return [(bounds[i], bounds[min(i + per, len(bounds) - 1)]) for i in range(0, len(bounds) - 1, per)]

    def source(self, source):
        """What the tasks read the vectors from, put in the object store: a file's path (every node reads it), else
        the array."""
        src = as_source(source)
        return self.put(src.path if isinstance(source, (str, Path)) else src.data)

    def put(self, value):
        return self.ray.put(value)

    def map(self, fn: Callable, calls: Calls) -> Iterator[tuple[Any, Any]]:
        """fn(*args) as a task for each (key, args) of calls, all submitted first; yields (key, result) as each
        task finishes (a task's error raised here)."""
        task = self.ray.remote(fn).options(num_cpus=1)
        pending = {task.remote(*args): key for key, args in calls}
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            key = pending.pop(done[0])
            yield key, self.ray.get(done[0])


def executor_for(use_ray: bool | None, threads: int) -> LocalExecutor | RayExecutor:
    """The build's executor: Ray's where use_ray (None: where Ray is initialised in this process; ConfigError where
    Ray is asked for and not installed or not connected), else this process's, its calls run with `threads`."""
    use_ray = ray_active() if use_ray is None else use_ray
    if not use_ray:
        return LocalExecutor(threads)
    ray = require_ray()
    if not ray.is_initialized():
        raise ConfigError("use_ray: connect to a Ray cluster first (ray.init(address=...))")
    return RayExecutor(ray)
