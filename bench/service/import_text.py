"""Bulk import from text through the real service (issue 65, item 3): the Python-docs paragraphs as a JSON-lines
file of ids, texts and metadata, no vectors, into a collection whose model (all-MiniLM-L6-v2) the service embeds
them with; documents a second end to end (upload, embedding on the bulk threads, storing, the index's build), the
server's CPU seconds and peak RSS, and the rate the import's own log line gives for the embedding alone.

    python -m bench.service.import_text [--limit N] [--work bench/work/import]

Writes bench/results/service/import_text.{json,md}. The issue's baseline, measured on this kind of machine before
the ONNX runtime and the bulk threads: ~16 documents a second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx

from bench.harness.paths import BENCH as ROOT
from bench.harness.paths import results
from bench.service.import_bulk import ServerProcess, peak_rss_mib, prepare

BASELINE_DOCS_PER_S = 16  # issue 65: "Bulk import embeds ~16 documents a second on this machine" (main 9c83e8f)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "import")
    ap.add_argument("--limit", type=int, default=0, help="import only the first N paragraphs (0: all)")
    args = ap.parse_args()
    _, sidecar, n, _, _ = prepare("docs", args.work)
    if args.limit:
        part = args.work / f"docs-text-{args.limit}.jsonl"
        with open(sidecar) as src, open(part, "w") as dst:
            for i, line in enumerate(src):
                if i == args.limit:
                    break
                dst.write(line)
        sidecar, n = part, min(n, args.limit)
    data = args.work / "docs-text-import"
    shutil.rmtree(data, ignore_errors=True)
    log = args.work / "docs-text-import.log"
    srv = ServerProcess(data, log, "--no-demo", "--min-index-count", "1000", "--max-text-chars", "100000")
    try:
        srv.wait_ready()
        rss0, cpu0 = peak_rss_mib(srv.proc.pid), cpu_s(srv.proc.pid)
        with httpx.Client(base_url=srv.url, timeout=3600) as c:
            r = c.post("/v1/collections", json={"name": "c", "dimension": 384, "metric": "cosine",
                                                "embedding": "all-MiniLM-L6-v2"})
            assert r.status_code == 201, r.text
            t = time.perf_counter()
            with open(sidecar, "rb") as f:
                r = c.post("/v1/collections/c/import", files={"documents": (sidecar.name, f)})
            assert r.status_code == 202, r.text
            while True:
                state = c.get("/v1/collections/c").json()["build_state"]
                if state["import"]["state"] not in ("uploading", "running"):
                    break
                time.sleep(0.5)
            seconds = time.perf_counter() - t
            assert state["import"]["state"] == "done", state
            hit = c.post("/v1/collections/c/search", json={"texts": ["How do I read a file line by line?"],
                                                            "k": 3}).json()["results"][0]
        res = {"documents": n, "seconds": round(seconds, 1), "documents_per_s": round(n / seconds, 1),
               "indexed": state["indexed"], "fresh": state["fresh"],
               "server_cpu_s": round(cpu_s(srv.proc.pid) - cpu0, 1), "server_peak_rss_mib": round(peak_rss_mib(
                   srv.proc.pid)), "server_rss_at_start_mib": round(rss0), "cores": os.cpu_count(),
               "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "first_hit": hit[0]["text"][:120]}
    finally:
        srv.stop()
    m = re.findall(r"embedded (\d+) texts in ([\d.]+) s \((\d+) docs/s\)", log.read_text())
    if m:
        res["embedding_docs_per_s_logged"] = int(m[-1][2])
    res["vs_baseline"] = round(res["documents_per_s"] / BASELINE_DOCS_PER_S, 2)
    out = results("service")
    (out / "import_text.json").write_text(json.dumps(res, indent=1))
    (out / "import_text.md").write_text(
        "# Bulk import from text (issue 65, item 3)\n\n"
        f"`python -m bench.service.import_text{f' --limit {args.limit}' if args.limit else ''}` on "
        f"{res['cores']} cores: {n:,} Python-docs paragraphs (ids, texts, metadata; no vectors) imported into a "
        "collection embedding with all-MiniLM-L6-v2 on the service's bulk threads (ONNX Runtime), its index built.\n\n"
        f"- end to end: **{res['documents_per_s']} documents/s** ({res['seconds']} s), "
        f"{res['vs_baseline']}x the issue's ~{BASELINE_DOCS_PER_S}/s on this kind of machine before\n"
        f"- the embedding alone, as the import logs it: {res.get('embedding_docs_per_s_logged', 'n/a')} documents/s\n"
        f"- server CPU {res['server_cpu_s']} s ({res['server_cpu_s'] / n * 1000:.1f} ms a document), peak RSS "
        f"{res['server_peak_rss_mib']} MiB (at start {res['server_rss_at_start_mib']}); load average at the end "
        f"{res['load_average_at_end']}\n"
        f"- indexed {res['indexed']:,}, fresh {res['fresh']:,}; a text query's first hit afterwards: "
        f"\"{res['first_hit']}\"\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
