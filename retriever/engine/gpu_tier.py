"""The filter tier on a GPU (FusionANNS's middle tier): LUTs, de-duplication, ADC scan and top-n
in Triton kernels (kernels/), inside a fixed GPU memory budget.

At start-up the tier takes the PQ codebooks, a pool of working blocks (one per in-flight batch)
and the PQ codes from its account in the process's one budget per device, which every open
index shares (shared_account); close() gives them back. When not every code fits, the codes of
the most visited posting lists stay in GPU memory and the rest are read by the scan from pinned
host memory (zero-copy): the budget is never exceeded, only the scan slows down. Per batch only
the gathered vector IDs go to the GPU and only the top-n come back; an exclusion bitmap stays in
GPU memory, and a batch uploads only its 4 KiB chunks that changed since the block's last one.

On CUDA the tier compiles every kernel specialisation it will launch when it opens (Triton
would otherwise compile during the first requests), and the process's budget is trued up to what
the driver counts for the process (kernels/pool.py), before the tier sizes its share and after.

Without CUDA the same code runs on CPU tensors when TRITON_INTERPRET=1 (Triton's interpreter):
that is how the tests check this tier against the CPU tier.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from fusionrag import native
from fusionrag.kernels import INTERPRETER_LOCK
from fusionrag.kernels import adc_scan as adc_scan_mod
from fusionrag.kernels import pq_table as pq_table_mod
from fusionrag.kernels import topn as topn_mod
from fusionrag.kernels.adc_scan import adc_scan
from fusionrag.kernels.dedup import FREE
from fusionrag.kernels.pool import ALIGN, OVERHEAD, BlockPool, BudgetAccount, BudgetError, DeviceBudget, WorkingBlock
from fusionrag.kernels.pq_table import KSUB, pq_tables
from fusionrag.kernels.topn import topn as select_topn
from fusionrag.kernels.variants import Variant, compile_all
from fusionrag.retriever.engine.filtering import Candidates
from fusionrag.retriever.errors import ConfigError, InputError

# Working memory per block beyond the batch's tables: a few MiB hold a batch of typical queries
# (~50 bytes per gathered ID); more only lets a huge batch go in fewer passes.
MIN_WORK, MAX_WORK = 1 << 20, 256 << 20
# Room a measured budget keeps for the CUDA caching allocator's rounding when a tier sizes its
# share: allocations of 1-10 MiB take a 20 MiB segment, larger ones round up to 2 MiB.
ALLOCATOR_SLACK = 24 << 20
CHUNK = 4096  # bytes of an exclusion bitmap uploaded together


def gpu_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    raise ConfigError("filter_tier='gpu' needs a CUDA device and torch sees none "
                      "(with TRITON_INTERPRET=1 the kernels run on the CPU, slowly, for tests)")


def default_budget(device: torch.device, llm_utilization: float) -> int:
    """What an LLM server taking `llm_utilization` of the device's memory leaves (and is free now)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(min(free, total * (1 - llm_utilization)))
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * (1 - llm_utilization))


@dataclass
class DeviceLuts:
    """A batch's tables, computed in a working block that topn then uses (and gives back)."""

    tables: torch.Tensor  # float32 (q, M, 256) on the device
    block: WorkingBlock  # its later views are carved after the tables
    pool: BlockPool  # where the block goes back


_INTERPRETER = INTERPRETER_LOCK  # one batch at a time in Triton's interpreter (GpuFilterTier._on)

# The process's one budget per device, shared by every GPU filter tier (see shared_account).
_budgets: dict[torch.device, DeviceBudget] = {}
_budgets_lock = threading.Lock()


def shared_account(device: torch.device, budget_bytes: int, llm_utilization: float, owner: str) -> BudgetAccount:
    """An account in the process's budget on `device`. The first tier to open on a device that no
    tier holds sizes the budget (budget_bytes, or 0: what the LLM server leaves); while any tier
    holds it, budget_bytes 0 joins it and another explicit size is a ConfigError."""
    device = torch.device(device)
    with _budgets_lock:
        budget = _budgets.get(device)
        if budget is None or not budget.owners:
            size = budget_bytes or default_budget(device, llm_utilization)
            if size <= 0:
                raise ConfigError(f"no GPU memory is left for the filter tier on {device} "
                                  f"(gpu_memory_utilization={llm_utilization}); set gpu_budget_bytes")
            if budget is None:
                budget = _budgets[device] = DeviceBudget(device, size, measured=True)
            else:
                budget.resize(size)
        elif budget_bytes and budget_bytes != budget.budget:
            raise ConfigError(
                f"gpu_budget_bytes={budget_bytes} for {owner}, but this process's GPU memory budget on {device} "
                f"is {budget.budget} bytes, held by {', '.join(sorted(budget.owners))}: every index of a "
                f"process shares one budget, so open them all with the same gpu_budget_bytes (or 0 to join)")
        return budget.account(owner)


class GpuFilterTier:
    """The filter tier on a GPU; see the module's docstring. Its batches always overlap the CPU's graph
    search and re-rank of others."""

    name = "gpu"
    overlaps = True

    def __init__(self, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray, codebooks: np.ndarray,
                 *, account: BudgetAccount, metric: str, batch_size: int, threads: int, blocks: int = 2,
                 work_bytes: int = 0, hotness: np.ndarray | None = None, tiered_share: float = 0.5):
        """metric: the tables' ('l2' or 'ip'), which decides the table kernel compiled here."""
        if codebooks.shape[1] != 256:
            raise ConfigError("the lists tier (gpu_search 'lists') scans 8-bit PQ codes only; an index with 4-bit "
                              "codes opens on the device tier (gpu_search 'device' or 'auto') or the CPU tier")
        self.list_offsets, self.list_ids, self.threads, self.batch_size = list_offsets, list_ids, threads, batch_size
        self.host_codes_all = codes  # the index's codes (memory-mapped or in RAM); placement reads them
        self.account, self.device = account, account.device
        # A tier dropped without close() still gives its bytes back when collected.
        self._release = weakref.finalize(self, account.release)
        self._close_lock = threading.Lock()
        count, m = codes.shape
        self.metric, self.m, self.dsub = metric, m, codebooks.shape[2]
        self.visits = np.zeros(len(list_offsets) - 1, dtype=np.int64)
        # Where topn's time goes, summed over calls (bench/gpu/gpu_tier.py reads it around a sweep point): the IDs
        # gathered on the host (into the blocks' pinned memory), the rest of a pass staged there, and the
        # device's part from the first upload to the results back on the host; and how many passes it took.
        self.phases = {"gather_s": 0.0, "stage_s": 0.0, "device_s": 0.0, "passes": 0}
        self._phases_lock = threading.Lock()
        cuda = self.device.type == "cuda"
        budget = account.budget
        # Tiers opening at once would each size their share by the same room: one at a time.
        with budget.opening:
            try:
                self.codebooks = account.upload("PQ codebooks", _host(codebooks.astype(np.float32, copy=False)))
                padded_dim = codebooks.shape[0] * codebooks.shape[2]
                tables = _aligned(batch_size * m * KSUB * 4) + _aligned(batch_size * padded_dim * 4)
                bitmap = _aligned(ResidentBitmap.padded(count))  # one per block
                all_codes = _aligned(count * m)
                # What the process holds beyond the parts (the CUDA context first of all) comes out of
                # the budget before the tier sizes its share, and so do the kernels it compiles.
                slack = ALLOCATOR_SLACK if budget.measured else 0
                budget.true_up()
                self.tiered = all_codes + blocks * (tables + bitmap + (work_bytes or MIN_WORK)) > budget.left - slack
                if self.tiered and count >= 1 << 31:
                    raise BudgetError(f"{count} vectors do not all fit, and slots for partly resident codes are int32")
                self.compile_seconds = self._compile() if cuda else {}
                budget.true_up()
                room = budget.left - slack
                # Fair sharing with the other indexes in the budget: codes that fit are taken whole,
                # and the blocks grow into half of what they leave. Otherwise the tier takes
                # tiered_share of what its slot map leaves, a quarter of that for the blocks.
                share = int((room - _aligned(4 * count)) * tiered_share) if self.tiered else 0
                if not work_bytes:
                    spare = share // 4 if self.tiered else (room - all_codes) // 2
                    work_bytes = int(np.clip(spare // blocks - tables - bitmap, MIN_WORK, MAX_WORK)) // ALIGN * ALIGN
                self.pool = BlockPool(account, blocks, tables + work_bytes, work_bytes // 2)
                self.bitmaps = {block: ResidentBitmap(account, f"exclusion bitmap {i}", count, cuda)
                                for i, block in enumerate(self.pool.blocks)}
                if not self.tiered:
                    self.codes = account.upload("PQ codes", _host(codes))
                    self.slots = self.host_codes = None
                else:
                    self.slots = account.empty("code slot map", (count,), torch.int32)
                    hot = min(share - blocks * (tables + bitmap + work_bytes), budget.left - slack)
                    rows = min(count, max(0, hot) // ALIGN * ALIGN // m)
                    self.codes = account.empty("hot PQ codes", (rows, m), torch.uint8)
                    self.host_codes = torch.empty((count - rows, m), dtype=torch.uint8, pin_memory=cuda)
                    # Before any query has come, longer lists count as hotter: they hold more candidates.
                    self.place(np.diff(list_offsets) if hotness is None else hotness)
                if cuda:  # torch's own kernels a search launches load now too (CUDA loads modules lazily)
                    self.pool.blocks[0].arena[:8].view(torch.int64).fill_(FREE).zero_()
                budget.true_up()
            except BaseException as e:
                self._release()  # what it took so far goes back now, not when the tier is collected
                if isinstance(e, BudgetError):
                    raise ConfigError(
                        f"{e}; raise gpu_budget_bytes, lower gpu_memory_utilization or use filter_tier='cpu'") from e
                raise
        if cuda:
            torch.cuda.synchronize(self.device)

    def variants(self) -> list[Variant]:
        """Every kernel specialisation this tier's searches launch on a GPU."""
        return [*pq_table_mod.variants(self.m, self.dsub, self.metric), *adc_scan_mod.variants(self.m, self.tiered),
                *topn_mod.variants()]

    def _compile(self) -> dict[str, float]:
        """Compile and load every variant, several at a time (Triton caches them in memory for this process,
        and on disk); per kernel, seconds until its variants were compiled (variants.compile_all)."""
        with torch.cuda.device(self.device):
            seconds = compile_all(self.variants())
        return {name: round(t, 3) for name, t in seconds.items()}

    def close(self) -> None:
        """Give this tier's GPU memory back to the budget, once the batches in flight are done.
        The tier filters nothing after (its index's close() calls this)."""
        with self._close_lock:
            if not self._release.alive:
                return
            for _ in self.pool.blocks:
                self.pool.take()
            self.pool = self.codes = self.codebooks = self.slots = self.host_codes = None
            self.bitmaps = {}
            self._release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device (an LLM server beside us), not only torch's cache

    def _pool(self) -> BlockPool:
        pool = self.pool
        if pool is None:
            raise InputError(f"the GPU filter tier of {self.account.owner} is closed")
        return pool

    @property
    def in_flight(self) -> int:
        """Batches this tier filters at once: one per working block on CUDA. One in the
        interpreter, which patches triton.language process-wide while a kernel runs."""
        return len(self._pool().blocks) if self.device.type == "cuda" else 1

    def place(self, hotness: np.ndarray) -> None:
        """Give the resident code rows to the IDs of the hottest posting lists first."""
        lens = np.diff(self.list_offsets)
        order = np.argsort(-np.asarray(hotness), kind="stable")
        run = lens[order]
        starts = np.repeat(self.list_offsets[:-1][order] - (np.cumsum(run) - run), run)
        seq = self.list_ids[starts + np.arange(len(starts))]
        _, first = np.unique(seq, return_index=True)
        count = len(self.host_codes_all)
        ranked = np.concatenate([seq[np.sort(first)], np.setdiff1d(np.arange(count), seq)]).astype(np.int64)
        rows = self.codes.shape[0]
        hot, cold = ranked[:rows], ranked[rows:]
        slots = np.empty(count, dtype=np.int32)
        slots[hot] = np.arange(rows, dtype=np.int32)
        slots[cold] = -1 - np.arange(len(cold), dtype=np.int32)
        self.codes.copy_(_host(self.host_codes_all[hot]))
        self.host_codes.copy_(_host(self.host_codes_all[cold]))
        self.slots.copy_(torch.from_numpy(slots))

    def rebalance(self) -> None:
        """Re-place the resident codes by the posting lists visited since start-up. Safe while
        searches run: it holds every working block, so no scan reads the codes meanwhile."""
        if not self.tiered:
            return
        pool = self._pool()
        held = [pool.take() for _ in pool.blocks]
        try:
            self.place(self.visits)
        finally:
            for block in held:
                pool.give(block)

    def memory_bytes(self) -> int:
        if self.codes is None:  # closed
            return 0
        held = self.codes.numel() + (self.host_codes.numel() + self.slots.numel() * 4 if self.tiered else 0)
        return int(held)

    def describe(self) -> dict:
        """The process's budget on this device (shared by every GPU tier) and this index's share;
        what the process holds on the device, measured: the driver's per-process figure (None
        where it gives none, and without CUDA) and torch's allocator's; seconds spent compiling
        each kernel when the tier opened."""
        cuda = self.device.type == "cuda"
        budget = self.account.budget
        return {
            "filter_tier": self.name,
            "device": torch.cuda.get_device_name(self.device) if cuda else "cpu (Triton interpreter)",
            "gpu_budget_bytes": budget.budget,
            "gpu_reserved_bytes": budget.used,
            "gpu_peak_bytes": budget.peak,
            "gpu_overhead_bytes": budget.parts.get(OVERHEAD, 0),  # of gpu_reserved_bytes: context, kernels, rounding
            "gpu_process_bytes": budget.process_bytes(),
            "gpu_allocator_reserved_bytes": int(torch.cuda.memory_reserved(self.device)) if cuda else None,
            "gpu_budget_holders": len(budget.owners),
            "gpu_index_reserved_bytes": self.account.used,
            "gpu_index_parts": dict(self.account.parts),
            "resident_code_fraction": round(self.codes.shape[0] / max(1, len(self.host_codes_all)), 4)
            if self.codes is not None else 0.0,
            # the cold codes, pinned in host memory (memory_bytes counts them too)
            "gpu_host_pinned_bytes": int(self.host_codes.numel()) if self.tiered and self.host_codes is not None else 0,
            "kernel_compile_seconds": dict(self.compile_seconds),
        }

    def _on(self, block: WorkingBlock):
        """On CUDA, the block's stream. Triton's interpreter patches triton.language process-wide while
        a kernel runs: there, one batch at a time in the whole process."""
        return torch.cuda.stream(block.stream) if block.stream is not None else _INTERPRETER

    def tables(self, queries: np.ndarray) -> DeviceLuts:
        """The queries' tables for the tier's metric, built in a working block that topn then uses."""
        pool = self._pool()
        block = pool.take()
        try:
            block.reset()
            with self._on(block):
                q = block.device(queries.shape, torch.float32)
                q.copy_(_host(queries))
                out = block.device((len(queries), self.m, KSUB), torch.float32)
                tables = pq_tables(q, self.codebooks, self.metric, out=out)
            return DeviceLuts(tables, block, pool)
        except BaseException:
            pool.give(block)
            raise

    def topn(self, luts, probe_lists: np.ndarray, n: int, exclude: np.ndarray | None = None) -> Candidates:
        """As CpuFilterTier.topn; luts from self.tables (already on the device) or a host array."""
        start = time.perf_counter()
        if isinstance(luts, DeviceLuts):
            block, tables, pool = luts.block, luts.tables, luts.pool
        else:
            pool = self._pool()
            block = pool.take()
        try:
            with self._on(block):
                if not isinstance(luts, DeviceLuts):
                    block.reset()
                    tables = block.device(luts.shape, torch.float32)
                    tables.copy_(_host(luts.astype(np.float32, copy=False)))
                return self._topn(block, tables, probe_lists, n, exclude, start)
        finally:
            pool.give(block)

    def _topn(self, block, tables, probe_lists, n, exclude, start) -> Candidates:
        q = len(probe_lists)
        if n < 1:
            raise InputError(f"n must be positive, got {n}")
        if tables.shape[0] != q:
            raise InputError(f"{tables.shape[0]} queries' tables for {q} queries' probe lists")
        t = time.perf_counter()
        # Where each query's IDs go (every probe validated); the IDs themselves are gathered pass by pass
        # straight into the working block's pinned memory (_pass): an array of them made for each batch
        # (40 MB for 1024 queries of 10k candidates) took longer to fault in and copy than to fill.
        probe_lists = np.ascontiguousarray(probe_lists, dtype=np.int32)
        offsets = native.gather_offsets(probe_lists, self.list_offsets, self.list_ids)
        # Racy under concurrent calls, and harmless: hotness only orders placement.
        self.visits += np.bincount(probe_lists[probe_lists >= 0], minlength=len(self.visits))
        self._phase("gather_s", time.perf_counter() - t)
        counts = np.diff(offsets)
        excluded = None
        if exclude is not None:
            need = (len(self.host_codes_all) + 7) // 8
            if exclude.shape != (need,) or exclude.dtype != np.uint8:
                raise InputError(
                    f"exclude must be a uint8 bitmap of ceil(N/8) = {need} bytes, got {exclude.dtype} {exclude.shape}")
            excluded = self.bitmaps[block].update(exclude)
        base = block.mark()
        out_ids = np.empty((q, n), dtype=np.int64)
        out_dists = np.empty((q, n), dtype=np.float32)
        unique = np.empty(q, dtype=np.int64)
        # Queries go in as many passes as the block needs (_pass_bytes); a query that alone overflows
        # the block is split (_split).
        dev_cost, host_cost = (np.cumsum(c) for c in _pass_bytes(counts, _table_caps(counts), n))
        dev_room, host_room = block.device_bytes - base - SLACK, block.host_bytes - SLACK
        i = 0
        while i < q:
            before_dev = dev_cost[i - 1] if i else 0
            before_host = host_cost[i - 1] if i else 0
            j = min(np.searchsorted(dev_cost, before_dev + dev_room, side="right"),
                    np.searchsorted(host_cost, before_host + host_room, side="right"))
            if j == i:
                ids, _ = native.gather(probe_lists[i:i + 1], self.list_offsets, self.list_ids, self.threads)
                self._split(block, base, tables[i:i + 1], ids, n, excluded, out_ids[i], out_dists[i],
                            unique[i:i + 1], dev_room, host_room)
                j = i + 1
            else:
                self._pass(block, base, tables[i:j], self._lists_gatherer(probe_lists[i:j]),
                           offsets[i:j + 1] - offsets[i], n, excluded, out_ids[i:j], out_dists[i:j], unique[i:j])
            i = j
        seconds = np.full(q, (time.perf_counter() - start) / max(q, 1))
        return Candidates(out_ids, out_dists, counts, unique, seconds)

    def _split(self, block, base, table, ids, n, excluded, out_ids, out_dists, unique, dev_room, host_room) -> None:
        """One query whose IDs overflow the block (a query left short by exclusions re-probes every
        list): its distinct IDs go in parts that fit, each ID in one part, so the parts' unique counts
        add up and their top-n merge into the query's."""
        distinct = np.unique(ids)

        def fits(part: int) -> bool:
            c = np.array([part])
            dev, host = _pass_bytes(c, _table_caps(c), n)
            return dev[0] <= dev_room and host[0] <= host_room

        if not fits(1):
            raise InputError(f"a working block of {block.device_bytes} bytes cannot hold the top n={n} of a query; "
                             f"lower rerank, or raise gpu_budget_bytes")
        part = 1
        while part < len(distinct) and fits(2 * part):
            part *= 2
        found_ids, found_dists = [], []
        part_ids, part_dists = np.empty((1, n), np.int64), np.empty((1, n), np.float32)
        part_unique = np.empty(1, np.int64)
        unique[0] = 0
        for s in range(0, len(distinct), part):
            chunk = distinct[s:s + part]
            self._pass(block, base, table, functools.partial(np.copyto, src=chunk), np.array([0, len(chunk)]), n,
                       excluded, part_ids, part_dists, part_unique)
            found_ids.append(part_ids[0].copy())
            found_dists.append(part_dists[0].copy())
            unique[0] += part_unique[0]
        ids_all, dists_all = np.concatenate(found_ids), np.concatenate(found_dists)
        order = np.lexsort((ids_all, dists_all))[:n]  # (distance, id): the GPU's key order; -1 pads sort last (inf)
        out_ids[:], out_dists[:] = ids_all[order], dists_all[order]

    def _phase(self, name: str, amount: float) -> None:
        with self._phases_lock:
            self.phases[name] += amount

    def _lists_gatherer(self, probe_lists: np.ndarray):
        """Writes the IDs of these queries' probed lists into a uint32 buffer (gather_into), timed as gather_s."""
        def fill(out: np.ndarray) -> None:
            t = time.perf_counter()
            native.gather_into(probe_lists, self.list_offsets, self.list_ids, out, self.threads)
            self._phase("gather_s", time.perf_counter() - t)
        return fill

    def _pass(self, block, base, tables, fill_ids, offsets, n, excluded, out_ids, out_dists, unique) -> None:
        """One pass of the block over the queries whose IDs fill_ids(out) writes (uint32 out, offsets[-1] long)."""
        q = len(offsets) - 1
        caps = _table_caps(np.diff(offsets))
        block.reset(base)
        total = int(offsets[-1])
        h_ids = block.host((total,), torch.int32)
        fill_ids(h_ids.numpy().view(np.uint32))
        t = time.perf_counter()
        h_offsets = block.host((q + 1,), torch.int64)
        h_offsets.numpy()[:] = offsets
        h_bases = block.host((q + 1,), torch.int64)
        h_bases.numpy()[:] = np.concatenate([[0], np.cumsum(caps)])
        staged = time.perf_counter()
        self._phase("stage_s", staged - t)
        self._phase("passes", 1)
        d_ids = block.device((total,), torch.int32)
        d_ids.copy_(h_ids, non_blocking=True)
        d_offsets = block.device((q + 1,), torch.int64)  # views of their own: every pointer 16-byte aligned
        d_offsets.copy_(h_offsets, non_blocking=True)
        d_bases = block.device((q + 1,), torch.int64)
        d_bases.copy_(h_bases, non_blocking=True)
        table = block.device((int(caps.sum()),), torch.int64).fill_(FREE)
        keys = block.device((total,), torch.int64)
        d_unique = block.device((q,), torch.int64).zero_()
        longest = int(np.diff(offsets).max())  # known here: nothing is read back before the results
        adc_scan(tables, d_ids, d_offsets, self.codes, self.host_codes, self.slots, excluded, table=table,
                 table_base=d_bases, keys=keys, unique=d_unique, max_count=longest)
        d_out_ids = block.device((q, n), torch.int64)
        d_out_dists = block.device((q, n), torch.float32)
        after = block.device((q,), torch.int64)
        select_topn(keys, d_offsets, n, d_out_ids, d_out_dists, max_count=longest, after=after)
        h_out_ids = block.host((q, n), torch.int64)
        h_out_dists = block.host((q, n), torch.float32)
        h_unique = block.host((q,), torch.int64)
        h_out_ids.copy_(d_out_ids, non_blocking=True)
        h_out_dists.copy_(d_out_dists, non_blocking=True)
        h_unique.copy_(d_unique, non_blocking=True)
        if block.stream is not None:
            block.stream.synchronize()
        self._phase("device_s", time.perf_counter() - staged)
        out_ids[:], out_dists[:], unique[:] = h_out_ids.numpy(), h_out_dists.numpy(), h_unique.numpy()


class ResidentBitmap:
    """An exclusion bitmap kept in device memory for one working block, and the host copy of what
    it holds (pinned on CUDA, so uploads are asynchronous): a batch uploads only the CHUNK-byte
    chunks that differ from the block's last one. Tombstones change between merges one delete at
    a time; a filter's bitmap changes with the filter."""

    def __init__(self, account: BudgetAccount, what: str, count: int, cuda: bool):
        self.nbytes = (count + 7) // 8
        self.device = account.empty(what, (self.padded(count),), torch.uint8).zero_()
        self.host = torch.zeros(self.padded(count), dtype=torch.uint8, pin_memory=cuda)

    @staticmethod
    def padded(count: int) -> int:
        return -(-((count + 7) // 8) // CHUNK) * CHUNK

    def update(self, bitmap: np.ndarray) -> torch.Tensor:
        """The device bitmap, made equal to `bitmap` (uint8 (nbytes,)) on the current stream."""
        n = self.nbytes
        held = self.host.numpy()
        full = n // CHUNK * CHUNK
        if full:  # whole chunks compared as 512 uint64 words each
            new_words = np.ascontiguousarray(bitmap[:full]).view(np.uint64).reshape(-1, CHUNK // 8)
            changed = np.any(new_words != held[:full].view(np.uint64).reshape(-1, CHUNK // 8), axis=1)
        else:
            changed = np.zeros(0, bool)
        changed = np.append(changed, n > full and not np.array_equal(bitmap[full:], held[full:n]))
        chunks = np.flatnonzero(changed)
        if len(chunks):
            # Runs of consecutive changed chunks go in one copy each.
            breaks = np.flatnonzero(np.diff(chunks) > 1)
            for a, b in zip(chunks[np.r_[0, breaks + 1]], chunks[np.r_[breaks, len(chunks) - 1]] + 1):
                lo, hi = a * CHUNK, min(b * CHUNK, n)
                held[lo:hi] = bitmap[lo:hi]
                self.device[lo:hi].copy_(self.host[lo:hi], non_blocking=True)
        return self.device


# A pass's bytes beyond what _pass_bytes counts: each view it carves is rounded up to ALIGN.
SLACK = 16 * ALIGN


def _table_caps(counts: np.ndarray) -> np.ndarray:
    """Hash table slots per query (dedup.table_layout): next_pow2(2 * count), at least 2."""
    return 2 ** np.ceil(np.log2(np.maximum(2 * counts, 2))).astype(np.int64)


def _pass_bytes(counts: np.ndarray, caps: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query of a pass, (device, host) bytes: IDs (4 B) and keys (8 B) per gathered ID, 8 B per hash
    slot, n results (12 B each), and offsets, table bases, unique counts and a top-n bound (8 B each)."""
    return 12 * counts + 8 * caps + 12 * n + 32, 4 * counts + 12 * n + 24


def _host(array: np.ndarray) -> torch.Tensor:
    """A tensor over a host array (often a read-only memory map) that is only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array))


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN
