"""The fresh tier's exact search (FreshView.search) against brute force: with most slots live (searched in place,
the others out of reach) and with few (gathered), under every metric, with and without an allowed set."""

import numpy as np
import pytest

from fusionrag.retriever.collection.fresh import FreshTier


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("live_share", [1.0, 0.8, 0.5, 0.3, 0.02])
def test_fresh_search_is_exact(metric, live_share):
    rng = np.random.default_rng(int(live_share * 100) + len(metric))
    n, dim, k = 600, 24, 10
    x = rng.standard_normal((n, dim)).astype(np.float32)
    if metric == "cosine":
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    tier = FreshTier(dim, capacity=64)
    rows = np.arange(1000, 1000 + n, dtype=np.int64)
    tier.add(rows, x)
    view = tier.view()
    view.live[:] = rng.random(n) < live_share
    view.live[rng.integers(n)] = True
    q = rng.standard_normal((5, dim)).astype(np.float32)
    if metric == "cosine":
        q /= np.linalg.norm(q, axis=1, keepdims=True)
    for allowed in (None, rng.random(n) < 0.7):
        ok = view.live if allowed is None else view.live & allowed
        got_rows, got_d = view.search(q, k, metric, allowed)
        cand = np.flatnonzero(ok)
        dots = q.astype(np.float64) @ x[cand].astype(np.float64).T
        want_d = {"ip": -dots, "cosine": 1 - dots,
                  "l2": ((q[:, None, :].astype(np.float64) - x[cand][None]) ** 2).sum(-1)}[metric]
        kk = min(k, cand.size)
        assert got_rows.shape == (5, kk)
        for i in range(5):
            order = np.argsort(want_d[i], kind="stable")[:kk]
            np.testing.assert_allclose(got_d[i], want_d[i][order], rtol=1e-4, atol=1e-4)
            assert set(got_rows[i][:kk - 1].tolist()) <= set(rows[cand].tolist())
            # the same set but for ties at the k-th distance
            assert len(set(got_rows[i].tolist()) & set(rows[cand[order]].tolist())) >= kk - 1
