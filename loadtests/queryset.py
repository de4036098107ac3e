"""The collections a load test runs against, built with known vectors, and their known query sets.

Ground truth is exact search (numpy, float64) over the very vectors the collection holds, so a check
can tell a right answer from a fast wrong one.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from fusionrag.loadtests.plan import QuerySet
from fusionrag.retriever.collection import Catalog, Document
from fusionrag.retriever.errors import InputError

VECTOR_COLLECTION = "loadtest-vectors"
TEXT_COLLECTION = "loadtest-texts"
_CHUNK = 2048


def vector_id(row: int) -> str:
    return f"v{row}"


def exact_knn(base: np.ndarray, queries: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows and distances of the exact top-k, in the engine's distance convention (ascending)."""
    base = base.astype(np.float64)
    queries = queries.astype(np.float64)
    if metric == "cosine":
        base = base / np.linalg.norm(base, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    norms = (base**2).sum(1)
    rows, dists = [], []
    for lo in range(0, len(queries), 256):
        q = queries[lo:lo + 256]
        if metric == "l2":
            d = (q**2).sum(1)[:, None] - 2 * q @ base.T + norms[None, :]
            d = np.maximum(d, 0)
        elif metric == "ip":
            d = -(q @ base.T)
        else:
            d = 1 - q @ base.T
        top = np.argsort(d, axis=1, kind="stable")[:, :k]
        rows.append(top)
        dists.append(np.take_along_axis(d, top, axis=1))
    return np.concatenate(rows), np.concatenate(dists)


def synthetic_vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """A Gaussian mixture: real embeddings are clustered, uniform noise is not."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(1, n // 100), dim)).astype(np.float32)
    labels = rng.integers(len(centers), size=n)
    return (centers[labels] + 0.3 * rng.standard_normal((n, dim))).astype(np.float32)


def load_vectors(path: str | None, count: int, dim: int, seed: int = 0) -> np.ndarray:
    if path is None:
        return synthetic_vectors(count, dim, seed)
    from fusionrag.retriever.engine.vectors import open_vectors

    vf = open_vectors(path)
    return np.ascontiguousarray(vf[: min(count, len(vf))], dtype=np.float32)


def near_queries(base: np.ndarray, n: int, seed: int = 1) -> np.ndarray:
    """Queries near the data but not on it: sampled rows plus noise of a tenth of the data's spread."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(base), size=n, replace=n > len(base))
    spread = float(base.std()) or 1.0
    return (base[rows] + 0.1 * spread * rng.standard_normal((n, base.shape[1]))).astype(np.float32)


def _upsert(coll, docs: list[Document]) -> None:
    for lo in range(0, len(docs), _CHUNK):
        coll.upsert(docs[lo:lo + _CHUNK])


def build_vector_collection(catalog: Catalog, base: np.ndarray, metric: str = "l2",
                            name: str = VECTOR_COLLECTION) -> None:
    """Documents `v<row>` holding the rows of `base`, folded into the main (three-tier) index."""
    coll = catalog.create(name, base.shape[1], metric)
    _upsert(coll, [Document(id=vector_id(i), text=f"Document {vector_id(i)}: row {i} of the load-test vectors.",
                            vector=v, metadata={"row": i}) for i, v in enumerate(base)])
    coll.merge()


def vector_query_set(base: np.ndarray, queries: np.ndarray, k: int, metric: str = "l2",
                     name: str = VECTOR_COLLECTION) -> QuerySet:
    rows, dists = exact_knn(base, queries, k, metric)
    # float32 storage against float64 truth: allow the rounding of a squared distance of this size.
    tol = 1e-4 * float(np.abs(dists).max() + 1)
    return QuerySet(collection=name, kind="vectors", metric=metric, queries=queries.tolist(),
                    truth=[[vector_id(r) for r in row] for row in rows.tolist()],
                    truth_dist=dists.tolist(), dist_tol=tol)


def read_texts(path: str | None, count: int) -> list[tuple[str, str]]:
    """(id, text) pairs: a JSON-lines file (.jsonl or .jsonl.gz) with "text" and optional "id" per line,
    or, without a file, the service's demo corpus."""
    if path is None:
        from fusionrag.server.demo import corpus

        return [(d.id, d.text) for d in corpus()][:count]
    opener = gzip.open if str(path).endswith(".gz") else open
    out, seen_texts, seen_ids = [], set(), set()
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                text = row["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
            doc_id = str(row.get("id", n))
            if text in seen_texts or doc_id in seen_ids:
                continue  # duplicate texts would make ground truth a coin toss between equal distances
            seen_texts.add(text)
            seen_ids.add(doc_id)
            out.append((doc_id, text))
            if len(out) >= count:
                break
    return out


def query_phrase(text: str, words: int = 12) -> str:
    """A phrase taken from a document, as a user who half-remembers it would type it."""
    return " ".join(text.split()[:words])


def build_text_collection(catalog: Catalog, texts: list[tuple[str, str]], n_queries: int, k: int,
                          embedding: str, name: str = TEXT_COLLECTION, seed: int = 2) -> QuerySet:
    """A cosine collection of the texts embedded here; queries are phrases from some of them."""
    from fusionrag.retriever.collection.embedding import get_embedder

    embedder = get_embedder(embedding)
    vectors = embedder.embed([t for _, t in texts])
    coll = catalog.create(name, embedder.dim, "cosine", embedder.name)
    _upsert(coll, [Document(id=i, text=t, vector=v) for (i, t), v in zip(texts, vectors)])
    coll.merge()
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(texts), size=n_queries, replace=n_queries > len(texts))
    phrases = [query_phrase(texts[i][1]) for i in picks]
    rows, dists = exact_knn(vectors, embedder.embed(phrases), k, "cosine")
    ids = [t for t, _ in texts]
    # The service embeds the query itself, in other batches: allow float noise of the model.
    return QuerySet(collection=name, kind="texts", metric="cosine", queries=phrases,
                    truth=[[ids[r] for r in row] for row in rows.tolist()], truth_dist=dists.tolist(),
                    dist_tol=2e-3)


def save_query_set(qs: QuerySet, path: str | Path) -> None:
    from dataclasses import asdict

    Path(path).write_text(json.dumps(asdict(qs)))


def load_query_set(path: str | Path) -> QuerySet:
    try:
        return QuerySet(**json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise InputError(f"query set {path}: {e}") from None
