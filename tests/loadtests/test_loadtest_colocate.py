"""The co-location measurement: its verdict's rules on figures that break each one, and the whole
run at toy size on CPU, where every phase runs for real (service, Locust, the PyTorch decode loop),
the report holds every figure, and the verdict and exit status follow from the figures recomputed
here from the run's own request logs and token timelines. The GPU run itself needs the GPU machine
(`make gpu-accept`)."""

import json

import numpy as np
import pytest

from fusionrag.loadtests import colocate
from fusionrag.loadtests.report import read_request_log


def phase(p99: float, failures: int = 0) -> dict:
    return {"latency_ms": {"p99": p99}, "failures": failures}


GOOD = dict(alone=phase(10.0), beside=phase(14.0), tok_alone=100.0, tok_beside=95.0, oom=False,
            service_alive=True, llm_budget_held=True, retrieval_budget_held=True, gpu=True, llm_budget_set=True)


@pytest.mark.parametrize("change, failed_rule", [
    ({}, None),
    ({"beside": phase(15.1)}, "retrieval_p99_ok"),
    ({"tok_beside": 89.0}, "llm_tokens_ok"),
    ({"oom": True}, "no_oom"),
    ({"beside": phase(12.0, failures=1)}, "no_oom"),
    ({"service_alive": False}, "no_oom"),
    ({"retrieval_budget_held": False}, "retrieval_budget_held"),
    ({"llm_budget_held": False}, "llm_budget_held"),
    ({"retrieval_budget_held": None}, "retrieval_budget_held"),  # unmeasured on a GPU
    ({"llm_budget_held": None}, "llm_budget_held"),
])
def test_verdict_fails_on_each_rule(change, failed_rule):
    verdict, passed = colocate.judge(**{**GOOD, **change})
    assert passed == (failed_rule is None)
    if failed_rule:
        assert verdict[failed_rule] in (False, None)


def test_verdict_on_a_cpu_or_beside_a_server_needs_no_memory_figures():
    assert colocate.judge(**{**GOOD, "gpu": False, "retrieval_budget_held": None, "llm_budget_held": None})[1]
    assert colocate.judge(**{**GOOD, "llm_budget_set": False, "llm_budget_held": None})[1]


def rate(timeline, start, end) -> float:
    inside = [(t, n) for t, n in timeline if start <= t <= end]
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def test_colocation_phases_run_and_report_every_figure(tmp_path):
    status = colocate.main(["--out", str(tmp_path), "--device", "cpu", "--preset", "tiny", "--seconds", "2",
                            "--warmup-seconds", "0", "--users", "2", "--count", "1200", "--dim", "16",
                            "--num-queries", "20", "--batch", "2", "--prompt-len", "8", "--memory-fraction", "0",
                            "--llm-margin", "3"])
    report = json.loads((tmp_path / "colocate.json").read_text())
    v = report["verdict"]
    # No GPU: nothing to measure against a budget, and nothing claimed.
    assert v["llm_budget_held"] is None and v["retrieval_budget_held"] is None
    assert report["gpu_peak_bytes_by_process"] is None
    # The ratios, from the request logs and the decode loop's token timelines.
    p99 = {}
    for tag in ("retrieval-alone", "retrieval-beside-llm"):
        rows = read_request_log(tmp_path / tag / "requests.csv")
        assert rows and all(r["ok"] for r in rows)
        p99[tag] = np.percentile([r["ms"] for r in rows], 99)
    assert v["retrieval_p99_ratio"] == pytest.approx(p99["retrieval-beside-llm"] / p99["retrieval-alone"], rel=1e-3)
    alone = json.loads((tmp_path / "llm-alone.json").read_text())["timeline"]
    beside = json.loads((tmp_path / "llm-beside.json").read_text())["timeline"]
    t0, t1 = alone[0][0], alone[-1][0]
    window = report["retrieval_beside_llm"]["window"]
    tokens_ratio = rate(beside, *window) / rate(alone, t0 + 0.1 * (t1 - t0), t1)
    assert v["llm_tokens_ratio"] == pytest.approx(tokens_ratio, rel=1e-9)
    # The LLM ran on both sides of the shared Locust window, so its rate is measured inside that window.
    assert beside[0][0] < window[0] and beside[-1][0] > window[1]
    assert v["no_oom"] is True
    passed = p99["retrieval-beside-llm"] / p99["retrieval-alone"] <= 1.5 and tokens_ratio >= 0.9
    assert report["passed"] == passed and status == (0 if passed else 1)
    for tag in ("retrieval_alone", "retrieval_beside_llm"):
        r = report[tag]
        assert r["requests"] > 0 and r["failures"] == 0 and r["recall"] >= 0.9 and r["locust_exit_status"] == 0
        assert r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0
        assert r["service_metrics"]["queries"] >= r["requests"]
    assert report["llm_parameters"] == colocate.PRESETS["tiny"].parameters()
    md = (tmp_path / "colocate.md").read_text()
    assert "| retrieval p99 (ms) |" in md and "| LLM tokens/s |" in md
    assert (tmp_path / "retrieval-beside-llm" / "latency.png").read_bytes()[:4] == b"\x89PNG"
