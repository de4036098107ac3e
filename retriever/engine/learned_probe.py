"""Learned pruning (SmartANNS): how many posting lists a query needs, predicted per query.

A small gradient-boosted model (scikit-learn, at build time) maps features of a query's distances to its
nearest centroids to the number of lists, in probe order, that hold its true top-k neighbours (all of
those the first nprobe lists hold). It is fitted to a quantile (`quantile`, 0.9 by default: the count
that suffices for 90% of queries like it), in log2 space. The router then probes that many lists, at
most nprobe, instead of cutting them by the distance-ratio rule.

The fitted trees are stored as plain arrays (probe_model.npy), not pickled, and predicted with NumPy:
opening an index runs no code from it, and needs no scikit-learn. A single index (BuildConfig.probe_model)
and a sharded router keep one the same way; NavigationTier.probe applies it (SearchParams.probe 'learned').
"""

from __future__ import annotations

import numpy as np

from fusionrag.retriever.engine.kmeans import sq_dists
from fusionrag.retriever.engine.manifest import load_array
from fusionrag.retriever.errors import ConfigError, IndexFormatError

MODEL_FILE = "probe_model.npy"
_ROWS = 16384  # data rows at a time in exact_topk

FEATURE_RANKS = (2, 4, 8, 16, 32, 64, 128, 256)
RATIOS = (1.1, 1.25, 1.5, 2.0)
N_FEATURES = 1 + len(FEATURE_RANKS) + len(RATIOS)


def probe_features(sqd: np.ndarray) -> np.ndarray:
    """Features of each query from its squared distances to its nearest centroids (q, m), ascending:
    log of the nearest distance, the distance ratios at ranks 2..256, the share of lists within 1.1-2x."""
    r = np.sqrt(np.maximum(np.nan_to_num(np.asarray(sqd, dtype=np.float64), posinf=np.inf), 0))
    m = r.shape[1]
    finite = np.isfinite(r)
    last = np.maximum(finite.sum(axis=1) - 1, 0)
    r = np.where(finite, r, r[np.arange(len(r)), last][:, None])
    d1 = np.maximum(r[:, 0], 1e-12)
    cols = [np.log(d1)]
    cols += [r[:, min(j, m) - 1] / d1 for j in FEATURE_RANKS]
    cols += [(r <= t * d1[:, None]).sum(axis=1) / m for t in RATIOS]
    return np.stack(cols, axis=1).astype(np.float32)


def lists_needed(probe_lists: np.ndarray, neighbours: np.ndarray, vector_lists, coverage: float = 1.0) -> np.ndarray:
    """Per query, the lists (a prefix of its probe order) holding `coverage` of its neighbours (those the
    probed lists hold at all). vector_lists(v) gives the lists vector v is in."""
    n_q, m = probe_lists.shape
    out = np.empty(n_q, dtype=np.int64)
    for i in range(n_q):
        rank = {int(c): j for j, c in enumerate(probe_lists[i]) if c >= 0}
        ranks = sorted(min((rank[c] for c in vector_lists(int(v)) if c in rank), default=m)
                       for v in neighbours[i] if v >= 0)
        ranks = [x for x in ranks if x < m]
        if not ranks:
            out[i] = m
            continue
        need = max(1, int(np.ceil(coverage * len(ranks))))
        out[i] = ranks[need - 1] + 1
    return out


class ProbeModel:
    """Gradient-boosted regression trees as arrays: trees (T, N, 5) float64 rows of (feature, threshold,
    left, right, value), feature -1 at a leaf; prediction = init + rate * sum of the trees' leaf values."""

    def __init__(self, trees: np.ndarray, init: float, rate: float, quantile: float):
        if trees.ndim != 3 or trees.shape[2] != 5:
            raise IndexFormatError(f"probe model: expected (trees, nodes, 5) arrays, got {trees.shape}")
        self.trees, self.init, self.rate, self.quantile = trees, float(init), float(rate), float(quantile)
        self.feature = trees[:, :, 0].astype(np.int64)
        self.threshold = trees[:, :, 1]
        self.left, self.right = trees[:, :, 2].astype(np.int64), trees[:, :, 3].astype(np.int64)
        self.value = trees[:, :, 4]
        nodes = trees.shape[1]
        if (self.feature >= N_FEATURES).any() or (self.left >= nodes).any() or (self.right >= nodes).any() or \
                (self.left < 0).any() or (self.right < 0).any() or not np.isfinite(self.value).all():
            raise IndexFormatError("probe model: a tree points outside itself")

    @classmethod
    def train(cls, features: np.ndarray, needed: np.ndarray, quantile: float = 0.9, trees: int = 100,
              depth: int = 3, seed: int = 0) -> "ProbeModel":
        if not 0 < quantile < 1:
            raise ConfigError(f"probe quantile must be in (0, 1), got {quantile}")
        try:
            from sklearn.ensemble import GradientBoostingRegressor
        except ImportError as e:
            raise ConfigError("training the learned probe needs scikit-learn (pip install scikit-learn)") from e
        y = np.log2(np.maximum(np.asarray(needed, dtype=np.float64), 1))
        gbr = GradientBoostingRegressor(loss="quantile", alpha=quantile, n_estimators=trees, max_depth=depth,
                                        learning_rate=0.1, random_state=seed)
        gbr.fit(features, y)
        nodes = max(e.tree_.node_count for e in gbr.estimators_[:, 0])
        arr = np.zeros((trees, nodes, 5))
        arr[:, :, 0] = -1
        for t, est in enumerate(gbr.estimators_[:, 0]):
            tr, n = est.tree_, est.tree_.node_count
            leaf = tr.children_left[:n] < 0
            arr[t, :n, 0] = np.where(leaf, -1, tr.feature[:n])
            arr[t, :n, 1] = tr.threshold[:n]
            arr[t, :n, 2] = np.maximum(tr.children_left[:n], 0)
            arr[t, :n, 3] = np.maximum(tr.children_right[:n], 0)
            arr[t, :n, 4] = tr.value[:n, 0, 0]
        model = cls(arr, 0.0, gbr.learning_rate, quantile)
        model.init = float(np.median(gbr.predict(features) - model.predict_log2(features)))
        return model

    def predict_log2(self, x: np.ndarray) -> np.ndarray:
        """log2 of the lists each row of features x needs: every tree walked at once, a level per step (on
        the query path: a few NumPy calls per batch, not one per tree)."""
        x = np.asarray(x, dtype=np.float32)
        n_trees = len(self.trees)
        tree = np.arange(n_trees)[None, :]
        rows = np.arange(len(x))[:, None]
        node = np.zeros((len(x), n_trees), dtype=np.int64)
        for _ in range(self.trees.shape[1]):  # a tree's depth at most; a damaged one may loop
            f = self.feature[tree, node]
            inner = f >= 0
            if not inner.any():
                break
            go_left = x[rows, np.maximum(f, 0)] <= self.threshold[tree, node]
            node = np.where(inner, np.where(go_left, self.left[tree, node], self.right[tree, node]), node)
        return self.init + self.rate * self.value[tree, node].sum(axis=1)

    def lists(self, features: np.ndarray, scale: float = 1.0, cap: int = 1 << 20) -> np.ndarray:
        """Lists to probe per query: scale x the predicted count, in [1, cap]."""
        predicted = np.nan_to_num(np.exp2(self.predict_log2(features)), nan=cap, posinf=cap)
        return np.clip(np.ceil(scale * predicted), 1, cap).astype(np.int64)

    def meta(self) -> dict:
        return {"init": self.init, "learning_rate": self.rate, "quantile": self.quantile, "trees": len(self.trees)}


def exact_topk(rows, n: int, queries: np.ndarray, k: int, metric: str, exclude: np.ndarray | None = None,
               distances: bool = False):
    """Brute-force top-k rows of each query (the engine's metric: l2, or ip), a chunk of rows at a time;
    exclude[i]: a row query i may not return (itself, when the queries are rows of the data). distances: return
    (ids, their distances: inf where -1) instead of the ids alone."""
    best_d = np.full((len(queries), k), np.inf, dtype=np.float32)
    best_i = np.full((len(queries), k), -1, dtype=np.int64)
    # Queries at a time: their (step, k + _ROWS) distances, ids and sorts (~24 bytes an entry) in at most 24 MiB.
    step = int(max(8, min(256, (24 << 20) // ((k + _ROWS) * 24))))
    # rows.order, where rows has one: the ids in the order their vectors lie in storage (a page file holds them in
    # list order), so each chunk reads one stretch of it. Gathered in id order instead, every chunk touched pages
    # all over the file: under a memory cap smaller than the file each touch read a whole read-around (8 MiB here),
    # and a calibration of 10M x 128 (5 GB of pages) in 1.6 GiB read several TB.
    stored_order = getattr(rows, "order", None)
    for lo in range(0, n, _ROWS):
        ids = np.arange(lo, min(n, lo + _ROWS)) if stored_order is None else np.sort(stored_order[lo:lo + _ROWS])
        x = rows(ids)
        for a in range(0, len(queries), step):
            q = queries[a:a + step]
            d = -(q @ x.T) if metric == "ip" else sq_dists(q, x)
            d = np.asarray(d, dtype=np.float32)
            if exclude is not None:
                e = exclude[a:a + step]
                at = np.minimum(np.searchsorted(ids, e), len(ids) - 1)
                inside = ids[at] == e
                d[np.flatnonzero(inside), at[inside]] = np.inf
            d = np.concatenate([best_d[a:a + step], d], axis=1)
            i = np.concatenate([best_i[a:a + step], np.broadcast_to(ids, (len(q), len(ids)))], axis=1)
            order = np.argpartition(d, k - 1, axis=1)[:, :k] if d.shape[1] > k else np.arange(d.shape[1])[None].repeat(len(q), 0)
            dd, ii = np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)
            o2 = np.argsort(dd, axis=1, kind="stable")
            best_d[a:a + step], best_i[a:a + step] = np.take_along_axis(dd, o2, 1), np.take_along_axis(ii, o2, 1)
    found = np.where(np.isfinite(best_d), best_i, -1)
    return (found, best_d) if distances else found


def train_probe_model(nav, rows, n: int, queries: np.ndarray, self_rows: np.ndarray | None, lists_of,
                      engine_metric: str, params, quantile: float, k: int = 10,
                      seed: int = 0) -> tuple[ProbeModel, dict]:
    """Learned pruning's model from sample queries: their exact top-k (rows(ids) gives the data, in the
    engine's metric; self_rows[i]: the row query i is, never its own neighbour), the lists in probe order
    (nav.nearest under params) that hold them (lists_of(neighbours) gives vector_lists: v -> the lists v is
    in), a quantile regression of that count on features of the centroid distances. Returns the model and
    its manifest entry (what it saw)."""
    truth = exact_topk(rows, n, queries, k, engine_metric, self_rows)
    lists, sqd = nav.nearest(queries, params)
    needed = lists_needed(lists, truth, lists_of(truth))
    model = ProbeModel.train(probe_features(sqd), needed, quantile, seed=seed)
    return model, {**model.meta(), "queries": int(len(queries)), "k": k, "nprobe": int(lists.shape[1]),
                   "mean_needed": float(needed.mean()), "p90_needed": float(np.quantile(needed, 0.9))}


def csr_lists_of(offsets: np.ndarray, list_ids: np.ndarray, wanted: np.ndarray):
    """vector_lists (v -> the lists v is in) from an index's postings (CSR), for the wanted vectors only."""
    keep = np.isin(list_ids, np.unique(wanted[wanted >= 0]))
    of_list = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))[keep]
    ids = list_ids[keep].astype(np.int64)
    order = np.argsort(ids, kind="stable")
    ids, of_list = ids[order], of_list[order]

    def vector_lists(v: int) -> np.ndarray:
        return of_list[np.searchsorted(ids, v, "left"):np.searchsorted(ids, v, "right")]

    return vector_lists


def lists_of_pairs(pair_lists: np.ndarray, pair_ids: np.ndarray):
    """lists_of for train_probe_model from (list, vector) postings sorted by vector."""
    def vector_lists(v: int) -> np.ndarray:
        return pair_lists[np.searchsorted(pair_ids, v, "left"):np.searchsorted(pair_ids, v, "right")]

    return lambda neighbours: vector_lists


def save_probe_model(w, model: ProbeModel, info: dict) -> dict:
    """Write the model into the index being written (w); returns its manifest entry ("probe_model")."""
    w.save_array(MODEL_FILE, model.trees)
    return info


def load_probe_model(path, manifest: dict) -> ProbeModel | None:
    """The probe model an index directory holds (its manifest's "probe_model" entry), None if it has none."""
    if "probe_model" not in manifest:
        return None
    if MODEL_FILE not in manifest.get("files", {}):
        raise IndexFormatError(f"{path}: the manifest names a probe model but not {MODEL_FILE}")
    pm = manifest["probe_model"]
    try:
        return ProbeModel(load_array(path, MODEL_FILE, np.float64, 3), pm["init"], pm["learning_rate"],
                          pm["quantile"])
    except (KeyError, TypeError, ValueError) as e:
        raise IndexFormatError(f"{path}: manifest garbles the probe model ({e!r})") from e
