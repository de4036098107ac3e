"""Learned pruning (SmartANNS): how many posting lists a query needs, predicted per query.

A small gradient-boosted model (scikit-learn, at build time) maps features of a query's distances to its
nearest centroids to the number of lists, in probe order, that hold its true top-k neighbours (all of
those the first nprobe lists hold). It is fitted to a quantile (`quantile`, 0.9 by default: the count
that suffices for 90% of queries like it), in log2 space. The router then probes that many lists, at
most nprobe, instead of cutting them by the distance-ratio rule.

The fitted trees are stored as plain arrays (probe_model.npy), not pickled, and predicted with NumPy:
opening an index runs no code from it, and needs no scikit-learn.
"""

from __future__ import annotations

import numpy as np

from fusionrag.retriever.errors import ConfigError, IndexFormatError

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
        if (self.feature >= N_FEATURES).any() or (self.left >= trees.shape[1]).any() or \
                (self.right >= trees.shape[1]).any():
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
        x = np.asarray(x, dtype=np.float32)
        out = np.full(len(x), self.init)
        rows = np.arange(len(x))
        for t in range(len(self.trees)):
            node = np.zeros(len(x), dtype=np.int64)
            while True:
                f = self.feature[t, node]
                inner = f >= 0
                if not inner.any():
                    break
                go_left = x[rows, np.maximum(f, 0)] <= self.threshold[t, node]
                node = np.where(inner, np.where(go_left, self.left[t, node], self.right[t, node]), node)
            out += self.rate * self.value[t, node]
        return out

    def lists(self, features: np.ndarray, scale: float = 1.0, cap: int = 1 << 20) -> np.ndarray:
        """Lists to probe per query: scale x the predicted count, in [1, cap]."""
        return np.clip(np.ceil(scale * np.exp2(self.predict_log2(features))), 1, cap).astype(np.int64)

    def meta(self) -> dict:
        return {"init": self.init, "learning_rate": self.rate, "quantile": self.quantile, "trees": len(self.trees)}
