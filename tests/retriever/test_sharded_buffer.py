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
    index = ShardedIndex.open(tmp_path / "sh", EngineConfig(buffer_bytes=total))
    try:
        held = [shard.index.memory()["page_buffer_bytes"] for shard in index.shards]
        assert [shard.config.buffer_bytes for shard in index.shards] == [total // 3] * 3
        assert sum(held) <= total and all(0 < h <= total // 3 for h in held), held
        res = index.search(base[:5], k=3)
        assert (res.ids[:, 0] == np.arange(5)).all()
    finally:
        index.close()
