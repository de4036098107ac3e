"""Heuristic re-ranking (FusionANNS Algorithm 1) on the page store."""

import numpy as np
import pytest
from conftest import status_bytes
from threads import run_threads

from fusionrag import native

NP_DTYPE = {"f32": np.float32, "u8": np.uint8, "i8": np.int8}


def make_store(tmp_path, vectors, dtype, buffer_blocks=256, spread=2, seed=0, **kw):
    """Writes vectors to a page file at shuffled, sparse slots; returns (store, locations)."""
    n, dim = vectors.shape
    rng = np.random.default_rng(seed)
    slots = np.sort(rng.choice(spread * n, n, replace=False)).astype(np.uint32)
    owner = rng.permutation(n)  # slot order is not id order, as after bucketing
    locations = np.empty(n, np.uint32)
    locations[owner] = slots
    records = np.ascontiguousarray(vectors[owner].astype(NP_DTYPE[dtype])).view(np.uint8)
    record_bytes = records.shape[1]
    rpb, ppb = native.page_layout(record_bytes)
    path = tmp_path / f"vectors-{dtype}-{seed}.pages"
    w = native.PageWriter(str(path), record_bytes, rpb, ppb)
    w.write(slots, records)
    store = native.PageStore(str(path), record_bytes, rpb, ppb, w.close(), buffer_blocks, **kw)
    return store, locations


def brute_force(queries, vectors, metric, k, ids=None):
    x = vectors.astype(np.float64)
    q = queries.astype(np.float64)
    if metric == "l2":
        d = ((q[:, None, :] - x[None]) ** 2).sum(-1)
    else:
        d = -(q @ x.T)
    if ids is not None:
        mask = np.full(d.shape, np.inf)
        np.put_along_axis(mask, ids, 0, 1)
        d = d + mask
    order = np.lexsort((np.broadcast_to(np.arange(d.shape[1]), d.shape), d), axis=1)[:, :k]
    return order, np.take_along_axis(d, order, 1)


def random_vectors(rng, dtype, n, dim):
    if dtype == "f32":
        return rng.standard_normal((n, dim)).astype(np.float32)
    lo, hi = (0, 256) if dtype == "u8" else (-128, 128)
    return rng.integers(lo, hi, (n, dim)).astype(NP_DTYPE[dtype])


@pytest.mark.parametrize("dtype", ["f32", "u8", "i8"])
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_full_rerank_equals_brute_force(tmp_path, dtype, metric):
    rng = np.random.default_rng(7)
    n, dim, k = 2000, 37, 10  # odd dim exercises the loop tails
    vectors = random_vectors(rng, dtype, n, dim)
    # Integer queries keep integer data exact, so ties are real and resolved by id.
    queries = (rng.standard_normal((6, dim)) * 20).round().astype(np.float32)
    if dtype == "f32":
        queries /= 20
    store, locations = make_store(tmp_path, vectors, dtype)
    cand = np.stack([rng.permutation(n) for _ in range(len(queries))]).astype(np.int64)
    cand[3, 1500:] = -1  # a padded row: only its first 1500 candidates count
    ids, dists, stats, seconds = native.rerank(
        store, queries, cand, locations, dtype, metric, k, minibatch=64, eps=0.0, beta=0
    )
    assert ids.shape == (6, k) and ids.dtype == np.int64 and dists.dtype == np.float32
    assert stats.shape == (6, 7) and seconds.shape == (6,) and (seconds > 0).all()
    for i in range(len(queries)):
        row = cand[i][cand[i] >= 0]
        want_ids, want_d = brute_force(queries[i : i + 1], vectors, metric, k, ids=row[None])
        assert np.array_equal(ids[i], want_ids[0]), i
        np.testing.assert_allclose(dists[i], want_d[0], rtol=1e-5, atol=1e-3)
        assert stats[i, 1] == len(row) and stats[i, 0] == -(-len(row) // 64)


def test_fewer_candidates_than_k(tmp_path):
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((50, 8)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32")
    cand = np.array([[4, 9, 2, -1, -1, -1]], np.int64)
    ids, dists, stats, _ = native.rerank(store, vectors[:1], cand, locations, "f32", "l2", 5, 2, 0.0, 0)
    want, _ = brute_force(vectors[:1], vectors, "l2", 3, ids=cand[:, :3])
    assert np.array_equal(ids[0, :3], want[0])
    assert np.array_equal(ids[0, 3:], [-1, -1]) and np.isinf(dists[0, 3:]).all()
    assert stats[0, :2].tolist() == [2, 3]


def ranked_store(tmp_path, n=200, dim=16):
    """Vector i sits at distance i^2 from the zero query (l2), so the rank of an id is the id."""
    vectors = np.zeros((n, dim), np.float32)
    vectors[:, 0] = np.arange(n)
    store, locations = make_store(tmp_path, vectors, "f32")
    return store, locations, np.zeros((1, dim), np.float32)


def run(store, locations, query, order, k, minibatch, eps, beta):
    cand = np.asarray(order, np.int64)[None]
    return native.rerank(store, query, cand, locations, "f32", "l2", k, minibatch, eps, beta)


def test_early_stop_after_stable_batches(tmp_path):
    store, locations, q = ranked_store(tmp_path)
    order = np.arange(100)  # the true top-5 all in the first mini-batch of 10
    for beta, batches in [(2, 3), (1, 2), (4, 5)]:
        ids, _, stats, _ = run(store, locations, q, order, 5, 10, 0.0, beta)
        assert stats[0, 0] == batches and stats[0, 1] == 10 * batches
        assert ids[0].tolist() == [0, 1, 2, 3, 4]
    _, _, stats, _ = run(store, locations, q, order, 5, 10, 0.0, 0)
    assert stats[0, 0] == 10  # beta <= 0: no early stop


def test_no_early_stop_while_topk_changes(tmp_path):
    store, locations, q = ranked_store(tmp_path)
    order = np.arange(100)[::-1]  # every mini-batch replaces the whole top-k
    ids, _, stats, _ = run(store, locations, q, order, 5, 5, 0.5, 1)
    assert stats[0, 0] == 20 and stats[0, 1] == 100
    assert ids[0].tolist() == [0, 1, 2, 3, 4]


def test_eps_tolerates_partial_change(tmp_path):
    store, locations, q = ranked_store(tmp_path)
    # Batch 1 holds ranks 0..8 and 10; batch 2 brings rank 9, which pushes out 10
    # (Delta = 1/10); batch 3 changes nothing.
    order = [*range(9), 10] + [9, *range(11, 20)] + list(range(20, 30))
    _, _, stats, _ = run(store, locations, q, order, 10, 10, 0.1, 1)
    assert stats[0, 0] == 2
    _, _, stats, _ = run(store, locations, q, order, 10, 10, 0.05, 1)
    assert stats[0, 0] == 3
    _, _, stats, _ = run(store, locations, q, order, 10, 10, 0.1, 2)
    assert stats[0, 0] == 3


def test_block_stats(tmp_path):
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((300, 100)).astype(np.float32)  # 10 records a block
    for buffer_blocks in (0, 64):
        store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=buffer_blocks, spread=1)
        block = locations // 10
        a, b = np.flatnonzero(block == 3)[:2]  # two ids on one block
        c = np.flatnonzero(block == 7)[0]
        cand = np.array([[a, b, c]], np.int64)
        _, _, stats, _ = native.rerank(store, vectors[:1], cand, locations, "f32", "l2", 2, 3, 0.0, 0)
        assert stats[0].tolist() == [1, 3, 2, 0, 0, 0, 0]
        assert store.stats()["read_calls"] == 1
        _, _, stats, _ = native.rerank(store, vectors[:1], cand, locations, "f32", "l2", 2, 3, 0.0, 0)
        assert stats[0].tolist() == ([1, 3, 2, 0, 0, 0, 0] if buffer_blocks == 0 else [1, 3, 0, 2, 0, 0, 0])


def test_backends_and_threads_agree(tmp_path):
    rng = np.random.default_rng(5)
    vectors = rng.integers(0, 256, (3000, 64)).astype(np.uint8)
    queries = rng.integers(0, 256, (16, 64)).astype(np.float32)
    d = ((queries[:, None, :] - vectors[None].astype(np.float32)) ** 2).sum(-1)
    # A PQ-like candidate order: roughly right, with noise.
    cand = np.argsort(d * rng.uniform(0.8, 1.2, d.shape), 1)[:, :200].astype(np.int64)
    results = []
    for backend in ("io_uring", "pread"):
        try:
            store, locations = make_store(tmp_path, vectors, "u8", buffer_blocks=64, io_backend=backend)
        except OSError as e:
            pytest.skip(f"{backend} not available: {e}")
        for threads in (1, 2):
            store.reset_buffer()
            results.append(native.rerank(store, queries, cand, locations, "u8", "l2", 10, 32, 0.0, 3, threads))
    for ids, dists, stats, _ in results[1:]:
        assert np.array_equal(ids, results[0][0]) and np.array_equal(dists, results[0][1])
        assert np.array_equal(stats[:, :2], results[0][2][:, :2])


def test_concurrent_calls_on_kept_scratch_answer_as_alone(tmp_path):
    """Re-rank calls share scratch kept between calls (a pool): calls from eight threads at once, on two stores,
    with and without read-ahead, page-mates and a record cache, each answer exactly as the same call alone."""
    rng = np.random.default_rng(12)
    vectors = rng.standard_normal((2000, 96)).astype(np.float32)
    queries = rng.standard_normal((24, 96)).astype(np.float32)
    d = ((queries[:, None, :] - vectors[None]) ** 2).sum(-1)
    cand = np.argsort(d * rng.uniform(0.8, 1.2, d.shape), 1)[:, :150].astype(np.int64)
    stores = [make_store(tmp_path, vectors, "f32", buffer_blocks=0, seed=0, io_backend="pread"),
              make_store(tmp_path, vectors, "f32", buffer_blocks=0, seed=1, io_backend="pread", record_cache=400)]
    calls = [(s, prefetch, mates, minibatch) for s in (0, 1) for prefetch in (False, True) for mates in (False, True)
             for minibatch in (4, 16)]

    def call(c):
        (store, locations), prefetch, mates, minibatch = stores[c[0]], c[1], c[2], c[3]
        ids, dists, _, _ = native.rerank(store, queries, cand, locations, "f32", "l2", 10, minibatch, 0.0, 2,
                                         num_threads=2, prefetch=prefetch, page_mates=mates)
        return ids, dists

    want = [call(c) for c in calls]
    got = {}

    def worker(w):
        for r in range(3):
            for i in range(w, len(calls), 8):
                got[(i, r)] = call(calls[i])

    errors = run_threads(worker, range(8))
    assert not errors, errors
    assert len(got) == 3 * len(calls)
    for (i, _), (ids, dists) in got.items():
        np.testing.assert_array_equal(ids, want[i][0], err_msg=str(calls[i]))
        np.testing.assert_array_equal(dists, want[i][1], err_msg=str(calls[i]))


def test_exact_distances(tmp_path):
    rng = np.random.default_rng(9)
    vectors = random_vectors(rng, "i8", 500, 1100)  # 1100-byte records: 3 a block
    queries = rng.standard_normal((3, 1100)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "i8")
    ids = rng.integers(0, 500, (3, 150))
    ids[1, 7] = ids[2, 149] = -1
    got = native.exact_distances(store, queries, ids, locations, "i8", "ip")
    want = -(queries.astype(np.float64)[:, None, :] * vectors[ids].astype(np.float64)).sum(-1)
    want[ids < 0] = np.inf
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", ["f32", "u8", "i8"])
@pytest.mark.parametrize("dim", [1, 7, 96, 100, 385])
def test_exact_distances_match_float64(tmp_path, dtype, dim):
    """The re-rank's kernels (each dimension count takes a different path through the lanes and
    the tail, on whichever build the CPU picks) against numpy in float64, for both metrics."""
    rng = np.random.default_rng(dim)
    vectors = random_vectors(rng, dtype, 300, dim)
    queries = rng.standard_normal((4, dim)).astype(np.float32) * (1 if dtype == "f32" else 50)
    store, locations = make_store(tmp_path, vectors, dtype)
    ids = np.stack([rng.permutation(300) for _ in range(4)]).astype(np.int64)
    x, q = vectors.astype(np.float64)[ids], queries.astype(np.float64)[:, None, :]
    for metric in ("l2", "ip"):
        want = ((q - x) ** 2).sum(-1) if metric == "l2" else -(q * x).sum(-1)
        scale = ((q - x) ** 2).sum(-1) if metric == "l2" else np.abs(q * x).sum(-1)  # the rounding's reach
        got = native.exact_distances(store, queries, ids, locations, dtype, metric)
        assert (np.abs(got - want) <= 1e-5 * scale + 1e-6).all(), (metric, np.abs(got - want).max())
        top, dists, _, _ = native.rerank(store, queries, ids, locations, dtype, metric, 10, 16, 0.0, 0)
        by_id = np.empty_like(got)
        np.put_along_axis(by_id, ids, got, 1)
        np.testing.assert_array_equal(dists, np.take_along_axis(by_id, top, 1))  # one kernel for both


@pytest.mark.parametrize("prefetch", [False, True])
def test_rerank_reports_corruption(tmp_path, prefetch):
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((100, 100)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0, spread=1)
    with open(store.path, "r+b") as f:
        f.seek(5 * 4096 + 10)
        f.write(b"\xff")
    cand = np.argsort(locations)[None]  # in slot order: block 5 comes in the 4th mini-batch, read ahead
    with pytest.raises(RuntimeError, match="block 5 fails its checksum"):
        native.rerank(store, vectors[:1], cand, locations, "f32", "l2", 5, 16, 0.0, 0, prefetch=prefetch)
    if prefetch:
        assert store.stats()["read_ahead"] > 0
    # The failed call's scratch (kept for the next call) holds nothing of it: with its store gone, another store's
    # calls answer exactly.
    del store
    healthy, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0, spread=1, seed=1)
    for _ in range(2):
        ids, _, _, _ = native.rerank(healthy, vectors[:3], np.tile(np.arange(100), (3, 1)), locations, "f32", "l2",
                                     5, 16, 0.0, 0, prefetch=prefetch)
        np.testing.assert_array_equal(ids, brute_force(vectors[:3], vectors, "l2", 5)[0])


def test_rerank_validates_arguments(tmp_path):
    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((100, 20)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32")
    q, cand = vectors[:2], np.tile(np.arange(10), (2, 1))

    def call(**over):
        args = dict(store=store, queries=q, candidates=cand, locations=locations, dtype="f32", metric="l2",
                    k=5, minibatch=4, eps=0.0, beta=2)
        args.update(over)
        return native.rerank(**args)

    for over, message in [
        (dict(dtype="f16"), "dtype"),
        (dict(metric="cos"), "metric"),
        (dict(k=0), "k must be positive"),
        (dict(minibatch=0), "minibatch must be positive"),
        (dict(dtype="u8"), "bytes"),
        (dict(queries=vectors[:2, :10].copy()), "bytes"),
        (dict(candidates=cand[:1]), "rows"),
        (dict(candidates=np.array([[1, 100, -1]] * 2)), "outside"),
        (dict(candidates=np.array([[1, -7, -1]] * 2)), "outside"),
        (dict(locations=np.full(100, 10**6, np.uint32)), "past the end"),
        (dict(num_threads=-1), "num_threads"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**over)
    call(candidates=np.array([[1, -1, 500]] * 2))  # ids after the first -1 are never looked at
    with pytest.raises(ValueError, match="outside"):
        native.exact_distances(store, q, np.array([[1, -1, 500]] * 2), locations, "f32", "l2")


def mixed_candidates(rng, vectors, queries):
    """Candidate rows whose queries stop at different rounds: near-sorted rows stop early,
    reversed rows never settle and run out, padded rows end early, and rows repeat ids."""
    n = len(vectors)
    d = ((queries[:, None, :] - vectors[None]) ** 2).sum(-1)
    cand = np.argsort(d * rng.uniform(0.9, 1.1, d.shape), 1)[:, :120].astype(np.int64)
    cand[[1, 11]] = np.argsort(d[[1, 11]], 1)[:, 119::-1]  # best last: the top-k changes every mini-batch
    cand[2, 13:] = -1
    cand[5, :] = -1  # nothing to re-rank
    cand[6, 40:] = -1
    cand[7, 8:16] = cand[7, :8]  # the whole second mini-batch repeats the first
    cand[9, 3] = cand[9, 1]
    cand[10] = rng.permutation(n)[:120]  # random: reads blocks nobody else needs
    return cand


def rerank_inflight(store, queries, cand, locations, inflight, threads=1):
    before = store.stats()["blocks_read"]
    out = native.rerank(store, queries, cand, locations, "f32", "l2", 5, 8, 0.0, 2, threads, inflight=inflight)
    return out, store.stats()["blocks_read"] - before


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_queries_in_flight_change_nothing_per_query(tmp_path, backend):
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((2000, 100)).astype(np.float32)  # 10 records a block, 200 blocks
    queries = rng.standard_normal((13, 100)).astype(np.float32)
    cand = mixed_candidates(rng, vectors, queries)
    try:
        store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0, spread=1, io_backend=backend)
    except OSError as e:
        pytest.skip(f"{backend} not available: {e}")
    (ids, dists, stats, seconds), reads = rerank_inflight(store, queries, cand, locations, 1)
    batches = stats[:, 0]
    assert batches[5] == 0 and (ids[5] == -1).all() and stats[2, 1] == 13 and stats[6, 1] == 40
    assert len(set(batches.tolist())) >= 4, "the queries should leave the group at different rounds"
    assert (stats[[1, 11], 1] == 120).all() and stats[0, 1] < 120  # exhaustion and early stop
    assert stats[:, 3].sum() == 0 and reads == stats[:, 2].sum()  # no buffer: every query reads its own
    for inflight in (3, 8, 64):  # 64: more than the queries
        for threads in (1, 2):
            (g_ids, g_dists, g_stats, g_seconds), g_reads = rerank_inflight(
                store, queries, cand, locations, inflight, threads)
            assert np.array_equal(g_ids, ids) and np.array_equal(g_dists, dists), (inflight, threads)
            assert np.array_equal(g_stats[:, :2], stats[:, :2])
            # Each query still touches the same blocks; shared ones count as read only once.
            assert np.array_equal(g_stats[:, 2] + g_stats[:, 3], stats[:, 2])
            assert g_reads == g_stats[:, 2].sum() < reads
            assert (g_seconds[stats[:, 0] > 0] > 0).all()


def test_queries_in_flight_attribute_shared_blocks_once(tmp_path):
    rng = np.random.default_rng(12)
    vectors = rng.standard_normal((300, 100)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0, spread=1)
    block = locations // 10
    a, b = np.flatnonzero(block == 3)[:2]
    c = np.flatnonzero(block == 7)[0]
    # Both queries need block 3 in their only mini-batch; the second also needs block 7.
    cand = np.array([[a, -1], [b, c]], np.int64)
    (_, _, stats, _), reads = rerank_inflight(store, vectors[:2], cand, locations, 2)
    assert stats[:, 2:4].tolist() == [[1, 0], [1, 1]] and reads == 2
    assert store.stats()["read_calls"] == 1  # both queries' blocks in one batched read
    (_, _, stats, _), reads = rerank_inflight(store, vectors[:2], cand, locations, 1)
    assert stats[:, 2:4].tolist() == [[1, 0], [2, 0]] and reads == 3


def test_queries_in_flight_use_and_fill_the_page_buffer(tmp_path):
    rng = np.random.default_rng(13)
    vectors = rng.standard_normal((2000, 100)).astype(np.float32)
    queries = rng.standard_normal((13, 100)).astype(np.float32)
    cand = mixed_candidates(rng, vectors, queries)
    store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=512, spread=1)
    (ids, _, first, _), reads = rerank_inflight(store, queries, cand, locations, 8)
    assert reads == first[:, 2].sum() > 0
    (again_ids, _, again, _), reads = rerank_inflight(store, queries, cand, locations, 8)
    assert reads == 0 and again[:, 2].sum() == 0
    assert np.array_equal(again[:, 3], first[:, 2] + first[:, 3]) and np.array_equal(again_ids, ids)


def test_inflight_must_be_positive(tmp_path):
    rng = np.random.default_rng(14)
    vectors = rng.standard_normal((100, 20)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32")
    for bad in (0, -3):
        with pytest.raises(ValueError, match="inflight .* must be positive"):
            native.rerank(store, vectors[:2], np.tile(np.arange(10), (2, 1)), locations, "f32", "l2", 5, 4, 0.0, 2,
                          inflight=bad)



def _by_hand(vectors, locations, rpb, query, cand, k, minibatch, beta, mates, resident=None):
    """Algorithm 1 with page-mates, step by step in Python: (ids, reranked, blocks touched, blocks touched
    summed over mini-batches, a block read again by a later one counted again). With
    resident (the blocks in the page buffer before the call), resident-first: the first mini-batch also
    scores every later candidate on a block then in the buffer, its own blocks included."""
    scored, prev, stable, blocks, batches, pos, touched = {}, None, 0, set(), 0, 0, 0
    while pos < len(cand) and not (beta and stable >= beta):
        batch = [c for c in cand[pos:pos + minibatch] if c not in scored]
        pos += minibatch
        mine = {int(locations[c]) // rpb for c in batch}
        blocks |= mine
        touched += len(mine)
        new = list(batch)
        if mates:
            new += [c for c in cand if int(locations[c]) // rpb in mine and c not in scored and c not in batch]
        if resident is not None and batches == 0:
            new += [c for c in cand if int(locations[c]) // rpb in resident | mine and c not in scored
                    and c not in new]
        for c in new:
            scored[c] = float(((vectors[c].astype(np.float64) - query) ** 2).sum())
        top = sorted(scored, key=lambda c: (scored[c], c))[:k]
        batches += 1
        stable = stable + 1 if batches > 1 and set(top) == prev else 0
        prev = set(top)
    return top, len(scored), blocks, touched


@pytest.mark.parametrize("beta", [0, 1, 2])
def test_page_mates_follow_algorithm_1(tmp_path, beta):
    """A block read for a mini-batch also scores the query's later candidates stored in it; their
    own mini-batches read nothing for them. Checked step by step against a Python replay."""
    rng = np.random.default_rng(3)
    n, dim, k, minibatch = 600, 96, 10, 4
    vectors = random_vectors(rng, "u8", n, dim)
    store, locations = make_store(tmp_path, vectors.astype(np.float32), "f32", spread=1)
    rpb = store.records_per_block
    assert rpb == 10
    queries = (rng.standard_normal((5, dim)) * 20 + 128).round().astype(np.float32)
    # Candidates clustered on a few blocks, as PQ candidates of real data are.
    some_blocks = rng.choice(n // rpb, 12, replace=False)
    pool = np.flatnonzero(np.isin(locations // rpb, some_blocks))
    cand = np.stack([rng.permutation(pool)[:40] for _ in range(5)]).astype(np.int64)
    ids, dists, stats, _ = native.rerank(store, queries, cand, locations, "f32", "l2", k, minibatch, 0.0, beta,
                                         page_mates=True)
    plain = native.rerank(store, queries, cand, locations, "f32", "l2", k, minibatch, 0.0, beta)
    for i in range(5):
        want, reranked, blocks, _ = _by_hand(vectors, locations, rpb, queries[i], cand[i].tolist(), k, minibatch, beta,
                                             True)
        assert ids[i].tolist() == want
        assert stats[i, 1] == reranked and stats[i, 2] + stats[i, 3] == len(blocks) and stats[i, 4] > 0
        w, r, _, _ = _by_hand(vectors, locations, rpb, queries[i], cand[i].tolist(), k, minibatch, beta, False)
        assert plain[0][i].tolist() == w and plain[2][i, 1] == r and plain[2][i, 4] == 0
    if beta == 0:  # every candidate scored either way: the exact top-k of the candidates
        np.testing.assert_array_equal(ids, plain[0])
        np.testing.assert_array_equal(dists, plain[1])
        assert (stats[:, 2] + stats[:, 3] <= plain[2][:, 2] + plain[2][:, 3]).all()
        assert (stats[:, 2] + stats[:, 3] < plain[2][:, 2] + plain[2][:, 3]).any()  # blocks read once


@pytest.mark.parametrize("mates", [False, True])
@pytest.mark.parametrize("beta", [1, 2])
def test_resident_first_follows_algorithm_1(tmp_path, mates, beta):
    """resident_first: the first mini-batch also scores the later candidates whose blocks are in the
    page buffer then, without reading them or counting them as buffer requests. Replayed by hand from
    the blocks the buffer held before each call (store.resident), query by query."""
    rng = np.random.default_rng(5)
    n, dim, k, minibatch = 600, 96, 10, 4
    vectors = random_vectors(rng, "u8", n, dim)
    store, locations = make_store(tmp_path, vectors.astype(np.float32), "f32", spread=1, buffer_blocks=256)
    rpb = store.records_per_block
    all_blocks = np.arange(store.num_blocks, dtype=np.uint32)
    queries = (rng.standard_normal((6, dim)) * 20 + 128).round().astype(np.float32)
    some_blocks = rng.choice(n // rpb, 16, replace=False)
    pool = np.flatnonzero(np.isin(locations // rpb, some_blocks))
    # Half the candidates' blocks in the buffer first, as a hot stream leaves them.
    warm = np.flatnonzero(np.isin(locations // rpb, some_blocks[:8]))
    native.exact_distances(store, vectors[warm[:1]].astype(np.float32), warm[None].astype(np.int64), locations,
                           "f32", "l2")
    grew = 0
    for i in range(len(queries)):
        cand = rng.permutation(pool)[:60].astype(np.int64)[None]
        resident = {int(b) for b in all_blocks[store.resident(all_blocks).astype(bool)]}
        before = store.stats()
        ids, _, stats, _ = native.rerank(store, queries[i:i + 1], cand, locations, "f32", "l2", k, minibatch, 0.0,
                                         beta, page_mates=mates, resident_first=True)
        after = store.stats()
        want, reranked, blocks, touched = _by_hand(vectors, locations, rpb, queries[i], cand[0].tolist(), k,
                                                   minibatch, beta, mates, resident)
        assert ids[0].tolist() == want and stats[0, 1] == reranked
        # Blocks of mini-batches only: read, or served by the buffer; peeked ones are neither.
        assert stats[0, 2] + stats[0, 3] == touched
        assert after["blocks_read"] - before["blocks_read"] == stats[0, 2] == len(blocks - resident)
        assert after["blocks_from_buffer"] - before["blocks_from_buffer"] == stats[0, 3]
        plain = native.rerank(store, queries[i:i + 1], cand, locations, "f32", "l2", k, minibatch, 0.0, beta,
                              page_mates=mates)
        assert plain[2][0, 5] == 0 and stats[0, 5] > 0
        grew += stats[0, 1] > plain[2][0, 1]
    assert grew  # scored more than the plain rule would have


def test_page_mates_are_only_candidates(tmp_path):
    """A record that shares a block with a candidate but is no candidate (excluded, or not in the
    probed lists) is never scored or returned."""
    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    store, locations = make_store(tmp_path, vectors, "f32", spread=1)
    rpb = store.records_per_block
    on_block = np.flatnonzero(locations // rpb == locations[0] // rpb)
    other = [int(i) for i in on_block if i != 0]
    cand = np.array([other], np.int64)  # vector 0, the query itself, is left out
    ids, _, stats, _ = native.rerank(store, vectors[:1], cand, locations, "f32", "l2", 3, 1, 0.0, 0, page_mates=True)
    assert 0 not in ids[0] and stats[0, 1] == len(other) and stats[0, 2] + stats[0, 3] == 1
    assert stats[0, 4] == len(other) - 1  # the first mini-batch read the block for all


def _rerank_counted(store, queries, cand, locations, beta, **kw):
    """rerank's answer and the store's counters it moved: (out, blocks_read, read_ahead, read_ahead_unused)."""
    before = store.stats()
    out = native.rerank(store, queries, cand, locations, "f32", "l2", 5, 8, 0.0, beta, **kw)
    after = store.stats()
    return out, *(after[key] - before[key] for key in ("blocks_read", "read_ahead", "read_ahead_unused"))


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
@pytest.mark.parametrize("buffer_blocks", [0, 64])
@pytest.mark.parametrize("beta", [1, 2])
def test_prefetch_changes_nothing_but_when_blocks_are_read(tmp_path, backend, buffer_blocks, beta):
    """Reading each query's next mini-batch before scoring this one gives the same answer and the
    same per-query statistics but blocks read; what it reads more is exactly what early stops left unused:
    nothing with beta 2 (a query one stable mini-batch from its stop is not read ahead), some with beta 1,
    each counted as read by the query it was read for, so that a call's blocks read summed over its
    queries are the store's."""
    rng = np.random.default_rng(21)
    vectors = rng.standard_normal((2000, 100)).astype(np.float32)  # 10 records a block, 200 blocks
    queries = rng.standard_normal((13, 100)).astype(np.float32)
    cand = mixed_candidates(rng, vectors, queries)
    try:
        store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=buffer_blocks, spread=1,
                                      io_backend=backend)
    except OSError as e:
        pytest.skip(f"{backend} not available: {e}")
    for mates in (False, True):
        for inflight in (1, 8):
            kw = dict(num_threads=1, inflight=inflight, page_mates=mates)
            store.reset_buffer()
            off, off_reads, ahead, _ = _rerank_counted(store, queries, cand, locations, beta, **kw)
            assert ahead == 0
            store.reset_buffer()
            on, on_reads, ahead, unused = _rerank_counted(store, queries, cand, locations, beta, prefetch=True, **kw)
            for a, b in zip(off[:2], on[:2]):
                np.testing.assert_array_equal(a, b)
            others = [c for c in range(off[2].shape[1]) if c != 2]
            np.testing.assert_array_equal(off[2][:, others], on[2][:, others])
            assert (on[2][:, 2] >= off[2][:, 2]).all()
            assert ahead > 0 and (unused == 0 if beta == 2 else 0 < unused < ahead), (mates, inflight, unused)
            assert on_reads == off_reads + unused == on[2][:, 2].sum() == off[2][:, 2].sum() + unused
        on2 = native.rerank(store, queries, cand, locations, "f32", "l2", 5, 8, 0.0, beta, 2, inflight=4,
                            page_mates=mates, prefetch=True)
        np.testing.assert_array_equal(on2[0], off[0])
        np.testing.assert_array_equal(on2[1], off[1])
        np.testing.assert_array_equal(on2[2][:, :2], off[2][:, :2])


def test_prefetch_wasted_reads_are_the_stopped_querys_next_batch(tmp_path):
    """One query, no page buffer, beta 1: it stops after 2 mini-batches, so the blocks of its 3rd,
    read ahead, are the unused reads; the pread backend's reads, seen by the kernel's counters
    (/proc/self/io), are the blocks the store says it read. With beta 2 nothing is read in vain."""
    store, locations, q = ranked_store(tmp_path)
    store = native.PageStore(store.path, store.record_bytes, store.records_per_block, store.pages_per_block,
                             _crc_of(store), 0, io_backend="pread")
    order = np.arange(100, dtype=np.int64)  # the true top-5 all in the first mini-batch of 10
    block = locations // store.records_per_block
    for beta, batches in [(1, 2), (2, 3)]:
        before, rchar = store.stats(), _rchar()
        ids, _, stats, _ = native.rerank(store, q, order[None], locations, "f32", "l2", 5, 10, 0.0, beta,
                                         prefetch=True)
        read_bytes, after = _rchar() - rchar, store.stats()
        assert ids[0].tolist() == [0, 1, 2, 3, 4] and stats[0, 0] == batches
        unused = len(np.unique(block[order[10 * batches:10 * batches + 10]])) if beta == 1 else 0
        assert after["read_ahead_unused"] - before["read_ahead_unused"] == unused
        # The query's blocks from SSD: its first mini-batch's, then every block read ahead for it, used or not.
        assert after["read_ahead"] - before["read_ahead"] == stats[0, 2] - len(np.unique(block[order[:10]]))
        read = after["blocks_read"] - before["blocks_read"]
        assert read == stats[0, 2]
        assert read_bytes // store.block_bytes == read  # a few bytes of other reads aside


def _crc_of(store):
    data = np.fromfile(store.path, np.uint8).reshape(-1, store.block_bytes)
    return np.array([native.crc32c(row) for row in data], np.uint32)


def _rchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_prefetch_of_more_blocks_than_a_ring_holds(tmp_path, backend):
    """A read-ahead of more blocks than one io_uring submission takes (256) is finished at the wait;
    without early stop (beta 0) it reads exactly what the plain re-rank reads. (A round reads ahead at most
    128 KiB of blocks, or one mini-batch where that is more: mini-batches of 300 one-block records.)"""
    rng = np.random.default_rng(22)
    vectors = rng.standard_normal((700, 1024)).astype(np.float32)  # one record a block
    queries = rng.standard_normal((10, 1024)).astype(np.float32)
    cand = np.stack([rng.permutation(700)[:640] for _ in range(10)]).astype(np.int64)
    try:
        store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0, io_backend=backend)
    except OSError as e:
        pytest.skip(f"{backend} not available: {e}")
    runs = []
    for prefetch in (False, True):
        before = store.stats()
        out = native.rerank(store, queries, cand, locations, "f32", "ip", 10, 300, 0.0, 0, 1, inflight=10,
                            prefetch=prefetch)
        after = store.stats()
        runs.append((out, {key: after[key] - before[key] for key in after}))
    (off, off_n), (on, on_n) = runs
    for a, b in zip(off[:3], on[:3]):
        np.testing.assert_array_equal(a, b)
    assert on_n["read_ahead"] > 256 * 2 and on_n["read_ahead_unused"] == 0
    assert on_n["blocks_read"] == off_n["blocks_read"] == on[2][:, 2].sum()
    want, _ = brute_force(queries, vectors, "ip", 10, ids=cand)
    np.testing.assert_array_equal(on[0], want)


def _rss() -> int:
    return status_bytes("VmRSS")


@pytest.mark.parametrize("policy", ["lfu", "clock", "auto"])
@pytest.mark.parametrize("mates", [False, True])
@pytest.mark.parametrize("beta", [0, 2])
def test_record_cache_scores_the_same_candidates_and_reads_less(tmp_path, policy, mates, beta):
    """A record cache beside a page buffer of nothing: every call scores exactly the candidates Algorithm 1
    scores (a block is skipped only if all its candidates of the round are cached), so answers, candidates
    re-ranked and blocks touched equal the Python replay; a stream that asks the same things again reads
    fewer blocks, counted by the process's own read bytes (pread backend), and the engine's counts say so."""
    rng = np.random.default_rng(6)
    n, dim, k, minibatch = 600, 96, 10, 4
    vectors = random_vectors(rng, "u8", n, dim)
    store, locations = make_store(tmp_path, vectors.astype(np.float32), "f32", spread=1, buffer_blocks=0,
                                  io_backend="pread", buffer_policy=policy, record_cache=300)
    rpb = store.records_per_block
    assert store.record_cache_capacity == 300 and store.buffer_capacity == 0
    queries = (rng.standard_normal((4, dim)) * 20 + 128).round().astype(np.float32)
    some_blocks = rng.choice(n // rpb, 12, replace=False)
    pool = np.flatnonzero(np.isin(locations // rpb, some_blocks))  # 120 records: all fit the cache
    cand = np.stack([rng.permutation(pool)[:40] for _ in range(4)]).astype(np.int64)
    reads = []
    for _ in range(3):  # the same queries again: a skewed stream's repeats
        rchar, before = _rchar(), store.stats()
        ids, dists, stats, _ = native.rerank(store, queries, cand, locations, "f32", "l2", k, minibatch, 0.0, beta,
                                             num_threads=1, page_mates=mates)
        reads.append((_rchar() - rchar) // store.block_bytes)
        # With no page buffer every candidate scored was asked of the record cache (some twice: a page-mate
        # looked up before its block's miss is asked again when the block is read), and each scored from it hit.
        after = store.stats()
        assert after["record_lookups"] - before["record_lookups"] >= stats[:, 1].sum()
        assert after["records_from_cache"] - before["records_from_cache"] >= stats[:, 6].sum()
        for i in range(4):
            want, reranked, _, touched = _by_hand(vectors, locations, rpb, queries[i], cand[i].tolist(), k, minibatch,
                                                  beta, mates)
            assert ids[i].tolist() == want and stats[i, 1] == reranked and stats[i, 2] + stats[i, 3] == touched
        assert reads[-1] == stats[:, 2].sum()  # blocks the engine says it read are the bytes the process read
    assert stats[:, 6].sum() > 0 and (stats[:, 6] <= stats[:, 1]).all()
    assert reads[2] < reads[0] and store.stats()["records_from_cache"] > 0
    plain, _ = make_store(tmp_path, vectors.astype(np.float32), "f32", spread=1, buffer_blocks=0, seed=0,
                          io_backend="pread")
    again = native.rerank(plain, queries, cand, locations, "f32", "l2", k, minibatch, 0.0, beta, page_mates=mates)
    np.testing.assert_array_equal(again[0], ids)
    np.testing.assert_array_equal(again[1], dists)
    assert again[2][:, 6].sum() == 0


def _full_scan(tmp_path, rng, n=60_000, dim=50):
    """A page file of n random 50-d float32 records (12 MB), a query whose candidates are all of them, and its
    answer from a store with no buffer (its call's own scratch made before any memory is measured)."""
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    rb = dim * 4
    rpb, ppb = native.page_layout(rb)
    path = tmp_path / "v.pages"
    w = native.PageWriter(str(path), rb, rpb, ppb)
    slots = np.arange(n, dtype=np.uint32)
    w.write(slots, vectors.view(np.uint8))
    crc = w.close()
    query = rng.standard_normal((1, dim)).astype(np.float32)
    cand = np.arange(n, dtype=np.int64)[None]
    plain = native.PageStore(str(path), rb, rpb, ppb, crc, 0, io_backend="pread")
    want = native.rerank(plain, query, cand, slots, "f32", "l2", 10, 64, 0.0, 0, num_threads=1)
    return path, rb, rpb, ppb, crc, slots, query, cand, want


def test_record_cache_holds_no_more_memory_than_it_says(tmp_path):
    """The record cache's bytes (records and their metadata, record_cache_bytes) bound the memory the process
    holds once it is full, measured as resident set growth; and it was full: most of the bytes are held."""
    cap = 40_000
    path, rb, rpb, ppb, crc, slots, query, cand, _ = _full_scan(tmp_path, np.random.default_rng(8))
    before = _rss()
    store = native.PageStore(str(path), rb, rpb, ppb, crc, 0, io_backend="pread", buffer_policy="lfu",
                             record_cache=cap)
    for _ in range(3):
        native.rerank(store, query, cand, slots, "f32", "l2", 10, 64, 0.0, 0, num_threads=1)
    held = _rss() - before
    assert store.record_cache_bytes == cap * (rb + native.PageStore.record_cache_overhead)
    assert cap * rb * 0.8 < held <= store.record_cache_bytes
    assert store.stats()["records_from_cache"] > cap // 2


def test_adaptive_layout_holds_one_layout_at_a_time(tmp_path):
    """An adaptive layout holds its bytes as blocks or as records, never both. Filled as blocks, switched to
    records (the most used blocks' records move over, each block's frame given back as they go), filled, then
    switched back (cold) and filled again: the process's resident set grows by at most the budget and 1 MiB (the
    frames' and the miniature's metadata, 0.6 MiB measured) at every step, its peak through the switch to records
    too; the records moved over serve the next call without a read; a switch to blocks gives the records' memory
    back; each layout was full. Answers are the same in either layout."""
    path, rb, rpb, ppb, crc, slots, query, cand, want = _full_scan(tmp_path, np.random.default_rng(9))
    per_record = rb + native.PageStore.record_cache_overhead
    budget = 40_000 * per_record  # 11.8 MB: ~98% of the 12 MB of records
    blocks, records = budget // (4096 * ppb), budget // per_record
    before = _rss()
    store = native.PageStore(str(path), rb, rpb, ppb, crc, blocks, io_backend="pread", buffer_policy="lfu",
                             record_cache=records, adaptive_layout=True)
    assert store.adaptive_layout and store.layout == "blocks"  # 200 + 96 bytes against 204.8 a record in a page
    assert store.buffer_bytes <= budget and store.record_cache_bytes == 0
    store.set_layout(False, hold=True)  # the miniature is held off (whole scans would keep it on blocks anyway)

    def fill():
        for _ in range(3):
            got = native.rerank(store, query, cand, slots, "f32", "l2", 10, 64, 0.0, 0, num_threads=1)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        return _rss() - before

    held = fill()
    assert 0.8 * blocks * 4096 * ppb < held <= budget + (1 << 20)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from now
    store.set_layout(True, hold=True)
    assert status_bytes("VmHWM") - before <= budget + (1 << 20)
    assert 0.5 * budget < _rss() - before <= budget + (1 << 20)  # the records moved over
    cached = store.stats()["records_from_cache"]
    native.rerank(store, query, cand, slots, "f32", "l2", 10, 64, 0.0, 0, num_threads=1)
    assert store.stats()["records_from_cache"] - cached > 0.5 * records
    held = fill()
    assert 0.8 * records * rb < held <= budget + (1 << 20)
    store.set_layout(False, hold=True)
    assert _rss() - before < 0.2 * budget  # a switch to blocks starts cold: the records' memory went back
    held = fill()
    assert 0.8 * blocks * 4096 * ppb < held <= budget + (1 << 20)
    assert store.stats()["layout_switches"] == 2


def _layout_store(tmp_path, rb=1000, blocks=64):
    rpb, ppb = native.page_layout(rb)
    n = 1024 * rpb
    path = tmp_path / f"l{rb}.pages"
    w = native.PageWriter(str(path), rb, rpb, ppb)
    w.write(np.arange(n, dtype=np.uint32), np.zeros((n, rb), np.uint8))
    crc = w.close()
    records = blocks * 4096 * ppb // (rb + native.PageStore.record_cache_overhead)
    return native.PageStore(str(path), rb, rpb, ppb, crc, blocks, io_backend="pread", buffer_policy="auto",
                            record_cache=records, adaptive_layout=True), rpb, records


def test_adaptive_layout_takes_what_its_miniature_serves_more(tmp_path):
    """An adaptive layout starts as blocks where a record with its metadata costs more than its share of a page
    (1000 + 96 bytes against 1024). Its miniature switches to records where queries touch one hot record in each
    of many blocks (260 blocks against a buffer of 64, 260 records against a cache of 239), and back to blocks
    where they touch every record of a few blocks (70 blocks against 64, 280 records against 239); both layouts
    see every touch, whichever is on. No verdict comes before both shadows are full, which each phase fills."""
    rng = np.random.default_rng(3)
    store, rpb, records = _layout_store(tmp_path)
    assert rpb == 4 and records == 239 and store.layout == "blocks"

    def touch(blocks, rounds, per_block):
        """rounds passes over blocks in random order, each touch asking for per_block records of the block."""
        for _ in range(rounds):
            for b in rng.permutation(blocks):
                store.observe(int(b), (b * rpb + np.arange(per_block)).astype(np.uint32))
        store.wait_layout()  # a switch runs on a thread of its own
        return store.layout, store.stats()["layout_switches"]

    # 200 hot records never fill the record shadow: no verdict, though records serve more
    assert touch(np.arange(200), 40, 1) == ("blocks", 0)
    assert touch(rng.choice(1024, 260, replace=False), 40, 1) == ("records", 1)
    assert touch(rng.choice(1024, 70, replace=False), 60, rpb) == ("blocks", 2)
    with pytest.raises(ValueError, match="block 5000 out of range"):
        store.observe(5000, np.array([0], np.uint32))


def test_adaptive_layout_needs_both_layouts(tmp_path):
    rpb, ppb = native.page_layout(1000)
    path = tmp_path / "v.pages"
    w = native.PageWriter(str(path), 1000, rpb, ppb)
    w.write(np.arange(8, dtype=np.uint32), np.zeros((8, 1000), np.uint8))
    crc = w.close()
    with pytest.raises(ValueError, match="adaptive layout needs both"):
        native.PageStore(str(path), 1000, rpb, ppb, crc, 4, record_cache=0, adaptive_layout=True)
    fixed = native.PageStore(str(path), 1000, rpb, ppb, crc, 4, record_cache=4)
    assert not fixed.adaptive_layout
    with pytest.raises(ValueError, match="set_layout needs an adaptive layout"):
        native.PageStore(str(path), 1000, rpb, ppb, crc, 4).set_layout(True)


def test_prefetch_reads_ahead_at_most_128_kib_a_round(tmp_path):
    """Many queries in flight: a round reads ahead at most 128 KiB of blocks (whole queries' mini-batches), not
    every query's next mini-batch, and the answer is the plain re-rank's."""
    rng = np.random.default_rng(23)
    vectors = rng.standard_normal((4000, 1024)).astype(np.float32)  # one record a block of 4 KiB: 32 blocks a round
    queries = rng.standard_normal((16, 1024)).astype(np.float32)
    cand = np.stack([rng.permutation(4000)[:64] for _ in range(16)]).astype(np.int64)
    store, locations = make_store(tmp_path, vectors, "f32", buffer_blocks=0)
    assert store.block_bytes == 4096
    runs = []
    for prefetch in (False, True):
        before = store.stats()
        out = native.rerank(store, queries, cand, locations, "f32", "l2", 10, 8, 0.0, 0, 1, inflight=16,
                            prefetch=prefetch)
        runs.append((out, store.stats()["read_ahead"] - before["read_ahead"]))
    (off, _), (on, ahead) = runs
    np.testing.assert_array_equal(off[0], on[0])
    rounds = 64 // 8  # no early stop (beta 0): every query takes all 8 of its mini-batches, all in flight together
    assert 0 < ahead <= (rounds - 1) * 32  # uncapped: 16 queries x 8 blocks a round, 4x as many
