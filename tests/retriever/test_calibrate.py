"""Build-time calibration of an index's default search settings (BuildConfig.calibrate, retriever/calibrate.py).

Recall is measured here against brute force on held-out queries (not the rows calibration sampled), and the
settings a search ran with are read from what it did (mini-batches re-ranked), not from the index's record."""

import json

import numpy as np
import pytest
from conftest import exact_knn, recall

from fusionrag.cli import main as cli_main
from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.calibrate import LADDER
from fusionrag.retriever.config import SearchOverrides, SearchParams
from fusionrag.retriever.errors import ConfigError, IndexFormatError
from fusionrag.retriever.vectors import write_bin
from fusionrag.server.requests import search_params

N, DIM = 12000, 96


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
    index = Index.open(built["root"] / "coarse")
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
    assert len(cal["tried"]) == 1 and cal["tried"][0]["recall"] >= 0.95 and cal["params"] == {}
    index = Index.open(built["root"] / "plain")
    try:
        assert index.params == SearchParams()
        assert recall(index.search(built["queries"], 10).ids, built["truth"]) >= 0.95
    finally:
        index.close()


def test_a_requests_knobs_apply_over_the_calibrated_defaults(built):
    index = Index.open(built["root"] / "coarse")
    try:
        q = built["queries"]
        chosen = SearchParams(**built["coarse"]["calibration"]["params"])
        # nprobe 4 binds: the ratio rule alone probes more lists than that here.
        assert index.search(q, 10).stats["centroids_probed"].mean() > 4
        full = index.search(q, 10, chosen.with_overrides(nprobe=4))
        for given in ({"nprobe": 4}, SearchOverrides.of({"nprobe": 4}), search_params({"nprobe": 4})):
            res = index.search(q, 10, given)
            assert res.stats["centroids_probed"].max() <= 4  # the named knob applies
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
                     str(tmp_path / "o.npy"), "--nprobe", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = built["coarse"]["calibration"]["params"]
    assert report["params"]["nprobe"] == 4 and report["params"]["beta"] == chosen["beta"]
    # What the search did, not only what it reports: at most 4 lists, and as many mini-batches as the
    # calibrated settings take (more than the class defaults' beta 2 takes).
    assert report["per_query"]["centroids_probed"] <= 4
    index = Index.open(built["root"] / "coarse")
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
    index = Index.open(tmp_path / "off")
    try:
        assert index.params == SearchParams()
    finally:
        index.close()


def test_small_collections_skip_calibration(tmp_path):
    m = Index.build(flat(1500, 1), tmp_path / "small", BuildConfig(threads=1), progress=False)
    assert "skipped" in m["calibration"] and m["search_defaults"] == {}


def test_the_ladder_only_raises_the_rerank():
    assert LADDER[0] == (SearchParams().rerank, SearchParams().beta)
    assert all(a[0] <= b[0] and a[1] < b[1] for a, b in zip(LADDER, LADDER[1:]))


def test_bad_search_defaults_in_a_manifest_are_refused(built, tmp_path):
    import shutil

    dest = tmp_path / "bad"
    shutil.copytree(built["root"] / "coarse", dest)
    path = dest / "manifest.json"
    m = json.loads(path.read_text())
    for bad in ({"rerank": 0}, {"no_such_knob": 1}, ["rerank"]):
        path.write_text(json.dumps({**m, "search_defaults": bad}))
        with pytest.raises(IndexFormatError, match="search_defaults"):
            Index.open(dest)


def test_bad_overrides_are_refused_when_made():
    with pytest.raises(ConfigError):
        SearchOverrides.of({"nprobe": 0})
    with pytest.raises(ConfigError):
        SearchOverrides.of({"no_such_knob": 1})
