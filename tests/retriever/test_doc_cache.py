"""The cache of returned documents (docstore.ROW_CACHE): a search's hits read from it are what SQLite holds now,
through upserts, metadata patches, deletes, delete-by-filter, delete-all and reopening, and concurrent writes; it
holds at most its bytes, all stores together, counted against the entries actually held and the memory they take."""

import sqlite3
import threading
import tracemalloc

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection import docstore
from fusionrag.retriever.collection.docstore import ROW_CACHE, DocStore, RowCache

DIM = 16


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=200, background_merge=False))
    yield cat
    cat.close()


def stored(col) -> dict[str, tuple]:
    """id -> (text, metadata JSON) straight from the collection's SQLite file, past every cache."""
    con = sqlite3.connect(f"file:{col.path / 'docs.sqlite'}?mode=ro", uri=True)
    try:
        return {i: (t, m) for i, t, m in con.execute("SELECT id, text, metadata FROM docs")}
    finally:
        con.close()


def check_hits(col, queries, k=10):
    """Every hit's text and metadata are the file's for its id, and no hit is a deleted document."""
    now = stored(col)
    res = col.search(queries, k=k)
    n = 0
    for hits in res.hits:
        for h in hits:
            assert h.id in now, f"{h.id} was deleted, yet returned"
            text, meta = now[h.id]
            assert h.text == text and h.metadata == docstore._metadata(meta), h.id
            n += 1
    return n


def test_hits_follow_every_kind_of_write(catalog):
    col = catalog.create("c", DIM, "l2")
    x = clustered(400, DIM, 8, seed=3)
    col.add([Document(f"d{i}", f"text {i}", v, {"n": i}) for i, v in enumerate(x)])
    col.merge()  # a main index: hits come from the engine, rows mapped through the generation
    q = x[::20]
    assert check_hits(col, q) == len(q) * 10
    assert col.store._cached, "the first search's documents are kept"
    # a metadata patch and a replace: the cached rows of those ids must not be served again
    col.set_metadata({"d0": {"n": -1, "tag": "patched"}})
    col.upsert([Document("d20", "replaced text", x[20], {"n": 20, "new": True})])
    got = {h.id: h for h in col.search(x[[0, 20]], k=1).hits[0] + col.search(x[[20]], k=1).hits[0]}
    assert got["d0"].metadata == {"n": -1, "tag": "patched"} and got["d20"].text == "replaced text"
    assert check_hits(col, q) == len(q) * 10
    # deletes by id and by filter: never returned from the cache afterwards
    col.delete(["d40", "d60"])
    col.delete_where({"n": {"$lt": 10, "$gte": 0}})
    for hits in col.search(x[[40, 60, 1, 2]], k=5).hits:
        assert not {"d40", "d60", "d1", "d2"} & {h.id for h in hits}
    check_hits(col, q)
    # a merge renumbers nothing (rows are never reused) and the cache stays right across it
    col.merge()
    check_hits(col, q)
    col.clear()
    assert all(not hits for hits in col.search(q, k=3).hits)
    assert not col.store._cached


def test_a_read_begun_before_a_commit_is_not_kept(tmp_path):
    """The race the epoch closes: a read of old rows that finishes after a commit changed them is not cached."""
    store = DocStore(tmp_path / "docs.sqlite", 4, create=True)
    try:
        store.begin()
        store.insert([0, 1], ["a", "b"], ["one", "two"], ['{"v":1}', '{"v":2}'], np.zeros((2, 4), np.float32))
        store.commit(1, 2)
        epoch = store._cache_epoch  # a reader about to read row 0 (old metadata)
        old = [(0, "a", "one", '{"v":1}')]
        store.begin()
        store.update_metadata(["a"], ['{"v":9}'], merge=False)
        store.commit(2, 2)
        ROW_CACHE.fill(store._cached, old, epoch, lambda: store._cache_epoch)  # the reader finishing late
        assert 0 not in store._cached
        assert store.by_rows([0], False)[0][2] == {"v": 9}
        assert store.by_rows([0], False)[0][2] == {"v": 9}  # and again, now from the cache
        assert store._cached[0][2] == '{"v":9}'
        # a rolled-back write changes nothing and drops nothing
        store.begin()
        store.remove(["a"])
        store.rollback()
        assert 0 in store._cached and store.by_rows([0, 1], False)[0][0] == "a"
    finally:
        store.close()
    assert not store._cached


def test_concurrent_writes_never_leave_a_stale_document(catalog):
    """Searches run while a writer patches metadata: after each acknowledged patch, a search returns it."""
    col = catalog.create("c", DIM, "l2")
    x = clustered(300, DIM, 6, seed=5)
    col.add([Document(f"d{i}", f"t{i}", v, {"v": 0}) for i, v in enumerate(x)])
    col.merge()
    stop = threading.Event()
    errors = []

    def reader():
        try:
            while not stop.is_set():
                col.search(x[:30], k=5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for v in range(1, 40):
            col.set_metadata({f"d{i}": {"v": v} for i in range(0, 30, 3)})
            for hits in col.search(x[:30:3], k=1).hits:
                assert hits[0].metadata == {"v": v}
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors


def test_bounded_by_its_bytes_across_stores(tmp_path, monkeypatch):
    """Two stores' documents share one bound: the entries held add up to at most it, by their own count and by
    the memory they take (tracemalloc), and the oldest go first."""
    cache = RowCache(256 << 10)
    monkeypatch.setattr(docstore, "ROW_CACHE", cache)
    text = "w" * 900
    stores = [DocStore(tmp_path / f"s{j}.sqlite", 4, create=True) for j in range(2)]
    try:
        for s in stores:
            n = 2000
            s.begin()
            s.insert(list(range(n)), [f"id-{i}" for i in range(n)], [text + str(i) for i in range(n)],
                     ['{"k":1}'] * n, np.zeros((n, 4), np.float32))
            s.commit(1, n)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, 2000, 50):
            for s in stores:
                s.by_rows(list(range(start, start + 50)), False)
        held_memory = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        entries = [e for s in stores for e in s._cached.values()]
        recount = sum(RowCache.ENTRY_OVERHEAD + len(i) + len(m) + len(t) for i, t, m, _ in entries)
        assert cache.held == recount <= cache.limit and cache.count == len(entries)
        assert held_memory <= 1.5 * cache.limit, held_memory
        assert len(entries) >= 0.8 * cache.limit / (RowCache.ENTRY_OVERHEAD + 920)  # it is used, not starved
        assert all(r >= 1500 for s in stores for r in s._cached)  # the newest kept, the oldest gone
        # the order's records of dropped entries do not pile up
        for _ in range(30):
            for s in stores:
                s.begin()
                s.update_metadata([f"id-{i}" for i in range(1900, 2000)], ['{"k":2}'] * 100, merge=False)
                s.commit(2, 2000)
                s.by_rows(list(range(1900, 2000)), False)
        assert len(cache._order) <= 2 * cache.count + 1024 + 200
        cache.resize(0)
        assert cache.held == 0 and not any(s._cached for s in stores)
    finally:
        for s in stores:
            s.close()
