"""Learned pruning on a single index (BuildConfig.probe_model, SearchParams.probe 'learned'): trained at build
time, stored checksummed beside the index, applied by the navigation tier, kept by merges; measured here
against brute force, not against the model's own predictions."""

import json
import sys
import time

import numpy as np
import pytest
from conftest import clustered, exact_knn, recall

from fusionrag.cli import main as cli_main
from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.config import SearchParams
from fusionrag.retriever.engine.learned_probe import MODEL_FILE, N_FEATURES, ProbeModel
from fusionrag.retriever.engine.merge import merge_index
from fusionrag.retriever.errors import ConfigError, IndexFormatError, InputError

N, DIM = 6000, 24
CONFIG = BuildConfig(threads=1, centroid_ratio=0.05, probe_model=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned")
    base = clustered(N, DIM, 30, seed=3, spread=0.6)
    # Held-out queries: not rows of the data the model was trained on.
    queries = clustered(300, DIM, 30, seed=3, spread=0.6)[::-1].copy() + 0.05
    manifest = Index.build(base, root / "idx", CONFIG, progress=False)
    Index.build(base, root / "plain", BuildConfig(threads=1, centroid_ratio=0.05), progress=False)
    return {"root": root, "base": base, "queries": queries, "manifest": manifest,
            "truth": exact_knn(base, queries, 10)}


def test_learned_pruning_probes_fewer_lists_than_the_ratio_rule_at_the_same_recall(built):
    index = Index.open(built["root"] / "idx")
    try:
        q, truth = built["queries"], built["truth"]
        ratio = index.search(q, 10)
        learned = index.search(q, 10, probe="learned")
        wider = index.search(q, 10, probe="learned", probe_scale=3)
        narrow = index.search(q, 10, probe="learned", probe_scale=0.2)
    finally:
        index.close()
    assert recall(learned.ids, truth) >= recall(ratio.ids, truth) - 0.02 and recall(learned.ids, truth) >= 0.93
    assert learned.stats["lists_probed"].mean() < 0.8 * ratio.stats["lists_probed"].mean()
    assert learned.stats["candidates"].mean() < ratio.stats["candidates"].mean()
    # The count is predicted per query, not a constant cut.
    assert len(np.unique(learned.stats["lists_probed"])) > 3
    # The scale moves what is probed, and recall with it.
    assert narrow.stats["lists_probed"].mean() < learned.stats["lists_probed"].mean() \
        < wider.stats["lists_probed"].mean() <= 256
    assert recall(narrow.ids, truth) < recall(learned.ids, truth) <= recall(wider.ids, truth)


def test_the_model_is_in_the_manifest_and_checksummed(built, tmp_path):
    m = json.loads((built["root"] / "idx" / "manifest.json").read_text())
    assert m["probe_model"] == built["manifest"]["probe_model"]
    pm = m["probe_model"]
    assert pm["queries"] == 1000 and pm["trees"] == 100 and pm["quantile"] == 0.9
    assert 1 <= pm["mean_needed"] <= pm["p90_needed"] <= 256
    assert MODEL_FILE in m["files"] and "sha256" in m["files"][MODEL_FILE]
    assert "probe_model_s" in m["build_timings"]
    # A model file changed on disk is refused at open (its checksum), and when not verified, a tree pointing
    # outside itself is refused by the model's own check.
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(built["root"] / "idx", bad)
    trees = np.load(bad / MODEL_FILE)
    trees[0, 0, 2] = 10**6
    np.save(bad / MODEL_FILE, trees)
    with pytest.raises(IndexFormatError, match=MODEL_FILE):
        Index.open(bad)
    with pytest.raises(IndexFormatError, match="points outside itself"):
        Index.open(bad, verify=False)
    (bad / MODEL_FILE).unlink()
    with pytest.raises(IndexFormatError):
        Index.open(bad, verify=False)


def test_an_index_without_a_model_says_how_to_get_one(built):
    index = Index.open(built["root"] / "plain")
    try:
        assert index.nav.model is None and "probe_model" not in index.manifest
        with pytest.raises(ConfigError, match="--probe-model"):
            index.search(built["queries"][:3], 10, probe="learned")
        with pytest.raises(ConfigError, match="probe"):
            index.search(built["queries"][:3], 10, probe="oracle")
        with pytest.raises(ConfigError, match="probe_scale"):
            index.search(built["queries"][:3], 10, probe_scale=0)
        assert index.search(built["queries"][:3], 10).ids.shape == (3, 10)  # the ratio rule still serves
    finally:
        index.close()


def test_building_a_model_without_scikit_learn_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.ensemble", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="scikit-learn"):
        Index.build(clustered(500, 8, 5), tmp_path / "idx", BuildConfig(threads=1, probe_model=True),
                    progress=False)
    assert not (tmp_path / "idx").exists()  # nothing half-written left behind


def test_a_damaged_tree_cannot_hang_a_search():
    """A cycle in a tree (possible in a file opened with verify off) ends after the tree's node count of steps."""
    trees = np.zeros((1, 3, 5))
    trees[0, :, 0] = -1
    trees[0, 0] = (0, 0.5, 0, 0, 0)  # node 0: feature 0, both children itself
    model = ProbeModel(trees, 3.0, 0.1, 0.9)
    x = np.zeros((4, N_FEATURES), np.float32)
    t = time.perf_counter()
    assert model.lists(x, 1.0, 50).tolist() == [8, 8, 8, 8]
    assert time.perf_counter() - t < 5


def test_the_cli_builds_a_model_and_searches_with_it(built, tmp_path, capsys):
    np.save(tmp_path / "base.npy", built["base"])
    np.save(tmp_path / "q.npy", built["queries"])
    np.save(tmp_path / "gt.npy", built["truth"])
    assert cli_main(["build", str(tmp_path / "base.npy"), str(tmp_path / "idx"), "--quiet", "--threads", "1",
                     "--centroid-ratio", "0.05", "--probe-model", "--probe-queries", "400"]) == 0
    assert "probe_model_s" in json.loads(capsys.readouterr().out)["timings"]
    reports = {}
    for probe in ("ratio", "learned"):
        assert cli_main(["search", str(tmp_path / "idx"), str(tmp_path / "q.npy"), "--out", str(tmp_path / "ids.npy"),
                         "--groundtruth", str(tmp_path / "gt.npy"), "--probe", probe]) == 0
        reports[probe] = json.loads(capsys.readouterr().out)
    assert reports["learned"]["params"]["probe"] == "learned" and reports["learned"]["recall@10"] > 0.9
    assert reports["learned"]["per_query"]["lists_probed"] < reports["ratio"]["per_query"]["lists_probed"]
    assert cli_main(["search", str(tmp_path / "idx"), str(tmp_path / "q.npy"), "--out", str(tmp_path / "x.npy"),
                     "--probe", "learned", "--probe-scale", "-1"]) == 2
    assert "probe_scale" in capsys.readouterr().err


def test_a_merge_keeps_the_model(built, tmp_path):
    old = Index.open(built["root"] / "idx")
    try:
        rng = np.random.default_rng(5)
        dead = np.zeros(N, bool)
        dead[rng.choice(N, 500, replace=False)] = True
        new = clustered(800, DIM, 30, seed=9, spread=0.6)
        merge_index(old, dead, new, tmp_path / "g2", CONFIG)
    finally:
        old.close()
    idx = Index.open(tmp_path / "g2")
    try:
        assert idx.nav.model is not None and idx.manifest["probe_model"]["queries"] == 1000
        vecs = np.concatenate([built["base"][~dead], new])
        q = built["queries"]
        truth = exact_knn(vecs, q, 10)
        assert recall(idx.search(q, 10, probe="learned").ids, truth) >= 0.9
    finally:
        idx.close()


def test_a_collection_built_with_a_model_searches_with_it(tmp_path):
    """Through a collection's own builds (its first merge, then an incremental one) and its search params: the
    index path, not the fresh tier."""
    cfg = CollectionConfig(min_index_count=200, background_merge=False,
                           build=BuildConfig(threads=1, probe_model=True, probe_queries=300))
    cat = Catalog(tmp_path, collection_config=cfg)
    try:
        col = cat.create("c", 16, "l2")
        x = clustered(3000, 16, 20, seed=4)
        q = clustered(3050, 16, 20, seed=4)[3000:]  # held out, from the data's own mixture
        col.add([Document(str(i), None, v) for i, v in enumerate(x[:2000])])
        col.merge()  # the first: a full build, with its model
        col.add([Document(str(i), None, v) for i, v in enumerate(x[2000:], 2000)])
        col.merge()  # incremental: the model carried over
        index = col._main.index
        assert index.nav.model is not None and index.manifest["merge"]["added"] == 1000
        res = col.search(q, k=10, params=SearchParams(probe="learned"))
        found = np.array([[int(h.id) for h in hits] for hits in res.hits])
        assert recall(found, exact_knn(x, q, 10)) >= 0.9
        probed = [s["lists_probed"] for s in res.stats]
        ratio = [s["lists_probed"] for s in col.search(q, k=10).stats]
        assert np.mean(probed) < np.mean(ratio) and len(set(probed)) > 1
    finally:
        cat.close()


def test_a_model_trained_on_a_query_log_serves_queries_unlike_the_data(tmp_path):
    """Queries from elsewhere than the data (their own mixture): far from every centroid, they need lists the
    model never saw rows need. Trained on rows it under-probes them; trained on a log of such queries
    (sample_queries) it probes what they need. Recall against brute force, on queries the log does not hold."""
    x = clustered(3000, 16, 20, seed=4)
    foreign = clustered(700, 16, 20, seed=6)
    log, q = foreign[:600], foreign[600:]
    truth = exact_knn(x, q, 10)
    cfg = BuildConfig(threads=1, probe_model=True, probe_queries=300)
    Index.build(x, tmp_path / "rows", cfg, progress=False)
    m = Index.build(x, tmp_path / "log", cfg, progress=False, sample_queries=log)
    assert m["probe_model"]["queries"] == 300
    got = {}
    for name in ("rows", "log"):
        index = Index.open(tmp_path / name)
        try:
            got[name] = index.search(q, 10, probe="learned")
        finally:
            index.close()
    assert recall(got["log"].ids, truth) >= 0.95
    assert recall(got["log"].ids, truth) > recall(got["rows"].ids, truth) + 0.05
    assert got["log"].stats["lists_probed"].mean() > got["rows"].stats["lists_probed"].mean()
    with pytest.raises(InputError, match="sample_queries"):
        Index.build(x, tmp_path / "bad", cfg, progress=False, sample_queries=log[:, :5])
    # Sample queries serve the probe model and calibration: a build with neither refuses them.
    with pytest.raises(ConfigError, match="probe_model"):
        Index.build(x, tmp_path / "bad", BuildConfig(threads=1, calibrate=False), progress=False, sample_queries=log)
