"""#66 finding 1: no write may poison a collection. Values a store cannot hold (integers outside int64, strings that
are not valid Unicode) are refused before they reach the log, naming the field, by every way in (upsert, metadata
updates, imports, filters, text queries, ids); and a log entry that cannot be applied anyway (planted on disk, or
past a check) is set aside with its reason: the writes after it apply, the collection opens and serves, and its
info reports the entry."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import clustered, exact_knn

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection.records import StoreRecord
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.errors import InputError

DIM = 8
BIG = 10 ** 400

# (metadata, the field the error names)
BAD_METADATA = [
    ({"n": BIG}, "'n'"),
    ({"n": 1 << 70}, "'n'"),
    ({"n": -(1 << 63) - 1}, "'n'"),
    ({"l": [1, 2, BIG]}, "'l[2]'"),
    ({"o": {"p": {"q": BIG}}}, "'o.p.q'"),
    ({"l": [{"z": "\ud800"}]}, "'l[0].z'"),
    ({"s": "ok \udfff"}, "'s'"),
    ({"\ud800": 1}, "key holding a lone surrogate"),
    ({"o": {"\udc00k": "v"}}, "key holding a lone surrogate"),
]


def _docs(x, prefix="d"):
    return [Document(f"{prefix}{i}", f"text {i}", v, {"i": i}) for i, v in enumerate(x)]


@pytest.fixture
def col(tmp_path):
    cat = Catalog(tmp_path)
    c = cat.create("c", DIM, "l2")
    c.upsert(_docs(clustered(20, DIM, 2)))
    yield c
    cat.close()


@pytest.mark.parametrize("meta,field", BAD_METADATA)
def test_metadata_a_store_cannot_hold_is_refused_naming_the_field(tmp_path, meta, field):
    cat = Catalog(tmp_path)
    c = cat.create("c", DIM, "l2")
    c.upsert(_docs(clustered(20, DIM, 2)))
    with pytest.raises(InputError, match="document 'bad': metadata field") as e:
        c.upsert([Document("ok", None, np.ones(DIM)), Document("bad", None, np.ones(DIM), meta)])
    assert field in str(e.value)
    with pytest.raises(InputError, match="document 'd1': metadata field"):
        c.set_metadata({"d0": {"fine": 1}, "d1": meta})
    with pytest.raises(InputError, match="document 'd1': metadata field"):
        c.set_metadata({"d1": meta}, merge=False)
    # Nothing of the refused writes was logged: the next write and a reopen both work.
    c.upsert([Document("after", None, np.ones(DIM), {"fine": True})])
    assert len(c) == 21 and c.get(["ok", "bad"]) == [] and c.get(["d0"])[0].metadata == {"i": 0}
    cat.close()
    cat = Catalog(tmp_path)
    assert cat.failed() == {} and len(cat.get("c")) == 21
    assert cat.get("c").info()["set_aside"]["count"] == 0
    cat.close()


def test_texts_and_ids_that_are_not_valid_unicode_are_refused(col):
    with pytest.raises(InputError, match=r"document 'x': text holds a lone surrogate \(U\+D800 at character 3\)"):
        col.upsert([Document("x", "abc\ud800", np.ones(DIM))])
    with pytest.raises(InputError, match="document 0: id"):
        col.upsert([Document("\udfffid", None, np.ones(DIM))])
    with pytest.raises(InputError, match="lone surrogate"):
        col.set_metadata({"\ud800": {"a": 1}})
    with pytest.raises(InputError, match="lone surrogate"):
        col.delete(["d0", "\ud800"])
    with pytest.raises(InputError, match="lone surrogate"):
        col.get(["\ud800"])
    with pytest.raises(InputError, match=r"texts\[1\] holds a lone surrogate"):
        col.search(texts=["fine", "bad \ud800"], mode="text")
    with pytest.raises(InputError, match=r"texts\[0\] holds a lone surrogate"):
        col.search(np.ones((1, DIM)), texts=["\udc00"], mode="hybrid")
    assert len(col) == 20 and col.get(["d0"])[0].id == "d0"


@pytest.mark.parametrize("flt,what", [
    ({"i": BIG}, "integer of 401 digits"),
    ({"i": {"$gt": (1 << 70) - 1}}, "integer of 22 digits"),
    ({"i": {"$in": [1, -(1 << 64)]}}, "integer of 20 digits"),
    ({"tags": {"$contains": BIG}}, "integer of 401 digits"),
    ({"s": "\ud800"}, "lone surrogate"),
    ({"\ud800": 1}, "filter field holds a lone surrogate"),
    ({"$or": [{"i": 1}, {"i": {"$lt": BIG}}]}, "integer of 401 digits"),
])
def test_filters_a_store_cannot_compare_are_refused(col, flt, what):
    calls = [lambda: col.count(flt), lambda: col.search(np.ones((1, DIM)), k=3, filter=flt),
             lambda: col.scroll(10, filter=flt), lambda: col.delete_where(flt),
             lambda: col.search(texts=["text"], mode="text", filter=flt)]
    for call in calls:
        with pytest.raises(InputError, match=what):
            call()
    assert len(col) == 20


def test_the_edges_of_what_a_store_holds_are_kept_exactly(col):
    """int64's ends stored and compared exactly; valid non-BMP text (an escaped surrogate pair in JSON), long runs of
    digits in strings and large floats pass."""
    lo, hi = -(1 << 63), (1 << 63) - 1
    col.upsert([Document("hi", "emoji \U0001F600", np.ones(DIM), {"n": hi, "s": "1234567890123456789012", "f": 1e300}),
                Document("lo", None, np.ones(DIM), {"n": lo, "e": "\U0001F600", "l": [hi, lo]})])
    assert col.get(["hi"])[0].metadata == {"n": hi, "s": "1234567890123456789012", "f": 1e300}
    assert col.get(["hi"])[0].text == "emoji \U0001F600"
    assert [d.id for d in col.scroll(10, filter={"n": {"$gt": hi - 1}})[0]] == ["hi"]
    assert [d.id for d in col.scroll(10, filter={"n": {"$lt": lo + 1}})[0]] == ["lo"]
    assert col.count({"l": {"$contains": lo}}) == 1 and col.count({"e": "\U0001F600"}) == 1


def _plant(path, write: StoreRecord, dim: int) -> int:
    """Append a write to a closed collection's log as the collection would have logged it, past every check."""
    wal = WriteAheadLog(path / "wal.log")
    records = wal.open()
    from fusionrag.retriever.collection.docstore import DocStore

    store = DocStore(path / "docs.sqlite", dim)
    last = max([store.meta("applied_lsn")] + [lsn for lsn, _ in records])
    logged = [StoreRecord.decode(n, p, dim, "collection").keys for n, p in records]
    row = max([store.meta("next_row")] + [int(k.max(initial=-1)) + 1 for k in logged if k is not None])
    if write.op == "upsert":
        write.keys = np.arange(row, row + len(write.ids), dtype=np.int64)
    store.close()
    lsn = last + 1
    wal.append(lsn, write.payload())
    wal.sync(lsn, lambda: lsn)
    wal.close()
    return lsn


def test_a_log_entry_that_cannot_be_applied_is_set_aside_and_the_collection_serves(tmp_path):
    """Planted on disk: an upsert whose text SQLite cannot encode, a metadata integer past int64 and past float,
    and a delete_where whose logged filter no longer compiles, between good writes. The collection opens (it
    failed to for good before: 503 to everything), holds every acknowledged document and the good write after the
    bad ones, reports the entries with their reasons, and a second reopen does not replay them."""
    cfg = CollectionConfig(min_index_count=50, background_merge=False)
    cat = Catalog(tmp_path, collection_config=cfg)
    c = cat.create("c", DIM, "l2")
    x = clustered(200, DIM, 4)
    c.upsert(_docs(x))
    c.merge()  # the acknowledged documents in an index, not only the fresh tier
    assert c.info()["build_state"]["generation"] == 1
    cat.close()
    path = tmp_path / "collections" / "c"
    bad = [StoreRecord("upsert", ["p1"], ["bad \ud800"], ["{}"], np.ones((1, DIM), np.float32)),
           StoreRecord("upsert", ["p2"], [None], [json.dumps({"n": BIG})], np.ones((1, DIM), np.float32)),
           StoreRecord("delete_where", filter=json.dumps({"i": {"$bogus": 1}}))]
    lsns = [_plant(path, w, DIM) for w in bad]
    good = _docs(clustered(5, DIM, 1, seed=7), "g")
    from fusionrag.retriever.collection.records import upsert_record

    w, _ = upsert_record(good, DIM, "l2")
    lsns.append(_plant(path, w, DIM))

    cat = Catalog(tmp_path, collection_config=cfg)
    assert cat.failed() == {}
    c = cat.get("c")
    aside = c.info()["set_aside"]
    assert aside["count"] == 3 and [e["lsn"] for e in aside["last"]] == lsns[2::-1]
    reasons = {e["lsn"]: e["reason"] for e in aside["last"]}
    assert "lone surrogate" in reasons[lsns[0]] and "outside the signed 64-bit range" in reasons[lsns[1]] \
        and "$bogus" in reasons[lsns[2]]
    assert aside["last"][2]["ids"] == ["p1"] and aside["last"][2]["op"] == "upsert"
    assert len(c) == 205 and c.get(["p1", "p2"]) == [] and len(c.get([d.id for d in good])) == 5
    # Searches over the index and the fresh tier answer as exact search over the acknowledged documents does.
    allv = np.concatenate([x, np.stack([d.vector for d in good])]).astype(np.float32)
    names = [f"d{i}" for i in range(200)] + [d.id for d in good]
    q = allv[::23] + 0.01
    truth = exact_knn(allv, q, 5)
    hits = c.search(q, k=5, params={"nprobe": 1000, "rerank": 1000}).hits
    assert [[h.id for h in row] for row in hits] == [[names[j] for j in t] for t in truth]
    c.upsert([Document("later", None, np.ones(DIM))])  # writes go on
    c.merge()
    assert len(c) == 206 and c.info()["set_aside"]["count"] == 3
    cat.close()
    cat = Catalog(tmp_path, collection_config=cfg)  # reopened: nothing replayed twice, nothing lost
    c = cat.get("c")
    assert cat.failed() == {} and len(c) == 206 and c.info()["set_aside"]["count"] == 3
    cat.close()


def test_a_write_that_cannot_be_applied_fails_alone_and_the_next_ones_apply(col):
    """A write past the checks (as a bug in them would let through) that SQLite refuses: its writer gets InputError
    (the service's 422) saying it was set aside; the collection keeps taking writes (every later write answered
    500 before, and the collection failed to open after a restart)."""
    poisoned = StoreRecord("upsert", ["p"], ["\ud800"], ["{}"], np.ones((1, DIM), np.float32))
    with pytest.raises(InputError, match="set aside"):
        col._commit(poisoned)
    col.upsert([Document("next", "fine", np.ones(DIM))])
    col.set_metadata({"next": {"a": 1}})
    assert len(col) == 21 and col.get(["next"])[0].metadata == {"a": 1} and col.get(["p"]) == []
    assert col.search(np.ones((1, DIM)), k=1).hits[0][0].id == "next"
    info = col.info()["set_aside"]
    assert info["count"] == 1 and info["last"][0]["ids"] == ["p"]


def test_an_import_line_a_store_cannot_hold_is_refused_naming_the_line(tmp_path):
    from fusionrag.retriever.collection import importer

    cat = Catalog(tmp_path / "data")
    c = cat.create("c", DIM, "l2")
    for line, what in [({"id": "a", "vector": [1.0] * DIM, "metadata": {"n": BIG}}, "documents line 2: metadata field 'n'"),
                       ({"id": "a", "vector": [1.0] * DIM, "text": "\ud800"}, "documents line 2: text holds a lone"),
                       ({"id": "\ud800", "vector": [1.0] * DIM}, "documents line 2: id")]:
        f = tmp_path / "docs.jsonl"
        f.write_text(json.dumps({"id": "ok", "vector": [0.5] * DIM}) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(InputError, match=what.replace("(", r"\(")):
            with c._merge_lock:
                importer.import_files(c, f, None, False)
    assert len(c) == 0
    cat.close()
