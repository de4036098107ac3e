"""Time to first token through vLLM's OpenAI server with fusionrag's plugin, with retrieval and without,
on a tiny Llama made from a config (fusionrag.loadtests.hf_llm: random weights, so only the timings mean
anything), streamed with the OpenAI Python client, one request at a time.

Per question, three requests in turn:
- plain: /v1/chat/completions with the question alone;
- prompt: /v1/chat/completions with the prompt the plugin builds (the k passages already in it), so
  the longer prompt's own cost shows apart from retrieval's;
- rag: /v1/rag/chat/completions with "retrieval": the question embedded and searched inside vLLM's
  API server, then that same prompt; also the time to its first chunk, which carries the retrieval.

The collection: a copy of --data-dir's --collection (its questions from --questions, one per line), or
by default the service's demo corpus, asked phrases of its own entries.

    python -m bench.service.rag_ttft --out bench/results/service/rag_ttft.json
    python -m bench.service.rag_ttft --data-dir bench/work/hybrid/data --collection docs --questions q.txt \\
        --out bench/results/service/rag_ttft_docs.json

Writes the JSON (every request's timings, the summary, the machine) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from fusionrag.integrations.vllm.prompt import augment
from fusionrag.loadtests.hf_llm import build_tiny_llm
from fusionrag.loadtests.queryset import query_phrase
from fusionrag.loadtests.runner import start_vllm_plugin, wait_vllm_plugin
from fusionrag.retriever.collection import Hit

KINDS = ("plain", "prompt", "rag")


def demo_collection(root: Path, name: str) -> list[str]:
    """The demo corpus as a collection under root; returns a question per entry."""
    from fusionrag.retriever.collection import Catalog, Document
    from fusionrag.retriever.collection.embedding import get_embedder
    from fusionrag.retriever.engine.config import EngineConfig
    from fusionrag.server.demo import corpus

    docs = corpus()
    vectors = get_embedder("all-MiniLM-L6-v2").embed([d.text for d in docs])
    catalog = Catalog(root, EngineConfig(filter_tier="cpu"))
    try:
        coll = catalog.create(name, vectors.shape[1], "cosine", embedding="all-MiniLM-L6-v2")
        coll.upsert([Document(d.id, d.text, v, d.metadata) for d, v in zip(docs, vectors)])
        coll.merge(progress=False)
    finally:
        catalog.close()
    return [query_phrase(d.text) for d in docs]


def timed_stream(create, **kw) -> dict:
    """Seconds to the first chunk carrying the retrieval (if any) and to the first content token."""
    start = time.perf_counter()
    retrieval_s = ttft_s = None
    with create(stream=True, **kw) as stream:
        for chunk in stream:
            now = time.perf_counter() - start
            if retrieval_s is None and getattr(chunk, "retrieval", None) is not None:
                retrieval_s = now
            if ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                ttft_s = now
    if ttft_s is None:
        raise RuntimeError("the stream carried no token")
    return {"ttft_ms": 1000 * ttft_s, "retrieval_ms": None if retrieval_s is None else 1000 * retrieval_s}


def summary(values: list[float]) -> dict:
    v = np.asarray(values)
    return {"p50": round(float(np.median(v)), 2), "p90": round(float(np.percentile(v, 90)), 2),
            "mean": round(float(v.mean()), 2), "n": len(v)}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import torch
    import vllm

    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file (a .md is written beside it)")
    p.add_argument("--data-dir", type=Path, help="a data directory holding --collection (copied, not touched)")
    p.add_argument("--collection", default="demo")
    p.add_argument("--questions", type=Path, help="with --data-dir: questions, one per line")
    p.add_argument("--requests", type=int, default=40, help="questions timed (each asked in all three ways)")
    p.add_argument("--k", type=int, default=4, help="passages retrieved into the prompt")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args(argv)
    import openai

    work = Path(tempfile.mkdtemp(prefix="rag-ttft-"))
    child = None
    try:
        data = work / "data"
        if args.data_dir:
            (data / "collections").mkdir(parents=True)
            shutil.copytree(args.data_dir / "collections" / args.collection, data / "collections" / args.collection)
            questions = [q for q in args.questions.read_text().splitlines() if q.strip()]
        else:
            questions = demo_collection(data, args.collection)
        rng = np.random.default_rng(0)
        asked = [questions[i] for i in rng.choice(len(questions), args.requests + 3,
                                                  replace=args.requests + 3 > len(questions))]
        model = build_tiny_llm(work / "llm", asked, vocab_size=2000)
        child, url = start_vllm_plugin(model, data, work / "vllm.log", args.max_model_len)
        wait_vllm_plugin(child, url, 600)
        http = httpx.Client(base_url=url, timeout=120)
        plain = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).chat.completions.create
        rag = openai.OpenAI(base_url=f"{url}/v1/rag", api_key="none", max_retries=0).chat.completions.create
        common = {"model": str(model), "max_tokens": args.max_tokens, "temperature": 0}
        rows = []
        for n, question in enumerate(asked):
            messages = [{"role": "user", "content": question}]
            found = http.post(f"/v1/collections/{args.collection}/search",
                              json={"texts": [question], "k": args.k}).json()["results"][0]
            hits = [Hit(h["id"], h["distance"], h["score"], h["text"], h["metadata"]) for h in found]
            timed = {
                "plain": lambda: timed_stream(plain, messages=messages, **common),
                "prompt": lambda: timed_stream(plain, messages=augment(messages, hits), **common),
                "rag": lambda: timed_stream(rag, messages=messages, **common,
                                            extra_body={"retrieval": {"collection": args.collection, "k": args.k}}),
            }
            order = KINDS[n % 3:] + KINDS[:n % 3]  # each kind first as often as the others
            row = {"question": question, **{kind: timed[kind]() for kind in order}}
            if n >= 3:  # the first three warm vLLM, the model and the embedder up
                rows.append(row)
        out = {
            "collection": args.collection, "documents": http.get("/v1/stats").json()["collections"][args.collection]
            ["count"], "k": args.k, "max_tokens": args.max_tokens,
            "ttft_ms": {kind: summary([r[kind]["ttft_ms"] for r in rows]) for kind in KINDS},
            "rag_retrieval_chunk_ms": summary([r["rag"]["retrieval_ms"] for r in rows]),
            "rag_minus_plain_ms": summary([r["rag"]["ttft_ms"] - r["plain"]["ttft_ms"] for r in rows]),
            "rag_minus_prompt_ms": summary([r["rag"]["ttft_ms"] - r["prompt"]["ttft_ms"] for r in rows]),
            "load_average_at_end": os.getloadavg(), "machine": machine(), "requests": rows,
        }
    finally:
        if child is not None:
            child.stop(60)
            if sys.exc_info()[0] is not None:
                print("end of vLLM's log:\n" + child.tail(30), file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(out, indent=1))
    t = out["ttft_ms"]
    md = [f"# Time to first token with and without retrieval ({out['collection']}, {out['documents']} documents, "
          f"k={out['k']})", "",
          f"{out['machine']['cpu']}, {out['machine']['cpus']} CPUs, vLLM {out['machine']['vllm']}, "
          f"GPU: {out['machine']['gpu']}; {len(rows)} questions, each asked three ways in turn; load average at "
          f"the end {', '.join(f'{x:.1f}' for x in out['load_average_at_end'])}.", "",
          "| request | TTFT p50 ms | p90 ms | mean ms |", "|---|---|---|---|"]
    names = {"plain": "question alone (/v1/chat/completions)",
             "prompt": "question + passages in the prompt (/v1/chat/completions)",
             "rag": "retrieval in vLLM + the same prompt (/v1/rag/chat/completions)"}
    md += [f"| {names[k]} | {t[k]['p50']} | {t[k]['p90']} | {t[k]['mean']} |" for k in KINDS]
    r = out["rag_retrieval_chunk_ms"]
    md += ["", f"The rag request's first chunk (the retrieval) arrived at p50 {r['p50']} ms (p90 {r['p90']}); "
               f"rag minus plain, per question: p50 {out['rag_minus_plain_ms']['p50']} ms; rag minus prompt "
               f"(retrieval's own cost): p50 {out['rag_minus_prompt_ms']['p50']} ms."]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
