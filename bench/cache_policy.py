"""The page buffer's policy on real query streams: CLOCK against cache by use (LFU with aging and
TinyLFU admission, EngineConfig.buffer_policy='lfu') against pinning the pages of the hottest
posting lists (EngineConfig.pin_fraction), at page buffers of 1/64, 1/16 and 1/4 of the raw vectors.

Streams, drawn from one half of a set's queries (the other half chooses the default):
    uniform   the queries themselves, in order
    skewed    queries drawn Zipf(1.0) over k-means clusters of the queries, uniform within a cluster,
              with repeats (as users ask the same things again)
    drifting  as skewed, but the hot clusters change half-way (the cluster ranks are reshuffled)

For each (set, stream, buffer, policy): page-buffer hit ratio (pages served by the buffer / pages
the re-rank touched, counted by the engine) and SSD pages read per query, after a warm-up of the
stream's first quarter (not counted). Pinning is re-chosen every REFRESH queries by the same call
the index manager thread makes (Index.refresh_hotness), so runs do not depend on timing.

    python bench/cache_policy.py                      # glove minilm; results in bench/results/
    python bench/cache_policy.py --datasets glove --build-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import datasets  # noqa: E402

_PLAIN = {"pin_fraction": 0.0, "buffer_compression": "off"}  # no pinning, a buffer never compressed
POLICIES = {  # name -> EngineConfig overrides
    "clock": {**_PLAIN, "buffer_policy": "clock", "record_cache": "off"},
    "lfu": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "off"},
    "clock+pin": {**_PLAIN, "buffer_policy": "clock", "pin_fraction": 0.25, "record_cache": "off"},
    "lfu+pin": {**_PLAIN, "buffer_policy": "lfu", "pin_fraction": 0.25, "record_cache": "off"},
    "auto": {**_PLAIN, "buffer_policy": "auto", "record_cache": "off"},
    "default": {},  # EngineConfig's defaults: buffer_policy auto, record_cache auto, buffer_compression auto
    # the defaults with a plain buffer, as they were before buffer_compression (stop 49)
    "plain": {"buffer_compression": "off"},
    # a share of the same bytes as a cache of single records (EngineConfig.record_cache, record_cache_share)
    "lfu+rec25": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on", "record_cache_share": 0.25},
    "lfu+rec50": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on", "record_cache_share": 0.5},
    "lfu+rec100": {**_PLAIN, "buffer_policy": "lfu", "record_cache": "on"},
    "auto+rec50": {**_PLAIN, "buffer_policy": "auto", "record_cache": "on", "record_cache_share": 0.5},
    "auto+rec100": {**_PLAIN, "buffer_policy": "auto", "record_cache": "on"},
    # the whole buffer as blocks or as records, whichever a miniature of both serves more now (record_cache 'auto'
    # since stop 43); before it, 'auto' was the byte rule alone: records where records_cache_denser, else blocks
    "adapt": {**_PLAIN, "buffer_policy": "auto", "record_cache": "auto"},
}
FRACTIONS = (64, 16, 4)
STREAMS = ("uniform", "skewed", "drifting")
REFRESH = 256  # queries between re-choices of the pinned pages
CLUSTERS = 64


def _knn_numpy(base: np.ndarray, queries: np.ndarray, k: int = datasets.GT_K) -> np.ndarray:
    """Exact L2 neighbours without faiss (the sets here are small enough)."""
    out = np.empty((len(queries), k), np.int32)
    bn = (np.asarray(base, np.float32) ** 2).sum(1)
    for lo in range(0, len(queries), 256):
        q = queries[lo:lo + 256]
        d = bn[None, :] - 2 * q @ np.asarray(base, np.float32).T
        part = np.argpartition(d, k, axis=1)[:, :k]
        order = np.argsort(np.take_along_axis(d, part, 1), axis=1, kind="stable")
        out[lo:lo + 256] = np.take_along_axis(part, order, 1)
    return out


def prepare(work: Path, name: str) -> Path:
    """The set, prepared as bench/run.py does; MiniLM reuses the paragraph embeddings bench/hybrid.py
    made when they are there (the same model and texts), and ground truth needs no faiss."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        datasets.exact_knn = _knn_numpy
    d = work / "data" / name
    emb = work / "hybrid" / "paragraphs.npy"
    if name == "minilm" and not (d / "embeddings.npy").exists() and emb.exists():
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "embeddings.npy", np.load(emb))
    return datasets.prepare(work, name)


def build(work: Path, name: str) -> Path:
    from fusionrag.retriever import BuildConfig, Index

    prepare(work, name)
    out = work / "idx" / name / "fusionrag"
    if not (out / "manifest.json").exists():
        meta = json.loads((work / "data" / name / "meta.json").read_text())
        t = time.perf_counter()
        Index.build(str(work / "data" / name / "base.fbin"), str(out), BuildConfig(metric=meta["metric"]),
                    progress=False, overwrite=True)
        print(f"{name}: built in {time.perf_counter() - t:.0f} s", flush=True)
    return out


def built_set(work: Path, name: str) -> tuple[Path, np.ndarray, np.ndarray, int]:
    """(index path, the set's queries as the index searches them, their ground truth, raw vector bytes) of one
    set's default build (build())."""
    from fusionrag.retriever import Index

    idx_path = build(work, name)
    _, queries, gt, _ = datasets.load(work, name)
    index = Index.open(idx_path, filter_tier="cpu")
    q = index.prepare_queries(queries)
    index.close()
    return idx_path, q, gt, (idx_path / "vectors.pages").stat().st_size


def streams(queries: np.ndarray, length: int, seed: int) -> dict[str, np.ndarray]:
    """Row numbers into queries for each stream."""
    from fusionrag.retriever.engine.kmeans import kmeans

    rng = np.random.default_rng(seed)
    c = min(CLUSTERS, len(queries) // 4)
    _, assign = kmeans(np.ascontiguousarray(queries, np.float32), c, 10, np.random.default_rng(seed))
    members = [np.flatnonzero(assign == i) for i in range(c)]
    members = [m for m in members if len(m)]
    c = len(members)
    zipf = 1.0 / np.arange(1, c + 1)
    zipf /= zipf.sum()

    def draw(n, ranks):
        clusters = ranks[rng.choice(c, n, p=zipf)]
        return np.array([members[j][rng.integers(len(members[j]))] for j in clusters])

    ranks = rng.permutation(c)
    half = length // 2
    return {
        "uniform": np.resize(np.arange(len(queries)), length),
        "skewed": draw(length, ranks),
        "drifting": np.concatenate([draw(half, ranks), draw(length - half, rng.permutation(c))]),
    }


HALF_SEEDS = {"tune": 1, "report": 2}  # each half of a set's queries draws its streams with its own seed


def half_bounds(n: int, half: str) -> tuple[int, int]:
    """Rows [lo, hi) of a set's n queries that make its tuning half (defaults are chosen on it) or its
    report half (results are reported on it)."""
    return (0, n // 2) if half == "tune" else (n // 2, n)


def half_streams(queries: np.ndarray, half: str, length: int) -> dict[str, np.ndarray]:
    """Each stream of one half of the queries, as row numbers into all of them (streams(), drawn with the
    half's seed)."""
    lo, hi = half_bounds(len(queries), half)
    return {k: lo + v for k, v in streams(queries[lo:hi], length, HALF_SEEDS[half]).items()}


def run_stream(index, q: np.ndarray, order: np.ndarray, batch: int, pinned: bool, gt: np.ndarray | None = None) -> dict:
    """Feeds the stream in batches of `batch` queries; counts after the first quarter (recall@10 too, with gt)."""
    warm = len(order) // 4
    read = buffered = counted = cached = 0
    hits = 0
    since = 0
    for lo in range(0, len(order), batch):
        r = index.search(q[order[lo:lo + batch]], 10)
        if lo >= warm:
            read += int(r.stats["pages_read"].sum())
            buffered += int(r.stats["pages_buffered"].sum())
            cached += int(r.stats["records_cached"].sum())
            counted += len(r.ids)
            if gt is not None:
                want = gt[order[lo:lo + batch], :10]
                hits += sum(len(np.intersect1d(a, b)) for a, b in zip(r.ids, want))
        since += batch
        if pinned and since >= REFRESH:
            index.refresh_hotness()
            since = 0
    return {"hit_ratio": buffered / max(1, read + buffered), "ssd_pages_per_query": read / max(1, counted),
            "pages_per_query": (read + buffered) / max(1, counted), "records_cached_per_query": cached / max(1, counted),
            "queries": counted, **({"recall": hits / (10 * max(1, counted))} if gt is not None else {})}


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


def save(result: dict, out: Path, tag: str, to_markdown) -> None:
    """Writes a run's results so far, stamped with the load now: out/tag.json and out/tag.md."""
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"{tag}.md").write_text(to_markdown(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "minilm"])
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--fractions", nargs="*", type=int, default=list(FRACTIONS))
    ap.add_argument("--length", type=int, default=4000, help="queries per stream")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results")
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
        _, queries, gt, meta = datasets.load(args.work, name)
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
