"""What the GPU path costs the host per query, the lists tier against the device tier (#47; not a test; runs on any
machine, no GPU needed).

The lists tier (retriever/engine/gpu_tier.py) leaves the host the graph search, the gathering of every probed list's IDs
into pinned staging memory (sent up, 4 bytes each), and the re-rank of the top-n from SSD. The device tier
(retriever/engine/device_tier.py) sends each batch's queries and receives its answers; where the raw vectors do not fit
on the device it receives the top-n and the host re-ranks them. Measured here, on one index (bench/gpu/gpu_tier.py's
1M x 128 clustered set by default, built if missing), on the report half of its held-out queries, in batches of
1,024 (the GPU batch):

- the lists tier's host stages, each timed with this machine's threads: graph search (NavigationTier.probe),
  gathering IDs (native.gather_offsets + gather_into, into a reused buffer), and the re-rank from SSD of the
  CPU tier's top-n (RerankTier.rerank; the page buffer warmed by an untimed pass);
- bytes crossing the boundary a query, both tiers, from what each sends (the lists tier: its queries, its IDs
  and a query's offsets; back: n candidates at 12 bytes), the device tier's as its code counts them
  (tests/retriever/test_device_tier.py checks those counts against its uploads);
- the device tier's host work a batch: the torch operations and Triton launches it issues, counted on a small
  index run through it on this machine (Triton's interpreter; the count does not depend on the data's size but
  through the number of chunks), at a launch cost that is a model input until a GPU window measures it, and the
  host syncs among them (two a batch: its chunk plan and its answers, as the cost model has it);
- the postings the device tier scans a query (exact navigation) against the CPU tier's (the graph's lists), and
  both recalls, at the same settings (`device_postings`): the scan and top-n of the cost model rest on it;
- the device tier larger than its budget (a tenth of the postings resident): the bytes its cold lists bring over
  the bus a query, placed by list length and by the lists the tuning half probed (`tiered`).

    python -m bench.gpu.gpu_host_cost [--count 1000000] [--nprobe 32 64] [--out bench/results/gpu/gpu_host_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the device tier's count runs on the CPU (before triton loads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fusionrag import native  # noqa: E402
from fusionrag.loadtests.queryset import synthetic_vectors  # noqa: E402
from fusionrag.retriever import BuildConfig, Index  # noqa: E402

from bench.harness.paths import ROOT
LAUNCH_S = 8e-6  # host seconds a device operation costs to issue (CUDA launch + torch dispatch): a model input
# Bytes/s a kernel streams from pinned host memory over the H200's PCIe 5.0 x16 link (64 GB/s a direction on paper):
# a model input until a window measures it (bench/gpu/gpu_tier.py, scan_stream's host_stream_bus_bytes_per_s).
BUS_BPS = 45e9


# Operations whose output size depends on the data: on a GPU the host waits for the device at each (#70 item 4)
_SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.repeat_interleave.Tensor", "aten.bincount.default", "aten._unique2.default",
            "aten.unique_consecutive.default", "aten.unique_dim.default"}


def _in_triton() -> bool:
    """Inside Triton's interpreter running a kernel (on a GPU: a launch, not host work)."""
    f = sys._getframe(2)
    while f is not None:
        if "/triton/" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class _Ops(TorchDispatchMode):
    """Counts the torch operations dispatched (each a kernel, or a copy, on a GPU), and the host syncs among them
    (a device tensor read by the host: .cpu(), .item(), int(); boolean-mask indexing, repeat_interleave without
    its output size, bincount: tests/retriever/test_device_tier_syncs.py counts them the same way)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += 1
        name = str(func)
        syncs = name in _SYNCING and not (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size"))
        if name.startswith(("aten.index.Tensor", "aten.index_put")):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            syncs = any(i is not None and i.dtype == torch.bool for i in indices)
        if syncs and not _in_triton():
            self.syncs += 1
        return func(*args, **kwargs)

    def __enter__(self):
        real, ops = torch.Tensor.cpu, self

        def cpu(t, *a, **kw):  # on CPU tensors .cpu() dispatches nothing: counted where it is called
            if not _in_triton():
                ops.syncs += 1
            return real(t, *a, **kw)
        self._real_cpu = real
        torch.Tensor.cpu = cpu
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.cpu = self._real_cpu
        return super().__exit__(*exc)


def device_ops_per_batch(work: Path) -> dict:
    """Operations the device tier issues for one batch (q queries, one chunk), and the Triton launches among them,
    on a small index: the same code path, whatever the index's size, but for the number of chunks."""
    from fusionrag.kernels import adc_stream as adc_stream_mod
    from fusionrag.kernels import pq_table as pq_table_mod

    x = synthetic_vectors(6000, 32)
    path = work / "gpu_host_cost_small"
    if not (path / "manifest.json").exists():
        Index.build(x[:5000], path, BuildConfig(metric="l2"), progress=False, overwrite=True)
    out = {}
    for raw, share in (("resident", 0.5), ("on SSD", 1e-9)):
        index = Index.open(path, filter_tier="gpu", gpu_search="device", gpu_budget_bytes=256 << 20, batch_size=64,
                           gpu_tiered_share=share)
        q = index.prepare_queries(x[5000:5064])
        p = index.params.with_overrides(nprobe=16)
        launches = []
        real = {m: m.__dict__[k] for m, k in ((adc_stream_mod, "adc_stream_kernel"),
                                              (pq_table_mod, "pq_table_kernel"))}

        class Counted:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                launches.append(1)
                return self.kernel[grid]

        for mod, kernel in real.items():
            setattr(mod, kernel.fn.__name__, Counted(kernel))
        try:
            index.filter.search(q, p, 200, 10)  # warm
            launches.clear()
            with _Ops() as ops:
                index.filter.search(q, p, 200, 10)
        finally:
            for mod, kernel in real.items():
                setattr(mod, kernel.fn.__name__, kernel)
        out[raw] = {"torch_ops": ops.count, "triton_launches": len(launches), "host_syncs": ops.syncs,
                    "host_s_per_batch_model": round((ops.count + len(launches)) * LAUNCH_S, 6)}
        index.close()
    return out


def tiered(index: Index, tune: np.ndarray, report: np.ndarray, nprobes, rerank: int, batch: int) -> list[dict]:
    """The device tier larger than its budget: a tenth of the postings on the device, the rest in host memory.
    Run through the device tier itself (here on CPU tensors, Triton's interpreter): per query of the report half, the
    postings its navigation probes and the bytes the cold ones bring over the bus (the tier's own count, which
    tests/retriever/test_device_tier.py checks against the lists probed), the lists placed by length (as at open), then
    by the lists the tuning half probed (rebalance); and the queries a second the bus would allow at BUS_BPS."""
    from fusionrag.retriever.engine.device_tier import DeviceTier
    from fusionrag.retriever.engine.gpu_tier import shared_account

    f = index.filter
    postings, m = len(f.list_ids), f.codes.shape[1]
    rows = []
    for nprobe in nprobes:  # a tier opened afresh for each: placed by length first
        tier = DeviceTier(index.nav.graph.vectors(), index.metric == "ip", f.list_offsets, f.list_ids, f.codes,
                          index.pq.codebooks, account=shared_account(torch.device("cpu"), 8 << 30, 0.9, "tiered"),
                          metric=index.reranker.metric, batch_size=batch, threads=f.threads, raw=None, dim=index.dim,
                          raw_share=1.0, work_bytes=1 << 30, max_resident_postings=postings // 10)
        p = index.params.with_overrides(nprobe=nprobe, rerank=rerank)
        row = {"nprobe": nprobe, "rerank": rerank, "resident_postings_fraction": round(tier.hot_postings / postings, 4)}
        for placed in ("by_length", "by_probes"):
            if placed == "by_probes":
                tier.search(tune, p, rerank, 10)  # counts the lists the tuning half probes
                tier.rebalance()
            before = dict(tier.phases)
            b = tier.search(report, p, rerank, 10)
            bus = (tier.phases["bytes_over_bus"] - before["bytes_over_bus"]) / len(report)
            row[placed] = {"postings_per_query": round(float(b.gathered.mean()), 1),
                           "cold_share_of_postings": round(bus / (m + 4) / max(1.0, float(b.gathered.mean())), 3),
                           "bus_bytes_per_query": round(bus),
                           "up_bytes_per_query": (tier.phases["bytes_up"] - before["bytes_up"]) / len(report),
                           "down_bytes_per_query": (tier.phases["bytes_down"] - before["bytes_down"]) / len(report),
                           "qps_bus_allows_model": round(BUS_BPS / max(1.0, bus))}
        rows.append(row)
        print(json.dumps({"tiered": row}), flush=True)
        tier.close()
    return rows


def device_postings(index_path: Path, base: np.ndarray, report: np.ndarray, points, batch: int) -> list[dict]:
    """What the cost model's scan and top-n rest on: the postings the device tier scans a query (its exact
    navigation and the probe rule) against those the CPU tier scans (the graph's lists), and each one's recall@10
    against brute force, at the same settings, on the report half (the device tier on CPU tensors, Triton's
    interpreter, all its parts resident)."""
    from fusionrag.retriever import EngineConfig

    xb, qq = torch.from_numpy(base), torch.from_numpy(report)
    truth = torch.topk((xb * xb).sum(1)[None, :] - 2 * qq @ xb.T, 10, dim=1, largest=False).indices.numpy()
    del xb

    def rec(ids):
        return round(float(np.mean([len(set(a.tolist()) & set(b.tolist())) / 10 for a, b in zip(ids, truth)])), 4)

    cpu = Index.open(index_path, EngineConfig(filter_tier="cpu"))
    dev = Index.open(index_path, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=8 << 30,
                                              batch_size=batch, gpu_tiered_share=1e-9, manager_interval_s=0))
    rows = []
    for nprobe, rerank in points:
        a = cpu.search(report, 10, nprobe=nprobe, rerank=rerank)
        b = dev.search(report, 10, nprobe=nprobe, rerank=rerank)
        rows.append({"nprobe": nprobe, "rerank": rerank, **{tier: {
            "recall@10": rec(r.ids), "postings_per_query": round(float(r.stats["candidates"].mean()), 1),
            "lists_per_query": round(float(r.stats["lists_probed"].mean()), 2)}
            for tier, r in (("cpu_tier", a), ("device_tier", b))}})
        print(json.dumps({"device_postings": rows[-1]}), flush=True)
    cpu.close()
    dev.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rerank", type=int, default=200)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--work", default=str(ROOT / "bench" / "work"))
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(args.work)
    # As bench/gpu/gpu_tier.py makes its set (the last 2,000 held out as queries): the same index directory.
    x = synthetic_vectors(args.count + 2000, args.dim)
    path = work / f"gpu_tier_synthetic_{args.count}x{args.dim}"
    if not (path / "manifest.json").exists():
        Index.build(x[:args.count], path, BuildConfig(metric="l2"), progress=False, overwrite=True)
    index = Index.open(path, filter_tier="cpu", batch_size=args.batch)
    f, threads = index.filter, index.filter.threads
    held = x[args.count:]
    report = held[1000:1000 + args.batch]  # the report half of the held-out queries (no setting is tuned here)
    q = index.prepare_queries(report)
    nq, d = q.shape
    rows = []
    for nprobe in args.nprobe:
        p = index.params.with_overrides(nprobe=nprobe, rerank=args.rerank)
        n = max(p.rerank, args.k)
        index.search(q, args.k, p)  # warms the page buffer as a serving index's would be
        t = time.perf_counter()
        lists, _, _ = index.nav.probe(q, p)
        graph_s = time.perf_counter() - t
        offsets = native.gather_offsets(lists, f.list_offsets, f.list_ids)
        staging = np.empty(int(offsets[-1]), np.uint32)
        staging[:] = 0
        t = time.perf_counter()
        offsets = native.gather_offsets(lists, f.list_offsets, f.list_ids)
        native.gather_into(lists, f.list_offsets, f.list_ids, staging, threads)
        gather_s = time.perf_counter() - t
        cand = f.topn(f.tables(q), lists, n)
        t = time.perf_counter()
        index.reranker.rerank(q, cand.ids, args.k, p)
        rerank_s = time.perf_counter() - t
        gathered = float(np.diff(offsets).mean())
        lists_up = 4 * d + 4 * gathered + 16  # the query, its IDs, its offset and table base
        lists_down = 12 * n + 8
        rows.append({
            "nprobe": nprobe, "rerank": p.rerank, "ids_gathered_per_query": round(gathered, 1),
            "lists_tier": {
                "host_us_per_query": {"graph": round(graph_s / nq * 1e6, 1), "gather": round(gather_s / nq * 1e6, 1),
                                      "rerank_from_ssd": round(rerank_s / nq * 1e6, 1),
                                      "all": round((graph_s + gather_s + rerank_s) / nq * 1e6, 1)},
                "bytes_per_query": {"up": round(lists_up), "down": lists_down}},
            "device_tier": {
                "raw_resident": {"bytes_per_query": {"up": 4 * d, "down": 12 * args.k + 32}},
                "raw_on_ssd": {"bytes_per_query": {"up": 4 * d, "down": 12 * n + 32},
                               "host_us_per_query": {"rerank_from_ssd": round(rerank_s / nq * 1e6, 1)}}},
        })
        print(json.dumps(rows[-1]), flush=True)
    points = [(64, 200), (64, 400)]  # about recall 0.92 and 0.95 on the default set (device_postings)
    postings = device_postings(path, x[:args.count], report[:512], points, args.batch)
    tenth = [tiered(index, index.prepare_queries(held[:args.batch]), q, [nprobe], rerank, args.batch)[0]
             for nprobe, rerank in points]
    ops = device_ops_per_batch(work)
    for r in rows:
        for where, key in (("resident", "raw_resident"), ("on SSD", "raw_on_ssd")):
            host = r["device_tier"][key].setdefault("host_us_per_query", {})
            host["issuing_device_work_model"] = round(ops[where]["host_s_per_batch_model"] / args.batch * 1e6, 3)
            host["all"] = round(sum(v for k, v in host.items() if k != "all"), 1)
        r["host_time_device_over_lists"] = {
            key: round(r["device_tier"][key]["host_us_per_query"]["all"] / r["lists_tier"]["host_us_per_query"]["all"],
                       4) for key in ("raw_resident", "raw_on_ssd")}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": threads,
              "index": path.name, "batch": args.batch, "k": args.k, "launch_cost_model_s": LAUNCH_S,
              "device_ops_per_batch_one_chunk": ops, "rows": rows, "bus_model_bytes_per_s": BUS_BPS,
              "device_postings_and_recall": postings, "tenth_of_postings_resident": tenth}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
