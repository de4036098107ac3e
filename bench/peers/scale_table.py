"""Builds and searches at growing N inside a memory cgroup of a third of the raw vectors (#51 items 3 and 4): one
table with the same columns at every N, and a log-log plot of build time and memory against N.

    python -m bench.peers.scale_table --n 1000000 3000000 10000000 20000000 [--dim 128] [--cap-share 0.3333]
    python -m bench.peers.scale_table --report            # the table and plot again from what is measured

Data: clustered synthetic float32 (4,000 Gaussian centres, sd 0.3, the same generator as
bench/service/capped_collection.py), a file per N; 1,000 queries from the same centres (another stream, the same
at every N), the first 500 to tune on (the settings that reach recall 0.90 and 0.95 are chosen there), the other
500 to report on. Truth: brute force. Each N's steps are kept under bench/work/scale/<N>x<dim>/ and skipped when
done, so a run stopped anywhere goes on: the build itself resumes from its last finished step (fusionrag build's
own resume), and its seconds are the sum of its steps' (the manifest's build_timings), so time spent stopped is
not counted.

- Build: `fusionrag build` at the defaults in a v1 memory cgroup (no swap) of cap-share x the raw vectors, with
  nothing else telling it the limit. Peak anonymous memory: the cgroup's total_rss sampled every 0.2 s (page cache
  is charged too, but the kernel reclaims it: not counted); CPU seconds of the build's process.
- Search: a process of its own in a fresh cgroup of the same limit, the index's files dropped from the page cache
  first; Index.open at the defaults (the page buffer and mapped arrays sized to the cgroup), 300 noisy base rows to
  warm, then the report half as one call at the defaults; a grid of nprobe x rerank (the probe ratio rule as the index has it; nprobe 512 and 1024,
  re-ranking up to 6400, too from 5M vectors) on the tune half; the fastest
  point reaching each target there, measured on the report half. Pages per query: the engine's pages_read.

Needs root for /sys/fs/cgroup/memory. Writes bench/results/peers/scale_table.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import Sampler, drop_cache
from bench.harness.paths import ROOT, WORK, module_argv, results, tests_module

OUT = results("peers")
GRID = [(nprobe, rerank) for nprobe in (8, 16, 32, 64, 128, 256) for rerank in (50, 100, 200, 400, 800)]
TARGETS = (0.90, 0.95)
CENTRES, SD, CHUNK = 4000, 0.3, 100_000


def work(n: int, dim: int) -> Path:
    return WORK / "scale" / f"{n}x{dim}"


def centres(dim: int) -> np.ndarray:
    return np.random.default_rng(5).standard_normal((CENTRES, dim)).astype(np.float32)


def prepare(d: Path, n: int, dim: int) -> None:
    """base.npy (written a chunk at a time), queries.npy, truth.npy (exact top-10 ids)."""
    d.mkdir(parents=True, exist_ok=True)
    c = centres(dim)
    if not (d / "base.done").exists():
        rng = np.random.default_rng(7)
        base = np.lib.format.open_memmap(d / "base.npy", "w+", np.float32, (n, dim))
        for lo in range(0, n, CHUNK):
            m = min(CHUNK, n - lo)
            base[lo:lo + m] = c[rng.integers(0, CENTRES, m)] + SD * rng.standard_normal((m, dim), dtype=np.float32)
        base.flush()
        del base
        (d / "base.done").write_text("")
    if not (d / "truth.npy").exists():
        rng = np.random.default_rng(11)
        q = (c[rng.integers(0, CENTRES, 1000)] + SD * rng.standard_normal((1000, dim), dtype=np.float32))
        base = np.load(d / "base.npy", mmap_mode="r")
        best_d = np.full((len(q), 10), np.inf, np.float32)
        best_i = np.zeros((len(q), 10), np.int64)
        qq = (q * q).sum(1)[:, None]
        for lo in range(0, n, CHUNK):
            xb = np.asarray(base[lo:lo + CHUNK])
            dd = qq + (xb * xb).sum(1)[None] - 2 * q @ xb.T
            part = np.argpartition(dd, 10, axis=1)[:, :10]
            cand_d = np.concatenate([best_d, np.take_along_axis(dd, part, 1)], 1)
            cand_i = np.concatenate([best_i, part + lo], 1)
            o = np.argsort(cand_d, 1)[:, :10]
            best_d, best_i = np.take_along_axis(cand_d, o, 1), np.take_along_axis(cand_i, o, 1)
        np.save(d / "queries.npy", q)
        np.save(d / "truth.npy", best_i)


def in_cgroup(cap: int, cmd: list[str], failed_log: Path, what: str):
    """cmd run alone in a fresh v1 memory cgroup of `cap` bytes, sampled (Sampler every 0.2 s): (the completed
    process, {wall_s, cpu_s, read_bytes, peak_anon_bytes, oom_kills}); a failure leaves its output in failed_log
    and stops the study."""
    cg = tests_module("cgroup").Cgroup(cap)
    sampler = Sampler(cg, every=0.2)
    t, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = cg.run(cmd, cwd=ROOT, capture_output=True, text=True)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = {"wall_s": time.perf_counter() - t, "oom_kills": cg.oom_kills(),
               "cpu_s": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime}
    finally:
        run_peak = sampler.stop()
        cg.remove()
    run.update(peak_anon_bytes=run_peak, read_bytes=sampler.read_bytes())
    if r.returncode != 0:
        failed_log.write_text(r.stdout + r.stderr)
        raise SystemExit(f"{what} failed ({r.returncode}, OOM kills {run['oom_kills']}): see {failed_log}")
    return r, run


def build(d: Path, n: int, dim: int, cap: int, flags: tuple[str, ...] = ()) -> dict:
    """fusionrag build at the defaults (and flags) inside the cap; resumes a stopped build (its own resume)."""
    if (d / "build.json").exists():
        return json.loads((d / "build.json").read_text())
    drop_cache(d / "base.npy")  # a cold start: what the build reads is read (and charged to its cgroup) by it
    load0 = os.getloadavg()
    cmd = [sys.executable, "-m", "fusionrag", "build", str(d / "base.npy"), str(d / "index"), "--quiet", *flags]
    r, run = in_cgroup(cap, cmd, d / "build_failed.log", f"build of {n}")
    manifest = json.loads((d / "index" / "manifest.json").read_text())
    timings = manifest.get("build_timings", {})
    steps = {k: v for k, v in timings.items() if k.endswith("_s") and k != "total_s"}
    out = {"n": n, "dim": dim, "cap_bytes": cap, "wall_s_last_run": run["wall_s"], "cpu_s_last_run": run["cpu_s"],
           "read_bytes_last_run": run["read_bytes"], "build_s": sum(steps.values()),
           "steps_s": steps, "timings": timings, "resumed": manifest.get("build_resumed", []),
           "peak_anon_bytes_last_run": run["peak_anon_bytes"], "oom_kills": run["oom_kills"], "load_at_start": load0, "load_at_end": os.getloadavg(),
           "budget_bytes": manifest.get("build_memory_budget_bytes"), "cli": r.stdout[-2000:],
           "calibrated": manifest.get("search_defaults") or manifest.get("calibration")}
    (d / "build.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def tier_bytes(index: Path, n: int) -> dict:
    """Bytes per vector of each tier's files: what the host holds (graph, list ids, slot map), the PQ codes (GPU
    tier; host here, mapped), the SSD's pages."""
    size = lambda name: (index / name).stat().st_size if (index / name).exists() else 0  # noqa: E731
    host = {name: size(name) for name in ("graph.bin", "list_ids.npy", "list_offsets.npy", "locations.npy")}
    return {"host_per_vector": sum(host.values()) / n, "host_files": host, "pq_per_vector": size("pq_codes.npy") / n,
            "ssd_per_vector": size("vectors.pages") / n,
            "all_files_bytes": sum(p.stat().st_size for p in index.rglob("*") if p.is_file())}


def search_worker(d: Path) -> None:
    """In the capped cgroup: defaults, the grid on the tune half, the chosen points on the report half."""
    import fusionrag.retriever as fr

    q, truth = np.load(d / "queries.npy"), np.load(d / "truth.npy")
    tune, report = slice(0, 500), slice(500, 1000)
    base = np.load(d / "base.npy", mmap_mode="r")
    rng = np.random.default_rng(1)
    rows = np.sort(rng.choice(len(base), 300, replace=False))
    warm = (np.asarray(base[rows]) + 0.05 * rng.standard_normal((300, base.shape[1]), dtype=np.float32))
    t = time.perf_counter()
    idx = fr.Index.open(str(d / "index"))
    opened = time.perf_counter() - t
    idx.search(warm, k=10)

    def measure(sl, **kw):
        t = time.perf_counter()
        r = idx.search(np.ascontiguousarray(q[sl]), k=10, **kw)
        s = time.perf_counter() - t
        rec = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(r.ids.tolist(), truth[sl].tolist())]))
        return {"recall@10": rec, "qps": (sl.stop - sl.start) / s, "pages_per_query": float(r.stats["pages_read"].mean()),
                "lists_probed": float(r.stats["lists_probed"].mean()), **({"params": kw} if kw else {})}

    p = idx.params
    out = {"open_s": opened, "defaults_params": {"nprobe": p.nprobe, "rerank": p.rerank, "probe_ratio": p.probe_ratio,
                                                  "probe": p.probe},
           "memory": {k: v for k, v in idx.memory().items() if isinstance(v, (int, float, bool))},
           "defaults": measure(report)}
    # From 5M, lists of ~10 vectors: wider probes, and the re-rank depths calibration climbs to there.
    wide = [(a, b) for a in (512, 1024) for b in (100, 200, 400, 800, 1600, 3200, 6400)] \
        if len(base) >= 5_000_000 else []
    grid = [{"nprobe": a, "rerank": b, **measure(tune, nprobe=a, rerank=b)} for a, b in GRID + wide]
    out["tune_grid"] = grid
    for target in TARGETS:
        ok = [g for g in grid if g["recall@10"] >= target]
        if ok:
            best = max(ok, key=lambda g: g["qps"])
            out[f"at_{target:.2f}"] = measure(report, nprobe=best["nprobe"], rerank=best["rerank"])
        else:
            out[f"at_{target:.2f}"] = None
    idx.close()
    print(json.dumps(out, default=float))


def search(d: Path, cap: int) -> dict:
    if (d / "search.json").exists():
        return json.loads((d / "search.json").read_text())
    drop_cache(d / "index")
    r, run = in_cgroup(cap, module_argv(__spec__.name, "--search-worker", str(d)), d / "search_failed.log",
                       f"search in {d}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.update(peak_anon_bytes=run["peak_anon_bytes"], oom_kills=run["oom_kills"], load_at_end=os.getloadavg())
    (d / "search.json").write_text(json.dumps(out, indent=1))
    return out


def rows(dim: int) -> list[dict]:
    found = []
    for d in sorted((WORK / "scale").glob(f"*x{dim}"), key=lambda p: int(p.name.split("x")[0])):
        if (d / "build.json").exists():
            b = json.loads((d / "build.json").read_text())
            if (d / "index" / "manifest.json").exists():  # kept beside build.json: the row outlives its index's files
                (d / "tiers.json").write_text(json.dumps(tier_bytes(d / "index", b["n"]), indent=1))
            r = {"build": b, "tiers": json.loads((d / "tiers.json").read_text())}
            if (d / "search.json").exists():
                r["search"] = json.loads((d / "search.json").read_text())
            found.append(r)
    return found


def report(dim: int) -> None:
    rs = rows(dim)
    mib = lambda b: f"{b / (1 << 20):,.0f}"  # noqa: E731
    fmt = lambda m: "-" if not m else f"{m['recall@10']:.3f} / {m['qps']:,.0f} / {m['pages_per_query']:.1f}"  # noqa: E731
    lines = [f"# Builds and searches at growing N under a cap of a third of the raw vectors ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.peers.scale_table` on this machine ({os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30} GiB, no swap); "
             "clustered synthetic float32, 4,000 centres; each build and each search alone in a v1 memory cgroup of a third of "
             "the raw vectors (at least 256 MiB: the interpreter, ~46 MiB, and the in-RAM tiers, ~23% of the raw vectors, "
             "do not fit a third of 1M x 128's 488 MiB), at the defaults, with nothing but the cgroup to tell them the limit. Search: 2 threads where "
             "the machine has 2 CPUs; recall@10 / q/s / pages per query on the 500 report queries; the points at 0.90 and "
             "0.95 chosen on the other 500 (nprobe x rerank, the index's probe ratio). Build seconds are the sum of its steps; load "
             "averages at the build's start and end are in the JSON beside it.", "",
             "| N | raw MiB | cap MiB | build s | s per 1M | clustering s | build read from disk GB | build peak anon MiB | "
             "host B/vec | PQ B/vec | SSD B/vec | defaults (nprobe, rerank) | at defaults | at 0.90 | at 0.95 | "
             "search peak anon MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|"]
    for r in rs:
        b, t, s = r["build"], r["tiers"], r.get("search", {})
        raw = b["n"] * b["dim"] * 4
        dp = s.get("defaults_params", {})
        lines.append(f"| {b['n']:,} | {mib(raw)} | {mib(b['cap_bytes'])} | {b['build_s']:,.0f} | {b['build_s'] / b['n'] * 1e6:,.0f} | "
                     f"{b['steps_s'].get('cluster_s', 0):,.0f} | {b.get('read_bytes_last_run', 0) / 1e9:,.1f} | "
                     f"{mib(b['peak_anon_bytes_last_run'])}{' (resumed)' if b['resumed'] else ''} | {t['host_per_vector']:.1f} | "
                     f"{t['pq_per_vector']:.1f} | {t['ssd_per_vector']:.1f} | {dp.get('nprobe', '-')}, {dp.get('rerank', '-')} | "
                     f"{fmt(s.get('defaults'))} | {fmt(s.get('at_0.90'))} | {fmt(s.get('at_0.95'))} | "
                     f"{mib(s['peak_anon_bytes']) if s else '-'} |")
    for d in sorted((WORK / "scale").glob(f"*x{dim}"), key=lambda p: int(p.name.split("x")[0])):
        state = d / ".index.partial" / "build_state.json"
        if (d / "build_failed.log").exists() and not (d / "build.json").exists() and state.exists():
            st = json.loads(state.read_text())
            done = ", ".join(f"{k[:-2]} {v:,.0f} s" for k, v in st.get("timings", {}).items() if k.endswith("_s"))
            lines.append(f"| {int(d.name.split('x')[0]):,} | failed: killed for memory (OOM) after the steps "
                         f"{', '.join(st.get('steps', {}))} ({done}); it resumes from them |" + " |" * 14)
    lines += ["", "![build time and memory against N](scale_table.png)", ""]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale_table.md").write_text("\n".join(lines))
    (OUT / "scale_table.json").write_text(json.dumps(rs, indent=1, default=str))
    if len(rs) >= 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = np.array([r["build"]["n"] for r in rs], float)
        fig, ax = plt.subplots(figsize=(6, 4))
        for ys, label in ((np.array([r["build"]["build_s"] for r in rs]), "build seconds"),
                          (np.array([r["build"]["peak_anon_bytes_last_run"] for r in rs]) / 2**20, "build peak anon MiB"),
                          (np.array([r["build"]["cap_bytes"] for r in rs]) / 2**20, "cap MiB")):
            ax.loglog(n, ys, "o-", label=label)
        ax.loglog(n, n / n[0] * rs[0]["build"]["build_s"], ":", color="grey", label="linear in N (from the first)")
        ax.set_xlabel("vectors (N)")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(OUT / "scale_table.png", dpi=110)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="*", default=[1_000_000, 3_000_000, 10_000_000, 20_000_000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cap-share", type=float, default=1 / 3)
    p.add_argument("--floor-mib", type=int, default=256,
                   help="the cap at least this: the interpreter (~46 MiB) and the in-RAM tiers (~23%% of the raw vectors "
                        "at 128-d) do not fit a third of a small set's")
    p.add_argument("--report", action="store_true", help="only write the table and plot from what is measured")
    p.add_argument("--search-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.search_worker:
        return search_worker(args.search_worker)
    if not args.report:
        for n in args.n:
            d = work(n, args.dim)
            cap = max(int(n * args.dim * 4 * args.cap_share), args.floor_mib << 20)
            print(f"{n:,}: data", flush=True)
            prepare(d, n, args.dim)
            print(f"{n:,}: build in {cap >> 20} MiB", flush=True)
            b = build(d, n, args.dim, cap)
            print(f"{n:,}: built in {b['build_s']:,.0f} s, peak anon {b['peak_anon_bytes_last_run'] >> 20} MiB", flush=True)
            s = search(d, cap)
            print(f"{n:,}: defaults {s['defaults']}", flush=True)
            report(args.dim)
    report(args.dim)


if __name__ == "__main__":
    main()
