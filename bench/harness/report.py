"""results.json -> results.md (tables, targets) and qps_recall.png.

    python -m bench.harness.report bench/results/peers/results.json [OTHER.json ...]

With OTHER runs, their data sets and build-time rows are merged into results.json first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = (0.90, 0.95)
MIB = 2**20


def best_at(points, threads, target):
    ok = [p for p in points if p["threads"] == threads and p["recall"] >= target]
    return max(ok, key=lambda p: p["qps"]) if ok else None


def fewest_pages_at(points, threads, target):
    ok = [p for p in points if p["threads"] == threads and p["recall"] >= target]
    return min(p["read_pages_per_query"] for p in ok) if ok else None


def system_summary(sys_res: dict) -> dict:
    points = [p for s in sys_res["search"] if "points" in s for p in s["points"]]
    peaks = [s for s in sys_res["search"] if "points" in s]
    out = {
        "build_s": sys_res["build"].get("build_s"),
        "build_peak_rss": sys_res["build"].get("build_peak_rss"),
        "index_disk_bytes": sys_res["build"].get("index_disk_bytes"),
        "search_peak_rss": max((s["search_peak_rss"] for s in peaks), default=None),
        "net_peak_rss": max((s["net_peak_rss"] for s in peaks), default=None),
        "best": {},
    }
    for threads in sorted({p["threads"] for p in points}):
        for t in TARGETS:
            b = best_at(points, threads, t)
            out["best"][f"{threads}t@{t:.2f}"] = b and {
                "qps": b["qps"], "recall": b["recall"], "knob": b["knob"], "pages": b["read_pages_per_query"],
                "cpu_ms": b["cpu_ms_per_query"], "fewest_pages": fewest_pages_at(points, threads, t),
                "engine_pages": b.get("engine", {}).get("pages_read")}
    return out


def fmt(x, nd=0):
    if x is None:
        return "—"
    return f"{x:,.{nd}f}"


def targets(summ: dict, goal: float = 2.0) -> list[str]:
    """The issue's three targets, from numbers measured in the same run: fusionrag at its defaults,
    and for "no more memory" whichever fusionrag configuration fits in DiskANN's net memory.
    `goal`: the QPS ratio to DiskANN asked for (issue #2: 2; issue #17, skewed stream: 3, 2.5 at 384-d)."""
    f, h, d = summ.get("fusionrag"), summ.get("hnswlib"), summ.get("diskann")
    lines = []
    if f and h and f["net_peak_rss"] and h["net_peak_rss"]:
        r_net = f["net_peak_rss"] / h["net_peak_rss"]
        r_tot = f["search_peak_rss"] / h["search_peak_rss"]
        lines.append(f"memory vs hnswlib (target ≤ 0.25): net {r_net:.2f}, whole process {r_tot:.2f} "
                     f"→ {'met' if r_net <= 0.25 else 'missed'} (net)")
    if not (f and d):
        return lines
    variants = {s: v for s, v in summ.items() if s.startswith("fusionrag") and v["net_peak_rss"]}
    for th in (1, 2):
        fb, db = f["best"].get(f"{th}t@0.90"), d["best"].get(f"{th}t@0.90")
        if not (fb and db):
            continue
        mem = f["net_peak_rss"] / d["net_peak_rss"] if d["net_peak_rss"] else float("nan")
        lines.append(f"QPS@0.90 vs DiskANN, {th} thread(s) (target ≥ {goal:g}), defaults: {fb['qps'] / db['qps']:.2f} "
                     f"(memory fusionrag/DiskANN net {mem:.2f}) → {'met' if fb['qps'] >= goal * db['qps'] else 'missed'}")
        fits = {s: v["best"][f"{th}t@0.90"] for s, v in variants.items()
                if v["net_peak_rss"] <= d["net_peak_rss"] and v["best"].get(f"{th}t@0.90")}
        if fits:
            s, b = max(fits.items(), key=lambda kv: kv[1]["qps"])
            m = variants[s]["net_peak_rss"] / d["net_peak_rss"]
            lines.append(f"… with no more memory than DiskANN, {th} thread(s): {s} {b['qps'] / db['qps']:.2f}× "
                         f"(net memory {m:.2f} of DiskANN's) → {'met' if b['qps'] >= goal * db['qps'] else 'missed'}")
        else:
            lines.append(f"… with no more memory than DiskANN, {th} thread(s): no fusionrag configuration fits "
                         f"(smallest net {min(v['net_peak_rss'] for v in variants.values()) / d['net_peak_rss']:.2f} "
                         "of DiskANN's) → missed")
        pr = fb["pages"] / db["pages"] if db["pages"] else float("nan")
        lines.append(f"pages/query@0.90 vs DiskANN, {th} thread(s) (target ≤ 0.5): {fb['pages']:.1f} vs "
                     f"{db['pages']:.1f} = {pr:.2f}; fewest at ≥0.90: {fb['fewest_pages']:.1f} vs "
                     f"{db['fewest_pages']:.1f} → {'met' if pr <= 0.5 else 'missed'}")
    return lines


def write_report(path: Path) -> None:
    path = Path(path)
    res = json.loads(path.read_text())
    md = [f"# fusionrag benchmark ({res['started']})", "",
          f"Load at start: `{res['uptime_start']}`  ", f"Load at end: `{res.get('uptime_end', '?')}`", "",
          "Machine shared with other jobs: absolute numbers are noisy; compare ratios within this run.", ""]
    summary = {}
    for name, ds in res["datasets"].items():
        meta, params = ds["meta"], ds["params"]
        summ = {s: system_summary(r) for s, r in ds["systems"].items()}
        summary[name] = summ
        md += [f"## {name}: {meta['count']:,} × {meta['dim']} ({meta['metric']}), {meta['origin']}", "",
               *([f"Measured by run {ds['from_run']}.", ""] if ds.get("from_run") else []),
               *([f"Query stream: {ds['stream']}, drawn from the report half of the set's queries "
                  "(bench/harness/runner.py --streams).", ""] if ds.get("stream") else []),
               f"fusionrag page buffer {params['buffer_bytes'] / MIB:.1f} MiB = raw vectors "
               f"({params['raw_bytes'] / MIB:.0f} MiB) / {round(params['raw_bytes'] / params['buffer_bytes'])} "
               f"(fusionrag-lean: a quarter of it, lists of ~40 vectors, at most 3 replicas); "
               f"DiskANN R={params['diskann_r']}, L_build={params['diskann_l_build']}, "
               f"PQ {params['fusionrag_pq_m']} B/vector (as fusionrag), node cache {params['diskann_cache_nodes']:,} "
               f"nodes (≈ the page buffer); faiss IVF{params['nlist']},PQ{params['pq_m']}+RFlat; HNSW M=16, "
               f"efConstruction=100.", "",
               *(["fusionrag's PQ codes (the build's choice, BuildConfig.pq_bits 0): " + "; ".join(
                   f"{s}: {b['pq_bits']}-bit ({b.get('pq_why') or 'not measured'})" for s, b in codes.items()), ""]
                 if (codes := {s: r["build"] for s, r in ds["systems"].items()
                               if isinstance(r.get("build"), dict) and "pq_bits" in r["build"]
                               and s not in ("fusionrag-ram",)}) else []),
               "| system | build s | build peak RSS MiB | search peak RSS MiB (net) | "
               + " | ".join(f"QPS@{t:.2f} {th}t (pages/q)" for th in (1, 2) for t in TARGETS) + " |",
               "|---" * 8 + "|"]
        for s, v in summ.items():
            cells = []
            for th in (1, 2):
                for t in TARGETS:
                    b = v["best"].get(f"{th}t@{t:.2f}")
                    cells.append(f"{fmt(b['qps'])} ({b['pages']:.1f})" if b else "not reached")
            md.append(f"| {s} | {fmt(v['build_s'], 1)} | {fmt((v['build_peak_rss'] or 0) / MIB)} | "
                      f"{fmt((v['search_peak_rss'] or 0) / MIB)} ({fmt((v['net_peak_rss'] or 0) / MIB)}) | "
                      + " | ".join(cells) + " |")
        md += ["", "Knob settings at those points (1 thread): " + "; ".join(
            f"{s}: " + ", ".join(f"{t:.2f}→{json.dumps(v['best'][f'1t@{t:.2f}']['knob'])}"
                                 for t in TARGETS if v["best"].get(f"1t@{t:.2f}"))
            for s, v in summ.items()), ""]
        # Issue #17 asks more on the skewed stream: 3x DiskANN on low-dimensional sets, 2.5x at 384-d and up.
        goal = (3.0 if meta["dim"] < 384 else 2.5) if ds.get("stream") == "skewed" else 2.0
        md += ["Targets:", ""] + [f"- {line}" for line in targets(summ, goal)] + [""]
        for fname, f in ds["systems"].items():
            if not fname.startswith("fusionrag"):
                continue
            md += [f"{fname} per-stage profile (mean per query, 1 thread):", "",
                   "| nprobe | rerank | minibatch | beta | probe ratio | recall | QPS | probed | cand. | unique | minibatches | reranked | pages SSD | pages buffer | graph µs | LUT µs | scan µs | rerank µs |",
                   "|---" * 18 + "|"]
            for s in f["search"]:
                for p in s.get("points", []):
                    if p["threads"] != 1:
                        continue
                    e = p["engine"]
                    md.append(f"| {p['knob']['nprobe']} | {p['knob']['rerank']} | {p['knob'].get('minibatch', 8)} | {p['knob'].get('beta', '')} | {p['knob'].get('probe_ratio', '')} | {p['recall']:.3f} | {p['qps']:,.0f} | "
                              f"{e.get('lists_probed', e.get('centroids_probed', 0)):.0f} | {e['candidates']:.0f} | {e['unique_candidates']:.0f} | "
                              f"{e['minibatches']:.1f} | {e['reranked']:.0f} | {e['pages_read']:.1f} | "
                              f"{e['pages_buffered']:.1f} | {e['graph_s'] * 1e6:.0f} | {e['lut_s'] * 1e6:.0f} | "
                              f"{e['scan_s'] * 1e6:.0f} | {e['rerank_s'] * 1e6:.0f} |")
            md.append("")
    if res.get("scaling"):
        md += ["## Build time against N (fusionrag, clustered synthetic, 2 build threads)", "",
               "| N | dim | build s | s per 1M vectors | load avg at start | build peak RSS MiB | best QPS@0.90 (2t) | recall/QPS points |",
               "|---" * 8 + "|"]
        for row in res["scaling"]:
            b = row["build"]
            pts = row["search"].get("points", [])
            best = best_at(pts, 2, 0.90)
            md.append(f"| {row['n']:,} | {row['dim']} | {fmt(b.get('build_s'), 1)} | "
                      f"{fmt((b.get('build_s') or 0) / row['n'] * 1e6, 1)} | {b.get('loadavg_before', [0])[0]:.1f} | "
                      f"{fmt((b.get('build_peak_rss') or 0) / MIB)} | "
                      f"{fmt(best and best['qps'])} | "
                      + ", ".join(f"{p['recall']:.3f}/{p['qps']:.0f}" for p in pts)
                      + (f" (run {row['from_run']})" if row.get("from_run") else "") + " |")
        md.append("")
    md += ["## What is measured", "",
           "- Each build and each search is a process of its own. Search processes load the index from disk; "
           "with `--pin-cores` (the default since 2026-11-23) a search of N threads is held to N cores "
           "(sched_setaffinity), every system alike, since fusionrag's pipeline runs its stages in threads of "
           "their own besides its N search threads.",
           "- QPS: all measured queries (the first 1000 of the set's queries, fewer where the set has fewer) as one "
           "batch call, after a warm-up of 300 other queries (noisy base rows) that fills caches and page buffers.",
           "- Resident memory: VmHWM of the search process, reset (/proc/self/clear_refs 5) after imports and query "
           "loading; 'net' subtracts the RSS at that moment (interpreter, libraries, queries). Each system's library "
           "is imported before it: for fusionrag its engine (`fusionrag.retriever.engine.index`, ~14 MiB of code and "
           "imports; runs before 2026-12-06 imported the lazy package only and counted them in net). For fusionrag "
           "net counts the navigation graph, posting lists, the PQ codes (host RAM: no GPU here), the slot map, the "
           "page buffer and its bookkeeping, the threads' scratch and a call's arrays (Index.memory()'s parts, "
           "in the JSON beside each point), and ~1-3 MiB of interpreter and allocator slack and code pages; the "
           "page file on SSD is not counted. For DiskANN it counts the PQ codes, the node cache and its I/O "
           "buffers; its disk index is not counted.",
           "- Pages per query: bytes this process read from storage (/proc/self/io read_bytes, which the kernel "
           "counts in submit_bio for O_DIRECT and buffered reads alike; page-cache hits are not counted) / 4096 / "
           "queries. Both fusionrag and DiskANN read with O_DIRECT, so every counted byte came from the device. "
           "fusionrag's own pages_read statistic is in the JSON beside it as a cross-check.",
           "", "## Machine", "", "```", res["machine"]["lscpu"], "", res["machine"]["memory"], "",
           res["machine"]["disk"], "", "kernel " + res["machine"]["kernel"] + ", Python " + res["machine"]["python"],
           res["machine"]["packages"], "```", ""]
    path.with_suffix(".md").write_text("\n".join(md))
    path.with_name(path.stem + "_summary.json").write_text(json.dumps(summary, indent=1))
    plot(res, path.with_name(path.stem + "_qps_recall.png"))


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["datasets"])
    if not names:
        return
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 7.5), squeeze=False)
    for j, name in enumerate(names):
        for i, threads in enumerate((1, 2)):
            ax = axes[i][j]
            for s, r in res["datasets"][name]["systems"].items():
                pts = sorted((p["recall"], p["qps"]) for sr in r["search"] for p in sr.get("points", [])
                             if p["threads"] == threads)
                # Pareto frontier: the best QPS at each recall or better.
                front, best = [], 0.0
                for rec, qps in reversed(pts):
                    if qps > best:
                        front.append((rec, qps))
                        best = qps
                if front:
                    ax.plot(*zip(*sorted(front)), marker="o", ms=3, label=s)
            for t in (0.90, 0.95):
                ax.axvline(t, color="grey", lw=0.5, ls="--")
            ax.set_xlim(0.7, 1.0)
            ax.set_yscale("log")
            ax.set_title(f"{name}, {threads} thread{'s' if threads > 1 else ''}", fontsize=9)
            ax.set_xlabel("recall@10")
            ax.set_ylabel("QPS")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def merge_runs(path: Path, others: list[Path]) -> None:
    """Add the data sets and build-time rows of other runs (run alongside this one on the same
    machine) to `path`, each marked with the run it came from."""
    res = json.loads(path.read_text())
    for other in others:
        o = json.loads(Path(other).read_text())
        for name, ds in o["datasets"].items():
            if name not in res["datasets"]:
                res["datasets"][name] = {**ds, "from_run": f"{Path(other).name}, started {o['started']}, "
                                                          f"load at start: {o['uptime_start']}"}
        for row in o["scaling"]:
            res["scaling"].append({**row, "from_run": Path(other).name})
    res["scaling"].sort(key=lambda r: r["n"])
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2:
        merge_runs(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
    write_report(Path(sys.argv[1]))
