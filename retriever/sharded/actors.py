"""The Ray plumbing of sharded mode: Ray itself (an extra), shards started as actors on nodes that answer, a
failure told apart from a refusal, and the in-process stand-in for an ObjectRef."""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout

from fusionrag.retriever.engine.config import EngineConfig, SearchParams
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.sharded.parts import SHARD_LOCK_WAIT_S, ShardDown

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
