"""4-bit PQ in the native core (native/scan4.h): the tables, the SIMD and scalar sums, the scan and the distances
of chosen ids, each against a plain numpy reference."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_index

from fusionrag import native


def packed(codes4: np.ndarray) -> np.ndarray:
    """(n, M) codes of 0..15 -> (n, ceil(M / 2)) bytes: sub-space 2b in byte b's low nibble, 2b + 1 in its high."""
    n, m = codes4.shape
    if m % 2:
        codes4 = np.hstack([codes4, np.zeros((n, 1), np.uint8)])
    return np.ascontiguousarray(codes4[:, 0::2] | (codes4[:, 1::2] << 4), dtype=np.uint8)


def unpacked(codes: np.ndarray, m: int) -> np.ndarray:
    return np.stack([codes & 15, codes >> 4], axis=2).reshape(len(codes), -1)[:, :m]


def reference_tables(q: np.ndarray, books: np.ndarray, metric: str) -> np.ndarray:
    """float64 (q, M, 16): the query zero-padded to M * dsub, as ProductQuantizer splits it."""
    m, _, dsub = books.shape
    qs = np.pad(q.astype(np.float64), ((0, 0), (0, m * dsub - q.shape[1]))).reshape(len(q), m, dsub)
    dots = np.einsum("qmd,mkd->qmk", qs, books.astype(np.float64))
    if metric == "ip":
        return -dots
    return (qs ** 2).sum(-1)[:, :, None] - 2 * dots + (books.astype(np.float64) ** 2).sum(-1)[None]


def quantize(luts: np.ndarray, rows: int) -> np.ndarray:
    """The kernel's uint8 tables from its float ones, in float32 as it computes them."""
    lo = luts.min(axis=2, keepdims=True)
    widest = (luts.max(axis=2) - lo[:, :, 0]).max(axis=1)
    inv = np.where(widest > 0, np.float32(255) / np.where(widest > 0, widest, 1), 0).astype(np.float32)
    q8 = np.minimum(np.float32(255), (luts - lo) * inv[:, None, None] + np.float32(0.5)).astype(np.uint8)
    out = np.zeros((len(luts), rows, 16), np.uint8)
    out[:, :luts.shape[1]] = q8
    return out


def sums_reference(q8: np.ndarray, ids: np.ndarray, codes: np.ndarray) -> np.ndarray:
    c = unpacked(codes[ids], 2 * codes.shape[1])
    return q8[np.arange(c.shape[1])[None, :], c].sum(axis=1).astype(np.uint16)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("m,dim", [(1, 3), (7, 20), (16, 50), (25, 50), (128, 384)])
def test_tables_are_the_reference_quantized(m, dim, metric):
    rng = np.random.default_rng(m + dim)
    dsub = -(-dim // m)
    books = rng.standard_normal((m, 16, dsub)).astype(np.float32)
    q = rng.standard_normal((5, dim)).astype(np.float32)
    luts, q8, base, scale = native.pq4_tables(q, books, metric)
    assert luts.shape == (5, m, 16) and q8.shape == (5, 2 * (-(-m // 2)), 16)
    ref = reference_tables(q, books, metric)
    np.testing.assert_allclose(luts, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(q8, quantize(luts, q8.shape[1]))
    np.testing.assert_allclose(base, luts.min(axis=2).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scale, (luts.max(axis=2) - luts.min(axis=2)).max(axis=1) / 255, rtol=1e-6)
    # every entry within half a step of its float value, the rows past M zero
    back = q8[:, :m].astype(np.float64) * scale[:, None, None] + luts.min(axis=2, keepdims=True)
    assert np.abs(back - luts).max() <= 0.5 * scale.max() * (1 + 1e-4) + 1e-6
    assert not q8[:, m:].any()


ISAS = ["baseline"] + (["avx2"] if native.pq4_isa() == "avx2" else [])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("p,count,n", [(1, 1, 3), (16, 31, 200), (25, 64, 500), (28, 77, 77), (32, 33, 40),
                                       (64, 300, 1000), (100, 65, 90), (128, 96, 128)])
def test_sums_equal_the_reference_at_every_width(isa, p, count, n):
    """Every row width (a block of 32 read 32 bytes at a time, the last columns skipped), partial blocks, and the
    last rows of the array (their 32 bytes would pass its end), with repeated ids."""
    rng = np.random.default_rng(p * 7 + count)
    codes = rng.integers(0, 256, (n, p), dtype=np.uint8)
    q8 = rng.integers(0, 256, (2 * p, 16), dtype=np.uint8)
    ids = rng.integers(0, n, count).astype(np.uint32)
    ids[-1] = n - 1
    ids[0] = n - 1
    np.testing.assert_array_equal(native.pq4_sums(q8, ids, codes, isa), sums_reference(q8, ids, codes))


def test_sums_of_the_largest_table_do_not_overflow():
    """256 sub-spaces of entries 255: 65,280, the most a uint16 sum holds here."""
    codes = np.full((40, 128), 0xFF, np.uint8)
    q8 = np.full((256, 16), 255, np.uint8)
    for isa in ISAS:
        assert (native.pq4_sums(q8, np.arange(40, dtype=np.uint32), codes, isa) == 65280).all()
    with pytest.raises(ValueError, match="M <= 256"):
        native.Pq4Codebooks(np.zeros((257, 16, 1), np.float32))


def test_the_simd_kernel_is_the_one_chosen_and_the_environment_asks_for_the_scalar_one():
    if native.pq4_isa() != "avx2":
        pytest.skip("this CPU has no AVX2: the scalar kernel is the only one (tested above)")
    code = "from fusionrag import native; print(native.pq4_isa())"
    env = {**os.environ, "FUSIONRAG_SCAN4_ISA": "baseline"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "baseline"


def scan_reference(q8, base, scale, probes, offsets, ids, codes, n, exclude=None):
    q = probes.shape[0]
    out_ids = np.full((q, n), -1, np.int64)
    out_d = np.full((q, n), np.inf, np.float32)
    counts = np.zeros((q, 2), np.int64)
    for i in range(q):
        parts = [ids[offsets[c]:offsets[c + 1]] for c in probes[i] if c != -1]
        got = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        uniq = np.unique(got).astype(np.int64)
        if exclude is not None:
            uniq = uniq[np.unpackbits(exclude, bitorder="little")[uniq] == 0]
        s = sums_reference(q8[i], uniq, codes).astype(np.int64)
        order = np.lexsort((uniq, s))[:n]
        out_ids[i, :len(order)] = uniq[order]
        out_d[i, :len(order)] = base[i] + scale[i] * s[order].astype(np.float32)
        counts[i] = (len(got), len(uniq))
    return out_ids, out_d, counts


@pytest.mark.parametrize("m,dim,q,n,n_probe", [(2, 4, 3, 5, 3), (25, 50, 37, 100, 6), (128, 384, 5, 1000, 8),
                                               (9, 27, 1, 1, 1)])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_scan_topn_pq4_matches_reference(m, dim, q, n, n_probe, num_threads, metric):
    rng = np.random.default_rng(m * 100 + q)
    offsets, ids, _ = make_index(rng, 500, 30, 1)
    dsub = -(-dim // m)
    books = rng.standard_normal((m, 16, dsub)).astype(np.float32)
    codes = packed(rng.integers(0, 16, (500, m), dtype=np.uint8))
    queries = rng.standard_normal((q, dim)).astype(np.float32)
    probes = rng.integers(0, 30, (q, n_probe)).astype(np.int32)
    probes[rng.random((q, n_probe)) < 0.2] = -1
    exclude = np.packbits(rng.random(500) < 0.3, bitorder="little")
    _, q8, base, scale = native.pq4_tables(queries, books, metric)
    laid = native.Pq4Codebooks(books)
    for ex in (None, exclude):
        got_ids, got_d, counts, seconds, lut_s = native.scan_topn_pq4(queries, laid, metric, probes, offsets, ids,
                                                                      codes, n, num_threads, ex)
        ref_ids, ref_d, ref_counts = scan_reference(q8, base, scale, probes, offsets, ids, codes, n, ex)
        np.testing.assert_array_equal(got_ids, ref_ids)
        np.testing.assert_allclose(got_d, ref_d, rtol=1e-6)
        np.testing.assert_array_equal(counts, ref_counts)
        assert (seconds >= 0).all() and (lut_s >= 0).all()
        if ex is not None:
            bits = np.unpackbits(ex, bitorder="little")
            assert not bits[got_ids[got_ids >= 0]].any()


def test_scan_ranks_by_the_float_table_within_its_rounding():
    """Against the unquantized 4-bit distances on clustered data: the n best by integer sums hold every candidate
    whose float distance beats the n-th by more than the rounding can move it (M * scale)."""
    rng = np.random.default_rng(5)
    m, dim, n_vec = 32, 64, 3000
    books = rng.standard_normal((m, 16, 2)).astype(np.float32)
    codes4 = rng.integers(0, 16, (n_vec, m), dtype=np.uint8)
    codes = packed(codes4)
    offsets = np.array([0, n_vec], np.int64)
    ids = np.arange(n_vec, dtype=np.uint32)
    queries = rng.standard_normal((4, dim)).astype(np.float32)
    luts, _, _, scale = native.pq4_tables(queries, books, "l2")
    got, _, _, _, _ = native.scan_topn_pq4(queries, books, "l2", np.zeros((4, 1), np.int32), offsets, ids, codes,
                                           50, 1)
    for i in range(4):
        exact = luts[i][np.arange(m)[None, :], codes4].sum(axis=1)
        nth = np.sort(exact)[49]
        must = np.flatnonzero(exact < nth - m * scale[i])
        assert len(must) > 10 and np.isin(must, got[i]).all()


def test_distances_of_chosen_ids():
    rng = np.random.default_rng(9)
    m, dim, n_vec = 25, 50, 9000  # more ids than a task's block of 4096
    books = rng.standard_normal((m, 16, 2)).astype(np.float32)
    codes = packed(rng.integers(0, 16, (n_vec, m), dtype=np.uint8))
    queries = rng.standard_normal((3, dim)).astype(np.float32)
    ids = rng.integers(0, n_vec, (3, 5000)).astype(np.int64)
    ids[:, ::7] = -1
    got = native.pq4_distances(queries, books, "l2", ids, codes, 2)
    _, q8, base, scale = native.pq4_tables(queries, books, "l2")
    for i in range(3):
        ok = ids[i] >= 0
        want = base[i] + scale[i] * sums_reference(q8[i], ids[i][ok], codes).astype(np.float32)
        np.testing.assert_allclose(got[i][ok], want, rtol=1e-6)
        assert np.isinf(got[i][~ok]).all()
    with pytest.raises(ValueError, match="out of range"):
        native.pq4_distances(queries[:1], books, "l2", np.array([[n_vec]]), codes)


def test_bad_shapes_are_refused():
    books = np.zeros((8, 16, 2), np.float32)
    codes = np.zeros((10, 4), np.uint8)
    q = np.zeros((1, 16), np.float32)
    one = np.zeros((1, 1), np.int32)
    offsets, ids = np.array([0, 10], np.int64), np.arange(10, dtype=np.uint32)
    with pytest.raises(ValueError, match=r"shape \(M, 16, dsub\)"):
        native.Pq4Codebooks(np.zeros((8, 256, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \(N, 4\)"):
        native.scan_topn_pq4(q, books, "l2", one, offsets, ids, np.zeros((10, 8), np.uint8), 5)
    with pytest.raises(ValueError, match="dimension 17"):
        native.scan_topn_pq4(np.zeros((1, 17), np.float32), books, "l2", one, offsets, ids, codes, 5)
    with pytest.raises(ValueError, match="q8 must have shape"):
        native.pq4_sums(np.zeros((4, 16), np.uint8), np.zeros(1, np.uint32), codes)
    with pytest.raises(ValueError, match="no avx512 kernel"):
        native.pq4_sums(np.zeros((8, 16), np.uint8), np.zeros(1, np.uint32), codes, "avx512")
