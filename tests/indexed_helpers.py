"""A collection the engine's defaults index, for the integrations' tests, and the checks that a store's
searches ran through that index and found what exact search finds.

Written through a store: N_BEFORE documents at once reach CollectionConfig.merge_fresh_count, so the
collection merges them into a built generation in the background; N_AFTER more, written once that
merge is published, stay in the fresh tier; DELETED of the indexed ones become tombstones. WIDE
passes more than CollectionConfig.filter_exact_max documents, so the index answers it with the others
excluded inside the PQ scan; NARROW passes few, and is answered by exact search. Ground truth: exact
search in float64 numpy over the same vectors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
from langchain_core.embeddings import Embeddings

from fusionrag.retriever.collection import CollectionConfig

DIM = 16
N_BEFORE = CollectionConfig.merge_fresh_count
N_AFTER = 4000
N = N_BEFORE + N_AFTER
GROUPS = 20
K = 10
WIDE = {"g": {"$ne": 3}}
NARROW = {"g": 3}
DELETED = np.arange(0, N_BEFORE, 40)  # 500 indexed documents
assert N - len(DELETED) - N // GROUPS > CollectionConfig.filter_exact_max, "WIDE must pass the index's threshold"


@dataclass(frozen=True)
class Corpus:
    vectors: np.ndarray  # float32 (N, DIM)
    queries: np.ndarray  # float32 (Q, DIM)
    near: np.ndarray  # the document each query sits next to

    @property
    def ids(self) -> list[str]:
        return [f"d{i}" for i in range(N)]

    @property
    def texts(self) -> list[str]:
        return [f"document {i}" for i in range(N)]

    @property
    def metadata(self) -> list[dict]:
        return [{"g": i % GROUPS, "part": "before" if i < N_BEFORE else "after"} for i in range(N)]

    def live(self, flt: dict | None = None) -> np.ndarray:
        """Which documents are there and pass `flt` (None, WIDE or NARROW)."""
        ok = np.ones(N, bool)
        ok[DELETED] = False
        g = np.arange(N) % GROUPS
        if flt is not None:
            ok &= (g != 3) if flt == WIDE else (g == 3)
        return ok

    def exact(self, metric: str, flt: dict | None) -> list[list[str]]:
        x, q = self.vectors.astype(np.float64), self.queries.astype(np.float64)
        if metric == "cosine":
            x = x / np.linalg.norm(x, axis=1, keepdims=True)
            q = q / np.linalg.norm(q, axis=1, keepdims=True)
            d = -(q @ x.T)
        else:
            d = (q * q).sum(1)[:, None] - 2 * q @ x.T + (x * x).sum(1)[None]
        d[:, ~self.live(flt)] = np.inf
        return [[f"d{j}" for j in row] for row in np.argsort(d, axis=1, kind="stable")[:, :K]]


def corpus(seed: int = 0) -> Corpus:
    """Clustered vectors; ten queries next to each of: deleted documents (whose exact answer would be
    themselves), documents written after the merge, and other indexed documents."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((50, DIM)) * 3
    x = (centers[rng.integers(0, 50, N)] + rng.standard_normal((N, DIM))).astype(np.float32)
    kept = np.setdiff1d(np.arange(N_BEFORE), DELETED)
    near = np.concatenate([DELETED[:10], rng.choice(np.arange(N_BEFORE, N), 10, replace=False),
                           rng.choice(kept, 10, replace=False)])
    q = (x[near] + 0.01 * rng.standard_normal((len(near), DIM))).astype(np.float32)
    return Corpus(x, q, near)


class Lookup(Embeddings):
    """A LangChain embedding that looks the corpus's vectors up by text."""

    def __init__(self, data: Corpus):
        self.table = dict(zip(data.texts, data.vectors.tolist()))

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.table[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.table[text]


def remote_search(url: str, key: str, name: str, queries: np.ndarray,
                  flt: dict | None) -> tuple[list[list[str]], list[dict]]:
    """The service's answers to `queries` (ids, best first) with the engine's statistics of each."""
    body = {"vectors": queries.tolist(), "k": K, "stats": True, **({"filter": flt} if flt else {})}
    r = httpx.post(f"{url}/v1/collections/{name}/search", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    return [[h["id"] for h in hits] for hits in out["results"]], out["stats"]


def remote_info(url: str, key: str, name: str) -> dict:
    r = httpx.get(f"{url}/v1/collections/{name}", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def wait_merged(info: Callable[[], dict], timeout: float = 300) -> dict:
    """The collection's build state once its first merge is published (N_BEFORE indexed, none fresh)."""
    deadline = time.monotonic() + timeout
    while True:
        state = info()["build_state"]
        if state["generation"] >= 1 and not state["merging"]:
            assert state["indexed"] == N_BEFORE and state["fresh"] == 0, state
            return state
        assert time.monotonic() < deadline, f"no merge within {timeout} s: {state}"
        time.sleep(0.2)


def recall(got: list[list[str]], truth: list[list[str]]) -> float:
    return float(np.mean([len(set(g) & set(t)) / len(t) for g, t in zip(got, truth)]))


def check_index_path(corpus: Corpus, metric: str, search: Callable[[dict | None], list[list[str]]],
                     engine: Callable[[dict | None], tuple[list[list[str]], list[dict]]]) -> dict:
    """`search(filter)`: the store's answers to corpus.queries (ids, best first); `engine(filter)`: the
    engine's own answers to the same queries, with its statistics. Checks, per filter, that the store
    answers what the engine does, only with documents that are there and pass the filter, at a recall
    against exact search that only the index can miss; and by the engine's statistics that the index
    answered (lists probed, pages read) beside the fresh tier, with WIDE's exclusions made inside the
    PQ scan and NARROW answered exactly. Returns the recall per filter."""
    out, unique = {}, {}
    for name, flt in (("none", None), ("wide", WIDE), ("narrow", NARROW)):
        got = search(flt)
        ids, stats = engine(flt)
        assert got == ids, f"{name}: the store's answers are not the engine's"
        assert all(len(hits) == K for hits in got), name
        passing = corpus.live(flt)
        assert all(passing[int(h[1:])] for hits in got for h in hits), f"{name}: a deleted or filtered-out hit"
        out[name] = recall(got, corpus.exact(metric, flt))
        if flt is NARROW:
            assert all(s["filtered_exact"] for s in stats) and out[name] == 1.0, (stats[0], out[name])
            continue
        fresh = int((passing & (np.arange(N) >= N_BEFORE)).sum())
        for s in stats:
            assert not s["filtered_exact"] and s["lists_probed"] > 0 and s["unique_candidates"] > 0, s
            # the index's exact re-rank scored candidates (from RAM or the SSD: raw_in_ram)
            assert s["reranked"] > 0 and s["fresh_candidates"] == fresh, (s, fresh)
        unique[name] = sum(s["unique_candidates"] for s in stats)
        assert out[name] >= 0.95, (name, out[name])
        if flt is None:
            # Next to a document written after the merge (fresh tier) or an indexed one: that one first.
            assert [hits[0] for hits in got[10:]] == [f"d{i}" for i in corpus.near[10:]]
    # The same queries and probed lists: WIDE's exclusions left fewer candidates in the scan.
    assert unique["wide"] < unique["none"], unique
    return out
