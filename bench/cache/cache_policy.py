"""The page buffer's policy on real query streams: CLOCK against cache by use (LFU with aging and
TinyLFU admission, EngineConfig.buffer_policy='lfu') against pinning the pages of the hottest
posting lists (EngineConfig.pin_fraction), at page buffers of 1/64, 1/16 and 1/4 of the raw vectors.

Streams (bench/harness/streams.py), drawn from one half of a set's queries (the other half chooses the default):
uniform, skewed (Zipf over clusters of the queries, with repeats), drifting (the hot clusters change half-way).

For each (set, stream, buffer, policy): page-buffer hit ratio (pages served by the buffer / pages
the re-rank touched, counted by the engine) and SSD pages read per query, after a warm-up of the
stream's first quarter (not counted). Pinning is re-chosen every REFRESH queries by the same call
the index manager thread makes (Index.refresh_hotness), so runs do not depend on timing.

    python -m bench.cache.cache_policy                      # glove minilm; results in bench/results/
    python -m bench.cache.cache_policy --datasets glove --build-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness import sets
from bench.harness.paths import WORK, results
from bench.harness.streams import FRACTIONS, POLICIES, REFRESH, STREAMS, build, half_streams, run_stream, save  # noqa: F401

def measure(idx_path: Path, q: np.ndarray, stream_rows: dict, fractions, policies, threads: int, batch: int,
            gt: np.ndarray | None = None) -> list:
    from fusionrag.retriever import EngineConfig, Index

    raw = (idx_path / "vectors.pages").stat().st_size
    rows = []
    for frac in fractions:
        for pname in policies:
            for sname, order in stream_rows.items():
                cfg = EngineConfig(buffer_bytes=raw // frac, threads=threads, filter_tier="cpu",
                                   manager_interval_s=0.0, **POLICIES[pname])
                index = Index.open(idx_path, cfg)
                t = time.perf_counter()
                res = run_stream(index, q, order, batch, cfg.pin_fraction > 0, gt)
                store = index.reranker.store
                res.update(layout=store.layout, layout_switches=int(store.stats()["layout_switches"]))
                index.close()
                res.update(buffer=f"1/{frac}", policy=pname, stream=sname, seconds=round(time.perf_counter() - t, 2))
                rows.append(res)
                print(json.dumps(res), flush=True)
    return rows


def choose(rows: list) -> dict:
    """Per buffer size, the policy with the best mean SSD pages per query over the streams, and the best of
    those that read no more than CLOCK on the uniform stream (#17: no loss on it)."""
    out = {}
    for frac in {r["buffer"] for r in rows}:
        sub = [r for r in rows if r["buffer"] == frac]
        by = {}
        for r in sub:
            by.setdefault(r["policy"], {})[r["stream"]] = r["ssd_pages_per_query"]
        mean = {p: float(np.mean(list(v.values()))) for p, v in by.items()}
        out[frac] = {"mean_ssd_pages": mean, "best": min(mean, key=mean.get)}
        if "clock" in by and all("uniform" in v for v in by.values()):
            fair = {p: m for p, m in mean.items() if by[p]["uniform"] <= by["clock"]["uniform"]}
            out[frac]["best_no_uniform_loss"] = min(fair, key=fair.get)
    return out


def markdown(result: dict) -> str:
    lines = [f"# Page-buffer policy ({result['date']})", "",
             f"Machine: {result['machine']}. Load average at start {result['load_start']}, at end "
             f"{result['load_end']} (shared VM: other jobs ran beside this one). Filter tier: CPU; "
             f"{result['threads']} thread(s), batches of {result['batch']} queries; a stream of "
             f"{result['stream_length']} queries per run, the first quarter as warm-up. Hit ratio: pages the "
             "page buffer served / pages the re-rank touched; SSD: pages read from the SSD per query.", "",
             "The default was chosen on the tuning half of each set's queries and is reported on the other half.", ""]
    if "runs" in result:
        lines += ["Runs: " + "; ".join(f"{', '.join(r['sets'])} started {r['started']}" for r in result["runs"]), ""]
    best = {c["best"] for r in result["sets"].values() for c in r["choice"].values()}
    lines += [f"Best on the tuning halves (mean SSD pages per query over the streams), per set and buffer size: "
              f"{', '.join(sorted(best))}.", ""]
    if any(p == "default" or "+rec" in p for r in result["sets"].values() for p in r["policies"]):
        # the record cache's runs (bench/results/cache_policy_records*.md): what each set's tuning half chose
        picks = "; ".join(f"{name} {frac}: {c.get('best_no_uniform_loss', c['best'])}" for name, r in result["sets"].items()
                          for frac, c in sorted(r["choice"].items(), key=lambda kv: -int(kv[0].split('/')[1])))
        lines += ["Record cache (`EngineConfig.record_cache`; `lfu+recS`/`auto+recS`: on, with S% of the buffer; "
                  "`default`: EngineConfig's defaults, `record_cache='auto'`, on where a record and its metadata "
                  "cost less than its share of a block). Best on each tuning half among the policies that read no "
                  f"more SSD pages than clock on the uniform stream: {picks}.", ""]
    elif all({"auto", "clock", "lfu"} <= set(r["policies"]) for r in result["sets"].values()):
        # auto against the better of the two it chooses between, row by row of the report halves.
        gaps = []
        for name, r in result["sets"].items():
            by = {}
            for x in r["report"]:
                by.setdefault((x["buffer"], x["stream"]), {})[x["policy"]] = x["hit_ratio"]
            gaps += [(v["auto"] - max(v["clock"], v["lfu"]), name, *key) for key, v in by.items()]
        worst = min(gaps)
        lines += [f"`auto` against the better of `clock` and `lfu` on each report-half row ({len(gaps)} rows): "
                  f"hit ratio {np.mean([g[0] for g in gaps]):+.4f} on average, at worst {worst[0]:+.4f} "
                  f"({worst[1]}, {worst[2]}, {worst[3]}). Chosen: `buffer_policy='auto'`.", ""]
    else:
        lines += ["Chosen then: `buffer_policy='lfu'`, `pin_fraction=0` (pinning on top of lfu won only where it was "
                  "within 1%, and lost up to 21%).", ""]
    for name, r in result["sets"].items():
        lines += [f"## {name} ({r['count']} vectors, {r['blocks']} blocks of {r['block_bytes']} B)", "",
                  "Tuning half, mean SSD pages per query over the three streams:", ""]
        for frac, c in sorted(r["choice"].items(), key=lambda kv: -int(kv[0].split('/')[1])):
            lines.append(f"- {frac}: " + ", ".join(f"{p} {v:.2f}" for p, v in c["mean_ssd_pages"].items())
                         + f" → best {c['best']}"
                         + (f"; of those reading no more than clock on the uniform stream, {c['best_no_uniform_loss']}"
                            if "best_no_uniform_loss" in c else ""))
        if all("recall" in x for x in r["report"]):
            per = {}
            for x in r["report"]:
                per.setdefault(x["stream"], set()).add(round(x["recall"], 6))
            lines += ["", "Recall@10 on the report half, per stream, under every policy and buffer: " + ", ".join(
                f"{st} {' / '.join(f'{v:.4f}' for v in sorted(vs))}" for st, vs in per.items())
                + (" (the same under all: answers do not depend on the buffer)" if all(len(v) == 1 for v in per.values())
                   else " (NOT the same under all)")]
        lines += ["", "Report half:", "", "| buffer | stream | " + " | ".join(
            f"{p} hit / SSD" for p in r["policies"]) + " |", "|---|---|" + "---|" * len(r["policies"])]
        for frac in r["fractions"]:
            for s in STREAMS:
                cells = []
                for p in r["policies"]:
                    m = [x for x in r["report"] if x["buffer"] == f"1/{frac}" and x["stream"] == s and x["policy"] == p]
                    cells.append(f"{m[0]['hit_ratio']:.3f} / {m[0]['ssd_pages_per_query']:.2f}" if m else "–")
                lines.append(f"| 1/{frac} | {s} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "minilm"])
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--fractions", nargs="*", type=int, default=list(FRACTIONS))
    ap.add_argument("--length", type=int, default=4000, help="queries per stream")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("cache"))
    ap.add_argument("--tag", default="cache_policy")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()}-core VM ({platform.node()})",
              "load_start": [round(x, 2) for x in os.getloadavg()], "threads": args.threads, "batch": args.batch,
              "stream_length": args.length, "refresh_every": REFRESH, "sets": {}}
    for name in args.datasets:
        idx_path = build(args.work, name)
        if args.build_only:
            continue
        _, queries, gt, meta = sets.load(args.work, name)
        from fusionrag.retriever import Index

        index = Index.open(idx_path, filter_tier="cpu")
        q = index.prepare_queries(queries)
        info = {"count": index.count, "blocks": int(index.reranker.store.num_blocks),
                "block_bytes": int(index.reranker.store.block_bytes)}
        index.close()
        tune = measure(idx_path, q, half_streams(q, "tune", args.length), args.fractions, args.policies,
                       args.threads, args.batch, gt)
        report = measure(idx_path, q, half_streams(q, "report", args.length), args.fractions, args.policies,
                         args.threads, args.batch, gt)
        result["sets"][name] = {**info, "fractions": args.fractions, "policies": args.policies, "tune": tune,
                                "choice": choose(tune), "report": report}
        save(result, args.out, args.tag, markdown)


if __name__ == "__main__":
    main()
