"""Sharded mode (retriever/sharded/): a router part and S shard parts; placement by expected work with
replicas of the hottest lists; the query path in this process and through Ray actors on a two-node
cluster on 127.0.0.1, in a network namespace of the test's own."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall
from ray_namespace import LOOPBACK, in_namespace, netns_works

from fusionrag.cli import main as cli_main
from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.config import BuildConfig, SearchParams
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.errors import ConfigError, IndexFormatError, InputError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.parts import is_sharded, part_name
from fusionrag.retriever.sharded.placement import place_lists
from fusionrag.retriever.sharded.router import ShardedIndex
from fusionrag.retriever.sharded.shard import ShardServer

CHILD = Path(__file__).with_name("sharded_ray_child.py")
N, DIM = 4000, 24
# threads=1: an HNSW graph built by several threads may differ run to run; one thread builds the same graph
# for the single index and the router, so both probe the same lists.
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05)
EXHAUSTIVE = SearchParams(rerank=N, beta=0)  # every candidate of the probed lists re-ranked, no early stop


def skewed_queries(base: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A skewed query stream: Zipf over 40 hot spots (data points), each query near its spot."""
    rng = np.random.default_rng(seed)
    spots = base[np.random.default_rng(7).choice(len(base), 40, replace=False)]
    weights = 1.0 / np.arange(1, 41) ** 1.3
    pick = rng.choice(40, n, p=weights / weights.sum())
    return (spots[pick] + 0.15 * rng.standard_normal((n, base.shape[1]))).astype(np.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    base = clustered(N, DIM, 30, seed=3, spread=0.6)
    queries = clustered(200, DIM, 30, seed=3, spread=0.6)[::-1].copy() + 0.05
    log = skewed_queries(base, 1500, seed=1)
    build_index(base, root / "single", CONFIG, progress=False)
    build_sharded(base, root / "sharded", 3, CONFIG, progress=False)
    build_sharded(base, root / "hot", 3, CONFIG, sample_queries=log, replicate=0.05, progress=False)
    build_sharded(base, root / "rr", 3, CONFIG, placement="round-robin", sample_queries=log, progress=False)
    build_sharded(base, root / "loc", 3, CONFIG, placement="locality", progress=False)
    build_sharded(base, root / "loc0", 3, CONFIG, placement="locality", replicate=0.0, progress=False)
    return {"root": root, "base": base, "queries": queries, "log": log}


def test_sharded_results_equal_the_single_index(built):
    single = Index.open(built["root"] / "single")
    sharded = ShardedIndex.open(built["root"] / "sharded")
    try:
        q = built["queries"]
        # The router probes exactly the lists the single index probes.
        p = SearchParams()
        assert np.array_equal(sharded.nav.probe(q, p)[0], single.nav.probe(q, p)[0])
        # All candidates of those lists re-ranked: the same top-10, the same exact distances.
        a, b = single.search(q, 10, EXHAUSTIVE), sharded.search(q, 10, EXHAUSTIVE)
        assert np.array_equal(a.ids, b.ids)
        assert np.allclose(a.distances, b.distances, rtol=1e-6, atol=1e-6)
        # At the default settings each shard keeps its own top-n PQ candidates (a superset of the single
        # index's top-n): recall against brute force is at least the single index's.
        truth = exact_knn(built["base"], q, 10)
        r_single, r_sharded = recall(single.search(q, 10).ids, truth), recall(sharded.search(q, 10).ids, truth)
        assert r_sharded >= r_single > 0.9
        assert np.all(sharded.search(q, 10).stats["shards_probed"] >= 1)
    finally:
        sharded.close()


def test_a_sharded_build_navigates_as_its_config_says_and_records_it(built, tmp_path):
    """BuildConfig.navigation 'graph' where 'auto' navigates exactly (200 centroids x 24): the router's rows
    and queries go by the graph as the single index's do, and the router and every part record it."""
    import dataclasses

    cfg = dataclasses.replace(CONFIG, navigation="graph")
    base = built["base"]
    build_index(base, tmp_path / "single", cfg, progress=False)
    build_sharded(base, tmp_path / "sharded", 3, cfg, progress=False)
    single, sharded = Index.open(tmp_path / "single"), ShardedIndex.open(tmp_path / "sharded")
    auto = Index.open(built["root"] / "single")
    try:
        assert auto.manifest["list_navigation"] == "exact" and auto.nav.exhaustive
        assert not single.nav.exhaustive and not sharded.nav.exhaustive
        assert not auto.nav.graph.linked and single.nav.graph.linked and sharded.nav.graph.linked
        manifests = [sharded.manifest] + [json.loads((tmp_path / "sharded" / part_name(s) / "manifest.json")
                                                     .read_text()) for s in range(3)]
        assert [m["list_navigation"] for m in manifests] == ["graph"] * 4
        q, p = built["queries"], SearchParams()
        assert np.array_equal(sharded.nav.probe(q, p)[0], single.nav.probe(q, p)[0])
        a, b = single.search(q, 10, EXHAUSTIVE), sharded.search(q, 10, EXHAUSTIVE)
        assert np.array_equal(a.ids, b.ids)
    finally:
        sharded.close()


def test_each_shard_part_is_an_ordinary_index_holding_its_lists(built):
    root = built["root"]
    single = Index.open(root / "single")
    offsets, ids = single.filter.list_offsets, single.filter.list_ids
    list_shards = np.load(root / "sharded" / "list_shards.npy")
    held = np.zeros(len(offsets) - 1, dtype=int)
    for s in range(3):
        part = root / "sharded" / part_name(s)
        shard = Index.open(part)
        assert shard.search(built["queries"][:5], 3).ids.shape == (5, 3)
        gids = np.load(part / "global_ids.npy").astype(np.int64)
        lists = np.load(part / "lists.npy")
        for local, c in enumerate(lists):
            f = shard.filter
            members = gids[f.list_ids[f.list_offsets[local]:f.list_offsets[local + 1]]]
            assert np.array_equal(np.sort(members), np.sort(ids[offsets[c]:offsets[c + 1]]))
            assert s in list_shards[c]
            held[c] += 1
        # Its raw vectors are the source's rows.
        got = shard.search(built["base"][gids[:20]], 1, EXHAUSTIVE)
        assert np.array_equal(gids[got.ids[:, 0]], gids[:20])
    assert np.array_equal(held, (list_shards >= 0).sum(axis=1))  # every list on its shard(s), and only there


def test_hotness_placement_balances_work_better_than_round_robin(built):
    """Work measured by the shards themselves: PQ candidates each one scanned for a held-out skewed stream."""
    held_out = skewed_queries(built["base"], 600, seed=2)
    ratios = {}
    for name in ("hot", "rr"):
        index = ShardedIndex.open(built["root"] / name)
        try:
            cand = index.search(held_out, 10).per_shard["candidates"].astype(float)
        finally:
            index.close()
        ratios[name] = cand.max() / cand.mean()
    assert ratios["hot"] < ratios["rr"], ratios
    assert ratios["hot"] < 1.05, ratios


def test_hottest_lists_have_a_replica_and_the_least_loaded_one_serves(built):
    root = built["root"]
    single = Index.open(root / "single")
    # Hotness measured independently: the single index's own probing of the same query log.
    lists, _, _ = single.nav.probe(built["log"], SearchParams())
    visits = np.bincount(lists[lists >= 0], minlength=single.filter.list_offsets.size - 1)
    work = np.diff(single.filter.list_offsets) * (visits + 1)
    list_shards = np.load(root / "hot" / "list_shards.npy")
    n_rep = int((list_shards[:, 1] >= 0).sum())
    assert n_rep == round(0.05 * len(work))
    hottest = np.argsort(-work, kind="stable")[: n_rep // 2]
    assert np.all(list_shards[hottest, 1] >= 0)
    assert np.all(list_shards[hottest, 0] != list_shards[hottest, 1])
    assert not (np.load(root / "rr" / "list_shards.npy")[:, 1] >= 0).any()

    index = ShardedIndex.open(root / "hot")
    try:
        c = int(hottest[0])
        a, b = list_shards[c]
        busy = np.zeros(3, dtype=np.int64)
        busy[a] = 10**9
        assert index.route(np.array([[c]]), busy)[0][0, 0] == b
        busy[:] = 0
        busy[b] = 10**9
        assert index.route(np.array([[c]]), busy)[0][0, 0] == a
        # Within a batch, what the batch already sent counts: two queries on the list go to both replicas.
        shard, planned = index.route(np.array([[c], [c]]), np.zeros(3, dtype=np.int64))
        assert sorted(shard[:, 0]) == sorted([a, b])
        assert planned[a] == planned[b] == index.list_sizes[c]
    finally:
        index.close()


def test_one_call_per_shard_per_batch(built, monkeypatch):
    calls = []
    real = ShardServer.search

    def counting(self, queries, lists, k, params):
        calls.append((self.path, len(queries)))
        assert lists.shape[0] == len(queries) and (lists >= -1).all()
        return real(self, queries, lists, k, params)

    monkeypatch.setattr(ShardServer, "search", counting)
    index = ShardedIndex.open(built["root"] / "sharded", batch_size=64)
    try:
        index.search(built["queries"][:130], 10)  # batches of 64, 64 and 2 queries
    finally:
        index.close()
    assert len(calls) <= 3 * 3
    per_shard = {}
    for path, n in calls:
        per_shard.setdefault(path, []).append(n)
    assert all(len(v) <= 3 and sum(v) <= 130 for v in per_shard.values())


def test_missing_or_corrupt_shard_parts_are_refused_clearly(built, tmp_path):
    src = built["root"] / "sharded"

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    d = copy("missing")
    shutil.rmtree(d / "shard-001")
    with pytest.raises(IndexFormatError, match="shard part shard-001 is missing"):
        ShardedIndex.open(d)

    d = copy("corrupt")
    codes = d / "shard-000" / "pq_codes.npy"
    raw = bytearray(codes.read_bytes())
    raw[-1] ^= 0xFF
    codes.write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match="shard-000.*checksum mismatch"):
        ShardedIndex.open(d)

    d = copy("replaced")
    manifest = json.loads((d / "shard-002" / "manifest.json").read_text())
    manifest["created"] = "yesterday"
    (d / "shard-002" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexFormatError, match="shard part shard-002 was replaced or is corrupt"):
        ShardedIndex.open(d)

    d = copy("nomanifest")
    (d / "shard-001" / "manifest.json").unlink()
    with pytest.raises(IndexFormatError, match="shard part shard-001 has no manifest"):
        ShardedIndex.open(d)

    with pytest.raises(IndexFormatError, match="not a sharded index"):
        ShardedIndex.open(built["root"] / "single")


def test_bad_input_is_refused(built, tmp_path):
    base = built["base"]
    with pytest.raises(ConfigError, match="shards must be a positive integer"):
        build_sharded(base, tmp_path / "x", 0, CONFIG)
    with pytest.raises(ConfigError, match="placement must be one of"):
        build_sharded(base, tmp_path / "x", 2, CONFIG, placement="random")
    with pytest.raises(ConfigError, match="exceed the .* posting lists"):
        build_sharded(base[:300], tmp_path / "x", 100, CONFIG)
    with pytest.raises(InputError, match="sample_queries"):
        build_sharded(base, tmp_path / "x", 2, CONFIG, sample_queries=np.zeros((3, 5), np.float32))
    with pytest.raises(ConfigError, match="shards must be in"):
        place_lists(np.ones(4), np.zeros(4), 5)
    index = ShardedIndex.open(built["root"] / "sharded")
    try:
        with pytest.raises(InputError, match="dimension"):
            index.search(np.zeros((2, DIM + 1), np.float32))
        with pytest.raises(InputError, match="k must be"):
            index.search(built["queries"][:2], 0)
    finally:
        index.close()
    single = Index.open(built["root"] / "single")
    with pytest.raises(InputError, match="lists must be"):
        single.search_lists(built["queries"][:2], np.zeros((3, 2), np.int32))


def test_placement_by_expected_work():
    """Skewed expected work: the greedy placement's max/mean is near 1, round-robin's is not."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(5, 15, 300)
    visits = (1000 / np.arange(1, 301) ** 1.1).astype(int)[rng.permutation(300)]
    hot, rr = place_lists(sizes, visits, 4, "hotness", 0.02), place_lists(sizes, visits, 4, "round-robin")
    assert hot.imbalance(4) < 1.05 < rr.imbalance(4)
    assert (hot.shards[:, 1] >= 0).sum() == 6
    w = sizes * (visits + 1.0)
    assert set(np.flatnonzero(hot.shards[:, 1] >= 0)) == set(np.argsort(-w)[:6])
    # Storage stays near even however the work falls.
    stored = np.array([sizes[(hot.shards == s).any(axis=1)].sum() for s in range(4)])
    assert stored.max() <= 1.25 * sizes.sum() / 4 + sizes.max()


def test_locality_placement_balances_work_in_regions_of_centroid_space():
    """Locality: every list on a shard, expected work within 1.1x the mean, the hottest lists replicated on
    another shard, and each shard a region: a list's nearest other centroids mostly share its shard."""
    rng = np.random.default_rng(0)
    centroids = clustered(400, 16, 12, seed=5, spread=0.5)
    sizes = rng.integers(5, 15, 400)
    visits = (1000 / np.arange(1, 401) ** 1.1).astype(int)[rng.permutation(400)]
    for S in (2, 3, 4):
        loc = place_lists(sizes, visits, S, "locality", 0.02, centroids=centroids)
        rr = place_lists(sizes, visits, S, "round-robin")
        assert loc.kind == "locality" and (loc.shards[:, 0] >= 0).all()
        assert set(loc.shards[:, 0]) == set(range(S))
        assert loc.imbalance(S) <= 1.1, (S, loc.imbalance(S))
        two = loc.shards[:, 1] >= 0
        assert two.sum() == 8 and (loc.shards[two, 0] != loc.shards[two, 1]).all()
        w = sizes * (visits + 1.0)
        assert set(np.flatnonzero(two)) == set(np.argsort(-w)[:8])
        d = ((centroids[:, None, :] - centroids[None, :, :]) ** 2).sum(-1)
        np.fill_diagonal(d, np.inf)
        nn = np.argsort(d, axis=1)[:, :10]
        same = lambda p: float((p.shards[nn, 0] == p.shards[:, :1]).mean())  # noqa: E731
        assert same(loc) > 0.7 > 0.55 > same(rr), (same(loc), same(rr))
    with pytest.raises(ConfigError, match="centroids"):
        place_lists(sizes, visits, 2, "locality")


def test_locality_placement_equals_the_single_index_and_reaches_fewer_shards(built):
    """Every candidate re-ranked: the same top-10 as the single index. On the clustered set a query reaches
    fewer shards than with round-robin, counted from the lists it probes and the list -> shard map on disk."""
    root, q = built["root"], built["queries"]
    single = Index.open(root / "single")
    reached = {}
    for name in ("loc", "loc0", "rr"):
        index = ShardedIndex.open(root / name)
        try:
            assert index.manifest["placement"]["kind"] == ("round-robin" if name == "rr" else "locality")
            res = index.search(q, 10, EXHAUSTIVE)
            a = single.search(q, 10, EXHAUSTIVE)
            assert np.array_equal(a.ids, res.ids)
            assert np.allclose(a.distances, res.distances, rtol=1e-6, atol=1e-6)
            res = index.search(q, 10)
            list_shards = np.load(root / name / "list_shards.npy")
            assert ((list_shards >= 0).sum(axis=1) >= 1).all()  # every list on at least one shard
            if name != "loc":  # no replicas: a query's shards are its probed lists' shards
                # probed at the router's own settings (the ratio rule keeps lists until they hold `rerank`
                # candidates, and the router's re-rank is its calibration's for RAM where the shards hold them there)
                lists, _, _ = single.nav.probe(q, index.params)
                want = np.array([len(set(list_shards[row[row >= 0], 0])) for row in lists])
                assert np.array_equal(res.stats["shards_probed"], want)
            reached[name] = float(res.stats["shards_probed"].mean())
        finally:
            index.close()
    assert reached["loc0"] < 0.8 * reached["rr"], reached
    assert reached["loc"] < reached["rr"], reached


def test_cli_builds_and_searches_a_sharded_index(built, tmp_path, capsys):
    base, queries = built["base"], built["queries"]
    np.save(tmp_path / "base.npy", base)
    np.save(tmp_path / "q.npy", queries)
    np.save(tmp_path / "gt.npy", exact_knn(base, queries, 10))
    assert cli_main(["build", str(tmp_path / "base.npy"), str(tmp_path / "idx"), "--shards", "2", "--quiet",
                     "--threads", "1", "--centroid-ratio", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shards"] == 2 and sum(p["count"] for p in out["parts"].values()) >= N
    assert is_sharded(tmp_path / "idx")
    assert cli_main(["search", str(tmp_path / "idx"), str(tmp_path / "q.npy"), "--out", str(tmp_path / "ids.npy"),
                     "--groundtruth", str(tmp_path / "gt.npy")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recall@10"] > 0.9 and report["shards"] == 2
    assert 1 <= report["per_query"]["shards_probed"] <= 2
    assert np.load(tmp_path / "ids.npy").shape == (len(queries), 10)
    assert cli_main(["search", str(tmp_path / "idx"), str(tmp_path / "q.npy"), "--out", str(tmp_path / "ids.npy"),
                     "--groundtruth", str(tmp_path / "gt.npy"), "--probe", "learned"]) == 0
    learned = json.loads(capsys.readouterr().out)
    assert learned["params"]["probe"] == "learned" and learned["recall@10"] > 0.9
    assert learned["per_query"]["lists_probed"] < report["per_query"]["lists_probed"]
    assert cli_main(["build", str(tmp_path / "base.npy"), str(tmp_path / "idx2"), "--shards", "-1", "--quiet"]) == 2
    assert "shards must be a positive integer" in capsys.readouterr().err


def test_learned_pruning_probes_fewer_lists_at_the_same_recall(built):
    """The probe model (trained at build time on rows of the data) against the distance-ratio rule, on held-out
    queries, recall measured against brute force."""
    index = ShardedIndex.open(built["root"] / "sharded")
    try:
        assert index.nav.model is not None and index.manifest["probe_model"]["queries"] == 1000
        q = built["queries"]
        truth = exact_knn(built["base"], q, 10)
        ratio = index.search(q, 10)
        learned = index.search(q, 10, probe="learned")
        wider = index.search(q, 10, probe="learned", probe_scale=2)
        with pytest.raises(ConfigError, match="probe"):
            index.search(q[:2], 10, probe="oracle")
    finally:
        index.close()
    assert recall(learned.ids, truth) >= 0.95
    assert recall(wider.ids, truth) >= recall(learned.ids, truth)
    assert learned.stats["lists_probed"].mean() < 0.7 * ratio.stats["lists_probed"].mean()
    assert learned.stats["candidates"].mean() < ratio.stats["candidates"].mean()
    # Lists vary per query: the model predicts, it does not just cut at a constant.
    assert len(np.unique(learned.stats["lists_probed"])) > 1


def test_the_probe_model_is_sklearns_trees_as_arrays():
    """The stored trees predict what the scikit-learn model they came from predicts."""
    from sklearn.ensemble import GradientBoostingRegressor

    from fusionrag.retriever.engine.learned_probe import N_FEATURES, ProbeModel

    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, N_FEATURES)).astype(np.float32)
    needed = np.exp2(2 + x[:, 1] + 0.5 * x[:, 3] ** 2 + 0.2 * rng.standard_normal(600)).round() + 1
    model = ProbeModel.train(x, needed, quantile=0.8, seed=3)
    ref = GradientBoostingRegressor(loss="quantile", alpha=0.8, n_estimators=100, max_depth=3, learning_rate=0.1,
                                    random_state=3).fit(x, np.log2(needed))
    test = rng.standard_normal((300, N_FEATURES)).astype(np.float32)
    assert np.allclose(model.predict_log2(test), ref.predict(test), atol=1e-9)
    # A quantile fit: about 80% of the training queries need no more than predicted (before rounding up).
    assert 0.7 <= np.mean(np.log2(needed) <= model.predict_log2(x)) <= 0.9
    assert np.all(model.lists(x) >= np.exp2(model.predict_log2(x)))
    with pytest.raises(IndexFormatError):
        ProbeModel(np.zeros((2, 3)), 0, 0.1, 0.9)


def test_ray_cluster_of_two_nodes_on_loopback(built, tmp_path):
    """Two Ray nodes (`ray start`) on 127.0.0.1 in a network namespace and PID namespace of the test's own: the
    build's tasks and the shards' actors run on them, and the results equal the in-process mode's. When the
    namespace's first process ends, the kernel ends every other process in it."""
    pytest.importorskip("ray")
    if not netns_works():
        pytest.skip("needs `unshare --net` (root, or user namespaces)")
    np.save(tmp_path / "base.npy", built["base"])
    np.save(tmp_path / "queries.npy", built["queries"])
    (tmp_path / "build_config.json").write_text(json.dumps(CONFIG.to_dict()))
    build_sharded(built["base"], tmp_path / "local", 2, CONFIG, progress=False)
    index = ShardedIndex.open(tmp_path / "local")
    try:
        res = index.search(built["queries"], 10)
    finally:
        index.close()
    np.savez(tmp_path / "local.npz", ids=res.ids, distances=res.distances)
    report = in_namespace(CHILD, tmp_path, 400)
    assert report["nodes"] == 2, report
    assert report["built_with"] == "ray" and report["same_as_local_build"], report
    assert report["actor_nodes"] == 2, report  # the two shards' actors on different nodes
    assert report["ids_equal"] and report["dists_close"], report
    assert all(n > 0 for n in report["queries_per_shard"])
    # Each shard merged on its actor while searches went on, every answer the same as before the merge.
    assert report["merged_generations"] == [1, 1] and report["merge_same_answers"], report
    assert report["searches_during_merge"][0] > 0 and report["searches_during_merge"][1], report
    assert report["fresh_after_merge"] == [0, 0], report
    # Every Ray server listened on loopback only.
    assert report["listening"] and all(a in LOOPBACK for a in report["listening"]), report["listening"]


def test_a_restarted_shard_goes_to_a_node_whose_raylet_answers_and_not_where_it_died(monkeypatch):
    """Ray counts a dead node alive until its health checks fail (12-15 s); a shard placed there meanwhile waits
    on it (and on Ray 2.60 the GCS was seen to exit when the node was then declared dead). So a shard goes only to
    a node whose raylet takes a connection (real sockets here: one listening, one closed), and a restarted one to
    another node than the one it died on while another answers."""
    import socket

    from fusionrag.retriever.sharded import actors as sharded

    a, b, c, d = (f"{i:02x}" * 28 for i in range(1, 5))  # node ids as Ray writes them (56 hex digits)

    listening = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: connection refused, as for a killed raylet
    nodes = [{"NodeID": a, "Alive": True, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening[0].getsockname()[1]},
             {"NodeID": b, "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": dead_port},
             {"NodeID": c, "Alive": True, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening[1].getsockname()[1]},
             {"NodeID": d, "Alive": False, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening[1].getsockname()[1]}]
    placed = []

    class FakeRay:
        @staticmethod
        def nodes():
            return nodes

        @staticmethod
        def remote(cls):
            class Options:
                def options(self, **options):
                    placed.append(options["scheduling_strategy"])
                    return self

                def remote(self, *args):
                    return "actor"
            return Options()

    monkeypatch.setattr(sharded, "require_ray", lambda: FakeRay)
    try:
        assert sharded.reachable_nodes(FakeRay) == [a, c]
        for s in range(4):  # shard s on the s-th answering node: never b (refuses), never d (dead)
            sharded.start_actor("p", None, None, {}, s)
        assert [p.node_id for p in placed] == [a, c, a, c] and not any(p.soft for p in placed)
        placed.clear()
        sharded.start_actor("p", None, None, {}, 0, avoid=a)  # died on a: c, though a answers
        sharded.start_actor("p", None, None, {}, 1, avoid=c)
        # Hard: a soft affinity let a raylet hand a restart on to a node that had died (the node-crash test).
        assert [p.node_id for p in placed] == [c, a] and not any(p.soft for p in placed)
        for sock in listening:
            sock.close()
        assert sharded.reachable_nodes(FakeRay) == [a, b, c]  # none answers: every node Ray counts alive
    finally:
        for sock in listening:
            sock.close()
