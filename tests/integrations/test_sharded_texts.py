"""A sharded collection of a user's texts (#50): built from JSON lines of documents whose texts the build embeds
(`fusionrag build docs.jsonl IDX --shards 2 --embedding MODEL`), its model recorded, so the sharded service embeds
the texts written and searched without a vector as a collection with a model does; the LangChain store works
against it unchanged. Vectors are checked against the model run on the texts here, rankings against exact cosine
search in numpy over those vectors; the service is the real app over uvicorn (shards in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from integration_helpers import serving_sharded

from fusionrag.cli import main as cli
from fusionrag.integrations.langchain import FusionRAGEmbeddings
from fusionrag.integrations.langchain import FusionRAGVectorStore as LangChainStore
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.errors import ConfigError, InputError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.router import ShardedIndex

MODEL, NAME, N = "all-MiniLM-L6-v2", "notes", 1500
TOPICS = ["gardening", "astronomy", "cooking", "databases", "sailing", "music", "chess", "geology", "medicine",
          "poetry", "cycling", "finance"]
WORDS = ["tomatoes", "telescope", "saffron", "index", "harbour", "violin", "opening", "basalt", "vaccine", "sonnet",
         "gears", "bonds", "compost", "nebula", "risotto", "query", "anchor", "chord", "endgame", "quartz", "dose",
         "rhyme", "saddle", "yield"]
EXHAUSTIVE = {"nprobe": 4096, "rerank": 4096, "beta": 0}


def texts_of(n: int) -> list[str]:
    rng = np.random.default_rng(5)
    return [f"A note on {TOPICS[i % len(TOPICS)]}: {' '.join(rng.choice(WORDS, 6))} (number {i})."
            for i in range(n)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The JSON-lines file (every 10th line carries its own vector: the rest are embedded), built with the CLI;
    the vectors the model gives the texts, computed here."""
    root = tmp_path_factory.mktemp("sharded-texts")
    texts = texts_of(N)
    model = get_embedder(MODEL).embed(texts)
    own = np.random.default_rng(8).standard_normal((N, model.shape[1])).astype(np.float32)
    expected = model.copy()
    with open(root / "docs.jsonl", "w") as f:
        for i, text in enumerate(texts):
            doc = {"id": f"note-{i}", "text": text, "metadata": {"topic": TOPICS[i % len(TOPICS)], "i": i}}
            if i % 10 == 0:
                doc["vector"] = own[i].tolist()
                expected[i] = own[i] / np.linalg.norm(own[i])  # cosine: stored at unit length
            f.write(json.dumps(doc) + "\n")
    assert cli(["build", str(root / "docs.jsonl"), str(root / "idx"), "--shards", "2", "--embedding", MODEL,
                "--centroid-ratio", "0.05", "--threads", "1", "--quiet"]) == 0
    return root, texts, expected


@pytest.fixture(scope="module")
def service(built):
    root, _, _ = built
    with serving_sharded(root / "idx", root / "served", NAME) as served:
        yield served


def exact(vectors: np.ndarray, names: list[str], q: np.ndarray, k: int) -> list[str]:
    v = vectors.astype(np.float64)
    sims = (v / np.linalg.norm(v, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
    return [names[i] for i in np.argsort(-sims, kind="stable")[:k]]


def test_the_build_embeds_the_texts_and_records_its_model(built):
    root, texts, expected = built
    index = ShardedIndex.open(root / "idx")
    try:
        assert index.manifest["embedding"] == MODEL and index.metric == "cosine" and index.manifest["count"] == N
        coll = ShardedCollection(index, NAME)
        assert coll.embedding == MODEL
        got = coll.get([f"note-{i}" for i in range(0, N, 7)], with_vectors=True)
        assert [d.id for d in got] == [f"note-{i}" for i in range(0, N, 7)]
        for d in got:
            i = int(d.id.split("-")[1])
            assert d.text == texts[i] and d.metadata == {"topic": TOPICS[i % len(TOPICS)], "i": i}
            np.testing.assert_allclose(d.vector, expected[i], atol=2e-3)  # the built vector: the model's, or its own
    finally:
        index.close()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]  # the staged vectors are gone


def test_the_service_embeds_what_is_written_and_searched_without_vectors(service, built):
    url, coll = service
    _, texts, expected = built
    info = httpx.get(f"{url}/v1/collections/{NAME}", timeout=30).json()
    assert info["embedding"] == MODEL
    new = ["A note on volcanoes: magma chambers, lava domes and ash columns.",
           "A note on knitting: cables, purl stitches and merino wool."]
    r = httpx.post(f"{url}/v1/collections/{NAME}/documents", timeout=60,
                   json={"documents": [{"id": f"new-{j}", "text": t, "metadata": {"topic": "new"}}
                                       for j, t in enumerate(new)]})
    assert r.status_code == 200, r.text
    vectors = np.vstack([expected, get_embedder(MODEL).embed(new)])
    names = [f"note-{i}" for i in range(N)] + ["new-0", "new-1"]
    queries = ["magma and lava from a volcano", texts[123], "bonds yield finance"]
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", timeout=60,
                   json={"texts": queries, "k": 10, "params": EXHAUSTIVE})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    qv = get_embedder(MODEL).embed(queries)
    for q, hits in zip(qv, results):
        assert [h["id"] for h in hits] == exact(vectors, names, q, 10)
    assert results[0][0]["id"] == "new-0" and results[1][0]["id"] == "note-123"
    # Filtered, by text: only what the filter passes, in exact order.
    r = httpx.post(f"{url}/v1/collections/{NAME}/search", timeout=60,
                   json={"texts": [queries[2]], "k": 5, "filter": {"topic": "finance"}, "params": EXHAUSTIVE})
    assert r.status_code == 200, r.text
    passing = [j for j, n in enumerate(names) if n.startswith("note-") and int(n[5:]) % len(TOPICS) == 11]
    assert [h["id"] for h in r.json()["results"][0]] == exact(vectors[passing], [names[j] for j in passing], qv[2], 5)


def test_the_langchain_store_works_against_it_unchanged(service, built):
    url, _ = service
    _, texts, _ = built
    store = LangChainStore(FusionRAGEmbeddings(MODEL), collection=NAME, url=url, search_params=EXHAUSTIVE)
    try:
        ids = store.add_texts(["A note on beekeeping: hives, smokers and wax frames."], metadatas=[{"topic": "bees"}])
        hits = store.similarity_search("keeping bees in hives", k=3)
        assert hits[0].id == ids[0] and hits[0].metadata == {"topic": "bees"}
        assert store.similarity_search(texts[77], k=1)[0].page_content == texts[77]
        store.delete(ids)
        assert all(h.id != ids[0] for h in store.similarity_search("keeping bees in hives", k=3))
    finally:
        store.close()


def test_bad_builds_are_refused_and_leave_nothing(tmp_path: Path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "no vector here"}) + "\n")
    with pytest.raises(InputError, match="needs a vector"):  # no model: every line needs its vector
        build_sharded(None, tmp_path / "idx", 2, BuildConfig(threads=1), documents=docs, progress=False)
    docs.write_text("".join(json.dumps({"id": str(i), "text": f"text {i}"}) + "\n" for i in range(40))
                    + json.dumps({"id": "40"}) + "\n")  # neither a text nor a vector
    with pytest.raises(InputError, match="line 41"):
        build_sharded(None, tmp_path / "idx", 2, BuildConfig(threads=1), documents=docs, progress=False,
                      embedding=MODEL)
    with pytest.raises(ConfigError, match="unknown embedding model"):
        build_sharded(None, tmp_path / "idx", 2, BuildConfig(threads=1), documents=docs, embedding="no-such-model")
    with pytest.raises(InputError, match="384-dimensional"):  # the model's vectors are not the source's
        build_sharded(np.zeros((100, 16), np.float32), tmp_path / "idx", 2, BuildConfig(threads=1), progress=False,
                      embedding=MODEL)
    assert cli(["build", str(docs), str(tmp_path / "idx"), "--embedding", MODEL, "--quiet"]) == 2  # no --shards
    assert "a sharded build's" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]
