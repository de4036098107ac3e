"""The raw vectors resident in RAM (EngineConfig.raw_in_ram, #68 item 5): the re-rank scores every candidate from one
array in RAM (native.rerank_resident) and reads nothing from the SSD.

On real data (SIFT's 5,000 float32 vectors; Fashion-MNIST's 60,000 uint8 images): the resident re-rank answers what the
SSD path answers without its early stop (beta 0: same ids, same distances, bit for bit, from the same record kernel),
and never worse than the SSD path with it; a search reads nothing from storage (the engine's pages_read, the store's
blocks_read, and the kernel's count of the process's bytes read from storage, /proc/self/io, which sees the SSD path's
O_DIRECT reads); Index.memory() counts the array, which the process's resident memory, measured in a fresh process,
agrees with, and the page buffer holds nothing beside it; 'auto' holds the vectors where the budget does.
"""

import json
import sys

import numpy as np
import pytest
from conftest import idx_images
from rss import run_alone, status

MiB = 1 << 20
KNOBS = [{"nprobe": 8, "rerank": 20}, {"nprobe": 32, "rerank": 100}, {"nprobe": 128, "rerank": 400}]


@pytest.fixture(scope="module")
def sift(tmp_path_factory, data_dir):
    """SIFT's 5,000 base vectors built at the defaults; its 100 queries."""
    from fusionrag.retriever import BuildConfig, Index
    from fusionrag.retriever.engine.vectors import open_vectors

    d, tmp = data_dir / "sift5k-ngt-texmexq", tmp_path_factory.mktemp("raw_in_ram_sift")
    Index.build(d / "sift5k_base.fvecs", tmp / "idx", BuildConfig(threads=2), progress=False)
    base = np.asarray(open_vectors(d / "sift5k_base.fvecs"), np.float32)
    queries = np.ascontiguousarray(open_vectors(d / "sift5k_query.fvecs"), np.float32)
    return tmp / "idx", base, queries


@pytest.fixture(scope="module")
def glove(tmp_path_factory, data_dir):
    """float32 records under cosine: GloVe's 10,000 held-out word vectors (the set's query file), 9,800 of them built
    at the defaults and the other 200 as queries."""
    from fusionrag.retriever import BuildConfig, Index
    from fusionrag.retriever.engine.vectors import open_vectors, write_bin

    tmp = tmp_path_factory.mktemp("raw_in_ram_glove")
    words = np.asarray(open_vectors(data_dir / "glove-6b-50d-angular" / "query_10k.fbin"), np.float32)
    write_bin(tmp / "base.fbin", words[:9800])
    Index.build(tmp / "base.fbin", tmp / "idx", BuildConfig(threads=2, metric="cosine"), progress=False)
    return tmp / "idx", np.ascontiguousarray(words[9800:])


@pytest.fixture(scope="module")
def fashion(tmp_path_factory, data_dir):
    """Fashion-MNIST's 60,000 training images (47 MB of uint8 records) built at the defaults; 300 test images."""
    from fusionrag.retriever import BuildConfig, Index
    from fusionrag.retriever.engine.vectors import write_bin

    d, tmp = data_dir / "fashion-mnist-784-euclidean", tmp_path_factory.mktemp("raw_in_ram_fashion")
    write_bin(tmp / "base.u8bin", idx_images(d / "train-images-idx3-ubyte.gz"))
    Index.build(tmp / "base.u8bin", tmp / "idx", BuildConfig(threads=2), progress=False)
    np.save(tmp / "queries.npy", idx_images(d / "t10k-images-idx3-ubyte.gz")[:300].astype(np.float32))
    return tmp / "idx", tmp / "queries.npy"


def _open(path, raw, **kw):
    from fusionrag.retriever import Index

    return Index.open(path, raw_in_ram=raw, threads=2, verify=False, manager_interval_s=0, **kw)


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (the kernel's count, /proc/self/io)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


@pytest.mark.parametrize("which", ["sift", "glove", "fashion"])
def test_resident_answers_what_the_ssd_path_answers(request, which):
    """Same ids and distances as the SSD path at beta 0 (both score every candidate); with the early stop on, each
    query's resident top-k is at least as near at every rank (it scores a superset of the SSD path's candidates).
    SIFT's and Fashion's records are stored as uint8, GloVe's as float32 (cosine)."""
    if which == "sift":
        path, _, queries = request.getfixturevalue("sift")
    elif which == "glove":
        path, queries = request.getfixturevalue("glove")
    else:
        path, qfile = request.getfixturevalue("fashion")
        queries = np.load(qfile)
    ram, ssd = _open(path, "on"), _open(path, "off", buffer_bytes=1 << 20)
    assert ram.reranker.resident and not ssd.reranker.resident
    for knob in KNOBS:
        a, b = ram.search(queries, 10, beta=0, **knob), ssd.search(queries, 10, beta=0, **knob)
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.distances, b.distances)
        assert a.info["raw_in_ram"] and not b.info["raw_in_ram"]
        np.testing.assert_array_equal(a.stats["reranked"], b.stats["reranked"])
        few = ram.search(queries[:5], 10, beta=0, **knob)  # under 16 queries: scored in the calling thread
        np.testing.assert_array_equal(few.ids, a.ids[:5])
        np.testing.assert_array_equal(few.distances, a.distances[:5])
        early = ssd.search(queries, 10, **knob)  # the SSD path's default early stop
        assert np.all(a.distances <= early.distances), knob
        # the control: the SSD path went through the page store (read, buffered or cached)
        assert (b.stats["pages_read"] + b.stats["pages_buffered"] + b.stats["records_cached"]).sum() > 0
        assert (a.stats["pages_read"] + a.stats["pages_buffered"] + a.stats["records_cached"]).sum() == 0
    ram.close(), ssd.close()


def test_resident_distances_are_exact(sift):
    """The resident re-rank's distances against numpy's exact squared L2 (float64) of the same ids, and the same
    top-k of the same candidates numpy ranks; read_vectors gives the stored rows back."""
    from fusionrag import native

    path, base, queries = sift
    index = _open(path, "on")
    dtype = index.reranker.dtype  # u8: SIFT's values are whole numbers up to 255
    assert index.reranker.raw.shape == (len(base), base.shape[1] * (4 if dtype == "f32" else 1))
    r = index.search(queries, 10, nprobe=64, rerank=200, beta=0)
    exact = ((queries[:, None, :].astype(np.float64) - base[r.ids].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_allclose(r.distances, exact, rtol=1e-5, atol=1e-2)
    np.testing.assert_array_equal(index.read_vectors(r.ids[0]), base[r.ids[0]])

    # The native call alone, on candidates of every kind: repeats (kept once), -1 padding, ids in any order.
    rng = np.random.default_rng(0)
    cand = rng.integers(0, len(base), (len(queries), 50)).astype(np.int64)
    cand[:, 10:13] = cand[:, :3]  # repeated ids
    cand[::3, 40:] = -1  # padded rows
    ids, dists, stats, secs = native.rerank_resident(index.reranker.raw, queries, cand, dtype, "l2", 10, 2)
    for i in range(len(queries)):
        c = np.unique(cand[i][:40] if i % 3 == 0 else cand[i])
        d = ((base[c].astype(np.float64) - queries[i]) ** 2).sum(1)
        best = c[np.lexsort((c, d))][:10]
        np.testing.assert_array_equal(ids[i], best)
        assert stats[i, 1] == (40 if i % 3 == 0 else 50) and stats[i, 2] == 0
    with pytest.raises(ValueError, match="outside"):
        native.rerank_resident(index.reranker.raw, queries[:1], np.array([[len(base)]], np.int64), dtype, "l2", 1, 1)
    with pytest.raises(ValueError, match="bytes"):
        native.rerank_resident(index.reranker.raw, queries[:1, :64].copy(), cand[:1], dtype, "l2", 1, 1)
    index.close()


def test_resident_reads_nothing_from_the_ssd(sift):
    """After the open, searches, search_among and read_vectors read no block: the engine's pages_read, the store's
    blocks_read and the kernel's read_bytes stay put; the SSD path's searches move all three (the control)."""
    path, base, queries = sift
    for raw in ("on", "off"):
        index = _open(path, raw, buffer_bytes=1 << 20, rerank_prefetch=False)
        store = index.reranker.store
        if raw == "on":  # the open read every block once, and the page buffer holds none of them
            assert store.stats()["blocks_read"] == store.num_blocks and store.buffer_capacity == 0
        before, blocks = _read_bytes(), store.stats()["blocks_read"]
        r = index.search(queries, 10, nprobe=64, rerank=200)
        among = index.search_among(queries[:5], np.arange(0, len(base), 7), 10)
        index.read_vectors(r.ids[0])
        read, blocks = _read_bytes() - before, store.stats()["blocks_read"] - blocks
        if raw == "on":
            assert r.stats["pages_read"].sum() == 0 and among.stats["pages_read"].sum() == 0
            assert blocks == 0 and read == 0, (blocks, read)
        else:
            assert r.stats["pages_read"].sum() > 0 and blocks > 0
            if store.direct:  # O_DIRECT reads reach the device, and the kernel counts them
                assert read >= blocks * store.block_bytes, (read, blocks)
        index.close()


def test_auto_holds_the_vectors_where_the_budget_does(sift):
    """raw_in_ram 'auto': resident where buffer_bytes holds count x record_bytes, the page buffer then empty; one
    byte less, the SSD path with the page buffer as before; 'off' never, 'on' always."""
    path, base, _ = sift
    raw = len(base) * json.loads((path / "manifest.json").read_text())["pages"]["record_bytes"]  # uint8 records
    cases = [("auto", raw, True), ("auto", raw - 1, False), ("auto", 4 * raw, True), ("off", 4 * raw, False),
             ("on", 1 << 20, True)]
    for choice, budget, resident in cases:
        index = _open(path, choice, buffer_bytes=budget)
        mem = index.memory()
        assert index.reranker.resident == resident == mem["raw_in_ram"], (choice, budget)
        if resident:
            assert mem["parts"]["raw_vectors"] == mem["raw_vectors_bytes"] == raw
            assert mem["parts"]["page_buffer"] == mem["parts"]["record_cache"] == 0
            assert index.reranker.store.buffer_capacity == 0 and index.reranker.store.record_cache_capacity == 0
        else:
            assert "raw_vectors" not in mem["parts"] and mem["raw_vectors_bytes"] == 0
            assert mem["parts"]["page_buffer"] + mem["parts"]["record_cache"] > 0
        index.close()


def _measure(path: str, queries: str, engine: str) -> dict:
    """In a fresh process: the engine imported, the index opened and searched on 2 threads; RSS at each step and
    memory() beside it (as tests/retriever/test_memory_accounting.py measures; the peak from the open on)."""
    from fusionrag.retriever.process import return_freed_memory

    return_freed_memory()
    from fusionrag.retriever.engine.index import Index

    q = np.load(queries)
    base = status("VmRSS", "RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    index = Index.open(path, threads=2, verify=False, **json.loads(engine))
    opened, at_open = status("VmRSS", "RssAnon"), index.memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from the open on: the searches' peak, not the load's chunks
    for _ in range(3):
        index.search(q, 10)
        index.search(q, 10, nprobe=128, rerank=400)
    return {"base": base, "opened": opened, "after": status("VmHWM", "RssAnon"), "at_open": at_open,
            "memory": index.memory({"nprobe": 128, "rerank": 400}, len(q), 10)}


@pytest.mark.parametrize("raw", ["on", "off"])
def test_memory_accounts_for_the_resident_vectors(fashion, raw):
    """Fashion's 47 MB of records in RAM: the process's anonymous memory grows at the open by memory()'s arrays, the
    raw vectors among them, within a few MiB, and peaks at its total; the page buffer holds nothing beside them.
    'off' at the same budget (the raw bytes) is the control: the same checks hold with a page buffer instead."""
    path, queries = fashion
    budget = 60000 * 784
    m = json.loads(run_alone(__file__, str(path), str(queries), json.dumps({"buffer_bytes": budget,
                                                                            "raw_in_ram": raw})))
    o, mem = m["at_open"]["parts"], m["memory"]
    arrays = sum(v for k, v in o.items() if k not in ("page_buffer", "record_cache", "search_scratch", "search_call"))
    grown = m["opened"]["RssAnon"] - m["base"]["RssAnon"]
    assert abs(grown - arrays) <= 2 * MiB, (grown, arrays, o)
    if raw == "on":  # (off: the page buffer fills only as searches read, its full part is not reached here)
        peak = m["after"]["VmHWM"] - m["base"]["VmRSS"]
        assert abs(peak - mem["total_bytes"]) <= 3 * MiB, (peak, mem)
        assert o["raw_vectors"] == budget and o["page_buffer"] == o["record_cache"] == 0
        assert o["page_buffer_metadata"] < 64 << 10  # an empty buffer's bookkeeping
        assert mem["total_bytes"] - mem["parts"]["search_call"] <= budget + o["navigation_graph"] + 16 * MiB
    else:
        assert "raw_vectors" not in o


if __name__ == "__main__":
    print(json.dumps(_measure(*sys.argv[1:4])))
