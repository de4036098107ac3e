"""#70 item 4: the device tier's batch waits for the device twice, as the cost model (docs/gpu.md) assumes: once
for the batch's chunk plan (each query's postings, after navigation) and once for its answers. On CUDA a host
sync is any read of device memory by the host: .cpu()/.numpy()/.item()/.tolist()/int()/bool() of a device tensor,
and the operations whose output size depends on the data (boolean-mask indexing and nonzero, masked_select,
repeat_interleave without output_size, bincount, unique). Without a GPU the tier's tensors are CPU tensors, so the
test counts those operations as they are dispatched (a TorchDispatchMode), and .cpu()/.tolist() as they are called,
while DeviceTier.search runs, leaving out what Triton's interpreter does inside a kernel launch (which on a GPU is a
launch, not a sync)."""

import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import clustered
from torch.utils._python_dispatch import TorchDispatchMode

from fusionrag.retriever import BuildConfig, EngineConfig, Index
from fusionrag.retriever.engine import device_tier as device_tier_mod
from fusionrag.retriever.engine.device_tier import DeviceTier

DIM = 24
DEVICE = dict(filter_tier="gpu", gpu_search="device", gpu_budget_bytes=128 << 20, batch_size=16,
              manager_interval_s=0)
MAIN = threading.get_ident()
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten.repeat_interleave.Tensor", "aten.bincount.default", "aten._unique2.default",
           "aten.unique_consecutive.default", "aten.unique_dim.default"}


def _in_interpreter() -> bool:
    """Inside a kernel's run by Triton's interpreter, or on another thread (the index manager's)."""
    if threading.get_ident() != MAIN:
        return True
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/triton/" in name:
            return True
        f = f.f_back
    return False


class Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        syncs = name in SYNCING and not (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size"))
        if name.startswith(("aten.index.Tensor", "aten.index_put")):  # a boolean mask: its nonzero
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            syncs = any(i is not None and i.dtype == torch.bool for i in indices)
        if syncs and not _in_interpreter():
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch):
    mode = Syncs()
    for method in ("cpu", "tolist"):
        real = getattr(torch.Tensor, method)

        def wrapped(self, *a, _real=real, _name=method, **kw):
            if not _in_interpreter():
                mode.seen.append(f"Tensor.{_name}")
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, method, wrapped)
    with mode:
        yield mode
    monkeypatch.undo()


pytestmark = pytest.mark.usefixtures("device_tier_bookkeeping")  # tests/conftest.py


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = clustered(2000, DIM, 25, seed=1)
    queries = clustered(16, DIM, 25, seed=2)
    path = tmp_path_factory.mktemp("device-syncs") / "idx"
    Index.build(base, path, BuildConfig(metric="l2"), progress=False)
    return base, queries, path


def test_the_counter_sees_a_sync(monkeypatch):
    t = torch.arange(10)
    with counting(monkeypatch) as c:
        t[t > 4].sum()
        int(t[0])
        torch.repeat_interleave(t[:3], torch.tensor([1, 2, 3]))
    assert len(c.seen) == 3, c.seen


@pytest.mark.parametrize("case", ["raw resident", "raw on SSD", "tiered", "excluded", "chunks", "half"])
def test_a_batch_syncs_twice(built, monkeypatch, case):
    base, queries, path = built
    share = 1e-9 if case == "raw on SSD" else 0.5
    if case == "half":  # float16 centroids (#70 item 2): their navigation waits for nothing either
        monkeypatch.setattr(device_tier_mod, "HALF_CENTROIDS_SHARE", 0.0)
    if case == "tiered":
        real = DeviceTier.__init__

        def tenth(self, *args, **kw):
            real(self, *args, **{**kw, "max_resident_postings": len(args[3]) // 10})
        monkeypatch.setattr(DeviceTier, "__init__", tenth)
    idx = Index.open(path, EngineConfig(**DEVICE, gpu_tiered_share=share))
    t = idx.filter
    assert t.tiered is (case == "tiered") and t.raw_resident is (case in ("raw resident", "excluded", "chunks", "half"))
    assert t.half is (case == "half")
    if case == "chunks":  # a batch in several chunks of queries: their postings are known on the host already
        t.work_bytes = 64 * device_tier_mod.PER_POSTING
    q = idx.prepare_queries(queries)
    p = idx.params.with_overrides(nprobe=8)
    exclude = np.packbits(np.arange(len(base)) % 7 == 0, bitorder="little") if case == "excluded" else None
    want = t.search(q, p, 50, 10, exclude)
    if case == "chunks":
        assert len(list(t._chunks(np.full(len(q), 1000), 0))) > 1
    with counting(monkeypatch) as c:
        got = t.search(q, p, 50, 10, exclude)
    assert len(c.seen) == 2, c.seen  # the chunk plan, the answers
    assert np.array_equal(got.ids, want.ids) and np.array_equal(got.unique, want.unique)
    idx.close()
