"""The buffer's layout (EngineConfig.record_cache): blocks only, records only, and 'auto', whose store holds
one of the two at a time and switches by a miniature of both (native PageStore adaptive_layout), on the three
query streams of bench/cache/cache_policy.py at buffers of 1/64, 1/16 and 1/4 of the raw vectors, tuning and report
halves. Per row: page-buffer hit ratio / SSD pages per query after the stream's first quarter, and the layout
the store ended in with its number of switches (b0: blocks, no switch; r1: records after one).

    python -m bench.cache.cache_layout                       # glove fashion minilm -> bench/results/cache/cache_layout.md
    python -m bench.cache.cache_layout --datasets glove --halves tune --fractions 16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.harness.paths import WORK, results

from bench.harness import streams as cp  # noqa: E402

# what each set is compared against: CLOCK, the layout the byte rule fixed before 'auto' switched (blocks for
# GloVe and Fashion-MNIST, records for MiniLM's 384-d float32), and the default
POLICIES = {"glove": ("clock", "auto", "default"), "fashion": ("clock", "auto", "default"),
            "minilm": ("clock", "auto+rec100", "default")}


def run(name: str, half: str, fractions, length: int) -> list[str]:
    from fusionrag.retriever import EngineConfig, Index

    idx_path, q, gt, raw = cp.built_set(WORK, name)
    rows = cp.half_streams(q, half, length)
    lines = []
    for frac in fractions:
        for sname in cp.STREAMS:
            out = []
            for pol in POLICIES[name]:
                cfg = EngineConfig(buffer_bytes=raw // frac, threads=1, filter_tier="cpu", manager_interval_s=0.0,
                                   **cp.POLICIES[pol])
                index = Index.open(idx_path, cfg)
                res = cp.run_stream(index, q, rows[sname], 16, False, gt)
                st = index.reranker.store
                out.append(f"{pol} {res['hit_ratio']:.3f}/{res['ssd_pages_per_query']:.2f} "
                           f"{st.layout[0]}{st.stats()['layout_switches']}")
                index.close()
            lines.append(f"{name} {half} 1/{frac} {sname.ljust(9)} " + " | ".join(out))
            print(lines[-1], flush=True)
    return lines


def markdown(lines: list[str], header: str) -> str:
    """One table per set: each row a (half, buffer, stream), each cell hit ratio / SSD pages per query, layout."""
    md, current = [header, ""], None
    for line in lines:
        name, half, frac, stream, cells = line.split(maxsplit=4)
        parts = [c.strip() for c in cells.split("|")]
        if name != current:
            current = name
            md += ["", f"### {name}", "", "| half | buffer | stream | " + " | ".join(p.split()[0] for p in parts)
                   + " |", "|---|---|---|" + "---|" * len(parts)]
        md.append(f"| {half} | {frac} | {stream} | " + " | ".join(" ".join(p.split()[1:]) for p in parts) + " |")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "fashion", "minilm"])
    ap.add_argument("--halves", nargs="*", default=["tune", "report"])
    ap.add_argument("--fractions", nargs="*", type=int, default=[64, 16, 4])
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=results("cache"))
    ap.add_argument("--tag", default="cache_layout")
    ap.add_argument("--from-log", type=Path, help="write the tables from the lines of an earlier run's output")
    args = ap.parse_args()
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.from_log:
        lines = [ln.rstrip("\n") for ln in args.from_log.read_text().splitlines() if " | " in ln]
    else:
        lines = [ln for name in args.datasets for half in args.halves for ln in run(name, half, args.fractions,
                                                                                     args.length)]
    header = (f"# The buffer's layout: blocks, records, or one at a time by a miniature ({start}, "
              f"{os.cpu_count()}-core VM, 1 thread, batches of 16)\n\nhit ratio / SSD pages per query after "
              "each stream's first quarter; the layout it ended in (b: blocks, r: records) and its switches. "
              "`auto`: blocks only; `auto+rec100`: records only; `default`: record_cache 'auto', one layout at a "
              "time.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.md").write_text(markdown(lines, header))
    (args.out / f"{args.tag}.json").write_text(json.dumps({"date": start, "rows": lines}, indent=1))


if __name__ == "__main__":
    main()
