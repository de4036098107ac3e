"""Blocks in and out of a small page buffer, each checked against the page file's bytes: shared by the plain and
the compressed buffer's tests."""

import numpy as np


def churn(store, data: np.ndarray, policy: str, seed: int = 7, steps: int = 2500, each=None) -> np.ndarray:
    """`steps` rounds of one block (a hot one 30% of the time) and five random ones read through store: every
    block served is data's, and under CLOCK, which admits every block read, a block just read is served from
    memory the next time (a lost table entry would read it again); the evictions counted match the blocks read
    and held (the store must be new). each(): called after every round. Returns the hot blocks."""
    rng = np.random.default_rng(seed)
    hot = rng.choice(store.num_blocks, 12, replace=False)
    for step in range(steps):
        b = int(hot[step % 12] if rng.random() < 0.3 else rng.integers(store.num_blocks))
        assert store.read_block(b) == data[b].tobytes(), (policy, step, b)
        blocks = rng.choice(store.num_blocks, 5, replace=False).astype(np.uint32)
        assert np.array_equal(store.read_blocks(blocks), data[blocks]), (policy, step)
        if policy == "clock":
            before = store.stats()
            assert store.read_block(b) == data[b].tobytes()
            after = store.stats()
            assert (after["blocks_from_buffer"] - before["blocks_from_buffer"],
                    after["blocks_read"] - before["blocks_read"]) == (1, 0), (step, b)
        if each:
            each()
    # Every block read was offered to the buffer once: held since, or placed and evicted later, or (lfu's
    # admission, not CLOCK's) refused. So the evictions counted are the blocks read less those held now, less
    # the refusals: a refusal counted as an eviction would show.
    st = store.stats()
    resident = int(store.resident(np.arange(store.num_blocks, dtype=np.uint32)).sum())
    if policy == "clock":
        assert st["evictions"] == st["blocks_read"] - resident, (st, resident)
    else:
        assert st["evictions"] < st["blocks_read"] - resident, (st, resident)
    return hot
