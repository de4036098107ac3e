"""Reads through the remote LangChain store: get_by_ids and MMR, one request each now, against what they cost
as one request per document (what the store did before batch reads and vectors in search results).

A service (`fusionrag serve`, its own process) holds a collection of 2000 documents (384-d vectors, texts of
~300 characters); the same documents sit in an embedded store. Each figure is the median of --repeats calls:

- get_by_ids(50): embedded; remote (one POST .../documents/get); remote, one GET .../documents/{id} per id
  (sync: one after the other on one keep-alive client; async: all at once, as aget_by_ids did);
- max_marginal_relevance_search(k=4, fetch_k=20): remote (one search with the hits' vectors); remote, the
  search then one GET ?vector=true per hit.

With --before FILE (an older integrations/backend.py, e.g. `git show REV:integrations/backend.py > old.py`), the
remote store is also measured over that file's RemoteBackend.

    python -m bench.cache.remote_reads [--repeats 50] [--before old.py] [--out bench/results/cache/remote_reads.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from langchain_core.embeddings import DeterministicFakeEmbedding

from fusionrag.integrations.langchain import FusionRAGVectorStore
from bench.harness.paths import results

DIM, COUNT, BATCH = 384, 2000, 50


def start_service(data: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "fusionrag", "serve", "--port", "0", "--no-demo",
                             "--data-dir", str(data)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            url = m.group(1)
            while httpx.get(url + "/readyz").status_code != 200:
                time.sleep(0.1)
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the service did not start:\n{log.read_text()}")


def median_ms(call, repeats: int) -> float:
    call()  # warm: connections, caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 2)


def amedian_ms(call, repeats: int) -> float:
    """median_ms of a coroutine function, every call in one event loop (as an application runs them)."""
    async def timed() -> float:
        await call()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) * 1000, 2)
    return asyncio.run(timed())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--before", type=Path, help="an older integrations/backend.py to measure the store over too")
    ap.add_argument("--out", type=Path, default=results("cache") / "remote_reads.json")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    words = "page buffer tombstone merge posting list centroid rerank vector index query".split()
    texts = [" ".join(rng.choice(words, 40)) for _ in range(COUNT)]
    ids = [f"doc-{i}" for i in range(COUNT)]
    metadatas = [{"n": i, "source": f"file-{i % 17}.md"} for i in range(COUNT)]
    emb = DeterministicFakeEmbedding(size=DIM)
    wanted = [ids[i] for i in rng.choice(COUNT, BATCH, replace=False)]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, url = start_service(tmp / "service", tmp / "service.log")
        try:
            embedded = FusionRAGVectorStore(embedding=emb, path=tmp / "embedded", collection="bench")
            remote = FusionRAGVectorStore(embedding=emb, url=url, collection="bench")
            for store in (embedded, remote):
                store.add_texts(texts, metadatas, ids=ids)
            assert [d.id for d in remote.get_by_ids(wanted)] == wanted == [d.id for d in embedded.get_by_ids(wanted)]
            http = httpx.Client(base_url=url, timeout=60)

            def per_id(doc_ids, vector=False):
                params = {"vector": "true"} if vector else None
                return [http.get(f"/v1/collections/bench/documents/{i}", params=params).json() for i in doc_ids]

            def per_id_async():
                ac = httpx.AsyncClient(base_url=url, timeout=60)  # one per loop, as the store keeps them
                return lambda: asyncio.gather(*(ac.get(f"/v1/collections/bench/documents/{i}") for i in wanted))

            def mmr_per_id():
                vector = emb.embed_query("merge the posting lists")
                r = http.post("/v1/collections/bench/search", json={"vectors": [vector], "k": 20}).json()
                return per_id([h["id"] for h in r["results"][0]], vector=True)

            def aget(store):
                return lambda: store.aget_by_ids(wanted)

            def mmr(store):
                return lambda: store.max_marginal_relevance_search("merge the posting lists", k=4, fetch_k=20)

            stores = {"remote": remote}
            if args.before:
                spec = importlib.util.spec_from_file_location("backend_before", args.before)
                old = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(old)
                stores["remote_before"] = before = FusionRAGVectorStore(embedding=emb, url=url, collection="bench")
                before._backend = old.RemoteBackend(url, "bench", None, None, None, 60.0)
                assert [d.id for d in before.get_by_ids(wanted)] == wanted

            figures = {
                "get_by_ids_50_ms": {
                    "embedded": median_ms(lambda: embedded.get_by_ids(wanted), args.repeats),
                    **{name: median_ms(lambda s=s: s.get_by_ids(wanted), args.repeats) for name, s in stores.items()},
                    "remote_one_request_per_id": median_ms(lambda: per_id(wanted), args.repeats),
                },
                "aget_by_ids_50_ms": {
                    **{name: amedian_ms(aget(s), args.repeats) for name, s in stores.items()},
                    "remote_one_request_per_id_at_once": amedian_ms(per_id_async(), args.repeats),
                },
                "mmr_k4_fetch20_ms": {
                    "embedded": median_ms(mmr(embedded), args.repeats),
                    **{name: median_ms(mmr(s), args.repeats) for name, s in stores.items()},
                    "remote_search_then_one_request_per_hit": median_ms(mmr_per_id, args.repeats),
                },
            }
            http.close()
            for store in (embedded, *stores.values()):
                store.close()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                       "python": platform.python_version()},
           "documents": COUNT, "dimension": DIM, "repeats": args.repeats, **figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
