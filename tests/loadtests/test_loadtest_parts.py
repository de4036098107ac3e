"""The load tests' own parts, without a server: shapes, plans, answer checks, ground truth, report."""

import json

import numpy as np
import pytest
from conftest import clustered, exact_knn

from fusionrag.loadtests.checks import Wrong, check_search, read_chat_stream
from fusionrag.loadtests.plan import LLMTarget, Plan, QuerySet, ShapeConfig, parse_weights
from fusionrag.loadtests.queryset import read_texts, vector_query_set
from fusionrag.loadtests.rag import rag_messages
from fusionrag.loadtests.report import parse_prometheus, plot_latency, summarize_metrics, summarize_requests
from fusionrag.retriever.errors import ConfigError, InputError


def test_shapes_follow_their_definition():
    steady = ShapeConfig(kind="steady", users=5, seconds=10)
    assert [steady.users_at(t) for t in (0, 5, 9.9)] == [5, 5, 5] and steady.users_at(10) is None
    step = ShapeConfig(kind="step", users=4, seconds=30, start_users=1, step_users=2, step_seconds=5)
    assert [step.users_at(t) for t in (0, 4.9, 5, 10, 29)] == [1, 1, 3, 4, 4]
    burst = ShapeConfig(kind="burst", users=8, seconds=20, start_users=2, burst_every_s=10, burst_seconds=3)
    assert [burst.users_at(t) for t in (0, 6.9, 7, 9.9, 10, 17.5)] == [2, 2, 8, 8, 2, 8]
    assert burst.rate() == 8  # a burst arrives at once
    with pytest.raises(ConfigError, match="shape must be one of"):
        ShapeConfig(kind="sine")
    with pytest.raises(ConfigError, match="burst_seconds"):
        ShapeConfig(kind="burst", burst_every_s=2, burst_seconds=3)


def _qs(metric="l2", k=10):
    return QuerySet(collection="c", kind="vectors", metric=metric, queries=[[0.0, 1.0]],
                    truth=[[f"v{i}" for i in range(k)]], truth_dist=[[float(i) for i in range(k)]], dist_tol=0.0)


def test_plan_round_trips_and_refuses_what_cannot_work(tmp_path):
    plan = Plan(shape=ShapeConfig(), request_log=str(tmp_path / "r.csv"), weights={"vector": 2, "rag": 1},
                vector=_qs(), llm=LLMTarget(url="http://127.0.0.1:1"))
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.user_classes() == ["VectorSearchUser", "RagUser"]
    with pytest.raises(ConfigError, match="only keeps ground truth under the l2"):
        Plan(shape=ShapeConfig(), request_log="x", weights={"mixed": 1}, vector=_qs("cosine"))
    with pytest.raises(ConfigError, match="rag users need an LLM"):
        Plan(shape=ShapeConfig(), request_log="x", weights={"rag": 1}, vector=_qs())
    with pytest.raises(ConfigError, match="text users need a text query set"):
        Plan(shape=ShapeConfig(), request_log="x", weights={"text": 1})
    with pytest.raises(ConfigError, match="ground truth for k=10, the plan asks k=20"):
        Plan(shape=ShapeConfig(), request_log="x", k=20, vector=_qs())
    with pytest.raises(ConfigError, match="unknown plan field"):
        Plan.from_dict({**json.loads(plan.to_json()), "surprise": 1})
    assert parse_weights("vector=3, mixed ,rag=0") == {"vector": 3, "mixed": 1, "rag": 0}
    with pytest.raises(ConfigError, match="unknown user kind 'browse'"):
        parse_weights("vector,browse")
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_weights("vector=x")


def _body(ids, dists):
    return {"results": [[{"id": i, "score": 0.0, "distance": d, "text": "", "metadata": {}}
                         for i, d in zip(ids, dists)]]}


def test_check_search_passes_the_exact_answer_and_catches_wrong_ones():
    truth, dist = [["a", "b", "c", "d"]], [[0.0, 1.0, 2.0, 3.0]]
    ok = check_search(_body(["a", "b", "c", "d"], [0.0, 1.0, 2.0, 3.0]), 1, 4, truth, dist, 0.0, 0.5)
    assert ok.recall == 1.0
    # An approximate answer that misses one is still right enough.
    assert check_search(_body(["a", "b", "c", "x"], [0.0, 1.0, 2.0, 3.5]), 1, 4, truth, dist, 0.0, 0.5).recall == 0.75
    cases = {
        "recall@4 0.25 below 0.5": _body(["a", "x", "y", "z"], [0.0, 4.0, 5.0, 6.0]),  # fast and wrong
        "below the exact": _body(["a", "b", "c", "x"], [0.0, 1.0, 2.0, 2.5]),  # a distance nothing can have
        "not in ascending distance": _body(["a", "c", "b", "d"], [0.0, 2.0, 1.0, 3.0]),
        "duplicate ids": _body(["a", "a", "b", "c"], [0.0, 0.0, 1.0, 2.0]),
        "3 hits, expected 4": _body(["a", "b", "c"], [0.0, 1.0, 2.0]),
        "has distance None": _body(["a", "b", "c", "d"], [0.0, 1.0, 2.0, None]),
    }
    for msg, body in cases.items():
        with pytest.raises(Wrong, match=msg):
            check_search(body, 1, 4, truth, dist, 0.0, 0.5)
    with pytest.raises(Wrong, match="2 result lists for 1 queries"):
        check_search({"results": [[], []]}, 1, 4)
    with pytest.raises(Wrong, match="no 'results' list"):
        check_search({"detail": "oops"}, 1, 4)
    # Without ground truth only the shape of the answer is checked.
    assert check_search(_body(["q", "r", "s", "t"], [5.0, 6.0, 7.0, 8.0]), 1, 4).recall is None


def _sse(*events, done=True):
    lines = [b"data: " + json.dumps(e).encode() for e in events] + ([b"data: [DONE]"] if done else [])
    return [x for line in lines for x in (line, b"")]


def test_read_chat_stream_needs_content_a_finish_and_done():
    role = {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}
    tok = {"choices": [{"delta": {"content": " ba"}, "finish_reason": None}]}
    last = {"choices": [{"delta": {"content": " ke"}, "finish_reason": "length"}]}
    ticks = iter([1.25, 2.0])
    ans = read_chat_stream(_sse(role, tok, last), 1.0, lambda: next(ticks))
    assert (ans.text, ans.chunks, ans.finish_reason, ans.ttft_s) == (" ba ke", 2, "length", 0.25)
    with pytest.raises(Wrong, match="without \\[DONE\\]"):
        read_chat_stream(_sse(tok, last, done=False), 0, lambda: 0)
    with pytest.raises(Wrong, match="no content"):
        read_chat_stream(_sse(role), 0, lambda: 0)
    with pytest.raises(Wrong, match="never gave a finish_reason"):
        read_chat_stream(_sse(tok), 0, lambda: 0)
    with pytest.raises(Wrong, match="LLM server error"):
        read_chat_stream(_sse({"error": {"message": "overloaded"}}), 0, lambda: 0)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_query_set_ground_truth_is_exact_search(metric):
    base = clustered(600, 12, 8, seed=3)
    queries = clustered(20, 12, 8, seed=4)
    qs = vector_query_set(base, queries, 10, metric)
    want = exact_knn(base, queries, 10, metric)
    assert qs.truth == [[f"v{r}" for r in row] for row in want.tolist()]
    d = np.asarray(qs.truth_dist)
    assert np.all(np.diff(d, axis=1) >= 0)
    if metric == "l2":
        np.testing.assert_allclose(d[:, 0], ((base[want[:, 0]] - queries) ** 2).sum(1), rtol=1e-5)


def test_read_texts_skips_duplicates_and_names_a_bad_line(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "one"}\n'
                    '{"text": "two"}\n{"id": "d", "text": "3"}\n')
    assert read_texts(str(good), 2) == [("a", "one"), ("3", "two")]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(InputError, match="b.jsonl:2: expected a JSON object with a 'text' field"):
        read_texts(str(bad), 10)


def test_rag_prompt_carries_every_hit():
    msgs = rag_messages("What is PQ?", [{"id": "d1", "text": "PQ codes live in GPU memory."},
                                        {"id": "d2", "text": None}])
    user = msgs[-1]["content"]
    assert msgs[0]["role"] == "system" and "[d1] PQ codes live in GPU memory." in user and "[d2]" in user
    assert user.endswith("Question: What is PQ?")


def test_prometheus_parse_and_summary_over_a_run():
    before = parse_prometheus('# HELP x\nfusionrag_queries_total{collection="a"} 10\n'
                              'fusionrag_ssd_pages_read_total{collection="a"} 5\n'
                              'fusionrag_page_buffer_hits_total{collection="a"} 5\n'
                              'fusionrag_reranked_candidates_total{collection="a"} 100\n'
                              'fusionrag_batch_queries_count 4\nfusionrag_batch_queries_sum 10\n'
                              'fusionrag_http_requests_total{method="GET",route="/readyz",status="503"} 3\n')
    after_text = ('fusionrag_queries_total{collection="a"} 30\n'
                  'fusionrag_ssd_pages_read_total{collection="a"} 15\n'
                  'fusionrag_page_buffer_hits_total{collection="a"} 35\n'
                  'fusionrag_reranked_candidates_total{collection="a"} 500\n'
                  'fusionrag_batch_queries_count 8\nfusionrag_batch_queries_sum 30\n'
                  'fusionrag_stage_seconds_count{stage="rerank"} 20\nfusionrag_stage_seconds_sum{stage="rerank"} 0.02\n'
                  'fusionrag_gpu_memory_bytes{kind="used"} 100\nfusionrag_gpu_memory_bytes{kind="budget"} 200\n'
                  'fusionrag_gpu_memory_bytes{kind="process"} 250\n'
                  'fusionrag_http_requests_total{method="POST",route="/v1/x",status="200"} 20\n'
                  'fusionrag_http_requests_total{method="GET",route="/readyz",status="503"} 3\n'
                  'weird_label{path="a \\"quoted\\" b"} 1.5e3\n')
    after = parse_prometheus(after_text)
    assert after[("weird_label", (("path", 'a \\"quoted\\" b'),))] == 1500.0
    s = summarize_metrics(before, after)
    assert s["queries"] == 20 and s["ssd_pages_read_per_query"] == 0.5 and s["page_buffer_hit_ratio"] == 0.75
    assert s["reranked_per_query"] == 20 and s["queries_per_batch"] == 5 and s["stage_mean_ms"] == {"rerank": pytest.approx(1.0)}
    # Judged by what the process holds (250), not by the budget's bookkeeping (100).
    assert s["gpu_within_budget"] is False and s["http_responses_by_status"] == {"200": 20}
    assert summarize_metrics(before, parse_prometheus(after_text.replace("} 250", "} 150")))["gpu_within_budget"]
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        parse_prometheus("{} 1\n")


def test_request_summary_and_latency_plot(tmp_path):
    rows = [{"t": 100 + i * 0.01, "name": "search:vector", "ms": float(i % 100 + 1), "ok": True,
             "recall": 1.0, "ttft_ms": None, "tokens": None, "error": ""} for i in range(400)]
    rows += [{"t": 102.0, "name": "search:vector", "ms": 3.0, "ok": False, "recall": 0.1, "ttft_ms": None,
              "tokens": None, "error": "query 0: recall@10 0.10 below 0.5"}]
    rows += [{"t": 101 + i, "name": "rag:generate", "ms": 200.0, "ok": True, "recall": None, "ttft_ms": 50.0 + i,
              "tokens": 16, "error": ""} for i in range(3)]
    s = summarize_requests(rows, seconds=4.0)
    v = s["by_type"]["search:vector"]
    assert v["requests"] == 401 and v["failures"] == 1 and v["per_s"] == 100.25
    assert v["latency_ms"]["p50"] == pytest.approx(50.5) and v["latency_ms"]["max"] == 100
    assert s["recall"]["checked"] == 401 and s["recall"]["mean"] < 1  # the wrong answer pulls recall down
    assert s["errors"] == [{"count": 1, "error": "search:vector: query 0: recall@10 0.10 below 0.5"}]
    g = s["by_type"]["rag:generate"]
    assert g["tokens"] == 48 and g["tokens_per_s"] == 12 and g["ttft_ms"]["p50"] == 51
    png = tmp_path / "latency.png"
    plot_latency(rows, ShapeConfig(kind="step", users=4, seconds=4, step_seconds=1), 100.0, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_step_ramp_too_slow_for_its_run_says_how_far_it_gets():
    """#49: a step ramp that reached 3 of 8 users in 30 s did not say so."""
    slow = ShapeConfig(kind="step", users=8, seconds=30, start_users=1, step_users=1, step_seconds=10)
    assert slow.peak_users() == 3 == max(slow.users_at(t / 10) for t in range(300))
    assert "reaches 3 of 8 users in 30 s" in slow.short_of_peak() and "--seconds 80" in slow.short_of_peak()
    fixed = ShapeConfig(kind="step", users=8, seconds=80, start_users=1, step_users=1, step_seconds=10)
    assert fixed.peak_users() == 8 == max(fixed.users_at(t / 10) for t in range(800)) and fixed.short_of_peak() is None
    for shape in (ShapeConfig(kind="steady", users=5, seconds=10),
                  ShapeConfig(kind="step", users=4, seconds=31, start_users=1, step_users=1, step_seconds=10)):
        assert shape.peak_users() == max(shape.users_at(t / 10) for t in range(int(shape.seconds * 10)))
