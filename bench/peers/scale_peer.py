"""A peer at the same scale and memory (#51 item 6): DiskANN's SSD index beside fusionrag's on a set of
bench/peers/scale_table.py, each built and searched alone in a v1 memory cgroup of the same cap (a third of the raw
vectors, at least 256 MiB), in the same run.

    python -m bench.peers.scale_peer --n 1000000 [--dim 128]   (needs scale_table's row for N: data and index)

- DiskANN (diskannpy 0.7.0, bench/work/diskann-venv, `make bench` makes it): R 64, L_build 100, its build memory
  limit set to fusionrag's build budget for that cap (the manifest's build_memory_budget_bytes: a quarter of the
  limit), its search memory (the PQ codes it keeps in RAM) to the bytes fusionrag's in-RAM tiers take a vector (graph,
  list ids, slot map and PQ codes, scale_table's tier bytes) times N; beam width 4, no nodes cached.
- fusionrag: the index scale_table built there, searched again in this run at the points scale_table chose on the
  tune half (and at its defaults).
- Searches alternate (fusionrag, DiskANN, fusionrag, DiskANN), each a process of its own in a fresh cgroup, the
  index's files dropped from the page cache first; 2 threads each; recall@10 and q/s on the 500 report queries,
  DiskANN's L chosen on the 500 tune queries as fusionrag's points were. Ratios are of the same run's medians.

Writes bench/results/peers/scale_peer.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import drop_cache
from bench.harness.paths import WORK, module_argv, results
from bench.peers.scale_table import in_cgroup, tier_bytes, work

OUT = results("peers")
VENV = WORK / "diskann-venv" / "bin" / "python"
WORKER = Path(__file__).with_name("diskann_worker.py")
SWEEP = [10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 320]
THREADS = min(2, os.cpu_count() or 1)
ROOM = 16 << 30  # DiskANN killed in the cap (for memory) runs again in a cgroup this large, its figures then labelled


def fbin(d: Path) -> Path:
    """base.npy as DiskANN's .fbin (int32 count, int32 dim, float32 rows), written a chunk at a time."""
    out = d / "diskann" / "base.fbin"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    base = np.load(d / "base.npy", mmap_mode="r")
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.array(base.shape, np.int32).tofile(f)
        for lo in range(0, len(base), 1 << 18):
            np.ascontiguousarray(base[lo:lo + (1 << 18)], np.float32).tofile(f)
    os.replace(tmp, out)
    return out


def diskann(what: str, spec: dict, cap: int, log: Path) -> tuple[dict, dict]:
    """DiskANN's build or search in a cgroup of cap; where it is killed there (for memory: its own limits are
    not the process's), again in one of ROOM bytes (its peak memory then measured, not bounded), the first attempt's
    end recorded."""
    try:
        r, run = in_cgroup(cap, [str(VENV), str(WORKER), what, json.dumps(spec)], log, f"DiskANN {what}")
        return json.loads(r.stdout.strip().splitlines()[-1]), {**run, "cap_bytes": cap}
    except SystemExit as e:
        failed = {"cap_bytes": cap, "failed": str(e), "log_tail": log.read_text()[-600:] if log.exists() else ""}
    r, run = in_cgroup(ROOM, [str(VENV), str(WORKER), what, json.dumps(spec)], log, f"DiskANN {what}")
    return json.loads(r.stdout.strip().splitlines()[-1]), {**run, "cap_bytes": ROOM, "at_the_cap": failed}


def ours_worker(d: Path) -> None:
    """fusionrag's index in d at the defaults and at scale_table's chosen points, on the report half."""
    import fusionrag.retriever as fr

    q, truth = np.load(d / "queries.npy"), np.load(d / "truth.npy")
    report = slice(500, 1000)
    chosen = json.loads((d / "search.json").read_text())
    base = np.load(d / "base.npy", mmap_mode="r")
    rng = np.random.default_rng(1)
    rows = np.sort(rng.choice(len(base), 300, replace=False))
    warm = (np.asarray(base[rows]) + 0.05 * rng.standard_normal((300, base.shape[1]), dtype=np.float32))
    idx = fr.Index.open(str(d / "index"), threads=THREADS)
    idx.search(warm, k=10)

    def measure(**kw):
        qq = np.ascontiguousarray(q[report])
        t = time.perf_counter()
        r = idx.search(qq, k=10, **kw)
        s = time.perf_counter() - t
        rec = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(r.ids.tolist(), truth[report].tolist())]))
        return {"recall@10": rec, "qps": len(qq) / s, **({"params": kw} if kw else {})}

    out = {"defaults": measure()}
    for key in ("at_0.90", "at_0.95"):
        point = (chosen.get(key) or {}).get("params")
        out[key] = measure(**point) if point else None
    idx.close()
    print(json.dumps(out))


def run_n(n: int, dim: int, cap_share: float, floor_mib: int, rounds: int) -> dict:
    d = work(n, dim)
    if not (d / "search.json").exists():
        raise SystemExit(f"{d}: no scale_table row for {n:,} (run python -m bench.peers.scale_table --n {n})")
    cap = max(int(n * dim * 4 * cap_share), floor_mib << 20)
    built = json.loads((d / "build.json").read_text())
    tiers = tier_bytes(d / "index", n)
    budget = built.get("budget_bytes") or cap // 4
    in_ram = (tiers["host_per_vector"] + tiers["pq_per_vector"]) * n
    out_dir = d / "diskann" / "index"
    record = {"n": n, "dim": dim, "measured": time.strftime("%Y-%m-%d"), "cap_bytes": cap, "build_budget_bytes": budget,
              "search_memory_bytes": in_ram,
              "fusionrag_build": {k: built.get(k) for k in ("build_s", "peak_anon_bytes_last_run", "read_bytes_last_run")}}
    spec = {"base": str(fbin(d)), "out": str(out_dir), "build_gb": budget / 2**30, "search_gb": in_ram / 2**30,
            "r": 64, "l_build": 100, "threads": THREADS}
    done = d / "diskann" / "build.json"
    if done.exists():
        record["diskann_build"] = json.loads(done.read_text())
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        drop_cache(Path(spec["base"]))
        load0 = os.getloadavg()
        got, run = diskann("build", spec, cap, d / "diskann" / "build_failed.log")
        record["diskann_build"] = {**got, "peak_anon_bytes": run["peak_anon_bytes"], "read_bytes": run["read_bytes"],
                                   "cpu_s": run["cpu_s"], "oom_kills": run["oom_kills"], "load_at_start": load0,
                                   "load_at_end": os.getloadavg(), "spec": spec, "cap_bytes": run["cap_bytes"],
                                   "at_the_cap": run.get("at_the_cap")}
        done.write_text(json.dumps(record["diskann_build"], indent=1))
    record["diskann_disk_bytes"] = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    search_spec = {"out": spec["out"], "queries": str(d / "queries.npy"), "truth": str(d / "truth.npy"),
                   "base_npy": str(d / "base.npy"), "dim": dim, "threads": THREADS, "w": 4, "cache_nodes": 0,
                   "sweep": SWEEP}
    record["rounds"] = []
    for i in range(rounds):
        drop_cache(d / "index")
        r, run = in_cgroup(cap, module_argv(__spec__.name, "--ours-worker", str(d)), d / "peer_ours_failed.log",
                           "fusionrag's search")
        ours = {**json.loads(r.stdout.strip().splitlines()[-1]), "peak_anon_bytes": run["peak_anon_bytes"]}
        drop_cache(out_dir)
        theirs, run = diskann("search", search_spec, cap, d / "diskann" / "search_failed.log")
        theirs.update(peak_anon_bytes=run["peak_anon_bytes"], cap_bytes=run["cap_bytes"], at_the_cap=run.get("at_the_cap"))
        record["rounds"].append({"fusionrag": ours, "diskann": theirs})
        print(json.dumps({"n": n, "round": i, "fusionrag": {k: ours[k] for k in ("at_0.90", "at_0.95")},
                          "diskann": {k: theirs[k] for k in ("at_0.90", "at_0.95")}}), flush=True)
    for target in ("at_0.90", "at_0.95"):
        ours = [r["fusionrag"][target]["qps"] for r in record["rounds"] if r["fusionrag"].get(target)]
        theirs = [r["diskann"][target]["qps"] for r in record["rounds"] if r["diskann"].get(target)]
        record[f"{target}_qps_median"] = {"fusionrag": float(np.median(ours)) if ours else None,
                                          "diskann": float(np.median(theirs)) if theirs else None}
        record[f"{target}_ratio"] = (float(np.median(ours) / np.median(theirs)) if ours and theirs else None)
    return record


def report(records: list[dict]) -> None:
    mib = lambda b: f"{b / (1 << 20):,.0f}"  # noqa: E731
    lines = [f"# fusionrag against DiskANN at the same scale and memory ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.peers.scale_peer` on this machine ({os.cpu_count()} CPUs, no swap): the sets of "
             "[scale_table](scale_table.md) (clustered synthetic float32, 128-d), each build and search alone in a "
             "v1 memory cgroup of a third of the raw vectors (at least 256 MiB). DiskANN (diskannpy 0.7.0, R 64, L "
             "100): its build memory limit fusionrag's build budget, its search memory fusionrag's in-RAM tiers; "
             f"{THREADS} threads each; searches alternated, each round a process of its own with the files dropped "
             "from the page cache; recall@10 / q/s on the 500 report queries at the points chosen on the other 500; "
             "ratios of the rounds' medians.", "",
             f"Where DiskANN was killed in the cap (for memory), it ran again in a cgroup of {ROOM >> 30} GiB, its peak "
             "memory then measured, not bounded: its cap column says so.", "",
             "| N | cap MiB (fusionrag / DiskANN build, search) | build s (fusionrag / DiskANN) | build peak anon MiB | "
             "DiskANN disk GB | at 0.90: fusionrag | DiskANN (L) | ratio | at 0.95: fusionrag | DiskANN (L) | ratio |",
             "|---:|---|---|---|---|---|---|---:|---|---|---:|"]
    for r in records:
        fb, db = r["fusionrag_build"], r["diskann_build"]
        last = r["rounds"][-1]

        def cell(x):
            return "-" if not x else f"{x['recall@10']:.3f} / {x['qps']:,.0f}" + (f" ({x['L']})" if "L" in x else "")
        lines.append(
            f"| {r['n']:,}{' (' + r['note'] + ')' if r.get('note') else ''} | {mib(r['cap_bytes'])} / {mib(db['cap_bytes'])}, {mib(last['diskann']['cap_bytes'])} | "
            f"{fb['build_s']:,.0f} / {db['build_s']:,.0f} | "
            f"{mib(fb['peak_anon_bytes_last_run'])} / {mib(db['peak_anon_bytes'])} | {r['diskann_disk_bytes'] / 1e9:.2f} | "
            f"{cell(last['fusionrag']['at_0.90'])} | {cell(last['diskann']['at_0.90'])} | "
            f"{r['at_0.90_ratio'] or 0:.2f} | {cell(last['fusionrag']['at_0.95'])} | {cell(last['diskann']['at_0.95'])} | "
            f"{r['at_0.95_ratio'] or 0:.2f} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale_peer.md").write_text("\n".join(lines) + "\n")
    (OUT / "scale_peer.json").write_text(json.dumps(records, indent=1, default=float))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="*", default=[1_000_000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cap-share", type=float, default=1 / 3)
    p.add_argument("--floor-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ours-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ours_worker:
        return ours_worker(args.ours_worker)
    if not VENV.exists():
        raise SystemExit(f"{VENV} is missing: make bench makes it (bench/harness/requirements-diskann.txt)")
    fresh = [run_n(n, args.dim, args.cap_share, args.floor_mib, args.rounds) for n in args.n]
    kept = []  # rows of other N measured before stay, each with the fusionrag build it was measured against
    if (OUT / "scale_peer.json").exists():
        kept = [r for r in json.loads((OUT / "scale_peer.json").read_text()) if r["n"] not in args.n]
    report(sorted(kept + fresh, key=lambda r: r["n"]))


if __name__ == "__main__":
    sys.exit(main())
