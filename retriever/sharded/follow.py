"""More than one router for a sharded index (docs/sharded.md, "Serving on Ray"): followers that search beside the
one router that writes, the leader.

The leader is an ordinary ShardedIndex: it opened the index, started the shards as Ray actors, and keeps the write
maps (which shards' fresh tiers hold which ids, which built ids are gone, the names of documents), which every write
changes and so only one router may hold. A search needs little of them: which shards are alive, how many fresh rows
each holds (a shard with some is asked by every query), which sets of shards hold fresh rows (what a down shard
makes unreachable), which list replicas missed writes (read only when their twin is down), and the default search
settings. ShardedIndex.view() hands that out, with the leader's shard actors, stamped (epoch, version): the
leader counts each change.

A follower (ShardedFollower) reads the router's navigation graph and list maps from the index directory, as the
leader did, and before each search asks for the view if it changed since the one it holds (one small call; None
when unchanged; in the service the leader publishes it on a board, server/ray_serve.py ViewBoard, and followers
read it there). A write the leader acknowledged changed the view before the acknowledgement, so a search that
starts after it, on any router, asks the shards that hold it: reads follow writes as on one router. Concurrent
searches share one such call (sync: group commit).

Everything else goes to the leader (FollowerCollection): writes, gets, pages, text and hybrid search, which read
the write maps. A filter's warnings (the metadata types every shard holds) are asked of the shards here. So many
routers scale the vector searches, which are most of the work, and each write is still done once, in order.

A shard a follower finds down is down for its searches until the leader's view says it is alive again (the leader
restarts it: a new actor, a new view), or for FOLLOWER_RECHECK_S at most when the leader still counts it alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.collection.records import CollectionSearch
from fusionrag.retriever.engine.config import EngineConfig, SearchParams, cpu_threads
from fusionrag.retriever.engine.learned_probe import load_probe_model
from fusionrag.retriever.engine.tiers import NavigationTier
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.router import ShardedIndex
from fusionrag.retriever.sharded.actors import shards_of

FOLLOWER_RECHECK_S = 2.0  # a shard this follower found down, while the leader counts it alive: tried again after

View = Callable[[str | None, int], dict | None]  # (epoch, version) -> the leader's view if newer, else None


class ShardedFollower(ShardedIndex):
    """A router that searches with the leader's shards and write state (module docstring); it writes nothing."""

    @classmethod
    def follow(cls, path, leader_view: View, config: EngineConfig | None = None, batch_size: int = 1024,
               verify: bool = True, call_timeout_s: float | None = None) -> "ShardedFollower":
        """The router at path (its graph and list maps, checked as ShardedIndex.open checks them), following the
        leader whose view() leader_view calls (in another process: through Ray)."""
        cls._check_options(call_timeout_s, batch_size)
        path, config = Path(path), config or EngineConfig()
        m, names = cls._read_router(path, config, verify)
        graph, list_shards, list_local, list_sizes, navigation = cls._router_tier(path, m, config)
        view = leader_view(None, -1)
        if view is None or len(view["shards"]) != len(names):
            raise ConfigError(f"{path}: the leader's view does not fit this index ({len(names)} shards)")
        nav = NavigationTier(graph, m["metric"] == "ip", cpu_threads(config.threads), navigation, None, list_sizes)
        out = cls(path, m, nav, list_shards, list_local, list_sizes, list(view["shards"]), shards_of(view["shards"]),
                  SearchParams.from_dict(view["params"]), batch_size)
        out.config, out.call_timeout_s, out.leader_view = config, call_timeout_s, leader_view
        out.shard_paths = [str((path / name).resolve()) for name in names]
        out.leader_alive = np.ones(out.n_shards, dtype=bool)
        out.down_since = np.zeros(out.n_shards)  # monotonic time this follower found each shard down
        out.seen: tuple[str | None, int] = (None, -1)
        out._rounds = threading.Condition()  # sync's rounds of calls to the leader: started, done (ok), one asking
        out._started, out._done, out._asking = 0, 0, False
        out._apply(view)
        out.nav.model = load_probe_model(path, m)
        return out

    def _apply(self, view: dict) -> None:
        """Take the leader's view: its shards, their state, its default search settings."""
        behind_lists, behind_col = view["behind"]
        writes = np.zeros_like(self.replica_writes)
        writes[np.asarray(behind_lists, dtype=np.int64), np.asarray(behind_col, dtype=np.int64)] = -1
        with self._lock:
            self.shards = list(view["shards"])
            self.leader_alive = np.asarray(view["alive"], dtype=bool).copy()
            self.alive[:] = self.leader_alive
            self.fresh_count[:] = view["fresh_count"]
            self.fresh_groups = dict(view["fresh_groups"])
            self.replica_writes = writes
            self.params = SearchParams.from_dict(view["params"])
            self.seen = (view["epoch"], int(view["version"]))

    def sync(self) -> None:
        """The leader's view, where it changed since the one this follower holds; shards found down here while
        the leader counts them alive are tried again after FOLLOWER_RECHECK_S.

        One call to the leader at a time, each for every search waiting (group commit): a search waits for the
        first call that starts after it arrived (one started earlier may have missed a write acknowledged
        meanwhile), so a follower asks the leader at most once per round trip however many searches it runs."""
        with self._rounds:
            need = self._started + 1  # the first round that starts after this search arrived
            while self._done < need:
                if not self._asking:
                    break
                self._rounds.wait()
            else:
                return
            self._asking, self._started = True, self._started + 1
            mine = self._started
        ok = False
        try:
            view = self.leader_view(*self.seen)
            if view is not None:
                self._apply(view)
            else:
                now = time.monotonic()
                with self._lock:
                    retry = ~self.alive & self.leader_alive & (now - self.down_since >= FOLLOWER_RECHECK_S)
                    self.alive[retry] = True
            ok = True
        finally:
            with self._rounds:
                self._asking = False
                if ok:  # a failed round serves no one: each waiting search then asks (and fails) itself
                    self._done = mine
                self._rounds.notify_all()

    def _mark_down(self, s: int) -> None:
        with self._lock:
            self.alive[s] = False
            self.down_since[s] = time.monotonic()

    def search(self, queries, k: int = 10, params: SearchParams | None = None, **kw):
        self.sync()
        return super().search(queries, k, params, **kw)

    def _leader_only(self, *_, **__):
        raise ConfigError(f"{self.path}: this router follows another; writes, merges and restarts are the leader's")

    upsert = delete = merge_shards = calibrate = heal = restart_shard = kill_shard = _leader_only
    documents = matching = text_search = page = live_count = _leader_only  # field_types, field_names: shards', here

    def close(self) -> None:
        """Lets go of the leader's shards (they are the leader's to stop)."""
        self.shard_kind.release()
        self.shards = []


Leader = Callable[[str, tuple, dict], Any]  # (a ShardedCollection method's name, args, kwargs) -> its answer


class FollowerCollection(ShardedCollection):
    """A ShardedCollection whose vector searches run on this router (a ShardedFollower), and everything else on
    the leader's collection (leader: calls a method of it, in another process through Ray)."""

    def __init__(self, index: ShardedFollower, name: str, leader: Leader, config: CollectionConfig | None = None):
        super().__init__(index, name, config)
        self.leader = leader

    def _on_leader(self, method: str, *args, **kwargs):
        return self.leader(method, args, kwargs)

    def upsert(self, docs) -> list[str]:
        return self._on_leader("upsert", list(docs))

    add = upsert

    def delete(self, ids: Sequence[str]) -> int:
        return self._on_leader("delete", ids)

    def delete_where(self, filter: dict) -> int:
        return self._on_leader("delete_where", filter)

    def __len__(self) -> int:
        return self._on_leader("__len__")

    def count(self, filter: dict | None = None) -> int:
        return self._on_leader("count", filter)

    def set_metadata(self, updates, merge: bool = True) -> int:
        return self._on_leader("set_metadata", dict(updates), merge)

    def get(self, ids: Sequence[str], with_vectors: bool = False):
        return self._on_leader("get", ids, with_vectors)

    def scroll(self, limit: int, after: int = -1, filter: dict | None = None, with_vectors: bool = False):
        return self._on_leader("scroll", limit, after, filter, with_vectors)

    def info(self) -> dict:
        return self._on_leader("info")

    def search(self, vectors=None, k: int = 10, filter: dict | None = None, params: SearchParams | None = None,
               with_vectors: bool = False, *, texts=None, mode: str = "vector", **kw) -> CollectionSearch:
        """Vector searches here; text and hybrid ones (they read the leader's write maps) on the leader."""
        if mode == "vector":
            return super().search(vectors, k, filter, params, with_vectors, texts=texts, mode=mode, **kw)
        return self._on_leader("search", vectors, k, filter, params, with_vectors, texts=texts, mode=mode, **kw)

    def close(self) -> None:
        self.index.close()
