"""The CPU filter tier (gather, de-duplicate, PQ ADC, top-n) against a plain numpy reference."""

import numpy as np
import pytest
from conftest import make_index, tiny_lists

from fusionrag.native import gather, gather_into, gather_offsets, pq_distances, scan_topn


def integer_luts(rng, q, m_sub):
    """Small integers: every summation order is exact, so ties are real and the tie rule is tested."""
    return rng.integers(-50, 50, (q, m_sub, 256)).astype(np.float32)


def reference(luts, probes, offsets, ids, codes, n, exclude=None):
    q = probes.shape[0]
    out_ids = np.full((q, n), -1, np.int64)
    out_d = np.full((q, n), np.inf, np.float32)
    counts = np.zeros((q, 2), np.int64)
    for i in range(q):
        parts = [ids[offsets[c] : offsets[c + 1]] for c in probes[i] if c != -1]
        got = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        uniq = np.unique(got).astype(np.int64)
        if exclude is not None:
            bits = np.unpackbits(exclude, bitorder="little")
            uniq = uniq[bits[uniq] == 0]
        d = luts[i][np.arange(codes.shape[1]), codes[uniq]].sum(axis=1, dtype=np.float64).astype(np.float32)
        order = np.lexsort((uniq, d))[:n]  # by distance, then id
        out_ids[i, : len(order)] = uniq[order]
        out_d[i, : len(order)] = d[order]
        counts[i] = (len(got), len(uniq))
    return out_ids, out_d, counts


@pytest.mark.parametrize(
    "m_sub,q,n,n_probe",
    [(1, 1, 5, 3), (3, 37, 10, 4), (8, 37, 100, 6), (25, 5, 1000, 8), (8, 1, 1, 1)],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_scan_topn_matches_reference(m_sub, q, n, n_probe, num_threads):
    rng = np.random.default_rng(m_sub * 1000 + q)
    offsets, ids, codes = make_index(rng, 500, 30, m_sub)
    probes = rng.integers(0, 30, (q, n_probe)).astype(np.int32)
    probes[rng.random((q, n_probe)) < 0.2] = -1  # per-query probe counts vary
    if q > 1:
        probes[0] = -1  # a query with no lists at all
    luts = integer_luts(rng, q, m_sub)
    got_ids, got_d, counts, seconds = scan_topn(luts, probes, offsets, ids, codes, n, num_threads=num_threads)
    want_ids, want_d, want_counts = reference(luts, probes, offsets, ids, codes, n)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_d, want_d)
    np.testing.assert_array_equal(counts, want_counts)
    assert got_ids.dtype == np.int64 and got_d.dtype == np.float32 and counts.dtype == np.int64
    assert seconds.shape == (q,) and seconds.dtype == np.float64 and np.all(seconds >= 0)


def test_float_luts_close_to_reference():
    rng = np.random.default_rng(7)
    offsets, ids, codes = make_index(rng, 2000, 50, 16)
    probes = rng.integers(0, 50, (20, 8)).astype(np.int32)
    luts = rng.random((20, 16, 256), dtype=np.float32)
    got_ids, got_d, _, _ = scan_topn(luts, probes, offsets, ids, codes, 50)
    want_ids, want_d, _ = reference(luts, probes, offsets, ids, codes, 50)
    np.testing.assert_allclose(got_d, want_d, rtol=1e-5)
    assert np.mean(got_ids == want_ids) > 0.99  # only near-ties may swap
    assert np.all(np.diff(got_d, axis=1) >= 0)


def test_all_lists_identical_everything_duplicate():
    rng = np.random.default_rng(1)
    base = rng.permutation(100).astype(np.uint32)
    ids = np.tile(base, 8)
    offsets = np.arange(9, dtype=np.int64) * 100
    codes = rng.integers(0, 256, (100, 4), dtype=np.uint8)
    probes = np.tile(np.arange(8, dtype=np.int32), (3, 1))
    luts = integer_luts(rng, 3, 4)
    got_ids, got_d, counts, _ = scan_topn(luts, probes, offsets, ids, codes, 150)
    np.testing.assert_array_equal(counts, [[800, 100]] * 3)
    assert np.all(got_ids[:, 100:] == -1) and np.all(np.isinf(got_d[:, 100:]))
    assert all(sorted(row[:100]) == list(range(100)) for row in got_ids)
    want_ids, want_d, _ = reference(luts, probes, offsets, ids, codes, 150)
    np.testing.assert_array_equal(got_ids, want_ids)


def test_last_id_and_n_larger_than_candidates():
    rng = np.random.default_rng(2)
    n_vectors = 130  # not a multiple of 64 or 8: exercises the bitmap tail
    codes = rng.integers(0, 256, (n_vectors, 3), dtype=np.uint8)
    ids = np.array([n_vectors - 1, 0, n_vectors - 1, 64, 63], np.uint32)
    offsets = np.array([0, 3, 5], np.int64)
    probes = np.array([[0, 1], [1, -1]], np.int32)
    luts = integer_luts(rng, 2, 3)
    got_ids, got_d, counts, _ = scan_topn(luts, probes, offsets, ids, codes, 10)
    want_ids, want_d, want_counts = reference(luts, probes, offsets, ids, codes, 10)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_d, want_d)
    np.testing.assert_array_equal(counts, [[5, 4], [2, 2]])
    assert n_vectors - 1 in got_ids[0]


def test_exclude_bitmap():
    rng = np.random.default_rng(3)
    n_vectors = 301
    offsets, ids, codes = make_index(rng, n_vectors, 20, 5)
    probes = rng.integers(0, 20, (9, 5)).astype(np.int32)
    deleted = rng.random(n_vectors) < 0.3
    deleted[n_vectors - 1] = True
    exclude = np.packbits(deleted, bitorder="little")
    luts = integer_luts(rng, 9, 5)
    got_ids, got_d, counts, _ = scan_topn(luts, probes, offsets, ids, codes, 40, exclude=exclude)
    want_ids, want_d, want_counts = reference(luts, probes, offsets, ids, codes, 40, exclude)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_d, want_d)
    np.testing.assert_array_equal(counts, want_counts)
    assert not np.any(deleted[got_ids[got_ids >= 0]])
    # The scratch bitmap is left clean: a later call without exclude sees every id again.
    plain = scan_topn(luts, probes, offsets, ids, codes, 40)
    np.testing.assert_array_equal(plain[0], reference(luts, probes, offsets, ids, codes, 40)[0])


def test_gather_equals_concatenation():
    rng = np.random.default_rng(4)
    offsets, ids, _ = make_index(rng, 400, 25, 1)
    probes = rng.integers(0, 25, (37, 6)).astype(np.int32)
    probes[rng.random(probes.shape) < 0.25] = -1
    probes[3] = -1
    got, got_offsets = gather(probes, offsets, ids)
    parts = [[ids[offsets[c] : offsets[c + 1]] for c in row if c != -1] for row in probes]
    want = [np.concatenate(p) if p else np.zeros(0, np.uint32) for p in parts]
    np.testing.assert_array_equal(got_offsets, np.concatenate([[0], np.cumsum([len(w) for w in want])]))
    np.testing.assert_array_equal(got, np.concatenate(want))
    assert got.dtype == np.uint32 and got_offsets.dtype == np.int64
    # The same into a buffer of the caller's (the GPU tier's pinned memory), its tail left as it was.
    np.testing.assert_array_equal(gather_offsets(probes, offsets, ids), got_offsets)
    out = np.full(len(got) + 5, 7, np.uint32)
    np.testing.assert_array_equal(gather_into(probes, offsets, ids, out, 3), got_offsets)
    np.testing.assert_array_equal(out[:len(got)], got)
    assert (out[len(got):] == 7).all()


def test_pq_distances():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (50, 7), dtype=np.uint8)
    luts = integer_luts(rng, 4, 7)
    ids = rng.integers(-1, 50, (4, 12)).astype(np.int64)
    got = pq_distances(luts, ids, codes)
    for i in range(4):
        for j in range(12):
            want = np.inf if ids[i, j] < 0 else luts[i][np.arange(7), codes[ids[i, j]]].sum()
            assert got[i, j] == want



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pq_distances_of_many_ids_in_blocks_the_threads_share(threads):
    """A filter's passing vectors (search_among): one query, or a few, with more ids than one block (4096) holds,
    -1 among them; each block's sums as numpy's, whichever thread took it."""
    rng = np.random.default_rng(threads)
    codes = rng.integers(0, 256, (20_000, 9), dtype=np.uint8)
    for q, n in ((1, 10_001), (3, 8_192), (2, 4_095)):
        luts = integer_luts(rng, q, 9)
        ids = rng.integers(-1, len(codes), (q, n)).astype(np.int64)
        got = pq_distances(luts, ids, codes, threads)
        want = np.stack([luts[i][np.arange(9)[None, :], codes[np.maximum(ids[i], 0)]].sum(1) for i in range(q)])
        np.testing.assert_array_equal(got, np.where(ids < 0, np.inf, want))

def test_empty_query_batch():
    offsets, ids = np.array([0, 2], np.int64), np.array([0, 1], np.uint32)
    codes = np.zeros((2, 4), np.uint8)
    res = scan_topn(np.zeros((0, 4, 256), np.float32), np.zeros((0, 3), np.int32), offsets, ids, codes, 5)
    assert [r.shape for r in res] == [(0, 5), (0, 5), (0, 2), (0,)]
    got, got_offsets = gather(np.zeros((0, 3), np.int32), offsets, ids)
    assert got.shape == (0,) and list(got_offsets) == [0]


def _valid():
    return dict(
        luts=np.zeros((2, 4, 256), np.float32),
        **tiny_lists(),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(n=0), "n must be positive"),
        (dict(luts=np.zeros((2, 4, 255), np.float32)), "luts"),
        (dict(luts=np.zeros((3, 4, 256), np.float32)), "luts"),
        (dict(luts=np.zeros((2, 4), np.float32)), "luts"),
        (dict(codes=np.zeros((10, 5), np.uint8)), "codes"),
        (dict(probe_lists=np.array([[0, 2], [1, -1]], np.int32)), r"probe_lists\[0, 1\] = 2"),
        (dict(probe_lists=np.array([[0, -2], [1, -1]], np.int32)), "probe_lists"),
        (dict(probe_lists=np.array([0, 1], np.int32)), "probe_lists"),
        (dict(list_ids=np.array([0, 5, 10], np.uint32)), r"list_ids\[2\] = 10"),
        (dict(list_offsets=np.array([0, 2, 4], np.int64)), "list_offsets"),
        (dict(list_offsets=np.array([0, 3, 2], np.int64)), "list_offsets"),
        (dict(exclude=np.zeros(1, np.uint8)), "exclude"),
        (dict(num_threads=-1), "num_threads"),
    ],
)
def test_scan_topn_rejects_bad_input(change, match):
    args = _valid()
    args.update(change)
    with pytest.raises(ValueError, match=match):
        scan_topn(**args)


def test_bad_input_of_gather_and_pq_distances():
    a = _valid()
    with pytest.raises(ValueError, match="probe_lists"):
        gather(np.array([[3]], np.int32), a["list_offsets"], a["list_ids"])
    with pytest.raises(ValueError, match="list_offsets"):
        gather(np.array([[1]], np.int32), np.array([0, 2, 7], np.int64), a["list_ids"])
    out = np.full(8, 9, np.uint32)
    for probes in (np.array([[3]], np.int32), np.array([[0, -2]], np.int32)):  # no list 3; -2 is no probe
        with pytest.raises(ValueError, match="probe_lists"):
            gather_into(probes, a["list_offsets"], a["list_ids"], out)
        with pytest.raises(ValueError, match="probe_lists"):
            gather_offsets(probes, a["list_offsets"], a["list_ids"])
    with pytest.raises(ValueError, match="out holds 1 ids; the probed lists hold"):
        gather_into(np.array([[0, 1]], np.int32), a["list_offsets"], a["list_ids"], out[:1])
    assert (out == 9).all()  # nothing written by a refused call
    # Not uint32, or read-only: refused, never converted into a copy that the IDs would go to instead.
    read_only = np.zeros(8, np.uint32)
    read_only.flags.writeable = False
    for bad in (np.zeros(8, np.int64), np.zeros(8, np.int32), read_only, np.zeros(16, np.uint32)[::2]):
        with pytest.raises(TypeError):
            gather_into(np.array([[0]], np.int32), a["list_offsets"], a["list_ids"], bad)
    with pytest.raises(ValueError, match=r"ids\[0, 1\] = 10"):
        pq_distances(a["luts"], np.array([[0, 10], [1, 2]], np.int64), a["codes"])
    with pytest.raises(ValueError, match="ids"):
        pq_distances(a["luts"], np.array([[0, -2], [1, 2]], np.int64), a["codes"])
    with pytest.raises(ValueError, match="luts"):
        pq_distances(a["luts"], np.zeros((3, 2), np.int64), a["codes"])


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("q", [1, 2, 5, 16, 37, 64, 200])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_batch_plan_same_as_per_query(metric, q, num_threads):
    """The batch plan (lists scanned once per group of queries) gives each query exactly what the
    per-query scan gives it: ids, PQ distances, gathered and unique counts, under an exclude bitmap."""
    from fusionrag.native import PqCodebooks, scan_topn_pq

    rng = np.random.default_rng(q * 10 + num_threads + (metric == "ip"))
    m_sub, dsub, n_vectors, n_lists = 8, 3, 1500, 24
    offsets, ids, codes = make_index(rng, n_vectors, n_lists, m_sub, replicas=4)
    codebooks = rng.standard_normal((m_sub, 256, dsub)).astype(np.float32)
    # Queries repeated and near each other, so that several probe the same lists (and some all the same).
    base = rng.standard_normal((max(1, q // 3), m_sub * dsub - 1)).astype(np.float32)
    queries = base[rng.integers(0, len(base), q)] + 0.01 * rng.standard_normal((q, m_sub * dsub - 1)).astype(np.float32)
    probes = rng.integers(0, 6, (q, 5)).astype(np.int32)  # 6 hot lists
    probes[:, 3:] = rng.integers(0, n_lists, (q, 2))
    probes[rng.random((q, 5)) < 0.2] = -1
    probes[q // 2] = -1  # a query with no lists at all
    exclude = np.packbits(rng.random(n_vectors) < 0.1, bitorder="little")
    for cb in (codebooks, PqCodebooks(codebooks)):
        for ex in (None, exclude):
            for n in (1, 10, 400):
                args = (queries, cb, metric, probes, offsets, ids, codes, n, num_threads, ex)
                off = scan_topn_pq(*args)
                on = scan_topn_pq(*args, batch_plan=True)
                for a, b in zip(off[:3], on[:3]):
                    np.testing.assert_array_equal(a, b)
                assert on[3].shape == (q,) and np.all(on[3] >= 0) and np.all(on[4] >= 0)


def test_batch_plan_wide_tables_and_bad_ids():
    """Groups bounded by their tables' bytes (M = 256: 4 queries a group); a bad id raises as without the plan."""
    from fusionrag.native import scan_topn_pq

    rng = np.random.default_rng(3)
    m_sub = 256
    offsets, ids, codes = make_index(rng, 400, 10, m_sub)
    codebooks = rng.standard_normal((m_sub, 256, 1)).astype(np.float32)
    queries = rng.standard_normal((50, m_sub)).astype(np.float32)
    probes = rng.integers(0, 10, (50, 3)).astype(np.int32)
    args = (queries, codebooks, "l2", probes, offsets, ids, codes, 20, 2, None)
    for a, b in zip(scan_topn_pq(*args)[:3], scan_topn_pq(*args, batch_plan=True)[:3]):
        np.testing.assert_array_equal(a, b)
    bad = ids.copy()
    bad[offsets[probes[7, 0]]] = 400
    args = (queries, codebooks, "l2", probes, offsets, bad, codes, 20, 2, None)
    for plan in (False, True):
        with pytest.raises(ValueError, match="out of range for 400 codes"):
            scan_topn_pq(*args, batch_plan=plan)
    # the scratch was cleaned up after the throw: a good call still matches
    args = (queries, codebooks, "l2", probes, offsets, ids, codes, 20, 2, None)
    for a, b in zip(scan_topn_pq(*args)[:3], scan_topn_pq(*args, batch_plan=True)[:3]):
        np.testing.assert_array_equal(a, b)
