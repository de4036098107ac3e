"""The embedding models' ONNX Runtime path (retriever/collection/embedding_onnx.py): the same vectors as
sentence-transformers on torch (the path it replaces) on Python docs paragraphs, short queries and texts past the
model's max_seq_length; the same token spans; its cache on disk reused, written whole or not at all, and
exported again when corrupt; torch as the fallback, saying why."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fusionrag.retriever.collection import embedding, embedding_onnx
from fusionrag.retriever.collection.embedding import Embedder
from embedding_helpers import EDGES, MODEL_DIR, minilm, paragraphs

# Paragraphs compared; the test takes ~1 minute on 2 busy cores at 2,000 (both runtimes embed them all).
PARAGRAPHS = int(os.environ.get("FUSIONRAG_EMBED_CHECK_PARAGRAPHS", "2000"))


@pytest.fixture(autouse=True)
def float32_onnx(monkeypatch):
    """These tests are of the ONNX Runtime model itself: never its bf16 stand-in (test_embedding_runtime_bf16.py),
    which a CPU with bf16 instructions would otherwise choose; subprocesses inherit it."""
    monkeypatch.setenv("FUSIONRAG_EMBED_BF16", "off")


@pytest.fixture(scope="module")
def torch_model():
    """Today's path, at one torch thread (on a busy machine torch's spinning OpenMP threads make two slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield embedding._sentence_transformer(MODEL_DIR)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One export for the module's tests that need one, in a cache of their own."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def exports(monkeypatch) -> list:
    """The exports made meanwhile (each the model directory exported)."""
    made = []
    export = embedding_onnx.export

    def counted(path, *a, **kw):
        made.append(path)
        return export(path, *a, **kw)

    monkeypatch.setattr(embedding_onnx, "export", counted)
    return made


def test_onnx_vectors_match_the_torch_models(torch_model, shared_cache, data_dir, monkeypatch):
    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(shared_cache))
    rows = paragraphs(data_dir, PARAGRAPHS)
    docs = [r["text"] for r in rows]
    # Short queries (section titles, API names) and texts longer than the model reads (cut at 256 tokens).
    queries = sorted({r["section"] for r in rows} | {r["api"] for r in rows if r["api"]})[:300] + EDGES
    long = [" ".join(r["text"] for r in rows[i:i + 12]) for i in range(0, 12 * 40, 12)]
    emb = minilm()
    assert emb.runtime == "onnx" and emb.dim == 384  # not silently the torch fallback

    t = time.perf_counter()
    got = np.concatenate([emb.embed(docs, bulk=True), emb.embed(queries), emb.embed(long, batch_size=16)])
    onnx_s = time.perf_counter() - t
    t = time.perf_counter()
    want = torch_model.encode(docs + queries + long, batch_size=64, normalize_embeddings=True,
                              convert_to_numpy=True)
    torch_s = time.perf_counter() - t
    assert got.shape == want.shape == (len(docs) + len(queries) + len(long), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    cosine = (got.astype(np.float64) * want).sum(1)
    print(f"\n{len(cosine)} texts ({len(docs)} paragraphs, {len(queries)} queries, {len(long)} long): minimum cosine "
          f"{cosine.min():.7f}, mean {cosine.mean():.7f}; ONNX {onnx_s:.1f} s, torch {torch_s:.1f} s")
    assert cosine.min() >= 0.999
    assert cosine.min() >= 0.9999  # as measured: float32 rounding only
    # Each text's vector does not depend on the batch it was in.
    one = np.stack([emb.embed([t])[0] for t in long[:3] + docs[:3]])
    assert (one * got[[*range(len(got) - len(long), len(got) - len(long) + 3), 0, 1, 2]]).sum(1).min() >= 0.99999


def test_token_spans_and_sizes_are_the_models(torch_model, shared_cache, data_dir, monkeypatch):
    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(shared_cache))
    emb = minilm()
    assert emb.runtime == "onnx"
    assert (emb.dim, emb.max_tokens) == (384, torch_model.max_seq_length - 2)
    for text in [r["text"] for r in paragraphs(data_dir, 200)] + EDGES:
        enc = torch_model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert emb.token_spans(text) == [tuple(o) for o in enc["offset_mapping"]]


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_the_cache_is_reused_and_a_corrupt_export_is_made_again(tmp_path, monkeypatch, exports, caplog):
    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(tmp_path))
    root = tmp_path / "onnx"
    texts = ["what happens to a deleted document?", "io_uring reads"]
    first = minilm()
    assert first.runtime == "onnx" and len(exports) == 1
    (entry,) = [root / name for name in _entries(root)]  # one folder, no temporary one left
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "model.onnx", "tokenizer.json"]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["graph"] == "fused" and meta["pooling"] == "mean" and meta["probe_min_cosine"] >= 0.9999
    vectors = first.embed(texts)

    # Another process (here a fresh embedder) loads it: no export, no torch model.
    loads, torch_model = [], embedding._sentence_transformer
    monkeypatch.setattr(embedding, "_sentence_transformer", lambda path: loads.append(path))
    second = minilm()
    assert second.runtime == "onnx" and len(exports) == 1 and not loads
    np.testing.assert_array_equal(second.embed(texts), vectors)
    monkeypatch.setattr(embedding, "_sentence_transformer", torch_model)

    # Bytes of the graph changed on disk (its size kept): found by its hash, set aside, exported again.
    with open(entry / "model.onnx", "r+b") as f:
        f.seek(os.path.getsize(entry / "model.onnx") // 2)
        f.write(b"\0" * 4096)
    with caplog.at_level(logging.WARNING, logger="fusionrag.retriever.collection.embedding_onnx"):
        third = minilm()
        assert third.runtime == "onnx" and len(exports) == 2
    assert "model.onnx does not match its SHA-256" in caplog.text and "exporting it again" in caplog.text
    assert _entries(root) == [entry.name]
    np.testing.assert_allclose(third.embed(texts), vectors, atol=1e-6)

    # A meta.json that is not JSON, or a graph ONNX Runtime cannot read (its hash made to match): refused.
    good = (entry / "meta.json").read_text()
    (entry / "meta.json").write_text(good[:50])
    with pytest.raises(embedding_onnx.Corrupt, match="meta.json"):
        embedding_onnx.OnnxModel(entry, lambda bulk: 1)
    (entry / "model.onnx").write_bytes(b"not a graph")
    meta["files"]["model.onnx"] = embedding_onnx._file_sha256(entry / "model.onnx")
    (entry / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(embedding_onnx.Corrupt, match="ONNX Runtime cannot load"):
        embedding_onnx.OnnxModel(entry, lambda bulk: 1)


def test_an_export_is_published_whole_or_not_at_all(tmp_path, torch_model, monkeypatch):
    root, key = tmp_path / "onnx", embedding_onnx.model_hash(MODEL_DIR)
    # Cut short after the graph is written (a crash, a full disk): no folder under the key, no temporary one.
    monkeypatch.setattr(embedding_onnx, "_fuse", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        embedding_onnx.export(MODEL_DIR, torch_model, root, key)
    assert _entries(root) == []
    monkeypatch.undo()
    # Two exporters of the same model at once: the first to rename its folder into place wins, the other's folder
    # is dropped and the winner's used (here the second finds the first's already there).
    first = embedding_onnx.export(MODEL_DIR, torch_model, root, key)
    stamp = (first / "model.onnx").stat().st_mtime_ns
    second = embedding_onnx.export(MODEL_DIR, torch_model, root, key)
    assert first == second == root / key and _entries(root) == [key]
    assert (first / "model.onnx").stat().st_mtime_ns == stamp
    # A temporary folder left by a process that died long ago is removed (by the next export); a recent one, maybe
    # another process's export under way, is not.
    for name, age in ((".tmp-dead", 2 * embedding_onnx.STALE_S), (".tmp-busy", 60)):
        (root / name).mkdir()
        os.utime(root / name, (time.time() - age, time.time() - age))
    embedding_onnx._remove_stale(root)
    assert _entries(root) == [".tmp-busy", key]


def test_two_processes_exporting_at_once_share_one_export(tmp_path):
    """Two processes load the model into the same empty cache at once: both embed, one folder is kept."""
    import subprocess

    code = ("from fusionrag.retriever.collection import embedding\n"
            "e = embedding.Embedder('m', 384, embedding._load_minilm)\n"
            "import sys; v = e.embed(['tombstones']); assert e.runtime == 'onnx', e.runtime\n"
            "sys.stdout.write(repr(float(v[0, :4].sum())))\n")
    env = {**os.environ, "FUSIONRAG_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert outs[0][0] == outs[1][0]
    assert len(_entries(tmp_path / "onnx")) == 1


def test_torch_runs_a_model_onnx_runtime_cannot_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(embedding, "_fallbacks", set())
    # A pooling this runtime does not do: the model runs on torch, the reason logged once.
    model = tmp_path / "weighted"
    shutil.copytree(MODEL_DIR, model)
    config = json.loads((model / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_weightedmean_tokens=True)
    (model / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="fusionrag.retriever.collection.embedding"):
        for _ in range(2):
            emb = Embedder("weighted", None, lambda: embedding._local_model(model))
            assert emb.runtime == "torch" and emb.embed(["a text"]).shape == (1, 384)
    assert caplog.text.count("runs on torch, not ONNX Runtime: its pooling is 'weightedmean'") == 1
    assert not (tmp_path / "cache" / "onnx").exists() or not _entries(tmp_path / "cache" / "onnx")
    # Asked for torch: torch, nothing logged.
    caplog.clear()
    monkeypatch.setattr(embedding, "_runtime", "torch")
    with caplog.at_level(logging.WARNING, logger="fusionrag.retriever.collection.embedding"):
        assert minilm().runtime == "torch"
    # fusionrag's own records: another package may warn here (vLLM's CPU worker, imported by an earlier test of the
    # suite, patches torch.set_num_threads and warns when it is called).
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fusionrag")] == []
    with pytest.raises(embedding.ConfigError, match="one of auto, onnx, bf16, torch"):
        embedding.set_runtime("tensorrt")
    # Without onnxruntime.
    monkeypatch.setattr(embedding, "_runtime", "auto")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level(logging.WARNING, logger="fusionrag.retriever.collection.embedding"):
        assert minilm().runtime == "torch"
    assert "runs on torch, not ONNX Runtime: onnxruntime is not installed" in caplog.text


def test_an_import_embeds_on_the_bulk_threads_and_logs_its_rate(tmp_path, shared_cache, data_dir, monkeypatch,
                                                                caplog):
    from fusionrag.retriever.collection import Catalog

    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(shared_cache))
    monkeypatch.setattr(embedding, "_threads", 1)
    monkeypatch.setattr(embedding, "_bulk_threads", 2)
    emb = minilm()
    monkeypatch.setattr(embedding, "get_embedder", lambda name: emb)
    rows = paragraphs(data_dir, 40)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": r["text"]}) + "\n"
                                                 for i, r in enumerate(rows)))
    cat = Catalog(tmp_path / "data")
    col = cat.create("c", 384, "cosine", "all-MiniLM-L6-v2")
    with caplog.at_level(logging.INFO, logger="fusionrag.retriever.collection.importer"):
        assert col.import_files(tmp_path / "docs.jsonl", progress=False)["stored"] == 40
    assert re.search(r"collection 'c': embedded 40 texts in [\d.]+ s \(\d+ docs/s\)", caplog.text), caplog.text
    assert sorted(emb._model._sessions) == [1, 2]  # the import's passes on 2 threads, the queries' on 1
    assert col.search(emb.embed([rows[7]["text"]]), k=1).hits[0][0].id == "d7"
    cat.close()


def test_a_lone_call_embeds_on_the_bulk_threads_unless_bulk_work_holds_them(shared_cache, data_dir, monkeypatch):
    """wide (a call the batcher knows to be alone): on the bulk session's threads when it is free, the same vectors
    as the query session's; while a bulk pass holds that session, on the query session at once, never waiting."""
    import threading

    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(shared_cache))
    monkeypatch.setattr(embedding, "_threads", 1)
    monkeypatch.setattr(embedding, "_bulk_threads", 2)
    emb = minilm()
    texts = [r["text"] for r in paragraphs(data_dir, 12)]
    narrow = emb.embed(texts)
    model = emb._model
    model._session(True)  # both sessions made, each's passes counted
    runs = []
    for threads, (session, _) in list(model._sessions.items()):
        real = session.run
        monkeypatch.setattr(session, "run", lambda *a, _t=threads, _r=real, **k: runs.append(_t) or _r(*a, **k),
                            raising=False)
    wide = emb.embed(texts, wide=True)
    assert set(runs) == {2}, runs  # the bulk session's 2 threads
    cos = (wide * narrow).sum(1) / np.linalg.norm(wide, axis=1) / np.linalg.norm(narrow, axis=1)
    assert cos.min() >= 0.99999, cos.min()
    bulk_session, bulk_lock = model._session(True)
    runs.clear()
    assert bulk_lock.acquire(blocking=False)  # a bulk pass holds it
    try:
        done = []
        t = threading.Thread(target=lambda: done.append(emb.embed(texts, wide=True)))
        t.start()
        t.join(30)
        assert done, "a wide call waited for the bulk pass"
        assert set(runs) == {1}, runs  # the query session's
        np.testing.assert_allclose(done[0], narrow, rtol=0, atol=1e-6)
    finally:
        bulk_lock.release()


def test_onnx_runtime_telemetry_is_off_before_it_loads():
    """ONNX Runtime's wheels send telemetry from Linux (its uploader looked up mobile.events.data.microsoft.com
    every few seconds from the service, seen with strace): ORT_DISABLE_TELEMETRY, which it reads once as it
    initialises, is set by the embedding module before anything imports onnxruntime; an operator's own value
    stays."""
    import subprocess
    import sys

    probe = ("import os, sys\n"
             "import fusionrag.retriever.collection.embedding_onnx\n"
             "assert 'onnxruntime' not in sys.modules\n"
             "import onnxruntime\n"
             "print(os.environ.get('ORT_DISABLE_TELEMETRY'))\n")
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "ORT_DISABLE_TELEMETRY": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_batches_pad_each_text_to_at_most_a_third_more_tokens():
    """However few texts a call holds (16 concurrent queries, say), no text is padded past 1/CUT of its own
    tokens: a batch of paragraphs used to fill to 1,024 tokens first, and 16 queries then cost 1.8x the CPU."""
    from fusionrag.retriever.collection.embedding_onnx import CUT, length_batches

    rng = np.random.default_rng(7)
    for n, batch_size in ((16, 64), (5, 64), (384, 128), (1000, 64), (40, 4)):
        lengths = rng.integers(3, 257, n)
        order = np.argsort(-lengths, kind="stable")
        batches = length_batches(lengths[order], order, batch_size)
        assert np.array_equal(np.concatenate(batches), order)  # every text once, longest first
        for rows in batches:
            width = lengths[rows].max()
            assert len(rows) <= batch_size and lengths[rows].min() >= CUT * width
        computed = sum(len(rows) * lengths[rows].max() for rows in batches)
        assert computed <= lengths.sum() / CUT
