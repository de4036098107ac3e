"""#70 item 1: posting offsets of any count. The device tier keeps its list starts and sizes, and a batch's scan
segments, in int32 where an index's postings fit int32 and in int64 past that, chosen per index at open. A
2^31-posting index cannot be built here: the tests lower the threshold (device_tier.INT32_POSTINGS) so that a small
index takes the wide path, and compare its answers with the narrow path's and the CPU tier's, under Triton's
interpreter (conftest.py sets TRITON_INTERPRET=1), at the tolerance test_device_tier.py uses (recall at least the CPU
tier's less 0.005, the same exact distances for the hits both return, the same lists and postings)."""

import numpy as np
import pytest
import torch
from conftest import clustered, exact_knn, recall

from fusionrag.kernels.adc_stream import adc_stream, adc_stream_reference
from fusionrag.retriever import BuildConfig, EngineConfig, Index
from fusionrag.retriever.engine import device_tier as device_tier_mod
from fusionrag.retriever.engine.device_tier import DeviceTier

DIM = 24
DEVICE = dict(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=128 << 20, batch_size=16)


pytestmark = pytest.mark.usefixtures("device_tier_bookkeeping")  # tests/conftest.py


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = clustered(2000, DIM, 25, seed=1)
    queries = clustered(32, DIM, 25, seed=2)
    path = tmp_path_factory.mktemp("device-wide") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, queries, path


def test_the_offsets_are_int32_below_the_threshold_and_int64_above(built, monkeypatch):
    base, queries, path = built
    narrow = Index.open(path, EngineConfig(**DEVICE))
    t = narrow.filter
    assert isinstance(t, DeviceTier) and not t.wide
    assert t.starts.dtype == t.sizes.dtype == torch.int32
    assert t.account.parts["list sizes"] == device_tier_mod._aligned(len(t.sizes_host) * 4)
    assert all(v.signature[0] == "*i32" for v in t.variants() if v.name == "adc_stream_kernel")
    narrow.close()
    monkeypatch.setattr(device_tier_mod, "INT32_POSTINGS", 0)  # every index is "past 2^31" now
    wide = Index.open(path, EngineConfig(**DEVICE))
    t = wide.filter
    assert t.wide and t.starts.dtype == t.sizes.dtype == torch.int64
    assert t.account.parts["list sizes"] == device_tier_mod._aligned(len(t.sizes_host) * 8)
    assert all(v.signature[0] == "*i64" for v in t.variants() if v.name == "adc_stream_kernel")
    wide.close()


@pytest.mark.parametrize("tiered", [False, True])
def test_the_wide_path_answers_as_the_narrow_one_and_the_cpu_tier(built, monkeypatch, tiered):
    """Forced wide (INT32_POSTINGS 0), all postings resident and raw vectors on the device, or most postings in
    pinned host memory (tiered): the same ids and distances as the narrow path, and as the CPU tier by test_device_
    tier's measure."""
    base, queries, path = built
    truth = exact_knn(base, queries, 10, "l2")
    cpu = Index.open(path, EngineConfig(filter_tier="cpu"))
    conf = EngineConfig(**DEVICE, gpu_tiered_share=0.5)
    narrow = Index.open(path, conf)
    want = {nprobe: narrow.search(queries, 10, nprobe=nprobe) for nprobe in (4, 16)}
    narrow.close()
    monkeypatch.setattr(device_tier_mod, "INT32_POSTINGS", 0)
    if tiered:  # a tenth of the postings on the device, as a collection larger than its budget
        real = DeviceTier.__init__

        def tenth(self, *args, **kw):
            real(self, *args, **{**kw, "max_resident_postings": len(args[3]) // 10})
        monkeypatch.setattr(DeviceTier, "__init__", tenth)
    wide = Index.open(path, conf)
    t = wide.filter
    assert t.wide and t.tiered is tiered
    for nprobe in (4, 16):
        a, b = cpu.search(queries, 10, nprobe=nprobe), wide.search(queries, 10, nprobe=nprobe)
        if not tiered:  # raw vectors on the device, as on the narrow run: the same answers bit for bit
            assert np.array_equal(b.ids, want[nprobe].ids)
            np.testing.assert_array_equal(b.distances, want[nprobe].distances)
        else:  # the host re-ranks the top-n: the same ids
            assert np.array_equal(b.ids, want[nprobe].ids)
        for key in ("lists_probed", "candidates", "unique_candidates"):
            assert np.array_equal(a.stats[key], b.stats[key]), key
        assert recall(b.ids, truth) >= recall(a.ids, truth) - 0.005
        for ai, ad, bi, bd in zip(a.ids, a.distances, b.ids, b.distances):
            _, at_a, at_b = np.intersect1d(ai[ai >= 0], bi[bi >= 0], return_indices=True)
            np.testing.assert_allclose(ad[at_a], bd[at_b], rtol=1e-5, atol=1e-4)
    wide.close()
    cpu.close()


def test_the_scan_takes_int32_and_int64_segments_alike():
    """kernels/adc_stream.py with the same segments in int32 and int64: the keys of its reference."""
    rng = np.random.default_rng(0)
    m, postings, q, nprobe = 8, 500, 5, 6
    luts = torch.from_numpy(rng.random((q, m, 256), dtype=np.float32))
    ids = torch.from_numpy(rng.permutation(postings).astype(np.int32))
    codes = torch.from_numpy(rng.integers(0, 256, (postings, m), dtype=np.uint8))
    starts = rng.integers(0, postings, (q, nprobe))
    ends = np.minimum(postings, starts + rng.integers(0, 80, (q, nprobe)))
    seg = np.stack([starts, ends], -1)
    got = {}
    for dtype in (torch.int32, torch.int64):
        keys, offsets = adc_stream(luts, torch.from_numpy(seg).to(dtype), ids, codes)
        got[dtype] = keys, offsets
    assert torch.equal(got[torch.int32][0], got[torch.int64][0])
    assert torch.equal(got[torch.int32][1], got[torch.int64][1])
    keys, offsets = got[torch.int64]
    ref = adc_stream_reference(luts, torch.from_numpy(seg), ids, codes)
    for i, (rid, _) in enumerate(ref):
        assert torch.equal(keys[offsets[i]:offsets[i + 1]] & 0xFFFFFFFF, rid)
