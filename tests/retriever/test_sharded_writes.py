"""Writes to a sharded index (retriever/sharded/, sharded/writes.py) and its faults, shards in this process: each
shard's own log and fresh tier, failover to replicas, missing lists reported, a shard restarted from its directory.
The same on a Ray cluster: test_sharded_ray.py."""

import threading

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection.fresh import distances
from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.errors import InputError, UnavailableError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.parts import merge_topk
from fusionrag.retriever.sharded.router import ShardedIndex

N, DIM, K = 3000, 16, 10
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05)
EXHAUSTIVE = SearchParams(rerank=N, beta=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-writes")
    base = clustered(N, DIM, 20, seed=5, spread=0.6)
    build_index(base, root / "single", CONFIG, progress=False)
    return {"root": root, "base": base, "queries": clustered(60, DIM, 20, seed=5, spread=0.6)[::-1] + 0.03}


def fresh_copy(data, name, **kw):
    path = data["root"] / name
    build_sharded(data["base"], path, 3, CONFIG, progress=False, **kw)
    return path


class Reference:
    """The single-machine answer a collection gives: the built index with replaced and deleted rows excluded,
    merged with an exact search over the vectors written since."""

    def __init__(self, index: Index):
        self.index, self.tomb, self.fresh = index, np.zeros(N, bool), {}

    def upsert(self, ids, vectors):
        for i, v in zip(ids.tolist(), vectors):
            if i < N:
                self.tomb[i] = True
            self.fresh[i] = v

    def delete(self, ids):
        for i in ids.tolist():
            if i < N:
                self.tomb[i] = True
            self.fresh.pop(i, None)

    def search(self, q, k=K):
        exclude = np.packbits(self.tomb, bitorder="little")
        res = self.index.search(q, k, EXHAUSTIVE, exclude=exclude)
        parts = [(res.ids, res.distances)]
        if self.fresh:
            ids = np.array(list(self.fresh), dtype=np.int64)
            x = np.array(list(self.fresh.values()), dtype=np.float32)
            d = distances(q, x, (x * x).sum(1), "l2").astype(np.float32)
            order = np.argsort(d, axis=1, kind="stable")[:, :k]
            parts.append((ids[order], np.take_along_axis(d, order, 1)))
        return merge_topk(parts, k)


def assert_same(res, ref_ids, ref_d):
    assert np.array_equal(res.ids, ref_ids)
    assert np.allclose(res.distances, ref_d, rtol=1e-5, atol=1e-5)


def test_writes_before_and_after_a_shard_restart_are_all_searchable(data):
    path = fresh_copy(data, "w1", replicate=0.05)
    rng = np.random.default_rng(1)
    single = Index.open(data["root"] / "single")
    ref = Reference(single)
    q = data["queries"]
    index = ShardedIndex.open(path)
    try:
        new_ids = np.arange(N, N + 150)
        new_vecs = data["base"][rng.choice(N, 150)] + 0.05 * rng.standard_normal((150, DIM)).astype(np.float32)
        assert index.upsert(new_ids, new_vecs) == 0
        ref.upsert(new_ids, new_vecs)
        replaced = np.arange(0, 60)
        moved = data["base"][rng.choice(N, 60)] + 0.05
        assert index.upsert(replaced, moved) == 60
        ref.upsert(replaced, moved)
        gone = np.concatenate([np.arange(100, 140), new_ids[:20]])
        assert index.delete(gone) == 60
        assert index.delete(gone) == 0  # unknown ids are ignored
        ref.delete(gone)
        assert_same(index.search(q, K, EXHAUSTIVE), *ref.search(q))
        # Every live written vector is found by itself; deleted ones never are.
        top = index.search(np.concatenate([new_vecs[20:], moved]), 1, EXHAUSTIVE)
        assert np.array_equal(top.ids[:, 0], np.concatenate([new_ids[20:], replaced]))
        assert not np.isin(index.search(data["base"][100:140], K).ids, gone).any()

        # A shard stops as a crash would; its log brings every write back.
        s = int(np.argmax(index.fresh_count))
        assert index.fresh_count[s] > 0
        index.kill_shard(s)
        down = index.search(q, K, EXHAUSTIVE)
        assert down.partial and s in down.missing_shards
        with pytest.raises(UnavailableError, match="down"):
            index.search(q, K, EXHAUSTIVE, partial=False)
        where = index.restart_shard(s)
        assert where["replayed"] >= 1 and where["fresh"] == index.fresh_count[s]
        full = index.search(q, K, EXHAUSTIVE)
        assert not full.partial
        assert_same(full, *ref.search(q))

        # Writes after the restart, then the whole index reopened from its directory.
        more_ids = np.arange(N + 150, N + 200)
        more = data["base"][rng.choice(N, 50)] - 0.04
        index.upsert(more_ids, more)
        ref.upsert(more_ids, more)
        index.upsert(new_ids[30:40], more[:10])  # replace fresh rows
        ref.upsert(new_ids[30:40], more[:10])
        index.delete(np.arange(200, 210))
        ref.delete(np.arange(200, 210))
        assert_same(index.search(q, K, EXHAUSTIVE), *ref.search(q))
    finally:
        index.close()
    index = ShardedIndex.open(path)
    try:
        assert_same(index.search(q, K, EXHAUSTIVE), *ref.search(q))
        assert index.fresh_count.sum() >= len(ref.fresh)
        with pytest.raises(InputError):
            index.upsert([1, 1], data["base"][:2])
        with pytest.raises(InputError):
            index.upsert([-1], data["base"][:1])
    finally:
        index.close()
        single.close()


def test_a_dead_shard_fails_over_to_replicas_and_reports_what_it_could_not_reach(data):
    path = fresh_copy(data, "w2", replicate=0.3)
    q = data["queries"]
    index = ShardedIndex.open(path)
    try:
        healthy = index.search(q, K, EXHAUSTIVE)
        s = 1
        sole = set(np.flatnonzero((index.list_shards[:, 0] == s) & (index.list_shards[:, 1] < 0)).tolist())
        index.kill_shard(s)  # the router learns it from the failed call
        res = index.search(q, K, EXHAUSTIVE)
        assert not index.alive[s]
        lists = index.nav.probe(index.prepare_queries(q), EXHAUSTIVE)[0]
        for i in range(len(q)):
            # Exactly the probed lists only the dead shard held are missing; the replicated ones were answered.
            want = sorted(set(lists[i][lists[i] >= 0].tolist()) & sole)
            assert res.missing_lists[i].tolist() == want
            if not want:
                assert np.array_equal(res.ids[i], healthy.ids[i])
        assert res.stats["missing_lists"].sum() > 0 and res.partial
        assert index.search(q, K, EXHAUSTIVE).per_shard["queries"][s] == 0  # no longer asked
        # Writes go on: new vectors to live shards; a write needing the dead shard is refused, not half-done.
        on_dead = index.base_ids[s][:3]
        with pytest.raises(UnavailableError, match="shard-001"):
            index.delete(on_dead)
        v = data["base"][:40] + 0.01
        index.upsert(np.arange(N, N + 40), v)
        assert np.array_equal(index.search(v, 1, EXHAUSTIVE).ids[:, 0], np.arange(N, N + 40))
        index.restart_shard(s)
        full = index.search(q, K, EXHAUSTIVE)
        assert not full.partial
        index.delete(on_dead)
        assert not np.isin(index.search(q, K, EXHAUSTIVE).ids, on_dead).any()
    finally:
        index.close()


def test_with_every_list_replicated_a_dead_shard_loses_nothing(data):
    path = fresh_copy(data, "w3", replicate=1.0)
    q = data["queries"]
    index = ShardedIndex.open(path)
    try:
        assert (index.list_shards[:, 1] >= 0).all()
        v = data["base"][500:560] + 0.02
        index.upsert(np.arange(N, N + 60), v)  # each to both replicas of its nearest list
        healthy = index.search(q, K, EXHAUSTIVE)
        index.kill_shard(0)
        res = index.search(q, K, EXHAUSTIVE, partial=False)
        assert np.array_equal(res.ids, healthy.ids)
        assert np.array_equal(index.search(v, 1, EXHAUSTIVE, partial=False).ids[:, 0], np.arange(N, N + 60))
    finally:
        index.close()


def test_searches_beside_writes_with_a_shard_down(data):
    """With a shard down, every search asks which down shards hold fresh rows no live shard holds, while writes
    change those rows' owners. It once read them in a pass over every fresh id, without a lock: a write during it
    failed the search ('dictionary changed size during iteration', seen under load on a Ray cluster)."""
    path = fresh_copy(data, "w5", replicate=0.3)
    q = data["queries"]
    index = ShardedIndex.open(path)
    rng = np.random.default_rng(3)
    try:
        index.kill_shard(1)
        index.search(q, K)  # the router learns it
        assert not index.alive[1]
        index.upsert(np.arange(N, N + 20000), rng.normal(size=(20000, DIM)).astype(np.float32))
        stop, errors, searches = threading.Event(), [], [0]

        def search():
            while not stop.is_set():
                try:
                    index.search(q[:4], K)
                    searches[0] += 1
                except Exception as e:  # reported below
                    errors.append(e)
                    return

        t = threading.Thread(target=search)
        t.start()
        try:
            for b in range(30):  # new ids, then some of them replaced and deleted
                ids = np.arange(N + 20000 + 200 * b, N + 20000 + 200 * (b + 1))
                index.upsert(ids, rng.normal(size=(len(ids), DIM)).astype(np.float32))
                index.upsert(ids[:50] - 20000, rng.normal(size=(50, DIM)).astype(np.float32))
                index.delete(ids[50:60] - 20000)
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        assert searches[0] > 0
        # What the searches were told equals a pass over every fresh id, made here.
        want = sorted({o for owners in index.fresh_owner.values() if not any(index.alive[list(owners)])
                       for o in owners})
        assert index._fresh_unreachable() == want
        index.restart_shard(1)
        index.kill_shard(0)
        index.search(q, K)
        want = sorted({o for owners in index.fresh_owner.values() if not any(index.alive[list(owners)])
                       for o in owners})
        assert index._fresh_unreachable() == want == [0]
    finally:
        index.close()


def test_a_shard_that_does_not_answer_in_time_is_taken_for_down_and_healed(data, monkeypatch):
    import time

    from fusionrag.retriever.sharded.parts import part_name
    from fusionrag.retriever.sharded.shard import ShardServer

    path = fresh_copy(data, "w4", replicate=0.3)
    q = data["queries"]
    index = ShardedIndex.open(path, call_timeout_s=0.5)
    # Every candidate found re-ranked, from lists that hold ~100 (rerank=N would probe every list: the ratio
    # rule keeps lists until they hold what the re-rank wants, and then every query would miss shard 2's).
    FEW = SearchParams(rerank=100, beta=0)
    slow = {str((path / part_name(2)).resolve())}
    real = ShardServer.search

    def stalled(self, *args):
        if self.path in slow:
            time.sleep(2)
        return real(self, *args)

    try:
        healthy = index.search(q, K, FEW)
        monkeypatch.setattr(ShardServer, "search", stalled)
        res = index.search(q, K, FEW)  # does not wait the 2 s out: shard 2 is taken for down
        assert not index.alive[2] and res.partial
        full = ~np.array([len(m) > 0 for m in res.missing_lists])
        assert full.any() and np.array_equal(res.ids[full], healthy.ids[full])
        slow.clear()
        assert index.heal() == [2] and index.alive.all()
        assert np.array_equal(index.search(q, K, FEW, partial=False).ids, healthy.ids)
    finally:
        index.close()
    with pytest.raises(Exception, match="call_timeout_s"):
        ShardedIndex.open(path, call_timeout_s=0)


def test_a_shards_search_does_not_wait_for_a_writes_fsync(tmp_path, monkeypatch):
    """A shard's log was fsynced under the lock its searches' snapshot takes, so every search stalled behind every
    write's fsync. The fsync is held open here (the log's sync waits on an event): a search of the same shard
    answers meanwhile, without the write, which is not acknowledged; once the fsync ends the write is applied and
    seen, and a write whose fsync fails is cut from the log and not applied."""
    from fusionrag.retriever.collection.wal import WriteAheadLog
    from fusionrag.retriever.errors import StorageError
    from fusionrag.retriever.sharded.writes import UPSERT, ShardWrites

    w = ShardWrites(tmp_path, np.arange(100, dtype=np.int64), DIM, "l2")
    w.write(UPSERT, [1000], np.ones((1, DIM), np.float32))  # the log exists: its sync is the one held below
    entered, release = threading.Event(), threading.Event()
    real_sync = WriteAheadLog.sync

    def held_sync(self, lsn, last):
        entered.set()
        assert release.wait(30)
        return real_sync(self, lsn, last)

    monkeypatch.setattr(WriteAheadLog, "sync", held_sync)
    writer = threading.Thread(target=w.write, args=(UPSERT, [5, 1001], np.zeros((2, DIM), np.float32)))
    writer.start()
    assert entered.wait(30)
    seen = []
    reader = threading.Thread(target=lambda: seen.append(w.snapshot()))
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the search waited for the write's fsync"
    tomb, fresh = seen[0]
    assert tomb is None and sorted(fresh.rows[fresh.live].tolist()) == [1000]  # the write not seen yet
    release.set()
    writer.join(30)
    tomb, fresh = w.snapshot()
    assert sorted(fresh.rows[fresh.live].tolist()) == [5, 1000, 1001] and tomb is not None and w.deleted == 1

    def failing_sync(self, lsn, last):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(WriteAheadLog, "sync", failing_sync)
    size = (tmp_path / "wal.log").stat().st_size
    with pytest.raises(StorageError):
        w.write(UPSERT, [1002], np.zeros((1, DIM), np.float32))
    assert (tmp_path / "wal.log").stat().st_size == size and not w.live(np.array([1002]))[0]
    monkeypatch.setattr(WriteAheadLog, "sync", real_sync)
    w.close()
    again = ShardWrites(tmp_path, np.arange(100, dtype=np.int64), DIM, "l2")  # replayed: the three writes only
    assert sorted(again.fresh_ids().tolist()) == [5, 1000, 1001] and again.replayed == 2
    again.close()
