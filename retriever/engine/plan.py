"""A capacity plan (#70 item 3): for N vectors of d dimensions, PQ codes of M bytes and a device, what goes on the
device, in host RAM and on the SSD, the build's peak memory and time, and the q/s the cost model predicts.

Nothing here is a new figure. The byte counts are the engine's own accounting: Index.memory()'s host parts (the
navigation graph, list offsets and IDs, the slot map and the page table), the page file's size, the CPU tier's
codes, and the device tier's parts as DeviceTier reserves them (device_tier.fixed_parts, its working memory, its
tiered capacity and whether its raw vectors fit: the same rules, checked against an opened tier in
tests/retriever/test_plan.py). What the structure leaves to the data, measured on builds of clustered 128-d
vectors on this project's 2-CPU VM, is cited where used:

- lists per vector and postings per vector (replicas): bench/results/peers/scale_table.json (centroid ratio 0.1 at
  1M-20M) and coarse_lists.json (ratios 0.01-0.1 at 10M);
- the navigation graph's bytes a centroid beyond its SQ8 codes and level-0 links: the same runs (289.5 bytes a
  centroid at d = 128, graph_m 16, at every N and ratio);
- the build's seconds per million vectors on 2 CPUs and its peak anonymous memory beyond its working budget: the
  same runs at 10M;
- the CUDA context and kernels beside the tiers (gpu_overhead_bytes): the H100 run of 2026-11-27,
  bench/results/gpu/gpu_accept_h100_run2/gpu_tier_h100.json;
- the cost model's stage figures: docs/gpu.md, "Predictions for the next window" (the copy bandwidth and brute
  force measured on the H100; the GEMM rate, the sort rate and the host's launch cost there are estimates, and the
  streamed scan and the bus's zero-copy rate are not measured yet). Postings a query: 1,191 at recall@10 0.95
  (nprobe 64, rerank 400) on the 1M x 128 set of docs/gpu.md, scaled by the mean list length (an assumption: as
  many lists probed at the same recall whatever their length).

The centroids' precision on the device is the device tier's own rule (device_tier.half_centroids: float16 where
float32 would take more than HALF_CENTROIDS_SHARE of the budget), and a plan given no centroid ratio takes the
coarser 0.01 from COARSE_FROM vectors (#70 item 2).

Everything is a plan, not a measurement: docs/gpu.md, "A capacity plan", holds the table for 1M-1B on an H100 and an
H200 and what it leaves out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from fusionrag.kernels.pool import ALIGN
from fusionrag.retriever.engine import device_tier as dt
from fusionrag.retriever.engine.pq import auto_m
from fusionrag.retriever.engine.tiers import exhaustive_is_cheap
from fusionrag.retriever.errors import ConfigError

# Devices by their nominal memory (the figures: H100 80 GB, H200 141 GB); --device-gb for another.
DEVICES = {"h100": 80e9, "h200": 141e9}
# Copy bandwidth, bytes/s: the H100's measured (docs/gpu.md, the H100 runs: 3.0 TB/s); the H200's "about 4" there.
BANDWIDTH = {"h100": 3.0e12, "h200": 4.0e12}
GPU_OVERHEAD = 2_238_026_240  # CUDA context and kernels (NVML), H100 run 2 (gpu_tier_h100.json)

# Measured builds (clustered 128-d, graph_m 16): {centroid ratio: (lists a vector, postings a vector)} at 10M
# (coarse_lists.json), and postings a vector at ratio 0.1 against N (scale_table.json).
AT_10M = {0.01: (101_336 / 1e7, 7.9164718), 0.02: (214_445 / 1e7, 7.8067512), 0.05: (518_810 / 1e7, 7.1015883),
          0.1: (1_026_511 / 1e7, 4.8874699)}
REPLICAS_BY_N = {1_000_000: 3.827247, 3_000_000: 4.49984, 10_000_000: 4.8874699, 20_000_000: 4.7525061}
# The linked graph: 289.5 bytes a centroid at d 128, graph_m 16 in all eight runs (289.50-289.57): its SQ8 code
# (128), level-0 links (2 x 16 x 4) and this rest (upper levels, norms); unlinked (exact navigation), a byte.
GRAPH_LINKED_REST = 289.5 - 128 - 2 * 16 * 4
# Build: seconds per 1M vectors on 2 CPUs, peak anonymous bytes a vector beyond the build's working budget (10M;
# the 20M row's 85.6 agrees, its build shared the machine). {ratio: (s per 1M, bytes a vector)}
BUILD_AT_10M = {0.01: (147.7, (625_520_640 - 426_665_984) / 1e7), 0.1: (143.3, (1_258_565_632 - 426_665_984) / 1e7)}
PAGE = 4096  # the page file's block (vectors.pages: 1,250,000 blocks of 4 KiB for 10M x 128 float32)
BLOCK_TABLE = 4  # bytes a block in Index.memory's host count (the page store's table)
SLOT = 4  # bytes a vector: locations.npy (uint32)
OFFSET = 8  # bytes a list: list_offsets.npy (int64)
POSTING_ID = 4  # bytes a posting: list_ids.npy (uint32)

# The cost model of docs/gpu.md (per batch of 1,024 queries at recall@10 0.95), low and high ends
GEMM_FLOPS = 30e12  # float32 GEMM rate assumed there
# float16 x float16 accumulating in float32 on the tensor cores (#70 item 2): a third of the H100's nominal 989
# TFLOP/s dense, assumed (not measured); the distance matrix it writes is float32 either way
HALF_GEMM_FLOPS = 300e12
# Coarser lists for the largest sets (#70 item 2): from this many vectors the plan's default centroid ratio is
# COARSE_RATIO (at 10M on CPU the same recall as 0.1, the build's peak beyond its budget a quarter:
# coarse_lists.json); below it, the build's default.
COARSE_FROM = 100_000_000
COARSE_RATIO = 0.01
DEFAULT_RATIO = 0.1
MEASURED_POSTINGS_A_QUERY = 1191  # the device tier at nprobe 64, rerank 400 on 1M x 128 (docs/gpu.md)
MEASURED_MEAN_LIST = 3_827_247 / 105_298  # postings a list of a 1M x 128 build at ratio 0.1 (scale_table.json)
SCAN_SHARE = (0.5, 0.1)  # of the copy bandwidth: the 50% target; the gather scan's measured 9-11%
SCAN_FLOOR_S = (1e-4, 3e-4)  # the scan's launches, 65k programs (docs/gpu.md: launch-bound 0.1-0.3 ms)
SORT_S_A_KEY = (0.3e-3 / 1.2e6, 1e-3 / 1.2e6)  # two sorts of 1.2M keys and their gathers: 0.3-1 ms
RERANK_FLOOR_S = (1e-4, 3e-4)  # the device re-rank's gather and top-10 (0.1-0.3 ms)
HOST_S_A_BATCH = (1.5e-3, 2.5e-3)  # ~220 operations issued at ~8 us and two syncs
BUS_BYTES_PER_S = 45e9  # a kernel's zero-copy reads over PCIe (assumed; scan_stream measures it)
HOST_RERANK_S_A_QUERY = (70e-6, 90e-6)  # CPU a query re-ranking from SSD at rerank 200 (2 threads here)
BATCH = 1024
RERANK = 400


def _interp(table: dict[float, object], x: float, at: int = 0) -> float:
    """Linear in log x between the measured points, held at the ends."""
    keys = sorted(table)
    val = (lambda k: table[k][at]) if isinstance(table[keys[0]], tuple) else (lambda k: table[k])
    if x <= keys[0]:
        return float(val(keys[0]))
    if x >= keys[-1]:
        return float(val(keys[-1]))
    for a, b in zip(keys, keys[1:]):
        if a <= x <= b:
            t = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
            return float(val(a) + t * (val(b) - val(a)))
    raise AssertionError


def _aligned(n: float) -> int:
    return -(-int(n) // ALIGN) * ALIGN


@dataclass
class Plan:
    n: int
    dim: int
    pq_m: int
    device: str
    device_bytes: int
    centroid_ratio: float
    lists: int
    postings: int
    wide_offsets: bool
    centroid_dtype: str = "float32"  # on the device: device_tier.half_centroids' rule over the budget
    host: dict = field(default_factory=dict)  # bytes, as Index.memory() counts host_index_bytes
    ssd: dict = field(default_factory=dict)  # bytes of the index's files
    gpu: dict = field(default_factory=dict)  # the device tier's parts and choices
    build: dict = field(default_factory=dict)
    qps: dict = field(default_factory=dict)
    fits: bool = True
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def default_ratio(n: int) -> float:
    """The centroid ratio a plan takes where none is given: COARSE_RATIO from COARSE_FROM vectors, else 0.1."""
    return COARSE_RATIO if n >= COARSE_FROM else DEFAULT_RATIO


def plan(n: int, dim: int, pq_m: int = 0, device: str = "h100", *, device_bytes: int | None = None,
         budget_bytes: int | None = None, centroid_ratio: float | None = None, metric: str = "l2",
         graph_m: int = 16, tiered_share: float = 0.5, cpus: int = 16, build_budget_bytes: int = 0,
         lists: int | None = None, postings: int | None = None, raw_bytes_per_value: int = 4,
         overhead_bytes: int = GPU_OVERHEAD, slack_bytes: int = dt.ALLOCATOR_SLACK, batch: int = BATCH,
         rerank: int = RERANK, centroid_dtype: str | None = None) -> Plan:
    """The plan of an index of n x dim vectors, pq_m-byte codes (0: the build's choice) on `device` ('h100', 'h200'
    or any name with device_bytes). budget_bytes: the GPU memory the process may take (gpu_budget_bytes; None: the
    whole device). lists, postings: the index's own where known (else from the measured builds). The build's
    working budget (memory_budget_bytes) comes on top of its peak's measured rest. raw_bytes_per_value: the page
    file's storage (4: float32). centroid_ratio None: default_ratio(n). centroid_dtype None: float16 where
    float32 centroids would take more than device_tier.HALF_CENTROIDS_SHARE of the budget, as the device tier
    chooses."""
    if n < 1 or dim < 1:
        raise ConfigError(f"n and dim must be positive, got {n} and {dim}")
    device = device.lower()
    if device_bytes is None:
        if device not in DEVICES:
            raise ConfigError(f"device must be one of {sorted(DEVICES)} or given with its bytes, got {device!r}")
        device_bytes = int(DEVICES[device])
    m = pq_m or auto_m(dim)
    if centroid_ratio is None:
        centroid_ratio = default_ratio(n)
    cdim = dim + (1 if metric == "ip" else 0)  # an ip index's centroids carry one more coordinate
    if lists is None:
        per_vector = _interp(AT_10M, centroid_ratio, 0)
        lists = max(1, round(n * per_vector))
    if postings is None:
        replicas = _interp(AT_10M, centroid_ratio, 1) * _interp(REPLICAS_BY_N, n) / REPLICAS_BY_N[10_000_000]
        postings = max(n, round(n * replicas))
    wide = dt.wide_offsets(postings)
    p = Plan(n, dim, m, device, device_bytes, centroid_ratio, lists, postings, wide)

    # Host RAM: Index.memory()'s host_index_bytes
    linked = not exhaustive_is_cheap(lists, cdim)
    graph = lists * cdim + 8 * cdim  # SQ8 codes and their per-dimension bounds and scales
    graph += lists * (2 * graph_m * 4 + GRAPH_LINKED_REST) if linked else lists  # links, levels, norms
    per_page = max(1, PAGE // (dim * raw_bytes_per_value))
    blocks = -(-n // per_page)
    p.host = {"navigation graph": int(graph), "list offsets": (lists + 1) * OFFSET, "list ids": postings * POSTING_ID,
              "slot map": n * SLOT, "page table": blocks * BLOCK_TABLE}
    p.host["host_index_bytes"] = sum(p.host.values())
    p.host["cpu_pq_codes (mapped, the CPU tier's)"] = n * m + 1536 * dim
    p.ssd = {"vectors.pages": blocks * PAGE, "pq_codes.npy": n * m, "list_ids.npy": postings * POSTING_ID}
    p.ssd["ssd_bytes"] = p.ssd["vectors.pages"]

    # The device tier's parts, as DeviceTier.__init__ sizes them
    budget = int(device_bytes if budget_bytes is None else budget_bytes)
    left = budget - overhead_bytes - slack_bytes
    if centroid_dtype is None:
        centroid_dtype = "float16" if dt.half_centroids(lists, cdim, budget) else "float32"
    if centroid_dtype not in dt.CENTROID_DTYPES:
        raise ConfigError(f"centroid_dtype must be one of {dt.CENTROID_DTYPES}, got {centroid_dtype!r}")
    p.centroid_dtype = centroid_dtype
    half = centroid_dtype == "float16"
    if half:
        p.notes.append(f"centroids in float16 ({lists * cdim * 2:,} bytes; float32 would take "
                       f"{lists * cdim * 4:,}, over {dt.HALF_CENTROIDS_SHARE:.0%} of the budget)")
    fixed = dt.fixed_parts(n, lists, cdim, 256 * dim, wide, half)
    need = sum(_aligned(b) for b in fixed.values())
    room = left - need
    all_postings = _aligned(postings * 4) + _aligned(postings * m)
    least_work = dt.MIN_WORK
    tiered = room - all_postings < least_work
    room -= 2 * _aligned(lists * 8) + _aligned(lists) if tiered else all_postings
    raw_bytes = n * dim * 4
    gpu = {"budget": budget, "overhead (CUDA context, kernels)": overhead_bytes, **fixed,
           "postings (ids and codes)": postings * (m + 4), "raw vectors (float32)": raw_bytes}
    if room < least_work:
        p.fits = False
        gpu.update(tier="lists tier (the device tier's fixed parts do not fit)", resident_postings=0.0,
                   raw_resident=False, working_memory=0, held=need + overhead_bytes)
        p.notes.append(f"the device tier needs {need + overhead_bytes + least_work:,} bytes before any posting "
                       f"(centroids {fixed['centroids']:,}) and the budget is {budget:,}: it is refused "
                       "(BudgetError) and the lists tier serves")
    else:
        raw_resident = not tiered and raw_bytes <= (room - least_work) * tiered_share
        whole = batch * (postings * dt.PER_POSTING + lists * 12 + 1024 * dim * 8)
        work = int(min(max(min((room - (raw_bytes if raw_resident else 0)) // 4, whole), dt.MIN_WORK), dt.MAX_WORK))
        work = work // ALIGN * ALIGN
        if tiered:
            capacity = int(max(0.0, (room - work) * tiered_share - 2 * ALIGN) // (m + 4))
            capacity = min(capacity, postings)
        else:
            capacity = postings
        held = (need + overhead_bytes + work + (2 * _aligned(lists * 8) + _aligned(lists) if tiered else all_postings)
                + (_aligned(capacity * 4) + _aligned(capacity * m) if tiered else 0)
                + (raw_bytes if raw_resident else 0))
        gpu.update(tier="device tier" + (", postings tiered" if tiered else ""), resident_postings=capacity / postings,
                   raw_resident=bool(raw_resident), working_memory=work, held=int(held),
                   host_pinned=(postings - capacity) * (m + 4) if tiered else 0)
        if tiered:
            p.notes.append(f"{capacity / postings:.1%} of the postings on the device, the rest pinned in host RAM "
                           f"({(postings - capacity) * (m + 4):,} bytes)")
        if not raw_resident:
            p.notes.append("raw vectors on the SSD: the host re-ranks the top-n")
    p.gpu = gpu

    # The build: measured seconds and peak beyond its working budget
    s_per_m = _interp(BUILD_AT_10M, centroid_ratio, 0)
    rest = _interp(BUILD_AT_10M, centroid_ratio, 1)
    p.build = {"seconds_on_2_cpus": n / 1e6 * s_per_m,
               f"seconds_on_{cpus}_cpus (linear in cores: not measured)": n / 1e6 * s_per_m * 2 / cpus,
               "peak_bytes_beyond_budget": int(n * rest),
               "peak_bytes": int(n * rest + build_budget_bytes) if build_budget_bytes else None}

    # q/s from the cost model
    if p.fits:
        p.qps = _predict(p, cdim, device, batch, rerank, cpus)
    else:
        p.qps = {"low": None, "high": None, "bound": "not predicted: the lists tier serves (measured 0.83x the CPU "
                                                    "tier at 1M on the H100)"}
    return p


def _predict(p: Plan, cdim: int, device: str, batch: int, rerank: int, cpus: int) -> dict:
    bw = BANDWIDTH.get(device, BANDWIDTH["h100"])
    mean_list = p.postings / p.lists
    per_query = MEASURED_POSTINGS_A_QUERY * mean_list / MEASURED_MEAN_LIST * rerank / RERANK
    keys = batch * per_query
    m = p.pq_m
    out = {"postings_a_query": round(per_query)}
    stages, device_qps, host_qps = {}, {}, {}
    for end, i in (("low", 0), ("high", 1)):
        flops = HALF_GEMM_FLOPS if p.centroid_dtype == "float16" else GEMM_FLOPS
        nav = 2 * batch * p.lists * cdim / flops + 2 * batch * p.lists * 4 / bw
        scan = max(SCAN_FLOOR_S[i], keys * (m + 4) / (bw * SCAN_SHARE[i]))
        topn = keys * SORT_S_A_KEY[i]
        bus = 0.0
        if p.gpu["resident_postings"] < 1:
            bus = keys * (1 - p.gpu["resident_postings"]) * (m + 4) / BUS_BYTES_PER_S
        rr = max(RERANK_FLOOR_S[i], batch * rerank * p.dim * 4 / bw) if p.gpu["raw_resident"] else 0.0
        host = HOST_S_A_BATCH[i]
        total = nav + scan + topn + bus + rr + host
        stages[end] = {"navigation": nav, "scan": scan, "top-n": topn, "bus": bus, "re-rank": rr, "host": host}
        device_qps[end] = batch / total
        # the host's re-rank from SSD beside the device's next batch
        host_qps[end] = math.inf if p.gpu["raw_resident"] else cpus / (HOST_RERANK_S_A_QUERY[i] * rerank / 200)
    # low: the slow end of every stage; high: the fast end
    out["low"] = min(device_qps["high"], host_qps["high"])
    out["high"] = min(device_qps["low"], host_qps["low"])
    ms = {k: (round(stages["low"][k] * 1e3, 3), round(stages["high"][k] * 1e3, 3)) for k in stages["low"]}
    out["ms_a_batch"] = ms
    if host_qps["low"] < device_qps["low"]:
        out["bound"] = "host re-rank from SSD"
    else:
        out["bound"] = max(ms, key=lambda k: ms[k][1])
    return out


def rows(plans: list[Plan]) -> list[list[str]]:
    """A table: one row a plan."""
    def gb(b):
        return "-" if b is None else f"{b / 1e9:,.1f}"
    out = [["N", "device", "ratio", "lists", "postings", "offsets", "centroids", "GPU: tier, held GB",
            "postings resident",
            "raw on GPU", "host RAM GB: index + pinned postings", "SSD GB", "build peak GB beyond budget",
            "build h (2 CPUs)", "predicted q/s", "bound by"]]
    for p in plans:
        q = p.qps
        qps = "-" if q.get("low") is None else f"{q['low'] / 1e3:,.1f}k-{q['high'] / 1e3:,.1f}k"
        out.append([f"{p.n:,}", p.device, f"{p.centroid_ratio:g}", f"{p.lists:,}", f"{p.postings:,}",
                    "int64" if p.wide_offsets else "int32", p.centroid_dtype, f"{p.gpu['tier']}, {gb(p.gpu['held'])}",
                    f"{p.gpu['resident_postings']:.0%}", "yes" if p.gpu["raw_resident"] else "no",
                    f"{gb(p.host['host_index_bytes'])} + {gb(p.gpu.get('host_pinned', 0))}", gb(p.ssd["ssd_bytes"]),
                    gb(p.build["peak_bytes_beyond_budget"]),
                    f"{p.build['seconds_on_2_cpus'] / 3600:,.1f}", qps, q.get("bound", "")])
    return out


def markdown(plans: list[Plan]) -> str:
    table = rows(plans)
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
    return "\n".join(lines)
