"""A writer for the crash tests: threads stream upserts and deletes into one collection, printing
"B t i" before write i of thread t starts and "A t i" once it is acknowledged. The writes are
a pure function of (seed, thread), so the test can rebuild what each acknowledgement promised."""

import sys

import numpy as np
from crash_helpers import stream_writes

DIM = 8
THREADS = 3


def vector(seed: int, t: int, i: int, j: int) -> np.ndarray:
    return np.random.default_rng([seed, t, i, j]).standard_normal(DIM).astype(np.float32)


def ops(seed: int, t: int):
    """Yields (i, op, ids, docs): docs = [(id, text, vector, metadata)] for upserts."""
    rng = np.random.default_rng([seed, t, 99])
    known: list[str] = []
    for i in range(1_000_000):
        if known and rng.random() < 0.25:
            ids = sorted({known[int(k)] for k in rng.integers(len(known), size=2)})
            yield i, "delete", ids, []
            continue
        ids = []
        for j in range(3):
            if known and rng.random() < 0.3:
                doc_id = known[int(rng.integers(len(known)))]
            else:
                doc_id = f"s{seed}t{t}-{len(known)}"
                known.append(doc_id)
            if doc_id not in ids:
                ids.append(doc_id)
        yield i, "upsert", ids, [(d, f"{d}@{i}", vector(seed, t, i, j), {"i": i, "t": t}) for j, d in enumerate(ids)]


def main(root: str, seed: int) -> None:
    from fusionrag.retriever.collection import Catalog, CollectionConfig

    cat = Catalog(root, collection_config=CollectionConfig(min_index_count=100, merge_fresh_count=120))
    col = cat.get("c") if "c" in cat.names() else cat.create("c", DIM, "l2")
    stream_writes(col, ops, seed, THREADS)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
