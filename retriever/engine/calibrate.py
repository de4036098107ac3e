"""Build-time calibration of an index's default search settings (BuildConfig.calibrate).

The class defaults of SearchParams (re-rank at most 200 PQ candidates, stop after 2 mini-batches that leave the
top-k unchanged) hold recall@10 near 0.95 on the real sets they were chosen on. They do not on flat data, where a
query's 10th neighbour is nearly as near as its 1st and a 64-byte PQ code cannot rank them: on 1M embedding-like
768-d vectors (d10/d1 1.07) the probed lists held 99.6% of the true top-10, but the PQ order put 11% of them
beyond the 200th candidate, and the early stop ended most searches after 9 mini-batches: recall@10 0.745.
The settings calibration chose there (rerank 1600, beta 24) gave 0.961 at 0.48x the QPS, and it left GloVe,
Fashion-MNIST, MiniLM and 100k 768-d vectors at the defaults (bench/results/calibration_*.md, docs/tuning.md).

So a build measures: recall@10 of `calibrate_queries` sample queries (the build's sample queries, a query log,
where it has them, else rows of the data; the rows sampled are left out of every search and of the truth, so no
row finds itself) against brute force, at the defaults and
then up LADDER's rungs, each re-ranking more candidates and waiting longer before it stops, until one reaches
`target_recall` by the lower confidence bound of its recall (Z standard errors below the sample's mean). The
first rung that does (or the last, where none does) is written to the manifest
("search_defaults"); Index.open takes it as the index's default SearchParams, and a request's own knobs
(SearchOverrides) apply over it. Where the index finds its lists by its navigation graph, the rung chosen is then
tried at narrower beams (BEAMS), and the narrowest that holds the recall is kept with it (_narrow). Where the
defaults already reach the target and the beam cannot narrow, nothing changes: calibration only raises the
re-rank, and narrows the beam only where the recall measured holds. An incremental merge measures again once the
index holds REMEASURE_GROWTH times more (or fewer) rows than its calibration measured, or first reaches MIN_ROWS
(merge_remeasures); a calibration on a query log is kept, since the merge has no log. A sharded build calibrates
its router the same way (calibrate_sharded), its sample searched across the shards.

Last, a second choice for an index that holds its raw vectors in RAM (EngineConfig.raw_in_ram), where the re-rank
scores every candidate it takes, with no early stop: the first choice with fewer candidates re-ranked while the
recall holds (walk_ram), kept as "search_defaults_ram".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fusionrag.retriever.engine import pq_choice
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig, SearchParams, cpu_threads
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.layout import PageLayout
from fusionrag.retriever.engine.learned_probe import exact_topk
from fusionrag.retriever.engine.manifest import MANIFEST, rewrite_manifest
from fusionrag.retriever.engine.vectors import STORAGE_DTYPES, internal_metric, sample_query_matrix
from fusionrag.retriever.errors import ConfigError

K = 10
# (rerank, beta): the class defaults first, then about 1.5x the candidates and the patience a rung (on the 1M
# 768-d set, doubling both went from recall 0.94 to 0.97 in one rung, at 0.6x the QPS).
LADDER = ((200, 2), (200, 3), (300, 4), (400, 6), (600, 8), (800, 12), (1200, 16), (1600, 24), (2400, 32))
# Where the navigation graph finds a query's lists, its beam is nprobe wide (SearchParams.graph_ef at least), and
# the class default (256) is set for recall, not cost: the beam took 1.2 of 1.3 ms a query on 100k 768-d vectors,
# where the ratio rule then kept ~23 lists. So calibration tries narrower beams at the rung it chose, down to the
# narrowest whose recall reaches the target and loses at most BEAM_SLACK to the best beam's (on that set and on
# Fashion-MNIST nprobe 64: recall -0.0004 / -0.0022, the rows' recall within 0.006 of held-out queries', 2-3.5x
# less time a query; bench/results/calibration_*_beam.md). Exact navigation costs the same at any nprobe: not tried.
BEAMS = (128, 64, 32)
BEAM_SLACK = 0.005
# Where no rung reaches the target, the lists probed bound the recall, not the re-rank: on 10M clustered 128-d
# vectors (lists of ~10 vectors, so a cluster's neighbours spread over hundreds of lists) every rung from rerank 600
# gave 0.904-0.908 at nprobe 256 (#51); at 512 the re-rank mattered again (600: 0.916, 2400: 0.939), and wider
# probes gave nothing more. So at each wider probe the ladder is climbed again from the cheapest rung whose recall
# was within PLATEAU of the best one's, with MORE rungs past its top, while a rung gains at least GAIN; a width that
# gains less than PLATEAU over the one before ends the search, and the best measured is kept where none reaches the
# target; where a width's first rung already reaches it, the cheaper rungs are tried there too (_cheaper).
# At 10M the climb at 512 still gained 0.003 at MORE's last rung then (4800: 0.955, its lower bound 0.945,
# 0.946 on fresh queries) and 1024 gained nothing at the same re-rank (each list ~10 vectors: 1024 lists hold twice
# the candidates 4800 re-ranks), so MORE goes on to twice that re-rank.
WIDER = (512, 1024, 2048)
MORE = ((3600, 48), (4800, 64), (7200, 96), (9600, 128))
PLATEAU = 0.005
GAIN = 0.001
MIN_ROWS = 2000  # fewer rows: the sample would be a large share of the data, and nearly every search is exact
# A merge measures again at 1.25x (or 1/1.25x) the rows measured: a collection merges up to 4x its last full build
# (CollectionConfig.rebuild_growth) before it rebuilds, and the settings chosen at 1x need not hold there.
REMEASURE_GROWTH = 1.25
# With the raw vectors in RAM (EngineConfig.raw_in_ram) a re-rank reads nothing: every candidate is scored from
# memory, with no early stop, so each one the re-rank takes costs the same, where the SSD path's early stop scores
# about a third of its 200 and stops. In RAM those 200 are more than the target needs: Fashion-MNIST's held-out
# queries, nprobe 64, 1 thread: rerank 200 recall@10 0.9969 at 8.9k q/s, 100 0.9966 at 11.1k, 50 0.9931 at 13.5k
# (the scan's selection of the best candidates costs less too). So calibration measures the answer RAM gives (the
# SSD path's at beta 0, where the re-rank too scores every candidate) at the settings it chose with the re-rank
# halved (to RAM_RERANK_MIN), while the recall's lower bound holds the target and the recall lies within RAM_SLACK
# of the best measured (walk_ram); the result is the manifest's search_defaults_ram, which Index.open takes where the
# raw vectors are resident. Not below 50: a query beside an outlier (far from every cluster, its neighbours at nearly
# equal distances) found 7 of its 10 at 30, 9 at 50. The lists probed stay as chosen: the sampled rows do not
# show what fewer lists cost queries unlike the rows (other clusters: 0.65 at nprobe 8). A filtered search (a filter
# passing 10% of 4,500 clustered rows: recall 1.0 on the rows at nprobe 32, 0.925 for the filtered queries) now
# widens its lists by the share passing (config.probe_widening), which would hold a narrowed nprobe's recall.
RAM_RERANK_MIN = 50
RAM_SLACK = 0.01


# A rung is chosen where the recall's lower confidence bound reaches the target, not its mean: the mean of 500
# sampled queries is off by its standard error (~0.004 at recall 0.95), and on 3M x 128 the rung whose mean on the
# sample was 0.95 gave 0.943 on queries drawn afresh (#51). One-sided 95%: half the rungs chosen on the mean alone
# would fall short on other queries of the same distribution, one in twenty on this bound.
Z = 1.645


def per_query_recall(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Each query's share of its true top-K (-1: none) among its found ids."""
    return np.array([len(set(f[f >= 0].tolist()) & set(t[t >= 0].tolist())) / max(1, int((t >= 0).sum()))
                     for f, t in zip(found, truth)], dtype=np.float64)


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each query's true top-K (-1: none) among its found ids."""
    return float(np.mean(per_query_recall(found, truth)))


def recall_bounds(found: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(mean recall, its one-sided lower confidence bound: mean - Z standard errors)."""
    r = per_query_recall(found, truth)
    if len(r) < 2:
        return float(r.mean()) if len(r) else 0.0, float(r.mean()) if len(r) else 0.0
    return float(r.mean()), float(r.mean() - Z * r.std(ddof=1) / np.sqrt(len(r)))


def sample_for_calibration(rows, n: int, queries: int, seed: int, sample_queries: np.ndarray | None):
    """(rows sampled: their ids, or None for a query log; the queries; what they are)."""
    rng = np.random.default_rng(seed + 3)
    if sample_queries is None:
        own = np.sort(rng.choice(n, min(n, queries), replace=False))
        return own, rows(own), "rows"
    return None, sample_queries[rng.permutation(len(sample_queries))[:queries]], "sample queries"


def climb(search, q: np.ndarray, truth: np.ndarray, target: float, graph: bool = False) -> tuple[list, dict]:
    """LADDER's rungs up to the first whose recall (search(q, params) -> ids) reaches target, by its lower
    confidence bound (recall_bounds): (tried, chosen). graph (the lists are found by the navigation graph): then
    the beam narrowed (_narrow)."""
    tried, chosen = [], {}
    for rerank, beta in LADDER:
        r, low = _measure(search, q, truth, {"rerank": rerank, "beta": beta}, tried)
        chosen = {} if (rerank, beta) == LADDER[0] else {"rerank": rerank, "beta": beta}
        if low >= target:
            break
    else:
        return tried, _widen(search, q, truth, target, chosen, tried)
    if graph and low >= target:
        chosen = _narrow(search, q, truth, target, r, chosen, tried)
    return tried, chosen


def walk_ram(search, q: np.ndarray, truth: np.ndarray, target: float, chosen: dict) -> tuple[list, dict]:
    """(tried, chosen in RAM): chosen (the SSD path's settings) with the re-rank halved down to RAM_RERANK_MIN, measured
    at beta 0 (the answer the raw vectors in RAM give), while the recall's lower bound reaches target and the
    recall lies within RAM_SLACK of the best measured. Where chosen itself falls short, chosen. The settings kept
    name no beta: RAM has no early stop."""
    tried: list = []
    best_r, low = _measure(search, q, truth, {**chosen, "beta": 0}, tried)
    if low < target:
        return tried, dict(chosen)
    best = {k: v for k, v in chosen.items() if k != "beta"}
    start = SearchParams(**chosen).rerank
    for rerank in (start >> i for i in range(1, 32) if start >> i >= RAM_RERANK_MIN):
        params = {**best, "rerank": rerank}
        r, low = _measure(search, q, truth, {**params, "beta": 0}, tried)
        if low < target or r < best_r - RAM_SLACK:
            break
        best, best_r = params, max(best_r, r)
    return tried, best


def _measure(search, q: np.ndarray, truth: np.ndarray, params: dict, tried: list) -> tuple[float, float]:
    """Recall and its lower bound at params, recorded in tried."""
    r, low = recall_bounds(search(q, SearchParams(**params)), truth)
    tried.append({**params, "recall": round(r, 4), "recall_low": round(low, 4)})
    return r, low


def _widen(search, q: np.ndarray, truth: np.ndarray, target: float, last: dict, tried: list) -> dict:
    """No rung reached target: at each of WIDER's probes (nprobe), the ladder climbed again from the plateau's first
    rung (MORE rungs past its top) while a rung gains GAIN, up to the first whose recall's lower bound reaches target;
    a width gaining less than PLATEAU over the last ends it. Where none reaches it, the best measured."""
    best_r = max(t["recall"] for t in tried)
    first = next(i for i, t in enumerate(tried) if t["recall"] >= best_r - PLATEAU)
    rungs = LADDER[first:] + MORE
    chosen, before = last, best_r
    for nprobe in WIDER:
        width_best = -1.0
        for step, (rerank, beta) in enumerate(rungs):
            params = {"rerank": rerank, "beta": beta, "nprobe": nprobe}
            r, low = _measure(search, q, truth, params, tried)
            if r > best_r:
                chosen, best_r = params, r
            if low >= target:
                return _cheaper(search, q, truth, target, params, LADDER[:first] if step == 0 else (), tried)
            if r < width_best + GAIN:  # more re-rank gains nothing at this width
                break
            width_best = max(width_best, r)
        if width_best < before + PLATEAU:  # wider probes gain nothing more
            break
        before = width_best
    return chosen


def _cheaper(search, q: np.ndarray, truth: np.ndarray, target: float, chosen: dict, below, tried: list) -> dict:
    """The first rung _widen climbed at a width reached the target: the rungs below (below: cheaper than the
    plateau's first, not yet tried at this width) from the top down, and the cheapest whose lower bound still
    reaches it. The climb begins where the narrower probe's plateau began, which the lists probed bounded, not the
    re-rank: a wider probe can need less re-rank than that (20M clustered vectors, report queries at nprobe 512:
    rerank 200 0.992 at 714 q/s, 800 0.992 at 424)."""
    for rerank, beta in reversed(below):
        params = {**chosen, "rerank": rerank, "beta": beta}
        if _measure(search, q, truth, params, tried)[1] < target:
            break
        chosen = params
    return chosen


def _narrow(search, q: np.ndarray, truth: np.ndarray, target: float, full: float, chosen: dict,
            tried: list) -> dict:
    """The chosen rung at BEAMS' narrower navigation beams (nprobe), down to the narrowest whose recall still
    reaches target (by its lower bound) and lies within BEAM_SLACK of the best measured so far (full: the full
    beam's); each one tried is added to tried. (A narrower beam can score higher: fewer lists, fewer far
    candidates that PQ ranks above true neighbours; on 1M 768-d vectors at rerank 1600, 0.962 at 256, 0.969 at 64,
    0.959 at 32.)"""
    best = full
    for nprobe in BEAMS:
        params = {**chosen, "nprobe": nprobe}  # chosen {}: LADDER[0], the class defaults, recorded as such
        r, low = _measure(search, q, truth, {"rerank": LADDER[0][0], "beta": LADDER[0][1], **params}, tried)
        if low < target or r < best - BEAM_SLACK:
            break
        chosen, best = params, max(best, r)
    return chosen


def calibrate_both(search, q: np.ndarray, truth: np.ndarray, target: float, graph: bool) -> tuple[list, dict, dict]:
    """(tried, chosen, ram): climb's choice for the SSD path, and walk_ram's from there for the raw vectors in RAM
    (ram: {"tried", "params"})."""
    tried, chosen = climb(search, q, truth, target, graph=graph)
    ram_tried, ram = walk_ram(search, q, truth, target, chosen)
    return tried, chosen, {"tried": ram_tried, "params": ram}


def calibration_entry(q, source: str, target: float, tried: list, chosen: dict, t0: float, n: int,
                      ram: dict | None = None) -> dict:
    """ram: calibrate_both's choice for the raw vectors in RAM (None: not measured)."""
    return {"queries": int(len(q)), "source": source, "target_recall": target, "tried": tried,
            "params": chosen, **({} if ram is None else {"ram": ram}), "count": int(n),
            "seconds": round(time.perf_counter() - t0, 2)}


def set_defaults(manifest: dict, cal: dict) -> None:
    """manifest (in place) with cal as its calibration, and the settings cal chose as its search_defaults and
    search_defaults_ram (dropped where cal measured none for RAM, so that an older choice does not outlive the
    calibration that replaced it)."""
    manifest["calibration"] = cal
    manifest["search_defaults"] = cal["params"]
    ram = (cal.get("ram") or {}).get("params")
    if ram is None:
        manifest.pop("search_defaults_ram", None)
    else:
        manifest["search_defaults_ram"] = ram


def merge_remeasures(old: dict, count: int, calibrate_on: bool) -> bool:
    """Whether a merge of the index whose manifest is old into one of count rows calibrates it again (calibrate_on:
    its BuildConfig.calibrate): not a shard part (its router's settings are what it searches with), not where a
    query log was measured (the merge has none, and rows need not stand for its queries); where the calibration
    was skipped, once count reaches MIN_ROWS; else once count is REMEASURE_GROWTH times the rows measured, or
    1/REMEASURE_GROWTH of them (the index's count where the entry does not say)."""
    cal = old.get("calibration")
    if not calibrate_on or "shard" in old or (cal or {}).get("source") == "sample queries":
        return False
    if cal is None or "skipped" in cal:
        return count >= MIN_ROWS
    measured = max(1, int(cal.get("count") or old["count"]))
    return max(count / measured, measured / max(1, count)) >= REMEASURE_GROWTH


SLICE = 64  # queries a calibration search takes at a time: its working memory, not the sample's, is what it holds


def in_slices(search, q: np.ndarray) -> np.ndarray:
    """search(queries) -> ids, over q SLICE queries at a time (recall is the same; the memory a slice's)."""
    return np.concatenate([search(q[i:i + SLICE]) for i in range(0, len(q), SLICE)]) if len(q) else search(q)


def calibration_engine(threads: int) -> EngineConfig:
    """How calibration opens the index it measures: recall does not depend on the page buffer, so a small one
    (8 MiB), leaving a budgeted build's memory to the index itself. The SSD path (raw_in_ram 'off'), whatever the
    index's size: its early stop re-ranks fewer candidates than the raw vectors in RAM do at the same knobs (their
    answer is the SSD path's at beta 0), so settings that reach the target there reach it either way."""
    return EngineConfig(filter_tier="cpu", manager_interval_s=0, threads=threads, verify=False, buffer_bytes=8 << 20,
                        raw_in_ram="off")


def calibrate_build(manifest: dict, w, steps, timings: dict, t_start: float, measure) -> None:
    """A build's last step, for the manifest about to be published by w (an IndexWriter): staged, so the index
    can be opened; measured (measure(index_dir) -> the calibration entry: calibrate or calibrate_sharded); the
    choice kept as its search_defaults (and search_defaults_ram), and the time in its build timings."""
    t = time.perf_counter()
    with steps.step("calibrating", 1, "index") as update:
        w.stage(manifest)
        set_defaults(manifest, measure(w.dir))
        update(1)
    timings["calibrate_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start


def calibrate(index_dir: Path, rows, n: int, engine_metric: str, queries: int, target: float, seed: int,
              threads: int, sample_queries: np.ndarray | None = None, trial: Path | None = None) -> dict:
    """The manifest's "calibration" entry for the complete (not yet published) index in index_dir: recall of each
    rung tried, and "params", the SearchParams fields of the one chosen (empty: the class defaults); "ram", what
    walk_ram tried and chose for the raw vectors in RAM. trial: 4-bit codes of the same rows
    (pq_choice.train_trial), measured against the index's at the settings chosen (compare_codes): the entry's
    "pq_bits"."""
    t0 = time.perf_counter()
    if sample_queries is None and n < MIN_ROWS:
        return {"skipped": f"fewer than {MIN_ROWS} rows", "params": {}, "count": int(n)}
    own, q, source = sample_for_calibration(rows, n, queries, seed, sample_queries)
    exclude = None
    if own is None:
        truth = exact_topk(rows, n, q, K, engine_metric)
    else:  # every sampled row is left out of every search, and of the truth: a row is not its own neighbour
        mask = np.zeros(n, bool)
        mask[own] = True
        exclude = np.packbits(mask, bitorder="little")
        wide = exact_topk(rows, n, q, K + len(own), engine_metric)
        truth = np.array([t[(t >= 0) & ~mask[np.maximum(t, 0)]][:K] for t in wide])
    index = Index.open(index_dir, calibration_engine(threads))
    try:
        tried, chosen, ram = calibrate_both(
            # passing 1: the rows left out stand for queries the index does not hold, not for a filter (a search
            # widens its lists by the share a filter passes, and a search without one does not).
            lambda q, p: in_slices(lambda s: index.search(s, K, p, exclude=exclude, passing=1.0).ids, q), q, truth,
            target,
            graph=not index.nav.exhaustive)
    finally:
        index.close()
    entry = calibration_entry(q, source, target, tried, chosen, t0, n, ram)
    if trial is not None:
        entry["pq_bits"] = compare_codes(index_dir, trial, q, truth, exclude, chosen, ram["params"], target, threads)
        entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry


def compare_codes(index_dir: Path, trial: Path, q: np.ndarray, truth: np.ndarray, exclude, chosen: dict, ram: dict,
                  target: float, threads: int) -> dict:
    """The index's 8-bit codes against the trial's 4-bit ones (pq_choice): both searched over the same sampled
    queries at the SSD path's chosen settings and at RAM's (beta 0), their recall@10 and its lower bound, and
    their tables' and scan's seconds at RAM's settings, the best of pq_choice.ROUNDS alternated searches each;
    "bits", the codes kept (pq_choice.verdict), and "why"."""
    pq_choice.stage_trial(index_dir, trial)
    settings = {"ssd": dict(chosen), "ram": {**ram, "beta": 0}}
    indexes = {8: Index.open(index_dir, calibration_engine(threads)), 4: Index.open(trial, calibration_engine(threads))}
    measured: dict = {8: {}, 4: {}}

    def search(index, params: dict):  # (ids, the seconds of the stages the codes change), over in_slices
        seconds = []

        def one(s: np.ndarray) -> np.ndarray:
            res = index.search(s, K, SearchParams(**params), exclude=exclude, passing=1.0)
            seconds.append(pq_choice.filter_seconds(res))
            return res.ids

        return in_slices(one, q), sum(seconds)

    try:
        for name, params in settings.items():
            for bits, index in indexes.items():
                ids, seconds = search(index, params)
                r, low = recall_bounds(ids, truth)
                measured[bits][name] = {"recall": round(r, 4), "recall_low": round(low, 4)}
                if name == "ram":
                    measured[bits]["filter_s"] = seconds
        for _ in range(pq_choice.ROUNDS - 1):
            for bits, index in indexes.items():
                measured[bits]["filter_s"] = min(measured[bits]["filter_s"], search(index, settings["ram"])[1])
    finally:
        for index in indexes.values():
            index.close()
    bits, why = pq_choice.verdict(measured, target)
    for m in measured.values():
        m["filter_s"] = round(m["filter_s"], 6)
    return {"bits": bits, "why": why, "settings": settings, "slack": pq_choice.SLACK, "gain": pq_choice.GAIN,
            "measured": {str(b): m for b, m in measured.items()}}


def page_rows(index):
    """rows(ids) over an opened index's page file: the stored vectors (float32, as the index holds them: unit
    length under cosine), gathered through a read-only memory map, for the brute-force truth of an index already
    built. Holds its own copy of the slot map, so it outlives the index's closing."""
    layout = PageLayout(**index.manifest["pages"])
    dtype = np.dtype({v: k for k, v in STORAGE_DTYPES.items()}[index.reranker.dtype])
    locations = np.array(index.reranker.locations, dtype=np.int64)
    mm = np.memmap(index.path / "vectors.pages", np.uint8, "r", shape=(layout.num_blocks * layout.block_bytes,))
    records = np.ndarray((layout.num_blocks, layout.records_per_block, layout.record_bytes), np.uint8, mm,
                         strides=(layout.block_bytes, layout.record_bytes, 1))
    dim = index.dim

    def rows(ids) -> np.ndarray:
        slots = locations[np.asarray(ids, dtype=np.int64)]
        raw = records[slots // layout.records_per_block, slots % layout.records_per_block]
        return np.ascontiguousarray(raw).view(dtype).reshape(len(slots), dim).astype(np.float32)

    rows.slots = locations
    rows.order = np.argsort(locations, kind="stable")  # ids by their place in the file: a pass over all reads it once
    return rows


def recalibrate(index_dir, sample_queries=None, queries: int | None = None, target: float | None = None,
                threads: int = 0) -> dict:
    """Calibrate an index already built again, and write the result into its manifest (search_defaults, and
    the measurement under calibration): on a query log (sample_queries) where given, else on its own stored rows
    as a build does. For an index built before calibration, or one whose build's sample does not stand for the
    queries it gets. queries, target: calibrate_queries and target_recall (the build's, where None). An index
    opened elsewhere keeps the settings it opened with until it is opened again. Returns the calibration."""
    path = Path(index_dir)
    threads = cpu_threads(threads)
    index = Index.open(path, EngineConfig(filter_tier="cpu", manager_interval_s=0, threads=threads, raw_in_ram="off"))
    try:
        m = index.manifest
        if "shard" in m:
            raise ConfigError(f"{path}: a shard part searches with its router's settings; calibrate the router")
        config, built = config_of(m, queries, target)
        log = None if sample_queries is None else sample_query_matrix(sample_queries, index.dim, m["metric"])
        rows, n, metric, seed = page_rows(index), index.count, internal_metric(m["metric"]), built.get("seed", 0)
    finally:
        index.close()
    cal = calibrate(path, rows, n, metric, config.calibrate_queries, config.target_recall, seed, threads, log)
    write_calibration(path, cal)
    return cal


def write_calibration(path: Path, cal: dict) -> None:
    """The manifest at path (an index's, or a sharded router's) rewritten whole with cal as its calibration and
    the settings it chose (set_defaults)."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    set_defaults(manifest, cal)
    rewrite_manifest(path, manifest)


def config_of(m: dict, queries: int | None, target: float | None):
    """The BuildConfig a recalibration measures with: the build's calibrate_queries and target_recall where not
    given (the class defaults for an older build)."""
    built, d = m.get("build_config") or {}, BuildConfig()
    return d.with_overrides(
        calibrate_queries=built.get("calibrate_queries", d.calibrate_queries) if queries is None else queries,
        target_recall=built.get("target_recall", d.target_recall) if target is None else target), built
