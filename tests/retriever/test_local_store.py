"""The local store a collection and a shard are both made of (retriever/collection/store.py, #69): one record format
that reads both v1 formats, one commit (group commit, set-aside, a cut log on a disk's error) for both users.
v1 logs written by the code before are replayed in test_v1_logs.py; SIGKILL rounds in test_collection_crash.py and
test_sharded_crash.py."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection.records import V2, StoreRecord
from fusionrag.retriever.collection.wal import WriteAheadLog
from fusionrag.retriever.errors import IndexFormatError, InputError
from fusionrag.retriever.sharded.writes import DELETE, UPSERT, UPSERT_DOCS, ShardWrites

DIM = 4


def records_of(path) -> list[tuple[int, bytes]]:
    wal = WriteAheadLog(path)
    try:
        return wal.open()
    finally:
        wal.close()


@pytest.mark.parametrize("legacy", ["collection", "shard"])
def test_every_op_round_trips_through_the_one_format(legacy):
    vecs = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    cases = [
        StoreRecord("upsert", ["a", "b"], ["x", None], ["{}", '{"k": [1, "\\ud800"]}'], vecs, np.array([7, 1 << 62])),
        StoreRecord("upsert", vectors=vecs, keys=np.array([3, 4]), lists=np.array([-1, 9])),
        StoreRecord("upsert", ["a", "b"], ["x", "y"], ["{}", "{}"], vecs, np.array([1, 2]), lists=np.array([0, 1]),
                    guests=[-1, 5]),
        StoreRecord("delete", ["a"]),
        StoreRecord("delete", keys=np.array([3, 4])),
        StoreRecord("delete_where", filter='{"k": 1}'),
        StoreRecord("clear"),
        StoreRecord("set_metadata", ["a"], metas=['{"z": 1}']),
        StoreRecord("merge_metadata", ["a"], metas=['{"z": null}']),
    ]
    for i, w in enumerate(cases):
        p = w.payload()
        assert p.startswith(V2)
        got = StoreRecord.decode(i + 1, p, DIM, legacy)
        assert got.lsn == i + 1
        for name in ("op", "ids", "texts", "metas", "filter", "guests"):
            assert getattr(got, name) == getattr(w, name), name
        for name in ("keys", "lists", "vectors"):
            a, b = getattr(got, name), getattr(w, name)
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name
        with pytest.raises(IndexFormatError):
            StoreRecord.decode(1, p[:-1], DIM, legacy)


def test_v1_records_are_told_apart_from_v2():
    """A collection's v1 payload starts with its JSON head's byte count, a shard's with its op letter: neither can
    start with the v2 magic (a count starting so is past a record's 1 GiB)."""
    head = json.dumps({"op": "delete", "ids": ["a"], "texts": [], "metas": [], "rows": []}).encode()
    old = StoreRecord.decode(1, struct.pack("<I", len(head)) + head, DIM, "collection")
    assert (old.op, old.ids, old.keys) == ("delete", ["a"], None)
    shard = struct.pack("<cII", b"d", 2, 0) + np.array([5, 6], "<i8").tobytes()
    old = StoreRecord.decode(1, shard, DIM, "shard")
    assert old.op == "delete" and old.keys.tolist() == [5, 6]
    assert struct.unpack("<I", V2[:4])[0] > 1 << 30 and V2[:1] not in (b"u", b"l", b"U", b"d")


def test_a_shard_logs_the_one_format_and_shares_fsyncs(tmp_path):
    """A shard's writes are StoreRecords in its log (v2), and writers at once share fsyncs (group commit), as a
    collection's do; each write's answer is how many of its ids were live before."""
    w = ShardWrites(tmp_path, np.arange(100, dtype=np.int64), DIM, "l2")
    assert w.write(UPSERT, [1000], np.ones((1, DIM), np.float32)) == 0
    assert w.write(UPSERT, [1000, 5], np.ones((2, DIM), np.float32)) == 2
    n, threads = 40, 4
    go = threading.Barrier(threads)

    def writer(t):
        go.wait()
        for i in range(n):
            w.write(UPSERT, [2000 + t * n + i], np.full((1, DIM), t, np.float32), lists=[t])

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert w.write(DELETE, [5, 2000, 99999]) == 2
    fsyncs = w.wal.fsyncs
    w.close()
    logged = records_of(tmp_path / "wal.log")
    assert len(logged) == 3 + n * threads and all(p.startswith(V2) for _, p in logged)
    assert fsyncs <= len(logged)
    again = ShardWrites(tmp_path, np.arange(100, dtype=np.int64), DIM, "l2")
    live = set(again.live_ids().tolist())
    assert 5 not in live and 2000 not in live and 1000 in live and len(live) == 99 + 1 + n * threads - 1
    assert again.list_writes == {t: n for t in range(threads)}  # upserts per router list, counted on replay
    again.close()


def test_writers_at_once_share_one_fsync_on_a_shard(tmp_path, monkeypatch):
    """Group commit, made certain: every writer's fsync waits until all four have appended (or 10 s pass), so the
    first to fsync covers all four and the others find theirs durable: one fsync for four writes. Before the one
    local store a shard held its write lock through each fsync, so the others could not append meanwhile: four."""
    w = ShardWrites(tmp_path, np.arange(10, dtype=np.int64), DIM, "l2")
    w.write(UPSERT, [100], np.ones((1, DIM), np.float32))  # the log made
    before, target = w.wal.fsyncs, w.last_lsn + 4
    real_sync = WriteAheadLog.sync

    def sync_once_all_appended(self, lsn, last):
        deadline = time.monotonic() + 10
        while w.last_appended < target and time.monotonic() < deadline:
            time.sleep(0.001)
        return real_sync(self, lsn, last)

    monkeypatch.setattr(WriteAheadLog, "sync", sync_once_all_appended)
    ts = [threading.Thread(target=w.write, args=(UPSERT, [200 + t], np.full((1, DIM), t, np.float32)))
          for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert w.wal.fsyncs - before == 1 and sorted(w.fresh_ids().tolist()) == [100, 200, 201, 202, 203]
    w.close()


def test_a_shard_write_its_doc_store_cannot_hold_is_set_aside(tmp_path):
    """A shard gained the collection's set-aside: a write whose documents SQLite refuses (past the router's
    checks, as a bug would let through) fails alone with InputError; the writes after it apply; reopened, the
    shard does not replay it into its fresh tier and its doc store does not hold it."""
    w = ShardWrites(tmp_path, np.arange(10, dtype=np.int64), DIM, "l2")
    w.write(UPSERT_DOCS, [100], np.ones((1, DIM), np.float32), [("a", "fine", "{}")])
    with pytest.raises(InputError, match="set aside"):
        w.write(UPSERT_DOCS, [101], np.ones((1, DIM), np.float32), [("b", "bad \ud800", "{}")])
    w.write(UPSERT_DOCS, [102], np.ones((1, DIM), np.float32), [("c", "fine", "{}")])
    assert sorted(w.fresh_ids().tolist()) == [100, 102]
    assert w.store.set_aside_entries()[0] == 1 and w.info()["set_aside"] == 1
    w.close()
    again = ShardWrites(tmp_path, np.arange(10, dtype=np.int64), DIM, "l2")
    assert sorted(again.fresh_ids().tolist()) == [100, 102] and again.replayed == 3 and again.info()["set_aside"] == 1
    ids, names = again.named()
    assert sorted(names) == ["a", "c"]
    again.close()


CHILD = """
import os, sys
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.collection.store import LocalStore
from fusionrag.retriever.errors import StorageError
col = Catalog(sys.argv[1], collection_config=CollectionConfig(background_merge=False)).create("c", 2, "l2")
col.upsert([Document("a", None, [1, 0])])
col.merge()  # the doc store made durable, the log emptied
call = sys.argv[2]  # the call the disk fails: the append's write, or the fsync after it
real = getattr(os, call)
def full(*a):
    raise OSError(28, "No space left on device")
setattr(os, call, full)
try:
    col.upsert([Document("b", None, [2, 0])])
except StorageError:
    pass
else:
    raise SystemExit("the write did not fail")
setattr(os, call, real)
LocalStore._apply_pending = lambda self: None  # logged and fsynced, never applied: as if killed just after
col.upsert([Document("c", None, [3, 0])])
os._exit(0)
"""


@pytest.mark.parametrize("call", ["pwrite", "fsync"])
def test_a_write_the_disk_refused_leaves_no_gap_in_the_log(tmp_path, call):
    """A write whose append or fsync failed (a full disk) took a log sequence number and left a gap after an
    emptied log; the next write logged but not applied before a crash then made the collection unreadable ("the doc
    store is older than the log"). The failed write's number is taken again: the collection opens with a and c."""
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), call], check=True, timeout=120)
    cat = Catalog(tmp_path)
    try:
        assert cat.failed() == {}
        c = cat.get("c")
        assert sorted(d.id for d in c.get(["a", "b", "c"])) == ["a", "c"] and len(c) == 2
    finally:
        cat.close()
