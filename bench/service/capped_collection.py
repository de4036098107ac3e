"""A collection served inside a memory cgroup capped at a third of its raw vectors (#51 item 2): `fusionrag serve`
opens it with nothing but the cgroup to tell it the limit, answers held-out queries, takes deletes and upserts
through the HTTP API and merges them in the background, then answers again; the same queries are first answered
by the same index without the cap, in the same run.

Data: clustered synthetic float32 (4,000 Gaussian centres, sd 0.3), imported uncapped with `fusionrag import`
(the build under a cap is tests/retriever/test_build_memory.py's and docs/engine.md's). The cgroup (v1, no swap)
holds the server alone (the collection's files are dropped from the page cache first, so the capped server reads
what it uses itself); its peak anonymous memory (memory.stat total_rss, sampled every 0.1 s) is taken by phase,
and the kernel's OOM kills are counted. Recall@10 is against brute force over what the collection holds then.

    python -m bench.service.capped_collection [--n 4000000] [--dim 128] [--cap-share 0.3333]

Needs root for /sys/fs/cgroup/memory. Writes bench/results/service/capped_collection_<n>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import Sampler, drop_cache
from bench.harness.paths import WORK, results, tests_module

ServerProcess = tests_module("server_util").ServerProcess  # the tests' own (tests/server_util.py)
Cgroup = tests_module("cgroup").Cgroup

from fusionrag.client import Client  # noqa: E402
from fusionrag.retriever.collection import Document  # noqa: E402
from fusionrag.retriever.errors import UnavailableError  # noqa: E402


def topk(q: np.ndarray, parts, k: int = 10) -> np.ndarray:
    """Exact top-k ids over (ids, vectors) parts."""
    best_d = np.full((len(q), k), np.inf, np.float32)
    best_i = np.zeros((len(q), k), np.int64)
    qq = (q * q).sum(1)[:, None]
    for ids, xb in parts:
        dd = qq + (xb * xb).sum(1)[None] - 2 * q @ xb.T
        d = np.concatenate([best_d, dd], 1)
        i = np.concatenate([best_i, np.broadcast_to(ids, dd.shape)], 1)
        o = np.argsort(d, 1)[:, :k]
        best_d, best_i = np.take_along_axis(d, o, 1), np.take_along_axis(i, o, 1)
    return best_i


def prepare(d: Path, n: int, dim: int, new_n: int, dead_n: int) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    centres = rng.standard_normal((4000, dim)).astype(np.float32)

    def sample(count):
        return centres[rng.integers(0, len(centres), count)] + 0.3 * rng.standard_normal((count, dim)).astype(
            np.float32)

    if not (d / "truth_after.npy").exists():
        base = np.lib.format.open_memmap(d / "base.npy", "w+", np.float32, (n, dim))
        for lo in range(0, n, 100_000):
            base[lo:lo + 100_000] = sample(min(100_000, n - lo))
        base.flush()
        new, q = sample(new_n), sample(1000)[500:]  # the second half: nothing was tuned on these
        dead = rng.choice(n, dead_n, replace=False)
        alive = np.ones(n, bool)
        alive[dead] = False
        chunks = [(np.arange(lo, min(n, lo + 100_000)), np.asarray(base[lo:lo + 100_000])) for lo in range(0, n, 100_000)]
        np.save(d / "truth_before.npy", topk(q, chunks))
        chunks = [(ids[alive[ids]], x[alive[ids]]) for ids, x in chunks] + [(n + np.arange(new_n), new)]
        np.save(d / "new.npy", new)
        np.save(d / "queries.npy", q)
        np.save(d / "dead.npy", dead)
        np.save(d / "truth_after.npy", topk(q, chunks))
    if not (d / "imported").exists():
        shutil.rmtree(d / "importing", ignore_errors=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fusionrag", "import", str(d / "importing"), "--collection", "big",
                        "--vectors", str(d / "base.npy"), "--metric", "l2", "--quiet"], check=True)
        (d / "importing" / "import_seconds").write_text(str(time.perf_counter() - t))
        (d / "importing").rename(d / "imported")
    return {k: np.load(d / f"{k}.npy") for k in ("new", "queries", "dead", "truth_before", "truth_after")}


def ids_of(hits, n: int) -> np.ndarray:
    return np.array([[n + int(h.id[1:]) if h.id.startswith("n") else int(h.id) for h in row] for row in hits])


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found.tolist(), truth.tolist())]))


def search(c: Client, q: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    t = time.perf_counter()
    found = np.concatenate([ids_of(c.search("big", q[s:s + 50], k=10).hits, n) for s in range(0, len(q), 50)])
    return found, len(q) / (time.perf_counter() - t)


def run(args) -> dict:
    d = WORK / "capped" / f"{args.n}x{args.dim}"
    data = prepare(d, args.n, args.dim, args.new, args.dead)
    raw = args.n * args.dim * 4
    cap = int(raw * args.cap_share)
    out = {"n": args.n, "dim": args.dim, "raw_bytes": raw, "cap_bytes": cap, "machine": f"{os.cpu_count()} CPUs",
           "import_seconds": float((d / "imported" / "import_seconds").read_text()), "load": os.getloadavg()}
    q, n = data["queries"], args.n
    served = d / "served"
    shutil.rmtree(served, ignore_errors=True)
    shutil.copytree(d / "imported", served)

    free = ServerProcess(served, d / "free.log", "--no-demo")
    try:
        free.wait_ready()
        with Client(free.url, timeout=300) as c:
            search(c, q[:50], n)  # warm
            found, qps = search(c, q, n)
            out["uncapped"] = {"recall@10": recall(found, data["truth_before"]), "qps": qps,
                               "tiers": c.info("big").tiers}
        reference = found
    finally:
        free.stop()

    # The uncapped server's page cache is charged to its own cgroup, not the capped one's: dropped, so the capped
    # server reads (and holds, within its limit) what it uses itself.
    drop_cache(served)
    cg = Cgroup(cap)
    sampler = Sampler(cg, phase="open")
    srv = ServerProcess(served, d / "capped.log", "--no-demo", cgroup=cg)
    try:
        srv.wait_ready(600)
        with Client(srv.url, timeout=600) as c:
            out["capped_tiers"] = c.info("big").tiers
            sampler.phase = "search"
            search(c, q[:50], n)
            found, qps = search(c, q, n)
            out["capped"] = {"recall@10": recall(found, data["truth_before"]), "qps": qps,
                             "same_answers_as_uncapped": bool(np.array_equal(found, reference))}
            sampler.phase = "writes"
            t = time.perf_counter()
            dead = [str(i) for i in data["dead"].tolist()]
            for s in range(0, len(dead), 1000):
                c.delete("big", dead[s:s + 1000])
            refused = 0
            new = data["new"]
            for s in range(0, len(new), 512):
                batch = [Document(id=f"n{j}", vector=new[j]) for j in range(s, min(len(new), s + 512))]
                while True:
                    try:
                        c.upsert("big", batch)
                        break
                    except UnavailableError:  # the fresh tier full while a merge runs
                        refused += 1
                        time.sleep(1)
            out["writes"] = {"deleted": len(dead), "upserted": len(new), "seconds": time.perf_counter() - t,
                             "upserts_refused_503": refused}
            sampler.phase = "merges"
            t = time.perf_counter()
            while True:
                state = c.info("big").build_state
                if not state["merging"] and state["generation"] >= 2 and not state["deleted"] and (
                        state["fresh"] < 20000):
                    break
                if srv.proc.poll() is not None or time.perf_counter() - t > 3600:
                    break
                time.sleep(2)
            out["merges"] = {"seconds_after_writes": time.perf_counter() - t, "build_state": state}
            manifest = json.loads((served / "collections" / "big" / f"gen-{state['generation']:06d}" / "index" /
                                   "manifest.json").read_text())
            out["merges"]["last"] = manifest.get("merge")
            sampler.phase = "search after"
            _, cold = search(c, q, n)  # the new generation's mapped files are read from disk as they are first used
            found, qps = search(c, q, n)
            out["after"] = {"recall@10": recall(found, data["truth_after"]), "qps": qps, "qps_first_pass": cold,
                            "count": c.count("big")}
    finally:
        alive = srv.proc.poll() is None
        srv.stop()
        sampler.stop()
        out["server_alive_to_the_end"] = alive
        out["oom_kills"] = cg.oom_kills()
        out["peak_anon_bytes"] = sampler.peak
        cg.remove()
    return out


def report(r: dict) -> str:
    mib = lambda b: f"{b / (1 << 20):,.0f}"  # noqa: E731
    peaks = ", ".join(f"{k} {mib(v)}" for k, v in r["peak_anon_bytes"].items())
    return f"""# A collection served in a cgroup at {r['cap_bytes'] / r['raw_bytes']:.2f} of its raw vectors

`python -m bench.service.capped_collection --n {r['n']} --dim {r['dim']}` on this machine ({r['machine']}, load
{r['load'][0]:.1f} at the start). {r['n']:,} x {r['dim']} clustered float32 ({mib(r['raw_bytes'])} MiB raw), imported
uncapped in {r['import_seconds']:,.0f} s; `fusionrag serve` inside a memory cgroup of {mib(r['cap_bytes'])} MiB (v1, no
swap), nothing else telling it the limit; 500 held-out queries, k=10, 50 to a request.

| | recall@10 | q/s |
|---|---|---|
| uncapped (same index, same run) | {r['uncapped']['recall@10']:.3f} | {r['uncapped']['qps']:,.0f} |
| capped | {r['capped']['recall@10']:.3f} | {r['capped']['qps']:,.0f} |
| capped, after the writes and merges (second pass; the first {r['after']['qps_first_pass']:,.0f} q/s) | {r['after']['recall@10']:.3f} | {r['after']['qps']:,.0f} |

- Same answers capped as uncapped: {r['capped']['same_answers_as_uncapped']}.
- Capped tiers: codes mapped {r['capped_tiers'].get('pq_mapped')}, lists mapped {r['capped_tiers'].get('lists_mapped')},
  page buffer {mib(r['capped_tiers']['page_buffer_bytes'])} MiB; host index {mib(r['capped_tiers']['host_index_bytes'])} MiB.
- Writes: {r['writes']['deleted']:,} deletes and {r['writes']['upserted']:,} upserts through the HTTP API in
  {r['writes']['seconds']:,.0f} s ({r['writes']['upserts_refused_503']} upserts answered 503 and sent again); the
  merges done {r['merges']['seconds_after_writes']:,.0f} s after; the last merge: {r['merges']['last']}.
- Count after: {r['after']['count']:,}. Server alive to the end: {r['server_alive_to_the_end']}; OOM kills in the
  cgroup: {r['oom_kills']}.
- Peak anonymous memory of the cgroup by phase (MiB): {peaks}.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cap-share", type=float, default=1 / 3)
    p.add_argument("--new", type=int, default=40_000)
    p.add_argument("--dead", type=int, default=20_000)
    args = p.parse_args()
    r = run(args)
    dest = results("service")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"capped_collection_{args.n}.json").write_text(json.dumps(r, indent=1, default=str))
    (dest / f"capped_collection_{args.n}.md").write_text(report(r))
    print(report(r))


if __name__ == "__main__":
    main()
