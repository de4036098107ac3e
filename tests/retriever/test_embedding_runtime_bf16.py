"""The embedding model's bf16 runtime (retriever/collection/embedding_bf16.py): its vectors against the float32
reference model's (sentence-transformers on torch) on a few thousand texts; batched (packed) calls answer what calls
of one text do; it serves only where the CPU has bf16 matrix instructions, its vectors pass the check and its passes
are faster than ONNX Runtime's float32 model, ONNX Runtime otherwise (the log says which and why); the default;
forced either way; its passes' threads (a lone call wide, bulk work in parallel passes), their batches and shapes;
the memory its passes keep; it loads neither transformers nor sentence-transformers."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from embedding_helpers import EDGES, MODEL_DIR, minilm, paragraphs

from fusionrag.retriever.collection import embedding, embedding_bf16

NATIVE = embedding_bf16.cpu_bf16() is not None
# Paragraphs compared: where the CPU has no bf16 instructions torch emulates them, far slower (and the runtime is
# never chosen there unless forced), so fewer.
PARAGRAPHS = int(os.environ.get("FUSIONRAG_EMBED_CHECK_PARAGRAPHS", "2000")) if NATIVE else 300
LOGGER = "fusionrag.retriever.collection.embedding"


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One ONNX export for the module's tests, in a cache of their own."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(shared_cache, monkeypatch):
    monkeypatch.setenv("FUSIONRAG_CACHE_DIR", str(shared_cache))
    monkeypatch.setenv(embedding_bf16.ENV, "auto")  # the choice by measurement (not the default: see below)
    monkeypatch.setattr(embedding, "_runtime", "auto")
    return shared_cache


@pytest.fixture(scope="module")
def reference():
    """The float32 reference: sentence-transformers on torch, one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield embedding._sentence_transformer(MODEL_DIR)
    torch.set_num_threads(threads)


def forced(monkeypatch) -> embedding.Embedder:
    monkeypatch.setattr(embedding, "_runtime", "bf16")
    emb = minilm()
    assert emb.runtime == "bf16"
    return emb


def test_bf16_vectors_match_the_float32_reference_models(cache, reference, data_dir, monkeypatch):
    rows = paragraphs(data_dir, PARAGRAPHS)
    docs = [r["text"] for r in rows]
    queries = sorted({r["section"] for r in rows} | {r["api"] for r in rows if r["api"]})[:300] + EDGES
    long = [" ".join(r["text"] for r in rows[i:i + 12]) for i in range(0, 12 * 40, 12)]
    emb = forced(monkeypatch)
    got = np.concatenate([emb.embed(docs, bulk=True), emb.embed(queries), emb.embed(long, batch_size=16)])
    want = reference.encode(docs + queries + long, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    assert got.shape == want.shape == (len(docs) + len(queries) + len(long), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    cosine = (got.astype(np.float64) * want).sum(1)
    print(f"\n{len(cosine)} texts ({len(docs)} paragraphs, {len(queries)} queries, {len(long)} long): bf16 against "
          f"float32, minimum cosine {cosine.min():.7f}, mean {cosine.mean():.7f}")
    assert cosine.min() >= 0.999
    # The same tokens as the float32 model's: spans and sizes are the ONNX model's own.
    assert (emb.dim, emb.max_tokens) == (384, reference.max_seq_length - 2)
    text = docs[0]
    enc = reference.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert emb.token_spans(text) == [tuple(o) for o in enc["offset_mapping"]]


def test_batched_calls_answer_what_calls_of_one_text_do(cache, data_dir, monkeypatch):
    """The service embeds concurrent queries together (server/batcher.py): each text's vector is its own,
    whatever it was batched with (bf16 sums may differ in their last bits with the batch's padding)."""
    monkeypatch.setattr(embedding, "_threads", 1)
    monkeypatch.setattr(embedding, "_bulk_threads", 2)
    emb = forced(monkeypatch)
    texts = [r["text"] for r in paragraphs(data_dir, 40)] + ["PQ", "What happens to a deleted document?", ""]
    one = np.concatenate([emb.embed([t]) for t in texts])
    for got in (emb.embed(texts), emb.embed(texts, batch_size=16), emb.embed(texts, wide=True),
                emb.embed(texts, bulk=True, batch_size=8)):
        cosine = (got * one).sum(1)
        assert cosine.min() >= 0.9999, cosine.min()


FIGURES = re.compile(r"batch of \d+ ([\d.]+) / ([\d.]+), one text ([\d.]+) / ([\d.]+); minimum cosine ([\d.]+)")


def test_auto_takes_bf16_where_it_is_right_and_faster(cache, monkeypatch, caplog):
    """auto measures the bf16 model against the float32 one as it loads, and its verdict is what its figures say:
    bf16 where it is right and at most FASTER of the float32 runtime's thread CPU (batch and one text), else ONNX
    Runtime, the log giving the figures. This machine's figures decide which (on a busy 2-core VM they fall on
    either side of FASTER); then, the timing made so, bf16 measured faster is taken."""
    if not NATIVE:
        pytest.skip("this CPU has no bf16 matrix instructions")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        emb = minilm()
        runtime = emb.runtime  # the model loads, and is measured, when first used
    said = FIGURES.search(caplog.text)
    assert said and "ms/text of thread CPU" in caplog.text, caplog.text
    bf16_batch, fp32_batch, bf16_one, fp32_one, cosine = map(float, said.groups())
    print(f"\n{said.group(0)}")
    assert cosine >= embedding_bf16.MIN_COSINE
    faster = bf16_batch <= embedding_bf16.FASTER * fp32_batch and bf16_one <= embedding_bf16.FASTER * fp32_one
    # the log rounds to 0.01 ms: a verdict within that of the line is not checked against it
    near = min(abs(bf16_batch - embedding_bf16.FASTER * fp32_batch), abs(bf16_one - embedding_bf16.FASTER * fp32_one))
    if runtime == "bf16":
        assert "runs in bf16 on torch" in caplog.text
        figures = emb._model.timing
        assert figures["bf16_batch_ms"] <= embedding_bf16.FASTER * figures["fp32_batch_ms"]
        assert figures["bf16_one_ms"] <= embedding_bf16.FASTER * figures["fp32_one_ms"]
        assert faster or near < 0.02
    else:
        assert runtime == "onnx" and "not faster here" in caplog.text, caplog.text
        assert not faster or near < 0.02
    monkeypatch.setattr(embedding_bf16, "timing", lambda model, texts: (4.0, 4.0) if isinstance(
        model, embedding_bf16.Bf16Model) else (10.0, 10.0))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert minilm().runtime == "bf16"
    assert "runs in bf16 on torch" in caplog.text and "batch of" in caplog.text, caplog.text


def _onnx_because(caplog, monkeypatch, why: str) -> None:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        emb = minilm()
        assert emb.runtime == "onnx"
        assert emb.embed(["a text"]).shape == (1, 384)
    assert "runs on ONNX Runtime in float32, not in bf16 on torch: " + why in caplog.text, caplog.text


def test_onnx_runtime_serves_where_bf16_is_unsupported_wrong_or_slower(cache, monkeypatch, caplog):
    # No bf16 instructions: not even torch's model is loaded to check.
    monkeypatch.setattr(embedding_bf16, "cpu_bf16", lambda: None)
    loads, load = [], embedding._sentence_transformer
    monkeypatch.setattr(embedding, "_sentence_transformer", lambda path: loads.append(path) or load(path))
    _onnx_because(caplog, monkeypatch, "the CPU has no bf16 matrix instructions")
    assert not loads
    monkeypatch.setattr(embedding_bf16, "cpu_bf16", lambda: "amx_bf16")
    # torch's oneDNN says no.
    monkeypatch.setattr(embedding_bf16, "_torch_bf16", lambda torch: False)
    _onnx_because(caplog, monkeypatch, "torch's oneDNN does not run bf16 on this CPU")
    monkeypatch.setattr(embedding_bf16, "_torch_bf16", lambda torch: True)
    # Vectors off the float32 model's (here made so): refused, whatever the timing would say.
    run = embedding_bf16.Bf16Model.run

    def off(self, outputs, feed):
        (tokens,) = run(self, outputs, feed)
        return [tokens + np.random.default_rng(0).normal(0, 0.05, tokens.shape).astype(np.float32)]

    monkeypatch.setattr(embedding_bf16.Bf16Model, "run", off)
    _onnx_because(caplog, monkeypatch, "its vectors differ from the float32 model's (minimum cosine 0.")
    monkeypatch.setattr(embedding_bf16.Bf16Model, "run", run)
    # Right but not faster than ONNX Runtime here, for a batch or for one text.
    for bf16 in ((9.5, 5.0), (5.0, 9.5)):
        monkeypatch.setattr(embedding_bf16, "timing", lambda model, texts, _b=bf16: _b if isinstance(
            model, embedding_bf16.Bf16Model) else (10.0, 10.0))
        _onnx_because(caplog, monkeypatch, "not faster here (ms/text of thread CPU, bf16 / ONNX Runtime float32")
    # torch's own failure while checking: ONNX Runtime serves, the log says so.
    monkeypatch.setattr(embedding_bf16, "timing", lambda model, texts: 1 / 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert minilm().runtime == "onnx"
    assert "its bf16 check failed (ZeroDivisionError" in caplog.text


def test_either_runtime_is_forced(cache, monkeypatch, caplog):
    monkeypatch.setattr(embedding_bf16, "timing", lambda *a: pytest.fail("timed when forced"))
    loads, load = [], embedding._sentence_transformer
    monkeypatch.setattr(embedding, "_sentence_transformer", lambda path: loads.append(path) or load(path))
    monkeypatch.setenv(embedding_bf16.ENV, "off")
    _onnx_because(caplog, monkeypatch, "FUSIONRAG_EMBED_BF16=off")
    monkeypatch.delenv(embedding_bf16.ENV)  # the default: chosen by measurement as the model loads
    assert embedding_bf16.mode() == "auto"
    monkeypatch.setenv(embedding_bf16.ENV, "sometimes")
    assert embedding_bf16.mode() == "auto"
    monkeypatch.setenv(embedding_bf16.ENV, "off")
    monkeypatch.setattr(embedding, "_runtime", "onnx")
    _onnx_because(caplog, monkeypatch, "the runtime asked for is 'onnx'")
    assert not loads  # neither loads torch's model
    # On: without the capability check and the timing, never without the vectors' check.
    monkeypatch.setattr(embedding, "_runtime", "auto")
    monkeypatch.setenv(embedding_bf16.ENV, "on")
    monkeypatch.setattr(embedding_bf16, "cpu_bf16", lambda: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert minilm().runtime == "bf16"
    assert "runs in bf16 on torch: FUSIONRAG_EMBED_BF16=on (minimum cosine 0.9999" in caplog.text, caplog.text
    monkeypatch.setattr(embedding_bf16, "MIN_COSINE", 1.5)
    _onnx_because(caplog, monkeypatch, "its vectors differ from the float32 model's")
    with pytest.raises(embedding.ConfigError, match="one of auto, onnx, bf16, torch"):
        embedding.set_runtime("tensorrt")


def test_passes_run_on_one_thread_each_and_calls_that_may_use_more_cores_run_them_in_parallel(cache, data_dir,
                                                                                              monkeypatch):
    """Each pass on one torch thread (torch's thread count is the process's; its OpenMP passes on two threads were
    far slower on a busy machine), at most one a core across the process: a call runs its batches one after
    another on threads(False) = 1; bulk work and a wide call (the batcher's lone query) run theirs as parallel
    passes on the bulk threads' count (2), in the model's pool; a call still runs while another pass holds a
    core."""
    import torch

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no room for a pass beside another")
    monkeypatch.setattr(embedding, "_threads", 1)
    monkeypatch.setattr(embedding, "_bulk_threads", 2)
    emb = forced(monkeypatch)
    model = emb._model
    runs, active, most = [], [0], [0]
    lock = threading.Lock()
    real = embedding_bf16.Bf16Model.run

    def counted(self, *a):
        with lock:
            runs.append((torch.get_num_threads(), threading.current_thread().name))
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return real(self, *a)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(embedding_bf16.Bf16Model, "run", counted)
    texts = [r["text"] for r in paragraphs(data_dir, 24)]
    narrow = emb.embed(texts, batch_size=4)
    assert {n for n, _ in runs} == {1} and {name for _, name in runs} == {threading.current_thread().name}
    assert most[0] == 1
    for how in ({"wide": True}, {"bulk": True}):
        runs.clear()
        most[0] = 0
        got = emb.embed(texts, batch_size=4, **how)
        assert {n for n, _ in runs} == {1} and all(name.startswith("fusionrag-bf16") for _, name in runs), how
        assert 1 <= most[0] <= 2 and model._passes.busy == 0
        assert (got * narrow).sum(1).min() >= 0.9999
    # One text, wide: one pass, here.
    runs.clear()
    emb.embed(texts[:1], wide=True)
    assert runs == [(1, threading.current_thread().name)]
    # A pass holds a core: a wide call runs beside it, on the other.
    runs.clear()
    with model._passes.one():
        done = []
        t = threading.Thread(target=lambda: done.append(emb.embed(texts[:8], batch_size=4, wide=True)))
        t.start()
        t.join(60)
        assert done, "a call waited for another's pass"
    assert {n for n, _ in runs} == {1} and model._passes.busy == 0


def test_pass_batches_cover_each_text_once_and_share_the_cores():
    rng = np.random.default_rng(5)
    for n, parallel, batch_size in ((1, 2, 64), (2, 2, 64), (16, 2, 64), (40, 2, 4), (300, 4, 64), (7, 1, 3)):
        lengths = rng.integers(3, 257, n)
        order = np.argsort(-lengths, kind="stable")
        batches = embedding_bf16.pass_batches(lengths, order, batch_size, parallel)
        assert np.array_equal(np.concatenate(batches), order)  # every text once, longest first
        share = min(embedding_bf16.PASS_TOKENS, -(-int(lengths.sum()) // parallel))
        for b in batches:
            assert 1 <= len(b) <= batch_size
            assert len(b) == 1 or lengths[b].sum() <= share, (lengths[b], share)
        if n >= parallel:  # a call of as many texts as passes at once gives each of them a pass
            assert len(batches) >= parallel
        if parallel == 1 and batch_size >= n and lengths.sum() <= embedding_bf16.PASS_TOKENS:
            assert len(batches) == 1  # one pass, its texts packed whatever their lengths


def test_padded_rows_repeat_few_shapes():
    rows = [embedding_bf16.padded_rows(c) for c in range(1, 4097)]
    assert all(r >= c for c, r in zip(range(1, 4097), rows)) and rows == sorted(rows)
    assert len(set(rows)) <= 60
    assert all(r - c < 8 or r <= c * 9 / 8 for c, r in zip(range(1, 4097), rows))  # at most an eighth more rows


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_passes_of_ever_new_token_counts_keep_no_memory(cache, data_dir, monkeypatch):
    """oneDNN compiles and caches a kernel per shape: calls of texts whose token counts never repeat must not grow
    the process (RssAnon, the kernel's count) past the first round's. Packed passes of exact token counts grew it by
    219 MiB over these 250 calls (2-core AMX VM)."""
    monkeypatch.setattr(embedding, "_threads", 1)
    emb = forced(monkeypatch)
    texts = [r["text"] for r in paragraphs(data_dir, 900)]
    for i in range(0, 150, 3):  # the first round: the shapes a call may take, and the allocator's own growth
        emb.embed(texts[i:i + 3])
    before = _rss_anon_mib()
    for i in range(150, 900, 3):
        emb.embed(texts[i:i + 3])
    grown = _rss_anon_mib() - before
    print(f"\n250 calls of 3 paragraphs after 50: RssAnon grew {grown:.1f} MiB")
    assert grown < 60, grown


def test_bf16_runtime_loads_neither_transformers_nor_sentence_transformers(cache, tmp_path):
    """The bf16 transformer is read from the model's own files: the service holds torch, not transformers and
    sentence-transformers beside it (the export to ONNX, once, uses them; its cache is made first here)."""
    minilm().load()  # the ONNX export in the module's cache
    code = ("import sys; from fusionrag.retriever.collection import embedding as e; e.set_runtime('bf16'); "
            "m = e.get_embedder(); v = m.embed(['a question?', 'a longer text about the index and its lists']); "
            "print(m.runtime, v.shape, sorted(k for k in ('transformers', 'sentence_transformers', 'torch') "
            "if k in sys.modules))")
    env = dict(os.environ, FUSIONRAG_EMBED_BF16="auto")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "bf16 (2, 384) ['torch']", out.stdout


def test_models_other_than_bert_encoders_stay_on_onnx_runtime(tmp_path):
    """The bf16 pass is BERT's encoder: a model of another architecture, position scheme or activation, or without
    its weights, is refused with why (choose() then leaves ONNX Runtime's float32 model serving)."""
    import json as _json
    import shutil

    good = _json.loads((MODEL_DIR / "config.json").read_text())
    for n, (change, why) in enumerate((({"model_type": "roberta"}, "BERT encoders with absolute positions, not 'roberta'"),
                        ({"position_embedding_type": "relative_key"}, "BERT encoders with absolute positions"),
                        ({"hidden_act": "relu"}, "its activation is 'relu'"))):
        folder = tmp_path / f"m{n}"
        folder.mkdir()
        (folder / "config.json").write_text(_json.dumps(good | change))
        with pytest.raises(embedding_bf16.Unsupported, match=why):
            embedding_bf16._Bert(folder)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(MODEL_DIR / "config.json", bare / "config.json")
    with pytest.raises(embedding_bf16.Unsupported, match="no model.safetensors or pytorch_model.bin"):
        embedding_bf16._Bert(bare)
