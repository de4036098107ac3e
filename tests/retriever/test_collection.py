"""Collections: the write path (log, doc store, fresh tier), search over main + fresh, merge."""

import os
import threading

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.errors import ConflictError, InputError, NotFoundError

DIM = 16


def docs_of(vectors, start=0, prefix="d"):
    return [Document(f"{prefix}{start + i}", f"text {start + i}", v, {"n": start + i, "even": (start + i) % 2 == 0})
            for i, v in enumerate(vectors)]


@pytest.fixture
def catalog(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=200, background_merge=False))
    yield cat
    cat.close()


def test_catalog_create_get_drop(tmp_path, catalog):
    col = catalog.create("docs-1", DIM, "l2", embedding="m")
    assert catalog.names() == ["docs-1"] and catalog.get("docs-1") is col
    with pytest.raises(ConflictError):
        catalog.create("docs-1", DIM)
    for bad in ("", "-x", "a/b", "x" * 65, None, "demo\n", "..", "a b"):
        with pytest.raises(InputError):
            catalog.create(bad, DIM)
    with pytest.raises(InputError, match="metric"):
        catalog.create("m", DIM, "hamming")
    with pytest.raises(NotFoundError):
        catalog.get("nope")
    catalog.drop("docs-1")
    assert catalog.names() == [] and not (tmp_path / "collections" / "docs-1").exists()
    with pytest.raises(NotFoundError):
        catalog.drop("docs-1")
    info = catalog.create("c", DIM, "cosine", None).info()
    assert info["name"] == "c" and info["dimension"] == DIM and info["count"] == 0


def test_add_search_upsert_delete_get(catalog):
    col = catalog.create("c", DIM, "l2")
    x = clustered(300, DIM, 10, seed=1)
    ids = col.add(docs_of(x))
    assert ids == [f"d{i}" for i in range(300)] and len(col) == 300
    res = col.search(x[:5], k=3)
    assert [h[0].id for h in res.hits] == ids[:5]
    assert res.hits[0][0].distance == pytest.approx(0, abs=1e-4) and res.hits[0][0].score == -res.hits[0][0].distance
    assert res.hits[0][0].text == "text 0" and res.hits[0][0].metadata == {"n": 0, "even": True}
    assert res.stats[0]["fresh_candidates"] == 300 and res.stats[0]["filtered_exact"] is False
    # upsert replaces text, metadata and vector
    far = x[0] + 100
    assert col.upsert([Document("d0", "new", far, {"v": 2})]) == ["d0"]
    assert len(col) == 300
    assert col.search(x[:1], k=1).hits[0][0].id != "d0"
    top = col.search(far[None], k=1).hits[0][0]
    assert (top.id, top.text, top.metadata) == ("d0", "new", {"v": 2})
    # get: order asked, missing skipped, vectors on request
    got = col.get(["d2", "zz", "d0"], with_vectors=True)
    assert [d.id for d in got] == ["d2", "d0"] and np.allclose(got[1].vector, far) and got[0].text == "text 2"
    assert col.get(["d1"])[0].vector is None
    # delete removes from get and from results
    assert col.delete(["d1", "d2", "nope"]) == 2
    assert col.get(["d1", "d2"]) == [] and len(col) == 298
    hits = col.search(x[1:3], k=5).hits
    assert all(h.id not in ("d1", "d2") for q in hits for h in q) and all(len(q) == 5 for q in hits)
    # new ids are assigned when missing
    new = col.add([Document(None, "t", x[5])])
    assert len(new[0]) == 32 and col.get(new)[0].text == "t"
    col.clear()
    assert len(col) == 0 and col.search(x[:1], k=3).hits == [[]]


def test_metrics_scores(catalog):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, DIM)).astype(np.float32)
    q = rng.standard_normal((1, DIM)).astype(np.float32)
    for metric in ("cosine", "ip", "l2"):
        col = catalog.create(metric, DIM, metric)
        col.add(docs_of(x))
        hit = col.search(q, k=1).hits[0][0]
        v = x[int(hit.id[1:])]
        cos = float(q[0] @ v / np.linalg.norm(q) / np.linalg.norm(v))
        expect = {"cosine": (1 - cos, cos), "ip": (-float(q[0] @ v), float(q[0] @ v)),
                  "l2": (float(((q[0] - v) ** 2).sum()), -float(((q[0] - v) ** 2).sum()))}[metric]
        assert (hit.distance, hit.score) == pytest.approx(expect, rel=1e-4, abs=1e-4)
        assert hit.id == f"d{exact_knn(x, q, 1, metric)[0, 0]}"


def test_bad_input_is_refused_and_changes_nothing(catalog):
    col = catalog.create("c", DIM, "cosine")
    col.add(docs_of(np.ones((3, DIM), np.float32)))
    bad = [
        [Document("a", None, np.ones(DIM + 1))],
        [Document("a", None, None)],
        [Document("a", None, np.full(DIM, np.nan))],
        [Document("a", None, np.zeros(DIM))],
        [Document("", None, np.ones(DIM))],
        [Document("x" * 513, None, np.ones(DIM))],
        [Document("a", None, np.ones(DIM), {"k": object()})],
        [Document("a", None, np.ones(DIM), {"k": float("nan")})],
        [Document("ok", None, np.ones(DIM)), "not a document"],
    ]
    for docs in bad:
        with pytest.raises(InputError):
            col.upsert(docs)
    assert len(col) == 3 and col.get(["a", "ok"]) == []
    for q, k in [(np.ones((1, DIM + 1)), 1), (np.full((1, DIM), np.inf), 1), (np.ones((1, DIM)), 0),
                 (np.ones((0, DIM)), 1)]:
        with pytest.raises(InputError):
            col.search(q, k)
    with pytest.raises(InputError, match="operator"):
        col.search(np.ones((1, DIM)), 1, filter={"n": {"$near": 1}})


def test_reopen_replays_the_log(tmp_path):
    cfg = CollectionConfig(min_index_count=200, background_merge=False)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("c", DIM, "l2")
    x = clustered(100, DIM, 5, seed=2)
    col.add(docs_of(x))
    col.delete(["d3"])
    col.upsert([Document("d4", "four", x[4] * 2)])
    expect = col.search(x[:10], k=5)
    cat.close()
    # Without its doc store the collection is rebuilt from the log alone.
    for f in (tmp_path / "collections" / "c").glob("docs.sqlite*"):
        f.unlink()
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.get("c")
    assert len(col) == 99 and col.get(["d3"]) == [] and col.get(["d4"])[0].text == "four"
    got = col.search(x[:10], k=5)
    assert [[h.id for h in q] for q in got.hits] == [[h.id for h in q] for q in expect.hits]
    cat.close()


def test_wal_torn_tail_is_dropped(tmp_path):
    wal = WriteAheadLog(tmp_path / "wal.log")
    assert wal.open() == []
    ends = []
    for lsn in range(1, 6):
        wal.append(lsn, bytes([lsn]) * (10 * lsn))
        ends.append(wal.end)
    wal.sync(5, lambda: 5)
    wal.close()
    full = (tmp_path / "wal.log").read_bytes()
    for cut in (ends[3] + 5, ends[3] + 17, ends[4] - 1):  # torn inside the header, inside the payload
        (tmp_path / "wal.log").write_bytes(full[:cut])
        wal = WriteAheadLog(tmp_path / "wal.log")
        assert [lsn for lsn, _ in wal.open()] == [1, 2, 3, 4]
        assert (tmp_path / "wal.log").stat().st_size == ends[3]
        wal.append(9, b"after")
        wal.close()
        assert [lsn for lsn, _ in WriteAheadLog(tmp_path / "wal.log").open()] == [1, 2, 3, 4, 9]
    # a flipped bit in the last record fails its checksum
    bad = bytearray(full)
    bad[-3] ^= 1
    (tmp_path / "wal.log").write_bytes(bytes(bad))
    assert [lsn for lsn, p in WriteAheadLog(tmp_path / "wal.log").open()] == [1, 2, 3, 4]


def test_wal_rewrite_keeps_the_records_asked_and_appends_after_them(tmp_path):
    wal = WriteAheadLog(tmp_path / "wal.log")
    wal.open()
    for lsn in range(1, 8):
        wal.append(lsn, bytes([lsn]) * 100)
    wal.sync(7, lambda: 7)
    size = wal.end
    assert wal.rewrite(lambda lsn: lsn > 4) == size - 3 * (size // 7)
    wal.append(8, b"after")  # at the new end, through the reopened file
    wal.sync(8, lambda: 8)
    wal.close()
    assert [(lsn, p[:1]) for lsn, p in WriteAheadLog(tmp_path / "wal.log").open()] == \
        [(5, b"\x05"), (6, b"\x06"), (7, b"\x07"), (8, b"a")]
    assert not (tmp_path / "wal.log.rewrite").exists()


def test_merge_keeps_results_and_tombstones(catalog):
    col = catalog.create("c", DIM, "l2")
    x = clustered(2000, DIM, 40, seed=3)
    q = clustered(50, DIM, 40, seed=4)
    col.add(docs_of(x[:1500]))
    col.merge()
    info = col.info()["build_state"]
    assert info == {"indexed": 1500, "fresh": 0, "deleted": 0, "merging": False, "generation": 1, "unsearchable": 0,
                    "progress": None, "import": None}
    assert not (col.path / "gen-000000").exists() and os.path.getsize(col.path / "wal.log") == 0
    col.add(docs_of(x[1500:], 1500))  # these live in the fresh tier beside the main index
    before = col.search(q, k=10)
    truth = exact_knn(x, q, 10)
    ids_of = lambda res: np.array([[int(h.id[1:]) for h in hits] for hits in res.hits])  # noqa: E731
    assert recall(ids_of(before), truth) >= 0.95
    col.merge()
    assert col.info()["build_state"]["indexed"] == 2000 and col.info()["build_state"]["generation"] == 2
    after = col.search(q, k=10)
    assert recall(ids_of(after), truth) >= 0.95
    assert recall(ids_of(after), ids_of(before)) >= 0.95
    # tombstones in the main index: the top results deleted, k results still come back, none deleted
    gone = {h.id for hits in after.hits for h in hits[:5]}
    col.delete(sorted(gone))
    res = col.search(q, k=10)
    assert all(len(h) == 10 and not gone & {x.id for x in h} for h in res.hits)
    alive = np.setdiff1d(np.arange(2000), [int(g[1:]) for g in gone])
    truth = alive[exact_knn(x[alive], q, 10)]
    assert recall(ids_of(res), truth) >= 0.95
    assert col.info()["build_state"]["deleted"] == len(gone)
    # replacing an indexed document: the old version is a tombstone, the new one is fresh
    col.upsert([Document("d1999", "moved", x[0] + 50)])
    assert col.search(x[1999:2000], k=1).hits[0][0].id != "d1999"
    assert col.search(x[:1] + 50, k=1).hits[0][0].text == "moved"


def test_concurrent_writes_share_fsyncs_and_searches_run_during_merge(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=200, merge_fresh_count=400))
    col = cat.create("c", DIM, "l2")
    x = clustered(2800, DIM, 30, seed=5)
    col.add(docs_of(x[:400]))
    col.merge()
    probe = np.arange(0, 400, 25)
    errors = []

    def writer(t):
        try:
            for i in range(400 + t * 300, 400 + (t + 1) * 300, 10):
                col.add(docs_of(x[i:i + 10], i))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def searcher():
        # Merges publish meanwhile: every search sees the old state or the new one, never a mix
        # (a document missing, or found twice, in main and fresh at once).
        try:
            for _ in range(60):
                res = col.search(x[probe], k=3)
                assert [h[0].id for h in res.hits] == [f"d{i}" for i in probe]
                assert all(len({h.id for h in hits}) == 3 for hits in res.hits)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)] + [
        threading.Thread(target=searcher) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert col._local.wal.fsyncs < 241  # 241 acknowledged writes: group commit made some share an fsync
    col.merge()
    assert len(col) == 2800 and col.info()["build_state"]["generation"] >= 3
    res = col.search(x[::100], k=1)
    assert [h[0].id for h in res.hits] == [f"d{i}" for i in range(0, 2800, 100)]
    cat.close()


def test_tombstones_mark_each_vector_once_and_exclude_what_a_filter_does_not_pass():
    """The one tombstone bitmap of a collection and of a shard (collection/tombstones.py): marking counts only bits
    newly set (ids given twice, or already dead, count once), ids not in the index are ignored, and a filtered
    search's exclusion is every vector the filter did not pass or that is dead, checked bit by bit here."""
    from fusionrag.retriever.collection import tombstones

    ids = np.array([3, 5, 8, 13, 21, 34, 55, 89, 144], np.int64)  # an index's vector ids (rows), ascending
    tomb = tombstones.empty(len(ids))
    assert tombstones.mark(tomb, tombstones.positions(ids, [5, 5, 13, 1000, -1])) == 2
    assert tombstones.mark(tomb, tombstones.positions(ids, [13, 144])) == 1
    assert tombstones.dead(tomb, len(ids)).tolist() == [i in (5, 13, 144) for i in ids]
    assert tombstones.dead_at(tomb, np.array([1, 2, 8])).tolist() == [True, False, True]
    ok = tombstones.passing(ids, np.array([3, 5, 21, 144, 200]), tomb)
    assert ok.tolist() == [i in (3, 21) for i in ids]
    excluded = np.unpackbits(tombstones.exclusion(ok), count=len(ids), bitorder="little").astype(bool)
    assert excluded.tolist() == [i not in (3, 21) for i in ids]
