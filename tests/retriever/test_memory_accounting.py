"""Index.memory() accounts for what a search holds (#68 item 1): an index built on real data (Fashion-MNIST's 60,000
training images), opened and searched in a fresh process, whose resident memory the kernel measures
(/proc/self/status) against the engine's own account, and the page buffer's parts within the budget it was given.

The baseline is the process with the engine imported (its code, as bench/harness/worker.py's net search RSS takes
it): what grows past it is the index's arrays, the page buffer as it fills, the threads' scratch and a call's
arrays, which memory() names part by part; beside them only the interpreter's and allocator's own slack (~0.5-2.5
MiB) and the code pages a first search touches (file-backed, ~1.5-2 MiB; bench/results/peers/memory_accounting.md),
hence the tolerances below.
"""

import json
import sys

import numpy as np
import pytest
from conftest import idx_images
from rss import run_alone, status

MiB = 1 << 20
# |measured growth - memory()'s total|, the interpreter's and allocator's slack and first-touched code between them.
TOLERANCE = 3 * MiB
# At open, before any search: the arrays alone (modules the open imports, ~0.5 MiB, beside them).
OPEN_TOLERANCE = int(1.5 * MiB)
QUERIES, KNOB = 1000, {"nprobe": 128, "rerank": 400}


@pytest.fixture(scope="module")
def fashion(tmp_path_factory, data_dir):
    """Fashion-MNIST's 60,000 training images built at the defaults (2 build threads), and 1000 test images."""
    from fusionrag.retriever import BuildConfig, Index
    from fusionrag.retriever.engine.vectors import write_bin

    d, tmp = data_dir / "fashion-mnist-784-euclidean", tmp_path_factory.mktemp("fashion_memory")
    write_bin(tmp / "base.u8bin", idx_images(d / "train-images-idx3-ubyte.gz"))
    Index.build(tmp / "base.u8bin", tmp / "idx", BuildConfig(threads=2), progress=False)
    np.save(tmp / "queries.npy", idx_images(d / "t10k-images-idx3-ubyte.gz")[:QUERIES].astype(np.float32))
    return tmp / "idx", tmp / "queries.npy"


def _status() -> dict:
    return status("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _measure(path: str, queries: str, engine: str) -> dict:
    """In a fresh process: the engine imported, glibc set to hand freed memory back as `fusionrag search` and
    `serve` do, then the index opened and searched on 2 threads; RSS at each step, memory() beside it."""
    from fusionrag.retriever.process import return_freed_memory

    return_freed_memory()
    from fusionrag.retriever.engine.index import Index

    q = np.load(queries)
    base = _status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    index = Index.open(path, threads=2, verify=False, **json.loads(engine))
    opened, at_open = _status(), index.memory()
    for _ in range(3):  # the page buffer fills, each thread's scratch grows to what these calls need
        index.search(q, 10)
        index.search(q, 10, **KNOB)
    return {"base": base, "opened": opened, "after": _status(), "at_open": at_open,
            "memory": index.memory(KNOB, len(q), 10), "budget": index.config.buffer_bytes,
            "layout": index.reranker.store.layout}


def _pages_budget(path, share: int) -> int:
    return (path / "vectors.pages").stat().st_size // share


CONFIGS = {
    # the defaults: blocks zero-run coded (Fashion's pages are half zero bytes), a sixteenth of the pages
    "compressed": lambda path: {"buffer_bytes": _pages_budget(path, 16)},
    # a plain buffer, the adaptive layout between blocks and records (its miniatures counted)
    "adaptive": lambda path: {"buffer_bytes": _pages_budget(path, 16), "buffer_compression": "off"},
    # half the bytes as records, half as blocks, a larger buffer
    "records": lambda path: {"buffer_bytes": _pages_budget(path, 8), "buffer_compression": "off",
                             "record_cache": "on", "record_cache_share": 0.5},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_memory_accounts_for_the_resident_growth_of_a_search(fashion, config):
    path, queries = fashion
    engine = CONFIGS[config](path)
    m = json.loads(run_alone(__file__, str(path), str(queries), json.dumps(engine)))
    mem, parts = m["memory"], m["memory"]["parts"]
    base, opened, after = m["base"], m["opened"], m["after"]
    assert not mem["mapped"]  # in RAM: a few MiB of arrays in a machine's memory
    assert mem["total_bytes"] == sum(parts.values())

    # Opened, nothing searched: the arrays and the buffer's bookkeeping are resident, its blocks' memory is not yet.
    o = m["at_open"]["parts"]
    arrays = sum(v for k, v in o.items() if k not in ("page_buffer", "record_cache", "search_scratch", "search_call"))
    grown = opened["RssAnon"] - base["RssAnon"]
    assert abs(grown - arrays) <= OPEN_TOLERANCE, (grown, arrays, o)

    # Searched: the peak growth of the whole process (the benchmark runner's net search RSS) is the total, the
    # largest call's arrays included; what stays after the calls is the total less that call.
    peak = after["VmHWM"] - base["VmRSS"]
    assert abs(peak - mem["total_bytes"]) <= TOLERANCE, (peak, mem)
    # After the calls their arrays are gone; what the process holds in anonymous memory (the file-backed rest is
    # the code those calls ran) is the rest of the total.
    held = after["RssAnon"] - base["RssAnon"]
    assert abs(held - (mem["total_bytes"] - parts["search_call"])) <= TOLERANCE, (held, mem)
    # The buffer filled within its share: what grew since the open beyond the threads' scratch is the buffer's
    # memory (records or blocks), at most its part.
    filled = after["RssAnon"] - opened["RssAnon"] - parts["search_scratch"]
    assert filled <= parts["page_buffer"] + parts["record_cache"] + TOLERANCE, (filled, parts)
    assert filled >= 0.5 * (parts["page_buffer"] + parts["record_cache"]) - TOLERANCE, (filled, parts)

    # Every part a search grows is within the budget it was given: the page buffer, its bookkeeping (entries,
    # FrameMaps, sketches, the miniatures) and the record cache together.
    budget = engine["buffer_bytes"]
    assert mem["buffer_budget_bytes"] == m["budget"] == budget
    buffer_parts = parts["page_buffer"] + parts["page_buffer_metadata"] + parts["record_cache"]
    assert 0.9 * budget <= buffer_parts <= budget, (buffer_parts, budget)
    assert parts["search_scratch"] > 0 and parts["search_call"] > 0
    if config == "records":
        assert parts["record_cache"] > 0 and parts["page_buffer"] > 0
    if config == "compressed":
        assert mem["page_buffer_compressed"] and parts["record_cache"] == 0


def test_memory_counts_mapped_arrays_apart(fashion):
    """map_arrays 'on': codes, list ids and slots are read through memory maps (page cache, resident as read):
    memory() names them under mapped, at their files' bytes, the most the process maps of them."""
    from fusionrag.retriever import Index

    path, _ = fashion
    index = Index.open(path, map_arrays="on", filter_tier="cpu", verify=False)
    mem = index.memory()
    assert set(mem["mapped"]) == {"list_ids", "slot_map", "pq_codes"}
    for name, f in (("list_ids", "list_ids.npy"), ("slot_map", "locations.npy"), ("pq_codes", "pq_codes.npy")):
        assert 0 < (path / f).stat().st_size - mem["mapped"][name] <= 4096  # the file less its .npy header
        assert name not in mem["parts"]
    assert mem["total_bytes"] == sum(mem["parts"].values()) + sum(mem["mapped"].values())
    index.close()


if __name__ == "__main__":
    print(json.dumps(_measure(*sys.argv[1:4])))
