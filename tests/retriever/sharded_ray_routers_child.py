"""Run inside a network and PID namespace of its own (tests/retriever/test_sharded_ray.py): a two-node Ray cluster on
127.0.0.1, the sharded index served by fusionrag.server.ray_serve with two router replicas following a leader
(retriever/sharded/follow.py), asked over real HTTP. Prints one JSON line of what it saw; stops every Ray process it
started.

usage: sharded_ray_routers_child.py WORKDIR   (WORKDIR holds queries.npy, idx/ and expect.npz, the in-process answers)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from ray_namespace import PORT, listening, ray_cluster  # noqa: E402
from sharded_ray_serve_child import actor_pids, shard_actor_pids  # noqa: E402

HTTP_PORT = 8392
SEARCH = "/v1/collections/docs/search"


def call(method: str, path: str, body=None) -> tuple[int, dict, str | None]:
    """(status, body, the router replica that answered: header x-fusionrag-router)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}", data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers.get("x-fusionrag-router")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get("x-fusionrag-router")


def status_of(method: str, path: str, body=None) -> str:
    try:
        return str(call(method, path, body)[0])
    except (OSError, ValueError) as e:
        return type(e).__name__


def router_pids() -> list[int]:
    return actor_pids(b"ray::ServeReplica:fusionrag:fusionrag-router")


def leader_pids() -> list[int]:
    return actor_pids(b"ray::ServeReplica:fusionrag:fusionrag-leader")


def top1(v) -> str | None:
    s, b, _ = call("POST", SEARCH, {"vectors": [v], "k": 1, "partial": False})
    return b["results"][0][0]["id"] if s == 200 and b["results"][0] else None


class Report(dict):
    """What the run saw; each entry also written to stderr as it comes (a post-mortem of a run cut short)."""

    def __setitem__(self, key, value):
        print(f"{key}: {value}", file=sys.stderr, flush=True)
        super().__setitem__(key, value)


def main() -> None:
    work = Path(sys.argv[1])
    report = Report()
    t0 = time.perf_counter()
    # Serve's HTTP proxy sends each request to a replica on its own node while that one has room; the test's
    # nodes are one machine, so it spreads them over both replicas instead (docs/sharded.md, "Serving on Ray").
    # CUDA_VISIBLE_DEVICES as a node with one GPU has it: the shard actors see it (they reserve no GPU of Ray's, which
    # would leave it unchanged only for them), and, this machine having no CUDA, filter on the CPU.
    with ray_cluster(2, env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0", "CUDA_VISIBLE_DEVICES": "0"}):
        from ray import serve as rserve

        from fusionrag.server.ray_serve import serve

        url = serve(f"127.0.0.1:{PORT}", work / "idx", "127.0.0.1", HTTP_PORT, name="docs", block=False, routers=2)
        report["serve_start_s"] = round(time.perf_counter() - t0, 1)
        report["ready"] = call("GET", "/readyz")[:2]
        report["routers"], report["leaders"] = len(router_pids()), len(leader_pids())
        queries = np.load(work / "queries.npy")
        expect = np.load(work / "expect.npz")
        # Every replica answers as the index in one process does.
        answered, equal = set(), []
        for _ in range(12):
            s, b, who = call("POST", SEARCH, {"vectors": queries.tolist(), "k": 10})
            answered.add(who)
            ids = [[int(h["id"]) for h in hits] for hits in b["results"]] if s == 200 else None
            equal.append(ids == [[int(i) for i in row if i >= 0] for row in expect["ids"]])
        report["answered_by"], report["all_equal"] = len(answered - {None}), all(equal)
        t = time.perf_counter()
        for _ in range(20):
            call("POST", SEARCH, {"vectors": queries[:1].tolist(), "k": 10})
        report["one_query_ms"] = round((time.perf_counter() - t) / 20 * 1000, 1)
        # Writes go through the leader; every replica's next search sees each one.
        seen = []
        for j in range(6):
            v = (queries[j] + 0.001).tolist()
            s, b, _ = call("POST", "/v1/collections/docs/documents", {"documents": [{"id": f"w{j}", "vector": v,
                                                                                     "text": f"write {j}"}]})
            seen.append(s == 200 and all(top1(v) == f"w{j}" for _ in range(4)))
        report["writes_seen_at_once"] = seen
        s, b, _ = call("POST", SEARCH, {"texts": ["write 3"], "mode": "text", "k": 1})
        report["text_first"] = b["results"][0][0]["id"] if s == 200 and b["results"][0] else s
        report["get"] = call("POST", "/v1/collections/docs/documents/get", {"ids": ["w2"]})[1].get("documents")
        info = call("GET", "/v1/collections/docs")[1]
        report["count"], report["tiers"] = info.get("count"), info.get("shards_tiers")
        report["bad"] = call("POST", SEARCH, {"vectors": [[0.0] * 3]})[0]
        report["bad_write"] = call("POST", "/v1/collections/docs/documents",
                                   {"documents": [{"id": "x", "vector": [0.0] * 3}]})[0]
        report["delete"] = call("POST", "/v1/collections/docs/documents/delete", {"ids": ["w5"]})[:2]
        report["deleted_gone"] = top1((queries[5] + 0.001).tolist()) != "w5"
        # One router replica SIGKILLed: the other goes on answering; Serve starts a third.
        old = router_pids()
        os.kill(old[0], signal.SIGKILL)
        t, statuses = time.perf_counter(), []
        while time.perf_counter() - t < 120:
            statuses.append(status_of("POST", SEARCH, {"vectors": queries[:4].tolist(), "k": 10}))
            now = router_pids()
            if len(now) == 2 and old[0] not in now:
                break
            time.sleep(0.2)
        report["router_statuses"] = {x: statuses.count(x) for x in set(statuses)}
        report["router_back_s"] = round(time.perf_counter() - t, 1)
        report["router_replaced"] = len(router_pids()) == 2 and old[0] not in router_pids()
        # The leader SIGKILLed (its shard actors die with it): 503s, no other error, until Serve's new leader has
        # opened the index again; then the writes acknowledged before are all there.
        old_leader = leader_pids()
        os.kill(old_leader[0], signal.SIGKILL)
        t, statuses = time.perf_counter(), []
        while time.perf_counter() - t < 180:
            statuses.append(status_of("POST", SEARCH, {"vectors": queries[:4].tolist(), "k": 10,
                                                       "partial": False}))
            if statuses[-1] == "200" and leader_pids() and leader_pids() != old_leader:
                break
            time.sleep(0.5)
        report["leader_statuses"] = {x: statuses.count(x) for x in set(statuses)}
        report["leader_back_s"] = round(time.perf_counter() - t, 1)
        report["writes_after_leader_kill"] = [top1((queries[j] + 0.001).tolist()) for j in range(6)]
        report["shards"] = len(shard_actor_pids())
        report["listening"] = listening()
        rserve.shutdown()
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["url"] = url
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
