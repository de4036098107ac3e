"""Which filter tier serves a search call, where an index opened both (#47, part 7): under filter_tier 'auto' with
CUDA, the GPU tier and the CPU tier share the index's host parts, and each call goes to the one whose measured
cost for a call of its size is lower, so a GPU box is never slower than its own CPUs.

Costs are measured, not modelled: each call's seconds, per query, kept per tier and per call size (powers of two:
1, 2-3, 4-7, ... queries) as an exponentially weighted mean. A size a tier has not served yet goes to it; once in
EXPLORE calls of a size, the tier not chosen serves one, so a figure that load or the other tenants of the device
changed is measured again (at most 1/EXPLORE of the calls are served by the slower tier). A tier's first call is
not counted: it pays once-only costs (a CUDA context, kernels loaded, pages first read).

The choice is per call: the service's micro-batcher asks `crossover()` for the call size from which the GPU is
cheaper per query, and holds a batch open for it (a bounded wait) while queries arrive fast enough to fill it.
"""

from __future__ import annotations

import math
import threading

import numpy as np

BUCKETS = 12  # call sizes 1, 2-3, 4-7, ..., 2048 and more
EXPLORE = 32
ALPHA = 0.2  # weight of a call's figure in its mean


def bucket(queries: int) -> int:
    return min(BUCKETS - 1, max(1, int(queries)).bit_length() - 1)


class TierChoice:
    """The measured costs of two tiers, by name, and the choice of one for a call of q queries."""

    def __init__(self, names: tuple[str, str] = ("gpu", "cpu"), explore: int = EXPLORE, alpha: float = ALPHA):
        self.names, self.explore, self.alpha = names, int(explore), float(alpha)
        self.per_query = np.full((2, BUCKETS), np.nan)  # seconds a query, per tier and call size
        self.calls = np.zeros((2, BUCKETS), np.int64)  # calls counted, per tier and size
        self.served = np.zeros(2, np.int64)  # calls served, per tier (first ones too)
        self.queries = np.zeros(2, np.int64)
        self._asked = np.zeros(BUCKETS, np.int64)
        self._lock = threading.Lock()

    def _predict(self, t: int, b: int) -> float:
        """Seconds a query on tier t for a call in size bucket b: its own figure, else the nearest size's."""
        row = self.per_query[t]
        if not math.isnan(row[b]):
            return float(row[b])
        known = np.flatnonzero(~np.isnan(row))
        return float(row[known[np.argmin(np.abs(known - b))]]) if len(known) else math.nan

    def choose(self, queries: int) -> int:
        """The index (into names) of the tier to serve a call of this many queries."""
        b = bucket(queries)
        with self._lock:
            for t in (0, 1):  # a size a tier has not been measured at: measure it there
                if self.calls[t, b] == 0:
                    return t
            self._asked[b] += 1
            cost = [self._predict(t, b) for t in (0, 1)]
            best = int(np.argmin(cost))
            return 1 - best if self._asked[b] % self.explore == 0 else best

    def record(self, t: int, queries: int, seconds: float) -> None:
        b = bucket(queries)
        with self._lock:
            first = self.served[t] == 0
            self.served[t] += 1
            self.queries[t] += queries
            if first:  # once-only costs: not what the next call pays
                return
            figure = seconds / max(1, queries)
            old = self.per_query[t, b]
            self.per_query[t, b] = figure if math.isnan(old) else (1 - self.alpha) * old + self.alpha * figure
            self.calls[t, b] += 1

    def crossover(self) -> int | None:
        """The smallest call size (a power of two) at which the first tier (the GPU) is measured cheaper per
        query than the second and stays so at every size measured above it; None where it never is or neither
        tier has been measured at two sizes."""
        with self._lock:
            g, c = self.per_query
            both = np.flatnonzero(~np.isnan(g) & ~np.isnan(c))
            if len(both) == 0:
                return None
            dearer = np.flatnonzero(g[both] >= c[both])
            first = 0 if len(dearer) == 0 else int(dearer[-1]) + 1
            return None if first == len(both) else 1 << int(both[first])

    def describe(self) -> dict:
        with self._lock:
            return {
                "tiers": list(self.names),
                "calls_served": {n: int(s) for n, s in zip(self.names, self.served)},
                "queries_served": {n: int(q) for n, q in zip(self.names, self.queries)},
                "us_per_query_by_call_size": {
                    n: {str(1 << b): round(float(v) * 1e6, 1) for b, v in enumerate(row) if not math.isnan(v)}
                    for n, row in zip(self.names, self.per_query)},
            }
