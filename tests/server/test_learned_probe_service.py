"""Learned pruning through the service: `serve --probe-model` makes each collection's index builds train the
model (server config probe_model), and a search asks for it with params {"probe": "learned"}; a collection
built without one answers 422 saying how to get one. Answers checked against brute force."""

import numpy as np
from conftest import clustered, exact_knn, recall
from server_util import ServerProcess

from fusionrag.retriever.collection import Document
from fusionrag.server.config import ServerConfig
from fusionrag.server.life import open_catalog


def build(data_dir, name: str, x: np.ndarray, probe_model: bool):
    catalog = open_catalog(ServerConfig(data_dir=str(data_dir), probe_model=probe_model, min_index_count=100))
    try:
        col = catalog.create(name, dim=x.shape[1], metric="l2")
        col.upsert([Document(id=str(i), vector=v) for i, v in enumerate(x)])
        col.merge()
        return col._main.index.nav.model is not None
    finally:
        catalog.close()


def test_the_service_searches_with_a_learned_probe(tmp_path):
    x = clustered(3000, 24, 30, seed=1)
    q = clustered(3040, 24, 30, seed=1)[3000:]  # held out, from the data's own mixture
    assert build(tmp_path / "data", "learned", x, True)
    assert not build(tmp_path / "data", "plain", x, False)
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--probe-model")
    try:
        srv.wait_ready()
        with srv.client() as c:
            answers = {}
            for probe in ("ratio", "learned"):
                r = c.post("/v1/collections/learned/search", json={"vectors": q.tolist(), "k": 10,
                                                                    "params": {"probe": probe}, "stats": True})
                assert r.status_code == 200, r.text
                answers[probe] = r.json()
            ids = np.array([[int(h["id"]) for h in hits] for hits in answers["learned"]["results"]])
            assert recall(ids, exact_knn(x, q, 10)) >= 0.9
            lists = {p: np.mean([s["lists_probed"] for s in a["stats"]]) for p, a in answers.items()}
            assert lists["learned"] < lists["ratio"]
            r = c.post("/v1/collections/plain/search", json={"vectors": q[:2].tolist(), "k": 10,
                                                             "params": {"probe": "learned"}})
            assert r.status_code == 422 and "--probe-model" in r.json()["detail"]
            r = c.post("/v1/collections/learned/search", json={"vectors": q[:2].tolist(), "k": 10,
                                                               "params": {"probe": "oracle"}})
            assert r.status_code == 422 and "probe" in r.json()["detail"]
    finally:
        srv.stop()
