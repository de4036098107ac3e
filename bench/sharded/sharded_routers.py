"""One router replica against two following a leader (docs/sharded.md, "More than one router replica"), over HTTP
through Ray Serve, in the same run (not a test).

A sharded index of a real set (--shards parts, hotness placement) is served from a two-node Ray cluster on
127.0.0.1, in a network and PID namespace of the run's own (`unshare --net --pid`, as the tests run Ray: nothing
listens or dials outside loopback, every process ends with the run). For each --routers value in turn the service
is started, warmed, and asked the second half of the set's queries (the first half is not used: nothing is tuned
here, every router searches at the index's calibrated defaults):
- sequential: one query per request, one request at a time: latency p50 / p99;
- loaded: --clients threads, each one query per request for --seconds: QPS, latency p50 / p99;
- CPU: the seconds each kind of process used during the loaded phase (/proc), per query: the HTTP proxy, the router
  replicas, the leader (views and nothing else here: no writes), the shards, this client;
- recall@10 of the sequential answers against the set's ground truth (followers answer as the router does).

On a machine of few cores every process shares them: the loaded QPS says what the extra hop costs there, not what
replicas on more nodes give. The routers' CPU per query is what a deployment divides among its router replicas.
Serve's proxy is told to spread requests over both nodes' replicas (RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0):
the nodes are one machine here.

    python -m bench.sharded.sharded_routers [--set minilm] [--shards 2] [--routers 1 2] [--clients 8] [--seconds 20] \
        [--out bench/results/sharded/sharded_routers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.harness.paths import ROOT, WORK, tests_module
from bench.harness.paths import results as results_dir
from bench.harness.sets import load  # noqa: E402

HTTP_PORT = 8393
KINDS = {"proxy": b"ray::ProxyActor", "routers": b"ray::ServeReplica:fusionrag:fusionrag-router",
         "leader": b"ray::ServeReplica:fusionrag:fusionrag-leader", "board": b"ray::ViewBoard",
         "shards": b"ray::ShardServer"}


def post(path: str, body: dict) -> tuple[dict, str | None]:
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}", json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), r.headers.get("x-fusionrag-router")


def cpu_seconds() -> dict[str, float]:
    """utime + stime of every process of each kind (KINDS), and of this process, now."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(KINDS, 0.0)
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            kind = next((k for k, prefix in KINDS.items() if cmd.startswith(prefix)), None)
            if kind is None and proc.name != str(os.getpid()):
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            secs = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
        out[kind or "client"] = out.get(kind or "client", 0.0) + secs
    return out


def measure(q: np.ndarray, gt: np.ndarray, clients: int, seconds: float) -> dict:
    path = "/v1/collections/bench/search"
    for v in q[:50]:  # warm: pages, Serve's connections
        post(path, {"vectors": [v.tolist()], "k": 10})
    lat, ids, who = [], [], set()
    for v in q:
        t = time.perf_counter()
        body, router = post(path, {"vectors": [v.tolist()], "k": 10})
        lat.append(time.perf_counter() - t)
        ids.append([int(h["id"]) for h in body["results"][0]])
        who.add(router)
    recall = float(np.mean([len(set(a) & set(b[:10].tolist())) / 10 for a, b in zip(ids, gt)]))
    out = {"sequential_ms": {"p50": round(1000 * float(np.median(lat)), 2),
                             "p99": round(1000 * float(np.quantile(lat, 0.99)), 2)},
           "recall@10": round(recall, 4)}
    done, lat2, stop = [], [], threading.Event()

    def client(c: int) -> None:
        i, mine, seen = c, [], set()
        while not stop.is_set():
            t = time.perf_counter()
            _, router = post(path, {"vectors": [q[i % len(q)].tolist()], "k": 10})
            mine.append(time.perf_counter() - t)
            seen.add(router)
            i += clients
        lat2.extend(mine)
        done.append(seen)

    cpu0, t0 = cpu_seconds(), time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall, cpu1 = time.perf_counter() - t0, cpu_seconds()
    n = len(lat2)
    out["loaded"] = {"clients": clients, "queries": n, "qps": round(n / wall, 1),
                     "p50_ms": round(1000 * float(np.median(lat2)), 2),
                     "p99_ms": round(1000 * float(np.quantile(lat2, 0.99)), 2),
                     "replicas_answering": len(set().union(*done) - {None}),
                     "cpu_ms_per_query": {k: round(1000 * (cpu1.get(k, 0) - cpu0.get(k, 0)) / n, 3) for k in cpu1}}
    out["replicas_answering_sequential"] = len(who - {None})
    return out


def child(args) -> None:
    ray_namespace = tests_module("ray_namespace")  # the tests' Ray cluster on loopback (tests/ray_namespace.py)
    PORT, ray_cluster = ray_namespace.PORT, ray_namespace.ray_cluster

    work = Path(args.work)
    _, queries, gt, _ = load(WORK, args.set)
    half = len(queries) // 2  # the second half reports; nothing is chosen on the first
    q, g = np.ascontiguousarray(queries[half:], dtype=np.float32), gt[half:]
    results = []
    with ray_cluster(2, env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}):
        from ray import serve as rserve

        from fusionrag.server.ray_serve import serve

        for routers in args.routers:
            t = time.perf_counter()
            serve(f"127.0.0.1:{PORT}", work / "idx", "127.0.0.1", HTTP_PORT, name="bench", block=False,
                  routers=routers)
            start = time.perf_counter() - t
            print(f"routers={routers}: serving after {start:.1f} s", file=sys.stderr, flush=True)
            r = measure(q, g, args.clients, args.seconds)
            r["serve_start_s"], r["routers"] = round(start, 1), routers
            results.append(r)
            print(f"routers={routers}: {json.dumps(r)}", file=sys.stderr, flush=True)
            rserve.delete("fusionrag")
            time.sleep(3)  # the replicas, and with them the shard actors, gone
        rserve.shutdown()
    print(json.dumps(results), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="minilm")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--routers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--work", default=str(WORK / "sharded_routers"))
    ap.add_argument("--out", default=str(results_dir("sharded") / "sharded_routers"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from fusionrag.retriever.engine.config import BuildConfig
    from fusionrag.retriever.sharded.build import build_sharded

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base, queries, _, meta = load(WORK, args.set)
    if not (work / "idx").exists():
        t = time.perf_counter()
        build_sharded(np.ascontiguousarray(base, dtype=np.float32), work / "idx", args.shards,
                      BuildConfig(metric=meta["metric"]), progress=False)
        print(f"built in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
           'ip link set lo up && exec "$@"', "sh", sys.executable, "-m", __spec__.name, "--child", *sys.argv[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    (work / "child.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}); its stderr: {work / 'child.stderr'}\n"
                         f"{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {"set": args.set, "count": meta["count"], "dim": meta["dim"], "shards": args.shards,
              "queries_reported": len(queries) - len(queries) // 2, "clients": args.clients,
              "seconds": args.seconds, "machine": f"{platform.node()} ({os.cpu_count()} cores)",
              "runs": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    lines = [f"# One router replica against two following a leader ({r['set']}, {r['count']:,} x {r['dim']}, "
             f"{r['shards']} shards)", "",
             f"`bench/sharded/sharded_routers.py`, {r['machine']}; two Ray nodes on one machine; one query per request over "
             f"HTTP; runs in the order listed; the set's second half of queries ({r['queries_reported']}); loaded: "
             f"{r['clients']} clients for {r['seconds']:.0f} s.", "",
             "| routers | recall@10 | sequential p50 / p99 ms | loaded QPS | loaded p50 / p99 ms | replicas answering "
             "| CPU ms per query: proxy / routers / leader / board / shards / client |",
             "|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        c, ld, seq = x["loaded"]["cpu_ms_per_query"], x["loaded"], x["sequential_ms"]
        lines.append(f"| {x['routers']} | {x['recall@10']} | {seq['p50']} / {seq['p99']} | "
                     f"{ld['qps']} | {ld['p50_ms']} / {ld['p99_ms']} | {ld['replicas_answering']} | "
                     f"{c['proxy']} / {c['routers']} / {c['leader']} / {c['board']} / {c['shards']} / "
                     f"{c.get('client', 0)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
