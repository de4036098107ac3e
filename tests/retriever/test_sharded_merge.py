"""A shard's fresh tier and tombstones merged into a new generation of its index (retriever/sharded/generations.py,
ShardServer.merge), shards in this process: with every list probed and every candidate re-ranked the answers are
the same before and after, id for id and distance for distance, and so after the index is reopened or a shard
restarted; at the defaults a merged vector is found by its own vector; writes made while a merge runs are kept;
a merge cut short after its generation was named loses nothing; a damaged generation is refused by name."""

import json
import threading

import numpy as np
import pytest
from conftest import clustered, sharded_copy

import fusionrag.retriever.engine.merge as merge_module
import fusionrag.retriever.sharded.shard as sharded_module
from fusionrag.retriever.collection import Document
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.errors import IndexFormatError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.generations import CURRENT, current_part, load_global_ids
from fusionrag.retriever.sharded.parts import NAMED_IDS
from fusionrag.retriever.sharded.router import ShardedIndex

N, DIM, K = 3000, 16, 10
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05)
EVERYTHING = SearchParams(rerank=N + 1000, beta=0, nprobe=1 << 16, probe_ratio=0)  # every list, every candidate


@pytest.fixture(scope="module")
def base():
    return clustered(N, DIM, 20, seed=5, spread=0.6)


@pytest.fixture(scope="module")
def built(tmp_path_factory, base):
    path = tmp_path_factory.mktemp("sharded-merge") / "idx"
    build_sharded(base, path, 3, CONFIG, replicate=0.2, progress=False)
    return path


@pytest.fixture
def coll(built, tmp_path):
    c = sharded_copy(built, tmp_path / "idx")
    yield c
    c.close()


def write_some(coll, base, n=150, seed=1):
    """Named documents, built vectors replaced (by id), built vectors deleted: what a merge folds in."""
    rng = np.random.default_rng(seed)
    docs = [Document(f"doc-{seed}-{i}", f"text {i}", base[rng.integers(N)] + rng.normal(0, 0.1, DIM).astype(np.float32),
                     {"year": 2000 + i % 5}) for i in range(n)]
    coll.upsert(docs)
    replaced = rng.choice(N, 40, replace=False)
    coll.index.upsert(replaced, base[replaced] + 0.3)
    coll.delete([str(i) for i in rng.choice(np.setdiff1d(np.arange(N), replaced), 30, replace=False)])
    return docs


def answers(coll, q, params=EVERYTHING):
    res = coll.index.search(q, K, params)
    return res.ids, res.distances


def test_a_merge_changes_no_answer_and_empties_the_fresh_tiers(coll, base, tmp_path):
    docs = write_some(coll, base)
    q = clustered(40, DIM, 20, seed=6, spread=0.6)
    ids, d = answers(coll, q)
    n, filtered = len(coll), coll.search(q, K, filter={"year": 2002}).hits
    replica_writes = coll.index.replica_writes.copy()
    assert replica_writes.sum() >= len(docs) + 40
    report = coll.index.merge_shards()
    assert sorted(report) == [0, 1, 2] and all(r["merged"] and r["generation"] == 1 for r in report.values())
    assert sum(r["fresh_merged"] for r in report.values()) >= len(docs) + 40  # replicas merge a vector twice
    assert not coll.index.fresh_count.any()
    for s in range(3):  # each shard's generation: its vectors in ascending id order, the named ones among them
        gen_dir, rec = current_part(tmp_path / "idx" / f"shard-{s:03d}")
        assert rec["generation"] == 1 and gen_dir.name == "gen-000001"
        gids = load_global_ids(gen_dir)
        assert len(gids) == rec["count"] and (gids >= NAMED_IDS).any()
        # The log keeps none of the records the generation holds: it was cut, not left to grow.
        assert report[s]["log_bytes_dropped"] > 0
        assert (tmp_path / "idx" / f"shard-{s:03d}" / "wal.log").stat().st_size == 0
    np.testing.assert_array_equal(coll.index.replica_writes, replica_writes)  # counts kept with the generation
    ids2, d2 = answers(coll, q)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(d2, d, rtol=1e-5, atol=1e-5)
    assert len(coll) == n
    assert [[h.id for h in hits] for hits in coll.search(q, K, filter={"year": 2002}).hits] == \
        [[h.id for h in hits] for hits in filtered]
    assert [d.text for d in coll.get([d.id for d in docs])] == [d.text for d in docs]
    # At the defaults a merged vector is found where the router looks: its nearest lists.
    res = coll.search(np.stack([d.vector for d in docs]), 1)
    assert [hits[0].id for hits in res.hits] == [d.id for d in docs]
    assert all(s["candidates"] > 0 for s in res.stats)
    # Reopened, and a shard restarted from its directory: the merged generation, the same answers.
    coll.index.restart_shard(1)
    np.testing.assert_array_equal(answers(coll, q)[0], ids)
    coll.index.close()
    again = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    try:
        assert [w["generation"] for w in again.index.where] == [1, 1, 1]
        np.testing.assert_array_equal(answers(again, q)[0], ids)
        np.testing.assert_array_equal(again.index.replica_writes, replica_writes)
        assert len(again) == n
        # A second merge goes on from the first; the first's directory goes once the second takes over.
        write_some(again, base, 30, seed=2)
        ids3, _ = answers(again, q)
        assert all(r["generation"] == 2 for r in again.index.merge_shards().values())
        np.testing.assert_array_equal(answers(again, q)[0], ids3)
        assert not list((tmp_path / "idx").glob("shard-*/gen-000001"))
    finally:
        again.close()


def test_writes_made_while_a_merge_runs_are_kept(coll, base, tmp_path, monkeypatch):
    write_some(coll, base)
    real = merge_module.merge_index
    late = [Document(f"late-{i}", f"late {i}", base[i] + 0.02, {"late": True}) for i in range(5)]
    done = []

    def writing_meanwhile(*args, **kwargs):
        if not done:  # the first shard's merge: the collection written from another thread, which must not wait
            t = threading.Thread(target=lambda: (coll.upsert(late), coll.delete(["doc-1-0"]), done.append(1)))
            t.start()
            t.join(30)
            assert done, "a write waited for the merge"
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_module, "merge_index", writing_meanwhile)
    coll.index.merge_shards()
    monkeypatch.undo()
    got = {d.id: d.text for d in coll.get([d.id for d in late] + ["doc-1-0"])}
    assert got == {d.id: d.text for d in late}
    q = np.stack([d.vector for d in late])
    assert [hits[0].id for hits in coll.search(q, 1).hits] == [d.id for d in late]
    coll.index.close()
    again = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    try:
        assert {d.id: d.text for d in again.get([d.id for d in late] + ["doc-1-0"])} == got
        assert [hits[0].id for hits in again.search(q, 1).hits] == [d.id for d in late]
    finally:
        again.close()


def test_a_merge_cut_short_after_naming_its_generation_loses_nothing(coll, base, tmp_path, monkeypatch):
    write_some(coll, base)
    q = clustered(40, DIM, 20, seed=6, spread=0.6)
    ids, d = answers(coll, q)

    class Crash(Exception):
        pass

    real = sharded_module.ShardWrites

    def crash_on_switch(*args, **kwargs):
        if kwargs.get("merged_lsn"):
            raise Crash("died between naming the new generation and switching to it")
        return real(*args, **kwargs)

    monkeypatch.setattr(sharded_module, "ShardWrites", crash_on_switch)
    with pytest.raises(Crash):
        coll.index.merge_shards(shards=[0])
    monkeypatch.undo()
    assert json.loads((tmp_path / "idx" / "shard-000" / CURRENT).read_text())["generation"] == 1
    coll.index.close()  # what a crash leaves: generation 1 named, the log holding every write
    again = ShardedCollection(ShardedIndex.open(tmp_path / "idx"), "docs")
    try:
        assert [w["generation"] for w in again.index.where] == [1, 0, 0]
        got_ids, got_d = answers(again, q)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(got_d, d, rtol=1e-5, atol=1e-5)
    finally:
        again.close()


def test_a_damaged_generation_is_refused_by_name(coll, base, tmp_path):
    write_some(coll, base)
    coll.index.merge_shards(shards=[2])
    coll.index.close()
    part = tmp_path / "idx" / "shard-002"
    rec = json.loads((part / CURRENT).read_text())
    (part / rec["dir"] / "manifest.json").write_text("{}")
    with pytest.raises(IndexFormatError, match="shard-002.*replaced or is corrupt"):
        ShardedIndex.open(tmp_path / "idx")
    (part / CURRENT).write_text("{not json")
    with pytest.raises(IndexFormatError, match="CURRENT.json: unreadable"):
        ShardedIndex.open(tmp_path / "idx")
