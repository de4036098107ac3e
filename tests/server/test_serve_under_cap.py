"""`fusionrag serve` inside a memory cgroup smaller than the collection's raw vectors (#51): nothing but the cgroup
tells it, and it opens the collection, answers as it does without the cap, takes writes and merges them (the
kernel, not the code under test, enforces the cap: a process past it is killed, and the cgroup counts the kill)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from server_util import ServerProcess

from fusionrag.client import Client
from fusionrag.retriever.collection import Document
from fusionrag.retriever.errors import UnavailableError

N, DIM, NEW, DEAD = 400_000, 128, 25_000, 5_000  # NEW: past the fresh tier's share of the cap: a merge starts
CAP = 184 << 20  # below the 205 MB of raw vectors (the process's own ~60 MiB and the buffers are the rest)


def _topk(q: np.ndarray, base: np.ndarray, ids: np.ndarray, k: int = 10) -> np.ndarray:
    best_d = np.full((len(q), k), np.inf, np.float32)
    best_i = np.zeros((len(q), k), np.int64)
    for lo in range(0, len(base), 50_000):
        xb = base[lo:lo + 50_000]
        dd = (q * q).sum(1)[:, None] + (xb * xb).sum(1)[None] - 2 * q @ xb.T
        d = np.concatenate([best_d, dd], 1)
        i = np.concatenate([best_i, np.broadcast_to(ids[lo:lo + len(xb)], dd.shape)], 1)
        o = np.argsort(d, 1)[:, :k]
        best_d, best_i = np.take_along_axis(d, o, 1), np.take_along_axis(i, o, 1)
    return best_i


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A data directory holding collection `big`, N clustered vectors imported from a file (ids "0".."N-1"), and
    vectors to write later, queries and their exact top-10 before and after those writes (new ids are N + j)."""
    d = tmp_path_factory.mktemp("cap")
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((1500, DIM)).astype(np.float32)

    def sample(n):
        return centres[rng.integers(0, len(centres), n)] + 0.3 * rng.standard_normal((n, DIM)).astype(np.float32)

    base = sample(N)
    np.save(d / "base.npy", base)
    new, q = sample(NEW), sample(200)
    dead = rng.choice(N, DEAD, replace=False)
    keep = np.ones(N, bool)
    keep[dead] = False
    after = _topk(q, np.concatenate([base[keep], new]), np.concatenate([np.flatnonzero(keep), N + np.arange(NEW)]))
    done = subprocess.run([sys.executable, "-m", "fusionrag", "import", str(d / "data"), "--collection", "big",
                           "--vectors", str(d / "base.npy"), "--metric", "l2", "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (d / "base.npy").unlink()
    return {"dir": d, "new": new, "q": q, "dead": dead, "before": _topk(q, base, np.arange(N)), "after": after}


def _search(client: Client, q: np.ndarray) -> np.ndarray:
    hits = client.search("big", q, k=10).hits
    return np.array([[int(h.id[1:]) + N if h.id.startswith("n") else int(h.id) for h in row] for row in hits])


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found.tolist(), truth.tolist())]))


def test_a_collection_served_in_a_cgroup_smaller_than_its_vectors_answers_takes_writes_and_merges(
        imported, cgroup_factory):
    d, q = imported["dir"], imported["q"]
    # Without a cap (this machine's memory): the reference answers, the codes in the heap.
    free = ServerProcess(d / "data", d / "free.log", "--no-demo")
    try:
        free.wait_ready()
        with Client(free.url) as c:
            reference = _search(c, q)
            assert not c.info("big").tiers["pq_mapped"]
    finally:
        free.stop()

    cg = cgroup_factory(CAP)
    srv = ServerProcess(d / "data", d / "capped.log", "--no-demo", cgroup=cg)
    try:
        srv.wait_ready()
        with Client(srv.url, timeout=120) as c:
            tiers = c.info("big").tiers
            # Sized to the cgroup: the codes and lists read through memory maps, the page buffer a sixteenth of it.
            assert tiers["page_buffer_bytes"] <= CAP // 16 and tiers["pq_mapped"] and tiers["lists_mapped"]
            found = _search(c, q)
            # The same index and settings: the same answers as without the cap (the buffer never changes them).
            assert np.array_equal(found, reference)
            assert _recall(found, imported["before"]) >= 0.9

            new = imported["new"]
            dead = [str(i) for i in imported["dead"].tolist()]
            for s in range(0, DEAD, 1000):
                c.delete("big", dead[s:s + 1000])
            for s in range(0, NEW, 512):  # an upsert past twice the fresh tier's share while a merge runs: a 503
                batch = [Document(id=f"n{j}", vector=new[j]) for j in range(s, min(NEW, s + 512))]
                while True:
                    try:
                        c.upsert("big", batch)
                        break
                    except UnavailableError:
                        time.sleep(0.5)
            deadline = time.monotonic() + 600
            while True:  # the fresh tier past its threshold: a merge ran in the background (the rest stays fresh)
                state = c.info("big").build_state
                if state["generation"] >= 2 and not state["merging"]:
                    break
                assert srv.proc.poll() is None, srv.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, state
                time.sleep(1)
            assert c.count("big") == N - DEAD + NEW
            assert _recall(_search(c, q), imported["after"]) >= 0.9
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    assert cg.oom_kills() == 0
    # The server's memory was charged to this cgroup (so the cap above applied to it): more than its open index.
    assert cg.value("memory.max_usage_in_bytes") > 64 << 20
