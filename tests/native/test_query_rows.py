"""native.check_rows, the one pass that checks query rows and makes them unit length (queries.prepare_queries),
against numpy's reference of the same rules (vectors.vector_problems, vectors.normalize)."""

import numpy as np
import pytest

from fusionrag import native
from fusionrag.retriever.engine.queries import check_queries, prepare_queries
from fusionrag.retriever.engine.vectors import MAX_SQ_NORM, normalize, vector_problems
from fusionrag.retriever.errors import InputError


def _rows(n, d, seed):
    rng = np.random.default_rng(seed)
    # magnitudes from denormal-ish to near the norm bound: where float32 sums would under- or overflow
    scale = 10.0 ** rng.uniform(-30, 14, (n, 1))
    return (rng.standard_normal((n, d)) * scale).astype(np.float32)


@pytest.mark.parametrize("d", [1, 7, 384, 1536])
def test_unit_rows_are_numpys_bit_for_bit(d):
    x = _rows(3000, d, seed=d)
    ok = np.setdiff1d(np.arange(len(x)), vector_problems(x, "cosine")[0])
    x = np.ascontiguousarray(x[ok])
    out, bad, why, _ = native.check_rows(x, True, True, MAX_SQ_NORM)
    assert bad == -1 and why == 0
    np.testing.assert_array_equal(out.view(np.int32), normalize(x).view(np.int32))


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
def test_the_first_bad_row_and_why_are_numpys(metric):
    rng = np.random.default_rng(5)
    for trial in range(200):
        x = rng.standard_normal((8, 16)).astype(np.float32)
        for row in rng.choice(8, rng.integers(0, 4), replace=False):
            kind = rng.integers(0, 5)
            if kind == 0:
                x[row, rng.integers(16)] = np.nan
            elif kind == 1:
                x[row, rng.integers(16)] = -np.inf
            elif kind == 2:
                x[row] = 0.0
            elif kind == 3:
                x[row, rng.integers(16)] = 3e15  # squared norm 9e30, over the bound
            else:
                x[row] = 1e-40  # denormal, yet a direction
        ref_bad, ref_why = vector_problems(x, metric)
        _, bad, why, sq = native.check_rows(x, metric == "cosine", False, MAX_SQ_NORM)
        if ref_bad.size == 0:
            assert bad == -1
            check_queries(x, 16, metric)  # accepted
            continue
        assert bad == ref_bad[0]
        with pytest.raises(InputError) as e:
            check_queries(x, 16, metric)
        assert e.value.args[0] == f"queries: row {ref_bad[0]} {ref_why[0]}"
        if why == 2:
            assert sq == pytest.approx(float(np.sum(x[bad].astype(np.float64) ** 2)), rel=1e-12)


def test_prepared_queries_of_every_input_type():
    x = np.arange(1, 9, dtype=np.int64).reshape(2, 4)
    p = prepare_queries(x, 4, "cosine")
    np.testing.assert_array_equal(p.vectors, normalize(x.astype(np.float32)))
    p = prepare_queries(x.astype(np.float64)[:, ::-1], 4, "l2")  # not contiguous, float64: as float32, not normalised
    np.testing.assert_array_equal(p.vectors, x[:, ::-1].astype(np.float32))
    assert p.vectors.flags.c_contiguous
