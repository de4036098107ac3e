"""#65: the search route answered below FastAPI's routing (server/fastpath.py) answers exactly what the FastAPI route
answers, errors, keys and limits included, counts in the metrics under the route's name, and neither makes a
thread-pool hop for its dependencies (FastAPI runs a plain-function dependency in its thread pool: three hops a
search before)."""

from __future__ import annotations

import json
import re

import anyio.to_thread
import numpy as np
import pytest
from fastapi.testclient import TestClient

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig

DIM = 8
KEYS = "admin-key-0001;team-key-0001 t-*"
ADMIN = {"Authorization": "Bearer admin-key-0001"}
TEAM = {"Authorization": "Bearer team-key-0001"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast") / "data"
    cat = Catalog(root, collection_config=CollectionConfig(background_merge=False, min_index_count=100))
    col = cat.create("c", DIM, "l2")
    rng = np.random.default_rng(0)
    col.add([Document(f"d{i}", f"text {i} about {i % 7}", rng.standard_normal(DIM), {"g": i % 5, "s": f"x{i % 3}"})
             for i in range(400)])
    col.merge()  # searched by the engine's index, not only the exact fresh tier
    cat.close()
    return root


def _vec(i: int) -> list[float]:
    return np.random.default_rng(100 + i).standard_normal(DIM).round(4).tolist()


# (headers, path, raw body): what a client sends, good and bad
REQUESTS = [
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(1), _vec(2)], "k": 3, "stats": True})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(3)], "k": 4, "filter": {"g": {"$gt": 2}},
                                                    "with_vectors": True})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(4)], "k": 4, "filter": {"missing": 1}})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"texts": ["text about 3"], "mode": "text", "k": 3})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"texts": ["needs a model"], "k": 3})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [[1.0, 2.0]], "k": 3})),
    (ADMIN, "/v1/collections/c/search", '{"vectors": [[1, 2, 3, 4, 5, 6, 7, NaN]], "k": 3}'),
    (ADMIN, "/v1/collections/c/search", '{"vectors": [' + json.dumps(_vec(5)) + '], "k": 3, "filter": {"g": 1' + "0" * 400 + "}}"),
    (ADMIN, "/v1/collections/c/search", '{"vectors": [[1, 2'),
    (ADMIN, "/v1/collections/c/search", "[1, 2]"),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(6)], "k": 100000})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(6)], "k": 2, "params": {"nprobe": "x"}})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(6)], "k": 2, "bogus": 1})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(7)] * 300, "k": 2})),
    (ADMIN, "/v1/collections/c/search", json.dumps({"vectors": [_vec(8)], "k": 2, "pad": "y" * 70000})),
    (ADMIN, "/v1/collections/nope/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    (ADMIN, "/v1/collections/bad%20name/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    (ADMIN, "/v1/collections/-x/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    ({}, "/v1/collections/c/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    ({"Authorization": "Bearer wrong-key-0001"}, "/v1/collections/c/search", json.dumps({"vectors": [_vec(0)]})),
    (TEAM, "/v1/collections/c/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    (TEAM, "/v1/collections/t-none/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
    (TEAM, "/v1/collections/vs_0123456789abcdef01234567/search", json.dumps({"vectors": [_vec(0)], "k": 5})),
]


def _answers(data, fast: bool):
    cfg = ServerConfig(data_dir=str(data), demo=False, api_keys=KEYS, max_body_bytes=65536)
    hops = []
    real = anyio.to_thread.run_sync

    async def counted(func, *args, **kwargs):
        inner = getattr(func, "func", func)  # run_in_threadpool hands a functools.partial
        hops.append(getattr(inner, "__name__", type(inner).__name__))
        return await real(func, *args, **kwargs)

    out = []
    with TestClient(create_app(cfg, fast_routes=fast), raise_server_exceptions=False) as client:
        client.get("/readyz")
        anyio.to_thread.run_sync = counted
        try:
            for headers, path, body in REQUESTS:
                r = client.post(path, content=body, headers={**headers, "content-type": "application/json"})
                answer = r.json()
                if "stats" in answer:  # timings differ run to run: their names compared
                    answer["stats"] = [sorted(s) for s in answer["stats"]]
                out.append((r.status_code, answer, {k: r.headers.get(k) for k in
                                                      ("www-authenticate", "retry-after", "connection")}))
            plain_hops = list(hops)  # every request above but the filtered searches is a plain one
        finally:
            anyio.to_thread.run_sync = real
        metrics = client.get("/metrics", headers=ADMIN).text
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'fusionrag_http_requests_total\{method="POST",route="/v1/collections/\{name\}/search",status="(\d+)"\} '
        r"([0-9.e+]+)", metrics)}
    return out, plain_hops, counts


def test_the_fast_search_route_answers_as_the_fastapi_route(data):
    fast, fast_hops, fast_counts = _answers(data, True)
    slow, slow_hops, slow_counts = _answers(data, False)
    statuses = [s for s, _, _ in fast]
    assert statuses[:5] == [200] * 5 and {400, 401, 403, 404, 413, 422} <= set(statuses), statuses
    for (req, f, s) in zip(REQUESTS, fast, slow):
        assert f == s, (req[1], req[2][:80], f, s)
    assert fast[0][1]["results"][0] and len(fast[0][1]["results"][0]) == 5
    assert fast[3][1].get("warnings")  # a filter on a field no document holds is warned of
    # Thread hops: only the filtered searches' warnings (a doc-store read, off the loop); no dependency's.
    # (opening a collection not open yet is a hop, 'collection_of': how many depends on the catalog's opening at
    # start racing the first requests)
    drop = lambda hops: [h for h in hops if h != "collection_of"]  # noqa: E731
    assert drop(fast_hops) == drop(slow_hops), (fast_hops, slow_hops)
    assert fast_hops.count("filter_warnings") == 2 and set(fast_hops) <= {"filter_warnings", "collection_of"}
    assert fast_counts == slow_counts and fast_counts.get("200") == 5, (fast_counts, slow_counts)


def test_a_search_skips_fastapis_stack_and_keeps_the_services_middleware(data, monkeypatch, fastapi_stack_passes):
    """The fast route is taken before FastAPI's own layers (no pass through its server-error middleware), yet keeps
    the service's: a router replica's headers, the request log and metrics, and an unexpected error answered as the
    app's 500 (closing the connection) and raised to the server, as through FastAPI."""
    from fusionrag.retriever.collection import Collection

    passes = fastapi_stack_passes
    cfg = ServerConfig(data_dir=str(data), demo=False, api_keys=KEYS)
    answers = {}
    for fast in (True, False):
        passes.clear()
        with TestClient(create_app(cfg, headers={"X-Replica": "r7"}, fast_routes=fast),
                        raise_server_exceptions=False) as client:
            client.get("/readyz", headers=ADMIN)
            ok = client.post("/v1/collections/c/search", json={"vectors": [_vec(0)], "k": 3}, headers=ADMIN)
            assert ok.status_code == 200 and ok.headers["x-replica"] == "r7"
            assert [p for p in passes if p.endswith("/search")] == ([] if fast else ["/v1/collections/c/search"])
            with monkeypatch.context() as m:
                m.setattr(Collection, "search", lambda *a, **k: 1 / 0)
                bad = client.post("/v1/collections/c/search", json={"vectors": [_vec(0)], "k": 3}, headers=ADMIN)
            metrics = client.get("/metrics", headers=ADMIN).text
        answers[fast] = (bad.status_code, bad.json(), bad.headers.get("connection"))
        assert re.search(r'fusionrag_http_requests_total\{method="POST",route="/v1/collections/\{name\}/search",'
                         r'status="500"\} 1\.0', metrics), fast
    assert answers[True] == answers[False] == (500, {"detail": "internal error; see the service's log"}, "close")
