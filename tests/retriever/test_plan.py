"""#70 item 3: the capacity plan (retriever/engine/plan.py, `fusionrag plan`). Its byte figures are the engine's
own accounting, so for an index built here, given that index's own list and posting counts, they equal what the
index reports: host_index_bytes and the CPU tier's PQ bytes exactly but for the graph's few bytes of rounding
(tolerance 1%), the page file within 5% (its blocks' packing: 0-1.7% beyond full pages measured at 1M-10M, a few
per cent at this N), and the device tier's reservation within 4 x 512 bytes (the budget aligns each tensor, the
plan each part), with the same choices (postings tiered or not, raw vectors resident or not, working memory,
postings resident). From the measured builds alone (no counts given) the plan for 1M x 128 is within 5% of what
that build recorded (bench/results/peers/scale_table.json). A configuration that does not fit is flagged."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered

from fusionrag.kernels.pool import DeviceBudget
from fusionrag.retriever import BuildConfig, EngineConfig, Index
from fusionrag.retriever.engine import device_tier as device_tier_mod
from fusionrag.retriever.engine import gpu_tier as gpu_tier_mod
from fusionrag.retriever.engine.device_tier import DeviceTier
from fusionrag.retriever.engine.plan import plan

N, DIM = 2000, 24
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def bookkeeping_budgets(monkeypatch):
    """As test_device_tier.py: no process budget between tests, budgets count the tiers' parts only (no CUDA
    context, no allocator slack: the plan is given overhead 0 and slack 0 to match)."""
    monkeypatch.setattr(gpu_tier_mod, "_budgets", {})
    monkeypatch.setattr(DeviceBudget, "true_up", lambda self: None)
    monkeypatch.setattr(device_tier_mod, "ALLOCATOR_SLACK", 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "idx"
    Index.build(clustered(N, DIM, 25, seed=1), path, BuildConfig(metric="l2"), progress=False)
    return path


def _counts(idx):
    f = idx.filter
    return dict(lists=len(f.list_offsets) - 1, postings=len(f.list_ids))


def test_the_plans_host_and_ssd_bytes_are_what_the_index_reports(built):
    idx = Index.open(built, EngineConfig(filter_tier="cpu"))
    mem = idx.memory()
    m = idx.filter.codes.shape[1]
    p = plan(N, DIM, m, "h100", **_counts(idx))
    assert p.host["host_index_bytes"] == pytest.approx(mem["host_index_bytes"], rel=0.01)
    assert p.host["list ids"] == idx.filter.list_ids.nbytes
    assert p.host["list offsets"] == idx.filter.list_offsets.nbytes
    assert p.host["slot map"] == idx.reranker.locations.nbytes
    assert p.host["navigation graph"] == pytest.approx(idx.nav.memory_bytes(), rel=0.01)
    assert p.host["cpu_pq_codes (mapped, the CPU tier's)"] == mem["pq_bytes"]
    assert mem["ssd_bytes"] == (built / "vectors.pages").stat().st_size
    assert p.ssd["ssd_bytes"] <= mem["ssd_bytes"] <= 1.05 * p.ssd["ssd_bytes"]
    npy_header = 128
    assert p.ssd["pq_codes.npy"] == (built / "pq_codes.npy").stat().st_size - npy_header
    assert p.ssd["list_ids.npy"] == (built / "list_ids.npy").stat().st_size - npy_header
    assert not p.wide_offsets and p.fits
    idx.close()


@pytest.mark.parametrize("budget, share, tiered, half", [(128 << 20, 0.5, False, False),
                                                          ((4 << 20) + (64 << 10), 1.0, True, False),
                                                          (128 << 20, 0.5, False, True)])
def test_the_plans_device_parts_and_choices_are_the_device_tiers(built, budget, share, tiered, half, monkeypatch):
    """All postings and the raw vectors on the device, or a budget that leaves room for a few hundred postings
    only (tiered), or float16 centroids forced (#70 item 2: the rule's share 0, for the tier and the plan alike):
    the plan reserves what the opened tier reserves and chooses as it does."""
    if half:
        monkeypatch.setattr(device_tier_mod, "HALF_CENTROIDS_SHARE", 0.0)
    idx = Index.open(built, EngineConfig(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=budget,
                                         batch_size=16, gpu_tiered_share=share))
    t = idx.filter
    assert isinstance(t, DeviceTier) and t.tiered is tiered
    p = plan(N, DIM, t.m, "test", device_bytes=budget, overhead_bytes=0, slack_bytes=0, tiered_share=share,
             batch=16, **_counts(idx))
    g = p.gpu
    assert g["raw_resident"] is t.raw_resident and g["working_memory"] == t.work_bytes
    assert ("tiered" in g["tier"]) is tiered
    assert round(g["resident_postings"] * p.postings) == t.capacity
    assert (p.centroid_dtype == "float16") is half is t.half
    assert abs(g["held"] - t.account.used) <= (5 if half else 4) * 512, (g["held"], t.account.used)
    if tiered:
        assert 0 < t.capacity < p.postings
        assert g["host_pinned"] == (p.postings - t.capacity) * (t.m + 4)
    idx.close()


def test_the_plan_from_the_measured_builds_is_the_recorded_1m_build():
    """No counts given: lists and postings from the measured builds; against the 1M x 128 row of
    scale_table.json (what that index's Index.memory() reported)."""
    rows = json.loads((ROOT / "bench/results/peers/scale_table.json").read_text())
    row = next(r for r in rows if r["build"]["n"] == 1_000_000)
    mem = row["search"]["memory"]
    p = plan(1_000_000, 128, 64, "h100")
    assert p.host["host_index_bytes"] == pytest.approx(mem["host_index_bytes"], rel=0.05)
    assert p.host["cpu_pq_codes (mapped, the CPU tier's)"] == mem["pq_bytes"]
    assert p.ssd["ssd_bytes"] == pytest.approx(mem["ssd_bytes"], rel=0.05)
    assert p.fits and p.gpu["raw_resident"] and p.gpu["resident_postings"] == 1.0
    assert 1e5 < p.qps["low"] <= p.qps["high"] < 4e5  # docs/gpu.md's prediction: 170-340k q/s at 0.95


def test_a_billion_takes_wide_offsets_and_a_plan_that_does_not_fit_is_flagged(capsys):
    assert not plan(100_000_000, 128, 64, "h100").wide_offsets
    big = plan(1_000_000_000, 128, 64, "h100")
    assert big.wide_offsets and big.fits and "tiered" in big.gpu["tier"] and big.gpu["resident_postings"] < 0.1
    # The largest sets take coarser lists (#70 item 2) and, past 2% of the budget, float16 centroids
    assert big.centroid_ratio == 0.01 and big.centroid_dtype == "float16"
    assert plan(10_000_000, 128, 64, "h100").centroid_ratio == 0.1
    assert plan(100_000_000, 128, 64, "h100").centroid_dtype == "float32"  # 1M centroids at 0.01: 0.5 GB
    assert plan(100_000_000, 128, 64, "h100", centroid_ratio=0.1).centroid_dtype == "float16"  # 10M: 5.3 GB
    # 1B at centroid ratio 0.1: ~53 GB of float32 centroids; in a 40 GB budget the device tier is refused, and
    # in float16 (26 GB) it fits
    small = plan(1_000_000_000, 128, 64, "h100", budget_bytes=40_000_000_000, centroid_ratio=0.1,
                 centroid_dtype="float32")
    assert not small.fits and small.gpu["tier"].startswith("lists tier") and small.qps["low"] is None
    assert any("refused" in note for note in small.notes)
    halved = plan(1_000_000_000, 128, 64, "h100", budget_bytes=40_000_000_000, centroid_ratio=0.1)
    assert halved.centroid_dtype == "float16" and halved.fits
    assert halved.gpu["centroids"] < 0.51 * small.gpu["centroids"]
    # navigation's GEMM ten times faster as modelled; the distance matrix's float32 bytes then bound it (~3x)
    assert halved.qps["low"] > 2.5 * plan(1_000_000_000, 128, 64, "h100", centroid_ratio=0.1,
                                          centroid_dtype="float32").qps["low"]
    from fusionrag.cli import main

    assert main(["plan", "--n", "1e9", "--dim", "128", "--device", "h100", "--json"]) == 0
    (cli_big,) = json.loads(capsys.readouterr().out)
    assert cli_big["centroid_ratio"] == 0.01  # the command takes the plan's default ratio, as plan() does
    assert main(["plan", "--n", "1e9", "--dim", "128", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "1,000,000,000" in out and "int64" in out and "tiered" in out and "float16" in out
    # 1B at ratio 0.1: 27 GB of float16 centroids in a 20 GB budget
    assert main(["plan", "--n", "1e9", "--dim", "128", "--device", "h100", "--budget-gb", "20",
                 "--centroid-ratio", "0.1"]) == 3
    assert "lists tier" in capsys.readouterr().out
    assert main(["plan", "--n", "1e6", "1e7", "--device", "both", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [(p["n"], p["device"]) for p in plans] == [(10**6, "h100"), (10**7, "h100"), (10**6, "h200"),
                                                     (10**7, "h200")]
    assert np.all([p["fits"] for p in plans])
