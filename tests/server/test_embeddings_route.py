"""#67 item 7: POST /v1/embeddings, OpenAI's embeddings API over the service's own models, driven by the real
OpenAI SDK: a client embeds with exactly its collections' model (the vectors the collection's own model gives),
in floats and in base64 (the SDK's default), with OpenAI's errors for what it cannot do."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from server_util import ServerProcess

from fusionrag.retriever.collection.embedding import get_embedder

TEXTS = ["How do I read a file line by line?", "The subprocess module spawns new processes.",
         "asyncio.gather runs awaitables concurrently", "x"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    s = ServerProcess(root / "data", root / "server.log", "--no-demo", "--max-documents", "8")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_the_sdk_embeds_with_the_collections_model(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = get_embedder("all-MiniLM-L6-v2").embed(TEXTS)
    for fmt in ("float", "base64", None):
        kw = {} if fmt is None else {"encoding_format": fmt}
        got = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, **kw)
        assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.model == "all-MiniLM-L6-v2"
        if fmt == "base64":  # asked for explicitly, the SDK hands the strings over as they came
            vecs = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in got.data])
        else:  # floats, or base64 the SDK asked for itself and decoded
            vecs = np.array([d.embedding for d in got.data], np.float32)
        assert vecs.shape == (len(TEXTS), 384)
        cos = (vecs * want).sum(1) / np.linalg.norm(vecs, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.99999, (fmt, cos)
        assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input="x", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[3], atol=1e-5)


def test_what_it_cannot_do_is_answered_as_openai_does(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    with pytest.raises(openai.UnprocessableEntityError, match="max_documents"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["a"] * 9)
    with pytest.raises(openai.UnprocessableEntityError, match="empty string"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["a", ""])
    with pytest.raises(openai.UnprocessableEntityError, match="384-dimensional"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="a", dimensions=64)
