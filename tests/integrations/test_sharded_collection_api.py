"""A sharded collection in the service's data directory (#50): created over the API with a shard count, empty (and
refusing writes and searches with 409) until its first import builds it, filled by an import of JSON lines whose
texts the service embeds or of a vector file with its sidecar, then written, searched by text, vector and filter,
snapshotted, restored under another name, dropped, and opened again by a restarted service, as a collection is.
The real service (`python -m fusionrag serve`) in a process of its own; rankings checked against exact search in
numpy over the vectors the model gives the texts here (or the vectors written); the shards' files checked on
disk."""

from __future__ import annotations

import io
import json
import tarfile
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import ServerProcess

from fusionrag.retriever.collection.embedding import get_embedder

MODEL, N, DIM = "all-MiniLM-L6-v2", 1200, 16
TOPICS = ["gardening", "astronomy", "cooking", "databases", "sailing", "music", "chess", "geology"]
WORDS = ["tomatoes", "telescope", "saffron", "index", "harbour", "violin", "opening", "basalt", "compost", "nebula",
         "risotto", "query", "anchor", "chord", "endgame", "quartz"]
EXHAUSTIVE = {"nprobe": 4096, "rerank": 4096, "beta": 0}


def texts_of(n: int) -> list[str]:
    rng = np.random.default_rng(3)
    return [f"A note on {TOPICS[i % len(TOPICS)]}: {' '.join(rng.choice(WORDS, 5))} (number {i})." for i in range(n)]


def exact(vectors: np.ndarray, names: list[str], q: np.ndarray, k: int, metric: str = "cosine") -> list[str]:
    v = vectors.astype(np.float64)
    if metric == "cosine":
        score = -(v / np.linalg.norm(v, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
    else:
        score = ((v - q) ** 2).sum(1)
    return [names[i] for i in np.argsort(score, kind="stable")[:k]]


def wait_import(c, name: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = c.get(f"/v1/collections/{name}").json()["build_state"]["import"]
        if state and state["state"] not in ("uploading", "running"):
            return state
        time.sleep(0.1)
    raise AssertionError(f"the import into {name} did not end")


@pytest.fixture(scope="module")
def corpus():
    """The texts, the vectors the model gives them (every 10th line carries its own vector instead), the lines."""
    texts = texts_of(N)
    vectors = get_embedder(MODEL).embed(texts)
    own = np.random.default_rng(4).standard_normal((N, vectors.shape[1])).astype(np.float32)
    lines = []
    for i, text in enumerate(texts):
        doc = {"id": f"note-{i}", "text": text, "metadata": {"topic": TOPICS[i % len(TOPICS)], "i": i}}
        if i % 10 == 0:
            doc["vector"] = own[i].tolist()
            vectors[i] = own[i]
        lines.append(json.dumps(doc) + "\n")
    return texts, vectors, "".join(lines)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-api")
    srv = ServerProcess(root / "data", root / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def search_ids(c, name: str, body: dict) -> list[list[str]]:
    r = c.post(f"/v1/collections/{name}/search", json={"params": EXHAUSTIVE, **body})
    assert r.status_code == 200, r.text
    return [[h["id"] for h in hits] for hits in r.json()["results"]]


def test_created_with_a_shard_count_it_is_empty_and_refuses_writes_until_its_import(server):
    with server.client() as c:
        assert c.post("/v1/collections", json={"name": "notes", "embedding": MODEL, "shards": 0}).status_code == 422
        assert c.post("/v1/collections", json={"name": "notes", "embedding": MODEL, "shards": 17}).status_code == 422
        r = c.post("/v1/collections", json={"name": "notes", "embedding": MODEL, "shards": 2})
        assert r.status_code == 201, r.text
        info = r.json()
        assert (info["sharded"], info["shards"], info["count"], info["state"]) == (True, 2, 0, "empty")
        assert info["dimension"] == get_embedder(MODEL).dim
        assert json.loads((server.data_dir / "collections" / "notes" / "collection.json").read_text())["shards"] == 2
        r = c.post("/v1/collections/notes/documents", json={"documents": [{"id": "x", "text": "too early"}]})
        assert r.status_code == 409 and "import" in r.json()["detail"]
        r = c.post("/v1/collections/notes/search", json={"texts": ["anything"]})
        assert r.status_code == 409 and "import" in r.json()["detail"]
        listed = {e["name"]: e for e in c.get("/v1/collections").json()["collections"]}
        assert listed["notes"]["count"] == 0


def test_its_import_builds_it_and_it_answers_as_exact_search_does(server, corpus):
    texts, vectors, body = corpus
    names = [f"note-{i}" for i in range(N)]
    with server.client() as c:
        r = c.post("/v1/collections/notes/import", content=body, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 202, r.text
        state = wait_import(c, "notes")
        assert state["state"] == "done" and state["documents"] == N, state
        info = c.get("/v1/collections/notes").json()
        assert info["count"] == N and info["shards"] == 2 and info["build_state"]["indexed"] == N
        parts = sorted(p.name for p in (server.data_dir / "collections" / "notes" / "index").glob("shard-*"))
        assert parts == ["shard-000", "shard-001"]  # built: both shards hold part of it
        # Its memory per tier is its shards': the SSD tier their page files, the PQ tier at least their codes (read
        # from disk here), and /metrics exports them as a collection's
        index = server.data_dir / "collections" / "notes" / "index"
        pages = sum((index / p / "vectors.pages").stat().st_size for p in parts)
        codes = sum(np.load(index / p / "pq_codes.npy", mmap_mode="r").nbytes for p in parts)
        tiers = info["tiers"]
        assert (tiers["ssd_bytes"], tiers["shards_counted"]) == (pages, 2)
        assert tiers["pq_bytes"] >= codes  # the codes, and the codebooks and tables beside them
        assert tiers["host_index_bytes"] > 0
        exported = {(m.labels.get("collection"), m.labels.get("tier")): m.value
                    for family in text_string_to_metric_families(c.get("/metrics").text)
                    for m in family.samples if m.name == "fusionrag_tier_bytes"}
        assert exported[("notes", "ssd")] == pages and exported[("notes", "pq")] == tiers["pq_bytes"]
        queries = ["telescope and nebula at night", texts[321], "risotto with saffron"]
        qv = get_embedder(MODEL).embed(queries)
        got = search_ids(c, "notes", {"texts": queries, "k": 10})
        assert got == [exact(vectors, names, q, 10) for q in qv]
        assert got[1][0] == "note-321"
        # a filter, by text: only what passes, in exact order
        passing = [i for i in range(N) if i % len(TOPICS) == 2]
        got = search_ids(c, "notes", {"texts": [queries[2]], "k": 5, "filter": {"topic": "cooking"}})
        assert got[0] == exact(vectors[passing], [names[i] for i in passing], qv[2], 5)
        r = c.post("/v1/collections/notes/documents/get", json={"ids": ["note-7", "nope"]})
        assert r.status_code == 200 and [d["id"] for d in r.json()["documents"]] == ["note-7"]
        assert r.json()["documents"][0]["text"] == texts[7]
        assert r.json()["documents"][0]["metadata"] == {"topic": TOPICS[7], "i": 7}
        # built: a second import is refused, writes go in by upsert
        r = c.post("/v1/collections/notes/import", content=body[:500], headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 409 and "upsert" in r.json()["detail"]
        new = "A note on volcanoes: magma chambers, lava domes and ash columns."
        r = c.post("/v1/collections/notes/documents", json={"documents": [{"id": "new", "text": new,
                                                                             "metadata": {"topic": "new"}}]})
        assert r.status_code == 200, r.text
        assert search_ids(c, "notes", {"texts": ["magma and lava from a volcano"], "k": 1}) == [["new"]]
        assert c.get("/v1/collections/notes").json()["count"] == N + 1


def test_a_vector_file_with_its_sidecar_imports_into_a_sharded_collection(server):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((900, DIM)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    sidecar = "".join(json.dumps({"id": f"v{i}", "metadata": {"odd": i % 2}}) + "\n" for i in range(900))
    with server.client() as c:
        assert c.post("/v1/collections", json={"name": "vecs", "dimension": DIM, "metric": "l2",
                                               "shards": 3}).status_code == 201
        wrong = io.BytesIO()
        np.save(wrong, x[:, :8])
        r = c.post("/v1/collections/vecs/import", files={"vectors": ("base.npy", wrong.getvalue())})
        assert r.status_code == 422 and "dimension 8" in r.json()["detail"], r.text  # refused before a 202 (#67)
        info = c.get("/v1/collections/vecs").json()
        assert info["count"] == 0 and info["build_state"]["import"] is None  # nothing kept: imported again below
        r = c.post("/v1/collections/vecs/import", files={"vectors": ("base.npy", buf.getvalue()),
                                                         "documents": ("d.jsonl", sidecar)})
        assert r.status_code == 202, r.text
        assert wait_import(c, "vecs")["state"] == "done"
        q = rng.standard_normal((4, DIM)).astype(np.float32)
        names = [f"v{i}" for i in range(900)]
        assert search_ids(c, "vecs", {"vectors": q.tolist(), "k": 10}) == [exact(x, names, v, 10, "l2") for v in q]
        odd = np.arange(1, 900, 2)
        got = search_ids(c, "vecs", {"vectors": q[:1].tolist(), "k": 5, "filter": {"odd": 1}})
        assert got[0] == exact(x[odd], [names[i] for i in odd], q[0], 5, "l2")


def test_snapshot_restore_drop_and_a_restart(server, corpus):
    texts, _, _ = corpus
    queries = {"texts": ["telescope and nebula at night", texts[99], "magma and lava from a volcano"], "k": 10}
    with server.client() as c:
        before = search_ids(c, "notes", queries)
        r = c.post("/v1/collections/notes/snapshots")
        assert r.status_code == 201, r.text
        snap = r.json()
        assert snap["documents"] == N + 1 and snap["shards"] == 2
        archive = c.get(f"/v1/collections/notes/snapshots/{snap['id']}").content
        names = tarfile.open(fileobj=io.BytesIO(archive)).getnames()
        assert "index/shard-000/docs.sqlite" in names and not any(n.endswith(("LOCK", "-wal", "-shm")) for n in names)
        # written after the snapshot: not in what it restores
        assert c.post("/v1/collections/notes/documents", json={"documents": [{"id": "later", "text": "x"}]}
                      ).status_code == 200
        # an altered archive is refused and leaves nothing
        tampered = bytearray(archive)
        member = tarfile.open(fileobj=io.BytesIO(archive)).getmember("index/shard-001/pq_codes.npy")
        tampered[member.offset_data + member.size - 1] ^= 0xFF
        r = c.post("/v1/collections/copy/restore", content=bytes(tampered))
        assert r.status_code == 422 and "altered" in r.json()["detail"]
        assert not (server.data_dir / "collections" / "copy").exists()
        r = c.post("/v1/collections/copy/restore", content=archive)
        assert r.status_code == 201, r.text
        assert r.json()["sharded"] and r.json()["count"] == N + 1
        assert search_ids(c, "copy", queries) == before
        assert c.post("/v1/collections/copy/documents/get", json={"ids": ["later"]}).json()["documents"] == []
        assert c.delete("/v1/collections/notes").status_code == 200
        assert c.get("/v1/collections/notes").status_code == 404
        assert not (server.data_dir / "collections" / "notes").exists()
        assert search_ids(c, "copy", queries) == before
    server.stop()
    again = ServerProcess(server.data_dir, server.log_path.with_name("again.log"), "--no-demo")
    try:
        again.wait_ready()
        with again.client() as c:
            assert c.get("/v1/collections/copy").json()["count"] == N + 1
            assert search_ids(c, "copy", queries) == before
    finally:
        again.stop()


def test_the_cli_imports_into_a_new_sharded_collection_snapshots_and_restores_it(tmp_path):
    from fusionrag.cli import main as cli
    from fusionrag.retriever.directory import catalog

    x = np.random.default_rng(12).standard_normal((700, DIM)).astype(np.float32)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "vector": x[i].tolist()}) + "\n"
                                              for i in range(700)))
    assert cli(["import", str(tmp_path / "data"), "--collection", "c", "--documents", str(tmp_path / "d.jsonl"),
                "--metric", "l2", "--shards", "2", "--quiet"]) == 0
    cat = catalog(tmp_path / "data")
    try:
        col = cat.get("c")
        assert col.info()["shards"] == 2 and len(col) == 700
        q = x[:3] + 0.05
        got = [[h.id for h in hits] for hits in col.search(q, k=10, params=EXHAUSTIVE).hits]
        assert got == [exact(x, [f"r{i}" for i in range(700)], v, 10, "l2") for v in q]
    finally:
        cat.close()
    # snapshotted and restored offline, into another data directory
    assert cli(["snapshot", str(tmp_path / "data"), "c", str(tmp_path / "c.tar")]) == 0
    assert cli(["restore", str(tmp_path / "other"), str(tmp_path / "c.tar"), "--collection", "copy"]) == 0
    cat = catalog(tmp_path / "other")
    try:
        copy = cat.get("copy")
        assert copy.info()["shards"] == 2 and len(copy) == 700
        assert [[h.id for h in hits] for hits in copy.search(q, k=10, params=EXHAUSTIVE).hits] == got
    finally:
        cat.close()


def test_writes_past_the_threshold_merge_the_shards_in_the_background(tmp_path):
    from fusionrag.retriever.collection import Document
    from fusionrag.retriever.collection.config import CollectionConfig
    from fusionrag.retriever.directory import catalog

    rng = np.random.default_rng(13)
    x = rng.standard_normal((800, DIM)).astype(np.float32)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "vector": x[i].tolist()}) + "\n"
                                              for i in range(800)))
    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(merge_fresh_count=60))
    try:
        col = cat.create("c", DIM, "l2", shards=2)
        col.import_files(tmp_path / "d.jsonl")
        new = rng.standard_normal((70, DIM)).astype(np.float32)
        col.upsert([Document(f"n{i}", None, new[i]) for i in range(50)])
        assert col.info()["build_state"]["fresh"] == 50  # under the threshold: no merge
        col.upsert([Document(f"n{i}", None, new[i]) for i in range(50, 70)])
        col.delete([f"r{i}" for i in range(10)])
        deadline = time.monotonic() + 120
        while col.info()["build_state"]["fresh"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert col.info()["build_state"]["fresh"] == 0 and len(col) == 860
        gens = list((tmp_path / "data" / "collections" / "c" / "index").glob("shard-*/CURRENT.json"))
        assert gens, "no shard published a merged generation"
        allv = np.vstack([x[10:], new])
        names = [f"r{i}" for i in range(10, 800)] + [f"n{i}" for i in range(70)]
        q = rng.standard_normal((3, DIM)).astype(np.float32)
        got = [[h.id for h in hits] for hits in col.search(q, k=10, params=EXHAUSTIVE).hits]
        assert got == [exact(allv, names, v, 10, "l2") for v in q]
    finally:
        cat.close()


def test_a_build_that_would_write_into_the_disk_reserve_is_refused_and_leaves_nothing(tmp_path):
    from fusionrag.retriever.collection import quota
    from fusionrag.retriever.directory import catalog
    from fusionrag.retriever.errors import StorageError

    x = np.random.default_rng(14).standard_normal((4000, DIM)).astype(np.float32)  # ~1.3 MB of JSON lines
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"vector": v.tolist()}) + "\n" for v in x))
    free = quota.free_bytes(tmp_path)
    # a reserve that leaves room for the collection's description, not for the build
    cat = catalog(tmp_path / "data", limits=quota.Limits(disk_reserve_bytes=free - (1 << 20)))
    try:
        col = cat.create("c", DIM, "l2", shards=2)
        with pytest.raises(StorageError, match="disk"):
            col.import_files(tmp_path / "d.jsonl")
        info = col.info()
        assert info["build_state"]["import"]["state"] == "failed" and "reserve" in info["build_state"]["import"]["reason"]
        assert sorted(p.name for p in (tmp_path / "data" / "collections" / "c").iterdir()) == ["collection.json",
                                                                                              "import.json"]
    finally:
        cat.close()


def test_the_embedded_langchain_and_llamaindex_stores_work_against_it_unchanged(tmp_path, corpus):
    """The LangChain and LlamaIndex stores over the data directory itself (no service): the stores' calls reach
    the sharded collection's shards in this process."""
    from fusionrag.integrations.langchain import FusionRAGEmbeddings
    from fusionrag.integrations.langchain import FusionRAGVectorStore as LangChainStore
    from fusionrag.retriever.directory import catalog

    texts, vectors, body = corpus
    (tmp_path / "docs.jsonl").write_text(body)
    cat = catalog(tmp_path / "data")
    try:
        cat.create("notes", get_embedder(MODEL).dim, "cosine", MODEL, shards=2).import_files(tmp_path / "docs.jsonl")
    finally:
        cat.close()
    store = LangChainStore(FusionRAGEmbeddings(MODEL), collection="notes", path=tmp_path / "data",
                           search_params=EXHAUSTIVE)
    try:
        names = [f"note-{i}" for i in range(N)]
        hits = store.similarity_search(texts[55], k=5)
        assert [h.id for h in hits] == exact(vectors, names, get_embedder(MODEL).embed([texts[55]])[0], 5)
        assert hits[0].page_content == texts[55] and hits[0].metadata == {"topic": TOPICS[55 % len(TOPICS)], "i": 55}
        ids = store.add_texts(["A note on beekeeping: hives, smokers and wax frames."], metadatas=[{"topic": "bees"}])
        assert store.similarity_search("keeping bees in hives", k=1)[0].id == ids[0]
        store.delete(ids)
        assert all(h.id != ids[0] for h in store.similarity_search("keeping bees in hives", k=3))
    finally:
        store.close()
    assert (tmp_path / "data" / "collections" / "notes" / "index" / "shard-001").is_dir()
    # and the LlamaIndex store, by vector under a metadata filter
    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters, VectorStoreQuery

    from fusionrag.integrations.llamaindex import FusionRAGVectorStore as LlamaIndexStore

    llama = LlamaIndexStore(collection="notes", path=tmp_path / "data", search_params=EXHAUSTIVE)
    try:
        q = vectors[40] + 0.01
        res = llama.query(VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=4, filters=MetadataFilters(
            filters=[MetadataFilter(key="topic", value="gardening")])))
        passing = [i for i in range(N) if i % len(TOPICS) == 0]
        assert res.ids == exact(vectors[passing], [names[i] for i in passing], q, 4)
        assert res.nodes[0].get_content() == texts[int(res.ids[0].split("-")[1])]
    finally:
        llama.close()


def test_an_import_cut_short_by_a_crash_leaves_no_index_and_says_so(tmp_path):
    """A service killed during the build (simulated: the state it leaves on disk, a half-written build beside an
    import.json saying running) reopens the collection empty, the import marked interrupted, and imports again."""
    import subprocess
    import sys

    from fusionrag.retriever.directory import catalog

    x = np.random.default_rng(15).standard_normal((800, DIM)).astype(np.float32)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "vector": v.tolist()}) + "\n"
                                              for i, v in enumerate(x)))
    # A child process that starts the import and is killed with SIGKILL as soon as its build has begun writing.
    child = subprocess.Popen([sys.executable, "-c", f"""
from fusionrag.retriever.directory import catalog
cat = catalog({str(tmp_path / 'data')!r})
col = cat.create("c", {DIM}, "l2", shards=2)
def step(name, done, total):  # held (until killed) once the shards are being written
    if name == "writing shards":
        print("step", flush=True)
        __import__("time").sleep(3600)
col._step = step
col.import_files({str(tmp_path / 'd.jsonl')!r})
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "step"  # the build is under way
    finally:
        child.kill()
        child.wait()
    where = tmp_path / "data" / "collections" / "c"
    assert [p.name for p in where.glob(".*index-building*")]  # what it was writing is there
    assert json.loads((where / "import.json").read_text())["state"] == "running"
    cat = catalog(tmp_path / "data")
    try:
        col = cat.get("c")
        state = col.info()["build_state"]["import"]
        assert state["state"] == "interrupted" and len(col) == 0
        assert not (where / "index").exists() and not list(where.glob(".*index-building*"))
        col.import_files(tmp_path / "d.jsonl")
        assert len(col) == 800 and col.search(x[:1], k=1).hits[0][0].id == "r0"
    finally:
        cat.close()
