"""Incremental merge: tombstones out, new vectors in, oversized lists split, old generation untouched."""

import hashlib
import json
import time

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.retriever import BuildConfig, Index, SearchParams
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.merge import merge_index
from fusionrag.retriever.engine.vectors import normalize

DIM = 12  # 48-byte records: 85 to a block, which leaves 16 bytes of it unused


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("metric", ["l2", "cosine", "ip"])
def test_merge_index_removes_adds_and_splits(tmp_path, metric):
    base = clustered(1200, DIM, 30, seed=1)
    cfg = BuildConfig(metric=metric)
    Index.build(base, tmp_path / "g1", cfg, progress=False)
    old = Index.open(tmp_path / "g1")
    before = {p.name: sha(p) for p in (tmp_path / "g1").iterdir()}
    rng = np.random.default_rng(2)
    dead = np.zeros(len(base), bool)
    dead[rng.choice(len(base), 400, replace=False)] = True
    # New vectors crowd one region, so the lists there outgrow their bound and split.
    new = (base[7] + 0.3 * rng.standard_normal((900, DIM))).astype(np.float32)
    new_engine = normalize(new) if metric == "cosine" else new
    stats = merge_index(old, dead, new_engine.astype(np.float32), tmp_path / "g2", cfg)
    assert {p.name: sha(p) for p in (tmp_path / "g1").iterdir()} == before  # old generation untouched
    assert (stats.removed, stats.added) == (400, 900) and stats.splits > 0
    assert stats.slots_reused >= 400  # every dead vector's slot went to a new one
    idx = Index.open(tmp_path / "g2")  # verifies every checksum
    assert idx.count == 800 + 900 and idx.manifest["centroids"] == old.manifest["centroids"] + stats.splits
    ssd_blocks = idx.manifest["pages"]["num_blocks"]
    per = idx.manifest["pages"]["records_per_block"]
    assert ssd_blocks - old.manifest["pages"]["num_blocks"] == stats.blocks_appended
    assert ssd_blocks * per < 1700 + per * 40  # pages were reused, not only appended
    vecs = np.concatenate([base[~dead], new])
    q = np.concatenate([clustered(30, DIM, 30, seed=3), base[7:8] + 0.3 * rng.standard_normal((30, DIM))])
    q = q.astype(np.float32)
    truth = exact_knn(vecs, q, 10, metric)
    # Every list probed and every candidate re-ranked: exact, if the lists hold every vector and
    # the pages hold the right ones.
    assert recall(idx.search(q, 10, nprobe=10**6, rerank=10**4, beta=0).ids, truth) == 1.0
    # With the default knobs: l2 and cosine keep their recall. (Under ip, a dense new region coded
    # with codebooks trained before it existed ranks too coarsely for 200 candidates: that drift is
    # what rebuild_growth bounds.)
    if metric != "ip":
        assert recall(idx.search(q, 10).ids, truth) >= 0.95
    # every vector is still reachable: itself (or an equally near twin) comes back first
    sample = rng.choice(len(vecs), 200, replace=False)
    if metric != "ip":  # (under ip a vector need not be its own nearest)
        assert (idx.search(vecs[sample], 1).ids[:, 0] == sample).mean() >= 0.97
    # posting lists hold every live vector, nothing else, and none more than max_replicas times
    ids = np.load(tmp_path / "g2" / "list_ids.npy")
    assert np.array_equal(np.unique(ids), np.arange(len(vecs)))
    assert np.bincount(ids).max() <= cfg.max_replicas
    # the SSD tier holds exactly the survivors then the new vectors
    from fusionrag import native
    store = idx.reranker
    got = native.exact_distances(store.store, np.zeros((1, DIM), np.float32), np.arange(len(vecs))[None],
                                 store.locations, store.dtype, "l2")
    engine = normalize(vecs) if metric == "cosine" else vecs
    assert np.allclose(got[0], (engine ** 2).sum(1), rtol=1e-4, atol=1e-4)


def test_collection_merges_incrementally_then_rebuilds(tmp_path):
    cfg = CollectionConfig(min_index_count=200, background_merge=False, rebuild_growth=3.0)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("c", DIM, "cosine")
    x = clustered(3000, DIM, 40, seed=5)
    q = clustered(40, DIM, 40, seed=6)
    col.add([Document(str(i), None, v) for i, v in enumerate(x[:800])])
    col.merge()  # the first: a full build
    manifest = lambda: col._main.index.manifest  # noqa: E731
    assert "merge" not in manifest()
    col.add([Document(str(i), None, v) for i, v in enumerate(x[800:2000], 800)])
    col.delete([str(i) for i in range(0, 800, 4)])
    col.merge()  # incremental
    assert manifest()["merge"]["added"] == 1200 and manifest()["merge"]["removed"] == 200
    alive = np.setdiff1d(np.arange(2000), np.arange(0, 800, 4))
    res = col.search(q, k=10)
    found = np.array([[int(h.id) for h in hits] for hits in res.hits])
    assert recall(found, alive[exact_knn(x[alive], q, 10, "cosine")]) >= 0.95
    col.add([Document(str(i), None, v) for i, v in enumerate(x[2000:], 2000)])
    col.merge()  # 2800 live > 3 x 800 from the full build: rebuilt
    assert "merge" not in manifest() and manifest()["count"] == 2800
    cat.close()
    cat = Catalog(tmp_path, collection_config=cfg)
    res = cat.get("c").search(q, k=10)
    alive = np.setdiff1d(np.arange(3000), np.arange(0, 800, 4))
    found = np.array([[int(h.id) for h in hits] for hits in res.hits])
    assert recall(found, alive[exact_knn(x[alive], q, 10, "cosine")]) >= 0.95
    cat.close()


def test_merge_reads_codes_from_the_index_not_the_filter_tier(tmp_path):
    """On the GPU tier the filter's codes are a device tensor that numpy refuses, and when tiered only
    the hot rows in slot order: a merge must take the codes from the index's own file."""
    torch = pytest.importorskip("torch")
    base = clustered(1200, DIM, 30, seed=1)
    Index.build(base, tmp_path / "g1", BuildConfig(), progress=False)
    old = Index.open(tmp_path / "g1")
    codes = np.load(tmp_path / "g1" / "pq_codes.npy")
    hot = np.random.default_rng(0).permutation(len(codes))[:400]
    # Device-like: rows in another order, on a device whose data numpy cannot read.
    old.filter.codes = torch.from_numpy(codes[hot]).to("meta")
    with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
        np.asarray(old.filter.codes)
    dead = np.zeros(len(base), bool)
    dead[::3] = True
    new = clustered(50, DIM, 30, seed=5)
    merge_index(old, dead, new, tmp_path / "g2", BuildConfig())
    merged = np.load(tmp_path / "g2" / "pq_codes.npy")
    assert np.array_equal(merged[:int((~dead).sum())], codes[~dead])
    assert np.array_equal(merged[-50:], old.pq.encode(new))


def test_a_merge_that_doubles_the_index_holds_memory_by_its_data(tmp_path):
    """Many splits at once: each offers its new list the vectors around it as they stood before the splits,
    so offers do not snowball, and the re-assignment reads them in chunks. They did snowball: here the merge
    peaked at 230 MB; folding 19.7k MiniLM vectors of the Python docs into an index of 20k offered 8.7 M
    (vector, list) pairs, whose distances asked 12 GiB at once, and the process met the OOM killer."""
    import tracemalloc

    base = clustered(4000, 64, 40, seed=1)
    Index.build(base, tmp_path / "g1", BuildConfig(), progress=False)
    old = Index.open(tmp_path / "g1")
    new = clustered(4000, 64, 40, seed=2)
    tracemalloc.start()
    try:
        stats = merge_index(old, np.zeros(4000, bool), new, tmp_path / "g2", BuildConfig())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats.splits > 100  # the case that snowballed
    assert peak < 80 << 20, f"{peak / 2**20:.0f} MiB"
    idx = Index.open(tmp_path / "g2")
    vecs = np.concatenate([base, new])
    q = clustered(50, 64, 40, seed=3)
    assert recall(idx.search(q, 10).ids, exact_knn(vecs, q, 10)) >= 0.95


def test_writes_are_refused_while_a_merge_runs_once_the_fresh_tier_is_full(tmp_path, monkeypatch):
    """The fresh tier holds its vectors in RAM until a merge folds them in: while a merge runs, upserts past
    FRESH_HOLD times the merge's threshold are refused (UnavailableError: a 503 the client retries), deletes are
    not, and once the merge is done upserts are taken again."""
    import threading

    from fusionrag.retriever.collection import compaction
    from fusionrag.retriever.collection.config import FRESH_HOLD
    from fusionrag.retriever.errors import UnavailableError

    vec_bytes = DIM * 4 + 4 + 8 + 1  # the fresh tier's bytes per vector (FreshTier.bytes)
    cfg = CollectionConfig(min_index_count=200, merge_fresh_bytes=300 * vec_bytes, merge_fresh_count=10**6)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("c", DIM, "l2")
    x = clustered(3000, DIM, 40, seed=5)
    release, started = threading.Event(), threading.Event()
    real = compaction.next_generation

    def held(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(compaction, "next_generation", held)
    col.add([Document(str(i), None, v) for i, v in enumerate(x[:300])])  # at the threshold: a merge starts
    assert started.wait(30)
    taken = 300
    with pytest.raises(UnavailableError, match="while a merge runs"):
        while taken < 3000:
            col.add([Document(str(taken + j), None, x[taken + j]) for j in range(50)])
            taken += 50
    assert FRESH_HOLD * 300 <= taken < FRESH_HOLD * 300 + 50  # refused once the fresh tier held FRESH_HOLD times it
    assert col.delete(["0"]) == 1  # a delete holds no vector: taken
    release.set()
    while col.info()["build_state"]["merging"] or col.info()["build_state"]["generation"] < 1:
        time.sleep(0.05)
    col.add([Document(str(taken), None, x[taken])])  # taken again once the merge is done
    assert col.count() == taken
    cat.close()


@pytest.mark.parametrize("reorder", [False, True])
def test_lists_written_a_block_at_a_time_are_those_the_pairs_give(tmp_path, reorder, monkeypatch):
    """A merge writes the new lists from the old CSR a block of lists at a time (no pair per posting is ever whole
    in memory): the same offsets and ids as grouping every (list, id) pair gives, with lists a split made (past the
    old ones), empty lists, dropped postings and a reordering of the ids."""
    from fusionrag.retriever.engine import merge
    from fusionrag.retriever.engine.manifest import IndexWriter

    real = merge._list_blocks
    monkeypatch.setattr(merge, "_list_blocks", lambda offsets, postings=0: real(offsets, 97))  # many small blocks
    rng = np.random.default_rng(4)
    n_old, n_lists, n_new, n_split = 3000, 120, 400, 5
    sizes = rng.integers(0, 60, n_lists)
    sizes[[3, 50, 51]] = 0  # empty lists, a run of them too
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    list_ids = np.concatenate([np.sort(rng.choice(n_old, s, replace=False)) for s in sizes]).astype(np.uint32)
    kept = rng.random(n_old) > 0.2
    n_keep = int(kept.sum())
    renum = np.cumsum(kept, dtype=np.int32) - 1
    add = merge._Lists(rng.integers(0, n_lists + n_split, 3 * n_new),
                       np.repeat(np.arange(n_keep, n_keep + n_new), 3), n_keep + n_new)
    of_list = np.repeat(np.arange(n_lists), sizes)
    lists = np.concatenate([of_list[kept[list_ids]], add.lists])
    ids = np.concatenate([renum[list_ids[kept[list_ids]]], add.ids])
    new_of = rng.permutation(n_keep + n_new) if reorder else np.arange(n_keep + n_new)
    ids = new_of[ids]
    o = np.lexsort((ids, lists))
    want_offsets = np.concatenate([[0], np.cumsum(np.bincount(lists, minlength=n_lists + n_split))])
    w = IndexWriter(tmp_path / "idx")
    got_offsets, got_ids = merge._stream_lists(w, offsets, list_ids, kept, renum, add, n_lists + n_split,
                                               new_of if reorder else None)
    assert np.array_equal(got_offsets, want_offsets)
    assert got_ids.dtype == np.uint32 and np.array_equal(got_ids, ids[o])
    w.abort()


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_the_centroids_a_merge_maps_from_the_graph_file_are_the_graphs(tmp_path, metric):
    """A merge reads the old centroids through a memory map of graph.bin rather than the graph's copy in the heap:
    the same rows as the graph's own vectors (without ip's augmented coordinate), and those splits append after."""
    from fusionrag import native
    from fusionrag.retriever.engine import merge

    Index.build(clustered(1500, DIM, 30, seed=1), tmp_path / "g", BuildConfig(metric=metric), progress=False)
    vectors = native.Graph.load(str(tmp_path / "g" / "graph.bin")).vectors()[:, :DIM]
    c = merge._Centroids(tmp_path / "g" / "graph.bin", DIM)
    assert len(c) == len(vectors) and c.shape == (len(vectors), DIM)
    idx = np.random.default_rng(0).integers(0, len(vectors), 50)
    assert np.array_equal(c[idx], vectors[idx]) and np.array_equal(c[int(idx[0])], vectors[idx[0]])
    extra = np.arange(DIM, dtype=np.float32)
    c.append(extra)
    assert np.array_equal(c[[len(vectors), 3]], np.stack([extra, vectors[3]]))
    assert np.array_equal(c.array(), np.vstack([vectors, extra]))


def test_splits_are_deferred_where_a_second_graph_does_not_fit(tmp_path, monkeypatch):
    """Where the process has no room for a private copy of the graph (a split adds a node to it beside the one the
    open index searches), the merge leaves the oversized lists whole and says so; they still hold every vector."""
    from fusionrag.retriever.engine import merge

    base = clustered(1200, DIM, 30, seed=1)
    Index.build(base, tmp_path / "g1", BuildConfig(), progress=False)
    old = Index.open(tmp_path / "g1")
    rng = np.random.default_rng(2)
    new = (base[7] + 0.3 * rng.standard_normal((900, DIM))).astype(np.float32)  # crowds one region: lists split
    dead = np.zeros(len(base), bool)
    assert merge_index(old, dead, new, tmp_path / "split", BuildConfig()).splits > 0
    monkeypatch.setattr(merge, "_room_for_graph", lambda graph_file: False)
    stats = merge_index(old, dead, new, tmp_path / "g2", BuildConfig())
    assert stats.splits == 0 and stats.splits_deferred > 0
    idx = Index.open(tmp_path / "g2")
    assert idx.manifest["merge"]["splits_deferred"] == stats.splits_deferred
    # The postings they hold, counted from the written lists: every list past the split bound.
    sizes = np.diff(np.load(tmp_path / "g2" / "list_offsets.npy"))
    bound = max(16, int(2 * BuildConfig().max_list_factor * old.manifest["postings"] / old.manifest["centroids"]))
    assert stats.unsplit_postings == int(sizes[sizes > bound].sum()) > 0
    assert idx.manifest["merge"]["unsplit_postings"] == stats.unsplit_postings
    assert idx.manifest["centroids"] == old.manifest["centroids"]
    vecs = np.concatenate([base, new])
    q = (base[7] + 0.3 * rng.standard_normal((20, DIM))).astype(np.float32)
    truth = exact_knn(vecs, q, 10, "l2")
    assert recall(idx.search(q, 10, nprobe=10**6, rerank=10**4, beta=0).ids, truth) == 1.0


def test_lists_left_unsplit_past_their_share_make_the_next_merge_a_rebuild(tmp_path, monkeypatch):
    """Under a memory limit a merge may leave oversized lists whole (no room for the graph's second copy): once
    those hold more than rebuild_unsplit_share of the postings, the next merge rebuilds (a full build: its lists
    within the bound again) rather than grow the index further; below the share it grows it."""
    from fusionrag.retriever.engine import merge

    monkeypatch.setattr(merge, "_room_for_graph", lambda graph_file: False)
    cfg = CollectionConfig(min_index_count=200, background_merge=False, rebuild_unsplit_share=0.05)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("c", DIM, "l2")
    base = clustered(1200, DIM, 30, seed=1)
    col.add([Document(str(i), None, v) for i, v in enumerate(base)])
    col.merge()  # the first: a full build
    manifest = lambda: col._main.index.manifest  # noqa: E731
    rng = np.random.default_rng(2)
    near = lambda n: (base[7] + 0.3 * rng.standard_normal((n, DIM))).astype(np.float32)  # noqa: E731
    col.add([Document(f"a{i}", None, v) for i, v in enumerate(near(20))])
    col.merge()  # grown: too few crowd in to make a list oversized
    m = manifest()["merge"]
    assert m["added"] == 20 and m["unsplit_postings"] <= 0.05 * manifest()["postings"]
    col.add([Document(f"b{i}", None, v) for i, v in enumerate(near(900))])
    col.merge()  # grown again, its crowded lists left whole
    m = manifest()["merge"]
    assert m["added"] == 900 and m["splits"] == 0 and m["splits_deferred"] > 0
    assert m["unsplit_postings"] > 0.05 * manifest()["postings"]
    last = near(1)[0]
    col.add([Document("c0", None, last)])
    col.merge()  # rebuilt
    assert "merge" not in manifest() and manifest()["count"] == 1200 + 20 + 900 + 1
    sizes = np.diff(np.load(col._main.index.path / "list_offsets.npy"))
    assert sizes.max() <= max(16, 2 * BuildConfig().max_list_factor * sizes.mean())
    assert col.search(last[None], k=1).hits[0][0].id == "c0"
    cat.close()


def test_a_rebuild_cut_short_resumes_from_its_last_finished_step(tmp_path, monkeypatch):
    """#51: a merge that rebuilds (here the first, nothing indexed yet) and fails or is killed after its build's
    first steps keeps them in the next generation's directory, through a reopen, and the next merge of the same
    vectors resumes there (its manifest's build_resumed) and answers as a whole build does; written to since, it
    starts over."""
    import fusionrag.retriever.engine.build as build

    cfg = CollectionConfig(min_index_count=200, background_merge=False)
    cat = Catalog(tmp_path, collection_config=cfg)
    col = cat.create("c", DIM, "l2")
    x = clustered(1500, DIM, 30, seed=8)
    col.add([Document(str(i), None, v) for i, v in enumerate(x[:1200])])
    real = build.write_pages

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(build, "write_pages", full_disk)
    with pytest.raises(OSError):
        col.merge()
    monkeypatch.setattr(build, "write_pages", real)
    partial = tmp_path / "collections" / "c" / "gen-000001" / ".index.partial"
    steps = set(json.loads((partial / "build_state.json").read_text())["steps"])
    assert {"clustering", "graph", "pq training", "assigning"} <= steps
    cat.close()

    cat = Catalog(tmp_path, collection_config=cfg)  # the open keeps the rebuild's finished steps
    col = cat.get("c")
    assert (partial / "build_state.json").is_file() and col._main.index is None
    col.merge()
    m = col._main.index.manifest
    assert set(m["build_resumed"]) == steps and not partial.exists()
    q = clustered(20, DIM, 30, seed=9)
    res = col.search(q, k=10, params=SearchParams(nprobe=10**6, rerank=10**4, beta=0))
    found = np.array([[int(h.id) for h in hits] for hits in res.hits])
    assert (found == exact_knn(x[:1200], q, 10, "l2")).all()

    # Cut short again, then written to: the vectors differ, so the rebuild starts over.
    col.add([Document(str(i), None, v) for i, v in enumerate(x[1200:], 1200)])
    col.delete([str(i) for i in range(0, 1200, 3)])
    cat.close()
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=200, background_merge=False,
                                                               incremental_merge=False))
    col = cat.get("c")
    monkeypatch.setattr(build, "write_pages", full_disk)
    with pytest.raises(OSError):
        col.merge()
    monkeypatch.setattr(build, "write_pages", real)
    col.add([Document("extra", None, x[0] + 0.5)])
    col.merge()
    m = col._main.index.manifest
    assert not m.get("build_resumed") and m["count"] == 1500 - 400 + 1
    alive = np.setdiff1d(np.arange(1500), np.arange(0, 1200, 3))
    vecs = np.vstack([x[alive], x[0] + 0.5])
    names = [str(i) for i in alive] + ["extra"]
    res = col.search(q, k=10, params=SearchParams(nprobe=10**6, rerank=10**4, beta=0))
    assert [[h.id for h in hits] for hits in res.hits] == [[names[j] for j in row]
                                                            for row in exact_knn(vecs, q, 10, "l2")]
    cat.close()
