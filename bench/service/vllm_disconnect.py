"""Does a client that leaves a streamed RAG answer stop vLLM's generation, with vLLM's CPU worker pinned or not?

vLLM's CPU build pins its worker to a core by default (VLLM_CPU_OMP_THREADS_BIND=auto), where it spins between
steps. On a machine of two cores that left other processes waiting seconds to run: a client asking for a long
answer and leaving after three chunks sometimes read its first chunk only after the whole generation, and its
disconnect saved nothing. This starts vLLM with fusionrag's plugin once per binding (the tiny Llama of
fusionrag.loadtests.hf_llm, a context of 8192), sends --requests streamed RAG requests of 7,992 tokens one after
another, each client leaving after its third chunk, and counts per request the tokens vLLM generated (its own
vllm:generation_tokens_total) and when the client had its third chunk.

    python -m bench.service.vllm_disconnect --out bench/results/service/vllm_disconnect.json     # auto, then nobind
    python -m bench.service.vllm_disconnect --bindings auto nobind nobind:1 --out ...  # nobind:1 adds OMP_NUM_THREADS=1

Writes the JSON (every request) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fusionrag.loadtests.hf_llm import build_tiny_llm
from fusionrag.loadtests.report import parse_prometheus
from fusionrag.loadtests.runner import start_vllm_plugin, wait_vllm_plugin

QUESTION = "What do worker bees gather from flowers?"
DOCS = [{"id": "bees", "text": "Worker bees gather nectar and pollen from many flowers."},
        {"id": "tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris."}]
KEY = "bench-disconnect-key"
CONTEXT = 8192
MAX_TOKENS = CONTEXT - 200


def _metric(url: str, name: str) -> float:
    return sum(v for (n, _), v in parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text).items() if n == name)


def run_binding(spec: str, model: Path, work: Path, requests: int) -> list[dict]:
    """spec: VLLM_CPU_OMP_THREADS_BIND's value, with ":N" for OMP_NUM_THREADS=N in vLLM's processes."""
    bind, _, threads = spec.partition(":")
    tag = spec.replace(":", "-")
    data = work / f"data-{tag}"
    data.mkdir()
    env = {"FUSIONRAG_API_KEYS": KEY, "VLLM_CPU_OMP_THREADS_BIND": bind}
    if threads:
        env["OMP_NUM_THREADS"] = threads
    child, url = start_vllm_plugin(model, data, work / f"vllm-{tag}.log", max_model_len=CONTEXT, env=env)
    out = []
    try:
        wait_vllm_plugin(child, url, 420, key=KEY)
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            c.post("/v1/collections", json={"name": "kb", "embedding": "all-MiniLM-L6-v2"}).raise_for_status()
            c.post("/v1/collections/kb/documents", json={"documents": DOCS}).raise_for_status()
            body = {"model": str(model), "messages": [{"role": "user", "content": QUESTION}], "stream": True,
                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
                    "retrieval": {"collection": "kb", "k": 2}}
            for _ in range(requests):
                before = _metric(url, "vllm:generation_tokens_total")
                asked = time.monotonic()
                chunks = 0
                with c.stream("POST", "/v1/rag/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():  # leaving the block closes the connection
                        chunks += line.startswith("data:") and '"choices":[{' in line
                        if chunks == 3:
                            break
                left = time.monotonic() - asked
                deadline = time.monotonic() + 120
                while _metric(url, "vllm:num_requests_running") and time.monotonic() < deadline:
                    time.sleep(0.05)
                out.append({"tokens": int(_metric(url, "vllm:generation_tokens_total") - before),
                            "client_left_s": round(left, 3), "idle_after_s": round(time.monotonic() - asked, 3)})
    finally:
        child.stop(60)
    return out


def summary(rows: list[dict]) -> dict:
    tokens = [r["tokens"] for r in rows]
    return {"requests": len(rows), "ran_to_the_end": sum(t >= MAX_TOKENS for t in tokens),
            "over_1000_tokens": sum(t > 1000 for t in tokens), "max_tokens_generated": max(tokens),
            "median_tokens": statistics.median(tokens), "max_client_left_s": max(r["client_left_s"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file (a .md is written beside it)")
    p.add_argument("--requests", type=int, default=60, help="requests per binding")
    p.add_argument("--bindings", nargs="+", default=["auto", "nobind"],
                   help="VLLM_CPU_OMP_THREADS_BIND values, each with :N for OMP_NUM_THREADS=N")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-disconnect-") as tmp:
        work = Path(tmp)
        model = build_tiny_llm(work / "llm", [QUESTION, *(d["text"] for d in DOCS)], max_positions=CONTEXT)
        runs = {b: run_binding(b, model, work, args.requests) for b in args.bindings}
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "max_tokens": MAX_TOKENS, "summary": {b: summary(r) for b, r in runs.items()}, "requests": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# A client leaving a streamed RAG answer after 3 chunks, {MAX_TOKENS} tokens asked", "",
             f"{os.cpu_count()} CPUs, {platform.platform()}; one vLLM server per binding, requests one after another.",
             "", "| VLLM_CPU_OMP_THREADS_BIND | requests | ran to the end | over 1,000 tokens | most tokens | "
             "median tokens | latest client exit (s) |", "|---|---|---|---|---|---|---|"]
    for b, s in result["summary"].items():
        lines.append(f"| {b} | {s['requests']} | {s['ran_to_the_end']} | {s['over_1000_tokens']} | "
                     f"{s['max_tokens_generated']} | {s['median_tokens']:g} | {s['max_client_left_s']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
