"""Makes the v1 write-ahead log fixtures beside this script (collection/ and shard/), with the code of the day they
were made: the log record formats from before the v2 record format (retriever/collection/records.py's JSON-headed
Write payload for a collection; retriever/sharded/writes.py's b"u"/b"l"/b"U"/b"d" records for a shard). It runs
only on that code (main at 0669d84, before the one store record of #69; it imports what that code had), by hand:

    git worktree add /tmp/v1 0669d84 && pip install --no-deps --target /tmp/v1-site /tmp/v1
    PYTHONPATH=/tmp/v1-site:<site-packages> python -S tests/data/v1_logs/make_v1_logs.py

tests/retriever/test_v1_logs.py reads the committed files and never runs this (it is no test module: pytest does
not collect it). Everything is a pure function of the seeds below; expected.json records what a correct open shows.

collection/: a collection directory (dim 8, l2, no merge ever: background_merge=False, so no CURRENT/gen-*) whose
wal.log holds every op a collection logs (upsert with texts and metadata, some without text; delete; delete_where;
set_metadata; merge_metadata; clear, early, with writes after it), and whose docs.sqlite is BEHIND the log: it is
the doc store as it stood, closed, after the first writes (applied_lsn SNAP_AFTER), put back beside the newer log,
as a crash can leave it (the doc store's commits are not fsynced; the log is what makes writes durable). Opening it
must replay the log's records after applied_lsn.

shard/: one shard part's wal.log alone (the collection's log framing, WriteAheadLog, with sharded/writes.py's
records): an upsert in the legacy b"u" form (no router lists; written by hand, as decode reads it), upserts in the
listed b"l" form (encode(UPSERT, ..., lists=...)), UPSERT_DOCS with 3-field and with 4-field documents, deletes.
Ids: base ids (replaced or deleted: tombstones) are in BASE_IDS, fresh vector ids from FRESH0, documents' ids from
NAMED_IDS (2**62) as ShardedCollection numbers named documents.
"""

import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
COL_DIM, SHARD_DIM = 8, 16
SNAP_AFTER = 5  # the doc store is put back as it was after this many collection writes
BASE_IDS = list(range(12))  # the shard fixture's base ids: the test builds an index whose one shard holds them all
FRESH0 = 1_000_000


def vec(seed, dim, *key):
    return np.random.default_rng([seed, *key]).standard_normal(dim).astype(np.float32)


# -- the collection ------------------------------------------------------------------------------------------------
def collection_writes():
    """The writes, in order: (op, args). Each a pure function of its position."""
    from fusionrag.retriever.collection import Document

    def doc(i, text=True, meta=None):
        return Document(f"d{i}", f"text of d{i} \u00e9" if text else None, vec(1, COL_DIM, i),
                        meta if meta is not None else {"i": i, "tag": "ab"[i % 2], "nested": {"x": i}})

    return [
        ("upsert", [[doc(0), doc(1), doc(2, text=False), doc(3)]]),
        ("clear", []),  # clear early: everything before it is gone
        ("upsert", [[doc(4), doc(5, text=False, meta={}), doc(6), doc(7), doc(8), doc(9)]]),
        ("delete", [["d5", "no-such-id"]]),
        ("set_metadata", [{"d4": {"replaced": True}}, False]),
        # -- the doc store is snapshotted here (SNAP_AFTER writes applied); the rest only the log holds --
        ("upsert", [[doc(10), doc(11, text=False), doc(4, meta={"i": 40, "tag": "b", "nested": {"x": 1, "y": 2}})]]),
        ("merge_metadata", [{"d6": {"tag": None, "nested": {"y": 6}, "new": [1, 2]}, "d11": {"k": "v"}}, True]),
        ("delete_where", [{"tag": "b"}]),
        ("delete", [["d8"]]),
        ("upsert", [[doc(12), doc(13, text=False), doc(7, meta={"i": 70, "tag": "a"})]]),
        ("set_metadata", [{"d12": {"only": "this"}}, False]),
    ]


def apply_write(col, op, args):
    if op == "upsert":
        col.upsert(*args)
    elif op == "clear":
        col.clear()
    elif op == "delete":
        col.delete(*args)
    elif op == "delete_where":
        col.delete_where(*args)
    elif op in ("set_metadata", "merge_metadata"):
        col.set_metadata(args[0], merge=args[1])


def make_collection(out: Path) -> None:
    from fusionrag.retriever.collection import Catalog, CollectionConfig
    from fusionrag.retriever.collection.docstore import DocStore

    cfg = CollectionConfig(background_merge=False)
    writes = collection_writes()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cat = Catalog(root, collection_config=cfg)
        col = cat.create("c", COL_DIM, "l2")
        path = col.path
        for op, args in writes[:SNAP_AFTER]:
            apply_write(col, op, args)
        cat.close()
        snap = root / "snap"
        snap.mkdir()
        stores = [p for p in path.iterdir() if p.name.startswith("docs.sqlite")]
        for p in stores:
            shutil.copy2(p, snap / p.name)
        cat = Catalog(root, collection_config=cfg)
        col = cat.get("c")
        for op, args in writes[SNAP_AFTER:]:
            apply_write(col, op, args)
        ids = sorted(d.id for d in col.scroll(1000)[0])
        docs = col.get(ids, with_vectors=True)
        expected = {
            "dim": COL_DIM, "metric": "l2", "count": len(col),
            "docs": [{"id": d.id, "text": d.text, "metadata": d.metadata, "vector": d.vector.tolist()} for d in docs],
            "gone": sorted({f"d{i}" for i in range(14)} - set(ids)),
        }
        cat.close()
        # The older doc store back beside the newer log.
        for p in path.iterdir():
            if p.name.startswith("docs.sqlite"):
                p.unlink()
        for p in snap.iterdir():
            shutil.copy2(p, path / p.name)
        store = DocStore(path / "docs.sqlite", COL_DIM)
        applied = store.meta("applied_lsn")
        store.close()
        from fusionrag.retriever.collection.wal import WriteAheadLog
        wal = WriteAheadLog(path / "wal.log")  # whole records, read as the collection reads them
        records = wal.open()
        wal.close()
        assert applied == SNAP_AFTER and records[0][0] == 1 and records[-1][0] == len(writes), (applied, records[-1][0])
        expected.update(applied_lsn=applied, last_lsn=records[-1][0], ops=[op for op, _ in writes])
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for p in sorted(path.iterdir()):
            if p.is_file() and p.name != "LOCK":
                shutil.copy2(p, out / p.name)
            elif p.is_dir():
                raise AssertionError(f"unexpected directory in the collection: {p}")
        (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


# -- the shard -----------------------------------------------------------------------------------------------------
def legacy_upsert(ids, vectors) -> bytes:
    """The b"u" record: _HEAD ("<cII": op, count, dim), ids int64, vectors float32, no lists."""
    ids = np.asarray(ids, "<i8")
    vectors = np.ascontiguousarray(vectors, "<f4")
    return struct.pack("<cII", b"u", len(ids), vectors.shape[1]) + ids.tobytes() + vectors.tobytes()


def shard_records():
    """(description, payload, (op, ids, vectors, docs, lists)) in log order."""
    from fusionrag.retriever.sharded.parts import NAMED_IDS
    from fusionrag.retriever.sharded.writes import DELETE, UPSERT, UPSERT_DOCS, encode

    def vs(*keys):
        return np.stack([vec(2, SHARD_DIM, k) for k in keys])

    F, N = FRESH0, NAMED_IDS
    out = []
    ids = [F + 0, F + 1, F + 2, F + 3, F + 4, 0, 1]  # two base ids replaced
    out.append(("legacy upsert", legacy_upsert(ids, vs(*range(7))), ("upsert", ids, vs(*range(7)), None, [-1] * 7)))
    ids, lists = [F + 5, F + 6, F + 7, 2, F + 1], [3, 3, 5, -1, 7]
    out.append(("listed upsert", encode(UPSERT, np.array(ids), vs(*range(10, 15)), lists=np.array(lists)),
                ("upsert", ids, vs(*range(10, 15)), None, lists)))
    docs3 = [["alpha", "the first text", '{"k":1,"tag":"a"}'], ["beta", None, '{}'],
             ["gamma", "caf\u00e9 au lait", '{"k":3,"nested":{"x":[1,2]}}']]
    ids = [N + 0, N + 1, N + 2]
    out.append(("upsert_docs, 3 fields", encode(UPSERT_DOCS, np.array(ids), vs(20, 21, 22), docs3, np.array([1, 2, 2])),
                ("upsert_docs", ids, vs(20, 21, 22), docs3, [1, 2, 2])))
    docs4 = [["delta", "a guest text", '{"k":4}', 1], ["alpha", "alpha again", '{"k":10}', 2],
             ["epsilon", "own text", '{"k":5}']]
    ids = [N + 3, N + 0, N + 4]
    out.append(("upsert_docs, 4 fields", encode(UPSERT_DOCS, np.array(ids), vs(23, 24, 25), docs4, np.array([4, 4, 6])),
                ("upsert_docs", ids, vs(23, 24, 25), docs4, [4, 4, 6])))
    ids = [F + 1, 3, N + 1, F + 99]  # a fresh id, a base id, a document, an unknown id
    out.append(("delete", encode(DELETE, np.array(ids)), ("delete", ids, None, None, None)))
    ids = [F + 0, F + 8, 4]
    out.append(("legacy upsert again", legacy_upsert(ids, vs(30, 31, 32)), ("upsert", ids, vs(30, 31, 32), None, [-1] * 3)))
    ids = [F + 2, N + 3]
    out.append(("delete", encode(DELETE, np.array(ids)), ("delete", ids, None, None, None)))
    docs3b = [["zeta", "last one", '{"k":6}']]
    out.append(("upsert_docs, 3 fields", encode(UPSERT_DOCS, np.array([N + 5]), vs(40), docs3b, np.array([-1])),
                ("upsert_docs", [N + 5], vs(40), docs3b, [-1])))
    return out


def shard_expected(records) -> dict:
    """What replaying the records over a shard whose base holds BASE_IDS gives, worked out here in plain Python
    (not by ShardWrites)."""
    base = set(BASE_IDS)
    tomb, fresh, lists_of, docs, list_writes = set(), {}, {}, {}, {}
    for _, _, (op, ids, vectors, dd, lists) in records:
        for i in ids:
            if i in base:
                tomb.add(i)
            fresh.pop(i, None)
            lists_of.pop(i, None)
            docs.pop(i, None)
        if op == "delete":
            continue
        for j, i in enumerate(ids):
            fresh[i] = vectors[j].tolist()
            lists_of[i] = lists[j]
            if lists[j] >= 0:
                list_writes[lists[j]] = list_writes.get(lists[j], 0) + 1
            if op == "upsert_docs":
                d = dd[j]
                docs[i] = {"name": d[0], "text": d[1], "metadata": json.loads(d[2]),
                           "guest_of": d[3] if len(d) == 4 else None}
    return {
        "dim": SHARD_DIM, "metric": "l2", "base_ids": BASE_IDS, "last_lsn": len(records),
        "records": [r[0] for r in records],
        "fresh": {str(i): v for i, v in sorted(fresh.items())},
        "fresh_lists": {str(i): lst for i, lst in sorted(lists_of.items())},
        "tombstoned": sorted(tomb),
        "live_ids": sorted((base - tomb) | set(fresh)),
        "documents": {str(i): d for i, d in sorted(docs.items())},
        "list_writes": {str(k): n for k, n in sorted(list_writes.items())},
        "touched": sorted({i for r in records for i in r[2][1]}),
    }


def make_shard(out: Path) -> None:
    from fusionrag.retriever.collection.wal import WriteAheadLog
    from fusionrag.retriever.sharded.writes import decode

    records = shard_records()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wal = WriteAheadLog(out / "wal.log")
    assert wal.open() == []
    for lsn, (_, payload, _) in enumerate(records, 1):
        decode(payload)  # today's decoder reads every record
        wal.append(lsn, payload)
        wal.sync(lsn, lambda: lsn)
    wal.close()
    (out / "expected.json").write_text(json.dumps(shard_expected(records), indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))
    make_collection(HERE / "collection")
    make_shard(HERE / "shard")
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"wrote {HERE}/collection and {HERE}/shard ({total} bytes in all)")
