"""Run inside a network and PID namespace of its own (tests/retriever/test_sharded_ray.py): a two-node Ray cluster on
127.0.0.1, the sharded index served by fusionrag.server.ray_serve (the router a Ray Serve deployment, the shards Ray
actors), asked over real HTTP. Prints one JSON line of what it saw; stops every Ray process it started.

usage: sharded_ray_serve_child.py WORKDIR   (WORKDIR holds queries.npy, idx/ and expect.npz, the in-process answers)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from ray_namespace import PORT, listening, ray_cluster  # noqa: E402

HTTP_PORT = 8391


def call(method: str, path: str, body=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}", data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def actor_pids(prefix: bytes) -> list[int]:
    """The processes whose command line starts with prefix (Ray names an actor's process ray::CLASS)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "cmdline").read_bytes().startswith(prefix):
                out.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return sorted(out)


def shard_actor_pids() -> list[int]:
    return actor_pids(b"ray::ShardServer")


def router_pids() -> list[int]:
    return actor_pids(b"ray::ServeReplica:fusionrag:fusionrag-router")


def status_of(method: str, path: str, body=None) -> str:
    """The HTTP status, or the error when there is no answer (the router's replica gone)."""
    try:
        return str(call(method, path, body)[0])
    except (OSError, ValueError) as e:
        return type(e).__name__


def main() -> None:
    work = Path(sys.argv[1])
    report: dict = {}
    t0 = time.perf_counter()
    with ray_cluster(2):
        import ray
        from ray import serve as rserve

        from fusionrag.server.ray_serve import serve

        report["nodes"] = sum(1 for n in ray.nodes() if n["Alive"])
        t = time.perf_counter()
        # The settings as `fusionrag serve --ray ADDRESS --index DIR --max-k 40 ...` reads them from its flags
        # (cli._cmd_serve hands them to serve() as config): a limit given there reaches every replica, and the
        # engine flags every shard actor.
        from fusionrag.cli import build_parser
        from fusionrag.server.config import flags_of, load_config

        args = build_parser().parse_args(["serve", "--ray", f"127.0.0.1:{PORT}", "--index", str(work / "idx"),
                                          "--name", "docs", "--host", "127.0.0.1", "--port", str(HTTP_PORT),
                                          "--max-k", "40", "--raw-in-ram", "off", "--buffer-mb", "2"])
        config = load_config(args.config, flags_of(args))
        url = serve(args.ray, args.index, config.host, config.port, name=args.name, block=False, config=config)
        report["url"] = url
        report["serve_start_s"] = time.perf_counter() - t
        report["ready"] = call("GET", "/readyz")
        queries = np.load(work / "queries.npy")
        expect = np.load(work / "expect.npz")
        status, body = call("POST", "/v1/collections/docs/search", {"vectors": queries.tolist(), "k": 10})
        report["search_status"] = status
        report["tiers"] = call("GET", "/v1/collections/docs")[1]["tiers"]
        report["over_max_k"] = call("POST", "/v1/collections/docs/search", {"vectors": queries[:1].tolist(), "k": 41})
        ids = np.array([[int(h["id"]) for h in hits] + [-1] * (10 - len(hits)) for hits in body["results"]])
        dists = np.array([[h["distance"] for h in hits] + [np.inf] * (10 - len(hits)) for hits in body["results"]])
        report["ids_equal"] = bool(np.array_equal(ids, expect["ids"]))
        report["dists_close"] = bool(np.allclose(dists, expect["distances"], rtol=1e-5, atol=1e-5))
        t = time.perf_counter()
        for _ in range(20):
            call("POST", "/v1/collections/docs/search", {"vectors": queries[:1].tolist(), "k": 10})
        report["one_query_ms"] = (time.perf_counter() - t) / 20 * 1000
        v = (queries[0] + 0.001).tolist()
        report["upsert"] = call("POST", "/v1/collections/docs/documents", {"documents": [{"id": "900000", "vector": v}]})
        s, b = call("POST", "/v1/collections/docs/search", {"vectors": [v], "k": 1})
        report["upserted_found"] = s == 200 and b["results"][0][0]["id"] == "900000"
        report["delete"] = call("POST", "/v1/collections/docs/documents/delete", {"ids": ["900000"]})
        # The LangChain store, unchanged, against the Ray-served router: texts, metadata, a filter, ids of its own.
        from langchain_core.embeddings import DeterministicFakeEmbedding

        from fusionrag.integrations.langchain import FusionRAGVectorStore

        store = FusionRAGVectorStore(DeterministicFakeEmbedding(size=16), collection="docs", url=url)
        texts = [f"note {i}" for i in range(20)]
        names = [f"n-{i}" for i in range(20)]
        report["langchain_ids"] = store.add_texts(texts, [{"kind": "odd" if i % 2 else "even"} for i in range(20)],
                                                  ids=names) == names
        hits = store.similarity_search(texts[3], k=4, filter={"kind": "odd"})
        report["langchain_first"] = [hits[0].id, hits[0].page_content] if hits else None
        report["langchain_filtered"] = len(hits) == 4 and all(h.metadata["kind"] == "odd" for h in hits)
        # Text search through the shard actors: the collection's BM25 statistics gathered from each, then scored.
        s, b = call("POST", "/v1/collections/docs/search", {"texts": ["note 3"], "mode": "text", "k": 3})
        report["text_first"] = b["results"][0][0]["id"] if s == 200 and b["results"][0] else s
        # A shard actor killed: answers go on (partial where lists are missing), the router restarts it.
        victim = shard_actor_pids()[0]
        os.kill(victim, signal.SIGKILL)
        t, statuses = time.perf_counter(), []
        while time.perf_counter() - t < 90:
            s, b = call("POST", "/v1/collections/docs/search", {"vectors": queries.tolist(), "k": 10})
            statuses.append((s, b.get("partial")))
            if call("GET", "/readyz")[0] == 200 and call("GET", "/readyz")[1]["status"] == "ready" and \
                    victim not in shard_actor_pids():
                break
            time.sleep(0.5)
        report["healed_s"] = round(time.perf_counter() - t, 2)
        report["statuses_while_down"] = sorted({f"{s} partial={p}" for s, p in statuses})
        # The store's documents came back with the restarted shard (its log replayed); then they go.
        report["langchain_after_heal"] = [d.page_content for d in store.get_by_ids(names)] == texts
        report["langchain_deleted"] = store.delete(names) and store.get_by_ids(names) == []
        store.close()
        s, b = call("POST", "/v1/collections/docs/search", {"vectors": queries.tolist(), "k": 10, "partial": False})
        report["after_heal"] = s
        report["after_heal_equal"] = s == 200 and [[int(h["id"]) for h in hits] for hits in b["results"]] == \
            [[int(i) for i in row if i >= 0] for row in expect["ids"]]
        # The router's replica killed: Serve starts another, which opens the index again (new shard actors, once
        # the dead replica's own are gone) and finds the write acknowledged just before.
        v2 = (queries[1] + 0.001).tolist()
        report["upsert_before_router_kill"] = call("POST", "/v1/collections/docs/documents",
                                                   {"documents": [{"id": "900001", "vector": v2}]})[0]
        old_router, old_shards = router_pids(), shard_actor_pids()
        os.kill(old_router[0], signal.SIGKILL)
        t, seen = time.perf_counter(), []
        while time.perf_counter() - t < 180:
            seen.append(status_of("GET", "/readyz"))
            if seen[-1] == "200" and router_pids() and router_pids() != old_router:
                break
            time.sleep(0.5)
        report["router_back_s"] = round(time.perf_counter() - t, 2)
        report["router_statuses_while_down"] = sorted(set(seen))
        report["router_replaced"] = bool(router_pids()) and router_pids() != old_router
        report["shards_replaced"] = len(shard_actor_pids()) == 2 and not set(old_shards) & set(shard_actor_pids())
        s, b = call("POST", "/v1/collections/docs/search", {"vectors": [v2], "k": 1, "partial": False})
        report["write_found_after_router_kill"] = s == 200 and b["results"][0][0]["id"] == "900001"
        report["bad"] = call("POST", "/v1/collections/docs/search", {"texts": ["hi"]})[0]
        report["unknown"] = call("POST", "/v1/collections/nope/search", {"vectors": [v]})[0]
        report["listening"] = listening()
        report["listeners"] = [line for line in subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True)
                               .stdout.splitlines() if "127.0.0.1" not in line]
        rserve.shutdown()
    report["total_s"] = time.perf_counter() - t0
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
