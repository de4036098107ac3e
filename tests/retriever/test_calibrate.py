"""Build-time calibration of an index's default search settings (BuildConfig.calibrate, retriever/engine/calibrate.py).

Recall is measured here against brute force on held-out queries (not the rows calibration sampled), and the
settings a search ran with are read from what it did (mini-batches re-ranked), not from the index's record. Indexes
open here as calibration measures them, on the SSD path (raw_in_ram 'off'): these small ones' raw vectors would
fit the default budget, and in RAM every candidate is re-ranked, with no early stop for the settings to change."""

import json

import numpy as np
import pytest
from conftest import exact_knn, recall

from fusionrag.cli import main as cli_main
from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.engine.calibrate import LADDER
from fusionrag.retriever.engine.config import EngineConfig, SearchOverrides, SearchParams
from fusionrag.retriever.engine.vectors import write_bin
from fusionrag.retriever.errors import ConfigError, IndexFormatError
from fusionrag.server.requests import search_params

N, DIM = 12000, 96
SSD = EngineConfig(raw_in_ram="off")


def flat(n: int, seed: int) -> np.ndarray:
    """Points near a 16-d subspace of DIM: neighbours at nearly equal distances, as embeddings are."""
    rng = np.random.default_rng(0)
    basis = np.linalg.qr(rng.standard_normal((DIM, 16)))[0].T.astype(np.float32)
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 16)).astype(np.float32)
    return z @ basis + 0.05 * rng.standard_normal((n, DIM)).astype(np.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    base, queries = flat(N, 1), flat(400, 2)
    # 8 PQ bytes for 96 dimensions: a PQ order too coarse for the defaults' re-rank on such data.
    coarse = Index.build(base, root / "coarse", BuildConfig(threads=1, pq_m=8), progress=False)
    plain = Index.build(base, root / "plain", BuildConfig(threads=1), progress=False)
    return {"root": root, "base": base, "queries": queries, "truth": exact_knn(base, queries, 10),
            "coarse": coarse, "plain": plain}


def test_calibration_raises_the_rerank_where_the_defaults_fall_short(built):
    cal = built["coarse"]["calibration"]
    assert cal["source"] == "rows" and cal["queries"] == 500
    assert cal["tried"][0]["recall"] < 0.95 and cal["params"], cal
    assert built["coarse"]["search_defaults"] == cal["params"]
    index = Index.open(built["root"] / "coarse", raw_in_ram="off")
    try:
        assert index.params == SearchParams(**cal["params"])
        q, truth = built["queries"], built["truth"]
        class_defaults = recall(index.search(q, 10, SearchParams()).ids, truth)
        calibrated = index.search(q, 10)
        assert recall(calibrated.ids, truth) >= class_defaults + 0.02, (class_defaults, cal)
        assert recall(calibrated.ids, truth) >= 0.92
    finally:
        index.close()


def test_calibration_leaves_the_defaults_where_they_reach_the_target(built):
    cal = built["plain"]["calibration"]
    assert len(cal["tried"]) == 1 and cal["tried"][0]["recall_low"] >= 0.95 and cal["params"] == {}
    index = Index.open(built["root"] / "plain", raw_in_ram="off")
    try:
        assert index.params == SearchParams()
        assert recall(index.search(built["queries"], 10).ids, built["truth"]) >= 0.95
    finally:
        index.close()


def test_a_requests_knobs_apply_over_the_calibrated_defaults(built):
    index = Index.open(built["root"] / "coarse", raw_in_ram="off")
    try:
        q = built["queries"]
        chosen = SearchParams(**built["coarse"]["calibration"]["params"])
        # nprobe 4 binds: the ratio rule alone probes more lists than that here.
        assert index.search(q, 10).stats["lists_probed"].mean() > 4
        full = index.search(q, 10, chosen.with_overrides(nprobe=4))
        for given in ({"nprobe": 4}, SearchOverrides.of({"nprobe": 4}), search_params({"nprobe": 4})):
            res = index.search(q, 10, given)
            assert res.stats["lists_probed"].max() <= 4  # the named knob applies
            np.testing.assert_array_equal(res.ids, full.ids)  # and the calibrated ones stay
            np.testing.assert_array_equal(res.stats["minibatches"], full.stats["minibatches"])
        # A SearchParams still replaces them all: the class default's patience stops searches sooner.
        whole = index.search(q, 10, SearchParams(nprobe=4))
        assert whole.stats["minibatches"].mean() < full.stats["minibatches"].mean()
    finally:
        index.close()


def test_the_cli_applies_its_flags_over_the_calibrated_defaults(built, tmp_path, capsys):
    write_bin(tmp_path / "q.fbin", built["queries"][:50])
    assert cli_main(["search", str(built["root"] / "coarse"), str(tmp_path / "q.fbin"), "--out",
                     str(tmp_path / "o.npy"), "--nprobe", "4", "--raw-in-ram", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = built["coarse"]["calibration"]["params"]
    assert report["params"]["nprobe"] == 4 and report["params"]["beta"] == chosen["beta"]
    # What the search did, not only what it reports: at most 4 lists, and as many mini-batches as the
    # calibrated settings take (more than the class defaults' beta 2 takes).
    assert report["per_query"]["lists_probed"] <= 4
    index = Index.open(built["root"] / "coarse", raw_in_ram="off")
    try:
        q = built["queries"][:50]
        calibrated = index.search(q, 10, {"nprobe": 4}).stats["minibatches"].mean()
        assert report["per_query"]["minibatches"] == pytest.approx(calibrated, abs=1e-3)
        assert index.search(q, 10, SearchParams(nprobe=4)).stats["minibatches"].mean() < calibrated
    finally:
        index.close()


def test_calibration_measures_the_builds_sample_queries_and_can_be_turned_off(built, tmp_path):
    m = Index.build(built["base"], tmp_path / "s", BuildConfig(threads=1, pq_m=8, calibrate_queries=100),
                    progress=False, sample_queries=flat(300, 3))
    assert m["calibration"]["source"] == "sample queries" and m["calibration"]["queries"] == 100
    off = Index.build(built["base"], tmp_path / "off", BuildConfig(threads=1, pq_m=8, calibrate=False),
                      progress=False)
    assert "calibration" not in off and "search_defaults" not in off
    index = Index.open(tmp_path / "off", raw_in_ram="off")
    try:
        assert index.params == SearchParams()
    finally:
        index.close()


def test_small_collections_skip_calibration(tmp_path):
    m = Index.build(flat(1500, 1), tmp_path / "small", BuildConfig(threads=1), progress=False)
    assert "skipped" in m["calibration"] and m["search_defaults"] == {}


def test_a_merge_calibrates_again_once_the_index_has_grown(built, tmp_path):
    """A collection's incremental merges grow its index up to 4x before a rebuild: a generation that has grown
    past what its calibration measured is measured again, on its own rows; a small merge keeps the settings."""
    from fusionrag.retriever.engine.merge import merge_index

    config = BuildConfig(threads=1, pq_m=8)
    small, grown = built["base"][:1500], built["base"][1500:]
    assert "skipped" in Index.build(small, tmp_path / "g0", config, progress=False)["calibration"]

    def merge(src: str, dst: str, new: np.ndarray) -> dict:
        old = Index.open(tmp_path / src, raw_in_ram="off")
        try:
            merge_index(old, np.zeros(old.count, bool), new, tmp_path / dst, config, progress=False)
        finally:
            old.close()
        return json.loads((tmp_path / dst / "manifest.json").read_text())

    m1 = merge("g0", "g1", grown)  # 1,500 -> 12,000 rows (survivors keep their ids, new rows follow)
    cal = m1["calibration"]
    assert cal["source"] == "rows" and cal["count"] == N and cal["tried"][0]["recall"] < 0.95 and cal["params"]
    assert m1["search_defaults"] == cal["params"] and m1["merge"]["calibrate_s"] > 0
    index = Index.open(tmp_path / "g1", raw_in_ram="off")
    try:
        assert index.params == SearchParams(**cal["params"])
        q, truth = built["queries"], built["truth"]  # held out, against brute force over all 12,000 rows
        class_defaults = recall(index.search(q, 10, SearchParams()).ids, truth)
        assert recall(index.search(q, 10).ids, truth) >= max(0.92, class_defaults + 0.02), (class_defaults, cal)
    finally:
        index.close()

    m2 = merge("g1", "g2", flat(600, 5))  # 5% more rows: the measurement stands
    assert m2["calibration"] == cal and m2["search_defaults"] == cal["params"] and "calibrate_s" not in m2["merge"]
    assert m2["count"] == N + 600


def clustered(n: int, seed: int) -> np.ndarray:
    """Points around 60 centres in 48-d (the same centres for every seed): a query's neighbours lie in a few lists."""
    centres = np.random.default_rng(0).standard_normal((60, 48)).astype(np.float32)
    rng = np.random.default_rng(seed)
    return centres[rng.integers(0, 60, n)] + 0.35 * rng.standard_normal((n, 48)).astype(np.float32)


@pytest.mark.parametrize("data", ["clustered", "flat"])
def test_a_graph_navigated_index_gets_the_narrowest_beam_that_holds_its_recall(built, tmp_path, data):
    """Where the navigation graph finds the lists, calibration tries narrower beams (nprobe) from the widest down
    and keeps the narrowest whose recall holds: on clustered data below the class default, where held-out queries
    (against brute force) keep what the full beam gave them and a search at the defaults probes no more lists than
    the narrow beam allows; on the flat data, whose neighbours spread over many lists, the full beam. Exactly
    navigated indexes are not narrowed (their lists cost the same at any nprobe)."""
    from fusionrag.retriever.engine.calibrate import BEAM_SLACK, BEAMS

    base, q = (clustered(N, 1), clustered(400, 2)) if data == "clustered" else (built["base"], built["queries"])
    m = Index.build(base, tmp_path / "g", BuildConfig(threads=1, navigation="graph"), progress=False)
    assert m["list_navigation"] == "graph"
    cal = m["calibration"]
    narrowed = [t for t in cal["tried"] if "nprobe" in t]
    full = cal["tried"][len(cal["tried"]) - len(narrowed) - 1]["recall"]
    assert cal["tried"][len(cal["tried"]) - len(narrowed) - 1]["recall_low"] >= 0.95
    assert narrowed and narrowed[0]["nprobe"] == BEAMS[0]
    kept, best = [], full  # tried from the widest down, kept while recall held: at the target, and within
    for t in narrowed:     # BEAM_SLACK of the best beam's so far (the target by the recall's lower bound)
        if t["recall_low"] < 0.95 or t["recall"] < best - BEAM_SLACK:
            break
        kept, best = kept + [t], max(best, t["recall"])
    assert len(narrowed) == min(len(kept) + 1, len(BEAMS)), cal
    index = Index.open(tmp_path / "g", raw_in_ram="off")
    try:
        truth = exact_knn(base, q, 10)
        at_defaults = index.search(q, 10)
        wide = index.search(q, 10, index.params.with_overrides(nprobe=SearchParams().nprobe))
        if data == "flat":  # recall fell at the first narrower beam: the class default kept
            assert not kept and "nprobe" not in cal["params"] and index.params.nprobe == SearchParams().nprobe
            return
        assert kept and cal["params"]["nprobe"] == kept[-1]["nprobe"] == index.params.nprobe < SearchParams().nprobe
        assert at_defaults.stats["lists_probed"].max() <= index.params.nprobe
        # The ratio rule alone keeps fewer lists than the narrow beam here; loosened by a request, it shows the
        # default beam capping what a search probes (a request naming nprobe widens it again).
        loose = index.search(q, 10, {"probe_ratio": 1.5}).stats["lists_probed"]
        loose_wide = index.search(q, 10, {"probe_ratio": 1.5, "nprobe": SearchParams().nprobe}).stats
        assert loose.max() <= index.params.nprobe < loose_wide["lists_probed"].max()
        assert recall(at_defaults.ids, truth) >= recall(wide.ids, truth) - 0.01 >= 0.94
    finally:
        index.close()
    assert all("nprobe" not in t for t in built["plain"]["calibration"]["tried"])  # navigated exactly


def test_the_ladder_only_raises_the_rerank():
    assert LADDER[0] == (SearchParams().rerank, SearchParams().beta)
    assert all(a[0] <= b[0] and a[1] < b[1] for a, b in zip(LADDER, LADDER[1:]))


def test_bad_search_defaults_in_a_manifest_are_refused(built, tmp_path):
    import shutil

    dest = tmp_path / "bad"
    shutil.copytree(built["root"] / "coarse", dest)
    path = dest / "manifest.json"
    m = json.loads(path.read_text())
    for key in ("search_defaults", "search_defaults_ram"):  # each refused whichever path the index opens with
        for bad in ({"rerank": 0}, {"no_such_knob": 1}, ["rerank"]):
            path.write_text(json.dumps({**m, key: bad}))
            with pytest.raises(IndexFormatError, match=key):
                Index.open(dest, raw_in_ram="off")


def test_bad_overrides_are_refused_when_made():
    with pytest.raises(ConfigError):
        SearchOverrides.of({"nprobe": 0})
    with pytest.raises(ConfigError):
        SearchOverrides.of({"no_such_knob": 1})


def test_a_sharded_build_calibrates_its_router_and_requests_apply_over_it(built, tmp_path, capsys):
    """The router measures rows searched across its shards (each row's own id dropped from what is found, as a
    sharded search has no exclude bitmap); ShardedIndex.open takes the choice, and knobs apply over it."""
    from fusionrag.retriever.sharded.build import build_sharded
    from fusionrag.retriever.sharded.router import ShardedIndex

    # 4 PQ bytes: each of the 2 shards re-ranks its own 200 candidates, so at 8 the defaults already reach 0.97.
    m = build_sharded(built["base"], tmp_path / "sh", 2, BuildConfig(threads=1, pq_m=4), progress=False)
    cal = m["calibration"]
    assert cal["source"] == "rows" and cal["tried"][0]["recall"] < 0.95 and cal["params"], cal
    assert m["search_defaults"] == cal["params"]
    q, truth = built["queries"], built["truth"]
    index = ShardedIndex.open(tmp_path / "sh", SSD)
    try:
        chosen = SearchParams(**cal["params"])
        assert index.params == chosen
        class_defaults = recall(index.search(q, 10, SearchParams()).ids, truth)
        calibrated = recall(index.search(q, 10).ids, truth)
        assert calibrated >= class_defaults + 0.02 and calibrated >= 0.92, (class_defaults, calibrated, cal)
        assert index.search(q, 10).stats["lists_probed"].mean() > 4
        full = index.search(q, 10, chosen.with_overrides(nprobe=4))
        for given in ({"nprobe": 4}, search_params({"nprobe": 4})):
            res = index.search(q, 10, given)
            assert res.stats["lists_probed"].max() <= 4
            np.testing.assert_array_equal(res.ids, full.ids)
            np.testing.assert_array_equal(res.stats["reranked"], full.stats["reranked"])
        assert index.search(q, 10, SearchParams(nprobe=4)).stats["reranked"].mean() < full.stats["reranked"].mean()
    finally:
        index.close()
    write_bin(tmp_path / "q.fbin", q[:50])
    assert cli_main(["search", str(tmp_path / "sh"), str(tmp_path / "q.fbin"), "--out", str(tmp_path / "o.npy"),
                     "--nprobe", "4", "--raw-in-ram", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"]["nprobe"] == 4 and report["params"]["beta"] == chosen.beta
    assert report["per_query"]["reranked"] == pytest.approx(full.stats["reranked"][:50].mean(), abs=1e-3)
    # `fusionrag info` opens a sharded index too: the router's record, and each shard's memory.
    assert cli_main(["info", str(tmp_path / "sh")]) == 0
    info = json.loads(capsys.readouterr().out)
    # opened with the engine's defaults, each shard's 6,000 raw vectors fit its half of the budget: those for RAM
    assert all(sh["raw_vectors_bytes"] > 0 for sh in info["memory"]["shards"]), info["memory"]["shards"]
    assert info["search_defaults"] == cal["params"] and info["shards"] == 2
    assert info["search_defaults_ram"] == cal["ram"]["params"] == m["search_defaults_ram"]
    assert info["search_params"] == SearchParams(**cal["ram"]["params"]).to_dict()
    ram = SearchParams(**cal["ram"]["params"])
    assert ram.rerank <= chosen.rerank and ram.nprobe == chosen.nprobe and "beta" not in cal["ram"]["params"]
    for mode, want in (("on", ram), ("off", chosen)):  # read from what a search did: candidates re-ranked
        index = ShardedIndex.open(tmp_path / "sh", EngineConfig(raw_in_ram=mode))
        try:
            res = index.search(q, 10)
            assert index.params == want and res.stats["reranked"].max() <= 2 * want.rerank  # each shard its own
        finally:
            index.close()
    codes = [np.load(p, mmap_mode="r").nbytes for p in sorted(tmp_path.glob("sh/shard-*/pq_codes.npy"))]
    assert len(codes) == 2 and all(s["pq_bytes"] >= c > 0 for s, c in zip(info["memory"]["shards"], codes))
    off = build_sharded(built["base"], tmp_path / "off", 2, BuildConfig(threads=1, pq_m=4, calibrate=False),
                        progress=False)
    assert "calibration" not in off and "search_defaults" not in off


def test_a_collections_info_says_which_search_settings_its_index_uses(built, tmp_path):
    """A service's users see what their requests' params apply over: info()["search_defaults"], read here
    against the manifest the collection's index was written with."""
    from fusionrag.retriever import EngineConfig
    from fusionrag.retriever.collection import Catalog, CollectionConfig, Document

    catalog = Catalog(tmp_path / "data", EngineConfig(filter_tier="cpu"),
                      CollectionConfig(background_merge=False, min_index_count=100,
                                       build=BuildConfig(threads=1, pq_m=8)))
    try:
        col = catalog.create("c", dim=DIM, metric="l2")
        before = col.info()
        assert before["search_defaults"] == SearchParams().to_dict() and before["calibration"] is None
        col.upsert([Document(id=str(i), vector=v) for i, v in enumerate(built["base"])])
        col.merge()
        info = col.info()
        (written,) = (tmp_path / "data").glob("collections/c/gen-*/index/manifest.json")
        stored = json.loads(written.read_text())
        assert stored["search_defaults"], stored["calibration"]  # the class defaults fall short here (above)
        # 12,000 x 96 float32 fit the default budget: the raw vectors are in RAM, and so are the settings
        assert info["tiers"]["raw_in_ram"] and stored["search_defaults_ram"] == stored["calibration"]["ram"]["params"]
        assert info["search_defaults"] == SearchParams(**stored["search_defaults_ram"]).to_dict()
        assert info["calibration"]["tried"] == stored["calibration"]["tried"]
    finally:
        catalog.close()


def test_an_index_built_without_calibration_is_calibrated_afterwards_as_its_build_would(built, tmp_path, capsys):
    """fusionrag calibrate: the stored rows, read back from the page file, measure what the build's source rows
    did; on a query log it measures the log; the rewritten manifest still verifies."""
    from fusionrag.retriever.engine.calibrate import recalibrate
    from fusionrag.retriever.errors import InputError

    path = tmp_path / "later"
    Index.build(built["base"], path, BuildConfig(threads=1, pq_m=8, calibrate=False), progress=False)
    assert cli_main(["calibrate", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    at_build = built["coarse"]["calibration"]
    assert out["tried"] == at_build["tried"] and out["params"] == at_build["params"] and out["params"]
    assert out["ram"] == at_build["ram"]
    assert json.loads((path / "manifest.json").read_text())["search_defaults_ram"] == at_build["ram"]["params"]
    index = Index.open(path, raw_in_ram="off")  # checksums verified against the rewritten manifest
    try:
        assert index.params == SearchParams(**at_build["params"])
    finally:
        index.close()
    write_bin(tmp_path / "log.fbin", flat(300, 3))
    assert cli_main(["calibrate", str(path), "--sample-queries", str(tmp_path / "log.fbin"), "--calibrate-queries",
                     "200", "--target-recall", "0.9"]) == 0
    m = json.loads((path / "manifest.json").read_text())
    cal = m["calibration"]
    assert (cal["source"], cal["queries"], cal["target_recall"]) == ("sample queries", 200, 0.9)
    assert m["search_defaults"] == cal["params"] and cal["tried"][-1]["recall_low"] >= 0.9
    with pytest.raises(ConfigError):
        recalibrate(path, target=1.5)
    with pytest.raises(InputError):
        recalibrate(path, np.zeros((5, DIM + 1), np.float32))
    assert json.loads((path / "manifest.json").read_text()) == m  # a refused call changes nothing


def test_a_sharded_index_is_calibrated_afterwards_across_its_shards_with_its_writes(built, tmp_path, capsys):
    """fusionrag calibrate on a sharded index: rows of its live vectors, fetched from the shards, and their truth
    by brute force on each shard (built and written vectors), merged at the router, measure what the build's
    source rows did; writes join the truth; a served index (its shards' locks held) and a shard part are
    refused, leaving the manifests as they were. A merge that grows it past its calibration measures again."""
    from fusionrag.retriever.directory import recalibrate
    from fusionrag.retriever.sharded.build import build_sharded
    from fusionrag.retriever.sharded.router import ShardedIndex

    config = BuildConfig(threads=1, pq_m=4)
    at_build = build_sharded(built["base"], tmp_path / "on", 2, config, progress=False)["calibration"]
    path = tmp_path / "later"
    build_sharded(built["base"], path, 2, config.with_overrides(calibrate=False), progress=False)
    assert cli_main(["calibrate", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tried"] == at_build["tried"] and out["params"] == at_build["params"] and out["params"]
    assert out["ram"] == at_build["ram"]
    assert json.loads((path / "manifest.json").read_text())["search_defaults_ram"] == at_build["ram"]["params"]

    extra = flat(4000, 6)
    every = np.concatenate([built["base"], extra])
    q = built["queries"]
    truth = exact_knn(every, q, 10)
    assert (truth >= N).any()  # the written vectors are among the held-out queries' neighbours
    index = ShardedIndex.open(path, SSD)
    try:
        assert index.params == SearchParams(**at_build["params"])  # the rewritten router manifest verifies
        index.upsert(np.arange(N, N + len(extra)), extra)
        before = json.loads((path / "manifest.json").read_text())
        with pytest.raises(Exception, match="open"):  # its shards are held by this process's index
            recalibrate(path)
        assert json.loads((path / "manifest.json").read_text()) == before
    finally:
        index.close()
    cal = recalibrate(path)  # the writes are in the shards' fresh tiers, not merged
    assert cal["count"] == N + len(extra) and cal["source"] == "rows" and cal["params"]
    index = ShardedIndex.open(path, SSD)
    try:
        assert index.params == SearchParams(**cal["params"])
        assert recall(index.search(q, 10).ids, truth) >= 0.92
    finally:
        index.close()
    part = next(path.glob("shard-*"))
    with pytest.raises(ConfigError, match="router"):
        recalibrate(part)

    # A served index's merge: 12,000 -> 16,000 live vectors, past 1.25x what the build measured.
    index = ShardedIndex.open(tmp_path / "on", SSD)
    try:
        index.upsert(np.arange(N, N + len(extra)), extra)
        index.merge_shards()
        m = json.loads((tmp_path / "on" / "manifest.json").read_text())
        assert m["calibration"]["count"] == N + len(extra) and m["calibration"]["tried"] != at_build["tried"]
        assert index.params == SearchParams(**m["search_defaults"])
        assert recall(index.search(q, 10).ids, truth) >= 0.92
        index.upsert(np.arange(N + len(extra), N + len(extra) + 500), flat(500, 7))
        index.merge_shards()  # 3% more: the measurement stands
        assert json.loads((tmp_path / "on" / "manifest.json").read_text())["calibration"] == m["calibration"]
    finally:
        index.close()


def test_a_rung_is_chosen_by_the_lower_bound_of_its_recall_not_its_mean():
    """#51 item 4: 500 sampled queries measure recall with a standard error; a rung is taken only where its mean
    less Z standard errors (computed here from the per-query recalls) reaches the target, so a rung whose mean
    just reaches it is passed over for the next."""
    from fusionrag.retriever.engine.calibrate import LADDER, Z, climb

    truth = np.arange(500 * 10).reshape(500, 10)

    def found_with(share: float) -> np.ndarray:  # each query finds 9 or 10 of its 10: mean recall `share`
        out = truth.copy()
        out[:round((1 - share) * 10 * 500), -1] = -1
        return out

    means = {LADDER[0]: 0.951, LADDER[1]: 0.953, LADDER[2]: 0.97}
    answers = {k: found_with(v) for k, v in means.items()}
    tried, chosen = climb(lambda q, p: answers[(p.rerank, p.beta)], np.zeros((500, 4)), truth, 0.95)
    for t in tried:
        r = (answers[(t["rerank"], t["beta"])] >= 0).sum(1) / 10
        assert t["recall"] == round(r.mean(), 4)
        assert t["recall_low"] == round(r.mean() - Z * r.std(ddof=1) / np.sqrt(500), 4)
    assert tried[0]["recall"] >= 0.95 > tried[0]["recall_low"]  # the mean alone would have stopped here
    assert chosen == {"rerank": tried[-1]["rerank"], "beta": tried[-1]["beta"]} and tried[-1]["recall_low"] >= 0.95


def _missing_columnwise(truth: np.ndarray, share: float) -> np.ndarray:
    """truth (500 x 10) with (1 - share) of its 5000 true neighbours missed, a column at a time."""
    out, left = truth.copy(), round((1 - share) * truth.size)
    for col in range(truth.shape[1] - 1, -1, -1):
        out[:min(len(truth), left), col] = -1
        left -= min(len(truth), left)
    return out


def test_where_no_rung_reaches_the_target_wider_probes_are_tried():
    """#51: at 10M clustered vectors the re-rank ladder plateaued near 0.908 at nprobe 256 (the lists probed bound
    the recall), and at nprobe 512 the re-rank mattered again. Calibration then climbs the ladder again at wider
    probes, from the plateau's first rung, past the ladder's top (MORE), up to the first that reaches the target;
    a width that gains nothing ends it, and the best measured is kept; where the rungs reach the target, nprobe is
    left as it was."""
    from fusionrag.retriever.engine.calibrate import LADDER, MORE, WIDER, climb

    truth = np.arange(500 * 10).reshape(500, 10)

    def found_with(share: float) -> np.ndarray:
        return _missing_columnwise(truth, share)

    def model(reach: float):  # plateau at 0.90 at nprobe 256; from 512 the re-rank counts, up to `reach`
        def recall_of(p) -> float:
            if p.nprobe < 512:
                return min(0.90, 0.80 + p.rerank / 4000)
            return min(reach, 0.86 + p.rerank / 50000)
        return lambda q, p: found_with(recall_of(p))

    tried, chosen = climb(model(0.99), np.zeros((500, 4)), truth, 0.95)
    wide = tried[len(LADDER):]
    assert all(t["nprobe"] == WIDER[0] for t in wide)  # reached at the first wider probe
    plateau = next(i for i, (r, _) in enumerate(LADDER) if min(0.90, 0.80 + r / 4000) >= 0.90 - 0.005)
    assert [(t["rerank"], t["beta"]) for t in wide] == [*LADDER[plateau:], *MORE][:len(wide)]
    assert chosen == {"rerank": wide[-1]["rerank"], "beta": wide[-1]["beta"], "nprobe": WIDER[0]}
    assert wide[-1]["recall_low"] >= 0.95 > wide[-2]["recall_low"]

    tried, chosen = climb(model(0.93), np.zeros((500, 4)), truth, 0.95)  # never reached: wider gains nothing
    assert {t.get("nprobe") for t in tried[len(LADDER):]} == {WIDER[0], WIDER[1]}  # 1024 gained nothing: stop
    best = max(tried, key=lambda t: t["recall"])
    assert chosen == {k: best[k] for k in ("rerank", "beta", "nprobe")} and best["recall"] == 0.93

    tried, chosen = climb(lambda q, p: found_with(0.97), np.zeros((500, 4)), truth, 0.95)
    assert chosen == {} and len(tried) == 1  # reached at the defaults: nothing widened


def test_a_wider_probe_that_reaches_the_target_at_once_is_given_the_cheapest_rung_that_holds_it():
    """#51: the climb at a wider probe begins at the narrower one's plateau, set by the lists probed; where its first
    rung already reaches the target, the cheaper rungs are tried at that width from the top down, and the cheapest
    whose lower bound holds is chosen (a rung that falls short ends the descent)."""
    from fusionrag.retriever.engine.calibrate import LADDER, WIDER, climb

    truth = np.arange(500 * 10).reshape(500, 10)

    def found_with(share: float) -> np.ndarray:
        return _missing_columnwise(truth, share)

    def model(at_512):  # plateau at 0.90 from rerank 600 at nprobe 256; at 512 recall by rung
        def recall_of(p) -> float:
            if p.nprobe < 512:
                return min(0.90, 0.80 + p.rerank / 6000)
            return at_512(p.rerank)
        return lambda q, p: found_with(recall_of(p))

    plateau = next(i for i, (r, _) in enumerate(LADDER) if min(0.90, 0.80 + r / 6000) >= 0.90 - 0.005)
    assert plateau >= 3  # the model leaves rungs below the plateau to descend to

    tried, chosen = climb(model(lambda rerank: 0.99 if rerank >= 300 else 0.94), np.zeros((500, 4)), truth, 0.95)
    wide = tried[len(LADDER):]
    assert [(t["rerank"], t["beta"]) for t in wide] == [LADDER[plateau], *reversed(LADDER[:plateau])][:len(wide)]
    assert all(t["nprobe"] == WIDER[0] for t in wide)
    assert wide[-1]["rerank"] == 200 and wide[-1]["recall_low"] < 0.95  # the first that falls short ends it
    cheapest = min((t for t in wide if t["recall_low"] >= 0.95), key=lambda t: (t["rerank"], t["beta"]))
    assert chosen == {"rerank": cheapest["rerank"], "beta": cheapest["beta"], "nprobe": WIDER[0]}
    assert cheapest["rerank"] == 300

    tried, chosen = climb(model(lambda rerank: 0.99), np.zeros((500, 4)), truth, 0.95)
    assert chosen == {"rerank": LADDER[0][0], "beta": LADDER[0][1], "nprobe": WIDER[0]}  # down to the defaults' rung
    assert len(tried) == len(LADDER) + 1 + plateau


def test_the_truth_of_a_built_index_is_read_in_the_order_of_its_page_file(built):
    """#51: calibration's brute force over an index's page file (page_rows) passes over the vectors in the order
    they lie in the file, not by id (by id, every chunk touched pages all over it: under a cap below the file each
    touch read an 8 MiB read-around, several TB for 10M x 128). The same neighbours either way, against numpy."""
    from fusionrag.retriever.engine.calibrate import page_rows
    from fusionrag.retriever.engine.learned_probe import exact_topk

    index = Index.open(built["root"] / "plain", raw_in_ram="off")
    try:
        rows = page_rows(index)
    finally:
        index.close()
    assert np.all(np.diff(rows.slots[rows.order].astype(np.int64)) > 0)  # forward through the file, each slot once
    read = []

    def recorded(ids):
        read.append(np.asarray(ids).copy())
        return rows(ids)

    recorded.order = rows.order
    q = built["queries"][:50]
    found = exact_topk(recorded, N, q, 10, "l2")
    assert (found == built["truth"][:50]).all()  # exact_knn in numpy over the source
    firsts = [int(rows.slots[ids].min()) for ids in read]
    assert firsts == sorted(firsts) and sum(map(len, read)) == N  # chunk after chunk further into the file
    self_rows = np.arange(50) * 7  # excluded rows found by position whatever the order
    unordered = exact_topk(lambda ids: rows(ids), N, q, 10, "l2", exclude=self_rows)
    assert (exact_topk(recorded, N, q, 10, "l2", exclude=self_rows) == unordered).all()
    assert not (unordered == self_rows[:, None]).any()


def test_calibration_lowers_the_rerank_for_the_raw_vectors_in_ram():
    """#68: in RAM every candidate the re-rank takes is scored, with no early stop, and the SSD path's 200 are more
    than the target needs. walk_ram measures at beta 0 (the answer RAM gives) the SSD path's choice with the re-rank
    halved down to RAM_RERANK_MIN, while the recall's lower bound holds the target and the recall stays within
    RAM_SLACK of the best; the lists probed are never narrowed. Where the choice itself falls short, it is kept."""
    from fusionrag.retriever.engine.calibrate import RAM_RERANK_MIN, RAM_SLACK, walk_ram

    truth = np.arange(500 * 10).reshape(500, 10)
    asked = []

    def model(curve):
        def found(q, p):
            asked.append(p)
            return _missing_columnwise(truth, curve(p.rerank))
        return found

    # flat data: the SSD path needed 1600; in RAM 400 holds the target, 200 does not
    tried, ram = walk_ram(model(lambda r: 0.97 if r >= 400 else 0.94), np.zeros((500, 4)), truth, 0.95,
                          {"nprobe": 64, "rerank": 1600, "beta": 24})
    assert {p.beta for p in asked} == {0} and {p.nprobe for p in asked} == {64}
    assert [t["rerank"] for t in tried] == [1600, 800, 400, 200] and all(t["beta"] == 0 for t in tried)
    assert ram == {"nprobe": 64, "rerank": 400}  # no beta: RAM has no early stop

    # from the class defaults, down to the floor where the recall holds
    tried, ram = walk_ram(model(lambda r: 0.99), np.zeros((500, 4)), truth, 0.95, {})
    assert ram == {"rerank": RAM_RERANK_MIN} and [t.get("rerank", 200) for t in tried] == [200, 100, 50]
    # a loss over RAM_SLACK ends the walk though the target still holds
    tried, ram = walk_ram(model(lambda r: 0.995 if r >= 200 else 0.995 - 2 * RAM_SLACK), np.zeros((500, 4)),
                          truth, 0.95, {})
    assert ram == {} and len(tried) == 2

    short = {"rerank": 1600, "beta": 24}
    tried, ram = walk_ram(model(lambda r: 0.9), np.zeros((500, 4)), truth, 0.95, short)
    assert ram == short and len(tried) == 1


def test_an_index_with_its_raw_vectors_in_ram_searches_with_what_calibration_chose_for_ram(built, tmp_path):
    """The build's calibration keeps a second choice for the raw vectors in RAM (search_defaults_ram), which
    Index.open takes where they are resident and only there. Checked against what the searches did (candidates
    re-ranked) and brute force on held-out queries; and the premise of its measurement, that RAM answers as the SSD
    path does at beta 0."""
    import shutil

    path = built["root"] / "plain"
    m = json.loads((path / "manifest.json").read_text())
    cal = m["calibration"]
    assert m["search_defaults_ram"] == cal["ram"]["params"] and all(t["beta"] == 0 for t in cal["ram"]["tried"])
    ssd, ram = SearchParams(**m["search_defaults"]), SearchParams(**m["search_defaults_ram"])
    assert ram.rerank < ssd.rerank and ram.nprobe == ssd.nprobe, cal["ram"]
    q, truth = built["queries"], built["truth"]
    in_ram, on_ssd = Index.open(path, raw_in_ram="on"), Index.open(path, raw_in_ram="off")
    # auto with a budget under the raw vectors' 4.6 MB: the SSD path, and its settings
    small = Index.open(path, buffer_bytes=2 << 20)
    try:
        assert in_ram.params == ram and on_ssd.params == ssd and small.params == ssd
        assert in_ram.memory()["raw_in_ram"] and not small.memory()["raw_in_ram"]
        got = in_ram.search(q, 10)
        assert got.stats["reranked"].max() == ram.rerank  # every candidate it takes, no more
        assert np.array_equal(got.ids, on_ssd.search(q, 10, ram.with_overrides(beta=0)).ids)
        # held-out queries against brute force
        assert recall(got.ids, truth) >= 0.95
        assert recall(on_ssd.search(q, 10).ids, truth) >= 0.95
    finally:
        for ix in (in_ram, on_ssd, small):
            ix.close()
    # an index calibrated before search_defaults_ram: the SSD path's settings in RAM too
    shutil.copytree(path, tmp_path / "older")
    old = {k: v for k, v in m.items() if k != "search_defaults_ram"}
    (tmp_path / "older" / "manifest.json").write_text(json.dumps(old))
    index = Index.open(tmp_path / "older", raw_in_ram="on", verify=False)
    try:
        assert index.params == ssd and index.search(q, 10).stats["reranked"].max() == ssd.rerank
    finally:
        index.close()
