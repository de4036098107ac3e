"""The load-test report: throughput, latency percentiles per request type, errors, recall of the checked
answers, the service's own metrics, and a plot of latency over time."""

from __future__ import annotations

import csv
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from fusionrag.loadtests.plan import ShapeConfig

# -- the service's Prometheus metrics ---------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple, float]:
    """{(name, ((label, value), ...)): value} of every sample in the text exposition format."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"not a Prometheus sample line: {line[:120]!r}")
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def _total(samples: dict, name: str, **labels) -> float | None:
    found = [v for (n, ls), v in samples.items() if n == name and all((k, w) in ls for k, w in labels.items())]
    return sum(found) if found else None


def _delta(before: dict, after: dict, name: str, **labels) -> float | None:
    a = _total(after, name, **labels)
    return None if a is None else a - (_total(before, name, **labels) or 0.0)


def _ratio(num, den):
    return None if num is None or not den else num / den


def summarize_metrics(before: dict, after: dict) -> dict:
    """What the service says about the run: counters as differences over the run, gauges at its end."""
    batches = _delta(before, after, "fusionrag_batch_queries_count")
    queries = _delta(before, after, "fusionrag_queries_total")
    read = _delta(before, after, "fusionrag_ssd_pages_read_total")
    buffered = _delta(before, after, "fusionrag_page_buffer_hits_total")
    stages = {}
    for (n, ls), _ in after.items():
        if n == "fusionrag_stage_seconds_count":
            stage = dict(ls)["stage"]
            count = _delta(before, after, n, stage=stage)
            stages[stage] = _ratio(_delta(before, after, "fusionrag_stage_seconds_sum", stage=stage), count)
    statuses = defaultdict(float)
    for (n, ls), v in after.items():
        if n == "fusionrag_http_requests_total":
            statuses[dict(ls).get("status", "?")] += v - before.get((n, ls), 0.0)
    gpu_used = _total(after, "fusionrag_gpu_memory_bytes", kind="used")
    gpu_budget = _total(after, "fusionrag_gpu_memory_bytes", kind="budget")
    # What the driver counts for the service process, measured: the budget's own bookkeeping ("used")
    # cannot say whether the budget held.
    gpu_process = _total(after, "fusionrag_gpu_memory_bytes", kind="process")
    return {
        "engine_batches": batches,
        "queries_per_batch": _ratio(_delta(before, after, "fusionrag_batch_queries_sum"), batches),
        "requests_per_batch": _ratio(_delta(before, after, "fusionrag_batch_requests_sum"),
                                     _delta(before, after, "fusionrag_batch_requests_count")),
        "queries": queries,
        "ssd_pages_read_per_query": _ratio(read, queries),
        "page_buffer_hits_per_query": _ratio(buffered, queries),
        # None where nothing was read: the raw vectors in RAM (raw_in_ram, where the budget holds them)
        "page_buffer_hit_ratio": _ratio(buffered, (read or 0) + (buffered or 0)),
        "reranked_per_query": _ratio(_delta(before, after, "fusionrag_reranked_candidates_total"), queries),
        "stage_mean_ms": {s: (None if v is None else 1000 * v) for s, v in sorted(stages.items())},
        # Statuses answered before the run (a /readyz 503 while loading, say) are not the run's.
        "http_responses_by_status": {s: n for s, n in sorted(statuses.items()) if n > 0},
        "gpu_memory_used_bytes": gpu_used,
        "gpu_memory_budget_bytes": gpu_budget,
        "gpu_memory_process_bytes": gpu_process,
        "gpu_within_budget": None if not gpu_budget or gpu_process is None else bool(gpu_process <= gpu_budget),
        "collection_documents": {dict(ls)["collection"]: v for (n, ls), v in after.items()
                                 if n == "fusionrag_collection_documents"},
        # Which filter tier served the run's queries (filter_tier auto sends each call to the one measured cheaper)
        "queries_by_filter_tier": {t: v for t in ("cpu", "gpu")
                                   if (v := _delta(before, after, "fusionrag_filter_tier_queries_total", tier=t))},
    }


def summarize_llm_metrics(before: dict, after: dict) -> dict | None:
    """vLLM's own figures over the run, when the LLM server is vLLM (None otherwise): requests by how they
    finished, tokens, and its mean time to first token, between tokens and in its queue, as it measured them."""
    if not any(n.startswith("vllm:") for n, _ in after):
        return None
    finished = defaultdict(float)
    for (n, ls), v in after.items():
        if n == "vllm:request_success_total":
            finished[dict(ls).get("finished_reason", "?")] += v - before.get((n, ls), 0.0)

    def mean_ms(name: str) -> float | None:
        mean = _ratio(_delta(before, after, f"{name}_sum"), _delta(before, after, f"{name}_count"))
        return None if mean is None else round(1000 * mean, 3)

    return {
        "requests_by_finish": {r: n for r, n in sorted(finished.items()) if n > 0},
        "prompt_tokens": _delta(before, after, "vllm:prompt_tokens_total"),
        "generation_tokens": _delta(before, after, "vllm:generation_tokens_total"),
        "ttft_mean_ms": mean_ms("vllm:time_to_first_token_seconds"),
        "inter_token_mean_ms": mean_ms("vllm:inter_token_latency_seconds"),
        "queue_mean_ms": mean_ms("vllm:request_queue_time_seconds"),
    }


# -- the client's view -------------------------------------------------------------------------------

def read_request_log(path: str | Path) -> list[dict]:
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({"t": float(r["t"]), "name": r["name"], "ms": float(r["ms"]), "ok": r["ok"] == "1",
                         "recall": float(r["recall"]) if r["recall"] else None,
                         "ttft_ms": float(r["ttft_ms"]) if r["ttft_ms"] else None,
                         "tokens": int(r["tokens"]) if r["tokens"] else None,
                         "retrieval_ms": float(r["retrieval_ms"]) if r.get("retrieval_ms") else None,
                         "error": r["error"]})
    return rows


def _percentiles(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return {}
    p50, p95, p99 = (float(x) for x in np.percentile(v, [50, 95, 99]))
    return {"p50": round(p50, 3), "p95": round(p95, 3), "p99": round(p99, 3), "mean": round(float(v.mean()), 3),
            "max": round(float(v.max()), 3)}


def summarize_requests(rows: list[dict], seconds: float) -> dict:
    """Per request type and in all: count, failures, throughput, latency percentiles (ms), recall."""
    def block(rs):
        ok = [r for r in rs if r["ok"]]
        out = {"requests": len(rs), "failures": len(rs) - len(ok), "per_s": round(len(rs) / seconds, 3),
               "latency_ms": _percentiles([r["ms"] for r in ok])}
        recalls = [r["recall"] for r in rs if r["recall"] is not None]
        if recalls:
            out["recall"] = {"checked": len(recalls), "mean": round(float(np.mean(recalls)), 5),
                             "min": round(float(np.min(recalls)), 5)}
        ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
        if ttft:
            tokens = sum(r["tokens"] or 0 for r in ok)
            out["ttft_ms"] = _percentiles(ttft)
            out["tokens"] = tokens
            out["tokens_per_s"] = round(tokens / seconds, 3)
        # The vLLM plugin's route: the retrieval chunk's arrival, alone and as a share of the first token's
        # and of the whole request's time.
        both = [r for r in ok if r.get("retrieval_ms") is not None and r["ttft_ms"]]
        if both:
            out["retrieval_ms"] = _percentiles([r["retrieval_ms"] for r in both])
            out["retrieval_share_of_ttft"] = _percentiles([r["retrieval_ms"] / r["ttft_ms"] for r in both])
            out["retrieval_share_of_latency"] = _percentiles([r["retrieval_ms"] / r["ms"] for r in both])
        return out

    by_name = defaultdict(list)
    for r in rows:
        by_name[r["name"]].append(r)
    errors = Counter(f"{r['name']}: {r['error']}" for r in rows if not r["ok"])
    # Recall over every checked answer, failed ones included: a wrong answer must pull it down.
    recalls = [r["recall"] for r in rows if r["recall"] is not None]
    return {
        "all": block(rows),
        "by_type": {name: block(rs) for name, rs in sorted(by_name.items())},
        "errors": [{"count": n, "error": e} for e, n in errors.most_common(20)],
        "recall": {"checked": len(recalls), "mean": round(float(np.mean(recalls)), 5) if recalls else None},
    }


def plot_latency(rows: list[dict], shape: ShapeConfig | None, t0: float, path: str | Path, title: str) -> None:
    """Each request as a dot (failures as crosses), the p95 of each second as a line, users behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    names = sorted({r["name"] for r in rows})
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    for name in names:
        rs = [r for r in rows if r["name"] == name]
        ok = [r for r in rs if r["ok"]]
        bad = [r for r in rs if not r["ok"]]
        ax.scatter([r["t"] - t0 for r in ok], [r["ms"] for r in ok], s=4, alpha=0.35, color=colors[name])
        if bad:
            ax.scatter([r["t"] - t0 for r in bad], [max(r["ms"], 0.01) for r in bad], s=30, marker="x",
                       color=colors[name], label=f"{name} failed ({len(bad)})")
        secs = defaultdict(list)
        for r in ok:
            secs[int(r["t"] - t0)].append(r["ms"])
        xs = sorted(secs)
        ax.plot([x + 0.5 for x in xs], [np.percentile(secs[x], 95) for x in xs], color=colors[name],
                label=f"{name} p95 per second")
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if shape is not None:
        users = ax.twinx()
        ts = np.linspace(0, shape.seconds, 400, endpoint=False)
        users.step(ts, [shape.users_at(t) for t in ts], where="post", color="grey", alpha=0.5, label="users")
        users.set_ylabel("users")
        users.set_ylim(0, shape.users * 1.15)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(report: dict) -> str:
    """The report as a short Markdown page."""
    lines = [f"# Load test: {'PASSED' if report['passed'] else 'FAILED'}", ""]
    lines += [f"- {k}: {v}" for k, v in report["verdict"].items()]
    lines += [f"- **warning**: {w}" for w in report.get("warnings", [])]
    lines += ["", "| request | count | failures | per s | p50 ms | p95 ms | p99 ms | recall |",
              "|---|---|---|---|---|---|---|---|"]
    req = report["requests"]
    for name, b in [*req["by_type"].items(), ("all", req["all"])]:
        lat = b["latency_ms"]
        rec = b.get("recall", {}).get("mean", "")
        lines.append(f"| {name} | {b['requests']} | {b['failures']} | {b['per_s']} | {lat.get('p50', '')} | "
                     f"{lat.get('p95', '')} | {lat.get('p99', '')} | {rec} |")
    for name in ("rag:generate", "rag:chat"):
        gen = req["by_type"].get(name)
        if gen and "ttft_ms" in gen:
            lines += ["", f"LLM ({name}): time to first token p50 {gen['ttft_ms']['p50']} ms, p95 "
                          f"{gen['ttft_ms']['p95']} ms; {gen['tokens_per_s']} streamed tokens/s"]
        if gen and "retrieval_ms" in gen:
            lines += [f"Retrieval ({name}): p50 {gen['retrieval_ms']['p50']} ms, p95 {gen['retrieval_ms']['p95']} ms; "
                      f"share of the time to first token p50 {gen['retrieval_share_of_ttft']['p50']:.3f}, of the "
                      f"request p50 {gen['retrieval_share_of_latency']['p50']:.3f}"]
    if req["errors"]:
        lines += ["", "Errors:", ""] + [f"- {e['count']} x {e['error']}" for e in req["errors"]]
    if report["service_metrics"] is not None:
        lines += ["", "Service metrics over the run:", "", "```", json.dumps(report["service_metrics"], indent=1),
                  "```"]
    if report.get("llm_metrics"):
        lines += ["", "vLLM's metrics over the run:", "", "```", json.dumps(report["llm_metrics"], indent=1), "```"]
    return "\n".join(lines) + "\n"
