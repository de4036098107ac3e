"""The GPU tier's memory against its budget, each measured apart from the budget's own bookkeeping.

Without a GPU the tier's device is the CPU (Triton's interpreter, conftest.py): what the tier
allocates there is recorded at each of torch's allocating calls that names the device. On CUDA:
what the process holds as the driver counts it (NVML, nvidia-smi's per-process figure) and what
torch's allocator holds."""

import numpy as np
import pytest
import torch
from conftest import clustered

from fusionrag.kernels.pool import process_gpu_bytes
from fusionrag.retriever import BuildConfig, Index
from fusionrag.retriever.engine import gpu_tier as gpu_tier_mod
from fusionrag.retriever.engine.gpu_tier import gpu_device

CUDA = torch.cuda.is_available()
ALLOCATING = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "arange", "tensor")


@pytest.fixture
def device_allocations(monkeypatch):
    """Bytes of every tensor torch is asked to make on the tiers' device, in order (CPU runs only:
    on CUDA the allocator's own figures are better)."""
    made = []
    device = gpu_device()
    for name in ALLOCATING:
        real = getattr(torch, name)

        def spy(*args, _real=real, **kw):
            t = _real(*args, **kw)
            if "device" in kw and torch.device(kw["device"]) == device:
                made.append(t.numel() * t.element_size())
            return t

        monkeypatch.setattr(torch, name, spy)
    return made


@pytest.mark.parametrize("gpu_search", ["lists", "device"])
def test_the_budget_holds_what_the_tier_allocates_and_searches_stay_within_it(tmp_path, monkeypatch,
                                                                             device_allocations, gpu_search):
    """The lists tier allocates nothing on the request path (its working blocks are carved); the device tier's
    temporaries come from torch's allocator, chunk by chunk, within the working memory it reserved."""
    monkeypatch.setattr(gpu_tier_mod, "_budgets", {})  # this test's own process budget
    base = clustered(3000, 24, 30, seed=1)
    queries = clustered(4, 24, 30, seed=2)
    Index.build(base, tmp_path / "idx", BuildConfig(metric="l2"), progress=False)
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved()
    # On CUDA the default: what an LLM server taking 90% leaves; the budget must hold the context too.
    index = Index.open(tmp_path / "idx", filter_tier="gpu", gpu_search=gpu_search,
                       gpu_budget_bytes=0 if CUDA else 64 << 20, batch_size=16)
    tier, budget = index.filter, index.filter.account.budget
    assert index.memory()["filter"].get("gpu_search", "lists") == gpu_search
    if CUDA:
        took = torch.cuda.memory_reserved() - reserved_before
    else:
        took = sum(device_allocations)
    assert 0 < took <= tier.account.used + budget.parts.get("CUDA context, kernels and allocator", 0)
    assert budget.used <= budget.budget
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        peak_before = torch.cuda.max_memory_reserved()
        allocated_before = torch.cuda.memory_allocated()
    made = len(device_allocations)
    drop = np.zeros(len(base), dtype=bool)
    drop[::5] = True
    exclude = np.packbits(drop, bitorder="little")
    for kw in (dict(k=10), dict(k=10, rerank=5000), dict(k=5, nprobe=100000, rerank=300)):
        for ex in (None, exclude):
            res = index.search(queries, exclude=ex, **kw)
            assert (res.ids >= 0).all()
    work = tier.account.parts.get("working memory")
    if CUDA:
        torch.cuda.synchronize()
        if gpu_search == "lists":
            assert torch.cuda.max_memory_reserved() == peak_before  # nothing allocated on the request path
        else:  # what searches held at once beyond the tier's parts: within the working memory reserved
            assert torch.cuda.max_memory_allocated() - allocated_before <= work
        held = process_gpu_bytes(torch.device("cuda", torch.cuda.current_device()), nvidia_smi=True)
        info = index.memory()["filter"]
        if held is not None:  # the driver's count of the whole process, CUDA context included
            assert held <= info["gpu_reserved_bytes"] <= info["gpu_budget_bytes"]
            assert info["gpu_overhead_bytes"] > 0
    elif gpu_search == "lists":
        assert len(device_allocations) == made
    else:  # no temporary of a search on the device exceeds the working memory reserved
        during = device_allocations[made:]
        assert during and max(during) <= work
    index.close()
    assert tier.account.used == 0
