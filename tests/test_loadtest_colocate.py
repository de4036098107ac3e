"""The co-location measurement at toy size on CPU: every phase runs for real (service, Locust, the
PyTorch decode loop) and the report holds every figure. The GPU run itself needs the GPU machine."""

import json

from fusionrag.loadtests import colocate


def test_colocation_phases_run_and_report_every_figure(tmp_path):
    status = colocate.main(["--out", str(tmp_path), "--device", "cpu", "--preset", "tiny", "--seconds", "2",
                            "--warmup-seconds", "0", "--users", "2", "--count", "1200", "--dim", "16",
                            "--num-queries", "20", "--batch", "2", "--prompt-len", "8", "--memory-fraction", "0",
                            "--llm-margin", "3"])
    report = json.loads((tmp_path / "colocate.json").read_text())
    assert status == (0 if report["passed"] else 1)  # two shared CPU cores decide nothing about a GPU
    v = report["verdict"]
    assert v["no_oom"] is True and v["llm_budget_held"] is True and v["retrieval_budget_held"] is None
    assert v["retrieval_p99_ratio"] > 0 and v["llm_tokens_ratio"] > 0
    assert v["retrieval_p99_ok"] == (v["retrieval_p99_ratio"] <= colocate.P99_LIMIT)
    assert v["llm_tokens_ok"] == (v["llm_tokens_ratio"] >= colocate.TOKENS_LIMIT)
    for phase in ("retrieval_alone", "retrieval_beside_llm"):
        r = report[phase]
        assert r["requests"] > 0 and r["failures"] == 0 and r["recall"] >= 0.9 and r["locust_exit_status"] == 0
        assert r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0
        assert r["service_metrics"]["queries"] >= r["requests"]
    alone, beside = report["llm_alone"], report["llm_beside_retrieval"]
    assert alone["tokens_per_s"] > 0 and beside["tokens_per_s"] > 0 and not alone["oom"] and not beside["oom"]
    assert v["llm_tokens_ratio"] == beside["tokens_per_s"] / alone["tokens_per_s"]
    # The LLM ran on both sides of the shared Locust window, so its rate is measured inside that window.
    assert beside["seconds"] > report["retrieval_beside_llm"]["window"][1] - report["retrieval_beside_llm"]["window"][0]
    assert report["llm_parameters"] == colocate.llm_mod.PRESETS["tiny"].parameters()
    md = (tmp_path / "colocate.md").read_text()
    assert "| retrieval p99 (ms) |" in md and "| LLM tokens/s |" in md
    assert (tmp_path / "retrieval-beside-llm" / "latency.png").read_bytes()[:4] == b"\x89PNG"
