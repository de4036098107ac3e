"""Logs written in today's (v1) record formats, committed as fixtures (tests/data/v1_logs/, made by
make_v1_logs.py there with the code of the day), open as they did: a collection whose doc store is behind its log
replays the records it lacks, every op kind a collection logs; a shard's log in both upsert forms (b"u" without
router lists, b"l" with), with 3- and 4-field documents and deletes, replays into the fresh tier, tombstones, list
counts and doc store. Writes after them, and a reopening, keep both. Every expectation is read from the fixtures'
expected.json, never regenerated here."""

import json
import shutil
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection import CollectionConfig, Document
from fusionrag.retriever.collection.api import Collection
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.parts import NAMED_IDS, part_name
from fusionrag.retriever.sharded.router import ShardedIndex
from fusionrag.retriever.sharded.writes import DELETE, UPSERT_DOCS, ShardWrites

FIXTURES = Path(__file__).parents[1] / "data" / "v1_logs"
_FRAME = struct.Struct("<IIQ")  # the log's record header as v1 writes it: payload bytes, crc32, lsn


def log_lsns(path: Path) -> list[int]:
    """The lsns of a log's records, read here from the v1 framing (not with the code under test)."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + _FRAME.size <= len(data):
        size, _, lsn = _FRAME.unpack_from(data, pos)
        pos += _FRAME.size + size
        out.append(lsn)
    assert pos == len(data), "the fixture's log is not whole records"
    return out


# -- a collection --------------------------------------------------------------------------------------------------

@pytest.fixture
def col_expected():
    return json.loads((FIXTURES / "collection" / "expected.json").read_text())


def copy_collection(dest: Path) -> Path:
    shutil.copytree(FIXTURES / "collection", dest, ignore=shutil.ignore_patterns("expected.json"))
    return dest


def open_collection(path: Path) -> Collection:
    return Collection(path, config=CollectionConfig(background_merge=False))


def check_collection(col: Collection, docs: dict, gone: list[str]) -> None:
    """docs: id -> (text, metadata, vector): exactly the live documents."""
    assert len(col) == col.count() == len(docs)
    ids = sorted(docs)
    got = col.get(ids + gone, with_vectors=True)
    assert [d.id for d in got] == ids  # none of the gone ids
    for d in got:
        text, meta, vec = docs[d.id]
        assert (d.text, d.metadata) == (text, meta), d.id
        np.testing.assert_array_equal(d.vector, np.asarray(vec, np.float32), err_msg=d.id)
    page, _ = col.scroll(1000)
    assert sorted(d.id for d in page) == ids
    # Filters read the replayed metadata.
    for flt, passes in [({"tag": "a"}, lambda m: m.get("tag") == "a"),
                        ({"i": {"$gte": 10}}, lambda m: isinstance(m.get("i"), int) and m["i"] >= 10)]:
        assert col.count(flt) == sum(passes(m) for _, m, _ in docs.values()), flt
    # Exact search: every live document, in brute-force order, for each of their vectors as the query.
    x = np.stack([np.asarray(docs[i][2], np.float32) for i in ids])
    res = col.search(x, k=len(ids), params=SearchParams(rerank=1000, beta=0))
    d2 = ((x[:, None, :].astype(np.float64) - x[None, :, :]) ** 2).sum(-1)
    for q, hits in enumerate(res.hits):
        assert [h.id for h in hits] == [ids[j] for j in np.argsort(d2[q], kind="stable")], q
        np.testing.assert_allclose([h.distance for h in hits], np.sort(d2[q]), rtol=1e-4, atol=1e-4)
        assert hits[0].text == docs[ids[q]][0]


def test_the_collection_fixture_is_a_doc_store_behind_its_log(col_expected, tmp_path):
    """The state the fixture stands for: the log holds every write from lsn 1, the doc store applied only some."""
    path = copy_collection(tmp_path / "c")
    lsns = log_lsns(path / "wal.log")
    assert lsns == list(range(1, col_expected["last_lsn"] + 1)) and len(lsns) == len(col_expected["ops"])
    assert set(col_expected["ops"]) == {"upsert", "delete", "delete_where", "set_metadata", "merge_metadata", "clear"}
    store = DocStore(path / "docs.sqlite", col_expected["dim"])
    try:
        assert store.meta("applied_lsn") == col_expected["applied_lsn"] < lsns[-1]
    finally:
        store.close()
    assert not (path / "CURRENT").exists()  # no merge: the main index is empty, everything is in the fresh tier


def test_a_v1_collection_log_replays_over_a_doc_store_behind_it(col_expected, tmp_path):
    path = copy_collection(tmp_path / "c")
    docs = {d["id"]: (d["text"], d["metadata"], d["vector"]) for d in col_expected["docs"]}
    gone = col_expected["gone"]
    assert len(docs) == col_expected["count"] and gone and any(t is None for t, _, _ in docs.values())
    col = open_collection(path)
    try:
        check_collection(col, docs, gone)
        assert col.info()["set_aside"]["count"] == 0
        # A write after the replayed ones: logged after them, and the doc store now up to date.
        new = Document("after-v1", "written after the v1 records", np.arange(8, dtype=np.float32) / 7, {"tag": "a"})
        col.upsert([new])
        col.delete([gone[0], sorted(docs)[0]])
        col.set_metadata({sorted(docs)[1]: {"touched": 1}}, merge=True)
    finally:
        col.close()
    first, second = sorted(docs)[:2]
    del docs[first]
    docs[second] = (docs[second][0], {**docs[second][1], "touched": 1}, docs[second][2])
    docs[new.id] = (new.text, new.metadata, new.vector.tolist())
    for _ in range(2):  # and again: a reopening replays nothing twice
        col = open_collection(path)
        try:
            check_collection(col, docs, gone + [first])
        finally:
            col.close()
    assert log_lsns(path / "wal.log")[-1] == col_expected["last_lsn"] + 3


def test_the_collection_fixture_checks_can_fail(col_expected, tmp_path):
    """The checks above see a wrong expectation: one metadata value changed, or a gone document counted live."""
    path = copy_collection(tmp_path / "c")
    docs = {d["id"]: (d["text"], d["metadata"], d["vector"]) for d in col_expected["docs"]}
    col = open_collection(path)
    try:
        some = sorted(docs)[0]
        wrong = dict(docs)
        wrong[some] = (docs[some][0], {**docs[some][1], "i": -1}, docs[some][2])
        with pytest.raises(AssertionError):
            check_collection(col, wrong, [])
        with pytest.raises(AssertionError):
            check_collection(col, docs | {col_expected["gone"][0]: (None, {}, [0.0] * 8)}, [])
    finally:
        col.close()


# -- a shard's log -------------------------------------------------------------------------------------------------

@pytest.fixture
def shard_expected():
    return json.loads((FIXTURES / "shard" / "expected.json").read_text())


def documents_of(w: ShardWrites) -> dict:
    """id -> (name, text, metadata, vector) of the shard's doc store."""
    ids, names = w.named()
    got = w.store.by_rows(ids, True)
    assert sorted(got) == sorted(ids.tolist()) and [got[i][0] for i in ids.tolist()] == names
    return got


def guests_of(path: Path) -> dict:
    con = sqlite3.connect(path)
    try:
        return dict(con.execute("SELECT row, owner FROM text_guests").fetchall())
    finally:
        con.close()


def check_shard_writes(w: ShardWrites, exp: dict, path: Path) -> None:
    fresh = {int(i): v for i, v in exp["fresh"].items()}
    assert sorted(w.fresh_ids().tolist()) == sorted(fresh)
    assert w.tombstoned_ids().tolist() == exp["tombstoned"]
    assert w.deleted == len(exp["tombstoned"])
    assert w.live_ids().tolist() == exp["live_ids"]
    assert w.live(np.array(exp["touched"])).tolist() == [i in exp["live_ids"] for i in exp["touched"]]
    vecs = w.fresh_vectors(np.array(sorted(fresh)))
    assert sorted(vecs) == sorted(fresh)
    for i, v in fresh.items():
        np.testing.assert_array_equal(vecs[i], np.asarray(v, np.float32), err_msg=str(i))
    assert w.fresh_list == {int(i): lst for i, lst in exp["fresh_lists"].items()}
    assert w.list_writes == {int(k): n for k, n in exp["list_writes"].items()}
    docs = {int(i): d for i, d in exp["documents"].items()}
    got = documents_of(w)
    assert sorted(got) == sorted(docs)
    for i, d in docs.items():
        name, text, meta, vec = got[i]
        assert (name, text, meta) == (d["name"], d["text"], d["metadata"]), i
        np.testing.assert_array_equal(vec, np.asarray(fresh[i], np.float32))
    # A 4-field document is counted in BM25's statistics by the shard its fourth field names (texted ones only).
    assert guests_of(path / "docs.sqlite") == {i: d["guest_of"] for i, d in docs.items()
                                               if d["guest_of"] is not None and d["text"] is not None}
    assert w.info()["documents"] == len(docs) and w.info()["fresh"] == len(fresh)


def test_a_v1_shard_log_replays_every_record_form(shard_expected, tmp_path):
    exp = shard_expected
    shutil.copy(FIXTURES / "shard" / "wal.log", tmp_path / "wal.log")
    assert log_lsns(tmp_path / "wal.log") == list(range(1, exp["last_lsn"] + 1))
    assert {"legacy upsert", "listed upsert", "upsert_docs, 3 fields", "upsert_docs, 4 fields", "delete"} <= \
        set(exp["records"])
    base = np.array(exp["base_ids"], np.int64)
    w = ShardWrites(tmp_path, base, exp["dim"], exp["metric"])
    try:
        assert w.last_lsn == w.replayed == exp["last_lsn"]
        check_shard_writes(w, exp, tmp_path)
        # Writes after the v1 records: a document (3 fields), a plain upsert replacing a base id, a delete.
        v = np.full((1, exp["dim"]), 0.25, np.float32)
        w.write(UPSERT_DOCS, [NAMED_IDS + 100], v, [("after", "written after", '{"k":100}')], [9])
        w.write(b"u", [exp["live_ids"][0]], v * 2)
        gone = max(int(i) for i in exp["fresh"] if int(i) < NAMED_IDS and int(i) != exp["live_ids"][0])
        w.write(DELETE, [gone])
        assert w.last_lsn == exp["last_lsn"] + 3
    finally:
        w.close()
    replaced = exp["live_ids"][0]
    exp2 = json.loads(json.dumps(exp))
    exp2["fresh"][str(NAMED_IDS + 100)] = v[0].tolist()
    exp2["fresh_lists"][str(NAMED_IDS + 100)] = 9
    exp2["list_writes"]["9"] = exp2["list_writes"].get("9", 0) + 1
    exp2["documents"][str(NAMED_IDS + 100)] = {"name": "after", "text": "written after", "metadata": {"k": 100},
                                               "guest_of": None}
    for d in (exp2["fresh"], exp2["fresh_lists"], exp2["documents"]):
        d.pop(str(gone), None)
    if replaced in exp["base_ids"]:
        exp2["tombstoned"] = sorted(set(exp["tombstoned"]) | {replaced})
    exp2["fresh"][str(replaced)] = (v[0] * 2).tolist()
    exp2["fresh_lists"][str(replaced)] = -1
    exp2["live_ids"] = sorted((set(exp["live_ids"]) - {gone}) | {NAMED_IDS + 100})
    exp2["touched"] = sorted(set(exp["touched"]) | {NAMED_IDS + 100, replaced})
    w = ShardWrites(tmp_path, base, exp["dim"], exp["metric"])
    try:
        assert w.last_lsn == w.replayed == exp["last_lsn"] + 3
        check_shard_writes(w, exp2, tmp_path)
    finally:
        w.close()


def test_the_shard_fixture_checks_can_fail(shard_expected, tmp_path):
    shutil.copy(FIXTURES / "shard" / "wal.log", tmp_path / "wal.log")
    exp = shard_expected
    w = ShardWrites(tmp_path, np.array(exp["base_ids"], np.int64), exp["dim"], exp["metric"])
    try:
        for key, change in [("tombstoned", lambda e: e["tombstoned"].pop()),
                            ("documents", lambda e: e["documents"][next(iter(e["documents"]))]["metadata"].update(x=1)),
                            ("fresh", lambda e: e["fresh"][next(iter(e["fresh"]))].__setitem__(0, 9.0))]:
            wrong = json.loads(json.dumps(exp))
            change(wrong)
            with pytest.raises(AssertionError):
                check_shard_writes(w, wrong, tmp_path)
    finally:
        w.close()


# -- a shard's log in a built sharded index ----------------------------------------------------------------------

N = 1500
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05)
EXHAUSTIVE = SearchParams(rerank=N, beta=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A 3-shard index whose built ids the shard fixture touches (its base_ids) are one vector repeated, so one
    list, so one shard (no replicas), holds them all: that shard's log may replace and delete them."""
    exp = json.loads((FIXTURES / "shard" / "expected.json").read_text())
    base = clustered(N, exp["dim"], 12, seed=3, spread=0.5)
    base[exp["base_ids"]] = base[exp["base_ids"][0]]
    path = tmp_path_factory.mktemp("v1-shard") / "idx"
    build_sharded(base, path, 3, CONFIG, replicate=0.0, progress=False)
    return path, base


def test_a_v1_shard_log_in_a_built_sharded_index(built, shard_expected, tmp_path):
    exp = shard_expected
    src, base = built
    path = tmp_path / "idx"
    shutil.copytree(src, path)
    index = ShardedIndex.open(path)
    try:
        holders = [s for s, b in enumerate(index.base_ids) if np.isin(exp["base_ids"], b).any()]
        assert len(holders) == 1 and np.isin(exp["base_ids"], index.base_ids[holders[0]]).all()
        assert not any(np.isin(exp["touched"], b).any() for s, b in enumerate(index.base_ids) if s != holders[0])
        assert not list(path.glob("shard-*/wal.log"))
    finally:
        index.close()
    s = holders[0]
    shutil.copy(FIXTURES / "shard" / "wal.log", path / part_name(s) / "wal.log")
    fresh = {int(i): np.asarray(v, np.float32) for i, v in exp["fresh"].items()}
    docs = {int(i): d for i, d in exp["documents"].items()}
    tomb = exp["tombstoned"]

    def check(coll: ShardedCollection, fresh: dict, docs: dict, dead: list[int]) -> None:
        ix = coll.index
        assert ix.live_count() == N - len(tomb) + len(fresh)
        assert {i for i, o in ix.fresh_owner.items()} == set(fresh)
        assert ix.base_gone == set(tomb)
        assert ix.named == {d["name"]: i for i, d in docs.items()}
        got = coll.get([d["name"] for d in docs.values()], with_vectors=True)
        assert [g.id for g in got] == [d["name"] for d in docs.values()]
        for g, (i, d) in zip(got, docs.items()):
            assert (g.text, g.metadata) == (d["text"], d["metadata"])
            np.testing.assert_array_equal(g.vector, fresh[i])
        plain = sorted(i for i in fresh if i < NAMED_IDS)
        got = ix.documents(np.array(plain), True)
        assert sorted(got) == plain
        for i in plain:
            np.testing.assert_array_equal(got[i][3], fresh[i])
        # Each fresh vector finds itself first; no dead id is ever found.
        ids = sorted(fresh)
        res = ix.search(np.stack([fresh[i] for i in ids]), 1, EXHAUSTIVE)
        assert res.ids[:, 0].tolist() == ids
        res = ix.search(np.concatenate([base[tomb], base[:5]]), 20, EXHAUSTIVE)
        assert not np.isin(res.ids, dead).any()

    dead = tomb + [i for i in exp["touched"] if i not in fresh and i not in exp["base_ids"]]
    coll = ShardedCollection(ShardedIndex.open(path), "docs")
    try:
        assert coll.index.fresh_count[s] == len(fresh) and coll.index.fresh_count.sum() == len(fresh)
        check(coll, fresh, docs, dead)
        # Writes after the replayed log, through the router: a new document, one replaced, a fresh id deleted.
        v = base[100] + 0.01
        coll.upsert([Document("after", "written after", v, {"k": 1})])
        first = docs[min(docs)]
        coll.upsert([Document(first["name"], "replaced text", v + 1, {"k": 2})])
        gone = min(i for i in fresh if i < NAMED_IDS)
        assert coll.index.delete([gone]) == 1
    finally:
        coll.close()
    coll = ShardedCollection(ShardedIndex.open(path), "docs")
    try:
        ix = coll.index
        after = ix.named["after"]
        fresh2 = dict(fresh)
        fresh2.pop(gone)
        fresh2[after] = v
        fresh2[min(docs)] = (v + 1).astype(np.float32)
        docs2 = dict(docs)
        docs2[min(docs)] = {**first, "text": "replaced text", "metadata": {"k": 2}}
        docs2[after] = {"name": "after", "text": "written after", "metadata": {"k": 1}}
        check(coll, fresh2, docs2, dead + [gone])
    finally:
        coll.close()
