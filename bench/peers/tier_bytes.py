"""Bytes per vector each tier holds, measured on built indexes: what sizing a deployment starts from
(docs/sharded.md, "A billion 768-d vectors, on paper").

    python -m bench.peers.tier_bytes [--work bench/work] [--sets glove minilm fashion synth1m] [--out bench/results/peers/tier_bytes.md]

Reads indexes bench/harness/runner.py or bench/cache/cache_policy.py built under WORK/idx/SET/fusionrag.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from fusionrag.retriever import Index

from bench.harness.paths import WORK, results


def measure(path: Path) -> dict:
    index = Index.open(str(path), filter_tier="cpu", verify=False)
    try:
        n, f, rr = index.count, index.filter, index.reranker
        lists = len(f.list_offsets) - 1
        nav = index.nav.memory_bytes()
        return {
            "vectors": n, "dim": index.dim, "dtype": rr.dtype, "pq_m": index.pq.m, "lists": lists,
            "vectors_per_list": n / lists,
            "nav_per_centroid": nav / lists, "nav_per_vector": nav / n,
            "list_ids_per_vector": f.list_ids.nbytes / n, "locations_per_vector": rr.locations.nbytes / n,
            "pq_codes_per_vector": f.codes.nbytes / n,
            "records_per_block": rr.store.records_per_block, "block_bytes": rr.store.block_bytes,
            "ssd_per_vector": (path / "vectors.pages").stat().st_size / n,
        }
    finally:
        index.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--sets", nargs="*", default=["glove", "minilm", "fashion", "synth1m"])
    ap.add_argument("--out", type=Path, default=results("peers") / "tier_bytes.md")
    args = ap.parse_args(argv)
    rows = [(name, measure(args.work / "idx" / name / "fusionrag")) for name in args.sets
            if (args.work / "idx" / name / "fusionrag").exists()]
    lines = [f"# Bytes per vector per tier ({time.strftime('%Y-%m-%d', time.gmtime())}, `bench/peers/tier_bytes.py`)", "",
             f"Indexes built with the default settings ({platform.machine()}); sizes are the files' and arrays' own, "
             "independent of the machine's load.", "",
             "| set | vectors | dim | stored | PQ bytes | vectors / list | graph B / centroid | graph B / vector | "
             "list ids B / vector | slot map B / vector | PQ codes B / vector | records / 4 KiB block | SSD B / vector |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['vectors']} | {r['dim']} | {r['dtype']} | {r['pq_m']} | {r['vectors_per_list']:.1f} | "
                     f"{r['nav_per_centroid']:.1f} | {r['nav_per_vector']:.1f} | {r['list_ids_per_vector']:.2f} | "
                     f"{r['locations_per_vector']:.1f} | {r['pq_codes_per_vector']:.1f} | {r['records_per_block']} | "
                     f"{r['ssd_per_vector']:.1f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
