"""The build's choice of PQ code width (BuildConfig.pq_bits 0, the default; retriever/engine/pq_choice.py): 4-bit
codes are trained beside the 8-bit ones, measured by calibration at the settings it chose, and kept only where
they hold recall and scan faster; the verdict is checked against the measurements it records, the adopted codes
against their own codebooks, and the search against SIFT5k's ground truth (real data: 5,000 x 128)."""

import json

import numpy as np
import pytest
from conftest import recall

from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.engine import pq_choice
from fusionrag.retriever.engine.calibrate import calibration_engine, sample_for_calibration
from fusionrag.retriever.engine.config import EngineConfig, SearchParams
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.engine.vectors import open_vectors
from fusionrag.retriever.errors import ConfigError


@pytest.fixture
def cpu_only(monkeypatch):
    """This machine as one where no GPU tier could serve an index (the suite runs under Triton's interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not pq_choice.gpu_could_serve()


@pytest.fixture(scope="module")
def sift(data_dir):
    d = data_dir / "sift5k-ngt-texmexq"
    base = np.asarray(open_vectors(d / "sift5k_base.fvecs")[:], np.float32)
    queries = np.asarray(open_vectors(d / "sift5k_query.fvecs")[:], np.float32)
    gt = open_vectors(d / "sift5k_groundtruth.ivecs")[:, :10]
    return d / "sift5k_base.fvecs", base, queries, gt


def measured(four_ram=0.95, eight_ram=0.95, four_low=0.94, eight_low=0.94, t4=1.0, t8=2.0):
    side = {"ssd": {"recall": 0.97, "recall_low": 0.96}}
    return {8: {**side, "ram": {"recall": eight_ram, "recall_low": eight_low}, "filter_s": t8},
            4: {**side, "ram": {"recall": four_ram, "recall_low": four_low}, "filter_s": t4}}


def test_the_verdict_keeps_four_bits_only_where_they_hold_recall_and_scan_faster():
    assert pq_choice.verdict(measured(), 0.93)[0] == 4
    # recall lost beyond the slack, at either setting
    assert pq_choice.verdict(measured(four_ram=0.95 - pq_choice.SLACK - 0.001), 0.9)[0] == 8
    lost_ssd = measured()
    lost_ssd[4]["ssd"] = {"recall": 0.9, "recall_low": 0.89}
    bits, why = pq_choice.verdict(lost_ssd, 0.8)
    assert bits == 8 and "ssd" in why
    # within the slack, but the lower bound falls below the target the 8-bit codes reached
    assert pq_choice.verdict(measured(four_ram=0.949, four_low=0.939, eight_low=0.941), 0.94)[0] == 8
    # where the 8-bit codes fall short of the target too, their own bound is the floor
    assert pq_choice.verdict(measured(eight_low=0.90, four_low=0.90), 0.95)[0] == 4
    # not faster enough
    bits, why = pq_choice.verdict(measured(t4=1.9, t8=2.0), 0.9)
    assert bits == 8 and "0.95x" in why
    assert pq_choice.verdict(measured(t4=pq_choice.GAIN * 2.0, t8=2.0), 0.9)[0] == 4


def test_builds_that_cannot_measure_keep_eight_bits_and_say_why(monkeypatch):
    auto = BuildConfig()
    assert auto.pq_bits == 0 and auto.pq_subspaces(128) == 64  # 8-bit codes first
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "GPU tier" in pq_choice.why_eight(auto, 10_000, 64, None, 2000)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert pq_choice.why_eight(auto, 10_000, 64, None, 2000) is None
    assert "asked for" in pq_choice.why_eight(BuildConfig(pq_bits=8), 10_000, 64, None, 2000)
    assert "calibration off" in pq_choice.why_eight(BuildConfig(calibrate=False), 10_000, 64, None, 2000)
    assert "2000 rows" in pq_choice.why_eight(auto, 1999, 64, None, 2000)
    assert pq_choice.why_eight(auto, 1999, 64, np.zeros((10, 4)), 2000) is None  # a query log is measured on
    assert "256 sub-spaces" in pq_choice.why_eight(auto, 10_000, 129, None, 2000)
    with pytest.raises(ConfigError, match="pq_bits must be 8, 4 or 0"):
        BuildConfig(pq_bits=2)


def check_published(path, bits):
    """The published index holds no trial, its files pass their checksums, and its codes are its codebooks' own
    (each sub-code the nearest centroid of the stored vector's slice)."""
    assert not (path / pq_choice.TRIAL).exists()
    index = Index.open(path, EngineConfig(verify=True, filter_tier="cpu"))
    try:
        m = index.manifest
        assert m["pq"]["bits"] == bits and index.filter.four_bit == (bits == 4)
        books = np.load(path / "pq_codebooks.npy")
        codes = np.load(path / "pq_codes.npy")
        assert books.shape[1] == (16 if bits == 4 else 256)
        assert codes.shape[1] == m["pq"]["m"] // (2 if bits == 4 else 1)
        assert json.loads((path / "manifest.json").read_text())["files"]["pq_codes.npy"]["bytes"] == \
            (path / "pq_codes.npy").stat().st_size
        return index, ProductQuantizer(books, index.dim), codes
    except BaseException:
        index.close()
        raise


def test_auto_measures_both_codes_and_its_verdict_is_what_it_measured(sift, tmp_path, cpu_only):
    src, base, queries, gt = sift
    m = Index.build(src, tmp_path / "auto", progress=False)
    choice = m["pq_choice"]
    got = {int(b): v for b, v in choice["measured"].items()}
    assert set(got) == {8, 4} and all({"ssd", "ram", "filter_s"} <= set(v) for v in got.values())
    assert choice["settings"]["ram"]["beta"] == 0
    # the verdict recorded is the documented rule (written out here, not pq_choice.verdict) over the figures recorded
    target = m["calibration"]["target_recall"]
    holds = all(got[4][s]["recall"] >= got[8][s]["recall"] - pq_choice.SLACK
                and got[4][s]["recall_low"] >= min(target, got[8][s]["recall_low"]) for s in ("ssd", "ram"))
    assert choice["bits"] == (4 if holds and got[4]["filter_s"] <= pq_choice.GAIN * got[8]["filter_s"] else 8)
    assert "pq_bits" not in m["calibration"] and m["build_config"]["pq_bits"] == 0
    index, pq, codes = check_published(tmp_path / "auto", choice["bits"])
    try:
        assert np.array_equal(pq.encode(base), codes)
        assert recall(index.search(queries, k=10).ids, gt) >= 0.95  # held-out queries, the defaults
    finally:
        index.close()
    # the recall recorded for the codes kept is what their index gives calibration's sampled rows (each left out of
    # the search and of a brute-force truth computed here) at the recorded settings
    own, sample, _ = sample_for_calibration(lambda ids: base[ids], len(base), m["calibration"]["queries"],
                                            m["build_config"]["seed"], None)
    left_out = np.zeros(len(base), bool)
    left_out[own] = True
    b64 = base.astype(np.float64)
    d = (b64 ** 2).sum(1)[None] - 2 * sample.astype(np.float64) @ b64.T
    d[:, left_out] = np.inf
    truth = np.argsort(d, axis=1, kind="stable")[:, :10]
    index = Index.open(tmp_path / "auto", calibration_engine(0))
    try:
        for name, params in choice["settings"].items():
            found = index.search(sample, 10, SearchParams(**params), exclude=np.packbits(left_out, bitorder="little"))
            assert recall(found.ids, truth) == pytest.approx(got[choice["bits"]][name]["recall"], abs=2e-4), name
    finally:
        index.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_build_adopts_the_codes_its_verdict_keeps(sift, tmp_path, cpu_only, monkeypatch, bits):
    src, base, queries, gt = sift
    monkeypatch.setattr(pq_choice, "verdict", lambda measured, target: (bits, "forced"))
    m = Index.build(src, tmp_path / "idx", progress=False)
    assert m["pq_choice"]["bits"] == bits and m["pq_choice"]["why"] == "forced"
    index, pq, codes = check_published(tmp_path / "idx", bits)
    try:
        if bits == 4:
            assert pq.m == 2 * 64  # twice the sub-spaces in the 8-bit codes' 64 bytes
        assert np.array_equal(pq.encode(base), codes)
        assert recall(index.search(queries, k=10).ids, gt) >= 0.95
    finally:
        index.close()


def test_explicit_bits_and_the_gpu_gate_measure_nothing(sift, tmp_path, monkeypatch):
    src = sift[0]
    m = Index.build(src, tmp_path / "eight", BuildConfig(pq_bits=8), progress=False)
    assert "pq_choice" not in m and m["pq"]["bits"] == 8 and "pq4_trial_s" not in m["build_timings"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a GPU tier could serve it: 8-bit codes, not measured
    m = Index.build(src, tmp_path / "gated", progress=False)
    assert m["pq_choice"]["bits"] == 8 and "GPU tier" in m["pq_choice"]["why"]
    assert m["pq"]["bits"] == 8 and "pq4_trial_s" not in m["build_timings"]
