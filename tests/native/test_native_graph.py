"""The HNSW navigation graph over posting-list centroids, against brute force."""

import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
from rss import rss_anon, run_alone

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


@pytest.mark.parametrize("quantize", [False, True])
def test_a_graph_loaded_without_links_searches_exactly_alone_and_holds_no_links(tmp_path, quantize):
    """What an index that navigates exactly loads (Graph.load(links=False)): exact_search answers as the whole
    graph's does, the links stay on disk (the process's resident memory, not the graph's count, grows by them only
    when they are loaded), and what needs them says so."""
    rng = np.random.default_rng(8)
    n, M = 100_000, 4
    x = clustered(rng, n, 8)
    g = Graph(8, "l2", M=M, ef_construction=8, seed=1)
    g.add(x, num_threads=2)
    path = tmp_path / "graph.bin"
    g.save(path)
    del g
    # Resident growth in a process of its own: memory this one freed, reused, would not show.
    bare_grew, whole_grew = map(int, run_alone(__file__, "load", str(path), str(int(quantize))).split())
    links = n * (1 + 2 * M) * 4  # level 0's lists alone
    assert whole_grew - bare_grew >= 0.9 * links, (whole_grew, bare_grew, links)
    bare = Graph.load(path, quantize=quantize, links=False)
    whole = Graph.load(path, quantize=quantize)
    assert not bare.linked and whole.linked and (bare.size, bare.dim) == (whole.size, whole.dim)
    assert whole.memory_bytes() - bare.memory_bytes() >= links
    q = clustered(rng, 50, 8)
    for a, b in zip(bare.exact_search(q, 16), whole.exact_search(q, 16)):
        np.testing.assert_array_equal(a, b)
    for call in (lambda: bare.search(q, 5, 32), bare.reachable):
        with pytest.raises(ValueError, match="without its links"):
            call()
    if not quantize:  # (a quantized graph refuses these anyway)
        for call in (lambda: bare.add(x[:3]), bare.repair, lambda: bare.save(tmp_path / "again.bin")):
            with pytest.raises(ValueError, match="without its links"):
                call()


@pytest.mark.parametrize("quantize", [False, True])
def test_load_rejects_bad_files(tmp_path, quantize):
    g = Graph(4)
    g.add(np.random.default_rng(0).normal(size=(100, 4)).astype(np.float32))
    good = tmp_path / "g.bin"
    g.save(str(good))
    blob = good.read_bytes()

    truncated = tmp_path / "truncated.bin"
    for cut in (10, 64, 200, len(blob) - 1):
        truncated.write_bytes(blob[:cut])
        with pytest.raises(ValueError, match="truncated.bin"):
            Graph.load(str(truncated), quantize=quantize)

    wrong_magic = tmp_path / "magic.bin"
    wrong_magic.write_bytes(b"NOTGRAPH" + blob[8:])
    with pytest.raises(ValueError, match="magic"):
        Graph.load(str(wrong_magic), quantize=quantize)

    trailing = tmp_path / "trailing.bin"
    trailing.write_bytes(blob + b"\0" * 4)
    with pytest.raises(ValueError, match="trailing"):
        Graph.load(str(trailing), quantize=quantize)
    for bad, match in ((truncated, "truncated"), (wrong_magic, "magic"), (trailing, "trailing")):
        with pytest.raises(ValueError, match=match):  # a load that leaves the links on disk checks the file alike
            Graph.load(str(bad), quantize=quantize, links=False)

    bad_link = bytearray(blob)  # first link id of node 0 points past the end
    start = 64 + 100 + 100 * 4 * 4
    bad_link[start + 4 : start + 8] = (1000).to_bytes(4, "little")
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(bytes(bad_link))
    with pytest.raises(ValueError, match="inconsistent"):
        Graph.load(str(corrupt), quantize=quantize)

    with pytest.raises((OSError, RuntimeError), match="missing.bin"):
        Graph.load(str(tmp_path / "missing.bin"), quantize=quantize)
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


# SQ8: the graph loaded with its vectors as 8-bit codes per dimension (Graph.load(quantize=True)).


def sq8_step(x):
    """The code step s_i of each dimension, as load(quantize=True) picks it."""
    span = x.max(0).astype(np.float64) - x.min(0)
    return np.where(span > 0, span / 255, 1.0)


def saved(tmp_path, x, metric="l2", **kw):
    g = Graph(x.shape[1], metric, seed=1, **kw)
    g.add(x, num_threads=1)  # the same graph every run (a build on several threads links in its own order)
    path = tmp_path / "graph.bin"
    g.save(path)
    return g, path


# Ranges per dimension: alike; one dimension 1000x wider than the rest, holding a few levels (a
# group label); spreads over six orders of magnitude; offsets of +-1e4. Out of reach of 8 bits, and
# so not here: detail inside a dimension much wider than the rest, which then orders the points
# alone (x[:, 7] *= 1000 on this data: top-32 overlap 0.76; 1000 * group + x[:, 7]: 0.92).
@pytest.mark.parametrize("dim,metric,ranges", [
    (64, "l2", "even"), (300, "l2", "even"), (64, "l2", "one dim x1000"),
    (64, "l2", "1e-3 .. 1e3"), (64, "l2", "offsets"), (64, "ip", "even"),
])
def test_sq8_search_agrees_with_float(tmp_path, dim, metric, ranges):
    rng = np.random.default_rng(dim)
    x = clustered(rng, 5200, dim)
    if ranges == "one dim x1000":
        x[:, 7] = 1000 * rng.integers(0, 16, len(x))
    elif ranges == "1e-3 .. 1e3":
        x *= np.logspace(-3, 3, dim, dtype=np.float32)[rng.permutation(dim)]
    elif ranges == "offsets":
        x += np.linspace(-1e4, 1e4, dim, dtype=np.float32)
    x, q = x[200:], x[:200]
    g, path = saved(tmp_path, x, metric)
    h = Graph.load(path, quantize=True)
    assert h.quantized and not g.quantized and "quantized=True" in repr(h)
    for m in (32, 256):
        want, _ = g.search(q, m, m)
        ids, dists = h.search(q, m, m)
        assert np.mean([len(np.intersect1d(a, b)) / m for a, b in zip(ids, want)]) >= 0.95
        assert np.all(np.diff(dists, axis=1) >= 0)
        # Against the true distances of the same nodes. The decoded x' is within s_i/2 of x per
        # coordinate, so the l2 distance (a norm) moves by at most ||s||/2, and -q.x by at most
        # sum |q_i| s_i / 2: bounds that hold for every pair, whatever the data.
        x64, q64 = x[ids].astype(np.float64), q.astype(np.float64)
        if metric == "l2":
            exact = ((q64[:, None, :] - x64) ** 2).sum(-1)
            off = np.abs(np.sqrt(dists) - np.sqrt(exact))
            assert np.all(off <= np.linalg.norm(sq8_step(x)) / 2 * 1.001 + 1e-6 * np.sqrt(exact).max())
        else:
            exact = -np.einsum("qd,qkd->qk", q64, x64)
            bound = np.abs(q64) @ sq8_step(x) / 2
            assert np.all(np.abs(dists - exact) <= bound[:, None] * 1.001 + 1e-6 * np.abs(exact).max())
        # Typical error is far below the bound: 0.1-4% of the distance here (the most where a few
        # wide dimensions carry the distance).
        assert np.median(np.abs(dists - exact) / np.abs(exact)) <= 0.06


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("dim", [7, 13, 50, 100, 385])
def test_sq8_search_distances_are_those_of_the_decoded_vectors(tmp_path, metric, dim):
    """The SQ8 distance kernels, through the graph's search, at dimensions that leave every kind of tail past
    their vectors of 32 and 16 lanes and 8 (GloVe's 50): each distance returned is the decoded vector's."""
    rng = np.random.default_rng(dim)
    x = clustered(rng, 600, dim, clusters=20)
    _, path = saved(tmp_path, x, metric, M=8, ef_construction=32)
    g = Graph.load(path, quantize=True)
    q = clustered(rng, 9, dim, clusters=20)
    ids, dists = g.search(q, 20, 64)
    v = g.vectors().astype(np.float64)[ids]  # (9, 20, dim)
    q64 = q.astype(np.float64)[:, None, :]
    want = ((q64 - v) ** 2).sum(-1) if metric == "l2" else -(q64 * v).sum(-1)
    np.testing.assert_allclose(dists, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_sq8_graph_is_read_only_and_smaller(tmp_path):
    rng = np.random.default_rng(3)
    x = clustered(rng, 3000, 40)
    x[:, 5] = 2.5  # a constant dimension is coded exactly
    g, path = saved(tmp_path, x, M=8, ef_construction=64)
    h = Graph.load(path, quantize=True)
    assert (h.size, h.dim, h.metric) == (g.size, g.dim, g.metric)

    v = h.vectors()
    assert v.dtype == np.float32 and v.shape == x.shape
    step = sq8_step(x)
    slack = 4 * np.finfo(np.float32).eps * np.abs(x).max(0)  # float rounding of lo + s * code
    assert np.all(np.abs(v.astype(np.float64) - x) <= step / 2 + slack)
    assert np.all(v[:, 5] == 2.5)
    assert not np.array_equal(v, x)

    # Codes take a byte where a float took four; two per-dimension floats (lo, s) come on top.
    saved_bytes = g.memory_bytes() - h.memory_bytes()
    assert saved_bytes == x.nbytes - x.size - 2 * 40 * 4

    with pytest.raises(ValueError, match="quantized graph is read-only; load it with quantize=False"):
        h.add(x[:10])
    with pytest.raises(ValueError, match="quantize=False"):
        h.save(tmp_path / "again.bin")
    assert not (tmp_path / "again.bin").exists()
    assert h.size == 3000

    empty = tmp_path / "empty.bin"
    Graph(8).save(empty)
    e = Graph.load(empty, quantize=True)
    ids, dists = e.search(np.zeros((2, 8), np.float32), 3, 10)
    assert e.quantized and np.all(ids == -1) and np.all(np.isinf(dists)) and e.vectors().shape == (0, 8)


def test_sq8_load_rejects_non_finite_vectors(tmp_path):
    x = np.random.default_rng(4).normal(size=(50, 4)).astype(np.float32)
    x[17, 2] = np.nan
    _, path = saved(tmp_path, x)
    assert Graph.load(path).size == 50  # the float graph holds what it is given
    with pytest.raises(ValueError, match="node 17 has a non-finite coordinate"):
        Graph.load(path, quantize=True)


# exact_search: the k nearest of every node by exact distance (the navigation tier's exhaustive mode).


def _true_distances(vectors, q, metric):
    """float64, from the vectors the graph holds (decoded, where quantized), as brute force."""
    v, q64 = vectors.astype(np.float64), q.astype(np.float64)
    return (q64 ** 2).sum(1)[:, None] - 2 * q64 @ v.T + (v ** 2).sum(1)[None] if metric == "l2" else -(q64 @ v.T)


def _check_exact(ids, dists, truth, k):
    """Each row: the k (or all) nearest, nearest first, their distances the true ones to float rounding, nothing
    left out that is nearer than the farthest kept; -1 / inf past the graph's size."""
    n = truth.shape[1]
    kept = min(k, n)
    tol = 1e-5 * np.abs(truth).max()
    assert ids.shape == dists.shape == (len(truth), k) and ids.dtype == np.int32 and dists.dtype == np.float32
    for row, (i, d) in enumerate(zip(ids, dists)):
        assert np.all(i[kept:] == -1) and np.all(np.isinf(d[kept:]))
        i, d = i[:kept], d[:kept]
        assert len(set(i.tolist())) == kept and i.min() >= 0 and i.max() < n
        np.testing.assert_allclose(d, truth[row, i], rtol=0, atol=tol)
        assert np.all(np.diff(d) >= 0)
        assert truth[row, i].max() <= np.sort(truth[row])[kept - 1] + tol


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("dim,metric", [(384, "l2"), (13, "l2"), (385, "ip"), (8, "ip")])
def test_exact_search_is_brute_force_over_the_held_vectors(tmp_path, quantize, dim, metric):
    """Against float64 brute force over g.vectors() (the decoded codes where quantized): queries one at a time, in
    blocks of 4, across tasks of 8 and a tail; dimensions that are and are not multiples of the vector width;
    k from 1 to past the size; 1 and 2 threads."""
    rng = np.random.default_rng(dim)
    x = clustered(rng, 1501, dim, clusters=40)
    _, path = saved(tmp_path, x, metric, M=8, ef_construction=32)
    g = Graph.load(path, quantize=quantize)
    q = clustered(rng, 37, dim, clusters=40)
    truth = _true_distances(g.vectors(), q, metric)
    for nq in (1, 3, 4, 5, 16, 37):
        for k, threads in ((1, 1), (10, 2), (64, 1), (1501, 2), (1504, 1)):
            ids, dists = g.exact_search(q[:nq], k, threads)
            _check_exact(ids, dists, truth[:nq], k)
    if metric == "l2":  # the graph's own search (navigation's: always l2) finds it, up to its approximation
        ids, _ = g.exact_search(q, 32, 2)
        approx, _ = g.search(q, 32, 256)
        assert np.mean([len(np.intersect1d(a, b)) / 32 for a, b in zip(ids, approx)]) >= 0.9


def test_exact_search_orders_ties_by_id(tmp_path):
    """Three copies of every vector: equal distances, so each copy follows the lower ids, and k cuts a tie
    where it falls (the ids a stable sort gives), whether the copies share a pair of rows, a chunk, or neither."""
    rng = np.random.default_rng(9)
    base = clustered(rng, 401, 24, clusters=20)
    x = np.concatenate([base, base, base])  # node i, i + 401, i + 802 alike
    _, path = saved(tmp_path, x, M=8, ef_construction=32)
    for quantize in (False, True):
        g = Graph.load(path, quantize=quantize)
        q = base[:9] + rng.normal(size=(9, 24)).astype(np.float32) * 0.01
        ids, _ = g.exact_search(q, 20, 2)
        full, d = g.exact_search(q, 1203, 1)
        for row in range(9):
            np.testing.assert_array_equal(ids[row], full[row][:20])
            np.testing.assert_array_equal(ids[row][:3], [row, row + 401, row + 802])
            tie = d[row][1:] == d[row][:-1]
            assert tie.sum() >= 2 * 401 - 10  # copies come out at exactly equal distances ...
            assert np.all(np.diff(full[row])[tie] > 0)  # ... and by id
            np.testing.assert_array_equal(np.sort(full[row]), np.arange(1203))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _builds_x86_kernels() -> bool:
    """Whether the compiler that built the extension (CMake's default, c++ on the PATH) is a GCC of 11 or later,
    the condition for dot_rows.cpp's AVX2 and VNNI builds."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if not cxx:
        return False
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    major = subprocess.run([cxx, "-dumpversion"], capture_output=True, text=True).stdout.strip().split(".")[0]
    return "clang" not in version.lower() and major.isdigit() and int(major) >= 11


def _isa_given(asked: str) -> str:
    """The build native.dot_isa() must report when FUSIONRAG_DOT_ISA asks for one: it where this CPU has it,
    else the best it has (an x86-64 CPU's flags in /proc/cpuinfo, read independently of the code's cpuid);
    the baseline alone where the compiler builds no x86 kernels."""
    flags = _cpu_flags() if platform.machine() == "x86_64" else set()
    if asked == "baseline" or not {"avx2", "fma"} <= flags or not _builds_x86_kernels():
        return "baseline"
    vnni, vnni512 = "avx_vnni" in flags, {"avx512_vnni", "avx512vl"} <= flags
    if asked == "avx2":
        return "avx2"
    if vnni and asked != "avx512vnni":
        return "avxvnni"
    return "avx512vnni" if vnni512 else "avx2"


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avxvnni", "avx512vnni"])
def test_exact_search_every_build_agrees(tmp_path, isa):
    """Each build of the kernels (FUSIONRAG_DOT_ISA: the baseline's SSE pairs and scalar integers, AVX2's
    vpmaddubsw, the two VNNIs' vpdpbusd), in a process of its own (the build is chosen once per process):
    screened and not, float and SQ8, dimensions with and without a tail past 32 bytes, against brute force."""
    rng = np.random.default_rng(5)
    q = {}
    for dim in (100, 64):
        x = clustered(rng, 700, dim, clusters=30)
        (tmp_path / str(dim)).mkdir()
        saved(tmp_path / str(dim), x, M=8, ef_construction=32)
        q[dim] = clustered(rng, 21, dim, clusters=30)
        np.save(tmp_path / str(dim) / "q.npy", q[dim])
    script = ("import sys, numpy as np; from fusionrag.native import Graph, dot_isa\n"
              "print(dot_isa())\n"
              "for dim in (100, 64):\n"
              "    p = f'{sys.argv[1]}/{dim}'; q = np.load(p + '/q.npy')\n"
              "    for quantize in (False, True):\n"
              "        g = Graph.load(p + '/graph.bin', quantize=quantize)\n"
              "        for k in (5, 50, 400):\n"
              "            for screen in (True, False):\n"
              "                ids, d = g.exact_search(q, k, 2, screen)\n"
              "                np.save(p + f'/ids{int(quantize)}{k}{int(screen)}.npy', ids)\n"
              "                np.save(p + f'/d{int(quantize)}{k}{int(screen)}.npy', d)\n")
    env = dict(os.environ, FUSIONRAG_DOT_ISA=isa)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, timeout=120,
                         capture_output=True, text=True)
    assert run.stdout.split()[0] == _isa_given(isa)
    for dim in (100, 64):
        for quantize in (False, True):
            g = Graph.load(tmp_path / str(dim) / "graph.bin", quantize=quantize)
            truth = _true_distances(g.vectors(), q[dim], "l2")
            for k in (5, 50, 400):
                for screen in (1, 0):
                    ids = np.load(tmp_path / str(dim) / f"ids{int(quantize)}{k}{screen}.npy")
                    dists = np.load(tmp_path / str(dim) / f"d{int(quantize)}{k}{screen}.npy")
                    _check_exact(ids, dists, truth, k)


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("dim", [64, 100, 384, 785])
def test_screen_keeps_every_node_within_rounding_of_the_kept(tmp_path, metric, dim):
    """The screen's worst case: nodes on a sphere around the queries (l2), or at one inner product with them
    (ip), their distances apart by about the error of the integer estimates, so the screen rules out fewer. It
    must still keep every node that can be among the k, ties by id: the answer is brute force's, screened or
    not, with k from 1 to a quarter of the nodes (past that, no screen), rows of 64 codes and more (below, no
    screen), with and without a tail past 32 bytes."""
    rng = np.random.default_rng(dim)
    n = 1200
    u = rng.normal(size=(n, dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    center = rng.normal(size=dim)
    center /= np.linalg.norm(center)  # terms of about 1: float32 rounding stays within _check_exact's 1e-5
    x = (center + u).astype(np.float32)
    _, path = saved(tmp_path, x, metric, M=8, ef_construction=32)
    g = Graph.load(path, quantize=True)
    if metric == "l2":  # near the centre: every node at a distance of about 1
        q = (center + 1e-3 * rng.normal(size=(9, dim))).astype(np.float32)
    else:  # along the centre: every node at about the same inner product
        q = (center + 1e-3 * rng.normal(size=(9, dim))).astype(np.float32)
    truth = _true_distances(g.vectors(), q, metric)
    for k in (1, 7, 64, n // 4):
        screened, sd = g.exact_search(q, k, 2)
        _check_exact(screened, sd, truth, k)
        full, fd = g.exact_search(q, k, 2, False)
        _check_exact(full, fd, truth, k)
        np.testing.assert_allclose(sd, fd, rtol=1e-5, atol=1e-6 * np.abs(truth).max())


def test_exact_search_rejects_bad_arguments_and_counts_its_norms(tmp_path):
    rng = np.random.default_rng(2)
    x = clustered(rng, 300, 16, clusters=10)
    _, path = saved(tmp_path, x, M=8, ef_construction=32)
    g = Graph.load(path, quantize=True)
    with pytest.raises(ValueError, match=r"queries must have shape \(n, 16\)"):
        g.exact_search(np.zeros((2, 15), np.float32), 3)
    with pytest.raises(ValueError, match="k must be positive"):
        g.exact_search(np.zeros((2, 16), np.float32), 0)
    with pytest.raises(ValueError, match="queries must be finite"):
        g.exact_search(np.full((2, 16), np.nan, np.float32), 3)
    before = g.memory_bytes()
    g.exact_search(x[:2], 3)
    assert g.memory_bytes() - before == 300 * 4  # ||x_j||^2 of each node, kept for the next call
    _, wide = saved(tmp_path, clustered(rng, 300, 64, clusters=10), M=8, ef_construction=32)
    g = Graph.load(wide, quantize=True)
    before = g.memory_bytes()
    g.exact_search(x[:2].repeat(4, axis=1), 3, screen=False)
    assert g.memory_bytes() - before == 300 * 4
    g.exact_search(x[:2].repeat(4, axis=1), 3)
    assert g.memory_bytes() - before == 2 * 300 * 4  # and the screen's ||c_j - 128|| (64 codes a row and more)
    empty = tmp_path / "empty.bin"
    Graph(16).save(empty)
    ids, dists = Graph.load(empty, quantize=True).exact_search(np.zeros((2, 16), np.float32), 3)
    assert np.all(ids == -1) and np.all(np.isinf(dists))

    grown = Graph(16, seed=1)  # a float graph that grows gets its new nodes' norms on the next call
    grown.add(x[:100])
    grown.exact_search(x[:1], 1)
    grown.add(x[100:])
    ids, dists = grown.exact_search(x[250:260], 1)
    np.testing.assert_array_equal(ids[:, 0], np.arange(250, 260))
    # ||q||^2 - 2 q.x + ||x||^2, as a matrix product computes it: 0 up to the rounding of its terms
    assert np.all(dists[:, 0] <= 1e-5 * (x[250:260] ** 2).sum(1))


def tight_clusters(rng, clusters, per, dim, spread):
    """Many small, well-apart clusters, as the centroids of clustered data are: where HNSW's heuristic leaves
    some nodes with no link into them."""
    c = rng.normal(size=(clusters, dim)).astype(np.float32)
    return (np.repeat(c, per, 0) + spread * rng.normal(size=(clusters * per, dim))).astype(np.float32)


def level0_lists(path) -> tuple[int, np.ndarray]:
    """(entry point, level-0 lists [count, ids...] a row per node) read from a saved graph file (the layout of
    native/graph.cpp's save), apart from the graph's own accounts."""
    raw = np.fromfile(path, np.uint8)
    dim, m, _, _, size = (int(v) for v in raw[16:56].view(np.uint64))
    off = 64 + size + size * dim * 4
    return int(raw[56:60].view(np.uint32)[0]), raw[off:off + size * (1 + 2 * m) * 4].view(np.uint32).reshape(size, -1)


def reached_in_file(path) -> np.ndarray:
    """Nodes reachable on level 0 from the entry point, by a walk over the saved file's lists."""
    entry, lists = level0_lists(path)
    seen = np.zeros(len(lists), bool)
    seen[entry] = True
    stack = [entry]
    while stack:
        row = lists[stack.pop()]
        for j in row[1:1 + row[0]]:
            if not seen[j]:
                seen[j] = True
                stack.append(int(j))
    return seen


def test_repair_links_every_node_into_reach(tmp_path):
    x = tight_clusters(np.random.default_rng(0), 2000, 10, 64, 0.05)
    plain = Graph(64, M=8, ef_construction=32, seed=1, repair=False)
    plain.add(x, num_threads=2)
    plain.save(tmp_path / "plain.bin")
    seen = reached_in_file(tmp_path / "plain.bin")
    out = np.flatnonzero(~seen)
    assert len(out) > 20, "the data no longer leaves nodes out of reach: the test checks nothing"
    assert plain.reachable() == seen.sum() and plain.repaired == 0
    # searches find few of them (those with upper levels can still be where a search starts on level 0)
    found_before = np.mean(plain.search(x[out], 1, 64)[0][:, 0] == out)

    fixed = Graph(64, M=8, ef_construction=32, seed=1)  # repair is the default
    fixed.add(x, num_threads=2)
    fixed.save(tmp_path / "fixed.bin")
    assert reached_in_file(tmp_path / "fixed.bin").all() and fixed.reachable() == len(x)
    assert 0 < fixed.repaired < len(x)
    again = Graph.load(tmp_path / "fixed.bin")  # links within their lists' room: the file loads
    assert reached_in_file(tmp_path / "fixed.bin").sum() == again.reachable()
    # nodes a search now reaches are found by a search for themselves (truth: each node is its own nearest). Whether
    # the graph finds as many nodes overall is asserted below on one graph before and after its repair, not across
    # two builds: builds on two threads interleave differently, and such pairs (plain, repaired at build) measured
    # 0.629-0.686 against 0.642-0.691, either one ahead
    ids = fixed.search(x, 1, 64)[0][:, 0]
    assert np.mean(ids[out] == out) > max(0.5, found_before)
    # the same graph repaired afterwards (Graph.repair): every node in reach, and a second repair has nothing to do
    before = plain.search(x, 1, 64)[0][:, 0] == np.arange(len(x))
    assert plain.repair() == plain.repaired > 0
    plain.save(tmp_path / "plain.bin")
    assert reached_in_file(tmp_path / "plain.bin").all() and plain.repair() == 0
    after = plain.search(x, 1, 64)[0][:, 0] == np.arange(len(x))
    # more found, few of those found before lost (a beam of 64 follows the new links too; measured: 0.7-1%)
    assert after[before].mean() > 0.97 and after.mean() > before.mean()


def test_a_loaded_graph_grown_stays_in_reach(tmp_path):
    rng = np.random.default_rng(1)
    x = tight_clusters(rng, 2000, 10, 64, 0.05)
    g = Graph(64, M=8, ef_construction=32, seed=2)
    g.add(x[:10000], num_threads=2)
    g.save(tmp_path / "g.bin")
    grown = Graph.load(tmp_path / "g.bin")  # as a merge grows an index's graph
    grown.add(x[10000:], num_threads=2)
    grown.save(tmp_path / "grown.bin")
    assert reached_in_file(tmp_path / "grown.bin").all()
    with pytest.raises(ValueError, match="read-only"):  # an SQ8 graph only searches
        Graph.load(tmp_path / "g.bin", quantize=True).repair()


def test_alpha_bounds_and_its_effect(tmp_path, data):
    x, _ = data
    with pytest.raises(ValueError, match="alpha"):
        Graph(32, alpha=0.9)
    with pytest.raises(ValueError, match="alpha"):
        Graph(32, alpha=float("nan"))
    links = {}
    for alpha in (1.0, 1.5):
        g = Graph(32, M=8, ef_construction=64, seed=1, alpha=alpha)
        g.add(x)
        g.save(tmp_path / f"{alpha}.bin")
        links[alpha] = level0_lists(tmp_path / f"{alpha}.bin")[1][:, 0]
        assert links[alpha].max() <= 16 and reached_in_file(tmp_path / f"{alpha}.bin").all()
    assert links[1.5].mean() > 1.3 * links[1.0].mean()  # keeps more, longer links (in the same room)


if __name__ == "__main__" and sys.argv[1:2] == ["load"]:  # resident growth of a load without and with links
    before = rss_anon()
    bare = Graph.load(sys.argv[2], quantize=bool(int(sys.argv[3])), links=False)
    bare_grew = rss_anon() - before
    whole = Graph.load(sys.argv[2], quantize=bool(int(sys.argv[3])))
    print(bare_grew, rss_anon() - before - bare_grew)


def test_search_from_given_entries(data):
    """entries start each query's level-0 search at a node of the caller's choosing: a query next to node e, started
    at e, finds e even at beam 1, where a greedy descent from the entry point misses some (so the entries were
    used); -1 searches as without entries; a wrong count of entries is refused."""
    x, _ = data
    g = Graph(32, "l2", M=16, ef_construction=200, seed=1)
    g.add(x)
    rng = np.random.default_rng(5)
    nodes = rng.choice(len(x), 500, replace=False).astype(np.int32)
    q = x[nodes] + rng.normal(size=(500, 32)).astype(np.float32) * 1e-3
    plain, _ = g.search(q, 1, 1)
    started, _ = g.search(q, 1, 1, entries=nodes)
    assert np.array_equal(started[:, 0], nodes)
    assert np.mean(plain[:, 0] == nodes) < 1.0
    wide, wide_d = g.search(q, 10, 64)
    same, same_d = g.search(q, 10, 64, entries=np.full(500, -1, np.int32))
    assert np.array_equal(wide, same) and np.array_equal(wide_d, same_d)
    with pytest.raises(ValueError, match="one node per query"):
        g.search(q, 1, 1, entries=nodes[:10])
