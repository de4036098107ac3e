"""Run inside a network namespace of its own (tests/retriever/test_sharded.py starts it under `unshare --net --pid`,
loopback up): a two-node Ray cluster on 127.0.0.1, a sharded build as Ray tasks, the query path through
Ray actors. Prints one JSON line of what it saw; stops every Ray process it started.

usage: sharded_ray_child.py WORKDIR   (WORKDIR holds base.npy, queries.npy and local/, a sharded index
built in this process's mode, whose results local.npz the test computed)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from ray_namespace import listening, ray_cluster  # noqa: E402


def main() -> None:
    work = Path(sys.argv[1])
    report: dict = {}
    with ray_cluster(2):
        import ray

        from fusionrag.retriever.engine.config import BuildConfig
        from fusionrag.retriever.sharded.build import build_sharded
        from fusionrag.retriever.sharded.router import ShardedIndex

        report["nodes"] = sum(1 for n in ray.nodes() if n["Alive"])
        base, queries = np.load(work / "base.npy"), np.load(work / "queries.npy")
        config = BuildConfig(**json.loads((work / "build_config.json").read_text()))
        m = build_sharded(base, work / "ray", 2, config, use_ray=True, progress=False)
        report["built_with"] = m["placement"]["built_with"]
        same = [np.array_equal(np.load(work / "ray" / f), np.load(work / "local" / f))
                for f in ("list_shards.npy", "list_local.npy", "list_sizes.npy")]
        for part in ("shard-000", "shard-001"):
            same += [np.array_equal(np.load(work / "ray" / part / f), np.load(work / "local" / part / f))
                     for f in ("global_ids.npy", "list_offsets.npy", "list_ids.npy", "pq_codes.npy")]
        report["same_as_local_build"] = all(same)
        index = ShardedIndex.open(work / "local", ray=True)
        report["actor_nodes"] = len({w["node_id"] for w in index.where})
        report["actor_pids"] = [w["pid"] for w in index.where]
        res = index.search(queries, 10)
        expect = np.load(work / "local.npz")
        report["ids_equal"] = bool(np.array_equal(res.ids, expect["ids"]))
        report["dists_close"] = bool(np.allclose(res.distances, expect["distances"], rtol=1e-5, atol=1e-5))
        report["shards_probed_mean"] = float(res.stats["shards_probed"].mean())
        report["queries_per_shard"] = [int(x) for x in res.per_shard["queries"]]
        # Writes, then each shard merged on its actor (searches answered meanwhile on the actor's other threads):
        # with every list probed and every candidate re-ranked, the same answers before and after.
        import threading

        from fusionrag.retriever.engine.config import SearchParams

        everything = SearchParams(rerank=len(base) + 500, beta=0, nprobe=1 << 16, probe_ratio=0)
        rng = np.random.default_rng(4)
        index.upsert(np.arange(len(base), len(base) + 300), base[rng.integers(0, len(base), 300)] + 0.05)
        index.delete(np.arange(0, 40))
        before = index.search(queries, 10, everything)
        during, stop = [], threading.Event()

        def search_meanwhile():
            while not stop.is_set():
                during.append(bool(np.array_equal(index.search(queries, 10, everything).ids, before.ids)))

        t = threading.Thread(target=search_meanwhile)
        t.start()
        merged = index.merge_shards()
        stop.set()
        t.join()
        after = index.search(queries, 10, everything)
        report["merged_generations"] = sorted(r.get("generation", 0) for r in merged.values())
        report["merge_same_answers"] = bool(np.array_equal(after.ids, before.ids)) and \
            bool(np.allclose(after.distances, before.distances, rtol=1e-5, atol=1e-5))
        report["searches_during_merge"] = [len(during), all(during)]
        report["fresh_after_merge"] = [int(x) for x in index.fresh_count]
        report["listening"] = listening()
        index.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
