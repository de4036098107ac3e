"""A build within a memory budget (#51): the budget read from the process's cgroup, the parts a budgeted build
does differently (postings grouped on disk, the page file written through spilled ranges) checked against the
in-memory forms they replace, and a build and a search inside a real memory cgroup capped below the raw vectors.

The cgroup tests use cgroup v1's memory controller (tests/cgroup.py, the cgroup_factory fixture): a child cgroup of
the test's own, the process under test moved into it, removed afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fusionrag.retriever.engine.build import PairSpill, postings, write_pages
from fusionrag.retriever.engine.config import MIN_BUILD_BUDGET, BuildConfig
from fusionrag.retriever.engine.kmeans import kmeans
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.process import cgroup_memory_limit, memory_limit
from fusionrag.retriever.progress import Progress


def test_a_cgroup_limit_is_read_from_v1_and_v2_trees(tmp_path):
    """The least limit of the process's cgroup and its ancestors, v2's memory.max or v1's limit_in_bytes and
    hierarchical_memory_limit; 'max' and v1's huge 'no limit' are none."""
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "a" / "memory.max").write_text(f"{300 << 20}\n")
    (v2 / "a" / "b" / "memory.max").write_text(f"{500 << 20}\n")
    proc.write_text("0::/a/b\n")
    assert cgroup_memory_limit(proc, v2) == 300 << 20  # the parent's is the lesser
    (v2 / "a" / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc, v2) == 500 << 20
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc, v2) is None

    v1 = tmp_path / "v1"
    (v1 / "memory" / "svc").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "svc" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "svc" / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {768 << 20}\n")
    proc.write_text("12:pids:/svc\n11:memory:/svc\n1:name=systemd:/svc\n")
    assert cgroup_memory_limit(proc, v1) == 768 << 20
    (v1 / "memory" / "svc" / "memory.stat").write_text("cache 0\n")
    assert cgroup_memory_limit(proc, v1) is None
    assert cgroup_memory_limit(tmp_path / "absent", v1) is None


def test_the_budget_is_a_quarter_of_the_cgroups_limit_inside_one(cgroup_factory):
    """Inside a real cgroup of 400 MiB, the process may use 400 MiB and a build's default budget is 100 MiB;
    outside it, the machine's memory (or this process's own cgroup's)."""
    cg = cgroup_factory(400 << 20)
    code = ("import json; from fusionrag.retriever.process import memory_limit; "
            "from fusionrag.retriever.engine.config import BuildConfig; "
            "print(json.dumps([memory_limit(), BuildConfig().memory_budget()]))")
    out = cg.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [400 << 20, 100 << 20]
    assert memory_limit() > 400 << 20
    assert BuildConfig(memory_budget_bytes=1).memory_budget() == MIN_BUILD_BUDGET
    assert BuildConfig(memory_budget_bytes=1 << 30).memory_budget() == 1 << 30


def test_postings_grouped_on_disk_are_those_grouped_in_memory(tmp_path):
    """PairSpill: pairs added in chunks, grouped a few at a time through files, give postings()'s CSR: the same
    offsets and, within each list, the ids in the order they came."""
    rng = np.random.default_rng(5)
    n_lists = 37
    chunks = [(rng.integers(0, n_lists, size), rng.integers(0, 1 << 31, size).astype(np.uint32))
              for size in (0, 1, 50, 400, 13)]
    want_offsets, want_ids = postings(np.concatenate([c[0] for c in chunks]),
                                      np.concatenate([c[1] for c in chunks]), n_lists)
    for chunk in (1, 7, 64, 10_000):
        where = tmp_path / str(chunk)
        where.mkdir()
        spill = PairSpill(where, n_lists)
        for lists, ids in chunks:
            spill.add(lists, ids)
        offsets, list_ids = spill.grouped(where / "list_ids.npy", chunk)
        assert np.array_equal(offsets, want_offsets) and np.array_equal(np.asarray(list_ids), want_ids)
        assert list_ids.dtype == want_ids.dtype
        assert np.array_equal(np.load(where / "list_ids.npy"), want_ids)
        assert sorted(p.name for p in where.iterdir()) == ["list_ids.npy"]  # the pairs' files removed


class _Dir:
    def __init__(self, d: Path):
        d.mkdir()
        self.d = d

    def path(self, name: str) -> Path:
        return self.d / name


@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_a_page_file_written_through_spilled_ranges_is_the_one_written_in_slot_order(tmp_path, dtype):
    """write_pages with rows beyond its budget reads the source once in order and spills ranges of slots to
    scratch: the page file, the slots and the block checksums are byte for byte those of the direct write, and
    the scratch is empty after."""
    rng = np.random.default_rng(2)
    n, dim = 3000, 24
    x = (rng.random((n, dim)) * 200).astype(dtype)
    xf = x.astype(np.float32)
    centroids, labels = kmeans(xf, 40, 4, rng)
    pq = ProductQuantizer.train(xf, 8, 4, rng)
    codes = pq.encode(xf)
    reads = []

    def stored(ids):
        reads.append(np.asarray(ids).copy())
        return x[ids]

    steps = Progress(False)
    direct = write_pages(_Dir(tmp_path / "a"), stored, n, dim, np.dtype(dtype), labels, centroids, pq, codes, steps)
    assert (tmp_path / "a" / "vectors.pages").exists()
    reads.clear()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    budget = 20_000  # bytes: each range of slots a small share of the rows
    spilled = write_pages(_Dir(tmp_path / "b"), stored, n, dim, np.dtype(dtype), labels, centroids, pq, codes,
                          steps, budget, scratch)
    assert (tmp_path / "a" / "vectors.pages").read_bytes() == (tmp_path / "b" / "vectors.pages").read_bytes()
    assert np.array_equal(direct[1], spilled[1]) and np.array_equal(direct[2], spilled[2])
    assert direct[0] == spilled[0]
    got = np.concatenate(reads)
    assert np.array_equal(got, np.arange(n))  # the source read once, in file order
    assert list(scratch.iterdir()) == []


N, DIM = 500_000, 96  # 192 MB of float32 vectors


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A clustered set larger than the cap below, with held-out queries and their exact top-10."""
    d = tmp_path_factory.mktemp("ltm")
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((2000, DIM)).astype(np.float32)
    path = d / "base.fbin"
    with open(path, "wb") as f:
        np.array([N, DIM], np.int32).tofile(f)
        for lo in range(0, N, 100_000):
            c = rng.integers(0, len(centres), 100_000)
            (centres[c] + 0.3 * rng.standard_normal((100_000, DIM)).astype(np.float32)).tofile(f)
    q = centres[rng.integers(0, len(centres), 200)] + 0.3 * rng.standard_normal((200, DIM)).astype(np.float32)
    base = np.memmap(path, np.float32, "r", offset=8, shape=(N, DIM))
    best = np.full((len(q), 10), np.inf, np.float32), np.zeros((len(q), 10), np.int64)
    for lo in range(0, N, 100_000):
        xb = np.asarray(base[lo:lo + 100_000])
        dd = (q * q).sum(1)[:, None] + (xb * xb).sum(1)[None] - 2 * q @ xb.T
        dist = np.concatenate([best[0], dd], 1)
        ids = np.concatenate([best[1], np.broadcast_to(np.arange(lo, lo + len(xb)), dd.shape)], 1)
        o = np.argsort(dist, 1)[:, :10]
        best = np.take_along_axis(dist, o, 1), np.take_along_axis(ids, o, 1)
    np.save(d / "queries.npy", q.astype(np.float32))
    with open(d / "gt.ivecs", "wb") as f:  # texmex .ivecs: each row its length, then the ids
        np.hstack([np.full((len(q), 1), 10, np.int32), best[1].astype(np.int32)]).tofile(f)
    return d


def test_a_build_and_a_search_fit_in_a_cgroup_smaller_than_the_vectors(big, cgroup_factory):
    """`fusionrag build` at the defaults, then `fusionrag search`, each inside a memory cgroup (no swap) capped at
    150 MiB, below the 192 MB of raw vectors: nothing but the cgroup tells them. Both finish (a process past the
    cap is killed by the kernel: the cgroup, not the code under test, enforces it), the build chose a quarter of
    the cap as its budget, and the search reaches recall@10 >= 0.90 against brute force."""
    raw = (big / "base.fbin").stat().st_size
    cap = 150 << 20
    assert cap < raw
    cg = cgroup_factory(cap)
    fusionrag = [sys.executable, "-m", "fusionrag"]
    built = cg.run([*fusionrag, "build", str(big / "base.fbin"), str(big / "idx"), "--quiet"], capture_output=True,
                   text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((big / "idx" / "manifest.json").read_text())
    assert manifest["build_memory_budget_bytes"] == cap // 4
    assert not [p for p in (big / "idx").iterdir() if p.name == "scratch"]
    found = cg.run([*fusionrag, "search", str(big / "idx"), str(big / "queries.npy"), "--k", "10",
                    "--out", str(big / "ids.npy"), "--groundtruth", str(big / "gt.ivecs")],
                   capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout.strip().splitlines()[-1])["recall@10"] >= 0.90
