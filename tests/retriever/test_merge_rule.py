"""One merge rule for a collection and a sharded one (#69 item 2: the Ray service merged a shard at 20,000 fresh
rows of its own while a sharded collection in a data directory merged at 20,000 over all its shards):
CollectionConfig.merge_due / shard_merge, what Collection, HostedSharded and the Ray service's health loop each
call. The loop is driven here over a stand-in for the router holding the counts it reads."""

from __future__ import annotations

import threading

import numpy as np

from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.server.ray_serve import keep_healthy


def test_a_merge_is_due_on_fresh_rows_or_tombstones_alone():
    cfg = CollectionConfig(merge_fresh_count=100)
    assert not cfg.merge_due(99, 99)  # each under the count: no merge, whatever their sum
    assert cfg.merge_due(100, 0) and cfg.merge_due(0, 100)
    assert cfg.shard_merge(99, 99, 4) is None
    assert cfg.shard_merge(100, 0, 4) == 25 and cfg.shard_merge(0, 250, 3) == 33
    assert CollectionConfig(merge_fresh_count=3).shard_merge(3, 0, 16) == 1  # never a share of 0
    assert cfg.filter_exact(cfg.filter_exact_max) and not cfg.filter_exact(cfg.filter_exact_max + 1)


class _Router:
    """What the health loop reads and calls of a ShardedIndex: its collection-wide fresh ids and tombstones."""

    def __init__(self, fresh: int, gone: int, shards: int, stop: threading.Event):
        self.fresh_owner = dict.fromkeys(range(fresh), (0,))
        self.base_gone = np.arange(gone)
        self.n_shards, self.stop, self.merges, self.rounds = shards, stop, [], 0

    def check_shards(self):
        return np.ones(self.n_shards, bool)

    def heal(self):
        return []

    def merge_shards(self, min_fresh: int):
        self.merges.append(min_fresh)


def _rounds(router: _Router, config: CollectionConfig, n: int = 3) -> list[int]:
    def after():
        router.rounds += 1
        if router.rounds >= n:
            router.stop.set()
    keep_healthy(router, 0.001, router.stop, config, after)
    return router.merges


def test_the_ray_services_health_loop_merges_by_the_collections_rule():
    cfg = CollectionConfig(merge_fresh_count=1000)
    # 4 shards holding 900 fresh rows in all (225 each): not due, where the old per-shard rule of 1,000 each and
    # this one agree; 1,200 in all (300 each): due by the collection's rule, which the per-shard one never reached.
    assert _rounds(_Router(900, 500, 4, threading.Event()), cfg) == []
    assert _rounds(_Router(1200, 0, 4, threading.Event()), cfg) == [250, 250, 250]
    assert _rounds(_Router(0, 1000, 2, threading.Event()), cfg) == [500, 500, 500]  # deletes alone
