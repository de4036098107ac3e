"""A doc store is read through SQLite's memory map only while its file is small beside the memory the process may
use (docstore.mmap_bytes): a store past an eighth of it is read without the map, whose faults bring in the
kernel's read-around (bench/results/service/docstore_reads.md). What each read connection was given is read back
from SQLite itself (PRAGMA mmap_size)."""

from __future__ import annotations

from fusionrag.retriever import process
from fusionrag.retriever.collection import docstore
from fusionrag.retriever.collection.docstore import DocStore


def test_a_store_larger_than_an_eighth_of_the_memory_is_read_without_the_map(tmp_path, monkeypatch):
    st = DocStore(tmp_path / "docs.sqlite", 4, create=True)
    try:
        size = (tmp_path / "docs.sqlite").stat().st_size
        monkeypatch.setattr(process, "memory_limit", lambda: 8 * size + 4096)  # the store within an eighth
        assert docstore.mmap_bytes(tmp_path / "docs.sqlite") == docstore._MMAP_BYTES
        with st._reader() as con:
            assert con.execute("PRAGMA mmap_size").fetchone()[0] == docstore._MMAP_BYTES
        monkeypatch.setattr(process, "memory_limit", lambda: 8 * size - 4096)  # past it
        assert docstore.mmap_bytes(tmp_path / "docs.sqlite") == 0
        fresh = DocStore(tmp_path / "docs.sqlite", 4)
        try:
            with fresh._reader() as con:
                assert con.execute("PRAGMA mmap_size").fetchone()[0] == 0
        finally:
            fresh.close()
    finally:
        st.close()
