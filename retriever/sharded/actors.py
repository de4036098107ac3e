"""The Ray plumbing of sharded mode: Ray itself (an extra), shards started as actors on nodes that answer, a
failure told apart from a refusal, and the in-process stand-in for an ObjectRef."""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from fusionrag.retriever.engine.config import EngineConfig, SearchParams
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.sharded.parts import SHARD_LOCK_WAIT_S, ShardDown

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("sharded mode on Ray needs the ray extra (pip install 'fusionrag[ray]')") from e
    return ray


def ray_active() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()




def is_down(e: BaseException) -> bool:
    """Whether a shard call failed because the shard is not running (not because of what it was asked)."""
    if isinstance(e, (ShardDown, FutureTimeout)):
        return True
    try:
        from ray import exceptions as rx
    except ImportError:
        return False
    return isinstance(e, (rx.RayActorError, rx.ActorUnavailableError, rx.GetTimeoutError))


def reachable_nodes(ray) -> list[str]:
    """The ids of the nodes Ray counts alive whose raylet also takes a connection now, sorted (all that Ray counts
    alive, if none does). Ray counts a node alive until its health checks fail, 12-15 s after it died; an actor
    placed there meanwhile waits on it, and on Ray 2.60 the GCS itself was seen to exit when the node was then
    declared dead with that actor's lease pending (tests/retriever/sharded_ray_faults_child.py node-crash)."""
    import socket

    alive = sorted((n["NodeID"], n.get("NodeManagerAddress"), n.get("NodeManagerPort")) for n in ray.nodes()
                   if n.get("Alive"))
    reachable = []
    for node, host, port in alive:
        try:
            socket.create_connection((host, int(port)), timeout=NODE_PROBE_S).close()
        except (OSError, TypeError, ValueError):
            continue
        reachable.append(node)
    return reachable or [node for node, _, _ in alive]


NODE_PROBE_S = 0.5  # a raylet that takes no connection in this long is taken for dead


def start_actor(path: str, config: EngineConfig, params: SearchParams, options: dict, s: int,
                 avoid: str | None = None, reachable: list[str] | None = None):
    """Shard s as a Ray actor: by default on the s-th alive node (mod their count), and only there (a hard
    affinity: a soft one lets the chosen raylet spill the lease to a node Ray still counts alive, a dead one), of
    the nodes whose raylet answers (reachable_nodes, or reachable where the caller probed them once for several
    shards). avoid: a node left out while another answers, the node a dead shard ran on."""
    from fusionrag.retriever.sharded.shard import ShardServer

    ray = require_ray()
    options = dict(options)
    if "scheduling_strategy" not in options:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        reachable = reachable or reachable_nodes(ray)
        nodes = [n for n in reachable if n != avoid] or reachable
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[s % len(nodes)], soft=False)
    return ray.remote(ShardServer).options(**options).remote(path, config, params, SHARD_LOCK_WAIT_S)


class LocalFuture:
    """A result computed in this process, with the interface the router needs of a Ray ObjectRef."""

    def __init__(self, fut):
        self.fut = fut

    def get(self, timeout: float | None = None):
        return self.fut.result(timeout)


# -- the two kinds of shard: the only place that tells a Ray actor from an object in this process -----------------


class LocalShards:
    """Shards as ShardServer objects in this process, their calls on a pool of threads (one a shard)."""

    def __init__(self, n: int):
        from concurrent.futures import ThreadPoolExecutor

        self._n = max(1, n)
        self._pool = ThreadPoolExecutor(max_workers=self._n, thread_name_prefix="fusionrag-shard")

    def _shared(self, config: EngineConfig) -> EngineConfig:
        """The shards of this process share its page buffer (--buffer-mb): each shard a share of it, where each
        took all of it (a 4-shard collection held 4 x 64 MiB). Shards as Ray actors keep theirs: each its own
        process, on its own node."""
        return config.with_overrides(buffer_bytes=config.buffer_bytes // self._n) if self._n > 1 else config

    def open_all(self, index: Path, paths: list[str], config: EngineConfig,
                 params: SearchParams) -> tuple[list, list[dict]]:
        """Every shard opened (those opened let go of their directories if one fails), and where each runs."""
        from fusionrag.retriever.sharded.shard import ShardServer

        shards = []
        try:
            for p in paths:
                shards.append(ShardServer(p, self._shared(config), params))
        except BaseException:
            for opened in shards:
                opened.close()
            raise
        return shards, [s.where() for s in shards]

    def call(self, shard, method: str, *args) -> LocalFuture:
        return LocalFuture(self._pool.submit(getattr(shard, method), *args))

    def call_apart(self, shard, method: str, *args) -> LocalFuture:
        """A long call (a merge) on a thread of its own, so the pool's stay free for searches and writes."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusionrag-merge")
        try:
            return LocalFuture(pool.submit(getattr(shard, method), *args))
        finally:
            pool.shutdown(wait=False)

    @staticmethod
    def get(handle: LocalFuture, timeout: float | None = None):
        return handle.get(timeout)

    @staticmethod
    def kill(shard) -> None:
        """As a crash would, for this process: the shard closed (its directory, log included, stays)."""
        try:
            shard.close()
        except Exception:  # noqa: BLE001 - already closed
            pass

    def restart(self, shard, path: str, config: EngineConfig, params: SearchParams, s: int,
                avoid: str | None = None) -> tuple[object, dict]:
        self.kill(shard)
        from fusionrag.retriever.sharded.shard import ShardServer

        new = ShardServer(path, self._shared(config), params)
        return new, new.where()

    def release(self) -> None:
        """Let go of the threads (a follower: the shards are its leader's)."""
        self._pool.shutdown()

    def stop(self, shards: list) -> None:
        self._pool.shutdown()
        for s in shards:
            if not s.closed:
                s.close()


class RayShards:
    """Shards as Ray actors (start_actor), each call a remote call."""

    def __init__(self, options: dict | None = None):
        self.ray_module = require_ray()
        self.options = options

    @classmethod
    def connected(cls, actor_options: dict | None) -> "RayShards":
        """The kind a router that starts its shards uses: Ray initialised (ConfigError otherwise); each actor takes
        no CPU, no restarts, threads of its own for its calls (searches go on while it merges: ShardServer is
        thread-safe), and actor_options over those."""
        ray = require_ray()
        if not ray.is_initialized():
            raise ConfigError("ray=True: connect to a Ray cluster first (ray.init(address=...))")
        return cls({"num_cpus": 0, "max_restarts": 0, "max_concurrency": 8, **(actor_options or {})})

    def open_all(self, index: Path, paths: list[str], config: EngineConfig,
                 params: SearchParams) -> tuple[list, list[dict]]:
        """Shard s on the s-th node that answers (the nodes probed once), and where each runs; a shard that fails
        to open stops them all: ConflictError where its index is open in another process, else IndexFormatError."""
        from fusionrag.retriever.errors import ConflictError, IndexFormatError

        ray = self.ray_module
        reachable = None if "scheduling_strategy" in self.options else reachable_nodes(ray)
        shards = [start_actor(p, config, params, self.options, s, reachable=reachable) for s, p in enumerate(paths)]
        try:
            return shards, ray.get([s.where.remote() for s in shards])
        except ray.exceptions.RayActorError as e:
            for s in shards:
                ray.kill(s)
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ConflictError):  # open in another process: the index is fine
                raise ConflictError(f"{index}: a shard failed to open: {cause}") from e
            raise IndexFormatError(f"{index}: a shard failed to open: {cause}") from e

    @staticmethod
    def call(shard, method: str, *args):
        return getattr(shard, method).remote(*args)

    call_apart = call  # an actor's calls run on its own threads

    def get(self, handle, timeout: float | None = None):
        return self.ray_module.get(handle, timeout=timeout)

    def kill(self, shard) -> None:
        try:
            self.ray_module.kill(shard, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def restart(self, shard, path: str, config: EngineConfig, params: SearchParams, s: int,
                avoid: str | None = None) -> tuple[object, dict]:
        """Shard s started again from its directory, on another node than `avoid` (the one it ran on, which may be
        dying) where another answers. Hard affinity (start_actor): with a soft one, the node-crash test saw the
        head's raylet hand the lease on to the killed node, and the GCS exit when that node was declared dead."""
        self.kill(shard)
        new = start_actor(path, config, params, self.options, s, avoid=avoid)
        return new, self.ray_module.get(new.where.remote())

    def release(self) -> None:
        pass

    def stop(self, shards: list) -> None:
        for s in shards:
            self.ray_module.kill(s)


def shards_of(handles: list) -> LocalShards | RayShards:
    """The kind of the shards a leader hands a follower: objects in this process (tests), or Ray actors."""
    from fusionrag.retriever.sharded.shard import ShardServer

    return LocalShards(len(handles)) if isinstance(handles[0], ShardServer) else RayShards()
