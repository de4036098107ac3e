"""A batch's whole search on the GPU (#47): navigation, posting lists, the PQ scan, top-n and, where the raw
vectors fit, the exact re-rank, so the host sends queries and receives answers.

The GPU filter tier (gpu_tier.py) left the host the graph search, the gathering of every query's ~10k candidate
IDs and their upload, and the re-rank of every candidate from SSD: on an H100 it was 0.83x the CPU tier with the
device idle 90% of a batch. Here, inside the same budget (kernels/pool.py), the device holds:

- the centroids and their squared norms: a batch's query-to-centroid distances are one GEMM, its probed lists a
  top-m, and the probe rule (ratio, with the lists that hold the re-rank's candidates) is applied there, as
  NavigationTier.probe applies it on the host (exact navigation: at least the graph's recall). The centroids are
  float32, or float16 where float32 would take more than HALF_CENTROIDS_SHARE of the budget (#70 item 2:
  half_centroids): then they are held centred on their mean and scaled into float16's range, the queries likewise
  (each by its own scale), the GEMM multiplies float16 and accumulates in float32, and the norms are the stored
  float16 centroids' (float32): a distance is then the exact one to the rounded centroid, off only by the query's
  rounding. Measured on sift5k, Fashion-MNIST and GloVe (bench/results/gpu/half_navigation.md): at least 99.95%
  of float32's lists, the same true neighbours reached and the same recall, so no float32 re-score follows;
- the posting lists (CSR offsets and IDs) and every posting's PQ code (a byte a sub-space, or two 4-bit codes a
  byte: BuildConfig.pq_bits, the tables then 16 entries a sub-space) in list order, so the scan streams each
  probed list (kernels/adc_stream.py) instead of gathering codes by ID; a vector replicated in several lists
  gives equal keys, removed at top-n. The offsets, and a batch's scan segments, are int32 where the index's
  postings fit and int64 past INT32_POSTINGS, chosen per index at open; vector IDs are uint32, up to 2^32 - 1
  vectors (#70);
- top-n as two sorts of a batch's keys (by key, then stably by query) and a rank within each query, exact and
  needing no kernel of its own to compile (the unrolled top-n kernel took 26-37 s to compile at open);
- where they fit in gpu_tiered_share of what is left, every raw vector (float32, converted from how the page
  file stores it, so the distances are the host re-rank's): candidates are re-ranked on the device and the
  batch reads nothing from SSD. Otherwise the top-n go back to the host re-rank (a few KiB a query).

Temporaries come from torch's allocator, in chunks of queries sized so that a batch's working memory stays
within the `working memory` part reserved in the budget at open.

Larger than its budget (tiered): where every posting's ID and code do not fit, the hottest lists' postings stay on
the device (at most gpu_tiered_share of what the other parts leave) and the rest lie in pinned host memory, in
list order too; the scan streams a cold list from there over the bus (zero-copy), so a batch still sends only
its queries. Until queries have come, longer lists count as hotter; `rebalance` (the index manager's thread)
re-places them by the lists probed since open. No raw vectors go up then: the host re-ranks the top-n. A tier
whose other parts (centroids, offsets, codebooks, bitmap, working memory) do not fit is not made (BudgetError);
open_filter_tier then opens the lists tier (gpu_tier.GpuFilterTier).

Without CUDA the same code runs on CPU tensors with Triton's interpreter (TRITON_INTERPRET=1), as the tests run it.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fusionrag.kernels import INTERPRETER_LOCK
from fusionrag.kernels import adc_stream as adc_stream_mod
from fusionrag.kernels import pq_table as pq_table_mod
from fusionrag.kernels.adc_stream import adc_stream
from fusionrag.kernels.pool import ALIGN, OVERHEAD, BudgetAccount, BudgetError
from fusionrag.kernels.pq_table import pq_tables
from fusionrag.kernels.topn import EMPTY, unpack_keys
from fusionrag.kernels.variants import Variant, compile_all
from fusionrag.retriever.engine.config import SearchParams, probe_widening
from fusionrag.retriever.engine.filtering import Candidates
from fusionrag.retriever.errors import InputError

MIN_WORK, MAX_WORK = 4 << 20, 1 << 30  # working memory a tier reserves: chunks of a batch fit in it
ALLOCATOR_SLACK = 24 << 20  # as gpu_tier: room for the caching allocator's rounding in a measured budget
# Bytes of working memory per posting of a chunk (keys, their sort's keys and orders, query index, masks and ranks)
PER_POSTING = 128
UPLOAD_CHUNK = 1 << 22  # rows of codes or vectors copied up at a time: no host copy of them all at once
# Offsets (#70): an index of at most so many postings keeps its list starts, sizes and a batch's segments in int32
# (every index up to a few hundred million vectors); past it, in int64. The margin keeps a scan tile's last position
# (start + BLOCK) inside int32. Tests lower it to force the wide path at small N.
INT32_POSTINGS = (1 << 31) - (1 << 16)
MAX_VECTORS = (1 << 32) - 1  # vector IDs are uint32 in the postings and in the rank keys (topn.pack_key)
# Navigation (#70 item 2): centroids whose float32 copy would take more than this share of the device's budget are
# held in float16 (half the bytes, and the GEMM on the tensor cores). 2%: on an H100's 80 GB, float32 up to ~3M
# centroids at d 128 (10M vectors at ratio 0.1, 100M at 0.01: ~1M centroids, 0.5 GB), float16 past it (100M at
# ratio 0.1, and every billion-vector index on an H100 or an H200). Tests set it to 0 to force the half path at
# small N (or pass centroid_dtype).
HALF_CENTROIDS_SHARE = 0.02
CENTROID_DTYPES = ("float32", "float16")


@dataclass
class DeviceBatch:
    """What one batch's device search gives back: ids and distances, best first, -1 / inf padded. final: they
    are the exact top-k (raw vectors on the device); else the top-n PQ candidates, for the host's re-rank."""

    ids: np.ndarray
    dists: np.ndarray
    final: bool
    probed: np.ndarray  # int64 (q,): lists probed
    gathered: np.ndarray  # int64 (q,): postings scanned, replicas included
    unique: np.ndarray  # int64 (q,): distinct candidates (not excluded)
    seconds: float  # the batch's wall time on the device side, uploads and downloads included
    bytes_up: int  # host-to-device bytes of the batch
    bytes_down: int  # device-to-host bytes of the batch


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def wide_offsets(postings: int, int32_postings: int | None = None) -> bool:
    """Whether an index of so many postings keeps its offsets in int64 (#70)."""
    return postings > (INT32_POSTINGS if int32_postings is None else int32_postings)


def half_centroids(n_lists: int, cdim: int, budget_bytes: int, share: float | None = None) -> bool:
    """Whether a device tier holds its centroids in float16 (#70 item 2): where float32 ones would take more than
    `share` (None: HALF_CENTROIDS_SHARE) of the budget."""
    return n_lists * cdim * 4 > (HALF_CENTROIDS_SHARE if share is None else share) * budget_bytes


def fixed_parts(count: int, n_lists: int, cdim: int, codebook_floats: int, wide: bool,
                half: bool = False) -> dict[str, int]:
    """Bytes of the parts a device tier holds whatever its budget (before alignment): what DeviceTier reserves
    first, and what a capacity plan (plan.py) counts. half: float16 centroids (and their float32 mean)."""
    centroids = n_lists * cdim * (2 if half else 4) + n_lists * 4 + (cdim * 4 if half else 0)
    return {"PQ codebooks": codebook_floats * 4, "centroids": centroids,
            "list starts and sizes": n_lists * 2 * (8 if wide else 4), "exclusion bitmap": (count + 7) // 8}


def _download(parts: list[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors to host arrays in one copy (one sync): their bytes laid end to end, split on the host."""
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in parts]).cpu().numpy()
    out, at = [], 0
    for t in parts:
        size = t.numel() * t.element_size()
        out.append(flat[at:at + size].view(_NUMPY[t.dtype]).reshape(tuple(t.shape)))
        at += size
    return out


_NUMPY = {torch.int64: np.int64, torch.float32: np.float32, torch.int32: np.int32}


def _host(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


class DeviceTier:
    """See the module. Implements the filter tier's interface (tables, topn: the lists given, as a shard of a
    sharded index or learned pruning gives them) and the device search (`navigates`: search)."""

    name = "gpu"
    overlaps = True
    navigates = True
    in_flight = 1

    def __init__(self, centroids: np.ndarray, augmented: bool, list_offsets: np.ndarray, list_ids: np.ndarray,
                 codes: np.ndarray, codebooks: np.ndarray, *, account: BudgetAccount, metric: str, batch_size: int,
                 threads: int, raw: Callable[[int, int], np.ndarray] | None = None, dim: int | None = None,
                 raw_share: float = 0.5, work_bytes: int = 0, compile_kernels: bool = True,
                 max_resident_postings: int | None = None, int32_postings: int | None = None,
                 centroid_dtype: str | None = None):
        """centroids: the navigation graph's (graph.vectors(); augmented for ip). raw(start, stop): the raw vectors
        of those ids as float32, read where they are kept, None to keep them off the device. raw_share: at most
        this share of what the fixed parts leave goes to raw vectors (tiered: to postings).
        max_resident_postings: at most so many postings on the device, the rest tiered (a benchmark's stand-in for
        a collection larger than its budget; None: as many as the budget holds). int32_postings: the most postings
        whose offsets stay int32 (None: INT32_POSTINGS); an index of more has them in int64. centroid_dtype:
        'float32' or 'float16' (None: half_centroids' rule over the budget)."""
        self.list_offsets, self.list_ids, self.threads, self.batch_size = list_offsets, list_ids, threads, batch_size
        self.account, self.device = account, account.device
        self._release = weakref.finalize(self, account.release)
        # One batch at a time on the device; in Triton's interpreter, which patches triton.language while a kernel
        # runs, one at a time in the process.
        self._lock = threading.Lock() if account.device.type == "cuda" else INTERPRETER_LOCK
        count, m = codes.shape  # m: a posting's code bytes (sub-spaces, or half of them for 4-bit codes)
        self.count, self.metric, self.augmented = count, metric, augmented
        self.m, self.ksub, self.code_bytes = codebooks.shape[0], codebooks.shape[1], m  # sub-spaces, centroids each
        self.dim = dim or codebooks.shape[0] * codebooks.shape[2]
        self.dsub = codebooks.shape[2]
        n_lists, cdim = centroids.shape
        postings = len(list_ids)
        if count > MAX_VECTORS:
            raise BudgetError(f"{count} vectors: the device tier holds vector IDs as uint32 (at most {MAX_VECTORS})")
        # Per index at open: int64 offsets only where the postings can pass int32 (#70)
        self.wide = wide_offsets(postings, int32_postings)
        self.offset_dtype = torch.int64 if self.wide else torch.int32
        cuda = self.device.type == "cuda"
        budget = account.budget
        self.sizes_host = np.diff(list_offsets).astype(np.int64)
        if centroid_dtype is None:
            centroid_dtype = "float16" if half_centroids(n_lists, cdim, budget.budget) else "float32"
        if centroid_dtype not in CENTROID_DTYPES:
            raise InputError(f"centroid_dtype must be one of {CENTROID_DTYPES}, got {centroid_dtype!r}")
        self.half = centroid_dtype == "float16"
        fixed = fixed_parts(count, n_lists, cdim, codebooks.size, self.wide, self.half)
        per_posting = m + 4  # its code and its vector ID
        self._codes_src, self._ids_src = codes, list_ids  # where placement reads them (memory maps, mostly)
        with budget.opening:
            try:
                slack = ALLOCATOR_SLACK if budget.measured else 0
                budget.true_up()
                self.compile_seconds = self._compile() if cuda and compile_kernels else {}
                budget.true_up()
                need = sum(_aligned(b) for b in fixed.values())
                room = budget.left - slack - need
                all_postings = _aligned(postings * 4) + _aligned(postings * m)
                least_work = max(MIN_WORK, work_bytes // ALIGN * ALIGN)  # work_bytes: as asked, if it was
                self.tiered = room - all_postings < least_work or (max_resident_postings is not None
                                                                   and max_resident_postings < postings)
                if self.tiered:  # where each list lies and how often it was probed
                    room -= 2 * _aligned(n_lists * 8) + _aligned(n_lists)
                else:
                    room -= all_postings
                if room < least_work:
                    parts = {**fixed, "list places and visits": n_lists * 17}
                    least = need + 2 * _aligned(n_lists * 8) + _aligned(n_lists) + least_work
                    raise BudgetError(f"the device tier needs {least} bytes of GPU memory "
                                      f"({', '.join(f'{k} {v}' for k, v in parts.items())}, working memory "
                                      f"{least_work}; the postings, {postings * per_posting} bytes, may lie in host "
                                      f"memory) and {budget.left - slack} are left")
                raw_bytes = count * self.dim * 4
                self.raw_resident = (not self.tiered and raw is not None
                                     and raw_bytes <= (room - least_work) * raw_share)
                if not work_bytes:  # a quarter of what is left, and no more than a whole batch could use
                    whole = batch_size * (postings * PER_POSTING + n_lists * 12 + 1024 * self.dim * 8)
                    work_bytes = int(np.clip(min((room - (raw_bytes if self.raw_resident else 0)) // 4, whole),
                                             MIN_WORK, MAX_WORK))
                self.work_bytes = work_bytes // ALIGN * ALIGN
                account.reserve("working memory", self.work_bytes)
                self.codebooks = account.upload("PQ codebooks", _host(codebooks.astype(np.float32, copy=False)))
                self._upload_centroids(centroids)
                self.sizes = account.upload("list sizes", _host(self.sizes_host.astype(np.int64 if self.wide
                                                                                      else np.int32)))
                self.starts = account.empty("list starts", (n_lists,), self.offset_dtype)  # in the memory it lies in
                self.bitmap = account.empty("exclusion bitmap", (max(1, (count + 7) // 8),), torch.uint8)
                self._bitmap_host: np.ndarray | None = None  # what self.bitmap holds (None: nothing yet)
                if self.tiered:
                    # The hottest lists' postings on the device, at most raw_share of what is left; the rest pinned
                    # on the host, sized for the most any placement leaves there (a list longer than the room
                    # left stops the hot run: less than the longest list's postings go unused).
                    self.capacity = int(max(0.0, (room - self.work_bytes) * raw_share - 2 * ALIGN) // per_posting)
                    self.capacity = min(self.capacity, postings, max_resident_postings or postings)
                    longest = int(self.sizes_host.max()) if n_lists else 0
                    cold = postings - max(0, self.capacity - longest) if self.capacity < postings else 0
                    self.cold_list = account.empty("list places", (n_lists,), torch.int8)
                    self._visits = account.empty("list visits", (n_lists,), torch.int64)
                    self._visits.zero_()
                    self.host_ids = torch.empty((cold,), dtype=torch.int32, pin_memory=cuda)
                    self.host_codes = torch.empty((cold, m), dtype=torch.uint8, pin_memory=cuda)
                else:
                    self.capacity = postings
                    self.cold_list = self._visits = self.host_ids = self.host_codes = None
                rows = max(1, self.capacity)  # a kernel's pointer argument must point somewhere, even all cold
                self.ids = account.empty("list ids", (rows,), torch.int32)
                self.codes = account.empty("PQ codes in list order", (rows, m), torch.uint8)
                self._hot = np.ones(n_lists, bool)
                self._place(self._choose(np.zeros(n_lists, np.int64)) if self.tiered else self._hot)
                self.raw = None
                if self.raw_resident:
                    self.raw = account.empty("raw vectors", (count, self.dim), torch.float32)
                    step = max(1, UPLOAD_CHUNK // max(1, self.dim))
                    for s in range(0, count, step):
                        e = min(count, s + step)
                        self.raw[s:e].copy_(_host(np.asarray(raw(s, e), dtype=np.float32)))
                budget.true_up()
            except BaseException:
                self._release()
                raise
        if cuda:
            torch.cuda.synchronize(self.device)
        self.phases = {"device_s": 0.0, "batches": 0, "bytes_up": 0, "bytes_down": 0, "bytes_over_bus": 0}

    def _upload_centroids(self, centroids: np.ndarray) -> None:
        """The centroids and their squared norms on the device: float32 as they are; or (half) centred on their
        mean, scaled so the largest coordinate is 1, in float16, with the norms of what is stored (float32), a
        chunk of rows at a time (no float32 copy of them all on the device)."""
        account, n_lists = self.account, len(centroids)
        self.centroid_mean, self.centroid_scale = None, 1.0
        if not self.half:
            c = centroids.astype(np.float32, copy=False)
            self.centroids = account.upload("centroids", _host(c))
            self.centroid_norms = account.empty("centroid norms", (n_lists,), torch.float32)
            self.centroid_norms.copy_(_host(np.einsum("ij,ij->i", c, c).astype(np.float32)))
            return
        step = max(1, UPLOAD_CHUNK // max(1, centroids.shape[1]))
        total = np.zeros(centroids.shape[1], np.float64)
        for s in range(0, n_lists, step):
            total += np.asarray(centroids[s:s + step], np.float64).sum(0)
        mean = (total / max(1, n_lists)).astype(np.float32)
        top = 0.0
        for s in range(0, n_lists, step):
            top = max(top, float(np.abs(np.asarray(centroids[s:s + step], np.float32) - mean).max(initial=0.0)))
        self.centroid_scale = top if top > 0 else 1.0
        self.centroid_mean = account.upload("centroid mean", _host(mean))
        self.centroids = account.empty("centroids", centroids.shape, torch.float16)
        self.centroid_norms = account.empty("centroid norms", (n_lists,), torch.float32)
        for s in range(0, n_lists, step):
            h = ((np.asarray(centroids[s:s + step], np.float32) - mean) / self.centroid_scale).astype(np.float16)
            back = h.astype(np.float32) * np.float32(self.centroid_scale)
            self.centroids[s:s + len(h)].copy_(_host(h))
            self.centroid_norms[s:s + len(h)].copy_(_host(np.einsum("ij,ij->i", back, back)))

    # -- placement (tiered) --------------------------------------------------------------------------------------
    def _choose(self, visits: np.ndarray) -> np.ndarray:
        """Which lists' postings go on the device: the most probed first (a resident byte saves a bus byte per
        probe), longer lists first among equals, while they fit the capacity."""
        order = np.lexsort((-self.sizes_host, -np.asarray(visits)))
        fits = np.cumsum(self.sizes_host[order]) <= self.capacity
        hot = np.zeros(len(self.sizes_host), bool)
        hot[order[fits]] = True  # a prefix: cumsum grows
        return hot

    def _place(self, hot: np.ndarray) -> None:
        """Lay the postings of the lists `hot` marks out on the device, the rest in pinned host memory, each list one
        run in list order, copied a chunk of lists at a time from the index's list ids and codes."""
        starts = np.zeros(len(hot), np.int64)
        for where, dest_ids, dest_codes in ((hot, self.ids, self.codes), (~hot, self.host_ids, self.host_codes)):
            lists = np.flatnonzero(where)
            if not len(lists):
                continue
            lens = self.sizes_host[lists]
            at = np.cumsum(lens) - lens  # each list's start in its memory
            starts[lists] = at
            if at[-1] + lens[-1] > len(dest_ids):
                raise BudgetError(f"{at[-1] + lens[-1]} postings placed in room for {len(dest_ids)}")
            group = np.searchsorted(at, np.arange(0, at[-1] + lens[-1], UPLOAD_CHUNK), side="right") - 1
            for a, b in zip(group, [*group[1:], len(lists)]):
                if b <= a:
                    continue
                src = np.concatenate([np.arange(self.list_offsets[i], self.list_offsets[i + 1]) for i in lists[a:b]])
                rows = np.asarray(self._ids_src[src], dtype=np.int64)
                s, e = int(at[a]), int(at[a]) + len(src)
                dest_ids[s:e].copy_(_host(rows.astype(np.uint32).view(np.int32)))
                dest_codes[s:e].copy_(_host(np.asarray(self._codes_src[rows])))
        self.starts.copy_(_host(starts))
        if self.tiered:
            self.cold_list.copy_(_host((~hot).astype(np.int8)))
        self._hot = hot.copy()
        self.hot_postings = int(self.sizes_host[hot].sum())

    @property
    def visits(self) -> np.ndarray:
        """Per list, the queries that probed it since open (tiered only; zeros otherwise)."""
        if self._visits is None:
            return np.zeros(len(self.sizes_host), np.int64)
        return self._visits.cpu().numpy()

    # -- compile ------------------------------------------------------------------------------------------
    def variants(self) -> list[Variant]:
        # Both scans: whether the postings are tiered is known only once the kernels' own memory is counted.
        return [*pq_table_mod.variants(self.m, self.dsub, self.metric, self.ksub),
                *adc_stream_mod.variants(self.m, wide=self.wide, ksub=self.ksub),
                *adc_stream_mod.variants(self.m, tiered=True, wide=self.wide, ksub=self.ksub)]

    def _compile(self) -> dict[str, float]:
        with torch.cuda.device(self.device):
            seconds = compile_all(self.variants())
        return {name: round(t, 3) for name, t in seconds.items()}

    # -- the filter tier's interface ------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of the postings' codes held: on the device, and (tiered) the cold lists' IDs and codes pinned on
        the host; the host keeps no other copy once they are placed."""
        if self.codes is None:
            return 0
        return int(self.codes.numel()) + self.host_pinned_bytes()

    def host_pinned_bytes(self) -> int:
        return 0 if self.host_codes is None else int(self.host_codes.numel() + self.host_ids.numel() * 4)

    def describe(self) -> dict:
        cuda = self.device.type == "cuda"
        budget = self.account.budget
        return {
            "filter_tier": self.name,
            "gpu_search": "device",
            "device": torch.cuda.get_device_name(self.device) if cuda else "cpu (Triton interpreter)",
            "gpu_budget_bytes": budget.budget,
            "gpu_reserved_bytes": budget.used,
            "gpu_peak_bytes": budget.peak,
            "gpu_overhead_bytes": budget.parts.get(OVERHEAD, 0),
            "gpu_process_bytes": budget.process_bytes(),
            "gpu_allocator_reserved_bytes": int(torch.cuda.memory_reserved(self.device)) if cuda else None,
            "gpu_budget_holders": len(budget.owners),
            "gpu_index_reserved_bytes": self.account.used,
            "gpu_index_parts": dict(self.account.parts),
            "resident_code_fraction": round(self.hot_postings / max(1, len(self.list_ids)), 4),
            "postings_tiered": bool(self.tiered),
            "gpu_host_pinned_bytes": self.host_pinned_bytes(),
            "raw_vectors_resident": bool(self.raw_resident),
            "centroid_dtype": "float16" if self.half else "float32",
            "kernel_compile_seconds": dict(self.compile_seconds),
        }

    def close(self) -> None:
        with self._lock:
            if not self._release.alive:
                return
            self.codebooks = self.centroids = self.centroid_norms = self.centroid_mean = None
            self.starts = self.sizes = None
            self.ids = self.codes = self.bitmap = self.raw = self.cold_list = self._visits = None
            self.host_ids = self.host_codes = None
            self._release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def rebalance(self) -> None:
        """Tiered: re-place the lists' postings by the probes counted since open (the index manager's thread calls
        it; searches wait meanwhile); nothing where the same lists stay hot, or where every list is resident."""
        if not self.tiered:
            return
        with self._lock:
            if self.codes is None:
                return
            hot = self._choose(self.visits)
            if not np.array_equal(hot, self._hot):
                self._place(hot)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)

    def tables(self, queries: np.ndarray) -> np.ndarray:
        """The queries as they are: topn builds their tables on the device with the rest of the batch."""
        return queries

    def topn(self, queries, probe_lists: np.ndarray, n: int, exclude: np.ndarray | None = None) -> Candidates:
        """Each query's top-n PQ candidates in the lists given (int (q, m), -1 where none); queries from
        self.tables (float32 (q, dim), prepared)."""
        if not isinstance(queries, np.ndarray) or queries.ndim != 2:
            raise InputError("the device tier's topn takes the prepared queries (its tables() gives them)")
        b = self.search(queries, None, n, n, exclude, lists=probe_lists, rerank=False)
        seconds = np.full(len(queries), b.seconds / max(1, len(queries)))
        return Candidates(b.ids, b.dists, b.gathered, b.unique, seconds)

    # -- the device search --------------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, p: SearchParams | None, n: int, k: int, exclude: np.ndarray | None = None,
               lists: np.ndarray | None = None, rerank: bool = True, passing: float = 1.0) -> DeviceBatch:
        """One batch: queries float32 (q, dim), prepared. lists None: navigate by p (nprobe, and the probe rule,
        widened where only `passing` of the vectors may be returned, as NavigationTier.probe); else the lists
        given. rerank: re-rank on the device where the raw vectors are (else the top-n return)."""
        if self.codes is None:
            raise InputError(f"the device tier of {self.account.owner} is closed")
        if n < 1:
            raise InputError(f"n must be positive, got {n}")
        t0 = time.perf_counter()
        nq = len(queries)
        up = down = 0
        with self._lock:
            q = _host(queries.astype(np.float32, copy=False)).to(self.device)
            up += q.numel() * 4
            if lists is None:
                dev_lists = self._navigate(q, p, passing)
            else:
                lists = np.ascontiguousarray(lists, dtype=np.int64)
                if lists.ndim != 2 or len(lists) != nq:
                    raise InputError(f"lists must be ({nq}, m), got {lists.shape}")
                if lists.size and (lists.max() >= len(self.list_offsets) - 1):
                    raise InputError("lists names a posting list the index does not have")
                dev_lists = _host(lists).to(self.device)
                up += lists.nbytes
            if exclude is not None:
                up += self._exclude(exclude)
            excl = self.bitmap if exclude is not None else None
            tables = pq_tables(q, self.codebooks, self.metric)
            probed = (dev_lists >= 0).sum(1)
            final = rerank and self.raw_resident
            width = min(k, n) if final else n
            out_ids = torch.full((nq, width), -1, dtype=torch.int64, device=self.device)
            out_d = torch.full((nq, width), float("inf"), dtype=torch.float32, device=self.device)
            gathered = torch.zeros(nq, dtype=torch.int64, device=self.device)
            unique = torch.zeros(nq, dtype=torch.int64, device=self.device)
            valid = dev_lists >= 0
            at = dev_lists.clamp(min=0)
            per_list = torch.where(valid, self.sizes[at], 0)
            bus = 0
            if self.tiered:  # the lists probed, counted for placement; the postings read over the bus
                self._visits.index_add_(0, at.reshape(-1), valid.reshape(-1).to(torch.int64))  # no mask: no sync
                counts = torch.stack([per_list.sum(1), (per_list * self.cold_list[at]).sum(1)]).cpu().numpy()
                sizes, bus = counts[0], int(counts[1].sum()) * (self.code_bytes + 4)
                down += nq * 8
            else:
                sizes = per_list.sum(1).cpu().numpy()
            for s, e in self._chunks(sizes, n if final else 0):
                total = int(sizes[s:e].sum())  # the chunk's postings, known on the host: no sync for them
                ids, dists, gathered[s:e], unique[s:e] = self._top_n(tables[s:e], dev_lists[s:e], n, excl, total)
                if final:
                    ids, dists = self._rerank(q[s:e], ids, width)
                out_ids[s:e], out_d[s:e] = ids, dists
            down += nq * width * 12 + nq * 32  # results; per query probed, gathered, unique and its postings
            result = _download([out_ids, out_d, probed.to(torch.int64), gathered, unique])
        seconds = time.perf_counter() - t0
        self.phases["device_s"] += seconds
        self.phases["batches"] += 1
        self.phases["bytes_up"] += up
        self.phases["bytes_down"] += down
        self.phases["bytes_over_bus"] += bus
        return DeviceBatch(*result[:2], final, *result[2:], seconds, up, down)

    def _chunks(self, postings: np.ndarray, rerank_n: int):
        """[start, stop) of query chunks whose working memory fits: the scan's PER_POSTING bytes a posting, and
        the re-rank's n vectors a query (rerank_n)."""
        per_query = postings * PER_POSTING + rerank_n * self.dim * 4 * 2 + 64
        cost = np.cumsum(per_query)
        s, nq = 0, len(postings)
        while s < nq:
            before = cost[s - 1] if s else 0
            e = max(s + 1, int(np.searchsorted(cost, before + self.work_bytes, side="right")))
            yield s, min(e, nq)
            s = e

    def _navigate(self, q: torch.Tensor, p: SearchParams, passing: float = 1.0) -> torch.Tensor:
        """Each query's probed lists (int64 (q, m), -1 where the probe rule cuts): the nearest centroids by exact
        distance, then the rule NavigationTier.probe applies."""
        n_lists = self.centroids.shape[0]
        m, floor = probe_widening(p, passing)
        m = min(m, n_lists)
        qa = torch.cat([q, torch.zeros(len(q), 1, dtype=q.dtype, device=q.device)], 1) if self.augmented else q
        rows = max(1, self.work_bytes // (n_lists * 4 * 3))
        lists = torch.empty((len(q), m), dtype=torch.int64, device=q.device)
        dists = torch.empty((len(q), m), dtype=torch.float32, device=q.device)
        for s in range(0, len(q), rows):
            x = qa[s:s + rows]
            if self.half:
                d = self._distances(x)
            else:
                d = torch.addmm(self.centroid_norms[None, :], x, self.centroids.T, alpha=-2.0)
                d += (x * x).sum(1, keepdim=True)
            dists[s:s + rows], lists[s:s + rows] = torch.topk(d, m, dim=1, largest=False, sorted=True)
        if p.probe == "ratio" and p.probe_ratio > 0 and not self.augmented and m > 1:
            r = dists.clamp(min=0).sqrt()
            keep = r <= (1 + p.probe_ratio) * r[:, :1]
            sizes = self.sizes[lists]
            keep |= (torch.cumsum(sizes, 1) - sizes) < floor
            lists = torch.where(keep, lists, torch.full_like(lists, -1))
        return lists

    def _distances(self, x: torch.Tensor) -> torch.Tensor:
        """Half navigation: squared distances (float32 (q, lists)) of queries x (float32, augmented where the index
        is ip) to the float16 centroids: x centred on their mean, each row scaled so its largest coordinate is 1
        and rounded to float16; the GEMM float16 x float16 accumulating and written in float32."""
        x = x - self.centroid_mean
        scale = x.abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        xh = (x / scale).to(torch.float16)
        if x.device.type == "cuda":
            try:
                dot = torch.mm(xh, self.centroids.T, out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch without mm's out_dtype: written in float16, which holds
                dot = torch.mm(xh, self.centroids.T).float()  # it (each coordinate at most 1: |dot| <= cdim)
        else:  # the CPU reference: the same float16 values, multiplied and summed in float32
            dot = xh.float() @ self.centroids.float().T
        back = xh.float() * scale
        d = torch.addcmul(self.centroid_norms[None, :], dot, scale, value=-2.0 * self.centroid_scale)
        return d.add_((back * back).sum(1, keepdim=True))

    def _exclude(self, exclude: np.ndarray) -> int:
        """The device bitmap made equal to `exclude`, uploading what changed since the last batch's; bytes sent."""
        need = (self.count + 7) // 8
        if exclude.shape != (need,) or exclude.dtype != np.uint8:
            raise InputError(f"exclude must be a uint8 bitmap of ceil(N/8) = {need} bytes, got {exclude.dtype} "
                             f"{exclude.shape}")
        held = self._bitmap_host
        if held is not None and np.array_equal(held, exclude):
            return 0
        if held is None:
            lo, hi = 0, need
        else:
            diff = np.flatnonzero(held != exclude)
            lo, hi = int(diff[0]), int(diff[-1]) + 1
        self.bitmap[lo:hi].copy_(_host(exclude[lo:hi]))
        self._bitmap_host = exclude.copy()
        return hi - lo

    def _top_n(self, tables: torch.Tensor, lists: torch.Tensor, n: int, excl: torch.Tensor | None,
               total: int | None = None):
        """The n best distinct candidates of each query's lists: (ids int64 (q, n), PQ distances, postings
        scanned, distinct candidates not excluded). total: the lists' postings where the caller knows them (else
        read from the device: a sync). Nothing here waits for the device then: no mask indexing, no sizes read."""
        nq = len(lists)
        valid = lists >= 0
        at = lists.clamp(min=0)
        starts = torch.where(valid, self.starts[at], 0)
        ends = starts + torch.where(valid, self.sizes[at], 0)
        tiers = {}
        if self.tiered:
            tiers = dict(cold=self.cold_list[at] * valid, host_ids=self.host_ids, host_codes=self.host_codes)
        keys, seg = adc_stream(tables.contiguous(), torch.stack([starts, ends], -1), self.ids, self.codes, **tiers,
                               total=total)
        counts = seg[1:] - seg[:-1]
        total = keys.numel()
        # one column more: the keys not taken are written there (a scatter with no mask), and it is dropped
        out = torch.full((nq, n + 1), EMPTY, dtype=torch.int64, device=lists.device)
        if total:
            if excl is not None:
                vid = keys & 0xFFFFFFFF
                bit = (excl[vid >> 3].to(torch.int64) >> (vid & 7)) & 1
                keys = torch.where(bit == 1, torch.full_like(keys, EMPTY), keys)
            qidx = torch.repeat_interleave(torch.arange(nq, device=lists.device), counts, output_size=total)
            order = torch.argsort(keys)  # by (distance, id), then stably by query: each query's keys, ascending
            qs = qidx[order]
            regroup = torch.sort(qs, stable=True).indices
            k2, q2 = keys[order][regroup], qs[regroup]
            live = k2 != EMPTY
            live[1:] &= (k2[1:] != k2[:-1]) | (q2[1:] != q2[:-1])  # a replica's key equals its first copy's
            seen = torch.cumsum(live, 0)  # live keys up to and including each position
            before = torch.cat([torch.zeros(1, dtype=seen.dtype, device=seen.device), seen])[seg[:-1]]
            rank = seen - 1 - before[q2]  # among its query's live keys
            take = live & (rank < n)
            out[q2, torch.where(take, rank, n)] = k2  # (query, rank < n) taken once each; the rest to column n
            unique = torch.zeros(nq, dtype=torch.int64, device=lists.device).index_add_(0, q2, live.to(torch.int64))
        else:
            unique = torch.zeros(nq, dtype=torch.int64, device=lists.device)
        ids, dists = unpack_keys(out[:, :n])
        return ids, dists, counts, unique

    def _rerank(self, q: torch.Tensor, ids: torch.Tensor, k: int):
        """Exact top-k of the candidates from the raw vectors on the device: squared l2, or -dot for ip, as the
        host re-rank computes them."""
        x = self.raw[ids.clamp(min=0)]
        if self.metric == "ip":
            d = -torch.einsum("qnd,qd->qn", x, q)
        else:
            d = ((x - q[:, None, :]) ** 2).sum(-1)
        d = torch.where(ids >= 0, d, torch.full_like(d, float("inf")))
        vals, pos = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False, sorted=True)
        out = ids.gather(1, pos)
        return torch.where(torch.isinf(vals), torch.full_like(out, -1), out), vals
