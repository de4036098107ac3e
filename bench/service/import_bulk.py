"""Bulk import vs the documents endpoint, through the real service: documents per second and the server's
peak RSS, on the Python docs (39,678 paragraphs with their all-MiniLM-L6-v2 vectors and a JSON-lines
sidecar of ids, texts and metadata) and on 1M synthetic 64-d vectors.

Each way runs against a fresh service on its own data directory (`--no-demo`): the import is one multipart
POST of the vector file and the sidecar, then polling the collection's info until the import is done (and
its index built); the endpoint is POSTs of 1024 documents each (vectors as JSON) until every one is
acknowledged, the service folding them into its index by background merges meanwhile (each 20,000
documents; `settled_seconds` is when the last of them has finished, and what is then indexed or still in
the fresh tier).

    python -m bench.service.import_bulk [--sets docs synth1m] [--work bench/work/import]

The Python-docs vectors come from bench/service/hybrid.py's work folder (it embeds them once). Writes
bench/results/service/import_bulk.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np

from bench.harness.paths import BENCH as ROOT
from bench.harness.paths import results, tests_module

ServerProcess = tests_module("server_util").ServerProcess  # the tests' own (tests/server_util.py)

from fusionrag.retriever.engine.vectors import write_bin  # noqa: E402

SHARED = ROOT.parents[1] / "shared" / "data"
BATCH = 1024


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prepare(name: str, work: Path) -> tuple[Path, Path | None, int, int, str]:
    """(vector file, sidecar or None, count, dimension, metric)."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    if name == "docs":
        emb = np.load(ROOT / "work" / "hybrid" / "paragraphs.npy")  # bench/service/hybrid.py makes it
        with gzip.open(SHARED / "python311-docs-paragraphs" / "paragraphs.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f]
        first = {}
        for r in rows:
            first.setdefault(r["text"], r)
        if not (d / "docs.jsonl").exists():
            with open(d / "docs.jsonl", "w") as f:
                for i, (text, r) in enumerate(first.items()):
                    f.write(json.dumps({"id": r["id"], "text": text,
                                        "metadata": {"doc": r["doc"], "section": r["section"]}}) + "\n")
            write_bin(d / "vectors.fbin", emb)
        return d / "vectors.fbin", d / "docs.jsonl", len(emb), emb.shape[1], "cosine"
    n, dim = 1_000_000, 64
    if not (d / "vectors.fbin").exists():
        rng = np.random.default_rng(7)
        centres = rng.standard_normal((4096, dim), dtype=np.float32)
        with open(d / "vectors.fbin", "wb") as f:
            np.array([n, dim], dtype=np.int32).tofile(f)
            for s in range(0, n, 1 << 17):
                m = min(1 << 17, n - s)
                (centres[rng.integers(4096, size=m)] + 0.3 * rng.standard_normal((m, dim), dtype=np.float32)).tofile(f)
    return d / "vectors.fbin", None, n, dim, "l2"


def create(c: httpx.Client, dim: int, metric: str) -> None:
    r = c.post("/v1/collections", json={"name": "c", "dimension": dim, "metric": metric})
    assert r.status_code == 201, r.text


def by_import(srv: ServerProcess, vectors: Path, sidecar: Path | None, dim: int, metric: str) -> dict:
    with httpx.Client(base_url=srv.url, timeout=3600) as c:
        create(c, dim, metric)
        t = time.perf_counter()
        files = {"vectors": (vectors.name, open(vectors, "rb"))}
        if sidecar is not None:
            files["documents"] = (sidecar.name, open(sidecar, "rb"))
        try:
            r = c.post("/v1/collections/c/import", files=files)
        finally:
            for _, f in files.values():
                f.close()
        assert r.status_code == 202, r.text
        uploaded = time.perf_counter() - t
        while (state := c.get("/v1/collections/c").json()["build_state"])["import"]["state"] == "running":
            time.sleep(0.5)
        seconds = time.perf_counter() - t
        assert state["import"]["state"] == "done", state
        return {"seconds": round(seconds, 1), "upload_seconds": round(uploaded, 1), "indexed": state["indexed"],
                "fresh": state["fresh"]}


def by_endpoint(srv: ServerProcess, vectors: Path, sidecar: Path | None, dim: int, metric: str, limit_s: float) -> dict:
    from fusionrag.retriever.engine.vectors import open_vectors

    src = open_vectors(vectors)
    lines = open(sidecar) if sidecar is not None else None
    sent = 0
    with httpx.Client(base_url=srv.url, timeout=3600) as c:
        create(c, dim, metric)
        t = time.perf_counter()
        while sent < src.count and time.perf_counter() - t < limit_s:
            block = np.asarray(src[sent:sent + BATCH], dtype=np.float32)
            docs = []
            for i, v in enumerate(block.tolist()):
                doc = json.loads(next(lines)) if lines is not None else {"id": str(sent + i)}
                docs.append({**doc, "vector": v})
            r = c.post("/v1/collections/c/documents", json={"documents": docs})
            assert r.status_code == 200, r.text
            sent += len(block)
        seconds = time.perf_counter() - t
        # The background merges go on after the last acknowledgement: until they are done, not all is indexed.
        while (state := c.get("/v1/collections/c").json()["build_state"])["merging"]:
            time.sleep(1)
        settled = time.perf_counter() - t
    return {"seconds": round(seconds, 1), "settled_seconds": round(settled, 1), "documents_sent": sent,
            "complete": sent == src.count, "indexed": state["indexed"], "fresh": state["fresh"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["docs", "synth1m"])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "import")
    ap.add_argument("--endpoint-limit-s", type=float, default=1800,
                    help="stop the endpoint way after this long and report its rate so far")
    args = ap.parse_args()
    out = {}
    for name in args.sets:
        vectors, sidecar, n, dim, metric = prepare(name, args.work)
        out[name] = {"documents": n, "dimension": dim}
        for way in ("import", "endpoint"):
            data = args.work / f"{name}-{way}"
            shutil.rmtree(data, ignore_errors=True)
            srv = ServerProcess(data, args.work / f"{name}-{way}.log", "--no-demo", "--min-index-count", "1000",
                                "--max-text-chars", "100000")  # the docs hold paragraphs of up to 18.6k characters
            try:
                srv.wait_ready()
                base = peak_rss_mib(srv.proc.pid)
                res = (by_import(srv, vectors, sidecar, dim, metric) if way == "import"
                       else by_endpoint(srv, vectors, sidecar, dim, metric, args.endpoint_limit_s))
                res["documents_per_s"] = round(res.get("documents_sent", n) / res["seconds"])
                res["server_peak_rss_mib"] = round(peak_rss_mib(srv.proc.pid))
                res["server_rss_at_start_mib"] = round(base)
            finally:
                srv.stop()
            out[name][way] = res
            print(name, way, res, flush=True)
    results("service").mkdir(exist_ok=True)
    (results("service") / "import_bulk.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
