"""A doc store read beside a memory cap, through SQLite's memory map or not (#51): what a search's hits cost
when the store is larger than the memory the process may use.

    python -m bench.service.docstore_reads [--store bench/work/capped/4000000x128/imported/collections/big/docs.sqlite]
                                           [--cap-mib 651] [--rows 5000]

Each arm is a process of its own in a fresh v1 memory cgroup (no swap) of cap-mib, the store dropped from the page
cache first; it fetches `rows` scattered documents (DocStore.by_rows, as a search of 500 queries with 10 hits each
does), twice (two draws), with SQLite's mmap_size 1 GiB (what every store had) and 0; arms alternate, A B A B.
Read bytes: the process's /proc/self/io read_bytes (what it read from storage). Writes
bench/results/service/docstore_reads.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.harness.cgroups import drop_cache
from bench.harness.paths import ROOT, WORK, module_argv, results, tests_module

ARMS = {"mapped (1 GiB)": 1 << 30, "unmapped": 0}


def child(store: str, rows: int) -> None:
    import fusionrag.retriever.collection.docstore as ds

    ds.mmap_bytes = lambda path: int(os.environ["MMAP"])  # the arm's, whatever the rule would choose
    st = ds.DocStore(store, int(os.environ["DIM"]))
    n = st.meta("next_row")
    rng = np.random.default_rng(0)
    out = {"rows_in_store": n}
    for rep in range(2):
        ids = np.sort(rng.choice(n, rows, replace=False))
        t = time.perf_counter()
        got = st.by_rows(ids, False)
        out[f"seconds_{rep}"] = time.perf_counter() - t
        out["found"] = len(got)
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes"):
            out["read_bytes"] = int(line.split()[1])
    st.close()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, default=WORK / "capped" / "4000000x128" / "imported" / "collections" / "big"
                   / "docs.sqlite")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--cap-mib", type=int, default=651)
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(str(args.store), args.rows)
    Cgroup = tests_module("cgroup").Cgroup
    runs = []
    for arm in [*ARMS, *ARMS]:
        drop_cache(args.store)
        cg = Cgroup(args.cap_mib << 20)
        try:
            r = cg.run(module_argv(__spec__.name, "--child", "--store", str(args.store), "--rows", str(args.rows)),
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "MMAP": str(ARMS[arm]), "DIM": str(args.dim)})
        finally:
            cg.remove()
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        runs.append({"arm": arm, **json.loads(r.stdout.strip().splitlines()[-1])})
        print(runs[-1], flush=True)
    out = {"store_bytes": args.store.stat().st_size, "cap_bytes": args.cap_mib << 20, "rows": args.rows,
           "machine": f"{os.cpu_count()} CPUs", "load": os.getloadavg(), "runs": runs}
    res = results("service")
    (res / "docstore_reads.json").write_text(json.dumps(out, indent=1))
    lines = [f"# A doc store read beside a cap, mapped or not ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m bench.service.docstore_reads` on this machine ({out['machine']}, load {out['load'][0]:.1f}): "
             f"a {out['store_bytes'] / 2**30:.1f} GiB doc store (the capped collection study's 4M documents), "
             f"{args.rows:,} scattered documents fetched twice in a {args.cap_mib} MiB cgroup, each arm a process of its "
             "own, the store cold at its start.", "",
             "| arm | first fetch s | second fetch s | read from disk MB |", "|---|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['arm']} | {r['seconds_0']:.2f} | {r['seconds_1']:.2f} | {r['read_bytes'] / 1e6:,.0f} |")
    lines += ["", "A store larger than an eighth of the memory the process may use is now read without the map "
              "(docstore.mmap_bytes)."]
    (res / "docstore_reads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
