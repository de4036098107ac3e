"""Every byte a search holds: the runner's net search memory (bench/harness/worker.py) taken apart, beside
Index.memory(), on indexes bench/harness/runner.py built and kept (#68 item 1).

    python -m bench.harness.runner --datasets glove minilm --systems fusionrag fusionrag-lean --build-only
    python -m bench.peers.memory_accounting [--sets glove minilm] [--systems fusionrag fusionrag-lean ...]

Each (set, system) runs in a process of its own, as the runner's search worker does: the queries and the warm-up
rows loaded, the base dropped, then the RSS (/proc/self/status, and /proc/self/smaps for what it is made of) at each
step: `import fusionrag.retriever` (where the runner took its baseline), the engine imported (where it takes it now:
the library a search runs, as for every other system), the index opened, the warm-up search, the runner's sweep on
1 and 2 threads. Net = peak RSS (VmHWM) - RSS after the engine's import, the runner's figure; Index.memory()'s
parts are set beside it. Results: bench/results/peers/memory_accounting.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.paths import ROOT, WORK, module_argv, results, tests_module

MiB = 1 << 20


def status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, bytes (the tests' reader, tests/rss.py)."""
    return tests_module("rss").status("VmRSS", "VmHWM", "RssAnon", "RssFile")


def smaps() -> dict:
    """Resident bytes of this process by what they are: each file of an index directory and each library mapped,
    the heap, other anonymous memory (malloc's mmaps, arenas, thread stacks) (/proc/self/smaps)."""
    out: dict[str, int] = {}
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":") or "-" in head[0]:
                name = head[5] if len(head) > 5 else "[anon]"
                if name.endswith(".so") or ".so." in name:
                    name = "[libraries]"
                elif name.startswith("[stack"):
                    name = "[stack]"
            elif head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1]) * 1024
    return out


def child(spec: dict) -> dict:
    """One system on one set, the runner's search worker's steps, with the RSS after each."""
    import importlib

    import numpy as np

    from bench.harness import worker
    from bench.harness.sets import load

    work = Path(spec["work"])
    base, queries, gt, meta = load(work, spec["dataset"])
    nq = min(spec["queries"], len(queries))
    q, gt = np.ascontiguousarray(queries[:nq]), gt[:nq]
    rng = np.random.default_rng(1)
    rows = np.sort(rng.choice(len(base), min(spec["warmup"], len(base)), replace=False))
    warm = np.asarray(base[rows]) + 0.01 * np.std(base[rows[:100]]) * rng.standard_normal((len(rows), meta["dim"]),
                                                                                            dtype=np.float32)
    warm = warm.astype(np.float32)
    if meta["metric"] == "cosine":
        warm /= np.linalg.norm(warm, axis=1, keepdims=True)
    del base
    steps = {}
    importlib.import_module("fusionrag.retriever")  # the runner's baseline until #68: the package, no engine
    worker.return_freed_memory()
    steps["package"] = status()
    importlib.import_module(worker.SYSTEMS[spec["system"]][2])  # the library a search runs
    worker.return_freed_memory()
    steps["engine"] = status()
    steps["engine_smaps"] = smaps()
    worker.reset_peak()
    from fusionrag import native

    points, memory = [], None
    allowed = sorted(os.sched_getaffinity(0))
    for threads in spec["threads"]:
        os.sched_setaffinity(0, allowed[:threads])
        run = worker.SYSTEMS[spec["system"]][1](Path(spec["index_dir"]), meta, spec["params"], threads)
        steps[f"open_{threads}"] = status()
        _, extra = run(warm, spec["sweep"][len(spec["sweep"]) // 2])
        steps[f"warm_{threads}"] = status()
        for knob in spec["sweep"]:
            t = time.perf_counter()
            ids, extra = run(q, knob)
            seconds = time.perf_counter() - t
            points.append({"threads": threads, "knob": knob, "qps": nq / seconds, "recall": worker.recall(ids, gt),
                           "pages": extra["engine"]["pages_read"], "memory": extra["memory"]})
        memory = max((p["memory"] for p in points), key=lambda m: m["total_bytes"])  # the largest call's
        steps[f"sweep_{threads}"] = status()
        steps[f"sweep_{threads}_smaps"] = smaps()
        steps[f"scratch_{threads}"] = int(native.scratch_bytes())
        del run
    return {"steps": steps, "points": points, "memory": memory, "peak": status()["VmHWM"]}


def run_child(spec: dict) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run(module_argv(__spec__.name, "--child", json.dumps(spec)), capture_output=True, text=True,
                       cwd=ROOT, env=env)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def mib(b) -> str:
    return f"{b / MiB:.1f}"


def report(out: dict) -> str:
    lines = [f"# Every byte a search holds: net search RSS and Index.memory() ({out['started']})", "",
             f"`python -m bench.peers.memory_accounting {' '.join(out['argv'])}` on {platform.node() and 'this machine'}: "
             f"load at start `{out['load_start']}`, at end `{out['load_end']}`. Each row a process of its own, the "
             "runner's search worker's steps (bench/harness/worker.py): page buffer = raw vectors / 16 (lean: / 4 of "
             "that), the runner's sweep on 1 then 2 threads, 1000 queries a point after 300 warm-up rows.", ""]
    before = out.get("before")
    lines += ["## Summary", "",
              "Net = peak RSS less the baseline: the runner's before this change (`import fusionrag.retriever`, which "
              "loads no engine since d4d5660) and now (the engine imported, as every other system's library is). "
              + ("'Before' is the run of " + before["started"] + " on the code before this change (its page buffer "
                 "without its bookkeeping inside the budget, its memory() without parts). " if before else "")
              + "Pages a query and QPS: means and medians over the sweep's points (1 and 2 threads); recall at every "
              "point.", "",
              "| set, system | net MiB, old baseline | net MiB, engine baseline | Index.memory() total MiB | "
              "net - total MiB | page buffer + bookkeeping + records MiB (budget) | pages/q | QPS median | "
              "recall |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def point_stats(r):
        pts = {(p["threads"], json.dumps(p["knob"], sort_keys=True)): p for p in r["points"]}
        return pts, sum(p["pages"] for p in pts.values()) / len(pts), sorted(p["qps"] for p in pts.values())[len(pts) // 2]

    for key, r in out["runs"].items():
        s, m = r["steps"], r["memory"]
        parts = m["parts"]
        net_old, net = r["peak"] - s["package"]["VmRSS"], r["peak"] - s["engine"]["VmRSS"]
        pts, pages, qps = point_stats(r)
        row = [mib(net_old), mib(net), mib(m["total_bytes"]), f"{(net - m['total_bytes']) / MiB:+.1f}",
               f"{mib(parts['page_buffer'] + parts['page_buffer_metadata'] + parts['record_cache'])} "
               f"({mib(m['buffer_budget_bytes'])})", f"{pages:.2f}", f"{qps:,.0f}", "-"]
        if before and key in before["runs"]:
            b = before["runs"][key]
            bpts, bpages, bqps = point_stats(b)
            row[0] = f"{mib(b['peak'] - b['steps']['package']['VmRSS'])} -> {row[0]}"
            row[1] = f"{mib(b['peak'] - b['steps']['engine']['VmRSS'])} -> {row[1]}"
            row[5], row[6] = f"{bpages:.2f} -> {pages:.2f}", f"{bqps:,.0f} -> {qps:,.0f}"
            same = all(abs(bpts[k]["recall"] - pts[k]["recall"]) < 1e-9 for k in pts if k in bpts)
            row[7] = "the same at every point" if same else "differs"
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    lines.append("")
    for key, r in out["runs"].items():
        s, m = r["steps"], r["memory"]
        base_old, base = s["package"]["VmRSS"], s["engine"]["VmRSS"]
        parts = m.get("parts", {})
        lines += [f"## {key}", "",
                  f"- RSS after `import fusionrag.retriever` (the runner's baseline until now): {mib(base_old)} MiB; "
                  f"after the engine's import (its baseline now): {mib(base)} MiB: the engine's code and its imports "
                  f"(pydantic, the native extension) take {mib(base - base_old)} MiB, the process's, not an index's.",
                  f"- peak (VmHWM) {mib(r['peak'])} MiB: net {mib(r['peak'] - base)} MiB from the engine's import "
                  f"(the runner's figure now), {mib(r['peak'] - base_old)} MiB from the package's (its figure "
                  f"before).",
                  f"- Index.memory() total {mib(m.get('total_bytes', 0))} MiB "
                  f"(the sweep's largest call; page buffer budget {mib(m['buffer_budget_bytes'])} MiB, its parts "
                  f"{mib(parts['page_buffer'] + parts['page_buffer_metadata'] + parts['record_cache'])}); RSS after the sweep - baseline: "
                  f"{mib(s['sweep_2']['VmRSS'] - base)} MiB (anon {mib(s['sweep_2']['RssAnon'] - s['engine']['RssAnon'])}, "
                  f"file {mib(s['sweep_2']['RssFile'] - s['engine']['RssFile'])}).", "",
                  "| part | bytes | MiB |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:,} | {mib(v)} |" for k, v in parts.items()]
        lines += ["", "| step | RSS MiB | anon MiB | file MiB |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {mib(v['VmRSS'])} | {mib(v['RssAnon'])} | {mib(v['RssFile'])} |"
                  for k, v in s.items() if isinstance(v, dict) and "VmRSS" in v]
        before, after = s["engine_smaps"], s["sweep_2_smaps"]
        grown = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in set(before) | set(after)), reverse=True)
        lines += ["", "Resident growth by mapping, engine imported -> after the sweep (/proc/self/smaps):", "",
                  "| mapping | MiB |", "|---|---:|"]
        lines += [f"| {Path(k).name if k.startswith('/') else k} | {mib(d)} |" for d, k in grown if abs(d) >= 64 << 10]
        pts = {(p["threads"], json.dumps(p["knob"], sort_keys=True)): p for p in r["points"]}
        lines += ["", "| threads | knob | recall@10 | QPS | pages/q |", "|---|---|---:|---:|---:|"]
        lines += [f"| {t} | {k} | {p['recall']:.4f} | {p['qps']:,.0f} | {p['pages']:.1f} |"
                  for (t, k), p in pts.items()]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--sets", nargs="*", default=["glove", "minilm"])
    ap.add_argument("--systems", nargs="*", default=["fusionrag", "fusionrag-lean"])
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--tag", default="memory_accounting")
    ap.add_argument("--before", type=Path, help="an earlier run's JSON (the code before a change), set beside this")
    ap.add_argument("--out", type=Path, default=results("peers"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from bench.harness import runner
    from bench.harness.sets import load

    out = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:],
           "load_start": os.popen("uptime").read().strip(), "runs": {}}
    ns = argparse.Namespace(buffer_fraction=16)
    for name in args.sets:
        _, _, _, meta = load(args.work, name)
        params = runner.params_for(meta, ns)
        for system in args.systems:
            index_dir = args.work / "idx" / name / runner.BUILT_BY.get(system, system)
            spec = {"work": str(args.work), "dataset": name, "system": system, "index_dir": str(index_dir),
                    "params": params, "threads": args.threads, "queries": args.queries, "warmup": args.warmup,
                    "sweep": runner.SWEEPS[system]}
            out["runs"][f"{name} {system}"] = run_child(spec)
            print(f"{name} {system}: peak {mib(out['runs'][f'{name} {system}']['peak'])} MiB", flush=True)
    out["load_end"] = os.popen("uptime").read().strip()
    if args.before:  # its figures, not its per-mapping detail
        b = json.loads(args.before.read_text())
        out["before"] = {"started": b["started"], "load_start": b["load_start"], "load_end": b["load_end"],
                         "runs": {k: {"peak": r["peak"], "steps": {n: v for n, v in r["steps"].items()
                                                                   if n in ("package", "engine")},
                                      "points": [{x: p[x] for x in ("threads", "knob", "qps", "recall", "pages")}
                                                 for p in r["points"]]} for k, r in b["runs"].items()}}
    (args.out / f"{args.tag}.json").write_text(json.dumps(out, indent=1))
    (args.out / f"{args.tag}.md").write_text(report(out))
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
