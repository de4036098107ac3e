"""Locust users of the retrieval service. Run through `fusionrag loadtest`, which writes the plan
(FUSIONRAG_LOADTEST_PLAN) this file reads: the load shape, user weights, known queries and their
exact answers, and where to log every request.

Every response is checked; a wrong answer is a Locust failure and a failed row in the request log,
whatever its speed.
"""

from __future__ import annotations

import csv
import random
import time
import uuid

from locust import HttpUser, LoadTestShape, constant, constant_throughput, events, task

from fusionrag.loadtests.checks import Wrong, check_search, read_chat_stream
from fusionrag.loadtests.plan import USER_CLASSES, Plan, QuerySet
from fusionrag.loadtests.rag import rag_messages

PLAN = Plan.from_env()
TIMEOUT_S = 60
LOG_FIELDS = ("t", "name", "ms", "ok", "recall", "ttft_ms", "tokens", "retrieval_ms", "error")


class RequestLog:
    """One CSV row per request, written as it completes: the report's source of truth."""

    def __init__(self, path: str):
        self.file = open(path, "w", newline="", buffering=1)
        self.out = csv.writer(self.file)
        self.out.writerow(LOG_FIELDS)

    def row(self, t: float, name: str, ms: float, error: str = "", recall=None, ttft_ms=None, tokens=None,
            retrieval_ms=None):
        self.out.writerow((f"{t:.6f}", name, f"{ms:.3f}", 0 if error else 1,
                           "" if recall is None else f"{recall:.4f}",
                           "" if ttft_ms is None else f"{ttft_ms:.3f}", "" if tokens is None else tokens,
                           "" if retrieval_ms is None else f"{retrieval_ms:.3f}", error.replace("\n", " ")[:300]))


LOG = RequestLog(PLAN.request_log)


@events.test_stop.add_listener
def _close_log(**_):
    LOG.file.flush()


class _ServiceUser(HttpUser):
    abstract = True
    wait_time = constant_throughput(PLAN.user_rate) if PLAN.user_rate else constant(0)

    def call(self, name: str, method: str, url: str, body: dict, check, stream: bool = False):
        """Send one request; `check(response)` returns the row's extra fields or raises Wrong."""
        start, clock = time.time(), time.perf_counter()
        fields, error = {}, ""
        with self.client.request(method, url, json=body, name=name, catch_response=True, stream=stream,
                                 timeout=TIMEOUT_S) as resp:
            try:
                if resp.status_code != 200:
                    raise Wrong(f"HTTP {resp.status_code}: {(resp.text or str(resp.error))[:200]}")
                fields = check(resp, clock) or {}
                resp.success()
            except (Wrong, ValueError, KeyError, TypeError, AttributeError) as e:  # a malformed body, too
                error = str(e) or type(e).__name__
                resp.failure(error)
        ms = 1000 * (time.perf_counter() - clock)
        LOG.row(start, name, ms, error, **{k: v for k, v in fields.items() if not k.startswith("_")})
        return None if error else fields

    def search_known(self, qs: QuerySet, name: str, k: int) -> dict | None:
        """One known query, its answer checked against the exact top-k."""
        i = random.randrange(len(qs.queries))
        body = {qs.kind: [qs.queries[i]], "k": k}

        def check(resp, _):
            ans = check_search(resp.json(), 1, k, [qs.truth[i][:k]], [qs.truth_dist[i][:k]], qs.dist_tol,
                               PLAN.min_recall)
            return {"recall": ans.recall, "_hits": ans.hits[0], "_query": qs.queries[i]}

        return self.call(name, "POST", f"/v1/collections/{qs.collection}/search", body, check)


class VectorSearchUser(_ServiceUser):
    @task
    def search(self):
        self.search_known(PLAN.vector, "search:vector", PLAN.k)


class TextSearchUser(_ServiceUser):
    @task
    def search(self):
        self.search_known(PLAN.text, "search:text", PLAN.k)


class MixedUser(_ServiceUser):
    """Searches while writing: add documents, find them, delete them, find them gone."""

    @task(3)
    def search(self):
        self.search_known(PLAN.vector, "search:vector", PLAN.k)

    @task(1)
    def write(self):
        coll = PLAN.vector.collection
        dim = len(PLAN.vector.queries[0])
        ids = [f"lt-{uuid.uuid4().hex}" for _ in range(random.randint(1, 4))]
        vectors = [[PLAN.write_offset + random.gauss(0, PLAN.write_spread) for _ in range(dim)] for _ in ids]
        docs = [{"id": i, "text": f"written by the load test: {i}", "vector": v, "metadata": {"loadtest": True}}
                for i, v in zip(ids, vectors)]

        def upserted(resp, _):
            got = resp.json().get("ids")
            if got != ids:
                raise Wrong(f"upsert returned ids {got}, sent {ids}")

        def nearest_is(expect: bool):
            def check(resp, _):
                hits = check_search(resp.json(), 1, 1).hits[0]
                if (hits[0]["id"] == ids[0]) != expect:
                    raise Wrong(f"nearest to written {ids[0]!r} is {hits[0]['id']!r}"
                                + (" after it was deleted" if not expect else ""))
            return check

        def deleted(resp, _):
            n = resp.json().get("deleted")
            if n != len(ids):
                raise Wrong(f"delete of {len(ids)} fresh documents reported {n}")

        path = f"/v1/collections/{coll}"
        if self.call("write:upsert", "POST", f"{path}/documents", {"documents": docs}, upserted) is None:
            return
        self.call("write:read-own", "POST", f"{path}/search", {"vectors": [vectors[0]], "k": 1}, nearest_is(True))
        if self.call("write:delete", "DELETE", f"{path}/documents", {"ids": ids}, deleted) is None:
            return
        self.call("write:read-deleted", "POST", f"{path}/search", {"vectors": [vectors[0]], "k": 1},
                  nearest_is(False))


class RagUser(_ServiceUser):
    """Retrieve, then stream an answer from the LLM server with the hits in the prompt; or, on the
    plugin's route, both in one streamed request to vLLM."""

    @task
    def ask(self):
        if PLAN.rag_route == "plugin":
            return self.ask_plugin()
        qs = PLAN.text or PLAN.vector
        found = self.search_known(qs, "rag:retrieve", PLAN.rag_k)
        if found is None:
            return
        hits = found["_hits"]
        question = found["_query"] if qs.kind == "texts" else \
            "What do the passages " + ", ".join(h["id"] for h in hits) + " say?"
        llm = PLAN.llm
        body = {"model": llm.model, "messages": rag_messages(question, hits), "max_tokens": llm.max_tokens,
                "stream": True, "temperature": 0}

        def streamed(resp, clock):
            ans = read_chat_stream(resp.iter_lines(), clock, time.perf_counter)
            return {"ttft_ms": 1000 * ans.ttft_s, "tokens": ans.chunks}

        self.call("rag:generate", "POST", llm.url.rstrip("/") + "/v1/chat/completions", body, streamed, stream=True)

    def ask_plugin(self):
        """One known text question to /v1/rag/chat/completions: the retrieval its first chunk carries is
        checked against the exact top-k, and must come before the first token."""
        qs, k, llm = PLAN.text, PLAN.rag_k, PLAN.llm
        i = random.randrange(len(qs.queries))
        body = {"model": llm.model, "messages": [{"role": "user", "content": qs.queries[i]}],
                "max_tokens": llm.max_tokens, "stream": True, "temperature": 0,
                "retrieval": {"collection": qs.collection, "k": k}}

        def streamed(resp, clock):
            ans = read_chat_stream(resp.iter_lines(), clock, time.perf_counter)
            if ans.retrieval is None or ans.retrieval_s > ans.ttft_s:
                raise Wrong("the stream did not carry the retrieval before its first token")
            ids = ans.retrieval.get("ids")
            if not isinstance(ids, list) or len(ids) != k or len(set(ids)) != k:
                raise Wrong(f"retrieval ids {str(ids)[:200]}: expected {k} distinct ids")
            recall = len(set(ids) & set(qs.truth[i][:k])) / k
            if recall < PLAN.min_recall:
                raise Wrong(f"retrieval recall@{k} {recall:.2f} below {PLAN.min_recall}: got {ids}, "
                            f"exact {qs.truth[i][:k]}")
            tokens = (ans.usage or {}).get("completion_tokens", ans.chunks)
            return {"ttft_ms": 1000 * ans.ttft_s, "tokens": tokens, "recall": recall,
                    "retrieval_ms": 1000 * ans.retrieval_s}

        self.call("rag:chat", "POST", "/v1/rag/chat/completions", body, streamed, stream=True)


for _kind, _weight in PLAN.weights.items():
    globals()[USER_CLASSES[_kind]].weight = _weight


class PlannedShape(LoadTestShape):
    """The plan's shape (steady, step or burst), ticked by Locust about once a second."""

    def tick(self):
        users = PLAN.shape.users_at(self.get_run_time())
        return None if users is None else (users, PLAN.shape.rate())
