"""The filter tier on a GPU (FusionANNS's middle tier): LUTs, de-duplication, ADC scan and top-n
in Triton kernels (kernels/), inside a fixed GPU memory budget.

At start-up the tier takes the PQ codebooks, a pool of working blocks (one per in-flight batch)
and the PQ codes from its account in the process's one budget per device, which every open
index shares (shared_account); close() gives them back. When not every code fits, the codes of
the most visited posting lists stay in GPU memory and the rest are read by the scan from pinned
host memory (zero-copy): the budget is never exceeded, only the scan slows down. Per batch only
the gathered vector IDs go to the GPU and only the top-n come back.

Without CUDA the same code runs on CPU tensors when TRITON_INTERPRET=1 (Triton's interpreter):
that is how the tests check this tier against the CPU tier.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from fusionrag import native
from fusionrag.kernels.adc_scan import adc_scan
from fusionrag.kernels.dedup import FREE
from fusionrag.kernels.pool import ALIGN, BlockPool, BudgetAccount, BudgetError, DeviceBudget, WorkingBlock
from fusionrag.kernels.pq_table import KSUB, pq_tables
from fusionrag.kernels.topn import topn as select_topn
from fusionrag.retriever.errors import ConfigError, InputError
from fusionrag.retriever.tiers import Candidates

# Working memory per block beyond the batch's tables: a few MiB hold a batch of typical queries
# (~50 bytes per gathered ID); more only lets a huge batch go in fewer passes.
MIN_WORK, MAX_WORK = 1 << 20, 256 << 20


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
                budget = _budgets[device] = DeviceBudget(device, size)
            else:
                budget.resize(size)
        elif budget_bytes and budget_bytes != budget.budget:
            raise ConfigError(
                f"gpu_budget_bytes={budget_bytes} for {owner}, but this process's GPU memory budget on {device} "
                f"is {budget.budget} bytes, held by {', '.join(sorted(budget.owners))}: every index of a "
                f"process shares one budget, so open them all with the same gpu_budget_bytes (or 0 to join)")
        return budget.account(owner)


class GpuFilterTier:
    name = "gpu"

    def __init__(self, list_offsets: np.ndarray, list_ids: np.ndarray, codes: np.ndarray, codebooks: np.ndarray,
                 *, account: BudgetAccount, batch_size: int, threads: int, blocks: int = 2, work_bytes: int = 0,
                 hotness: np.ndarray | None = None, tiered_share: float = 0.5):
        self.list_offsets, self.list_ids, self.threads = list_offsets, list_ids, threads
        self.host_codes_all = codes  # the index's codes (memory-mapped or in RAM); placement reads them
        self.account, self.device = account, account.device
        # A tier dropped without close() still gives its bytes back when collected.
        self._release = weakref.finalize(self, account.release)
        self._close_lock = threading.Lock()
        count, m = codes.shape
        self.visits = np.zeros(len(list_offsets) - 1, dtype=np.int64)
        budget = account.budget
        # Tiers opening at once would each size their share by the same room: one at a time.
        with budget.opening:
            try:
                self.codebooks = account.upload("PQ codebooks", _host(codebooks.astype(np.float32, copy=False)))
                padded_dim = codebooks.shape[0] * codebooks.shape[2]
                tables = _aligned(batch_size * m * KSUB * 4) + _aligned(batch_size * padded_dim * 4)
                room = budget.left
                all_codes = _aligned(count * m)
                self.tiered = all_codes + blocks * (tables + (work_bytes or MIN_WORK)) > room
                if self.tiered and count >= 1 << 31:
                    raise BudgetError(f"{count} vectors do not all fit, and slots for partly resident codes are int32")
                # Fair sharing with the other indexes in the budget: codes that fit are taken whole,
                # and the blocks grow into half of what they leave. Otherwise the tier takes
                # tiered_share of what its slot map leaves, a quarter of that for the blocks.
                share = int((room - _aligned(4 * count)) * tiered_share) if self.tiered else 0
                if not work_bytes:
                    spare = share // 4 if self.tiered else (room - all_codes) // 2
                    work_bytes = int(np.clip(spare // blocks - tables, MIN_WORK, MAX_WORK)) // ALIGN * ALIGN
                self.pool = BlockPool(account, blocks, tables + work_bytes, work_bytes // 2)
                if not self.tiered:
                    self.codes = account.upload("PQ codes", _host(codes))
                    self.slots = self.host_codes = None
                else:
                    self.slots = account.empty("code slot map", (count,), torch.int32)
                    hot = min(share - blocks * (tables + work_bytes), budget.left)
                    rows = min(count, max(0, hot) // ALIGN * ALIGN // m)
                    self.codes = account.empty("hot PQ codes", (rows, m), torch.uint8)
                    self.host_codes = torch.empty((count - rows, m), dtype=torch.uint8,
                                                  pin_memory=self.device.type == "cuda")
                    # Before any query has come, longer lists count as hotter: they hold more candidates.
                    self.place(np.diff(list_offsets) if hotness is None else hotness)
            except BaseException as e:
                self._release()  # what it took so far goes back now, not when the tier is collected
                if isinstance(e, BudgetError):
                    raise ConfigError(
                        f"{e}; raise gpu_budget_bytes, lower gpu_memory_utilization or use filter_tier='cpu'") from e
                raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Give this tier's GPU memory back to the budget, once the batches in flight are done.
        The tier filters nothing after (its index's close() calls this)."""
        with self._close_lock:
            if not self._release.alive:
                return
            for _ in self.pool.blocks:
                self.pool.take()
            self.pool = self.codes = self.codebooks = self.slots = self.host_codes = None
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
        """The process's budget on this device (shared by every GPU tier) and this index's share."""
        cuda = self.device.type == "cuda"
        budget = self.account.budget
        return {
            "filter_tier": self.name,
            "device": torch.cuda.get_device_name(self.device) if cuda else "cpu (Triton interpreter)",
            "gpu_budget_bytes": budget.budget,
            "gpu_reserved_bytes": budget.used,
            # CUDA: what the allocator saw at its peak, every tier's reservations included.
            "gpu_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)) if cuda else budget.peak,
            "gpu_budget_holders": len(budget.owners),
            "gpu_index_reserved_bytes": self.account.used,
            "gpu_index_parts": dict(self.account.parts),
            "resident_code_fraction": round(self.codes.shape[0] / max(1, len(self.host_codes_all)), 4)
            if self.codes is not None else 0.0,
        }

    def _on(self, block: WorkingBlock):
        return torch.cuda.stream(block.stream) if block.stream is not None else contextlib.nullcontext()

    def luts(self, pq, queries: np.ndarray, metric: str) -> DeviceLuts:
        pool = self._pool()
        block = pool.take()
        try:
            block.reset()
            with self._on(block):
                q = block.device(queries.shape, torch.float32)
                q.copy_(_host(queries))
                out = block.device((len(queries), pq.m, KSUB), torch.float32)
                tables = pq_tables(q, self.codebooks, metric, out=out)
            return DeviceLuts(tables, block, pool)
        except BaseException:
            pool.give(block)
            raise

    def topn(self, luts, probe_lists: np.ndarray, n: int, exclude: np.ndarray | None = None) -> Candidates:
        """As CpuFilterTier.topn; luts from self.luts (already on the device) or a host array."""
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
        ids, offsets = native.gather(probe_lists, self.list_offsets, self.list_ids, self.threads)  # validates
        # Racy under concurrent calls, and harmless: hotness only orders placement.
        self.visits += np.bincount(probe_lists[probe_lists >= 0], minlength=len(self.visits))
        counts = np.diff(offsets)
        caps = 2 ** np.ceil(np.log2(np.maximum(2 * counts, 2))).astype(np.int64)
        excluded = None
        if exclude is not None:
            need = (len(self.host_codes_all) + 7) // 8
            if exclude.shape != (need,) or exclude.dtype != np.uint8:
                raise InputError(
                    f"exclude must be a uint8 bitmap of ceil(N/8) = {need} bytes, got {exclude.dtype} {exclude.shape}")
            excluded = block.device((need,), torch.uint8)
            excluded.copy_(_host(exclude))
        base = block.mark()
        out_ids = np.empty((q, n), dtype=np.int64)
        out_dists = np.empty((q, n), dtype=np.float32)
        unique = np.empty(q, dtype=np.int64)
        # Queries go in as many passes as the block needs; each pass holds its IDs (4 B), keys
        # (8 B), hash slots (8 B each) and results, every view rounded up to ALIGN.
        slack = 8 * ALIGN
        dev_cost = np.cumsum(12 * counts + 8 * caps + 12 * n + 24)
        host_cost = np.cumsum(4 * counts + 12 * n + 24)
        dev_room, host_room = block.device_bytes - base - slack, block.host_bytes - slack
        i = 0
        while i < q:
            before_dev = dev_cost[i - 1] if i else 0
            before_host = host_cost[i - 1] if i else 0
            j = min(np.searchsorted(dev_cost, before_dev + dev_room, side="right"),
                    np.searchsorted(host_cost, before_host + host_room, side="right"))
            if j == i:
                raise InputError(
                    f"query {i} gathers {int(counts[i])} candidate IDs, more than a working block of "
                    f"{block.device_bytes} bytes holds with n={n}; lower nprobe or rerank, or raise gpu_budget_bytes")
            self._pass(block, base, tables[i:j], ids[offsets[i]:offsets[j]], offsets[i:j + 1] - offsets[i],
                       caps[i:j], n, excluded, out_ids[i:j], out_dists[i:j], unique[i:j])
            i = j
        seconds = np.full(q, (time.perf_counter() - start) / max(q, 1))
        return Candidates(out_ids, out_dists, counts, unique, seconds)

    def _pass(self, block, base, tables, ids, offsets, caps, n, excluded, out_ids, out_dists, unique) -> None:
        q = len(caps)
        block.reset(base)
        h_ids = block.host((len(ids),), torch.int32)
        h_ids.numpy()[:] = ids.view(np.int32)
        h_meta = block.host((2, q + 1), torch.int64)
        h_meta.numpy()[0] = offsets
        h_meta.numpy()[1] = np.concatenate([[0], np.cumsum(caps)])
        d_ids = block.device((len(ids),), torch.int32)
        d_ids.copy_(h_ids, non_blocking=True)
        meta = block.device((2, q + 1), torch.int64)
        meta.copy_(h_meta, non_blocking=True)
        table = block.device((int(caps.sum()),), torch.int64).fill_(FREE)
        keys = block.device((len(ids),), torch.int64)
        d_unique = block.device((q,), torch.int64).zero_()
        longest = int(np.diff(offsets).max())  # known here: nothing is read back before the results
        adc_scan(tables, d_ids, meta[0], self.codes, self.host_codes, self.slots, excluded, table=table,
                 table_base=meta[1], keys=keys, unique=d_unique, max_count=longest)
        d_out_ids = block.device((q, n), torch.int64)
        d_out_dists = block.device((q, n), torch.float32)
        select_topn(keys, meta[0], n, d_out_ids, d_out_dists, max_count=longest)
        h_out_ids = block.host((q, n), torch.int64)
        h_out_dists = block.host((q, n), torch.float32)
        h_unique = block.host((q,), torch.int64)
        h_out_ids.copy_(d_out_ids, non_blocking=True)
        h_out_dists.copy_(d_out_dists, non_blocking=True)
        h_unique.copy_(d_unique, non_blocking=True)
        if block.stream is not None:
            block.stream.synchronize()
        out_ids[:], out_dists[:], unique[:] = h_out_ids.numpy(), h_out_dists.numpy(), h_unique.numpy()


def _host(array: np.ndarray) -> torch.Tensor:
    """A tensor over a host array (often a read-only memory map) that is only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array))


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN
