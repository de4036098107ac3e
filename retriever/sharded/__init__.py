"""Sharded mode (docs/sharded.md): one collection over S shards, on Ray or in one process.

- parts.py: the directory (a router part, S shard parts), the names both sides use, the top-k merge;
- placement.py: which shard holds each posting list;
- build.py: the sharded build; executors.py: where its steps run (this process or Ray tasks), chosen once;
- shard.py: one shard part, opened (ShardServer): its generations (generations.py) and writes (writes.py);
- actors.py: the Ray plumbing (shards as actors, failures told from refusals);
- router.py: ShardedIndex, the router that sends each shard its lists and merges the answers (calls.py: a call to
  a shard as a typed record), made of its operations: router_search.py, router_reads.py, router_writes.py,
  router_admin.py (merges, faults);
- calibrate.py: the router's default search settings measured through the shards;
- docs.py: string ids, texts, metadata and filters over a sharded index (ShardedCollection);
- follow.py: routers beside the one that writes; hosted.py: a sharded collection in a data directory;
  catalog.py: one sharded collection as the service's catalog.
"""

from fusionrag.lazy import face

__all__ = ["PLACEMENTS", "ShardServer", "ShardedIndex", "ShardedResult", "build_sharded", "is_sharded"]
__getattr__, __dir__ = face(__name__, {
    "PLACEMENTS": "parts", "is_sharded": "parts", "ShardServer": "shard", "ShardedIndex": "router",
    "ShardedResult": "router", "build_sharded": "build",
})
