"""#67 item 6: the shards of a sharded collection opened in one process share its page buffer (--buffer-mb), each
a share of it; each took the whole of it before."""

import numpy as np
from conftest import clustered

from fusionrag.retriever.engine.config import BuildConfig, EngineConfig
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.router import ShardedIndex


def test_local_shards_share_the_page_buffer(tmp_path):
    base = clustered(3000, 16, 12, seed=4)
    build_sharded(base, tmp_path / "sh", 3, BuildConfig(threads=1, pq_m=4), progress=False)
    total = 3 << 20
    # raw_in_ram 'off': the budget holds these shards' raw vectors, which would take the page buffer's place
    index = ShardedIndex.open(tmp_path / "sh", EngineConfig(buffer_bytes=total, raw_in_ram="off"))
    try:
        held = [shard.index.memory()["page_buffer_bytes"] for shard in index.shards]
        assert [shard.config.buffer_bytes for shard in index.shards] == [total // 3] * 3
        assert sum(held) <= total and all(0 < h <= total // 3 for h in held), held
        res = index.search(base[:5], k=3)
        assert (res.ids[:, 0] == np.arange(5)).all()
    finally:
        index.close()


def test_local_shards_hold_their_raw_vectors_within_their_share(tmp_path):
    """Under raw_in_ram 'auto' (the default) a shard holds its raw vectors in RAM where its share of --buffer-mb
    holds them, and not where only the whole budget would."""
    base = clustered(3000, 16, 12, seed=4)
    build_sharded(base, tmp_path / "sh", 3, BuildConfig(threads=1, pq_m=4), progress=False)
    held = None
    for total in (3 << 20, None):
        # None: the largest shard's vectors, which the whole budget holds and no shard's third of it does
        index = ShardedIndex.open(tmp_path / "sh", EngineConfig(buffer_bytes=total or max(held)))
        try:
            mem = [shard.index.memory() for shard in index.shards]
            if held is None:
                held = [m["raw_vectors_bytes"] for m in mem]
                assert all(m["raw_in_ram"] for m in mem) and sum(held) >= base.nbytes, held  # boundary replicas
                assert max(held) // 3 < min(held), held  # so that the second budget's share holds none
            else:
                assert not any(m["raw_in_ram"] or m["raw_vectors_bytes"] for m in mem)
            res = index.search(base[:5], k=3)
            assert (res.ids[:, 0] == np.arange(5)).all()
        finally:
            index.close()
