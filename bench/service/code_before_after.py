"""Two checkouts of the code, the same answers and the same speed (#50: a refactor shows behaviour unchanged).

The code before is an install of an older commit into a directory of its own (BEFORE_SITE, e.g.
`git worktree add /tmp/before <commit> && pip install --no-deps --target /tmp/before-site /tmp/before`); the code
after is this checkout's install. Both read the same index directories and data directory, built once by the
code after (the formats are the same): a single index, a sharded one (2 shards, in this process) and a
collection served by `fusionrag serve`. For each, runs alternate A B B A (--rounds blocks), each in a fresh
interpreter:

- index and sharded: the query set searched in one batch (q/s), then its first --single queries one at a time
  (latency), ids and distances kept;
- service: `fusionrag serve` started on the data directory, --single searches of one vector each over HTTP, one
  after another (latency), the hits kept;
- sharded-service: the sharded index's HTTP app (after #50 step 3 the service's own app over a ShardedCatalog,
  ray_serve.replica_app; before it ray_serve's own app, create_app) under uvicorn, shards in its process, the same
  searches;
- collection-writes, sharded-writes (#69, the one local store): 400 writes, each durable when it returns (upserts of
  4 documents or vectors, some replacing earlier ones, deletes, metadata updates) to a new collection and to a copy
  of the sharded index; q/s is writes a second, p50 a write's latency; the answers are an exhaustive search after a
  merge and a reopen (the collection) or a reopen that replays every shard's log (the sharded index).

The answers of every run are compared with the first run's (ids equal, distances within 1e-6 relative): the
before and after code must give the same. Results: bench/results/service/code_before_after.json and .md.

    python -m bench.service.code_before_after --before-site /tmp/before-site [--set fashion] [--queries 2000]
        [--targets index,sharded] [--engine '{"raw_in_ram": "on"}'] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results
from bench.harness.sets import load, prepare  # noqa: E402

TARGETS = ("index", "sharded", "service", "sharded-service", "collection-writes", "sharded-writes")

WORKER = r"""
import json, sys, time
import numpy as np
from fusionrag.retriever import EngineConfig, Index
from fusionrag.retriever.sharded import ShardedIndex

path, kind, qfile, single, out, engine = sys.argv[1:7]
q = np.load(qfile)
engine = EngineConfig().with_overrides(**json.loads(engine))
index = (ShardedIndex if kind == "sharded" else Index).open(path, engine)
try:
    index.search(q[:64], 10)  # warm
    t = time.perf_counter()
    res = index.search(q, 10)
    batch_s = time.perf_counter() - t
    lat = []
    for i in range(int(single)):
        t = time.perf_counter()
        index.search(q[i:i + 1], 10)
        lat.append(time.perf_counter() - t)
finally:
    index.close()
np.savez(out, ids=res.ids, distances=res.distances)
print(json.dumps({"qps": len(q) / batch_s, "latency_s": lat}))
"""

WRITES = 400  # writes a -writes run makes

WRITER = r"""
import json, shutil, sys, time
import numpy as np

kind, src, qfile, out, scratch = sys.argv[1:6]  # and the writes to make
q = np.load(qfile)
rng = np.random.default_rng(7)
n_writes = int(sys.argv[6])
lat = []


def timed(call, *a, **kw):
    t = time.perf_counter()
    call(*a, **kw)
    lat.append(time.perf_counter() - t)


if kind == "collection-writes":
    # A fresh collection: upserts of 4 documents (a fifth replacing earlier ones), deletes, metadata updates, each
    # durable when it returns; then one merge, reopened, searched exhaustively.
    from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
    cfg = CollectionConfig(background_merge=False)
    cat = Catalog(scratch, collection_config=cfg)
    col = cat.create("w", q.shape[1], "l2")
    names = []
    for i in range(n_writes):
        r = rng.random()
        if names and r < 0.1:
            timed(col.delete, [names[j] for j in rng.integers(len(names), size=2)])
        elif names and r < 0.15:
            timed(col.set_metadata, {names[int(rng.integers(len(names)))]: {"i": i, "m": True}})
        else:
            docs = []
            for j in range(4):
                name = names[int(rng.integers(len(names)))] if names and rng.random() < 0.2 else f"d{len(names)}"
                if name == f"d{len(names)}":
                    names.append(name)
                docs.append(Document(name, f"text {i} {j}", q[(i * 4 + j) % len(q)] + 0.01 * j, {"i": i}))
            timed(col.upsert, docs)
    col.merge()
    cat.close()
    cat = Catalog(scratch, collection_config=cfg)
    col = cat.get("w")
    res = col.search(q[:200], k=10, params={"nprobe": 100000, "rerank": 100000})
    ids = [[int(h.id[1:]) for h in row] + [-1] * (10 - len(row)) for row in res.hits]
    dists = [[h.distance for h in row] + [0.0] * (10 - len(row)) for row in res.hits]
    count = len(col)
    cat.close()
else:
    # A copy of the built sharded index: upserts of 4 vectors (new ids and built ones replaced), deletes; searched
    # exhaustively, then reopened (each shard's log replayed) and searched again.
    from fusionrag.retriever.sharded import ShardedIndex
    shutil.copytree(src, scratch, dirs_exist_ok=True)
    ix = ShardedIndex.open(scratch)
    for i in range(n_writes):
        if rng.random() < 0.1:
            timed(ix.delete, rng.integers(0, 1000, size=2).astype(np.int64))
        else:
            new = np.where(rng.random(4) < 0.2, rng.integers(0, 1000, size=4), 10_000_000 + i * 4 + np.arange(4))
            new = np.unique(new.astype(np.int64))
            timed(ix.upsert, new, q[(i * 4 + np.arange(len(new))) % len(q)])
    ix.close()
    ix = ShardedIndex.open(scratch)
    res = ix.search(q[:200], 10, rerank=100000, beta=0)
    ids, dists, count = res.ids.tolist(), res.distances.tolist(), 0
    ix.close()
np.savez(out, ids=np.array(ids), distances=np.array(dists, np.float64))
print(json.dumps({"latency_s": lat, "qps": n_writes / sum(lat), "count": count}))
"""

CLIENT = r"""
import json, sys, time
import httpx
import numpy as np

url, qfile, single, out = sys.argv[1:5]
q = np.load(qfile)
ids, dists, lat = [], [], []
with httpx.Client(base_url=url, timeout=60) as c:
    for i in range(8):  # warm
        c.post("/v1/collections/c/search", json={"vectors": [q[i].tolist()], "k": 10}).raise_for_status()
    for i in range(int(single)):
        body = {"vectors": [q[i].tolist()], "k": 10}
        t = time.perf_counter()
        r = c.post("/v1/collections/c/search", json=body)
        lat.append(time.perf_counter() - t)
        r.raise_for_status()
        hits = r.json()["results"][0]
        ids.append([h["id"] for h in hits])
        dists.append([h["distance"] for h in hits])
np.savez(out, ids=np.array(ids), distances=np.array(dists, np.float64))
print(json.dumps({"latency_s": lat}))
"""


SHARDED_SERVER = r"""
import sys
import uvicorn
from fusionrag.retriever.sharded import ShardedIndex
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.server import ray_serve

path, port = sys.argv[1], int(sys.argv[2])
coll = ShardedCollection(ShardedIndex.open(path), "c")
app = ray_serve.replica_app(coll) if hasattr(ray_serve, "replica_app") else ray_serve.create_app(coll)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def interpreters(before_site: Path) -> dict[str, tuple[list[str], dict]]:
    """variant -> (command prefix, environment): before runs without site (so this checkout's editable install is
    not found) with BEFORE_SITE ahead of this environment's site-packages."""
    site = sysconfig.get_paths()["purelib"]
    before = {**os.environ, "PYTHONPATH": f"{before_site}{os.pathsep}{site}"}
    return {"before": ([sys.executable, "-S"], before), "after": ([sys.executable], dict(os.environ))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(cmd: list[str], env: dict, data: Path, qfile: Path, single: int, out: Path,
                sharded: Path | None = None) -> dict:
    """The service on data (or, sharded: the sharded index's app over that index) and CLIENT's searches."""
    port = free_port()
    log = open(out.with_suffix(".log"), "w")
    argv = ["-c", SHARDED_SERVER, str(sharded), str(port)] if sharded is not None else \
        ["-m", "fusionrag", "serve", "--data-dir", str(data), "--no-demo", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen([*cmd, *argv], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the service exited: see {out.with_suffix('.log')}")
            time.sleep(0.5)
        else:
            raise RuntimeError("the service did not become ready")
        p = subprocess.run([*cmd, "-c", CLIENT, f"http://127.0.0.1:{port}", str(qfile), str(single), str(out)],
                           env=env, capture_output=True, text=True, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def same(a: dict, b: dict) -> dict:
    ids_equal = bool(np.array_equal(a["ids"], b["ids"]))
    da, db = np.asarray(a["distances"], np.float64), np.asarray(b["distances"], np.float64)
    rel = float(np.max(np.abs(da - db) / np.maximum(np.abs(da), 1e-12))) if da.shape == db.shape else float("inf")
    return {"ids_equal": ids_equal, "max_rel_distance_diff": rel, "same": ids_equal and rel <= 1e-6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-site", type=Path, required=True)
    ap.add_argument("--before-label", default="", help="what the code before is (a commit)")
    ap.add_argument("--set", default="fashion")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--single", type=int, default=300, help="queries searched one at a time")
    ap.add_argument("--rounds", type=int, default=2, help="A B B A blocks")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("service"))
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of: " + ", ".join(TARGETS))
    ap.add_argument("--engine", default="{}", help="EngineConfig overrides (JSON) the index and sharded targets "
                    "open with, e.g. '{\"raw_in_ram\": \"on\"}': the same settings under either code's defaults")
    ap.add_argument("--name", default="code_before_after", help="the result files' name (.json, .md) in --out")
    args = ap.parse_args()
    targets = args.targets.split(",")
    if unknown := set(targets) - set(TARGETS):
        ap.error(f"unknown targets: {sorted(unknown)}")
    engine = json.loads(args.engine)

    prepare(args.work, args.set)
    base, q, gt, meta = load(args.work, args.set)
    work = args.work / "code_before_after"
    work.mkdir(parents=True, exist_ok=True)
    qfile = work / "queries.npy"
    np.save(qfile, np.ascontiguousarray(q[:args.queries], np.float32))
    fbin = args.work / "data" / args.set / "base.fbin"
    after_cmd = [sys.executable, "-m", "fusionrag"]
    built = {}
    for kind, extra in (("index", []), ("sharded", ["--shards", "2"])):
        path = work / kind
        if not any(t.startswith(kind) for t in targets):  # only what the targets search
            continue
        if not (path / "manifest.json").exists():
            t = time.perf_counter()
            subprocess.run([*after_cmd, "build", str(fbin), str(path), "--quiet", "--overwrite", *extra], check=True,
                           stdout=subprocess.DEVNULL)
            built[kind] = round(time.perf_counter() - t, 1)
    data = work / "data"
    if {"service", "sharded-service"} & set(targets) and not (data / "collections" / "c").exists():  # an earlier run's
        subprocess.run([*after_cmd, "import", str(data), "--collection", "c", "--vectors", str(fbin), "--metric",
                        meta["metric"], "--quiet"], check=True, stdout=subprocess.DEVNULL)

    envs = interpreters(args.before_site)
    order = [v for _ in range(args.rounds) for v in ("before", "after", "after", "before")]
    report = {"set": args.set, "queries": args.queries, "single": args.single, "order": order,
              "before": args.before_label, "after": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                   capture_output=True, text=True).stdout.strip(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_at_start": os.getloadavg()[0]},
              "built_s": built, "engine": engine, "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            runs, first = [], None
            for i, variant in enumerate(order):
                cmd, env = envs[variant]
                out = Path(tmp) / f"{target}-{i}.npz"
                if target.endswith("-writes"):
                    scratch = Path(tmp) / f"{target}-{i}"
                    p = subprocess.run([*cmd, "-c", WRITER, target, str(work / "sharded"), str(qfile), str(out),
                                        str(scratch), str(WRITES)], env=env, capture_output=True, text=True)
                    if p.returncode:
                        raise RuntimeError(p.stderr[-3000:])
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    shutil.rmtree(scratch, ignore_errors=True)
                elif target in ("service", "sharded-service"):
                    r = run_service(cmd, env, data, qfile, args.single, out,
                                    work / "sharded" if target == "sharded-service" else None)
                else:
                    p = subprocess.run([*cmd, "-c", WORKER, str(work / target), target, str(qfile),
                                        str(args.single), str(out), json.dumps(engine)], env=env, capture_output=True,
                                       text=True)
                    if p.returncode:
                        raise RuntimeError(p.stderr[-3000:])
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                ans = dict(np.load(out))
                first = first or ans
                lat = np.asarray(r["latency_s"])
                runs.append({"variant": variant, "qps": r.get("qps"), "p50_ms": float(np.median(lat) * 1e3),
                             "p99_ms": float(np.quantile(lat, 0.99) * 1e3), **same(first, ans)})
                print(target, runs[-1], flush=True)
            summary = {}
            for v in ("before", "after"):
                mine = [x for x in runs if x["variant"] == v]
                summary[v] = {"p50_ms": float(np.median([x["p50_ms"] for x in mine])),
                              "qps": None if mine[0]["qps"] is None else float(np.median([x["qps"] for x in mine]))}
            summary["p50_ratio_after_over_before"] = summary["after"]["p50_ms"] / summary["before"]["p50_ms"]
            if summary["after"]["qps"]:
                summary["qps_ratio_after_over_before"] = summary["after"]["qps"] / summary["before"]["qps"]
            summary["answers_same_in_every_run"] = all(x["same"] for x in runs)
            report["targets"][target] = {"runs": runs, **summary}
    report["machine"]["load_at_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Code before ({args.before_label or 'before'}) and after ({report['after']}): same answers, same "
             "speed", "",
             f"{args.set}, {args.queries} queries in one batch (q/s), the first {args.single} one at a time "
             f"(p50 latency); runs {' '.join(order)}; {os.cpu_count()} CPUs, load {report['machine']['load_at_start']:.2f}"
             f" at the start; index and sharded opened with {json.dumps(engine)}. Every run's answers compared with "
             f"the first run's. The -writes targets: {WRITES} writes, "
             "each durable when it returns (q/s: writes a second; p50: a write's latency), then an exhaustive search "
             "(the module's docstring).", "",
             "| target | answers the same in every run | q/s before | q/s after | ratio | p50 ms before | p50 ms after "
             "| ratio |", "|---|---|---|---|---|---|---|---|"]
    for target, t in report["targets"].items():
        qb, qa = t["before"]["qps"], t["after"]["qps"]
        lines.append(f"| {target} | {'yes' if t['answers_same_in_every_run'] else 'NO'} | "
                     f"{'' if qb is None else f'{qb:,.0f}'} | {'' if qa is None else f'{qa:,.0f}'} | "
                     f"{t.get('qps_ratio_after_over_before', float('nan')):.3f} | {t['before']['p50_ms']:.3f} | "
                     f"{t['after']['p50_ms']:.3f} | {t['p50_ratio_after_over_before']:.3f} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(t["answers_same_in_every_run"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
