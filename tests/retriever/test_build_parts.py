"""The build's pure-Python parts: k-means, PQ, the page layout, the manifest."""

import json

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.engine.kmeans import assign, hierarchical_balanced_kmeans, kmeans
from fusionrag.retriever.engine.layout import PAGE, block_shape, chain_order, plan_layout
from fusionrag.retriever.engine.manifest import FORMAT_VERSION, read_manifest, writing_index
from fusionrag.retriever.engine.pq import ProductQuantizer, auto_m
from fusionrag.retriever.errors import IndexFormatError


def test_balanced_kmeans_caps_cluster_size():
    x = np.random.default_rng(0).standard_normal((4000, 16)).astype(np.float32)
    _, labels = kmeans(x, 8, 10, np.random.default_rng(1), balance=0.25)
    sizes = np.bincount(labels, minlength=8)
    assert sizes.sum() == 4000 and sizes.max() <= np.ceil(4000 / 8 * 1.25)


def test_kmeans_finds_separated_clusters():
    x = clustered(3000, 8, 5, seed=3, spread=0.01)
    centers, labels = kmeans(x, 5, 20, np.random.default_rng(0))
    # Every true cluster maps to exactly one label.
    truth = assign(x, centers)[0]
    assert len(np.unique(labels)) == 5 and np.array_equal(truth, labels)


@pytest.mark.parametrize("n", [1, 15, 5000])
def test_hierarchical_lists_are_bounded(n):
    x = clustered(n, 12, 20, seed=n)
    leaves = []
    cents = hierarchical_balanced_kmeans(lambda ids: x[ids], n, 10, 20, 16, 10, np.random.default_rng(0),
                                         progress=leaves.append)
    # Each list is a leaf of at most max_size = 20 vectors, the leaves partition the data, and there
    # are about n/10 of them; each centroid is the mean of its leaf, so it lies inside the data's box.
    assert len(leaves) == len(cents) and sum(leaves) == n
    assert max(leaves) <= 20 if n > 20 else leaves == [n]
    assert len(cents) >= max(1, n // 20) and len(cents) <= max(1, n // 4)
    assert np.all(cents >= x.min(0) - 1e-5) and np.all(cents <= x.max(0) + 1e-5)
    # Measured apart from the build's own report: reassigned to their nearest centroid, as the lists are
    # filled, the vectors keep every list near that bound (leaves are Voronoi-ish; up to 23 seen here).
    labels, _ = assign(x, cents)
    assert np.bincount(labels, minlength=len(cents)).max() <= 2 * 20 or n <= 20


def test_hierarchical_handles_identical_points():
    x = np.ones((500, 4), np.float32)
    cents = hierarchical_balanced_kmeans(lambda ids: x[ids], 500, 10, 20, 16, 5, np.random.default_rng(0))
    assert len(cents) >= 25


def test_pq_round_trip_and_luts():
    rng = np.random.default_rng(0)
    x = clustered(3000, 30, 40, seed=1)
    pq = ProductQuantizer.train(x, 8, 10, rng)  # 30 dims -> 8 x 4, zero-padded
    assert pq.codebooks.shape == (8, 256, 4)
    codes = pq.encode(x)
    err = np.mean(np.sum((pq.decode(codes) - x) ** 2, axis=1)) / np.mean(np.sum(x**2, axis=1))
    assert err < 0.05
    q = x[:5] + 0.01
    for metric in ("l2", "ip"):
        lut = pq.luts(q, metric)
        adc = lut[:, np.arange(8)[None, :], codes[:50].astype(int)].sum(-1)  # (5, 50)
        approx = pq.decode(codes[:50])
        ref = ((q[:, None] - approx[None]) ** 2).sum(-1) if metric == "l2" else -(q @ approx.T)
        np.testing.assert_allclose(adc, ref, rtol=1e-4, atol=1e-3)


def test_auto_m():
    assert auto_m(128) == 64 and auto_m(50) == 25 and auto_m(784) == 64 and auto_m(12) == 8 and auto_m(4) == 4


@pytest.mark.parametrize("record_bytes", [200, 512, 784, 4096, 6144])
def test_layout_invariants(record_bytes):
    rng = np.random.default_rng(record_bytes)
    buckets = 300
    bucket_of = rng.integers(buckets, size=5000)
    layout, slots = plan_layout(bucket_of, buckets, record_bytes)
    per_block, pages = block_shape(record_bytes)
    assert layout.records_per_block == per_block and layout.pages_per_block == pages
    assert per_block * record_bytes <= pages * PAGE
    # Each vector exactly once, every slot inside the file.
    assert len(np.unique(slots)) == len(slots)
    assert slots.max() < layout.num_blocks * per_block
    # A bucket occupies whole blocks of its own plus at most one shared block.
    blocks = slots // per_block
    for b in range(0, buckets, 17):
        mine = blocks[bucket_of == b]
        full = np.sum(bucket_of == b) // per_block
        assert len(np.unique(mine)) <= full + 1
    # No empty block, and best-fit decreasing stays within its bound of 11/9 of the fewest
    # shared blocks possible (plus one).
    used = np.bincount(blocks, minlength=layout.num_blocks)
    counts = np.bincount(bucket_of, minlength=buckets)
    full_blocks, rest = int(np.sum(counts // per_block)), counts % per_block
    assert used.min() >= 1
    assert layout.num_blocks - full_blocks <= 11 / 9 * np.ceil(rest.sum() / per_block) + 1


def test_chain_order_puts_near_vectors_on_one_page():
    """Each bucket is a nearest-neighbour chain: the same slots as id order, but records that
    share a block are nearer each other than in id order."""
    rng = np.random.default_rng(1)
    buckets, dim, record_bytes = 200, 8, 1024  # 4 records per block
    centers = rng.standard_normal((buckets, dim)).astype(np.float32) * 10
    bucket_of = np.concatenate([rng.integers(buckets, size=6000), np.arange(buckets)])  # every bucket used
    # Each bucket holds a few tight groups, as a posting list of real data holds near-duplicates.
    groups = centers[:, None] + rng.standard_normal((buckets, 6, dim)).astype(np.float32) * 3
    x = (groups[bucket_of, rng.integers(6, size=len(bucket_of))]
         + 0.3 * rng.standard_normal((len(bucket_of), dim))).astype(np.float32)
    order = chain_order(bucket_of, buckets, centers, lambda ids: x[ids], chunk_floats=5000)  # many chunks
    assert np.array_equal(np.sort(order), np.arange(len(x))) and np.all(np.diff(bucket_of[order]) >= 0)
    # A chain starts at its bucket's vector nearest the center and steps to the nearest unplaced one.
    first = order[np.searchsorted(bucket_of[order], 7)]
    mine = np.flatnonzero(bucket_of == 7)
    assert first == mine[((x[mine] - centers[7]) ** 2).sum(1).argmin()]
    chained = order[bucket_of[order] == 7]
    for t in range(len(chained) - 1):
        a, rest = chained[t], chained[t + 1:]
        assert ((x[chained[t + 1]] - x[a]) ** 2).sum() == ((x[rest] - x[a]) ** 2).sum(1).min()
    by_id, slots_id = plan_layout(bucket_of, buckets, record_bytes)
    by_chain, slots_chain = plan_layout(bucket_of, buckets, record_bytes, order)
    assert by_id == by_chain
    for b in range(buckets):  # a bucket keeps its slots; only who sits where changes
        assert set(slots_id[bucket_of == b]) == set(slots_chain[bucket_of == b])

    def mean_mate_distance(slots):  # over the blocks a bucket has to itself
        block = slots // by_id.records_per_block
        total, pairs = 0.0, 0
        for blk in np.unique(block):
            ids = np.flatnonzero(block == blk)
            if len(ids) > 1 and len(np.unique(bucket_of[ids])) == 1:
                diff = x[ids][:, None] - x[ids][None]
                total += (diff ** 2).sum() / 2
                pairs += len(ids) * (len(ids) - 1) // 2
        return total / pairs

    near, far = mean_mate_distance(slots_chain), mean_mate_distance(slots_id)
    assert near < 0.5 * far
    with pytest.raises(ValueError, match="grouped by bucket"):
        plan_layout(bucket_of, buckets, record_bytes, order[::-1])
    with pytest.raises(ValueError, match="grouped by bucket"):
        plan_layout(bucket_of, buckets, record_bytes, order[:-1])
    twice = order.copy()
    twice[1] = twice[0]  # same bucket, one id twice and one missing
    assert bucket_of[order[0]] == bucket_of[order[1]]
    with pytest.raises(ValueError, match="every id once"):
        plan_layout(bucket_of, buckets, record_bytes, twice)


def test_manifest_publish_and_checks(tmp_path):
    target = tmp_path / "idx"
    with writing_index(target) as w:
        w.save_array("a.npy", np.arange(10))
        w.publish({"count": 10})
    m = read_manifest(target)
    assert m["format_version"] == FORMAT_VERSION and "a.npy" in m["files"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".idx")]  # no temp dir left

    # A failed build leaves nothing behind, and the old index stays.
    with pytest.raises(RuntimeError):
        with writing_index(target, overwrite=True) as w:
            w.save_array("a.npy", np.arange(3))
            raise RuntimeError("crash mid-build")
    assert read_manifest(target)["count"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]
    with pytest.raises(FileExistsError):
        writing_index(target).__enter__()

    raw = bytearray((target / "a.npy").read_bytes())
    raw[-1] ^= 0xFF
    (target / "a.npy").write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match="checksum mismatch"):
        read_manifest(target)
    (target / "a.npy").write_bytes(bytes(raw[:-1]))
    with pytest.raises(IndexFormatError, match="truncated"):
        read_manifest(target)

    m = json.loads((target / "manifest.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (target / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="newer than this fusionrag supports"):
        read_manifest(target)
    (target / "manifest.json").write_text("{not json")
    with pytest.raises(IndexFormatError, match="unreadable manifest"):
        read_manifest(target)
    (target / "manifest.json").unlink()
    with pytest.raises(IndexFormatError, match="no manifest.json"):
        read_manifest(target)


def test_a_top_cluster_past_its_cap_is_split_again_before_it_is_read_whole(tmp_path, monkeypatch):
    """Nine rows in ten round three tight centres: the sample's balanced top clusters leave the nearest-centre
    pass parts far past the cap. No cluster is read whole (handed to the in-memory split) past the cap, the
    clusters read whole partition the rows, the lists stay bounded, and centroids written to a file are the same."""
    from fusionrag.retriever.engine import kmeans as km
    rng = np.random.default_rng(3)
    x = np.concatenate([clustered(4500, 8, 3, seed=4, spread=0.05), clustered(500, 8, 20, seed=5)])
    x = x[rng.permutation(len(x))]
    cap, whole, leaves = 400, [], []
    split = km._split
    monkeypatch.setattr(km, "_split", lambda c, *a: (whole.append(len(c)), split(c, *a)))
    plain = km.hierarchical_balanced_kmeans(lambda ids: x[ids], len(x), 10, 20, 16, 5, np.random.default_rng(0),
                                            progress=leaves.append)
    assert max(whole) > cap  # without the cap, the pass leaves clusters past it
    whole.clear(), leaves.clear()
    cents = km.hierarchical_balanced_kmeans(lambda ids: x[ids], len(x), 10, 20, 16, 5, np.random.default_rng(0),
                                            progress=leaves.append, top_cluster_cap=cap)
    assert max(whole) <= cap and sum(whole) == len(x)
    assert sum(leaves) == len(x) and max(leaves) <= 20 and abs(len(cents) - len(plain)) < len(plain) // 5
    assert np.bincount(assign(x, cents)[0], minlength=len(cents)).max() <= 2 * 20
    spilled = km.hierarchical_balanced_kmeans(lambda ids: x[ids], len(x), 10, 20, 16, 5, np.random.default_rng(0),
                                              top_cluster_cap=cap, out=tmp_path / "c.f32")
    assert isinstance(spilled, np.memmap) and np.array_equal(spilled, cents)


def test_spilled_parts_give_the_same_centroids_read_in_order_and_leave_no_file(tmp_path):
    """With spill, every streaming pass (nested ones too: the tight centres leave parts past the cap) writes its
    parts' rows to files of their own and later reads a part from its file, never gathering it from the source:
    the same centroids as without, no source read but in runs of consecutive rows after the samples, and no file
    left behind."""
    from fusionrag.retriever.engine import kmeans as km
    rng = np.random.default_rng(3)
    x = np.concatenate([clustered(4500, 8, 3, seed=4, spread=0.05), clustered(500, 8, 20, seed=5)])
    x = x[rng.permutation(len(x))]
    asked: list[np.ndarray] = []

    def rows(ids):
        asked.append(np.asarray(ids))
        return x[ids]

    want = km.hierarchical_balanced_kmeans(lambda ids: x[ids], len(x), 10, 20, 16, 5, np.random.default_rng(0),
                                           top_cluster_cap=400)
    got = km.hierarchical_balanced_kmeans(rows, len(x), 10, 20, 16, 5, np.random.default_rng(0), top_cluster_cap=400,
                                          spill=tmp_path / "spill")
    assert np.array_equal(got, want)
    runs = [a for a in asked if len(a) > 1 and np.all(np.diff(a) == 1)]
    scattered = [a for a in asked if not (len(a) > 1 and np.all(np.diff(a) == 1))]
    assert sum(len(a) for a in runs) == len(x)  # one pass over the source, in runs
    assert len(scattered) == 1 and len(scattered[0]) <= 256 * 16  # the top level's sample alone
    assert list((tmp_path / "spill").iterdir()) == []


def test_a_bucket_longer_than_a_chunk_is_chained_in_pieces_within_the_chunk():
    """#51: a bucket of 6,000 vectors, chained whole, held three (6000, 6000) float32 temporaries (430 MB; a
    10M build's longest lists would need several GB). With chunk_floats 1<<16 it is cut into pieces of at most
    256 along its principal directions: every id placed once, the memory the chaining allocates (tracemalloc,
    which counts numpy's buffers) far below one whole matrix, and consecutive records still near each other:
    their mean distance within a tenth of the whole chain's (7.8 against 7.1 here; 14.7 in id order)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    dim = 16
    x = (rng.standard_normal((6000, dim)) * np.linspace(1, 4, dim)).astype(np.float32)
    small = rng.standard_normal((400, dim)).astype(np.float32) + 20  # buckets of 4 beside it, chained as before
    x = np.concatenate([x, small])
    bucket_of = np.concatenate([np.zeros(6000, np.int64), 1 + np.arange(400) // 4])
    centers = np.stack([x[bucket_of == b].mean(0) for b in range(101)])
    tracemalloc.start()
    order = chain_order(bucket_of, 101, centers, lambda ids: x[ids], chunk_floats=1 << 16)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert np.array_equal(np.sort(order), np.arange(len(x))) and np.all(np.diff(bucket_of[order]) >= 0)
    assert peak < 6000 * 6000 * 4 / 8
    big = x[order[:6000]]
    step = np.sqrt(((big[1:] - big[:-1]) ** 2).sum(1)).mean()
    by_id = np.sqrt(((x[1:6000] - x[:5999]) ** 2).sum(1)).mean()
    whole = chain_order(bucket_of, 101, centers, lambda ids: x[ids], chunk_floats=1 << 26)[:6000]
    assert step < 1.1 * np.sqrt(((x[whole[1:]] - x[whole[:-1]]) ** 2).sum(1)).mean() and step < 0.6 * by_id


@pytest.mark.parametrize("how", ["one leaf", "in memory", "capped", "spilled"])
def test_each_rows_leaf_is_the_part_whose_mean_is_its_centroid(tmp_path, how):
    """leaf_of records the leaf every row fell in: each centroid is the mean of the rows given its number (checked
    against the rows themselves, not the clustering's bookkeeping), every leaf has rows, and none has more than
    max_size, whether the clustering runs in memory, with a cap on its top-level clusters, or spilling them."""
    from fusionrag.retriever.engine import kmeans as km
    rng = np.random.default_rng(3)
    x = np.concatenate([clustered(4500, 8, 3, seed=4, spread=0.05), clustered(500, 8, 20, seed=5)])
    x = x[rng.permutation(len(x))]
    n = 15 if how == "one leaf" else len(x)
    leaf_of = np.full(n, -1, np.int32)
    extra = {"capped": {"top_cluster_cap": 400},
             "spilled": {"top_cluster_cap": 400, "spill": tmp_path / "spill", "out": tmp_path / "c.f32"}}.get(how, {})
    cents = km.hierarchical_balanced_kmeans(lambda ids: x[ids], n, 10, 20, 16, 5, np.random.default_rng(0),
                                            leaf_of=leaf_of, **extra)
    sizes = np.bincount(leaf_of, minlength=len(cents))
    assert leaf_of.min() == 0 and len(sizes) == len(cents) and sizes.min() >= 1
    assert sizes.max() <= (n if how == "one leaf" else 20)
    means = np.stack([x[:n][leaf_of == j].mean(0) for j in range(len(cents))])
    np.testing.assert_allclose(cents, means, atol=1e-5)


def test_rows_start_their_list_search_at_their_leaf_and_find_their_nearest_list():
    """Far-apart clusters of data (1,000 centres in 128-d), ~3,400 lists: a search from the graph's entry point at
    the build's beam ends in another cluster for some rows, which then all join the few lists it ends at (the
    hub lists of bench/peers/scale_lists). Started at their leaf of the clustering, rows land in their nearest
    list, by exact distance in numpy, and no list swells."""
    from fusionrag.native import Graph
    from fusionrag.retriever.engine.build import assign_rows, nearest_rows
    from fusionrag.retriever.engine.config import BuildConfig

    n, dim = 40_000, 128
    c = np.random.default_rng(5).standard_normal((1000, dim)).astype(np.float32)
    r = np.random.default_rng(7)
    x = c[r.integers(0, 1000, n)] + 0.3 * r.standard_normal((n, dim), dtype=np.float32)
    leaf = np.full(n, -1, np.int32)
    cents = np.ascontiguousarray(hierarchical_balanced_kmeans(lambda i: x[i], n, 10, 40, 16, 10,
                                                              np.random.default_rng(0), leaf_of=leaf))
    graph = Graph(dim, "l2", 16, 200, 0)
    graph.add(cents, 1)
    pq = ProductQuantizer.train(x[:5000], 8, 5, np.random.default_rng(0))
    nearest = nearest_rows(x, cents, 1)[0][:, 0]
    ids = np.arange(n)
    plain, plain_lists, _, _ = assign_rows(graph, pq, ids, x, BuildConfig(), 2)
    started, lists, members, codes = assign_rows(graph, pq, ids, x, BuildConfig(), 2, leaves=leaf)
    assert np.mean(plain == nearest) < 0.97 and np.bincount(plain_lists).max() > 500  # the data loses searches
    assert np.mean(started == nearest) >= 0.995 and np.bincount(lists).max() <= 2 * 40
    assert np.array_equal(codes, pq.encode(x)) and set(np.unique(members)) == set(ids)


def test_a_merges_new_rows_start_at_a_sampled_centroid_and_find_their_nearest_list(tmp_path):
    """A merge's new rows have no leaf of the clustering: on far-apart clusters (1,000 centres in 128-d, ~3,400
    lists) a search from the graph's entry point at the merge's beam ends in another cluster for some of them.
    Started at the nearest of the centroids sampled evenly over the graph (merge._entry_sample, read from the graph
    file as a merge reads them), they land in their nearest list, by exact distance in numpy."""
    from fusionrag.native import Graph
    from fusionrag.retriever.engine import merge
    from fusionrag.retriever.engine.build import nearest_rows

    n, dim = 40_000, 128
    c = np.random.default_rng(5).standard_normal((1000, dim)).astype(np.float32)
    r = np.random.default_rng(7)
    x = c[r.integers(0, 1000, n)] + 0.3 * r.standard_normal((n, dim), dtype=np.float32)
    cents = np.ascontiguousarray(hierarchical_balanced_kmeans(lambda i: x[i], n, 10, 40, 16, 10,
                                                              np.random.default_rng(0), leaf_of=np.full(n, -1, np.int32)))
    graph = Graph(dim, "l2", 16, 200, 0)
    graph.add(cents, 1)
    graph.save(str(tmp_path / "graph.bin"))
    mapped = merge._Centroids(tmp_path / "graph.bin", dim)
    new = (c[r.integers(0, 1000, 10_000)] + 0.3 * r.standard_normal((10_000, dim), dtype=np.float32))
    nearest = nearest_rows(new, cents, 1)[0][:, 0]
    entry = merge._entry_sample(mapped)
    assert len(entry[0]) == min(len(cents), merge._ENTRY_SAMPLE) and np.array_equal(entry[1], cents[entry[0]])
    plain = merge._nearest(new, mapped, graph, "l2", 8, 2, False)[0][:, 0]
    started = merge._nearest(new, mapped, graph, "l2", 8, 2, False, entry)[0][:, 0]
    assert np.mean(plain == nearest) < 0.99 and np.mean(started == nearest) >= 0.995
