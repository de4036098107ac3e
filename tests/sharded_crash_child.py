"""A writer for the sharded crash test (tests/retriever/test_sharded_crash.py): threads stream upserts (documents:
name, text, vector, metadata) and deletes into one sharded collection (retriever/sharded/docs.py over ShardedIndex,
its shards in this process), printing "B t i" before write i of thread t starts and "A t i" once it is
acknowledged. The writes are a pure function of (seed, thread), so the test can rebuild what each acknowledgement
promised."""

import sys

import numpy as np
from crash_helpers import stream_writes

DIM = 16
THREADS = 3
N = 600  # the built vectors, named "0" .. "599"
BUILT_PER_THREAD = 40  # built names a (seed, thread) may replace or delete: its own, so no two writers share one


def vector(seed: int, t: int, i: int, j: int) -> np.ndarray:
    return (3 * np.random.default_rng([seed, t, i, j]).standard_normal(DIM)).astype(np.float32)


def built_name(seed: int, t: int, k: int) -> str:
    return str(((seed * THREADS + t) * BUILT_PER_THREAD + k) % N)


def ops(seed: int, t: int):
    """Yields (i, op, names, docs): docs = [(name, text, vector, metadata)] for upserts. Names are new ones, ones
    this (seed, thread) wrote before, or built vectors' (replaced: the built vector tombstoned)."""
    rng = np.random.default_rng([seed, t, 99])
    known: list[str] = []
    built = 0
    for i in range(1_000_000):
        if known and rng.random() < 0.25:
            names = sorted({known[int(k)] for k in rng.integers(len(known), size=2)})
            yield i, "delete", names, []
            continue
        names = []
        for j in range(int(rng.integers(1, 4))):
            r = rng.random()
            if known and r < 0.3:
                name = known[int(rng.integers(len(known)))]
            elif r > 0.9 and built < BUILT_PER_THREAD:
                name = built_name(seed, t, built)
                built += 1
                known.append(name)
            else:
                name = f"s{seed}t{t}-{len(known)}"
                known.append(name)
            if name not in names:
                names.append(name)
        yield i, "upsert", names, [(d, None if j == 1 else f"{d} at {i}", vector(seed, t, i, j), {"i": i, "t": t})
                                   for j, d in enumerate(names)]


def main(root: str, seed: int) -> None:
    from fusionrag.retriever.sharded.docs import ShardedCollection
    from fusionrag.retriever.sharded.router import ShardedIndex

    coll = ShardedCollection(ShardedIndex.open(root), "docs")
    stream_writes(coll, ops, seed, THREADS)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
