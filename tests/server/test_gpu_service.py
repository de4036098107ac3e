"""The service with its collections on the GPU tier: `fusionrag serve --filter-tier gpu --gpu-budget-mb`
answers as the CPU tier does and holds its budget, as /metrics and a collection's info show. A
vector collection, so that no embedding model is needed: this runs on the GPU machine too (`make
gpu-accept`), where the demo's model is not. Without a GPU the tier runs through Triton's
interpreter (conftest.py)."""

import numpy as np
import torch
from conftest import clustered, exact_knn, recall
from prometheus_client.parser import text_string_to_metric_families
from server_util import ServerProcess

from fusionrag.retriever import EngineConfig
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document

CUDA = torch.cuda.is_available()
# On CUDA the budget also holds the service's CUDA context and kernels (a few hundred MiB).
BUDGET_MB = 2048 if CUDA else 256


def test_gpu_tier_service_answers_and_holds_its_budget(tmp_path):
    base = clustered(3000, 24, 30, seed=1)
    queries = clustered(8, 24, 30, seed=2)
    catalog = Catalog(tmp_path / "data", EngineConfig(filter_tier="cpu"),
                      CollectionConfig(background_merge=False, min_index_count=100))
    col = catalog.create("vectors", dim=24, metric="l2")
    col.upsert([Document(id=str(i), vector=v) for i, v in enumerate(base)])
    col.merge()
    cpu = [[int(h.id) for h in hits] for hits in col.search(queries, k=10).hits]
    catalog.close()
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--filter-tier", "gpu",
                        "--gpu-budget-mb", str(BUDGET_MB))
    try:
        srv.wait_ready()
        with srv.client() as c:
            r = c.post("/v1/collections/vectors/search", json={"vectors": queries.tolist(), "k": 10})
            assert r.status_code == 200, r.text
            gpu = [[int(h["id"]) for h in hits] for hits in r.json()["results"]]
            truth = exact_knn(base, queries, 10)
            assert recall(np.array(gpu), truth) >= 0.95
            assert abs(recall(np.array(gpu), truth) - recall(np.array(cpu), truth)) <= 0.02
            tiers = c.get("/v1/collections/vectors").json()["tiers"]
            assert tiers["pq_tier"] == "gpu"
            f = tiers["filter"]
            assert f["gpu_budget_bytes"] == BUDGET_MB << 20 and 0 < f["gpu_reserved_bytes"] <= f["gpu_budget_bytes"]
            if CUDA:
                # The driver's count of the service process (its CUDA context included), where it gives one.
                assert f["gpu_process_bytes"] is None or f["gpu_process_bytes"] <= f["gpu_budget_bytes"]
                assert set(f["kernel_compile_seconds"]) == {"pq_table_kernel", "adc_scan_kernel", "topn_kernel"}
            else:
                assert f["gpu_process_bytes"] is None and f["kernel_compile_seconds"] == {}
            fams = {m.name: m for m in text_string_to_metric_families(c.get("/metrics").text)}
            mem = {s.labels["kind"]: s.value for s in fams["fusionrag_gpu_memory_bytes"].samples}
            assert mem["budget"] == BUDGET_MB << 20 and 0 < mem["used"] <= mem["budget"]
    finally:
        srv.stop()
