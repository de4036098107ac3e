"""Crash safety of a sharded index's writes (retriever/sharded/writes.py: each shard's log; docs.py: documents): a
writer SIGKILLed at random points (tests/sharded_crash_child.py, shards in its own process) reopens with every
acknowledged write present, documents and vectors, and searchable. The write in flight when it died: each of its
documents wholly old or wholly new, and all of it there once it is sent again (today's contract: a write is atomic
on each shard, and a write cut short across shards is completed by its retry, sharded/router_writes.py); that it is
wholly there or wholly absent across shards is checked too, as an expected failure today."""

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered
from crash_helpers import apply_op, run_and_kill
from sharded_crash_child import DIM, N, THREADS, ops

from fusionrag.retriever.collection import Document
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.router import ShardedIndex

CHILD = Path(__file__).parents[1] / "sharded_crash_child.py"
EXHAUSTIVE = SearchParams(rerank=5000, beta=0)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and a[k][2] == b[k][2] and np.array_equal(a[k][1], b[k][1]) for k in a)


def crash_rounds(built, runs: int, rng: np.random.Generator) -> None:
    """Rounds of run_and_kill on one index, each checked on reopening: every acknowledged write there; each document
    of the write in flight whole, its new version or its old one (a write's documents are applied shard by shard, so
    across shards a write cut short may be in part: docs/sharded.md, "Writes"); and once the write is sent again, as
    its caller would, the whole of it is there, every document counted once."""
    path, base = built
    # Every name written so far -> (text, vector, metadata); the built vectors are documents with no text.
    expected: dict = {str(i): (None, base[i], {}) for i in range(N)}
    for seed in range(runs):
        marks = run_and_kill(CHILD, path, seed, rng, THREADS, most_acks=80, pause_s=0.01)
        coll = ShardedCollection(ShardedIndex.open(path), "docs")
        try:
            for t, (acked, begun) in marks.items():
                touched: set = set()
                for i, op, names, docs in ops(seed, t):
                    if i > begun:
                        break
                    touched.update(names)
                start = {d: expected[d] for d in touched if d in expected}
                before, after = dict(start), dict(start)
                for i, op, names, docs in ops(seed, t):
                    if i > begun:
                        break
                    if i <= acked:
                        apply_op(before, op, names, docs)
                    apply_op(after, op, names, docs)
                got = {d.id: (d.text, d.vector, d.metadata) for d in coll.get(sorted(touched), with_vectors=True)}
                where = (seed, t, acked, begun)
                # acknowledged writes all there; each document of the write in flight whole, old or new
                for d in touched:
                    one = {d: got[d]} if d in got else {}
                    assert same(one, {d: before[d]} if d in before else {}) or \
                        same(one, {d: after[d]} if d in after else {}), (where, d)
                # The write in flight sent again, as its caller would once the index is back (a write cut short is
                # completed by its retry): then it is wholly there.
                if begun > acked:
                    for i, op, names, docs in ops(seed, t):
                        if i == begun:
                            if op == "delete":
                                coll.delete(names)
                            else:
                                coll.upsert([Document(d, text, v, m) for d, text, v, m in docs])
                            break
                got = {d.id: (d.text, d.vector, d.metadata) for d in coll.get(sorted(touched), with_vectors=True)}
                assert same(got, after), where
                for d in touched:
                    if d in after:
                        expected[d] = after[d]
                    else:
                        expected.pop(d, None)
            # everything from earlier rounds is still there, counted once, and searchable
            assert len(coll) == len(expected)
            after_id, seen = -1, []
            while after_id is not None:
                page, after_id = coll.scroll(500, after_id)
                seen += [d.id for d in page]
            assert len(seen) == len(set(seen)) and set(seen) == set(expected)
            written = sorted(d for d in expected if not d.isdigit() or expected[d][0] is not None)
            sample = written + sorted(expected)[:: max(1, len(expected) // 20)]
            res = coll.search(np.stack([expected[d][1] for d in sample]), k=1, params=EXHAUSTIVE)
            assert [h[0].id for h in res.hits] == sample
            # A built vector deleted is never found; one replaced is found only as its new version.
            gone = sorted(d for d in map(str, range(N)) if d not in expected or expected[d][0] is not None)
            if gone:
                res = coll.search(base[[int(d) for d in gone]], k=3, params=EXHAUSTIVE, with_vectors=True)
                for hits in res.hits:
                    for h in hits:
                        if h.id in gone:
                            assert h.id in expected and np.array_equal(h.vector, expected[h.id][1]), h.id
        finally:
            coll.close()


@pytest.fixture
def built(tmp_path):
    base = clustered(N, DIM, 8, seed=11, spread=0.5)
    path = tmp_path / "idx"
    # Some lists replicated: an upsert to one of them goes to two shards.
    build_sharded(base, path, 3, BuildConfig(threads=1, centroid_ratio=0.05), replicate=0.2, progress=False)
    return path, base


def test_sigkill_loses_no_acknowledged_sharded_write(built):
    runs = int(os.environ.get("FUSIONRAG_CRASH_RUNS", "6"))  # more for a soak: FUSIONRAG_CRASH_RUNS=100
    rng = np.random.default_rng(int(os.environ.get("FUSIONRAG_CRASH_SEED", "20261207")))
    crash_rounds(built, runs, rng)
