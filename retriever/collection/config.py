"""How collections behave: their names, formats, and the knobs of merging, filtering and hybrid search."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


from fusionrag.retriever.config import BuildConfig, _check, _Config


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_ID_CHARS = 512
COLLECTION_FORMAT = 1
CURRENT_FORMAT = 2  # 2: CURRENT holds the digest of its generation's rows.npy
MERGE_RETRY_S = 30  # a failed background merge (a full disk, say) waits this long to retry
SEARCH_MODES = ("vector", "text", "hybrid")
# Hybrid search: each ranking is taken this deep (or k) before fusion, and fused by reciprocal rank
# with the usual constant (Cormack et al., 2009); the text ranking's weight by default. Chosen on half of
# a labelled question set of the Python docs (bench/hybrid.py).
HYBRID_DEPTH = 20
RRF_K = 60
DEFAULT_TEXT_WEIGHT = 0.5


@dataclass(frozen=True)
class CollectionConfig(_Config):
    """How collections fold writes into their main index and answer filtered searches."""

    # A merge starts in the background once the fresh tier holds this many vectors or bytes.
    merge_fresh_count: int = 20000
    merge_fresh_bytes: int = 256 << 20
    background_merge: bool = True
    # Fewer live documents than this are not worth an index: they stay in the (exact) fresh tier.
    min_index_count: int = 1000
    # A filter that at most this many documents pass is answered by exact search over them.
    filter_exact_max: int = 20000
    # Merges fold writes into the current index (merge.py) rather than rebuilding it, until the
    # index has grown this many times over its last full build (its clusters and PQ codebooks
    # were trained on that) or until less than this fraction of its SSD slots hold live vectors.
    incremental_merge: bool = True
    rebuild_growth: float = 4.0
    rebuild_live_fraction: float = 0.5
    build: BuildConfig = field(default_factory=BuildConfig)

    def __post_init__(self):
        _check(self.merge_fresh_count >= 1, f"merge_fresh_count must be >= 1, got {self.merge_fresh_count}")
        _check(self.merge_fresh_bytes >= 1, f"merge_fresh_bytes must be >= 1, got {self.merge_fresh_bytes}")
        _check(self.min_index_count >= 1, f"min_index_count must be >= 1, got {self.min_index_count}")
        _check(self.filter_exact_max >= 0, f"filter_exact_max must be >= 0, got {self.filter_exact_max}")
        _check(self.rebuild_growth >= 1, f"rebuild_growth must be >= 1, got {self.rebuild_growth}")
        _check(0 <= self.rebuild_live_fraction < 1,
               f"rebuild_live_fraction must be in [0, 1), got {self.rebuild_live_fraction}")
