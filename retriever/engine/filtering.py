"""The filter tier's interface (the codec of Faiss's quantizer / codec / refine) and what it hands the
re-ranker. CpuFilterTier (tiers.py) and GpuFilterTier (gpu_tier.py) implement it; pipeline.open_filter_tier
picks one. Both import this module and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Candidates:
    ids: np.ndarray  # int64 (q, n), best PQ distance first, -1 padding
    pq_dists: np.ndarray  # float32 (q, n)
    gathered: np.ndarray  # int64 (q,): IDs gathered, duplicates included
    unique: np.ndarray  # int64 (q,): after de-duplication
    seconds: np.ndarray  # float64 (q,)
    # float64 (q,): building PQ tables inside topn (the CPU tier's BatchTables); 0 where
    # the tables came built (timed by whoever built them).
    lut_seconds: np.ndarray | float = 0.0


class FilterTier(Protocol):
    """PQ tables of a batch's queries, then each query's top-n candidates among the IDs of its probed
    posting lists. A tier holds the PQ codebooks and codes and the tables' metric ('l2' or 'ip') it was
    opened with. Its capabilities, which the query pipeline asks instead of its name:"""

    name: str  # 'cpu' or 'gpu': for describe() and configuration, never to choose behaviour
    batch_size: int  # queries per internal batch of a search
    overlaps: bool  # a call's batches run as a pipeline (graph, filter, re-rank of three batches at once)
    in_flight: int  # batches the tier filters at once in such a pipeline
    tiered: bool  # only the hottest lists' codes are resident: the index manager calls rebalance()
    list_offsets: np.ndarray  # int64 (lists + 1,): CSR offsets into list_ids
    list_ids: np.ndarray  # uint32: the posting lists' vector IDs

    def memory_bytes(self) -> int: ...

    def describe(self) -> dict: ...

    def close(self) -> None:
        """Give back what the tier holds (GPU memory); no search may run meanwhile or after."""

    def tables(self, queries: np.ndarray):
        """The queries' PQ tables (float32 (q, dim), prepared) in the form topn takes best: BatchTables
        on the CPU (built during topn), tables in device memory on the GPU."""

    def topn(self, tables, probe_lists: np.ndarray, n: int, exclude: np.ndarray | None = None) -> Candidates:
        """tables: from self.tables, or float32 (q, M, 256) host tables as ProductQuantizer.luts gives.
        exclude: bitmap of vector ids never to return (a collection's tombstones and filter)."""
