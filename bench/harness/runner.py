"""fusionrag against faiss IVFPQ+RefineFlat, faiss HNSWFlat, hnswlib and DiskANN (SSD index),
in one run on the same data: QPS at recall@10 >= 0.90 / 0.95 with 1 and 2 threads, build time,
resident memory, SSD pages read per query, and a QPS-vs-recall plot.

    python -m bench.harness.runner [--datasets glove fashion minilm synth300k] [--scaling 100k 300k 1m]
                        [--queries 2000] [--streams uniform skewed]

With --streams, every system searches each named stream of the data set's report half (its second
half of queries; the first half is where defaults and sweep points are chosen), results under
"<set>:<stream>": `uniform` is those queries in order; `skewed` draws them Zipf(1.0) over k-means
clusters of the queries, with repeats, as users ask (bench/harness/streams.py's streams), its first
WARMUP queries as warm-up and the next QUERIES measured. Without it, the set's first QUERIES
queries as before.

Every build and every search runs in a process of its own (bench/harness/worker.py; DiskANN under
bench/work/diskann-venv because diskannpy pins numpy 1.25). Searches run in rounds by thread
count, the systems in a rotating order, so the load of a shared machine falls on all of them.
Results: bench/results/peers/results.json, results.md and qps_recall.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.paths import ROOT, WORK, results
from bench.harness.sets import load, prepare  # noqa: E402
from bench.harness.report import write_report  # noqa: E402

SYSTEMS = ["fusionrag", "fusionrag-halfbuf", "fusionrag-lean", "fusionrag-lean-halfbuf", "fusionrag-lean-fullbuf",
           "fusionrag-lean-noprefetch", "fusionrag-lean-halfbuf-noprefetch",
           "faiss-ivfpq-refine", "faiss-hnsw", "hnswlib", "diskann"]
# Run only when named: fusionrag's build with the record cache off, or with a plain (never compressed) page buffer;
# fusionrag built to navigate by the graph.
# fusionrag's build with a budget that holds the raw vectors: in RAM (raw_in_ram auto), or as a page buffer (off).
OPTIONAL = ["fusionrag-blocks", "fusionrag-plain", "fusionrag-graphnav", "fusionrag-ram", "fusionrag-rawbuf"]
# Variants that search another system's index with other engine settings (worker.py says which).
BUILT_BY = {"fusionrag-halfbuf": "fusionrag", "fusionrag-lean-fullbuf": "fusionrag-lean", "fusionrag-blocks": "fusionrag",
            "fusionrag-plain": "fusionrag", "fusionrag-ram": "fusionrag", "fusionrag-rawbuf": "fusionrag",
            "fusionrag-lean-halfbuf": "fusionrag-lean", "fusionrag-lean-noprefetch": "fusionrag-lean",
            "fusionrag-lean-halfbuf-noprefetch": "fusionrag-lean"}
SWEEPS = {
    # rerank is only an upper bound (Algorithm 1 stops after beta stable mini-batches) and
    # probe_ratio may cut lists before nprobe: docs/tuning.md. 0 disables the ratio rule.
    "fusionrag": [{"nprobe": n, "rerank": r, "beta": b, "probe_ratio": pr, "minibatch": mb} for n, r, b, pr, mb in
                  [(16, 40, 2, 1.0, 8), (32, 60, 2, 1.0, 8), (64, 100, 2, 1.0, 8), (128, 200, 2, 1.0, 8),
                   (256, 400, 2, 1.0, 8), (128, 200, 4, 1.0, 8), (128, 200, 2, 0, 8), (256, 400, 4, 0, 8),
                   (512, 800, 4, 0, 8),
                   # Smaller mini-batches stop sooner: fewer pages for the same recall on high-d data.
                   (8, 30, 2, 1.0, 4), (16, 40, 2, 1.0, 4), (32, 60, 2, 1.0, 4), (64, 100, 2, 1.0, 4),
                   # One stable mini-batch ends the re-rank: the fewest pages for a given recall.
                   (16, 40, 1, 1.0, 4), (32, 60, 1, 1.0, 4), (64, 100, 1, 1.0, 4),
                   # Mini-batches of 2: with page-mates scored, the top-k can settle after very few pages.
                   (16, 40, 2, 1.0, 2), (32, 60, 2, 1.0, 2), (64, 100, 2, 1.0, 2)]],
    # Lists 4x larger: a quarter of the lists probed for the same candidates.
    "fusionrag-lean": [{"nprobe": n, "rerank": r, "beta": b, "probe_ratio": 1.0, "minibatch": mb} for n, r, mb, b in
                       [(4, 30, 4, 2), (8, 40, 4, 2), (12, 60, 4, 2), (16, 60, 4, 2), (24, 80, 4, 2), (32, 100, 4, 2),
                        (32, 100, 8, 2), (48, 150, 8, 2), (64, 200, 8, 2), (96, 300, 8, 2),
                        (8, 40, 4, 1), (16, 60, 4, 1), (24, 80, 4, 1), (8, 40, 2, 2), (16, 60, 2, 2), (24, 80, 2, 2)]],
    "faiss-ivfpq-refine": [{"nprobe": n, "k_factor": f} for n, f in
                           [(2, 8), (4, 8), (8, 16), (12, 16), (16, 16), (24, 32), (32, 32), (64, 64), (128, 64)]],
    "faiss-hnsw": [{"ef": e} for e in (10, 16, 24, 32, 48, 64, 96, 128, 256)],
    "hnswlib": [{"ef": e} for e in (10, 16, 24, 32, 48, 64, 96, 128, 256)],
    "diskann": [{"L": L, "W": w} for w in (2, 4) for L in (10, 16, 24, 32, 48, 64, 96, 128, 200)],
}


for _variant, _built_by in BUILT_BY.items():
    SWEEPS[_variant] = SWEEPS[_built_by]
SWEEPS["fusionrag-graphnav"] = SWEEPS["fusionrag"]  # its own build, fusionrag's sweep
# The re-rank from RAM scores every candidate (no early stop: beta and minibatch do nothing), at a few ns each: the
# sweep is lists probed and candidates re-ranked only.
SWEEPS["fusionrag-ram"] = [{"nprobe": n, "rerank": r, "probe_ratio": 1.0} for n, r in
                           [(8, 20), (8, 40), (16, 30), (16, 60), (24, 40), (24, 80), (32, 50), (32, 100), (48, 60),
                            (48, 120), (64, 100), (64, 200), (96, 150), (128, 200), (128, 400), (256, 400)]]


def machine() -> dict:
    def sh(cmd):
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    return {
        "lscpu": sh("lscpu"), "memory": sh("free -h"), "disk": sh("df -h / ; lsblk -d -o NAME,ROTA,SIZE,MODEL"),
        "kernel": platform.uname().release, "python": sys.version.split()[0],
        "packages": sh(f"{sys.executable} -m pip freeze 2>/dev/null | grep -i -E 'faiss|hnswlib|numpy|fusionrag'"
                       f"; {diskann_python()} -m pip freeze 2>/dev/null | grep -i -E 'diskannpy|numpy'"),
    }


def diskann_python() -> str:
    return str(WORK / "diskann-venv" / "bin" / "python")


def params_for(meta: dict, args) -> dict:
    """Per-data-set parameters, the same rules for every set."""
    n, d = meta["count"], meta["dim"]
    raw = n * d * 4
    pq_m = min(64, max(1, d // 2))  # fusionrag's automatic choice (BuildConfig.pq_m = 0)
    # faiss PQ needs M | d; sub-vectors of at least 8 dims because faiss 1.15.1 trains 2- and
    # 4-dim sub-quantizers 50-100x slower here (minutes for 20k vectors). RFlat re-ranks exactly.
    faiss_m = max(m for m in range(1, d // 8 + 1) if d % m == 0)
    buffer = max(1 << 20, raw // args.buffer_fraction)
    # DiskANN's graph degree as HNSW's layer-0 degree (2M = 32), and a build beam of 64: what two
    # shared cores can build in the time of one run (diskannpy suggests R 60-150, L 75-200).
    r = 32
    node_bytes = 4 * d + 4 + 4 * r
    return {
        "build_threads": 2, "buffer_bytes": buffer, "pq_m": faiss_m, "nlist": int(4 * math.sqrt(n)),
        "hnsw_m": 16, "ef_construction": 100,
        # DiskANN: the same PQ code size as fusionrag in RAM, and a node cache as large as
        # fusionrag's page buffer: the same memory for the same job.
        "diskann_r": r, "diskann_l_build": 64, "diskann_search_gb": n * (pq_m + 0.5) / 2**30,
        "diskann_build_gb": 4.0, "diskann_cache_nodes": buffer // node_bytes,
        "fusionrag_pq_m": pq_m, "raw_bytes": raw,
    }


def worker(spec: dict, log) -> dict:
    py = diskann_python() if spec["system"] == "diskann" else sys.executable
    t = time.perf_counter()
    load = os.getloadavg()
    # OpenMP threads that spin at barriers waste the cores of a shared machine: let them sleep.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run([py, "-m", "bench.harness.worker", json.dumps(spec)], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        print(f"FAILED {spec['phase']} {spec['system']} {spec['dataset']}:\n{p.stderr[-3000:]}", file=log, flush=True)
        return {"error": p.stderr[-2000:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["loadavg_before"] = load
    print(f"{time.strftime('%H:%M:%S')} {spec['phase']:6} {spec['system']:19} {spec['dataset']:10} "
          f"{time.perf_counter() - t:7.1f}s load {load[0]:.1f}", file=log, flush=True)
    return out


def stream_rows(work: Path, name: str, stream: str, queries: int, warmup: int) -> Path:
    """Rows into the set's queries, for the warm-up and the measured queries of one stream of its
    report half, written once to WORK/streams so that every system's worker reads the same."""
    import numpy as np
    from bench.harness.streams import half_bounds, half_streams

    path = work / "streams" / f"{name}-{stream}-{queries}-{warmup}.npz"
    if path.exists():
        return path
    _, q, _, _ = load(work, name)
    if stream == "uniform":  # the report half in order, warmed up as the default run is
        lo, hi = half_bounds(len(q), "report")
        warm, rows = None, np.arange(lo, min(hi, lo + queries))
    else:  # bench/harness/streams.py's report-half stream
        drawn = half_streams(q, "report", warmup + queries)[stream]
        warm, rows = drawn[:warmup], drawn[warmup:]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, rows=rows, **({} if warm is None else {"warm": warm}))
    return path


def run_dataset(name, args, log) -> dict:
    """{key: result}: one key per stream searched ("<set>:<stream>"), or the set's name without --streams."""
    work = args.work
    prepare(work, name)
    _, _, _, meta = load(work, name)
    params = params_for(meta, args)
    res = {"meta": meta, "params": params, "systems": {}}
    base_spec = {"work": str(work), "dataset": name, "params": params}
    for s in sorted(args.systems, key=lambda s: s in BUILT_BY):  # variants after the builds they search
        if s in BUILT_BY:
            if BUILT_BY[s] not in res["systems"]:
                raise SystemExit(f"{s} searches the index of {BUILT_BY[s]}: run them together")
            res["systems"][s] = {"build": res["systems"][BUILT_BY[s]]["build"], "search": []}
            continue
        spec = {**base_spec, "phase": "build", "system": s, "index_dir": str(args.index_dir / name / s)}
        record = args.index_dir / name / f"{s}.build.json"
        if args.reuse_builds and record.exists() and json.loads(record.read_text()).get("params") == params:
            build = json.loads(record.read_text())  # built earlier with the same parameters, and timed then
        else:
            subprocess.run(["rm", "-rf", spec["index_dir"], str(record)])
            build = worker(spec, log)
            if "error" not in build:
                record.write_text(json.dumps(build))
        res["systems"][s] = {"build": build, "search": []}
    res["systems"] = {s: res["systems"][s] for s in args.systems}
    if args.build_only:
        return {name: res}
    out = {}
    for stream in args.streams or [None]:
        sres = {**res, "systems": {s: {"build": v["build"], "search": []} for s, v in res["systems"].items()}}
        extra = {}
        if stream:
            sres["stream"] = stream
            extra = {"stream": stream, "stream_rows": str(stream_rows(work, name, stream, args.queries, args.warmup))}
        for i, threads in enumerate(args.threads):
            order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]
            for s in order:
                if "error" in res["systems"][s]["build"]:
                    continue
                spec = {**base_spec, "phase": "search", "system": s,
                        "index_dir": str(args.index_dir / name / BUILT_BY.get(s, s)), "threads": [threads],
                        "queries": args.queries, "warmup": args.warmup, "sweep": SWEEPS[s],
                        "pin_cores": args.pin_cores, **extra}
                sres["systems"][s]["search"].append(worker(spec, log))
        out[f"{name}:{stream}" if stream else name] = sres
    for s in set(args.systems) - set(BUILT_BY):
        if not args.keep_indexes:
            subprocess.run(["rm", "-rf", str(args.index_dir / name / s), str(args.index_dir / name / f"{s}.build.json")])
    return out


def scaling(args, log, rows: list, save) -> None:
    """fusionrag build time against N on the clustered synthetic set (and a short search)."""
    for n in args.scaling:
        name = f"synth{n}"
        t = time.perf_counter()
        prepare(args.work, name)
        gen_s = time.perf_counter() - t
        _, _, _, meta = load(args.work, name)
        params = params_for(meta, args)
        idx = str(args.index_dir / name / "fusionrag")
        subprocess.run(["rm", "-rf", idx])
        spec = {"work": str(args.work), "dataset": name, "params": params, "system": "fusionrag", "index_dir": idx}
        b = worker({**spec, "phase": "build"}, log)
        s = worker({**spec, "phase": "search", "threads": [2], "queries": args.queries, "warmup": args.warmup,
                    "sweep": SWEEPS["fusionrag"][2:7]}, log)
        rows.append({"n": meta["count"], "dim": meta["dim"], "generate_s": gen_s, "build": b, "search": s})
        save()
        if not args.keep_indexes:
            subprocess.run(["rm", "-rf", idx])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "synth200k", "fashion", "minilm"])
    ap.add_argument("--systems", nargs="*", default=SYSTEMS)
    ap.add_argument("--scaling", nargs="*", default=[], help="synthetic sizes for the build-time curve, e.g. 100k 300k 1m")
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--streams", nargs="*", choices=["uniform", "skewed", "drifting"], default=[],
                    help="query streams of each set's report half (module docstring); default: its first QUERIES")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--buffer-fraction", type=int, default=16,
                    help="fusionrag page buffer (and DiskANN node cache) = raw vector bytes / this")
    ap.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="hold each search process to as many cores as it has threads (every system alike)")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("peers"))
    ap.add_argument("--index-dir", type=Path, help="where indexes are built (default WORK/idx); runs in parallel need their own")
    ap.add_argument("--tag", default="results")
    ap.add_argument("--keep-indexes", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="build (and keep) the indexes, search nothing")
    ap.add_argument("--reuse-builds", action="store_true",
                    help="search indexes kept by an earlier --build-only/--keep-indexes run with the same parameters, "
                         "reporting that run's build figures")
    args = ap.parse_args()
    args.keep_indexes |= args.build_only
    args.work = args.work.resolve()
    args.index_dir = (args.index_dir or args.work / "idx").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    log = sys.stdout
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out = {"started": started, "machine": machine(), "uptime_start": os.popen("uptime").read().strip(),
           "args": {k: str(v) for k, v in vars(args).items()}, "datasets": {}, "scaling": []}
    path = args.out / f"{args.tag}.json"

    def save():  # after every step, so a run cut short still leaves its tables
        out["uptime_end"] = os.popen("uptime").read().strip()
        out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path.write_text(json.dumps(out, indent=1))
        write_report(path)

    for name in args.datasets:
        out["datasets"].update(run_dataset(name, args, log))
        save()
    scaling(args, log, out["scaling"], save)


if __name__ == "__main__":
    main()
