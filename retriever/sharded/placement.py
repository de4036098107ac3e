"""Placement of posting lists on shards (docs/sharded.md, "Placement"): by expected work (hotness, after
SmartANNS), round-robin, or by regions of centroid space (locality)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from fusionrag.retriever.engine.config import SearchParams
from fusionrag.retriever.engine.kmeans import sq_dists
from fusionrag.retriever.engine.tiers import NavigationTier
from fusionrag.retriever.errors import ConfigError
from fusionrag.retriever.sharded.parts import LOCALITY_TOLERANCE, PLACEMENTS, STORAGE_SLACK

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Placement


@dataclass
class Placement:
    shards: np.ndarray  # int32 (lists, 2): the list's shards, -1 where it has no second one
    work: np.ndarray  # float64 (lists,): expected work of each list (size x visits)
    kind: str

    def shard_work(self, n_shards: int) -> np.ndarray:
        """Expected work per shard, a replicated list's split evenly between its two shards."""
        out = np.zeros(n_shards)
        two = self.shards[:, 1] >= 0
        np.add.at(out, self.shards[:, 0], np.where(two, self.work / 2, self.work))
        np.add.at(out, self.shards[two, 1], self.work[two] / 2)
        return out

    def imbalance(self, n_shards: int) -> float:
        w = self.shard_work(n_shards)
        return float(w.max() / w.mean()) if w.mean() > 0 else 1.0


def _regions(points: np.ndarray, work: np.ndarray, n_parts: int, seed: int = 0, iters: int = 8) -> np.ndarray:
    """Recursive bisection of `points` (list centroids) into n_parts regions of balanced `work`: each split
    runs a few rounds of weighted 2-means, orders the points by (distance to one centre - distance to the
    other) and cuts where the work reaches the part's share (n_parts // 2 of n_parts), so each region is
    a compact piece of centroid space and its work is its share to within one list's."""
    part = np.zeros(len(points), dtype=np.int32)
    rng = np.random.default_rng(seed)

    def split(idx: np.ndarray, first: int, parts: int) -> None:
        if parts == 1 or len(idx) == 0:
            part[idx] = first
            return
        x, w = points[idx].astype(np.float64), work[idx]
        left = parts // 2
        if len(idx) <= parts:
            for j, i in enumerate(idx):
                part[i] = first + min(j, parts - 1)
            return
        a, b = x[rng.choice(len(idx), 2, replace=False)]
        for _ in range(iters):
            key = ((x - a) ** 2).sum(1) - ((x - b) ** 2).sum(1)
            near_a = key <= np.median(key)
            if near_a.all() or not near_a.any():
                break
            a = np.average(x[near_a], axis=0, weights=w[near_a] + 1e-12)
            b = np.average(x[~near_a], axis=0, weights=w[~near_a] + 1e-12)
        key = ((x - a) ** 2).sum(1) - ((x - b) ** 2).sum(1)
        order = np.argsort(key, kind="stable")
        cum = np.cumsum(w[order])
        cut = int(np.searchsorted(cum, cum[-1] * left / parts))
        cut = min(max(cut, left), len(idx) - (parts - left))  # every region keeps a list
        split(idx[order[:cut]], first, left)
        split(idx[order[cut:]], first + left, parts - left)

    split(np.arange(len(points)), 0, n_parts)
    return part


def _rebalance(plan: Placement, x: np.ndarray, n_shards: int, tolerance: float = LOCALITY_TOLERANCE) -> None:
    """Replicas (and lists heavier than a region's slack) can leave a region over its share: while the
    heaviest shard is over `tolerance` x the mean, move one of its unreplicated lists to a shard under the
    mean, the list nearest that shard's region (its centroid's distance to the region's centre, less its
    distance to its own), so regions give up their boundary lists first. In place."""
    own = plan.shards[:, 0]
    centre = np.stack([x[own == s].mean(axis=0) if (own == s).any() else x.mean(axis=0) for s in range(n_shards)])
    d = sq_dists(x.astype(np.float32), centre.astype(np.float32)).astype(np.float64)
    single = plan.shards[:, 1] < 0
    for _ in range(len(own)):
        load = plan.shard_work(n_shards)
        mean = load.mean()
        s = int(np.argmax(load))
        if mean <= 0 or load[s] <= tolerance * mean:
            return
        mine = np.flatnonzero(single & (own == s))
        under = np.flatnonzero(load < mean)
        if not len(mine) or not len(under):
            return
        # Moving list c from s to t helps while its work is under the gap between them.
        cost = d[mine][:, under] - d[mine, s][:, None]
        cost[plan.work[mine][:, None] >= (load[s] - load[under])[None, :]] = np.inf
        i, j = np.unravel_index(np.argmin(cost), cost.shape)
        if not np.isfinite(cost[i, j]):
            return
        own[mine[i]] = under[j]


def place_lists(sizes: np.ndarray, visits: np.ndarray, n_shards: int, kind: str = "hotness",
                replicate: float = 0.02, centroids: np.ndarray | None = None) -> Placement:
    """Each list's shard(s). hotness: lists by expected work (size x (visits + 1)), heaviest first, each to the
    shard with the least work so far among those under STORAGE_SLACK x their share of postings; the hottest
    `replicate` fraction of lists get a second shard (the next least loaded), each copy expecting half.
    round-robin: list i on shard i mod n_shards, no replicas.
    locality: shard s holds region s of centroid space (`centroids`, one row per list; _regions: recursive
    bisection balancing the expected work), so lists probed together sit together; the hottest `replicate`
    fraction get a second shard, the nearest other region's (by the distance from the list's centroid to the
    work-weighted centre of each region), each copy expecting half. No storage cap: it balances work."""
    sizes = np.asarray(sizes, dtype=np.int64)
    n_lists = len(sizes)
    if kind not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {PLACEMENTS}, got {kind!r}")
    if kind == "locality" and (centroids is None or len(centroids) != n_lists):
        raise ConfigError("placement 'locality' needs the lists' centroids (one row per list)")
    if not 1 <= n_shards <= n_lists:
        raise ConfigError(f"shards must be in [1, {n_lists}] (the posting lists), got {n_shards}")
    if not 0 <= replicate <= 1:
        raise ConfigError(f"replicate must be in [0, 1], got {replicate}")
    work = sizes * (np.asarray(visits, dtype=np.float64) + 1.0)
    shards = np.full((n_lists, 2), -1, dtype=np.int32)
    if kind == "round-robin":
        shards[:, 0] = np.arange(n_lists) % n_shards
        return Placement(shards, work, kind)
    n_rep = int(round(replicate * n_lists)) if n_shards > 1 else 0
    if kind == "locality":
        x = np.asarray(centroids, dtype=np.float64)
        shards[:, 0] = _regions(x, work, n_shards)
        if n_rep:
            centre = np.stack([np.average(x[shards[:, 0] == s], axis=0, weights=work[shards[:, 0] == s] + 1e-12)
                               for s in range(n_shards)])
            hot = np.argsort(-work, kind="stable")[:n_rep]
            d = sq_dists(x[hot].astype(np.float32), centre.astype(np.float32)).astype(np.float64)
            d[np.arange(n_rep), shards[hot, 0]] = np.inf
            shards[hot, 1] = np.argmin(d, axis=1)
        _rebalance(Placement(shards, work, kind), x, n_shards)
        return Placement(shards, work, kind)
    load = np.zeros(n_shards)
    stored = np.zeros(n_shards)
    cap = STORAGE_SLACK * sizes.sum() / n_shards + sizes.max(initial=0)
    # Every shard first gets one list, so none is left empty.
    order = np.argsort(-work, kind="stable")
    for rank, c in enumerate(order):
        c = int(c)
        copies = 2 if rank < n_rep else 1
        if rank < n_shards:
            pick = [rank] if copies == 1 else [rank, (rank + 1) % n_shards]
        else:
            room = stored + sizes[c] <= cap
            key = np.where(room, load, np.inf + load)
            if not room.any():
                key = stored.astype(np.float64)
            pick = list(np.argsort(key, kind="stable")[:copies])
        for j, s in enumerate(pick):
            shards[c, j] = s
            load[s] += work[c] / copies
            stored[s] += sizes[c]
    return Placement(shards, work, kind)


def sample_visits(nav: NavigationTier, queries: np.ndarray, n_lists: int, params: SearchParams) -> np.ndarray:
    """How many of the queries probe each list (the router's own probing)."""
    visits = np.zeros(n_lists, dtype=np.int64)
    for s in range(0, len(queries), 1024):
        lists, _, _ = nav.probe(queries[s:s + 1024], params)
        lists = lists[lists >= 0]
        visits += np.bincount(lists, minlength=n_lists)
    return visits
