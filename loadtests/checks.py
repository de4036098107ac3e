"""Checks of every answer, so that a fast wrong answer counts as a failure, not as throughput."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


class Wrong(Exception):
    """An answer that arrived but is not right; the message says what is wrong with it."""


@dataclass(frozen=True)
class SearchAnswer:
    hits: list[list[dict]]
    recall: float | None  # mean recall@k over the queries that have ground truth; None without


def check_search(body: dict, n_queries: int, expect_hits: int, truth: list[list[str]] | None = None,
                 truth_dist: list[list[float]] | None = None, dist_tol: float = 0.0,
                 min_recall: float = 0.0) -> SearchAnswer:
    """Check one search response. `truth[i]`/`truth_dist[i]`: exact top-k ids and distances of query i.

    Whatever the engine does, a valid answer has per query `expect_hits` distinct hits in ascending
    distance, and its j-th distance can never beat the exact j-th distance. Recall below `min_recall`
    means the ids are wrong even though they look plausible.
    """
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise Wrong("response has no 'results' list")
    if len(results) != n_queries:
        raise Wrong(f"{len(results)} result lists for {n_queries} queries")
    recalls = []
    for qi, hits in enumerate(results):
        if not isinstance(hits, list) or len(hits) != expect_hits:
            got = len(hits) if isinstance(hits, list) else type(hits).__name__
            raise Wrong(f"query {qi}: {got} hits, expected {expect_hits}")
        ids, dists = [], []
        for h in hits:
            if not isinstance(h, dict) or not isinstance(h.get("id"), str) or "score" not in h:
                raise Wrong(f"query {qi}: malformed hit {str(h)[:120]}")
            d = h.get("distance")
            if not isinstance(d, (int, float)) or not math.isfinite(d):
                raise Wrong(f"query {qi}: hit {h['id']!r} has distance {d!r}")
            ids.append(h["id"])
            dists.append(float(d))
        if len(set(ids)) != len(ids):
            raise Wrong(f"query {qi}: duplicate ids in {ids}")
        tol = 1e-5 * (1 + max(abs(x) for x in dists)) if dists else 0.0
        if any(b < a - tol for a, b in zip(dists, dists[1:])):
            raise Wrong(f"query {qi}: hits not in ascending distance: {dists}")
        if truth is None:
            continue
        exact = truth_dist[qi]
        for j, (d, e) in enumerate(zip(dists, exact)):
            if d < e - dist_tol - 1e-5 * abs(e):
                raise Wrong(f"query {qi}: hit {j} ({ids[j]!r}) claims distance {d:.6g}, below the exact "
                            f"{j}-th distance {e:.6g}: the distances are wrong")
        k = min(len(truth[qi]), expect_hits)
        r = len(set(ids[:k]) & set(truth[qi][:k])) / k
        if r < min_recall:
            raise Wrong(f"query {qi}: recall@{k} {r:.2f} below {min_recall}: got {ids[:k]}, "
                        f"exact {truth[qi][:k]}")
        recalls.append(r)
    return SearchAnswer(results, sum(recalls) / len(recalls) if recalls else None)


@dataclass(frozen=True)
class StreamedAnswer:
    text: str
    chunks: int  # content chunks, one token each for servers that stream token by token
    finish_reason: str
    ttft_s: float  # time to the first content chunk
    retrieval: dict | None = None  # what a chunk's "retrieval" carried (the vLLM plugin's first chunk)
    retrieval_s: float | None = None  # time to that chunk
    usage: dict | None = None  # the usage chunk's, when the server sent one


def read_chat_stream(lines, started: float, clock) -> StreamedAnswer:
    """Consume an OpenAI chat-completions SSE stream (an iterable of byte lines) to its `[DONE]`."""
    text, chunks, finish, first = [], 0, None, None
    retrieval, retrieval_at, usage = None, None, None
    done = False
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data:"):
            raise Wrong(f"not a server-sent event line: {line[:120]!r}")
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise Wrong(f"stream event is not JSON: {data[:120]!r}") from None
        if "error" in event:
            raise Wrong(f"LLM server error in stream: {str(event['error'])[:200]}")
        if "retrieval" in event:
            if retrieval is not None:
                raise Wrong("the stream carried the retrieval twice")
            retrieval, retrieval_at = event["retrieval"], clock()
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if first is None:
                    first = clock()
                text.append(piece)
                chunks += 1
            finish = choice.get("finish_reason") or finish
    if not done:
        raise Wrong("stream ended without [DONE]")
    if not chunks:
        raise Wrong("stream carried no content")
    if finish is None:
        raise Wrong("stream never gave a finish_reason")
    return StreamedAnswer("".join(text), chunks, finish, first - started, retrieval,
                          None if retrieval_at is None else retrieval_at - started, usage)
