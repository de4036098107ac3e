"""The batch plan (EngineConfig.batch_plan, Aether's S2 plan) on the CPU filter tier, on and off in one run.

With the plan, the queries of an internal batch are ordered by their nearest list and cut into groups (at most
8 queries, at least one group per thread); each group's posting lists are scanned list by list, each code
loaded once and scored against the table of every query of the group that probes the list. Results are the
same either way (checked here on four batches of each row); what changes is how often a list's ids and codes are read.

Streams of the set's queries: uniform (the set's own queries in order), skewed (Zipf(1.0) over clusters
of the queries: bench/cache_policy.streams) and repeats (32 of the queries drawn Zipf(1.0): the same
queries many times in each batch). Calls of 16 and 256 queries (cut by the index into
internal batches of 64). Per row: queries/s of the filter stage alone (PQ tables, gather, de-duplicate, ADC,
top-n over the lists the graph gave, timed apart from the graph), queries/s end to end (Index.search), and
how much the batch's queries share lists: (query, list) pairs per distinct list, in an internal batch and in
a plan group. On and off alternate call by call, the order swapped every round; medians over rounds.
Results: bench/results/batch_plan.{json,md}.

    python -m bench.pipeline.batch_plan --datasets glove
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results

from bench.harness import sets
from bench.harness.streams import build, streams  # noqa: E402

PLAN_GROUP, PLAN_TABLE_BYTES = 8, 1 << 20  # as native/scan.cpp (kPlanGroup, kPlanTableBytes)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def sharing(lists: np.ndarray, threads: int, m_sub: int) -> tuple[float, float]:
    """(pairs per distinct list in the batch, the same within the plan's groups) of one internal batch."""
    valid = lists[lists >= 0]
    batch = valid.size / max(1, np.unique(valid).size)
    q = len(lists)
    group = min(PLAN_GROUP, max(1, PLAN_TABLE_BYTES // (m_sub * 256 * 4)), -(-q // threads))
    first = np.array([row[row >= 0][0] if (row >= 0).any() else -1 for row in lists])
    order = np.argsort(first, kind="stable")
    pairs = distinct = 0
    for lo in range(0, q, group):
        g = lists[order[lo:lo + group]]
        g = g[g >= 0]
        pairs, distinct = pairs + g.size, distinct + np.unique(g).size
    return batch, pairs / max(1, distinct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove"])
    ap.add_argument("--threads", nargs="*", type=int, default=[2, 1])
    ap.add_argument("--calls", nargs="*", type=int, default=[16, 256], help="queries per search call")
    ap.add_argument("--queries", type=int, default=1024, help="queries per (setting, round)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--buffer-fraction", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("pipeline") / "batch_plan")
    args = ap.parse_args()

    from fusionrag.retriever import EngineConfig, Index

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()}-core VM ({cpu_model()}), shared with other jobs",
              "load_start": [round(x, 2) for x in os.getloadavg()], "rows": [], "args": vars(args) | {
                  "work": str(args.work), "out": str(args.out)}}
    for name in args.datasets:
        idx_path = build(args.work, name)
        _, queries, _, _ = sets.load(args.work, name)
        raw = (idx_path / "vectors.pages").stat().st_size
        orders = streams(queries, args.queries, seed=1)
        # Repeats: the skewed stream's first 32 distinct queries, drawn Zipf(1.0): the same queries again and
        # again within a batch, as a popular question asked by many users (the plan's best case).
        pool = np.unique(orders["skewed"])[:32]
        zipf = 1.0 / np.arange(1, len(pool) + 1)
        orders["repeats"] = pool[np.random.default_rng(2).choice(len(pool), args.queries, p=zipf / zipf.sum())]
        for threads in args.threads:
            index = Index.open(idx_path, EngineConfig(buffer_bytes=raw // args.buffer_fraction, threads=threads,
                                                      filter_tier="cpu"))
            tier, p = index.filter, index.params
            m_sub = int(tier.codebooks.M)
            for stream in ("uniform", "skewed", "repeats"):
                q = index.prepare_queries(queries[orders[stream]])
                for call in args.calls:
                    # The lists of each internal batch, from the graph once: the filter stage is timed alone.
                    chunks = []
                    for lo in range(0, len(q), call):
                        for blo in range(lo, min(len(q), lo + call), tier.batch_size):
                            sl = q[blo:min(len(q), lo + call, blo + tier.batch_size)]
                            chunks.append((sl, index.nav.probe(sl, p)[0]))
                    share = np.array([sharing(lists, threads, m_sub) for _, lists in chunks])
                    pairs = np.array([(lists >= 0).sum() for _, lists in chunks])
                    index.search(q[:256], 10)  # warm the page buffer
                    filt = {False: [], True: []}
                    e2e = {False: [], True: []}
                    for r in range(args.rounds):
                        for plan in ((False, True) if r % 2 == 0 else (True, False)):
                            tier.batch_plan = plan
                            t = time.perf_counter()
                            for sl, lists in chunks:
                                tier.topn(tier.tables(sl), lists, p.rerank)
                            filt[plan].append(len(q) / (time.perf_counter() - t))
                        for plan in ((False, True) if r % 2 == 0 else (True, False)):
                            tier.batch_plan = plan
                            t = time.perf_counter()
                            for lo in range(0, len(q), call):
                                index.search(q[lo:lo + call], 10)
                            e2e[plan].append(len(q) / (time.perf_counter() - t))
                    # Same candidates on and off, on this data.
                    for sl, lists in chunks[:4]:
                        got = []
                        for plan in (False, True):
                            tier.batch_plan = plan
                            c = tier.topn(tier.tables(sl), lists, p.rerank)
                            got.append((c.ids, c.pq_dists, c.gathered, c.unique))
                        for a, b in zip(*got):
                            np.testing.assert_array_equal(a, b)
                    tier.batch_plan = False
                    row = {"dataset": name, "threads": threads, "stream": stream, "call": call, "M": m_sub,
                           "pairs_per_batch": float(np.mean(pairs)),
                           "pairs_per_list_batch": round(float(np.mean(share[:, 0])), 3),
                           "pairs_per_list_group": round(float(np.mean(share[:, 1])), 3),
                           "filter_qps_off": round(float(np.median(filt[False])), 1),
                           "filter_qps_on": round(float(np.median(filt[True])), 1),
                           "e2e_qps_off": round(float(np.median(e2e[False])), 1),
                           "e2e_qps_on": round(float(np.median(e2e[True])), 1),
                           "filter_runs": {str(k): [round(x, 1) for x in v] for k, v in filt.items()},
                           "e2e_runs": {str(k): [round(x, 1) for x in v] for k, v in e2e.items()},
                           "load": [round(x, 2) for x in os.getloadavg()]}
                    row["filter_gain"] = round(row["filter_qps_on"] / row["filter_qps_off"], 3)
                    row["e2e_gain"] = round(row["e2e_qps_on"] / row["e2e_qps_off"], 3)
                    result["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_runs")}), flush=True)
            index.close()
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "# The batch plan on the CPU filter tier (`python -m bench.pipeline.batch_plan`)", "",
        f"{result['date']}, {result['machine']}, load average {result['load_start']} at the start, "
        f"{result['load_end']} at the end. On and off alternate call by call; medians of "
        f"{result['args']['rounds']} rounds of {result['args']['queries']} queries. Pairs per list: "
        "(query, list) pairs per distinct list, in an internal batch (64 queries at most) and in a plan group.", "",
        "| set | threads | stream | call | pairs/list batch | pairs/list group | filter q/s off → on | "
        "end to end q/s off → on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['dataset']} | {r['threads']} | {r['stream']} | {r['call']} | {r['pairs_per_list_batch']} "
                     f"| {r['pairs_per_list_group']} | {r['filter_qps_off']} → {r['filter_qps_on']} "
                     f"({r['filter_gain']}×) | {r['e2e_qps_off']} → {r['e2e_qps_on']} ({r['e2e_gain']}×) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
