"""Crash safety: a writer SIGKILLed at random points restarts with every acknowledged write
present and no unacknowledged one half-applied; a full disk fails a write and loses nothing."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from collection_crash_child import THREADS, ops
from crash_helpers import apply_op, run_and_kill

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.errors import StorageError

CHILD = Path(__file__).parents[1] / "collection_crash_child.py"


def test_sigkill_loses_no_acknowledged_write(tmp_path):
    runs = int(os.environ.get("FUSIONRAG_CRASH_RUNS", "8"))  # more for a soak: FUSIONRAG_CRASH_RUNS=200
    rng = np.random.default_rng(int(os.environ.get("FUSIONRAG_CRASH_SEED", "20261122")))
    expected: dict = {}  # every id written so far -> (text, vector, metadata)
    for seed in range(runs):
        marks = run_and_kill(CHILD, tmp_path, seed, rng, THREADS)
        cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=100, background_merge=False))
        col = cat.get("c")
        for t, (acked, begun) in marks.items():
            before, after = dict(), dict()
            touched = set()
            for i, op, ids, docs in ops(seed, t):
                if i > begun:
                    break
                touched.update(ids)
                if i <= acked:
                    apply_op(before, op, ids, docs)
                apply_op(after, op, ids, docs)
            got = {d.id: (d.text, d.vector, d.metadata) for d in col.get(sorted(touched), with_vectors=True)}

            def same(a, b):
                return a.keys() == b.keys() and all(
                    a[k][0] == b[k][0] and a[k][2] == b[k][2] and np.array_equal(a[k][1], b[k][1]) for k in a)

            # acknowledged writes all there; the write in flight wholly applied or not at all
            assert same(got, before) or same(got, after), (seed, t, acked, begun)
            expected.update(got)
            for d in touched - got.keys():
                expected.pop(d, None)
        # everything from earlier runs is still there, and searchable
        assert len(col) == len(expected)
        sample = sorted(expected)[:: max(1, len(expected) // 20)]
        res = col.search(np.stack([expected[d][1] for d in sample]), k=1)
        assert [h[0].id for h in res.hits] == sample
        cat.close()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_full_disk_fails_the_write_and_keeps_the_collection(tmp_path):
    """A 1 MiB tmpfs where mounting is allowed (root), else a file size limit (RLIMIT_FSIZE) in a
    child process: either way the disk refuses bytes in the middle of the write path."""
    mnt = tmp_path / "mnt"
    if _mount_tmpfs(mnt, "1m"):
        try:
            fill_the_disk(mnt)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
    else:
        code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
                "sys.path.insert(0, sys.argv[2]); from test_collection_crash import fill_the_disk; "
                "from pathlib import Path; fill_the_disk(Path(sys.argv[1]))")
        r = subprocess.run([sys.executable, "-c", code, str(mnt), str(Path(__file__).parent)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


def fill_the_disk(root: Path) -> None:
    cfg = CollectionConfig(background_merge=False)
    cat = Catalog(root, collection_config=cfg)
    col = cat.create("c", 64, "l2")
    rng = np.random.default_rng(0)
    acked = {}
    for i in range(100_000):
        batch = [Document(f"{i}-{j}", "x" * 200, rng.standard_normal(64)) for j in range(20)]
        try:
            col.upsert(batch)
        except StorageError:
            break
        acked.update({d.id: d.vector for d in batch})
    else:
        raise AssertionError("the disk never filled")
    assert col.get([f"{i}-0"]) == [] and len(col) == len(acked)
    some = sorted(acked)[::50]
    assert [h[0].id for h in col.search(np.stack([acked[d] for d in some]), k=1).hits] == some
    cat.close()
    cat = Catalog(root, collection_config=cfg)  # and after a restart, all acknowledged writes are there
    col = cat.get("c")
    assert len(col) == len(acked) and col.get([f"{i}-0"]) == []
    got = col.get(some, with_vectors=True)
    assert [d.id for d in got] == some and all(np.allclose(d.vector, acked[d.id]) for d in got)
    cat.close()
