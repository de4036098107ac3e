"""Page-buffer policies replayed offline on the block requests of real query streams, against the best any
policy could do (Belady's, which knows the future).

The blocks a re-rank asks for do not depend on the page buffer (only where they come from does), so one
recorded trace per (set, stream) replays every policy: PageStore.set_trace records each block fetch() is
asked for, in order, with how many queries asked (its weight). The replays of 'clock' and 'lfu' follow
native/page_buffer.cpp (shards of at least 256 frames, the same sketch hashes, aging and admission); the
native buffer's own hit ratio, measured on the same stream, checks them. Also replayed:

    lfu_agingA  lfu halving its counts every A requests a frame (--agings; the engine's: AGING, 10 before
                the tuning halves' replays chose 20)
    wlfu        W-TinyLFU (Einziger et al.): 1% of each shard's frames an LRU window that admits every missed
                block; a block leaving the window enters the main part only if the sketch counts it more
                often than the main part's victim (lfu's sweep)
    wlfuW       the same with a window of W% of the frames (--windows)
    lfu_sampleS lfu whose victim is the frame of least sketch count among the next S from the hand, instead
                of the first the sweep finds unused (--variants)
    lfu_ties    lfu admitting a missed block whose count equals the victim's (lfu keeps the victim)
    lfu_counted lfu starting an admitted block with its sketch count as its uses, instead of its weight
    opt         Belady with bypass over the whole buffer: on a miss, keep the blocks needed soonest (a block
                needed later than every resident one is not kept): no policy reads fewer blocks

Streams and warm-up as bench/cache/cache_policy.py (its streams, the first quarter not counted); a hit ratio is
pages served by the buffer / pages the re-rank touched, a block read for several queries counting as read
once and served for the others, as the engine counts it.

    python -m bench.cache.cache_sim [--datasets glove minilm fashion] [--half tune|report]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from bench.harness.paths import WORK, results

from bench.harness import sets
from bench.harness.streams import FRACTIONS, STREAMS, build, half_streams  # noqa: E402

MAX_USES = 15
CALL = 0xFFFFFFFF  # PageStore::kTraceCall: a fetch() call's header row
AGING = 20  # PageBuffer::kAgingRequests: requests per frame between two halvings of the counts
M64 = (1 << 64) - 1


def _slot(block: int, row: int, mask: int) -> int:
    h = ((block + 1) * (0xC2B2AE3D27D4EB4F if row else 0x9E3779B97F4A7C15)) & M64
    return (h >> 32) & mask


class _Shard:
    def __init__(self, frames: int, sketch: bool, aging: int = AGING):
        self.frames, self.aging = frames, aging
        self.block_of = [-1] * frames
        self.uses = [0] * frames
        self.frame_of: dict[int, int] = {}
        self.hand = 0
        size = 1
        while size < max(64, 16 * frames):
            size <<= 1
        self.sketch = [0] * size if sketch else None
        self.mask = size - 1
        self.requests = 0

    def estimate(self, b: int) -> int:
        return min(self.sketch[_slot(b, 0, self.mask)], self.sketch[_slot(b, 1, self.mask)])

    def count(self, b: int, w: int) -> None:
        to = min(255, self.estimate(b) + w)
        for row in (0, 1):
            i = _slot(b, row, self.mask)
            if self.sketch[i] < to:
                self.sketch[i] = to
        self.requests += w
        if self.requests >= self.aging * self.frames:
            self.sketch = [c >> 1 for c in self.sketch]
            self.uses = [u >> 1 for u in self.uses]
            self.requests //= 2

    def victim(self) -> int:
        while True:
            f = self.hand
            self.hand = (self.hand + 1) % self.frames
            if self.block_of[f] < 0 or not self.uses[f]:
                return f
            self.uses[f] -= 1


class NativeReplay:
    """'clock' and 'lfu' as native/page_buffer.cpp's PageBuffer runs them (no pinning); aging: lfu's requests per
    frame between two halvings of its counts."""

    def __init__(self, capacity: int, policy: str, aging: int = AGING):
        n = min(16, max(1, capacity // 256))
        self.lfu = policy == "lfu"
        self.shards = [_Shard(capacity * (i + 1) // n - capacity * i // n, self.lfu, aging) for i in range(n)]

    def _shard(self, b: int) -> _Shard:  # PageBuffer::shard_index
        return self.shards[(((b * 0x9E3779B1) & 0xFFFFFFFF) >> 16) % len(self.shards)]

    def lookup(self, b: int, w: int) -> bool:  # PageBuffer::lookup
        s = self._shard(b)
        if self.lfu:
            s.count(b, w)
        f = s.frame_of.get(b)
        if f is None:
            return False
        s.uses[f] = min(MAX_USES, s.uses[f] + w) if self.lfu else 1
        return True

    def insert(self, b: int, w: int) -> None:  # PageBuffer::insert, without pinning
        s = self._shard(b)
        if b in s.frame_of:
            return
        f = s.victim()
        old = s.block_of[f]
        if old >= 0:
            if self.lfu and s.estimate(b) <= s.estimate(old):
                return
            del s.frame_of[old]
        s.block_of[f], s.frame_of[b] = b, f
        s.uses[f] = min(MAX_USES, w) if self.lfu else 0


class WTinyLfu(NativeReplay):
    """lfu's shards, each with an LRU window of 1% of its frames in front of the main part."""

    def __init__(self, capacity: int, window: float = 0.01):
        super().__init__(capacity, "lfu")
        for s in self.shards:
            s.window_size = max(1, int(round(window * s.frames)))
            s.frames -= s.window_size  # the main part
            s.block_of, s.uses = s.block_of[:s.frames], s.uses[:s.frames]
            s.window = OrderedDict()

    def lookup(self, b: int, w: int) -> bool:
        s = self._shard(b)
        s.count(b, w)
        if b in s.window:
            s.window.move_to_end(b)
            return True
        f = s.frame_of.get(b)
        if f is None:
            return False
        s.uses[f] = min(MAX_USES, s.uses[f] + w)
        return True

    def insert(self, b: int, w: int) -> None:
        s = self._shard(b)
        if b in s.window or b in s.frame_of:
            return
        s.window[b] = w
        if len(s.window) > s.window_size:
            c, cw = s.window.popitem(last=False)
            f = s.victim()
            old = s.block_of[f]
            if old >= 0:
                if s.estimate(c) <= s.estimate(old):
                    return
                del s.frame_of[old]
            s.block_of[f], s.frame_of[c] = c, f
            s.uses[f] = min(MAX_USES, cw)


class LfuVariant(NativeReplay):
    """lfu with one of three changes (the module's docstring): victims sampled (sample > 0), ties admitted, or an
    admitted block's uses from its count."""

    def __init__(self, capacity: int, sample: int = 0, admit_ties: bool = False, counted: bool = False):
        super().__init__(capacity, "lfu")
        self.sample, self.admit_ties, self.counted = sample, admit_ties, counted

    def _victim(self, s: _Shard) -> int:
        if not self.sample:
            return s.victim()
        best, least = -1, None
        for _ in range(self.sample):
            f = s.hand
            s.hand = (s.hand + 1) % s.frames
            if s.block_of[f] < 0:
                return f
            e = s.estimate(s.block_of[f])
            if least is None or e < least:
                best, least = f, e
        return best

    def insert(self, b: int, w: int) -> None:
        s = self._shard(b)
        if b in s.frame_of:
            return
        f = self._victim(s)
        old = s.block_of[f]
        if old >= 0:
            new, kept = s.estimate(b), s.estimate(old)
            if new < kept or (new == kept and not self.admit_ties):
                return
            del s.frame_of[old]
        s.block_of[f], s.frame_of[b] = b, f
        s.uses[f] = min(MAX_USES, s.estimate(b) if self.counted else w)


VARIANTS = {"lfu_sample4": {"sample": 4}, "lfu_sample8": {"sample": 8}, "lfu_sample16": {"sample": 16},
            "lfu_ties": {"admit_ties": True}, "lfu_counted": {"counted": True}}


def calls(trace: np.ndarray) -> list[np.ndarray]:
    """PageStore.take_trace's rows, split into its fetch() calls (each a header row (CALL, n) and n requests)."""
    heads = np.flatnonzero(trace[:, 0] == CALL)
    if len(heads) == 0 or heads[0] != 0 or not np.array_equal(trace[heads, 1], np.diff(np.append(heads, len(trace))) - 1):
        raise ValueError("not a block trace of whole calls")
    return np.split(trace, heads[1:])


def belady(trace: np.ndarray, capacity: int, count_from: int) -> tuple[int, int]:
    """(blocks read, pages served) of the optimal policy with bypass, counted from row count_from."""
    keep = trace[:, 0] != CALL
    rows = np.flatnonzero(keep)
    trace, first = trace[keep], int(np.searchsorted(rows, count_from))
    blocks = trace[:, 0].astype(np.int64)
    n = len(blocks)
    nxt = np.full(n, n, dtype=np.int64)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        b = int(blocks[i])
        nxt[i] = last.get(b, n)
        last[b] = i
    resident: dict[int, int] = {}  # block -> its next request
    heap: list[tuple[int, int]] = []  # (-next request, block), stale entries skipped
    read = served = 0
    for i in range(n):
        b, w, nb = int(blocks[i]), int(trace[i, 1]), int(nxt[i])
        hit = b in resident
        if i >= first:
            read += 0 if hit else 1
            served += w if hit else w - 1
        if hit:
            resident[b] = nb
            heapq.heappush(heap, (-nb, b))
            continue
        if nb >= n or capacity == 0:
            continue
        if len(resident) >= capacity:
            while True:
                far, v = heap[0]
                if resident.get(v) == -far:
                    break
                heapq.heappop(heap)
            if -far <= nb:  # every resident block is needed sooner: bypass
                continue
            heapq.heappop(heap)
            del resident[v]
        resident[b] = nb
        heapq.heappush(heap, (-nb, b))
    return read, served


def replay(policy, trace: np.ndarray, count_from: int) -> tuple[int, int]:
    """(blocks read, pages served) with `policy`, counted from row count_from: each call looks all its blocks
    up, then inserts those it read, in order, as PageStore::fetch does."""
    read = served = at = 0
    for call in calls(trace):
        counted = at >= count_from
        at += len(call)
        missed = []
        for b, w in call[1:].tolist():
            hit = policy.lookup(b, w)
            if counted:
                read += 0 if hit else 1
                served += w if hit else w - 1
            if not hit:
                missed.append((b, w))
        for b, w in missed:
            policy.insert(b, w)
    return read, served


def record(idx_path: Path, q: np.ndarray, order: np.ndarray, batch: int, frac: int) -> dict:
    """The stream's block trace, and the native buffer's own counts with clock and lfu at buffer raw/frac."""
    from fusionrag.retriever import EngineConfig, Index

    raw = (idx_path / "vectors.pages").stat().st_size
    out = {}
    for policy in ("clock", "lfu"):
        index = Index.open(idx_path, EngineConfig(buffer_bytes=raw // frac, threads=1, filter_tier="cpu",
                                                  manager_interval_s=0.0, buffer_policy=policy, record_cache="off",
                                                  buffer_compression="off"))
        store = index.reranker.store
        warm = len(order) // 4
        read = buffered = 0
        parts, mark = [], None
        store.set_trace(True)
        for lo in range(0, len(order), batch):
            r = index.search(q[order[lo:lo + batch]], 10)
            if lo >= warm:  # counted as bench/cache/cache_policy.py counts
                mark = sum(len(t) for t in parts) if mark is None else mark
                read += int(r.stats["pages_read"].sum())
                buffered += int(r.stats["pages_buffered"].sum())
            parts.append(store.take_trace())
        store.set_trace(False)
        trace = np.concatenate(parts)
        out[policy] = {"read": read, "served": buffered, "frames": int(store.buffer_capacity)}
        if "trace" in out:
            assert np.array_equal(out["trace"], trace), "the block trace depended on the buffer policy"
        out["trace"], out["count_from"] = trace, mark
        index.close()
    return out


def markdown(res: dict) -> str:
    agings = sorted({int(k[len("lfu_aging"):]) for r in res["rows"] for k in r if k.startswith("lfu_aging")})
    windows = sorted({k for r in res["rows"] for k in r if k.startswith("wlfu") and k != "wlfu"},
                     key=lambda k: float(k[4:]))
    variants = [v for v in VARIANTS if any(v in r for r in res["rows"])]
    cols = ["clock", *(f"lfu_aging{a}" for a in agings), "wlfu", *windows, *variants, "opt"]
    lines = [f"# Page-buffer policies replayed on real block traces ({res['date']}, {res['half']} half)", "",
             f"Machine: {res['machine']}. Streams of {res['length']} queries from the {res['half']} half of each "
             f"set's queries (bench/harness/streams.py's streams), in batches of {res['batch']}, one thread, CPU filter "
             "tier; the first quarter warms up and is not counted. Page-buffer hit ratio = pages served by the "
             "buffer / pages the re-rank touched. `native clock` / `native lfu`: the engine's own counts on the "
             f"same stream (lfu with its built-in aging, {AGING} requests a frame); the other columns replay the "
             "recorded block trace (bench/cache/cache_sim.py): `lfu_agingA` halves its counts every A requests a frame, "
             "`wlfu` is W-TinyLFU (1% LRU window), `wlfuW` with a W% window, `lfu_sampleS`, `lfu_ties` and "
             "`lfu_counted` lfu with one change each (bench/cache/cache_sim.py's docstring), `opt` is Belady's with "
             "bypass, the most any policy could serve.", "",
             "| set | stream | buffer | native clock | native lfu | " + " | ".join(cols) + f" | lfu_aging{AGING} / clock |",
             "|---" * (6 + len(cols)) + "|"]
    for r in res["rows"]:
        ratio = r.get(f"lfu_aging{AGING}", float("nan")) / max(r["clock"], 1e-9)
        lines.append(f"| {r['set']} | {r['stream']} | {r['buffer']} | {r['native_clock']:.3f} | {r['native_lfu']:.3f} | "
                     + " | ".join(f"{r[c]:.3f}" if c in r else "–" for c in cols) + f" | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="*", default=["glove", "minilm", "fashion"])
    ap.add_argument("--fractions", nargs="*", type=int, default=list(FRACTIONS))
    ap.add_argument("--streams", nargs="*", default=list(STREAMS))
    ap.add_argument("--half", choices=("tune", "report"), default="tune")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--out", type=Path, default=results("cache"))
    ap.add_argument("--agings", nargs="*", type=int, default=[10, 20, 40, 80],
                    help="lfu's requests per frame between halvings, replayed")
    ap.add_argument("--windows", nargs="*", type=float, default=[],
                    help="W-TinyLFU windows (fractions of the frames) replayed besides wlfu's 1%%")
    ap.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                    help="changes to lfu's victim, admission or starting uses, replayed")
    ap.add_argument("--tag", default="cache_sim")
    args = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()} {os.cpu_count()}-core VM", "half": args.half,
           "length": args.length, "batch": args.batch, "rows": []}
    for name in args.datasets:
        idx_path = build(args.work, name)
        from fusionrag.retriever import Index

        _, queries, _, _ = sets.load(args.work, name)
        index = Index.open(idx_path, filter_tier="cpu")
        q = index.prepare_queries(queries)
        index.close()
        rows = half_streams(q, args.half, args.length)
        for sname in args.streams:
            for frac in args.fractions:
                rec = record(idx_path, q, rows[sname], args.batch, frac)
                trace, start, frames = rec["trace"], rec["count_from"], rec["clock"]["frames"]
                row = {"set": name, "stream": sname, "buffer": f"1/{frac}", "frames": frames,
                       "requests": int((trace[start:, 0] != CALL).sum())}
                policies = [("clock", NativeReplay(frames, "clock"))]
                policies += [(f"lfu_aging{a}", NativeReplay(frames, "lfu", a)) for a in args.agings]
                policies += [("wlfu", WTinyLfu(frames))]
                policies += [(f"wlfu{w * 100:g}", WTinyLfu(frames, w)) for w in args.windows]
                policies += [(v, LfuVariant(frames, **VARIANTS[v])) for v in args.variants]
                for p, pol in policies:
                    read, served = replay(pol, trace, start)
                    row[p] = served / max(1, read + served)
                read, served = belady(trace, frames, start)
                row["opt"] = served / max(1, read + served)
                for p in ("clock", "lfu"):
                    n = rec[p]
                    row[f"native_{p}"] = n["served"] / max(1, n["read"] + n["served"])
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{args.tag}.json").write_text(json.dumps(res, indent=1))
                (args.out / f"{args.tag}.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
