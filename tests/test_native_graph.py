"""The HNSW navigation graph over posting-list centroids, against brute force."""

import numpy as np
import pytest

from fusionrag.native import Graph


def clustered(rng, n, dim, clusters=64):
    """Gaussian clusters with a decaying spectrum, like k-means centroids of text embeddings."""
    centers = rng.normal(size=(clusters, dim)) * 3
    scale = 1.0 / np.sqrt(np.arange(1, dim + 1))
    return (centers[rng.integers(0, clusters, n)] + rng.normal(size=(n, dim)) * scale).astype(np.float32)


def brute_force(x, q, k, metric):
    d = ((q[:, None, :] - x[None]) ** 2).sum(-1) if metric == "l2" else -(q @ x.T)
    return np.argsort(d, axis=1, kind="stable")[:, :k]


def recall(ids, truth):
    return np.mean([len(set(a) & set(b)) / truth.shape[1] for a, b in zip(ids, truth)])


@pytest.fixture(scope="module")
def data():
    x = clustered(np.random.default_rng(0), 5200, 32)
    return x[200:], x[:200]  # queries from the same distribution, not in the index


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_recall_against_brute_force(data, metric):
    x, q = data
    g = Graph(32, metric, M=16, ef_construction=200, seed=1)
    g.add(x)
    ids, dists = g.search(q, 10, 64)
    assert ids.shape == (200, 10) and ids.dtype == np.int32 and dists.dtype == np.float32
    assert recall(ids, brute_force(x, q, 10, metric)) >= 0.98
    assert np.all(np.diff(dists, axis=1) >= 0)
    want = ((q[:, None, :] - x[ids]) ** 2).sum(-1) if metric == "l2" else -np.einsum("qd,qkd->qk", q, x[ids])
    np.testing.assert_allclose(dists, want, rtol=1e-4, atol=1e-3)


def test_multithreaded_build_as_good_as_single(data):
    x, q = data
    truth = brute_force(x, q, 10, "l2")
    single, multi = Graph(32, seed=3), Graph(32, seed=3)
    single.add(x, num_threads=1)
    multi.add(x, num_threads=2)
    r1 = recall(single.search(q, 10, 64, num_threads=1)[0], truth)
    r2 = recall(multi.search(q, 10, 64, num_threads=2)[0], truth)
    assert r2 >= 0.98 and r2 >= r1 - 0.01


def test_single_thread_build_is_deterministic():
    rng = np.random.default_rng(1)
    x, q = clustered(rng, 1500, 16), clustered(rng, 50, 16)
    results = []
    for _ in range(2):
        g = Graph(16, "l2", M=8, ef_construction=50, seed=42)
        g.add(x, num_threads=1)
        results.append(g.search(q, 5, 20))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_k_larger_than_size_pads():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(7, 8)).astype(np.float32)
    g = Graph(8)
    ids, dists = g.search(x[:2], 3, 10)  # empty graph
    assert np.all(ids == -1) and np.all(np.isinf(dists))
    g.add(x)
    ids, dists = g.search(x[:3], 12, 4)
    assert ids.shape == (3, 12)
    assert np.all(ids[:, 7:] == -1) and np.all(np.isinf(dists[:, 7:]))
    for row in ids:
        assert sorted(row[:7]) == list(range(7))
    assert np.all(ids[:, 0] == [0, 1, 2])  # each query is its own nearest


def test_incremental_add_finds_new_ids(data):
    x, _ = data
    g = Graph(32, seed=5)
    g.add(x[:3000])
    g.add(x[3000:])
    assert g.size == len(x) == len(g)
    ids, dists = g.search(x[3000:3200], 1, 32)
    assert np.mean(ids[:, 0] == np.arange(3000, 3200)) >= 0.99
    np.testing.assert_array_equal(g.vectors(), x)


def test_save_load_round_trip(tmp_path, data):
    x, q = data
    g = Graph(32, "ip", M=8, ef_construction=64, seed=9)
    g.add(x[:2000])
    path = tmp_path / "graph.bin"
    g.save(path)  # str or os.PathLike
    h = Graph.load(str(path))
    assert (h.size, h.dim, h.metric) == (2000, 32, "ip")
    assert h.memory_bytes() > x[:2000].nbytes
    for a, b in zip(g.search(q, 10, 40), h.search(q, 10, 40)):
        np.testing.assert_array_equal(a, b)
    # Grown after loading, it equals a graph grown before saving (levels hash (seed, id)).
    g.add(x[2000:2500], num_threads=1)
    h.add(x[2000:2500], num_threads=1)
    for a, b in zip(g.search(q, 10, 40), h.search(q, 10, 40)):
        np.testing.assert_array_equal(a, b)


def test_load_rejects_bad_files(tmp_path):
    g = Graph(4)
    g.add(np.random.default_rng(0).normal(size=(100, 4)).astype(np.float32))
    good = tmp_path / "g.bin"
    g.save(str(good))
    blob = good.read_bytes()

    truncated = tmp_path / "truncated.bin"
    for cut in (10, 64, 200, len(blob) - 1):
        truncated.write_bytes(blob[:cut])
        with pytest.raises(ValueError, match="truncated.bin"):
            Graph.load(str(truncated))

    wrong_magic = tmp_path / "magic.bin"
    wrong_magic.write_bytes(b"NOTGRAPH" + blob[8:])
    with pytest.raises(ValueError, match="magic"):
        Graph.load(str(wrong_magic))

    trailing = tmp_path / "trailing.bin"
    trailing.write_bytes(blob + b"\0" * 4)
    with pytest.raises(ValueError, match="trailing"):
        Graph.load(str(trailing))

    bad_link = bytearray(blob)  # first link id of node 0 points past the end
    start = 64 + 100 + 100 * 4 * 4
    bad_link[start + 4 : start + 8] = (1000).to_bytes(4, "little")
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(bytes(bad_link))
    with pytest.raises(ValueError, match="inconsistent"):
        Graph.load(str(corrupt))

    with pytest.raises((OSError, RuntimeError), match="missing.bin"):
        Graph.load(str(tmp_path / "missing.bin"))
    with pytest.raises((OSError, RuntimeError), match="nowhere"):
        g.save(tmp_path / "nowhere" / "g.bin")


def test_bad_arguments_raise_value_error():
    g = Graph(8)
    with pytest.raises(ValueError, match="vectors"):
        g.add(np.zeros((5, 7), np.float32))
    with pytest.raises(ValueError, match="vectors"):
        g.add(np.zeros(8, np.float32))
    g.add(np.zeros((5, 8), np.float32))
    with pytest.raises(ValueError, match="queries"):
        g.search(np.zeros((2, 9), np.float32), 3, 10)
    with pytest.raises(ValueError, match="k must be positive"):
        g.search(np.zeros((2, 8), np.float32), 0, 10)
    with pytest.raises(ValueError, match="metric"):
        Graph(8, "cosine")
    with pytest.raises(ValueError, match="dim"):
        Graph(0)
    with pytest.raises(ValueError, match="M"):
        Graph(8, M=1)
    with pytest.raises(ValueError, match="num_threads"):
        g.search(np.zeros((2, 8), np.float32), 3, 10, num_threads=-1)
