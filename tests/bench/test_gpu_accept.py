"""`make gpu-accept` without CUDA: the dry run of the GPU acceptance, every step at toy size through
Triton's interpreter, so that the command the GPU machine runs cannot rot. It checks that each step
ran and the summary holds its figures, not what toy figures on two shared cores say about a GPU.
CUDA is hidden from it, so that it is the dry run on a GPU machine too."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_accept_dry_run_runs_every_step_and_summarizes(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(["make", "-s", "gpu-accept", f"OUT={out}", f"ACCEPT_PY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode in (0, 2), p.stdout[-2000:] + p.stderr[-2000:]  # make: 2 when the run failed
    assert sorted(f.name for f in out.iterdir()) == ["gpu_accept-files.tar.gz", "gpu_accept.json", "gpu_accept.md"]
    s = json.loads((out / "gpu_accept.json").read_text())
    assert s["cuda"] is False and "dry run" in s["device"] and s["torch"] == torch.__version__
    steps = s["steps"]
    assert list(steps) == ["install", "a", "b", "c", "d", "e"] and steps["install"]["outcome"] == "skipped"
    assert s["passed"] == all(r["outcome"] in ("passed", "skipped") for r in steps.values())
    assert p.returncode == (0 if s["passed"] else 2)
    a = steps["a"]
    assert a["outcome"] == "passed" and a["tests"] >= 2 and a["failures"] == a["errors"] == 0
    b = steps["b"]
    assert b["outcome"] == "passed" and b["tier"] == "gpu" and all(b["checks"].values())
    c = steps["c"]
    assert c["outcome"] == "passed" and c["measured_bandwidth_GBps"] > 0 and c["kernel_compile_seconds"] == {}
    assert c["gpu_tier_qps_at_recall_0.90"]["recall@10"] >= 0.9 and c["cpu_tier_qps_at_recall_0.90"]["qps"] > 0
    assert c["exact_on_device"]["recall@10"] == 1.0
    assert c["gpu_search"] == "device" and c["raw_vectors_resident"] is True and c["gpu_tier_second_open_s"] >= 0
    assert c["lists_tier_qps_at_recall_0.90"]["qps"] > 0 and c["gpu_tier_raw_on_ssd_qps_at_recall_0.90"]["qps"] > 0
    # the device tier sends the queries and receives the answers: a few hundred bytes a query here (24-d, k=10)
    assert c["gpu_tier_qps_at_recall_0.90"]["bytes_per_query"]["up"] <= 4 * 24 + 8
    assert 0.05 < c["gpu_memory_tenth_codes_resident"]["resident_code_fraction"] <= 0.1
    # filter_tier auto without CUDA is the CPU tier alone: every call there, no crossover
    assert set(c["by_call_size"]) == {"1", "8"} and c["crossover"] is None
    assert all(r["auto_served"] == {"cpu": 2} and r["auto_ms"] > 0 < r["gpu_ms"] for r in c["by_call_size"].values())
    d = steps["d"]  # its verdict on two shared cores says nothing about a GPU: that it ran, and judged
    assert d["exit_status"] in (0, 1) and d["verdict_passed"] == (d["exit_status"] == 0)
    assert d["verdict"]["no_oom"] is True and d["verdict"]["retrieval_budget_held"] is None
    e = steps["e"]  # both services at each level; without CUDA both on the CPU tier, so no verdict to read
    assert e["outcome"] == "passed" and set(e["levels"]) == {"auto", "cpu"}
    assert all(set(t) == {"1", "4"} and all(x["per_s"] > 0 and set(x["served_by"]) == {"cpu"} for x in t.values())
               for t in e["levels"].values())
    assert s["targets"]["service_auto_over_cpu"]["measured"] == e["auto_over_cpu_worst"]
    md = (out / "gpu_accept.md").read_text()
    assert s["device"] in md and all(f"| {name} |" in md for name in steps)
    with tarfile.open(out / "gpu_accept-files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"gpu_accept-files/{x}" for x in ("a.log", "a.xml", "b.json", "c.json", "d.log",
                                               "colocate/colocate.json", "e.log", "levels/levels.json")} <= names
    # Runs made step by step (the GPU machine runs a command for at most 10 minutes) merge into one.
    for part, keep in (("first", ("install", "a", "b")), ("second", ("c", "d", "e"))):
        (tmp_path / part).mkdir()
        (tmp_path / part / "gpu_accept.json").write_text(json.dumps({**s, "steps": {
            k: v for k, v in steps.items() if k in keep}}))
    merged = subprocess.run([sys.executable, "-m", "bench.gpu.gpu_accept", "--merge", str(tmp_path / "first"),
                             str(tmp_path / "second"), "--out", str(tmp_path / "merged")], cwd=ROOT)
    m = json.loads((tmp_path / "merged" / "gpu_accept.json").read_text())
    assert m["steps"] == steps and m["passed"] == s["passed"] and merged.returncode == (0 if s["passed"] else 1)
    # The targets are judged from the figures, apart from the steps' outcomes: a run whose steps all pass
    # misses a target by its figure, meets it by its figure, and leaves unmeasured what did not run.
    for scan, ratio, met in (([0.12, 0.61], 5.2, True), ([0.09, 0.107], 0.83, False)):
        fake = {**s, "steps": {**steps, "c": {**c, "outcome": "passed", "scan_fraction_of_bandwidth": scan,
                                              "stream_fraction_of_bandwidth": [], "gpu_over_cpu_at_0.90": ratio,
                                              "gpu_over_cpu_at_0.95": ratio}}}
        (tmp_path / "fake").mkdir(exist_ok=True)
        (tmp_path / "fake" / "gpu_accept.json").write_text(json.dumps(fake))
        subprocess.run([sys.executable, "-m", "bench.gpu.gpu_accept", "--merge", str(tmp_path / "fake"), "--out",
                        str(tmp_path / "judged")], cwd=ROOT, capture_output=True)
        t = json.loads((tmp_path / "judged" / "gpu_accept.json").read_text())["targets"]
        assert (t["scan_bandwidth"]["measured"], t["scan_bandwidth"]["met"]) == (max(scan), met)
        assert (t["gpu_over_cpu"]["measured"], t["gpu_over_cpu"]["met"]) == (ratio, met)
        md = (tmp_path / "judged" / "gpu_accept.md").read_text()
        assert ("| >= 5 | met |" in md) == met and ("| >= 5 | NOT met |" in md) != met
    only_a = tmp_path / "only_a"
    only_a.mkdir()
    (only_a / "gpu_accept.json").write_text(json.dumps({**s, "steps": {"a": a}}))
    subprocess.run([sys.executable, "-m", "bench.gpu.gpu_accept", "--merge", str(only_a), "--out", str(tmp_path / "half")],
                   cwd=ROOT, capture_output=True)
    half = json.loads((tmp_path / "half" / "gpu_accept.json").read_text())
    assert half["targets_met"] is None and all(x["met"] is None for x in half["targets"].values())
